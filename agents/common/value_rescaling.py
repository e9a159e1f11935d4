"""Invertible value rescaling (Pohlen et al., 2018), used by R2D2 on its Q-values.

h(x) = sign(x) (sqrt(|x| + 1) - 1) + eps x squashes large returns so that one network
fits returns of very different scales; Bellman targets are built in the raw scale,
h(r + discount * h^-1(q)), so the inverse must be exact.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

DEFAULT_EPS = 1e-3


def rescale(x: jax.Array, eps: float = DEFAULT_EPS) -> jax.Array:
    """h(x), elementwise; strictly increasing, h(0) = 0, odd."""
    # sign(x)(sqrt(|x| + 1) - 1) written as x / (sqrt(|x| + 1) + 1): no cancellation near
    # 0, and a true gradient there (1/2 + eps; sign's zero gradient made it eps).
    return x / (jnp.sqrt(jnp.abs(x) + 1.0) + 1.0) + eps * x


def unrescale(y: jax.Array, eps: float = DEFAULT_EPS) -> jax.Array:
    """h^-1(y), elementwise: the exact inverse of `rescale` with the same eps.

    Solving y = s(sqrt(u) - 1) + eps s (u - 1) for u = |x| + 1 > 0 (s = sign) is a
    quadratic in sqrt(u) whose positive root gives
    |x| = ((sqrt(1 + 4 eps (|y| + 1 + eps)) - 1) / (2 eps))^2 - 1.
    For eps = 0 it is (|y| + 1)^2 - 1.
    """
    a = jnp.abs(y)
    if eps == 0.0:
        return jnp.sign(y) * ((a + 1.0) ** 2 - 1.0)
    # root - 1 rewritten without the cancellations of sqrt(1 + z) - 1 and root^2 - 1, which
    # cost float32 about 1e-4 absolute error near 0: |x| = d (d + 2) with d = root - 1.
    z = 4.0 * eps * (a + 1.0 + eps)
    s = jnp.sqrt(1.0 + z)
    d = (2.0 * a + 2.0 * eps - z / (1.0 + s)) / (s + 1.0)
    return jnp.sign(y) * d * (d + 2.0)
