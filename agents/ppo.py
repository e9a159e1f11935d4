"""Proximal Policy Optimization (Schulman et al., 2017) with GAE(lambda), on segments.

Each update's trajectory shard [E, T] (E = K x E_group / L rows: `trajectories_per_update`
trajectories joined along the env axis) is learnt from for `num_epochs` epochs of
`num_minibatches` minibatches of segments (`sebulba.experience.segments`): every env's stream is
cut into segments of `bptt_horizon` steps (the whole trajectory by default), optionally
sampled in proportion to their summed |advantage|^prio_alpha with importance weights on
the policy loss. The advantages are computed once per trajectory, in
`update_experience`, with the learner's current value function; the ratio's denominator
is the behaviour policy the actor recorded (under policy lag it is not the learner's).

One network protocol (`agents.common.networks`), feed-forward (separate tanh MLPs for
policy and value) or recurrent (`use_lstm`: a resetting LSTM core). The actor records
the core state it acts from in `ActorOutput.extras["core"]` every step (`()` for a
feed-forward core), so every segment is unrolled in training from the state the actor
had at its first step, and resets where an episode starts inside it exactly as acting
did. Read top to bottom: config, state,
acting, experience, loss.
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
from agents.common.returns import action_mask, gae_advantages
from sebulba.experience import segments
from sebulba.types import Metrics, Nets, OptState, PyTree, Trajectory


@dataclasses.dataclass(frozen=True)
class PPOConfig(policy.ActorCriticOptions):
    """Hyperparameters; the defaults learn CartPole-v1 (16 envs per group, T = 32). The
    fields of `policy.ActorCriticOptions` (normalization, the Gaussian's std) come first.

    Attributes:
      hidden_sizes: tanh layers of the policy MLP and, separately, of the value MLP (with
        use_lstm: of the torso before the LSTM; policy and value each have their own
        unless `shared_core`).
      use_lstm: a resetting LSTM core between the torso and the heads (partially observed
        envs); training unrolls each segment from the actor's state at its first step.
      lstm_size: units of the LSTM core (only with use_lstm).
      learning_rate: Adam step size.
      adam_eps: Adam's epsilon (CleanRL's 1e-5 rather than optax's 1e-8).
      max_grad_norm: gradients are clipped to this global norm before Adam.
      discount: per-step discount of the returns.
      gae_lambda: lambda of the GAE advantages (0: one-step TD errors, 1: Monte Carlo).
      num_epochs: passes over each update's trajectory shard; 0: by action space, 4 for
        discrete actions and 10 for Box ones (CleanRL's Atari and MuJoCo PPO: continuous
        control reuses each sample more).
      num_minibatches: minibatches per epoch; they split the segments of a learner's
        shard; 0: by action space, 4 for discrete actions and 8 for Box ones.
      bptt_horizon: steps per segment; must divide steps_per_cycle; 0: the whole
        trajectory (one segment per env and trajectory).
      num_segments: segments per update over all learner devices the run must produce
        (e.g. from a PufferLib batch size / bptt_horizon): envs_per_group x
        trajectories_per_update x processes x steps_per_cycle / bptt_horizon; a mismatch
        with the envs is an error. 0: whatever the envs produce.
      prio_alpha: segments are sampled with probability proportional to (sum_t |A_t|) to
        this power; 0: uniform minibatches without replacement.
      prio_beta0: initial exponent of the importance weights (N p_i)^-beta on the policy
        loss; beta rises linearly to 1 over prio_beta_anneal_updates.
      prio_beta_anneal_updates: learner updates over which beta reaches 1, e.g.
        total_env_steps / (envs_per_group x steps_per_cycle x trajectories_per_update x
        processes); 0 keeps beta at prio_beta0.
      clip_epsilon: the probability ratio is clipped to [1 - eps, 1 + eps].
      clip_value_loss: also clip the value to within clip_epsilon of its old estimate.
      normalize_advantages: standardize the advantages within each minibatch.
      value_cost: weight of the value's squared error in the loss.
      entropy_cost: weight of a categorical policy's entropy bonus in the loss (Discrete
        and MultiDiscrete actions; `gaussian_entropy_cost` for Box ones).
    """

    hidden_sizes: tuple[int, ...] = (64, 64)
    use_lstm: bool = False
    lstm_size: int = 64
    learning_rate: float = 2.5e-4
    adam_eps: float = 1e-5
    max_grad_norm: float = 0.5
    discount: float = 0.99
    gae_lambda: float = 0.95
    num_epochs: int = 0
    num_minibatches: int = 0
    bptt_horizon: int = 0
    num_segments: int = 0
    prio_alpha: float = 0.0
    prio_beta0: float = 0.6
    prio_beta_anneal_updates: int = 0
    clip_epsilon: float = 0.2
    clip_value_loss: bool = True
    normalize_advantages: bool = True
    value_cost: float = 0.5
    entropy_cost: float = 0.01

    def __post_init__(self):
        super().__post_init__()
        checks.ints(self, "lstm_size")
        checks.ints(self, "num_epochs", "num_minibatches", "bptt_horizon", "num_segments",
                    "prio_beta_anneal_updates", low=0)
        checks.reals(self, "discount", "gae_lambda", "prio_beta0", low=0.0, high=1.0)
        checks.sizes(self, "hidden_sizes")
        checks.reals(self, "prio_alpha", low=0.0, high=sys.float_info.max,
                     expected="a finite number >= 0")
        checks.reals(self, "clip_epsilon", low=0.0, open_low=True)
        checks.reals(self, "learning_rate", "adam_eps", "max_grad_norm", low=0.0,
                     high=sys.float_info.max, open_low=True, expected="a finite number > 0")
        checks.reals(self, "value_cost", "entropy_cost", low=0.0, high=sys.float_info.max,
                     expected="a finite number >= 0")

    def for_actions(self, action_space: gym.Space) -> PPOConfig:
        """This config with the action-space defaults (the fields left at 0) filled in."""
        box = isinstance(action_space, gym.spaces.Box)
        return dataclasses.replace(
            self,
            num_epochs=self.num_epochs or (10 if box else 4),
            num_minibatches=self.num_minibatches or (8 if box else 4))


class PPOBatch(NamedTuple):
    """A trajectory shard cut into N segments of H steps: leaves [N, H, ...] (a minibatch:
    [B, H, ...]), except `core`, the recurrent state at each segment's first step."""

    obs: jax.Array  # [N, H, *obs_shape] observations acted on
    first: jax.Array  # [N, H] bool, an episode starts here: the LSTM state resets
    action: jax.Array  # [N, H, *action_shape]
    behaviour_log_prob: jax.Array  # [N, H] log pi_behaviour(action | obs), from the actor
    advantage: jax.Array  # [N, H] GAE(lambda), not normalized
    value: jax.Array  # [N, H] values when the advantages were computed; targets = adv + value
    # [N, H] what training's unroll gives before the update's first optimizer step: the
    # value clip's centre (`value` but for a recurrent core cut into segments, each of
    # which training unrolls from the actor's state, not from the whole unroll's)
    old_value: jax.Array
    mask: jax.Array  # [N, H] float, 0 where the env ignored the action
    core: networks.CoreState  # leaves [N, ...]; () for a feed-forward core


class PPOExperience(NamedTuple):
    batch: PPOBatch
    indices: jax.Array  # [num_epochs * num_minibatches, B] int32 segments of each step
    weights: jax.Array  # [N] float32 importance weights of the segments (1 if alpha = 0)
    cursor: jax.Array  # int32, optimizer steps taken on `batch`
    updates: jax.Array  # int32, learner updates so far (anneals beta)
    key: jax.Array  # typed PRNG key for the next trajectory's minibatches


class PPO(policy.ActorCriticActing, sebulba.Agent):
    """PPO-clip, feed-forward or LSTM, for Discrete, MultiDiscrete and Box action spaces
    (a categorical or diagonal Gaussian policy: `agents.common.distributions`)."""

    def __init__(self, env_spec: sebulba.EnvSpec, config: PPOConfig = PPOConfig()):
        super().__init__(env_spec)
        self.config = config = config.for_actions(env_spec.action_space)
        self.entropy_cost = policy.entropy_cost(config, env_spec.action_space)
        # A centralized value needs each minibatch to hold whole envs: K segments at a time.
        self.central_agents = env_spec.agents_per_env if config.central_value else 1
        self.network, self.return_discount = policy.actor_critic_network(
            env_spec, config, config.hidden_sizes, config.lstm_size if config.use_lstm else 0,
            config.discount)
        self.optimizer = optax.chain(
            optax.clip_by_global_norm(config.max_grad_norm),
            optax.adam(config.learning_rate, eps=config.adam_eps),
        )

    # State (networks, StepState and acting come from `policy.ActorCriticActing`; the
    # actor records its core state every step, where a segment starting there starts).

    record_core = True

    def new_opt_state(self, nets: Nets, key: jax.Array) -> OptState:
        return self.optimizer.init(nets)

    def new_experience_state(
        self, nets: Nets, key: jax.Array, layout: sebulba.Layout
    ) -> PPOExperience:
        # An update's shard has K x E / L rows: K trajectories joined along the env axis.
        seg = self._segment_layout(layout.envs_per_update_shard, layout.steps_per_cycle,
                                   layout.num_learner_devices * layout.num_processes,
                                   layout.agents_per_env)
        groups = seg.num_segments // self.central_agents
        if groups % self.config.num_minibatches:
            raise ValueError(
                f"num_minibatches={self.config.num_minibatches} must divide the {groups} "
                f"(env, segment) groups of each learner device ({seg.num_segments} "
                f"segments / {self.central_agents} agents per env): a centralized value "
                "(central_value) keeps each env's agents in one minibatch")
        # A placeholder of exactly the structure and shapes update_experience returns (the
        # buffers are donated), from the same function's shapes: zeros, and the real key
        # the first update draws from. Not `_prepare` itself, which outside `jit` would
        # run op by op, compiling each op (and its scans on every run).
        zeros = sebulba.zeros_trajectory(
            self, nets, layout.envs_per_update_shard, layout.steps_per_cycle)
        shapes = jax.eval_shape(self._prepare, zeros, nets, key, jnp.zeros((), jnp.int32))
        return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype),
                            shapes._replace(key=None))._replace(key=key)

    def _segment_layout(
        self, num_envs: int, steps_per_cycle: int, num_shards: int | None = None,
        agents_per_env: int = 1,
    ) -> segments.SegmentLayout:
        """Checks the sizes (errors name them); `num_shards` is None inside the learner,
        where the count of learner devices is not known and was checked at construction."""
        cfg = self.config
        return segments.segment_layout(
            num_envs, steps_per_cycle, cfg.bptt_horizon, cfg.num_minibatches,
            num_shards or 1, cfg.num_segments if num_shards else 0, agents_per_env)

    # Experience: one update's trajectory shard, cut into segments, with each step's
    # minibatch.

    def update_experience(
        self,
        experience: PPOExperience,
        initial_step_state: policy.StepState,
        final_step_state: policy.StepState,
        trajectory: Trajectory,
        nets: Nets,
    ) -> PPOExperience:
        # The initial StepState's core is entry 0 of the recorded extras["core"].
        return self._prepare(trajectory, nets, experience.key, experience.updates)

    def _prepare(
        self, trajectory: Trajectory, nets: Nets, key: jax.Array, updates: jax.Array
    ) -> PPOExperience:
        cfg = self.config
        steps, outputs = trajectory.env_steps, trajectory.actor_outputs
        num_envs, num_steps = outputs.action.shape[:2]
        horizon = self._segment_layout(num_envs, num_steps).horizon
        cores = outputs.extras["core"]  # leaves [E, T, ...]
        # Values of all T + 1 observations (entry T and truncated steps bootstrap),
        # unrolled from the actor's state at the trajectory's first step.
        start = jax.tree.map(lambda c: c[:, 0], cores)
        _, out = self.network.apply(nets, start, steps.obs, steps.first)
        values = out.value  # [E, T+1]
        reward = normalization.scale_rewards(  # identity unless scaling
            nets, steps.reward, policy.reward_min_std(cfg.normalize_rewards))
        advantages = jax.vmap(gae_advantages, in_axes=(0, 0, 0, 0, None, None))(
            reward, values, steps.terminated, steps.truncated, cfg.discount, cfg.gae_lambda
        )  # [E, T]

        def cut(x):
            return segments.to_segments(x, horizon)

        batch = PPOBatch(
            obs=cut(steps.obs[:, :-1]),
            first=cut(steps.first[:, :-1]),
            action=cut(outputs.action),
            behaviour_log_prob=cut(outputs.extras["log_prob"]),
            advantage=cut(advantages),
            value=cut(values[:, :-1]),
            old_value=cut(values[:, :-1]),
            mask=cut(jax.vmap(action_mask)(steps.terminated, steps.truncated)),
            core=segments.segment_starts(cores, horizon),
        )
        if self.central_agents > 1:  # whole envs per minibatch, their agents adjacent
            batch = jax.tree.map(
                lambda x: segments.group_by_env(x, self.central_agents, num_envs), batch)
        if jax.tree.leaves(batch.core) and horizon < num_steps:  # as `loss` unrolls them
            _, out = self.network.apply(nets, batch.core, batch.obs, batch.first)
            batch = batch._replace(old_value=out.value)
        key, plan_key = jax.random.split(key)
        beta = segments.annealed_beta(cfg.prio_beta0, updates, cfg.prio_beta_anneal_updates)
        plan = segments.plan_minibatches(plan_key, batch.advantage, cfg.num_epochs,
                                         cfg.num_minibatches, cfg.prio_alpha, beta,
                                         self.central_agents)
        return PPOExperience(batch, plan.indices, plan.weights, jnp.zeros((), jnp.int32),
                             updates + 1, key)

    def num_off_policy_optims_per_cycle(self) -> int:
        return self.config.num_epochs * self.config.num_minibatches

    # Learning: each call takes the next minibatch of segments and advances the cursor.

    def loss(
        self, nets: Nets, opt: OptState, experience: PPOExperience
    ) -> tuple[jax.Array, tuple[PPOExperience, Metrics]]:
        cfg = self.config
        b, weight = self._minibatch(experience)  # leaves [B, H, ...], [B]

        def masked_mean(x: jax.Array) -> jax.Array:
            # Actions the env ignored (at the last step of an episode) carry no signal.
            return policy.masked_mean(x, b.mask)

        _, out = self.network.apply(nets, b.core, b.obs, b.first)
        dist, value = out.policy, out.value  # batch [B, H], [B, H]
        log_ratio = dist.log_prob(b.action) - b.behaviour_log_prob
        ratio = jnp.exp(log_ratio)

        advantage = b.advantage
        if cfg.normalize_advantages:
            advantage = policy.standardize(advantage, b.mask)
        surrogate = policy.clipped_surrogate(ratio, advantage, cfg.clip_epsilon)
        # Importance weights correct the prioritized sampling of segments (1 if alpha = 0).
        pg_loss = -masked_mean(weight[:, None] * surrogate)

        target = b.advantage + b.value  # the lambda-return
        value_error = (value - target) ** 2
        if cfg.clip_value_loss:
            clipped = b.old_value + jnp.clip(value - b.old_value, -cfg.clip_epsilon,
                                             cfg.clip_epsilon)
            value_error = jnp.maximum(value_error, (clipped - target) ** 2)
        value_loss = 0.5 * masked_mean(value_error)

        entropy = masked_mean(dist.entropy())
        loss = pg_loss + cfg.value_cost * value_loss - self.entropy_cost * entropy
        metrics = {
            "pg_loss": pg_loss,
            "value_loss": value_loss,
            "entropy": entropy,
            # Against the behaviour policy: includes the policy lag, not only this update.
            "approx_kl": jax.lax.stop_gradient(masked_mean((ratio - 1.0) - log_ratio)),
            "clip_fraction": masked_mean(jnp.abs(ratio - 1.0) > cfg.clip_epsilon),
            "importance_weight": jnp.mean(weight),
        }
        return loss, (experience._replace(cursor=experience.cursor + 1), metrics)

    def _minibatch(self, experience: PPOExperience) -> tuple[PPOBatch, jax.Array]:
        """The segments (leaves [B, H, ...]) and their importance weights [B] that optimizer
        step `cursor` learns from."""
        # The modulo only matters if the loss is called more often than the framework does.
        step = experience.cursor % experience.indices.shape[0]
        rows = experience.indices[step]
        return jax.tree.map(lambda x: x[rows], experience.batch), experience.weights[rows]

    def optimize_from_grads(
        self, nets: Nets, opt: OptState, grads: PyTree
    ) -> tuple[Nets, OptState]:
        updates, opt = self.optimizer.update(grads, opt, nets)
        return optax.apply_updates(nets, updates), opt
