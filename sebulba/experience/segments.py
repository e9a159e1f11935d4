"""Segment experience: trajectories cut into `bptt_horizon`-step segments, sampled by advantage.

Each env's stream is cut into segments of H = `bptt_horizon` consecutive steps. A
trajectory shard [E, T, ...] of one learner device holds E * T / H segments:
segment i is env i // (T / H), steps [(i % (T / H)) * H, ... + H). Episodes cross
segment boundaries freely; a segment may hold the end of one episode and the start of
the next, and its `first` flags say where a recurrent state must reset (`ResetLSTM`
does it in a masked scan, in acting and in training alike).

Where a segment's recurrent state comes from. H must divide T, so a segment never spans
two inference cycles (a learner receives each group's cycles interleaved with other
groups', and holding half-segments across them would tie the experience to the group
order). For the first segment of a trajectory the state is the initial StepState's; for
the others it is the state the actor held at that step. We take both from the actor's
own record: a recurrent agent writes the state it acts from into `ActorOutput.extras`
every step, and `segment_starts` picks entries 0, H, 2H, ... (entry 0 equals the initial
StepState's). One code path for every H dividing T, no need for `step` to know T, and
the cost is E x state-size floats per step, small next to the observations.

Sizing is exact: the buffer holds every segment the envs produced in one update, no
empty slots. Asking for another number of segments (a PufferLib-style batch size that
does not match the envs: 8,192 segments for 8,160 agents), or for minibatches that do
not divide the segments, is an error at construction naming both numbers.

Prioritized sampling by advantage (PufferLib's scheme, with proportional prioritization's
formulas from Schaul et al., 2016): segment i is drawn with probability
p_i = (sum_t |A_it|)^alpha / sum_k (sum_t |A_kt|)^alpha, and its policy loss is
multiplied by the importance weight w_i = (N p_i)^-beta / max_k (N p_k)^-beta (the max
over the segments that can be drawn, so weights only scale updates down and are the
same for every minibatch of an update). beta goes from beta0 to 1 over training
(`annealed_beta`). With alpha = 0 minibatches are a plain uniform split without
replacement: each epoch visits every segment exactly once and every weight is exactly 1;
with alpha > 0 each minibatch draws its segments from p with replacement, so the
sampled frequencies are exactly p in expectation.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from sebulba.experience.replay import power_probabilities
from sebulba.types import PyTree


@dataclasses.dataclass(frozen=True)
class SegmentLayout:
    """How one update's trajectories are cut into segments and minibatches.

    Attributes:
      envs_per_shard: envs of a trajectory one learner device receives (E).
      steps_per_cycle: T, steps of a trajectory.
      horizon: H, steps of a segment; divides T.
      num_minibatches: M, minibatches per epoch on each learner device; divides E * T / H.
      num_shards: learner devices of all processes (each holds its own segments).
    """

    envs_per_shard: int
    steps_per_cycle: int
    horizon: int
    num_minibatches: int
    num_shards: int = 1

    @property
    def segments_per_env(self) -> int:
        return self.steps_per_cycle // self.horizon

    @property
    def num_segments(self) -> int:
        """Segments of one learner device per update (N)."""
        return self.envs_per_shard * self.segments_per_env

    @property
    def total_segments(self) -> int:
        """Segments of all learner devices per update."""
        return self.num_segments * self.num_shards

    @property
    def minibatch_size(self) -> int:
        return self.num_segments // self.num_minibatches


def segment_layout(
    envs_per_shard: int,
    steps_per_cycle: int,
    bptt_horizon: int,
    num_minibatches: int,
    num_shards: int = 1,
    expected_segments: int = 0,
    agents_per_env: int = 1,
) -> SegmentLayout:
    """Checks and returns the segment layout of a run.

    Args:
      envs_per_shard: envs per trajectory on one learner device.
      steps_per_cycle: T.
      bptt_horizon: H >= 1 dividing T; 0 means H = T (a segment per env per trajectory).
      num_minibatches: minibatches per epoch, must divide the segments of one device.
      num_shards: learner devices of all processes.
      expected_segments: if not 0, the segments per update (all devices) the caller
        sized for; it must equal what the envs produce exactly: slots = agents x
        segments per agent, where an agent is an env, or one of the K agents of a
        multi-agent env (`agents_per_env`; `envs_per_shard` then counts agent rows).

    Raises:
      ValueError: where the numbers do not fit, naming them.
    """
    horizon = bptt_horizon or steps_per_cycle
    if horizon < 1 or steps_per_cycle % horizon:
        raise ValueError(
            f"bptt_horizon={bptt_horizon} must divide steps_per_cycle={steps_per_cycle} "
            "(0 means the whole trajectory): a segment may not span two inference cycles")
    layout = SegmentLayout(envs_per_shard, steps_per_cycle, horizon, num_minibatches, num_shards)
    if expected_segments and expected_segments != layout.total_segments:
        if agents_per_env > 1:
            agents = envs_per_shard * num_shards
            empty = expected_segments - layout.total_segments
            what = (f"{empty:,} slots would stay empty" if empty > 0
                    else f"{-empty:,} segments would find no slot")
            raise ValueError(
                f"the buffer was sized for {expected_segments:,} segments, but "
                f"{agents // agents_per_env:,} envs x {agents_per_env} agents = {agents:,} "
                f"agents x {steps_per_cycle} steps / bptt_horizon={horizon} fill "
                f"{layout.total_segments:,} per update: {what}; sizes must match exactly "
                "(slots = agents x segments per agent)")
        raise ValueError(
            f"the buffer was sized for {expected_segments} segments, but the envs fill "
            f"{layout.total_segments} per update ({envs_per_shard} envs x {num_shards} "
            f"learner devices x {steps_per_cycle} steps / bptt_horizon={horizon}); sizes must "
            "match exactly so that no segment is left empty")
    if num_minibatches < 1 or layout.num_segments % num_minibatches:
        raise ValueError(
            f"num_minibatches={num_minibatches} must divide the {layout.num_segments} "
            f"segments of each learner device ({envs_per_shard} "
            f"{'agent rows' if agents_per_env > 1 else 'envs'} x {steps_per_cycle} "
            f"steps / bptt_horizon={horizon})")
    return layout


def to_segments(x: jax.Array, horizon: int) -> jax.Array:
    """Cuts per-env streams into segments.

    Args:
      x: [E, T, ...] with T a multiple of `horizon`.

    Returns:
      [E * T / H, H, ...]; segment i is env i // (T / H), chunk i % (T / H).
    """
    e, t = x.shape[:2]
    return x.reshape((e * (t // horizon), horizon) + x.shape[2:])


def group_by_env(x: jax.Array, agents_per_env: int, num_rows: int) -> jax.Array:
    """Reorders segments from `to_segments`' (row, chunk) order to (env, chunk, agent), so
    that the K agents of an env at one chunk are K adjacent segments.

    Args:
      x: [E x C, ...] segments (or segment starts) of E rows env-major, C chunks each.

    Returns:
      [E x C, ...]: entry ((e x C) + c) x K + j is agent j of env e, chunk c.
    """
    k, chunks = agents_per_env, x.shape[0] // num_rows
    y = x.reshape((num_rows // k, k, chunks) + x.shape[1:])
    return jnp.swapaxes(y, 1, 2).reshape(x.shape)


def segment_starts(x: PyTree, horizon: int) -> PyTree:
    """The entries at each segment's first step, e.g. the actor's recurrent state.

    Args:
      x: pytree with leaves [E, T, ...].

    Returns:
      leaves [E * T / H, ...]: entry t = 0, H, 2H, ... of each env, in segment order.
    """

    def starts(leaf):
        picked = leaf[:, ::horizon]  # [E, T / H, ...]
        return picked.reshape((-1,) + picked.shape[2:])

    return jax.tree.map(starts, x)


def segment_probabilities(advantages: jax.Array, alpha: float) -> jax.Array:
    """p_i proportional to (sum_t |A_it|)^alpha.

    Args:
      advantages: [N, H], 0 where an action carried no signal.
      alpha: >= 0; 0 gives the uniform 1 / N.

    Returns:
      [N] float32 probabilities summing to 1 (uniform if every segment's sum is 0).
    """
    return power_probabilities(jnp.sum(jnp.abs(advantages), axis=1), alpha)


def importance_weights(probabilities: jax.Array, beta: jax.Array | float) -> jax.Array:
    """w_i = (N p_i)^-beta / max_k (N p_k)^-beta over the segments with p_k > 0.

    Args:
      probabilities: [N] sampling probabilities.
      beta: scalar in [0, 1].

    Returns:
      [N] float32 in (0, 1]; 0 for segments that are never drawn. Exactly 1 everywhere
      when the probabilities are uniform.
    """
    n = probabilities.shape[0]
    drawable = probabilities > 0
    w = jnp.where(drawable, (n * jnp.where(drawable, probabilities, 1.0)) ** -beta, 0.0)
    return w / jnp.max(w)


def annealed_beta(beta0: float, updates: jax.Array, anneal_updates: int) -> jax.Array:
    """beta0 + (1 - beta0) * min(1, updates / anneal_updates): 1 once training is done.

    `anneal_updates` = 0 keeps beta at beta0.
    """
    if anneal_updates <= 0:
        return jnp.asarray(beta0, jnp.float32)
    frac = jnp.minimum(1.0, updates.astype(jnp.float32) / anneal_updates)
    return beta0 + (1.0 - beta0) * frac


class MinibatchPlan(NamedTuple):
    """Which segments each optimizer step of one update learns from.

    Attributes:
      indices: [K, B] int32 segment indices, K = epochs x minibatches, B = N / M.
      weights: [N] float32 importance weights of the segments.
      probabilities: [N] float32 sampling probabilities.
    """

    indices: jax.Array
    weights: jax.Array
    probabilities: jax.Array


def plan_minibatches(
    key: jax.Array,
    advantages: jax.Array,
    num_epochs: int,
    num_minibatches: int,
    alpha: float,
    beta: jax.Array | float,
    group_size: int = 1,
) -> MinibatchPlan:
    """Samples every minibatch of an update at once (one compiled call, no host loop).

    With `group_size` G > 1, segments [g x G, (g + 1) x G) form group g and are sampled
    together (adjacent, in order) with the group's summed priority: a minibatch then holds
    whole groups, e.g. the K agents of an env for a centralized value (`group_by_env`).

    Args:
      key: PRNG key.
      advantages: [N, H] segment advantages.
      num_epochs: passes over the segments; K = num_epochs * num_minibatches
        minibatches in all.
      num_minibatches: minibatches per epoch, of B = N / num_minibatches segments each.
      alpha: prioritization exponent; 0 splits a fresh permutation per epoch.
      beta: importance-weight exponent.
      group_size: G, segments sampled together as one group (1: each on its own).

    Returns:
      A MinibatchPlan.
    """
    if group_size > 1:
        n = advantages.shape[0]
        plan = plan_minibatches(key, advantages.reshape(n // group_size, -1), num_epochs,
                                num_minibatches, alpha, beta)
        members = jnp.arange(group_size, dtype=jnp.int32)
        indices = (plan.indices[..., None] * group_size + members).reshape(
            plan.indices.shape[0], -1)
        return MinibatchPlan(indices, jnp.repeat(plan.weights, group_size),
                             jnp.repeat(plan.probabilities, group_size) / group_size)
    n = advantages.shape[0]
    size = n // num_minibatches
    probabilities = segment_probabilities(advantages, alpha)
    keys = jax.random.split(key, num_epochs)
    if alpha == 0:
        order = jax.vmap(lambda k: jax.random.permutation(k, n))(keys)  # [epochs, N]
    else:
        order = jax.vmap(lambda k: jax.random.choice(
            k, n, (num_minibatches * size,), replace=True, p=probabilities))(keys)
    indices = order.reshape(num_epochs * num_minibatches, size).astype(jnp.int32)
    return MinibatchPlan(indices, importance_weights(probabilities, beta), probabilities)
