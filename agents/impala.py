"""IMPALA (Espeholt et al., 2018): an actor-critic corrected for policy lag by V-trace.

Each update's trajectory shard (`trajectories_per_update` trajectories joined along the
env axis) is learnt from as it arrives. In Sebulba the networks that acted are usually
1-2 updates older than the learner's (the learner publishes after the trajectory was
produced), so the learner's policy pi is not the behaviour policy mu: the actor records
log mu(a | x) in `ActorOutput.extras`. Two schedules:
- one step per shard (the paper's, the feed-forward default): V-trace targets for the
  value, and a policy gradient weighted by the clipped ratio pi / mu;
- `num_epochs` passes of `num_minibatches` steps over random splits of the shard's env
  rows (the LSTM default, 4 x 4): the V-trace targets and advantages are fixed as the
  shard arrives, and the policy learns by PPO's clipped surrogate of pi / mu on them,
  as Sample Factory's APPO does.

One network protocol (`agents.common.networks`), feed-forward (separate tanh MLPs for
policy and value) or recurrent (`use_lstm`: resetting LSTM cores, by default one for the
policy and one for the value, each behind its own torso: `networks.TwinLSTMCore`). The core's state
lives in the StepState; acting resets it where an episode starts, and training unrolls
the network over the trajectory from the state the actor had at its first step (kept
from the initial StepState), with the same resets. Read top to
bottom: config, state, acting, experience, loss.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import NamedTuple

import gymnasium as gym
import jax
import jax.numpy as jnp
import optax

import sebulba
from agents.common import checks, networks, normalization, policy
from agents.common.returns import action_mask
from agents.common.vtrace import VTraceOutput, vtrace
from sebulba.experience import segments
from sebulba.types import Metrics, Nets, OptState, PyTree, Trajectory

OPTIMIZERS = ("adam", "rmsprop")


@dataclasses.dataclass(frozen=True)
class IMPALAConfig(policy.ActorCriticOptions):
    """IMPALA's hyperparameters; the defaults learn CartPole-v1 with T = 32 and 16 or 32 envs
    per group (benchmarks/HISTORY.md, "IMPALA's late collapse on CartPole").

    Fields left "by network" (0, or -1 for `vtrace_lambda`) take, with `use_lstm`, the
    values that learn the whole memory suite with one setting (benchmarks/RESULTS.md, "The
    memory suite"): 4 minibatches x 4 epochs per shard at learning rate 2.5e-4 (PPO's),
    advantages standardized per minibatch, lambda 0.9; without it, one step per shard (the
    paper's schedule) at 1e-3.

    The fields of `policy.ActorCriticOptions` (normalization, the Gaussian's std) come
    first. For a feed-forward agent with discrete actions `normalize_rewards` "auto" means
    "down" (rewards divided by the running std of the discounted return where it exceeds 1:
    on large returns the value's gradient would otherwise set the clipped step of the
    policy, which then collapses late; small rewards are not scaled up against the fixed
    entropy bonus), and "off" with `reward_clip`.

    Attributes:
      use_lstm: a resetting LSTM core between the torso and the heads (for partially
        observed envs); otherwise separate feed-forward policy and value MLPs.
      hidden_sizes: tanh layers of the MLPs (or of the torso before the LSTM).
      lstm_size: units of the LSTM core (only with use_lstm).
      optimizer: "adam" (the default) or "rmsprop" (decay 0.99). The paper's RMSProp, with
        its eps of 0.01, is large next to these small gradients and barely moves CartPole.
      learning_rate: the optimizer's step size. 0 (the default): by network, 2.5e-4 with
        use_lstm (16 steps per shard), 1e-3 otherwise (one step per shard).
      optimizer_eps: epsilon of Adam or RMSProp (the paper's RMSProp used 0.01).
      max_grad_norm: gradients are clipped to this global norm before the optimizer.
      discount: per-step discount gamma.
      rho_bar: clips the importance ratio in the V-trace targets (their fixed point).
      c_bar: clips the trace coefficients of the V-trace targets (speed of contraction);
        at most rho_bar.
      pg_rho_bar: clips the importance ratio of the policy gradient advantages (the
        single step; several steps clip pi / mu at 1 +- ratio_clip instead).
      vtrace_lambda: scales the traces, c = lambda * min(c_bar, ratio); 1 in the paper.
        -1 (the default): by network, 0.9 with use_lstm (less variance from the later
        steps' sampled actions in its targets and advantages), 1 otherwise.
      baseline_cost: weight of the value's squared error (to the V-trace targets).
      entropy_cost: weight of a categorical policy's entropy bonus (Discrete and
        MultiDiscrete actions; `gaussian_entropy_cost` for Box ones).
      reward_clip: rewards are clipped to [-reward_clip, reward_clip] for learning; 0
        disables clipping (the paper clips Atari rewards to [-1, 1]).
      normalize_advantages: "auto" | "on" | "off": standardize the advantages within
        each minibatch, as PPO does. "auto": on with several steps per shard, off with
        one, where standardizing turns the tiny advantages near the optimum into
        unit-sized ones (benchmarks/HISTORY.md, "IMPALA and the reward scale").
      num_minibatches: optimizer steps per pass over an update's shard, each on 1 /
        num_minibatches of its env rows, split afresh at random for each pass (whole
        rows: an LSTM unrolls each from the state its actor had; with `central_value`,
        whole envs). 0 (the default): by network, 4 with use_lstm, 1 otherwise.
      num_epochs: passes over each update's shard; 0 (the default): by network, 4 with
        use_lstm, 1 otherwise (the paper's single step). With more than one step per
        shard the V-trace targets and advantages are computed once, as the shard arrives,
        and the policy maximizes PPO's clipped surrogate of pi / mu with them: the clip
        bounds the drift from the policy that acted, lag included.
      ratio_clip: the clip of pi / mu (only with several steps per shard).
    """

    use_lstm: bool = False
    hidden_sizes: tuple[int, ...] = (64, 64)
    lstm_size: int = 64
    optimizer: str = "adam"
    learning_rate: float = 0.0
    optimizer_eps: float = 1e-5
    max_grad_norm: float = 0.5
    discount: float = 0.99
    rho_bar: float = 1.0
    c_bar: float = 1.0
    pg_rho_bar: float = 1.0
    vtrace_lambda: float = -1.0
    baseline_cost: float = 0.5
    entropy_cost: float = 0.01
    reward_clip: float = 0.0
    normalize_advantages: str = "auto"
    num_minibatches: int = 0
    num_epochs: int = 0
    ratio_clip: float = 0.2

    def __post_init__(self):
        super().__post_init__()
        checks.one_of(self, "optimizer", OPTIMIZERS)
        checks.sizes(self, "hidden_sizes")
        checks.ints(self, "lstm_size")
        checks.ints(self, "num_minibatches", "num_epochs", low=0,
                    expected="an int >= 1 (or 0: by network)")
        checks.one_of(self, "normalize_advantages", policy.SWITCHES)
        checks.reals(self, "learning_rate", low=0.0, high=sys.float_info.max,
                     expected="a finite number > 0 (or 0: by network)")
        checks.reals(self, "optimizer_eps", low=0.0, high=sys.float_info.max, open_low=True,
                     expected="a finite number > 0")
        # inf: no clipping
        checks.reals(self, "max_grad_norm", "rho_bar", "c_bar", "pg_rho_bar", "ratio_clip",
                     low=0.0, open_low=True)
        checks.reals(self, "discount", low=0.0, high=1.0)
        if not (0.0 <= self.vtrace_lambda <= 1.0 or self.vtrace_lambda == -1.0):
            raise ValueError(f"vtrace_lambda must be in [0, 1], got {self.vtrace_lambda!r} "
                             "(or -1: by network)")
        checks.reals(self, "baseline_cost", "entropy_cost", low=0.0, high=sys.float_info.max,
                     expected="a finite number >= 0")
        checks.reals(self, "reward_clip", low=0.0)  # inf: no clipping
        if self.c_bar > self.rho_bar:
            # The paper's analysis of V-trace assumes rho_bar >= c_bar (section 4.1).
            raise ValueError(
                f"c_bar must be <= rho_bar, got c_bar={self.c_bar!r} > rho_bar={self.rho_bar!r}")

    def resolved(self, action_space: gym.Space) -> IMPALAConfig:
        """This config with the fields left "by network" (or by action space) filled in."""
        lstm = self.use_lstm
        rewards = self.normalize_rewards
        if rewards == "auto" and not lstm and not isinstance(action_space, gym.spaces.Box):
            # Where "auto" would leave them raw; clipped rewards keep the scale the user
            # chose (the paper's Atari agent learns them so).
            rewards = "off" if self.reward_clip > 0.0 else "down"
        num_minibatches = self.num_minibatches or (4 if lstm else 1)
        num_epochs = self.num_epochs or (4 if lstm else 1)
        normalize = self.normalize_advantages
        if normalize == "auto":
            normalize = "on" if num_minibatches * num_epochs > 1 else "off"
        return dataclasses.replace(
            self,
            learning_rate=self.learning_rate or (2.5e-4 if lstm else 1e-3),
            vtrace_lambda=(self.vtrace_lambda if self.vtrace_lambda != -1.0
                           else 0.9 if lstm else 1.0),
            num_minibatches=num_minibatches,
            num_epochs=num_epochs,
            normalize_advantages=normalize,
            normalize_rewards=rewards)


class Targets(NamedTuple):
    """What the value and the policy learn towards, leaves [E, T]: the V-trace targets
    `vs` and the advantages r_t + gamma v_{t+1} - V(x_t), without V-trace's ratio (the
    clipped surrogate's pi / mu takes its place)."""

    vs: jax.Array
    advantage: jax.Array


class IMPALAExperience(NamedTuple):
    """The latest update's shard; its targets (computed as it arrives, from the networks
    of that moment, when several optimizer steps learn from it; zeros otherwise: the one
    step computes its own); the env rows of each of those steps (a fresh random split of
    the rows per pass, as PPO splits its segments); the count of steps taken on it; and
    the key of the next shard's split."""

    latest: policy.LatestTrajectory
    targets: Targets
    rows: jax.Array  # [num_epochs * num_minibatches, E / num_minibatches] int32
    step: jax.Array  # int32 scalar
    key: jax.Array  # typed PRNG key


class IMPALA(policy.ActorCriticActing, sebulba.Agent):
    """IMPALA with V-trace, feed-forward or LSTM, for Discrete, MultiDiscrete and Box action
    spaces (V-trace's ratios come from the policy's log-probabilities, whatever it is)."""

    def __init__(self, env_spec: sebulba.EnvSpec, config: IMPALAConfig = IMPALAConfig()):
        super().__init__(env_spec)
        self.config = config = config.resolved(env_spec.action_space)
        self.entropy_cost = policy.entropy_cost(config, env_spec.action_space)
        # A centralized value sees all agents of an env: their rows share each minibatch.
        self.central_agents = env_spec.agents_per_env if config.central_value else 1
        self.network, self.return_discount = policy.actor_critic_network(
            env_spec, config, config.hidden_sizes, config.lstm_size if config.use_lstm else 0,
            config.discount)
        if config.optimizer == "adam":
            opt = optax.adam(config.learning_rate, eps=config.optimizer_eps)
        else:
            opt = optax.rmsprop(config.learning_rate, decay=0.99, eps=config.optimizer_eps)
        self.optimizer = optax.chain(optax.clip_by_global_norm(config.max_grad_norm), opt)

    # State.

    def new_opt_state(self, nets: Nets, key: jax.Array) -> OptState:
        return self.optimizer.init(nets)

    def new_experience_state(self, nets: Nets, key: jax.Array,
                             layout: sebulba.Layout) -> IMPALAExperience:
        m, k = self.config.num_minibatches, self.central_agents
        units = layout.envs_per_update_shard // k  # what a minibatch takes whole
        if units % m:
            what = (f"envs (of {k} agent rows each, for the centralized value)" if k > 1
                    else "env rows")
            raise ValueError(
                f"num_minibatches={m} must divide the {units} {what} of each learner "
                "device's update shard (trajectories_per_update x envs_per_group x agents "
                "per env / learner devices)")
        latest = policy.zeros_latest_trajectory(self, nets, layout)
        return self._experience(latest, _zero_targets(latest.trajectory), key)

    def update_experience(
        self,
        experience: IMPALAExperience,
        initial_step_state: policy.StepState,
        final_step_state: policy.StepState,
        trajectory: Trajectory,
        nets: Nets,
    ) -> IMPALAExperience:
        latest = policy.latest_trajectory(initial_step_state, trajectory)
        if self._fixed_targets:
            # Fixed for the whole update, as PPO fixes its advantages: recomputed at each
            # step, they would shrink as the value fits this very shard.
            _, out = self.network.apply(nets, latest.core, trajectory.env_steps.obs,
                                        trajectory.env_steps.first)
            vt = self._vtrace(nets, latest.trajectory, out)
            targets = Targets(vt.vs, vt.advantage)
        else:
            targets = _zero_targets(trajectory)
        return self._experience(latest, targets, experience.key)

    def _experience(self, latest: policy.LatestTrajectory, targets: Targets,
                    key: jax.Array) -> IMPALAExperience:
        """The experience of a new shard: its rows split into each step's minibatch."""
        cfg = self.config
        key, split_key = jax.random.split(key)
        # Whole rows: the LSTM unrolls each from the state its actor had.
        plan = segments.plan_minibatches(split_key, targets.advantage, cfg.num_epochs,
                                         cfg.num_minibatches, 0.0, 1.0,
                                         self.central_agents)
        return IMPALAExperience(latest, targets, plan.indices, jnp.zeros((), jnp.int32), key)

    # Learning: a V-trace actor-critic step per minibatch of env rows.

    def num_off_policy_optims_per_cycle(self) -> int:
        return self.config.num_epochs * self.config.num_minibatches

    @property
    def _fixed_targets(self) -> bool:
        return self.num_off_policy_optims_per_cycle() > 1

    def _vtrace(self, nets: Nets, trajectory: Trajectory,
                out: networks.PolicyValue) -> VTraceOutput:
        """V-trace on `trajectory` (leaves [E, T(+1)]) from the network's outputs `out` on
        it: a `VTraceOutput` with leaves [E, T]."""
        cfg = self.config
        steps, outputs = trajectory.env_steps, trajectory.actor_outputs
        dist = jax.tree.map(lambda x: x[:, :-1], out.policy)
        log_rho = jax.lax.stop_gradient(dist.log_prob(outputs.action)) \
            - outputs.extras["log_prob"]
        reward = normalization.scale_rewards(  # identity unless scaling
            nets, steps.reward, policy.reward_min_std(cfg.normalize_rewards))
        if cfg.reward_clip > 0.0:
            reward = jnp.clip(reward, -cfg.reward_clip, cfg.reward_clip)
        return jax.vmap(vtrace, in_axes=(0, 0, 0, 0, 0, None, None, None, None, None))(
            log_rho, reward, out.value, steps.terminated, steps.truncated, cfg.discount,
            cfg.rho_bar, cfg.c_bar, cfg.pg_rho_bar, cfg.vtrace_lambda)

    def loss(
        self, nets: Nets, opt: OptState, experience: IMPALAExperience
    ) -> tuple[jax.Array, tuple[IMPALAExperience, Metrics]]:
        cfg = self.config
        # The modulo only matters if the loss is called more often than the framework does.
        rows = experience.rows[experience.step % experience.rows.shape[0]]
        minibatch = (jax.tree.map(lambda x: x[rows], experience.latest) if self._fixed_targets
                     else experience.latest)  # the single step learns from the whole shard
        steps, outputs = minibatch.trajectory.env_steps, minibatch.trajectory.actor_outputs
        # All T + 1 observations: entry T (and truncated steps) are bootstrapped from.
        _, out = self.network.apply(nets, minibatch.core, steps.obs, steps.first)
        dist, values = jax.tree.map(lambda x: x[:, :-1], out.policy), out.value  # [E, T], [E, T+1]
        log_pi = dist.log_prob(outputs.action)  # [E, T]
        log_rho = log_pi - outputs.extras["log_prob"]  # log pi / mu
        rho = jnp.exp(jax.lax.stop_gradient(log_rho))
        mask = jax.vmap(action_mask)(steps.terminated, steps.truncated)  # [E, T]

        def advantages(advantage):
            return policy.standardize(advantage, mask) if cfg.normalize_advantages == "on" \
                else advantage

        if self._fixed_targets:
            targets = jax.tree.map(lambda x: x[rows], experience.targets)
            # PPO's clipped surrogate of pi / mu (APPO): the clip bounds the policy's
            # drift from the one that acted, lag included.
            surrogate = policy.clipped_surrogate(jnp.exp(log_rho), advantages(targets.advantage),
                                                 cfg.ratio_clip)
            vs = targets.vs
        else:
            # The paper's: V-trace's clipped rho weighs advantage x grad log pi (written
            # as A x pi / stop_gradient(pi): the gradient is that, the value A).
            vt = self._vtrace(nets, minibatch.trajectory, out)
            surrogate = advantages(vt.pg_advantage) * jnp.exp(
                log_pi - jax.lax.stop_gradient(log_pi))
            vs = vt.vs
        pg_loss = -policy.masked_mean(surrogate, mask)
        baseline_loss = 0.5 * policy.masked_mean((vs - values[:, :-1]) ** 2, mask)
        entropy = policy.masked_mean(dist.entropy(), mask)
        loss = pg_loss + cfg.baseline_cost * baseline_loss - self.entropy_cost * entropy
        log_rho = jax.lax.stop_gradient(log_rho)
        metrics = {
            "pg_loss": pg_loss,
            "baseline_loss": baseline_loss,
            "entropy": entropy,
            # How far the learner has moved from the acting policy (the policy lag's cost).
            "rho_mean": policy.masked_mean(rho, mask),
            "rho_clipped_fraction": policy.masked_mean(rho > cfg.rho_bar, mask),
            "approx_kl": policy.masked_mean(jnp.expm1(log_rho) - log_rho, mask),
        }
        return loss, (experience._replace(step=experience.step + 1), metrics)

    def optimize_from_grads(
        self, nets: Nets, opt: OptState, grads: PyTree
    ) -> tuple[Nets, OptState]:
        updates, opt = self.optimizer.update(grads, opt, nets)
        return optax.apply_updates(nets, updates), opt


def _zero_targets(trajectory: Trajectory) -> Targets:
    """Placeholder targets [E, T] for `trajectory` (the single step computes its own)."""
    zeros = jnp.zeros(trajectory.actor_outputs.action.shape[:2], jnp.float32)
    return Targets(zeros, zeros)

