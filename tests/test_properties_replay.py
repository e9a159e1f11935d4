"""The sum-tree replay against a brute-force model over random schedules of inserts
(random masks, wrapping around) and priority updates (repeated rows, rows not held, zero
priorities), for random priority exponents; then its sampling frequencies against
P(i) = p_i^alpha / sum_k p_k^alpha over the held rows.

Shapes are fixed (capacity 13, batches of 4, draws of 4,096), so the compiled functions
are built once; hypothesis varies the values and the schedule.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from sebulba.experience import replay as rp
from tests import brute_force as bf
from tests.test_replay import ITEM, assert_tree_consistent, items

CAPACITY, BATCH, DRAWS, SMALL_BATCH = 13, 4, 4096, 8  # 13 rows: 16 leaves, 3 never used
insert_jit = jax.jit(rp.insert)
update_jit = jax.jit(rp.update_priorities)
sample_jit = jax.jit(rp.sample, static_argnums=2)
sample_many = jax.jit(jax.vmap(rp.sample, in_axes=(None, 0, None, None)), static_argnums=2)

PRIORITY = st.just(0.0) | st.floats(0.0078125, 128.0, width=32)  # 2^-7 to 2^7
INSERT = st.tuples(st.just("insert"), st.lists(st.booleans(), min_size=BATCH,
                                               max_size=BATCH))
UPDATE = st.tuples(st.just("update"), st.lists(
    st.tuples(st.integers(0, CAPACITY - 1), PRIORITY), min_size=BATCH, max_size=BATCH))
SCHEDULE = st.lists(INSERT | UPDATE, min_size=1, max_size=12)
# The replay keeps alpha in float32: 1e-137 would be 0 there (and 0^0 = 1: uniform).
ALPHA = st.sampled_from([0.0, 0.5, 0.9, 1.0]) | st.floats(0.0, 1.5, **bf.FINITE)


@dataclasses.dataclass
class Model:
    """What the replay should hold, row by row."""

    alpha: float
    priorities: np.ndarray = dataclasses.field(
        default_factory=lambda: np.zeros(CAPACITY, np.float64))
    ids: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(CAPACITY, np.int64))
    size: int = 0
    cursor: int = 0
    max_priority: float = 1.0
    next_id: int = 0

    def insert(self, mask: list[bool]) -> np.ndarray:
        """Writes the masked items of the next batch of ids; returns the batch's ids."""
        ids = np.arange(self.next_id, self.next_id + BATCH)
        self.next_id += BATCH
        for i in ids[np.asarray(mask, bool)]:
            self.priorities[self.cursor], self.ids[self.cursor] = self.max_priority, i
            self.cursor = (self.cursor + 1) % CAPACITY
            self.size = min(self.size + 1, CAPACITY)
        return ids

    def update(self, rows_values: list[tuple[int, float]], held: np.ndarray) -> None:
        """Sets each row to the value the replay kept, which must be one of those given."""
        for row in {r for r, _ in rows_values}:
            given_values = [np.float32(v) for r, v in rows_values if r == row]
            assert held[row] in given_values, (row, held[row], given_values)
            self.priorities[row] = held[row]
        # Only rows that hold an item raise it (a value for an empty row is no one's).
        self.max_priority = max([self.max_priority, *(
            float(np.float32(v)) for r, v in rows_values if r < self.size)])

    def probabilities(self) -> np.ndarray:
        """P(i) over the held rows (uniform over them if their mass is 0)."""
        mass = np.zeros(CAPACITY)
        mass[:self.size] = self.priorities[:self.size] ** self.alpha  # 0^0 = 1: uniform
        if mass.sum() == 0:
            mass[:self.size] = 1.0
        return mass / mass.sum()


def play(alpha: float, schedule) -> tuple[rp.Replay, Model]:
    replay = rp.new_replay(ITEM, CAPACITY, priority_exponent=alpha)
    model = Model(alpha)
    for op, args in [INSERT_FIRST, *schedule]:
        if op == "insert":
            ids = model.insert(args)
            replay = insert_jit(replay, items(ids), jnp.asarray(args))
        else:
            rows, values = zip(*args, strict=True)
            replay = update_jit(replay, jnp.asarray(rows, jnp.int32),
                                jnp.asarray(values, jnp.float32))
            model.update(args, np.asarray(replay.priorities))
    return replay, model


INSERT_FIRST = ("insert", [True] * BATCH)  # no replay is sampled empty here


@pytest.mark.timeout(120)
@bf.examples(30)
@given(alpha=ALPHA,
       schedule=SCHEDULE)
def test_random_inserts_and_updates_keep_the_model(alpha, schedule):
    replay, model = play(alpha, schedule)
    assert (int(replay.size), int(replay.cursor)) == (model.size, model.cursor)
    assert float(replay.max_priority) == pytest.approx(model.max_priority, rel=1e-6)
    np.testing.assert_array_equal(np.asarray(replay.items["id"])[:model.size],
                                  model.ids[:model.size])
    np.testing.assert_allclose(np.asarray(replay.priorities), model.priorities, rtol=1e-6)
    assert_tree_consistent(replay)
    np.testing.assert_allclose(np.asarray(rp.probabilities(replay)), model.probabilities(),
                               rtol=1e-5, atol=1e-7)


@pytest.mark.timeout(120)
@bf.examples(25)
@given(alpha=ALPHA,
       schedule=SCHEDULE, seed=st.integers(0, 2**31 - 1), beta=st.floats(0.0, 1.0))
def test_sampling_frequencies_follow_the_priorities(alpha, schedule, seed, beta):
    replay, model = play(alpha, schedule)
    p = model.probabilities()
    key_one, key_many = jax.random.split(jax.random.key(seed))
    s = sample_jit(replay, key_one, DRAWS, beta)
    indices = np.asarray(s.indices)
    counts = np.bincount(indices, minlength=CAPACITY)
    assert counts[p == 0].sum() == 0  # rows not held, zero priorities with alpha > 0
    np.testing.assert_allclose(np.asarray(s.probabilities), p[indices], rtol=1e-4)
    raw = (model.size * p[indices]) ** -beta
    np.testing.assert_allclose(np.asarray(s.weights), raw / raw.max(), rtol=1e-4)
    mass = model.priorities[:model.size] ** alpha
    if mass.sum() > 0:
        # One draw per 1/DRAWS of the mass: row i gets DRAWS x P(i) draws, give or take
        # the two strata its mass begins and ends in.
        assert np.all(np.abs(counts - DRAWS * p) <= 2.5), (counts, DRAWS * p)
    # Independent batches: each draw alone has probability P(i).
    many = sample_many(replay, jax.random.split(key_many, DRAWS // SMALL_BATCH),
                       SMALL_BATCH, beta)
    assert_frequencies(np.bincount(np.asarray(many.indices).ravel(), minlength=CAPACITY),
                       DRAWS * p)


def assert_frequencies(counts: np.ndarray, expected: np.ndarray) -> None:
    """Pearson's statistic over the rows expected 5 times or more, against a bound its
    chi-square law (at most 12 degrees of freedom) exceeds with probability below 1e-9;
    the rarer rows pooled, within 6 Poisson standard deviations (plus 3) of their sum;
    never a row that cannot be drawn."""
    assert counts[expected == 0].sum() == 0
    common = expected >= 5
    chi2 = np.sum((counts[common] - expected[common]) ** 2 / expected[common])
    assert chi2 < 70, (chi2, counts, expected)
    rare_count, rare = counts[~common].sum(), expected[~common].sum()
    assert abs(rare_count - rare) <= 6 * np.sqrt(rare) + 3, (counts, expected)
