"""R2D2 learns what needs memory, in the real Sebulba loop.

Metric: mean return of the episodes completed in the last 10% of the budget, with the
actors' own exploration (per-env epsilon from 0.4 down to 0.4^8: on cue recall with 32
envs the mean epsilon is ~0.06, so the best achievable is ~0.97).
"""

from __future__ import annotations

import pytest

import sebulba
from agents.r2d2 import R2D2, R2D2Config
from sebulba.envs import suite

CUE_RECALL = suite.CUE_RECALL
CUE_KWARGS = {"num_cues": 2, "delay": 5}  # 7-step episodes; chance is 0.5, the max 1
CARTPOLE = suite.CARTPOLE_NO_VELOCITY  # a uniformly random policy scores ~22


def run(env: str, env_kwargs: dict, config: R2D2Config, steps: int,
        seed: int) -> sebulba.RunResult:
    loop_config = sebulba.Config(env=env, env_kwargs=env_kwargs, envs_per_group=16,
                                 steps_per_cycle=config.sequence_period, async_factor=2,
                                 seed=seed)
    agent = R2D2(sebulba.env_spec(env, env_kwargs), config)
    result = sebulba.Sebulba(agent, loop_config).run(steps)
    assert result.env_steps == result.consumed + result.dropped + result.in_flight
    assert result.consumed >= steps
    return result


def cue_recall_config(use_lstm: bool) -> R2D2Config:
    # Sequences of 16 (8 of burn-in) cover two 7-step episodes.
    return R2D2Config(torso_sizes=(32,), lstm_size=32, head_sizes=(32,), use_lstm=use_lstm,
                      sequence_length=16, sequence_overlap=8, burn_in=4, n_step=3,
                      discount=0.9, target_update_period=50, learning_rate=1e-3,
                      batch_size=32, replay_capacity=2000, min_replay_size=200,
                      updates_per_trajectory=2)


@pytest.mark.timeout(600)
def test_r2d2_recalls_the_cue_where_a_feed_forward_q_network_cannot(no_leftovers):
    # At 50k steps the LSTM's last-10% mean is near 0.96-0.98 and the feed-forward
    # agent's near 0.5. The LSTM reaches ~0.96 by 20-30k steps, sometimes with a brief
    # dip later. ~10 s per run alone, 25-45 s on 2 cores under load.
    steps = 50_000
    recurrent = run(CUE_RECALL, CUE_KWARGS, cue_recall_config(use_lstm=True), steps, seed=0)
    feed_forward = run(CUE_RECALL, CUE_KWARGS, cue_recall_config(use_lstm=False), steps, seed=0)
    assert recurrent.mean_return(0.9, 1.0) >= 0.9, recurrent.summary()
    assert feed_forward.mean_return(0.9, 1.0) <= 0.6, feed_forward.summary()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_r2d2_defaults_learn_small_rewards_that_need_memory(no_leftovers):
    """RepeatFirst-v0 with R2D2's defaults: name the symbol shown at step 0 at each of 50
    steps, 1/50 a step; without memory the best is 0.265 (a policy sees zeros after step
    0). The defaults' learner schedule is what this checks: with the paper's (a target
    copy every 2,500 steps, learning from 5,000 sequences, Adam at 1e-4, eps 1e-3) the
    agent is at chance at 300k steps.
    """
    # With the defaults (own value torso and LSTM, rewards in units of their RMS, 3-step
    # returns) in the memory suite's loop R2D2 reaches 0.8 by 100k steps and about 0.94 at
    # 1M; the feed-forward twin 0.26.
    result = run(suite.REPEAT_FIRST, {}, R2D2Config(), 120_000, seed=0)
    assert result.mean_return(0.9, 1.0) >= 0.6, result.summary()


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_r2d2_defaults_repeat_the_symbol_shown_four_steps_back(no_leftovers):
    """RepeatPrevious-v0 (k = 4, 1/46 a rewarded step; chance 0.25) with the defaults,
    and the feed-forward twin at chance. In the memory suite's loop (1M steps; the last
    10% over the optimum) the defaults end at 0.91-0.94, at 0.8 by 700k to 850k; the twin
    at 0.25. A shared value core with raw rewards stays near 0.44. This test and the
    CartPole one take about 5 minutes together on 2 cores."""
    task = suite.REPEAT_PREVIOUS
    recurrent = run(task, {}, R2D2Config(), 1_000_000, seed=1)
    assert recurrent.mean_return(0.9, 1.0) >= 0.8, recurrent.summary()
    feed_forward = run(task, {}, R2D2Config(use_lstm=False), 300_000, seed=1)
    assert feed_forward.mean_return(0.9, 1.0) <= 0.3, feed_forward.summary()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_r2d2_balances_cartpole_without_velocities(no_leftovers):
    # The bar is >= 150 within 1M steps; 300k suffice: the last-10% mean at 300k is near
    # 375-390 with Adam's epsilon 1e-3 (~150 is passed near 200k), and the default 1e-6
    # passes too. 30-50 s per run on 2 cores: in the slow set, to keep the default suite
    # short (cue recall stays there).
    config = R2D2Config(torso_sizes=(64,), lstm_size=64, head_sizes=(64,),
                        sequence_length=40, sequence_overlap=20, burn_in=10, n_step=5,
                        discount=0.99, target_update_period=200, learning_rate=5e-4,
                        batch_size=32, replay_capacity=5000, min_replay_size=500,
                        updates_per_trajectory=4)
    result = run(CARTPOLE, {}, config, 300_000, seed=0)
    assert result.mean_return(0.9, 1.0) >= 150, result.summary()
