"""Checks of what envs return, where it enters the framework (`Config.check_env_output`).

Left alone, bad env output surfaces far from its cause: numpy stores a reward of None as
NaN and a flag of None as False, an old-API step (four values) fails inside gymnasium's
vector env as an unpacking error, an observation of the wrong shape as gymnasium's
"Output array is the wrong shape", and NaN observations or rewards as the learner's NaN
loss updates later. Here each is a `BadEnvOutput` naming the env, which of the source's
envs it is, its step and the field.

Two kinds of check, each where it is cheapest:
- `CheckedEnv` wraps each env of a "sync" or "async" vector env (in an async worker, the
  check runs in the worker): the step's and reset's form, the types of reward and flags
  (before numpy converts them), a finite reward and the observation's shape and dtype
  (`ObservationForm`), one env at a time. The PettingZoo source checks its agents'
  fields with the same functions.
- `BatchCheck` runs on the rows a source's `recv` returns: the observation batch's shape,
  finite float observations and (where no `CheckedEnv` did) rewards, with one reduction
  per array; only when one fails are the env and entry looked for.

A step number n is the env's output after its n-th action: 0 is its first reset, and
the reset that follows an episode's end (NEXT_STEP autoreset) counts as a step.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import gymnasium as gym
import numpy as np

from sebulba.envs import observations
from sebulba.types import EnvStep

# The common types of a reward and of a terminated/truncated flag, recognized without a
# numpy call; any other value is judged by `reward_problem` / `flag_problem`.
_REWARD_TYPES = frozenset({float, int, np.float64, np.float32, np.int64, np.int32})
_FLAG_TYPES = frozenset({bool, np.bool_})
_INT_TYPES = frozenset({int, np.int64, np.int32})
_STEP_FIELDS = "(observation, reward, terminated, truncated, info)"
# The largest reward magnitude the rows hold (float32): `-LIMIT <= r <= LIMIT` is also
# False for NaN, so one chained comparison checks a reward.
REWARD_LIMIT = float(np.finfo(np.float32).max)


class BadEnvOutput(ValueError):
    """An env returned what the framework cannot take: its message names the env, which
    env of its source it is, the step and the field (also attributes, None if unknown)."""

    def __init__(self, message: str, *, env: str | None = None, place: str | None = None,
                 step: int | None = None, field: str | None = None):
        super().__init__(message)
        # Attributes, not arguments: an error raised in an async worker is pickled, and
        # pickling rebuilds an exception from its message alone.
        self.env, self.place, self.step, self.field = env, place, step, field


def env_name(env: Any) -> str:
    """How messages name the run's env: an id quoted, a factory by its function's name."""
    if isinstance(env, str):
        return repr(env)
    func = env.func if isinstance(env, functools.partial) else env
    return f"made by {getattr(func, '__qualname__', None) or repr(func)}"


def bad_output(env: str, place: str, step: int, field: str, problem: str) -> BadEnvOutput:
    return BadEnvOutput(f"env {env} ({place}), step {step}: {field} {problem}",
                        env=env, place=place, step=step, field=field)


def _shown(value: Any) -> str:
    text = repr(value)
    text = text if len(text) <= 80 else text[:77] + "..."
    return f"{text} ({type(value).__name__})"


def step_problem(result: Any) -> str | None:
    """What is wrong with the form of an env's step result, or None."""
    if isinstance(result, tuple | list) and len(result) == 5:
        return None
    if isinstance(result, tuple | list) and len(result) == 4:
        return (f"is 4 values, {_shown(result)}: the old gym API's (observation, reward, "
                f"done, info); gymnasium's step returns 5, {_STEP_FIELDS}, with done split "
                "into terminated and truncated")
    return f"is {_shown(result)}; expected gymnasium's 5 values {_STEP_FIELDS}"


def reset_problem(result: Any) -> str | None:
    """What is wrong with the form of an env's reset result, or None."""
    if isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], dict):
        return None
    return (f"is {_shown(result)}; expected gymnasium's pair (observation, info dict) (the "
            "old gym API's reset returned the observation alone)")


class ObservationForm:
    """What an env's observations must be to enter the rows: of the observation space's
    `shape`, and of a dtype numpy casts to the space's with same_kind casting (float64
    into float32, not floats into uint8 frames), as gymnasium's "sync" vector env
    requires; an async worker's or a PettingZoo row's write would cast any other
    silently (floats in [0, 1) into uint8 zeros). `dtypes` keeps those seen to cast."""

    def __init__(self, space: gym.Space):
        self.shape = tuple(space.shape or ())
        self.dtype = None if space.dtype is None else np.dtype(space.dtype)
        self.dtypes = {self.dtype}

    def dtype_ok(self, dtype: np.dtype) -> bool:
        if dtype in self.dtypes:
            return True
        if self.dtype is not None and not np.can_cast(dtype, self.dtype, "same_kind"):
            return False
        self.dtypes.add(dtype)
        return True


def observation_problem(obs: Any, form: ObservationForm) -> str | None:
    """What is wrong with one env's observation for a space of `form`, or None."""
    try:
        got = np.shape(obs)
    except ValueError:  # a ragged nesting of sequences
        got = None
    if got != form.shape:
        return (f"has shape {got}, expected {form.shape} (the observation space's): "
                f"{_shown(obs)}")
    dtype = obs.dtype if isinstance(obs, np.ndarray) else np.asarray(obs).dtype
    if form.dtype is not None and dtype.kind != "O" and not form.dtype_ok(dtype):
        return (f"has dtype {dtype}, which the observation space's {form.dtype} cannot "
                f"hold without changing values (numpy's same_kind casting): {_shown(obs)}")
    return None


def reward_problem(reward: Any) -> str | None:
    """What is wrong with one env's reward, or None: it must be a finite real number."""
    if reward is None:
        return ("is None; expected a real number (a vector env's reward array would hold it "
                "as NaN)")
    if not (np.ndim(reward) == 0 and np.asarray(reward).dtype.kind in "biuf"):
        return f"is {_shown(reward)}; expected a real number"
    if not np.isfinite(reward):
        return f"is {reward}; expected a finite number"
    if not -REWARD_LIMIT <= reward <= REWARD_LIMIT:
        return (f"is {reward}, beyond float32's range (the rows hold rewards as float32: "
                "it would be inf); scale it down")
    return None


def flag_problem(flag: Any) -> str | None:
    """What is wrong with a terminated or truncated flag, or None: a bool, or 0 or 1."""
    if np.ndim(flag) == 0 and (np.asarray(flag).dtype.kind == "b" or (
            np.asarray(flag).dtype.kind in "iu" and flag in (0, 1))):
        return None
    silently = " (a vector env's flag array would hold it as False)" if flag is None else ""
    return f"is {_shown(flag)}; expected a bool{silently}"


def fields_ok(obs: Any, reward: Any, terminated: Any, truncated: Any,
              form: ObservationForm) -> bool:
    """Whether a step's fields have the common types and the observation `form`, decided
    without a numpy call (but the first time a dtype is seen). False is no verdict: ask
    the `*_problem` functions."""
    return (reward.__class__ in _REWARD_TYPES and terminated.__class__ in _FLAG_TYPES
            and truncated.__class__ in _FLAG_TYPES
            and ((obs.__class__ is np.ndarray and obs.shape == form.shape
                  and form.dtype_ok(obs.dtype))
                 or (form.shape == () and obs.__class__ in _INT_TYPES)))


def first_field_problem(obs: Any, reward: Any, terminated: Any, truncated: Any,
                        form: ObservationForm) -> tuple[str, str] | None:
    """(field, problem) of the first bad field of a step, or None."""
    for field, problem in (("observation", observation_problem(obs, form)),
                           ("reward", reward_problem(reward)),
                           ("terminated", flag_problem(terminated)),
                           ("truncated", flag_problem(truncated))):
        if problem is not None:
            return field, problem
    return None


class CheckedEnv(gym.Wrapper):
    """One env of a vector env, its outputs checked as they leave it (`BadEnvOutput`),
    its reward's finiteness and range included (one comparison here costs less than a
    numpy call on the batch).

    Sits inside sebulba's own `DesyncFirstEpisode`, around the env and the user's
    wrappers, so it sees what they return. The common case costs a few attribute and type
    tests per step; anything unusual goes through the `*_problem` functions.
    """

    def __init__(self, env: gym.Env, name: str, index: int, num_envs: int):
        super().__init__(env)
        self._name = name
        self._place = f"env {index} of the {num_envs} in its group"
        self._form = ObservationForm(env.observation_space)
        self._shape, self._dtypes = self._form.shape, self._form.dtypes
        self._step = -1  # the first reset's output is step 0

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        result = self.env.reset(seed=seed, options=options)
        self._step += 1
        problem = reset_problem(result)
        if problem is not None:
            raise bad_output(self._name, self._place, self._step, "reset's result", problem)
        problem = observation_problem(result[0], self._form)
        if problem is not None:
            raise bad_output(self._name, self._place, self._step, "observation", problem)
        return result

    def step(self, action):
        result = self.env.step(action)
        self._step += 1
        try:
            obs, reward, terminated, truncated, _ = result
        except (TypeError, ValueError):
            raise bad_output(self._name, self._place, self._step, "step's result",
                             step_problem(result)) from None
        # Three tiers, each costlier and rarer than the one before: Python's own types
        # (most envs'), checked by identity; the other common types (`fields_ok`); the
        # `*_problem` functions, which name what is wrong. A reward is finite and in
        # float32's range in one comparison (`REWARD_LIMIT`). This runs at every env
        # step, for "sync" in the inferencer thread.
        if not (reward.__class__ is float and terminated.__class__ is bool
                and truncated.__class__ is bool and obs.__class__ is np.ndarray
                and obs.shape == self._shape and obs.dtype in self._dtypes
                and -REWARD_LIMIT <= reward <= REWARD_LIMIT) and not (
                fields_ok(obs, reward, terminated, truncated, self._form)
                and -REWARD_LIMIT <= reward <= REWARD_LIMIT):
            bad = first_field_problem(obs, reward, terminated, truncated, self._form)
            if bad is not None:
                raise bad_output(self._name, self._place, self._step, *bad)
        return result


class BatchCheck:
    """The rows a source's `recv` returns: the observations' shape, and finite float
    observations and (unless `rewards` is False: each env's step checked its own) rewards.

    `place(i)` names env i of the source (its id in `recv`). The check counts each env's
    outputs to name the step: a source whose recv returns every env in id order passes
    `ids=None` (one count for all); one that returns any of its envs passes their ids,
    kept and counted in bulk every `_FOLD` calls, which costs a list append a call.
    """

    _FOLD = 1024

    def __init__(self, env: str, observation_space: gym.Space, num_envs: int,
                 place: Callable[[int], str], rewards: bool = True):
        self.env, self._place, self._rewards = env, place, rewards
        self._shape = tuple(observation_space.shape or ())
        dtype = observations.host_dtype(observation_space)
        self._float_obs = dtype.kind == "f"
        self._narrowed = np.dtype(observation_space.dtype) != dtype  # float64 -> float32
        self._calls = 0  # calls with every env
        self._counts = np.zeros(num_envs, np.int64)  # outputs of each env, folded
        self._unfolded: list[np.ndarray] = []  # ids of the calls since the last fold

    def __call__(self, env_step: EnvStep, ids: np.ndarray | None = None) -> None:
        obs, reward = env_step.obs, env_step.reward
        # A sum of squares (`vdot`: one numpy call, the cheapest reduction of a small
        # array) is finite exactly when every entry is, unless it overflows (entries beyond
        # 1e19 in float32), which the search for the bad entry then clears. In the acting
        # loop each numpy call costs 1 to 2 us (cold caches): these are the check's cost.
        if (obs.shape[1:] != self._shape
                or (self._float_obs and not math.isfinite(np.vdot(obs, obs)))
                or (self._rewards and not math.isfinite(np.vdot(reward, reward)))):
            self._raise_if_bad(obs, reward, ids)
        if ids is None:
            self._calls += 1
        else:
            self._unfolded.append(ids)
            if len(self._unfolded) == self._FOLD:
                self._fold()

    def step(self, env: int) -> int:
        """The step of env `env`'s output that the next call checks."""
        self._fold()
        return self._calls + int(self._counts[env])

    def _fold(self) -> None:
        if self._unfolded:
            ids = np.concatenate(self._unfolded)
            self._counts += np.bincount(ids, minlength=len(self._counts))
            self._unfolded.clear()

    def _raise_if_bad(self, obs: np.ndarray, reward: np.ndarray,
                      ids: np.ndarray | None) -> None:
        def bad(row: int, field: str, problem: str) -> BadEnvOutput:
            env = row if ids is None else int(ids[row])
            return bad_output(self.env, self._place(env), self.step(env), field, problem)

        if obs.shape[1:] != self._shape:
            raise BadEnvOutput(
                f"env {self.env}: its source's observations have shape {obs.shape}, "
                f"expected ({len(obs)}, *{self._shape}) (rows, then the observation "
                "space's shape)", env=self.env, field="observation")
        finite_reward = np.isfinite(reward)
        finite_obs = (np.isfinite(obs).reshape(len(obs), -1).all(axis=1) if self._float_obs
                      else np.ones(len(obs), bool))
        rows = np.flatnonzero(~(finite_obs & finite_reward))
        if not len(rows):
            return
        # Of several bad envs, name the one of lowest id: the same whatever order the
        # source returned them in.
        row = int(rows[0] if ids is None else rows[np.argmin(ids[rows])])
        if not finite_obs[row]:
            entry = tuple(int(i) for i in np.argwhere(~np.isfinite(obs[row]))[0])
            value = obs[row][entry]
            narrowed = (" (the env's float64 observations are float32 here: inf beyond its "
                        "range)") if self._narrowed and np.isinf(value) else ""
            raise bad(row, "observation", f"holds {value} at index {list(entry)}; expected "
                      f"finite values{narrowed}")
        raise bad(row, "reward", f"is {reward[row]}; expected a finite number")
