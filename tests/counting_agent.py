"""A minimal real agent that logs what the learner receives, for pipeline tests."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

import sebulba


class CountingStepState(NamedTuple):
    count: jax.Array  # [E] int32, acting steps taken by each env
    last_id: jax.Array  # [E] float32, env id in the last observation acted on


class Log(NamedTuple):
    """What each of the first C updates received; an update's rows are K x E/L (K =
    trajectories_per_update, item k's envs in rows [k E/L, (k + 1) E/L))."""

    obs: jax.Array  # [C, K E/L, T+1, 3]
    first: jax.Array  # [C, K E/L, T+1]
    initial_count: jax.Array  # [C, K E/L]
    final_count: jax.Array  # [C, K E/L]
    final_id: jax.Array  # [C, K E/L]
    size: jax.Array  # int32, updates logged


class CountingAgent(sebulba.Agent):
    """Acts with action 0, counts its steps, and logs up to `capacity` updates."""

    def __init__(self, env_spec, capacity: int = 64):
        super().__init__(env_spec)
        self.capacity = capacity

    def new_networks(self, key):
        return {"w": jnp.ones(())}

    def new_step_state(self, nets, key, num_envs):
        return CountingStepState(jnp.zeros(num_envs, jnp.int32), jnp.full(num_envs, -1.0))

    def new_opt_state(self, nets, key):
        return ()

    def new_experience_state(self, nets, key, layout):
        c, e, t = self.capacity, layout.envs_per_update_shard, layout.steps_per_cycle
        return Log(
            obs=jnp.zeros((c, e, t + 1, 3)),
            first=jnp.zeros((c, e, t + 1), bool),
            initial_count=jnp.zeros((c, e), jnp.int32),
            final_count=jnp.zeros((c, e), jnp.int32),
            final_id=jnp.zeros((c, e)),
            size=jnp.zeros((), jnp.int32),
        )

    def step(self, step_state, nets, env_step):
        action = jnp.zeros(env_step.obs.shape[0], jnp.int32)
        new_state = CountingStepState(step_state.count + 1, env_step.obs[:, 0])
        return sebulba.ActorOutput(action=action), new_state

    def update_experience(self, experience, initial_step_state, final_step_state, trajectory,
                          nets):
        i = experience.size

        def put(buf, x):
            return buf.at[i].set(x, mode="drop")

        return Log(
            obs=put(experience.obs, trajectory.env_steps.obs),
            first=put(experience.first, trajectory.env_steps.first),
            initial_count=put(experience.initial_count, initial_step_state.count),
            final_count=put(experience.final_count, final_step_state.count),
            final_id=put(experience.final_id, final_step_state.last_id),
            size=i + 1,
        )

    def loss(self, nets, opt, experience):
        loss = jnp.square(nets["w"])
        return loss, (experience, {"w": nets["w"]})

    def optimize_from_grads(self, nets, opt, grads):
        return jax.tree.map(lambda w, g: w - 0.01 * g, nets, grads), opt
