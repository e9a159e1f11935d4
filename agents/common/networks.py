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


class NatureCNN(nn.Module):
    """The DQN Nature torso (Mnih et al., 2015): three convolutions and a 512-unit layer.

    Maps stacked frames [..., C, H, W] (uint8 0-255, channels first as ale-py's
    AtariVectorEnv emits them: C = 4 frames of 84 x 84) to features [..., 512].
    """

    @nn.compact
    def __call__(self, frames: jax.Array) -> jax.Array:
        batch_shape = frames.shape[:-3]
        x = frames.reshape((-1,) + frames.shape[-3:]).astype(jnp.float32) / 255.0
        x = jnp.transpose(x, (0, 2, 3, 1))  # to channels last, as nn.Conv expects
        init = nn.initializers.orthogonal(jnp.sqrt(2.0))
        for features, kernel, stride in ((32, 8, 4), (64, 4, 2), (64, 3, 1)):
            x = nn.relu(nn.Conv(features, (kernel, kernel), (stride, stride), padding="VALID",
                                kernel_init=init)(x))
        x = nn.relu(nn.Dense(512, kernel_init=init)(x.reshape(x.shape[0], -1)))
        return x.reshape(batch_shape + (512,))


class CNNPolicyValue(nn.Module):
    """NatureCNN torso shared by a policy head and a value head (pixels are expensive to
    encode twice). Maps frames [..., C, H, W] to (logits [..., num_actions], value [...])."""

    num_actions: int

    @nn.compact
    def __call__(self, frames: jax.Array) -> tuple[jax.Array, jax.Array]:
        x = NatureCNN()(frames)
        logits = nn.Dense(self.num_actions, kernel_init=nn.initializers.orthogonal(0.01))(x)
        value = nn.Dense(1, kernel_init=nn.initializers.orthogonal(1.0))(x)
        return logits, value[..., 0]


def policy_value_network(
    num_actions: int, obs_shape: Sequence[int], hidden_sizes: Sequence[int]
) -> nn.Module:
    """The feed-forward policy/value network for an observation shape: NatureCNN for
    stacked frames [C, H, W], separate tanh MLPs for anything else (flattened)."""
    if len(obs_shape) == 3:
        return CNNPolicyValue(num_actions)
    return SeparatePolicyValueMLP(num_actions, tuple(hidden_sizes), obs_rank=len(obs_shape))
