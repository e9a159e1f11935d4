"""Async env workers: the loop each one runs, and errors that name those that die or cannot
start, not a bare EOFError.

gymnasium's AsyncVectorEnv reports a worker killed by a signal, or one that failed to
bootstrap because the main script has no `if __name__ == "__main__":` guard, as the pipe
error its parent gets (EOFError, ConnectionResetError). Here they are RuntimeErrors naming
the worker, its pid and its signal or exit code, with no worker left behind.
"""

from __future__ import annotations

import ast
import atexit
import contextlib
import multiprocessing
import multiprocessing.connection
import multiprocessing.util  # its exit handler first, so that `_kill_open_workers` runs before it
import os
import pickle
import queue
import signal
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium.spaces.utils import is_space_dtype_shape_equiv
from gymnasium.vector.utils import write_to_shared_memory

# What a pipe to a worker process raises once the worker is gone.
PIPE_ERRORS = (EOFError, BrokenPipeError, ConnectionResetError)


def _main_script() -> str | None:
    """The file the "spawn" and "forkserver" start methods run again in every worker
    process (as `__mp_main__`), or None (an interactive session, `python -c`)."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if path is None or hasattr(sys, "ps1"):
        return None
    return os.path.abspath(path)


def _has_main_guard(path: str) -> bool | None:
    """Whether the script compares `__name__` with "__main__" (or asks multiprocessing which
    process it is, another way to keep a worker from starting the run); None if unreadable."""
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=path)
    except (OSError, SyntaxError, ValueError, UnicodeDecodeError):
        return None
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            if any(isinstance(o, ast.Name) and o.id == "__name__" for o in operands) and any(
                    isinstance(c, ast.Constant) and c.value == "__main__"
                    for o in operands for c in ast.walk(o)):
                return True
        name = node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", None)
        if name in ("parent_process", "current_process"):
            return True
    return False


def _guard_advice(path: str, async_context: str) -> str:
    return (f"with the {async_context!r} start method each async env worker imports the main "
            f"script {path} again, running its top-level code: put the code that starts the "
            'run under `if __name__ == "__main__":` so that workers only import it')


def check_main_guard(async_context: str) -> None:
    """RuntimeError, before any worker starts, if async env workers would run the main
    script's run again: "spawn" and "forkserver" workers import the main script, and one
    without an `if __name__ == "__main__":` guard starts the run (and async workers) in
    every worker, which multiprocessing refuses; the parent would see only a
    ConnectionResetError."""
    if async_context == "fork":
        return
    path = _main_script()
    if path is not None and _has_main_guard(path) is False:
        raise RuntimeError(f"vectorization 'async': {_guard_advice(path, async_context)}")


def _signal_name(exitcode: int) -> str | None:
    """The signal that ended a process with this multiprocessing exit code (-signum)."""
    if exitcode >= 0:
        return None
    try:
        return signal.Signals(-exitcode).name
    except ValueError:
        return f"signal {-exitcode}"


def _describe_exit(exitcode: int) -> str:
    name = _signal_name(exitcode)
    return f"was killed by {name}" if name else f"exited with code {exitcode}"


# What a signal that kills env workers usually means.
_SIGNAL_HINTS = {
    "SIGKILL": "SIGKILL comes from another process or the kernel's out-of-memory killer "
               "(see dmesg)",
    "SIGSEGV": "SIGSEGV is a crash in native code (the env's simulator or a library)",
}


def worker_death_error(processes: Sequence[multiprocessing.Process], during: str,
                       context: str | None = None, wait_s: float = 2.0) -> RuntimeError | None:
    """A RuntimeError naming the async env workers that have exited (index, pid, signal or
    exit code), waiting up to `wait_s` for a dying one to be reaped; None if all live."""
    deadline = time.monotonic() + wait_s
    while True:
        dead = [(i, p) for i, p in enumerate(processes) if p.exitcode is not None]
        if dead or time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    if not dead:
        return None
    described = "; ".join(f"async env worker {i} of {len(processes)} (pid {p.pid}) "
                          f"{_describe_exit(p.exitcode)}" for i, p in dead[:4])
    more = f" (and {len(dead) - 4} more)" if len(dead) > 4 else ""
    message = f"{described}{more} while {during}"
    hints = {_SIGNAL_HINTS[name] for _, p in dead
             if (name := _signal_name(p.exitcode)) in _SIGNAL_HINTS}
    message += "".join(f"; {hint}" for hint in sorted(hints))
    if any(p.exitcode > 0 for _, p in dead):
        message += "; a worker's own error, if it printed one, is above on stderr"
        path = _main_script()
        if during == "starting" and context != "fork" and path is not None:
            message += f". If that error is about bootstrapping: {_guard_advice(path, context)}"
    return RuntimeError(message)


def raise_named_worker_death(vec: gym.vector.VectorEnv, during: str,
                             error: BaseException) -> None:
    """For the bare EOFError (or another of `PIPE_ERRORS`) of a pipe to a dead async
    worker, raises an error naming the worker, from `error`; returns where `error` says
    more as it is (the env's own error, from its worker) or no worker died, for the
    caller's `raise`. Called from an `except PIPE_ERRORS` around each env step: a handler
    costs nothing until it runs, unlike a context manager entered every step."""
    if isinstance(error.__cause__, RemoteTraceback):  # the env's own error, from its worker
        return
    processes = getattr(vec, "processes", None)
    named = worker_death_error(processes, during) if processes else None
    if named is not None:
        # No answer will come for the call under way: let close() terminate the workers
        # instead of waiting for it (and failing on the dead pipe again).
        vec._state = gym.vector.async_vector_env.AsyncState.DEFAULT
        raise named from error


class RemoteTraceback(Exception):
    """The traceback of an error raised in an async env worker, as the worker formatted
    it: the `__cause__` of that error where the parent re-raises it."""

    def __str__(self) -> str:
        return f"\n\n{self.args[0]}"


# How long the parent waits for the error report of a worker that replied "failed": the
# worker flushes it to the error queue's pipe right after its reply, before its env's
# close.
ERROR_REPORT_TIMEOUT_S = 10.0
# How long closing waits for the workers to close their envs, and then for killed ones
# to be reaped.
CLOSE_TIMEOUT_S = 5.0
# A report stays under a pipe's buffer (64 KiB on Linux): the worker's flush waits for
# the parent to read only beyond it, and the parent reads only after the reply.
_MAX_REPORT_BYTES = 32_768
# How long the parent waits for its workers to make their envs: a simulator may take
# minutes to start, one that never does must not hang the run's start (nothing else
# watches it then: the progress watchdog starts with the inferencer threads).
MAKE_TIMEOUT_S = 600.0


class AsyncVectorEnv(gym.vector.AsyncVectorEnv):
    """gymnasium's AsyncVectorEnv, with errors that keep their origin and a forced close
    that cannot hang:
    - a worker's error is re-raised as the env raised it (gymnasium wraps it in a new
      exception of its type), with the worker's traceback as its cause;
    - workers dying while it starts are an error naming them (gymnasium's is the bare
      pipe error), and no worker outlives a failed start, whatever the error;
    - `close(terminate=True)` kills the workers (they ignore SIGTERM and SIGINT: the
      parent decides when they end), where gymnasium's SIGTERM would leave a worker
      that ignores it, and its join wait for it forever; `close()` first asks each
      worker to close its env (which may own processes of its own: a simulator's
      server) and kills those that have not ended within `CLOSE_TIMEOUT_S`.
    """

    def __init__(self, env_fns: Sequence[Callable[[], gym.Env]], **kwargs: Any):
        _kill_at_exit(self)
        try:
            super().__init__(env_fns, **kwargs)
        except BaseException as e:
            error = None
            if isinstance(e, PIPE_ERRORS) and not isinstance(e.__cause__, RemoteTraceback):
                error = worker_death_error(getattr(self, "processes", []), "starting",
                                           kwargs.get("context"))
            if not getattr(self, "_stuck_making", False):
                # The workers that made their env close it (a simulator's server with it);
                # those that failed or died have ended, those still making it would not
                # answer.
                self._ask_workers_to_close()
            self._stop_workers()
            self.closed = True  # nothing left for __del__ to close
            if error is None:
                raise
            raise error from e

    def _check_spaces(self) -> None:
        """gymnasium's check that every worker's env has the vector env's spaces (its
        first command, answered once the env is made), waiting at most MAKE_TIMEOUT_S
        for the answers: gymnasium waits without a bound."""
        self._assert_is_running()
        for pipe in self.parent_pipes:
            pipe.send(("_check_spaces", (self.observation_mode, self.single_observation_space,
                                         self.single_action_space)))
        deadline = time.monotonic() + MAKE_TIMEOUT_S
        waiting = list(self.parent_pipes)
        while waiting:
            ready = multiprocessing.connection.wait(
                waiting, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                self._stuck_making = True
                late = [self.parent_pipes.index(p) for p in waiting]
                raise RuntimeError(
                    f"async env workers {late} of {self.num_envs} did not make their env "
                    f"within {MAKE_TIMEOUT_S:g}s (sebulba.envs.async_workers.MAKE_TIMEOUT_S):"
                    " its constructor waits on something that does not come")
            waiting = [p for p in waiting if p not in ready]
        results, successes = zip(*[pipe.recv() for pipe in self.parent_pipes], strict=True)
        self._raise_if_errors(successes)
        same_observation_spaces, same_action_spaces = zip(*results, strict=True)
        if not all(same_observation_spaces):
            raise RuntimeError(
                f"the envs' observation spaces differ from {self.single_observation_space} "
                f"(observation_mode={self.observation_mode!r}): workers "
                f"{[i for i, same in enumerate(same_observation_spaces) if not same]}")
        if not all(same_action_spaces):
            raise RuntimeError(
                f"the envs' action spaces differ from {self.single_action_space}: workers "
                f"{[i for i, same in enumerate(same_action_spaces) if not same]}")

    def _raise_if_errors(self, successes: Sequence[bool]) -> None:
        successes = list(successes)
        if all(successes):
            return
        failed = [i for i, ok in enumerate(successes) if not ok]
        reports = []
        deadline = time.monotonic() + ERROR_REPORT_TIMEOUT_S
        try:
            for _ in failed:
                reports.append(self.error_queue.get(
                    timeout=max(0.0, deadline - time.monotonic())))
        except queue.Empty:
            pass
        except Exception as e:  # noqa: BLE001 - a report that cannot be unpickled
            reports.append((f"of {failed}", RuntimeError, RuntimeError(
                f"an async env worker's error report could not be read: "
                f"{type(e).__name__}: {e}"), ""))
        for index in failed:  # as gymnasium: a failed worker has ended; its pipe goes
            if self.parent_pipes[index] is not None:
                self.parent_pipes[index].close()
                self.parent_pipes[index] = None
        self._state = gym.vector.async_vector_env.AsyncState.DEFAULT
        if not reports:
            raise RuntimeError(f"async env workers {failed} of {self.num_envs} failed and "
                               f"sent no error report within {ERROR_REPORT_TIMEOUT_S}s")
        # The lowest worker's, whichever came first: the same error for the same failure.
        reports.sort(key=lambda r: (not isinstance(r[0], int), r[0] if isinstance(r[0], int)
                                    else 0))
        index, error_type, error, trace = reports[0]
        if not isinstance(error, BaseException):
            error = error_type(error)
        others = f"; workers {failed} of {self.num_envs} failed" if len(failed) > 1 else ""
        error.__cause__ = RemoteTraceback(f"async env worker {index}{others}\n{trace}")
        raise error

    def close_extras(self, timeout: float | None = None, terminate: bool = False) -> None:
        try:
            if not terminate:
                self._ask_workers_to_close()
        finally:  # a Ctrl-C in the polite close still kills the workers
            self._stop_workers()

    def _ask_workers_to_close(self) -> None:
        """Asks each idle worker to close its env and end, waiting for them up to
        `CLOSE_TIMEOUT_S` in all (gymnasium's close waits without a bound); a worker in
        the middle of a command is left to `_stop_workers`."""
        if getattr(self, "_state", None) != gym.vector.async_vector_env.AsyncState.DEFAULT:
            return
        asked = []
        for pipe in getattr(self, "parent_pipes", []):
            if pipe is not None:
                with contextlib.suppress(*PIPE_ERRORS):
                    pipe.send(("close", None))
                    asked.append(pipe)
        deadline = time.monotonic() + CLOSE_TIMEOUT_S
        for pipe in asked:
            with contextlib.suppress(*PIPE_ERRORS, EOFError):
                if pipe.poll(max(0.0, deadline - time.monotonic())):
                    pipe.recv()
        for process in getattr(self, "processes", []):
            if process.pid is not None:
                process.join(max(0.0, deadline - time.monotonic()))

    def _stop_workers(self) -> None:
        """Kills every worker (nothing under way is waited for), closes the pipes and
        reaps the workers."""
        # A process whose start failed (an env_fn "spawn" cannot pickle) has no pid.
        processes = [p for p in getattr(self, "processes", []) if p.pid is not None]
        for process in processes:  # first, before any wait a Ctrl-C could cut short
            if process.is_alive():
                process.kill()
        for pipe in getattr(self, "parent_pipes", []):
            if pipe is not None:
                pipe.close()
        deadline = time.monotonic() + CLOSE_TIMEOUT_S
        for process in processes:
            process.join(max(0.0, deadline - time.monotonic()))
        if hasattr(self, "_state"):
            self._state = gym.vector.async_vector_env.AsyncState.DEFAULT


_OPEN: weakref.WeakSet[AsyncVectorEnv] = weakref.WeakSet()


def _kill_at_exit(vec: AsyncVectorEnv) -> None:
    """Tracks `vec` so that the interpreter's exit kills its workers if nothing closed
    it (a Ctrl-C that cut a close short): multiprocessing's own exit handler sends live
    workers SIGTERM, which they ignore, and joins them without a timeout, so the process
    would never end. Registered after multiprocessing's handler, this one runs first."""
    if not _OPEN:
        atexit.unregister(_kill_open_workers)  # once, after multiprocessing's
        atexit.register(_kill_open_workers)
    _OPEN.add(vec)


def _kill_open_workers() -> None:
    for vec in list(_OPEN):
        if getattr(vec, "closed", True):
            continue
        for process in getattr(vec, "processes", []):
            if process.pid is not None and process.is_alive():
                process.kill()
        vec.closed = True  # nothing left for its __del__, at the interpreter's teardown


# Spaces whose shared memory is one flat array of their dtype, `size` items per env.
_FLAT_SPACES = (gym.spaces.Box, gym.spaces.Discrete, gym.spaces.MultiDiscrete,
                gym.spaces.MultiBinary)


def _observation_writer(space: gym.Space, index: int,
                        shared_memory: Any) -> Callable[[Any], None]:
    """Writes one env's observation into its slice of the vector env's shared memory.

    A Box, Discrete, MultiDiscrete or MultiBinary space's memory is one flat array: the
    env's slice of it is viewed once, here, and each observation is flattened into it
    (as gymnasium does, so an observation of the space's size in another shape is
    written too). gymnasium's `write_to_shared_memory` builds that view again at every
    step, which costs an async worker about 22 us of CPU a step against 2
    (benchmarks/HISTORY.md, "sebulba's own async env worker").
    Other spaces (Dict, Tuple, Text, ...) go through gymnasium's writer.
    """
    if not isinstance(space, _FLAT_SPACES):
        return lambda obs: write_to_shared_memory(space, index, obs, shared_memory)
    size = int(np.prod(space.shape))
    flat = np.frombuffer(shared_memory.get_obj(), dtype=space.dtype)
    row = flat[index * size:(index + 1) * size]

    def write(obs: Any) -> None:
        # As strict as gymnasium's "sync" vector env: no broadcast of a wrong size, no
        # cast that changes values (floats into uint8 frames), even with the checks off.
        obs = np.ravel(obs)
        if obs.size != size:
            raise ValueError(f"the env's observation has {obs.size} values, its observation "
                             f"space {space} {size}")
        np.copyto(row, obs, casting="same_kind")
    return write


def _check_supported(autoreset_mode: Any, semaphore: Any, shared_memory: Any) -> None:
    mode = gym.vector.AutoresetMode(autoreset_mode)
    if mode != gym.vector.AutoresetMode.NEXT_STEP or semaphore is not None:
        raise ValueError("sebulba's env worker runs NEXT_STEP autoreset with no "
                         f"max_concurrency, got {mode} and semaphore {semaphore!r}")
    if shared_memory is None:
        raise ValueError("sebulba's env worker writes observations to shared memory; "
                         "the AsyncVectorEnv has shared_memory=False")


def env_worker(index: int, env_fn: Callable[[], gym.Env], pipe: Connection,
               parent_pipe: Connection, shared_memory: Any, error_queue: Any,
               autoreset_mode: Any = gym.vector.AutoresetMode.NEXT_STEP,
               semaphore: Any = None) -> None:
    """The loop of one async env process, passed to AsyncVectorEnv as its `worker`.

    It speaks gymnasium's worker protocol (the same commands, replies and error reports
    as gymnasium's own worker), with the one autoreset mode sebulba uses, NEXT_STEP (the
    step after an episode's last only resets), and observations written into the shared
    memory through a slice viewed once (`_observation_writer`). An error, the env's or
    an unsupported setting's, is the reply to the command under way, which the parent
    raises; the env is closed on the way out.
    """
    # The parent decides when a worker ends: Ctrl-C reaches every process of the terminal's
    # group, and a scheduler's SIGTERM often every process of the job's (SLURM's does);
    # a worker that died of it would fail the run the parent is stopping gracefully. The
    # parent's forced close kills (SIGKILL); a parent that dies closes the pipe, which
    # ends the worker at its next command.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _end_with_parent()
    parent_pipe.close()
    env = None
    try:
        env = env_fn()
        write = None  # made at the first reset or step, after the parent checked the spaces
        autoreset = False
        while True:
            try:
                command, data = pipe.recv()
            except PIPE_ERRORS:  # the parent closed its end: nothing to answer
                break
            if write is None and command in ("reset", "step"):
                _check_supported(autoreset_mode, semaphore, shared_memory)
                write = _observation_writer(env.observation_space, index, shared_memory)
            if command == "step":
                if autoreset:
                    obs, info = env.reset()
                    reward, terminated, truncated = 0, False, False
                else:
                    obs, reward, terminated, truncated, info = env.step(data)
                autoreset = terminated or truncated
                write(obs)
                pipe.send(((None, reward, terminated, truncated, info), True))
            elif command == "reset":
                obs, info = env.reset(**data)
                autoreset = False
                write(obs)
                pipe.send(((None, info), True))
            elif command == "close":
                pipe.send((None, True))
                break
            else:
                pipe.send((_answer(env, command, data), True))
    except (KeyboardInterrupt, Exception):  # the reply to the command under way (or the
        error_type, error, _ = sys.exc_info()  # first one, for an env that cannot be made)
        error_queue.put(_error_report(index, error_type, error, traceback.format_exc()))
        if env is None:  # not made: reply to the parent's first command, not before it
            with contextlib.suppress(*PIPE_ERRORS):
                pipe.recv()
        # The reply, then the report wholly in the queue's pipe before the env's close (a
        # close that kills the process, a simulator's segfault, must not take the report
        # with it). Not the report first: the workers share the queue's pipe, and once
        # their reports fill it (64 KiB: a dozen tracebacks) the rest would wait for the
        # parent to read them, while the parent waits for their replies first.
        pipe.send((None, False))
        error_queue.close()
        error_queue.join_thread()
    finally:
        if env is not None:
            env.close()


def _error_report(index: int, error_type: type, error: BaseException,
                  trace: str) -> tuple[int, type, BaseException, str]:
    """What the error queue carries for the parent to re-raise. The queue pickles it in a
    background thread that only prints a failure, and the parent would wait forever for
    the lost report: an error that does not survive pickling is sent as a RuntimeError
    naming it instead."""
    # A deep recursion's trace: its two ends (characters of up to 4 bytes each).
    if len(trace) > _MAX_REPORT_BYTES // 8:
        end = _MAX_REPORT_BYTES // 16
        trace = f"{trace[:end]}\n[...]\n{trace[-end:]}"
    report = (index, error_type, error, trace)
    try:
        pickled = pickle.dumps(report)
        if len(pickled) > _MAX_REPORT_BYTES:
            raise ValueError(f"the report is {len(pickled)} bytes")
        pickle.loads(pickled)
        return report
    except Exception as e:  # noqa: BLE001 - any pickling failure
        message = (f"{error_type.__name__}: {str(error)[:1000]} (the env's error could not "
                   f"be sent from its worker as it is: {type(e).__name__}: {e})")
        return index, RuntimeError, RuntimeError(message), trace


def _end_with_parent() -> None:
    """Ends this worker process once its parent is gone: a parent killed (SIGKILL, out of
    memory) never closes it, and a worker stuck in its env would not read the closed
    pipe. A thread waiting on the parent's sentinel (whatever the start method: under
    "forkserver" the worker's OS parent is the server), not PR_SET_PDEATHSIG, which fires
    when the thread that started the worker ends, not its process."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        parent.join()
        os._exit(1)

    threading.Thread(target=watch, name="sebulba-parent-watch", daemon=True).start()


def _answer(env: gym.Env, command: str, data: Any) -> Any:
    """The reply to one of the worker protocol's other commands."""
    if command == "reset-noop":  # an env a partial reset leaves alone
        return None, {}
    if command == "_check_spaces":
        obs_mode, observation_space, action_space = data
        same = (observation_space == env.observation_space if obs_mode == "same"
                else is_space_dtype_shape_equiv(observation_space, env.observation_space))
        return same, action_space == env.action_space
    if command == "_call":
        name, args, kwargs = data
        if name in ("reset", "step", "close", "_setattr", "_check_spaces"):
            raise ValueError(f"call({name!r}) is not allowed: use the vector env's {name}")
        attr = env.get_wrapper_attr(name)
        return attr(*args, **kwargs) if callable(attr) else attr
    if command == "_setattr":
        name, value = data
        env.set_wrapper_attr(name, value)
        return None
    raise RuntimeError(f"unknown async env worker command {command!r}")
