"""Configuration of a Sebulba run, checked when it is made."""

from __future__ import annotations

import dataclasses
import math
import multiprocessing
import numbers
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from sebulba.envs import registry
from sebulba.envs.gymnasium_source import EnvFactory
from sebulba.envs.wrappers import EnvWrapper, parse_wrappers
from sebulba.evaluation import check_video_writer
from sebulba.types import EnvSpec

ASYNC_CONTEXTS = tuple(multiprocessing.get_all_start_methods())

DeviceLike = int | jax.Device


# How long an inferencer polls for an action before sleeping on it, by default, unless its
# envs run in subprocesses (`Config.action_poll_seconds`).
DEFAULT_ACTION_POLL_S = 0.0005


@dataclasses.dataclass(frozen=True)
class Config:
    """What a run collects from, and where it acts and learns.

    Everything is checked at construction; a bad value is a ValueError naming it (a
    TypeError for an `env` that is neither an id nor a factory).

    Attributes:
      env: a `gymnasium.make_vec` id (`module:Id` imports the module that registers it),
        or a factory returning one gymnasium.Env; what the vectorization's source makes.
      env_kwargs: keyword arguments for the env id's constructor (a factory takes
        none: bind them in it).
      env_wrappers: gymnasium wrappers around each env, innermost first, by name with
        literal arguments ("FlattenObservation,FrameStackObservation(stack_size=4)"), a
        sequence of such names, or env -> env callables. Needs a vectorization that
        makes each env itself ("sync", "async").
      envs_per_group: envs in each env group (the batch of one acting call, and the envs
        of one trajectory).
        Divisible by the number of learner devices: each trajectory is split over them.
      vectorization: the env source kind, a name registered in `sebulba.envs.registry`
        (shipped: "sync", "async", "vector_entry_point", "envpool", "envpool_async",
        "pettingzoo"; each kind's `help` says what it is).
      agent_ids: multi-agent envs: append a one-hot of the agent's index to its (flat)
        observation, so that one shared policy can act differently per agent.
      async_factor: env groups per inference device; 2 = double buffering.
      steps_per_cycle: env steps per inference cycle (the trajectory length T).
      inference_devices: local device indices (or local devices) that run `Agent.step`.
      learner_devices: local device indices (or local devices) the learner feeds from this
        process; with several processes, these indices of every process. Both default
        to the first local device.
      queue_capacity: trajectories the global queue holds; 0: one per env group.
      trajectories_per_update: trajectories (queue items, from any groups, in queue
        order) the learner joins along the env axis for one update; 1 learns from each
        as it arrives. Any value works with any queue_capacity.
      drop_when_full: drop the oldest queued trajectory instead of waiting for the
        learner (backpressure) when the queue is full. Drops are counted. Refused with
        `lockstep` and trajectories_per_update > 1 (a drop would deadlock the run).
      check_finite: raise if the learner's loss is NaN or infinite.
      transfer_guard: check that the acting loop and the learner update make no
        host-device transfer but their own (sebulba.runtime.transfers): JAX's transfer
        guard disallows implicit ones there, and the loop's own become explicit. For
        tests and for finding a transfer an agent adds; it costs tens of microseconds per
        acting call.
      stack_frames_on_device: where the env source's observations are stacks of an
        env's last frames kept by a rule it declares (`frame_stack`: EnvPool's Atari
        envs without `episodic_life`, ale-py's vector env), send only each observation's
        newest frame to the inference device, which restacks it (a quarter of the
        observations' copy for 4 frames; the trajectory holds the env's stacks, and a row
        of each cycle is checked against the rule). None: on accelerators, off on the
        CPU, where the copy is a memcpy small next to the CNN's call; True with a source
        that declares no stack is an error.
      check_env_output: check what the envs return where it enters the framework: a step
        or reset of the wrong form (the old gym API's four values), a reward or flag that
        is not a number or bool (None), an observation of the wrong shape, and NaN or
        infinite float observations or rewards raise `BadEnvOutput`, naming the env, its
        index, its step and the field (sebulba.envs.output_checks). False removes the
        checks and their cost (about 1% of the acting benchmark's time on a shared 2-core
        VM: benchmarks/RESULTS.md, "Env output checks: cost").
      async_context: multiprocessing start method of env worker processes.
      shutdown_timeout_s: seconds stopping waits for a thread before giving up on it.
      action_poll_s: seconds an inferencer thread polls for an acting call's actions
        before it sleeps on them: waking a thread costs tens of microseconds, polling
        holds a core and the GIL. 0 suits many inferencer threads per core. None: 0.5 ms,
        or 0 where envs step in worker processes, which need those cores.
      seed: seeds the networks, the agent state and the envs; in [0, 2**63) (JAX's keys
        take its low 32 bits: seeds 2**32 apart start from the same networks).
      desync_episodes: truncate each env's first episode at a length drawn uniformly from
        1 to the env's episode step limit, so that envs that start together do not stay
        in the same phase of their episodes. Needs a time limit (a registered
        `max_episode_steps` or a `TimeLimit` wrapper) and a vectorization that makes
        each env itself.
      lockstep: acting waits for the learner: every cycle acts with the networks learnt
        from all trajectories before it (policy lag 0), so a run on deterministic envs
        repeats bit for bit, resumed or not. For reproducing and debugging, not speed:
        needs one env group per process and envs stepped in order.
      eval_every_updates: evaluate the networks the learner publishes every this many
        learner updates, on a thread with envs of its own (sebulba.runtime.evaluator),
        never waiting and never making the learner or the inferencers wait; 0: no
        evaluation during training. Results go to `on_update`'s `UpdateInfo.evaluations`
        and `RunResult.evaluations`. Process 0 of a multi-process run evaluates.
      eval_episodes: complete episodes per evaluation, one env each (a multi-agent
        env's episodes: its env episodes).
      eval_greedy: evaluate `Agent.greedy_step` (False: `Agent.step`, sampling); an
        agent without `greedy_step` is refused at construction.
      eval_device: the local device index (or device) evaluation runs on; None: the
        first inference device.
      eval_max_share: an evaluation due is skipped while the evaluator's env steps would
        pass this share of the training's (this process's), the next evaluation's
        estimated as the larger of the last one's and its envs times the longest training
        episode; one that runs past the share is abandoned (`RunResult.
        evaluations_abandoned`). With the default, evaluation costs at most about 2% of
        the env steps.
      eval_video_dir: record one more episode every `eval_video_every` evaluations to
        this directory (`update_<learner update, 8 digits>.mp4`: update_00000020.mp4);
        the env must render (render_mode="rgb_array"). None: no video.
      eval_video_every: evaluations per recorded episode.
    """

    env: str | EnvFactory = "CartPole-v1"
    env_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    env_wrappers: str | Sequence[EnvWrapper] = ()
    envs_per_group: int = 16
    vectorization: str = "sync"
    async_factor: int = 2
    steps_per_cycle: int = 32
    inference_devices: Sequence[DeviceLike] | None = None
    learner_devices: Sequence[DeviceLike] | None = None
    queue_capacity: int = 0
    trajectories_per_update: int = 1
    drop_when_full: bool = False
    check_finite: bool = True
    transfer_guard: bool = False
    stack_frames_on_device: bool | None = None
    check_env_output: bool = True
    async_context: str = "spawn"
    shutdown_timeout_s: float = 10.0
    action_poll_s: float | None = None
    seed: int = 0
    desync_episodes: bool = False
    agent_ids: bool = False
    lockstep: bool = False
    eval_every_updates: int = 0
    eval_episodes: int = 10
    eval_greedy: bool = True
    eval_device: DeviceLike | None = None
    eval_max_share: float = 0.02
    eval_video_dir: str | None = None
    eval_video_every: int = 10

    def __post_init__(self):
        _positive("envs_per_group", self.envs_per_group)
        _positive("async_factor", self.async_factor)
        _positive("steps_per_cycle", self.steps_per_cycle)
        # No bound against queue_capacity or the number of groups: the learner pops items
        # one at a time and holds them until it has K, so the queue never has to hold K
        # items at once. A producer blocks only on a full queue, which the learner can
        # always pop from, and never waits for the learner to publish, so every item the
        # learner waits for is eventually produced (K > num_groups just takes several
        # cycles of some groups, K items of one group are joined in production order).
        _positive("trajectories_per_update", self.trajectories_per_update)
        self._check_scalars()
        kind = registry.get(self.vectorization)
        if self.lockstep and self.drop_when_full and self.trajectories_per_update > 1:
            # Lockstep's next cycle waits for the update that learns from this one; a
            # dropped trajectory leaves that update one short for ever (a deadlock the
            # stall detector would blame on the env).
            raise ValueError(
                f"lockstep with drop_when_full needs trajectories_per_update=1, got "
                f"{self.trajectories_per_update}: acting waits for the update that learns "
                "from the cycles before it, and a dropped trajectory leaves that update one "
                "short for ever; use drop_when_full=False (a full queue then waits for "
                "the learner)")
        if self.lockstep and not kind.steps_in_order:
            raise ValueError(f"lockstep needs envs stepped in order; vectorization "
                             f"{self.vectorization!r} returns whichever envs are ready")
        self._check_evaluation(kind)
        # One canonical tuple, so that equal configs compare equal and a checkpoint records
        # the same text for the same wrappers.
        object.__setattr__(self, "env_wrappers", parse_wrappers(self.env_wrappers))
        # Checks the env too, before devices are set up: an unknown id (or a `module:Id`
        # whose module does not import) is an error naming it, not a registry's traceback.
        registry.check_request(kind, self.env, self.env_wrappers, self.desync_episodes,
                               self.agent_ids)
        num_learners = len(self.resolved_local_learner_devices())
        if self.envs_per_group % num_learners:
            raise ValueError(
                f"envs_per_group={self.envs_per_group} must be divisible by the number of "
                f"learner devices ({num_learners}): each trajectory is split over them"
            )
        self.resolved_inference_devices()
        if self.lockstep and self.num_groups != 1:
            raise ValueError(
                f"lockstep needs one env group per process, got {self.num_groups} "
                f"(async_factor={self.async_factor} x "
                f"{len(self.resolved_inference_devices())} inference devices): with several "
                "groups the order in which trajectories reach the learner depends on timing")

    def _check_scalars(self) -> None:
        """Types and ranges of the fields no other check reads (bools are not ints here)."""
        if (not isinstance(self.queue_capacity, int) or isinstance(self.queue_capacity, bool)
                or self.queue_capacity < 0):
            raise ValueError(f"queue_capacity must be an int >= 0, got {self.queue_capacity!r}")
        timeout = self.shutdown_timeout_s
        if (isinstance(timeout, bool) or not isinstance(timeout, int | float)
                or not 0 < timeout < math.inf):
            raise ValueError(f"shutdown_timeout_s must be finite seconds > 0, got {timeout!r}")
        if (not isinstance(self.seed, int) or isinstance(self.seed, bool)
                or not 0 <= self.seed < 2**63):
            raise ValueError(f"seed must be an int in [0, 2**63) (JAX's PRNG keys and the "
                             f"envs are seeded from it), got {self.seed!r}")
        for name in ("drop_when_full", "check_finite", "desync_episodes", "transfer_guard",
                     "lockstep", "check_env_output", "agent_ids", "eval_greedy"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if not isinstance(self.env_kwargs, Mapping):
            raise ValueError(f"env_kwargs must be a mapping of keyword arguments, got "
                             f"{self.env_kwargs!r}")
        if self.env_kwargs and callable(self.env):  # a factory is called without them
            raise ValueError(f"env_kwargs {dict(self.env_kwargs)!r} given with the factory "
                             f"{self.env!r}, which is called without arguments: bind them "
                             "in the factory (functools.partial)")
        if self.async_context not in ASYNC_CONTEXTS:
            raise ValueError(f"async_context must be one of {ASYNC_CONTEXTS}, got "
                             f"{self.async_context!r}")
        if self.eval_video_dir is not None and not isinstance(self.eval_video_dir, str):
            raise ValueError(f"eval_video_dir must be a path (str) or None, got "
                             f"{self.eval_video_dir!r}")
        if self.eval_video_dir == "":  # else os.makedirs("") fails at the first video
            raise ValueError("eval_video_dir='' is an empty path: name the directory the "
                             "videos go to, or None for no videos")
        if not (self.stack_frames_on_device is None
                or isinstance(self.stack_frames_on_device, bool)):
            raise ValueError(f"stack_frames_on_device must be a bool, or None (on "
                             f"accelerators, off on the CPU), got "
                             f"{self.stack_frames_on_device!r}")
        poll = self.action_poll_s
        if poll is not None and (isinstance(poll, bool) or not isinstance(poll, int | float)
                                 or not 0 <= poll <= 1):
            raise ValueError(f"action_poll_s must be seconds in [0, 1] or None, got {poll!r}")

    def _check_evaluation(self, kind: registry.EnvSourceKind) -> None:
        if (not isinstance(self.eval_every_updates, int) or isinstance(
                self.eval_every_updates, bool) or self.eval_every_updates < 0):
            raise ValueError(f"eval_every_updates must be an int >= 0 (0: no evaluation), "
                             f"got {self.eval_every_updates!r}")
        _positive("eval_episodes", self.eval_episodes)
        _positive("eval_video_every", self.eval_video_every)
        if (not isinstance(self.eval_max_share, int | float)
                or isinstance(self.eval_max_share, bool) or not 0 < self.eval_max_share <= 1):
            raise ValueError(f"eval_max_share must be a share of the env steps in (0, 1], "
                             f"got {self.eval_max_share!r}")
        if not self.eval_every_updates:
            if self.eval_video_dir is not None:
                raise ValueError(f"eval_video_dir={self.eval_video_dir!r} records episodes of "
                                 "evaluations during training: it needs eval_every_updates > 0")
            return
        if kind.evaluate_as is None:
            raise ValueError(f"eval_every_updates={self.eval_every_updates}: vectorization "
                             f"{self.vectorization!r} does not support evaluation (its "
                             "registry entry has evaluate_as=None)")
        if self.eval_device is not None:
            self.resolved_eval_device()
        if self.eval_video_dir is not None:
            check_video_writer(f"eval_video_dir={self.eval_video_dir!r}")

    def resolved_eval_device(self) -> jax.Device:
        """The device evaluation runs on."""
        if self.eval_device is None:
            return self.resolved_inference_devices()[0]
        return _resolve("eval_device", [self.eval_device])[0]

    def env_spec(self) -> EnvSpec:
        """The spec of this run's env, as the loop checks the agent's against."""
        return registry.env_spec(self.env, self.env_kwargs, self.vectorization,
                                 self.agent_ids, self.env_wrappers, self.desync_episodes)

    def source_request(self, num_groups: int, seed: int) -> registry.SourceRequest:
        """What the loop asks this run's env source kind for: `num_groups` groups from
        `seed` on (see `registry.SourceRequest`)."""
        return registry.SourceRequest(
            env=self.env, env_kwargs=self.env_kwargs, group_size=self.envs_per_group,
            num_groups=num_groups, seed=seed, env_wrappers=self.env_wrappers,
            async_context=self.async_context, desync_episodes=self.desync_episodes,
            agent_ids=self.agent_ids, check_env_output=self.check_env_output)

    def resolved_inference_devices(self) -> list[jax.Device]:
        """This process's inference devices."""
        return _resolve("inference_devices", self.inference_devices)

    def resolved_local_learner_devices(self) -> list[jax.Device]:
        """This process's learner devices."""
        return _resolve("learner_devices", self.learner_devices)

    def resolved_global_learner_devices(self) -> list[jax.Device]:
        """The learner devices of every process, process by process: the learner mesh."""
        local = self.resolved_local_learner_devices()
        if jax.process_count() == 1:
            return local
        mine = jax.local_devices()
        indices = [mine.index(d) for d in local]
        return [
            jax.local_devices(process_index=p)[i]
            for p in range(jax.process_count())
            for i in indices
        ]

    @property
    def num_groups(self) -> int:
        return self.async_factor * len(self.resolved_inference_devices())

    @property
    def effective_queue_capacity(self) -> int:
        return self.queue_capacity or self.num_groups

    @property
    def action_poll_seconds(self) -> float:
        """`action_poll_s`, None resolved: env worker processes lose more to a polling
        thread than it gains (benchmarks/HISTORY.md, "Async versus sync vectorization on
        2 cores")."""
        if self.action_poll_s is not None:
            return self.action_poll_s
        env_processes = registry.get(self.vectorization).env_processes
        return 0.0 if env_processes else DEFAULT_ACTION_POLL_S


def _positive(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")


def _resolve(name: str, devices: Sequence[DeviceLike] | None) -> list[jax.Device]:
    local = jax.local_devices()
    if devices is None:
        return [local[0]]
    if (isinstance(devices, str) or not isinstance(devices, Sequence)
            or len(devices) == 0):
        raise ValueError(f"{name} must be a non-empty list of devices or indices, got "
                         f"{devices!r}")
    resolved = []
    for d in devices:
        if isinstance(d, numbers.Integral) and not isinstance(d, bool | np.bool_):
            d = int(d)
            if not 0 <= d < len(local):
                raise ValueError(
                    f"{name} has device index {d}, but this process has {len(local)} local "
                    f"devices (indices 0..{len(local) - 1}): {local}"
                )
            resolved.append(local[d])
        elif isinstance(d, jax.Device):
            if d not in local:
                raise ValueError(f"{name} has {d}, which is not one of this process's {local}")
            resolved.append(d)
        else:
            raise ValueError(f"{name} entries must be device indices or jax.Device, got "
                             f"{d!r}")
    if len(set(resolved)) != len(resolved):
        raise ValueError(f"{name} lists a device twice: {resolved}")
    return resolved
