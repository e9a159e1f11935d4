"""sebulba.experience.warmup: every learner device counts the run's env steps from its
own shard, the count saturates instead of wrapping, and bad thresholds are refused."""

from __future__ import annotations

import re

import jax.numpy as jnp
import pytest

import sebulba
from sebulba.experience import warmup
from sebulba.types import ActorOutput, EnvStep, Trajectory


def shard(rows: int, steps: int) -> Trajectory:
    """A trajectory shard of `rows` envs and `steps` actions (T + 1 env steps)."""
    zeros = jnp.zeros((rows, steps + 1))
    flags = zeros.astype(bool)
    return Trajectory(EnvStep(obs=zeros, reward=zeros, first=flags, terminated=flags,
                              truncated=flags),
                      ActorOutput(action=jnp.zeros((rows, steps), jnp.int32)))


def layout(learner_devices: int, processes: int) -> sebulba.Layout:
    return sebulba.Layout(envs_per_group=8, num_groups=2, steps_per_cycle=5,
                          num_learner_devices=learner_devices, num_processes=processes)


@pytest.mark.parametrize(("learner_devices", "processes"), [(1, 1), (2, 1), (2, 3)])
def test_each_device_counts_the_whole_runs_env_steps(learner_devices, processes):
    count = warmup.new_count(layout(learner_devices, processes))
    devices = learner_devices * processes
    assert int(count.learner_devices) == devices and int(count.env_steps) == 0
    for _ in range(3):  # a shard of 4 rows x 5 steps on each of the run's devices
        count = warmup.add(count, shard(4, 5))
    assert int(count.env_steps) == 3 * 4 * 5 * devices
    assert bool(warmup.reached(count, 3 * 4 * 5 * devices))
    assert not bool(warmup.reached(count, 3 * 4 * 5 * devices + 1))


def test_the_count_saturates_instead_of_wrapping():
    count = warmup.new_count(layout(2, 1))._replace(
        env_steps=jnp.asarray(warmup.SATURATION - 7, jnp.int32))
    for _ in range(3):
        count = warmup.add(count, shard(4, 5))  # 40 env steps a time, past the cap
        assert int(count.env_steps) == warmup.SATURATION
    assert bool(warmup.reached(count, warmup.SATURATION))


@pytest.mark.parametrize("bad", [-1, 1.5, True, "100", warmup.SATURATION + 1])
def test_a_bad_threshold_is_refused_naming_it(bad):
    count = warmup.new_count(layout(1, 1))
    with pytest.raises(ValueError, match=rf"env_steps.*{re.escape(repr(bad))}"):
        warmup.reached(count, bad)
