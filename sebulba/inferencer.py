"""Inferencer threads: each owns one env group and runs inference cycles on its device.

One cycle of a group with E envs and T = steps_per_cycle:

    initial = step_state
    for t in 0..T-1:   one compiled, donated call: agent.step + write step t into the
                       on-device trajectory buffer; then the action comes to the host
                       and the vector env steps
    finish:            write env step T (the bootstrap) into the buffer
    push (initial, final, trajectory), each split along the env axis over the
    learner devices, onto the global queue.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from sebulba import sharding
from sebulba.accounting import Accounting, StageClock
from sebulba.agent import Agent
from sebulba.channels import POLL_SECONDS, ErrorBox, QueueItem, Staging
from sebulba.envs import HostEnvStepper
from sebulba.types import ActorOutput, EnvStep, StepState, Trajectory


class _Buffer(NamedTuple):
    trajectory: Trajectory
    cursor: jax.Array  # int32 scalar: next time index to write


class ActingFunctions:
    """The compiled acting functions, shared by all env groups of a run."""

    def __init__(self, agent: Agent, steps_per_cycle: int):
        self.agent = agent
        self.steps_per_cycle = steps_per_cycle
        self.act = jax.jit(self._act, donate_argnums=(1, 3))
        self.finish = jax.jit(self._finish, donate_argnums=0)

    def _act(self, nets, step_state, env_step: EnvStep, buf: _Buffer):
        actor_output, step_state = self.agent.step(step_state, nets, env_step)
        t = buf.cursor

        def write(buffer_leaf, x):
            return jax.lax.dynamic_update_index_in_dim(buffer_leaf, x, t, axis=1)

        trajectory = Trajectory(
            env_steps=jax.tree.map(write, buf.trajectory.env_steps, env_step),
            actor_outputs=jax.tree.map(write, buf.trajectory.actor_outputs, actor_output),
        )
        return actor_output.action, step_state, _Buffer(trajectory, t + 1)

    def _finish(self, buf: _Buffer, env_step: EnvStep) -> _Buffer:
        env_steps = jax.tree.map(
            lambda b, x: jax.lax.dynamic_update_index_in_dim(b, x, self.steps_per_cycle, axis=1),
            buf.trajectory.env_steps,
            env_step,
        )
        return _Buffer(buf.trajectory._replace(env_steps=env_steps), jnp.zeros((), jnp.int32))

    def new_buffer(self, nets, step_state, env_step: EnvStep, device: jax.Device) -> _Buffer:
        """A zeroed trajectory buffer on `device`, shaped from one traced step."""
        out_shape, _ = jax.eval_shape(self.agent.step, step_state, nets, env_step)
        if not isinstance(out_shape, ActorOutput):
            raise TypeError(
                f"Agent.step must return (ActorOutput, StepState), got {type(out_shape)}"
            )
        t = self.steps_per_cycle

        def zeros(x, length):
            shape = (x.shape[0], length) + tuple(x.shape[1:])
            return np.zeros(shape, x.dtype)

        trajectory = Trajectory(
            env_steps=jax.tree.map(lambda x: zeros(x, t + 1), env_step),
            actor_outputs=jax.tree.map(lambda x: zeros(x, t), out_shape),
        )
        return jax.device_put(_Buffer(trajectory, np.zeros((), np.int32)), device)


class EnvGroupRunner:
    """The body of one inferencer thread."""

    def __init__(
        self,
        *,
        group: int,
        device: jax.Device,
        stepper: HostEnvStepper,
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
    ):
        self.group = group
        self.device = device
        self.stepper = stepper
        self.step_state = jax.device_put(step_state, device, may_alias=False)
        self.seed = seed
        self.acting = acting
        self.staging = staging
        self.learner_devices = learner_devices
        self.queue = out_queue
        self.drop_when_full = drop_when_full
        self.stop = stop
        self.errors = errors
        self.accounting = accounting
        self.partial_steps = 0  # env steps taken in the cycle not yet on the queue
        self.finished = False  # the thread left its loop without an error

    def __call__(self) -> None:
        try:
            self._run()
            self.finished = True
        except BaseException as e:  # noqa: BLE001 - every error must reach the caller
            self.errors.report(e)

    def _run(self) -> None:
        agent = self.acting.agent
        num_envs = self.stepper.num_envs
        clock = StageClock()
        env_step = self.stepper.reset(seed=self.seed)
        _, nets = self.staging.latest()
        buf = self.acting.new_buffer(nets, self.step_state, env_step, self.device)
        clock.lap("env_step")
        while not self.stop.is_set():
            version, nets = self.staging.latest()
            initial = agent.shard_step_state(self.step_state, self.learner_devices)
            clock.lap("shard")
            for _ in range(self.acting.steps_per_cycle):
                if self.stop.is_set():
                    return
                action, self.step_state, buf = self.acting.act(nets, self.step_state, env_step, buf)
                action = np.asarray(action)
                clock.lap("inference")
                env_step, ended = self.stepper.step(action)
                self.partial_steps += num_envs
                self.accounting.add_env_steps(num_envs, ended)
                clock.lap("env_step")
            buf = self.acting.finish(buf, env_step)
            final = agent.shard_step_state(self.step_state, self.learner_devices)
            trajectory = sharding.shard_env_axis(buf.trajectory, self.learner_devices)
            clock.lap("shard")
            item = QueueItem(self.group, version, initial, final, trajectory, self.partial_steps)
            if not self._put(item):
                return
            self.partial_steps = 0
            clock.lap("queue_put")
            clock.flush_into(self.accounting)

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
