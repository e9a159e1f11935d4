"""Gymnasium envs as env sources: "sync" (envs stepped in the inferencer thread), "async"
(a worker process per env, `async_workers`) and "vector_entry_point" (the id's own vector
env). One vector env is one env group, with NEXT_STEP autoreset; wrappers by name and
`DesyncFirstEpisode` go around each env of the first two."""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import gymnasium as gym
import numpy as np

from sebulba.envs.async_workers import (
    PIPE_ERRORS,
    AsyncVectorEnv,
    check_main_guard,
    env_worker,
    raise_named_worker_death,
)
from sebulba.envs.base import EpisodeTracker, action_to_env, check_spaces
from sebulba.envs.frame_stacks import ale_vector_frame_stack
from sebulba.envs.output_checks import BatchCheck, CheckedEnv, env_name
from sebulba.envs.wrappers import EnvWrapper, parse_wrappers, wrapper_function
from sebulba.types import EnvSpec, EnvStep

EnvFactory = Callable[[], gym.Env]
GymEnvSpec = gym.envs.registration.EnvSpec  # a registered id's spec (not sebulba's EnvSpec)
# Gymnasium's vectorizations that make each env themselves, so wrappers go around each one.
PER_ENV_VECTORIZATIONS = ("sync", "async")


def register_env_family(env_id: str) -> None:
    """Registers the envs an id needs that gymnasium does not ship (Atari: ale-py)."""
    if env_id.startswith("ALE/"):
        try:
            import ale_py
        except ImportError:
            raise ImportError(
                f"env {env_id!r} needs ale-py: pip install -e '.[atari]' in sebulba's checkout"
            ) from None
        gym.register_envs(ale_py)


def check_env_id(env: str, vectorization: str = "sync") -> None:
    """ValueError naming `env` unless it names a gymnasium env `vectorization` can make.

    Reads registries and imports the module of a `module:Id` id (as making the env would),
    but makes no env, so a misspelt id fails in a fraction of a second.
    """
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
        # Where gymnasium names no other id, the env may be one a module registers.
        if module is None and name.startswith("sebulba/"):
            reason += (f" (the module that registers the suite's envs comes first: "
                       f"'sebulba.envs.suite:{name}')")
        elif module is None and not isinstance(e, gym.error.DeprecatedEnv) \
                and "Did you mean" not in reason:
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


def env_spec(
    env: str | EnvFactory,
    env_kwargs: Mapping[str, Any] | None = None,
    vectorization: str = "sync",
    env_wrappers: Sequence[EnvWrapper] = (),
    desync_episodes: bool = False,
) -> EnvSpec:
    """Makes one env to read its spaces, then closes it.

    With "vector_entry_point" the spaces are those of the id's own vector env, which may
    preprocess (ale-py's AtariVectorEnv emits 84 x 84 grayscale stacks, not RGB frames;
    its rewards are the game's, unclipped, unless env_kwargs say reward_clipping=True).
    `env_wrappers` (`parse_wrappers`) wrap the env, in order. With `desync_episodes` the
    env must have an episode step limit to cut its first episode at (ValueError if not).
    """
    env_wrappers = parse_wrappers(env_wrappers)
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
        if desync_episodes:
            DesyncFirstEpisode(single)  # raises unless the env has a step limit
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


def _make_single(env: str | GymEnvSpec | EnvFactory, env_kwargs: Mapping[str, Any] | None,
                 env_wrappers: Sequence[EnvWrapper], desync_episodes: bool,
                 checked: tuple[str, int, int] | None = None) -> gym.Env:
    """One env of a vector env (in a worker process for "async"); with `checked` (the
    env's name, index and the group's size) its outputs are checked (`CheckedEnv`)."""
    single = make_env(env, env_kwargs, env_wrappers)
    if checked is not None:  # inside desync, whose `truncated or ...` would hide a None
        single = CheckedEnv(single, *checked)
    return DesyncFirstEpisode(single) if desync_episodes else single


def make_vector_env(
    env: str | EnvFactory,
    num_envs: int,
    vectorization: str,
    env_kwargs: Mapping[str, Any] | None = None,
    async_context: str = "spawn",
    desync_episodes: bool = False,
    env_wrappers: Sequence[EnvWrapper] = (),
    check_output: bool = False,
) -> gym.vector.VectorEnv:
    """Makes the vector env of one env group, with NEXT_STEP autoreset.

    Async (subprocess) envs start their workers with `async_context`; "spawn" by
    default because forking a process that runs JAX threads can deadlock the child.
    Each env is wrapped in `env_wrappers` (in order), with `check_output` in
    `output_checks.CheckedEnv` ("sync" and "async"), then with `desync_episodes` in
    `DesyncFirstEpisode`.
    """
    kwargs = dict(env_kwargs or {})
    env_wrappers = parse_wrappers(env_wrappers)
    next_step = gym.vector.AutoresetMode.NEXT_STEP
    if desync_episodes and vectorization not in PER_ENV_VECTORIZATIONS:
        raise ValueError("desync_episodes needs vectorization 'sync' or 'async', "
                         f"got {vectorization!r}")
    if env_wrappers and vectorization not in PER_ENV_VECTORIZATIONS:
        raise ValueError("env_wrappers wrap each env, so they need vectorization 'sync' or "
                         f"'async', got {vectorization!r}")
    if vectorization == "vector_entry_point":
        if not isinstance(env, str):
            raise ValueError(f"vectorization {vectorization!r} needs an env id, not a factory")
        register_env_family(env)
        if env.startswith("ALE/"):
            # ale-py's vector env clips rewards to [-1, 1] unless told not to: episode
            # returns would be sums of signs, not game scores (every other source's and
            # the evaluation's). Reward scaling is the agent's.
            kwargs.setdefault("reward_clipping", False)
        vec = check_env_kwargs(
            env, kwargs, lambda: gym.make_vec(env, num_envs, vectorization, **kwargs))
    elif vectorization in PER_ENV_VECTORIZATIONS:
        make_fns = _single_env_factories(env, num_envs, kwargs, env_wrappers, desync_episodes,
                                         check_output)
        if vectorization == "sync":
            vec = gym.vector.SyncVectorEnv(make_fns, autoreset_mode=next_step)
        else:
            check_main_guard(async_context)
            vec = AsyncVectorEnv(make_fns, autoreset_mode=next_step, context=async_context,
                                 worker=env_worker)
    else:
        raise ValueError(f"vectorization {vectorization!r} is not one of gymnasium's: "
                         "make_vector_env makes 'sync', 'async' and 'vector_entry_point'")
    mode = vec.metadata.get("autoreset_mode", next_step)
    if mode != next_step:
        vec.close()
        raise ValueError(f"env {env!r} autoresets with {mode}; sebulba needs {next_step}")
    return vec


def _single_env_factories(env: str | EnvFactory, num_envs: int,
                          env_kwargs: dict[str, Any] | None,
                          env_wrappers: Sequence[EnvWrapper], desync_episodes: bool,
                          check_output: bool) -> list[EnvFactory]:
    """The factory of each env of a "sync" or "async" vector env (picklable for "spawn")."""
    if isinstance(env, str):
        # The id's spec, found here: a worker process then needs no registration of its
        # own (an id the main script registered under its __main__ guard works).
        register_env_family(env)
        made: GymEnvSpec | EnvFactory = _find_spec(env)
        kwargs = env_kwargs
    else:
        made, kwargs = env, None
        if not (env_wrappers or desync_episodes or check_output):
            return [env] * num_envs
    if not check_output:
        return [functools.partial(_make_single, made, kwargs, env_wrappers,
                                  desync_episodes)] * num_envs
    return [functools.partial(_make_single, made, kwargs, env_wrappers, desync_episodes,
                              (env_name(env), i, num_envs)) for i in range(num_envs)]


def close_vector_env(vec: gym.vector.VectorEnv) -> None:
    """Closes a vector env. Subprocess workers (sebulba's `AsyncVectorEnv`) are asked to
    close their envs and killed if they have not within `CLOSE_TIMEOUT_S`; those of
    another AsyncVectorEnv are terminated, not waited for."""
    if isinstance(vec, gym.vector.AsyncVectorEnv) and not isinstance(vec, AsyncVectorEnv):
        vec.close(terminate=True)
    else:
        vec.close()


class VectorEnvSource:
    """A gymnasium vector env as an env source: one group whose envs step together.

    The env-source interface the inferencers drive (an EnvPool source has the same):
    `reset(seed)`, then alternately `recv() -> (ids, EnvStep, env steps)` and
    `send(actions, ids)`; `num_envs` envs in `num_groups` groups of `group_size`.
    Here recv returns what the last send's step produced, for all envs in id order, and
    `pop_episodes()` the (return, length) of the episodes that ended in the rows it
    returned since the last call.
    """

    num_groups = 1
    in_order = True

    def __init__(self, vec: gym.vector.VectorEnv, check_output: bool = False,
                 env: str | EnvFactory | None = None, envs_checked: bool = False):
        self.vec = vec
        self.num_envs = self.group_size = vec.num_envs
        self._ids = np.arange(self.num_envs)
        self.frame_stack = ale_vector_frame_stack(vec)
        # Its close may wait for worker processes (`CLOSE_TIMEOUT_S`, then kills them).
        self.has_worker_processes = isinstance(getattr(vec, "unwrapped", vec),
                                               gym.vector.AsyncVectorEnv)
        self._tracker = EpisodeTracker(self.num_envs, vec.single_observation_space)
        self._to_env = action_to_env(vec.single_action_space)
        self._result: tuple | None = None
        # With `check_output`, recv checks the rows (`output_checks.BatchCheck`): their
        # observations, and their rewards unless `envs_checked` (a vector env made with
        # `make_vector_env(check_output=True)`, whose envs check their own steps, rewards
        # included, in `CheckedEnv`).
        self._check = BatchCheck(
            env_name(env) if env is not None else repr(vec), vec.single_observation_space,
            self.num_envs, lambda i: f"env {i} of the {self.num_envs} in its group",
            rewards=not envs_checked) if check_output else None

    def reset(self, seed: int) -> None:
        try:
            obs, _ = self.vec.reset(seed=seed)
        except PIPE_ERRORS as e:
            raise_named_worker_death(self.vec, "resetting its env", e)
            raise
        self._tracker.restart()
        zeros = np.zeros(self.num_envs, bool)
        self._result = (obs, np.zeros(self.num_envs, np.float32), zeros, zeros)

    def recv(self) -> tuple[np.ndarray, EnvStep, int]:
        env_step, steps = self._tracker.observe_all(*self._result)
        if self._check is not None:
            self._check(env_step)
        return self._ids, env_step, steps

    def pop_episodes(self) -> list[tuple[float, int]]:
        return self._tracker.pop_episodes()

    def render(self) -> np.ndarray | None:
        """The first env's frame (envs made with render_mode="rgb_array"), else None."""
        frames = self.vec.render() if self.vec.render_mode == "rgb_array" else None
        return None if frames is None else np.asarray(frames[0])

    def send(self, actions: np.ndarray, ids: np.ndarray) -> None:
        actions = self._to_env(actions, ids)
        try:
            obs, reward, terminated, truncated, _ = self.vec.step(actions)
        except PIPE_ERRORS as e:
            raise_named_worker_death(self.vec, "stepping its env", e)
            raise
        self._tracker.sent(ids)
        self._result = (obs, reward, terminated, truncated)

    def close(self) -> None:
        close_vector_env(self.vec)
