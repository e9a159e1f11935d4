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
    out, raw, _ = acting.act_all(acting.networks(nets), state.step_state, None, env_step)
    np.testing.assert_array_equal(out.action, want_out.action)
    np.testing.assert_allclose(out.extras["log_prob"], want_out.extras["log_prob"],
                               rtol=1e-6)
    typed = acting.typed(raw)  # the keys typed again, as the learner gets them
    np.testing.assert_array_equal(key_data(typed), key_data(want_state))
    # The next step draws from the advanced keys: the same actions as the agent's.
    again, _, _ = acting.act_all(acting.networks(nets), raw, None, env_step)
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
    out, raw, _ = acting.act(acting.networks(nets), state.step_state, None, ids, batch)
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


class ChangesItsStepState(SPG):
    """Returns its step state's key as data of another dtype, or a row too many."""

    def __init__(self, env_spec, change: str):
        super().__init__(env_spec, SPGConfig(hidden_sizes=(16, 16)))
        self.change = change

    def step(self, step_state, nets, env_step):
        output, state = super().step(step_state, nets, env_step)
        keys = jax.random.key_data(state.key)
        if self.change == "dtype":
            return output, state._replace(key=keys.astype(jax.numpy.float32))
        return output, state._replace(key=jax.numpy.concatenate([state.key, state.key[:1]]))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("change,message", [
    ("dtype", r"Agent\.step returned step_state\.key float32\[6, 2\]; it was given "
              r"key<fry>\[6\] \(a StepState keeps its structure, shapes and dtypes"),
    ("shape", r"Agent\.step returned step_state\.key key<fry>\[7\]; it was given "
              r"key<fry>\[6\]"),
], ids=["dtype", "shape"])
def test_a_step_state_that_changes_its_shape_or_dtype_is_refused_naming_the_leaf(
        change, message):
    _, nets, step_state, env_step = setup()
    agent = ChangesItsStepState(sebulba.env_spec("CartPole-v1"), change)
    acting = ActingFunctions(agent, steps_per_cycle=4)
    state = acting.new_state(step_state, jax.devices()[0])
    with pytest.raises(ValueError, match=message):
        acting.act_all(acting.networks(nets), state.step_state, None, env_step)
    with pytest.raises(ValueError, match=message.replace("[6", "[3").replace("[7", "[4")):
        acting.act(acting.networks(nets), state.step_state, None, np.array([4, 1, 2], np.int32),
                   jax.tree.map(lambda x: x[:3], env_step))


class WeakStepState(SPG):
    """A step state of a weakly typed leaf (`jnp.full(n, -1.0)`), strong once it steps."""

    def new_step_state(self, nets, key, num_envs):
        state = super().new_step_state(nets, key, num_envs)
        return state, jax.numpy.full(num_envs, -1.0)

    def step(self, step_state, nets, env_step):
        state, _ = step_state
        output, state = super().step(state, nets, env_step)
        return output, (state, env_step.obs[:, 0])


@pytest.mark.timeout(120)
def test_a_weakly_typed_step_state_compiles_the_acting_call_once():
    agent = WeakStepState(sebulba.env_spec("CartPole-v1"), SPGConfig(hidden_sizes=(16, 16)))
    _, nets, _, env_step = setup()
    step_state = agent.new_step_state(nets, jax.random.key(3), N)
    assert jax.typeof(step_state[1]).weak_type
    acting = ActingFunctions(agent, steps_per_cycle=4)
    raw = acting.new_state(step_state, jax.devices()[0], snapshots=False).step_state
    for _ in range(3):
        _, raw, _ = acting.act_all(acting.networks(nets), raw, None, env_step)
    assert acting.act_all._cache_size() == 1
