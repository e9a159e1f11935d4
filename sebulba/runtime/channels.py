"""What passes between threads: the queue item, the networks' staging deque, the error box.

    inferencer threads --QueueItem--> queue.Queue --> Learner
    Learner --publish(version, nets)--> Staging (one per inference device) --> inferencers
    any thread --report(error)--> ErrorBox --> stops the run, re-raised in the caller
"""

from __future__ import annotations

import collections
import threading
from typing import NamedTuple

import jax

from sebulba.types import Nets, StepState, Trajectory

# How often blocking waits wake up to check whether the run is stopping.
POLL_SECONDS = 0.05


class QueueItem(NamedTuple):
    """One inference cycle of one env group, placed on the learner devices.

    Attributes:
      group: the env group (inferencer thread) of this process that produced it.
      version: learner updates done when the networks that acted were published (the
        policy lag of this item is the learner's updates when it is consumed minus this).
      initial_step_state: the StepState the cycle started from, sharded along the env
        axis over the learner devices.
      final_step_state: the StepState it ended in (the next cycle's initial), sharded.
      trajectory: what the cycle produced, leaves [envs, T, ...], sharded.
      num_env_steps: env steps the cycle took (envs_per_group x steps_per_cycle).
    """

    group: int
    version: int
    initial_step_state: StepState
    final_step_state: StepState
    trajectory: Trajectory
    num_env_steps: int


class Staging:
    """The latest published networks for one inference device: a deque(maxlen=1).

    The learner appends; inferencers read the newest entry at the start of each cycle.
    A deque's append and [-1] are atomic, so neither side locks.
    """

    def __init__(self, device: jax.Device):
        self.device = device
        self._latest: collections.deque[tuple[int, Nets]] = collections.deque(maxlen=1)

    def publish(self, version: int, nets: Nets) -> None:
        """Copies `nets` to this device (asynchronously) and makes them the latest."""
        self._latest.append((version, jax.device_put(nets, self.device)))

    def latest(self) -> tuple[int, Nets]:
        """(learner updates when published, networks on this device)."""
        return self._latest[-1]


class ErrorBox:
    """The first error of any thread; setting it stops the run."""

    def __init__(self, stop: threading.Event):
        self._stop = stop
        self._lock = threading.Lock()
        self.error: BaseException | None = None

    def report(self, error: BaseException) -> None:
        with self._lock:
            if self.error is None and not self._stop.is_set():
                self.error = error
        self._stop.set()

    def raise_if_any(self) -> None:
        if self.error is not None:
            raise self.error
