"""Counting env steps, episodes, policy lag and where the time went.

Invariant at the end of a run: env_steps == consumed + dropped + in_flight, where
in_flight counts the steps still queued, in unfinished inference cycles, or popped by
a learner update that did not finish. Each term is counted where it happens, so the
identity is a check, not a definition.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import threading
import time
from typing import Any

import numpy as np

from sebulba.runtime.bottleneck import Bottleneck, diagnose
from sebulba.types import AgentState

# Per-episode and per-trajectory records kept, the most recent ones: a run of days would
# otherwise grow them by one entry per episode and per trajectory. Totals, sums and maxima
# are kept over the whole run.
EPISODE_WINDOW = 100_000
LAG_WINDOW = 100_000


class Accounting:
    """Thread-safe counters shared by the inferencer threads and the learner.

    The live source of `RunResult`'s figures (`UpdateInfo.accounting` during a run), in
    env steps of this process (agent steps with several agents per env):

    Attributes:
      env_steps: env steps taken by the env groups so far (an autoreset, the step after
        an episode ends, included; an env's first reset is not a step).
      consumed: env steps in the trajectories the learner has taken.
      dropped: env steps in trajectories dropped from a full queue.
      trajectories_consumed, trajectories_dropped: the same, in trajectories (one env
        group's cycle each).
      episodes, episodes_total: (env_steps when counted, return, length) of the most
        recent episodes; all of the run's, counted.
      longest_episode: the run's longest episode, in env steps.
      policy_lags, lag_sum, lag_max: policy lag (learner updates) of the most recent
        consumed trajectories; its sum and maximum over the run.
      stage_seconds: seconds per stage, summed over threads (`RunResult.stage_seconds`).
      padding_steps, team_episodes, team_episodes_total: multi-agent envs' padding rows
        and env (team) episodes (`RunResult.padding_steps`, `RunResult.team_episodes`).

    Memory is bounded: `episodes`, `team_episodes` and `policy_lags` hold the most recent
    `EPISODE_WINDOW` / `LAG_WINDOW` records; `episodes_total`, `team_episodes_total`,
    `lag_sum` and `lag_max` cover the whole run.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self.env_steps = 0
        self.consumed = 0
        self.dropped = 0
        self.trajectories_consumed = 0
        self.trajectories_dropped = 0
        # (env_steps when counted, return, length) of the most recent episodes
        self.episodes: collections.deque[tuple[int, float, int]] = collections.deque(
            maxlen=EPISODE_WINDOW)
        self.episodes_total = 0
        self.longest_episode = 0  # of the whole run, in env steps (agent steps)
        self.policy_lags: collections.deque[int] = collections.deque(maxlen=LAG_WINDOW)
        self.lag_sum = 0
        self.lag_max = 0
        self.stage_seconds: dict[str, float] = collections.defaultdict(float)
        # multi-agent envs: steps of agents that had left their env's episode, and the
        # (env_steps at its end, team return, length) of the most recent env episodes
        self.padding_steps = 0
        self.team_episodes: collections.deque[tuple[int, float, int]] = collections.deque(
            maxlen=EPISODE_WINDOW)
        self.team_episodes_total = 0

    def add_env_steps(self, n: int) -> None:
        with self._lock:
            self.env_steps += n

    def add_episodes(self, ended: list[tuple[float, int]]) -> None:
        """(return, length) of episodes that ended, stamped with the env steps so far."""
        if not ended:
            return
        with self._lock:
            for ret, length in ended:
                self.episodes.append((self.env_steps, ret, length))
                self.longest_episode = max(self.longest_episode, length)
            self.episodes_total += len(ended)

    def add_team_episodes(self, padding_steps: int, ended: list[tuple[float, int]]) -> None:
        with self._lock:
            self.padding_steps += padding_steps
            for ret, length in ended:
                self.team_episodes.append((self.env_steps, ret, length))
            self.team_episodes_total += len(ended)

    def add_consumed(self, n: int, policy_lag: int) -> None:
        with self._lock:
            self.consumed += n
            self.trajectories_consumed += 1
            self.policy_lags.append(policy_lag)
            self.lag_sum += policy_lag
            self.lag_max = max(self.lag_max, policy_lag)

    def add_dropped(self, n: int) -> None:
        with self._lock:
            self.dropped += n
            self.trajectories_dropped += 1

    def add_time(self, stage: str, seconds: float) -> None:
        with self._lock:
            self.stage_seconds[stage] += seconds

    def recent_episodes(self, since_total: int) -> list[tuple[int, float, int]]:
        """The episodes that ended after the first `since_total` of the run (at most the
        window), copied under the lock (the inferencers append meanwhile)."""
        return self.episodes_since(since_total)[0]

    def episodes_since(self, since_total: int) -> tuple[list[tuple[int, float, int]], int]:
        """(`recent_episodes(since_total)`, `episodes_total`) read together under the lock:
        the next call passes that total, so that no episode is missed or counted twice
        (reading the total apart would skip the episodes that end in between)."""
        with self._lock:
            return _since(self.episodes, self.episodes_total, since_total)

    def team_episodes_since(self, since_total: int) -> tuple[list[tuple[int, float, int]], int]:
        """`episodes_since` of the env (team) episodes of a multi-agent env: those after
        the first `since_total` of the run (at most the window), and
        `team_episodes_total`."""
        with self._lock:
            return _since(self.team_episodes, self.team_episodes_total, since_total)

    def snapshot(self) -> tuple[list[tuple[int, float, int]], list[int]]:
        """(episodes, policy lags) of the windows, copied under the lock."""
        with self._lock:
            return list(self.episodes), list(self.policy_lags)


def _since(window: collections.deque[tuple[int, float, int]], total: int,
           since_total: int) -> tuple[list[tuple[int, float, int]], int]:
    """The records of `window` (the most recent of `total`) after the first `since_total`,
    and `total`; the caller holds the lock."""
    new = min(total - since_total, len(window))
    return (list(window)[len(window) - new:] if new > 0 else []), total


class StageClock:
    """Accumulates time per stage locally; merged into `Accounting` once per cycle."""

    def __init__(self):
        self.seconds: dict[str, float] = collections.defaultdict(float)
        self._last = time.perf_counter()

    def lap(self, stage: str) -> None:
        now = time.perf_counter()
        self.seconds[stage] += now - self._last
        self._last = now

    def flush_into(self, accounting: Accounting) -> None:
        for stage, s in self.seconds.items():
            accounting.add_time(stage, s)
        self.seconds.clear()


@dataclasses.dataclass
class RunResult:
    """What `Sebulba.run` returns.

    Attributes:
      env_steps: env steps taken by this process's env groups (an autoreset, the step
        after an episode ends, included; an env's first reset is not a step).
      consumed: env steps the learner learnt from (this process's; `global_consumed`
        is the run's).
      dropped: env steps in trajectories dropped from a full queue (`drop_when_full`).
      in_flight: env steps acted but not consumed when the run ended: in open cycles,
        the queue, or taken by the learner for an update it did not make.
      wall_seconds: from the inferencer threads' start to the end of the learner's last
        update (the shutdown after it, and `on_stop`, not counted).
      timed_env_steps: the env steps taken within `wall_seconds` (`steps_per_second`'s);
        None: all of `env_steps` (a run that raised).
      episodes: (env_steps when it was counted, return, length) of the completed
        episodes, the most recent `EPISODE_WINDOW` of them (`episodes_total` counts
        all). An in-order loop counts the episodes that ended when it pushes a cycle (and
        the last ones when it stops), the by-id loop after each batch.
      policy_lags: per consumed trajectory (the most recent `LAG_WINDOW`), in learner
        updates: the learner's updates when it consumed the trajectory minus its updates
        when it published the networks that acted (0: the freshest networks possible).
      stage_seconds: seconds per stage, summed over threads. The inferencers':
        env_step, dispatch (starting the acting call: its inputs copied in, the copy of
        its outputs to the host started), inference (waiting for its action), record
        (writing steps into the cycle's host buffers), shard (the trajectory to the
        learner devices), queue_put (waiting for room), wait_for_networks (lockstep
        acting waiting for the learner). The learner's: queue_get (waiting for
        trajectories), update_experience, optimize.
      learner_updates: learner updates of this run (one update_experience each, on
        `trajectories_per_update` trajectories joined; the unit of policy lag); a
        resumed run's learner version is its `run(learner_updates=)` plus these.
      optimizer_steps: optimizer (gradient) steps run: learner_updates x
        `Agent.optimizer_steps_per_update(layout)` (`num_off_policy_optims_per_cycle()`
        unless the agent derives it from the layout), the steps of updates that
        `Agent.ready_to_learn` held back included, less `optimizer_steps_cut`.
      optimizer_steps_cut: optimizer steps left out of a last update cut short to stop
        by a stop event's deadline (see `Sebulba.run`'s `stop`).
      metrics: the learner's last metrics (floats).
      state: final AgentState (nets, opt, experience of the first learner device; the
        step state of this process's envs).
      learner_experience: every learner device's experience, leaves [num_learners, ...].
      agents_per_env: K of a multi-agent env (1 otherwise). With K > 1 every step count
        above counts agent steps (rows: K per env step), `episodes` are agents' episodes,
        and `team_steps` counts env steps.
      padding_steps: agent steps of agents that had left their env's episode before the
        others (part of `env_steps`; masked out of every loss).
      team_episodes: (env_steps when it was counted, team return: the sum of the env's
        agents' returns, length in env steps) of the most recent `EPISODE_WINDOW` env
        episodes (multi-agent only; `team_episodes_total` counts all), counted with the
        agents' `episodes`, so that both are stamped alike.
      stopped_early: the run ended on its `stop` event before consuming its steps.
      inferencer_threads: this process's inferencer threads (their stages' seconds are
        summed over them).
      evaluations: the evaluations during training (`Config.eval_every_updates`),
        oldest first (`sebulba.runtime.evaluator.Evaluation`); their videos' frames are
        dropped, but for those that finished after the last update (no `on_update` carried
        them), which `metrics.Reporter.finish` writes and then drops.
      evaluator_env_steps: env steps the evaluator took (not part of `env_steps`),
        those of abandoned evaluations included.
      evaluations_abandoned: evaluations given up for running past
        `Config.eval_max_share` (their networks' episodes outlasted the estimate).
      evaluation_videos_cut: evaluations kept without the video due with them
        (`Config.eval_video_every`), whose recording ran past `Config.eval_max_share`.
      evaluations_passed_over: evaluations due (every `Config.eval_every_updates`) and
        not taken, while none was under way: the next one's estimated env steps would
        have passed `Config.eval_max_share`, or no training episode had ended yet.
      evaluations_cut: evaluations under way when the run ended, stopped with it (their
        env steps are in `evaluator_env_steps`).
      episodes_total: the run's completed episodes, all counted.
      lag_count, lag_sum, lag_max: trajectories consumed over the whole run, and the sum
        and maximum of their policy lags (`policy_lags` keeps only the most recent).
      num_processes: processes of the run (1 unless distributed).
    """

    env_steps: int
    consumed: int
    dropped: int
    in_flight: int
    wall_seconds: float
    episodes: list[tuple[int, float, int]]
    policy_lags: list[int]
    stage_seconds: dict[str, float]
    learner_updates: int
    metrics: dict[str, float]
    optimizer_steps: int = 0
    optimizer_steps_cut: int = 0
    episodes_total: int = 0
    lag_count: int = 0
    lag_sum: int = 0
    lag_max: int = 0
    num_processes: int = 1
    state: AgentState | None = None
    learner_experience: Any = None
    agents_per_env: int = 1
    padding_steps: int = 0
    team_episodes: list[tuple[int, float, int]] = dataclasses.field(default_factory=list)
    stopped_early: bool = False
    team_episodes_total: int = 0
    inferencer_threads: int = 1
    evaluations: list[Any] = dataclasses.field(default_factory=list)
    evaluator_env_steps: int = 0
    evaluations_abandoned: int = 0
    evaluation_videos_cut: int = 0
    evaluations_passed_over: int = 0
    evaluations_cut: int = 0
    timed_env_steps: int | None = None

    @property
    def team_steps(self) -> int:
        """Env steps of this process's envs (agent steps / agents_per_env)."""
        return self.env_steps // self.agents_per_env

    @property
    def global_consumed(self) -> int:
        """Consumed by the learner over all processes (each consumes the same)."""
        return self.consumed * self.num_processes

    @property
    def steps_per_second(self) -> float:
        """Env steps this process's envs took per second of `wall_seconds` (agent steps
        for multi-agent envs; 0.0 for a run of no wall time)."""
        steps = self.env_steps if self.timed_env_steps is None else self.timed_env_steps
        return steps / self.wall_seconds if self.wall_seconds > 0 else 0.0

    @property
    def consumed_steps_per_second(self) -> float:
        """Env steps this process's learner consumed per second of `wall_seconds`."""
        return self.consumed / self.wall_seconds if self.wall_seconds > 0 else 0.0

    def mean_return(self, start_frac: float = 0.0, end_frac: float = 1.0) -> float:
        """Mean return (float; NaN if none) of the episodes that ended while the run's
        env steps were within [start_frac, end_frac) of `env_steps` (fractions in
        [0, 1]: `mean_return(0.9)` is the last 10%), of those in the window (the last
        `EPISODE_WINDOW` episodes)."""
        return _mean_return(self.episodes, self.env_steps, start_frac, end_frac)

    def mean_team_return(self, start_frac: float = 0.0, end_frac: float = 1.0) -> float:
        """`mean_return` of the env episodes' team returns (multi-agent runs)."""
        return _mean_return(self.team_episodes, self.env_steps, start_frac, end_frac)

    def as_dict(self) -> dict[str, Any]:
        """Plain figures (no arrays), ready for json.dumps."""
        lag_count = max(self.lag_count, len(self.policy_lags))
        lag_sum = self.lag_sum if self.lag_count else sum(self.policy_lags)
        lag_max = self.lag_max if self.lag_count else max(self.policy_lags, default=0)
        return {
            "env_steps": self.env_steps,
            "consumed": self.consumed,
            "num_processes": self.num_processes,
            "global_consumed": self.global_consumed,
            "dropped": self.dropped,
            "in_flight": self.in_flight,
            "wall_seconds": round(self.wall_seconds, 3),
            "steps_per_second": round(self.steps_per_second, 1),
            "global_consumed_steps_per_second": round(
                self.global_consumed / self.wall_seconds if self.wall_seconds > 0 else 0.0, 1),
            "episodes": max(self.episodes_total, len(self.episodes)),
            "mean_return_last_10pct": self.mean_return(0.9, 1.0),
            "policy_lag_mean": lag_sum / max(lag_count, 1),
            "policy_lag_max": lag_max,
            "learner_updates": self.learner_updates,
            "optimizer_steps": self.optimizer_steps,
            **({"optimizer_steps_cut": self.optimizer_steps_cut}
               if self.optimizer_steps_cut else {}),
            "stopped_early": self.stopped_early,
            "stage_seconds": {k: round(v, 3) for k, v in sorted(self.stage_seconds.items())},
            "bottleneck": self.bottleneck().as_dict(),
            "metrics": self.metrics,
            **({"agents_per_env": self.agents_per_env,
                "team_steps": self.team_steps,
                "team_steps_per_second": round(self.steps_per_second / self.agents_per_env, 1),
                "padding_steps": self.padding_steps,
                "team_episodes": max(self.team_episodes_total, len(self.team_episodes)),
                "mean_team_return_last_10pct": self.mean_team_return(0.9, 1.0)}
               if self.agents_per_env > 1 else {}),
            **({"evaluations": len(self.evaluations),
                "evaluator_env_steps": self.evaluator_env_steps,
                "evaluations_abandoned": self.evaluations_abandoned,
                "evaluation_videos_cut": self.evaluation_videos_cut,
                "evaluations_passed_over": self.evaluations_passed_over,
                "evaluations_cut": self.evaluations_cut,
                "last_evaluation": self.evaluations[-1].scalars() if self.evaluations
                else None}
               if self.evaluations or self.evaluator_env_steps
               or self.evaluations_passed_over else {}),
        }

    def bottleneck(self) -> Bottleneck:
        """What bounded the run, from its stage times (`sebulba.runtime.bottleneck`)."""
        return diagnose(self.stage_seconds, self.wall_seconds, self.inferencer_threads)

    def summary(self) -> str:
        d = self.as_dict()
        unit = "agent steps" if self.agents_per_env > 1 else "env steps"
        stages = ", ".join(f"{k} {v:.2f}s" for k, v in d["stage_seconds"].items())
        return "\n".join([
            f"{unit} {d['env_steps']:,} = consumed {d['consumed']:,} + dropped "
            f"{d['dropped']:,} + in flight {d['in_flight']:,}",
            f"{d['wall_seconds']:.1f}s, {d['steps_per_second']:,.0f} {unit}/s, "
            f"{d['learner_updates']} learner updates"
            + (f" (the last cut short by {self.optimizer_steps_cut} optimizer steps to "
               "stop in time)" if self.optimizer_steps_cut else ""),
            f"{d['episodes']} episodes, mean return (last 10%) {d['mean_return_last_10pct']:.4g}",
            f"policy lag mean {d['policy_lag_mean']:.2f}, max {d['policy_lag_max']}",
            f"time by stage (summed over threads): {stages}",
            self.bottleneck().line(),
            *([self._evaluations_line()] if "evaluations" in d else []),
            *([f"{d['agents_per_env']} agents per env: {d['team_steps']:,} env steps, "
               f"{d['padding_steps']:,} padding agent steps, {d['team_episodes']} env "
               f"episodes, mean team return (last 10%) {d['mean_team_return_last_10pct']:.4g}"]
              if "agents_per_env" in d else []),
            f"last metrics: {json.dumps(d['metrics'])}",
        ])


    def _evaluations_line(self) -> str:
        share = self.evaluator_env_steps / max(self.env_steps, 1)
        line = (f"{len(self.evaluations)} evaluations during training, "
                f"{self.evaluator_env_steps:,} env steps ({share:.1%} of training's)")
        if self.evaluations_abandoned:
            line += (f", {self.evaluations_abandoned} more abandoned for running past "
                     "eval_max_share")
        if self.evaluations_cut:
            line += f", {self.evaluations_cut} more cut short by the run's end"
        if not self.evaluations and self.evaluations_passed_over:
            line += (f"; {self.evaluations_passed_over} were due and passed over: the next "
                     "one's estimated env steps (eval_episodes envs x the longest training "
                     "episode) would have passed eval_max_share, or no training episode "
                     "had ended (a longer run, a larger eval_max_share or fewer "
                     "eval_episodes)")
        if self.evaluation_videos_cut:
            line += (f", {self.evaluation_videos_cut} kept without the video due then (the "
                     "recording ran past eval_max_share)")
        if self.evaluations:
            last = self.evaluations[-1]
            scalars = last.scalars()  # eval/return: an agent's, as the sinks get it
            team = (f" (team {scalars['eval/team_return']:.4g})"
                    if "eval/team_return" in scalars else "")
            line += (f"; the last, of update {last.learner_update}: mean return "
                     f"{scalars['eval/return']:.4g}{team} over {len(last.result.returns)} "
                     "episodes")
        return line


def _mean_return(episodes: list[tuple[int, float, int]], env_steps: int, start_frac: float,
                 end_frac: float) -> float:
    lo, hi = start_frac * env_steps, end_frac * env_steps
    rets = [r for s, r, _ in episodes if lo <= s < hi or (end_frac == 1 and s == hi)]
    return float(np.mean(rets)) if rets else float("nan")
