"""SPG learns CartPole-v1 in the real Sebulba loop: gymnasium envs, inferencer threads, learner."""

from __future__ import annotations

import threading

import pytest

import sebulba
from agents.spg import SPG, SPGConfig

TOTAL_ENV_STEPS = 400_000


@pytest.mark.timeout(600)
def test_spg_learns_cartpole():
    # 64-step cycles of 16 envs: 1024 env steps per update. With 32-step cycles the
    # policy can collapse to a single action (returns ~9) after reaching 500. With these
    # settings the last 10% ends at 483-499 over seeds 0-3 (large returns divided by
    # their std; raw, 310-487 over twelve seeds), from ~32.
    config = sebulba.Config(
        env="CartPole-v1",
        envs_per_group=16,
        vectorization="sync",
        async_factor=2,
        steps_per_cycle=64,
        seed=0,
    )
    agent = SPG(sebulba.env_spec(config.env), SPGConfig())
    result = sebulba.Sebulba(agent, config).run(TOTAL_ENV_STEPS)

    assert [t for t in threading.enumerate() if t.name.startswith("sebulba-")] == []
    assert result.env_steps == result.consumed + result.dropped + result.in_flight
    assert result.consumed >= TOTAL_ENV_STEPS
    first, last = result.mean_return(0.0, 0.1), result.mean_return(0.9, 1.0)
    report = f"first 10%: {first:.1f}, last 10%: {last:.1f}\n{result.summary()}"
    assert last >= 150, report
    assert last >= 2 * first, report


@pytest.mark.timeout(600)
def test_spg_learns_acrobot_a_task_its_defaults_were_not_tuned_on(no_leftovers):
    """Acrobot pays -1 a step for up to 500 steps (random: about -500). Its returns of
    about -100 are divided by their std ("down"): the last 10% ends at -94 to -103 over
    seeds 0-3; with raw rewards no seed of the four reached the goal in the recorded run
    (three of four in an earlier one; benchmarks/RESULTS.md, "Reward scales")."""
    config = sebulba.Config(env="Acrobot-v1", envs_per_group=16, vectorization="sync",
                            async_factor=2, steps_per_cycle=64, seed=0)
    result = sebulba.Sebulba(SPG(sebulba.env_spec(config.env)), config).run(TOTAL_ENV_STEPS)
    last = result.mean_return(0.9, 1.0)
    assert last >= -200, f"last 10%: {last:.1f}\n{result.summary()}"
