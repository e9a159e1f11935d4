"""Action distributions for the three action spaces actor-critic agents act in, and the
network head that outputs their parameters.

    head = policy_head_for(action_space)   # a flax module: features [..., D] -> distribution
    dist = head.apply(params, features)     # Categorical | MultiCategorical | DiagGaussian
    dist.log_prob(action)    # [...]   the action's log-probability (summed over its parts)
    dist.entropy()           # [...]
    dist.mode()              # [..., *action_shape]  the greedy action
    dist.sample(key)         # one env's action from an unbatched distribution (vmap it)

A distribution is a pytree of arrays (a `flax.struct` dataclass; sizes are static
fields), so it passes through `jit`, `vmap`, `scan` and `tree.map` slicing; the leading
axes are batch axes ([E] when acting, [B, T] in a loss).

- `Discrete(n)`: `Categorical(logits [..., n])`, actions int32 [...].
- `MultiDiscrete(nvec)`: independent categoricals, `MultiCategorical(logits [..., sum
  nvec])`, actions int32 [..., len(nvec)].
- `Box(shape)`: `DiagGaussian(mean [..., *shape], log_std [..., *shape])`, actions float32
  [..., *shape], unbounded: the env boundary clips them to the space's bounds
  (`sebulba.envs.action_to_env`) while the agent keeps the unclipped sample, so its
  log-probability is the one of the action it learns from. The head works in units of
  the bounds (`box_units`): a mean of 0 is their middle and a std of 1 half their width,
  so a policy starts spread over [low, high] whatever their scale (torques of 1e3 or of
  0.4); entries without finite bounds are in the env's own units.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import flax.struct
import gymnasium as gym
import jax
import jax.numpy as jnp
import numpy as np

_HALF_LOG_2PI = 0.5 * float(np.log(2.0 * np.pi))


@flax.struct.dataclass
class Categorical:
    """One categorical over `logits.shape[-1]` actions."""

    logits: jax.Array  # [..., A]

    def log_prob(self, action: jax.Array) -> jax.Array:
        log_probs = jax.nn.log_softmax(self.logits)
        index = action[..., None].astype(jnp.int32)
        return jnp.take_along_axis(log_probs, index, axis=-1)[..., 0]

    def entropy(self) -> jax.Array:
        log_probs = jax.nn.log_softmax(self.logits)
        return -jnp.sum(jnp.exp(log_probs) * log_probs, axis=-1)

    def mode(self) -> jax.Array:
        return jnp.argmax(self.logits, axis=-1).astype(jnp.int32)

    def sample(self, key: jax.Array) -> jax.Array:
        return jax.random.categorical(key, self.logits).astype(jnp.int32)


@flax.struct.dataclass
class MultiCategorical:
    """Independent categoricals, one per entry of a MultiDiscrete action; `logits` holds
    them side by side, `nvec` (static) their sizes."""

    logits: jax.Array  # [..., sum(nvec)]
    nvec: tuple[int, ...] = flax.struct.field(pytree_node=False)

    def _parts(self) -> list[Categorical]:
        bounds = np.cumsum(self.nvec)[:-1].tolist()
        return [Categorical(x) for x in jnp.split(self.logits, bounds, axis=-1)]

    def log_prob(self, action: jax.Array) -> jax.Array:
        return sum(c.log_prob(action[..., i]) for i, c in enumerate(self._parts()))

    def entropy(self) -> jax.Array:
        return sum(c.entropy() for c in self._parts())

    def mode(self) -> jax.Array:
        return jnp.stack([c.mode() for c in self._parts()], axis=-1)

    def sample(self, key: jax.Array) -> jax.Array:
        keys = jax.random.split(key, len(self.nvec))
        return jnp.stack([c.sample(k) for c, k in zip(self._parts(), keys, strict=True)],
                         axis=-1)


@flax.struct.dataclass
class DiagGaussian:
    """A Gaussian with independent entries; the last `event_ndim` axes (the action's
    shape) are one action, the axes before them batch axes."""

    mean: jax.Array  # [..., *shape]
    log_std: jax.Array  # [..., *shape]
    event_ndim: int = flax.struct.field(pytree_node=False, default=1)

    def _sum_event(self, x: jax.Array) -> jax.Array:
        return jnp.sum(x, axis=tuple(range(-self.event_ndim, 0)))

    def log_prob(self, action: jax.Array) -> jax.Array:
        z = (action - self.mean) * jnp.exp(-self.log_std)
        return self._sum_event(-0.5 * z * z - self.log_std - _HALF_LOG_2PI)

    def entropy(self) -> jax.Array:
        return self._sum_event(self.log_std + 0.5 + _HALF_LOG_2PI)

    def mode(self) -> jax.Array:
        return self.mean

    def sample(self, key: jax.Array) -> jax.Array:
        noise = jax.random.normal(key, jnp.shape(self.mean), jnp.float32)
        return self.mean + jnp.exp(self.log_std) * noise


Distribution = Categorical | MultiCategorical | DiagGaussian


@flax.struct.dataclass
class TanhGaussian:
    """tanh(u), u ~ `base` (a DiagGaussian): actions in (-1, 1)^shape, as SAC's policy
    (agents/sac.py rescales them to the action space's bounds).

    The density follows from the change of variables a = tanh(u), entry by entry:
    log p(a) = log N(u) - sum log(1 - tanh(u)^2), with log(1 - tanh(u)^2) computed as
    2 (log 2 - u - softplus(-2u)), exact and finite for every u (no epsilon added to
    1 - a^2). Sample and log-probability come together from the same u: recovering u
    from a (`atanh`) loses precision near the bounds.
    """

    base: DiagGaussian

    def _log_det_jacobian(self, u: jax.Array) -> jax.Array:
        """sum log |d tanh(u) / du| over the event axes."""
        return self.base._sum_event(2.0 * (np.log(2.0) - u - jax.nn.softplus(-2.0 * u)))

    def sample_and_log_prob(self, key: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(a [..., *shape], log p(a) [...]) for the whole batch from one key;
        reparameterized: differentiable in the mean and log-std."""
        u = self.base.sample(key)
        return jnp.tanh(u), self.base.log_prob(u) - self._log_det_jacobian(u)

    def log_prob(self, action: jax.Array) -> jax.Array:
        """log p(a) of actions in (-1, 1) (an action at +-1 has density 0: -inf)."""
        u = jnp.arctanh(action)
        return self.base.log_prob(u) - self._log_det_jacobian(u)

    def mode(self) -> jax.Array:
        """tanh of the Gaussian's mean (the greedy action; not the density's mode)."""
        return jnp.tanh(self.base.mean)


class CategoricalHead(nn.Module):
    """Features [..., D] -> `Categorical` (near-uniform at init: orthogonal gain 0.01)."""

    num_actions: int

    @nn.compact
    def __call__(self, x: jax.Array) -> Categorical:
        return Categorical(nn.Dense(self.num_actions, name="logits",
                                    kernel_init=nn.initializers.orthogonal(0.01))(x))


class MultiCategoricalHead(nn.Module):
    """Features [..., D] -> `MultiCategorical` over `nvec`."""

    nvec: tuple[int, ...]

    @nn.compact
    def __call__(self, x: jax.Array) -> MultiCategorical:
        logits = nn.Dense(sum(self.nvec), name="logits",
                          kernel_init=nn.initializers.orthogonal(0.01))(x)
        return MultiCategorical(logits, self.nvec)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def clip_returning(x: jax.Array, low: float, high: float) -> jax.Array:
    """`jnp.clip(x, low, high)` whose gradient still lets an `x` outside [low, high] come
    back: outside, the part of the gradient that would move it back passes, the part
    that would move it further out is zero. `jnp.clip`'s gradient is zero outside, so a
    parameter an optimizer carried past a bound (an entropy bonus raising a log-std)
    stayed there for good, whatever the loss asked of it later."""
    return jnp.clip(x, low, high)


def _clip_returning_fwd(x, low, high):
    return jnp.clip(x, low, high), x


def _clip_returning_bwd(low, high, x, g):
    # Gradient descent moves x by -g: down (back in from above) where g > 0.
    return (jnp.where(x > high, jnp.maximum(g, 0.0),
                      jnp.where(x < low, jnp.minimum(g, 0.0), g)),)


clip_returning.defvjp(_clip_returning_fwd, _clip_returning_bwd)


def box_units(space: gym.spaces.Box) -> tuple[tuple[float, ...], tuple[float, ...]] | None:
    """(middle, half width) of each entry of a Box's bounds, flattened, or None where
    every entry's are -1 and 1 (nothing to scale). An entry with an infinite bound, or one
    of 1e30 or more (float32's max stands for none in some envs), or no width (or one too
    small for float32) keeps the env's units: middle 0, half width 1."""
    low = np.asarray(space.low, np.float64).reshape(-1)
    high = np.asarray(space.high, np.float64).reshape(-1)
    # A half width below float32's least normal number would be flushed to 0 on the
    # device (a log-std of -inf): such an entry keeps the env's units too.
    bounded = ((np.abs(low) < 1e30) & (np.abs(high) < 1e30)
               & ((high - low) / 2 >= np.finfo(np.float32).tiny))
    low, high = np.where(bounded, low, -1.0), np.where(bounded, high, 1.0)
    middle, half = (low + high) / 2, (high - low) / 2
    if np.all(middle == 0.0) and np.all(half == 1.0):
        return None
    return tuple(middle.tolist()), tuple(half.tolist())


class GaussianHead(nn.Module):
    """Features [..., D] -> `DiagGaussian` over actions of `shape`.

    The mean is linear in the features (orthogonal gain 0.01: near 0 at init, as
    CleanRL's continuous PPO). The log-std is one learnt parameter per action entry,
    the same in every state (`state_dependent_std` False: CleanRL's default, robust for
    on-policy learning), or a second linear output of the features. It starts at
    `init_log_std` and is kept in [min_log_std, max_log_std] so a policy can neither
    collapse to a point nor explode (`clip_returning`: a log-std past a bound can still
    be brought back by the loss). With `units` (`box_units`: middle, half width of each
    flattened entry) mean and std are in those units: mean = middle + half x output, std
    = half x exp(log-std), the bounds of the log-std applied before.
    """

    shape: tuple[int, ...]
    state_dependent_std: bool = False
    init_log_std: float = 0.0
    min_log_std: float = -5.0
    max_log_std: float = 2.0
    units: tuple[tuple[float, ...], tuple[float, ...]] | None = None

    @nn.compact
    def __call__(self, x: jax.Array) -> DiagGaussian:
        size = int(np.prod(self.shape))
        batch = x.shape[:-1]
        mean = nn.Dense(size, name="mean", kernel_init=nn.initializers.orthogonal(0.01))(x)
        if self.state_dependent_std:
            log_std = nn.Dense(size, name="log_std", kernel_init=nn.initializers.zeros,
                               bias_init=nn.initializers.constant(self.init_log_std))(x)
        else:
            log_std = self.param("log_std", nn.initializers.constant(self.init_log_std),
                                 (size,))
            log_std = jnp.broadcast_to(log_std, batch + (size,))
        log_std = clip_returning(log_std, self.min_log_std, self.max_log_std)
        if self.units is not None:
            middle, half = (jnp.asarray(u, jnp.float32) for u in self.units)
            mean = middle + half * mean
            log_std = log_std + jnp.log(half)
        return DiagGaussian(mean.reshape(batch + self.shape),
                            log_std.reshape(batch + self.shape), len(self.shape))


def policy_head_for(action_space: gym.Space, *, state_dependent_std: bool = False
                    ) -> nn.Module:
    """The head for an action space: Discrete, MultiDiscrete (every entry from 0) or Box."""
    if isinstance(action_space, gym.spaces.Discrete):
        return CategoricalHead(int(action_space.n))
    if isinstance(action_space, gym.spaces.MultiDiscrete):
        return MultiCategoricalHead(tuple(int(n) for n in np.asarray(action_space.nvec)))
    if isinstance(action_space, gym.spaces.Box):
        return GaussianHead(tuple(int(d) for d in action_space.shape),
                            state_dependent_std=state_dependent_std,
                            units=box_units(action_space))
    raise ValueError(f"no policy head for action space {action_space!r}: expected "
                     "Discrete, MultiDiscrete or Box")


def action_shape(action_space: gym.Space) -> tuple[int, ...]:
    """The shape of one env's action as the agents produce it."""
    if isinstance(action_space, gym.spaces.MultiDiscrete):
        return (int(np.asarray(action_space.nvec).size),)
    return tuple(action_space.shape or ())

