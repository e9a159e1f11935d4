"""Damaged checkpoints: every way a part of a step can be damaged is named as damage, and a
resumed run falls back to the newest intact checkpoint (or stops with one line)."""

from __future__ import annotations

import glob
import os
import re
import shutil

import jax.numpy as jnp
import numpy as np
import pytest

from sebulba.checkpoint import Checkpointer, DamagedCheckpoint
from tests.test_launcher import run

NETS = {"w": jnp.arange(4000.0).reshape(40, 100), "b": jnp.ones(7)}
OPT = {"m": jnp.full((40, 100), 0.5)}
META = {"agent": "ppo"}


def _files(step_dir: str, part: str) -> list[str]:
    if part == "meta":
        return [os.path.join(step_dir, "meta", "metadata")]
    # The data files of an item: tensorstore's OCDBT nodes and chunks.
    return [p for p in glob.glob(os.path.join(step_dir, part, "**", "d", "*"), recursive=True)
            if os.path.isfile(p)]


def damage(step_dir: str, part: str, how: str) -> None:
    """Damages checkpoint part `part` ("nets", "opt", "meta", or "step" for the whole step
    directory emptied) of `step_dir`: truncated, deleted or garbled (overwritten with
    random bytes, as a bad disk block reads back)."""
    if part == "step":
        for name in os.listdir(step_dir):
            path = os.path.join(step_dir, name)
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
        return
    files = _files(step_dir, part)
    assert files, (step_dir, part)
    rng = np.random.default_rng(0)
    for path in files:
        if how == "deleted":
            os.remove(path)
        elif how == "truncated":
            with open(path, "r+b") as f:
                f.truncate(os.path.getsize(path) // 2)
        else:
            size = os.path.getsize(path)
            with open(path, "wb") as f:
                f.write(rng.integers(0, 256, size, dtype=np.uint8).tobytes())


DAMAGE = [(part, how) for part in ("nets", "opt", "meta")
          for how in ("truncated", "deleted", "garbled")] + [("step", "emptied")]


@pytest.mark.timeout(120)
def test_an_intact_optimizer_state_of_another_structure_is_a_mismatch_not_damage(tmp_path):
    """A resumed run whose agent settings change the optimizer (its clip left out): the
    checkpoint is intact, and says which settings differ, instead of being passed over
    (and set aside) as damaged."""
    import optax

    from sebulba.checkpoint import CheckpointMismatch

    nets = {"w": jnp.ones((3, 2))}
    clipped = optax.chain(optax.clip_by_global_norm(0.5), optax.adam(1e-3))
    saved = {"agent": "ppo", "agent_config": {"max_grad_norm": 0.5}}
    checkpointer = Checkpointer(str(tmp_path), max_to_keep=3)
    checkpointer.save(1, nets=nets, opt=clipped.init(nets), counters={"consumed": 1},
                      metadata=saved)
    run = {"agent": "ppo", "agent_config": {"max_grad_norm": 0.0}}
    with pytest.raises(CheckpointMismatch, match=re.escape(
            "its opt is intact but does not fit this run's, whose agent settings differ "
            "from the checkpoint's (max_grad_norm: checkpoint 0.5, run 0.0)")):
        checkpointer.restore(nets=nets, opt=optax.adam(1e-3).init(nets), metadata=run, step=1)
    # With the checkpoint's settings it restores
    restored = checkpointer.restore(nets=nets, opt=clipped.init(nets), metadata=saved, step=1)
    assert restored.counters == {"consumed": 1}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("part,how", DAMAGE)
def test_each_damage_of_each_part_is_named_and_the_step_before_restores(tmp_path, part, how):
    checkpointer = Checkpointer(str(tmp_path), max_to_keep=3)
    for step in (1, 2):
        checkpointer.save(step, nets=jax_tree_times(NETS, step), opt=OPT,
                          counters={"consumed": step}, metadata=META)
    damage(str(tmp_path / "2"), part, how)
    checkpointer.close()
    checkpointer = Checkpointer(str(tmp_path), max_to_keep=3)  # as a new run reads it
    # Without the fix: tensorstore's OUT_OF_RANGE / DATA_LOSS ValueError, a JSON or
    # unicode error, FileNotFoundError or KeyError, none naming the step or the part.
    with pytest.raises(DamagedCheckpoint) as info:
        checkpointer.restore(nets=NETS, opt=OPT, metadata=META, step=2)
    error = info.value
    assert error.step == 2 and error.directory == str(tmp_path)
    assert error.part == ("meta" if part in ("meta", "step") else part)
    assert str(error).startswith(f"checkpoint 2 in {tmp_path} is damaged: its {error.part} "
                                 "cannot be read (")
    assert "\n" not in str(error)
    restored = checkpointer.restore(nets=NETS, opt=OPT, metadata=META, step=1)
    np.testing.assert_array_equal(restored.nets["w"], NETS["w"])
    checkpointer.close()


def jax_tree_times(tree, k):
    return {name: x * k for name, x in tree.items()}


SMALL = ["--envs_per_group=8", "--steps_per_cycle=8", "--progress=false",
         "--log_every_seconds=0", "--ppo_hidden_sizes=16"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> str:
    """A launcher run's logdir with checkpoints 1024, 2048 and 3008."""
    logdir = str(tmp_path_factory.mktemp("trained") / "run")
    result = run("examples.train", f"--logdir={logdir}", "--total_env_steps=3000",
                 "--checkpoint_every_steps=1000", "--keep_checkpoints=3", *SMALL)
    assert result.returncode == 0, result.stderr[-3000:]
    return logdir


def steps_in(directory: str) -> list[int]:
    return sorted(int(d) for d in os.listdir(directory) if d.isdigit())


@pytest.mark.timeout(300)
def test_resume_falls_back_to_the_newest_intact_checkpoint(trained, tmp_path):
    logdir = str(tmp_path / "run")
    shutil.copytree(trained, logdir)
    checkpoints = os.path.join(logdir, "checkpoints")
    newest, second, oldest = steps_in(checkpoints)[::-1]
    damage(os.path.join(checkpoints, str(newest)), "nets", "truncated")
    damage(os.path.join(checkpoints, str(second)), "step", "emptied")
    result = run("examples.train", f"--logdir={logdir}", "--resume", "--total_env_steps=4000",
                 "--checkpoint_every_steps=1000", *SMALL)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (f"--resume: skipping checkpoint {newest} in {checkpoints}: it is damaged, its "
            "nets cannot be read (OUT_OF_RANGE: ") in result.stderr
    assert (f"--resume: skipping checkpoint {second} in {checkpoints}: it is damaged, its "
            "meta cannot be read (KeyError: ") in result.stderr
    assert f"resumed from {checkpoints} at {oldest:,} env steps" in result.stdout
    # The damaged steps are set aside (not deleted), and the run saved its own after them.
    assert steps_in(checkpoints + "_damaged") == [second, newest]
    assert steps_in(checkpoints)[-1] >= 4000
    assert "Traceback" not in result.stderr


@pytest.mark.timeout(200)
def test_resume_with_no_intact_checkpoint_stops_with_one_line_naming_the_directory(
        trained, tmp_path):
    logdir = str(tmp_path / "run")
    shutil.copytree(trained, logdir)
    checkpoints = os.path.join(logdir, "checkpoints")
    for step, (part, how) in zip(steps_in(checkpoints), [("meta", "garbled"),
                                                         ("opt", "deleted"),
                                                         ("nets", "garbled")], strict=True):
        damage(os.path.join(checkpoints, str(step)), part, how)
    result = run("examples.train", f"--logdir={logdir}", "--resume", "--total_env_steps=4000",
                 *SMALL)
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if line.startswith("train.py: error:")]
    assert errors == [f"train.py: error: --resume: no intact checkpoint in {checkpoints}: every "
                      f"one of {steps_in(checkpoints)} is damaged (see above)"]
    assert result.stderr.count("--resume: skipping checkpoint") == 3
    assert "Traceback" not in result.stderr and "env steps" not in result.stdout
    assert steps_in(checkpoints) == steps_in(os.path.join(trained, "checkpoints"))  # untouched


@pytest.mark.timeout(300)
def test_evaluate_passes_over_damaged_checkpoints_as_resume_does(trained, tmp_path):
    """examples.evaluate's default is the newest intact checkpoint (it crashed on a
    damaged newest one); a damaged step asked for by --step is one line, no traceback."""
    logdir = str(tmp_path / "run")
    shutil.copytree(trained, logdir)
    checkpoints = os.path.join(logdir, "checkpoints")
    newest, second, _ = steps_in(checkpoints)[::-1]
    damage(os.path.join(checkpoints, str(newest)), "meta", "garbled")
    result = run("examples.evaluate", f"--checkpoint={logdir}", "--episodes=2",
                 "--num_envs=2")
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"checkpoint {newest} is damaged: passed over" in result.stderr
    assert f'"checkpoint_env_steps": {second}' in result.stdout
    asked = run("examples.evaluate", f"--checkpoint={logdir}", f"--step={newest}")
    assert asked.returncode == 2 and "Traceback" not in asked.stderr
    assert f"--checkpoint={logdir}: checkpoint {newest}" in asked.stderr


@pytest.mark.timeout(60)
@pytest.mark.parametrize("file, how, part", [
    ("640.npz", "truncate", "arrays"), ("640.npz", "garble", "arrays"),
    ("640.json", "truncate", "meta"), ("640.json", "garble", "meta"),
    ("640.json", "list", "meta")])
def test_a_damaged_part_of_a_process_s_own_is_named_with_its_step_and_directory(
        tmp_path, file, how, part):
    """Not a raw zipfile.BadZipFile or JSONDecodeError naming nobody."""
    from sebulba.checkpoint import ProcessCheckpointer

    directory = str(tmp_path / "checkpoints_process_1")
    own = ProcessCheckpointer(directory)
    state = {"h": jnp.arange(1000.0)}
    own.save(640, counters={"consumed": 640}, metadata=META, step_state=state)
    path = os.path.join(directory, file)
    with open(path, "rb") as f:
        data = f.read()
    damaged = {"truncate": data[: len(data) // 2], "garble": b"\x00garbled" * 20,
               "list": b"[1, 2]"}[how]
    with open(path, "wb") as f:
        f.write(damaged)
    with pytest.raises(DamagedCheckpoint) as e:
        own.restore(metadata=META, step=640, step_state=state)
    assert (e.value.directory, e.value.step, e.value.part) == (directory, 640, part)
    assert f"checkpoint 640 in {directory} is damaged: its {part} cannot be read" in str(
        e.value)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("failing", [0, 1])
def test_a_part_one_process_cannot_read_is_one_error_in_every_process(
        tmp_path, monkeypatch, failing):
    """Each process contributes its step, or -(step + 2) where its own part of that step
    is damaged, to one collective: every process then raises the same error naming the
    failing process and step (not the failing one alone, the other in a gloo timeout)."""
    import types

    import jax

    from examples import train
    from sebulba.runtime import distributed

    directory = str(tmp_path / "checkpoints")
    launch = types.SimpleNamespace(checkpointer=types.SimpleNamespace(directory=directory))
    restored = types.SimpleNamespace(counters={"consumed": 640})
    damage = DamagedCheckpoint(f"{directory}_process_1", 640, "arrays",
                               ValueError("File is not a zip file"))
    monkeypatch.setattr(jax, "process_count", lambda: 2)

    def restore_intact(launch, state):
        if failing:
            raise damage
        return restored, None

    monkeypatch.setattr(train, "restore_intact", restore_intact)
    contributed = []

    def value_of_every_process(value):  # this process is process `failing`
        contributed.append(value)
        return [640, -642]  # process 0's step; process 1's own part of 640 damaged

    monkeypatch.setattr(distributed, "value_of_every_process", value_of_every_process)
    with pytest.raises(ValueError) as e:
        train.restore_agreed(launch, None)
    message = str(e.value)
    assert message.startswith(
        f"--resume: process 1 could not read its own part of checkpoint 640 (in "
        f"{directory}_process_1: damaged); the processes must resume from one checkpoint")
    assert ("File is not a zip file" in message) == bool(failing)  # the cause, its own
    assert contributed == [-642 if failing else 640]
    # Every process failing alike (e.g. no intact checkpoint): each raises its own error.
    monkeypatch.setattr(distributed, "value_of_every_process", lambda v: [-642, -642])
    monkeypatch.setattr(train, "restore_intact", lambda launch, state: (_ for _ in ()).throw(
        damage))
    with pytest.raises(DamagedCheckpoint):
        train.restore_agreed(launch, None)
