"""The resetting LSTM core: acting step by step equals the training unroll; resets work."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agents.common.recurrent import ResetLSTM, initial_lstm_state

B, T, D, H = 3, 7, 5, 8


def setup():
    core = ResetLSTM(H)
    x = jax.random.normal(jax.random.key(0), (B, T, D))
    first = jnp.zeros((B, T), bool).at[:, 0].set(True).at[1, 4].set(True)
    state = initial_lstm_state(B, H)
    params = core.init(jax.random.key(1), state, x, first)
    return core, params, x, first


@pytest.mark.timeout(60)
def test_unroll_equals_acting_one_step_at_a_time():
    core, params, x, first = setup()
    # Start from a non-zero state, as a trajectory that continues an episode does.
    state = jax.tree.map(lambda s: s + 0.3, initial_lstm_state(B, H))
    first = first.at[:, 0].set(False)
    final, outs = core.apply(params, state, x, first)
    step_state, step_outs = state, []
    for t in range(T):
        step_state, out = core.apply(params, step_state, x[:, t:t + 1], first[:, t:t + 1])
        step_outs.append(out[:, 0])
    np.testing.assert_allclose(np.stack(step_outs, 1), outs, rtol=1e-5, atol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
                 step_state, final)


@pytest.mark.timeout(60)
def test_state_resets_where_an_episode_starts():
    core, params, x, first = setup()
    _, from_zero = core.apply(params, initial_lstm_state(B, H), x, first)
    carried = jax.tree.map(lambda s: s + 5.0, initial_lstm_state(B, H))
    _, from_carried = core.apply(params, carried, x, first)
    # Every row starts an episode at t = 0, so the carried state must not matter at all.
    np.testing.assert_allclose(from_zero, from_carried, rtol=1e-6)
    # Row 1 restarts at t = 4: its outputs from there equal a fresh unroll of x[1, 4:].
    _, fresh = core.apply(params, initial_lstm_state(1, H), x[1:2, 4:], first[1:2, 4:])
    np.testing.assert_allclose(from_zero[1, 4:], fresh[0], rtol=1e-5, atol=1e-6)
    # Without the reset the same outputs differ (the test can fail).
    _, no_reset = core.apply(params, initial_lstm_state(B, H), x, first.at[1, 4].set(False))
    assert not np.allclose(no_reset[1, 4:], fresh[0], atol=1e-4)
