"""Simple policy gradient: REINFORCE with a learned baseline, on-policy.

Each received trajectory shard is the experience for one update. Returns are
bootstrapped from the baseline at the trajectory's end and at truncations, so a
trajectory need not hold whole episodes. Read top to bottom: config, state, acting,
loss.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

import sebulba
from agents.common import policy
from agents.common.networks import policy_value_network
from agents.common.returns import action_mask, bootstrapped_returns
from sebulba.types import EnvStep, Metrics, Nets, OptState, PyTree, Trajectory


@dataclasses.dataclass(frozen=True)
class SPGConfig:
    """Hyperparameters; the defaults learn CartPole-v1 with 16 envs per group and
    steps_per_cycle=64 (tests/test_spg_learning.py).

    Attributes:
      hidden_sizes: tanh layers of the policy MLP and, separately, of the baseline MLP.
      learning_rate: Adam step size.
      discount: per-step discount of the returns.
      value_cost: weight of the baseline's squared error in the loss.
      entropy_cost: weight of the policy's entropy bonus in the loss.
      max_grad_norm: gradients are clipped to this global norm before Adam.
    """

    hidden_sizes: Sequence[int] = (64, 64)
    learning_rate: float = 1e-3
    discount: float = 0.99
    value_cost: float = 0.5
    entropy_cost: float = 0.01
    max_grad_norm: float = 0.5


class SPGStepState(NamedTuple):
    key: jax.Array  # [E] typed PRNG keys, one per env


class SPG(sebulba.Agent):
    """REINFORCE with a baseline for Discrete action spaces; observations are flattened."""

    def __init__(self, env_spec: sebulba.EnvSpec, config: SPGConfig = SPGConfig()):
        super().__init__(env_spec)
        self.config = config
        # Separate tanh MLPs for policy and baseline. On CartPole-v1 one shared ReLU torso
        # with policy and value heads learned slowly and often collapsed to a
        # deterministic policy (returns ~10); separate ReLU MLPs swung between ~400 and ~50.
        self.network = policy_value_network(
            env_spec.num_actions, env_spec.obs_shape, config.hidden_sizes)
        self.optimizer = optax.chain(
            optax.clip_by_global_norm(config.max_grad_norm), optax.adam(config.learning_rate)
        )

    def new_networks(self, key: jax.Array) -> Nets:
        obs = jnp.zeros((1,) + self.env_spec.obs_shape, jnp.float32)
        return self.network.init(key, obs)

    def _new_step_state(self, nets: Nets, key: jax.Array, num_envs: int) -> SPGStepState:
        return SPGStepState(key=jax.random.split(key, num_envs))

    def _new_opt_state(self, nets: Nets, key: jax.Array) -> OptState:
        return self.optimizer.init(nets)

    def _new_experience_state(self, nets: Nets, key: jax.Array, layout: sebulba.Layout):
        return sebulba.zeros_trajectory(
            self, nets, layout.envs_per_learner_shard, layout.steps_per_cycle
        )

    def step(
        self, step_state: SPGStepState, nets: Nets, env_step: EnvStep
    ) -> tuple[sebulba.ActorOutput, SPGStepState]:
        logits, _ = self.network.apply(nets, env_step.obs)
        action, key = policy.sample(step_state.key, logits)
        return sebulba.ActorOutput(action=action), SPGStepState(key=key)

    def greedy_step(
        self, step_state: SPGStepState, nets: Nets, env_step: EnvStep
    ) -> tuple[sebulba.ActorOutput, SPGStepState]:
        logits, _ = self.network.apply(nets, env_step.obs)
        return sebulba.ActorOutput(action=jnp.argmax(logits, axis=-1)), step_state

    def update_experience(
        self,
        experience: Trajectory,
        initial_step_state: SPGStepState,
        final_step_state: SPGStepState,
        trajectory: Trajectory,
        nets: Nets,
    ) -> Trajectory:
        return trajectory  # on-policy: learn from the latest trajectory only

    def loss(
        self, nets: Nets, opt: OptState, experience: Trajectory
    ) -> tuple[jax.Array, tuple[Trajectory, Metrics]]:
        cfg = self.config
        steps, actions = experience.env_steps, experience.actor_outputs.action
        logits, values = self.network.apply(nets, steps.obs)  # [E, T+1, A], [E, T+1]
        returns = jax.vmap(bootstrapped_returns, in_axes=(0, 0, 0, 0, None))(
            steps.reward, values, steps.terminated, steps.truncated, cfg.discount
        )  # [E, T], constants
        mask = jax.vmap(action_mask)(steps.terminated, steps.truncated)  # [E, T]
        logits, values = logits[:, :-1], values[:, :-1]
        advantage = returns - values
        chosen = policy.log_prob(logits, actions)
        entropy = policy.entropy(logits)

        def masked_mean(x: jax.Array) -> jax.Array:
            # Actions the env ignored (at the last step of an episode) carry no signal.
            return policy.masked_mean(x, mask)

        pg_loss = -masked_mean(chosen * jax.lax.stop_gradient(advantage))
        value_loss = 0.5 * masked_mean(advantage**2)
        entropy_mean = masked_mean(entropy)
        loss = pg_loss + cfg.value_cost * value_loss - cfg.entropy_cost * entropy_mean
        metrics = {"pg_loss": pg_loss, "value_loss": value_loss, "entropy": entropy_mean}
        return loss, (experience, metrics)

    def optimize_from_grads(
        self, nets: Nets, opt: OptState, grads: PyTree
    ) -> tuple[Nets, OptState]:
        updates, opt = self.optimizer.update(grads, opt, nets)
        return optax.apply_updates(nets, updates), opt
