"""SAC: soft actor-critic (Haarnoja et al., 2018) for Box action spaces.

A tanh-squashed Gaussian policy, twin Q networks with Polyak-averaged targets and an
entropy temperature learnt towards a target entropy, trained off-policy from a uniform
replay of the transitions of every env. Read top to bottom: config, networks, state,
acting, experience, loss, optimizer.

How it fits the Sebulba loop:

- Actions: the policy acts in [-1, 1]^d (tanh of a Gaussian, which float32 rounds to
  +-1 far out); `step` rescales them linearly to the Box's bounds [low, high], which
  must be finite in float32 with low < high. The replay stores them back in [-1, 1],
  where the critics read them and the target entropy -d is meant (the rescaling only
  shifts log-probabilities by a constant).
- Experience: one uniform replay per learner device (`sebulba.experience.replay`,
  sampled with `sample_uniform`), holding `replay_capacity / D` transitions, D the
  run's learner devices: `replay_capacity` counts transitions of the whole run. Every
  update cuts its trajectory shard (K x E / L envs of T steps, L the process's learner
  devices) into one-step transitions (`sebulba.experience.transitions`, n_step > 1 for
  n-step ones): the action an env ignored on an episode's last observation (NEXT_STEP
  autoreset) is left out, a terminated episode bootstraps 0, a truncated one from its
  final observation.
- Reward scale: with `normalize_rewards` the experience keeps the running moments of
  the rewards received (`agents.common.normalization`, over every learner device) and
  the critics learn from rewards divided by their RMS: Q stays near the scale Adam's
  steps and the entropy bonus are sized for, whatever the task pays. The replay keeps
  the rewards as received; acting never sees the scale.
- Warm-up: the experience counts the run's env steps (every env, every learner device:
  `sebulba.experience.warmup`); `ready_to_learn` is False until `learning_starts` of
  them, and the learner skips the gradient steps until then. The networks count the
  gradient steps taken, and `acting_nets` publishes "act at random" while that count is
  0: the actors draw uniform actions until the learner has learnt once, whatever the
  layout.
- Replay ratio: `replay_ratio` gradient steps per env step of the run (every env of
  every process). A learner update learns from K x envs_per_group x steps_per_cycle x
  processes env steps (K = `Config.trajectories_per_update`), so
  `optimizer_steps_per_update` runs round(replay_ratio x that) gradient steps, whatever
  K and the learner devices, and refuses a ratio that rounds to none; the `replay_ratio`
  metric reports the ratio achieved after rounding.
- Learner devices: each samples `batch_size` transitions from its own replay, and
  draws the policy's noise, with its own key; the learner averages the gradients, so a
  gradient step learns from D x batch_size transitions.
- Three objectives, three optimizers: the networks are `SACNets(actor, critic,
  log_alpha, ...)`; `sebulba.objectives.own_part_losses` makes the critic loss
  train only `critic`, the actor loss only `actor`, the temperature loss only
  `log_alpha` (each sees the other parts as constants), and `per_field_optimizer` gives
  each part its own Adam.
- Target networks: `critic` is a `sebulba.target_network.OnlineAndTarget` pair (the
  actor has no target); `partition_for_grad` holds its target out of the gradient and
  `optimize_from_grads` moves it by `soft_refresh` with `tau` after every gradient step.
  Actors receive the actor's parameters only.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Sequence
from typing import NamedTuple

import flax.linen as nn
import gymnasium as gym
import jax
import jax.numpy as jnp
import numpy as np
import optax

import sebulba
from agents.common import checks, normalization
from agents.common.distributions import GaussianHead, TanhGaussian
from agents.common.networks import MLP
from sebulba import target_network
from sebulba.agent import combine_partitions
from sebulba.envs import observations
from sebulba.experience import replay as rp
from sebulba.experience import warmup
from sebulba.experience.transitions import Transition, n_step_transitions
from sebulba.objectives import own_part_losses, per_field_optimizer
from sebulba.runtime.sharding import own_key
from sebulba.types import EnvStep, Metrics, Nets, PyTree, Trajectory


@dataclasses.dataclass(frozen=True)
class SACConfig:
    """SAC's hyperparameters (the published ones, with a replay ratio for many envs).

    Attributes:
      hidden_sizes: ReLU layers of the actor and of each critic.
      discount: per-step discount.
      n_step: steps of reward before bootstrapping (1: SAC's one-step target). With
        n > 1 the target sums the n env rewards and takes the entropy bonus at the
        bootstrap step only, not the soft n-step return (which adds each step's).
      tau: Polyak rate of the critics' targets, per gradient step.
      actor_learning_rate: Adam step size of the actor.
      critic_learning_rate: Adam step size of the twin critics.
      temperature_learning_rate: Adam step size of log(alpha).
      initial_temperature: alpha at the start.
      batch_size: transitions each learner device samples per gradient step.
      replay_capacity: transitions the run's replays hold in total (each of the D
        learner devices of the run holds replay_capacity / D, the newest it received).
      learning_starts: env steps of the whole run (every env) received before the
        first gradient step; the actors act at random until its networks reach them
        (a few more trajectories: those in flight then). With a multi-agent env (N
        agents per env) it counts agent steps, trajectory rows: N per env step.
      replay_ratio: gradient steps per env step of the run (every env of every
        process), independent of `Config.trajectories_per_update` and of the learner
        devices; per agent step (trajectory row, N per env step) with N agents per env.
        Each learner update runs round(replay_ratio x its env steps) gradient steps,
        which must not round to 0; 0.5 is 256 steps per update with the launcher's 16
        envs x 32 steps. The `replay_ratio` metric is the ratio achieved.
        Published SAC takes 1 (one gradient step per env step); 0.5 halves the learner's
        work, and on Hopper-v5 it ended the training episodes' last 10% of 1M env steps
        at 2,744 over three seeds against 2,421 at 0.25 (benchmarks/RESULTS.md).
      normalize_rewards: the critics learn from rewards divided by the running root mean
        square of the rewards received (kept in the experience; 1 before any), so that
        a task paying 1e3 a step is learnt like one paying 1 (raw, the critics' Q must
        grow by Adam steps of about the learning rate to ~1e5). The policy is
        unaffected: its loss is Q's, up to the scale the temperature adapts to. Rewards
        that are mostly 0 are scaled up as their RMS is small (a first reward of 1 after
        N zeros is learnt as about sqrt(N)); a resume that does not restore the
        experience starts the moments anew with the replay.
    """

    hidden_sizes: Sequence[int] = (256, 256)
    discount: float = 0.99
    n_step: int = 1
    tau: float = 0.005
    actor_learning_rate: float = 3e-4
    critic_learning_rate: float = 1e-3
    temperature_learning_rate: float = 1e-3
    initial_temperature: float = 1.0
    batch_size: int = 256
    replay_capacity: int = 1_000_000
    learning_starts: int = 5_000
    replay_ratio: float = 0.5
    normalize_rewards: bool = True

    def __post_init__(self):
        checks.sizes(self, "hidden_sizes")
        checks.ints(self, "n_step", "batch_size", "replay_capacity")
        checks.reals(self, "replay_ratio", low=0.0, high=sys.float_info.max, open_low=True,
                     expected="a finite number > 0 (gradient steps per env step)")
        checks.ints(self, "learning_starts", low=0, high=warmup.SATURATION,
                    expected=f"an int in [0, {warmup.SATURATION}] (env steps the count holds)")
        checks.reals(self, "discount", low=0.0, high=1.0)
        checks.reals(self, "tau", low=0.0, high=1.0, open_low=True,
                     expected="in (0, 1] (at 0 the critics' targets never move)")
        checks.reals(self, "actor_learning_rate", "critic_learning_rate",
                     "temperature_learning_rate", low=0.0, high=sys.float_info.max,
                     open_low=True, expected="a finite number > 0")
        # alpha is a float32: beyond its range the losses are inf or NaN from the start.
        checks.reals(self, "initial_temperature", low=0.0,
                     high=float(np.finfo(np.float32).max), open_low=True,
                     expected="a finite number > 0 (within float32's range)")


# Networks.


class Actor(nn.Module):
    """Observations [..., *obs_shape] -> TanhGaussian over actions [..., d] in [-1, 1]."""

    action_dim: int
    hidden_sizes: Sequence[int]
    obs_rank: int

    @nn.compact
    def __call__(self, obs: jax.Array) -> TanhGaussian:
        x = MLP(tuple(self.hidden_sizes), "relu", self.obs_rank)(obs)
        return TanhGaussian(GaussianHead((self.action_dim,), state_dependent_std=True)(x))


class Critic(nn.Module):
    """(observations [..., *obs_shape], actions [..., d]) -> Q [...]."""

    hidden_sizes: Sequence[int]
    obs_rank: int

    @nn.compact
    def __call__(self, obs: jax.Array, action: jax.Array) -> jax.Array:
        x = MLP((), "relu", self.obs_rank)(obs)  # flattened, float32
        x = jnp.concatenate([x, action.astype(jnp.float32)], axis=-1)
        x = MLP(tuple(self.hidden_sizes) + (1,), "relu", 1, activate_final=False)(x)
        return x[..., 0]


# Two critics with their own parameters (stacked on a leading axis): Q [2, ...].
TwinCritic = nn.vmap(Critic, variable_axes={"params": 0}, split_rngs={"params": True},
                     in_axes=None, out_axes=0, axis_size=2)


# State.


class SACNets(NamedTuple):
    actor: PyTree  # Actor parameters
    critic: target_network.OnlineAndTarget  # TwinCritic parameters and their target
    log_alpha: jax.Array  # float32 scalar, log of the entropy temperature
    gradient_steps: jax.Array  # int32 scalar, gradient steps taken (not differentiated)


class ActingNets(NamedTuple):  # what the learner publishes to the actors
    actor: PyTree
    random: jax.Array  # bool scalar: act uniformly at random (before the first step)


class SACStepState(NamedTuple):
    key: jax.Array  # [E] typed PRNG keys


class SACExperience(NamedTuple):  # one per learner device
    replay: rp.Replay  # items: Transition, actions in [-1, 1]
    received: warmup.EnvStepCount  # env steps of the whole run received so far
    replay_ratio: jax.Array  # float32 scalar, gradient steps per env step of the run
    key: jax.Array  # typed PRNG key for sampling
    reward_moments: dict  # running moments of the rewards received (normalization)


def env_steps_per_update(layout: sebulba.Layout) -> int:
    """Env steps of one learner update of the run: every env of every process."""
    return (layout.trajectories_per_update * layout.envs_per_group * layout.steps_per_cycle
            * layout.num_processes)


class SAC(sebulba.Agent):
    def __init__(self, env_spec: sebulba.EnvSpec, config: SACConfig | None = None):
        super().__init__(env_spec)
        space = env_spec.action_space
        if not isinstance(space, gym.spaces.Box):
            raise ValueError(f"SAC needs a Box action space (continuous actions), got "
                             f"{space!r}; use PPO, IMPALA or SPG for discrete actions (R2D2 too "
                             "for a Discrete space)")
        if len(space.shape) != 1:
            raise ValueError(f"SAC needs a 1-D Box action space, got shape {space.shape}")
        # Actions are float32: bounds beyond its range would make them inf or NaN at the
        # first step (within it, so is the half-range below).
        low, high = np.asarray(space.low, np.float64), np.asarray(space.high, np.float64)
        with np.errstate(over="ignore", invalid="ignore"):
            finite32 = [np.isfinite(x.astype(np.float32)).all() for x in (low, high)]
        half = 0.5 * high - 0.5 * low  # not (high - low) / 2: that overflows at +-max
        if not all(finite32):
            raise ValueError(f"SAC rescales actions to the Box's bounds, which must be "
                             f"finite in float32 (|bound| <= {np.finfo(np.float32).max:.4g}); "
                             f"got {space!r} with low={space.low}, high={space.high}")
        # low < high, by a half-range float32 holds (a normal number: XLA flushes others)
        flat = np.flatnonzero(~(half.astype(np.float32) >= np.finfo(np.float32).tiny))
        if len(flat):
            raise ValueError(f"SAC rescales actions to the Box's bounds, which need low < "
                             f"high in every dimension; dimensions {flat.tolist()} have "
                             f"low={space.low[flat]}, high={space.high[flat]} (a fixed "
                             "dimension: drop it with an action wrapper)")
        if observations.kind(env_spec.observation_space) != observations.VECTOR:
            raise ValueError(
                f"SAC's networks are MLPs on vector observations, got "
                f"{env_spec.observation_space!r} ({observations.kind(env_spec.observation_space)}"
                " observations); flatten or embed them with a wrapper (--env_wrappers)")
        self.config = config = config or SACConfig()
        self.action_dim = int(space.shape[0])
        # [-1, 1] -> [low, high] as center + half x u, each term finite in float32.
        self.low, self.high = low.astype(np.float32), high.astype(np.float32)
        self.center = (0.5 * low + 0.5 * high).astype(np.float32)
        self.half = half.astype(np.float32)
        # XLA divides by multiplying with the reciprocal, which is subnormal (flushed to 0)
        # for a half-range above 2^126: `from_env` divides by sqrt(half) twice instead.
        self.root_half = np.sqrt(half).astype(np.float32)
        self.target_entropy = -float(self.action_dim)
        obs_rank = len(env_spec.obs_shape)
        self.actor = Actor(self.action_dim, tuple(config.hidden_sizes), obs_rank)
        self.critic = TwinCritic(tuple(config.hidden_sizes), obs_rank)
        self.optimizer = per_field_optimizer({
            "actor": optax.adam(config.actor_learning_rate),
            "critic": optax.adam(config.critic_learning_rate),
            "log_alpha": optax.adam(config.temperature_learning_rate),
        })

    # Action bounds: the policy's [-1, 1] <-> the env's [low, high].

    def to_env(self, unit_action: jax.Array) -> jax.Array:
        # The clip keeps rounding at float32's edge inside the bounds (inf -> high).
        return jnp.clip(self.center + self.half * unit_action, self.low, self.high)

    def from_env(self, action: jax.Array) -> jax.Array:
        return jnp.clip((action - self.center) / self.root_half / self.root_half, -1.0, 1.0)

    # Construction.

    def new_networks(self, key: jax.Array) -> SACNets:
        actor_key, critic_key = jax.random.split(key)
        obs = jnp.zeros((1,) + self.env_spec.obs_shape, jnp.float32)
        action = jnp.zeros((1, self.action_dim), jnp.float32)
        return SACNets(
            actor=self.actor.init(actor_key, obs),
            critic=target_network.new(self.critic.init(critic_key, obs, action)),
            # log in float64: a tiny temperature is 0 in float32, and its log -inf.
            log_alpha=jnp.asarray(math.log(self.config.initial_temperature), jnp.float32),
            gradient_steps=jnp.zeros((), jnp.int32),
        )

    def new_step_state(self, nets: Nets, key: jax.Array, num_envs: int) -> SACStepState:
        return SACStepState(jax.random.split(key, num_envs))

    def new_opt_state(self, nets: SACNets, key: jax.Array) -> PyTree:
        return self.optimizer.init(self.partition_for_grad(nets)[0])

    def new_experience_state(self, nets: Nets, key: jax.Array,
                             layout: sebulba.Layout) -> SACExperience:
        cfg = self.config
        devices = layout.num_learner_devices * layout.num_processes
        capacity = cfg.replay_capacity // devices
        per_update = layout.envs_per_update_shard * layout.steps_per_cycle
        if capacity < per_update:
            raise ValueError(
                f"replay_capacity={cfg.replay_capacity} over {devices} learner devices "
                f"leaves {capacity} transitions per device, fewer than one update brings "
                f"it ({per_update}); raise replay_capacity to at least {per_update * devices}")
        items, _ = n_step_transitions(sebulba.zeros_trajectory(self, nets, 1, 1),
                                      cfg.discount, cfg.n_step)
        example = jax.tree.map(lambda x: x[0], items)
        return SACExperience(
            # priority_exponent does not matter: only ever sampled uniformly.
            replay=rp.new_replay(example, capacity, priority_exponent=0.0),
            received=warmup.new_count(layout),
            replay_ratio=jnp.asarray(
                self.optimizer_steps_per_update(layout) / env_steps_per_update(layout),
                jnp.float32),
            key=key,
            reward_moments=normalization.new_moments(()),
        )

    # Acting.

    def acting_nets(self, nets: SACNets, learner_updates: jax.Array) -> ActingNets:
        return ActingNets(nets.actor, nets.gradient_steps == 0)

    def step(self, step_state: SACStepState, nets: ActingNets,
             env_step: EnvStep) -> tuple[sebulba.ActorOutput, SACStepState]:
        """A sample of the policy, or a uniform action before the first gradient step."""
        keys = jax.vmap(lambda k: jax.random.split(k, 3))(step_state.key)  # [E, 3]
        policy = self.actor.apply(nets.actor, env_step.obs)
        sampled = jax.vmap(lambda p, k: p.sample_and_log_prob(k)[0])(policy, keys[:, 0])
        uniform = jax.vmap(lambda k: jax.random.uniform(
            k, (self.action_dim,), minval=-1.0, maxval=1.0))(keys[:, 1])
        unit = jnp.where(nets.random, uniform, sampled)
        return sebulba.ActorOutput(self.to_env(unit)), SACStepState(keys[:, 2])

    def greedy_step(self, step_state: SACStepState, nets: ActingNets,
                    env_step: EnvStep) -> tuple[sebulba.ActorOutput, SACStepState]:
        policy = self.actor.apply(nets.actor, env_step.obs)
        return sebulba.ActorOutput(self.to_env(policy.mode())), step_state

    # Experience.

    def transitions(self, trajectory: Trajectory) -> tuple[Transition, jax.Array]:
        """The trajectory's transitions, actions in [-1, 1], and which are real."""
        unit = self.from_env(trajectory.actor_outputs.action)
        trajectory = trajectory._replace(
            actor_outputs=trajectory.actor_outputs._replace(action=unit))
        return n_step_transitions(trajectory, self.config.discount, self.config.n_step)

    def update_experience(self, experience: SACExperience, initial_step_state: SACStepState,
                          final_step_state: SACStepState, trajectory: Trajectory,
                          nets: Nets) -> SACExperience:
        items, valid = self.transitions(trajectory)
        return experience._replace(
            replay=rp.insert(experience.replay, items, valid),
            received=warmup.add(experience.received, trajectory),
            reward_moments=normalization.received_rewards_merged(experience.reward_moments,
                                                                trajectory))

    def reward_scale(self, experience: SACExperience) -> jax.Array:
        """What the critics' rewards are multiplied by: one over the running RMS of the
        rewards received with `normalize_rewards`, 1 without."""
        if not self.config.normalize_rewards:
            return jnp.ones((), jnp.float32)
        return normalization.inverse_rms(experience.reward_moments)

    def ready_to_learn(self, experience: SACExperience) -> jax.Array:
        """After `learning_starts` env steps of the run (and at least one transition)."""
        return (warmup.reached(experience.received, self.config.learning_starts)
                & (experience.replay.size > 0))

    def optimizer_steps_per_update(self, layout: sebulba.Layout) -> int:
        """round(replay_ratio x the env steps of an update of the run), at least 1."""
        ratio, env_steps = self.config.replay_ratio, env_steps_per_update(layout)
        steps = round(ratio * env_steps)
        if steps < 1:
            raise ValueError(
                f"replay_ratio={ratio} gradient steps per env step rounds to 0 gradient "
                f"steps per learner update of {env_steps} env steps (trajectories_per_update "
                f"x envs_per_group x steps_per_cycle x processes = "
                f"{layout.trajectories_per_update} x {layout.envs_per_group} x "
                f"{layout.steps_per_cycle} x {layout.num_processes}); use replay_ratio >= "
                f"{1 / env_steps:.3g} (1 step per update), or more env steps per update")
        return steps

    # Learning.

    def loss(self, nets: SACNets, opt: PyTree, experience: SACExperience
             ) -> tuple[jax.Array, tuple[SACExperience, Metrics]]:
        """Critic, actor and temperature losses of one uniform batch, each
        differentiable in its own part of the networks only."""
        cfg = self.config
        # Every learner device starts from the same experience key: the carried key stays
        # common, this step's draws (batch, the policy's noise) are each device's own.
        key, step_key = jax.random.split(experience.key)
        sample_key, critic_key, actor_key = jax.random.split(own_key(step_key), 3)
        batch = rp.sample_uniform(experience.replay, sample_key, cfg.batch_size).items
        reward_scale = self.reward_scale(experience)
        actor, critic = self.actor.apply, self.critic.apply

        def critic_loss(n: SACNets):
            next_action, next_log_prob = actor(n.actor, batch.next_obs).sample_and_log_prob(
                critic_key)
            next_q = jnp.min(critic(n.critic.target, batch.next_obs, next_action), axis=0)
            soft_value = next_q - jnp.exp(n.log_alpha) * next_log_prob
            target = batch.reward * reward_scale + batch.discount * soft_value
            q = critic(n.critic.online, batch.obs, batch.action)  # [2, B]
            loss = jnp.sum(jnp.mean(jnp.square(q - target), axis=1))
            return loss, {"q": jnp.mean(q)}

        def actor_loss(n: SACNets):
            action, log_prob = actor(n.actor, batch.obs).sample_and_log_prob(actor_key)
            q = jnp.min(critic(n.critic.online, batch.obs, action), axis=0)
            loss = jnp.mean(jnp.exp(n.log_alpha) * log_prob - q)
            return loss, {"entropy": -jnp.mean(log_prob)}

        def temperature_loss(n: SACNets):
            _, log_prob = actor(n.actor, batch.obs).sample_and_log_prob(actor_key)
            loss = -jnp.mean(n.log_alpha * (log_prob + self.target_entropy))
            return loss, {"alpha": jnp.exp(n.log_alpha)}

        loss, metrics = own_part_losses(nets, {"critic": critic_loss, "actor": actor_loss,
                                               "log_alpha": temperature_loss})
        metrics = {**metrics,
                   "replay_size": experience.replay.size.astype(jnp.float32),
                   "replay_ratio": experience.replay_ratio,
                   "reward_scale": reward_scale}
        return loss, (experience._replace(key=key), metrics)

    def partition_for_grad(self, nets: SACNets) -> tuple[SACNets, SACNets]:
        """Differentiates the actor, the online critics and log(alpha): not the critics'
        target, not the step counter."""
        diff, fixed = target_network.partition_for_grad(nets)
        return (diff._replace(gradient_steps=None),
                fixed._replace(gradient_steps=nets.gradient_steps))

    def optimize_from_grads(self, nets: SACNets, opt: PyTree, grads: SACNets
                            ) -> tuple[SACNets, PyTree]:
        """One Adam step per part, then the critics' target moves `tau` towards them."""
        diff, fixed = self.partition_for_grad(nets)
        updates, opt = self.optimizer.update(grads, opt, diff)
        nets = combine_partitions(optax.apply_updates(diff, updates), fixed)
        critic = target_network.soft_refresh(nets.critic, nets.critic.online, self.config.tau)
        return nets._replace(critic=critic, gradient_steps=nets.gradient_steps + 1), opt
