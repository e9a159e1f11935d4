"""Categorical policy pieces shared by agents: sampling, log-probabilities, entropy,
the behaviour log-prob recorded by the actor, and masked means over trajectories."""

from __future__ import annotations

import jax
import jax.numpy as jnp

import sebulba


def sample(keys: jax.Array, logits: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One action per env from per-env typed keys [E] and logits [E, A].

    Returns (actions [E] int, the next keys [E]).
    """
    keys = jax.vmap(jax.random.split)(keys)  # [E, 2]
    return jax.vmap(jax.random.categorical)(keys[:, 0], logits), keys[:, 1]


def log_prob(logits: jax.Array, action: jax.Array) -> jax.Array:
    """log pi(action) from logits [..., A] and int actions [...]."""
    log_probs = jax.nn.log_softmax(logits)
    return jnp.take_along_axis(log_probs, action[..., None].astype(jnp.int32), axis=-1)[..., 0]


def entropy(logits: jax.Array) -> jax.Array:
    """Entropy [...] of the categorical distributions with logits [..., A]."""
    log_probs = jax.nn.log_softmax(logits)
    return -jnp.sum(jnp.exp(log_probs) * log_probs, axis=-1)


def actor_output(logits: jax.Array, action: jax.Array) -> sebulba.ActorOutput:
    """The action with the acting policy's log pi(action | obs) [E] in `extras["log_prob"]`,
    the denominator of a learner's importance ratio (under policy lag the learner's own
    policy is not the one that acted)."""
    return sebulba.ActorOutput(action=action, extras={"log_prob": log_prob(logits, action)})


def masked_mean(x: jax.Array, mask: jax.Array) -> jax.Array:
    """Mean of `x` over entries where `mask` (same shape, 0/1) is 1; 0 if there are none."""
    return jnp.sum(x * mask) / jnp.maximum(jnp.sum(mask), 1.0)
