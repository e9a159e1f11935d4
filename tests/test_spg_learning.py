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
    # settings the last 10% ends at 310-487 over twelve seeds, from ~32.
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
