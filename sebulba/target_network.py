"""Target networks: copies of online networks that trail them, held out of the gradient.

Two ways to trail, for any `OnlineAndTarget` pair:

- `refresh`: the target is set to the online networks every `period` optimizer steps
  (a periodic hard copy, R2D2's and DQN's);
- `soft_refresh`: after every optimizer step the target moves a fraction `tau` of the
  way to the online networks, target <- tau online + (1 - tau) target (Polyak
  averaging, SAC's), so it is an exponential moving average of the online networks
  with a horizon of about 1 / tau optimizer steps.

Whole networks (as agents/r2d2.py does):

    def new_networks(self, key):          return target_network.new(init(key))
    def partition_for_grad(self, nets):   return target_network.partition_for_grad(nets)
    def acting_nets(self, nets, updates): return nets.online   # the target stays home
    def optimize_from_grads(self, nets, opt, grads):
        online = <apply grads.online to nets.online>
        return target_network.refresh(nets, online, steps, period), opt

Part of the networks (as agents/sac.py does: its critics have a target, its actor and
temperature none): put an `OnlineAndTarget` pair anywhere inside the networks' pytree,
e.g. `SACNets(actor=..., critic=target_network.new(critic), log_alpha=...)`;
`partition_for_grad` holds out every pair's target wherever it sits, and the agent
refreshes the pair it owns (`nets.critic = soft_refresh(nets.critic, online, tau)`).

Either way the target gets no gradient and no optimizer state, is not published to the
actors unless `acting_nets` returns it, and changes only by `refresh`/`soft_refresh`.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from sebulba.types import PyTree


class OnlineAndTarget(NamedTuple):
    online: PyTree  # trained by the optimizer
    target: PyTree  # trails `online` (`refresh` or `soft_refresh`), never differentiated


def new(online: PyTree) -> OnlineAndTarget:
    """Online networks and a target that starts as their copy."""
    return OnlineAndTarget(online, jax.tree.map(jnp.copy, online))


def _is_pair(x) -> bool:
    return isinstance(x, OnlineAndTarget)


def _none(tree: PyTree) -> PyTree:
    return jax.tree.map(lambda _: None, tree)


def partition_for_grad(nets: PyTree) -> tuple[PyTree, PyTree]:
    """`Agent.partition_for_grad` for networks holding `OnlineAndTarget` pairs: the
    whole `nets` may be one pair, or pairs may sit anywhere inside it.

    Differentiated: everything but the pairs' targets. Held fixed: the targets. Both
    parts keep the structure of `nets`, with None where a leaf belongs to the other.
    """
    if _is_pair(nets):
        return (OnlineAndTarget(nets.online, _none(nets.target)),
                OnlineAndTarget(_none(nets.online), nets.target))

    def diff(x):
        return OnlineAndTarget(x.online, _none(x.target)) if _is_pair(x) else x

    def fixed(x):
        return OnlineAndTarget(_none(x.online), x.target) if _is_pair(x) else None

    return (jax.tree.map(diff, nets, is_leaf=_is_pair),
            jax.tree.map(fixed, nets, is_leaf=_is_pair))


def _check_period(period: int) -> None:
    if not isinstance(period, int) or isinstance(period, bool) or period < 1:
        raise ValueError(f"period must be an int >= 1, got {period!r}")


def refresh(nets: OnlineAndTarget, online: PyTree, steps: jax.Array,
            period: int) -> OnlineAndTarget:
    """The new `online` networks, with the target set to them when `steps` (the optimizer
    steps taken, this one included) is a multiple of `period`."""
    _check_period(period)
    copy = steps % period == 0
    target = jax.tree.map(lambda o, t: jnp.where(copy, o, t), online, nets.target)
    return OnlineAndTarget(online, target)


def polyak(online: PyTree, target: PyTree, tau: float | jax.Array) -> PyTree:
    """tau x online + (1 - tau) x target, leaf by leaf, in the target's dtypes.

    tau in [0, 1]: 1 copies `online`, 0 keeps `target`. Checked when tau is a Python
    number (a traced tau is the caller's to keep in range).
    """
    if isinstance(tau, int | float) and not 0.0 <= tau <= 1.0:  # also rejects NaN
        raise ValueError(f"tau must be in [0, 1], got {tau!r}")
    return jax.tree.map(
        lambda o, t: (tau * o + (1.0 - tau) * t).astype(t.dtype), online, target)


def soft_refresh(nets: OnlineAndTarget, online: PyTree,
                 tau: float | jax.Array) -> OnlineAndTarget:
    """The new `online` networks, with the target moved a fraction `tau` towards them
    (`polyak`); call once per optimizer step."""
    return OnlineAndTarget(online, polyak(online, nets.target, tau))
