"""Gymnasium vector envs for env groups, and the host side of one env step."""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import gymnasium as gym
import numpy as np

from sebulba import observations
from sebulba.async_workers import (
    AsyncVectorEnv,
    check_main_guard,
    env_worker,
    named_worker_deaths,
)
from sebulba.types import EnvSpec, EnvStep
from sebulba.wrappers import EnvWrapper, parse_wrappers, wrapper_function

EnvFactory = Callable[[], gym.Env]
GymEnvSpec = gym.envs.registration.EnvSpec  # a registered id's spec (not sebulba's EnvSpec)
VECTORIZATIONS = ("sync", "async", "vector_entry_point", "envpool", "pettingzoo")
# Vectorizations that make each env themselves, so that wrappers can go around each one.
PER_ENV_VECTORIZATIONS = ("sync", "async")


def check_spaces(observation_space: gym.Space, action_space: gym.Space) -> None:
    """Raises ValueError unless the spaces are ones the framework batches."""
    observations.kind(observation_space)  # names the space and the wrapper to use
    if not isinstance(action_space, gym.spaces.Discrete | gym.spaces.MultiDiscrete
                      | gym.spaces.Box):
        raise ValueError(f"unsupported action space {action_space!r}: expected gymnasium."
                         "spaces.Discrete, MultiDiscrete or Box")
    if isinstance(action_space, gym.spaces.Discrete) and int(action_space.start) != 0:
        raise ValueError(f"unsupported action space {action_space!r}: Discrete must start at 0")
    if isinstance(action_space, gym.spaces.MultiDiscrete) and (
            np.ndim(action_space.nvec) != 1 or np.any(action_space.start != 0)):
        raise ValueError(f"unsupported action space {action_space!r}: MultiDiscrete must be "
                         "one-dimensional and start at 0")


def action_to_env(action_space: gym.Space) -> Callable[[np.ndarray], np.ndarray]:
    """What the env boundary does to the agents' actions [E, *shape] before an env sees them.

    Box: non-finite actions (a diverged policy) are an error here, before they reach the
    env (MuJoCo would integrate them into NaN states); finite ones are clipped to the
    space's bounds. The trajectory keeps the unclipped action, whose log-probability the
    agent recorded. Discrete and MultiDiscrete actions pass unchanged.
    """
    if not isinstance(action_space, gym.spaces.Box):
        return lambda action: action
    low, high = action_space.low, action_space.high

    def to_env(action: np.ndarray) -> np.ndarray:
        finite = np.isfinite(action)
        if not finite.all():
            rows = np.flatnonzero(~finite.reshape(len(action), -1).all(axis=1)).tolist()
            raise FloatingPointError(
                f"the policy produced non-finite actions for envs {rows[:8]} (e.g. "
                f"{action[rows[0]]!r}) in {action_space!r}: the networks have probably "
                "diverged (see the learner's metrics: loss, entropy)")
        return np.clip(action, low, high)

    return to_env


def register_env_family(env_id: str) -> None:
    """Registers the envs an id needs that gymnasium does not ship (Atari: ale-py)."""
    if env_id.startswith("ALE/"):
        try:
            import ale_py
        except ImportError:
            raise ImportError(
                f"env {env_id!r} needs ale-py: pip install 'sebulba[atari]'"
            ) from None
        gym.register_envs(ale_py)


def check_env_id(env: str, vectorization: str = "sync") -> None:
    """ValueError naming `env` unless it names an env `vectorization` can make.

    Reads registries and imports the module of a `module:Id` id (as making the env would),
    but makes no env, so a misspelt id fails in a fraction of a second.
    """
    if vectorization == "envpool":
        from sebulba.envpool_source import check_task_id

        try:
            check_task_id(env)
        except ValueError as e:
            raise ValueError(f"env {env!r}: {e}") from None
        return
    if vectorization == "pettingzoo":
        try:
            importlib.import_module(env)
        except ImportError as e:
            raise ValueError(
                f"env {env!r} is not an importable PettingZoo env module (e.g. "
                f"'mpe2.simple_spread_v3'): {e}") from None
        return
    try:
        register_env_family(env)
    except ImportError as e:
        raise ValueError(str(e)) from None
    # gymnasium's `module:Id` form: importing the module registers the id.
    module, name = env.split(":", 1) if ":" in env else (None, env)
    if module is not None:
        try:
            importlib.import_module(module)
        except ImportError as e:
            raise ValueError(
                f"env {env!r}: importing {module!r}, which the `module:Id` form imports to "
                f"register {name!r}, failed: {e}") from None
    try:
        spec = _find_spec(name)
    except gym.error.Error as e:
        reason = str(e).rstrip(".")
        if module is None and "Did you mean" not in reason:
            reason += " (an id that a module registers takes the form 'module:Id')"
        raise ValueError(f"env {env!r} is not a registered gymnasium id: {reason}") from None
    if vectorization == "vector_entry_point" and spec.vector_entry_point is None:
        raise ValueError(f"env {env!r} has no vectorized version of its own, so vectorization "
                         "'vector_entry_point' cannot make it; use 'sync' or 'async'")


def _find_spec(env: str) -> GymEnvSpec:
    """The registered spec of a gymnasium id, as gym.make finds it: `module:Id` imports the
    module, an unversioned name means its latest version."""
    if ":" in env:
        module, env = env.split(":", 1)
        importlib.import_module(module)
    from gymnasium.envs.registration import find_highest_version, parse_env_id

    namespace, name, version = parse_env_id(env)
    latest = find_highest_version(namespace, name)
    if version is None and latest is not None:
        env = f"{env}-v{latest}"
    return gym.spec(env)


def check_env_kwargs(env: str, env_kwargs: Mapping[str, Any], make: Callable[[], Any]) -> Any:
    """`make()`, with a constructor's complaint about `env_kwargs` as a ValueError naming
    them (a TypeError from deeper inside the env is a bug there and passes unchanged)."""
    try:
        return make()
    except TypeError as e:
        if env_kwargs and "keyword argument" in str(e):
            raise ValueError(
                f"env_kwargs {dict(env_kwargs)!r} do not fit env {env!r}: {e}") from None
        raise


def make_env(
    env: str | GymEnvSpec | EnvFactory,
    env_kwargs: Mapping[str, Any] | None = None,
    env_wrappers: Sequence[EnvWrapper] = (),
    **make_kwargs: Any,
) -> gym.Env:
    """One env: `gym.make(env, **env_kwargs, **make_kwargs)` for an id (or its gymnasium
    spec), `env()` for a factory, then `env_wrappers` applied in order (the first is
    innermost)."""
    if isinstance(env, str | GymEnvSpec):
        if isinstance(env, str):
            register_env_family(env)
        kwargs = dict(env_kwargs or {})
        name = env if isinstance(env, str) else env.id
        single = check_env_kwargs(name, kwargs, lambda: gym.make(env, **kwargs, **make_kwargs))
    else:
        single = env()
    for wrapper in env_wrappers:
        single = wrapper_function(wrapper)(single)
    return single


def _check_wrappable(env_wrappers: Sequence[EnvWrapper], vectorization: str) -> None:
    if env_wrappers and vectorization not in PER_ENV_VECTORIZATIONS:
        raise ValueError(
            f"env_wrappers wrap each env, so they need vectorization 'sync' or 'async', got "
            f"{vectorization!r}")


def env_spec(
    env: str | EnvFactory,
    env_kwargs: Mapping[str, Any] | None = None,
    vectorization: str = "sync",
    agent_ids: bool = False,
    env_wrappers: Sequence[EnvWrapper] = (),
) -> EnvSpec:
    """Makes one env to read its spaces, then closes it.

    With "vector_entry_point" the spaces are those of the id's own vector env, which may
    preprocess (ale-py's AtariVectorEnv emits 84 x 84 grayscale stacks, not RGB frames).
    With "pettingzoo" they are one agent's (`sebulba.multiagent.parallel_env_spec`; with
    `agent_ids`, extended by the agent's one-hot). `env_wrappers` (`parse_wrappers`) wrap
    the env, in order.
    """
    env_wrappers = parse_wrappers(env_wrappers)
    _check_wrappable(env_wrappers, vectorization)
    if vectorization == "pettingzoo":
        from sebulba.multiagent import parallel_env_spec

        return parallel_env_spec(env, env_kwargs, agent_ids)
    if agent_ids:
        raise ValueError(f"agent_ids is for multi-agent envs (vectorization 'pettingzoo'), got "
                         f"vectorization {vectorization!r}")
    if vectorization == "envpool":
        from sebulba.envpool_source import make_pool

        if not isinstance(env, str):
            raise ValueError(f"vectorization 'envpool' needs an EnvPool task id, got {env!r}")
        pool = make_pool(env, 1, 1, 0, env_kwargs)
        try:
            check_spaces(pool.observation_space, pool.action_space)
            return EnvSpec(pool.observation_space, pool.action_space)
        finally:
            pool.close()
    if isinstance(env, str):
        check_env_id(env, vectorization)
    if isinstance(env, str) and vectorization == "vector_entry_point":
        kwargs = dict(env_kwargs or {})
        vec = check_env_kwargs(
            env, kwargs, lambda: gym.make_vec(env, 1, "vector_entry_point", **kwargs))
        try:
            check_spaces(vec.single_observation_space, vec.single_action_space)
            return EnvSpec(vec.single_observation_space, vec.single_action_space)
        finally:
            vec.close()
    single = make_env(env, env_kwargs, env_wrappers)
    try:
        check_spaces(single.observation_space, single.action_space)
        return EnvSpec(single.observation_space, single.action_space)
    finally:
        single.close()


def episode_step_limit(env: gym.Env) -> int | None:
    """The env's episode step limit: its spec's `max_episode_steps` or a TimeLimit's."""
    if env.spec is not None and env.spec.max_episode_steps:
        return int(env.spec.max_episode_steps)
    while isinstance(env, gym.Wrapper):
        if isinstance(env, gym.wrappers.TimeLimit):
            return int(env._max_episode_steps)
        env = env.env
    return None


class DesyncFirstEpisode(gym.Wrapper):
    """Truncates the first episode at a length drawn uniformly from 1..`max_episode_steps`.

    Envs reset together stay in phase until their episodes end at different times; a
    random cut of the first episode spreads their phases over the episode length from
    the second episode on. Later episodes are untouched. The length is drawn from the
    seed of the first reset (vector envs give env i seed + i), so runs repeat.
    """

    def __init__(self, env: gym.Env, max_episode_steps: int | None = None):
        super().__init__(env)
        limit = max_episode_steps or episode_step_limit(env)
        if not limit:
            raise ValueError(
                f"desync_episodes needs an episode step limit, and {env} has none: register "
                "the id with max_episode_steps or wrap the env in gymnasium.wrappers.TimeLimit")
        self.max_episode_steps = limit
        self.first_episode_length: int | None = None  # drawn at the first reset
        self._in_first = False
        self._t = 0

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        obs, info = self.env.reset(seed=seed, options=options)
        if self.first_episode_length is None:
            # Its own generator, so the env's randomness is the same with and without desync.
            rng = np.random.default_rng(None if seed is None else [seed, 0xDE5C])
            self.first_episode_length = int(rng.integers(1, self.max_episode_steps + 1))
            self._in_first = True
        else:
            self._in_first = False
        self._t = 0
        return obs, info

    def step(self, action):
        obs, reward, terminated, truncated, info = self.env.step(action)
        self._t += 1
        if self._in_first:
            truncated = truncated or (self._t >= self.first_episode_length and not terminated)
            self._in_first = not (terminated or truncated)
        return obs, reward, terminated, truncated, info


def check_desync(env: str | EnvFactory, env_kwargs: Mapping[str, Any] | None = None,
                 env_wrappers: Sequence[EnvWrapper] = ()) -> None:
    """Raises ValueError, naming the env, if it has no episode step limit to desync with."""
    single = make_env(env, env_kwargs, parse_wrappers(env_wrappers))
    try:
        DesyncFirstEpisode(single)
    finally:
        single.close()


def _make_single(env: str | GymEnvSpec | EnvFactory, env_kwargs: Mapping[str, Any] | None,
                 env_wrappers: Sequence[EnvWrapper], desync_episodes: bool) -> gym.Env:
    """One env of a vector env (in a worker process for "async")."""
    single = make_env(env, env_kwargs, env_wrappers)
    return DesyncFirstEpisode(single) if desync_episodes else single


def make_vector_env(
    env: str | EnvFactory,
    num_envs: int,
    vectorization: str,
    env_kwargs: Mapping[str, Any] | None = None,
    async_context: str = "spawn",
    desync_episodes: bool = False,
    env_wrappers: Sequence[EnvWrapper] = (),
) -> gym.vector.VectorEnv:
    """Makes the vector env of one env group, with NEXT_STEP autoreset.

    Async (subprocess) envs start their workers with `async_context`; "spawn" by
    default because forking a process that runs JAX threads can deadlock the child.
    Each env is wrapped in `env_wrappers` (in order), then with `desync_episodes` in
    `DesyncFirstEpisode`.
    """
    kwargs = dict(env_kwargs or {})
    env_wrappers = parse_wrappers(env_wrappers)
    next_step = gym.vector.AutoresetMode.NEXT_STEP
    if desync_episodes and vectorization not in PER_ENV_VECTORIZATIONS:
        raise ValueError("desync_episodes needs vectorization 'sync' or 'async', "
                         f"got {vectorization!r}")
    _check_wrappable(env_wrappers, vectorization)
    if vectorization == "vector_entry_point":
        if not isinstance(env, str):
            raise ValueError(f"vectorization {vectorization!r} needs an env id, not a factory")
        register_env_family(env)
        vec = check_env_kwargs(
            env, kwargs, lambda: gym.make_vec(env, num_envs, vectorization, **kwargs))
    elif vectorization in PER_ENV_VECTORIZATIONS:
        if isinstance(env, str):
            # The id's spec, found here: a worker process then needs no registration of
            # its own (an id the main script registered under its __main__ guard works).
            register_env_family(env)
            make_one = functools.partial(_make_single, _find_spec(env), kwargs, env_wrappers,
                                         desync_episodes)
        elif env_wrappers or desync_episodes:
            make_one = functools.partial(_make_single, env, None, env_wrappers, desync_episodes)
        else:
            make_one = env
        if vectorization == "sync":
            vec = gym.vector.SyncVectorEnv([make_one] * num_envs, autoreset_mode=next_step)
        else:
            check_main_guard(async_context)
            vec = AsyncVectorEnv([make_one] * num_envs, autoreset_mode=next_step,
                                 context=async_context, worker=env_worker)
    else:
        raise ValueError(f"vectorization {vectorization!r} is not one of gymnasium's: "
                         "make_vector_env makes 'sync', 'async' and 'vector_entry_point'")
    mode = vec.metadata.get("autoreset_mode", next_step)
    if mode != next_step:
        vec.close()
        raise ValueError(f"env {env!r} autoresets with {mode}; sebulba needs {next_step}")
    return vec


def close_vector_env(vec: gym.vector.VectorEnv) -> None:
    """Closes a vector env; subprocess workers are terminated, not waited for."""
    if isinstance(vec, gym.vector.AsyncVectorEnv):
        vec.close(terminate=True)
    else:
        vec.close()


class EpisodeTracker:
    """Per-env episode starts, returns and lengths for envs addressed by id.

    Turns an env's (obs, reward, terminated, truncated) rows into `EnvStep` rows with
    fixed dtypes (so the compiled acting step never retraces) and the `first` flag. The
    episodes' returns and lengths are tallied later, when `pop_episodes` asks for the
    episodes that ended (or at the next observe): an acting loop asks while the device
    computes, so the tally stays off the path from one env step to the next.
    """

    def __init__(self, num_envs: int, observation_space: gym.Space):
        self._obs_dtype = observations.host_dtype(observation_space)
        self._was_last = np.ones(num_envs, bool)
        self._acted = np.zeros(num_envs, bool)  # sent an action since the reset
        self._all_acted = False
        self._returns = np.zeros(num_envs, np.float64)
        self._lengths = np.zeros(num_envs, np.int64)
        self._untallied: tuple | None = None  # (ids or None: all, reward, first, last)
        self._ended: list[tuple[float, int]] = []

    def observe(self, ids: np.ndarray, obs, reward, terminated, truncated
                ) -> tuple[EnvStep, int]:
        """(EnvStep rows for `ids`, env steps these rows complete)."""
        self._tally()
        first = self._was_last[ids]
        terminated = np.asarray(terminated, bool)
        truncated = np.asarray(truncated, bool)
        last = terminated | truncated
        self._was_last[ids] = last
        # Copies: the tally comes later, and a source may reuse its buffers.
        reward = np.array(reward, np.float32)
        self._untallied = (ids.copy(), reward, first, last)
        # Once every env has been sent an action (the usual case), each row is a step.
        steps = len(ids) if self._all_acted else int(np.count_nonzero(self._acted[ids]))
        return EnvStep(np.asarray(obs, self._obs_dtype), reward, terminated, truncated,
                       first), steps

    def observe_all(self, obs, reward, terminated, truncated) -> tuple[EnvStep, int]:
        """`observe` for every env in id order (a vector env's step): whole arrays, no
        gathers by id. In the acting loop each numpy call costs 1 to 2 us (the caches
        are cold after an acting call), several times what it costs in a tight loop."""
        self._tally()
        first = self._was_last  # a fresh array each step: `last` below replaces it
        terminated = np.asarray(terminated, bool)
        truncated = np.asarray(truncated, bool)
        last = terminated | truncated
        self._was_last = last
        reward = np.asarray(reward, np.float32)
        self._untallied = (None, reward, first, last)
        steps = len(first) if self._all_acted else int(np.count_nonzero(self._acted))
        return EnvStep(np.asarray(obs, self._obs_dtype), reward, terminated, truncated,
                       first), steps

    def pop_episodes(self) -> list[tuple[float, int]]:
        """(return, length) of the episodes that ended in the rows observed since the last
        call, in the order observed."""
        self._tally()
        ended, self._ended = self._ended, []
        return ended

    def _tally(self) -> None:
        """Adds the last observed rows to their episodes' returns and lengths."""
        if self._untallied is None:
            return
        ids, reward, first, last = self._untallied
        self._untallied = None
        if ids is None:  # every env, in id order: the whole arrays, in place
            returns, lengths = self._returns, self._lengths
        else:
            returns, lengths = self._returns[ids], self._lengths[ids]
        returns += reward
        lengths += 1
        if first.any():  # a reset's row: its reward is not the new episode's
            returns[first] = 0.0
            lengths[first] = 0
        if ids is not None:
            self._returns[ids] = returns
            self._lengths[ids] = lengths
        if last.any():
            self._ended += zip(returns[last].tolist(), lengths[last].tolist(), strict=True)

    def sent(self, ids: np.ndarray) -> None:
        if not self._all_acted:
            self._acted[ids] = True
            self._all_acted = bool(self._acted.all())


class VectorEnvSource:
    """A gymnasium vector env as an env source: one group whose envs step together.

    The env-source interface the inferencers drive (an EnvPool source has the same):
    `reset(seed)`, then alternately `recv() -> (ids, EnvStep, env steps)` and
    `send(actions, ids)`; `num_envs` envs in `num_groups` groups of `group_size`.
    Here recv returns what the last send's step produced, for all envs in id order, and
    `pop_episodes()` the (return, length) of the episodes that ended in it.
    """

    num_groups = 1
    in_order = True

    def __init__(self, vec: gym.vector.VectorEnv):
        self.vec = vec
        self.num_envs = self.group_size = vec.num_envs
        self._ids = np.arange(self.num_envs)
        self._tracker = EpisodeTracker(self.num_envs, vec.single_observation_space)
        self._to_env = action_to_env(vec.single_action_space)
        self._result: tuple | None = None

    def reset(self, seed: int) -> None:
        with named_worker_deaths(self.vec, "resetting its env"):
            obs, _ = self.vec.reset(seed=seed)
        zeros = np.zeros(self.num_envs, bool)
        self._result = (obs, np.zeros(self.num_envs, np.float32), zeros, zeros)

    def recv(self) -> tuple[np.ndarray, EnvStep, int]:
        return (self._ids, *self._tracker.observe_all(*self._result))

    def pop_episodes(self) -> list[tuple[float, int]]:
        return self._tracker.pop_episodes()

    def send(self, actions: np.ndarray, ids: np.ndarray) -> None:
        actions = self._to_env(actions)
        with named_worker_deaths(self.vec, "stepping its env"):
            obs, reward, terminated, truncated, _ = self.vec.step(actions)
        self._tracker.sent(ids)
        self._result = (obs, reward, terminated, truncated)

    def close(self) -> None:
        close_vector_env(self.vec)


def example_env_step(spec: EnvSpec, num_envs: int) -> EnvStep:
    """A zero EnvStep with the shapes and dtypes env sources produce."""
    obs_dtype = observations.host_dtype(spec.observation_space)
    flags = np.zeros(num_envs, bool)
    return EnvStep(
        obs=np.zeros((num_envs,) + spec.obs_shape, obs_dtype),
        reward=np.zeros(num_envs, np.float32),
        terminated=flags,
        truncated=flags,
        first=flags,
    )
