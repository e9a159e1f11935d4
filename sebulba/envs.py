"""Gymnasium vector envs for env groups, and the host side of one env step."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import gymnasium as gym
import numpy as np

from sebulba import observations
from sebulba.types import EnvSpec, EnvStep

EnvFactory = Callable[[], gym.Env]
VECTORIZATIONS = ("sync", "async", "vector_entry_point")


def check_spaces(observation_space: gym.Space, action_space: gym.Space) -> None:
    """Raises ValueError unless the spaces are ones the framework batches."""
    observations.kind(observation_space)  # names the space and the wrapper to use
    if not isinstance(action_space, gym.spaces.Discrete | gym.spaces.Box):
        raise ValueError(
            f"unsupported action space {action_space!r}: expected gymnasium.spaces.Discrete or Box"
        )
    if isinstance(action_space, gym.spaces.Discrete) and int(action_space.start) != 0:
        raise ValueError(f"unsupported action space {action_space!r}: Discrete must start at 0")


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


def env_spec(
    env: str | EnvFactory,
    env_kwargs: Mapping[str, Any] | None = None,
    vectorization: str = "sync",
) -> EnvSpec:
    """Makes one env to read its spaces, then closes it.

    With "vector_entry_point" the spaces are those of the id's own vector env, which may
    preprocess (ale-py's AtariVectorEnv emits 84 x 84 grayscale stacks, not RGB frames).
    """
    if isinstance(env, str):
        register_env_family(env)
    if isinstance(env, str) and vectorization == "vector_entry_point":
        vec = gym.make_vec(env, 1, "vector_entry_point", **(env_kwargs or {}))
        try:
            check_spaces(vec.single_observation_space, vec.single_action_space)
            return EnvSpec(vec.single_observation_space, vec.single_action_space)
        finally:
            vec.close()
    single = gym.make(env, **(env_kwargs or {})) if isinstance(env, str) else env()
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


def check_desync(env: str | EnvFactory, env_kwargs: Mapping[str, Any] | None = None) -> None:
    """Raises ValueError, naming the env, if it has no episode step limit to desync with."""
    single = gym.make(env, **(env_kwargs or {})) if isinstance(env, str) else env()
    try:
        DesyncFirstEpisode(single)
    finally:
        single.close()


def _desynced(env: EnvFactory) -> gym.Env:
    return DesyncFirstEpisode(env())


def make_vector_env(
    env: str | EnvFactory,
    num_envs: int,
    vectorization: str,
    env_kwargs: Mapping[str, Any] | None = None,
    async_context: str = "spawn",
    desync_episodes: bool = False,
) -> gym.vector.VectorEnv:
    """Makes the vector env of one env group, with NEXT_STEP autoreset.

    Async (subprocess) envs start their workers with `async_context`; "spawn" by
    default because forking a process that runs JAX threads can deadlock the child.
    With `desync_episodes` each env is wrapped in `DesyncFirstEpisode`.
    """
    kwargs = dict(env_kwargs or {})
    next_step = gym.vector.AutoresetMode.NEXT_STEP
    if desync_episodes and vectorization == "vector_entry_point":
        raise ValueError("desync_episodes needs vectorization 'sync' or 'async', "
                         "got 'vector_entry_point'")
    if isinstance(env, str):
        register_env_family(env)
        vector_kwargs: dict[str, Any] = {}
        if vectorization != "vector_entry_point":
            vector_kwargs["autoreset_mode"] = next_step
        if vectorization == "async":
            vector_kwargs["context"] = async_context
        wrappers = [DesyncFirstEpisode] if desync_episodes else None
        vec = gym.make_vec(env, num_envs, vectorization, vector_kwargs=vector_kwargs,
                           wrappers=wrappers, **kwargs)
    elif desync_episodes:
        return make_vector_env(functools.partial(_desynced, env), num_envs, vectorization,
                               None, async_context)
    elif vectorization == "sync":
        vec = gym.vector.SyncVectorEnv([env] * num_envs, autoreset_mode=next_step)
    elif vectorization == "async":
        vec = gym.vector.AsyncVectorEnv(
            [env] * num_envs, autoreset_mode=next_step, context=async_context
        )
    else:
        raise ValueError(f"vectorization {vectorization!r} needs an env id, not a factory")
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


class HostEnvStepper:
    """Steps one vector env on the host and tracks episode starts and returns.

    Turns gymnasium's (obs, reward, terminated, truncated) into `EnvStep`s with fixed
    dtypes (so the compiled acting step never retraces) and the `first` flag.
    """

    def __init__(self, vec: gym.vector.VectorEnv):
        self.vec = vec
        self.num_envs = vec.num_envs
        self._obs_dtype = observations.host_dtype(vec.single_observation_space)
        self._was_last = np.ones(self.num_envs, bool)
        self._returns = np.zeros(self.num_envs, np.float64)
        self._lengths = np.zeros(self.num_envs, np.int64)

    def reset(self, seed: int) -> EnvStep:
        obs, _ = self.vec.reset(seed=seed)
        n = self.num_envs
        self._was_last[:] = True
        zeros = np.zeros(n, bool)
        return self._env_step(obs, np.zeros(n, np.float32), zeros, zeros)

    def step(self, action: np.ndarray) -> tuple[EnvStep, list[tuple[float, int]]]:
        """Returns the next EnvStep and the (return, length) of episodes that ended."""
        obs, reward, terminated, truncated, _ = self.vec.step(action)
        env_step = self._env_step(obs, reward, terminated, truncated)
        first = env_step.first
        self._returns = np.where(first, 0.0, self._returns + env_step.reward)
        self._lengths = np.where(first, 0, self._lengths + 1)
        last = self._was_last
        if not last.any():
            return env_step, []
        returns, lengths = self._returns[last].tolist(), self._lengths[last].tolist()
        return env_step, list(zip(returns, lengths, strict=True))

    def _env_step(self, obs, reward, terminated, truncated) -> EnvStep:
        first = self._was_last
        terminated = np.asarray(terminated, bool)
        truncated = np.asarray(truncated, bool)
        self._was_last = terminated | truncated
        obs = np.asarray(obs, self._obs_dtype)
        return EnvStep(obs, np.asarray(reward, np.float32), terminated, truncated, first)


def example_env_step(spec: EnvSpec, num_envs: int) -> EnvStep:
    """A zero EnvStep with the shapes and dtypes `HostEnvStepper` produces."""
    obs_dtype = observations.host_dtype(spec.observation_space)
    flags = np.zeros(num_envs, bool)
    return EnvStep(
        obs=np.zeros((num_envs,) + spec.obs_shape, obs_dtype),
        reward=np.zeros(num_envs, np.float32),
        terminated=flags,
        truncated=flags,
        first=flags,
    )
