"""Preemption: SIGTERM and SIGINT end a run cleanly, within a bounded time.

A cluster sends SIGTERM before it takes a machine back (SLURM, Kubernetes, cloud spot
instances), and a person at a terminal sends SIGINT. Either sets `Preemption.event`,
which `Sebulba.run(stop=...)` honours at once while the learner waits for a trajectory,
and otherwise after the learner update under way (every process of a multi-process run
after the same update), so the caller can save a checkpoint and exit with 128 + the
signal's number, as a shell reports a process killed by it. A single-process run cuts
that update short, between optimizer steps, when it would not end by
`StopEvent.deadline`: half the grace after the signal, leaving the other half to save.
If the run has not ended `grace_seconds` after the signal (an env stuck in a step, a
peer that never answers), the process ends itself: it terminates its child processes
(env workers) and exits at once with the same code. A second signal ends it at once the
same way.

Python runs a signal's handler in the main thread between bytecodes, so a main thread
waiting in one long C call (the learner waiting for the device) would see the signal
only when the call returns: late, deadline included. The signal's number is therefore
read from a wakeup file descriptor by a thread of its own, which acts on it at once.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import threading
import time
import types

SIGNALS = (signal.SIGTERM, signal.SIGINT)
_CLOSE = 0  # written to the wakeup pipe by __exit__: no signal has the number 0


def end_process_now(code: int, why: str) -> None:
    """Prints why, ends this process's child processes (env workers) and exits with `code`
    at once: for when the main thread cannot be reached (stuck in a C call)."""
    print(f"sebulba: {why}; exiting with {code}", file=sys.stderr, flush=True)
    # Killed, not terminated: env workers ignore SIGTERM (the parent decides when they
    # end), and a wait for each would keep a scheduler's kill window waiting per worker.
    children = multiprocessing.active_children()
    for child in children:
        child.kill()
    deadline = time.monotonic() + 2.0
    for child in children:
        child.join(max(0.0, deadline - time.monotonic()))
    os._exit(code)


class StopEvent(threading.Event):
    """A stop request that may come with a deadline.

    Attributes:
      deadline: `time.monotonic()` by which the learner should have ended its update, or
        None (the update under way runs to its end). `Sebulba.run` cuts a single-process
        run's update short, between optimizer steps, when it would not end by then.
    """

    def __init__(self) -> None:
        super().__init__()
        self.deadline: float | None = None


class Preemption:
    """A context manager that turns SIGTERM and SIGINT into a stop event, with a deadline.

    Handlers are installed on entry and the previous ones restored on exit; signal
    handlers can only be installed from the main thread, so enter it there.

    Attributes:
      event: a `StopEvent`, set when the first signal arrives; pass it to
        `Sebulba.run(stop=...)`.
      signum: the number of that signal, or None.
    """

    def __init__(self, grace_seconds: float = 30.0):
        if not grace_seconds > 0:
            raise ValueError(f"grace_seconds must be > 0, got {grace_seconds!r}")
        self.grace_seconds = grace_seconds
        self.event = StopEvent()
        self.signum: int | None = None
        self._previous: dict[int, object] = {}
        self._previous_wakeup_fd = -1
        self._pipe: tuple[int, int] | None = None
        self._reader: threading.Thread | None = None
        self._deadline: threading.Timer | None = None

    @property
    def exit_code(self) -> int | None:
        """128 + the signal's number once one arrived (143 for SIGTERM, 130 for SIGINT)."""
        return None if self.signum is None else 128 + self.signum

    def __enter__(self) -> Preemption:
        # Signal handlers and the wakeup fd belong to the main thread: refuse elsewhere
        # before anything is started (a reader thread would outlive the error).
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("Preemption must be entered in the main thread (signal "
                               f"handlers are set there), not {threading.current_thread().name!r}")
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)  # what set_wakeup_fd requires
        self._pipe = (read_fd, write_fd)
        self._reader = threading.Thread(target=self._read_signals, name="sebulba-signals",
                                        daemon=True)
        self._reader.start()
        self._previous_wakeup_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        for signum in SIGNALS:
            # The reader thread acts; the Python-level handler only keeps the default
            # action (exit, KeyboardInterrupt) from happening.
            self._previous[signum] = signal.signal(signum, _ignore)
        return self

    def __exit__(self, *exc_info) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()
        signal.set_wakeup_fd(self._previous_wakeup_fd)
        if self._pipe is not None:
            read_fd, write_fd = self._pipe
            os.write(write_fd, bytes([_CLOSE]))
            self._reader.join()
            os.close(read_fd)
            os.close(write_fd)
            self._pipe = None
        if self._deadline is not None:
            self._deadline.cancel()

    def _read_signals(self) -> None:
        read_fd = self._pipe[0]
        while True:
            for signum in os.read(read_fd, 64):
                if signum == _CLOSE:
                    return
                if signum in SIGNALS:
                    self._handle(signum)

    def _handle(self, signum: int) -> None:
        name = signal.Signals(signum).name
        if self.signum is not None:
            end_process_now(self.exit_code, f"a second signal ({name}) while stopping")
        self.signum = signum
        self.event.deadline = time.monotonic() + self.grace_seconds / 2
        self.event.set()
        print(f"sebulba: {name}: stopping (the learner update under way ends within "
              f"{self.grace_seconds / 2:g} s, the run within {self.grace_seconds:g} s)",
              file=sys.stderr, flush=True)
        self._deadline = threading.Timer(
            self.grace_seconds, end_process_now,
            (self.exit_code, f"the run did not stop within {self.grace_seconds:g} s of {name}"))
        self._deadline.daemon = True
        self._deadline.start()


def _ignore(signum: int, frame: types.FrameType | None) -> None:
    """Python-level handler of SIGNALS while a Preemption is entered (see _read_signals)."""
