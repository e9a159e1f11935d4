"""EnvPool task ids as env sources (extra `envpool`); envs step in EnvPool's C++ threads,
outside the GIL, and one inferencer thread per inference device drives its groups.

- `EnvPoolGroups` (`vectorization="envpool"`): a synchronous pool per group (its batch all
  its envs), which EnvPool returns in the order they were sent. The groups take turns,
  each a whole batch in id order, so the thread acts on a group as on a vector env and
  pipelines them: one group's inference runs while another's envs step.
- `EnvPoolSource` (`vectorization="envpool_async"`): one pool of `num_groups x
  group_size` envs with `batch_size=group_size`, whose `recv` returns whichever
  `group_size` envs finished first, from any group, with their `env_id`; the thread
  assembles each group's trajectory by env id. No group waits for its slowest env.

EnvPool's semantics, as sebulba needs them: gymnasium's (obs, reward, terminated,
truncated, info); after a step that ends an episode, the next `send` for that env is
ignored and its `recv` is the reset observation with reward 0 (NEXT_STEP autoreset, as
our gymnasium vector envs do). Episode returns are summed from the reward `recv` gives;
EnvPool's own `reward_clip` is off by default, so they are the raw rewards (an agent
clips rewards for learning itself, as IMPALA's `reward_clip` does).
"""

from __future__ import annotations

import contextlib
import difflib
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from sebulba.envs.base import EpisodeTracker, action_to_env, check_spaces, close_all
from sebulba.envs.frame_stacks import envpool_frame_stack
from sebulba.envs.output_checks import BatchCheck
from sebulba.types import EnvSpec, EnvStep


@contextlib.contextmanager
def _environment_kept():
    """envpool sets process-wide environment variables as it loads its parts (MPLBACKEND=Agg
    among them, which silences matplotlib in every notebook kernel started afterwards):
    put the environment back as it was."""
    before = dict(os.environ)
    try:
        yield
    finally:
        for key in set(os.environ) - set(before):
            del os.environ[key]
        os.environ.update(before)


def _envpool():
    try:
        import envpool
    except ImportError:
        raise ValueError(
            "vectorization 'envpool' needs the envpool package: pip install -e '.[envpool]' "
            "in sebulba's checkout"
        ) from None
    return envpool


def check_task_id(task_id: str) -> None:
    """ValueError naming the id unless EnvPool has it."""
    with _environment_kept():
        known = _envpool().list_all_envs()
    if task_id not in known:
        close = difflib.get_close_matches(task_id, known, n=3)
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise ValueError(f"{task_id!r} is not an EnvPool task id{hint}; "
                         "envpool.list_all_envs() lists them")


def check_env(env: str) -> None:
    """`check_task_id`, the error naming `env` as the run's env."""
    try:
        check_task_id(env)
    except ValueError as e:
        raise ValueError(f"env {env!r}: {e}") from None


def pool_spec(task_id: str, env_kwargs: Mapping[str, Any] | None = None) -> EnvSpec:
    """The spaces of an EnvPool task (a pool of one env, made and closed)."""
    pool = make_pool(task_id, 1, 1, 0, env_kwargs)
    try:
        check_spaces(pool.observation_space, pool.action_space)
        return EnvSpec(pool.observation_space, pool.action_space)
    finally:
        pool.close()


def make_pool(task_id: str, num_envs: int, batch_size: int, seed: int,
              env_kwargs: Mapping[str, Any] | None = None):
    """An EnvPool of `num_envs` envs, env i seeded `seed + i`. EnvPool takes int32
    seeds only, while a run's seeds are any int >= 0 (a resumed run's grow with its
    updates): `seed` is taken modulo 2**31, as C++ then wraps `seed + i` past it
    (the pool's envs keep distinct seeds)."""
    check_task_id(task_id)
    with _environment_kept():
        return _envpool().make(task_id, env_type="gymnasium", num_envs=num_envs,
                               batch_size=batch_size, seed=seed % 2**31,
                               **dict(env_kwargs or {}))


def _cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


class _Pool:
    """One EnvPool and the two calls a source makes on it, below EnvPool's Python wrapper
    where its layout allows (`_raw_layout`)."""

    def __init__(self, task_id: str, num_envs: int, batch_size: int, seed: int,
                 env_kwargs: Mapping[str, Any] | None):
        self.pool = make_pool(task_id, num_envs, batch_size, seed, env_kwargs)
        self.observation_space = self.pool.observation_space
        self.action_space = self.pool.action_space
        self._action_dtype = self.pool.action_space.dtype
        self._action_shape = tuple(self.pool.action_space.shape or ())
        self._to_env = action_to_env(self.pool.action_space)
        self._raw = _raw_layout(self.pool)

    def recv(self) -> tuple[np.ndarray, Any, Any, Any, Any]:
        """(env ids, obs, reward, terminated, truncated) of the next batch."""
        if self._raw is None:
            obs, reward, terminated, truncated, info = self.pool.recv()
            return info["env_id"], obs, reward, terminated, truncated
        state = self.pool._recv()
        ids, obs, reward, done, truncated = (state[i] for i in self._raw)
        return ids, obs, reward, done & ~truncated, truncated  # done: either of them

    def send(self, actions: np.ndarray, ids32: np.ndarray, source_ids: np.ndarray) -> None:
        """Steps the pool's envs `ids32` (the pool's ids; `source_ids`: the source's, for
        errors) with `actions`."""
        actions = np.asarray(self._to_env(actions, source_ids), self._action_dtype)
        # Below EnvPool's wrapper nothing checks the shape, and C++ aborts the process
        # (no traceback, no save) on too few rows; too many or a missing axis pass.
        if actions.shape != (len(ids32), *self._action_shape):
            raise ValueError(
                f"actions of shape {actions.shape} for {len(ids32)} envs; expected "
                f"{(len(ids32), *self._action_shape)}, one action of the action space "
                f"{self.action_space} per env")
        if self._raw is None:
            self.pool.send(actions, ids32)
        else:
            self.pool._send([ids32, ids32, actions])  # env_id, players.env_id, action

    def render(self) -> np.ndarray:
        return np.asarray(self.pool.render()[0])

    def close(self) -> None:
        self.pool.close()


class EnvPoolGroups:
    """`num_groups` groups of `group_size` envs, one synchronous EnvPool per group, in
    order (vectorization "envpool").

    A pool whose batch is all its envs returns them in the order they were sent, so
    each group steps as a vector env does: `recv` returns a whole group, in id order,
    the groups taking turns (0, 1, ..., 0, ...), and `send` takes them in the same turns;
    it returns at once, the group's envs stepping in the pool's C++ threads while the
    thread acts for the other groups.
    Group g's env i is seeded `seed + g * group_size + i`.
    """

    in_order = True

    def __init__(self, task_id: str, num_groups: int, group_size: int, seed: int,
                 env_kwargs: Mapping[str, Any] | None = None, check_output: bool = False,
                 share_cores: bool = True):
        self.num_groups, self.group_size = num_groups, group_size
        self.num_envs = num_groups * group_size
        self._render_mode = (env_kwargs or {}).get("render_mode")
        # EnvPool's default gives each pool a thread per core (at most one per env). With
        # two groups one pool steps at a time (the thread waits for each group in turn),
        # so on an accelerator each keeps that default; with `share_cores` (the acting
        # calls run on these cores too) the pools share them as one pool of all the
        # groups would, since surplus threads only preempt the acting calls (about 16%
        # more steps/s with one thread per pool, CartPole on 2 cores). `env_kwargs` may
        # set `num_threads` itself (several inference devices, several threads' pools).
        threads = max(1, min(group_size, _cores() // (num_groups if share_cores else 1)))
        kwargs = {"num_threads": threads, **dict(env_kwargs or {})}
        self.pools: list[_Pool] = []
        try:
            for g in range(num_groups):
                self.pools.append(_Pool(task_id, group_size, group_size,
                                        seed + g * group_size, kwargs))
        except BaseException:
            self.close()
            raise
        space = self.pools[0].observation_space
        self.frame_stack = envpool_frame_stack(self.pools[0].pool)
        self._trackers = [EpisodeTracker(group_size, space) for _ in range(num_groups)]
        # The pools' C++ envs emit arrays of their spec's shapes and types: only NaN and
        # infinite values are left to check.
        self._checks = [BatchCheck(repr(task_id), space, group_size,
                                   lambda i, g=g: self._place(g * group_size + i))
                        for g in range(num_groups)] if check_output else None
        self._ids = [np.arange(g * group_size, (g + 1) * group_size)
                     for g in range(num_groups)]
        self._order = np.arange(group_size, dtype=np.int32)  # a pool's own env ids
        self._order_bytes = self._order.tobytes()  # compared with each recv's (checks)
        # The groups take turns, in recv and in send alike; a loop may receive the next
        # group before it sends the one before (pipelining).
        self._recv_turn = self._send_turn = 0

    def _place(self, env: int) -> str:
        """Env `env` of the source, named for an error message."""
        return (f"env {env % self.group_size} of the {self.group_size} in group "
                f"{env // self.group_size}'s EnvPool")

    def reset(self, seed: int) -> None:
        del seed  # each pool was seeded when made
        for pool, tracker in zip(self.pools, self._trackers, strict=True):
            pool.pool.async_reset()
            tracker.restart()
        self._recv_turn = self._send_turn = 0

    def recv(self) -> tuple[np.ndarray, EnvStep, int]:
        g = self._recv_turn
        self._recv_turn = g + 1 if g + 1 < self.num_groups else 0
        order, obs, reward, terminated, truncated = self.pools[g].recv()
        env_step, steps = self._trackers[g].observe_all(obs, reward, terminated, truncated)
        if self._checks is not None:
            # EnvPool returns a synchronous pool's envs in the order they were sent; the
            # rows are taken to be in env order, so the checks hold it to that.
            # (Their bytes: a twentieth of np.array_equal's cost, every recv.)
            if np.asarray(order, np.int32).tobytes() != self._order_bytes:
                raise RuntimeError(f"EnvPool returned group {g}'s envs in the order "
                                   f"{np.asarray(order).tolist()}, not in the order sent")
            self._checks[g](env_step)
        return self._ids[g], env_step, steps

    def pop_episodes(self) -> list[tuple[float, int]]:
        """The episodes that ended in the rows recv returned since the last call, group
        by group."""
        return [e for tracker in self._trackers for e in tracker.pop_episodes()]

    def send(self, actions: np.ndarray, ids: np.ndarray) -> None:
        g = self._send_turn
        self._send_turn = g + 1 if g + 1 < self.num_groups else 0
        self.pools[g].send(actions, self._order, ids)
        self._trackers[g].sent(self._order)

    def render(self) -> np.ndarray | None:
        """Group 0's env 0's frame (pools made with render_mode="rgb_array"), else None."""
        return self.pools[0].render() if self._render_mode == "rgb_array" else None

    def close(self) -> None:
        close_all(self.pools)


class EnvPoolSource:
    """`num_groups` groups of `group_size` envs in one asynchronous EnvPool, by env id
    (vectorization "envpool_async"): `recv` returns whichever `group_size` envs finished
    first, from any group, and the thread assembles each group's cycles by env id."""

    in_order = False

    def __init__(self, task_id: str, num_groups: int, group_size: int, seed: int,
                 env_kwargs: Mapping[str, Any] | None = None, check_output: bool = False):
        self.num_groups, self.group_size = num_groups, group_size
        self.num_envs = num_groups * group_size
        self._pool = _Pool(task_id, self.num_envs, group_size, seed, env_kwargs)
        self.pool = self._pool.pool
        self.frame_stack = envpool_frame_stack(self.pool)
        self._render_mode = (env_kwargs or {}).get("render_mode")
        self._tracker = EpisodeTracker(self.num_envs, self.pool.observation_space)
        # The pool's C++ envs emit arrays of their spec's shapes and types: only NaN and
        # infinite values are left to check.
        self._check = BatchCheck(repr(task_id), self.pool.observation_space, self.num_envs,
                                 self._place) if check_output else None

    def _place(self, env: int) -> str:
        """Env `env` of the pool, named for an error message."""
        return (f"env {env} of the {self.num_envs} in its EnvPool: env {env % self.group_size}"
                f" of the pool's group {env // self.group_size}")

    def reset(self, seed: int) -> None:
        del seed  # the pool was seeded when made; env i gets seed + i
        self.pool.async_reset()
        self._tracker.restart()

    def recv(self) -> tuple[np.ndarray, EnvStep, int]:
        ids, obs, reward, terminated, truncated = self._pool.recv()
        ids = np.asarray(ids, np.int64)
        env_step, steps = self._tracker.observe(ids, obs, reward, terminated, truncated)
        if self._check is not None:
            self._check(env_step, ids)
        return ids, env_step, steps

    def pop_episodes(self) -> list[tuple[float, int]]:
        return self._tracker.pop_episodes()

    def render(self) -> np.ndarray | None:
        """Env 0's frame (a pool made with render_mode="rgb_array"), else None."""
        return self._pool.render() if self._render_mode == "rgb_array" else None

    def send(self, actions: np.ndarray, ids: np.ndarray) -> None:
        self._pool.send(actions, ids.astype(np.int32), ids)
        self._tracker.sent(ids)

    def close(self) -> None:
        self._pool.close()


_RAW_STATE = ("info:env_id", "obs", "reward", "done", "trunc")
_RAW_ACTION = ["env_id", "players.env_id", "action"]


def _raw_layout(pool) -> tuple[int, ...] | None:
    """Where `_recv`'s list holds (env_id, obs, reward, done, trunc), for a pool whose
    arrays `recv`/`send` only repackage (and check the actions' shape, which
    `_Pool.send` does instead): one player, one array action, one array obs.

    EnvPool's `recv` and `send` build dicts and optree structures around its C++
    `_recv`/`_send` (about 70 us a batch on this project's 2-core machine, the order of
    the inference call itself); where the layout is this simple, the source calls those
    two directly. Anything else, or an EnvPool without them, goes through `recv`/`send`.
    """
    keys = list(getattr(pool, "_state_keys", []))
    if (not hasattr(pool, "_recv") or not hasattr(pool, "_send")
            or list(getattr(pool, "_action_keys", [])) != _RAW_ACTION
            or pool.config.get("max_num_players", 1) != 1
            or any(k not in keys for k in _RAW_STATE)
            or sum(k.startswith("obs") for k in keys) != 1):
        return None
    return tuple(keys.index(k) for k in _RAW_STATE)
