"""Running a benchmark script's smoke mode as the tests do: in a process session of its
own, on one CPU device compiled with XLA's cheapest optimizations (the smoke checks what
is recorded, not how fast), and checking that nothing of the session outlives it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from typing import NamedTuple

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class BenchmarkRun(NamedTuple):
    returncode: int
    stdout: str
    stderr: str
    printed: list[dict]  # the JSON records printed
    written: list[dict]  # the records of its --out file
    gone: bool  # no process of its session is left


def smoke_env() -> dict[str, str]:
    env = dict(os.environ)
    env["XLA_FLAGS"] = ("--xla_backend_optimization_level=0 "
                        "--xla_llvm_disable_expensive_passes=true")
    env["JAX_PLATFORMS"] = "cpu"
    return env


def run_benchmark(module: str, *args: str, out: str, timeout_s: float = 240) -> BenchmarkRun:
    """`python -m module *args --out=out` in its own session; fails the test if it
    outlasts `timeout_s` (its session is killed)."""
    proc = subprocess.Popen([sys.executable, "-m", module, *args, f"--out={out}"], cwd=ROOT,
                            env=smoke_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"{module} {' '.join(args)} did not finish within {timeout_s} s")
    printed = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    with open(out, encoding="utf-8") as f:
        written = [json.loads(line) for line in f]
    return BenchmarkRun(proc.returncode, stdout, stderr, printed, written,
                        session_gone(proc.pid))


def session_gone(session: int) -> bool:
    try:
        os.killpg(session, 0)
    except ProcessLookupError:
        return True
    return False
