"""Returns and masks over trajectories with NEXT_STEP autoreset (see sebulba.types.EnvStep).

Time-major functions on one env's stream; `jax.vmap` them over envs. Index t of
`reward` is the reward for the action taken at t - 1; a `last` step (terminated or
truncated) is followed by a reset step whose action the env ignored.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp


def action_mask(terminated: jax.Array, truncated: jax.Array,
                first: jax.Array | None = None) -> jax.Array:
    """Which of the first T actions the env acted on (and, with `first`, whose outcome
    the stream holds).

    Args:
      terminated: [T + 1] bool.
      truncated: [T + 1] bool.
      first: [T + 1] bool, optional. Where step t + 1 is `first` although step t was not
        last (a seam: a stream that joins what was recorded before a resume to the reset
        envs after it), the action at t led to a step that is not in the stream.

    Returns:
      [T] float32, 0 where step t was the last of an episode (its action was ignored) or,
      with `first`, where step t + 1 starts an episode.
    """
    chex.assert_equal_shape((terminated, truncated))
    cut = terminated[:-1] | truncated[:-1]
    if first is not None:
        chex.assert_equal_shape((terminated, first))
        cut = cut | first[1:]
    return 1.0 - cut.astype(jnp.float32)


def bootstrapped_returns(
    reward: jax.Array,
    value: jax.Array,
    terminated: jax.Array,
    truncated: jax.Array,
    discount: float,
) -> jax.Array:
    """Discounted returns to the end of the trajectory, bootstrapped from `value`.

    G_t = r_{t+1} + discount * G_{t+1}; at the last step of an episode G is 0 if it
    terminated and value_t if it was truncated; at the trajectory's end G_T = value_T (0 if
    step T ended an episode by termination).

    Args:
      reward: [T + 1] float, reward[t] follows the action at t - 1.
      value: [T + 1] float, state values (treated as constants).
      terminated: [T + 1] bool.
      truncated: [T + 1] bool.
      discount: scalar in [0, 1].

    Returns:
      [T] returns for t = 0..T-1 (meaningless where `action_mask` is 0).
    """
    chex.assert_equal_shape((reward, value, terminated, truncated))
    value = jax.lax.stop_gradient(value)
    end_value = jnp.where(terminated, 0.0, value)  # what a last step is worth

    def backward(g_next, xs):
        r_next, last, end_v = xs
        g = jnp.where(last, end_v, r_next + discount * g_next)
        return g, g

    last = terminated | truncated
    _, returns = jax.lax.scan(
        backward, end_value[-1], (reward[1:], last[:-1], end_value[:-1]), reverse=True
    )
    return returns


def gae_advantages(
    reward: jax.Array,
    value: jax.Array,
    terminated: jax.Array,
    truncated: jax.Array,
    discount: float,
    lambda_: float,
) -> jax.Array:
    """Generalized advantage estimates, GAE(lambda) (Schulman et al., 2016).

    delta_t = r_{t+1} + discount * v_{t+1} - value_t, where v_{t+1} is 0 if step t + 1
    terminated and value_{t+1} otherwise (a truncated step is bootstrapped from);
    A_t = delta_t + discount * lambda_ * A_{t+1}, with A = 0 at the last step of an
    episode (its action was ignored: nothing flows back from the next episode) and
    A_T = 0 (the trajectory's end bootstraps from value_T through delta_{T-1}).
    With lambda_ = 1, A_t = bootstrapped_returns(...)_t - value_t where `action_mask` is 1.

    Args:
      reward: [T + 1] float, reward[t] follows the action at t - 1.
      value: [T + 1] float, state values (treated as constants).
      terminated: [T + 1] bool.
      truncated: [T + 1] bool.
      discount: scalar in [0, 1].
      lambda_: scalar in [0, 1]; 0 gives one-step TD errors, 1 Monte Carlo advantages.

    Returns:
      [T] advantages for t = 0..T-1, 0 where `action_mask` is 0. Trailing batch axes
      (leaves [T + 1, B]) are carried through.
    """
    chex.assert_equal_shape((reward, value, terminated, truncated))
    value = jax.lax.stop_gradient(value)
    next_value = jnp.where(terminated[1:], 0.0, value[1:])
    delta = reward[1:] + discount * next_value - value[:-1]
    last = terminated[:-1] | truncated[:-1]

    def backward(a_next, xs):
        delta_t, last_t = xs
        a = jnp.where(last_t, 0.0, delta_t + discount * lambda_ * a_next)
        return a, a

    _, advantages = jax.lax.scan(
        backward, jnp.zeros_like(delta[-1]), (delta, last), reverse=True
    )
    return advantages
