"""desync_episodes: each env's first episode is cut at a random length, so phases spread."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest

import sebulba
from sebulba.envs.gymnasium_source import DesyncFirstEpisode, VectorEnvSource, make_vector_env
from tests.counting_agent import CountingAgent
from tests.envs import CountingEnv

EPISODE_LENGTH = 24


def limited_counting_env() -> gym.Env:
    """Observation (env id, episode, step in episode); episodes of 24 steps, time-limited."""
    return gym.wrappers.TimeLimit(CountingEnv(EPISODE_LENGTH), EPISODE_LENGTH)


@pytest.mark.timeout(60)
def test_only_the_first_episode_is_cut_and_the_cut_repeats_with_the_seed():
    lengths = []
    for seed in range(40):
        env = DesyncFirstEpisode(limited_counting_env())
        env.reset(seed=seed)
        cut = env.first_episode_length
        assert 1 <= cut <= EPISODE_LENGTH
        steps, truncated = 0, False
        while not truncated:
            _, _, terminated, truncated, _ = env.step(0)
            steps += 1
            assert not terminated or steps == EPISODE_LENGTH
            truncated = truncated or terminated
        assert steps == cut
        env.reset()
        for _ in range(EPISODE_LENGTH - 1):  # the second episode runs to its full length
            assert not any(env.step(0)[2:4])
        assert any(env.step(0)[2:4])
        again = DesyncFirstEpisode(limited_counting_env())
        again.reset(seed=seed)
        assert again.first_episode_length == cut
        lengths.append(cut)
    assert len(set(lengths)) > 15  # spread over 1..24, not one value


@pytest.mark.timeout(60)
def test_an_env_without_a_step_limit_is_rejected_at_construction():
    config = sebulba.Config(env=CountingEnv, envs_per_group=2, desync_episodes=True)
    with pytest.raises(ValueError, match="desync_episodes needs an episode step limit"):
        sebulba.Sebulba(CountingAgent(sebulba.env_spec(CountingEnv)), config)
    with pytest.raises(ValueError, match="desync_episodes needs vectorization 'sync' or 'async'"):
        make_vector_env("CartPole-v1", 2, "vector_entry_point", desync_episodes=True)


@pytest.mark.timeout(60)
def test_cartpole_ids_get_the_wrapper_with_their_registered_limit():
    vec = make_vector_env("CartPole-v1", 8, "sync", desync_episodes=True)
    try:
        VectorEnvSource(vec).reset(seed=0)
        cuts = [e.first_episode_length for e in vec.envs if isinstance(e, DesyncFirstEpisode)]
        assert len(cuts) == 8 and max(cuts) <= 500 and len(set(cuts)) == 8
    finally:
        vec.close()


def phases_after_first_cycle(desync: bool) -> np.ndarray:
    """Step in episode of every env at the end of the first cycle (T = 32 > 24).

    One group of 16 envs: with two, one group may fill the learner's log before the
    other's first trajectory reaches it (thread timing)."""
    steps = 32
    config = sebulba.Config(env=limited_counting_env, envs_per_group=16, async_factor=1,
                            steps_per_cycle=steps, seed=3, desync_episodes=desync)
    agent = CountingAgent(sebulba.env_spec(limited_counting_env), capacity=8)
    result = sebulba.Sebulba(agent, config).run(2 * 16 * steps)
    log = result.learner_experience
    obs = np.asarray(log.obs.addressable_shards[0].data)[0]  # [C, E, T + 1, 3]
    # The first trajectory starts at episode 0, step 0 in every env.
    assert np.all(obs[0, :, 0, 1:] == 0), obs[0, :, 0]
    return obs[0, :, steps, 2]


@pytest.mark.timeout(180)
def test_desync_spreads_the_episode_phases_in_the_buffer(no_leftovers):
    synced = phases_after_first_cycle(False)
    assert len(set(synced.tolist())) == 1  # all 16 envs at the same step of an episode
    spread = phases_after_first_cycle(True)
    # With this run's seed: 11 distinct phases over 16 envs, from 1 to 23; without desync
    # all 7.
    assert len(set(spread.tolist())) >= 8, spread
    assert spread.max() - spread.min() >= EPISODE_LENGTH // 2, spread


@pytest.mark.timeout(120)
def test_factories_are_desynced_in_subprocess_workers_too(no_leftovers):
    vec = make_vector_env(limited_counting_env, 2, "async", desync_episodes=True)
    try:
        source = VectorEnvSource(vec)
        source.reset(seed=0)
        ids, _, _ = source.recv()
        cuts = [DesyncFirstEpisode(limited_counting_env()) for _ in range(2)]
        for seed, env in enumerate(cuts):
            env.reset(seed=seed)
        ends = []
        for t in range(1, EPISODE_LENGTH + 1):
            source.send(np.zeros(2, np.int64), ids)
            _, env_step, _ = source.recv()
            ends += [(i, t) for i in np.flatnonzero(env_step.truncated)]
        # Each worker cuts its first episode where the same wrapper in-process does.
        assert sorted(ends) == [(i, env.first_episode_length) for i, env in enumerate(cuts)]
    finally:
        vec.close()
