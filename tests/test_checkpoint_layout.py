"""Resume checks the run's layout: a checkpoint's step states and experience fit only the
layout that saved them (orbax restores an array as saved, whatever the target's shape),
so a run of another layout is refused with one line naming both values."""

from __future__ import annotations

import json
import os
import shutil

import jax
import jax.numpy as jnp
import pytest

from sebulba.checkpoint import LAYOUT_KEYS, Checkpointer, CheckpointMismatch
from tests.test_launcher import run

LAYOUT = {"envs_per_group": 16, "async_factor": 2, "inference_devices": 1,
          "num_processes": 1, "agents_per_env": 1, "learner_devices": 1}
NETS = {"w": jnp.ones((2, 3))}


def saved(tmp_path, *, layout=LAYOUT, experience=True) -> Checkpointer:
    checkpointer = Checkpointer(str(tmp_path))
    meta = {"agent": "ppo"} if layout is None else {"agent": "ppo", "layout": layout}
    checkpointer.save(1, nets=NETS, opt=(), counters={"consumed": 10}, metadata=meta,
                      local_experience={"x": jnp.zeros((1, 4))} if experience else None,
                      step_state={"h": jnp.zeros((32, 2))})
    return checkpointer


@pytest.mark.timeout(60)
@pytest.mark.parametrize("key", LAYOUT_KEYS)
def test_each_entry_of_another_layout_is_refused_naming_both_values(tmp_path, key):
    checkpointer = saved(tmp_path)
    run_layout = {**LAYOUT, key: LAYOUT[key] * 2}
    message = (f"checkpoint 1 in {tmp_path} was saved by a run of another layout: {key} "
               f"{LAYOUT[key]} (this run: {LAYOUT[key] * 2}). ")
    with pytest.raises(CheckpointMismatch, match="^" + message.replace("(", r"\(")
                       .replace(")", r"\)").replace(".", r"\.")):
        checkpointer.check_metadata({"agent": "ppo", "layout": run_layout})
    checkpointer.close()


@pytest.mark.timeout(60)
def test_learner_devices_matter_only_where_the_checkpoint_holds_experience(tmp_path):
    checkpointer = saved(tmp_path, experience=False)
    more = {"agent": "ppo", "layout": {**LAYOUT, "learner_devices": 2}}
    assert checkpointer.check_metadata(more)["layout"] == LAYOUT
    checkpointer.close()


@pytest.mark.timeout(60)
def test_an_older_checkpoint_without_a_layout_still_restores(tmp_path):
    checkpointer = saved(tmp_path, layout=None)
    restored = checkpointer.restore(nets=NETS, opt=(), metadata={"agent": "ppo",
                                                                "layout": LAYOUT})
    assert "layout" not in restored.metadata and restored.counters == {"consumed": 10}
    checkpointer.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("rows", [16, 64])
def test_step_states_of_another_shape_are_refused_not_restored_as_saved(tmp_path, rows):
    # What the layout check guards, checked on the arrays themselves too: orbax restored
    # the saved [32, 2] for targets of [16, 2] and [64, 2].
    checkpointer = saved(tmp_path, layout=None)
    with pytest.raises(CheckpointMismatch, match=rf"checkpoint 1 in {tmp_path} holds "
                       rf"step_state of another shape: \['h'\] \(checkpoint float32\[32, 2\], "
                       rf"run float32\[{rows}, 2\]\)"):
        checkpointer.restore(nets=NETS, opt=(), metadata={"agent": "ppo"},
                             step_state={"h": jnp.zeros((rows, 2))})
    restored = checkpointer.restore(nets=NETS, opt=(), metadata={"agent": "ppo"},
                                    step_state={"h": jnp.zeros((32, 2))})
    assert jax.tree.leaves(restored.step_state)[0].shape == (32, 2)
    checkpointer.close()


SMALL = ["--steps_per_cycle=8", "--progress=false", "--log_every_seconds=0",
         "--ppo_hidden_sizes=16"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> str:
    """A launcher run's logdir: 8 envs per group, 2 groups, 1 learner device."""
    logdir = str(tmp_path_factory.mktemp("layout") / "run")
    result = run("examples.train", f"--logdir={logdir}", "--total_env_steps=1000",
                 "--envs_per_group=8", "--async_factor=2", *SMALL)
    assert result.returncode == 0, result.stderr[-3000:]
    return logdir


def launcher_with_devices(*args: str, devices: int = 2):
    """examples.train on `devices` CPU devices."""
    import subprocess
    import sys

    from tests.test_launcher import ROOT
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    return subprocess.run([sys.executable, "-m", "examples.train", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=180)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("flags,differ", [
    (["--envs_per_group=4", "--async_factor=2"], "envs_per_group 8 (this run: 4)"),
    (["--envs_per_group=16", "--async_factor=2"], "envs_per_group 8 (this run: 16)"),
    (["--envs_per_group=8", "--async_factor=1"], "async_factor 2 (this run: 1)"),
    (["--envs_per_group=8", "--async_factor=2", "--learner_devices=0,1",
      "--inference_devices=0"], "learner_devices 1 (this run: 2)"),
])
def test_the_launcher_refuses_to_resume_into_another_layout(trained, flags, differ):
    result = launcher_with_devices(f"--logdir={trained}", "--resume",
                                   "--total_env_steps=2000", *flags, *SMALL)
    assert result.returncode == 2, result.stderr[-3000:]
    checkpoints = os.path.join(trained, "checkpoints")
    step = max(int(d) for d in os.listdir(checkpoints) if d.isdigit())
    assert (f"train.py: error: checkpoint {step} in {checkpoints} was saved by a run of "
            f"another layout: {differ}. ") in result.stderr
    assert "Traceback" not in result.stderr and "env steps" not in result.stdout


@pytest.mark.timeout(120)
@pytest.mark.parametrize("flag,differ", [
    ("--steps_per_cycle=16", "steps_per_cycle 8 (this run: 16)"),
    ("--trajectories_per_update=2", "trajectories_per_update 1 (this run: 2)"),
])
def test_an_experience_that_does_not_fit_names_the_setting_that_shapes_it(trained, flag,
                                                                         differ):
    """PPO's experience is a trajectory of T steps and K items: a run may change them
    (a replay of transitions does not depend on them), and a PPO checkpoint's experience
    that then does not fit is refused naming them, not by its arrays' shapes alone."""
    result = launcher_with_devices(f"--logdir={trained}", "--resume",
                                   "--total_env_steps=2000", "--envs_per_group=8",
                                   "--async_factor=2", *SMALL, flag)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "holds experience of another shape" in result.stderr
    assert (f"this run differs in {differ}: resume with the checkpoint's, or start a new "
            "run") in result.stderr


@pytest.mark.timeout(200)
def test_the_launcher_resumes_an_older_checkpoint_without_a_layout_and_says_so(trained,
                                                                              tmp_path):
    logdir = str(tmp_path / "run")
    shutil.copytree(trained, logdir)
    checkpoints = os.path.join(logdir, "checkpoints")
    step = max(int(d) for d in os.listdir(checkpoints) if d.isdigit())
    path = os.path.join(checkpoints, str(step), "meta", "metadata")
    with open(path) as f:
        meta = json.load(f)
    del meta["layout"]  # as checkpoints were written before they recorded it
    with open(path, "w") as f:
        json.dump(meta, f)
    result = run("examples.train", f"--logdir={logdir}", "--resume", "--total_env_steps=1500",
                 "--envs_per_group=8", "--async_factor=2", *SMALL)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (f"checkpoint {step} in {checkpoints} records no run layout (it was saved before "
            "checkpoints did): its envs_per_group, async_factor, processes and learner "
            "devices are not checked\n") in result.stderr
    assert f"resumed from {checkpoints} at {step:,} env steps" in result.stdout


@pytest.mark.timeout(120)
def test_networks_of_another_shape_name_the_flags_that_changed_them(trained):
    """The parameters' paths and shapes alone leave the user to guess the cause."""
    result = run("examples.train", f"--logdir={trained}", "--resume",
                 "--total_env_steps=2000", "--envs_per_group=8", "--async_factor=2",
                 *SMALL[:-1], "--ppo_hidden_sizes=32")
    assert result.returncode == 2, result.stderr[-3000:]
    assert "holds networks of another shape" in result.stderr
    assert ("(settings that differ from the checkpoint's: --ppo_hidden_sizes [16] -> [32])"
            in result.stderr)
