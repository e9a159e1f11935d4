"""The memory envs behave as documented, in sync and subprocess vector envs."""

from __future__ import annotations

import math
import warnings

import gymnasium as gym
import numpy as np
import pytest

import sebulba  # noqa: F401  (registers the ids)
from sebulba.envs import suite
from sebulba.envs.gymnasium_source import close_vector_env, make_vector_env
from sebulba.envs.suite import CueRecall


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
    cartpole = make_vector_env(suite.CARTPOLE_NO_VELOCITY, 2, vectorization)
    cue = make_vector_env(suite.CUE_RECALL, 2, vectorization, env_kwargs={"delay": 1})
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


# The memory-task suite. A policy sees only observations: an optimal one gets the episode's
# observations so far (oldest first; rows of envs for a vector env, whose episodes stay in
# step), a memoryless one only the current observation.


def repeat_first_optimal(history):
    return np.argmax(history[0], axis=-1)  # the symbol shown at step 0


def repeat_previous_optimal(k):
    def act(history):
        if len(history) <= k:  # step t < k: nothing to name yet, any action
            return np.argmax(history[-1], axis=-1)
        return np.argmax(history[-1 - k], axis=-1)  # the symbol shown at step t - k
    return act


def count_recall_optimal(max_count):
    def act(history):
        return np.minimum(sum(obs[..., 0] for obs in history), max_count).astype(np.int64)
    return act


def repeat_first_continuous_optimal(history):
    x = history[0][..., :-1]  # the vector shown at step 0, without its flag
    return np.sum((x > 0) * 2 ** np.arange(x.shape[-1]), axis=-1)


def run_episode(env, policy, seed):
    """(per-step rewards, terminated flags) of one episode of `policy`, which gets the
    observations so far."""
    obs, _ = env.reset(seed=seed)
    history, rewards, terminations = [obs], [], []
    while True:
        assert env.observation_space.contains(obs)
        obs, reward, terminated, truncated, _ = env.step(int(policy(history)))
        assert not truncated
        rewards.append(reward)
        terminations.append(terminated)
        if terminated:
            assert not obs.any()  # the final observation is zeros
            return np.array(rewards), np.array(terminations)
        history.append(obs)


OPTIMAL_CASES = [  # (env, its optimal policy, episode length, unrewarded first steps)
    (suite.RepeatFirst(), repeat_first_optimal, 50, 0),
    (suite.RepeatFirst(num_symbols=7, episode_length=3), repeat_first_optimal, 3, 0),
    (suite.RepeatFirst(episode_length=1), repeat_first_optimal, 1, 0),
    (suite.RepeatPrevious(), repeat_previous_optimal(4), 50, 4),
    (suite.RepeatPrevious(num_symbols=3, k=1, episode_length=2),
     repeat_previous_optimal(1), 2, 1),
    (suite.RepeatPrevious(num_symbols=5, k=9, episode_length=30),
     repeat_previous_optimal(9), 30, 9),
    (suite.CountRecall(), count_recall_optimal(20), 20, 0),
    (suite.CountRecall(num_symbols=3, episode_length=40), count_recall_optimal(40), 40, 0),
    (suite.CountRecall(max_count=3), count_recall_optimal(3), 20, 0),  # the cap binds
    (suite.RepeatFirstContinuous(), repeat_first_continuous_optimal, 50, 0),
    (suite.RepeatFirstContinuous(dim=5, episode_length=9),
     repeat_first_continuous_optimal, 9, 0),
]


def case_id(case):
    env = case[0]
    args = ", ".join(f"{k}={v}" for k, v in vars(env).items()
                     if k in ("num_symbols", "k", "episode_length", "max_count", "dim"))
    return f"{type(env).__name__}({args})"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("env, policy, length, unrewarded", OPTIMAL_CASES,
                         ids=[case_id(c) for c in OPTIMAL_CASES])
def test_optimal_policies_reach_return_one_in_episodes_of_the_documented_length(
        env, policy, length, unrewarded):
    rewarded = length - unrewarded  # RepeatPrevious rewards steps t >= k only
    for seed in range(50):
        rewards, terminations = run_episode(env, policy, seed)
        assert len(rewards) == length
        assert terminations[-1] and not terminations[:-1].any()
        assert rewards.sum() == pytest.approx(1.0, abs=1e-9)
        np.testing.assert_array_equal(rewards[length - rewarded:], 1.0 / rewarded)


@pytest.mark.timeout(60)
def test_optimal_counting_needs_the_cap():
    """An uncapped count is wrong once it passes max_count: the cap is part of the task."""
    env = suite.CountRecall(max_count=2)
    assert env.action_space.n == 3
    returns = [run_episode(env, count_recall_optimal(2), seed)[0].sum() for seed in range(50)]
    assert returns == pytest.approx([1.0] * 50, abs=1e-9)
    uncapped = count_recall_optimal(20)
    returns = [run_episode(env, uncapped, seed)[0].sum() for seed in range(50)]
    assert np.mean(returns) < 0.7  # counts above 2 are wrong answers


def random_when_blank(obs, rng):
    """Names what is shown, and guesses uniformly at random when nothing is."""
    if not obs.any():
        return rng.integers(obs.shape[0])
    return np.argmax(obs)


def random_sign_pattern_when_blank(obs, rng):
    x = obs[:-1]
    if obs[-1] == 0.0:
        return rng.integers(2 ** x.shape[0])
    return np.sum((x > 0) * 2 ** np.arange(x.shape[0]))


def current_symbol(obs, rng):
    return np.argmax(obs)


def count_as_if_first(obs, rng):
    return int(obs[0] == 1.0)  # the count if this were the episode's first step


def always(action):
    return lambda obs, rng: action


def shown_else(action):
    """Names what is shown, and `action` when nothing is."""
    return lambda obs, rng: np.argmax(obs) if obs.any() else action


def uniformly_random(num_actions):
    return lambda obs, rng: rng.integers(num_actions)


CHANCE_CASES = [  # (env, a memoryless policy, the chance return the env documents)
    (suite.RepeatFirst(), random_when_blank, 0.265),
    (suite.RepeatFirst(episode_length=10), shown_else(2), 0.325),
    (suite.RepeatFirst(num_symbols=2, episode_length=10), random_when_blank, 0.55),
    (suite.RepeatPrevious(), current_symbol, 0.25),
    (suite.RepeatPrevious(), always(1), 0.25),
    (suite.RepeatPrevious(num_symbols=3, k=1, episode_length=5), current_symbol, 1 / 3),
    (suite.CountRecall(), count_as_if_first, (1 - 2.0 ** -20) / 10),
    (suite.CountRecall(), uniformly_random(21), 1 / 21),
    (suite.CountRecall(num_symbols=3, episode_length=10), count_as_if_first,
     (1 - (2 / 3) ** 10) * 3 / 10),
    (suite.CountRecall(max_count=5), always(5), 0.550),
    (suite.RepeatFirstContinuous(), random_sign_pattern_when_blank, 0.265),
    (suite.RepeatFirstContinuous(dim=1, episode_length=10),
     random_sign_pattern_when_blank, 0.55),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("env, policy, chance", CHANCE_CASES,
                         ids=[f"{case_id(c)}-{i}" for i, c in enumerate(CHANCE_CASES)])
def test_memoryless_policies_score_the_documented_chance(env, policy, chance):
    rng = np.random.default_rng(0)
    episodes = max(4000, 200_000 // env.episode_length)
    returns = np.empty(episodes)
    for i in range(episodes):
        obs, _ = env.reset(seed=1000 + i)
        total, terminated = 0.0, False
        while not terminated:
            obs, reward, terminated, _, _ = env.step(int(policy(obs, rng)))
            total += reward
        returns[i] = total
    standard_error = returns.std() / np.sqrt(episodes)
    assert standard_error < 0.004  # enough episodes to tell chance from a few percent more
    # Six standard errors, plus the rounding of the documented 0.550.
    assert abs(returns.mean() - chance) < 6 * standard_error + 1e-3


@pytest.mark.timeout(60)
def test_count_recall_documented_chance_is_the_best_memoryless_score():
    """The best memoryless policy answers a0 on symbol 0 and a1 otherwise (it cannot see
    the step); exact expected returns of every such pair, from binomial counts."""

    def best_memoryless(num_symbols, length, max_count):
        p = 1 / num_symbols

        def probability(t, answer, shown):  # P(capped count at step t == answer)
            previous = [math.comb(t, j) * p ** j * (1 - p) ** (t - j) for j in range(t + 1)]
            return sum(q for j, q in enumerate(previous)
                       if min(j + shown, max_count) == answer)

        def best(shown):
            return max(sum(probability(t, a, shown) for t in range(length))
                       for a in range(max_count + 1))

        return (p * best(1) + (1 - p) * best(0)) / length

    assert best_memoryless(2, 20, 20) == pytest.approx((1 - 2.0 ** -20) / 10, abs=1e-12)
    assert best_memoryless(3, 10, 10) == pytest.approx((1 - (2 / 3) ** 10) * 3 / 10, abs=1e-12)
    assert best_memoryless(2, 20, 5) == pytest.approx(0.550, abs=1e-3)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("k", [1, 3, 7])
def test_repeat_previous_rewards_nothing_before_step_k(k):
    num_symbols, length = 4, k + 3
    env = suite.RepeatPrevious(num_symbols=num_symbols, k=k, episode_length=length)
    for seed in range(25):
        for action in range(num_symbols):  # no action is rewarded before step k
            env.reset(seed=seed)
            for _ in range(k):
                _, reward, terminated, _, _ = env.step(action)
                assert reward == 0.0 and not terminated
        # From step k on, the symbol shown k steps earlier earns 1 / (length - k), others 0.
        for right in (True, False):
            obs, _ = env.reset(seed=seed)
            shown = [int(np.argmax(obs))]
            for t in range(length):
                answer = shown[t - k] if t >= k else 0
                obs, reward, _, _, _ = env.step(answer if right else (answer + 1) % num_symbols)
                shown.append(int(np.argmax(obs)))
                assert reward == (1 / (length - k) if right and t >= k else 0.0)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("env", [suite.RepeatFirst(episode_length=3),
                                 suite.RepeatPrevious(k=1, episode_length=3),
                                 suite.CountRecall(episode_length=3),
                                 suite.RepeatFirstContinuous(episode_length=3)],
                         ids=lambda env: type(env).__name__)
def test_stepping_outside_an_episode_is_an_error(env):
    with pytest.raises(RuntimeError, match="call reset"):
        env.step(0)  # before the first reset
    env.reset(seed=0)
    for t in range(3):
        assert env.step(0)[2] == (t == 2)
    with pytest.raises(RuntimeError, match="ended after 3 steps: call reset"):
        env.step(0)
    env.reset(seed=1)
    assert not env.step(0)[2]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("env_class", [suite.RepeatFirst, suite.RepeatPrevious,
                                       suite.CountRecall,
                                       suite.RepeatFirstContinuous],
                         ids=lambda cls: cls.__name__)
def test_new_envs_pass_the_gymnasium_env_checker(env_class):
    from gymnasium.utils.env_checker import check_env

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the checker warns about what it dislikes
        check_env(env_class(), skip_render_check=True)
    env = env_class()
    first, _ = env.reset(seed=3)
    again, _ = env.reset(seed=3)
    other = [env.reset(seed=seed)[0] for seed in range(20)]
    np.testing.assert_array_equal(first, again)  # seeded through np_random
    assert any(not np.array_equal(first, obs) for obs in other)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("env_class, kwargs, message", [
    (suite.RepeatFirst, {"num_symbols": 1}, r"num_symbols=1 must be an int >= 2"),
    (suite.RepeatFirst, {"episode_length": 0}, r"episode_length=0 must be an int >= 1"),
    (suite.RepeatFirst, {"num_symbols": 2.5}, r"num_symbols=2.5 must be an int >= 2"),
    (suite.RepeatFirst, {"episode_length": True},
     r"episode_length=True must be an int >= 1"),
    (suite.RepeatPrevious, {"k": 60},
     r"k=60 must be less than episode_length=50: no step would be rewarded"),
    (suite.RepeatPrevious, {"k": 5, "episode_length": 5},
     r"k=5 must be less than episode_length=5: no step would be rewarded"),
    (suite.RepeatPrevious, {"k": 0}, r"k=0 must be an int >= 1 \(with k=0 the task"),
    (suite.RepeatPrevious, {"episode_length": -3},
     r"episode_length=-3 must be an int >= 1"),
    (suite.RepeatPrevious, {"num_symbols": 0}, r"num_symbols=0 must be an int >= 2"),
    (suite.CountRecall, {"max_count": 0}, r"max_count=0 must be an int >= 1"),
    (suite.CountRecall, {"episode_length": 0}, r"episode_length=0 must be an int >= 1"),
    (suite.CountRecall, {"num_symbols": 1}, r"num_symbols=1 must be an int >= 2"),
    (suite.RepeatFirstContinuous, {"dim": 0}, r"dim=0 must be an int >= 1"),
    (suite.RepeatFirstContinuous, {"dim": 31},
     r"dim=31 must be <= 30: the actions are the 2\^dim sign patterns"),
    (suite.RepeatFirstContinuous, {"episode_length": 0},
     r"episode_length=0 must be an int >= 1"),
])
def test_new_envs_reject_bad_arguments_by_name_and_value(env_class, kwargs, message):
    with pytest.raises(ValueError, match=message):
        env_class(**kwargs)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("env_id, kwargs, policy, obs_size, length", [
    (suite.REPEAT_FIRST, {}, repeat_first_optimal, 4, 50),
    (suite.REPEAT_PREVIOUS, {}, repeat_previous_optimal(4), 4, 50),
    (suite.REPEAT_PREVIOUS, {"k": 2, "episode_length": 7}, repeat_previous_optimal(2),
     4, 7),
    (suite.COUNT_RECALL, {}, count_recall_optimal(20), 2, 20),
    (suite.REPEAT_FIRST_CONTINUOUS, {}, repeat_first_continuous_optimal, 3, 50),
    (suite.REPEAT_FIRST_CONTINUOUS, {"dim": 3}, repeat_first_continuous_optimal, 4, 50),
], ids=["RepeatFirst", "RepeatPrevious", "RepeatPrevious-k2-L7", "CountRecall",
        "RepeatFirstContinuous", "RepeatFirstContinuous-dim3"])
def test_new_ids_work_in_sync_vector_envs(env_id, kwargs, policy, obs_size, length,
                                          no_leftovers):
    assert env_id.startswith("sebulba.envs.suite:sebulba/")
    assert gym.spec(env_id.split(":")[1]).max_episode_steps is None  # they end themselves
    vec = make_vector_env(env_id, 4, "sync", env_kwargs=kwargs)
    try:
        obs, _ = vec.reset(seed=0)
        assert obs.shape == (4, obs_size)
        for _ in range(2):  # the second episode starts with the autoreset step
            history, returns = [obs], np.zeros(4)
            for t in range(length):
                obs, reward, terminated, truncated, _ = vec.step(policy(history))
                returns += reward
                assert not truncated.any()
                np.testing.assert_array_equal(terminated, t == length - 1)
                history.append(obs)
            np.testing.assert_allclose(returns, 1.0, atol=1e-9)
            obs, reward, terminated, _, _ = vec.step(np.zeros(4, np.int64))  # autoreset
            np.testing.assert_array_equal(reward, 0.0)
            assert not terminated.any()
    finally:
        close_vector_env(vec)


@pytest.mark.timeout(60)
def test_pendulum_without_velocity_is_pendulum_observing_the_angle(no_leftovers):
    pendulum = make_vector_env(suite.PENDULUM_NO_VELOCITY, 2, "sync")
    full = gym.make("Pendulum-v1")
    try:
        obs, _ = pendulum.reset(seed=3)
        full_obs, _ = full.reset(seed=3)
        assert obs.shape == (2, 2) and pendulum.single_action_space.shape == (1,)
        np.testing.assert_allclose(obs[0], full_obs[:2], rtol=1e-6)
        for t in range(200):  # same dynamics and rewards, 200-step episodes
            torque = np.full((2, 1), np.sin(t / 10.0), np.float32)
            obs, reward, _, truncated, _ = pendulum.step(torque)
            full_obs, full_reward, _, full_truncated, _ = full.step(torque[0])
            np.testing.assert_allclose(obs[0], full_obs[:2], rtol=1e-5, atol=1e-6)
            assert reward[0] == pytest.approx(full_reward, rel=1e-5)
        assert truncated.all() and full_truncated
    finally:
        close_vector_env(pendulum)
        full.close()
