"""The compiled acting functions take what makes them cheap to dispatch (the networks'
leaves, PRNG keys as raw data) and still act exactly as the agent's own step."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import sebulba
from agents.spg import SPG, SPGConfig
from sebulba.envs import example_env_step
from sebulba.runtime.inferencer import ActingFunctions

N = 6


def setup():
    agent = SPG(sebulba.env_spec("CartPole-v1"), SPGConfig(hidden_sizes=(16, 16)))
    key = jax.random.key(3)
    nets = agent.new_networks(key)
    step_state = agent.new_step_state(nets, key, N)
    env_step = example_env_step(agent.env_spec, N)
    env_step = env_step._replace(obs=np.random.default_rng(0).normal(
        size=env_step.obs.shape).astype(np.float32))
    return agent, nets, step_state, env_step


def key_data(state):
    return jax.random.key_data(state.key)


@pytest.mark.timeout(120)
def test_acting_all_envs_matches_the_agents_step():
    agent, nets, step_state, env_step = setup()
    acting = ActingFunctions(agent, steps_per_cycle=4)
    state = acting.new_state(step_state, jax.devices()[0], snapshots=False)
    assert not jax.dtypes.issubdtype(state.step_state.key.dtype, jax.dtypes.prng_key)
    want_out, want_state = jax.jit(agent.step)(step_state, nets, env_step)
    out, raw = acting.act_all(acting.networks(nets), state.step_state, env_step)
    np.testing.assert_array_equal(out.action, want_out.action)
    np.testing.assert_allclose(out.extras["log_prob"], want_out.extras["log_prob"],
                               rtol=1e-6)
    typed = acting.typed(raw)  # the keys typed again, as the learner gets them
    np.testing.assert_array_equal(key_data(typed), key_data(want_state))
    # The next step draws from the advanced keys: the same actions as the agent's.
    again, _ = acting.act_all(acting.networks(nets), raw, env_step)
    want_again, _ = jax.jit(agent.step)(want_state, nets, env_step)
    np.testing.assert_array_equal(again.action, want_again.action)


@pytest.mark.timeout(120)
def test_acting_by_id_changes_only_those_envs_rows():
    agent, nets, step_state, env_step = setup()
    acting = ActingFunctions(agent, steps_per_cycle=4)
    state = acting.new_state(step_state, jax.devices()[0])
    before = np.asarray(state.step_state.key)
    ids = np.array([4, 1, 2], np.int32)
    rows = jax.tree.map(lambda x: x[ids], step_state)
    batch = jax.tree.map(lambda x: x[ids], env_step)
    want_out, want_rows = jax.jit(agent.step)(rows, nets, batch)
    out, raw = acting.act(acting.networks(nets), state.step_state, ids, batch)
    np.testing.assert_array_equal(out.action, want_out.action)
    after = np.asarray(raw.key)
    np.testing.assert_array_equal(after[ids], key_data(want_rows))
    others = np.setdiff1d(np.arange(N), ids)
    np.testing.assert_array_equal(after[others], before[others])
    assert not np.array_equal(after[ids], before[ids])


@pytest.mark.timeout(60)
def test_networks_of_another_structure_are_refused():
    agent, nets, _, _ = setup()
    acting = ActingFunctions(agent, steps_per_cycle=4)
    acting.networks(nets)
    renamed = {"other": nets["params"]}
    with pytest.raises(ValueError, match="changed structure"):
        acting.networks(renamed)
