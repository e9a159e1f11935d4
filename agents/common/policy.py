"""The acting step every actor-critic agent (SPG, PPO, IMPALA) shares, for any action
distribution (`agents.common.distributions`), and masked means."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence
from typing import Any, NamedTuple

import chex
import flax.linen as nn
import gymnasium as gym
import jax
import jax.numpy as jnp

import sebulba
from agents.common import checks, distributions, networks, normalization
from sebulba.envs import observations
from sebulba.runtime.sharding import LEARNER_AXIS


def sample(keys: jax.Array, dist: distributions.Distribution) -> tuple[jax.Array, jax.Array]:
    """One action per env from per-env typed keys [E] and a distribution with batch [E].

    Returns (actions [E, *action_shape], the next keys [E]).
    """
    chex.assert_rank(keys, 1)
    keys = jax.vmap(jax.random.split)(keys)  # [E, 2]
    return jax.vmap(lambda d, k: d.sample(k))(dist, keys[:, 0]), keys[:, 1]


SWITCHES = ("auto", "on", "off")
REWARD_SWITCHES = ("auto", "on", "down", "off")  # "down": only a std above 1 divides


def switch_on(value: str, action_space: gym.Space) -> bool:
    """`normalize_observations`: "auto" is on for continuous (Box) actions, where
    observation scales vary most between tasks (MuJoCo), as CleanRL's continuous PPO
    normalizes them, and off for discrete actions (on, PPO learnt nothing on Acrobot:
    benchmarks/HISTORY.md, "Observation normalization for discrete actions")."""
    return value == "on" or (value == "auto" and isinstance(action_space, gym.spaces.Box))


@dataclasses.dataclass(frozen=True)
class ActorCriticOptions:
    """Options every actor-critic config shares (a base class of PPO's and IMPALA's).

    Attributes:
      normalize_observations: "auto" | "on" | "off": standardize vector observations by
        running moments learnt on the learner and published with the networks
        (`agents.common.normalization`); "auto": on for Box action spaces.
      normalize_rewards: "auto" | "on" | "down" | "off": divide rewards, for learning
        only, by the running std of the discounted return (the actors accumulate it; the
        learner keeps the moments); "down": only where that std exceeds 1. "auto": on, so
        that one setting learns rewards of 1/50 or 1 a step (benchmarks/RESULTS.md, "The
        memory suite") and of any scale (PPO on CartPole x1e-6 and x1e6, "Reward scales");
        IMPALA's feed-forward agent with discrete actions takes "down" instead (or "off"
        with its `reward_clip`).
      state_dependent_std: a Gaussian policy's log-std is a linear output of the
        features; False (CleanRL's choice): one learnt parameter per action dimension.
      gaussian_entropy_cost: weight of the entropy bonus of a Gaussian policy (Box
        actions), in place of `entropy_cost`: a Gaussian's entropy grows without bound
        with its std and the bonus raises every log-std at a constant rate, so continuous
        control explores through the std alone by default (0, as CleanRL's MuJoCo PPO).
      central_value: multi-agent envs: the value function also sees the features of all
        agents of the row's env (MAPPO's centralized critic); the policy sees only its
        own observation, so acting stays decentralized.
      shared_core: with an LSTM, policy and value share one torso and one LSTM (linear
        heads). False (the default): each has its own of the same sizes, so that the
        value's loss does not reshape the policy's memory (benchmarks/RESULTS.md, "The
        memory suite"). Frames always share one Nature CNN and LSTM.
    """

    normalize_observations: str = "auto"
    normalize_rewards: str = "auto"
    state_dependent_std: bool = False
    gaussian_entropy_cost: float = 0.0
    central_value: bool = False
    shared_core: bool = False

    def __post_init__(self):
        checks.one_of(self, "normalize_observations", SWITCHES)
        checks.one_of(self, "normalize_rewards", REWARD_SWITCHES)
        checks.reals(self, "gaussian_entropy_cost", low=0.0, high=sys.float_info.max,
                     expected="a finite number >= 0")


def actor_critic_network(env_spec: sebulba.EnvSpec, options: ActorCriticOptions,
                         hidden_sizes: Sequence[int], lstm_size: int,
                         discount: float) -> tuple[networks.Unroll, float | None]:
    """The agent's network for its env and options, and the discount its actors accumulate
    returns with for reward scaling (None: rewards are not scaled)."""
    if options.central_value and env_spec.agents_per_env == 1:
        raise ValueError("central_value needs a multi-agent env (agents_per_env > 1), got "
                         f"{env_spec}")
    space = env_spec.observation_space
    if lstm_size and not options.shared_core and observations.kind(space) != observations.IMAGE:
        network = twin_lstm_network(env_spec, options, hidden_sizes, lstm_size)
    else:
        network = networks.actor_critic(
            env_spec.action_space, space, hidden_sizes, lstm_size,
            state_dependent_std=options.state_dependent_std,
            central_agents=env_spec.agents_per_env if options.central_value else 1,
            normalize_observations=switch_on(options.normalize_observations,
                                             env_spec.action_space))
    # "auto" is on here: IMPALA resolves its own "auto" before (`IMPALAConfig.resolved`).
    return network, discount if options.normalize_rewards != "off" else None


def reward_min_std(normalize_rewards: str) -> float:
    """The least std `normalization.scale_rewards` divides rewards by under a
    `normalize_rewards` setting: 1 for "down" (it never makes them larger), 0 otherwise."""
    return 1.0 if normalize_rewards == "down" else 0.0


def twin_lstm_network(env_spec: sebulba.EnvSpec, options: ActorCriticOptions,
                      hidden_sizes: Sequence[int], lstm_size: int) -> networks.Unroll:
    """Policy and value each with a tanh MLP torso of `hidden_sizes` and an LSTM of
    `lstm_size` units (vector or discrete observations, normalized as
    `networks.actor_critic` does)."""
    space = env_spec.observation_space
    torso = networks.TwinTorso(networks.torso_for(space, hidden_sizes),
                               networks.torso_for(space, hidden_sizes))
    if (switch_on(options.normalize_observations, env_spec.action_space)
            and observations.kind(space) == observations.VECTOR):
        torso = nn.Sequential([normalization.ObservationNormalizer(len(space.shape)), torso])
    head = distributions.policy_head_for(env_spec.action_space,
                                         state_dependent_std=options.state_dependent_std)
    return networks.Unroll(torso, networks.TwinLSTMCore(lstm_size), networks.TwinHead(
        head, env_spec.agents_per_env if options.central_value else 1))


def entropy_cost(config: Any, action_space: gym.Space) -> float:
    """The entropy bonus's weight for this action space: the config's (an agent's, with
    both fields) `gaussian_entropy_cost` for Box actions, its `entropy_cost` for
    categorical ones."""
    if isinstance(action_space, gym.spaces.Box):
        return config.gaussian_entropy_cost
    return config.entropy_cost


def _over_learner_devices(x: jax.Array) -> jax.Array | None:
    """psum of `x` over the learner devices where traced inside the learner's shard_map;
    None elsewhere (a loss evaluated on its own)."""
    try:
        return jax.lax.psum(x, LEARNER_AXIS)
    except NameError:  # the learner axis is not bound here
        return None


def masked_mean(x: jax.Array, mask: jax.Array) -> jax.Array:
    """Mean of `x` over entries where `mask` (same shape, 0/1) is 1; 0 if there are none.

    Inside the learner, a loss term of the whole batch: this device's masked sum over
    the mean count of unmasked entries per learner device, so that its average over
    the devices (the learner's pmean of losses, gradients and metrics) is the batch's
    masked mean whatever share of the unmasked entries each device holds. Dividing by
    each device's own count would weigh a device's entries more where it holds fewer,
    and the result would depend on the number of learner devices.
    """
    chex.assert_equal_shape((x, mask))
    count = jnp.sum(mask)
    total = _over_learner_devices(jnp.stack([count, jnp.ones_like(count)]))
    if total is not None:
        count = total[0] / total[1]
    return jnp.sum(x * mask) / jnp.maximum(count, 1.0)


def masked_batch_mean(x: jax.Array, mask: jax.Array) -> jax.Array:
    """Mean of `x` where `mask` is 1 over the whole batch, the same value on every
    learner device (the statistics of `standardize`); over `x` alone outside the learner."""
    chex.assert_equal_shape((x, mask))
    sums = jnp.stack([jnp.sum(x * mask), jnp.sum(mask).astype(x.dtype)])
    total = _over_learner_devices(sums)
    if total is not None:
        sums = total
    return sums[0] / jnp.maximum(sums[1], 1.0)


def clipped_surrogate(ratio: jax.Array, advantage: jax.Array, epsilon: float) -> jax.Array:
    """PPO's pessimistic objective per step (same shapes in and out): min(r A, clip(r,
    1 - epsilon, 1 + epsilon) A), whose gradient vanishes once the ratio r = pi / pi_old
    has moved past the clip in the advantage's direction."""
    clipped = jnp.clip(ratio, 1.0 - epsilon, 1.0 + epsilon)
    return jnp.minimum(ratio * advantage, clipped * advantage)


def standardize(x: jax.Array, mask: jax.Array) -> jax.Array:
    """`x` less its masked mean, over its masked std, both of the whole batch over the
    learner devices (shapes as `masked_mean`): advantages
    in units the policy loss can weigh against the entropy bonus whatever the rewards'
    scale."""
    mean = masked_batch_mean(x, mask)
    return (x - mean) / (jnp.sqrt(masked_batch_mean((x - mean) ** 2, mask)) + 1e-8)


class StepState(NamedTuple):
    """The acting state of an actor-critic agent.

    Attributes:
      key: [E] typed PRNG keys, one per env (a shared key would repeat across groups).
      core: the network core's state, leaves [E, ...]; () for a feed-forward network.
      discounted_return: [E] float32, each env's discounted return so far (what reward
        scaling takes its statistics from; zeros unless the agent scales rewards).
    """

    key: jax.Array
    core: networks.CoreState
    discounted_return: jax.Array


def new_step_state(network: networks.Unroll, key: jax.Array, num_envs: int) -> StepState:
    return StepState(key=jax.random.split(key, num_envs), core=network.initial_state(num_envs),
                     discounted_return=jnp.zeros(num_envs, jnp.float32))


def act(network: networks.Unroll, params: networks.Params, step_state: StepState,
        env_step: sebulba.EnvStep, *, greedy: bool = False, record_core: bool = False,
        return_discount: float | None = None) -> tuple[sebulba.ActorOutput, StepState]:
    """One acting step of a `PolicyValueHead` network: sample an action (or take the
    distribution's mode: the argmax, or a Gaussian's mean).

    The actor records log pi(action | obs) [E] in `extras["log_prob"]`, the denominator
    of a learner's importance ratio (under policy lag the learner's policy is not the
    one that acted), and with `record_core` the core state [E, ...] it acted from in
    `extras["core"]` (where a training segment that starts at this step starts from).
    A greedy step leaves the keys unchanged.
    """
    core, out = networks.act(network, params, step_state.core, env_step.obs, env_step.first)
    if greedy:
        action, key = out.policy.mode(), step_state.key
    else:
        action, key = sample(step_state.key, out.policy)
    extras = {"log_prob": out.policy.log_prob(action)}
    if record_core:
        extras["core"] = step_state.core
    returns = step_state.discounted_return
    if return_discount is not None:
        returns = normalization.discounted_return(returns, env_step.reward, env_step.first,
                                                  return_discount)
        extras["discounted_return"] = returns
    return sebulba.ActorOutput(action=action, extras=extras), StepState(key, core, returns)


class ActorCriticActing:
    """The acting hooks of an agent whose `self.network` is an `Unroll` with a
    `PolicyValueHead` (SPG, PPO, IMPALA): networks, StepState, sampled and greedy steps.

    Mix it in before `sebulba.Agent`. `record_core` = True makes the actor record the core
    state each step acts from (where a training segment starting there starts from).
    `return_discount` set (by an agent that scales rewards) makes the networks hold
    reward moments and the actor accumulate discounted returns; observation moments are
    held when the network normalizes its observations (`networks.actor_critic`). Both are
    updated on the learner, in `update_statistics`.
    """

    network: networks.Unroll
    env_spec: sebulba.EnvSpec
    record_core: bool = False
    return_discount: float | None = None

    def new_networks(self, key: jax.Array) -> networks.Params:
        nets = networks.init(self.network, key, self.env_spec.observation_space)
        if self.return_discount is not None:
            nets = normalization.with_reward_scaling(nets)
        return nets

    def update_statistics(self, nets: networks.Params,
                          trajectory: sebulba.Trajectory) -> networks.Params:
        # Entry T of the observations is entry 0 of the next trajectory: counted there.
        # Padding rows of a multi-agent env (first and terminated at once, which no real
        # step is: sebulba.envs.pettingzoo_source) hold no observation.
        steps = jax.tree.map(lambda x: x[:, :-1], trajectory.env_steps)
        return normalization.update(
            nets, steps.obs, trajectory.actor_outputs.extras.get("discounted_return"),
            valid=~(steps.first & steps.terminated))

    def new_step_state(self, nets: networks.Params, key: jax.Array,
                       num_envs: int) -> StepState:
        return new_step_state(self.network, key, num_envs)

    def step(self, step_state: StepState, nets: networks.Params,
             env_step: sebulba.EnvStep) -> tuple[sebulba.ActorOutput, StepState]:
        return act(self.network, nets, step_state, env_step, record_core=self.record_core,
                   return_discount=self.return_discount)

    def greedy_step(self, step_state: StepState, nets: networks.Params,
                    env_step: sebulba.EnvStep) -> tuple[sebulba.ActorOutput, StepState]:
        return act(self.network, nets, step_state, env_step, greedy=True,
                   record_core=self.record_core, return_discount=self.return_discount)


class LatestTrajectory(NamedTuple):
    """On-policy experience: the latest update's trajectory shard (leaves [K x E / L,
    T(+1), ...]) and the core state [K x E / L, ...] the actors had before its first step,
    which the learner unrolls from."""

    trajectory: sebulba.Trajectory
    core: networks.CoreState


def zeros_latest_trajectory(agent: ActorCriticActing, nets: networks.Params,
                            layout: sebulba.Layout) -> LatestTrajectory:
    """A placeholder shaped exactly like what `latest_trajectory` returns (the learner
    donates the experience's buffers, so the shapes must not change)."""
    num_envs = layout.envs_per_update_shard  # K trajectories x E / L envs
    zeros = sebulba.zeros_trajectory(agent, nets, num_envs, layout.steps_per_cycle)
    return LatestTrajectory(zeros, agent.network.initial_state(num_envs))


def latest_trajectory(initial_step_state: StepState,
                      trajectory: sebulba.Trajectory) -> LatestTrajectory:
    """`update_experience` of an on-policy agent that learns from each update's shard."""
    return LatestTrajectory(trajectory, initial_step_state.core)
