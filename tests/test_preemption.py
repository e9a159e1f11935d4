"""Preemption: SIGTERM and SIGINT save a checkpoint and end every process in bounded time."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from tests.test_failures import _alive
from tests.test_launcher import run_together

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--envs_per_group=8", "--steps_per_cycle=8", "--progress=false",
         "--log_every_seconds=0", "--checkpoint_every_steps=1000000000",
         "--total_env_steps=1000000000"]
GRACE = 30.0


def _descendants(pid: int) -> set[int]:
    """Every process below `pid`, from /proc (env workers, their children)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().split(")")[-1].split()[1])
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def _launch(args: list[str], new_session: bool = False) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    return subprocess.Popen([sys.executable, "-m", "examples.train", *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=new_session)


def _wait_until_training(proc: subprocess.Popen, logdir, timeout: float = 120.0) -> None:
    """Until the run has written a learner update's metrics (so it is past its set-up)."""
    deadline = time.monotonic() + timeout
    metrics = logdir / "metrics.jsonl"
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        if metrics.exists() and metrics.read_text().count("\n") >= 2:
            return
        time.sleep(0.2)
    raise AssertionError(f"no metrics in {metrics} within {timeout} s")


def _checkpoint_steps(logdir) -> list[int]:
    directory = logdir / "checkpoints"
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())


@pytest.mark.timeout(300)
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_saves_a_checkpoint_and_exits_with_128_plus_its_number(signum, tmp_path):
    logdir = tmp_path / "run"
    # async envs (SIGTERM): worker processes, which must not outlive the run;
    # --resume_if_present starts afresh where there is no checkpoint yet
    vectorization = "async" if signum == signal.SIGTERM else "sync"
    proc = _launch([f"--logdir={logdir}", "--resume_if_present",
                    f"--vectorization={vectorization}", *SMALL], new_session=True)
    try:
        _wait_until_training(proc, logdir)
        workers = _descendants(proc.pid)
        if vectorization == "async":
            assert len(workers) >= 8, workers  # 2 groups x 8 envs
        sent = time.monotonic()
        # To the whole process group, as a terminal's Ctrl-C and a scheduler (SLURM) send
        # it: the env workers get it too.
        os.killpg(proc.pid, signum)
        out, err = proc.communicate(timeout=GRACE + 30)
        elapsed = time.monotonic() - sent
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 128 + signum, err[-3000:]
    assert elapsed <= GRACE, elapsed
    name = signal.Signals(signum).name
    assert f"stopped by {name} after" in err
    summary = json.loads([line for line in out.splitlines() if line.startswith("{")][-1])
    assert summary["stopped_early"] and summary["consumed"] > 0
    steps = _checkpoint_steps(logdir)
    assert steps and steps[-1] == summary["total_consumed"]
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in workers if _alive(p)]
    if signum != signal.SIGTERM:
        return
    # The same command again, as a requeued job runs it, continues from it.
    args = [f"--logdir={logdir}", "--resume_if_present", *SMALL[:-1],
            f"--total_env_steps={steps[-1] + 1000}"]
    resumed = subprocess.run([sys.executable, "-m", "examples.train", *args], cwd=ROOT,
                             env={k: v for k, v in os.environ.items() if k != "XLA_FLAGS"},
                             capture_output=True, text=True, timeout=180)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"at {steps[-1]:,} env steps" in resumed.stdout


@pytest.mark.timeout(300)
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_one_process_of_two_ends_both_with_a_checkpoint(signum, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    logdir = tmp_path / "run"
    procs = [_launch([f"--coordinator_address=127.0.0.1:{port}", "--num_processes=2",
                      f"--process_id={i}", "--heartbeat_timeout_seconds=30",
                      f"--logdir={logdir}", *SMALL]) for i in range(2)]
    try:
        _wait_until_training(procs[0], logdir)
        children = set().union(*(_descendants(p.pid) for p in procs))
        sent = time.monotonic()
        procs[1].send_signal(signum)  # the other process is told by the run
        results = [p.communicate(timeout=GRACE + 30) for p in procs]
        elapsed = time.monotonic() - sent
    finally:
        for p in procs:
            p.kill()
            p.wait()
    # The signalled process exits with its signal's code; a peer it stopped exits as if it
    # had been preempted (SIGTERM), so that a job script requeues on one code.
    for p, (_, err), code in zip(procs, results, [signal.SIGTERM, signum], strict=True):
        assert p.returncode == 128 + code, err[-3000:]
    assert elapsed <= GRACE, elapsed
    assert f"stopped by {signal.Signals(signum).name}" in results[1][1]
    assert "stopped by a signal to another process" in results[0][1]
    # Both parts of the checkpoint, at the same step: process 0's (networks, its envs'
    # step states) and process 1's own; one save each (no periodic ones in this run), at
    # the update both stopped after, none by the signalled process alone before it.
    steps = _checkpoint_steps(logdir)
    own = sorted(int(p.name[:-5]) for p in (tmp_path / "run" / "checkpoints_process_1").iterdir()
                 if p.name.endswith(".json"))
    assert len(steps) == 1 and own == steps, (steps, own)
    assert not [c for c in children if _alive(c)]  # nothing they started outlives them


STUCK_SCRIPT = textwrap.dedent("""
    import multiprocessing, os, signal, sys, time
    from sebulba.runtime.preemption import Preemption
    if __name__ == "__main__":
        child = multiprocessing.Process(target=time.sleep, args=(600,))
        child.start()
        print(child.pid, flush=True)
        with Preemption(grace_seconds=float(sys.argv[1])):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(600)  # a run that never gets back to its stop check
""")


@pytest.mark.timeout(60)
def test_a_run_that_does_not_stop_in_time_is_ended_with_its_children():
    proc = subprocess.Popen([sys.executable, "-c", STUCK_SCRIPT, "1.0"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        child = int(proc.stdout.readline())
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "did not stop within 1 s of SIGTERM" in err
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(child)


def test_the_grace_period_must_be_positive():
    from sebulba.runtime.preemption import Preemption

    with pytest.raises(ValueError, match="grace_seconds must be > 0, got 0"):
        Preemption(0)


def test_entering_off_the_main_thread_is_an_error_that_starts_nothing(no_leftovers):
    import threading

    from sebulba.runtime.preemption import Preemption

    errors = []

    def enter():
        try:
            with Preemption(5.0):
                pass
        except RuntimeError as e:
            errors.append(str(e))

    fds_before = len(os.listdir("/proc/self/fd"))
    worker = threading.Thread(target=enter, name="not-main")
    worker.start()
    worker.join(10)
    assert errors == ["Preemption must be entered in the main thread (signal handlers are "
                      "set there), not 'not-main'"]
    assert len(os.listdir("/proc/self/fd")) == fds_before  # no pipe left open
    assert not [t for t in threading.enumerate() if t.name == "sebulba-signals"]


EARLY_SIGNAL_SCRIPT = textwrap.dedent("""
    import os, signal, time
    import jax
    from examples import train
    from examples.config_flags import run_main

    restore = train.restore

    def restore_then_signalled(launch):
        # The signal comes while process 1 sets up (a slow restore), before training.
        restore(launch)
        if jax.process_index() == 1:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(2)  # for the signal thread to see it before restore returns

    train.restore = restore_then_signalled
    run_main(train.main)
""")


@pytest.mark.timeout(300)
def test_a_signal_to_one_process_before_training_ends_both_together_with_a_checkpoint(
        tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    logdir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    results = run_together(
        [["-c", EARLY_SIGNAL_SCRIPT, f"--coordinator_address=127.0.0.1:{port}",
          "--num_processes=2", f"--process_id={i}", "--heartbeat_timeout_seconds=30",
          "--preemption_grace_seconds=120", f"--logdir={logdir}", *SMALL] for i in range(2)],
        [env, env], timeout=240)
    # Not process 1 alone (which aborted in the cluster's shutdown barrier, rc 134, and
    # process 0 a collective timeout later, rc 1): both stop after the same update, save
    # it and exit as preempted.
    for result in results:
        assert result.returncode == 128 + signal.SIGTERM, result.stderr[-3000:]
    assert "SIGTERM before training started" in results[1].stderr
    assert "stopped by SIGTERM after" in results[1].stderr
    assert "stopped by a signal to another process" in results[0].stderr
    steps = _checkpoint_steps(logdir)
    own = sorted(int(p.name[:-5]) for p in (logdir / "checkpoints_process_1").iterdir()
                 if p.name.endswith(".json"))
    assert len(steps) == 1 and own == steps, (steps, own)
    assert "no checkpoint saved" not in results[1].stderr
