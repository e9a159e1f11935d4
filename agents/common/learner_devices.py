"""What an agent's learner functions need to know about the learner device they run on."""

from __future__ import annotations

import jax

from sebulba.runtime.sharding import LEARNER_AXIS


def own_key(key: jax.Array) -> jax.Array:
    """`key` with the learner device's index folded in, so that devices that start from
    the same experience (and key) sample independently, e.g. their own replay batches.

    Outside the learner's shard_map (a direct call, as in unit tests) the key is used
    as is.
    """
    try:
        index = jax.lax.axis_index(LEARNER_AXIS)
    except NameError:
        return key
    return jax.random.fold_in(key, index)
