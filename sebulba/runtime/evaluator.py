"""Evaluation during training: a thread with its own envs, off the hot path.

    Learner --offer(update, env steps, acting nets)--> deque --> evaluator thread
    evaluator thread --Evaluation--> Accounting.evaluations --> on_update, RunResult

The learner offers the networks it just published every `eval_every_updates` updates;
an offer never waits: it is passed over while an evaluation is under way, and declined
while the evaluations' env steps, the next one's estimated from the longest training
episode, would pass `eval_max_share` of the training's (this process's: only process 0
evaluates, and the others wait for it at the learner's collectives), so evaluation costs
its own work and never a wait. An evaluation that runs past that share (a policy whose
episodes outlast the estimate, or never end) is abandoned, not reported, and the next
one waits for twice the env steps it had taken. A resumed run counts the share from its
own start, plus one evaluation's worth where the training before it allows that much: a
run preempted and resumed every few hundred thousand steps still evaluates. The thread
runs `eval_episodes` complete episodes (`sebulba.evaluation.EpisodeRunner`) per
evaluation, on envs of its own made like the run's, and every `eval_video_every`-th
evaluation records one more episode to `eval_video_dir`. An error in it stops the run
like any thread's.
"""

from __future__ import annotations

import collections
import dataclasses
import sys
import threading
import time

import jax
import numpy as np

from sebulba.agent import Agent
from sebulba.config import Config
from sebulba.envs import registry
from sebulba.envs.base import close_quietly
from sebulba.evaluation import EpisodeRunner, EvaluationResult, VideoRecorder, save_video
from sebulba.runtime.channels import POLL_SECONDS, ErrorBox
from sebulba.types import Nets

# How long `close` waits, beyond its timeout, for a video being written when the run
# ends (encoding cannot be interrupted, and the last evaluation's video is worth a wait).
VIDEO_WRITE_TIMEOUT_S = 120.0

# Evaluation envs are seeded from the run's seed plus this (then each evaluation's own
# seeds): apart from the training envs' first seeds (`Sebulba._env_seed`), which move on
# with each resume, until a resume's draw passes a million of them (then a training env
# may start from an evaluation's seed: the same first episode, no more).
EVAL_SEED = 1_000_003


@dataclasses.dataclass(frozen=True)
class Evaluation:
    """One evaluation of the networks published after `learner_update`.

    Attributes:
      learner_update: the learner update whose networks were evaluated.
      env_steps: the run's env steps consumed (all processes) when they were published,
        counted from this run's start (a resumed run's curves add the steps before it:
        `Reporter`'s step offset).
      result: the episodes' returns and lengths.
      seconds: how long the evaluation took.
      video: the path of the episode recorded after it, if any.
      video_frames: that episode's frames [T, H, W, 3] uint8 (for trackers), if any.
      video_fps: their frame rate.
    """

    learner_update: int
    env_steps: int
    result: EvaluationResult
    seconds: float
    video: str | None = None
    video_frames: np.ndarray | None = dataclasses.field(default=None, repr=False)
    video_fps: int = 30

    def scalars(self) -> dict[str, float]:
        """The figures every metric sink gets, under `eval/`."""
        d = self.result.as_dict()
        out = {"eval/return": d["mean_return"], "eval/return_std": d["std_return"],
               "eval/episodes": d["episodes"], "eval/length": d["mean_length"],
               "eval/learner_update": self.learner_update, "eval/seconds": self.seconds}
        if self.result.agent_returns:  # multi-agent: returns are the team's
            out["eval/team_return"] = out["eval/return"]
            out["eval/return"] = d["mean_agent_return"]
            out.update({f"eval/return/{agent}": r
                        for agent, r in d["mean_return_by_agent"].items()})
        return out


class Evaluator:
    """Evaluates networks the learner offers, on a thread of its own (see the module).

    `start()` starts the thread; `close()` ends it (an evaluation under way is
    abandoned) and closes its envs. `take()` returns the evaluations finished since the
    last call; `abandoned` counts those given up for running past the share,
    `passed_over` the due offers not taken (over the share, or before any training
    episode had ended). `steps_before`: this process's training env steps before this
    run (a resumed run's).
    """

    def __init__(self, agent: Agent, config: Config, device: jax.Device, errors: ErrorBox,
                 halt: threading.Event, steps_before: int = 0):
        self.config, self.device = config, device
        self._steps_before = steps_before
        self._credit: float | None = None  # set at the first estimate (`offer`)
        self._errors, self._halt = errors, halt
        kind = config.vectorization
        vectorization = registry.get(kind).evaluate_as
        if vectorization is None:  # Config refuses it; a direct caller may not have
            raise ValueError(f"vectorization {kind!r} does not support evaluation")
        # Its envs are made like the run's, seeded apart from every training env's, and
        # never desynchronized: a first episode cut short would be a biased sample.
        request = dataclasses.replace(config.source_request(1, config.seed + EVAL_SEED),
                                      group_size=config.eval_episodes, desync_episodes=False)
        self._sources = registry.get(vectorization).make_sources(request)
        self._video = None
        try:
            self.runner = EpisodeRunner(agent, _one(self._sources), greedy=config.eval_greedy,
                                        name="the evaluator")
            if config.eval_video_dir is not None:
                self._video = VideoRecorder(agent, vectorization, request,
                                            greedy=config.eval_greedy)
        except BaseException:
            self._close_envs()
            raise
        self._offered: collections.deque[tuple[int, int, Nets]] = collections.deque()
        self._done: collections.deque[Evaluation] = collections.deque()
        self._evaluations = 0
        self._last_steps = 0  # the env steps of the last evaluation (its video included)
        self._busy = False  # networks taken and not evaluated yet
        self._last_taken = -1  # the learner update of the networks taken last
        self._allowed = 0.0  # the evaluator's env steps the share allows, at the last offer
        self._abandon = threading.Event()  # set by `offer`: the evaluation under way is over
        self._stop = _AnyOf(halt, self._abandon)
        self.abandoned = 0
        self.passed_over = 0
        self.videos_cut = 0  # videos stopped by the share, their evaluations kept
        self.cut = 0  # evaluations under way when the run ended: their steps counted
        self.writing_video = False  # in `save_video`, which cannot be interrupted
        self.thread = threading.Thread(target=self._main, name="sebulba-evaluator", daemon=True)

    @property
    def env_steps(self) -> int:
        """Env steps the evaluator took (agent steps for multi-agent envs)."""
        return self.runner.env_steps + (self._video.runner.env_steps if self._video else 0)

    def start(self) -> None:
        self.thread.start()

    def offer(self, learner_update: int, env_steps: int, acting_nets: Nets,
              longest_episode: int, own_env_steps: int) -> bool:
        """Hands networks to evaluate (copied to the evaluator's device, asynchronously);
        never waits. Taken only every `eval_every_updates` updates, once per update
        (networks that did not change since are not evaluated again), while no
        evaluation is under way, and when the evaluations' env steps would stay within
        `eval_max_share` of `own_env_steps`, this process's training env steps; whether
        taken. `env_steps`, the run's (every process's), dates the evaluation.

        Called after every learner update: an evaluation under way that has passed the
        share is abandoned here.

        The next evaluation is estimated at the larger of the last one's env steps and
        its envs (rows; with the video env's where it records an episode) times
        `longest_episode`, the longest training episode so far: an evaluation steps every
        env until its longest episode ends. Before any training episode has ended there
        is no estimate, and nothing is taken. A resumed run may take one evaluation's
        worth more than its own share, as far as the training before it allows."""
        cfg = self.config
        self._allowed = cfg.eval_max_share * own_env_steps + (self._credit or 0.0)
        if self._busy:
            if self.env_steps > self._allowed:
                self._abandon.set()
            return False
        if learner_update % cfg.eval_every_updates or learner_update == self._last_taken:
            return False
        rows = self.runner.source.num_envs
        if self._video is not None and self._evaluations % cfg.eval_video_every == 0:
            rows += self._video.runner.source.num_envs  # the episode recorded after it
        estimate = max(self._last_steps, rows * longest_episode)
        if self._credit is None and estimate:
            self._credit = min(cfg.eval_max_share * self._steps_before, estimate)
            self._allowed += self._credit
        if not estimate or self.env_steps + estimate > self._allowed:
            self.passed_over += 1
            return False
        self._busy, self._last_taken = True, learner_update  # busy until evaluated
        self._offered.append((learner_update, env_steps,
                              jax.device_put(acting_nets, self.device)))
        return True

    def take(self) -> list[Evaluation]:
        """The evaluations finished since the last call, oldest first."""
        taken = []
        while self._done:
            taken.append(self._done.popleft())
        return taken

    def close(self, timeout_s: float) -> bool:
        """Ends the thread (it polls the run's halt event) and closes the envs; whether
        the thread ended within `timeout_s` (or, writing a video, within
        `VIDEO_WRITE_TIMEOUT_S` more)."""
        self._halt.set()
        if self.thread.ident is not None:
            self.thread.join(timeout_s)
            if self.thread.is_alive() and self.writing_video:
                self.thread.join(VIDEO_WRITE_TIMEOUT_S)
        ended = not self.thread.is_alive()
        if ended:  # a thread stuck in an env step keeps its envs (closing could block)
            self._close_envs()
        return ended

    def _main(self) -> None:
        try:
            while not self._halt.is_set():
                if not self._offered:
                    time.sleep(POLL_SECONDS)
                    continue
                evaluation = self._evaluate(*self._offered.popleft())
                if evaluation is not None:
                    self._done.append(evaluation)
                self._busy = False
        except BaseException as e:  # noqa: BLE001 - stops the run, re-raised in the caller
            self._errors.report(e)

    def _evaluate(self, learner_update: int, env_steps: int, nets: Nets) -> Evaluation | None:
        cfg, start_steps, t0 = self.config, self.env_steps, time.perf_counter()
        self._abandon.clear()  # an offer may have set it as the last evaluation ended
        # env i of evaluation e starts from seed base + e x envs + i: no two share one
        seed = cfg.seed + EVAL_SEED + self._evaluations * self.runner.source.num_envs
        # No step limit of its own: the share bounds it (`offer` abandons it).
        result = self.runner.run(nets, cfg.eval_episodes, seed, stop=self._stop,
                                 max_env_steps=sys.maxsize)
        if result is None:
            if self._halt.is_set():
                self.cut += 1
            else:
                self._abandoned(start_steps)
            return None
        seconds = time.perf_counter() - t0
        video = frames = None
        if self._video is not None and self._evaluations % cfg.eval_video_every == 0:
            recorded = self._video.record(nets, seed, stop=self._stop,
                                          max_env_steps=sys.maxsize)
            if recorded is not None:  # else the episodes stand, without their video
                frames = recorded[0]
                self.writing_video = True
                try:
                    video = save_video(frames, cfg.eval_video_dir,
                                       f"update_{learner_update:08d}", self._video.fps)
                finally:
                    self.writing_video = False
            elif not self._halt.is_set():  # the share ran out during the video: say so
                self.videos_cut += 1
        self._evaluations += 1
        self._last_steps = self.env_steps - start_steps
        return Evaluation(learner_update, env_steps, result, seconds, video, frames,
                          self._video.fps if self._video is not None else 30)

    def _abandoned(self, start_steps: int) -> None:
        """An evaluation ran past the share: the next waits for twice its env steps (an
        estimate that doubles until one fits, so that the abandoned ones cost at most
        about as much as the one that finishes)."""
        self.abandoned += 1
        self._last_steps = max(self._last_steps, 2 * (self.env_steps - start_steps))

    def _close_envs(self) -> None:
        """Closes every env of the evaluator; an error in a close is logged, not raised:
        the run has ended (or is ending with an error of its own, which it would hide)."""
        close_quietly([*self._sources, *([self._video] if self._video is not None else [])],
                      "the evaluator's envs")


class _AnyOf:
    """Set when any of its events is (a `stop` for `EpisodeRunner.run`)."""

    def __init__(self, *events: threading.Event):
        self._events = events

    def is_set(self) -> bool:
        return any(e.is_set() for e in self._events)


def _one(sources: list) -> object:
    if len(sources) != 1:
        close_quietly(sources)
        raise ValueError(f"the evaluator drives one env source, its kind made {len(sources)}")
    return sources[0]
