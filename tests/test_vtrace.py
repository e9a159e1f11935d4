"""V-trace against hand-computed cases and the paper's sum formula."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agents.common.vtrace import vtrace

GAMMA = 0.9
# One stream of T = 3 actions: V(x_0..x_3), rewards after actions 0..2 (reward[0] unused).
VALUE = np.array([1.0, 2.0, 3.0, 4.0], np.float32)
REWARD = np.array([0.0, 1.0, 0.0, 2.0], np.float32)
NO = np.zeros(4, bool)


def run(rho, reward=REWARD, terminated=NO, truncated=NO, **kwargs):
    out = jax.jit(vtrace, static_argnames=("discount", "rho_bar", "c_bar", "pg_rho_bar",
                                           "lambda_"))(
        jnp.log(jnp.asarray(rho, jnp.float32)), jnp.asarray(reward), jnp.asarray(VALUE),
        jnp.asarray(terminated), jnp.asarray(truncated), discount=GAMMA, **kwargs)
    return np.asarray(out.vs), np.asarray(out.pg_advantage)


@pytest.mark.timeout(60)
def test_c_bar_1_by_hand():
    # rho = [0.5, 2, 1], rho_bar = c_bar = 1: clipped rho = c = [0.5, 1, 1].
    # delta_2 = 1 * (2 + 0.9 * 4 - 3) = 2.6
    # delta_1 = 1 * (0 + 0.9 * 3 - 2) = 0.7
    # delta_0 = 0.5 * (1 + 0.9 * 2 - 1) = 0.9
    # A_2 = 2.6;  A_1 = 0.7 + 0.9 * 1 * 2.6 = 3.04;  A_0 = 0.9 + 0.9 * 0.5 * 3.04 = 2.268
    # vs = V + A = [3.268, 5.04, 5.6]
    # pg_t = rho_t (r_{t+1} + 0.9 vs_{t+1} - V_t) with vs_3 = V_3 = 4:
    #   [0.5 * (1 + 0.9 * 5.04 - 1), 1 * (0 + 0.9 * 5.6 - 2), 1 * (2 + 0.9 * 4 - 3)]
    vs, pg = run([0.5, 2.0, 1.0])
    np.testing.assert_allclose(vs, [3.268, 5.04, 5.6], rtol=1e-5)
    np.testing.assert_allclose(pg, [2.268, 3.04, 2.6], rtol=1e-5)


@pytest.mark.timeout(60)
def test_c_bar_below_1_by_hand():
    # As above with c_bar = 0.5: c = [0.5, 0.5, 0.5], the deltas are unchanged.
    # A_2 = 2.6;  A_1 = 0.7 + 0.9 * 0.5 * 2.6 = 1.87;  A_0 = 0.9 + 0.9 * 0.5 * 1.87 = 1.7415
    vs, pg = run([0.5, 2.0, 1.0], c_bar=0.5)
    np.testing.assert_allclose(vs, [2.7415, 3.87, 5.6], rtol=1e-5)
    # pg uses the targets of the next step: 0.5 * (1 + 0.9 * 3.87 - 1), 0.9 * 5.6 - 2, 2.6
    np.testing.assert_allclose(pg, [1.7415, 3.04, 2.6], rtol=1e-5)


@pytest.mark.timeout(60)
def test_rho_bar_clips_the_ratio_and_pg_rho_bar_only_the_policy_gradient():
    # rho_bar = 2 leaves rho_1 = 2 unclipped: delta_1 = 2 * 0.7 = 1.4; c_bar = 1 still
    # clips c_1 to 1. A_1 = 1.4 + 0.9 * 2.6 = 3.74;  A_0 = 0.9 + 0.45 * 3.74 = 2.583.
    vs, pg = run([0.5, 2.0, 1.0], rho_bar=2.0)
    np.testing.assert_allclose(vs, [3.583, 5.74, 5.6], rtol=1e-5)
    np.testing.assert_allclose(pg, [0.5 * 0.9 * 5.74, 2.0 * (0.9 * 5.6 - 2), 2.6], rtol=1e-5)
    # pg_rho_bar = 1 clips the policy gradient's rho_1 back to 1; the targets keep rho_bar 2.
    vs1, pg1 = run([0.5, 2.0, 1.0], rho_bar=2.0, pg_rho_bar=1.0)
    np.testing.assert_allclose(vs1, vs, rtol=1e-6)
    np.testing.assert_allclose(pg1, [0.5 * 0.9 * 5.74, 0.9 * 5.6 - 2, 2.6], rtol=1e-5)


@pytest.mark.timeout(60)
def test_termination_zeroes_the_bootstrap_and_stops_the_traces():
    # x_2 is terminal (reward 5 for action 1); x_3 starts the next episode (reward 0).
    reward = np.array([0.0, 1.0, 5.0, 0.0], np.float32)
    terminated = np.array([False, False, True, False])
    # rho = 1: delta_1 = 5 + 0.9 * 0 - 2 = 3 (V(x_2) = 3 is not used); A_2 = 0 (x_2 is last)
    # A_1 = 3;  A_0 = (1 + 0.9 * 2 - 1) + 0.9 * 3 = 4.5;  vs = [5.5, 5, 3]:
    # the discounted rewards of the episode, 1 + 0.9 * 5 and 5, nothing of V(x_2), V(x_3).
    vs, pg = run([1.0, 1.0, 1.0], reward, terminated)
    np.testing.assert_allclose(vs, [5.5, 5.0, 3.0], rtol=1e-6)
    np.testing.assert_allclose(pg, [4.5, 3.0, 0.0], rtol=1e-6)


@pytest.mark.timeout(60)
def test_truncation_bootstraps_from_the_value_of_the_last_observation():
    reward = np.array([0.0, 1.0, 5.0, 0.0], np.float32)
    truncated = np.array([False, False, True, False])
    # vs_1 = 5 + 0.9 * V(x_2) = 7.7;  vs_0 = 1 + 0.9 * 5 + 0.81 * 3 = 7.93;  vs_2 = V(x_2).
    vs, pg = run([1.0, 1.0, 1.0], reward, truncated=truncated)
    np.testing.assert_allclose(vs, [7.93, 7.7, 3.0], rtol=1e-6)
    np.testing.assert_allclose(pg, [6.93, 5.7, 0.0], rtol=1e-6)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("flag", ["terminated", "truncated"])
def test_the_ignored_action_at_an_episode_end_is_masked(flag):
    # With NEXT_STEP autoreset the action at the last step (t = 2) is ignored and x_3 is
    # a reset observation. Whatever its ratio and whatever follows, the earlier targets
    # do not change, its own target is V(x_2) and its policy-gradient weight is 0.
    flags = {flag: np.array([False, False, True, False])}
    reward = np.array([0.0, 1.0, 5.0, 0.0], np.float32)
    vs, pg = run([1.0, 1.0, 1.0], reward, **flags)
    vs_odd, pg_odd = run([1.0, 1.0, 7.0], reward, c_bar=3.0, rho_bar=9.0, **flags)
    np.testing.assert_allclose(vs_odd, vs, rtol=1e-6)
    np.testing.assert_allclose(pg_odd, pg, rtol=1e-6)
    assert vs[2] == VALUE[2] and pg[2] == 0.0


def reference_vtrace(rho, reward, value, gamma, rho_bar, c_bar, lambda_):
    """The paper's definition as a sum, for one trajectory without episode boundaries."""
    t_len = len(rho)
    clipped = np.minimum(rho_bar, rho)
    c = lambda_ * np.minimum(c_bar, rho)
    delta = clipped * (reward[1:] + gamma * value[1:] - value[:-1])
    vs = np.array([
        value[s] + sum(gamma ** (t - s) * np.prod(c[s:t]) * delta[t] for t in range(s, t_len))
        for s in range(t_len)])
    vs_next = np.append(vs[1:], value[-1])
    return vs, clipped * (reward[1:] + gamma * vs_next - value[:-1])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("rho_bar,c_bar,lambda_", [(1.0, 1.0, 1.0), (1.0, 0.7, 1.0),
                                                   (2.0, 1.5, 1.0), (1.0, 1.0, 0.8)])
def test_matches_the_papers_sum_on_random_trajectories(rho_bar, c_bar, lambda_):
    rng = np.random.default_rng(0)
    t_len, num_envs = 7, 5
    rho = np.exp(rng.normal(0.0, 0.7, (num_envs, t_len))).astype(np.float32)
    reward = rng.normal(size=(num_envs, t_len + 1)).astype(np.float32)
    value = rng.normal(size=(num_envs, t_len + 1)).astype(np.float32)
    no = np.zeros((num_envs, t_len + 1), bool)
    out = jax.vmap(vtrace, in_axes=(0, 0, 0, 0, 0, None, None, None, None, None))(
        jnp.log(rho), reward, value, no, no, 0.95, rho_bar, c_bar, None, lambda_)
    for e in range(num_envs):
        vs, pg = reference_vtrace(rho[e], reward[e], value[e], 0.95, rho_bar, c_bar, lambda_)
        np.testing.assert_allclose(np.asarray(out.vs[e]), vs, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(np.asarray(out.pg_advantage[e]), pg, rtol=1e-4, atol=1e-5)
        # The uncorrected advantage is the policy gradient's before its clipped ratio.
        np.testing.assert_allclose(np.minimum(rho_bar, rho[e]) * np.asarray(out.advantage[e]),
                                   pg, rtol=1e-4, atol=1e-5)


@pytest.mark.timeout(60)
def test_on_policy_targets_are_the_bootstrapped_returns():
    # rho = 1, c_bar = rho_bar = 1: v_s is the n-step return bootstrapped from V(x_T).
    vs, _ = run([1.0, 1.0, 1.0])
    expected = [1 + 0.9 * 0 + 0.81 * 2 + 0.729 * 4, 0 + 0.9 * 2 + 0.81 * 4, 2 + 0.9 * 4]
    np.testing.assert_allclose(vs, expected, rtol=1e-6)


@pytest.mark.timeout(60)
def test_no_gradient_flows_through_the_targets():
    def total(value, log_rho):
        out = vtrace(log_rho, jnp.asarray(REWARD), value, jnp.asarray(NO), jnp.asarray(NO), GAMMA)
        return jnp.sum(out.vs) + jnp.sum(out.pg_advantage)

    g_value, g_rho = jax.grad(total, argnums=(0, 1))(jnp.asarray(VALUE), jnp.zeros(3))
    assert not np.any(np.asarray(g_value)) and not np.any(np.asarray(g_rho))
