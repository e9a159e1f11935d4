"""What every env source shares: the protocol inferencer threads drive, and the host side
of one env step (spaces checked, actions to the env, episode bookkeeping)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import gymnasium as gym
import numpy as np

from sebulba.envs import observations
from sebulba.types import EnvSpec, EnvStep


class EnvSource(Protocol):
    """What an inferencer thread drives: `num_groups` env groups of `group_size` envs.

    The thread calls `reset(seed)` once, then alternates `recv()` and `send(actions,
    ids)`: `recv` returns the ids of the envs whose step finished (any `group_size` of
    them, from any group), their `EnvStep` rows and the env steps those rows complete;
    `send` hands those envs their actions. Env `i` belongs to group `i // group_size`.
    When `in_order`, `recv` returns a whole group in id order, the groups in turn (0, 1,
    ..., 0, ...), and `send` takes them in the same turns; with several groups the thread
    receives the next group before it sends the one before (it pipelines them), so such
    a source's envs must step while the thread acts (EnvPool's do, in C++ threads).
    `pop_episodes` may be asked after each recv or after many (an in-order loop asks once
    per cycle, a by-id loop after each recv): a source keeps what it has not been asked.
    Episodes end with gymnasium's NEXT_STEP autoreset:
    the action sent for an episode's last row is ignored, and the env's next row is its
    reset (`first`, reward 0). `EpisodeTracker` builds such rows from an env's own outputs.

    A multi-agent source also has `padding_steps` (rows of agents that left their episode
    while their env went on) and `pop_team_episodes()`, as `pettingzoo_source` does.
    A source whose envs were made with render_mode="rgb_array" may have `render()`: the
    frame of its first env ([H, W, 3] uint8), for evaluation videos. A source whose
    observations are stacks of frames kept by a known rule may have `frame_stack` (a
    `frame_stacks.FrameStack`; None or absent otherwise): the acting loop may then send
    only each observation's newest frame to the device (`Config.stack_frames_on_device`).
    A source whose envs run in worker processes has `has_worker_processes` True: the
    shutdown then gives a stuck group's close the workers' `CLOSE_TIMEOUT_S` to end them.
    """

    num_envs: int
    num_groups: int
    group_size: int
    in_order: bool  # recv returns a whole group, in id order, the groups in turn

    def reset(self, seed: int) -> None:
        """Starts every env anew; called with no step in flight (each send received)."""
    def recv(self) -> tuple[np.ndarray, EnvStep, int]: ...  # ids, their rows, env steps
    def pop_episodes(self) -> list[tuple[float, int]]:
        """(return, length) of the episodes that ended in the rows recv returned since
        the last call."""
    def send(self, actions: np.ndarray, ids: np.ndarray) -> None: ...
    def close(self) -> None: ...


def check_spaces(observation_space: gym.Space, action_space: gym.Space) -> None:
    """Raises ValueError unless the spaces are ones the framework batches."""
    observations.kind(observation_space)  # names the space and the wrapper to use
    observations.host_dtype(observation_space)  # refuses integers beyond 32 bits
    if not isinstance(action_space, gym.spaces.Discrete | gym.spaces.MultiDiscrete
                      | gym.spaces.Box):
        raise ValueError(f"unsupported action space {action_space!r}: expected gymnasium."
                         "spaces.Discrete, MultiDiscrete or Box")
    if isinstance(action_space, gym.spaces.Discrete) and int(action_space.start) != 0:
        raise ValueError(f"unsupported action space {action_space!r}: Discrete must start at "
                         "0 (a gymnasium.ActionWrapper that adds the start maps 0..n-1 to it)")
    if isinstance(action_space, gym.spaces.MultiDiscrete) and (
            np.ndim(action_space.nvec) != 1 or np.any(action_space.start != 0)):
        raise ValueError(f"unsupported action space {action_space!r}: MultiDiscrete must be "
                         "one-dimensional and start at 0")
    if isinstance(action_space, gym.spaces.Box) and action_space.dtype.kind != "f":
        # The agents' Box actions are real numbers: an integer env would get every action
        # off its grid.
        raise ValueError(f"unsupported action space {action_space!r}: a Box of actions must "
                         "hold floats; integer actions are a MultiDiscrete (or a wrapper "
                         "that rounds real actions to the env's integers)")


def action_to_env(action_space: gym.Space
                  ) -> Callable[[np.ndarray, np.ndarray | None], np.ndarray]:
    """What the env boundary does to the agents' actions [E, *shape] before an env sees them:
    `to_env(actions, ids)`, `ids` [E] the source's ids of the envs they are for (None: the
    rows' positions), which an error names.

    Box: non-finite actions (a diverged policy) are an error here, before they reach the
    env (MuJoCo would integrate them into NaN states); finite ones are clipped to the
    space's bounds. The trajectory keeps the unclipped action, whose log-probability the
    agent recorded. Discrete and MultiDiscrete actions pass unchanged.
    """
    if not isinstance(action_space, gym.spaces.Box):
        return lambda action, ids=None: action
    low, high = action_space.low, action_space.high

    def to_env(action: np.ndarray, ids: np.ndarray | None = None) -> np.ndarray:
        finite = np.isfinite(action)
        if not finite.all():
            rows = np.flatnonzero(~finite.reshape(len(action), -1).all(axis=1))
            envs = (rows if ids is None else np.asarray(ids)[rows]).tolist()
            raise FloatingPointError(
                f"the policy produced non-finite actions for envs {envs[:8]} (e.g. "
                f"{action[rows[0]]!r}) in {action_space!r}: the networks have probably "
                "diverged (see the learner's metrics: loss, entropy)")
        return np.clip(action, low, high)

    return to_env


class EpisodeTracker:
    """Per-env episode starts, returns and lengths for envs addressed by id.

    Turns an env's (obs, reward, terminated, truncated) rows into `EnvStep` rows with
    fixed dtypes (so the compiled acting step never retraces) and the `first` flag. The
    episodes' returns and lengths are tallied later, when `pop_episodes` asks for the
    episodes that ended, so the tally stays off the path from one env step to the next:
    rows of every env in order (`observe_all`) wait for it, up to `MAX_PENDING` of them,
    and are tallied together, a few NumPy calls for all of them (an in-order acting loop
    asks once per cycle); rows by id (`observe`) are tallied at the next observe.
    """

    MAX_PENDING = 1024  # in-order rows kept for the tally; more are tallied at observe

    def __init__(self, num_envs: int, observation_space: gym.Space):
        self._obs_dtype = observations.host_dtype(observation_space)
        self._was_last = np.ones(num_envs, bool)
        self._acted = np.zeros(num_envs, bool)  # sent an action since the reset
        self._all_acted = False
        self._returns = np.zeros(num_envs, np.float64)
        self._lengths = np.zeros(num_envs, np.int64)
        self._envs = np.arange(num_envs)
        # Rows observed, not yet tallied: by id, the last one (ids, reward, first, last);
        # in order, up to MAX_PENDING of them (reward, first, last).
        self._untallied: tuple | None = None
        self._pending: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self._ended: list[tuple[float, int]] = []

    def restart(self) -> None:
        """Forgets every episode under way: the envs were reset (a source reset again,
        as an evaluation's is before each evaluation)."""
        self._was_last = np.ones_like(self._was_last)
        self._returns[:] = 0.0
        self._lengths[:] = 0
        self._untallied = None
        self._pending = []
        self._ended = []

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
        if self._untallied is not None or len(self._pending) >= self.MAX_PENDING:
            self._tally()
        first = self._was_last  # a fresh array each step: `last` below replaces it
        terminated = np.asarray(terminated, bool)
        truncated = np.asarray(truncated, bool)
        last = terminated | truncated
        self._was_last = last
        # A copy: the tally comes later, and a source may reuse its buffers.
        reward = np.array(reward, np.float32)
        self._pending.append((reward, first, last))
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
        """Adds the observed rows to their episodes' returns and lengths."""
        if self._pending:
            self._tally_in_order()
        if self._untallied is None:
            return
        ids, reward, first, last = self._untallied
        self._untallied = None
        returns, lengths = self._returns[ids], self._lengths[ids]
        self._add_row(returns, lengths, reward, first, last)
        self._returns[ids] = returns
        self._lengths[ids] = lengths

    def _tally_in_order(self) -> None:
        """Tallies the pending rows of every env, [T, N], in one pass over all of them.

        A reset's row (`first`) adds nothing and starts its env's episode afresh: an
        episode's return at row t is the sum of its env's rewards after its latest
        first row up to t (or since the pending rows began, on top of what it had), the
        difference of two running sums: exact for whole-number rewards, else within the
        float64 rounding of the env's running sum over the rows.
        """
        rows, self._pending = self._pending, []
        if len(rows) == 1:  # asked after each recv (an evaluation): a few calls in place
            self._add_row(self._returns, self._lengths, *rows[0])
            return
        n = len(rows)
        # np.array of a list of rows: a third of np.stack's cost on small arrays.
        reward, first, last = (np.array(x) for x in zip(*rows, strict=True))
        # Each env's return so far enters with its first pending row (unless it restarts
        # there): an episode under way sums its rewards in the order they came, as a
        # step-by-step tally would.
        gains = reward.astype(np.float64)
        gains[first] = 0.0
        gains[0] += np.where(first[0], 0.0, self._returns)
        steps = np.cumsum(gains, axis=0)
        if not np.isfinite(steps[-1]).all():
            # An infinite or NaN reward (the output checks off): a difference of running
            # sums would carry it into the env's later episodes. Row by row instead.
            for row in rows:
                self._add_row(self._returns, self._lengths, *row)
            return
        # Each row's latest first row at or before it (-1: none among the pending). Only
        # the rows that end an episode and the last row need their return and length:
        # after a restart at row s, steps[t] - steps[s] and t - s; without one, steps[t]
        # and the length so far + t + 1.
        start = np.maximum.accumulate(np.where(first, np.arange(n)[:, None], -1), axis=0)
        if last.any():  # in the order observed: row by row, env by env
            t, env = np.nonzero(last)
            returns, lengths = self._since_start(steps, start[t, env], t, env)
            self._ended += zip(returns.tolist(), lengths.tolist(), strict=True)
        self._returns, self._lengths = self._since_start(steps, start[-1], n - 1, self._envs)

    def _since_start(self, steps: np.ndarray, start: np.ndarray, t: np.ndarray | int,
                     env: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Returns and lengths at rows `t` of envs `env` whose latest first rows are
        `start` (-1: none), from the running sums `steps` of `_tally_in_order`."""
        restarted = start >= 0
        returns = steps[t, env] - np.where(restarted, steps[np.maximum(start, 0), env], 0.0)
        lengths = np.where(restarted, t - start, self._lengths[env] + t + 1)
        return returns, lengths

    def _add_row(self, returns: np.ndarray, lengths: np.ndarray, reward: np.ndarray,
                 first: np.ndarray, last: np.ndarray) -> None:
        """Adds one row to its envs' `returns` and `lengths` (in place) and keeps the
        episodes it ends."""
        returns += reward
        lengths += 1
        if first.any():  # a reset's row: its reward is not the new episode's
            returns[first] = 0.0
            lengths[first] = 0
        if last.any():
            self._ended += zip(returns[last].tolist(), lengths[last].tolist(), strict=True)

    def sent(self, ids: np.ndarray) -> None:
        if not self._all_acted:
            self._acted[ids] = True
            self._all_acted = bool(self._acted.all())


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


def _close_each(closeables: Sequence[Any]) -> list[Exception]:
    """Closes each of `closeables`, even after some raised; their errors, in order."""
    errors = []
    for closeable in closeables:
        try:
            closeable.close()
        except Exception as e:  # noqa: BLE001 - the others must still be closed
            errors.append(e)
    return errors


def close_quietly(closeables: Sequence[Any], what: str = "an env") -> None:
    """Closes each of `closeables`, logging an error in a close rather than raising it:
    where an error is on its way to the caller (it must reach it as raised, not replaced
    by a close's), or a run has ended (a close must not fail it)."""
    for error in _close_each(closeables):
        logging.getLogger(__name__).warning("closing %s failed", what, exc_info=error)


def close_all(closeables: Sequence[Any]) -> None:
    """Closes each of `closeables` (env sources, envs), even if closing one raises (the
    first error is re-raised)."""
    errors = _close_each(closeables)
    if errors:
        raise errors[0]
