"""The memory envs behave as documented, in sync and subprocess vector envs."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest

import sebulba  # noqa: F401  (registers the ids)
from sebulba import memory_envs
from sebulba.envs import close_vector_env, make_vector_env
from sebulba.memory_envs import CueRecall


@pytest.mark.timeout(60)
@pytest.mark.parametrize("answer_right", [True, False])
def test_cue_recall_rewards_naming_the_cue_after_the_delay(answer_right):
    env = CueRecall(num_cues=3, delay=4)
    obs, _ = env.reset(seed=1)
    cue = int(np.argmax(obs[:3]))
    assert obs[cue] == 1.0 and obs.sum() == 1.0
    for t in range(1, 5 + 1):  # delay blanks, then the query
        obs, reward, terminated, truncated, _ = env.step((cue + 1) % 3)  # ignored actions
        assert reward == 0.0 and not terminated and not truncated
        assert obs[:3].sum() == 0.0 and obs[3] == float(t == 5)
    _, reward, terminated, _, _ = env.step(cue if answer_right else (cue + 1) % 3)
    assert terminated and reward == float(answer_right)


@pytest.mark.timeout(60)
def test_cue_recall_rejects_bad_arguments():
    with pytest.raises(ValueError, match="num_cues must be >= 2, got 1"):
        CueRecall(num_cues=1)
    with pytest.raises(ValueError, match="delay must be >= 0, got -1"):
        CueRecall(delay=-1)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("vectorization", ["sync", "async"])
def test_ids_work_in_vector_envs(vectorization, no_leftovers):
    cartpole = make_vector_env(memory_envs.CARTPOLE_NO_VELOCITY, 2, vectorization)
    cue = make_vector_env(memory_envs.CUE_RECALL, 2, vectorization, env_kwargs={"delay": 1})
    try:
        obs, _ = cartpole.reset(seed=0)
        assert obs.shape == (2, 2)
        full = gym.make("CartPole-v1")
        full_obs, _ = full.reset(seed=0)
        np.testing.assert_allclose(obs[0], full_obs[[0, 2]])  # same dynamics, fewer entries
        obs, _ = cue.reset(seed=0)
        assert obs.shape == (2, 3)
        for _ in range(3):  # cue, one blank, query: the third action answers
            _, reward, terminated, _, _ = cue.step(np.zeros(2, np.int64))
        assert terminated.all()
        np.testing.assert_array_equal(reward, np.argmax(obs[:, :2], axis=1) == 0)
    finally:
        close_vector_env(cartpole)
        close_vector_env(cue)
