"""How the fault matrix (benchmarks/faults.py) starts a run's processes, notes the time of
its fault and finds what it left behind.

Every process started for a run carries a marker in its environment, so its env workers
are found even when orphaned (from /proc: Linux)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MARKER = "SEBULBA_FAULT_RUN"  # in the environment of every process started for a run
SETTLE_S = 5.0  # a run's processes still alive this long after it ended are left behind


# --- the time of a fault, noted by whichever process of the run it happens in ---

def note(work: str, name: str = "fault_at") -> None:
    """Writes the time now into `work/name`, once (a later call keeps the first)."""
    try:
        with open(os.path.join(work, name), "x") as f:
            f.write(repr(time.time()))
    except FileExistsError:
        pass


def noted(work: str, name: str = "fault_at") -> float | None:
    try:
        with open(os.path.join(work, name)) as f:
            return float(f.read())
    except (FileNotFoundError, ValueError):  # ValueError: not written yet
        return None


# --- a run's processes and threads ---

def run_processes(marker: str) -> list[int]:
    """Live (not zombie) processes whose marker starts with `marker`, but this one and
    multiprocessing's resource tracker (a helper of a live process, which ends with it)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if not any(v.startswith(f"{MARKER}={marker}".encode())
                           for v in f.read().split(b"\0")):
                    continue
            with open(f"/proc/{pid}/stat") as f:
                zombie = f.read().rsplit(")", 1)[1].split()[0] in "ZX"
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                tracker = b"resource_tracker" in f.read()
        except OSError:
            continue
        if not zombie and not tracker and int(pid) != os.getpid():
            found.append(int(pid))
    return found


def left_behind(marker: str) -> list[int]:
    """The run's processes still alive `SETTLE_S` after it ended."""
    deadline = time.monotonic() + SETTLE_S
    while (pids := run_processes(marker)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return pids


def sebulba_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("sebulba-")]


def kill_all(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
            os.kill(pid, signal.SIGCONT)  # a stopped process ends only once continued
        except ProcessLookupError:
            pass


# --- starting one, and reading what it wrote ---

def start(args: list[str], marker: str, log: str) -> subprocess.Popen:
    """`python ARGS` in the checkout; output to `log`.out and .err (a full pipe would
    block it)."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    with open(log + ".out", "w") as out, open(log + ".err", "w") as err:
        return subprocess.Popen([sys.executable, *args], cwd=ROOT, env={**env, MARKER: marker},
                                stdout=out, stderr=err)


def read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except FileNotFoundError:
        return ""


def last_json(path: str) -> dict:
    lines = [line for line in read(path).splitlines() if line.startswith("{")]
    return json.loads(lines[-1]) if lines else {}


def wait_for(ready: Callable[[], bool], procs: list[subprocess.Popen],
             timeout: float = 180.0) -> str | None:
    """Until `ready()`; what went wrong otherwise."""
    deadline = time.monotonic() + timeout
    while not ready():
        if any(p.poll() is not None for p in procs):
            return f"a process ended before the fault: exits {[p.poll() for p in procs]}"
        if time.monotonic() > deadline:
            return f"not ready within {timeout} s"
        time.sleep(0.1)
    return None


def wait_timed(proc: subprocess.Popen, timeout: float) -> tuple[int | None, float]:
    """(its exit code or None if it ran past `timeout`, the time.time() it ended)."""
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        rc = None
    return rc, time.time()
