"""Returns and action masks on hand-computed trajectories (NEXT_STEP autoreset layout)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from agents.common.returns import action_mask, bootstrapped_returns

DISCOUNT = 0.5
# T = 4: five env steps, four actions. reward[t] follows the action at t - 1.
VALUE = jnp.array([10.0, 20.0, 30.0, 40.0, 50.0])
NO = jnp.zeros(5, bool)


def flags(*indices: int) -> jax.Array:
    return NO.at[jnp.array(indices, int)].set(True)


def returns(reward, terminated=NO, truncated=NO, value=VALUE):
    return np.asarray(bootstrapped_returns(
        jnp.asarray(reward, jnp.float32), value, terminated, truncated, DISCOUNT))


def test_bootstraps_from_the_value_at_the_trajectory_end():
    # G3 = 4 + .5 * 50 = 29, G2 = 3 + .5 * 29 = 17.5, G1 = 2 + .5 * 17.5, G0 = 1 + .5 * G1.
    expected = [6.375, 10.75, 17.5, 29.0]
    np.testing.assert_allclose(returns([0, 1, 2, 3, 4]), expected)
    # A time limit at the end bootstraps from the same value.
    np.testing.assert_allclose(returns([0, 1, 2, 3, 4], truncated=flags(4)), expected)


def test_termination_at_the_trajectory_end_is_worth_zero():
    # G3 = 4, G2 = 3 + 2, G1 = 2 + 2.5, G0 = 1 + 2.25.
    np.testing.assert_allclose(returns([0, 1, 2, 3, 4], terminated=flags(4)),
                               [3.25, 4.5, 5.0, 4.0])


def test_terminated_mid_trajectory():
    # Step 2 ends the episode (value 0); step 3 is the reset step (reward 0) that starts
    # the next one. G1 = 2 + .5 * 0, G0 = 1 + .5 * 2; G3 = 4 + .5 * 50. G2 is masked.
    terminated = flags(2)
    got = returns([0, 1, 2, 0, 4], terminated=terminated)
    mask = np.asarray(action_mask(terminated, NO))
    np.testing.assert_array_equal(mask, [1, 1, 0, 1])
    np.testing.assert_allclose(got[mask == 1], [2.0, 2.0, 29.0])


def test_truncated_mid_trajectory_bootstraps_from_the_truncated_observation():
    # Step 2 hits a time limit: G1 = 2 + .5 * value[2] (30, not the reset step's 40).
    truncated = flags(2)
    got = returns([0, 1, 2, 0, 4], truncated=truncated)
    mask = np.asarray(action_mask(NO, truncated))
    np.testing.assert_array_equal(mask, [1, 1, 0, 1])
    np.testing.assert_allclose(got[mask == 1], [9.5, 17.0, 29.0])


def test_vmapped_over_envs_like_the_agent():
    reward = jnp.array([[0, 1, 2, 0, 4], [0, 1, 2, 0, 4]], jnp.float32)
    terminated = jnp.stack([flags(2), NO])
    truncated = jnp.stack([NO, flags(2)])
    value = jnp.stack([VALUE, VALUE])
    got = jax.vmap(bootstrapped_returns, in_axes=(0, 0, 0, 0, None))(
        reward, value, terminated, truncated, DISCOUNT)
    assert got.shape == (2, 4)
    np.testing.assert_allclose(np.asarray(got)[:, [0, 1, 3]], [[2.0, 2.0, 29.0],
                                                               [9.5, 17.0, 29.0]])


def test_returns_are_constant_targets():
    # The baseline regresses towards the returns; gradients must not flow into them.
    def total(value):
        return jnp.sum(bootstrapped_returns(
            jnp.ones(5), value, NO, flags(2), DISCOUNT))

    np.testing.assert_array_equal(np.asarray(jax.grad(total)(VALUE)), np.zeros(5))


def test_action_mask():
    # Actions at the last step of an episode (terminated or truncated) are ignored by
    # the env; the flags of step T belong to the next trajectory's first action.
    terminated = jnp.array([False, True, False, False, True])
    truncated = jnp.array([False, False, False, True, False])
    mask = action_mask(terminated, truncated)
    assert mask.shape == (4,) and mask.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(mask), [1, 0, 1, 0])
    np.testing.assert_array_equal(np.asarray(action_mask(NO, NO)), [1, 1, 1, 1])
