"""The hot paths make only their own host-device transfers, counted per step, under JAX's
transfer guard (which on XLA:CPU catches implicit host-to-device transfers; the counts
stand in for the device-to-host ones, which only an accelerator's guard sees)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sebulba
from agents.registry import AGENTS
from sebulba.envs.base import example_env_step
from sebulba.runtime import sharding, transfers

ACT = {"acting: observations to device", "acting: actions to host"}
LEARN = {"learner: version to device", "learner: metrics to host",
         "cycle: trajectory to learner devices"}
BY_ID = {"acting: snapshot slots to device", "cycle: snapshot slot to device"}
EXTRAS = "acting: extras to host"  # by id: each step's, in the actions' batch
CYCLE_EXTRAS = "cycle: extras to host"  # in order: a cycle's, stacked on the device
ROLE_CALL = "sebulba.envs.suite.role_call"


def _loop(agent_name: str, vectorization: str, env: str = "CartPole-v1",
          **agent_config) -> sebulba.Sebulba:
    steps = 40 if agent_name == "r2d2" else 8
    cfg = sebulba.Config(env=env, envs_per_group=4, steps_per_cycle=steps,
                         vectorization=vectorization, transfer_guard=True)
    entry = AGENTS[agent_name]
    return sebulba.Sebulba(entry.build(cfg.env_spec(), entry.config_class(**agent_config)),
                           cfg)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("agent_name,vectorization,env,agent_config", [
    ("spg", "sync", "CartPole-v1", {}),
    ("r2d2", "sync", "CartPole-v1", {"replay_capacity": 64, "min_replay_size": 8}),
    ("spg", "envpool", "CartPole-v1", {}),
    ("spg", "envpool_async", "CartPole-v1", {}),
    ("ppo", "pettingzoo", ROLE_CALL, {}),
    # The same acting and learner paths as above, with other agents' state and extras.
    pytest.param("ppo", "sync", "CartPole-v1", {}, marks=pytest.mark.slow),
    pytest.param("impala", "sync", "CartPole-v1", {}, marks=pytest.mark.slow),
    pytest.param("spg", "async", "CartPole-v1", {}, marks=pytest.mark.slow),
])
def test_each_step_makes_its_own_transfers_and_no_other(
        agent_name, vectorization, env, agent_config, no_leftovers):
    by_id = vectorization == "envpool_async"
    if vectorization.startswith("envpool"):
        pytest.importorskip("envpool", reason="vectorization 'envpool' needs its extra")
    if vectorization == "pettingzoo":  # absent where only the test's GPU run carries wheels
        pytest.importorskip("pettingzoo", reason="multi-agent envs need the 'multiagent' extra")
    loop = _loop(agent_name, vectorization, env, **agent_config)
    cfg = loop.config
    state = loop.initial_state()
    with transfers.counting() as counts:  # every implicit H2D transfer would raise
        result = loop.run(6 * loop.env_steps_per_update, state)
    updates, threads = result.learner_updates, cfg.num_groups
    rows = loop.rows_per_group
    # One acting call per env step of a group (a by-id source's batches are groups too):
    # its observations in, its actions out.
    calls = counts["acting: observations to device"]
    assert abs(calls * rows - result.env_steps) <= threads * rows, (calls, result.env_steps)
    assert 0 <= calls - counts["acting: actions to host"] <= threads
    # Per cycle: the trajectory to the learner devices (the cycles consumed, queued and
    # in the learner's hands); per update: the networks' version in, the metrics out.
    cycles = counts["cycle: trajectory to learner devices"]
    # The extras: by id, each step's in the actions' batch; in order, a cycle's at once.
    output, _ = jax.eval_shape(loop.agent.step, *_step_args(loop))
    if not jax.tree.leaves(output.extras):
        assert not {EXTRAS, CYCLE_EXTRAS} & set(counts)
    elif by_id:
        assert 0 <= counts["acting: actions to host"] - counts[EXTRAS] <= threads
        assert CYCLE_EXTRAS not in counts
    else:
        assert counts[CYCLE_EXTRAS] == cycles and EXTRAS not in counts
    assert updates <= cycles <= updates + cfg.effective_queue_capacity + threads + 1
    assert counts["learner: version to device"] == updates + 1  # and the first publish
    assert counts["learner: metrics to host"] == updates
    # By-id sources keep each cycle's first StepState: one slot per cycle and group.
    if not by_id:
        assert not BY_ID & set(counts)
    else:
        assert counts["cycle: snapshot slot to device"] <= cycles + threads
        assert counts["acting: snapshot slots to device"] <= 2 * (cycles + threads)
    allowed = ACT | LEARN | (BY_ID if by_id else set())
    assert set(counts) - {EXTRAS, CYCLE_EXTRAS} <= allowed, set(counts)
    assert updates >= 6


def _step_args(loop):
    key = jax.random.key(0)
    nets = jax.eval_shape(loop.agent.new_networks, key)
    acting = jax.eval_shape(loop.agent.acting_nets, nets,
                            jax.ShapeDtypeStruct((), np.int32))
    step_state = jax.eval_shape(
        lambda n, k: loop.agent.new_step_state(n, k, loop.rows_per_group), nets, key)
    return step_state, acting, example_env_step(loop.agent.env_spec, loop.rows_per_group)


@pytest.mark.timeout(120)
def test_an_implicit_transfer_is_named_with_its_place(no_leftovers):
    entry = AGENTS["spg"]
    base = entry.config_class

    class CopiesStepState(type(entry.build(sebulba.Config(env="CartPole-v1").env_spec(),
                                           base()))):
        def shard_step_state(self, step_state, learner_devices):
            # A host round trip of the step state: the way back is an implicit transfer.
            host = jax.tree.map(lambda x: x if jax.dtypes.issubdtype(
                x.dtype, jax.dtypes.prng_key) else np.asarray(x), step_state)
            back = jax.tree.map(lambda x: x if not isinstance(x, np.ndarray)
                                else jnp.asarray(x), host)
            return sharding.shard_env_axis(back, learner_devices)

    cfg = sebulba.Config(env="CartPole-v1", envs_per_group=4, steps_per_cycle=8,
                         transfer_guard=True)
    loop = sebulba.Sebulba(CopiesStepState(cfg.env_spec(), base()), cfg)
    with pytest.raises(transfers.DisallowedTransfer,
                       # the way back first where the guard sees it (an accelerator)
                       match=r"sebulba-inferencer-\d's acting loop: an implicit transfer.*"
                             r"(host-to-device|device-to-host)"):
        loop.run(10**6)
    # Without the guard the same agent runs: the guard is what caught it.
    loop = sebulba.Sebulba(CopiesStepState(cfg.env_spec(), base()),
                           sebulba.Config(env="CartPole-v1", envs_per_group=4,
                                          steps_per_cycle=8))
    assert loop.run(4 * 8 * 2).learner_updates >= 1


def test_counting_is_one_at_a_time_and_ends_with_its_block():
    with transfers.counting() as counts:
        transfers.to_host(jnp.ones(2), "somewhere")
        with pytest.raises(RuntimeError, match="already being counted"), \
                transfers.counting():
            pass
    transfers.to_host(jnp.ones(2), "somewhere")  # not counted any more
    assert counts == {"somewhere": 1}


def test_the_guard_leaves_explicit_transfers_alone_and_names_implicit_ones():
    device = jax.devices()[0]
    with transfers.guarded("a test"):
        x = transfers.to_device(np.ones(3, np.float32), device, "in")
        assert isinstance(x, jax.Array)  # explicit inside the guard
        assert transfers.to_host(jnp.sin(x), "out").shape == (3,)
    with pytest.raises(transfers.DisallowedTransfer, match="^a test: an implicit"), \
            transfers.guarded("a test"):
        jax.jit(jnp.sin)(np.ones(3, np.float32))
    # Outside it the host arrays go to compiled calls as they are (the fast path).
    host = np.ones(3, np.float32)
    assert transfers.to_device(host, device, "in") is host
