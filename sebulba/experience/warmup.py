"""A warm-up counted in env steps of the whole run, as a replay agent's experience holds it.

A replay agent waits for `learning_starts` env steps before its first gradient step
(`Agent.ready_to_learn`). Counted in env steps, the warm-up means the same whatever the
layout; counted in learner updates it would have to be worked out from `envs_per_group`,
`steps_per_cycle`, `trajectories_per_update` and the processes, and would change when
one of them does. Each learner device sees only its shard of every update, the same
number of rows on every device, so each counts the run's env steps as its shard's steps
times the run's learner devices D, and all devices agree on when the warm-up ends.

Usage, in an agent's experience state:

    new_experience_state: Experience(..., received=warmup.new_count(layout))
    update_experience:    experience._replace(received=warmup.add(experience.received,
                                                                  trajectory))
    ready_to_learn:       warmup.reached(experience.received, cfg.learning_starts)

Acting before the first gradient step is the agent's choice (SAC acts uniformly at
random until its networks have taken a step, which `acting_nets` publishes).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import jax
import jax.numpy as jnp

from sebulba.types import Trajectory

if TYPE_CHECKING:
    from sebulba.agent import Layout

# The count stops here (int32 scalars: x64 is off by default), far above any warm-up:
# a run of more env steps keeps a reached warm-up reached instead of wrapping around.
SATURATION = 2**30


class EnvStepCount(NamedTuple):
    """Env steps of the run received by the learner, as one learner device counts them."""

    env_steps: jax.Array  # int32 scalar, saturating at SATURATION
    learner_devices: jax.Array  # int32 scalar: D, the learner devices of every process


def new_count(layout: Layout) -> EnvStepCount:
    """A count at 0 for the run `layout` describes."""
    return EnvStepCount(
        env_steps=jnp.zeros((), jnp.int32),
        learner_devices=jnp.asarray(layout.num_learner_devices * layout.num_processes,
                                    jnp.int32))


def add(count: EnvStepCount, trajectory: Trajectory) -> EnvStepCount:
    """`count` plus the env steps of the update this device's shard belongs to.

    Args:
      count: the device's count so far.
      trajectory: the device's shard as `update_experience` receives it, actions
        [rows, T, ...] (K trajectories joined: rows = K x E / L); its T + 1st env step
        is the next trajectory's first and is not counted here.
    """
    rows, steps = trajectory.actor_outputs.action.shape[:2]
    received = jnp.asarray(rows * steps, jnp.int32) * count.learner_devices
    # min first, so that the sum itself never passes SATURATION (nor int32's range)
    return count._replace(
        env_steps=jnp.minimum(count.env_steps, SATURATION - received) + received)


def reached(count: EnvStepCount, env_steps: int) -> jax.Array:
    """bool scalar: the run has received at least `env_steps` env steps."""
    if not isinstance(env_steps, int) or isinstance(env_steps, bool) or env_steps < 0:
        raise ValueError(f"env_steps must be an int >= 0, got {env_steps!r}")
    if env_steps > SATURATION:
        raise ValueError(f"env_steps={env_steps} is beyond what the count holds "
                         f"({SATURATION})")
    return count.env_steps >= env_steps
