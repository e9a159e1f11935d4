"""The episode tracker's two paths: by env id (EnvPool) and every env in order (a vector
env's fast path) give the same EnvStep rows, ended episodes and step counts."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest

from sebulba.envs import EpisodeTracker

N = 7
SPACE = gym.spaces.Box(-1.0, 1.0, (3,), np.float32)


@pytest.mark.timeout(60)
def test_in_order_path_matches_the_by_id_path():
    rng = np.random.default_rng(0)
    by_id, in_order = EpisodeTracker(N, SPACE), EpisodeTracker(N, SPACE)
    ids = np.arange(N)
    ended_total = 0
    for step in range(2000):
        obs = rng.normal(size=(N, 3))  # float64: both convert to the space's float32
        reward = rng.normal(size=N) * (step > 0)
        terminated, truncated = rng.random(N) < 0.05, rng.random(N) < 0.03
        a = by_id.observe(ids, obs, reward, terminated, truncated)
        b = in_order.observe_all(obs, reward, terminated, truncated)
        for x, y in zip(a[0], b[0], strict=True):
            assert x.dtype == y.dtype
            np.testing.assert_array_equal(x, y)
        assert a[1:] == b[1:], step  # (return, length) of ended episodes; steps counted
        ended_total += len(b[1])
        if step not in (1, 2, 4):  # some steps send no action: their rows are not steps
            by_id.sent(ids)
            in_order.sent(ids)
    assert ended_total > 100


@pytest.mark.timeout(60)
def test_in_order_returns_count_the_steps_after_the_first():
    tracker = EpisodeTracker(2, SPACE)
    obs, flags = np.zeros((2, 3)), np.zeros(2, bool)
    step, ended, steps = tracker.observe_all(obs, np.zeros(2), flags, flags)
    assert step.first.tolist() == [True, True] and ended == [] and steps == 0
    tracker.sent(np.arange(2))
    tracker.observe_all(obs, np.array([1.0, 2.0]), flags, flags)
    step, ended, steps = tracker.observe_all(obs, np.array([3.0, 4.0]),
                                             np.array([True, False]), flags)
    assert ended == [(4.0, 2)] and steps == 2 and not step.first.any()
    step, ended, _ = tracker.observe_all(obs, np.array([0.0, 5.0]), flags,
                                         np.array([False, True]))
    assert step.first.tolist() == [True, False] and ended == [(11.0, 3)]
