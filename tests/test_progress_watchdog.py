"""What a multi-process run's watchdog says about its peers: who never started, keys of
one run only, and a peer's last position, not one of a second before."""

from __future__ import annotations

import itertools
import threading
import time

import pytest

from sebulba.runtime import watchdog
from sebulba.runtime.watchdog import ProgressWatchdog, describe_progress


class KeyValueStore:
    """The two calls of JAX's coordination client the watchdog makes, over a dict (the
    real store needs a `jax.distributed` cluster; tests/test_multihost.py runs one)."""

    def __init__(self):
        self.values: dict[str, str] = {}
        self.lock = threading.Lock()

    def key_value_set(self, key: str, value: str, allow_overwrite: bool = False) -> None:
        with self.lock:
            assert allow_overwrite or key not in self.values
            self.values[key] = value

    def key_value_dir_get(self, prefix: str) -> list[tuple[str, str]]:
        with self.lock:
            return [(k, v) for k, v in self.values.items() if k.startswith(prefix)]


@pytest.mark.timeout(30)
def test_a_peer_that_never_published_is_named_as_never_started():
    # Process 1 never reached its learner: "every process is in update 1" hid it.
    assert describe_progress({0: 1}, me=0, num_processes=2) == (
        "process 1 never started its learner (process 0 in update 1): the silent peer")
    assert describe_progress({0: 1}, me=0, num_processes=3) == (
        "process 1, process 2 never started their learners (process 0 in update 1): the "
        "silent peers")
    assert describe_progress({0: 1, 1: 1}, me=0, num_processes=2) == \
        "every process is in update 1"


def _watchdogs(store: KeyValueStore, monkeypatch, run: int,
               n: int = 2) -> list[ProgressWatchdog]:
    """The watchdogs of `n` processes' `run`-th run (one process plays them all here)."""
    monkeypatch.setattr(watchdog, "_coordination_client", lambda: store)
    monkeypatch.setattr(watchdog, "_RUNS", itertools.repeat(run))
    return [ProgressWatchdog(60.0, p, on_stall=lambda message: None, num_processes=n)
            for p in range(n)]


@pytest.mark.timeout(30)
def test_positions_are_published_as_the_learner_moves_and_per_run(monkeypatch):
    store = KeyValueStore()
    first = _watchdogs(store, monkeypatch, 0)
    try:
        for update in range(1, 9):  # eight updates well within the one-second poll
            for w in first:
                w.entering(update)
                w.finished(update)
        first[1].entering(9)
        time.sleep(0.2)
        # The last position of each, not one of a second before.
        assert first[0].progress() == {0: 16, 1: 17}
        assert first[1].report().startswith("process 0 stopped after update 8 ")
    finally:
        for w in first:
            w.close()
    # A second run of the same processes: the first run's positions stand for no one.
    second = _watchdogs(store, monkeypatch, 1)
    try:
        second[0].entering(1)
        time.sleep(0.2)
        assert second[0].progress() == {0: 1}
        assert second[0].report() == (
            "process 1 never started its learner (process 0 in update 1): the silent peer")
    finally:
        for w in second:
            w.close()
