"""One run per logdir: a launcher holds an OS file lock (flock) on its logdir for its life;
a second launcher on the same logdir stops at once naming the holder's pid, and a killed
run never blocks the next (the kernel releases its lock)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.test_launcher import ROOT, last_json, run

SMALL = ["--envs_per_group=8", "--steps_per_cycle=8", "--progress=false",
         "--log_every_seconds=0", "--ppo_hidden_sizes=16"]


@pytest.mark.timeout(300)
def test_a_second_launcher_on_a_logdir_in_use_stops_at_once_naming_the_pid(tmp_path):
    logdir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    first = subprocess.Popen(
        [sys.executable, "-m", "examples.train", f"--logdir={logdir}",
         "--total_env_steps=100000000", "--checkpoint_every_steps=1000000000", *SMALL],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 150
        while not (logdir / "metrics.jsonl").exists():  # it trains, holding the lock
            assert first.poll() is None, first.stderr.read()[-3000:]
            assert time.monotonic() < deadline, "the first launcher did not start training"
            time.sleep(0.5)
        start = time.monotonic()
        second = run("examples.train", f"--logdir={logdir}", "--total_env_steps=1000", *SMALL,
                     timeout=100)
        assert second.returncode == 2, second.stderr[-3000:]
        assert (f"train.py: error: --logdir={logdir} is in use by another run (pid "
                f"{first.pid} holds {logdir}/.lock): one run per logdir; wait for it to end, "
                "or choose another --logdir\n") in second.stderr
        assert "env steps" not in second.stdout
        assert time.monotonic() - start < 60  # before any env or compilation
        assert first.poll() is None  # the first run goes on
    finally:
        first.send_signal(signal.SIGKILL)  # no cleanup: only the kernel releases the lock
        first.wait(timeout=30)
        first.stderr.close()
    # The killed run's lock file is still there, with its pid, but no longer locked.
    assert (logdir / ".lock").read_text().strip() == str(first.pid)
    third = run("examples.train", f"--logdir={logdir}", "--total_env_steps=500", *SMALL,
                timeout=150)
    assert third.returncode == 0, third.stderr[-3000:]
    assert last_json(third.stdout)["consumed"] >= 500
