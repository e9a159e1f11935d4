"""Flax Linen networks shared by agents."""

from __future__ import annotations

from collections.abc import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp


def flatten_trailing(x: jax.Array, rank: int) -> jax.Array:
    """[..., *shape] with len(shape) == rank -> [..., prod(shape)] (images into vectors)."""
    batch_shape = x.shape[: x.ndim - rank]
    return x.reshape(batch_shape + (-1,))


class MLP(nn.Module):
    """ReLU layers of `hidden_sizes`; no activation on the last if `activate_final` is False."""

    hidden_sizes: Sequence[int]
    activate_final: bool = True

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        for i, size in enumerate(self.hidden_sizes):
            x = nn.Dense(size)(x)
            if self.activate_final or i < len(self.hidden_sizes) - 1:
                x = nn.relu(x)
        return x


class TanhMLP(nn.Module):
    """tanh layers of `hidden_sizes` with orthogonal sqrt(2) init (CleanRL's hidden layers)."""

    hidden_sizes: Sequence[int]

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        for size in self.hidden_sizes:
            x = nn.tanh(nn.Dense(size, kernel_init=nn.initializers.orthogonal(jnp.sqrt(2.0)))(x))
        return x


class SeparatePolicyValueMLP(nn.Module):
    """Separate tanh MLPs for the policy and the value (CleanRL's actor and critic).

    Maps observations [..., *obs_shape] with len(obs_shape) == obs_rank to (logits
    [..., num_actions], value [...]); the obs_rank trailing dims are flattened. Separate
    torsos keep the value loss, much larger than the policy's on CartPole-v1, from
    reshaping the policy's features. Output init: a near-uniform initial policy (gain
    0.01 on the logits) and unit-scale values.
    """

    num_actions: int
    hidden_sizes: Sequence[int] = (64, 64)
    obs_rank: int = 1

    @nn.compact
    def __call__(self, obs: jax.Array) -> tuple[jax.Array, jax.Array]:
        x = flatten_trailing(obs, self.obs_rank).astype(jnp.float32)
        policy = TanhMLP(self.hidden_sizes, name="policy_torso")(x)
        logits = nn.Dense(self.num_actions, kernel_init=nn.initializers.orthogonal(0.01),
                          name="policy_head")(policy)
        value = TanhMLP(self.hidden_sizes, name="value_torso")(x)
        value = nn.Dense(1, kernel_init=nn.initializers.orthogonal(1.0), name="value_head")(value)
        return logits, value[..., 0]
