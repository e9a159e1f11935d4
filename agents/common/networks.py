"""Flax Linen networks shared by agents."""

from __future__ import annotations

from collections.abc import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp


class MLP(nn.Module):
    """ReLU layers of `hidden_sizes`; the last layer has no activation if `activate_final` is False."""

    hidden_sizes: Sequence[int]
    activate_final: bool = True

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        for i, size in enumerate(self.hidden_sizes):
            x = nn.Dense(size)(x)
            if self.activate_final or i < len(self.hidden_sizes) - 1:
                x = nn.relu(x)
        return x


class PolicyValueMLP(nn.Module):
    """An MLP torso with a softmax-policy head and a value head.

    Maps observations [..., *obs_shape] to (logits [..., num_actions], value [...]).
    """

    num_actions: int
    hidden_sizes: Sequence[int] = (64, 64)

    @nn.compact
    def __call__(self, obs: jax.Array) -> tuple[jax.Array, jax.Array]:
        x = obs.reshape(obs.shape[: obs.ndim - 1] + (-1,)) if obs.ndim > 1 else obs
        x = MLP(self.hidden_sizes)(x.astype(jnp.float32))
        logits = nn.Dense(self.num_actions, kernel_init=nn.initializers.orthogonal(0.01))(x)
        value = nn.Dense(1, kernel_init=nn.initializers.orthogonal(1.0))(x)
        return logits, value[..., 0]
