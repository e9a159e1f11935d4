"""Replay: p^alpha sampling by sum tree, importance weights, uniform sampling, ring
insertion, priorities, the tree's consistency, empty replays and jit."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sebulba.experience import replay as rp

ITEM = {"x": jnp.zeros((2,), jnp.float32), "id": jnp.zeros((), jnp.int32)}


def items(ids) -> dict:
    ids = jnp.asarray(ids, jnp.int32)
    return {"x": jnp.stack([ids, -ids], 1).astype(jnp.float32), "id": ids}


def filled(priorities, alpha=0.9, capacity=None) -> rp.Replay:
    n = len(priorities)
    replay = rp.new_replay(ITEM, capacity or n, priority_exponent=alpha)
    replay = rp.insert(replay, items(np.arange(n)))
    return rp.update_priorities(replay, jnp.arange(n), jnp.asarray(priorities, jnp.float32))


def assert_tree_consistent(replay: rp.Replay) -> None:
    """Leaves are p^alpha of the held rows (0 elsewhere); each inner node sums its children."""
    tree = np.asarray(replay.tree, np.float64)
    half = len(tree) // 2
    alpha, size = float(replay.priority_exponent), int(replay.size)
    expected = np.zeros(half)
    expected[:size] = np.asarray(replay.priorities[:size], np.float64) ** alpha
    np.testing.assert_allclose(tree[half:], expected, rtol=1e-6)
    nodes = np.arange(1, half)
    np.testing.assert_allclose(tree[nodes], tree[2 * nodes] + tree[2 * nodes + 1], rtol=1e-6)
    np.testing.assert_allclose(tree[1], expected.sum(), rtol=1e-5)
    assert tree[0] == 0


sample_jit = jax.jit(rp.sample, static_argnums=2)


@pytest.mark.timeout(120)
def test_sampling_frequencies_follow_priorities_to_the_alpha():
    priorities = np.array([0.25, 1.0, 4.0, 16.0, 64.0, 0.0])
    alpha, draws = 0.9, 200_000
    s = sample_jit(filled(priorities, alpha), jax.random.key(0), draws, 0.6)
    freq = np.bincount(np.asarray(s.indices), minlength=len(priorities)) / draws
    expected = priorities**alpha / np.sum(priorities**alpha)
    # 5 standard deviations of an independent draw's frequency (stratified draws vary
    # less); p (alpha = 1) is off by 0.037 at the top and a softmax by far more, so
    # either mistake fails.
    tolerance = 5 * np.sqrt(expected * (1 - expected) / draws) + 1e-9
    np.testing.assert_array_less(np.abs(freq - expected), tolerance)
    assert np.abs(freq[4] - priorities[4] / priorities.sum()) > 3 * tolerance[4]
    assert freq[5] == 0.0  # a zero priority is never drawn
    np.testing.assert_allclose(s.probabilities, expected[np.asarray(s.indices)], rtol=1e-5)


@pytest.mark.timeout(120)
def test_frequencies_over_a_partly_filled_replay_pass_a_chi_square_test():
    capacity, held, alpha, draws = 1000, 700, 0.6, 200_000  # 1000 rows: 1024 leaves
    priorities = np.random.default_rng(0).uniform(0.01, 10.0, held)
    replay = filled(priorities, alpha, capacity)
    s = sample_jit(replay, jax.random.key(3), draws, 0.4)
    counts = np.bincount(np.asarray(s.indices), minlength=capacity)
    assert counts[held:].sum() == 0  # never a row not held
    expected = draws * priorities**alpha / np.sum(priorities**alpha)
    chi2 = np.sum((counts[:held] - expected) ** 2 / expected)
    dof = held - 1
    assert chi2 < dof + 6 * np.sqrt(2 * dof), chi2
    np.testing.assert_allclose(rp.probabilities(replay)[:held], expected / draws, rtol=1e-5)
    assert float(jnp.sum(rp.probabilities(replay))) == pytest.approx(1.0, rel=1e-5)


@pytest.mark.timeout(120)
def test_draws_are_stratified_over_the_total_mass():
    # Masses 1 : 3 and 4 draws: one draw per quarter of the mass, so exactly 1 and 3.
    replay = filled([1.0, 3.0], alpha=1.0)
    for seed in range(20):
        s = sample_jit(replay, jax.random.key(seed), 4, 0.0)
        np.testing.assert_array_equal(np.bincount(np.asarray(s.indices), minlength=2), [1, 3])
    # Shuffled strata: the batch is not sorted by row.
    s = rp.sample(filled(np.ones(64), alpha=1.0), jax.random.key(0), 64, 0.0)
    assert not np.all(np.diff(np.asarray(s.indices)) >= 0)


@pytest.mark.timeout(120)
def test_importance_weights_are_n_p_to_minus_beta_normalised_by_the_batch_max():
    priorities = np.array([0.5, 1.0, 2.0, 4.0, 8.0])
    alpha, beta = 0.9, 0.6
    s = rp.sample(filled(priorities, alpha), jax.random.key(1), 64, beta)
    probs = priorities**alpha / np.sum(priorities**alpha)
    raw = (len(priorities) * probs[np.asarray(s.indices)]) ** (-beta)
    np.testing.assert_allclose(s.weights, raw / raw.max(), rtol=1e-5)
    assert np.max(s.weights) == pytest.approx(1.0)
    assert np.min(s.weights) < 0.9  # not all ones: the rarer draws weigh more
    items_drawn = jax.tree.map(np.asarray, s.items)
    np.testing.assert_array_equal(items_drawn["id"], s.indices)
    assert s.indices.dtype == jnp.int32 and s.weights.dtype == jnp.float32


@pytest.mark.timeout(120)
def test_insert_wraps_around_and_overwrites_the_oldest():
    replay = rp.new_replay(ITEM, 5, priority_exponent=0.5)
    replay = jax.jit(rp.insert)(replay, items([10, 11, 12]))
    assert int(replay.size) == 3 and int(replay.cursor) == 3
    replay = rp.update_priorities(replay, jnp.arange(3), jnp.array([0.25, 4.0, 9.0]))
    replay = jax.jit(rp.insert)(replay, items([13, 14, 15, 16]))
    # Rows 3, 4 then 0, 1: 10 and 11 were the oldest.
    np.testing.assert_array_equal(replay.items["id"], [15, 16, 12, 13, 14])
    np.testing.assert_array_equal(replay.items["x"][:, 1], [-15, -16, -12, -13, -14])
    assert int(replay.size) == 5 and int(replay.cursor) == 2
    # Overwritten rows enter at the max priority, in the tree as well.
    np.testing.assert_allclose(replay.priorities, [9.0, 9.0, 9.0, 9.0, 9.0])
    assert_tree_consistent(replay)
    replay = rp.insert(replay, items([17, 18, 19, 20, 21]))  # a whole capacity at once
    np.testing.assert_array_equal(replay.items["id"], [20, 21, 17, 18, 19])
    assert int(replay.cursor) == 2
    assert_tree_consistent(replay)
    with pytest.raises(ValueError, match="cannot insert 6 items at once into a replay of "
                                         "capacity 5"):
        rp.insert(replay, items(np.arange(6)))
    with pytest.raises(AssertionError):  # an item of the wrong shape
        rp.insert(replay, {"x": jnp.zeros((2, 3)), "id": jnp.zeros((2,), jnp.int32)})


@pytest.mark.timeout(120)
def test_masked_insert_writes_only_the_selected_rows_consecutively():
    replay = rp.new_replay(ITEM, 4, priority_exponent=0.9)
    replay = rp.insert(replay, items([1, 2, 3]), jnp.array([True, False, True]))
    np.testing.assert_array_equal(replay.items["id"], [1, 3, 0, 0])
    np.testing.assert_array_equal(replay.priorities, [1, 1, 0, 0])
    assert int(replay.size) == 2 and int(replay.cursor) == 2
    assert_tree_consistent(replay)
    assert float(replay.total_mass) == 2.0


@pytest.mark.timeout(120)
def test_new_items_enter_at_the_max_priority_and_priorities_update():
    replay = filled([0.5, 3.0, 2.0])
    assert float(replay.max_priority) == 3.0
    replay = rp.update_priorities(replay, jnp.array([1]), jnp.array([0.25]))
    np.testing.assert_allclose(replay.priorities, [0.5, 0.25, 2.0])
    assert float(replay.max_priority) == 3.0  # the largest ever seen, not the current
    assert_tree_consistent(replay)
    bigger = rp.new_replay(ITEM, 4, priority_exponent=0.9)
    bigger = rp.update_priorities(rp.insert(bigger, items([0, 1])), jnp.array([0]),
                                  jnp.array([7.0]))
    bigger = rp.insert(bigger, items([2]))
    np.testing.assert_allclose(bigger.priorities, [7.0, 1.0, 7.0, 0.0])
    assert_tree_consistent(bigger)


@pytest.mark.timeout(120)
def test_only_held_rows_raise_the_max_priority():
    replay = filled([0.5, 1.0], capacity=8)
    # Row 8 is dropped (out of range), row 5 holds no item yet: neither is anyone's.
    replay = rp.update_priorities(replay, jnp.array([0, 8, 5]), jnp.array([2.0, 1e6, 1e5]))
    assert float(replay.max_priority) == 2.0
    replay = rp.insert(replay, items([7]))
    np.testing.assert_allclose(replay.priorities[:3], [2.0, 1.0, 2.0])
    assert_tree_consistent(replay)


@pytest.mark.timeout(120)
def test_negative_infinite_or_nan_priorities_count_as_zero_and_leave_the_rest_prioritized():
    replay = filled([1.0] * 8, capacity=8)
    replay = rp.update_priorities(replay, jnp.arange(8), jnp.array(
        [100.0, 1e-3, 1e-3, 1e-3, 1e-3, jnp.inf, -1e-6, jnp.nan]))
    np.testing.assert_array_equal(replay.priorities[5:], [0.0, 0.0, 0.0])
    assert float(replay.max_priority) == 100.0 and np.isfinite(float(replay.total_mass))
    assert_tree_consistent(replay)
    s = rp.sample(replay, jax.random.key(0), 64, 0.5)
    assert np.mean(np.asarray(s.indices) == 0) > 0.9  # still prioritized, not uniform
    assert not np.isin(np.asarray(s.indices), [5, 6, 7]).any()
    replay = rp.insert(replay, items([9]))  # enters at a finite max priority
    assert float(replay.priorities[0]) == 100.0


@pytest.mark.timeout(120)
def test_the_tree_stays_the_sum_of_its_leaves_over_random_inserts_and_updates():
    rng = np.random.default_rng(1)
    capacity = 37  # not a power of two: 64 leaves, 27 never used
    replay = rp.new_replay(ITEM, capacity, priority_exponent=0.7)
    insert, update = jax.jit(rp.insert), jax.jit(rp.update_priorities)
    next_id, seen_max = 0, 1.0
    for _ in range(30):
        # Batches of 8 (one compilation), a random subset of them written.
        mask = jnp.asarray(rng.random(8) < rng.random())
        replay = insert(replay, items(np.arange(next_id, next_id + 8)), mask)
        next_id += 8
        # Duplicates on purpose, and rows not yet held (they stay out of the tree).
        rows = rng.integers(0, capacity, 8)
        rows[1] = rows[0]
        values = rng.uniform(0.0, 5.0, 8).astype(np.float32)
        held = rows < int(replay.size)
        replay = update(replay, jnp.asarray(rows, jnp.int32), jnp.asarray(values))
        seen_max = max(seen_max, float(values[held].max(initial=0.0)))
        # The repeated row took one of its values (the tree checks it got the same one).
        assert float(replay.priorities[rows[0]]) in values[rows == rows[0]]
        assert_tree_consistent(replay)
    assert int(replay.size) == capacity  # it wrapped around
    assert float(replay.max_priority) == seen_max
    assert float(replay.total_mass) == pytest.approx(
        float(np.sum(np.asarray(replay.priorities, np.float64) ** 0.7)), rel=1e-5)


@pytest.mark.timeout(120)
def test_rows_not_held_are_never_drawn():
    # Held rows with tiny and huge masses next to the empty ones: rounding in the
    # descent must not step into a row with mass 0.
    replay = filled([1e-6, 1e6, 1e-6], alpha=1.0, capacity=10)
    s = sample_jit(replay, jax.random.key(0), 50_000, 0.5)
    assert np.max(np.asarray(s.indices)) <= 2
    assert np.all(np.isfinite(np.asarray(s.weights)))
    # alpha = 0: uniform over the held rows even where a priority is 0.
    replay = filled([0.0, 2.0, 0.0], alpha=0.0, capacity=10)
    s = sample_jit(replay, jax.random.key(1), 30_000, 0.5)
    counts = np.bincount(np.asarray(s.indices), minlength=10)
    assert counts[3:].sum() == 0 and np.all(np.abs(counts[:3] - 10_000) < 500)
    np.testing.assert_allclose(s.weights, 1.0, rtol=1e-5)


@pytest.mark.timeout(120)
def test_a_target_at_or_past_the_total_mass_still_ends_on_a_held_row():
    # What rounding can give the last stratum: the descent must not step right into
    # rows with no mass (rows 3 to 7 here), whose items are zeros and P(i) = 0.
    replay = filled([2.0, 0.0, 3.0], alpha=1.0, capacity=8)
    total = float(replay.total_mass)
    targets = jnp.array([0.0, 1.999, 2.0, total, np.nextafter(total, np.inf, dtype=np.float32),
                         2 * total], jnp.float32)
    rows = rp._descend(replay.tree, targets)
    np.testing.assert_array_equal(rows, [0, 0, 2, 2, 2, 2])
    np.testing.assert_array_equal(rp._descend(rp.new_replay(ITEM, 8, priority_exponent=1.0)
                                              .tree, targets), 0)


@pytest.mark.timeout(120)
def test_uniform_sampling_covers_only_the_held_rows_uniformly():
    replay = filled([0.01, 100.0, 1.0, 5.0, 0.0, 2.0], capacity=16)  # priorities ignored
    draws = 120_000
    s = jax.jit(rp.sample_uniform, static_argnums=2)(replay, jax.random.key(2), draws)
    counts = np.bincount(np.asarray(s.indices), minlength=16)
    assert counts[6:].sum() == 0
    expected = draws / 6
    chi2 = np.sum((counts[:6] - expected) ** 2 / expected)
    assert chi2 < 5 + 6 * np.sqrt(10), chi2
    np.testing.assert_allclose(s.probabilities, 1 / 6, rtol=1e-6)
    np.testing.assert_array_equal(s.weights, 1.0)
    np.testing.assert_array_equal(s.items["id"], s.indices)


@pytest.mark.timeout(120)
def test_sampling_an_empty_replay_is_finite():
    empty = rp.new_replay(ITEM, 8, priority_exponent=0.9)
    for s in [rp.sample(empty, jax.random.key(0), 4, 0.6),
              sample_jit(empty, jax.random.key(0), 4, 0.6),
              rp.sample_uniform(empty, jax.random.key(0), 4)]:
        assert np.all(np.isfinite(s.weights)) and np.all(np.isfinite(s.probabilities))
        assert np.all(np.asarray(s.items["x"]) == 0)
        np.testing.assert_array_equal(s.indices, 0)
    # As `sample` draws: row 0, always.
    np.testing.assert_array_equal(rp.probabilities(empty), [1.0] + [0.0] * 7)
    # Held rows whose priorities are all 0: uniform over them, weights 1.
    zeros = filled([0.0, 0.0, 0.0], capacity=8)
    s = rp.sample(zeros, jax.random.key(1), 300, 0.6)
    assert np.max(np.asarray(s.indices)) <= 2 and len(np.unique(s.indices)) == 3
    np.testing.assert_allclose(s.weights, 1.0)
    np.testing.assert_allclose(rp.probabilities(zeros), [1 / 3] * 3 + [0] * 5, rtol=1e-6)
    # A learner writes back the priorities of what an empty replay gave: harmless.
    after = rp.update_priorities(empty, s.indices[:4], jnp.zeros(4))
    assert float(after.total_mass) == 0.0 and int(after.size) == 0
    with pytest.raises(ValueError, match="capacity must be an int >= 1, got 0"):
        rp.new_replay(ITEM, 0, priority_exponent=0.9)
    with pytest.raises(ValueError, match="priority_exponent must be >= 0"):
        rp.new_replay(ITEM, 4, priority_exponent=-1.0)
    with pytest.raises(ValueError, match="batch_size must be a static int >= 1"):
        rp.sample(empty, jax.random.key(0), 0, 0.6)


@pytest.mark.timeout(120)
def test_a_jitted_learner_step_samples_updates_and_inserts_like_the_eager_one():
    def step(replay, key, new_ids, beta):
        batch = rp.sample(replay, key, 8, beta)
        replay = rp.update_priorities(replay, batch.indices,
                                      batch.items["x"][:, 0] / 10.0 + 0.1)
        return rp.insert(replay, items(new_ids)), batch

    replay = filled(np.arange(1.0, 13.0), alpha=0.8, capacity=16)
    jitted = jax.jit(step, donate_argnums=0)
    eager_replay = replay
    jit_replay = jax.tree.map(jnp.copy, replay)
    for i in range(6):
        key = jax.random.key(i)
        new_ids = jnp.arange(2, dtype=jnp.int32) + 100 + 2 * i
        eager_replay, eager_batch = step(eager_replay, key, new_ids, 0.5)
        jit_replay, jit_batch = jitted(jit_replay, key, new_ids, jnp.float32(0.5))
        np.testing.assert_array_equal(jit_batch.indices, eager_batch.indices)
        np.testing.assert_allclose(jit_batch.weights, eager_batch.weights, rtol=1e-6)
        np.testing.assert_allclose(jit_replay.tree, eager_replay.tree, rtol=1e-6)
        assert_tree_consistent(jit_replay)
    np.testing.assert_array_equal(jit_replay.items["id"], eager_replay.items["id"])
    assert int(jit_replay.size) == 16 and int(jit_replay.cursor) == 8


@pytest.mark.timeout(120)
def test_power_probabilities_for_segments():
    p = rp.power_probabilities(jnp.array([1.0, 4.0, 0.0]), 0.5)
    np.testing.assert_allclose(p, [1 / 3, 2 / 3, 0.0], rtol=1e-6)
    p = rp.power_probabilities(jnp.array([0.0, 4.0, 9.0]), 0.0, jnp.array([True, True, False]))
    np.testing.assert_allclose(p, [0.5, 0.5, 0.0])
    np.testing.assert_allclose(rp.power_probabilities(jnp.zeros(4), 1.0), 0.25)
