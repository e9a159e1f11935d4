"""Simple policy gradient: REINFORCE with a learned baseline, on-policy.

Each received trajectory shard is the experience for one update. Returns are
bootstrapped from the baseline at the trajectory's end and at truncations, so a
trajectory need not hold whole episodes. Read top to bottom: state, acting, loss.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

import sebulba
from agents.common.networks import PolicyValueMLP
from agents.common.returns import action_mask, bootstrapped_returns


@dataclasses.dataclass(frozen=True)
class SPGConfig:
    hidden_sizes: Sequence[int] = (64, 64)
    learning_rate: float = 1e-3
    discount: float = 0.99
    value_cost: float = 0.5
    entropy_cost: float = 0.01
    max_grad_norm: float = 0.5


class SPGStepState(NamedTuple):
    key: jax.Array  # [E] typed PRNG keys, one per env


class SPG(sebulba.Agent):
    """REINFORCE with a baseline for Discrete action spaces."""

    def __init__(self, env_spec: sebulba.EnvSpec, config: SPGConfig = SPGConfig()):
        super().__init__(env_spec)
        self.config = config
        self.network = PolicyValueMLP(env_spec.num_actions, tuple(config.hidden_sizes))
        self.optimizer = optax.chain(
            optax.clip_by_global_norm(config.max_grad_norm), optax.adam(config.learning_rate)
        )

    def new_networks(self, key):
        obs = jnp.zeros((1,) + self.env_spec.obs_shape, jnp.float32)
        return self.network.init(key, obs)

    def _new_step_state(self, nets, key, num_envs):
        return SPGStepState(key=jax.random.split(key, num_envs))

    def _new_opt_state(self, nets, key):
        return self.optimizer.init(nets)

    def _new_experience_state(self, nets, key, layout):
        return sebulba.zeros_trajectory(
            self, nets, layout.envs_per_learner_shard, layout.steps_per_cycle
        )

    def step(self, step_state, nets, env_step):
        logits, _ = self.network.apply(nets, env_step.obs)
        keys = jax.vmap(jax.random.split)(step_state.key)  # [E, 2]
        action = jax.vmap(jax.random.categorical)(keys[:, 0], logits)
        return sebulba.ActorOutput(action=action), SPGStepState(key=keys[:, 1])

    def update_experience(self, experience, initial_step_state, final_step_state, trajectory):
        return trajectory  # on-policy: learn from the latest trajectory only

    def loss(self, nets, opt, experience):
        cfg = self.config
        steps, actions = experience.env_steps, experience.actor_outputs.action
        logits, values = self.network.apply(nets, steps.obs)  # [E, T+1, A], [E, T+1]
        returns = jax.vmap(bootstrapped_returns, in_axes=(0, 0, 0, 0, None))(
            steps.reward, values, steps.terminated, steps.truncated, cfg.discount
        )
        mask = jax.vmap(action_mask)(steps.terminated, steps.truncated)  # [E, T]
        logits, values = logits[:, :-1], values[:, :-1]
        advantage = returns - values
        log_probs = jax.nn.log_softmax(logits)
        chosen = jnp.take_along_axis(log_probs, actions[..., None], axis=-1)[..., 0]
        entropy = -jnp.sum(jnp.exp(log_probs) * log_probs, axis=-1)

        def masked_mean(x):
            return jnp.sum(x * mask) / jnp.maximum(jnp.sum(mask), 1.0)

        pg_loss = -masked_mean(chosen * jax.lax.stop_gradient(advantage))
        value_loss = 0.5 * masked_mean(advantage**2)
        entropy_mean = masked_mean(entropy)
        loss = pg_loss + cfg.value_cost * value_loss - cfg.entropy_cost * entropy_mean
        metrics = {"pg_loss": pg_loss, "value_loss": value_loss, "entropy": entropy_mean}
        return loss, (experience, metrics)

    def optimize_from_grads(self, nets, opt, grads):
        updates, opt = self.optimizer.update(grads, opt, nets)
        return optax.apply_updates(nets, updates), opt
