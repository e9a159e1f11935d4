"""Returns, GAE, V-trace and R2D2's n-step targets against brute-force sums
(tests/brute_force.py) on random streams: episodes that terminate (no bootstrap) or are
truncated (bootstrapped) anywhere, seams for the n-step targets, random discounts, trace
parameters and importance ratios.

Each compiled function is jitted once for one stream length; hypothesis varies the
values only, so no example recompiles.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from agents.common.returns import action_mask, bootstrapped_returns, gae_advantages
from agents.common.vtrace import vtrace
from agents.r2d2 import n_step_returns
from tests import brute_force as bf

T = 16  # actions per stream: streams of T + 1 env steps
UNIT = st.floats(0.0, 1.0)
returns_jit = jax.jit(bootstrapped_returns)
gae_jit = jax.jit(gae_advantages)
vtrace_jit = jax.jit(vtrace)
n_step_jit = jax.jit(n_step_returns, static_argnames="n")
mask_jit = jax.jit(action_mask)


def device(s: bf.Stream) -> tuple[jax.Array, ...]:
    return tuple(map(jnp.asarray, (s.reward, s.value, s.terminated, s.truncated)))


def assert_mask(s: bf.Stream, expected_steps, with_first: bool = False) -> np.ndarray:
    """The action mask, checked against the steps a reference defines a value for."""
    flags = (s.terminated, s.truncated) + ((s.first,) if with_first else ())
    mask = np.asarray(mask_jit(*map(jnp.asarray, flags)))
    assert np.flatnonzero(mask).tolist() == sorted(expected_steps)
    return mask


@pytest.mark.timeout(120)
@bf.examples(100)
@given(s=bf.streams(T + 1), discount=UNIT)
def test_bootstrapped_returns_are_the_discounted_sums_to_the_episodes_end(s, discount):
    got = np.asarray(returns_jit(*device(s), discount))
    want, scale = bf.bootstrapped_return(s, discount)
    assert_mask(s, want)
    steps = sorted(want)
    bf.assert_close(got[steps], [want[t] for t in steps], [scale[t] for t in steps],
                    "returns")


@pytest.mark.timeout(120)
@bf.examples(100)
@given(s=bf.streams(T + 1), discount=UNIT, lambda_=UNIT)
def test_gae_is_the_lambda_weighted_sum_of_td_errors_within_the_episode(s, discount,
                                                                         lambda_):
    got = np.asarray(gae_jit(*device(s), discount, lambda_))
    want, scale = bf.gae(s, discount, lambda_)
    bf.assert_close(got, want, scale, "advantages")
    assert np.all(got[s.last[:-1]] == 0.0)  # exactly: an ignored action learns nothing


@pytest.mark.timeout(120)
@bf.examples(100)
@given(s=bf.streams(T + 1), discount=UNIT, lambda_=UNIT,
       log_rho=st.lists(st.floats(-2.0, 2.0), min_size=T, max_size=T),
       rho_bar=st.floats(0.5, 3.0), c_bar=st.floats(0.1, 1.2),
       pg_rho_bar=st.none() | st.floats(0.5, 3.0))
def test_vtrace_is_the_papers_sum_within_each_episode(s, discount, lambda_, log_rho,
                                                      rho_bar, c_bar, pg_rho_bar):
    log_rho = np.asarray(log_rho, np.float32)
    out = vtrace_jit(jnp.asarray(log_rho), *device(s), discount, rho_bar, c_bar,
                     pg_rho_bar, lambda_)
    rho = np.exp(log_rho.astype(np.float64))
    vs, pg, vs_scale, pg_scale = bf.vtrace(s, rho, discount, rho_bar, c_bar,
                                           rho_bar if pg_rho_bar is None else pg_rho_bar,
                                           lambda_)
    bf.assert_close(np.asarray(out.vs), vs, vs_scale, "vs")
    bf.assert_close(np.asarray(out.pg_advantage), pg, pg_scale, "pg_advantage")


@pytest.mark.timeout(120)
@bf.examples(100)
@given(s=bf.streams(T + 1, seams=True), discount=UNIT, n=st.sampled_from([1, 2, 3, 5]))
def test_n_step_targets_stop_at_episode_ends_seams_and_the_sequence_end(s, discount, n):
    got = np.asarray(n_step_jit(*device(s), discount, n, jnp.asarray(s.first)))
    want = bf.n_step_targets(s.reward, s.value, s.terminated, s.truncated, s.first,
                             discount, n)
    # No target crosses a `first` step: the steps learnt from are exactly those whose
    # action has its outcome in the same episode.
    assert_mask(s, want, with_first=True)
    for t, g in want.items():
        scale = np.sum(np.abs(s.reward[t + 1:t + n + 1])) + np.max(np.abs(s.value))
        bf.assert_close(got[t:t + 1], [g], [scale], f"n-step target {t}")
