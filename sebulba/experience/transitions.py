"""Cutting trajectories into n-step transitions for a replay, under NEXT_STEP autoreset.

A trajectory shard has env steps [E, T + 1] and actions [E, T]: action t was taken on
step t's observation and led to step t + 1. Gymnasium's NEXT_STEP autoreset makes two
kinds of rows carry no transition:

- an action taken on an episode's last observation (`terminated | truncated` at t):
  the env ignored it and reset, so step t + 1 is the next episode's first step;
- an action followed by a `first` step that did not end an episode (a seam, e.g. the
  envs reset on a resume): what followed it is lost.

A transition from step t sums up to n discounted rewards and bootstraps from step
t + k, k <= n, the first step that ends the episode, precedes a seam, or is the
trajectory's last (T): so it never needs another trajectory. Termination and
truncation stay apart: `discount` is 0 after a termination (the end has no value) and
discount^k after a truncation, which bootstraps from the final observation (the
trajectory carries it).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from sebulba.types import Trajectory


class Transition(NamedTuple):
    """One transition (leaves [N, ...] for N of them)."""

    obs: jax.Array  # the observation acted on
    action: jax.Array  # the action taken on it
    reward: jax.Array  # float32 sum_{j<k} discount^j reward[t + j + 1]
    discount: jax.Array  # float32 discount^k, or 0 if next_obs terminated the episode
    next_obs: jax.Array  # the observation to bootstrap from, k steps later


def n_step_transitions(trajectory: Trajectory, discount: float, n: int = 1
                       ) -> tuple[Transition, jax.Array]:
    """The E x T transitions of a trajectory shard (leaves [E, T(+1), ...]), env-major,
    and which of them are real ([E x T] bool; insert only those).

    Args:
      trajectory: env steps [E, T + 1, ...], actions [E, T, ...].
      discount: per-step discount in [0, 1].
      n: steps of reward before bootstrapping, >= 1 (static).
    """
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"n must be an int >= 1, got {n!r}")
    if not 0.0 <= discount <= 1.0:
        raise ValueError(f"discount must be in [0, 1], got {discount!r}")
    steps, action = trajectory.env_steps, trajectory.actor_outputs.action
    T = action.shape[1]
    last = steps.terminated | steps.truncated  # [E, T + 1]
    seam_after = jnp.concatenate([steps.first[:, 1:] & ~last[:, :-1],
                                  jnp.zeros_like(last[:, :1])], axis=1)  # [E, T + 1]
    stop = last | seam_after
    t = jnp.arange(T)
    reward = jnp.zeros(action.shape[:2], jnp.float32)
    scale = jnp.ones(action.shape[:2], jnp.float32)  # discount^k so far
    end = jnp.broadcast_to(t, action.shape[:2])  # t + k: the step to bootstrap from
    running = jnp.ones(action.shape[:2], bool)
    for k in range(1, n + 1):
        i = jnp.minimum(t + k, T)
        reward = reward + jnp.where(running, scale * steps.reward[:, i], 0.0)
        scale = jnp.where(running, scale * discount, scale)
        end = jnp.where(running, i, end)
        running = running & ~stop[:, i] & (t + k < T)
    at_end = jax.vmap(lambda x, e: x[e])  # x [E, T + 1, ...], e [E, T] -> [E, T, ...]
    terminated = at_end(steps.terminated, end)
    items = Transition(
        obs=steps.obs[:, :-1],
        action=action,
        reward=reward,
        discount=jnp.where(terminated, 0.0, scale),
        next_obs=at_end(steps.obs, end),
    )
    valid = ~last[:, :-1] & ~seam_after[:, :-1]

    def flat(x):
        return x.reshape((-1,) + x.shape[2:])

    return jax.tree.map(flat, items), flat(valid)
