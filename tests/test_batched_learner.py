"""A batched learner (`Config.trajectories_per_update` = K): each update joins K queue items
along the env axis, on the learner devices, and learns from all of them at once."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src import dispatch

import sebulba
from agents.impala import IMPALA, IMPALAConfig
from agents.ppo import PPO, PPOConfig
from agents.r2d2 import R2D2, R2D2Config
from sebulba.envs import suite
from sebulba.runtime import sharding
from sebulba.runtime.channels import QueueItem
from sebulba.runtime.learner import Learner, env_axis_joiner
from tests.counting_agent import CountingAgent
from tests.envs import CountingEnv
from tests.test_pipeline import EPISODE_LENGTH, expected_next
from tests.test_r2d2 import SPEC as R2D2_SPEC
from tests.test_r2d2 import act_two_groups, check_stored_sequences, small_config

COUNTING = functools.partial(CountingEnv, EPISODE_LENGTH)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("value", [0, 1.5, -2, True, "2"])
def test_trajectories_per_update_must_be_an_int_of_at_least_one(value):
    with pytest.raises(ValueError, match=rf"trajectories_per_update must be an int >= 1, "
                                         rf"got {value!r}"):
        sebulba.Config(trajectories_per_update=value)
    assert sebulba.Config().trajectories_per_update == 1
    # K larger than the queue and than the number of groups is allowed (see Config).
    assert sebulba.Config(trajectories_per_update=5, queue_capacity=1).num_groups == 2


@pytest.mark.timeout(60)
def test_the_layout_counts_the_rows_of_an_update():
    layout = sebulba.Layout(envs_per_group=8, num_groups=4, steps_per_cycle=5,
                            num_learner_devices=2, trajectories_per_update=3)
    assert layout.envs_per_learner_shard == 4  # E / L, of one trajectory
    assert layout.envs_per_update_shard == 12  # K x E / L, of one update
    assert layout.total_envs == 32  # unchanged by K
    assert sebulba.Layout(8, 4, 5, 2).envs_per_update_shard == 4  # K = 1 by default


@pytest.mark.timeout(60)
def test_a_learner_update_takes_exactly_k_items():
    agent = CountingAgent(sebulba.env_spec(COUNTING))

    def layout(k):
        return sebulba.Layout(envs_per_group=4, num_groups=2, steps_per_cycle=3,
                              num_learner_devices=1, trajectories_per_update=k)

    learner = Learner(agent, jax.devices()[:1], layout(2))
    item = QueueItem(0, 0, None, None, None, 12)
    with pytest.raises(ValueError, match="takes trajectories_per_update=2 queue items, got 1"):
        learner.update(item)
    with pytest.raises(ValueError, match="takes trajectories_per_update=2 queue items, got 3"):
        learner.update([item] * 3)
    with pytest.raises(ValueError, match="trajectories_per_update must be an int >= 1, got 0"):
        Learner(agent, jax.devices()[:1], layout(0))

    # The learner asks the agent for the optimizer steps of an update of its layout.
    class StepsFromLayout(CountingAgent):
        steps = None

        def optimizer_steps_per_update(self, layout):
            return self.steps if self.steps is not None else (
                layout.trajectories_per_update * layout.steps_per_cycle)

    agent = StepsFromLayout(sebulba.env_spec(COUNTING))
    assert Learner(agent, jax.devices()[:1], layout(2)).optims_per_update == 2 * 3
    agent.steps = -1
    with pytest.raises(ValueError, match=r"StepsFromLayout.optimizer_steps_per_update\(layout\) "
                                         r"must be an int >= 0, got -1"):
        Learner(agent, jax.devices()[:1], layout(2))


@pytest.mark.timeout(60)
def test_the_join_concatenates_each_devices_envs_and_keeps_the_sharding():
    devices = jax.devices()[1:3]

    def item(offset):
        tree = {"x": jnp.arange(8.0).reshape(4, 2) + offset,  # 4 envs
                "keys": jax.random.split(jax.random.key(offset), 4),  # per-env keys
                "key": jax.random.key(offset),  # 0-d leaves: replicated
                "n": jnp.int32(offset)}
        return sharding.shard_env_axis(tree, devices)

    items = [item(0), item(100), item(200)]
    joined = env_axis_joiner(devices)(tuple(items))
    assert joined["x"].shape == (2, 6, 2)
    # Device d holds its 2 envs of item 0, then of item 1, then of item 2.
    for d in range(2):
        expected = np.concatenate([np.asarray(it["x"][d]) for it in items])
        np.testing.assert_array_equal(joined["x"][d], expected)
        np.testing.assert_array_equal(
            jax.random.key_data(joined["keys"][d]),
            np.concatenate([jax.random.key_data(it["keys"][d]) for it in items]))
    np.testing.assert_array_equal(joined["n"], [0, 0])  # the first item's
    np.testing.assert_array_equal(jax.random.key_data(joined["key"]),
                                  jax.random.key_data(items[0]["key"]))
    for name in joined:
        # Sharded as the items are: update_experience neither recompiles nor reshards.
        assert joined[name].sharding == items[0][name].sharding, name
        assert {s.device for s in joined[name].addressable_shards} == set(devices)
        assert all(s.data.shape[0] == 1 for s in joined[name].addressable_shards)


def counting_run(k, async_factor, inference, learner, updates, **config):
    cfg = sebulba.Config(env=COUNTING, envs_per_group=4, steps_per_cycle=3,
                         async_factor=async_factor, inference_devices=inference,
                         learner_devices=learner, trajectories_per_update=k, **config)
    loop = sebulba.Sebulba(CountingAgent(sebulba.env_spec(COUNTING), capacity=64), cfg)
    return cfg, loop.run(updates * k * cfg.envs_per_group * cfg.steps_per_cycle)


@pytest.mark.parametrize(
    "k,async_factor,inference,learner",
    [
        (2, 2, [0], [0]),  # one learner device
        (2, 2, [0, 1], [2, 3]),  # two learner devices, four groups
        (3, 2, [0], [1, 2]),  # K above the number of groups (and the queue's capacity)
    ],
)
@pytest.mark.timeout(180)
def test_each_update_holds_k_trajectories_in_order(k, async_factor, inference, learner,
                                                   no_leftovers):
    cfg, result = counting_run(k, async_factor, inference, learner, updates=8)
    log = jax.tree.map(np.asarray, result.learner_experience)
    num_learners, e, t_len = len(learner), cfg.envs_per_group, cfg.steps_per_cycle
    per_shard = e // num_learners
    trajectories = result.consumed // (e * t_len)
    assert result.consumed == trajectories * e * t_len == 8 * k * e * t_len
    assert result.env_steps == result.consumed + result.dropped + result.in_flight
    assert result.learner_updates == trajectories // k == 8
    assert len(result.policy_lags) == trajectories  # one lag per item, not per update
    assert log.obs.shape[2] == k * per_shard  # the update's rows: K x E / L

    # Which groups' cycles an update joins is up to the threads' timing (an update may
    # hold two cycles of one group); every update is checked whatever it joined, and the
    # join of items from anywhere is checked exactly in
    # test_the_join_concatenates_each_devices_envs_and_keeps_the_sharding.
    for shard in range(num_learners):
        assert int(log.size[shard]) == result.learner_updates
        seen = {}  # env id -> its trajectories, in the order the learner got them
        for u in range(result.learner_updates):
            for item in range(k):  # item k's envs are rows [k E/L, (k + 1) E/L)
                rows = slice(item * per_shard, (item + 1) * per_shard)
                ids = log.obs[shard, u, rows, :, 0]
                assert (ids == ids[:, :1]).all()
                ids = ids[:, 0].astype(int)
                group, offset = divmod(int(ids[0]), e)
                assert offset == shard * per_shard  # this shard's block of one group's envs
                np.testing.assert_array_equal(ids, group * e + offset + np.arange(per_shard))
                for j, env_id in enumerate(ids):
                    r = item * per_shard + j
                    seen.setdefault(int(env_id), []).append((
                        int(log.initial_count[shard, u, r]), log.obs[shard, u, r],
                        log.first[shard, u, r], int(log.final_count[shard, u, r]),
                        float(log.final_id[shard, u, r])))
        assert sum(len(v) for v in seen.values()) == trajectories * per_shard
        for env_id, trajs in seen.items():
            # In order, nothing lost or duplicated: initial counts are 0, T, 2T, ...
            assert [c for c, *_ in trajs] == [i * t_len for i in range(len(trajs))], env_id
            previous_last = None
            for initial, obs, first, final, final_id in trajs:
                assert final == initial + t_len and final_id == env_id
                if previous_last is None:
                    np.testing.assert_array_equal(obs[0], (env_id, 0, 0))
                    assert first[0]
                else:  # consecutive trajectories overlap by one env step
                    np.testing.assert_array_equal(obs[0], previous_last)
                for s in range(t_len):
                    assert tuple(obs[s + 1]) == expected_next(tuple(obs[s]), None)
                    assert first[s + 1] == (obs[s][2] == EPISODE_LENGTH)
                previous_last = obs[-1]


@pytest.mark.timeout(120)
def test_nothing_recompiles_after_the_first_joined_updates(no_leftovers):
    compiles = []

    def listener(event, duration, **kwargs):
        if event == dispatch.BACKEND_COMPILE_EVENT:
            compiles.append(event)

    cfg = sebulba.Config(env=COUNTING, envs_per_group=4, steps_per_cycle=3,
                         inference_devices=[0, 1], learner_devices=[2, 3],
                         trajectories_per_update=2)
    loop = sebulba.Sebulba(CountingAgent(sebulba.env_spec(COUNTING)), cfg)
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        loop.run(2 * 2 * 4 * 3 * 4)
        assert compiles, "the listener saw no compilation at all"
        compiles.clear()
        result = loop.run(20 * 2 * 4 * 3)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert result.learner_updates == 20
    assert compiles == []


@pytest.mark.timeout(180)
def test_ppo_learns_from_two_trajectories_per_update(no_leftovers):
    env, kwargs = suite.CUE_RECALL, {"num_cues": 2, "delay": 3}
    config = sebulba.Config(env=env, env_kwargs=kwargs, envs_per_group=4, steps_per_cycle=16,
                            async_factor=2, inference_devices=[0], learner_devices=[1, 2],
                            trajectories_per_update=2)

    def ppo(num_segments):
        return PPO(sebulba.env_spec(env, kwargs),
                   PPOConfig(use_lstm=True, hidden_sizes=(16,), lstm_size=16, bptt_horizon=4,
                             num_minibatches=2, num_epochs=1, num_segments=num_segments))

    # An update is 2 trajectories x 4 envs x 16 steps in 4-step segments: 32, not 16.
    with pytest.raises(ValueError, match="sized for 16 segments, but the envs fill 32"):
        sebulba.Sebulba(ppo(16), config).initial_state()
    result = sebulba.Sebulba(ppo(32), config).run(2 * 4 * 16 * 5)
    trajectories = result.consumed // (4 * 16)
    assert result.env_steps == result.consumed + result.dropped + result.in_flight
    assert result.learner_updates == trajectories // 2 == 5
    assert len(result.policy_lags) == trajectories
    assert result.optimizer_steps == 2 * result.learner_updates
    assert np.isfinite(result.metrics["loss"])
    # Each learner device holds 2 x 2 envs' 16 segments of 4 steps.
    batch = result.state.experience.batch
    assert batch.obs.shape[:2] == (16, 4)
    # the policy's and the value's LSTM states (a core each, the default)
    assert [c.cell.shape for c in batch.core] == [(16, 16), (16, 16)]


@pytest.mark.timeout(180)
def test_impala_learns_from_two_trajectories_per_update(no_leftovers):
    config = sebulba.Config(envs_per_group=8, steps_per_cycle=8, learner_devices=[0, 1],
                            inference_devices=[2], trajectories_per_update=2, seed=3)
    agent = IMPALA(sebulba.env_spec("CartPole-v1"),
                   IMPALAConfig(use_lstm=True, lstm_size=16, hidden_sizes=(16,)))
    result = sebulba.Sebulba(agent, config).run(8 * 8 * 2 * 12)
    trajectories = result.consumed // (8 * 8)
    assert result.env_steps == result.consumed + result.dropped + result.in_flight
    assert result.learner_updates == trajectories // 2 == 12
    assert len(result.policy_lags) == trajectories and min(result.policy_lags) >= 0
    assert np.isfinite(result.metrics["loss"]) and np.isfinite(result.metrics["rho_mean"])
    latest = result.state.experience.latest  # of one learner device: 2 x 8 / 2 envs
    assert latest.trajectory.actor_outputs.action.shape == (8, 8)
    # the policy's and the value's LSTM states (IMPALA's LSTM has a value core of its own)
    assert [c.cell.shape for c in latest.core] == [(8, 16), (8, 16)]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("length", [8, 12])  # 2 and 3 trajectories per sequence
def test_r2d2_joined_trajectories_fill_each_envs_own_slot_in_order(length):
    # Two groups, one learner shard of two (rows 2 and 3 of each group); updates of two
    # trajectories, some of two groups, some of two cycles of one group.
    T, E, D = 4, 4, 2
    agent = R2D2(R2D2_SPEC, small_config(sequence_length=length, sequence_overlap=length - T,
                                         replay_capacity=64))
    nets = agent.new_networks(jax.random.key(0))
    layout = sebulba.Layout(envs_per_group=E, num_groups=2, steps_per_cycle=T,
                            num_learner_devices=D, trajectories_per_update=2)
    state = agent.new_state(nets, jax.random.key(1), layout)
    experience = state.experience
    cycles = 5
    groups = act_two_groups(agent, nets, state.step_state, E, T, cycles)
    arrivals = [[(0, 0), (0, 1)], [(1, 0), (0, 2)], [(1, 1), (1, 2)], [(0, 3), (1, 3)],
                [(1, 4), (0, 4)]]
    update = jax.jit(agent.update_experience)
    rows = slice(2, 4)
    for pair in arrivals:
        pieces = [groups[g][0][c] for g, c in pair]
        initial = jax.tree.map(lambda *x: jnp.concatenate([y[rows] for y in x]),
                               *[p[0] for p in pieces])
        traj = jax.tree.map(lambda *x: jnp.concatenate([y[rows] for y in x]),
                            *[p[1] for p in pieces])
        experience = update(experience, initial, None, traj, nets)
    replay = experience.replay
    per_env = cycles - length // T + 1
    assert int(replay.size) == 2 * 2 * per_env
    for i in range(int(replay.size)):
        item = jax.tree.map(lambda x, i=i: np.asarray(x[i]), replay.items)
        env = int(item.env_index)
        g, row = divmod(env, E)
        assert row in (2, 3)  # only this shard's envs
        stream = groups[g][1]
        # Which sequence of this env: rows of the same env are inserted in time order.
        start = sum(int(replay.items.env_index[p]) == env for p in range(i)) * T
        jax.tree.map(lambda got, want, r=row: np.testing.assert_array_equal(got, want[r]),
                     item.core, stream["core"][start])
        obs = np.stack([s.obs[row] for s in stream["steps"][start:start + length]])
        np.testing.assert_array_equal(item.env_steps.obs[:length], obs)
        actions = np.array([a[row] for a in stream["actions"][start:start + length]])
        np.testing.assert_array_equal(item.action, actions)


@pytest.mark.timeout(600)
def test_r2d2_real_run_with_two_trajectories_per_update(no_leftovers):
    # As test_r2d2's real run: learning never starts, so the learner can recompute what
    # the actors did; a sequence's stored state unrolled over its first T steps is the
    # env's next sequence's stored state, whichever update each came in.
    env, kwargs, T, E = suite.CUE_RECALL, {"num_cues": 2, "delay": 3}, 4, 4
    cfg = R2D2Config(torso_sizes=(8,), lstm_size=8, head_sizes=(8,), sequence_length=2 * T,
                     sequence_overlap=T, burn_in=2, batch_size=4, replay_capacity=200,
                     min_replay_size=200)
    agent = R2D2(sebulba.env_spec(env, kwargs), cfg)
    config = sebulba.Config(env=env, env_kwargs=kwargs, envs_per_group=E, steps_per_cycle=T,
                            async_factor=2, learner_devices=[0, 1], trajectories_per_update=2,
                            seed=3)
    result = sebulba.Sebulba(agent, config).run(2 * E * T * 12)
    assert result.env_steps == result.consumed + result.dropped + result.in_flight
    assert result.learner_updates == result.consumed // (E * T) // 2 == 12
    for size, checked in check_stored_sequences(agent, result, E, T):
        # An env that sent n trajectories holds n - 1 sequences; the 2 groups sent 24.
        assert size == 2 * (24 - 2) and checked > 0
