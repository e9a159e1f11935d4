"""Inferencer threads: each drives one env source on one inference device.

An env source holds `num_groups` env groups of E envs. A gymnasium vector env is one
group, and `async_factor` such threads per device alternate on the GIL; EnvPool's source
holds a device's `async_factor` groups, which one thread drives in turn while the others'
envs step in C++ threads. A source whose envs step in order (both of those) returns a
whole group at each recv, and the thread keeps one cursor and one StepState per group:

    ids, env_step = source.recv()      # a group's E envs, in id order
    one compiled, donated call on the device: agent.step -> actions and extras
    (with several groups: the group before this one is sent its actions here)
    while the device computes: record the env step and the previous step's action
        into the group's current cycle (host memory, numpy; the extras stay on the
        device, stacked once the cycle ends), and push a cycle that ended: (initial,
        final, trajectory) sharded over the learner devices, after a tally of the
        episodes that ended since the last push (one pass over those rows)
    the actions to the host; source.send

A source whose recv returns any E of its envs (one asynchronous EnvPool,
"envpool_async") is driven by id: the acting call gathers and scatters the ids' StepState
rows and keeps a copy of those that start a cycle (a trajectory's initial StepState); each
env keeps its own cycle and cursor, so envs of a group need not step together: an env may
run up to `HOLD_AHEAD_CYCLES - 1` cycles ahead of its group's slowest, and is held back
there (`_HoldBack`) until that env's cycle is pushed; while no more envs can wait, it runs
on, up to `MAX_PENDING_CYCLES - 1` cycles ahead.

Only the action's transfer stands between the acting call and the env step; the rest of
the host's work overlaps the device's (JAX dispatches asynchronously). Trajectories are
built in host memory and go to the learner devices in one transfer per device per cycle;
the acting call carries only the step's data, not the trajectory (skipping all host
recording saved EnvPool's in-order loop at most 5%: benchmarks/HISTORY.md, "The acting
loops reordered around the action's transfer"; recording on the device instead costs
more: benchmarks/RESULTS.md, "Where the trajectory is assembled").
"""

from __future__ import annotations

import dataclasses
import functools
import queue
import threading
import time
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from sebulba.agent import Agent, check_actor_output, checked_step_state, strongly_typed
from sebulba.envs.base import EnvSource
from sebulba.envs.frame_stacks import FrameStack
from sebulba.envs.observations import host_dtype
from sebulba.envs.output_checks import BadEnvOutput
from sebulba.runtime import sharding, transfers
from sebulba.runtime.accounting import Accounting, StageClock
from sebulba.runtime.channels import POLL_SECONDS, ErrorBox, QueueItem, Staging
from sebulba.types import ActorOutput, EnvStep, StepState, Trajectory

# Cycles of one group open at once: the slowest env's and those of envs that ran ahead of
# it. An env about to open a cycle HOLD_AHEAD_CYCLES after its group's oldest open one is
# held back (`_HoldBack`) while there is room for it to wait; with none (the room is tight:
# the pool's envs less two batches) it runs on, and the run fails only where an env would
# open one MAX_PENDING_CYCLES after it, whose StepState rows would overwrite a snapshot
# still needed. Each snapshot slot is one StepState of the pool's envs on the device.
HOLD_AHEAD_CYCLES = 3
MAX_PENDING_CYCLES = 8
_SNAPSHOT_SLOTS = MAX_PENDING_CYCLES + 1  # a cycle's final StepState is the next's initial


@functools.partial(jax.tree_util.register_dataclass, data_fields=["stack"],
                   meta_fields=["spec"])
@dataclasses.dataclass(frozen=True)
class DeviceFrames:
    """The frame stacks an inference device keeps for its N envs where only each step's
    newest frames come from the host (`Config.stack_frames_on_device`): every env's last
    observation [N, frames x frame_size, ...], restacked by `spec` at each acting call."""

    stack: jax.Array
    spec: FrameStack


class ActorState(NamedTuple):
    """An inferencer's device state: the StepState of its N envs (leaves [N, ...]),
    copies of rows taken where a cycle starts (leaves [slots, N, ...]; None for a
    source whose envs step in order) and the envs' frame stacks (None unless only the
    newest frames are sent). PRNG keys are held as their raw data (`ActingFunctions`);
    the acting functions see typed keys."""

    step_state: StepState
    snapshots: StepState
    frames: DeviceFrames | None = None


def _restacked(frames: DeviceFrames | None, env_step: EnvStep, ids: jax.Array | None = None
               ) -> tuple[EnvStep, DeviceFrames | None]:
    """`env_step` with whole observations, restacked from its newest frames for envs `ids`
    (None: all, in order), and the frames kept; as they are without `frames`."""
    if frames is None:
        return env_step, None
    previous = frames.stack if ids is None else frames.stack[ids]
    obs = frames.spec.restack(previous, env_step.obs, env_step.first)
    stack = obs if ids is None else frames.stack.at[ids].set(obs)
    return env_step._replace(obs=obs), dataclasses.replace(frames, stack=stack)


def _is_shared(x) -> bool:
    return jnp.ndim(x) == 0  # a 0-d StepState leaf is shared by all envs


def _is_key(x) -> bool:
    return jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


class ActingFunctions:
    """The compiled acting functions, shared by all inferencer threads of a run.

    Their arguments are what makes a call cheap to dispatch, which an acting loop does
    once per env step: the networks as a flat tuple of leaves (`networks`, flattened
    once per published version; a nested dict of them costs about 10 us per call to
    flatten) and the state's PRNG keys as raw data (a typed key array is flattened and
    rebuilt in Python on every call). Inside, the agent sees its own pytrees.
    """

    def __init__(self, agent: Agent, steps_per_cycle: int):
        self.agent = agent
        self.steps_per_cycle = steps_per_cycle
        self._nets_def: jax.tree_util.PyTreeDef | None = None  # set by `networks`
        self._key_impls: list | None = None  # per StepState leaf; set by `new_state`
        # ActorOutput's structure, for the host's records of it (leaves): set when an
        # acting function is traced, so before any step is recorded.
        self.output_def: jax.tree_util.PyTreeDef | None = None
        self.act = jax.jit(self._act, donate_argnums=(1, 2))
        self.act_all = jax.jit(self._act_all, donate_argnums=(1, 2))
        self.snapshot = jax.jit(self._snapshot, donate_argnums=0)  # once a cycle starts
        self.take = jax.jit(self._take, static_argnums=(2, 3))
        self.stack_steps = jax.jit(_stack_steps)  # once a cycle ends (in-order sources)
        self.typed = jax.jit(self._typed)

    def networks(self, nets) -> tuple[jax.Array, ...]:
        """`nets` (as published) in the form the acting calls take: their leaves."""
        leaves, treedef = jax.tree.flatten(nets)
        if self._nets_def is None:
            self._nets_def = treedef
        elif treedef != self._nets_def:
            raise ValueError(f"published networks changed structure: {treedef} after "
                             f"{self._nets_def}")
        return tuple(leaves)

    def _typed(self, state: StepState) -> StepState:
        """A StepState whose keys are raw data (as an ActorState holds it), typed again."""
        leaves, treedef = jax.tree.flatten(state)
        return treedef.unflatten([
            x if impl is None else jax.random.wrap_key_data(x, impl=impl)
            for x, impl in zip(leaves, self._key_impls, strict=True)])

    @staticmethod
    def _raw(state: StepState) -> StepState:
        return jax.tree.map(lambda x: jax.random.key_data(x) if _is_key(x) else x, state)

    def _act(self, nets: tuple[jax.Array, ...], step_state: StepState,
             frames: DeviceFrames | None, ids: jax.Array, env_step: EnvStep
             ) -> tuple[ActorOutput, StepState, DeviceFrames | None]:
        """Acts for envs `ids` [E] of the N whose StepState rows `step_state` holds (and
        whose frame stacks `frames` holds, if `env_step` brings only the newest frames)."""
        step_state = self._typed(step_state)
        env_step, frames = _restacked(frames, env_step, ids)
        rows = jax.tree.map(lambda x: x if _is_shared(x) else x[ids], step_state)
        output, new_rows = self.agent.step(rows, self._nets_def.unflatten(nets), env_step)
        rows = checked_step_state(rows, new_rows)
        self._check_output(output, env_step)
        self.output_def = jax.tree.structure(output)
        return output, self._raw(jax.tree.map(
            lambda x, r: r if _is_shared(x) else x.at[ids].set(r), step_state, rows)), frames

    def _act_all(self, nets: tuple[jax.Array, ...], step_state: StepState,
                 frames: DeviceFrames | None, env_step: EnvStep
                 ) -> tuple[ActorOutput, StepState, DeviceFrames | None]:
        """`_act` for all N envs in order, as a vector env steps them: no row gathering."""
        step_state = self._typed(step_state)
        env_step, frames = _restacked(frames, env_step)
        output, new_state = self.agent.step(step_state, self._nets_def.unflatten(nets),
                                            env_step)
        self._check_output(output, env_step)
        self.output_def = jax.tree.structure(output)
        return output, self._raw(checked_step_state(step_state, new_state)), frames

    def _check_output(self, output: ActorOutput, env_step: EnvStep) -> None:
        """At trace time (once per compile): the ActorOutput `Agent.step` returned holds
        actions the env's action space takes and per-env extras, for the envs of
        `env_step` (`check_actor_output`; the loop checks it before a run too)."""
        check_actor_output(output, jnp.shape(env_step.reward)[0],
                           self.agent.env_spec.action_space)

    def _snapshot(self, snapshots: StepState, step_state: StepState, ids: jax.Array,
                  slots: jax.Array) -> StepState:
        """Copies the StepState rows of envs `ids` [E] to their `slots` [E] (where a cycle
        starts; slot `_SNAPSHOT_SLOTS` means no copy)."""
        rows = jax.tree.map(lambda x: x if _is_shared(x) else x[ids],
                            self._typed(step_state))

        def keep(buf, r):
            shared, r = _is_shared(r), jax.random.key_data(r) if _is_key(r) else r
            return (buf.at[slots].set(r, mode="drop") if shared
                    else buf.at[slots, ids].set(r, mode="drop"))

        return jax.tree.map(keep, snapshots, rows)

    def _take(self, snapshots: StepState, slot: jax.Array, group: int,
              size: int) -> StepState:
        """The StepState rows of `group`'s envs kept in `slot`: leaves [size, ...], with
        typed keys."""
        rows = jax.tree.map(lambda b: b[slot], snapshots)  # one slot: as a StepState
        return jax.tree.map(
            lambda x: x if _is_shared(x)
            else jax.lax.dynamic_slice_in_dim(x, group * size, size), self._typed(rows))

    def new_state(self, step_state: StepState, device: jax.Device, *,
                  snapshots: bool = True, frame_stack: FrameStack | None = None,
                  num_envs: int = 0) -> ActorState:
        """The state on `device`; without `snapshots` (a source whose envs step in order,
        whose cycle ends are taken from the step state itself) no snapshot slots; with a
        `frame_stack`, the frame stacks of `num_envs` envs (their first step refills
        them: `first` holds there)."""
        if self._key_impls is None:  # the same for every thread's StepState
            self._key_impls = [jax.random.key_impl(x) if _is_key(x) else None
                               for x in jax.tree.leaves(step_state)]
        raw = strongly_typed(self._raw(step_state))  # as the acting calls return it
        kept = None
        if snapshots:
            kept = jax.tree.map(
                lambda x: jnp.zeros((_SNAPSHOT_SLOTS,) + jnp.shape(x), x.dtype), raw)
        frames = None
        if frame_stack is not None:
            if num_envs < 1:
                raise ValueError(f"a frame stack needs the envs' number (num_envs >= 1), "
                                 f"got {num_envs!r}")
            space = self.agent.env_spec.observation_space
            frames = DeviceFrames(np.zeros((num_envs, *space.shape), host_dtype(space)),
                                  frame_stack)
        return jax.device_put(ActorState(raw, kept, frames), device, may_alias=False)


def _stack_steps(steps: list[list[jax.Array]]) -> list[jax.Array]:
    """T steps' lists of L leaves [E, ...] -> L leaves [E, T, ...]."""
    return [jnp.stack(leaf, axis=1) for leaf in zip(*steps, strict=True)]


class _Cycle:
    """One group's inference cycle being recorded in host memory."""

    def __init__(self, version: int, env_step: EnvStep, num_envs: int, steps: int):
        self.version = version  # learner updates of the oldest networks that acted in it
        self.env_steps = jax.tree.map(
            lambda x: np.zeros((num_envs, steps + 1) + x.shape[1:], x.dtype), env_step)
        self.outputs: list[np.ndarray] | None = None  # ActorOutput's leaves, once written
        # An in-order loop's extras, one list of leaves per step, on the device until the
        # cycle ends (`ActingFunctions.stack_steps`); a by-id loop writes them in `outputs`.
        self.device_extras: list[list[jax.Array]] = []
        self.steps = steps

    def write_env_step(self, rows: np.ndarray | None, t: np.ndarray | int,
                       env_step: EnvStep, mask: np.ndarray | None) -> None:
        """Rows `rows` (None: all, in order) at times `t` from `env_step`'s rows `mask`
        (None: all)."""
        for buf, x in zip(self.env_steps, env_step, strict=True):
            if rows is None:
                buf[:, t] = x
            else:
                buf[rows, t] = x if mask is None else x[mask]

    def write_output(self, rows: np.ndarray | None, t: np.ndarray | int,
                     output: list[np.ndarray], mask: np.ndarray | None) -> None:
        """`write_env_step` for an ActorOutput's leaves `output`."""
        if self.outputs is None:
            num_envs = self.env_steps.reward.shape[0]
            self.outputs = [np.zeros((num_envs, self.steps) + x.shape[1:], x.dtype)
                            for x in output]
        for buf, x in zip(self.outputs, output, strict=True):
            if rows is None:
                buf[:, t] = x
            else:
                buf[rows, t] = x if mask is None else x[mask]

    def trajectory(self, output_def: jax.tree_util.PyTreeDef) -> Trajectory:
        return Trajectory(self.env_steps, output_def.unflatten(self.outputs))


class _Slots(NamedTuple):
    """Where the envs of a batch from a by-id source write in their groups' cycles."""

    rows: np.ndarray  # [E] each env's row in its group
    t: np.ndarray  # [E] each env's cursor in its current cycle
    keys: np.ndarray  # [E] each env's (group, cycle) as group << 32 | cycle
    only: tuple[int, int] | None  # the (group, cycle) of all of them, if they share one

    @staticmethod
    def of(ids: np.ndarray, size: int, cycle: np.ndarray, t: np.ndarray) -> _Slots:
        """The slots of envs `ids` of groups of `size`, from each env's cycle (all envs)
        and these envs' cursors `t`."""
        groups = ids // size
        keys = (groups << 32) | cycle[ids]
        first = int(keys[0])
        only = divmod(first, 1 << 32) if (keys == first).all() else None
        return _Slots(ids - groups * size, t, keys, only)


class _HoldBack:
    """Envs of a by-id source kept from stepping because they ran too far ahead of the
    slowest env of their group: their actions are kept, and sent once that env's cycle
    is pushed.

    With three or more groups in one pool two batches step at once, and recv returns
    whichever envs finish first: an env's lead over the slowest of its group grows like a
    random walk, without bound (two groups keep their batches: one steps while the other
    is in inference). An env whose next step would open a cycle `HOLD_AHEAD_CYCLES`
    after its group's oldest open one waits instead. At most `capacity` envs wait, so
    that a recv always has a batch of envs stepping to return; while that many wait,
    others run on.
    """

    def __init__(self, capacity: int, group_size: int, steps_per_cycle: int):
        self.capacity = capacity
        self.group_size = group_size
        self.steps = steps_per_cycle
        self.ids = np.zeros(0, np.int64)
        self.actions: np.ndarray | None = None

    def choose(self, ids: np.ndarray, cycle: np.ndarray, cursor: np.ndarray,
               oldest: np.ndarray) -> np.ndarray | None:
        """Which envs of a batch to hold (a mask), or None for none; `cursor` counts
        their actions before this batch's. Decided before the actions' transfer, which
        the envs wait for."""
        room = self.capacity - len(self.ids)
        if room <= 0:
            return None
        last = cursor[ids] == self.steps - 1  # this action's step ends the env's cycle
        if not last.any():  # the usual case: one check a batch
            return None
        opens = cycle[ids] + 1 - oldest[ids // self.group_size]  # the cycle it would open
        hold = last & (opens >= HOLD_AHEAD_CYCLES)
        hold &= np.cumsum(hold) <= room
        return hold if hold.any() else None

    def split(self, ids: np.ndarray, actions: np.ndarray, hold: np.ndarray | None
              ) -> tuple[np.ndarray, np.ndarray]:
        """The (ids, actions) to send now; those of `hold` (from `choose`) are kept."""
        if hold is None:
            return ids, actions
        self.ids = np.concatenate([self.ids, ids[hold]])
        self.actions = (actions[hold] if self.actions is None
                        else np.concatenate([self.actions, actions[hold]]))
        return ids[~hold], actions[~hold]

    def release(self, cycle: np.ndarray, oldest: np.ndarray
                ) -> tuple[np.ndarray, np.ndarray] | None:
        """The (ids, actions) of held envs whose group has caught up, no longer held."""
        if not len(self.ids):
            return None
        free = cycle[self.ids] + 1 - oldest[self.ids // self.group_size] < HOLD_AHEAD_CYCLES
        if not free.any():
            return None
        out = self.ids[free], self.actions[free]
        self.ids, self.actions = self.ids[~free], self.actions[~free]
        return out


OBS = "acting: observations to device"  # with the ids of a by-id source's batch


def fetch_polling(x: jax.Array, poll_s: float) -> np.ndarray:
    """np.asarray(x) of an acting call's output, polling for up to `poll_s` before
    sleeping on it (`Config.action_poll_s`: a sleeping thread wakes late). The benchmarks'
    calibrations fetch this way too, so that their bounds are what the loop could reach."""
    if poll_s and not x.is_ready():
        deadline = time.perf_counter() + poll_s
        while not x.is_ready() and time.perf_counter() < deadline:
            pass
    return transfers.to_host(x, "acting: actions to host")


def copies_early_to_host(device: jax.Device) -> bool:
    """Whether an acting call's outputs on `device` start their copies to the host as soon
    as the call is dispatched: on an accelerator each fetch is a round trip, and the
    action and the extras then arrive in one (on the CPU they are host memory already)."""
    return device.platform != "cpu"


def frame_stack_sent(source: EnvSource, space, device: jax.Device,
                     on: bool | None) -> FrameStack | None:
    """The frame stack whose newest frames alone go to `device` (which keeps the stacks),
    or None. `on` is `Config.stack_frames_on_device`: True takes `source.frame_stack`
    (ValueError if it has none), None takes it on an accelerator only, whose copy in
    grows with the observations' bytes (on the CPU it is a memcpy, 0.8 ms of a Nature
    CNN call of 110 ms at 256 envs of Atari stacks, and the call took as long either
    way), False never."""
    spec = getattr(source, "frame_stack", None)
    if on and spec is None:
        raise ValueError(
            f"stack_frames_on_device=True needs a source that declares its observations' "
            f"frame stack (frame_stack), and {type(source).__name__} (observations {space}) "
            "declares none; the shipped ones that do: 'envpool' and 'envpool_async' with an "
            "Atari task of stack_num > 1 without episodic_life (whose stack goes on across "
            "a life lost), and 'vector_entry_point' with ale-py's Atari vector env")
    if spec is None or on is False or (on is None and not copies_early_to_host(device)):
        return None
    spec.check_space(space)
    return spec


def start_host_copies(output: ActorOutput | jax.Array) -> None:
    transfers.start_to_host(jax.tree.leaves(output))


def _host_output(action: np.ndarray, output: ActorOutput) -> list[np.ndarray]:
    """A sent step's outputs on the host, as ActorOutput's leaves: its action (fetched to
    send it) and its extras, fetched now (ready since the step's call). Leaves, not a
    pytree: jax.tree.map costs several microseconds a step."""
    extras = jax.tree.leaves(output.extras)
    return [action, *transfers.to_host_all(extras, "acting: extras to host")] if extras \
        else [action]


def _write_outputs(record: _Cycle, t: int, action: np.ndarray, output: ActorOutput) -> None:
    """Records a step of an in-order source's group (all its envs, in order): the action,
    fetched to send it, and the extras, kept on the device until the cycle ends."""
    record.write_output(None, t, [action], None)
    record.device_extras.append(jax.tree.leaves(output.extras))


class EnvGroupRunner:
    """The body of one inferencer thread: one env source, its groups' cycles."""

    def __init__(
        self,
        *,
        first_group: int,
        device: jax.Device,
        source: EnvSource,
        step_state: StepState,
        seed: int,
        acting: ActingFunctions,
        staging: Staging,
        learner_devices: Sequence[jax.Device],
        out_queue: queue.Queue,
        drop_when_full: bool,
        stop: threading.Event,
        errors: ErrorBox,
        accounting: Accounting,
        lockstep: tuple[int, int] | None = None,
        action_poll_s: float = 0.0,
        transfer_guard: bool = False,
        stack_frames_on_device: bool | None = None,
    ):
        """`lockstep` = (learner updates at the run's start, trajectories per update):
        cycle c acts only with the networks of update start + c // K, learnt from every
        trajectory before it (`Config.lockstep`; one group, in-order sources only).
        `action_poll_s`: `Config.action_poll_s`; `transfer_guard`: `Config.transfer_guard`;
        `stack_frames_on_device`: `Config.stack_frames_on_device`."""
        if lockstep is not None and not source.in_order:
            raise ValueError("lockstep needs a source whose envs step in order")
        self.first_group = first_group
        self.device = device
        self.source = source
        self.frame_stack = frame_stack_sent(source, acting.agent.env_spec.observation_space,
                                            device, stack_frames_on_device)
        if source.in_order:  # one state per group: its envs act together, all of them
            size = source.group_size
            self.group_states = [
                acting.new_state(sharding.slice_env_axis(step_state, g * size, size), device,
                                 snapshots=False, frame_stack=self.frame_stack,
                                 num_envs=size)
                for g in range(source.num_groups)]
        else:  # one state for all: a batch may hold any of the envs
            self.state = acting.new_state(step_state, device, frame_stack=self.frame_stack,
                                          num_envs=source.num_envs)
        self.seed = seed
        self.acting = acting
        self.staging = staging
        self.learner_devices = learner_devices
        self.queue = out_queue
        self.drop_when_full = drop_when_full
        self.stop = stop
        self.errors = errors
        self.accounting = accounting
        self.lockstep = lockstep
        self.action_poll_s = action_poll_s
        self.transfer_guard = transfer_guard
        self._nets = (None, ())  # the staging area's latest networks, and their leaves
        self.copies_early = copies_early_to_host(device)
        self.partial_steps = 0  # env steps taken in cycles not yet on the queue
        # Cycles each group pushed with its frames checked: which env the next check reads.
        self._frame_checks = np.zeros(source.num_groups, np.int64)
        self._padded = 0  # a multi-agent source's padding steps, accounted so far
        self.finished = False  # the thread left its loop without an error

    @property
    def name(self) -> str:
        last = self.first_group + self.source.num_groups - 1
        groups = f"{self.first_group}" if last == self.first_group else \
            f"{self.first_group}-{last}"
        return f"sebulba-inferencer-{groups}"

    def __call__(self) -> None:
        try:
            self._run()
            self.finished = True
        except BaseException as e:  # noqa: BLE001 - every error must reach the caller
            self.errors.report(e)

    def _run(self) -> None:
        with transfers.guarded(f"{self.name}'s acting loop", self.transfer_guard):
            if self.source.in_order:
                self._run_in_order()
            else:
                self._run_by_id()

    def _run_in_order(self) -> None:
        """A source whose recv returns a whole group, every env in id order (a vector
        env, or EnvPool's groups, which take turns): one cursor per group.

        Each group's step comes in two halves (`_group_steps`): up to its acting call and
        the host work that overlaps it, then the action's fetch and send. With several
        groups they interleave as a pipelined recv/send loop does: group j is received and
        its acting call dispatched before group i, the one before it, is sent its
        actions, so the device computes one group's actions while another's envs step.
        """
        self.source.reset(seed=self.seed)
        clock = StageClock()
        groups = [self._group_steps(g, state, clock)
                  for g, state in enumerate(self.group_states)]
        self.group_states = []  # the generators hold each group's state from here on
        if not next(groups[0], False):
            return
        i = 0
        while not self.stop.is_set():
            j = i + 1 if i + 1 < len(groups) else 0
            # With one group j is i: its halves simply alternate.
            if not (next(groups[j], False) and next(groups[i], False)):
                break
            i = j
        self._add_episodes()  # the last cycles'

    def _group_steps(self, g: int, state: ActorState, clock: StageClock
                     ) -> Iterator[bool]:
        """Group g of an in-order source, half an env step per `next` (True): recv to
        the acting call's dispatch and the work that overlaps it; the action's fetch and
        send. Exhausted once a push finds the run stopped.

        Between one env step and the next only: recv, dispatch the acting call, fetch the
        action, send. The rest runs while the device computes (JAX dispatches
        asynchronously): writing the env step and the previous step's action into the
        cycle's host buffers, and pushing a finished cycle. The extras stay on the device
        until their cycle ends, then come to the host stacked, in one transfer.
        A cycle's final StepState is the one its bootstrap step starts from, sharded once
        and reused as the next cycle's initial StepState.
        """
        source, steps, agent = self.source, self.acting.steps_per_cycle, self.acting.agent
        device, learner_devices = self.device, self.learner_devices
        step_state, frames = state.step_state, state.frames
        initial = agent.shard_step_state(self.acting.typed(step_state), learner_devices)
        record: _Cycle | None = None
        unwritten = None  # (cycle, t, action, output) of the last step, not yet recorded
        t = c = 0  # the cursor in cycle c
        while True:
            ids, env_step, new_steps = source.recv()
            self.partial_steps += new_steps
            self.accounting.add_env_steps(new_steps)
            clock.lap("env_step")
            ending = None  # a cycle that ended at this step, pushed once it is recorded
            if t == steps:  # entry T of cycle c: it ends here, and c + 1 starts from here
                record.write_env_step(None, steps, env_step, None)
                final = agent.shard_step_state(self.acting.typed(step_state), learner_devices)
                ending, record, t, c = record, None, 0, c + 1
                if self._push_before_acting():
                    _write_outputs(*unwritten)
                    unwritten = None
                    if not self._push(g, ending, initial, final, clock):
                        return
                    clock.flush_into(self.accounting)
                    initial, ending = final, None
            if record is None:  # a cycle starts with the latest networks
                if self.lockstep is not None:
                    if not self._wait_for_networks(c):
                        return
                    clock.lap("wait_for_networks")
                version, nets = self._latest_networks()
                record = _Cycle(version, env_step, source.group_size, steps)
            clock.lap("record")  # a cycle's end and start: the dispatch is timed alone
            output, step_state, frames = self.acting.act_all(
                nets, step_state, frames, transfers.to_device(self._sent(env_step), device, OBS))
            if self.copies_early:
                start_host_copies(output.action)  # the extras stay until the cycle ends
            clock.lap("dispatch")
            # While the device computes:
            record.write_env_step(None, t, env_step, None)
            if unwritten is not None:
                _write_outputs(*unwritten)
            clock.lap("record")
            if ending is not None:
                if not self._push(g, ending, initial, final, clock):
                    return
                clock.flush_into(self.accounting)
                initial = final
            yield True
            # The one transfer before the env steps.
            action = fetch_polling(output.action, self.action_poll_s)
            clock.lap("inference")
            source.send(action, ids)
            clock.lap("env_step")
            unwritten = (record, t, action, output)
            t += 1
            yield True

    def _sent(self, env_step: EnvStep) -> EnvStep:
        """What of `env_step` goes to the device: all of it, or only each observation's
        newest frame where the device keeps the frame stacks."""
        if self.frame_stack is None:
            return env_step
        return env_step._replace(obs=self.frame_stack.newest(env_step.obs))

    def _push_before_acting(self) -> bool:
        """Whether a finished cycle goes on the queue before the next cycle's first acting
        call rather than while it computes: where the push may wait (a full queue that
        applies backpressure), so that the next cycle acts with the networks published
        meanwhile, and in lockstep, whose next networks learn from this cycle."""
        return self.lockstep is not None or (not self.drop_when_full and self.queue.full())

    def _latest_networks(self) -> tuple[int, tuple[jax.Array, ...]]:
        """The staging area's latest (version, networks), networks as the acting calls
        take them (flattened once per published networks)."""
        version, nets = self.staging.latest()
        if nets is not self._nets[0]:
            self._nets = (nets, self.acting.networks(nets))
        return version, self._nets[1]

    def _wait_for_networks(self, cycle: int) -> bool:
        """Lockstep: waits until the networks cycle `cycle` acts with are published;
        False if the run stopped first."""
        start, per_update = self.lockstep
        wanted = start + cycle // per_update
        while self.staging.latest()[0] < wanted:
            if self.stop.wait(0.0005):  # an update takes far longer than this poll
                return False
        return True

    def _run_by_id(self) -> None:
        """A source whose recv returns any E of its envs ("envpool_async"): per-env
        cycles."""
        source, steps, device = self.source, self.acting.steps_per_cycle, self.device
        size, num_groups = source.group_size, source.num_groups
        cycle = np.zeros(source.num_envs, np.int64)  # each env's current cycle
        cursor = np.zeros(source.num_envs, np.int64)  # actions it took in that cycle
        open_cycles: dict[tuple[int, int], _Cycle] = {}
        oldest = np.zeros(num_groups, np.int64)  # each group's oldest cycle not yet pushed
        initial: dict[int, StepState] = {}  # group -> its next trajectory's sharded initial
        clock = StageClock()
        source.reset(seed=self.seed)
        version, nets = self._latest_networks()  # refreshed where a cycle starts
        # Pipelining holds one batch back from the source: with one group nothing would
        # be left stepping, and recv would wait forever.
        pipelined = num_groups > 1
        # Envs that may wait for their group with a batch still stepping for recv: all but
        # the batch just received and the one sent (none with fewer than three groups).
        held = _HoldBack(max(0, source.num_envs - 2 * size), size, steps)
        pending = None  # a batch whose actions are being computed, not yet sent
        while not self.stop.is_set():
            ids, env_step, new_steps = source.recv()
            self.partial_steps += new_steps
            self.accounting.add_env_steps(new_steps)
            clock.lap("env_step")
            if pending is not None:  # its actions were computed while this batch stepped
                sent = self._send(pending, clock, held, cycle, cursor, oldest)
            env_cursor = cursor[ids]
            bootstrap = env_cursor == steps
            if bootstrap.any():  # entry T of their cycle, and entry 0 of the next
                self._record_env_steps(open_cycles, ids,
                                       _Slots.of(ids, size, cycle, env_cursor), env_step,
                                       bootstrap, version)
                done = ids[bootstrap]
                cycle[done] += 1
                cursor[done] = 0
                env_cursor = cursor[ids]
            ids32, on_device = transfers.to_device((ids.astype(np.int32), self._sent(env_step)),
                                                   device, OBS)
            starts = env_cursor == 0
            if starts.any():  # keep the StepState rows a trajectory starts from
                kept_in = np.where(starts, cycle[ids] % _SNAPSHOT_SLOTS, _SNAPSHOT_SLOTS)
                self.state = self.state._replace(snapshots=self.acting.snapshot(
                    self.state.snapshots, self.state.step_state, ids32,
                    transfers.to_device(kept_in.astype(np.int32), device,
                                        "acting: snapshot slots to device")))
                complete = [g for g in np.unique(ids[bootstrap] // size).tolist()
                            if cycle[g * size:(g + 1) * size].min() > oldest[g]]
                for g in complete:
                    # Push before acting, so that the next cycle acts with the networks
                    # published while the push waited for room in the queue.
                    c = oldest[g]
                    if not self._push_snapshots(g, open_cycles.pop((g, c)), c, initial,
                                                clock):
                        # stopping: this batch's env steps are counted, so its episodes
                        self.accounting.add_episodes(source.pop_episodes())
                        return
                    oldest[g] += 1
                if complete:
                    released = held.release(cycle, oldest)
                    if released is not None:
                        source.send(released[1], released[0])
                    clock.flush_into(self.accounting)
                version, nets = self._latest_networks()  # a cycle starts with the latest
            output = self._dispatch(nets, ids32, on_device, clock)
            # While the device computes (JAX dispatches asynchronously) and the envs of
            # the batch sent above step: tally the episodes that ended, write this
            # batch's env steps and the sent batch's outputs (pipelined; its envs are not
            # in this batch).
            self.accounting.add_episodes(source.pop_episodes())
            slots = _Slots.of(ids, size, cycle, env_cursor)  # where this batch's rows go
            self._record_env_steps(open_cycles, ids, slots, env_step, None, version, oldest)
            if pending is not None:
                self._record_sent(pending, sent, open_cycles, cursor)
            pending = (ids, slots, output)
            if not pipelined:
                self._record_sent(pending, self._send(pending, clock, held, cycle, cursor,
                                                      oldest), open_cycles, cursor)
                pending = None
            clock.lap("record")

    def _dispatch(self, nets, ids32: jax.Array, env_step, clock: StageClock) -> ActorOutput:
        """Starts the acting call for a batch of envs `ids32` (by id) and the copy of its
        outputs to the host; the batch's bookkeeping before it is timed as record."""
        clock.lap("record")
        output, step_state, frames = self.acting.act(nets, self.state.step_state,
                                                     self.state.frames, ids32, env_step)
        self.state = self.state._replace(step_state=step_state, frames=frames)
        if self.copies_early:
            start_host_copies(output)
        clock.lap("dispatch")
        return output

    def _send(self, batch, clock: StageClock, held: _HoldBack, cycle: np.ndarray,
              cursor: np.ndarray, oldest: np.ndarray) -> np.ndarray:
        """Fetches a batch's actions (the envs wait for this transfer only) and sends
        those of the envs `held` does not keep back; returns them all."""
        ids, _, output = batch
        hold = held.choose(ids, cycle, cursor, oldest)
        action = fetch_polling(output.action, self.action_poll_s)
        clock.lap("inference")
        send_ids, send_actions = held.split(ids, action, hold)
        if len(send_ids):
            self.source.send(send_actions, send_ids)
        clock.lap("env_step")
        return action

    @staticmethod
    def _record_sent(batch, action: np.ndarray, open_cycles, cursor) -> None:
        """Records a sent batch's actions and extras (fetched now) and moves its cursors.
        Its slots still hold: its envs have not stepped since (they were not sent)."""
        ids, slots, output = batch
        output = _host_output(action, output)
        if slots.only is not None:  # the usual case: one group's envs in one cycle
            open_cycles[slots.only].write_output(slots.rows, slots.t, output, None)
        else:
            for key in np.unique(slots.keys).tolist():
                sel = slots.keys == key
                open_cycles[divmod(key, 1 << 32)].write_output(
                    slots.rows[sel], slots.t[sel], output, sel)
        cursor[ids] += 1

    def _record_env_steps(self, open_cycles, ids, slots: _Slots, env_step, mask, version,
                          oldest=None) -> None:
        """Writes the env step rows `mask` (None: all) into each env's current cycle at
        its cursor, opening the cycles that start here."""
        if mask is None and slots.only is not None and slots.only in open_cycles:
            # The usual case: one group's envs (EnvPool returns the envs that were sent
            # together), all in one open cycle: no sorting into cycles, no masks.
            open_cycles[slots.only].write_env_step(slots.rows, slots.t, env_step, None)
            return
        size = self.source.group_size
        keys = slots.keys if mask is None else slots.keys[mask]
        for key in np.unique(keys).tolist():
            g, c = divmod(key, 1 << 32)
            record = open_cycles.get((g, c))
            if record is None:
                if oldest is not None and c - oldest[g] >= MAX_PENDING_CYCLES:
                    raise RuntimeError(
                        f"an env of group {self.first_group + g} is {MAX_PENDING_CYCLES} "
                        "cycles ahead of the slowest env of its group, and no more envs "
                        "can wait for theirs (a batch of envs must keep stepping): its "
                        "envs' step times differ too much for cycles this short; longer "
                        "cycles (steps_per_cycle) or more env groups per pool "
                        "(async_factor) give them more room")
                record = open_cycles[(g, c)] = _Cycle(version, env_step, size,
                                                      self.acting.steps_per_cycle)
            sel = slots.keys == key
            if mask is not None:
                sel &= mask
            record.write_env_step(slots.rows[sel], slots.t[sel], env_step, sel)

    def _push_snapshots(self, g: int, record: _Cycle, c: int,
                        initial: dict[int, StepState], clock: StageClock) -> bool:
        """`_push` of group g's cycle c, its StepStates taken from the snapshots."""
        agent, size, devices = self.acting.agent, self.source.group_size, self.learner_devices
        snapshots = self.state.snapshots
        if g not in initial:
            first = self.acting.take(snapshots, self._slot(c), g, size)
            initial[g] = agent.shard_step_state(first, devices)
        last = self.acting.take(snapshots, self._slot(c + 1), g, size)
        final = agent.shard_step_state(last, devices)
        pushed = self._push(g, record, initial[g], final, clock)
        initial[g] = final  # the next cycle starts where this one ended
        return pushed

    def _slot(self, cycle: int) -> jax.Array:
        """The snapshot slot of cycle `cycle`'s first StepState, for `ActingFunctions.take`."""
        return transfers.to_device(np.int32(cycle % _SNAPSHOT_SLOTS), self.device,
                                   "cycle: snapshot slot to device")

    def _push(self, g: int, record: _Cycle, initial: StepState, final: StepState,
              clock: StageClock) -> bool:
        """Puts group g's recorded cycle on the queue; False if the run stopped first.
        Counts the episodes that ended since the last push, of every group of the source
        (the in-order loop asks for them nowhere else while it runs)."""
        self._add_episodes()
        if self.frame_stack is not None:
            self._check_frames(g, record)
        if record.device_extras and record.device_extras[0]:  # an in-order loop's
            stacked = self.acting.stack_steps(record.device_extras)  # one call, [E, T, ...]
            record.outputs += transfers.to_host_all(stacked, "cycle: extras to host")
            record.device_extras = []
        transfers.count("cycle: trajectory to learner devices")
        trajectory = sharding.shard_host_env_axis(record.trajectory(self.acting.output_def),
                                                  self.learner_devices)
        num_steps = self.source.group_size * self.acting.steps_per_cycle
        item = QueueItem(self.first_group + g, record.version, initial, final, trajectory,
                         num_steps)
        clock.lap("shard")
        if not self._put(item):
            return False
        self.partial_steps -= num_steps
        clock.lap("queue_put")
        return True

    def _add_episodes(self) -> None:
        """Counts the episodes that ended since the last call, and a multi-agent source's
        env episodes and padding steps with them, so that both are stamped alike."""
        self.accounting.add_episodes(self.source.pop_episodes())
        teams = getattr(self.source, "pop_team_episodes", None)  # a multi-agent source
        if teams is not None:
            padding = self.source.padding_steps
            self.accounting.add_team_episodes(padding - self._padded, teams())
            self._padded = padding

    def _check_frames(self, g: int, record: _Cycle) -> None:
        """BadEnvOutput unless one env's observations in group g's cycle `record` (the
        group's envs in turn, one a cycle) keep the source's frame stack: the device restacks each
        step's newest frame by that rule, so a source that broke it would have the agent
        act on observations other than those its trajectory holds. One env's T frames a
        cycle: a small share of what the cycle copies."""
        env = int(self._frame_checks[g] % self.source.group_size)
        self._frame_checks[g] += 1
        found = self.frame_stack.mismatch(record.env_steps.obs[env],
                                          record.env_steps.first[env])
        if found is not None:
            t, problem = found
            place = f"env {env} of group {self.first_group + g}"
            raise BadEnvOutput(
                f"{place} ({type(self.source).__name__}): its observation at step {t} of a "
                f"cycle does not follow the one before as its source's frame_stack, "
                f"{self.frame_stack}, says ({problem}), so the stacks the inference device "
                "restacks from each newest frame differ from the env's; run with "
                "stack_frames_on_device=False", place=place, step=t, field="obs")

    def _put(self, item: QueueItem) -> bool:
        """Puts `item` on the queue; False if the run stopped first."""
        while not self.stop.is_set():
            if self.drop_when_full:
                try:
                    self.queue.put_nowait(item)
                    return True
                except queue.Full:
                    try:
                        oldest = self.queue.get_nowait()
                        self.accounting.add_dropped(oldest.num_env_steps)
                    except queue.Empty:
                        pass
            else:
                try:
                    self.queue.put(item, timeout=POLL_SECONDS)
                    return True
                except queue.Full:
                    pass
        return False

