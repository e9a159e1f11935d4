"""Running observation normalization and reward scaling, kept as learner state.

The statistics live in the networks' variables, in the collection `"normalization"`, so
they are published with the networks (every actor normalizes with the same numbers),
checkpointed with them, and updated on the learner, not in per-env wrappers:

    network = Unroll(ObservationNormalizer(...) -> torso, core, head)   # reads them
    nets = update(nets, obs [E, T, ...], returns [E, T])   # in Agent.update_statistics

`update` merges one update's batch into the running moments with the parallel-variance
formula (Chan et al., 1979), after summing the batch's moments over the learner devices
of every process (`psum` over `sebulba.runtime.sharding.LEARNER_AXIS`), so the replicas stay
identical. Reward scaling divides rewards by the running standard deviation of each env's
discounted return (the actor accumulates it: `discounted_return`), as gymnasium's
NormalizeReward wrapper and CleanRL's continuous PPO do, but with one set of statistics
for the whole run.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from sebulba.runtime.sharding import LEARNER_AXIS

COLLECTION = "normalization"
EPSILON = 1e-8


def new_moments(shape: tuple[int, ...]) -> dict[str, jax.Array]:
    """Moments of nothing yet: count 0, mean 0, variance 1 (normalizing is the identity)."""
    return {"count": jnp.zeros((), jnp.float32), "mean": jnp.zeros(shape, jnp.float32),
            "var": jnp.ones(shape, jnp.float32)}


class ObservationNormalizer(nn.Module):
    """(x - mean) / sqrt(var + eps), clipped to [-clip, clip], from the running moments of
    the observations (rank `obs_rank`); the moments are variables, not parameters, and
    receive no gradient."""

    obs_rank: int = 1
    clip: float = 10.0

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        shape = x.shape[x.ndim - self.obs_rank:]
        moments = self.variable(COLLECTION, "observation", new_moments, shape).value
        mean, var = jax.lax.stop_gradient((moments["mean"], moments["var"]))
        x = (x.astype(jnp.float32) - mean) / jnp.sqrt(var + EPSILON)
        return jnp.clip(x, -self.clip, self.clip)


def new_reward_moments() -> dict[str, jax.Array]:
    return new_moments(())


def _learner_sum(x: jax.Array) -> jax.Array:
    """`x` summed over the learner devices of every process; `x` itself outside the
    learner's shard_map (a direct call, as in unit tests)."""
    try:
        return jax.lax.psum(x, LEARNER_AXIS)
    except NameError:
        return x


def merged(moments: dict[str, jax.Array], x: jax.Array, batch_axes: int,
           valid: jax.Array | None = None) -> dict[str, jax.Array]:
    """`moments` with the entries of `x` over its first `batch_axes` axes (on every learner
    device of every process) added; with `valid` (bool, x's batch shape) only those."""
    axes = tuple(range(batch_axes))
    if valid is None:
        valid = jnp.ones(x.shape[:batch_axes], bool)
    w = valid.astype(jnp.float32).reshape(valid.shape + (1,) * (x.ndim - batch_axes))
    total = _learner_sum(jnp.sum(w))
    safe_total = jnp.maximum(total, 1.0)
    mean = _learner_sum(jnp.sum(w * x, axis=axes)) / safe_total
    m2 = _learner_sum(jnp.sum(w * jnp.square(x - mean), axis=axes))
    n = moments["count"]
    new_count = n + total
    safe_count = jnp.maximum(new_count, 1.0)
    delta = mean - moments["mean"]
    new_mean = moments["mean"] + delta * total / safe_count
    new_m2 = moments["var"] * n + m2 + jnp.square(delta) * n * total / safe_count
    combined = {"count": new_count, "mean": new_mean, "var": new_m2 / safe_count}
    # a batch with no valid entry changes nothing
    return jax.tree.map(lambda new, old: jnp.where(total > 0, new, old), combined,
                        moments)


def update(nets: Any, obs: jax.Array, returns: jax.Array | None,
           valid: jax.Array | None = None) -> Any:
    """`nets` with the normalization statistics it holds updated from one update's shard:
    observations [E, T, *obs_shape] and the actors' discounted returns [E, T] (None if
    rewards are not scaled), of the steps where `valid` [E, T] (None: all; padding steps
    of multi-agent envs are not). Must run inside the learner's shard_map (it sums over
    the learner devices). Networks without statistics are returned unchanged."""
    if not isinstance(nets, dict) or COLLECTION not in nets:
        return nets
    stats = dict(nets[COLLECTION])

    def merge_observations(tree):
        if isinstance(tree, dict) and set(tree) == {"count", "mean", "var"}:
            return merged(tree, obs.astype(jnp.float32), 2, valid)
        return {k: merge_observations(v) for k, v in tree.items()}

    for name, tree in stats.items():
        if name == "reward":
            if returns is not None:
                stats[name] = merged(tree, returns.astype(jnp.float32), 2, valid)
        else:
            stats[name] = merge_observations(tree)
    return {**nets, COLLECTION: stats}


def with_reward_scaling(nets: Any) -> Any:
    """`nets` holding reward moments too (call on new networks to scale rewards)."""
    stats = dict(nets.get(COLLECTION, {}))
    stats["reward"] = new_reward_moments()
    return {**nets, COLLECTION: stats}


def scale_rewards(nets: Any, reward: jax.Array, min_std: float = 0.0) -> jax.Array:
    """Rewards divided by the running std of the discounted return (or by `min_std` if
    that is larger), where `nets` hold reward moments; unchanged otherwise."""
    stats = nets.get(COLLECTION, {}) if isinstance(nets, dict) else {}
    if "reward" not in stats:
        return reward
    var = jax.lax.stop_gradient(stats["reward"]["var"])
    return reward / jnp.maximum(jnp.sqrt(var + EPSILON), min_std)


def received_rewards_merged(moments: dict[str, jax.Array], trajectory: Any
                            ) -> dict[str, jax.Array]:
    """`moments` with the rewards of `trajectory` (env steps [B, T+1]) added: entry 0 is
    the previous trajectory's last step (counted there), and a reset step's reward (0)
    follows no action (not counted)."""
    new = jax.tree.map(lambda x: x[:, 1:], trajectory.env_steps)
    return merged(moments, new.reward.astype(jnp.float32), 2, valid=~new.first)


def inverse_rms(moments: dict[str, jax.Array]) -> jax.Array:
    """One over the root mean square of the rewards `moments` hold (1 before any, and
    while every reward has been 0): what rewards are multiplied by to learn them at a
    unit scale, whatever the task pays."""
    rms = jnp.sqrt(moments["var"] + jnp.square(moments["mean"]))
    return jnp.where(rms > 0, 1.0 / jnp.maximum(rms, EPSILON), 1.0)


def discounted_return(accumulated: jax.Array, reward: jax.Array, first: jax.Array,
                      discount: float) -> jax.Array:
    """Each env's discounted return so far [E]: restarts at an episode's first step."""
    return jnp.where(first, 0.0, accumulated * discount + reward)
