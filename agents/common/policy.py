"""Categorical policies: sampling, log-probabilities, entropy, masked means, and the acting
step every actor-critic agent (SPG, PPO, IMPALA) shares."""

from __future__ import annotations

from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp

import sebulba
from agents.common import networks


def sample(keys: jax.Array, logits: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One action per env from per-env typed keys [E] and logits [E, A].

    Returns (actions [E] int, the next keys [E]).
    """
    chex.assert_rank(logits, 2)
    chex.assert_axis_dimension(keys, 0, logits.shape[0])
    keys = jax.vmap(jax.random.split)(keys)  # [E, 2]
    return jax.vmap(jax.random.categorical)(keys[:, 0], logits), keys[:, 1]


def log_prob(logits: jax.Array, action: jax.Array) -> jax.Array:
    """log pi(action) [...] from logits [..., A] and int actions [...]."""
    chex.assert_equal_shape_prefix((logits, action), action.ndim)
    log_probs = jax.nn.log_softmax(logits)
    return jnp.take_along_axis(log_probs, action[..., None].astype(jnp.int32), axis=-1)[..., 0]


def entropy(logits: jax.Array) -> jax.Array:
    """Entropy [...] of the categorical distributions with logits [..., A]."""
    log_probs = jax.nn.log_softmax(logits)
    return -jnp.sum(jnp.exp(log_probs) * log_probs, axis=-1)


def masked_mean(x: jax.Array, mask: jax.Array) -> jax.Array:
    """Mean of `x` over entries where `mask` (same shape, 0/1) is 1; 0 if there are none."""
    chex.assert_equal_shape((x, mask))
    return jnp.sum(x * mask) / jnp.maximum(jnp.sum(mask), 1.0)


class StepState(NamedTuple):
    """The acting state of an actor-critic agent.

    Attributes:
      key: [E] typed PRNG keys, one per env (a shared key would repeat across groups).
      core: the network core's state, leaves [E, ...]; () for a feed-forward network.
    """

    key: jax.Array
    core: networks.CoreState


def new_step_state(network: networks.Unroll, key: jax.Array, num_envs: int) -> StepState:
    return StepState(key=jax.random.split(key, num_envs), core=network.initial_state(num_envs))


def act(network: networks.Unroll, params: networks.Params, step_state: StepState,
        env_step: sebulba.EnvStep, *, greedy: bool = False,
        record_core: bool = False) -> tuple[sebulba.ActorOutput, StepState]:
    """One acting step of a `PolicyValueHead` network: sample (or argmax) an action.

    The actor records log pi(action | obs) [E] in `extras["log_prob"]`, the denominator
    of a learner's importance ratio (under policy lag the learner's policy is not the
    one that acted), and with `record_core` the core state [E, ...] it acted from in
    `extras["core"]` (where a training segment that starts at this step starts from).
    A greedy step leaves the keys unchanged.
    """
    core, out = networks.act(network, params, step_state.core, env_step.obs, env_step.first)
    if greedy:
        action, key = jnp.argmax(out.logits, axis=-1), step_state.key
    else:
        action, key = sample(step_state.key, out.logits)
    extras = {"log_prob": log_prob(out.logits, action)}
    if record_core:
        extras["core"] = step_state.core
    return sebulba.ActorOutput(action=action, extras=extras), StepState(key, core)


class ActorCriticActing:
    """The acting hooks of an agent whose `self.network` is an `Unroll` with a
    `PolicyValueHead` (SPG, PPO, IMPALA): networks, StepState, sampled and greedy steps.

    Mix it in before `sebulba.Agent`. `record_core` = True makes the actor record the core
    state each step acts from (where a training segment starting there starts from).
    """

    network: networks.Unroll
    env_spec: sebulba.EnvSpec
    record_core: bool = False

    def new_networks(self, key: jax.Array) -> networks.Params:
        return networks.init(self.network, key, self.env_spec.observation_space)

    def new_step_state(self, nets: networks.Params, key: jax.Array,
                       num_envs: int) -> StepState:
        return new_step_state(self.network, key, num_envs)

    def step(self, step_state: StepState, nets: networks.Params,
             env_step: sebulba.EnvStep) -> tuple[sebulba.ActorOutput, StepState]:
        return act(self.network, nets, step_state, env_step, record_core=self.record_core)

    def greedy_step(self, step_state: StepState, nets: networks.Params,
                    env_step: sebulba.EnvStep) -> tuple[sebulba.ActorOutput, StepState]:
        return act(self.network, nets, step_state, env_step, greedy=True,
                   record_core=self.record_core)


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
