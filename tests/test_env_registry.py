"""A source of one's own: one class and one registry entry, then Config, the loop and
evaluation take it like the shipped ones."""

from __future__ import annotations

import dataclasses
import multiprocessing

import gymnasium as gym
import numpy as np
import pytest

import sebulba
from agents.spg import SPG, SPGConfig
from sebulba.envs import EnvSourceKind, EpisodeTracker, SourceRequest, registry
from sebulba.evaluation import evaluate

EPISODE_LENGTH = 8


class SignSource:
    """`num_groups` groups of envs in one numpy array: each step shows a sign (one-hot of
    2) and pays 1 when the action names it; episodes last EPISODE_LENGTH steps.

    An env source with no gymnasium env behind it, addressed by id like a pool of envs
    stepped elsewhere: `recv` returns the `group_size` envs sent actions longest ago.
    """

    in_order = False

    def __init__(self, num_groups: int, group_size: int, seed: int):
        self.num_groups, self.group_size = num_groups, group_size
        self.num_envs = num_groups * group_size
        self.space = gym.spaces.Box(0.0, 1.0, (2,), np.float32)
        self._tracker = EpisodeTracker(self.num_envs, self.space)
        self._rng = np.random.default_rng(seed)
        self._sign = np.zeros(self.num_envs, np.int64)
        self._t = np.zeros(self.num_envs, np.int64)
        self._reward = np.zeros(self.num_envs, np.float32)
        self._last = np.zeros(self.num_envs, bool)
        self._ready: list[int] = []  # envs whose step is done, in the order they were sent
        self.closed = False

    def reset(self, seed: int) -> None:
        self._rng = np.random.default_rng(seed)
        self._sign = self._rng.integers(0, 2, self.num_envs)
        self._ready = list(range(self.num_envs))

    def recv(self):
        ids = np.array(self._ready[:self.group_size])
        del self._ready[:self.group_size]
        obs = np.eye(2, dtype=np.float32)[self._sign[ids]]
        no = np.zeros(len(ids), bool)
        return (ids, *self._tracker.observe(ids, obs, self._reward[ids], self._last[ids], no))

    def send(self, actions: np.ndarray, ids: np.ndarray) -> None:
        restart = self._last[ids]  # NEXT_STEP autoreset: the action after a last step resets
        self._reward[ids] = np.where(restart, 0.0, actions == self._sign[ids])
        self._t[ids] = np.where(restart, 0, self._t[ids] + 1)
        self._last[ids] = self._t[ids] == EPISODE_LENGTH
        self._sign[ids] = self._rng.integers(0, 2, len(ids))
        self._ready += ids.tolist()
        self._tracker.sent(ids)

    def pop_episodes(self):
        return self._tracker.pop_episodes()

    def close(self) -> None:
        self.closed = True


made: list[SignSource] = []


def make_sign_sources(request: SourceRequest) -> list[SignSource]:
    made.append(SignSource(request.num_groups, request.group_size, request.seed))
    return [made[-1]]


def check_sign_env(env: str) -> None:
    if env != "sign":
        raise ValueError(f"env {env!r}: the sign source makes only 'sign'")


SIGN = EnvSourceKind(
    "test_sign",
    make_sources=make_sign_sources,
    env_spec=lambda r: sebulba.EnvSpec(gym.spaces.Box(0.0, 1.0, (2,), np.float32),
                                       gym.spaces.Discrete(2)),
    check_env=check_sign_env,
    needs_env_id=True,
    steps_in_order=False,
)


class InTurnSignSource(SignSource):
    """The same source, declared to step in order: with the loop's pipelining (a group
    is received before the one before it is sent) its recv returns the groups in turn,
    each whole and in id order, as a source of several groups in order must."""

    in_order = True

    def recv(self):
        ids, env_step, steps = super().recv()
        g = int(ids[0]) // self.group_size
        np.testing.assert_array_equal(ids, g * self.group_size + np.arange(self.group_size))
        return ids, env_step, steps


def make_in_turn_sources(request: SourceRequest) -> list[SignSource]:
    made.append(InTurnSignSource(request.num_groups, request.group_size, request.seed))
    return [made[-1]]


@pytest.fixture
def sign_kind():
    registry.register(SIGN)
    made.clear()
    yield SIGN
    registry.unregister(SIGN.name)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("in_order", [False, True])
def test_a_registered_source_trains_through_the_loop(sign_kind, in_order, no_leftovers):
    if in_order:  # the same source's groups in turn, driven as in-order groups
        registry.register(dataclasses.replace(SIGN, make_sources=make_in_turn_sources,
                                              steps_in_order=True), replace=True)
    config = sebulba.Config(env="sign", vectorization="test_sign", envs_per_group=8,
                            async_factor=2, steps_per_cycle=16, learner_devices=[0, 1])
    agent = SPG(config.env_spec(), SPGConfig(hidden_sizes=(32,)))
    result = sebulba.Sebulba(agent, config).run(40_000)

    assert len(made) == 1 and made[0].closed  # one source of both groups, closed at the end
    assert made[0].in_order == in_order
    assert result.env_steps == result.consumed + result.dropped + result.in_flight
    assert result.consumed >= 40_000
    # Chance is EPISODE_LENGTH / 2; naming the sign shown is worth EPISODE_LENGTH.
    first, last = result.mean_return(0.0, 0.1), result.mean_return(0.9, 1.0)
    assert first < 0.7 * EPISODE_LENGTH, result.summary()
    assert last > 0.9 * EPISODE_LENGTH, result.summary()
    # Evaluation asks the kind too: a source that does not step in order is refused.
    with pytest.raises(ValueError, match="'test_sign'"):
        evaluate(agent, result.state.nets, "sign", 2, vectorization="test_sign")


@pytest.mark.timeout(60)
def test_config_asks_the_registry(sign_kind):
    with pytest.raises(ValueError, match="the sign source makes only 'sign'"):
        sebulba.Config(env="other", vectorization="test_sign")
    with pytest.raises(ValueError, match="needs an env id"):
        sebulba.Config(env=lambda: None, vectorization="test_sign")
    with pytest.raises(ValueError, match="lockstep needs envs stepped in order"):
        sebulba.Config(env="sign", vectorization="test_sign", lockstep=True, async_factor=1)
    with pytest.raises(ValueError, match="env_wrappers wrap each env.*'sync' or 'async'"):
        sebulba.Config(env="sign", vectorization="test_sign",
                       env_wrappers="FlattenObservation")
    with pytest.raises(ValueError, match="registered already"):
        registry.register(SIGN)
    registry.unregister(SIGN.name)
    with pytest.raises(ValueError, match=r"must be one of \('sync', .*'pettingzoo'\)"):
        sebulba.Config(env="sign", vectorization="test_sign")


@pytest.mark.timeout(60)
def test_the_shipped_kinds_say_what_they_support():
    assert registry.names()[:6] == ("sync", "async", "vector_entry_point", "envpool",
                                    "envpool_async", "pettingzoo")
    each_env = [k for k in registry.names() if registry.get(k).wraps_each_env]
    assert each_env == ["sync", "async"]
    assert [k for k in registry.names()[:6] if not registry.get(k).steps_in_order] == [
        "envpool_async"]
    assert registry.get("pettingzoo").multi_agent
    # every shipped kind is evaluated by one of its own process (async: by sync)
    assert {k: registry.get(k).evaluate_as for k in registry.names()[:6]} == {
        "sync": "sync", "async": "sync", "vector_entry_point": "vector_entry_point",
        "envpool": "envpool", "envpool_async": "envpool", "pettingzoo": "pettingzoo"}
    assert sebulba.Config(vectorization="async").action_poll_seconds == 0.0
    assert sebulba.Config(vectorization="sync").action_poll_seconds > 0.0


@pytest.mark.timeout(60)
def test_atari_by_its_vector_entry_point_gives_game_scores_not_clipped_rewards():
    # ale-py's vector env clips rewards to [-1, 1] by default; Space Invaders' aliens are
    # worth 5 to 30 points, and the returns every other source reports are game scores.
    pytest.importorskip("ale_py", reason="Atari envs need the atari extra (ale-py)")
    from sebulba.envs.gymnasium_source import make_vector_env

    vec = make_vector_env("ALE/SpaceInvaders-v5", 4, "vector_entry_point")
    try:
        vec.reset(seed=0)
        rng = np.random.default_rng(0)
        rewards = set()
        for _ in range(400):
            _, reward, *_ = vec.step(rng.integers(0, vec.single_action_space.n, 4))
            rewards.update(reward.tolist())
        assert max(rewards) >= 5, sorted(rewards)
    finally:
        vec.close()


@pytest.mark.timeout(60)
def test_a_source_that_fails_to_wrap_its_vector_env_leaves_no_worker(monkeypatch,
                                                                    no_leftovers):
    # Say the source refuses what the vector env holds: its async workers must end with
    # the error, not when the garbage collector finds the vector env.
    from sebulba.envs import gymnasium_source

    class Refusing(gymnasium_source.VectorEnvSource):
        def __init__(self, vec, *args, **kwargs):
            raise ValueError("refused")

    monkeypatch.setattr(gymnasium_source, "VectorEnvSource", Refusing)
    request = SourceRequest("CartPole-v1", {}, 2, num_groups=2, seed=0)
    with pytest.raises(ValueError, match="refused") as raised:
        registry.get("async").make_sources(request)
    # while the traceback, which holds the vector env, is still alive
    assert raised.traceback and multiprocessing.active_children() == []


class CloseFailsSignSource(SignSource):
    def close(self) -> None:
        raise OSError("this source's close failed too")


@pytest.mark.timeout(60)
def test_a_failed_construction_raises_its_own_error_though_a_close_fails(sign_kind, caplog,
                                                                        no_leftovers):
    """Two sources for a device that asked for one group: the loop's error names that,
    and the sources it closes on the way, whose close fails, do not replace it."""
    registry.register(dataclasses.replace(SIGN, make_sources=lambda r: [
        CloseFailsSignSource(1, r.group_size, r.seed),
        CloseFailsSignSource(1, r.group_size, r.seed)]), replace=True)
    config = sebulba.Config(env="sign", vectorization="test_sign", envs_per_group=4,
                            async_factor=1, steps_per_cycle=4)
    loop = sebulba.Sebulba(SPG(config.env_spec(), SPGConfig(hidden_sizes=(8,))), config)
    with pytest.raises(ValueError, match="made sources of 2 groups for device"):
        loop.run(64)
    closes = [r for r in caplog.records if r.getMessage() == "closing an env failed"]
    assert [str(r.exc_info[1]) for r in closes] == ["this source's close failed too"] * 2
