"""Prioritized replay of fixed capacity as a pure, jit-compatible pytree.

Proportional prioritization (Schaul et al., 2016) as R2D2 and Ape-X use it: item i is
sampled with probability P(i) = p_i^alpha / sum_k p_k^alpha over the items held (a power
of the priorities, not a softmax), and its loss is weighted by the importance weight
w_i = (N P(i))^-beta / max_j w_j, normalised by the largest weight of the sampled batch
so that weights only ever scale updates down. New items enter at the largest priority
seen so far, so each is sampled soon after it arrives.

An item is any pytree (e.g. one R2D2 sequence); the replay stores it with a leading
capacity axis C. Inserting past C overwrites the oldest items (a ring). Every function
returns a new `Replay`; put it in an agent's experience state, which the framework keeps
once per learner device, to get one replay shard per learner device. Sampling is O(C)
per batch (a cumulative sum), which is cheap next to a learner step for the capacities
one device holds; a sum tree would make it O(B log C).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from sebulba.types import PyTree


class Replay(NamedTuple):
    """A replay of capacity C.

    Attributes:
      items: pytree with leaves [C, ...]; rows >= size are zeros until first written.
      priorities: [C] float32, 0 for rows never written.
      size: int32 scalar, rows holding an item (min(inserted, C)).
      cursor: int32 scalar, the row the next insert writes first (the oldest item once
        the replay is full).
      max_priority: float32 scalar, the largest priority ever held (1 initially); new
        items enter with it.
    """

    items: PyTree
    priorities: jax.Array
    size: jax.Array
    cursor: jax.Array
    max_priority: jax.Array

    @property
    def capacity(self) -> int:
        return self.priorities.shape[0]


class Sample(NamedTuple):
    """What `sample` draws: B items with replacement.

    Attributes:
      indices: [B] int32 rows, for `update_priorities`.
      items: pytree with leaves [B, ...].
      probabilities: [B] float32, P(i) of each draw.
      weights: [B] float32 importance weights (N P(i))^-beta / max over the batch.
    """

    indices: jax.Array
    items: PyTree
    probabilities: jax.Array
    weights: jax.Array


def new_replay(example_item: PyTree, capacity: int) -> Replay:
    """An empty replay for items shaped like `example_item` (arrays or shape structs)."""
    if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1:
        raise ValueError(f"capacity must be an int >= 1, got {capacity!r}")
    items = jax.tree.map(
        lambda x: jnp.zeros((capacity,) + tuple(x.shape), x.dtype), example_item)
    return Replay(
        items=items,
        priorities=jnp.zeros((capacity,), jnp.float32),
        size=jnp.zeros((), jnp.int32),
        cursor=jnp.zeros((), jnp.int32),
        max_priority=jnp.ones((), jnp.float32),
    )


def insert(replay: Replay, items: PyTree, mask: jax.Array | None = None) -> Replay:
    """Writes the rows of `items` (leaves [B, ...]) where `mask` [B] is set.

    The written rows go to consecutive positions from `cursor`, wrapping around, in
    order; they enter with priority `max_priority`. B must not exceed the capacity (a
    batch would overwrite itself).
    """
    batch = jax.tree.leaves(items)[0].shape[0]
    if batch > replay.capacity:
        raise ValueError(
            f"cannot insert {batch} items at once into a replay of capacity {replay.capacity}")
    mask = jnp.ones((batch,), bool) if mask is None else mask.astype(bool)
    offsets = jnp.cumsum(mask) - 1  # position of each written row among the written
    rows = (replay.cursor + offsets) % replay.capacity
    rows = jnp.where(mask, rows, replay.capacity)  # out of bounds: dropped by the scatter
    count = jnp.sum(mask, dtype=jnp.int32)

    def write(store, new):
        return store.at[rows].set(new.astype(store.dtype), mode="drop")

    return Replay(
        items=jax.tree.map(write, replay.items, items),
        priorities=replay.priorities.at[rows].set(replay.max_priority, mode="drop"),
        size=jnp.minimum(replay.size + count, replay.capacity),
        cursor=(replay.cursor + count) % replay.capacity,
        max_priority=replay.max_priority,
    )


def power_probabilities(
    priorities: jax.Array, alpha: float, valid: jax.Array | None = None
) -> jax.Array:
    """P(i) = p_i^alpha / sum_k p_k^alpha over the valid rows (shared with segment sampling).

    Args:
      priorities: [N] >= 0.
      alpha: >= 0; 0 is uniform over the valid rows.
      valid: [N] bool, or None for all rows. Invalid rows get 0 even for alpha = 0
        (where 0^0 would be 1).
    Returns:
      [N] probabilities summing to 1; uniform over all N rows if no valid row has weight.
    """
    powered = priorities.astype(jnp.float32) ** alpha
    if valid is not None:
        powered = jnp.where(valid, powered, 0.0)
    total = jnp.sum(powered)
    uniform = jnp.full_like(powered, 1.0 / powered.shape[0])
    return jnp.where(total > 0, powered / jnp.where(total > 0, total, 1.0), uniform)


def probabilities(replay: Replay, alpha: float) -> jax.Array:
    """[C] P(i) = p_i^alpha / sum p^alpha over held rows; uniform over all rows while empty."""
    return power_probabilities(
        replay.priorities, alpha, jnp.arange(replay.capacity) < replay.size)


def sample(replay: Replay, key: jax.Array, batch_size: int, alpha: float,
           beta: float) -> Sample:
    """Draws `batch_size` rows with replacement by P(i), with their importance weights.

    Sampling an empty replay returns zero items with finite weights, so a learner may
    run (and mask) its loss before the replay holds enough.
    """
    probs = probabilities(replay, alpha)
    indices = jax.random.choice(key, replay.capacity, (batch_size,), p=probs)
    p = probs[indices]
    n = jnp.maximum(replay.size, 1).astype(jnp.float32)
    weights = (n * p) ** (-beta)
    weights = weights / jnp.max(weights)
    items = jax.tree.map(lambda x: x[indices], replay.items)
    return Sample(indices.astype(jnp.int32), items, p, weights)


def update_priorities(replay: Replay, indices: jax.Array, priorities: jax.Array) -> Replay:
    """Sets the priorities [B] of rows `indices` [B] and raises `max_priority` to them.

    A row drawn twice in one batch gets one of its two values (both come from the same
    networks and data, so they agree).
    """
    priorities = priorities.astype(jnp.float32)
    return replay._replace(
        priorities=replay.priorities.at[indices].set(priorities),
        max_priority=jnp.maximum(replay.max_priority, jnp.max(priorities)),
    )
