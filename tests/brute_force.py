"""Brute-force references and hypothesis strategies shared by the property tests
(tests/test_properties_*.py).

The references compute, step by step in float64, what the compiled functions compute by
backward recursions: each quantity as the explicit sum its docstring defines, over the
steps of the episode it belongs to. Each also returns a scale, the sum of the absolute
values of its terms, which bounds the float32 rounding of any summation order
(`assert_close`). n-step returns with seams: `n_step_targets`, from
tests/test_r2d2_seams.py (defined there first).

Streams follow NEXT_STEP autoreset (sebulba.types.EnvStep): entry t of [T + 1] arrays
is the env step acted on at t; reward[t] follows the action at t - 1; a last step
(terminated or truncated) is followed by a `first` step with reward 0; a seam is a
`first` step after a step that did not end its episode (a resumed run's reset envs).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from tests.test_r2d2_seams import brute_force_targets as n_step_targets

__all__ = ["Stream", "streams", "examples", "assert_close", "bootstrapped_return",
           "gae", "vtrace", "n_step_targets"]


def examples(n: int) -> settings:
    """Deterministic hypothesis settings for `n` examples: the same examples on every
    run (derandomize), no time limit per example (the first one compiles), and no example
    database written into the checkout."""
    return settings(max_examples=n, derandomize=True, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow,
                                           HealthCheck.data_too_large])


class Stream(NamedTuple):
    """One env's stream of T + 1 env steps (float32 and bool arrays [T + 1])."""

    reward: np.ndarray
    value: np.ndarray
    terminated: np.ndarray
    truncated: np.ndarray
    first: np.ndarray

    @property
    def last(self) -> np.ndarray:
        return self.terminated | self.truncated


NONE, TERMINATE, TRUNCATE, SEAM = range(4)
FINITE = {"allow_nan": False, "allow_infinity": False, "allow_subnormal": False,
          "width": 32}


@st.composite
def streams(draw, length: int, seams: bool = False, bound: float = 10.0,
            starts: bool | None = None) -> Stream:
    """A stream of `length` = T + 1 env steps with random episode ends (terminations and
    truncations) and, with `seams`, seams; rewards and values in [-bound, bound]. Its
    step 0 is `first` if `starts`, or at random if None."""
    events = draw(st.lists(st.sampled_from([NONE, NONE, TERMINATE, TRUNCATE]
                                           + ([SEAM] if seams else [])),
                           min_size=length, max_size=length))
    reward = np.array(draw(st.lists(st.floats(-bound, bound, **FINITE), min_size=length,
                                    max_size=length)), np.float32)
    value = np.array(draw(st.lists(st.floats(-bound, bound, **FINITE), min_size=length,
                                   max_size=length)), np.float32)
    terminated, truncated, first = (np.zeros(length, bool) for _ in range(3))
    first[0] = draw(st.booleans()) if starts is None else starts
    for t, event in enumerate(events):
        if t > 0:
            first[t] = terminated[t - 1] or truncated[t - 1] or event == SEAM
        if not first[t]:  # a reset observation never ends its episode
            terminated[t], truncated[t] = event == TERMINATE, event == TRUNCATE
    reward[first] = 0.0  # a first step follows no action
    return Stream(reward, value, terminated, truncated, first)


def assert_close(got: np.ndarray, want: np.ndarray, scale: np.ndarray, what: str) -> None:
    """|got - want| within float32 rounding of sums whose terms' magnitudes add to
    `scale` (a few ulps per term, with room for the recursions' other order)."""
    got, want, scale = (np.asarray(x, np.float64) for x in (got, want, scale))
    bound = 1e-5 * scale + 1e-6
    bad = np.abs(got - want) > bound
    assert not bad.any(), (f"{what}: at {np.flatnonzero(bad).tolist()} got {got[bad]}, "
                           f"want {want[bad]} (bound {bound[bad]})")


def _end(s: Stream, t: int) -> int:
    """The step after t that ends t's stretch: its episode's last step, or T."""
    horizon = len(s.reward) - 1
    return next((k for k in range(t + 1, horizon) if s.last[k]), horizon)


def _worth(s: Stream, k: int, value: np.ndarray) -> float:
    """What step k is worth as a bootstrap: 0 if it terminated, value[k] otherwise."""
    return 0.0 if s.terminated[k] else float(value[k])


def bootstrapped_return(s: Stream, discount: float) -> tuple[dict, dict]:
    """{t: G_t} and {t: scale} for every t whose action the env acted on (not last):
    G_t = sum_{i=t+1..j} discount^(i-t-1) reward[i] + discount^(j-t) worth(j), j the end
    of t's stretch."""
    returns, scales = {}, {}
    for t in range(len(s.reward) - 1):
        if s.last[t]:
            continue
        j = _end(s, t)
        terms = [discount ** (i - t - 1) * float(s.reward[i]) for i in range(t + 1, j + 1)]
        terms.append(discount ** (j - t) * _worth(s, j, s.value))
        returns[t], scales[t] = sum(terms), sum(map(abs, terms))
    return returns, scales


def _delta(s: Stream, k: int, discount: float, value: np.ndarray) -> tuple[float, float]:
    """The TD error r_{k+1} + discount worth(k+1) - value_k and the sum of its terms'
    magnitudes."""
    terms = (float(s.reward[k + 1]), discount * _worth(s, k + 1, value), -float(value[k]))
    return sum(terms), sum(map(abs, terms))


def gae(s: Stream, discount: float, lambda_: float) -> tuple[np.ndarray, np.ndarray]:
    """Advantages [T]: sum_{k=t..j-1} (discount lambda)^(k-t) delta_k for not-last t
    (j the end of t's stretch), 0 for last t; and their scales."""
    horizon = len(s.reward) - 1
    advantages, scales = np.zeros(horizon), np.zeros(horizon)
    for t in range(horizon):
        if s.last[t]:
            continue
        for k in range(t, _end(s, t)):
            delta, size = _delta(s, k, discount, s.value)
            advantages[t] += (discount * lambda_) ** (k - t) * delta
            scales[t] += (discount * lambda_) ** (k - t) * size
    return advantages, scales


def vtrace(s: Stream, rho: np.ndarray, discount: float, rho_bar: float, c_bar: float,
           pg_rho_bar: float, lambda_: float) -> tuple[np.ndarray, np.ndarray, np.ndarray,
                                                        np.ndarray]:
    """(vs [T], pg_advantage [T], vs scales, pg scales) by the paper's sum, within each
    episode: vs_t = V_t + sum_{k=t..j-1} discount^(k-t) (c_t ... c_{k-1}) delta_k with
    delta_k = min(rho_bar, rho_k) (r_{k+1} + discount worth(k+1) - V_k),
    c_i = lambda min(c_bar, rho_i); pg_t = min(pg_rho_bar, rho_t) (r_{t+1} + discount
    w - V_t), w = 0 after a termination, V_{t+1} at a truncation or the end, vs_{t+1}
    otherwise. A last step t: vs_t = V_t, pg_t = 0."""
    horizon = len(s.reward) - 1
    value = s.value.astype(np.float64)
    vs, vs_scale = value[:-1].copy(), np.abs(value[:-1])
    c = lambda_ * np.minimum(c_bar, rho)
    for t in range(horizon):
        if s.last[t]:
            continue
        trace = 1.0
        for k in range(t, _end(s, t)):
            delta, size = _delta(s, k, discount, value)
            weight = discount ** (k - t) * trace * min(rho_bar, rho[k])
            vs[t] += weight * delta
            vs_scale[t] += abs(weight) * size
            trace *= c[k]
    pg, pg_scale = np.zeros(horizon), np.zeros(horizon)
    for t in range(horizon):
        if s.last[t]:
            continue
        if s.terminated[t + 1]:
            w, w_scale = 0.0, 0.0
        elif s.truncated[t + 1] or t + 1 == horizon:
            w, w_scale = value[t + 1], abs(value[t + 1])
        else:
            w, w_scale = vs[t + 1], vs_scale[t + 1]
        ratio = min(pg_rho_bar, rho[t])
        pg[t] = ratio * (float(s.reward[t + 1]) + discount * w - value[t])
        pg_scale[t] = ratio * (abs(float(s.reward[t + 1])) + discount * w_scale + abs(value[t]))
    return vs, pg, vs_scale, pg_scale
