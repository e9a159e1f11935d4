"""gae_advantages against hand-computed cases and against bootstrapped_returns."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agents.common.returns import action_mask, bootstrapped_returns, gae_advantages

GAMMA, LAMBDA = 0.9, 0.5
# T = 4: five env steps; reward[t] follows the action at t - 1.
REWARD = jnp.array([0.0, 1.0, 1.0, 0.0, 1.0])
VALUE = jnp.array([1.0, 2.0, 3.0, 4.0, 5.0])
NONE = jnp.zeros(5, bool)
AT_2 = jnp.array([False, False, True, False, False])  # step 2 ends the episode; 3 is a reset


def gae(terminated, truncated, lambda_=LAMBDA):
    return np.asarray(gae_advantages(REWARD, VALUE, terminated, truncated, GAMMA, lambda_))


@pytest.mark.timeout(60)
def test_no_episode_end_bootstraps_from_the_last_value():
    d = [1 + 0.9 * 2 - 1, 1 + 0.9 * 3 - 2, 0 + 0.9 * 4 - 3, 1 + 0.9 * 5 - 4]  # TD errors
    a3 = d[3]
    a2 = d[2] + 0.45 * a3
    a1 = d[1] + 0.45 * a2
    a0 = d[0] + 0.45 * a1
    np.testing.assert_allclose(gae(NONE, NONE), [a0, a1, a2, a3], rtol=1e-6)


@pytest.mark.timeout(60)
def test_terminated_step_is_worth_zero_and_cuts_the_trace():
    # A_1 = r_2 + 0 - v_1 (terminal value 0); A_2 = 0 (ignored action);
    # A_3 = r_4 + g v_4 - v_3 starts the next episode; A_0 = delta_0 + g l A_1.
    expected = [(1 + 1.8 - 1) + 0.45 * (1 - 2), 1 - 2, 0.0, 1 + 4.5 - 4]
    np.testing.assert_allclose(gae(AT_2, NONE), expected, rtol=1e-6)


@pytest.mark.timeout(60)
def test_truncated_step_bootstraps_from_its_value():
    a1 = 1 + 0.9 * 3 - 2  # bootstraps from v_2, and nothing flows back from step 3
    expected = [(1 + 1.8 - 1) + 0.45 * a1, a1, 0.0, 1 + 4.5 - 4]
    np.testing.assert_allclose(gae(NONE, AT_2), expected, rtol=1e-6)


@pytest.mark.timeout(60)
def test_terminated_at_the_trajectory_end_does_not_bootstrap():
    at_end = jnp.array([False, False, False, False, True])
    a3 = 1 + 0.0 - 4
    np.testing.assert_allclose(gae(at_end, NONE)[3], a3, rtol=1e-6)
    truncated_end = gae(NONE, at_end)
    np.testing.assert_allclose(truncated_end, gae(NONE, NONE), rtol=1e-6)


@pytest.mark.timeout(60)
def test_lambda_zero_is_the_one_step_td_error():
    expected = [1 + 1.8 - 1, 1 - 2, 0.0, 1 + 4.5 - 4]
    np.testing.assert_allclose(gae(AT_2, NONE, lambda_=0.0), expected, rtol=1e-6)


def random_streams(key, num_envs=8, length=21):
    k1, k2, k3, k4 = jax.random.split(key, 4)
    reward = jax.random.normal(k1, (num_envs, length))
    value = jax.random.normal(k2, (num_envs, length))
    ends = jax.random.uniform(k3, (num_envs, length)) < 0.15
    terminated_end = jax.random.uniform(k4, (num_envs, length)) < 0.5
    terminated, truncated = ends & terminated_end, ends & ~terminated_end
    # NEXT_STEP autoreset: the step after a last step starts an episode with reward 0.
    after_last = jnp.pad(ends[:, :-1], ((0, 0), (1, 0)))
    reward = jnp.where(after_last, 0.0, reward)
    terminated, truncated = terminated & ~after_last, truncated & ~after_last
    return reward, value, terminated, truncated


@pytest.mark.timeout(60)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_lambda_one_is_the_bootstrapped_return_minus_the_value(seed):
    reward, value, terminated, truncated = random_streams(jax.random.key(seed))
    assert terminated.any() and truncated.any()
    advantages = jax.vmap(gae_advantages, in_axes=(0, 0, 0, 0, None, None))(
        reward, value, terminated, truncated, 0.97, 1.0)
    returns = jax.vmap(bootstrapped_returns, in_axes=(0, 0, 0, 0, None))(
        reward, value, terminated, truncated, 0.97)
    mask = np.asarray(jax.vmap(action_mask)(terminated, truncated))
    expected = np.asarray(returns - value[:, :-1])
    np.testing.assert_allclose(np.asarray(advantages)[mask == 1], expected[mask == 1],
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(advantages)[mask == 0], 0.0)


@pytest.mark.timeout(60)
def test_time_major_batch_matches_vmap_over_envs():
    reward, value, terminated, truncated = random_streams(jax.random.key(3))
    per_env = jax.vmap(gae_advantages, in_axes=(0, 0, 0, 0, None, None))(
        reward, value, terminated, truncated, 0.99, 0.95)
    time_major = gae_advantages(reward.T, value.T, terminated.T, truncated.T, 0.99, 0.95)
    np.testing.assert_allclose(np.asarray(time_major).T, np.asarray(per_env), rtol=1e-6)


@pytest.mark.timeout(60)
def test_values_are_constants():
    grad = jax.grad(lambda v: gae_advantages(REWARD, v, NONE, NONE, GAMMA, LAMBDA).sum())(VALUE)
    np.testing.assert_array_equal(np.asarray(grad), 0.0)
