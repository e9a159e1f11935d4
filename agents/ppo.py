"""Proximal Policy Optimization (Schulman et al., 2017) with GAE(lambda), CleanRL style.

Each received trajectory shard is learnt from for `num_epochs` epochs of
`num_minibatches` minibatches. The advantages are computed once per trajectory, in
`update_experience`, with the learner's current value function; the ratio's
denominator is the behaviour policy the actor recorded (under policy lag it is not the
learner's). Minibatches are sets of envs (rows of the [E, T, ...] shard), so each keeps
its time order for a recurrent variant. Read top to bottom: config, state, acting,
experience, loss.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

import sebulba
from agents.common.networks import SeparatePolicyValueMLP
from agents.common.returns import action_mask, gae_advantages
from sebulba.types import EnvStep, Metrics, Nets, OptState, PyTree, Trajectory


@dataclasses.dataclass(frozen=True)
class PPOConfig:
    """Hyperparameters; the defaults learn CartPole-v1 (16 envs per group, T = 32).

    Attributes:
      hidden_sizes: tanh layers of the policy MLP and, separately, of the value MLP.
      learning_rate: Adam step size.
      adam_eps: Adam's epsilon (CleanRL's 1e-5 rather than optax's 1e-8).
      max_grad_norm: gradients are clipped to this global norm before Adam.
      discount: per-step discount of the returns.
      gae_lambda: lambda of the GAE advantages (0: one-step TD errors, 1: Monte Carlo).
      num_epochs: passes over each received trajectory shard.
      num_minibatches: minibatches per epoch; they split the envs of a learner's shard.
      clip_epsilon: the probability ratio is clipped to [1 - eps, 1 + eps].
      clip_value_loss: also clip the value to within clip_epsilon of its old estimate.
      normalize_advantages: standardize the advantages within each minibatch.
      value_cost: weight of the value's squared error in the loss.
      entropy_cost: weight of the policy's entropy bonus in the loss.
    """

    hidden_sizes: tuple[int, ...] = (64, 64)
    learning_rate: float = 2.5e-4
    adam_eps: float = 1e-5
    max_grad_norm: float = 0.5
    discount: float = 0.99
    gae_lambda: float = 0.95
    num_epochs: int = 4
    num_minibatches: int = 4
    clip_epsilon: float = 0.2
    clip_value_loss: bool = True
    normalize_advantages: bool = True
    value_cost: float = 0.5
    entropy_cost: float = 0.01

    def __post_init__(self):
        for name in ("num_epochs", "num_minibatches"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        for name in ("discount", "gae_lambda"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)!r}")
        if self.clip_epsilon <= 0.0:
            raise ValueError(f"clip_epsilon must be > 0, got {self.clip_epsilon!r}")


class PPOStepState(NamedTuple):
    key: jax.Array  # [E] typed PRNG keys, one per env (a shared 0-d key would repeat per group)


class PPOBatch(NamedTuple):
    """A trajectory shard ready to learn from: leaves [E, T, ...] (a minibatch: [E / M, T, ...])."""

    obs: jax.Array  # [E, T, *obs_shape] observations acted on
    action: jax.Array  # [E, T] int
    behaviour_log_prob: jax.Array  # [E, T] log pi_behaviour(action | obs), from the actor
    advantage: jax.Array  # [E, T] GAE(lambda), not normalized
    value: jax.Array  # [E, T] values when the advantages were computed; targets = adv + value
    mask: jax.Array  # [E, T] float, 0 where the env ignored the action


class PPOExperience(NamedTuple):
    batch: PPOBatch
    permutations: jax.Array  # [num_epochs, E] int32, each epoch's order of envs
    cursor: jax.Array  # int32, optimizer steps taken on `batch`
    key: jax.Array  # typed PRNG key for the next trajectory's permutations


class PPO(sebulba.Agent):
    """PPO-clip for Discrete action spaces; observations are flattened."""

    def __init__(self, env_spec: sebulba.EnvSpec, config: PPOConfig = PPOConfig()):
        super().__init__(env_spec)
        self.config = config
        self.network = SeparatePolicyValueMLP(
            env_spec.num_actions, tuple(config.hidden_sizes), obs_rank=len(env_spec.obs_shape))
        self.optimizer = optax.chain(
            optax.clip_by_global_norm(config.max_grad_norm),
            optax.adam(config.learning_rate, eps=config.adam_eps),
        )

    def _apply(self, nets: Nets, obs: jax.Array) -> tuple[jax.Array, jax.Array]:
        """obs [..., *obs_shape] -> (logits [..., A], value [...])."""
        return self.network.apply(nets, obs)

    # State.

    def new_networks(self, key: jax.Array) -> Nets:
        return self.network.init(key, jnp.zeros((1,) + self.env_spec.obs_shape, jnp.float32))

    def _new_step_state(self, nets: Nets, key: jax.Array, num_envs: int) -> PPOStepState:
        return PPOStepState(key=jax.random.split(key, num_envs))

    def _new_opt_state(self, nets: Nets, key: jax.Array) -> OptState:
        return self.optimizer.init(nets)

    def _new_experience_state(
        self, nets: Nets, key: jax.Array, layout: sebulba.Layout
    ) -> PPOExperience:
        self._check_minibatches(layout.envs_per_learner_shard, layout)
        # A placeholder built by the same function as real experience, so its structure
        # and shapes are exactly what update_experience returns (the buffers are donated).
        zeros = sebulba.zeros_trajectory(
            self, nets, layout.envs_per_learner_shard, layout.steps_per_cycle)
        return self._prepare(zeros, nets, key)

    def _check_minibatches(self, num_envs: int, layout: sebulba.Layout | None = None) -> None:
        m = self.config.num_minibatches
        if num_envs % m == 0:
            return
        where = "" if layout is None else (
            f" (envs_per_group={layout.envs_per_group} / {layout.num_learner_devices} "
            "learner devices)")
        raise ValueError(
            f"num_minibatches={m} must divide the envs each learner device receives per "
            f"trajectory, {num_envs}{where}: PPO minibatches are sets of whole envs")

    # Acting.

    def step(
        self, step_state: PPOStepState, nets: Nets, env_step: EnvStep
    ) -> tuple[sebulba.ActorOutput, PPOStepState]:
        logits, _ = self._apply(nets, env_step.obs)  # [E, A]
        keys = jax.vmap(jax.random.split)(step_state.key)  # [E, 2]
        action = jax.vmap(jax.random.categorical)(keys[:, 0], logits)
        return _actor_output(logits, action), PPOStepState(key=keys[:, 1])

    def greedy_step(
        self, step_state: PPOStepState, nets: Nets, env_step: EnvStep
    ) -> tuple[sebulba.ActorOutput, PPOStepState]:
        logits, _ = self._apply(nets, env_step.obs)
        return _actor_output(logits, jnp.argmax(logits, axis=-1)), step_state

    # Experience: one trajectory shard, with advantages and each epoch's minibatch order.

    def update_experience(
        self,
        experience: PPOExperience,
        initial_step_state: PPOStepState,
        final_step_state: PPOStepState,
        trajectory: Trajectory,
        nets: Nets,
    ) -> PPOExperience:
        return self._prepare(trajectory, nets, experience.key)

    def _prepare(self, trajectory: Trajectory, nets: Nets, key: jax.Array) -> PPOExperience:
        cfg = self.config
        steps, outputs = trajectory.env_steps, trajectory.actor_outputs
        num_envs = steps.reward.shape[0]
        self._check_minibatches(num_envs)
        # Values of all T + 1 observations: entry T (and truncated steps) bootstrap.
        _, values = self._apply(nets, steps.obs)  # [E, T+1]
        advantages = jax.vmap(gae_advantages, in_axes=(0, 0, 0, 0, None, None))(
            steps.reward, values, steps.terminated, steps.truncated, cfg.discount, cfg.gae_lambda
        )  # [E, T]
        key, perm_key = jax.random.split(key)
        epoch_keys = jax.random.split(perm_key, cfg.num_epochs)
        permutations = jax.vmap(lambda k: jax.random.permutation(k, num_envs))(epoch_keys)
        batch = PPOBatch(
            obs=steps.obs[:, :-1],
            action=outputs.action,
            behaviour_log_prob=outputs.extras["log_prob"],
            advantage=advantages,
            value=values[:, :-1],
            mask=jax.vmap(action_mask)(steps.terminated, steps.truncated),
        )
        return PPOExperience(batch, permutations.astype(jnp.int32), jnp.zeros((), jnp.int32), key)

    def num_off_policy_optims_per_cycle(self) -> int:
        return self.config.num_epochs * self.config.num_minibatches

    # Learning: each call takes the next minibatch and advances the cursor.

    def loss(
        self, nets: Nets, opt: OptState, experience: PPOExperience
    ) -> tuple[jax.Array, tuple[PPOExperience, Metrics]]:
        cfg = self.config
        b = self._minibatch(experience)  # leaves [E / M, T, ...]

        def masked_mean(x: jax.Array) -> jax.Array:
            # Actions the env ignored (at the last step of an episode) carry no signal.
            return jnp.sum(x * b.mask) / jnp.maximum(jnp.sum(b.mask), 1.0)

        logits, value = self._apply(nets, b.obs)  # [B, T, A], [B, T]
        log_probs = jax.nn.log_softmax(logits)
        log_prob = jnp.take_along_axis(log_probs, b.action[..., None], axis=-1)[..., 0]
        log_ratio = log_prob - b.behaviour_log_prob
        ratio = jnp.exp(log_ratio)

        advantage = b.advantage
        if cfg.normalize_advantages:
            mean = masked_mean(advantage)
            advantage = (advantage - mean) / (jnp.sqrt(masked_mean((advantage - mean) ** 2)) + 1e-8)
        clipped_ratio = jnp.clip(ratio, 1.0 - cfg.clip_epsilon, 1.0 + cfg.clip_epsilon)
        pg_loss = -masked_mean(jnp.minimum(ratio * advantage, clipped_ratio * advantage))

        target = b.advantage + b.value  # the lambda-return
        value_error = (value - target) ** 2
        if cfg.clip_value_loss:
            clipped = b.value + jnp.clip(value - b.value, -cfg.clip_epsilon, cfg.clip_epsilon)
            value_error = jnp.maximum(value_error, (clipped - target) ** 2)
        value_loss = 0.5 * masked_mean(value_error)

        entropy = masked_mean(-jnp.sum(jnp.exp(log_probs) * log_probs, axis=-1))
        loss = pg_loss + cfg.value_cost * value_loss - cfg.entropy_cost * entropy
        metrics = {
            "pg_loss": pg_loss,
            "value_loss": value_loss,
            "entropy": entropy,
            # Against the behaviour policy: includes the policy lag, not only this update.
            "approx_kl": jax.lax.stop_gradient(masked_mean((ratio - 1.0) - log_ratio)),
            "clip_fraction": masked_mean(jnp.abs(ratio - 1.0) > cfg.clip_epsilon),
        }
        return loss, (experience._replace(cursor=experience.cursor + 1), metrics)

    def _minibatch(self, experience: PPOExperience) -> PPOBatch:
        """The rows (envs) of the batch that optimizer step `cursor` learns from."""
        m = self.config.num_minibatches
        size = experience.permutations.shape[1] // m
        # The modulo only matters if the loss is called more often than the framework does.
        epoch, minibatch = jnp.divmod(
            experience.cursor % self.num_off_policy_optims_per_cycle(), m)
        rows = jax.lax.dynamic_slice_in_dim(experience.permutations[epoch], minibatch * size, size)
        return jax.tree.map(lambda x: x[rows], experience.batch)

    def optimize_from_grads(
        self, nets: Nets, opt: OptState, grads: PyTree
    ) -> tuple[Nets, OptState]:
        updates, opt = self.optimizer.update(grads, opt, nets)
        return optax.apply_updates(nets, updates), opt


def _actor_output(logits: jax.Array, action: jax.Array) -> sebulba.ActorOutput:
    """Records log pi(action | obs) [E] of the acting policy for the learner's ratio."""
    log_prob = jnp.take_along_axis(jax.nn.log_softmax(logits), action[..., None], axis=-1)
    return sebulba.ActorOutput(action=action, extras={"log_prob": log_prob[..., 0]})
