"""A target network: a copy of the online networks, refreshed every `period` optimizer steps.

Use it from an agent's hooks (as agents/r2d2.py does):

    def new_networks(self, key):          return target_network.new(init(key))
    def partition_for_grad(self, nets):   return target_network.partition_for_grad(nets)
    def acting_nets(self, nets, updates): return nets.online   # the target stays home
    def optimize_from_grads(self, nets, opt, grads):
        online = <apply grads.online to nets.online>
        return target_network.refresh(nets, online, steps, period), opt

so the target is held out of the gradient (it gets no gradient and no optimizer state),
out of what is published to the actors, and changes only by the periodic copy.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from sebulba.types import PyTree


class OnlineAndTarget(NamedTuple):
    online: PyTree  # trained by the optimizer
    target: PyTree  # a periodic copy of `online`, never differentiated


def new(online: PyTree) -> OnlineAndTarget:
    """Online networks and a target that starts as their copy."""
    return OnlineAndTarget(online, jax.tree.map(jnp.copy, online))


def partition_for_grad(nets: OnlineAndTarget) -> tuple[OnlineAndTarget, OnlineAndTarget]:
    """`Agent.partition_for_grad` for `OnlineAndTarget` nets: differentiate `online` only."""

    def none(tree):
        return jax.tree.map(lambda _: None, tree)

    return (OnlineAndTarget(nets.online, none(nets.target)),
            OnlineAndTarget(none(nets.online), nets.target))


def refresh(nets: OnlineAndTarget, online: PyTree, steps: jax.Array,
            period: int) -> OnlineAndTarget:
    """The new `online` networks, with the target set to them when `steps` (the optimizer
    steps taken, this one included) is a multiple of `period`."""
    if not isinstance(period, int) or isinstance(period, bool) or period < 1:
        raise ValueError(f"period must be an int >= 1, got {period!r}")
    copy = steps % period == 0
    target = jax.tree.map(lambda o, t: jnp.where(copy, o, t), online, nets.target)
    return OnlineAndTarget(online, target)
