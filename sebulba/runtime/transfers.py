"""Every host-device transfer of the acting loop and the learner, made in one place.

On an accelerator each transfer is a round trip of tens of microseconds or more, so the
hot paths make only the ones they need: per acting call, the observations to the
device and the actions (whose copy starts at once) to the host; per inference cycle, the
extras to the host, stacked on the device (a by-id source's come with each step's
actions), and the trajectory to the learner devices; per learner update, nothing but
the metrics of the update before. They go through `to_device` and `to_host`, which
count them by place (`counting`) so a test can assert the number per step.

`guarded` checks that nothing else transfers: inside it JAX's transfer guard disallows
implicit transfers (a NumPy argument to a compiled call, `np.asarray` of a device array,
a Python scalar turned into an array), and `to_device` and `to_host` use JAX's explicit
forms instead of the implicit ones. On XLA:CPU device buffers are host memory, so the
guard sees implicit host-to-device transfers but not device-to-host ones; on a GPU it
sees both. The explicit forms cost more per call than the implicit fast path (tens of
microseconds on the CPU, as much as a whole acting step of a small network), which is
why they are for checking and not the default; the transfers made are the same.
"""

from __future__ import annotations

import collections
import contextlib
import threading
from collections.abc import Iterator

import jax
import numpy as np

from sebulba.types import PyTree

_counts: collections.Counter[str] | None = None  # None: not counting
_lock = threading.Lock()
_guarded = threading.local()  # .on: inside `guarded` on this thread


def _count(place: str) -> None:
    with _lock:
        if _counts is not None:
            _counts[place] += 1


def to_device(tree: PyTree, device: jax.Device, place: str) -> PyTree:
    """`tree` (host arrays) for a compiled call on `device`: as it is (the call copies it,
    JAX's fastest path) or, inside `guarded`, copied explicitly."""
    if _counts is not None:
        _count(place)
    if is_guarded():
        return jax.device_put(tree, device)
    return tree


def is_guarded() -> bool:
    """Whether this thread is inside `guarded` (its implicit transfers disallowed)."""
    return getattr(_guarded, "on", False)


def to_host(x: jax.Array, place: str) -> np.ndarray:
    """`x` as a NumPy array (waits for it); explicitly inside `guarded`."""
    if _counts is not None:
        _count(place)
    if is_guarded():
        return jax.device_get(x)
    return np.asarray(x)


def to_host_all(xs: list[jax.Array], place: str) -> list[np.ndarray]:
    """`to_host` of each of `xs`, counted as one transfer (their copies start together)."""
    if _counts is not None:
        _count(place)
    if is_guarded():
        return jax.device_get(xs)
    return [np.asarray(x) for x in xs]


def start_to_host(xs: list[jax.Array]) -> None:
    """Starts copying `xs` to the host (an accelerator's round trip begins at dispatch; the
    fetch that follows is counted). A deliberate transfer, allowed inside `guarded`,
    whose device-to-host guard catches this call too on an accelerator."""
    allowed = jax.transfer_guard_device_to_host("allow") if is_guarded() else \
        contextlib.nullcontext()
    with allowed:
        for x in xs:
            x.copy_to_host_async()


def count(place: str) -> None:
    """Counts a transfer made by other means (`jax.device_put` to learner devices)."""
    if _counts is not None:
        _count(place)


@contextlib.contextmanager
def counting() -> Iterator[collections.Counter[str]]:
    """Counts the transfers of every thread by place while open (one at a time)."""
    global _counts
    if _counts is not None:
        raise RuntimeError("transfers are already being counted")
    counts: collections.Counter[str] = collections.Counter()
    _counts = counts
    try:
        yield counts
    finally:
        _counts = None


class DisallowedTransfer(RuntimeError):
    """A transfer the guard caught, with the place it happened in."""


@contextlib.contextmanager
def guarded(place: str, on: bool = True) -> Iterator[None]:
    """This thread's implicit transfers disallowed while open (if `on`); one the guard
    catches is re-raised as a DisallowedTransfer naming `place` and the array."""
    if not on:
        yield
        return
    _guarded.on = True
    try:
        with jax.transfer_guard("disallow"):
            yield
    except Exception as e:
        if "Disallowed" in str(e) and "transfer" in str(e):
            raise DisallowedTransfer(
                f"{place}: an implicit transfer, which the transfer guard disallows "
                f"(make it explicit, or out of the hot path): {e}") from e
        raise
    finally:
        _guarded.on = False
