"""V-trace off-policy targets (Espeholt et al., 2018, "IMPALA", section 4), with c-bar.

Time-major functions on one env's stream with NEXT_STEP autoreset (see
`agents/common/returns.py`); `jax.vmap` them over envs. Index t of `reward` is the reward
for the action taken at t - 1. Writing A_t = v_t - V(x_t), the paper's definition

    v_s = V(x_s) + sum_{t >= s} gamma^(t - s) (c_s ... c_{t-1}) delta_t,
    delta_t = rho_t (r_{t+1} + gamma V(x_{t+1}) - V(x_t)),
    rho_t = min(rho_bar, pi(a_t|x_t) / mu(a_t|x_t)),  c_t = lambda min(c_bar, pi / mu),

is computed backwards as A_t = delta_t + gamma c_t A_{t+1}. Episode boundaries inside
the trajectory:

- a terminated step t + 1 is worth 0: V(x_{t+1}) is replaced by 0 in delta_t;
- a truncated step t + 1 is bootstrapped from: V(x_{t+1}) stays, its own A is 0;
- a last step t (terminated or truncated) has A_t = 0: its action was ignored by the env,
  so nothing flows back from the next episode through it;
- the trajectory's end has A_T = 0, i.e. v_T = V(x_T) is the bootstrap.
"""

from __future__ import annotations

from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp


class VTraceOutput(NamedTuple):
    """Leaves [T] (`vtrace` takes one trajectory: vmap it over a batch).

    Attributes:
      vs: V-trace targets v_t of the value V(x_t).
      pg_advantage: rho_pg_t (r_{t+1} + gamma v_{t+1} - V(x_t)), the policy gradient's
        weight of log pi(a_t | x_t), with rho_pg clipped at `pg_rho_bar`.
      rho: the unclipped importance ratios pi / mu (for metrics).
      advantage: r_{t+1} + gamma v_{t+1} - V(x_t), pg_advantage before its ratio (for
        an objective that corrects for mu itself, e.g. PPO's clipped pi / mu).
    """

    vs: jax.Array
    pg_advantage: jax.Array
    rho: jax.Array
    advantage: jax.Array


def vtrace(
    log_rho: jax.Array,
    reward: jax.Array,
    value: jax.Array,
    terminated: jax.Array,
    truncated: jax.Array,
    discount: float,
    rho_bar: float = 1.0,
    c_bar: float = 1.0,
    pg_rho_bar: float | None = None,
    lambda_: float = 1.0,
) -> VTraceOutput:
    """V-trace targets and policy-gradient advantages of one trajectory.

    Args:
      log_rho: [T] log pi(a_t | x_t) - log mu(a_t | x_t), target minus behaviour policy.
      reward: [T + 1] float, reward[t] follows the action at t - 1 (reward[0] is unused).
      value: [T + 1] float, V(x_t) under the target policy's baseline (constants: no
        gradient flows through the targets).
      terminated: [T + 1] bool.
      truncated: [T + 1] bool.
      discount: gamma, a scalar in [0, 1].
      rho_bar: clips rho in delta_t; it sets the fixed point (rho_bar = inf: the target
        policy's value, smaller: closer to the behaviour policy's).
      c_bar: clips the trace coefficients c; it sets the speed of convergence.
      pg_rho_bar: clips rho in the policy gradient advantage; None: `rho_bar`.
      lambda_: scales the traces, c_t = lambda_ min(c_bar, rho_t) (lambda_ = 0: one-step).

    Returns:
      VTraceOutput with leaves [T]. Where the action was ignored (`action_mask` is 0),
      vs_t = V(x_t) and pg_advantage_t = 0; mask the losses there.
    """
    chex.assert_rank(log_rho, 1)
    chex.assert_equal_shape((reward, value, terminated, truncated))
    chex.assert_axis_dimension(value, 0, log_rho.shape[0] + 1)
    pg_rho_bar = rho_bar if pg_rho_bar is None else pg_rho_bar
    value = jax.lax.stop_gradient(value)
    log_rho = jax.lax.stop_gradient(log_rho)
    rho = jnp.exp(log_rho)
    clipped_rho = jnp.minimum(rho_bar, rho)
    c = lambda_ * jnp.minimum(c_bar, rho)

    next_value = jnp.where(terminated[1:], 0.0, value[1:])  # what x_{t+1} is worth
    delta = clipped_rho * (reward[1:] + discount * next_value - value[:-1])
    last = terminated[:-1] | truncated[:-1]

    def backward(a_next, xs):
        delta_t, c_t, last_t = xs
        a = jnp.where(last_t, 0.0, delta_t + discount * c_t * a_next)
        return a, a

    _, correction = jax.lax.scan(
        backward, jnp.zeros_like(delta[-1]), (delta, c, last), reverse=True)
    vs = value[:-1] + correction

    # v_{t+1}: 0 after a termination; V(x_{t+1}) at a truncation or the trajectory's end
    # (their correction is 0); the V-trace target otherwise.
    vs_next = jnp.where(terminated[1:], 0.0, jnp.concatenate([vs[1:], value[-1:]]))
    # An ignored action learns nothing.
    advantage = jnp.where(last, 0.0, reward[1:] + discount * vs_next - value[:-1])
    pg_advantage = jnp.minimum(pg_rho_bar, rho) * advantage
    return VTraceOutput(vs=vs, pg_advantage=pg_advantage, rho=rho, advantage=advantage)
