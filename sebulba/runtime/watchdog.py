"""Runs that stop progressing end, saying where they stopped.

`EnvStall` (every single-process run): the learner waits for a trajectory while no env
steps, so some env step does not return; the run ends with an error that shows where
each inferencer thread is.

`ProgressWatchdog` (multi-process runs): a learner that stops progressing ends the run,
naming who is behind.

JAX's heartbeats catch a peer that died or froze, but not one whose Python is stuck (an
env step that never returns, a callback in a loop): its heartbeat thread runs on while
the others wait for it forever inside the learner's next collective, where no Python
code of theirs runs. Here every process publishes its learner's update count to JAX's
coordination key-value store from a thread of its own, and when its own count has not
moved for `timeout_s` it reads everyone's, prints which processes are behind (or that all
are at the same update), ends its child processes and exits with `EXIT_CODE`: the
waiting processes end, and the stuck one too, each saying the same thing.
"""

from __future__ import annotations

import contextlib
import itertools
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence

from sebulba.runtime.preemption import end_process_now

EXIT_CODE = 3
# Seconds a learner may take to finish its first update (start-up and compilation
# included) when the timeout is shorter.
FIRST_UPDATE_S = 600.0
_PREFIX = "sebulba/learner_position/"
_VERDICT = "sebulba/stalled/"
_RUNS = itertools.count()  # this process's multi-process runs, for their keys
_PUBLISH_GAP_S = 0.05  # the least time between two publications of a position


# Frames of each stuck thread's stack that an `EnvStall` error shows (innermost last).
STACK_FRAMES = 6


def thread_stacks(threads: Sequence[threading.Thread], frames: int = STACK_FRAMES) -> str:
    """The innermost `frames` frames of each live thread's stack, under its name."""
    current = sys._current_frames()
    parts = []
    for t in threads:
        frame = current.get(t.ident) if t.is_alive() else None
        if frame is None:
            parts.append(f"{t.name}: ended")
            continue
        stack = "".join(traceback.format_stack(frame)[-frames:])
        parts.append(f"{t.name}, innermost {frames} frames:\n{stack.rstrip()}")
    return "\n".join(parts)


class EnvStall:
    """Ends a run whose envs stopped stepping while its learner waits for a trajectory.

    In a single-process run the learner thread only waits without bound for the queue,
    and that wait ends unless every inferencer thread is stuck: in an env step that does
    not return (a deadlocked simulator, a worker waiting for a lock), as nothing else in
    the acting loop waits without bound. The learner calls `waiting(env steps so far)` as
    a wait starts and `check(env steps so far, busy)` each time the wait times out; when
    no env stepped for `timeout_s` of waiting, `check` raises a RuntimeError showing
    where the inferencer threads are (and `fired` is set). Time in which the learner's
    last update is still running on its devices (`busy`) does not count: acting calls
    may queue behind it, and lockstep acting waits for its networks. Until the first env
    step (envs resetting, the acting call compiling) the limit is at least
    `first_step_s`.
    """

    def __init__(self, timeout_s: float, threads: Sequence[threading.Thread],
                 first_step_s: float = FIRST_UPDATE_S):
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        self.timeout_s, self.threads = timeout_s, threads
        self.first_step_s = max(timeout_s, first_step_s)
        self.fired = False
        self._steps, self._since = -1, time.monotonic()

    def waiting(self, env_steps: int) -> None:
        """The learner starts to wait: the stall clock starts now (while it updated, the
        envs may have waited for room in the queue)."""
        self._steps, self._since = env_steps, time.monotonic()

    def check(self, env_steps: int, busy: bool = False) -> None:
        now = time.monotonic()
        if busy or env_steps != self._steps:
            self._steps, self._since = env_steps, now
            return
        limit = self.timeout_s if env_steps > 0 else self.first_step_s
        if now - self._since <= limit:
            return
        self.fired = True
        raise RuntimeError(
            f"no env stepped for {limit:g} s while the learner waited for a trajectory "
            f"({env_steps} env steps so far): an env step that does not return? "
            "(Sebulba.run's progress_timeout_s sets this limit.) Closing the envs ends "
            "async env workers, which frees the threads waiting on them; a thread stuck in "
            "an env's own code runs on until that code returns, as Python cannot stop a "
            f"thread. Where the inferencer threads are:\n{thread_stacks(self.threads)}")


def _coordination_client():
    """JAX's key-value client of this process's `jax.distributed` run (a private API:
    None where it moved, and the watchdog then names nobody)."""
    try:
        from jax._src import distributed
    except ImportError:
        return None
    return getattr(distributed.global_state, "client", None)


def _where(position: int) -> str:
    """A position as `ProgressWatchdog` counts them: 2u - 1 in update u, 2u after it."""
    if position % 2 == 0:
        return f"after update {position // 2}"
    return f"in update {position // 2 + 1}"


def describe_progress(positions: dict[int, int], me: int,
                      num_processes: int | None = None) -> str:
    """Which processes are behind, from {process index: position} (the peers' as last
    published); of `num_processes`, those that published nothing have not started their
    learner, and are the ones behind."""
    if not positions:
        return "the other processes' progress is unknown"
    missing = sorted(set(range(num_processes or 0)) - set(positions))
    if missing:
        names = ", ".join(f"process {p}" for p in missing)
        where = ", ".join(f"process {p} {_where(u)}" for p, u in sorted(positions.items()))
        return (f"{names} never started its learner ({where}): the silent peer"
                if len(missing) == 1 else
                f"{names} never started their learners ({where}): the silent peers")
    low = min(positions.values())
    behind = sorted(p for p, u in positions.items() if u == low)
    if len(behind) == len(positions):
        return f"every process is {_where(low)}"
    names = ", ".join(f"process {p}" + (" (this one)" if p == me else "") for p in behind)
    ahead = ", ".join(f"process {p} {_where(u)}" for p, u in sorted(positions.items())
                      if u != low)
    return f"{names} stopped {_where(low)} ({ahead}): the silent peer"


class ProgressWatchdog:
    """Ends this process when its learner has not moved for `timeout_s` seconds.

    The learner calls `entering(u)` before update u (whose collectives need every
    process) and `finished(u)` after it; `close()` at the end of the run. A process that
    stopped outside an update is the silent peer its waiting peers name. `on_stall`
    replaces the exit (for tests): it gets the message instead.
    """

    def __init__(self, timeout_s: float, process_index: int,
                 on_stall: Callable[[str], None] | None = None,
                 first_update_s: float = FIRST_UPDATE_S, num_processes: int | None = None):
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        self.timeout_s, self.process_index = timeout_s, process_index
        self.num_processes = num_processes
        # Keys of this run's positions: every process makes one watchdog per run, so the
        # n-th run of each reads the others' n-th (an earlier run's last positions would
        # otherwise stand for a peer that has not started this one).
        self._prefix = f"{_PREFIX}{next(_RUNS)}/"
        # Until its first update is done a learner is also starting (env workers,
        # compilation), which takes its own time under load: a timeout sized for the
        # steady state would end healthy runs there.
        self.first_update_s = max(timeout_s, first_update_s)
        self._started = False
        self._client = _coordination_client()
        self._on_stall = on_stall or _exit_with
        self._position, self._last_beat = 0, time.monotonic()
        self._published = -1
        self._moved = threading.Event()  # set by `entering` and `finished`: publish now
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="sebulba-watchdog",
                                        daemon=True)
        self._thread.start()

    def entering(self, update: int) -> None:
        self._position, self._last_beat = 2 * update - 1, time.monotonic()
        self._moved.set()

    def finished(self, update: int) -> None:
        self._position, self._last_beat = 2 * update, time.monotonic()
        self._started = True
        self._moved.set()

    def close(self) -> None:
        self._closed.set()
        self._moved.set()
        self._thread.join()

    def _publish(self) -> None:
        position = self._position
        if self._client is not None and position != self._published:
            self._client.key_value_set(f"{self._prefix}{self.process_index}", str(position),
                                       allow_overwrite=True)
            self._published = position

    def progress(self) -> dict[int, int]:
        """{process index: position} as published (this process's own, current)."""
        found = {self.process_index: self._position}
        if self._client is not None:
            for key, value in self._client.key_value_dir_get(self._prefix):
                found.setdefault(int(key.rsplit("/", 1)[-1]), int(value))
        return found

    def report(self) -> str:
        """Who is behind, as far as the key-value store still answers."""
        try:
            return describe_progress(self.progress(), self.process_index,
                                     self.num_processes)
        except Exception as e:
            return f"the coordination service did not answer ({e})"

    def _verdict(self) -> str | None:
        """A stall another process found and published, if any."""
        if self._client is None:
            return None
        with contextlib.suppress(Exception):
            for _, message in self._client.key_value_dir_get(_VERDICT):
                return message
        return None

    def _watch(self) -> None:
        period = min(1.0, self.timeout_s / 4)
        checked = time.monotonic()
        while True:
            # Woken as the learner moves, so that the position a dead peer leaves is its
            # last one (a peer whose save failed right after an update showed an update
            # of a second before); the checks below run once a period.
            self._moved.wait(period)
            self._moved.clear()
            if self._closed.is_set():
                return
            # If the coordination service is gone, the stall check below decides.
            with contextlib.suppress(Exception):
                self._publish()
            # Moves within this gap are published together: at most one call to the
            # coordination service per gap however fast the updates come.
            self._closed.wait(_PUBLISH_GAP_S)
            if time.monotonic() - checked < period:
                continue
            checked = time.monotonic()
            verdict = self._verdict()
            if verdict is not None:  # a peer found the stall first: end with its words
                if self.process_index == 0:
                    # This process hosts the coordination service: the publisher waits
                    # two polls before it goes, and its JAX client aborts (not exit code
                    # EXIT_CODE) if the service goes first.
                    self._closed.wait(3 * period)
                self._on_stall(f"{verdict} (process {self.process_index} ends too)")
                return
            timeout = self.timeout_s if self._started else self.first_update_s
            if time.monotonic() - self._last_beat <= timeout:
                continue
            message = (f"process {self.process_index}'s learner made no progress for "
                       f"{timeout:g} s, {_where(self._position)}: {self.report()}")
            if self._client is not None:
                with contextlib.suppress(Exception):
                    self._client.key_value_set(f"{_VERDICT}{self.process_index}", message)
                # Give every peer a poll to read it before this process (perhaps the
                # coordination service's host) goes.
                self._closed.wait(2 * period)
            self._on_stall(message)
            return


def _exit_with(message: str) -> None:
    end_process_now(EXIT_CODE, message)
