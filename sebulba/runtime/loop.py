"""The Sebulba loop: inferencer threads feeding a learner on the main thread."""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
import warnings
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from sebulba.agent import (
    Agent,
    Layout,
    check_actor_output,
    check_sharded_step_state,
    check_step_state_rows,
    strongly_typed,
)
from sebulba.config import Config
from sebulba.envs import registry
from sebulba.envs.async_workers import CLOSE_TIMEOUT_S
from sebulba.envs.base import EnvSource, close_quietly, example_env_step
from sebulba.evaluation import check_greedy
from sebulba.runtime import memory, sharding, transfers
from sebulba.runtime.accounting import Accounting, RunResult
from sebulba.runtime.channels import POLL_SECONDS, ErrorBox, QueueItem, Staging
from sebulba.runtime.evaluator import Evaluation, Evaluator
from sebulba.runtime.inferencer import ActingFunctions, EnvGroupRunner
from sebulba.runtime.learner import Learner
from sebulba.runtime.watchdog import EnvStall, ProgressWatchdog
from sebulba.types import AgentState, Nets, PyTree, Trajectory

# What tracing a hook with `jax.eval_shape` raises where its result depends on values, not
# only on shapes: such an agent is checked and sized where its functions first compile.
VALUE_DEPENDENT = (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError)


@dataclasses.dataclass(frozen=True)
class UpdateInfo:
    """What `on_update` callbacks see after each learner iteration.

    Attributes:
      version: learner updates so far (each on `trajectories_per_update` trajectories;
        the unit of policy lag).
      metrics: the learner's metrics of the previous update (name -> float; fetched one
        update late so the learner never waits for the device; empty at first): the
        agent's, averaged over the learner devices, and `loss`. An agent that overrides
        `Agent.ready_to_learn` (a warm-up) also gets `learning`: 1.0 where the update
        took its optimizer steps, 0.0 where `ready_to_learn` held it back (and then
        every other metric is 0).
      nets: what was just published to the actors, `Agent.acting_nets` of the networks
        (first local learner replica, on device).
      accounting: the run's live `runtime.accounting.Accounting` of this process (env
        steps, consumed, episodes, stage seconds, ...): read it, don't change it.
      evaluations: the evaluations during training (`Config.eval_every_updates`) that
        finished since the last call (`sebulba.runtime.evaluator.Evaluation`).

    `learner_state()` and `actor_state()` copy what a checkpoint needs, until the next
    update starts (within `on_update`, or after the run for its last update, as a save at
    the end does): the next update donates the learner's buffers and moves the actors'
    cut on, so a kept UpdateInfo refuses them from then on.
    """

    version: int
    metrics: dict[str, float]
    nets: Nets
    accounting: Accounting
    _learner: _LearnerSnapshot
    evaluations: tuple[Evaluation, ...] = ()

    def learner_state(self) -> tuple[Nets, PyTree, PyTree]:
        """(nets, opt, local experience [num_local_learners, ...]) copied off the
        learner now, e.g. for a checkpoint; costs a copy, so call it only when needed, and
        within `on_update` (the next update reuses these buffers). First waits for this
        update's finiteness check (`Config.check_finite`), which raises before a NaN state
        is copied out, rather than at the next update."""
        snap = self._learner
        self._check_current("learner_state")
        snap.check()
        return (sharding.first_replica(snap.nets), sharding.first_replica(snap.opt),
                sharding.local_entries(snap.experience))

    def actor_state(self) -> PyTree:
        """The StepState of this process's envs (leaves [envs, ...]) that goes with
        `learner_state()`: each group's as it was at the end of the last trajectory the
        learner has learnt from (trajectories acted since are not in the learner state).
        With both, a run resumes where the learner stands (`Sebulba.run`'s `state` and
        `learner_updates`)."""
        self._check_current("actor_state")
        return self._learner.cut.step_state()

    def _check_current(self, method: str) -> None:
        if not self._learner.current[0]:
            raise RuntimeError(
                f"UpdateInfo.{method}() of update {self.version} was called after a later "
                "update started: the learner has reused its buffers and the actors' cut "
                "has moved on; copy the state within the on_update call that received it")


class _LearnerSnapshot(NamedTuple):
    nets: PyTree
    opt: PyTree
    experience: PyTree
    cut: _ConsumedCut
    check: Callable[[], None]  # the learner's pending finiteness check
    current: list[bool]  # [True] until the next update starts


class _ConsumedCut:
    """Per env group, the StepState at the end of the last trajectory the learner took:
    the actors' half of a consistent learner state (trajectories in flight and queued
    are not learnt from yet; a run resumed from this state acts them again)."""

    def __init__(self, initial: PyTree, num_groups: int, rows_per_group: int):
        self.initial = [sharding.slice_env_axis(initial, g * rows_per_group, rows_per_group)
                        for g in range(num_groups)]
        self.final: dict[int, PyTree] = {}  # group -> as the learner got it (sharded)

    def consumed(self, item: QueueItem) -> None:
        self.final[item.group] = item.final_step_state

    def step_state(self) -> PyTree:
        # On the initial state's device whichever groups were consumed: one placement,
        # so one compiled concatenation for every run of the loop (a restored state may
        # be NumPy arrays: the first local device then).
        leaves = jax.tree.leaves(self.initial)
        if not leaves:  # a stateless agent's StepState: nothing to place or join
            return self.initial[0]
        first = leaves[0]
        device = first.device if isinstance(first, jax.Array) else jax.local_devices()[0]
        return _concat_env_axis([
            sharding.unshard_env_axis(self.final[g]) if g in self.final else initial
            for g, initial in enumerate(self.initial)], device)


@dataclasses.dataclass
class _Run:
    """One call of `Sebulba.run`: its channels, threads and progress."""

    halt: threading.Event  # tells the inferencer threads to end
    errors: ErrorBox
    accounting: Accounting
    trajectories: queue.Queue[QueueItem]
    stagings: dict[jax.Device, Staging]
    cut: _ConsumedCut
    watchdog: ProgressWatchdog | None = None
    stall: EnvStall | None = None
    runners: list[EnvGroupRunner] = dataclasses.field(default_factory=list)
    threads: list[threading.Thread] = dataclasses.field(default_factory=list)
    popped: list[QueueItem] = dataclasses.field(default_factory=list)  # not learnt from yet
    evaluator: Evaluator | None = None
    evaluations: list[Evaluation] = dataclasses.field(default_factory=list)
    stopped_early: bool = False
    stop_seen: bool = False  # by the learner, also in its last update (on_stop then)
    start: float = dataclasses.field(default_factory=time.perf_counter)
    wall: float = 0.0
    timed_env_steps: int | None = None  # the env steps within `wall`


class Sebulba:
    """Runs an agent: `async_factor` env groups per inference device, one learner.

    Construction checks the configuration against the env and the agent and compiles
    nothing; `run` may be called several times and reuses what it compiled.
    """

    def __init__(self, agent: Agent, config: Config):
        self.agent = agent
        self.config = config
        self.inference_devices = config.resolved_inference_devices()
        self.local_learner_devices = config.resolved_local_learner_devices()
        self.learner_devices = config.resolved_global_learner_devices()  # the learner mesh
        self.process_index, self.num_processes = jax.process_index(), jax.process_count()
        spec = config.env_spec()
        if agent.env_spec != spec:
            raise ValueError(
                f"the agent was built for {agent.env_spec}, but env {config.env!r} has {spec}"
            )
        if config.eval_every_updates:
            check_greedy(agent, config.eval_greedy, "eval_greedy")
        if config.drop_when_full and agent.needs_consecutive_trajectories:
            raise ValueError(
                f"{type(agent).__name__} joins each env's consecutive trajectories into "
                "sequences, so it needs every trajectory: with drop_when_full a dropped one "
                "would join its neighbours into a sequence that never happened; use "
                "drop_when_full=False (the learner then applies backpressure)")
        # A row is one acting stream: one env, or one agent of a multi-agent env.
        self.rows_per_group = config.envs_per_group * spec.agents_per_env
        self.layout = Layout(
            envs_per_group=self.rows_per_group,
            agents_per_env=spec.agents_per_env,
            num_groups=config.num_groups,
            steps_per_cycle=config.steps_per_cycle,
            num_learner_devices=len(self.local_learner_devices),
            num_processes=self.num_processes,
            trajectories_per_update=config.trajectories_per_update,
        )
        self._memory_checked = False
        self._agent_checked = False  # `_check_agent`'s, once
        self._info_current: list[bool] = [False]  # the last UpdateInfo's (`_expire_info`)
        self._experience_shape: PyTree | None = None  # `_check_experience`'s, traced once
        self.acting = ActingFunctions(agent, config.steps_per_cycle)
        self.learner = Learner(agent, self.learner_devices, self.layout,
                               check_finite=config.check_finite)

    def initial_state(self) -> AgentState:
        """The agent's initial state; nets, optimizer and experience are the same in every
        process, the step state (this process's envs) differs between processes."""
        self._check_agent()
        self.check_memory()
        net_key, state_key = jax.random.split(jax.random.key(self.config.seed))
        nets = self.agent.new_networks(net_key)
        state = self.agent.new_state(nets, state_key, self.layout)
        check_step_state_rows(self.agent, state.step_state, self.layout.total_envs)
        if self.num_processes > 1:
            # This process's rows of the step state one process with every env would
            # start from (Agent.new_state's step key), so that the run's envs act alike
            # however many processes share them.
            step_key = jax.random.split(state_key, 3)[2]
            n = self.layout.total_envs
            every = self.agent.new_step_state(nets, step_key, n * self.num_processes)
            check_step_state_rows(self.agent, every, n * self.num_processes)
            state = state._replace(
                step_state=sharding.slice_env_axis(every, self.process_index * n, n))
        return state

    def run(
        self,
        total_env_steps: int,
        state: AgentState | None = None,
        *,
        learn: bool = True,
        on_update: Callable[[UpdateInfo], None] | None = None,
        local_experience: PyTree | None = None,
        stop: threading.Event | None = None,
        on_stop: Callable[[], None] | None = None,
        progress_timeout_s: float | None = 600.0,
        learner_updates: int = 0,
    ) -> RunResult:
        """Acts and learns until the learner has consumed `total_env_steps` env steps.

        Args:
          total_env_steps: env steps over all envs of all processes the learner must
            consume. Every process consumes `trajectories_per_update` trajectories per
            learner iteration.
          state: where to start from; `initial_state()` if None.
          learn: if False, trajectories are consumed without updates (acting only).
          on_update: called on the learner thread after each learner iteration (for
            progress, logging, checkpoints); an error in it stops the run.
          local_experience: one experience per local learner device, stacked (leaves
            [num_local_learners, ...]: `UpdateInfo.learner_state()`'s or a checkpoint's,
            or in a single process `RunResult.learner_experience`); by default every
            learner device starts from `state.experience`. Either must be of this
            loop's layout (an experience's shapes follow its envs and steps per cycle),
            else a ValueError names the leaf.
          stop: when set (e.g. by a SIGTERM handler: a preemption), the run ends with
            `RunResult.stopped_early`: at once if the learner is waiting for a
            trajectory, else after the learner update under way. A single-process run
            cuts that update short between optimizer steps when it would not end by the
            event's `deadline` (a `preemption.StopEvent`; `RunResult.optimizer_steps_cut`
            counts the steps left out). In a multi-process run every process ends after
            the same update (one update after the first process saw its event), so
            their learner states agree.
          on_stop: called on the learner thread when `stop` ends the run, before its
            threads and envs are shut down (which may take up to 2 x
            `Config.shutdown_timeout_s`): where a preempted run saves its checkpoint,
            from the last `on_update`'s info, within its grace. An error in it is the
            run's error.
          progress_timeout_s: a single-process run whose learner waits this long for a
            trajectory while no env steps (an env step that never returns) ends with a
            RuntimeError showing where the inferencer threads are
            (`watchdog.EnvStall`). In a multi-process run a learner that finishes no
            update for this long ends this process (exit code `watchdog.EXIT_CODE`),
            naming the processes that are behind (`watchdog.ProgressWatchdog`); allow
            for the slowest inference cycle there. Before the first env step (or
            update) `watchdog.FIRST_UPDATE_S` (600 s) if that is longer. None: wait
            forever.
          learner_updates: updates the learner made before this run (a resumed run
            passes its checkpoint's): the version its networks are published under
            (`Agent.acting_nets` sees it; policy lags and lockstep count from it), and
            a new draw of env seeds, so that a resumed run does not replay its first
            episodes. A resumed run continues the learner exactly when `state` holds
            the checkpoint's nets, opt and `UpdateInfo.actor_state()` (its step state)
            and `local_experience` the checkpoint's experience.

        Returns:
          The figures of the run and its final state. An error in any thread or env
          stops the run and is re-raised here.
        """
        self._check_run_args(total_env_steps, learn, progress_timeout_s, learner_updates)
        self._expire_info()  # a run starts the learner anew from `state`
        self._check_agent()
        self.check_memory()
        if state is None:
            state = self.initial_state()
        else:
            self._check_step_state_rows(state.step_state)
        self._check_experience(state.nets, state.experience if local_experience is None
                               else local_experience, stacked=local_experience is not None)
        # As the acting calls return it, so that each compiles once (and the cut's
        # concatenation of consumed and unconsumed groups' rows too).
        state = state._replace(step_state=strongly_typed(state.step_state))
        self._check_shard_step_state(state.step_state)
        run = self._start_learner(state, local_experience, learner_updates,
                                  progress_timeout_s)
        try:
            if self.config.eval_every_updates and self.process_index == 0:
                run.evaluator = Evaluator(
                    self.agent, self.config, self.config.resolved_eval_device(), run.errors,
                    run.halt, steps_before=learner_updates * self.env_steps_per_update
                    // self.num_processes)
                run.evaluator.start()
            self._start_inferencers(run, state.step_state, learner_updates,
                                    progress_timeout_s)
            self._update_loop(run, total_env_steps, learn, on_update, stop)
            self.learner.finish()
            # The run's time ends with its last update: not the shutdown (threads joined,
            # envs closed, one after another) nor on_stop's save.
            run.wall = time.perf_counter() - run.start
            run.timed_env_steps = run.accounting.env_steps
            # A stop seen in the last update ends nothing early, but its save (a
            # preemption's) still comes before the shutdown, within the grace.
            if run.stop_seen and on_stop is not None:
                on_stop()
        except BaseException as error:
            # Whatever ends the run, threads left stuck are said with its error.
            self._note_still_alive(error, self._stop(run))
            raise
        still_alive = self._stop(run)
        if run.errors.error is not None:
            self._note_still_alive(run.errors.error, still_alive)
        run.errors.raise_if_any()
        if still_alive:
            raise RuntimeError(self._still_alive_message(still_alive))
        return self._result(run, learner_updates)

    def _still_alive_message(self, still_alive: list[str]) -> str:
        return (f"threads did not stop within the shutdown's waits of shutdown_timeout_s="
                f"{self.config.shutdown_timeout_s}s each (two for the inferencers, one for "
                f"the evaluator; stuck in an env's step, or in its close): {still_alive}")

    def _note_still_alive(self, error: BaseException, still_alive: list[str]) -> None:
        """Adds to `error`, on its way to the caller, the threads the shutdown left alive."""
        if still_alive:
            error.add_note(self._still_alive_message(still_alive))

    def _expire_info(self) -> None:
        """The last UpdateInfo handed to on_update no longer copies state: an update (or
        a run) is about to reuse the learner's buffers and move the actors' cut."""
        self._info_current[0] = False

    def _check_agent(self) -> None:
        """Once per loop, before anything is allocated: the agent's hooks traced on this
        layout's shapes (`jax.eval_shape`: nothing compiled, nothing allocated), so that
        a hook that breaks its contract is a ValueError naming the hook and the leaf
        before any env or thread starts, not a failure far from it (an empty slice of a
        StepState, the env's assertion in its thread, a sharding error):

        - `new_step_state`: every leaf per env or 0-d (`agent.check_step_state_rows`);
        - `step`: an action the env's action space takes and per-env extras
          (`agent.check_actor_output`; the acting calls check it too, and the StepState);
        - the learner's hooks: experience, networks and optimizer state returned as
          they were given, scalar metrics (`Learner.check_hooks`).

        An agent whose state depends on values, not only on shapes, is checked where
        its functions are first compiled instead (the same checks run there)."""
        if self._agent_checked:
            return
        agent, layout, key = self.agent, self.layout, jax.random.key(0)
        rows, shard = self.rows_per_group, layout.envs_per_update_shard
        try:
            nets = jax.eval_shape(agent.new_networks, key)
            step_state = jax.eval_shape(
                lambda n, k: agent.new_step_state(n, k, layout.total_envs), nets, key)
        except VALUE_DEPENDENT:
            self._agent_checked = True
            return
        check_step_state_rows(agent, step_state, layout.total_envs)

        def with_rows(tree, n):  # per-env leaves of n rows, strongly typed, as the run's
            return jax.tree.map(lambda x: jax.ShapeDtypeStruct(
                (n, *x.shape[1:]) if x.ndim else (), x.dtype), tree)

        acting = jax.eval_shape(agent.acting_nets, nets, jax.ShapeDtypeStruct((), jnp.int32))
        env_step = example_env_step(agent.env_spec, rows)
        output, _ = jax.eval_shape(agent.step, with_rows(step_state, rows), acting, env_step)
        check_actor_output(output, rows, agent.env_spec.action_space)
        try:
            opt = jax.eval_shape(agent.new_opt_state, nets, key)
            experience = jax.eval_shape(
                lambda n, k: agent.new_experience_state(n, k, layout), nets, key)
        except VALUE_DEPENDENT:
            self._agent_checked = True
            return

        def over_time(tree, length):  # [E, ...] -> one update's shard [K E / L, T(+1), ...]
            return jax.tree.map(lambda x: jax.ShapeDtypeStruct(
                (shard, length, *jnp.shape(x)[1:]), jnp.result_type(x)), tree)

        trajectory = Trajectory(over_time(env_step, layout.steps_per_cycle + 1),
                                over_time(output, layout.steps_per_cycle))
        self.learner.check_hooks(nets, opt, experience, with_rows(step_state, shard),
                                 trajectory)
        self._agent_checked = True

    def _check_shard_step_state(self, step_state: PyTree) -> None:
        """Once per run: `Agent.shard_step_state` of the first group's rows keeps to its
        contract (global arrays split over the learner devices, [L, E / L_local, ...]:
        `agent.check_sharded_step_state`); the inferencer threads call it on every
        trajectory's StepStates, and the learner would fail far from it (or not at all,
        pairing envs with other envs' rows) on another layout."""
        rows = sharding.slice_env_axis(step_state, 0, self.rows_per_group)
        check_sharded_step_state(self.agent, rows,
                                 self.agent.shard_step_state(rows, self.learner_devices),
                                 self.learner_devices)

    def check_memory(self) -> None:
        """Raises a ValueError, with the estimate and the memory available, when the
        layout cannot fit in memory (see `runtime.memory`); `initial_state` and `run`
        call it before they allocate."""
        if self._memory_checked:
            return
        cfg = self.config
        try:
            need = memory.estimate(self.agent, self.layout, self.inference_devices,
                                   self.local_learner_devices, cfg.effective_queue_capacity)
        except VALUE_DEPENDENT:
            # An agent whose state depends on values, not only on shapes: nothing to
            # estimate from before allocating.
            self._memory_checked = True
            return
        groups = "1 env group" if cfg.num_groups == 1 else f"{cfg.num_groups} env groups"
        memory.check_fits(need, f"the layout ({groups} of "
                          f"{cfg.envs_per_group:,} envs, {cfg.steps_per_cycle} steps per "
                          "cycle)")
        self._memory_checked = True

    @property
    def env_steps_per_update(self) -> int:
        """Env steps (agent steps of a multi-agent env) one learner update consumes,
        over all processes: trajectories_per_update x rows per group x steps per cycle."""
        cfg = self.config
        return (cfg.trajectories_per_update * self.rows_per_group * cfg.steps_per_cycle
                * self.num_processes)

    def _check_run_args(self, total_env_steps: int, learn: bool,
                        progress_timeout_s: float | None, learner_updates: int) -> None:
        if not isinstance(total_env_steps, int) or total_env_steps < 1:
            raise ValueError(f"total_env_steps must be an int >= 1, got {total_env_steps!r}")
        if total_env_steps < self.env_steps_per_update:
            warnings.warn(
                f"total_env_steps={total_env_steps:,} is less than one learner update, "
                f"which consumes {self.env_steps_per_update:,} env steps "
                "(trajectories_per_update x envs per group x steps per cycle x processes): "
                f"the run will consume {self.env_steps_per_update:,}", stacklevel=3)
        if not isinstance(learner_updates, int) or learner_updates < 0:
            raise ValueError(f"learner_updates must be an int >= 0, got {learner_updates!r}")
        if progress_timeout_s is not None and not progress_timeout_s > 0:
            raise ValueError(
                f"progress_timeout_s must be > 0 or None, got {progress_timeout_s!r}")
        if self.config.lockstep and not (learn and self.learner.optims_per_update > 0):
            raise ValueError("lockstep acting waits for networks that only learning "
                             "publishes: it needs learn=True and an optimizer step per update")

    def _check_step_state_rows(self, step_state: PyTree) -> None:
        """ValueError unless every per-env leaf holds a row for each of this process's
        envs: the groups' slices of a shorter state would be empty (the agent acting on
        nothing, or failing deep inside the learner), a longer one's rows left out."""
        rows = self.layout.total_envs
        wrong = sorted({jnp.shape(x)[0] for x in jax.tree.leaves(step_state)
                        if jnp.ndim(x) > 0 and jnp.shape(x)[0] != rows})
        if wrong:
            raise ValueError(
                f"state.step_state has per-env leaves of {wrong} rows; this process's envs "
                f"need {rows} ({self.config.num_groups} env groups x {self.rows_per_group} "
                "rows): a step state made for another layout (Sebulba.initial_state makes "
                "one for this one)")

    def _check_experience(self, nets: Nets, experience: PyTree, stacked: bool) -> None:
        """ValueError unless `experience` (per local learner device when `stacked`) has
        the structure, shapes and dtypes this loop's layout gives it with `nets`: an
        experience made for another layout (more envs, other groups) would run and be
        wrong (a replay's sequences spliced from two envs' steps)."""
        if self._experience_shape is None:
            try:
                self._experience_shape = jax.eval_shape(
                    lambda n, k: self.agent.new_experience_state(n, k, self.layout), nets,
                    jax.random.key(0))
            except VALUE_DEPENDENT:
                return  # an experience that depends on values, not only on shapes
        name = "local_experience" if stacked else "state.experience"
        expected, expected_def = jax.tree_util.tree_flatten_with_path(self._experience_shape)
        leaves, treedef = jax.tree.flatten(experience)
        if treedef != expected_def:
            raise ValueError(f"{name} has the structure {treedef}; this loop's agent and "
                             f"layout make {expected_def}")
        layout = (f"{self.config.num_groups} env groups x {self.rows_per_group} rows, "
                  f"{self.config.steps_per_cycle} steps per cycle")
        for (path, want), x in zip(expected, leaves, strict=True):
            shape = jnp.shape(x)[1:] if stacked else jnp.shape(x)
            if shape != want.shape or jnp.result_type(x) != want.dtype:
                raise ValueError(
                    f"{name}{jax.tree_util.keystr(path)} is {jnp.result_type(x)}"
                    f"{list(shape)}{' per learner device' if stacked else ''}; this loop's "
                    f"layout ({layout}) makes {want.dtype}{list(want.shape)}: an experience "
                    "made for another layout (Sebulba.initial_state makes one for this one)")

    def _start_learner(self, state: AgentState, local_experience: PyTree | None,
                       learner_updates: int, progress_timeout_s: float | None) -> _Run:
        """The run's channels, and the learner started from `state` (its networks
        published to every inference device's staging area)."""
        cfg, devices = self.config, self.learner_devices
        if local_experience is None:
            experience = sharding.replicate(state.experience, devices)
        else:
            experience = sharding.stack_local(local_experience, devices)
        halt = threading.Event()  # tells the inferencer threads to end
        run = _Run(
            halt=halt,
            errors=ErrorBox(halt),
            accounting=Accounting(),
            trajectories=queue.Queue(cfg.effective_queue_capacity),
            stagings={d: Staging(d) for d in self.inference_devices},
            cut=_ConsumedCut(state.step_state, cfg.num_groups, self.rows_per_group),
        )
        if self.num_processes > 1 and progress_timeout_s is not None:
            # Started first: the learner's start is collective, and a peer may never come.
            run.watchdog = ProgressWatchdog(progress_timeout_s, self.process_index,
                                            num_processes=self.num_processes)
        try:
            self.learner.start(sharding.replicate(state.nets, devices),
                               sharding.replicate(state.opt, devices), experience,
                               stagings=run.stagings.values(), accounting=run.accounting,
                               updates=learner_updates)
        except BaseException:
            if run.watchdog is not None:  # it would end the process later on its own
                run.watchdog.close()
            raise
        return run

    def _start_inferencers(self, run: _Run, step_state: PyTree, learner_updates: int,
                           progress_timeout_s: float | None) -> None:
        """Makes the env sources and starts one inferencer thread on each."""
        run.runners = self._make_runners(step_state, run, learner_updates)
        run.threads = [threading.Thread(target=r, name=r.name, daemon=True)
                       for r in run.runners]
        if self.num_processes == 1 and progress_timeout_s is not None:
            run.stall = EnvStall(progress_timeout_s, run.threads)
        run.start = time.perf_counter()
        for t in run.threads:
            t.start()

    def _update_loop(self, run: _Run, total_env_steps: int, learn: bool,
                     on_update: Callable[[UpdateInfo], None] | None,
                     stop: threading.Event | None) -> None:
        """Pops trajectories and updates until `total_env_steps` are consumed (or `stop`).

        `consumed` grows only after an update, so an iteration always gathers its K items
        (popped one at a time: see Config.trajectories_per_update for why this cannot
        deadlock) and every process runs the same number of iterations.
        """
        learner, accounting = self.learner, run.accounting
        while accounting.consumed * self.num_processes < total_env_steps:
            item = self._get(run, stop if self.num_processes == 1 else None)
            if item is None:  # stopped while waiting: the last update is the cut
                run.stopped_early = run.stop_seen = True
                return
            run.popped.append(item)
            if len(run.popped) < self.config.trajectories_per_update:
                continue
            lags = [learner.updates - item.version for item in run.popped]
            self._expire_info()
            run.stopped_early = self._update(run, learn, stop)
            for item, lag in zip(run.popped, lags, strict=True):
                accounting.add_consumed(item.num_env_steps, lag)
                run.cut.consumed(item)
            run.popped = []
            evaluations = self._evaluate(run)
            if on_update is not None:
                self._info_current = [True]  # until the next update (`_expire_info`)
                on_update(UpdateInfo(
                    learner.updates, learner.metrics, learner.published, accounting,
                    _LearnerSnapshot(learner.nets, learner.opt, learner.experience, run.cut,
                                     learner.finish, self._info_current),
                    evaluations))
            # One process needs no vote: an event set in on_update counts at once. A stop
            # during the last update ends nothing early: every step is consumed.
            if run.stopped_early or (self.num_processes == 1 and stop is not None
                                     and stop.is_set()):
                run.stop_seen = True
                run.stopped_early = (accounting.consumed * self.num_processes
                                     < total_env_steps)
                return

    def _evaluate(self, run: _Run) -> tuple[Evaluation, ...]:
        """Offers the networks just published to the evaluator (it never waits); the
        evaluations finished since the last update."""
        if run.evaluator is None:
            return ()
        own = run.accounting.consumed
        run.evaluator.offer(self.learner.updates, own * self.num_processes,
                            self.learner.published, run.accounting.longest_episode, own)
        evaluations = tuple(run.evaluator.take())
        # The result keeps their figures, not their videos' frames (hundreds of MB each).
        run.evaluations.extend(dataclasses.replace(e, video_frames=None) for e in evaluations)
        return evaluations

    def _update(self, run: _Run, learn: bool, stop: threading.Event | None) -> bool:
        """One learner update on the popped items; whether the processes voted to stop."""
        learner, watchdog = self.learner, run.watchdog
        if watchdog is not None:
            watchdog.entering(learner.updates + 1)
        try:  # the collectives of an update (and of the stop vote) need every process
            with transfers.guarded("the learner update", self.config.transfer_guard):
                if learn:
                    learner.update(run.popped, _update_cutter(stop, self.num_processes))
                # Every process votes, with a stop event or not: the vote is collective.
                stopped = learner.vote_to_stop(stop is not None and stop.is_set())
        except RuntimeError as e:  # a collective failed: say who was behind
            if watchdog is None:
                raise
            raise RuntimeError(f"{e}\n{watchdog.report()}") from e
        if watchdog is not None:
            watchdog.finished(learner.updates)
        return stopped

    def _stop(self, run: _Run) -> list[str]:
        """Ends the run's threads and envs; the names of threads still alive after that."""
        if run.watchdog is not None:
            run.watchdog.close()
        run.halt.set()
        still_alive = self._shut_down(run.threads, run.runners,
                                      stalled=run.stall is not None and run.stall.fired)
        if run.evaluator is not None:
            if not run.evaluator.close(self.config.shutdown_timeout_s):
                still_alive.append(run.evaluator.thread.name + (
                    " (writing a video)" if run.evaluator.writing_video else ""))
            # These keep their frames: no on_update carries them, and `Reporter.finish`
            # writes their videos from the result (and drops the frames). At most one
            # evaluation runs after the last update's offer, so this is one video at most.
            run.evaluations.extend(run.evaluator.take())
        if not run.wall:  # a run that raised
            run.wall = time.perf_counter() - run.start
        return still_alive

    def _result(self, run: _Run, learner_updates: int) -> RunResult:
        """The run's figures, every env step accounted for, and the state it ends in."""
        learner, accounting = self.learner, run.accounting
        in_flight = sum(r.partial_steps for r in run.runners)
        in_flight += sum(item.num_env_steps for item in run.popped)
        while True:
            try:
                in_flight += run.trajectories.get_nowait().num_env_steps
            except queue.Empty:
                break
        episodes, policy_lags = accounting.snapshot()
        final_state = AgentState(
            nets=sharding.first_replica(learner.nets),
            opt=sharding.first_replica(learner.opt),
            experience=sharding.first_replica(learner.experience),
            step_state=run.cut.step_state(),  # where the learner stands: run(state=) resumes
        )
        return RunResult(
            env_steps=accounting.env_steps,
            consumed=accounting.consumed,
            dropped=accounting.dropped,
            in_flight=in_flight,
            wall_seconds=run.wall,
            timed_env_steps=run.timed_env_steps,
            episodes=episodes,
            policy_lags=policy_lags,
            episodes_total=accounting.episodes_total,
            lag_count=accounting.trajectories_consumed,
            lag_sum=accounting.lag_sum,
            lag_max=accounting.lag_max,
            stage_seconds=dict(accounting.stage_seconds),
            learner_updates=learner.updates - learner_updates,  # this run's
            optimizer_steps=learner.optimizer_steps,
            optimizer_steps_cut=learner.steps_cut,
            metrics=learner.metrics,
            num_processes=self.num_processes,
            state=final_state,
            agents_per_env=self.layout.agents_per_env,
            padding_steps=accounting.padding_steps,
            team_episodes=list(accounting.team_episodes),
            team_episodes_total=accounting.team_episodes_total,
            learner_experience=learner.experience,
            stopped_early=run.stopped_early,
            inferencer_threads=len(run.runners),
            evaluations=run.evaluations,
            evaluator_env_steps=run.evaluator.env_steps if run.evaluator else 0,
            evaluations_abandoned=run.evaluator.abandoned if run.evaluator else 0,
            evaluation_videos_cut=run.evaluator.videos_cut if run.evaluator else 0,
            evaluations_passed_over=run.evaluator.passed_over if run.evaluator else 0,
            evaluations_cut=run.evaluator.cut if run.evaluator else 0,
        )

    def _env_seed(self, group: int, learner_updates: int) -> int:
        """The seed of env group `group`'s first row (the others follow it): distinct for
        every row of every process, and drawn anew for a run resumed at another update."""
        cfg, size = self.config, self.rows_per_group
        rows = size * cfg.num_groups * self.num_processes
        return (cfg.seed + (self.process_index * cfg.num_groups + group) * size
                + learner_updates * rows)

    def _make_sources(self, learner_updates: int) -> list[tuple[int, jax.Device, EnvSource]]:
        """(first group, inference device, env source) of each inferencer thread: the
        run's env source kind makes `async_factor` groups per device (one source per
        group, or one source of several groups)."""
        cfg = self.config
        kind = registry.get(cfg.vectorization)
        sources: list[tuple[int, jax.Device, EnvSource]] = []
        try:
            for d, device in enumerate(self.inference_devices):
                group = d * cfg.async_factor
                request = dataclasses.replace(
                    cfg.source_request(cfg.async_factor,
                                       self._env_seed(group, learner_updates)),
                    inference_on_cpu=device.platform == "cpu")
                for source in kind.make_sources(request):
                    sources.append((group, device, source))  # closed on error
                    group += source.num_groups
                if group != (d + 1) * cfg.async_factor:
                    raise ValueError(
                        f"vectorization {cfg.vectorization!r} made sources of "
                        f"{group - d * cfg.async_factor} groups for device {device}, "
                        f"asked for {cfg.async_factor}")
        except BaseException:
            close_quietly([source for _, _, source in sources])
            raise
        return sources

    def _make_runners(self, step_state: PyTree, run: _Run,
                      learner_updates: int) -> list[EnvGroupRunner]:
        cfg = self.config
        size = self.rows_per_group
        runners = []
        sources = self._make_sources(learner_updates)
        lockstep = (learner_updates, cfg.trajectories_per_update) if cfg.lockstep else None
        try:
            for first, device, source in sources:
                runners.append(EnvGroupRunner(
                    first_group=first,
                    device=device,
                    source=source,
                    step_state=sharding.slice_env_axis(step_state, first * size, source.num_envs),
                    seed=self._env_seed(first, learner_updates),
                    acting=self.acting,
                    staging=run.stagings[device],
                    learner_devices=self.learner_devices,
                    out_queue=run.trajectories,
                    drop_when_full=cfg.drop_when_full,
                    stop=run.halt,
                    errors=run.errors,
                    accounting=run.accounting,
                    lockstep=lockstep,
                    action_poll_s=cfg.action_poll_seconds,
                    transfer_guard=cfg.transfer_guard,
                    stack_frames_on_device=cfg.stack_frames_on_device,
                ))
        except BaseException:
            close_quietly([source for _, _, source in sources])
            raise
        return runners

    def _get(self, run: _Run, stop: threading.Event | None = None) -> QueueItem | None:
        """The next trajectory, or None once `stop` is set; raises a thread's error, or
        a stalled env's."""
        errors, accounting, stall = run.errors, run.accounting, run.stall
        t0 = time.perf_counter()
        if stall is not None:
            stall.waiting(accounting.env_steps)
        while True:
            errors.raise_if_any()
            if stop is not None and stop.is_set():
                return None
            try:
                item = run.trajectories.get(timeout=POLL_SECONDS)
                break
            except queue.Empty:
                if stall is not None:
                    errors.raise_if_any()  # a thread's own error says more than a stall
                    stall.check(accounting.env_steps, self.learner.device_busy())
        accounting.add_time("queue_get", time.perf_counter() - t0)
        return item

    def _shut_down(self, threads: list[threading.Thread], runners: list[EnvGroupRunner],
                   *, stalled: bool = False) -> list[str]:
        """Stops every thread and env, waiting at most about 2 x shutdown_timeout_s (one
        after a stall, whose threads are known to be stuck), plus the async workers'
        `CLOSE_TIMEOUT_S` where a stuck thread's env is closed and, one source after
        another, where an idle source's envs hang in their own close.

        Returns the names of threads still alive after that: inferencers stuck in user
        code, and closes of their envs that did not return (`<inferencer>-closing`).
        """
        timeout = self.config.shutdown_timeout_s
        # A Ctrl-C while this waits ends the waits, not the closes: every source is
        # closed (its workers killed) before the interrupt goes on to the caller.
        interrupt: KeyboardInterrupt | None = None
        if not stalled:
            deadline = time.monotonic() + timeout
            try:
                for t in threads:
                    t.join(max(0.0, deadline - time.monotonic()))
            except KeyboardInterrupt as e:
                interrupt = e
        # Closing terminates async workers, which also frees a thread stuck waiting on one.
        # The env of a thread still stuck in its step may block in close too (on the lock
        # the step waits for), so it is closed in a thread of its own, waited for below.
        closing, workers = [], False
        for i, r in enumerate(runners):
            try:
                if i < len(threads) and threads[i].is_alive():
                    workers = workers or getattr(r.source, "has_worker_processes", False)
                    closing.append(threading.Thread(
                        target=close_quietly, args=([r.source],), name=f"{r.name}-closing",
                        daemon=True))
                    closing[-1].start()
                else:  # a broken env must not keep the others from closing, nor fail it
                    close_quietly([r.source])
            except KeyboardInterrupt as e:  # the source's close kills its workers anyway
                interrupt = interrupt or e
        if interrupt is not None:
            raise interrupt
        # Closing a stuck thread's env may take CLOSE_TIMEOUT_S where it has worker
        # processes (one that outlives SIGTERM is killed after it); in-process envs do not.
        deadline = time.monotonic() + timeout + (CLOSE_TIMEOUT_S if workers else 0.0)
        for t in closing + threads:
            t.join(max(0.0, deadline - time.monotonic()))
        return [t.name for t in threads + closing if t.is_alive()]


def _update_cutter(stop: threading.Event | None, num_processes: int
                   ) -> Callable[[float], bool] | None:
    """`Learner.update`'s `cut`: true once `stop` is set and the update's remaining
    seconds would take it past the stop's deadline. None where no deadline can apply: a
    multi-process run (the other processes would wait in the left-out steps)."""
    if stop is None or num_processes > 1:
        return None

    def cut(remaining_s: float) -> bool:
        deadline = getattr(stop, "deadline", None)
        return (stop.is_set() and deadline is not None
                and time.monotonic() + remaining_s > deadline)

    return cut


def _concat_env_axis(trees: list[PyTree], device: jax.Device) -> PyTree:
    """Inverse of `sharding.slice_env_axis` over consecutive groups, on `device`."""
    if not trees:
        return None

    def concat(*xs):
        if jnp.ndim(xs[0]) == 0:
            return xs[0]
        return jnp.concatenate([jax.device_put(x, device) for x in xs])

    return jax.tree.map(concat, *trees)
