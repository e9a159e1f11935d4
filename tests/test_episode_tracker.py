"""The episode tracker's two paths: by env id (EnvPool) and every env in order (a vector
env's fast path) give the same EnvStep rows, ended episodes and step counts, however
often the ended episodes are asked for (the tally runs when they are)."""

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
    ended_by_id, ended_in_order = [], []
    # Asked now and then, up to more rows than it keeps for the tally at once.
    asked_at = {4, 9, 10, 50, 51, 400} | set(range(1500, 3000, 111))
    for step in range(3000):
        obs = rng.normal(size=(N, 3))  # float64: both convert to the space's float32
        reward = rng.normal(size=N) * (step > 0)
        terminated, truncated = rng.random(N) < 0.05, rng.random(N) < 0.03
        a = by_id.observe(ids, obs, reward, terminated, truncated)
        b = in_order.observe_all(obs, reward, terminated, truncated)
        for x, y in zip(a[0], b[0], strict=True):
            assert x.dtype == y.dtype
            np.testing.assert_array_equal(x, y)
        assert a[1] == b[1], step  # steps counted
        ended_by_id += by_id.pop_episodes()  # every step
        if step in asked_at:  # now and then: the tally catches up
            ended_in_order += in_order.pop_episodes()
        if step not in (1, 2, 4):  # some steps send no action: their rows are not steps
            by_id.sent(ids)
            in_order.sent(ids)
    ended_in_order += in_order.pop_episodes()
    # (return, length), in the order they ended; the in-order path sums an episode that
    # starts among the rows it tallies at once as a difference of running sums.
    assert [n for _, n in ended_by_id] == [n for _, n in ended_in_order]
    np.testing.assert_allclose([r for r, _ in ended_in_order], [r for r, _ in ended_by_id],
                               rtol=1e-12, atol=1e-12)
    assert len(ended_by_id) > 200


@pytest.mark.timeout(60)
def test_in_order_returns_count_the_steps_after_the_first():
    tracker = EpisodeTracker(2, SPACE)
    obs, flags = np.zeros((2, 3)), np.zeros(2, bool)
    step, steps = tracker.observe_all(obs, np.zeros(2), flags, flags)
    assert step.first.tolist() == [True, True] and steps == 0
    assert tracker.pop_episodes() == []
    tracker.sent(np.arange(2))
    tracker.observe_all(obs, np.array([1.0, 2.0]), flags, flags)
    step, steps = tracker.observe_all(obs, np.array([3.0, 4.0]), np.array([True, False]),
                                      flags)
    assert tracker.pop_episodes() == [(4.0, 2)] and steps == 2 and not step.first.any()
    step, _ = tracker.observe_all(obs, np.array([0.0, 5.0]), flags, np.array([False, True]))
    assert step.first.tolist() == [True, False]
    assert tracker.pop_episodes() == [(11.0, 3)] and tracker.pop_episodes() == []


@pytest.mark.timeout(60)
def test_by_id_rows_tally_into_their_own_envs():
    tracker = EpisodeTracker(4, SPACE)
    obs, no = np.zeros((2, 3)), np.zeros(2, bool)
    tracker.observe(np.array([0, 1]), obs, np.zeros(2), no, no)
    tracker.observe(np.array([2, 3]), obs, np.zeros(2), no, no)
    tracker.sent(np.arange(4))
    tracker.observe(np.array([3, 0]), obs, np.array([1.0, 10.0]), no, no)
    tracker.observe(np.array([1, 3]), obs, np.array([100.0, 2.0]), no, np.array([False, True]))
    assert tracker.pop_episodes() == [(3.0, 2)]  # env 3's: 1 + 2 over two steps
    tracker.observe(np.array([0, 1]), obs, np.array([20.0, 200.0]), np.array([True, True]),
                    no)
    assert tracker.pop_episodes() == [(30.0, 2), (300.0, 2)]


@pytest.mark.timeout(60)
def test_a_source_may_reuse_its_buffers_before_the_tally():
    """The tally runs later (when episodes are asked for, or at the next observe): it
    must count the rows as observed, not what a source wrote into its buffers since."""
    tracker = EpisodeTracker(4, SPACE)
    ids, reward = np.array([0, 1]), np.array([1.0, 2.0], np.float32)
    obs, no = np.zeros((2, 3), np.float32), np.zeros(2, bool)
    tracker.observe(ids, obs, reward, no, no)  # resets: their rows are not returns
    tracker.sent(ids)
    tracker.observe(ids, obs, reward, no, no)  # envs 0 and 1 get 1 and 2
    tracker.sent(ids)
    ids[:], reward[:] = [2, 3], [100.0, 100.0]  # the source's next batch, same buffers
    tracker.observe(np.array([0, 1]), obs, np.array([3.0, 4.0], np.float32), no,
                    np.ones(2, bool))  # envs 0 and 1 get 3 and 4, and end
    assert tracker.pop_episodes() == [(4.0, 2), (6.0, 2)]


@pytest.mark.timeout(60)
def test_in_order_rows_are_tallied_as_observed_however_late():
    """Rows of every env wait for the tally, many of them: a source that reuses its
    reward buffer meanwhile must not change what they count."""
    tracker = EpisodeTracker(2, SPACE)
    obs, no = np.zeros((2, 3), np.float32), np.zeros(2, bool)
    reward = np.zeros(2, np.float32)  # the source's buffer, written in place each step
    tracker.observe_all(obs, reward, no, no)  # the resets
    tracker.sent(np.arange(2))
    for step in range(1, 11):
        reward[:] = [step, 10 * step]
        tracker.observe_all(obs, reward, no, np.array([False, step == 4]))
    reward[:] = -1000.0
    # Env 1 ended at step 4 (10 + 20 + 30 + 40), reset at step 5 and has 6 steps since.
    assert tracker.pop_episodes() == [(100.0, 4)]
    tracker.observe_all(obs, reward * 0 + 1.0, np.ones(2, bool), no)
    assert tracker.pop_episodes() == [(sum(range(1, 11)) + 1.0, 11),
                                      (10.0 * sum(range(6, 11)) + 1.0, 6)]


@pytest.mark.timeout(60)
def test_an_infinite_reward_stays_in_its_own_episode():
    """With the output checks off an env may return inf: tallied with the rows after it,
    it must not turn the env's later episodes into NaN (a difference of running sums)."""
    obs, no = np.zeros((1, 3), np.float32), np.zeros(1, bool)
    steps = [(0.0, False), (np.inf, True), (0.0, False), (1.0, True), (0.0, False),
             (2.0, True), (0.0, False), (3.0, False)]
    one_pass, row_by_row = EpisodeTracker(1, SPACE), EpisodeTracker(1, SPACE)
    ended = []
    for tracker in (one_pass, row_by_row):
        tracker.observe_all(obs, np.zeros(1), no, no)
        tracker.sent(np.arange(1))
    for reward, terminated in steps:
        for tracker in (one_pass, row_by_row):
            tracker.observe_all(obs, np.array([reward]), np.array([terminated]), no)
        ended += row_by_row.pop_episodes()
    # Each reset's row starts the next episode and counts nothing.
    assert one_pass.pop_episodes() == ended == [(np.inf, 2), (1.0, 1), (2.0, 1)]
    for tracker in (one_pass, row_by_row):  # the episode under way (3 so far) ends
        for reward, terminated in [(4.0, True), (5.0, False), (6.0, True)]:
            tracker.observe_all(obs, np.array([reward]), np.array([terminated]), no)
    assert one_pass.pop_episodes() == [(7.0, 2), (6.0, 1)]
