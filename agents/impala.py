"""IMPALA (Espeholt et al., 2018): an actor-critic corrected for policy lag by V-trace.

Each update's trajectory shard (`trajectories_per_update` trajectories joined along the
env axis) is learnt from as it arrives: one V-trace step by default, or `num_epochs`
passes of `num_minibatches` steps over random splits of its env rows, towards targets
fixed as it arrived, with the policy's drift within the update clipped as in PPO. In Sebulba the
networks that acted are usually 1-2 updates older than the learner's (the learner
publishes after the trajectory was produced), so the learner's policy pi is not the
behaviour policy mu: the actor records log mu(a | x) in `ActorOutput.extras` and V-trace
weighs the returns and the policy gradient by clipped ratios pi / mu.

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
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

import sebulba
from agents.common import networks, normalization, policy
from agents.common.returns import action_mask
from agents.common.vtrace import vtrace
from sebulba.experience import segments
from sebulba.types import Metrics, Nets, OptState, PyTree, Trajectory

OPTIMIZERS = ("adam", "rmsprop")


@dataclasses.dataclass(frozen=True)
class IMPALAConfig(policy.ActorCriticOptions):
    """Hyperparameters; the defaults learn CartPole-v1 with T = 32 (16 envs per group
    learn fastest; 32 are steadier over 1M steps: tests/test_impala_learning.py). With
    `use_lstm` three defaults differ: a value torso and LSTM of its own and rewards
    scaled (`policy.ActorCriticOptions`' `shared_core` and `normalize_rewards`, as for
    PPO), and lambda 0.9. They make the LSTM agent indifferent to the rewards' scale, and
    it learns RepeatFirst-v0 (1/50 a step) and CartPoleNoVelocity-v1 (1 a step) with the
    same settings (benchmarks/RESULTS.md, "IMPALA and the reward scale"). The fields of
    `policy.ActorCriticOptions` (normalization, the Gaussian's std) come first.

    Attributes:
      use_lstm: a resetting LSTM core between the torso and the heads (for partially
        observed envs); otherwise separate feed-forward policy and value MLPs.
      hidden_sizes: tanh layers of the MLPs (or of the torso before the LSTM).
      lstm_size: units of the LSTM core (only with use_lstm).
      optimizer: "adam" (the default: one setting learns CartPole and cue recall; the
        paper's RMSProp with eps 0.01 barely moved CartPole in 1M steps at lr 5e-4, its
        eps being large next to these small gradients) or "rmsprop" (decay 0.99).
      learning_rate: the optimizer's step size.
      optimizer_eps: epsilon of Adam or RMSProp (the paper's RMSProp used 0.01).
      max_grad_norm: gradients are clipped to this global norm before the optimizer.
      discount: per-step discount gamma.
      rho_bar: clips the importance ratio in the V-trace targets (their fixed point).
      c_bar: clips the trace coefficients of the V-trace targets (speed of contraction).
      pg_rho_bar: clips the importance ratio of the policy gradient advantages.
      vtrace_lambda: scales the traces, c = lambda * min(c_bar, ratio); 1 in the paper.
        -1 (the default): by network, 0.9 with use_lstm (less variance from the later
        steps' sampled actions in its targets and advantages), 1 otherwise.
      baseline_cost: weight of the value's squared error (to the V-trace targets).
      entropy_cost: weight of a categorical policy's entropy bonus (Discrete and
        MultiDiscrete actions; `gaussian_entropy_cost` for Box ones).
      reward_clip: rewards are clipped to [-reward_clip, reward_clip] for learning; 0
        disables clipping (the paper clips Atari rewards to [-1, 1]).
      normalize_advantages: standardize the policy gradient's V-trace advantages within
        each update (as PPO does within each minibatch). Off by default: it let the
        shared-core LSTM agent learn rewards of 1/50 a step, but without PPO's clipping it
        also made it collapse on CartPole, as tiny advantages near the optimum become
        unit-sized ones (benchmarks/RESULTS.md, "IMPALA and the reward scale"); the LSTM
        defaults scale the rewards instead.
      num_minibatches: optimizer steps per pass over an update's shard, each on 1 /
        num_minibatches of its env rows, split afresh at random for each pass as PPO
        splits its segments (whole rows: an LSTM unrolls each from the state its actor
        had; with `central_value`, whole envs).
      num_epochs: passes over each update's shard. With more than one step per shard
        the targets and advantages are computed once, as the shard arrives (recomputed
        at each step they shrink as the value fits the shard, and the LSTM agent stayed
        at 0.47 on RepeatPrevious-v0), and each step weighs the advantages by pi / pi_0,
        its policy's drift from the one that computed them, clipped at 1 +- ratio_clip
        as PPO clips its ratio (V-trace still corrects the actors' lag through the
        advantages). 1 x 1 by default, the paper's one step per trajectory. For memory
        tasks try 4 minibatches x 2 epochs at learning rate 2.5e-4: they took the LSTM
        agent from 0.45-0.49 to 0.91, 0.89, 0.69 on RepeatPrevious-v0 (seeds 0-2) and
        scored 0.73, 0.86, 0.81 on CartPoleNoVelocity-v1 (the defaults: 0.85, 0.81,
        0.71); benchmarks/RESULTS.md, "The memory suite".
      ratio_clip: the clip of pi / pi_0 (only with several steps per shard).
    """

    use_lstm: bool = False
    hidden_sizes: tuple[int, ...] = (64, 64)
    lstm_size: int = 64
    optimizer: str = "adam"
    learning_rate: float = 1e-3
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
    normalize_advantages: bool = False
    num_minibatches: int = 1
    num_epochs: int = 1
    ratio_clip: float = 0.2

    def __post_init__(self):
        super().__post_init__()
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}")
        sizes = self.hidden_sizes
        if not isinstance(sizes, tuple) or not all(
                isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in sizes):
            raise ValueError(f"hidden_sizes must be a tuple of ints >= 1, got {sizes!r}")
        if not isinstance(self.lstm_size, int) or isinstance(self.lstm_size, bool) \
                or self.lstm_size < 1:
            raise ValueError(f"lstm_size must be an int >= 1, got {self.lstm_size!r}")
        for name in ("learning_rate", "optimizer_eps", "max_grad_norm", "rho_bar", "c_bar",
                     "pg_rho_bar", "ratio_clip"):
            if not getattr(self, name) > 0.0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if not 0.0 <= self.discount <= 1.0:
            raise ValueError(f"discount must be in [0, 1], got {self.discount!r}")
        if not (0.0 <= self.vtrace_lambda <= 1.0 or self.vtrace_lambda == -1.0):
            raise ValueError(f"vtrace_lambda must be in [0, 1], got {self.vtrace_lambda!r} "
                             "(or -1: by network)")
        for name in ("num_minibatches", "num_epochs"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        for name in ("baseline_cost", "entropy_cost", "reward_clip"):
            if not getattr(self, name) >= 0.0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        if self.c_bar > self.rho_bar:
            # The paper's analysis of V-trace assumes rho_bar >= c_bar (section 4.1).
            raise ValueError(
                f"c_bar must be <= rho_bar, got c_bar={self.c_bar!r} > rho_bar={self.rho_bar!r}")

    def resolved(self) -> IMPALAConfig:
        """This config with `vtrace_lambda` -1 filled in by network."""
        return dataclasses.replace(
            self, vtrace_lambda=(self.vtrace_lambda if self.vtrace_lambda != -1.0
                                 else 0.9 if self.use_lstm else 1.0))


class Targets(NamedTuple):
    """What the policy and value learn towards, leaves [E, T]: the V-trace targets `vs`,
    the policy gradient's advantages, and log pi(a_t | x_t) of the learner's policy when
    they were computed (the later steps weigh the advantages by their drift from it)."""

    vs: jax.Array
    advantage: jax.Array
    log_prob: jax.Array


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
        self.config = config = config.resolved()
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
        rows, m = layout.envs_per_update_shard, self.config.num_minibatches
        group = self.central_agents
        if (rows // group) % m:
            raise ValueError(
                f"num_minibatches={m} must divide the {rows // group} "
                + ("envs (of " + str(group) + " agent rows each, for the centralized value) "
                   if group > 1 else "env rows ")
                + "of each learner device's update shard (trajectories_per_update x "
                "envs_per_group x agents per env / learner devices)")
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
            targets = self._targets(nets, latest.trajectory, out)
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

    def _targets(self, nets: Nets, trajectory: Trajectory, out: networks.PolicyValue) -> Targets:
        """V-trace targets and advantages of `trajectory` (leaves [E, T(+1)]) from the
        network's outputs `out` on it."""
        cfg = self.config
        steps, outputs = trajectory.env_steps, trajectory.actor_outputs
        dist = jax.tree.map(lambda x: x[:, :-1], out.policy)
        log_pi = jax.lax.stop_gradient(dist.log_prob(outputs.action))
        log_rho = log_pi - outputs.extras["log_prob"]
        reward = normalization.scale_rewards(nets, steps.reward)  # identity unless scaling
        if cfg.reward_clip > 0.0:
            reward = jnp.clip(reward, -cfg.reward_clip, cfg.reward_clip)
        vt = jax.vmap(vtrace, in_axes=(0, 0, 0, 0, 0, None, None, None, None, None))(
            log_rho, reward, out.value, steps.terminated, steps.truncated, cfg.discount,
            cfg.rho_bar, cfg.c_bar, cfg.pg_rho_bar, cfg.vtrace_lambda)  # leaves [E, T]
        return Targets(vt.vs, vt.pg_advantage, log_pi)

    def loss(
        self, nets: Nets, opt: OptState, experience: IMPALAExperience
    ) -> tuple[jax.Array, tuple[IMPALAExperience, Metrics]]:
        cfg = self.config
        # The modulo only matters if the loss is called more often than the framework does.
        rows = experience.rows[experience.step % experience.rows.shape[0]]
        minibatch = jax.tree.map(lambda x: x[rows], experience.latest)
        experience_targets = experience.targets
        experience = experience._replace(step=experience.step + 1)
        steps, outputs = minibatch.trajectory.env_steps, minibatch.trajectory.actor_outputs
        # All T + 1 observations: entry T (and truncated steps) are bootstrapped from.
        _, out = self.network.apply(nets, minibatch.core, steps.obs, steps.first)
        dist, values = jax.tree.map(lambda x: x[:, :-1], out.policy), out.value  # [E, T], [E, T+1]
        log_pi = dist.log_prob(outputs.action)  # [E, T]
        log_rho = jax.lax.stop_gradient(log_pi - outputs.extras["log_prob"])
        if self._fixed_targets:
            targets = jax.tree.map(lambda x: x[rows], experience_targets)
        else:
            targets = self._targets(nets, minibatch.trajectory, out)
        mask = jax.vmap(action_mask)(steps.terminated, steps.truncated)  # [E, T]
        rho = jnp.exp(log_rho)

        advantage = targets.advantage
        if cfg.normalize_advantages:
            advantage = policy.standardize(advantage, mask)
        # pi / pi_0, pi_0 the policy the targets were computed with: 1 at an update's first
        # step (the paper's gradient, advantage * grad log pi), the drift since at later
        # ones, clipped pessimistically as PPO does (unclipped, 4 x 4 steps learnt
        # RepeatPrevious-v0 to 0.98 and fell back to 0.5 twice).
        ratio = jnp.exp(log_pi - targets.log_prob)
        surrogate = policy.clipped_surrogate(ratio, advantage, cfg.ratio_clip)
        pg_loss = -policy.masked_mean(surrogate, mask)
        baseline_loss = 0.5 * policy.masked_mean((targets.vs - values[:, :-1]) ** 2, mask)
        entropy = policy.masked_mean(dist.entropy(), mask)
        loss = pg_loss + cfg.baseline_cost * baseline_loss - self.entropy_cost * entropy
        metrics = {
            "pg_loss": pg_loss,
            "baseline_loss": baseline_loss,
            "entropy": entropy,
            # How far the learner has moved from the acting policy (the policy lag's cost).
            "rho_mean": policy.masked_mean(rho, mask),
            "rho_clipped_fraction": policy.masked_mean(rho > cfg.rho_bar, mask),
            "approx_kl": policy.masked_mean(jnp.expm1(log_rho) - log_rho, mask),
        }
        return loss, (experience, metrics)

    def optimize_from_grads(
        self, nets: Nets, opt: OptState, grads: PyTree
    ) -> tuple[Nets, OptState]:
        updates, opt = self.optimizer.update(grads, opt, nets)
        return optax.apply_updates(nets, updates), opt


def _zero_targets(trajectory: Trajectory) -> Targets:
    """Placeholder targets [E, T] for `trajectory` (the single step computes its own)."""
    zeros = jnp.zeros(trajectory.actor_outputs.action.shape[:2], jnp.float32)
    return Targets(zeros, zeros, zeros)

