"""What bounds a run, named from its stage times (`RunResult.stage_seconds`).

A run is a producer and a consumer joined by a queue: inferencer threads step envs, act
and hand trajectories to the learner devices; the learner takes them and updates. Each
side waits for the other in one place only, so the waits say which side is slower:

- the learner waits for a trajectory in `queue_get`;
- an inferencer thread waits for the learner in `queue_put` (room in a full queue) and,
  with lockstep, `wait_for_networks`.

Every other stage is work. The rules, on the seconds of each stage:

1. The learner's waiting share is `queue_get / wall`; the inferencer threads' is
   `(queue_put + wait_for_networks) / their time`, their time being
   `inferencer_threads x wall` (each stage is summed over the threads), or, where the
   threads are not counted (live counters), the seconds their stages account for.
2. If the learner waits no more than the inferencer threads do, or less than
   `LEARNER_SATURATED` of the wall time, the run is **learner-bound**: more trajectories
   would not be learnt from any sooner. (With `drop_when_full` the threads never wait;
   a learner that never waits is the sign.) The share is the learner's busy time,
   `1 - queue_get / wall`: updating (`update_experience`, `optimize`, which includes
   waiting for the device) and its `on_update` callbacks.
3. Otherwise the inferencer threads bound the run, and the largest part of their work
   names how, its share of their time being the verdict's share:
   - `env_step` (stepping envs, including waiting for EnvPool's `recv` or for async
     workers): **env-bound**;
   - `dispatch` + `inference` + `record` (starting the acting call, waiting for its
     actions, and the host work done while it computes; on the CPU the call may run
     inside `dispatch`): **inference-bound**;
   - `shard` (moving a finished trajectory and its step states to the learner devices):
     **queue-bound**, the hand-off from the threads to the learner.

Each verdict names the one setting most likely to help (`ADVICE`): env-bound, a larger
`async_factor` (more groups stepping at once; `envs_per_group` would lengthen each
group's step as much where a group's envs step one after another); inference-bound, more
`envs_per_group` (an acting call costs an accelerator about the same for more envs);
learner-bound, a larger `trajectories_per_update` (open to any machine; where devices
are spare, more `learner_devices` help too; an agent whose gradient steps per update
grow with the update's env steps, as SAC's `replay_ratio` makes them, needs a lower ratio
or more learner devices instead); queue-bound, a longer `steps_per_cycle`
(the same transfers carry more env steps).

Undetermined (no verdict, never an error): no wall time, or no seconds yet from either
side (live counters before the first cycle or update). A run with `learn=False` has no
update stages: its learner only takes trajectories, so its verdict names the threads'
bound. Stage times are wall times per thread: a thread waiting for the GIL counts the
wait in the stage it is in, and each process of a multi-process run judges its own
stages (a learner waiting in a collective for another process counts it as optimize).
Stage names this module does not know are left out.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Mapping
from typing import Literal

Kind = Literal["env", "inference", "learner", "queue", "undetermined"]

# Where each side waits for the other.
LEARNER_WAITS = ("queue_get",)
INFERENCERS_WAIT = ("queue_put", "wait_for_networks")
# The inferencer threads' work, by the bound it names.
INFERENCER_WORK: dict[str, tuple[str, ...]] = {
    "env": ("env_step",),
    "inference": ("dispatch", "inference", "record"),
    "queue": ("shard",),
}
LEARNER_WORK = ("update_experience", "optimize")
INFERENCER_STAGES = INFERENCERS_WAIT + tuple(s for v in INFERENCER_WORK.values() for s in v)
LEARNER_STAGES = LEARNER_WAITS + LEARNER_WORK

# A learner waiting for trajectories less than this share of the wall time is saturated:
# it bounds the run whatever the threads do (and stage times are too coarse to say more).
LEARNER_SATURATED = 0.05

ADVICE: dict[str, str] = {
    "env": "try a larger async_factor: more env groups per inference device stepping at "
           "once (it helps envs whose steps release the GIL: worker processes, EnvPool)",
    "inference": "try more envs_per_group: each acting call then acts for more envs, at "
                 "little more cost on an accelerator",
    "learner": "try a larger trajectories_per_update: each update then learns from more "
               "env steps at once, spreading its cost over them (where an agent's "
               "gradient steps grow with its env steps, as SAC's replay_ratio makes them, "
               "a lower ratio or more learner_devices instead)",
    "queue": "try a longer steps_per_cycle: the same transfers to the learner devices then "
             "carry more env steps",
}

_NAMES = {"env": "the envs", "inference": "inference", "learner": "the learner",
          "queue": "the queue (the hand-off of trajectories to the learner devices)"}


@dataclasses.dataclass(frozen=True)
class Bottleneck:
    """A run's verdict.

    Attributes:
      kind: "env", "inference", "learner", "queue", or "undetermined".
      share: the fraction of the wall time behind the verdict: of the inferencer threads'
        time (per thread) for env, inference and queue; of the learner's for learner; 0
        when undetermined.
      advice: one sentence naming the setting most likely to help ("" when undetermined).
      evidence: what the share measures, in words (or why there is no verdict).
    """

    kind: Kind
    share: float
    advice: str
    evidence: str

    def line(self) -> str:
        """One line for a run's summary."""
        if self.kind == "undetermined":
            return f"bottleneck undetermined: {self.evidence}"
        return f"bound by {_NAMES[self.kind]}: {self.evidence}; {self.advice}"

    def short(self) -> str:
        """A few characters for a progress bar: "env 81%", or "?" when undetermined."""
        return "?" if self.kind == "undetermined" else f"{self.kind} {self.share:.0%}"

    def as_dict(self) -> dict[str, str | float]:
        return {"kind": self.kind, "share": round(self.share, 3), "advice": self.advice}


def undetermined(why: str) -> Bottleneck:
    return Bottleneck("undetermined", 0.0, "", why)


def diagnose(stage_seconds: Mapping[str, float], wall_seconds: float,
             inferencer_threads: int | None = None) -> Bottleneck:
    """The bound of a run (or of a run so far) from its stage seconds (summed over
    threads), its wall seconds and its inferencer threads (None: the threads' time is the
    seconds their stages account for); the rules are the module's."""
    _check(stage_seconds, wall_seconds, inferencer_threads)
    if wall_seconds == 0:
        return undetermined("no wall time")
    seconds = {s: float(stage_seconds.get(s, 0.0)) for s in INFERENCER_STAGES + LEARNER_STAGES}
    accounted = sum(seconds[s] for s in INFERENCER_STAGES)
    if accounted == 0:
        return undetermined("the inferencer threads have recorded no stage yet")
    if sum(seconds[s] for s in LEARNER_STAGES) == 0:
        return undetermined("the learner has taken no trajectory yet")
    threads_time = inferencer_threads * wall_seconds if inferencer_threads else accounted

    def of_wall(stages: tuple[str, ...]) -> float:
        return min(1.0, sum(seconds[s] for s in stages) / wall_seconds)

    def of_threads(stages: tuple[str, ...]) -> float:
        return min(1.0, sum(seconds[s] for s in stages) / threads_time)

    learner_waits, threads_wait = of_wall(LEARNER_WAITS), of_threads(INFERENCERS_WAIT)
    if learner_waits <= max(threads_wait, LEARNER_SATURATED):
        busy = 1.0 - learner_waits
        return Bottleneck("learner", busy, ADVICE["learner"],
                          f"the learner was busy {busy:.0%} of the wall time (updating "
                          f"{of_wall(LEARNER_WORK):.0%}) and the inferencer threads waited "
                          f"for it {threads_wait:.0%} of theirs")
    work = {kind: of_threads(stages) for kind, stages in INFERENCER_WORK.items()}
    kind = max(work, key=work.__getitem__)
    doing = {"env": "stepping envs", "inference": "acting (inference and recording)",
             "queue": "moving trajectories to the learner devices"}[kind]
    return Bottleneck(kind, work[kind], ADVICE[kind],
                      f"the inferencer threads spent {work[kind]:.0%} of their time "
                      f"{doing}, and the learner waited for trajectories "
                      f"{learner_waits:.0%} of the wall time")


class Tracker:
    """The verdict of a run so far, for a progress bar: call it with the live
    `Accounting.stage_seconds` (e.g. from `on_update`'s `UpdateInfo.accounting`) to get
    `diagnose` of the stage seconds and wall time since its first call. Starting there
    leaves out what precedes it (compiling, the first update's wait for the first
    trajectory); the threads' time is what their stages account for, which trails the
    clock by each thread's cycle in progress."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self._clock = clock
        self._start: tuple[float, dict[str, float]] | None = None

    def __call__(self, stage_seconds: Mapping[str, float]) -> Bottleneck:
        # One C-level copy under the GIL: the threads add to the dict meanwhile, and
        # iterating it in Python could see it change size.
        now, seconds = self._clock(), dict(stage_seconds)
        # A stage behind its start: the figures of another run (one tracker, two runs).
        if self._start is None or any(v < self._start[1].get(s, 0.0)
                                      for s, v in seconds.items()):
            self._start = (now, seconds)
            return undetermined("no wall time")
        start, before = self._start
        return diagnose({s: v - before.get(s, 0.0) for s, v in seconds.items()}, now - start)


def _check(stage_seconds: Mapping[str, float], wall_seconds: float,
           inferencer_threads: int | None) -> None:
    if not _finite_non_negative(wall_seconds):
        raise ValueError(f"wall_seconds must be a finite number >= 0, got {wall_seconds!r}")
    if inferencer_threads is not None and (
            isinstance(inferencer_threads, bool) or not isinstance(inferencer_threads, int)
            or inferencer_threads < 1):
        raise ValueError(
            f"inferencer_threads must be an int >= 1 or None, got {inferencer_threads!r}")
    for stage, s in stage_seconds.items():
        if not _finite_non_negative(s):
            raise ValueError(f"stage_seconds[{stage!r}] must be a finite number of seconds "
                             f">= 0, got {s!r}")


def _finite_non_negative(x: object) -> bool:
    return (isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)
            and x >= 0)
