"""Simple policy gradient: REINFORCE with a learned baseline, on-policy.

Each update's trajectory shard (`trajectories_per_update` trajectories joined along the
env axis) is the experience for that update. Returns are
bootstrapped from the baseline at the trajectory's end and at truncations, so a
trajectory need not hold whole episodes. Read top to bottom: config, state, acting,
loss.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence

import jax
import optax

import sebulba
from agents.common import checks, networks, normalization, policy
from agents.common.returns import action_mask, bootstrapped_returns
from sebulba.types import Metrics, Nets, OptState, PyTree, Trajectory


@dataclasses.dataclass(frozen=True)
class SPGConfig:
    """Hyperparameters; the defaults learn CartPole-v1 with 16 envs per group and
    steps_per_cycle=64 (tests/test_spg_learning.py).

    Attributes:
      hidden_sizes: tanh layers of the policy MLP and, separately, of the baseline MLP.
      learning_rate: Adam step size.
      discount: per-step discount of the returns.
      value_cost: weight of the baseline's squared error in the loss.
      entropy_cost: weight of a categorical policy's entropy bonus in the loss (Discrete
        and MultiDiscrete actions).
      gaussian_entropy_cost: the same for a Gaussian policy (Box actions), 0 by default:
        a Gaussian's entropy grows without bound with its std, and at a small reward
        scale the bonus alone drives every log-std to its bound
        (`agents.common.policy.ActorCriticOptions`).
      max_grad_norm: gradients are clipped to this global norm before Adam.
      lstm_size: units of an LSTM core after a tanh torso of `hidden_sizes`; 0: none
        (feed-forward, separate policy and baseline MLPs).
      normalize_rewards: "down" | "on" | "off": divide rewards, for learning only, by
        the running std of the discounted return (the actors accumulate it, the
        networks keep its moments: `agents.common.normalization`); "down" (IMPALA's
        feed-forward choice too): only where that std exceeds 1. Scaled down, large
        returns no longer swamp the baseline's fit and the gradient clip (CartPole x1e6,
        Acrobot); scaled up, small ones weigh the fixed entropy bonus less, and a
        shared policy on RoleCall locked pairs onto wrong answers (benchmarks/RESULTS.md,
        "Reward scales").
    """

    hidden_sizes: Sequence[int] = (64, 64)
    learning_rate: float = 1e-3
    discount: float = 0.99
    value_cost: float = 0.5
    entropy_cost: float = 0.01
    gaussian_entropy_cost: float = 0.0
    max_grad_norm: float = 0.5
    lstm_size: int = 0
    normalize_rewards: str = "down"

    def __post_init__(self):
        checks.sizes(self, "hidden_sizes")
        checks.ints(self, "lstm_size", low=0, expected="an int >= 1 (or 0: no LSTM)")
        checks.reals(self, "learning_rate", "max_grad_norm", low=0.0, open_low=True,
                     high=sys.float_info.max, expected="a finite number > 0")
        checks.reals(self, "discount", low=0.0, high=1.0)
        checks.reals(self, "value_cost", "entropy_cost", "gaussian_entropy_cost", low=0.0,
                     high=sys.float_info.max, expected="a finite number >= 0")
        checks.one_of(self, "normalize_rewards", ("on", "down", "off"))


class SPG(policy.ActorCriticActing, sebulba.Agent):
    """REINFORCE with a baseline, feed-forward or LSTM, for Discrete, MultiDiscrete and Box
    action spaces (`agents.common.distributions`)."""

    def __init__(self, env_spec: sebulba.EnvSpec, config: SPGConfig = SPGConfig()):
        super().__init__(env_spec)
        self.config = config
        self.entropy_cost = policy.entropy_cost(config, env_spec.action_space)
        # Separate tanh MLPs for policy and baseline: on CartPole-v1 a shared ReLU torso
        # learns slowly and can collapse to a deterministic policy, and separate ReLU
        # MLPs swing widely.
        self.network = networks.actor_critic(
            env_spec.action_space, env_spec.observation_space, config.hidden_sizes,
            config.lstm_size)
        self.return_discount = config.discount if config.normalize_rewards != "off" else None
        self.optimizer = optax.chain(
            optax.clip_by_global_norm(config.max_grad_norm), optax.adam(config.learning_rate)
        )

    def new_opt_state(self, nets: Nets, key: jax.Array) -> OptState:
        return self.optimizer.init(nets)

    def new_experience_state(self, nets: Nets, key: jax.Array,
                             layout: sebulba.Layout) -> policy.LatestTrajectory:
        return policy.zeros_latest_trajectory(self, nets, layout)

    def update_experience(
        self,
        experience: policy.LatestTrajectory,
        initial_step_state: policy.StepState,
        final_step_state: policy.StepState,
        trajectory: Trajectory,
        nets: Nets,
    ) -> policy.LatestTrajectory:
        # On-policy: learn from the latest trajectory only, unrolled from the actor's state.
        return policy.latest_trajectory(initial_step_state, trajectory)

    def loss(
        self, nets: Nets, opt: OptState, experience: policy.LatestTrajectory
    ) -> tuple[jax.Array, tuple[policy.LatestTrajectory, Metrics]]:
        cfg = self.config
        steps = experience.trajectory.env_steps
        actions = experience.trajectory.actor_outputs.action
        _, out = self.network.apply(nets, experience.core, steps.obs, steps.first)
        values = out.value  # [E, T+1]
        reward = normalization.scale_rewards(  # identity unless scaling
            nets, steps.reward, policy.reward_min_std(cfg.normalize_rewards))
        returns = jax.vmap(bootstrapped_returns, in_axes=(0, 0, 0, 0, None))(
            reward, values, steps.terminated, steps.truncated, cfg.discount
        )  # [E, T], constants
        mask = jax.vmap(action_mask)(steps.terminated, steps.truncated)  # [E, T]
        dist = jax.tree.map(lambda x: x[:, :-1], out.policy)  # batch [E, T]
        values = values[:, :-1]
        advantage = returns - values
        chosen = dist.log_prob(actions)
        entropy = dist.entropy()

        def masked_mean(x: jax.Array) -> jax.Array:
            # Actions the env ignored (at the last step of an episode) carry no signal.
            return policy.masked_mean(x, mask)

        pg_loss = -masked_mean(chosen * jax.lax.stop_gradient(advantage))
        value_loss = 0.5 * masked_mean(advantage**2)
        entropy_mean = masked_mean(entropy)
        loss = pg_loss + cfg.value_cost * value_loss - self.entropy_cost * entropy_mean
        metrics = {"pg_loss": pg_loss, "value_loss": value_loss, "entropy": entropy_mean}
        return loss, (experience, metrics)

    def optimize_from_grads(
        self, nets: Nets, opt: OptState, grads: PyTree
    ) -> tuple[Nets, OptState]:
        updates, opt = self.optimizer.update(grads, opt, nets)
        return optax.apply_updates(nets, updates), opt
