"""Placing pytrees on the learner devices.

Learner-side arrays are global `jax.Array`s with a leading axis of one entry per
learner device (the `pmap` layout), sharded over a 1-D mesh whose axis is named
`LEARNER_AXIS`. Each process provides the entries of its own (local) learner
devices, so the same code serves one host and several.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from sebulba.runtime import transfers
from sebulba.types import PyTree

LEARNER_AXIS = "learner"


@functools.cache
def learner_mesh(devices: tuple[jax.Device, ...]) -> Mesh:
    """The 1-D mesh over all (global) learner devices."""
    return Mesh(np.asarray(devices), (LEARNER_AXIS,))


def learner_sharding(devices: Sequence[jax.Device]) -> NamedSharding:
    return NamedSharding(learner_mesh(tuple(devices)), P(LEARNER_AXIS))


def own_key(key: jax.Array) -> jax.Array:
    """`key` with the learner device's index folded in, so that devices that start from
    the same experience (and key) sample independently, e.g. their own replay batches.

    Call it inside an agent's learner functions (`Agent.loss`, `update_experience`);
    outside the learner's shard_map (a direct call, as in unit tests) the key is used
    as is.
    """
    try:
        index = jax.lax.axis_index(LEARNER_AXIS)
    except NameError:
        return key
    return jax.random.fold_in(key, index)


def local_devices_of(devices: Sequence[jax.Device]) -> list[jax.Device]:
    """The devices of `devices` that belong to this process, in mesh order."""
    return [d for d in devices if d.process_index == jax.process_index()]


def slice_env_axis(tree: PyTree, start: int, size: int) -> PyTree:
    """Envs [start, start + size) of per-env leaves; 0-d leaves are shared."""
    return jax.tree.map(lambda x: x if jnp.ndim(x) == 0 else x[start:start + size], tree)


def assemble(per_device: Sequence[PyTree], devices: Sequence[jax.Device],
             *, stacked: bool = False) -> PyTree:
    """Builds global [num_learners, ...] arrays from one pytree per local learner device.

    `per_device[i]` must already live on `local_devices_of(devices)[i]`, with leaves
    [1, ...] if `stacked` (no device op needed: the hot path) or [...] otherwise.
    """
    sharding = learner_sharding(devices)
    num_global = len(devices)

    def build(*pieces: jax.Array) -> jax.Array:
        if not stacked:
            pieces = [p[None] for p in pieces]
        shape = (num_global,) + pieces[0].shape[1:]
        return jax.make_array_from_single_device_arrays(shape, sharding, list(pieces))

    return jax.tree.map(build, *per_device)


def _learner_axis_first(x: jax.Array | np.ndarray, num_pieces: int):
    """[E, ...] -> [num_pieces, E / num_pieces, ...] (a 0-d leaf: [num_pieces], repeated)."""
    if x.ndim == 0:
        return jnp.broadcast_to(x[None], (num_pieces,))
    if x.shape[0] % num_pieces:
        raise ValueError(
            f"a per-env leaf of shape {x.shape} has {x.shape[0]} envs, not divisible by "
            f"{num_pieces} local learner devices")
    return x.reshape((num_pieces, x.shape[0] // num_pieces) + x.shape[1:])


@functools.cache
def _env_axis_splitter(num_pieces: int):
    def split(tree):
        def pieces(x):  # each [1, ...], as `assemble(stacked=True)` takes them
            return list(_learner_axis_first(x, num_pieces)[:, None])

        leaves, treedef = jax.tree.flatten(tree)
        per_leaf = [pieces(x) for x in leaves]
        return [treedef.unflatten([p[i] for p in per_leaf]) for i in range(num_pieces)]

    return jax.jit(split)


@functools.cache
def _env_axis_to_learners(devices: tuple[jax.Device, ...]):
    """One compiled call from a pytree of device arrays [E, ...] on the one device of
    the learner mesh of a single process to global arrays [1, E, ...] on that mesh."""
    split = functools.partial(jax.tree.map, lambda x: _learner_axis_first(x, 1))
    return jax.jit(split, out_shardings=learner_sharding(devices))


@functools.cache
def _host_to_learners(devices: tuple[jax.Device, ...]):
    """The identity, taking host arrays [1, E, ...] to global arrays on the one device of
    the learner mesh of a single process: the call's own transfer of its arguments
    (JAX's fastest) and no computation (its outputs are its inputs)."""
    sharding = learner_sharding(devices)
    return jax.jit(lambda tree: tree, in_shardings=sharding, out_shardings=sharding)


def _one_device_mesh(devices: Sequence[jax.Device]) -> bool:
    """Whether the learner mesh is one device of this process, the only process: the
    hot paths then place a pytree with one compiled call (about 10x cheaper than a
    transfer per device and a global array built per leaf)."""
    return len(devices) == 1 and jax.process_count() == 1


def shard_env_axis(tree: PyTree, devices: Sequence[jax.Device]) -> PyTree:
    """Splits per-env leaves along their leading env axis over the local learner devices.

    Leaves with at least one axis are per-env ([E, ...] becomes [num_learners, E / L, ...],
    L the number of local learner devices); 0-d leaves (a shared counter, a typed PRNG
    key) are replicated ([num_learners]). One compiled split on the source device, then
    one transfer per learner device (one call in all where the mesh is that device).
    """
    if _one_device_mesh(devices) and all(
            isinstance(x, jax.Array) and x.devices() == {devices[0]}
            for x in jax.tree.leaves(tree)):
        return _env_axis_to_learners(tuple(devices))(tree)
    local = local_devices_of(devices)
    pieces = _env_axis_splitter(len(local))(tree)
    return assemble([jax.device_put(p, d) for p, d in zip(pieces, local, strict=True)], devices,
                    stacked=True)


# Up to this many bytes a host pytree goes to a one-device learner mesh in one call: its
# per-leaf costs are saved (33 against 214 us for a CartPole trajectory of 16 envs x 100
# steps), while for megabytes the call's transfer of its arguments is slower than
# `jax.device_put`'s (7.5 MB of Atari frames: 410 to 865 us against 366 to 651).
_ONE_CALL_MAX_BYTES = 1 << 20


def shard_host_env_axis(tree: PyTree, devices: Sequence[jax.Device]) -> PyTree:
    """`shard_env_axis` for a pytree of host (numpy) arrays with an env axis first: each
    local learner device gets its slice straight from host memory, one transfer each
    (one call in all for a small pytree where the mesh is one device, outside
    `transfers.guarded`, whose guard disallows the call's implicit transfer)."""
    if (_one_device_mesh(devices) and not transfers.is_guarded()
            and sum(x.nbytes for x in jax.tree.leaves(tree)) <= _ONE_CALL_MAX_BYTES):
        return _host_to_learners(tuple(devices))(jax.tree.map(lambda x: x[None], tree))
    local = local_devices_of(devices)
    n = len(local)

    def piece(x: np.ndarray, i: int) -> np.ndarray:
        if x.shape[0] % n:
            raise ValueError(f"a per-env leaf of shape {x.shape} has {x.shape[0]} envs, not "
                             f"divisible by {n} local learner devices")
        size = x.shape[0] // n
        return x[None, i * size:(i + 1) * size]  # [1, E / L, ...]: a view, no copy

    return assemble([jax.device_put(jax.tree.map(lambda x, i=i: piece(x, i), tree), d)
                     for i, d in enumerate(local)], devices, stacked=True)


def replicate(tree: PyTree, devices: Sequence[jax.Device]) -> PyTree:
    """The same pytree on every learner device, with a leading learner axis."""
    local = local_devices_of(devices)
    return assemble([jax.device_put(tree, d, may_alias=False) for d in local], devices)


def stack_local(tree: PyTree, devices: Sequence[jax.Device]) -> PyTree:
    """Global arrays from leaves [num_local_learners, ...]: entry i goes to local device i."""
    local = local_devices_of(devices)
    leading = {x.shape[0] for x in jax.tree.leaves(tree)}
    if leading != {len(local)}:
        raise ValueError(
            f"per-device state has leading axes {sorted(leading)}, expected {len(local)} "
            "(one entry per local learner device)"
        )
    return assemble([jax.device_put(jax.tree.map(lambda x, i=i: x[i], tree), d)
                     for i, d in enumerate(local)], devices)


def local_entries(tree: PyTree) -> PyTree:
    """This process's entries of global [num_learners, ...] arrays, stacked in mesh order
    on the first local device: leaves [num_local_learners, ...], copies that outlive
    the arrays (which the learner's next update donates)."""
    def gather(x: jax.Array) -> jax.Array:
        shards = sorted(x.addressable_shards, key=lambda s: s.index[0].start)
        if len(shards) == 1:  # concatenate would hand back the shard's own buffer
            return jnp.copy(shards[0].data)
        device = shards[0].device
        return jnp.concatenate([jax.device_put(s.data, device) for s in shards])

    return jax.tree.map(gather, tree)


@jax.jit
def _drop_learner_axis(tree: PyTree) -> PyTree:
    return jax.tree.map(lambda x: x[0], tree)


def first_replica(tree: PyTree) -> PyTree:
    """The entry of the first local learner device, without the learner axis."""
    shards = jax.tree.map(lambda x: x.addressable_shards[0].data, tree)
    return _drop_learner_axis(shards)


def unshard_env_axis(tree: PyTree) -> PyTree:
    """Inverse of `shard_env_axis` for the local entries, gathered on one device."""
    def merge(x: jax.Array) -> jax.Array:
        local = [s.data for s in sorted(x.addressable_shards, key=lambda s: s.index[0].start)]
        if x.ndim == 1:  # a replicated 0-d leaf
            return local[0][0]
        device = local[0].device
        return jnp.concatenate([jax.device_put(p[0], device) for p in local])

    return jax.tree.map(merge, tree)
