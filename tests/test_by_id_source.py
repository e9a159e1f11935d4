"""An inferencer driving a source whose recv returns any E of its envs (EnvPool's kind),
with batches that mix groups and envs that drift apart in their cycles: each env's steps
still land in its own trajectory row, in order, with the step states they started and
ended from. Whether EnvPool's batches mix groups depends on how the first resets finish
(in some runs most batches do, in others none), so this scripted source makes sure the
by-id loop's general path is exercised."""

from __future__ import annotations

import queue
import threading

import gymnasium as gym
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sebulba
from sebulba.envs import EpisodeTracker
from sebulba.runtime import inferencer
from sebulba.runtime.accounting import Accounting
from sebulba.runtime.channels import ErrorBox, Staging
from sebulba.runtime.inferencer import (
    HOLD_AHEAD_CYCLES,
    ActingFunctions,
    EnvGroupRunner,
    _HoldBack,
)
from tests.counting_agent import CountingAgent

E, T, GROUPS = 4, 5, 3
OBS_SPACE = gym.spaces.Box(-np.inf, np.inf, (3,), np.float32)


class TaggingAgent(CountingAgent):
    """CountingAgent whose outputs name the env and its count, to check where they land."""

    def step(self, step_state, nets, env_step):
        output, new_state = super().step(step_state, nets, env_step)
        extras = {"env": env_step.obs[:, 0].astype(jnp.int32), "count": step_state.count}
        return output._replace(action=step_state.count % 2, extras=extras), new_state


class ScriptedPool:
    """GROUPS x E envs; recv returns E of the envs sent (or reset) and not yet returned,
    picked by a seeded rng among the `window` that waited longest (None: all of them).
    obs = (env id, steps the env took, 0); episodes never end."""

    in_order = False

    def __init__(self, seed: int, window: int | None = E + 2):
        self.num_groups, self.group_size, self.num_envs = GROUPS, E, GROUPS * E
        self.rng = np.random.default_rng(seed)
        self.window = window
        self.steps = np.zeros(self.num_envs, np.int64)
        self.ready: list[int] = []
        self.tracker = EpisodeTracker(self.num_envs, OBS_SPACE)
        self.mixed_groups = self.mixed_steps = 0  # batches of several groups / step counts
        self.short_sends = 0  # sends of fewer than E envs: envs held back, released

    def reset(self, seed: int) -> None:
        self.ready = list(range(self.num_envs))

    def pick(self) -> np.ndarray:
        """The ids recv returns, taken out of `ready`."""
        window = self.ready[:self.window]
        picked = sorted(self.rng.choice(len(window), E, replace=False).tolist())
        self.ready = [e for i, e in enumerate(self.ready) if i not in picked]
        return np.array([window[i] for i in picked], np.int64)

    def recv(self):
        assert len(self.ready) >= E, "recv would wait forever: fewer than E envs stepping"
        ids = self.pick()
        self.mixed_groups += len(set((ids // E).tolist())) > 1
        self.mixed_steps += len(set(self.steps[ids].tolist())) > 1
        obs = np.stack([ids, self.steps[ids], np.zeros(E)], axis=1).astype(np.float32)
        zeros = np.zeros(E, bool)
        return (ids, *self.tracker.observe(ids, obs, np.zeros(E, np.float32), zeros, zeros))

    def pop_episodes(self):
        return self.tracker.pop_episodes()

    def send(self, actions: np.ndarray, ids: np.ndarray) -> None:
        np.testing.assert_array_equal(actions, self.steps[ids] % 2)  # each env's own action
        self.steps[ids] += 1
        self.ready.extend(ids.tolist())
        self.tracker.sent(ids)
        self.short_sends += len(ids) < E

    def close(self) -> None:
        pass


def run_until_pushed(pool: ScriptedPool, cycles: int, copies_early: bool = False
                     ) -> dict[int, list]:
    """Drives `pool` with an inferencer thread until each group pushed `cycles` cycles;
    `copies_early`: the outputs' host copies start at dispatch, as on an accelerator."""
    agent = TaggingAgent(sebulba.EnvSpec(OBS_SPACE, gym.spaces.Discrete(2)))
    device = jax.devices()[0]
    key = jax.random.key(0)
    nets = agent.new_networks(key)
    staging = Staging(device)
    staging.publish(0, nets)
    stop = threading.Event()
    errors = ErrorBox(stop)
    items: queue.Queue = queue.Queue()
    runner = EnvGroupRunner(
        first_group=0, device=device, source=pool,
        step_state=agent.new_step_state(nets, key, pool.num_envs), seed=0,
        acting=ActingFunctions(agent, T), staging=staging, learner_devices=[device],
        out_queue=items, drop_when_full=False, stop=stop, errors=errors,
        accounting=Accounting())
    runner.copies_early = copies_early
    thread = threading.Thread(target=runner, name="sebulba-test-by-id")
    thread.start()
    pushed: dict[int, list] = {g: [] for g in range(GROUPS)}
    try:
        while min(len(p) for p in pushed.values()) < cycles and errors.error is None:
            try:
                item = items.get(timeout=1)
            except queue.Empty:
                continue
            pushed[item.group].append(item)
    finally:
        stop.set()
        thread.join(10)
    assert not thread.is_alive()
    assert errors.error is None, errors.error
    return pushed


def check_rows_in_order(pushed: dict[int, list]) -> None:
    """Each env's steps in its own row of its group's trajectories, in order, with the
    outputs of its own acting steps and the step states its cycles started and ended at."""
    for g, group_items in pushed.items():
        for c, item in enumerate(group_items):
            obs = np.asarray(item.trajectory.env_steps.obs)[0]  # [E, T + 1, 3]
            first = np.asarray(item.trajectory.env_steps.first)[0]
            initial = np.asarray(item.initial_step_state.count)[0]
            final = np.asarray(item.final_step_state.count)[0]
            np.testing.assert_array_equal(obs[:, :, 0],
                                          np.broadcast_to((g * E + np.arange(E))[:, None],
                                                          (E, T + 1)))
            # Row e holds env e's steps c T .. (c + 1) T, the last one the next's first.
            np.testing.assert_array_equal(obs[:, :, 1],
                                          np.broadcast_to(c * T + np.arange(T + 1), (E, T + 1)))
            np.testing.assert_array_equal(first[:, 0], np.full(E, c == 0))
            assert not first[:, 1:].any()
            # The outputs of each env's acting steps, in its row, in order.
            outputs = jax.tree.map(lambda x: np.asarray(x)[0], item.trajectory.actor_outputs)
            steps = np.broadcast_to(c * T + np.arange(T), (E, T))
            np.testing.assert_array_equal(outputs.extras["env"], obs[:, :T, 0])
            np.testing.assert_array_equal(outputs.extras["count"], steps)
            np.testing.assert_array_equal(outputs.action, steps % 2)
            # The step states are the ones the cycle started from and ended at.
            np.testing.assert_array_equal(initial, np.full(E, c * T))
            np.testing.assert_array_equal(final, np.full(E, (c + 1) * T))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("copies_early", [False, True])
def test_mixed_batches_fill_each_envs_own_row_in_order(copies_early, monkeypatch):
    copied = []
    start = inferencer.start_host_copies
    monkeypatch.setattr(inferencer, "start_host_copies",
                        lambda output: (copied.append(1), start(output)))
    pool = ScriptedPool(seed=0)
    pushed = run_until_pushed(pool, cycles=8, copies_early=copies_early)
    assert bool(copied) == copies_early  # an accelerator's early host copies, if asked
    # The script did reach the general path: batches of several groups, and envs of
    # one batch at different steps (so at different cursors, often in different cycles).
    assert pool.mixed_groups > 10 and pool.mixed_steps > 10
    check_rows_in_order(pushed)


@pytest.mark.timeout(120)
def test_envs_that_run_ahead_of_their_group_are_held_back():
    """With three or more groups in one pool, two batches step at once and recv returns
    whichever envs finish first: an env's lead over the slowest of its group grows as a
    random walk, without bound. An env about to open a cycle HOLD_AHEAD_CYCLES ahead of
    its group's oldest is held back (its action kept, not sent) until that cycle is
    pushed, as long as E envs are left stepping for recv."""
    pool = ScriptedPool(seed=1, window=None)  # any stepping env may finish first
    pushed = run_until_pushed(pool, cycles=60)
    assert pool.short_sends > 0  # envs were held back, and released
    check_rows_in_order(pushed)


class SlowEnvsPool(ScriptedPool):
    """A pool whose first env of groups 0 and 1 finishes last whenever E others can be
    returned instead (a slow reset, a slow simulator): the other envs of those groups,
    more than can wait for them, run ahead. Records the largest lead in env steps."""

    slow = (0, E)

    def __init__(self, seed: int):
        super().__init__(seed, window=None)
        self.lead = 0

    def pick(self) -> np.ndarray:
        steps = self.steps.reshape(GROUPS, E)
        self.lead = max(self.lead, int((steps.max(1) - steps.min(1)).max()))
        fast = [e for e in self.ready if e not in self.slow]
        if len(fast) < E:
            return super().pick()
        ids = np.sort(self.rng.choice(fast, E, replace=False))
        self.ready = [e for e in self.ready if e not in ids]
        return ids


@pytest.mark.timeout(120)
def test_envs_run_on_where_no_more_can_wait_for_their_group():
    """Three groups: the room for held envs is one group's (all but the batch received
    and the one sent). Two groups' fast envs are more than that: those that find no room
    run on, past the lead where envs are held, and the trajectories stay in order."""
    pool = SlowEnvsPool(seed=2)
    pushed = run_until_pushed(pool, cycles=40)
    assert pool.lead > HOLD_AHEAD_CYCLES * T  # more than holding alone allows
    check_rows_in_order(pushed)


def test_an_env_is_held_just_before_it_would_open_one_cycle_too_many():
    steps, size = 4, 2
    held = _HoldBack(capacity=2, group_size=size, steps_per_cycle=steps)
    oldest = np.zeros(3, np.int64)  # three groups of two envs, all at their first cycle
    cycle = np.array([HOLD_AHEAD_CYCLES - 1, HOLD_AHEAD_CYCLES - 2, 0, 0, 0, 0])
    cursor = np.array([steps - 1, steps - 1, 0, 0, 0, 0])
    ids = np.array([0, 1])
    # Env 0's next step ends cycle oldest + MAX - 1 and opens one too many: held. Env 1's
    # opens oldest + MAX - 1, which may be open: sent.
    hold = held.choose(ids, cycle, cursor, oldest)
    np.testing.assert_array_equal(hold, [True, False])
    send_ids, send_actions = held.split(ids, np.array([10, 11]), hold)
    np.testing.assert_array_equal(send_ids, [1])
    np.testing.assert_array_equal(send_actions, [11])
    # Mid-cycle, an env ahead is sent: its step opens nothing.
    assert held.choose(ids, cycle, np.array([steps - 2] * 6), oldest) is None
    # At most `capacity` envs wait (a batch must keep stepping for recv): one more here.
    cycle[1] = HOLD_AHEAD_CYCLES - 1
    cycle[3] = HOLD_AHEAD_CYCLES  # group 1's oldest is 1 below
    oldest[1] = 1
    cursor[3] = steps - 1
    hold = held.choose(np.array([1, 3]), cycle, cursor, oldest)
    np.testing.assert_array_equal(hold, [True, False])  # room for one
    held.split(np.array([1, 3]), np.array([21, 23]), hold)
    assert held.choose(np.array([3]), cycle, cursor, oldest) is None  # full
    # Group 0's oldest cycle is pushed: its envs go, with the actions they were held with.
    assert held.release(cycle, oldest) is None
    oldest[0] += 1
    released_ids, released_actions = held.release(cycle, oldest)
    np.testing.assert_array_equal(released_ids, [0, 1])
    np.testing.assert_array_equal(released_actions, [10, 21])
    assert held.release(cycle, oldest) is None
    # With two groups or fewer nothing is held: those batches never drift.
    none = _HoldBack(capacity=0, group_size=size, steps_per_cycle=steps)
    assert none.choose(ids, cycle, cursor, np.zeros(3, np.int64)) is None
