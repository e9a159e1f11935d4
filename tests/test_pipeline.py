"""What the learner receives: every env's steps and step states, on the right shard, in order."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

import sebulba
import sebulba.runtime.inferencer
from tests.counting_agent import CountingAgent
from tests.envs import CountingEnv

EPISODE_LENGTH = 5


def run_counting(async_factor, inference_devices, learner_devices, envs_per_group=4,
                 steps_per_cycle=3, cycles_per_group=5, **config):
    factory = functools.partial(CountingEnv, EPISODE_LENGTH)
    cfg = sebulba.Config(env=factory, envs_per_group=envs_per_group,
                         steps_per_cycle=steps_per_cycle, async_factor=async_factor,
                         inference_devices=inference_devices, learner_devices=learner_devices,
                         **config)
    agent = CountingAgent(sebulba.env_spec(factory), capacity=64)
    loop = sebulba.Sebulba(agent, cfg)
    total = cfg.num_groups * cycles_per_group * envs_per_group * steps_per_cycle
    return cfg, loop.run(total)


def expected_next(obs, terminated_now):
    """The counting env's next observation after `obs` = (id, episode, t)."""
    env_id, episode, t = obs
    if t == EPISODE_LENGTH:  # last step: the env resets
        return (env_id, episode + 1, 0)
    return (env_id, episode, t + 1)


@pytest.mark.parametrize(
    "async_factor,inference,learner",
    [
        (1, [0, 1], [2, 3]),
        (2, [0, 1], [2, 3]),
        (2, [0], [0]),
        (2, [0, 1], [0, 1, 2, 3]),
        (1, [3], [1, 2]),
    ],
)
@pytest.mark.timeout(120)
def test_each_shard_gets_its_envs_in_order(async_factor, inference, learner, no_leftovers):
    cfg, result = run_counting(async_factor, inference, learner)
    log = jax.tree.map(np.asarray, result.learner_experience)
    num_learners, envs_per_group, t_len = len(learner), cfg.envs_per_group, cfg.steps_per_cycle
    per_shard = envs_per_group // num_learners
    consumed_trajectories = result.consumed // (envs_per_group * t_len)
    assert result.consumed == consumed_trajectories * envs_per_group * t_len
    assert result.env_steps == result.consumed + result.dropped + result.in_flight
    assert result.dropped == 0

    seen = {}  # env id -> list of (initial count, obs [T+1, 3], first [T+1], final count/id)
    for shard in range(num_learners):
        size = int(log.size[shard])
        assert size == consumed_trajectories  # every trajectory reaches every shard
        for k in range(size):
            ids = log.obs[shard, k, :, :, 0]  # [E/L, T+1]
            assert (ids == ids[:, :1]).all()
            ids = ids[:, 0].astype(int)
            group, offset = divmod(int(ids[0]), envs_per_group)
            # This shard holds a contiguous block of one group's envs, its own block.
            assert offset == shard * per_shard
            expected_ids = group * envs_per_group + offset + np.arange(per_shard)
            np.testing.assert_array_equal(ids, expected_ids)
            for j, env_id in enumerate(ids):
                seen.setdefault(int(env_id), []).append((
                    int(log.initial_count[shard, k, j]), log.obs[shard, k, j],
                    log.first[shard, k, j], int(log.final_count[shard, k, j]),
                    float(log.final_id[shard, k, j]),
                ))

    groups_seen = {env_id // envs_per_group for env_id in seen}
    assert groups_seen <= set(range(cfg.num_groups))
    for env_id, trajectories in seen.items():
        # In order, nothing lost or duplicated: initial counts are 0, T, 2T, ...
        counts = [c for c, *_ in trajectories]
        assert counts == [k * t_len for k in range(len(trajectories))], env_id
        previous_last = None
        for initial, obs, first, final, final_id in trajectories:
            assert final == initial + t_len
            assert final_id == env_id  # the step state acted on this env's observations
            if previous_last is None:
                np.testing.assert_array_equal(obs[0], (env_id, 0, 0))
                assert first[0]
            else:  # consecutive trajectories overlap by one env step
                np.testing.assert_array_equal(obs[0], previous_last)
            for t in range(t_len):
                assert tuple(obs[t + 1]) == expected_next(tuple(obs[t]), None), (env_id, obs)
                assert first[t + 1] == (obs[t][2] == EPISODE_LENGTH)
            previous_last = obs[-1]


@pytest.mark.timeout(120)
def test_early_host_copies_deliver_the_same_stream(monkeypatch, no_leftovers):
    # On an accelerator the acting call's outputs start their copies to the host at
    # dispatch (`inferencer.copies_early_to_host`); forced here on the CPU.
    copied = []
    start = sebulba.runtime.inferencer.start_host_copies
    monkeypatch.setattr(sebulba.runtime.inferencer, "start_host_copies",
                        lambda output: (copied.append(1), start(output)))
    cfg, result = run_counting(2, [0], [0, 1], cycles_per_group=3)
    assert not copied  # on the CPU the outputs are host memory already
    monkeypatch.setattr(sebulba.runtime.inferencer, "copies_early_to_host", lambda device: True)
    cfg, result = run_counting(2, [0], [0, 1], cycles_per_group=3)
    assert len(copied) * cfg.envs_per_group >= result.env_steps  # once per acting call
    assert result.env_steps == result.consumed + result.dropped + result.in_flight
    log = jax.tree.map(np.asarray, result.learner_experience)
    assert int(log.size[0]) == int(log.size[1]) == result.consumed // (4 * 3) > 0
    for traj in log.obs[0, : int(log.size[0])].reshape(-1, 4, 3):
        for t in range(3):
            assert tuple(traj[t + 1]) == expected_next(tuple(traj[t]), None)


@pytest.mark.timeout(120)
def test_async_vectorization_delivers_the_same_stream(no_leftovers):
    cfg, result = run_counting(2, [0], [0, 1], vectorization="async", cycles_per_group=3)
    log = jax.tree.map(np.asarray, result.learner_experience)
    assert int(log.size[0]) == int(log.size[1]) == result.consumed // (4 * 3)
    obs = log.obs[0, : int(log.size[0])]
    for traj in obs.reshape(-1, 4, 3):
        for t in range(3):
            assert tuple(traj[t + 1]) == expected_next(tuple(traj[t]), None)


@pytest.mark.timeout(120)
def test_drop_when_full_accounts_for_every_step(no_leftovers):
    import time

    class SlowLearner(CountingAgent):
        def update_experience(self, *args):
            jax.debug.callback(lambda: time.sleep(0.05))
            return super().update_experience(*args)

    factory = functools.partial(CountingEnv, EPISODE_LENGTH)
    cfg = sebulba.Config(env=factory, envs_per_group=4, steps_per_cycle=2, async_factor=2,
                         queue_capacity=1, drop_when_full=True)
    loop = sebulba.Sebulba(SlowLearner(sebulba.env_spec(factory)), cfg)
    result = loop.run(4 * 2 * 10)
    assert result.dropped > 0
    assert result.env_steps == result.consumed + result.dropped + result.in_flight
    assert result.consumed >= 80
