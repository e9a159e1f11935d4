"""Returns and masks over trajectories with NEXT_STEP autoreset (see sebulba.types.EnvStep).

Time-major functions on one env's stream; `jax.vmap` them over envs. Index t of
`reward` is the reward for the action taken at t - 1; a `last` step (terminated or
truncated) is followed by a reset step whose action the env ignored.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def action_mask(terminated: jax.Array, truncated: jax.Array) -> jax.Array:
    """Which of the first T actions the env acted on.

    Args:
      terminated, truncated: [T + 1] bool.
    Returns:
      [T] float32, 0 where step t was the last of an episode (its action was ignored).
    """
    return 1.0 - (terminated[:-1] | truncated[:-1]).astype(jnp.float32)


def bootstrapped_returns(
    reward: jax.Array,
    value: jax.Array,
    terminated: jax.Array,
    truncated: jax.Array,
    discount: float,
) -> jax.Array:
    """Discounted returns to the end of the trajectory, bootstrapped from `value`.

    G_t = r_{t+1} + discount * G_{t+1}; at the last step of an episode G is 0 if it
    terminated and value_t if it was truncated; at the trajectory's end G_T = value_T.

    Args:
      reward: [T + 1] float, reward[t] follows the action at t - 1.
      value: [T + 1] float, state values (treated as constants).
      terminated, truncated: [T + 1] bool.
      discount: scalar in [0, 1].
    Returns:
      [T] returns for t = 0..T-1 (meaningless where `action_mask` is 0).
    """
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
