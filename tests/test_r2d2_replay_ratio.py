"""R2D2's `updates_per_trajectory` counts optimizer steps per trajectory consumed, whatever
number of trajectories (`Config.trajectories_per_update`) one learner update joins."""

from __future__ import annotations

import pytest

import sebulba
from agents.r2d2 import R2D2, R2D2Config
from sebulba.envs import suite


@pytest.mark.timeout(300)
@pytest.mark.parametrize("trajectories_per_update", [1, 2])
def test_updates_per_trajectory_counts_optimizer_steps_per_trajectory(
        trajectories_per_update, no_leftovers):
    env, kwargs, T, E = suite.CUE_RECALL, {"num_cues": 2, "delay": 1}, 4, 4
    cfg = R2D2Config(torso_sizes=(8,), lstm_size=8, head_sizes=(8,), sequence_length=2 * T,
                     sequence_overlap=T, burn_in=2, batch_size=4, replay_capacity=64,
                     min_replay_size=8, updates_per_trajectory=3)
    agent = R2D2(sebulba.env_spec(env, kwargs), cfg)
    layout = sebulba.Layout(envs_per_group=E, num_groups=2, steps_per_cycle=T,
                            num_learner_devices=1, trajectories_per_update=trajectories_per_update)
    assert agent.optimizer_steps_per_update(layout) == 3 * trajectories_per_update
    config = sebulba.Config(env=env, env_kwargs=kwargs, envs_per_group=E, steps_per_cycle=T,
                            async_factor=2, trajectories_per_update=trajectories_per_update,
                            seed=1)
    result = sebulba.Sebulba(agent, config).run(E * T * 12)
    trajectories = result.lag_count  # consumed by the learner
    assert result.learner_updates * trajectories_per_update == trajectories >= 12
    assert result.optimizer_steps == 3 * trajectories, result.summary()
    assert int(result.state.opt.steps) > 0  # learning started: these are real steps
