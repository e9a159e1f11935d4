"""Prioritized replay: p^alpha sampling, importance weights, ring insertion, priorities."""

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


def filled(priorities) -> rp.Replay:
    n = len(priorities)
    replay = rp.insert(rp.new_replay(ITEM, n), items(np.arange(n)))
    return rp.update_priorities(replay, jnp.arange(n), jnp.asarray(priorities, jnp.float32))


@pytest.mark.timeout(120)
def test_sampling_frequencies_follow_priorities_to_the_alpha():
    priorities = np.array([0.25, 1.0, 4.0, 16.0, 64.0, 0.0])
    alpha, draws = 0.9, 200_000
    replay = filled(priorities)
    s = jax.jit(rp.sample, static_argnums=(2, 3, 4))(replay, jax.random.key(0), draws, alpha, 0.6)
    freq = np.bincount(np.asarray(s.indices), minlength=len(priorities)) / draws
    expected = priorities**alpha / np.sum(priorities**alpha)
    # 5 standard deviations of a frequency; p (alpha = 1) is off by 0.037 at the top
    # and a softmax by far more, so either mistake fails.
    tolerance = 5 * np.sqrt(expected * (1 - expected) / draws) + 1e-9
    np.testing.assert_array_less(np.abs(freq - expected), tolerance)
    assert np.abs(freq[4] - priorities[4] / priorities.sum()) > 3 * tolerance[4]
    assert freq[5] == 0.0  # a zero priority is never drawn
    np.testing.assert_allclose(s.probabilities, expected[np.asarray(s.indices)], rtol=1e-5)


@pytest.mark.timeout(120)
def test_importance_weights_are_n_p_to_minus_beta_normalised_by_the_batch_max():
    priorities = np.array([0.5, 1.0, 2.0, 4.0, 8.0])
    alpha, beta = 0.9, 0.6
    s = rp.sample(filled(priorities), jax.random.key(1), 64, alpha, beta)
    probs = priorities**alpha / np.sum(priorities**alpha)
    raw = (len(priorities) * probs[np.asarray(s.indices)]) ** (-beta)
    np.testing.assert_allclose(s.weights, raw / raw.max(), rtol=1e-5)
    assert np.max(s.weights) == pytest.approx(1.0)
    assert np.min(s.weights) < 0.9  # not all ones: the rarer draws weigh more
    items_drawn = jax.tree.map(np.asarray, s.items)
    np.testing.assert_array_equal(items_drawn["id"], s.indices)


@pytest.mark.timeout(120)
def test_insert_wraps_around_and_overwrites_the_oldest():
    replay = rp.new_replay(ITEM, 5)
    replay = jax.jit(rp.insert)(replay, items([10, 11, 12]))
    assert int(replay.size) == 3 and int(replay.cursor) == 3
    replay = jax.jit(rp.insert)(replay, items([13, 14, 15, 16]))
    # Rows 3, 4 then 0, 1: 10 and 11 were the oldest.
    np.testing.assert_array_equal(replay.items["id"], [15, 16, 12, 13, 14])
    np.testing.assert_array_equal(replay.items["x"][:, 1], [-15, -16, -12, -13, -14])
    assert int(replay.size) == 5 and int(replay.cursor) == 2
    replay = rp.insert(replay, items([17, 18, 19, 20, 21]))  # a whole capacity at once
    np.testing.assert_array_equal(replay.items["id"], [20, 21, 17, 18, 19])
    assert int(replay.cursor) == 2
    with pytest.raises(ValueError, match="cannot insert 6 items at once into a replay of "
                                         "capacity 5"):
        rp.insert(replay, items(np.arange(6)))


@pytest.mark.timeout(120)
def test_masked_insert_writes_only_the_selected_rows_consecutively():
    replay = rp.new_replay(ITEM, 4)
    replay = rp.insert(replay, items([1, 2, 3]), jnp.array([True, False, True]))
    np.testing.assert_array_equal(replay.items["id"], [1, 3, 0, 0])
    np.testing.assert_array_equal(replay.priorities, [1, 1, 0, 0])
    assert int(replay.size) == 2 and int(replay.cursor) == 2


@pytest.mark.timeout(120)
def test_new_items_enter_at_the_max_priority_and_priorities_update():
    replay = filled([0.5, 3.0, 2.0])
    assert float(replay.max_priority) == 3.0
    replay = rp.update_priorities(replay, jnp.array([1]), jnp.array([0.25]))
    np.testing.assert_allclose(replay.priorities, [0.5, 0.25, 2.0])
    assert float(replay.max_priority) == 3.0  # the largest ever seen, not the current
    bigger = rp.new_replay(ITEM, 4)
    bigger = rp.update_priorities(rp.insert(bigger, items([0, 1])), jnp.array([0]),
                                  jnp.array([7.0]))
    bigger = rp.insert(bigger, items([2]))
    np.testing.assert_allclose(bigger.priorities, [7.0, 1.0, 7.0, 0.0])


@pytest.mark.timeout(120)
def test_sampling_an_empty_replay_is_finite():
    s = rp.sample(rp.new_replay(ITEM, 8), jax.random.key(0), 4, 0.9, 0.6)
    assert np.all(np.isfinite(s.weights)) and np.all(np.asarray(s.items["x"]) == 0)
    with pytest.raises(ValueError, match="capacity must be an int >= 1, got 0"):
        rp.new_replay(ITEM, 0)
