"""Replay of fixed capacity as a pure, jit-compatible pytree: prioritized or uniform.

What it is. A ring of C items (any pytree, e.g. one R2D2 sequence, stored with a leading
capacity axis) plus a priority per row. Inserting past C overwrites the oldest items.
Every function returns a new `Replay`; put it in an agent's experience state, which the
framework keeps once per learner device (and donates to its jitted functions, so the
writes below happen in place), to get one replay shard per learner device.

Prioritized sampling (`sample`): proportional prioritization (Schaul et al., 2016) as
R2D2 and Ape-X use it. Row i is drawn with probability

    P(i) = p_i^alpha / sum_k p_k^alpha       (over the rows held; a power, not a softmax)

with alpha = `priority_exponent`, fixed by `new_replay`, and its loss is weighted by the
importance weight w_i = (N P(i))^-beta / max_j w_j (N rows held, max over the batch), so
that weights only ever scale updates down. New items enter at the largest priority seen
so far (`max_priority`), so each is drawn soon after it arrives. A batch of B is drawn
stratified: the total mass is cut into B equal strata and one point is drawn uniformly in
each (as the PER paper does), so a batch spreads over the priority mass with less
variance than B independent draws. The strata are shuffled over the batch, so each draw
alone has probability exactly P(i) and the batch order carries no rank.

Uniform sampling (`sample_uniform`): every held row with probability 1/N, weights 1; it
ignores the priorities. A uniform replay is a `Replay` only ever sampled this way (no
`update_priorities` needed; `priority_exponent` does not matter). `sample` with
`priority_exponent=0` draws the same distribution, at the cost of the tree descent.

Sum tree. `tree` holds p_i^alpha of row i at leaf `L + i`, L the power of two >= C, and
each inner node n the sum of its children 2n and 2n + 1; node 1, the root, is the total
mass (node 0 and the leaves past C stay 0). Rows never written have mass 0, so they are
never drawn while any held row has mass. Each node is recomputed from its two children
(not updated by differences), so no rounding error accumulates over updates. Masses are
float32: a row whose mass is under ~1e-7 of the total is drawn with a relative error in
its probability.

Shapes and units: C = capacity, B = batch (static Python ints), L = 2^ceil(log2 C).
Priorities are non-negative float32 in the learner's units (e.g. R2D2's mixed absolute
TD error); probabilities are per draw; weights are dimensionless in (0, 1].

Costs per call, with D = log2 L tree levels (20 for C = 1M):
  - `insert` of B items: O(B D) for the tree, plus writing the B items.
  - `update_priorities` of B rows: O(B D).
  - `sample` of B: O(B D) (B descents of D levels at once), plus gathering B items.
  - `sample_uniform` of B: O(B), plus gathering B items.
  - `probabilities`: O(C), for inspection only.
  - memory: the items, plus 4C bytes of priorities and 8L bytes of tree.
Under `jax.jit` without donated arguments, XLA copies the arrays it writes (O(C)), so
donate the replay (as the framework's learner does) where the writes matter.
"""

from __future__ import annotations

from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp

from sebulba.types import PyTree


class Replay(NamedTuple):
    """A replay of capacity C (see the module docstring for the tree's layout).

    Attributes:
      items: pytree with leaves [C, ...]; rows >= size are zeros until first written.
      priorities: [C] float32 priorities p_i as given (not raised to alpha); 0 for rows
        never written.
      tree: [2L] float32 sum tree of p_i^alpha over the held rows, L the power of two
        >= C; `tree[1]` is the total mass.
      size: int32 scalar, rows holding an item (min(inserted, C)); rows [0, size) are
        the held ones.
      cursor: int32 scalar, the row the next insert writes first (the oldest item once
        the replay is full).
      max_priority: float32 scalar, the largest priority ever held (1 initially); new
        items enter with it.
      priority_exponent: float32 scalar alpha >= 0, fixed at construction.
    """

    items: PyTree
    priorities: jax.Array
    tree: jax.Array
    size: jax.Array
    cursor: jax.Array
    max_priority: jax.Array
    priority_exponent: jax.Array

    @property
    def capacity(self) -> int:
        """C, a static int."""
        return self.priorities.shape[0]

    @property
    def total_mass(self) -> jax.Array:
        """sum_i p_i^alpha over the held rows (float32 scalar, the tree's root)."""
        return self.tree[1]


class Sample(NamedTuple):
    """What `sample` and `sample_uniform` draw: B rows with replacement.

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


def _leaves(capacity: int) -> int:
    """L: the power of two >= capacity (the tree's leaf count)."""
    return 1 << (capacity - 1).bit_length()


def _depth(replay: Replay) -> int:
    """D = log2 L, the levels between the root and the leaves."""
    return (replay.tree.shape[0] // 2).bit_length() - 1


def new_replay(example_item: PyTree, capacity: int, *, priority_exponent: float) -> Replay:
    """An empty replay for items shaped like `example_item` (arrays or shape structs).

    Args:
      example_item: one item (no capacity axis); only shapes and dtypes are used.
      capacity: C >= 1 rows.
      priority_exponent: alpha >= 0 of P(i) proportional to p_i^alpha for `sample`; 0
        samples uniformly over the held rows. Fixed for the replay's life because the
        sum tree stores p_i^alpha.
    """
    if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1:
        raise ValueError(f"capacity must be an int >= 1, got {capacity!r}")
    if not priority_exponent >= 0:  # also rejects NaN
        raise ValueError(f"priority_exponent must be >= 0, got {priority_exponent!r}")
    items = jax.tree.map(
        lambda x: jnp.zeros((capacity,) + tuple(x.shape), x.dtype), example_item)
    return Replay(
        items=items,
        priorities=jnp.zeros((capacity,), jnp.float32),
        tree=jnp.zeros((2 * _leaves(capacity),), jnp.float32),
        size=jnp.zeros((), jnp.int32),
        cursor=jnp.zeros((), jnp.int32),
        max_priority=jnp.ones((), jnp.float32),
        priority_exponent=jnp.asarray(priority_exponent, jnp.float32),
    )


def _write_leaves(replay: Replay, rows: jax.Array, priorities: jax.Array,
                  size: jax.Array) -> jax.Array:
    """The tree with rows' leaves set from `priorities` [C] and their ancestors redone.

    `rows` [B] may repeat; rows outside [0, C) are dropped. Each leaf is read back from
    the already written `priorities`, so a repeated row gets the same value in both
    whichever of its writes won there.
    """
    capacity = replay.capacity
    half = replay.tree.shape[0] // 2
    in_range = (rows >= 0) & (rows < capacity)
    safe = jnp.where(in_range, rows, 0)
    p = priorities[safe]
    # Rows beyond size hold no item: mass 0, even for alpha = 0 (where 0^0 would be 1).
    mass = jnp.where(safe < size, p ** replay.priority_exponent, 0.0)
    nodes = jnp.where(in_range, safe + half, 2 * half)  # out of bounds: dropped
    tree = replay.tree.at[nodes].set(mass, mode="drop")
    # Level by level up to the root; duplicates (and the dropped rows, sent to row 0,
    # whose ancestors are already consistent) recompute a node to the same sum.
    nodes = safe + half
    for _ in range(_depth(replay)):
        nodes = nodes // 2
        tree = tree.at[nodes].set(tree[2 * nodes] + tree[2 * nodes + 1])
    return tree


def insert(replay: Replay, items: PyTree, mask: jax.Array | None = None) -> Replay:
    """Writes the rows of `items` (leaves [B, ...]) where `mask` [B] is set.

    The written rows go to consecutive positions from `cursor`, wrapping around, in
    order; they enter with priority `max_priority`. B must not exceed the capacity (a
    batch would overwrite itself). O(B log C).
    """
    leaves = jax.tree.leaves(items)
    if not leaves:
        raise ValueError("items has no arrays")
    batch = leaves[0].shape[0]
    if batch > replay.capacity:
        raise ValueError(
            f"cannot insert {batch} items at once into a replay of capacity {replay.capacity}")
    # Same structure, one leading batch axis, the stored item shapes after it.
    jax.tree.map(lambda s, x: chex.assert_shape(x, (batch,) + s.shape[1:]), replay.items,
                 items)
    mask = jnp.ones((batch,), bool) if mask is None else mask.astype(bool)
    chex.assert_shape(mask, (batch,))
    offsets = jnp.cumsum(mask) - 1  # position of each written row among the written
    rows = (replay.cursor + offsets) % replay.capacity
    rows = jnp.where(mask, rows, replay.capacity)  # out of bounds: dropped by the scatter
    count = jnp.sum(mask, dtype=jnp.int32)
    size = jnp.minimum(replay.size + count, replay.capacity)

    def write(store, new):
        return store.at[rows].set(new.astype(store.dtype), mode="drop")

    priorities = replay.priorities.at[rows].set(replay.max_priority, mode="drop")
    return replay._replace(
        items=jax.tree.map(write, replay.items, items),
        priorities=priorities,
        tree=_write_leaves(replay, rows, priorities, size),
        size=size,
        cursor=(replay.cursor + count) % replay.capacity,
    )


def update_priorities(replay: Replay, indices: jax.Array, priorities: jax.Array) -> Replay:
    """Sets the priorities [B] (>= 0) of rows `indices` [B] in [0, C) (others are dropped)
    and raises `max_priority` to those of held rows.

    A row given twice in one batch gets one of its values, the same in `priorities` and
    in the tree (a sampled batch's repeats come from the same networks and data, so they
    agree). Rows not held keep mass 0 in the tree until inserted. A negative, infinite or
    NaN priority counts as 0 (its row is not drawn until updated again): in the tree's sums it
    would make the total NaN, which `sample` cannot tell from an empty tree, and in
    `max_priority` every later insert's. O(B log C).
    """
    chex.assert_rank(indices, 1)
    chex.assert_type(indices, int)
    chex.assert_shape(priorities, indices.shape)
    priorities = priorities.astype(jnp.float32)
    # NaN >= 0 is false too; an infinite one would make the total (and max_priority) inf.
    priorities = jnp.where((priorities >= 0) & jnp.isfinite(priorities), priorities, 0.0)
    # Out-of-range rows are dropped here as in the tree (a negative index would wrap).
    rows = jnp.where((indices >= 0) & (indices < replay.capacity), indices, replay.capacity)
    written = replay.priorities.at[rows].set(priorities, mode="drop")
    max_priority = replay.max_priority
    if indices.shape[0]:  # only rows that hold an item: a dropped row's value is no one's
        held = (indices >= 0) & (indices < replay.size)
        max_priority = jnp.maximum(max_priority, jnp.max(jnp.where(held, priorities, 0.0)))
    return replay._replace(
        priorities=written,
        tree=_write_leaves(replay, rows, written, replay.size),
        max_priority=max_priority,
    )


def power_probabilities(
    priorities: jax.Array, alpha: float, valid: jax.Array | None = None
) -> jax.Array:
    """P(i) = p_i^alpha / sum_k p_k^alpha over the valid rows (shared with segment sampling).

    O(N); the replay's sampling uses its sum tree instead.

    Args:
      priorities: [N] >= 0.
      alpha: >= 0; 0 is uniform over the valid rows.
      valid: [N] bool, or None for all rows. Invalid rows get 0 even for alpha = 0
        (where 0^0 would be 1).

    Returns:
      [N] probabilities summing to 1; uniform over all N rows if no valid row has weight.
    """
    chex.assert_rank(priorities, 1)
    p = priorities.astype(jnp.float32)
    # In log space, shifted by the largest: p^alpha itself overflows float32 for large
    # sums of |advantage| and exponents (1e4^10), and inf / inf is NaN.
    positive = p > 0
    logits = jnp.where(positive, alpha * jnp.log(jnp.where(positive, p, 1.0)),
                       jnp.where(jnp.asarray(alpha) == 0, 0.0, -jnp.inf))  # 0^0 = 1
    if valid is not None:
        chex.assert_shape(valid, priorities.shape)
        logits = jnp.where(valid, logits, -jnp.inf)
    top = jnp.max(logits)
    weighted = top > -jnp.inf
    powered = jnp.exp(logits - jnp.where(weighted, top, 0.0))
    uniform = jnp.full_like(powered, 1.0 / powered.shape[0])
    return jnp.where(weighted, powered / jnp.sum(powered), uniform)


def probabilities(replay: Replay) -> jax.Array:
    """[C] P(i) of one `sample` draw, from the tree's leaves. O(C): for inspection.

    Uniform over the held rows while their total mass is 0 (as `sample` then draws), and
    all on row 0 while the replay is empty (`sample` then draws row 0, which holds zeros).
    """
    half = replay.tree.shape[0] // 2
    mass = replay.tree[half:half + replay.capacity]
    total = replay.total_mass
    rows = jnp.arange(replay.capacity) < jnp.maximum(replay.size, 1)
    uniform = rows / jnp.sum(rows, dtype=jnp.float32)
    return jnp.where(total > 0, mass / jnp.where(total > 0, total, 1.0), uniform)


def _descend(tree: jax.Array, target: jax.Array) -> jax.Array:
    """[B] leaf positions (rows) where the cumulative mass passes `target` [B].

    Goes right when the target lies at or past the left child's mass, and only if the
    right child has mass: rounding can put a target at or past a node's mass (the last
    stratum's may equal the total), and this way a descent from a node with mass always
    ends on a leaf with mass. With no mass at all it ends on row 0.
    """
    half = tree.shape[0] // 2
    node = jnp.ones(target.shape, jnp.int32)
    for _ in range(half.bit_length() - 1):
        left = tree[2 * node]
        go_right = (target >= left) & (tree[2 * node + 1] > 0)
        target = jnp.where(go_right, target - left, target)
        node = 2 * node + go_right.astype(jnp.int32)
    return node - half


def _check_batch_size(batch_size: int) -> None:
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ValueError(f"batch_size must be a static int >= 1, got {batch_size!r}")


def _gather(replay: Replay, indices: jax.Array) -> PyTree:
    return jax.tree.map(lambda x: x[indices], replay.items)


def sample(replay: Replay, key: jax.Array, batch_size: int, beta: float | jax.Array) -> Sample:
    """Draws `batch_size` rows with replacement by P(i), with their importance weights.

    Stratified (one draw per 1/B of the total mass, in shuffled order) by descending the
    sum tree for the B draws at once: O(B log C). Rows not held are never drawn. While
    the held rows' total mass is 0 (an empty replay, or every priority 0 with alpha > 0)
    the draw is uniform over the held rows, weights 1; an empty replay gives row 0's
    zeros, so a learner may run (and mask) its loss before the replay holds enough.

    Args:
      replay: the replay.
      key: a PRNG key.
      batch_size: B, a static int.
      beta: importance exponent >= 0 (0: all weights 1).
    """
    _check_batch_size(batch_size)
    half = replay.tree.shape[0] // 2
    total = replay.total_mass
    strata_key, offset_key, uniform_key = jax.random.split(key, 3)
    strata = jax.random.permutation(strata_key, batch_size)
    offsets = jax.random.uniform(offset_key, (batch_size,))
    target = (strata + offsets) * (total / batch_size)  # [B] in [0, total]
    indices = _descend(replay.tree, target)  # rows < C: the leaves past C have no mass
    n = jnp.maximum(replay.size, 1)
    has_mass = total > 0
    fallback = jax.random.randint(uniform_key, (batch_size,), 0, n, jnp.int32)
    indices = jnp.where(has_mass, indices, fallback)
    p = jnp.where(has_mass, replay.tree[indices + half] / jnp.where(has_mass, total, 1.0),
                  1.0 / n.astype(jnp.float32))
    weights = (n.astype(jnp.float32) * p) ** (-jnp.asarray(beta, jnp.float32))
    weights = weights / jnp.max(weights)
    return Sample(indices, _gather(replay, indices), p, weights)


def sample_uniform(replay: Replay, key: jax.Array, batch_size: int) -> Sample:
    """Draws `batch_size` rows uniformly with replacement from the held rows. O(B).

    Ignores priorities: probabilities are 1/N and weights 1. An empty replay gives row
    0's zeros (probability 1, weight 1).
    """
    _check_batch_size(batch_size)
    n = jnp.maximum(replay.size, 1)
    indices = jax.random.randint(key, (batch_size,), 0, n, jnp.int32)
    p = jnp.full((batch_size,), 1.0, jnp.float32) / n.astype(jnp.float32)
    return Sample(indices, _gather(replay, indices), p, jnp.ones((batch_size,), jnp.float32))
