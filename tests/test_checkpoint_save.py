"""Saving that cannot succeed: refused before any env starts when the checkpoint directory
cannot be written; a save that fails mid-run names the path and the cause in one line,
leaves no partial directory and the earlier checkpoints intact, and stops the run.

A full disk is simulated portably, and even for root, at the kernel: RLIMIT_FSIZE (with
SIGXFSZ ignored) makes every write past the limit fail with EFBIG, in tensorstore's C++
writes as in Python's."""

from __future__ import annotations

import contextlib
import os
import re
import resource
import shutil
import signal
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from sebulba.checkpoint import Checkpointer, CheckpointSaveError, check_writable
from tests.test_launcher import ROOT

SMALL = ["--envs_per_group=8", "--steps_per_cycle=8", "--progress=false",
         "--log_every_seconds=0"]


@contextlib.contextmanager
def file_size_limit(limit: int):
    """Writes past `limit` bytes of a file fail with EFBIG (as on a full disk) meanwhile."""
    old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, old_limit[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
        signal.signal(signal.SIGXFSZ, old_handler)


def limited(limit: int):
    def preexec():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
    return preexec


def launch(*args: str, limit: int | None = None, timeout: float = 200):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    return subprocess.run([sys.executable, "-m", "examples.train", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout,
                          preexec_fn=None if limit is None else limited(limit))


def partial_dirs(directory) -> list[str]:
    return [d for d in os.listdir(directory) if ".orbax-checkpoint-tmp" in d]


@pytest.mark.timeout(60)
def test_a_step_at_or_below_the_latest_is_refused_not_skipped(tmp_path):
    # Orbax's manager returns False for it and writes nothing: a run that started afresh
    # in another run's directory would have lost every save up to that run's latest.
    checkpointer = Checkpointer(str(tmp_path), max_to_keep=3)
    small = {"w": jnp.ones(10)}
    checkpointer.save(500, nets=small, opt=(), counters={"consumed": 500},
                      metadata={"agent": "a"})
    with pytest.raises(CheckpointSaveError, match=(
            f"checkpoint 100 was not written: {tmp_path} already holds step 500")):
        checkpointer.save(100, nets=small, opt=(), counters={"consumed": 100},
                          metadata={"agent": "a"})
    assert checkpointer.all_steps() == [500]
    checkpointer.close()


@pytest.mark.timeout(60)
def test_the_writer_removes_the_partial_saves_of_a_run_killed_while_it_saved(tmp_path):
    """A process killed mid-save (a preemption grace that ran out) leaves orbax's
    temporary directory, as large as a checkpoint; a reader (evaluate.py beside a run
    that is saving) must not remove a save under way."""
    checkpointer = Checkpointer(str(tmp_path), max_to_keep=3)
    checkpointer.save(10, nets={"w": jnp.ones(3)}, opt=(), counters={"consumed": 10},
                      metadata={"agent": "a"})
    checkpointer.close()
    (tmp_path / "20.orbax-checkpoint-tmp" / "nets").mkdir(parents=True)
    Checkpointer(str(tmp_path)).close()
    assert partial_dirs(tmp_path) == ["20.orbax-checkpoint-tmp"]
    writer = Checkpointer(str(tmp_path), clean_partial_saves=True)
    assert partial_dirs(tmp_path) == [] and writer.all_steps() == [10]
    writer.close()


@pytest.mark.timeout(60)
def test_a_failed_save_names_the_path_and_cause_removes_its_partial_directory(tmp_path):
    checkpointer = Checkpointer(str(tmp_path), max_to_keep=3)
    small = {"w": jnp.ones(10)}
    checkpointer.save(1, nets=small, opt=(), counters={"consumed": 1}, metadata={"agent": "a"})
    big = {"w": jnp.asarray(np.random.default_rng(0).normal(size=300_000), jnp.float32)}
    with file_size_limit(200_000), pytest.raises(CheckpointSaveError) as info:
        checkpointer.save(2, nets=big, opt=(), counters={"consumed": 2},
                          metadata={"agent": "a"})
    # Without the fix: tensorstore's ValueError of several lines with no errno, and
    # 2.orbax-checkpoint-tmp left behind.
    assert str(info.value) == (f"could not save checkpoint 2 in {tmp_path}: [Errno 27] File "
                               "too large; the earlier checkpoints are intact")
    assert partial_dirs(tmp_path) == []
    assert checkpointer.all_steps() == [1]
    restored = checkpointer.restore(nets=small, opt=(), metadata={"agent": "a"}, step=1)
    np.testing.assert_array_equal(restored.nets["w"], np.ones(10))
    checkpointer.close()


@pytest.mark.timeout(60)
def test_the_writability_probe_names_the_path_and_cause(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match=f"cannot save checkpoints in {tmp_path}/file: it is "
                                         "not a directory"):
        check_writable(str(tmp_path / "file"))
    with pytest.raises(ValueError, match=f"cannot save checkpoints in {tmp_path}/file/sub: "
                                         r"\[Errno 20\] Not a directory"):
        check_writable(str(tmp_path / "file" / "sub"))
    with file_size_limit(100), pytest.raises(
            ValueError, match=rf"cannot save checkpoints in {tmp_path}/ok: \[Errno 27\]"):
        check_writable(str(tmp_path / "ok"))
    check_writable(str(tmp_path / "ok"))
    assert os.listdir(tmp_path / "ok") == []  # the probe leaves nothing


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", ["checkpoints_is_a_file", "nothing_can_be_written"])
def test_an_unwritable_checkpoint_directory_is_a_usage_error_before_any_env_starts(
        tmp_path, case):
    logdir = tmp_path / "run"
    logdir.mkdir()
    if case == "checkpoints_is_a_file":
        (logdir / "checkpoints").write_text("not a directory")
        result = launch(f"--logdir={logdir}", "--total_env_steps=2000", *SMALL)
        cause = "it is not a directory"
    else:
        # Small writes (the lock's pid, Python's own probe of its temp directory) fit;
        # the 4 KiB of the probe do not.
        result = launch(f"--logdir={logdir}", "--total_env_steps=2000", *SMALL, limit=1000)
        cause = "[Errno 27] File too large"
    assert result.returncode == 2, result.stderr[-3000:]
    assert (f"train.py: error: cannot save checkpoints in {logdir}/checkpoints: {cause}\n"
            in result.stderr)
    assert "Traceback" not in result.stderr
    assert "env steps" not in result.stdout and not (logdir / "metrics.jsonl").exists()


@pytest.mark.timeout(400)
def test_a_save_that_fails_mid_run_stops_the_run_with_one_line(tmp_path):
    logdir = tmp_path / "run"
    big = ["--ppo_hidden_sizes=512,512", "--checkpoint_every_steps=1000", *SMALL]
    first = launch(f"--logdir={logdir}", "--total_env_steps=2000", "--keep_checkpoints=3",
                   *big)
    assert first.returncode == 0, first.stderr[-3000:]
    checkpoints = logdir / "checkpoints"
    saved = sorted(os.listdir(checkpoints))
    copy = tmp_path / "copy"
    shutil.copytree(checkpoints, copy)
    # A save of an earlier run killed midway: the resumed run removes it as it starts.
    (checkpoints / "1500.orbax-checkpoint-tmp").mkdir()
    # Networks of about 1 MiB do not fit under the limit; the run's other files (its
    # metrics, events, the probe) do.
    resumed = launch(f"--logdir={logdir}", "--resume", "--total_env_steps=4000", *big,
                     limit=300_000)
    assert resumed.returncode == 1, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout
    lines = [line for line in resumed.stderr.splitlines()
             if not re.match(r"[IWE]\d{4} ", line)]  # absl's log lines
    # The launcher ends with one line and no traceback of its own; under load a write of
    # the failed save still under way in orbax's threads has printed its traceback after
    # it as the process ended (twice in CI, never alone: left open in the notes).
    ends = [i for i, line in enumerate(lines)
            if line.startswith("train.py: error: could not save checkpoint ")]
    assert ends, resumed.stderr[-3000:]
    assert lines[ends[-1]].endswith(f" in {checkpoints}: [Errno 27] File too large; the "
                                    "earlier checkpoints are intact")
    assert "Traceback" not in "\n".join(lines[:ends[-1]])
    assert partial_dirs(checkpoints) == []
    assert sorted(os.listdir(checkpoints)) == saved
    for step in saved:  # intact: every file as it was
        for root, _, files in os.walk(copy / step):
            for name in files:
                path = os.path.join(root, name)
                other = checkpoints / os.path.relpath(path, copy)
                with open(path, "rb") as f:
                    assert other.read_bytes() == f.read()
