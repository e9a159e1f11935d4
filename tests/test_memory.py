"""Sizes that cannot work are refused before anything is allocated; a run shorter than
one learner update says so."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import jax
import pytest

import sebulba
from agents.r2d2 import R2D2, R2D2Config
from agents.spg import SPG, SPGConfig
from sebulba.runtime import memory

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _spg_loop(**config) -> sebulba.Sebulba:
    cfg = sebulba.Config(env="CartPole-v1", **config)
    return sebulba.Sebulba(SPG(cfg.env_spec(), SPGConfig()), cfg)


def test_the_estimate_is_what_the_initial_state_allocates():
    cfg = sebulba.Config(env="CartPole-v1", envs_per_group=40, steps_per_cycle=40,
                         inference_devices=[0, 1], learner_devices=[2, 3])
    agent = R2D2(cfg.env_spec(), R2D2Config(replay_capacity=64, min_replay_size=32,
                                            sequence_length=80, sequence_overlap=40))
    loop = sebulba.Sebulba(agent, cfg)
    need = memory.estimate(agent, loop.layout, loop.inference_devices,
                           loop.local_learner_devices, cfg.effective_queue_capacity)
    state = loop.initial_state()
    learners = len(loop.local_learner_devices)
    assert need.host["experience"] == memory.tree_bytes(state.experience) * learners
    assert need.host["optimizer state"] == memory.tree_bytes(state.opt) * learners
    # Step states: every group's, and the learner's copy of them.
    assert need.host["step states"] == 2 * memory.tree_bytes(state.step_state)
    assert need.per_device == {}  # a CPU platform: everything is host memory
    assert need.host["experience"] > 0 and need.host["recorded trajectories"] > 0


def test_trajectories_scale_with_envs_steps_and_the_queue():
    small = _spg_loop(envs_per_group=8, steps_per_cycle=16)
    big = _spg_loop(envs_per_group=16, steps_per_cycle=16, queue_capacity=6)

    def parts(loop):
        return memory.estimate(loop.agent, loop.layout, loop.inference_devices,
                               loop.local_learner_devices,
                               loop.config.effective_queue_capacity).host

    a, b = parts(small), parts(big)
    assert b["recorded trajectories"] == 2 * a["recorded trajectories"]
    # 2 groups' worth in the queue and one popped, then 6 and one, twice the envs.
    assert b["queued trajectories"] == 2 * a["queued trajectories"] * 7 // 3
    # each item carries its initial and final step states; one item per update: no join
    step_state = memory.tree_bytes(jax.eval_shape(
        lambda k: small.agent.new_step_state(small.agent.new_networks(k), k, 8),
        jax.random.key(0)))
    assert a["queued step states"] == 2 * step_state * 3 and "joined trajectories" not in a
    joined = parts(_spg_loop(envs_per_group=8, steps_per_cycle=16, trajectories_per_update=2))
    assert joined["joined trajectories"] == 2 * (
        a["queued trajectories"] // 3 + 2 * step_state)


def test_a_layout_that_cannot_fit_is_refused_before_anything_is_allocated(no_leftovers):
    available = memory.available_host_bytes()
    assert available is not None and available > 0
    loop = _spg_loop(envs_per_group=10**9, steps_per_cycle=32)
    start = time.monotonic()
    with pytest.raises(ValueError) as error:
        loop.run(10**12)
    assert time.monotonic() - start < 10  # no env made, no array allocated
    message = str(error.value)
    assert "2 env groups of 1,000,000,000 envs" in message
    assert "TiB of host memory" in message and "recorded trajectories" in message
    # What was available when the loop looked: other processes free and take memory
    # meanwhile (14.x GiB here, 15 GiB there, once, beside another test's processes).
    named = re.search(r"more than the ([\d.,]+) (B|KiB|MiB|GiB|TiB) available", message)
    assert named, message
    units = {"B": 0, "KiB": 1, "MiB": 2, "GiB": 3, "TiB": 4}
    seen = float(named[1].replace(",", "")) * 1024 ** units[named[2]]
    assert 0.8 * available <= seen <= 1.25 * available, (seen, available)
    with pytest.raises(ValueError, match="TiB of host memory"):
        loop.initial_state()


def test_the_launcher_refuses_it_in_one_line(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.run(
        [sys.executable, "-m", "examples.train", "--envs_per_group=1000000000",
         f"--logdir={tmp_path}"], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=120)
    assert proc.returncode != 0
    assert proc.stderr.startswith("train.py: error: the layout (2 env groups of "
                                  "1,000,000,000 envs"), proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "checkpoints").exists() or not any(
        (tmp_path / "checkpoints").iterdir())


def test_fewer_steps_than_one_update_warn_and_say_what_runs(no_leftovers):
    loop = _spg_loop(envs_per_group=4, steps_per_cycle=16)  # 2 groups: 64 per update
    with pytest.warns(UserWarning, match=r"total_env_steps=10 is less than one learner "
                      r"update, which consumes 64 env steps"):
        result = loop.run(10)
    assert result.consumed == 64


def test_human_bytes():
    assert memory.human_bytes(512) == "512 B"
    assert memory.human_bytes(3 * 2**20) == "3 MiB"
    assert memory.human_bytes(1.5 * 2**30) == "1.5 GiB"
    assert memory.human_bytes(2**41) == "2 TiB"


def test_tree_bytes_counts_keys_and_shape_structs():
    tree = {"a": jax.ShapeDtypeStruct((3, 4), "float32"), "k": jax.random.key(0)}
    assert memory.tree_bytes(tree) == 3 * 4 * 4 + jax.random.key(0).dtype.itemsize
