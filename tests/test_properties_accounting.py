"""The accounting identity, env_steps = consumed + dropped + in flight, under random
schedules: first event by event (the real `Accounting`, the real bounded queue and the
inferencers' real put, which drops the oldest item of a full queue), then in real runs
(threads, drops, stops at random points).

After every event of a schedule, and in every run, the counters are non-negative and
never go back, and consumed and dropped steps are whole trajectories.
"""

from __future__ import annotations

import functools
import queue
import threading
import time
import types

import numpy as np
import pytest
from hypothesis import event, given
from hypothesis import strategies as st

import sebulba
from sebulba.runtime.accounting import Accounting
from sebulba.runtime.channels import QueueItem
from sebulba.runtime.inferencer import EnvGroupRunner
from tests import brute_force as bf
from tests.conftest import sebulba_threads
from tests.counting_agent import CountingAgent
from tests.envs import CountingEnv

ENVS, STEPS = 4, 3  # per group: a trajectory is ENVS x STEPS env steps
CYCLE = ENVS * STEPS
MONOTONE = ("env_steps", "consumed", "dropped", "trajectories_consumed",
            "trajectories_dropped", "episodes_total", "lag_sum", "lag_max")

# (kind, group): a step of group g's envs, the learner popping an item, an episode of
# group g ending. Steps weigh most: a cycle takes STEPS of them.
EVENT = st.tuples(st.sampled_from(["step"] * 4 + ["learn"] * 2 + ["episode"]),
                  st.integers(0, 2))


class Schedule:
    """Groups, a bounded queue and a learner, one event at a time."""

    def __init__(self, groups: int, capacity: int, drop_when_full: bool, per_update: int):
        self.accounting = Accounting()
        self.queue: queue.Queue[QueueItem] = queue.Queue(capacity)
        # What EnvGroupRunner._put reads of its runner.
        self.runner = types.SimpleNamespace(stop=threading.Event(), queue=self.queue,
                                            drop_when_full=drop_when_full,
                                            accounting=self.accounting)
        self.steps = [0] * groups  # env steps of each group's open cycle, per env
        self.partial = [0] * groups  # env steps in open cycles (the runners' partial_steps)
        self.popped: list[QueueItem] = []
        self.per_update = per_update
        self.updates = 0
        self.lags: list[int] = []
        self.episodes_read = 0

    def step(self, g: int) -> None:
        """One env step of group g's envs; a full cycle goes on the queue, unless the
        queue is full and applies backpressure (the group then waits to push it)."""
        if self.steps[g] == STEPS:  # a cycle waits for room
            if self.queue.full() and not self.runner.drop_when_full:
                return
            item = QueueItem(g, self.updates, None, None, None, CYCLE)
            assert EnvGroupRunner._put(self.runner, item)
            self.partial[g] -= CYCLE
            self.steps[g] = 0
        self.accounting.add_env_steps(ENVS)
        self.partial[g] += ENVS
        self.steps[g] += 1

    def learn(self) -> None:
        """Pops an item; an update consumes `per_update` of them (as Sebulba's loop)."""
        try:
            self.popped.append(self.queue.get_nowait())
        except queue.Empty:
            return
        if len(self.popped) == self.per_update:
            for item in self.popped:
                self.lags.append(self.updates - item.version)
                self.accounting.add_consumed(item.num_env_steps, self.lags[-1])
            self.popped = []
            self.updates += 1

    def episode(self, g: int) -> None:
        self.accounting.add_episodes([(float(g), STEPS)])

    def in_flight(self) -> int:
        """As Sebulba's loop counts it at the end of a run: open cycles, items popped for
        an update not made, items still queued."""
        queued = list(self.queue.queue)
        return sum(self.partial) + sum(i.num_env_steps for i in self.popped + queued)

    def check(self, before: dict[str, int]) -> dict[str, int]:
        a = self.accounting
        now = {name: getattr(a, name) for name in MONOTONE}
        assert all(v >= 0 for v in now.values()), now
        assert all(now[k] >= before.get(k, 0) for k in MONOTONE), (before, now)
        assert a.env_steps == a.consumed + a.dropped + self.in_flight(), now
        assert a.consumed == CYCLE * a.trajectories_consumed
        assert a.dropped == CYCLE * a.trajectories_dropped
        assert a.trajectories_consumed == self.updates * self.per_update == len(self.lags)
        assert (a.lag_sum, a.lag_max) == (sum(self.lags), max(self.lags, default=0))
        new, total = a.episodes_since(self.episodes_read)
        assert len(new) == total - self.episodes_read  # none missed, none twice
        self.episodes_read = total
        return now


@pytest.mark.timeout(120)
@bf.examples(200)
@given(groups=st.integers(1, 3), capacity=st.integers(1, 3), drop_when_full=st.booleans(),
       per_update=st.integers(1, 3), events=st.lists(EVENT, min_size=40, max_size=150))
def test_every_step_is_consumed_dropped_or_in_flight_after_every_event(
        groups, capacity, drop_when_full, per_update, events):
    s = Schedule(groups, capacity, drop_when_full, per_update)
    counters = s.check({})
    for kind, g in events:
        if kind == "step":
            s.step(g % groups)
        elif kind == "learn":
            s.learn()
        else:
            s.episode(g)
        counters = s.check(counters)
    event(f"dropped: {s.accounting.dropped > 0}, consumed: {s.accounting.consumed > 0}")
    # Stopping anywhere ends the schedule as it stands: the identity holds as checked.
    if not drop_when_full:
        assert s.accounting.dropped == 0


@pytest.fixture(scope="module")
def loops():
    """Two env groups of CountingEnv; one loop per queue policy, each compiled once."""
    factory = functools.partial(CountingEnv, 5)
    agent = CountingAgent(sebulba.env_spec(factory))
    return {drop: sebulba.Sebulba(agent, sebulba.Config(
        env=factory, envs_per_group=ENVS, steps_per_cycle=STEPS, async_factor=2,
        queue_capacity=1, drop_when_full=drop, trajectories_per_update=2 if drop else 1))
        for drop in (True, False)}


@pytest.mark.timeout(240)
@bf.examples(8)
@given(drop=st.booleans(), updates=st.integers(1, 12), stop_after=st.none() | st.integers(1, 12),
       stop_seconds=st.none() | st.floats(0.0, 0.3), learner_sleep=st.floats(0.0, 0.02))
def test_real_runs_account_for_every_step(loops, drop, updates, stop_after, stop_seconds,
                                          learner_sleep):
    loop = loops[drop]
    per_update = loop.config.trajectories_per_update * CYCLE
    stop = threading.Event()
    seen: list[tuple[int, ...]] = []

    def on_update(info):
        a = info.accounting
        seen.append((a.env_steps, a.consumed, a.dropped, a.episodes_total))
        if stop_after is not None and info.version == stop_after:
            stop.set()
        time.sleep(learner_sleep)  # a slow learner: the queue fills, items drop

    timer = None
    if stop_seconds is not None:  # a stop from outside, at any point of the run
        timer = threading.Timer(stop_seconds, stop.set)
        timer.start()
    try:
        r = loop.run(updates * per_update, on_update=on_update, stop=stop)
    finally:
        if timer is not None:
            timer.cancel()
            timer.join()
    assert r.env_steps == r.consumed + r.dropped + r.in_flight
    assert min(r.env_steps, r.consumed, r.dropped, r.in_flight) >= 0
    assert r.consumed == r.learner_updates * per_update
    assert r.dropped % CYCLE == 0 and (drop or r.dropped == 0)
    assert r.env_steps % ENVS == 0  # a vector step counts its envs
    assert len(seen) == r.learner_updates
    assert r.stopped_early or r.learner_updates == updates
    if stop_after is not None and stop_after < updates and stop_seconds is None:
        assert r.stopped_early and r.learner_updates == stop_after
    # The live counters never went back, and end at the run's figures.
    if seen:
        assert np.all(np.diff(np.array(seen), axis=0) >= 0), seen
        assert seen[-1][1] == r.consumed
    assert sebulba_threads() == []  # every inferencer thread ended with the run
    event(f"dropped: {r.dropped > 0}, stopped early: {r.stopped_early}, "
          f"in flight: {r.in_flight > 0}")
