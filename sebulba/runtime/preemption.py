"""Preemption: SIGTERM and SIGINT end a run cleanly, within a bounded time.

A cluster sends SIGTERM before it takes a machine back (SLURM, Kubernetes, cloud spot
instances), and a person at a terminal sends SIGINT. Either sets `Preemption.event`,
which `Sebulba.run(stop=...)` honours after the learner update under way (every process
of a multi-process run after the same update), so the caller can save a checkpoint and
exit with 128 + the signal's number, as a shell reports a process killed by it. If that
has not happened `grace_seconds` after the signal (an env stuck in a step, a peer that
never answers), the process ends itself: it terminates its child processes (env workers)
and exits at once with the same code. A second signal ends it at once the same way.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import threading
import types

SIGNALS = (signal.SIGTERM, signal.SIGINT)


def end_process_now(code: int, why: str) -> None:
    """Prints why, ends this process's child processes (env workers) and exits with `code`
    at once: for when the main thread cannot be reached (stuck in a C call)."""
    print(f"sebulba: {why}; exiting with {code}", file=sys.stderr, flush=True)
    for child in multiprocessing.active_children():
        child.terminate()
    for child in multiprocessing.active_children():
        child.join(timeout=2.0)
        if child.is_alive():
            child.kill()
    os._exit(code)


class Preemption:
    """A context manager that turns SIGTERM and SIGINT into a stop event, with a deadline.

    Handlers are installed on entry and the previous ones restored on exit; signal
    handlers can only be installed from the main thread, so enter it there.

    Attributes:
      event: set when the first signal arrives; pass it to `Sebulba.run(stop=...)`.
      signum: the number of that signal, or None.
    """

    def __init__(self, grace_seconds: float = 30.0):
        if not grace_seconds > 0:
            raise ValueError(f"grace_seconds must be > 0, got {grace_seconds!r}")
        self.grace_seconds = grace_seconds
        self.event = threading.Event()
        self.signum: int | None = None
        self._previous: dict[int, object] = {}
        self._deadline: threading.Timer | None = None

    @property
    def exit_code(self) -> int | None:
        """128 + the signal's number once one arrived (143 for SIGTERM, 130 for SIGINT)."""
        return None if self.signum is None else 128 + self.signum

    def __enter__(self) -> Preemption:
        for signum in SIGNALS:
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc_info) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()
        if self._deadline is not None:
            self._deadline.cancel()

    def _handle(self, signum: int, frame: types.FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.signum is not None:
            end_process_now(self.exit_code, f"a second signal ({name}) while stopping")
        self.signum = signum
        self.event.set()
        print(f"sebulba: {name}: stopping after the learner update under way (at most "
              f"{self.grace_seconds:g} s)", file=sys.stderr, flush=True)
        self._deadline = threading.Timer(
            self.grace_seconds, end_process_now,
            (self.exit_code, f"the run did not stop within {self.grace_seconds:g} s of {name}"))
        self._deadline.daemon = True
        self._deadline.start()
