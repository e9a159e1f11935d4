"""Where run metrics go: TensorBoard event files, JSON lines, Weights & Biases, a
progress bar.

`MetricWriter` is the one interface: `write(step, scalars)` and `close()`. Writers are
cheap to combine (`MultiWriter`); `Reporter` turns the loop's `on_update` calls into
periodic writes (evaluations as they finish, with their videos) and a live tqdm bar:
one reporter feeds every sink.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, NamedTuple, Protocol

import numpy as np

from sebulba import plot
from sebulba.runtime import bottleneck
from sebulba.runtime.accounting import Accounting, RunResult
from sebulba.runtime.evaluator import Evaluation
from sebulba.runtime.loop import UpdateInfo

_log = logging.getLogger(__name__)


class MetricWriter(Protocol):
    """A sink of metrics. One may also take videos: `write_video(step, tag, frames, fps)`
    with frames [T, H, W, 3] uint8 (`MultiWriter` passes them to those that do)."""

    def write(self, step: int, scalars: Mapping[str, float]) -> None: ...

    def close(self) -> None: ...


class JsonLinesWriter:
    """One JSON object per write: {"step": ..., "time": ..., **scalars}, in `path`."""

    def __init__(self, path: str):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self._file = open(path, "a", buffering=1)  # noqa: SIM115 - closed in close()

    def write(self, step: int, scalars: Mapping[str, float]) -> None:
        row = {"step": int(step), "time": time.time()}
        row.update({k: _finite_or_none(v) for k, v in scalars.items()})
        self._file.write(json.dumps(row) + "\n")

    def close(self) -> None:
        self._file.close()


class TensorBoardWriter:
    """Scalars and videos as TensorBoard event files (tensorboardX: no TensorFlow or torch
    needed).

    A row is in the event file when `write` returns, as a JSON line is: tensorboardX's
    `SummaryWriter` queues events for a thread of its own, and its `flush` does not wait
    for that queue, so a hard kill (or the exit forced when the preemption grace runs out)
    lost the newest rows. The events are written here, by the caller, through
    tensorboardX's own event file writer.

    `purge_step`: the first step this run can write (its checkpoint's step + 1; 1 for a
    run that starts afresh). TensorBoard drops the rows of the logdir's earlier event
    files at or past it: those an earlier run wrote past the checkpoint this one resumed
    from (it crashed or was killed after that checkpoint, or a damaged newer checkpoint
    was passed over), which the resumed run's rows would otherwise be drawn beside.
    """

    def __init__(self, logdir: str, purge_step: int | None = None):
        from tensorboardX.event_file_writer import EventsWriter
        from tensorboardX.proto.event_pb2 import Event, SessionLog

        os.makedirs(logdir, exist_ok=True)
        self._events = EventsWriter(os.path.join(logdir, "events"))
        self._closed = False
        if purge_step is not None:
            # What tensorboardX's SummaryWriter(purge_step=) writes: TensorBoard purges
            # the earlier events at or past the step of a session's START.
            now = time.time()
            self._events.write_event(Event(wall_time=now, step=int(purge_step),
                                           file_version="brain.Event:2"))
            self._events.write_event(Event(wall_time=now, step=int(purge_step),
                                           session_log=SessionLog(status=SessionLog.START)))
        self._events.flush()

    def write(self, step: int, scalars: Mapping[str, float]) -> None:
        from tensorboardX.summary import scalar

        values = [value for name, v in scalars.items() for value in scalar(name, v).value]
        self._write(step, values)

    def write_video(self, step: int, tag: str, frames: np.ndarray, fps: int) -> None:
        from tensorboardX.summary import video

        # TensorBoard keeps videos as GIFs in its event file: frames are halved in size
        # until at most 256 pixels wide, so that an episode stays a few MB.
        stride = max(1, int(np.ceil(frames.shape[2] / 256)))
        small = frames[:, ::stride, ::stride]
        self._write(step, video(tag, small.transpose(0, 3, 1, 2)[None], fps).value)

    def _write(self, step: int, values: Sequence[Any]) -> None:
        """One event of `values` at `step`, in the file (the OS's) on return."""
        from tensorboardX.proto.event_pb2 import Event
        from tensorboardX.proto.summary_pb2 import Summary

        self._events.write_event(Event(wall_time=time.time(), step=int(step),
                                       summary=Summary(value=values)))
        self._events.flush()

    def close(self) -> None:
        if not self._closed:  # as SummaryWriter's: a second close does nothing
            self._closed = True
            self._events.close()


class WandbWriter:
    """Scalars, the run's config and videos to Weights & Biases (the `wandb` extra).

    `mode` is wandb's: "online", "offline" (written under `logdir/wandb`, synced later
    with `wandb sync`; needs no network) or "disabled".
    """

    def __init__(self, project: str, logdir: str | None, config: Mapping[str, Any],
                 mode: str = "online", name: str | None = None):
        try:
            import wandb
        except ImportError:
            raise ValueError("Weights & Biases needs the wandb extra: pip install "
                             "-e '.[wandb]' in sebulba's checkout") from None
        self._wandb = wandb
        self._run = wandb.init(project=project, dir=logdir, config=dict(config), mode=mode,
                               name=name, reinit="create_new")
        # wandb's own step must only grow, but an evaluation is written at the (earlier)
        # step its networks were published at: every figure is plotted against
        # "env_steps" instead.
        self._run.define_metric("env_steps")
        self._run.define_metric("*", step_metric="env_steps")

    def write(self, step: int, scalars: Mapping[str, float]) -> None:
        self._run.log({**{k: _finite_or_none(v) for k, v in scalars.items()},
                       "env_steps": int(step)})

    def write_video(self, step: int, tag: str, frames: np.ndarray, fps: int) -> None:
        self._run.log({tag: self._wandb.Video(frames.transpose(0, 3, 1, 2), fps=fps,
                                              format="mp4"), "env_steps": int(step)})

    def close(self) -> None:
        self._run.finish()


class MultiWriter:
    def __init__(self, writers: Sequence[MetricWriter]):
        self.writers = list(writers)

    def write(self, step: int, scalars: Mapping[str, float]) -> None:
        """Every sink gets the row, whichever of them fail; then the first error."""
        _call_each(functools.partial(w.write, step, scalars) for w in self.writers)

    def write_video(self, step: int, tag: str, frames: np.ndarray, fps: int) -> None:
        """Every sink that takes videos gets the video, whichever of them fail: one broken
        sink (a W&B upload, a codec) must not cost the others theirs. The first error is
        raised once all had their call."""
        _call_each(functools.partial(w.write_video, step, tag, frames, fps)
                   for w in self.writers if hasattr(w, "write_video"))

    def close(self) -> None:
        """Closes every sink (a failing one must not leave the others unflushed), then
        raises the first error."""
        _call_each(w.close for w in self.writers)


def _call_each(calls: Iterable[Callable[[], None]]) -> None:
    """Makes every one of `calls`, even after some raised; then raises the first error,
    logging the others."""
    errors: list[Exception] = []
    for call in calls:
        try:
            call()
        except Exception as e:  # noqa: BLE001 - raised below, once the others had their call
            errors.append(e)
    for e in errors[1:]:
        _log.error("another metric sink failed too", exc_info=e)
    if errors:
        raise errors[0]


def default_writers(logdir: str, purge_step: int | None = None) -> MultiWriter:
    """TensorBoard events and `metrics.jsonl` in `logdir`, for a run that starts at env
    step `purge_step - 1` (None: 0). `purge_step`: see `TensorBoardWriter`. The JSON
    lines are appended: the start goes to `plot.STARTS_FILE`, from which plot.py drops
    the lines an earlier run wrote past it."""
    os.makedirs(logdir, exist_ok=True)
    with open(os.path.join(logdir, plot.STARTS_FILE), "a") as f:
        f.write(json.dumps({"step": 0 if purge_step is None else purge_step - 1,
                            "time": time.time()}) + "\n")
    return MultiWriter([TensorBoardWriter(logdir, purge_step),
                        JsonLinesWriter(os.path.join(logdir, "metrics.jsonl"))])


def _finite_or_none(v: float) -> float | None:
    v = float(v)
    return v if math.isfinite(v) else None


def json_line(obj: Any) -> str:
    """`obj` as one line of strict JSON: NaN and infinities (a mean of no episodes) as
    null, which every JSON reader takes (Python's NaN is not JSON)."""
    def strict(x: Any) -> Any:
        if isinstance(x, float):
            return _finite_or_none(x)
        if isinstance(x, Mapping):
            return {k: strict(v) for k, v in x.items()}
        if isinstance(x, list | tuple):
            return [strict(v) for v in x]
        return x
    return json.dumps(strict(obj), allow_nan=False)


class _Update(NamedTuple):
    """What a row needs of an `UpdateInfo`, and when it came."""

    step: int
    version: int
    accounting: Accounting
    at: float
    bound: bottleneck.Bottleneck


class Reporter:
    """An `on_update` callback: writes metrics every `every_seconds`, drives a tqdm bar.

    Steps are global env steps consumed (`step_offset` adds those of a resumed run).
    The rows' windows start at the first update seen, not at construction: the time
    before it (envs starting, compilation) would make the first row's throughput a
    fraction of the run's. A row of no window (the first update's, with every_seconds=0,
    or `finish` after one update) has no throughput.

    A row is the update's step, its learner version and metrics, and the window's
    throughput and episodes. The learner's metrics come one update late (`UpdateInfo`),
    so a row is written at the next update, with the metrics that update brings (or at
    `finish`, with the run's last: `RunResult.metrics`; `close` writes it without them).
    `finish` also writes the last row that `every_seconds` held back and the evaluations
    that came after the last update; `close` waits for the videos.
    """

    def __init__(
        self,
        total_env_steps: int,
        writer: MetricWriter | None = None,
        *,
        every_seconds: float = 5.0,
        progress: bool = True,
        step_offset: int = 0,
        num_processes: int = 1,
    ):
        self.total = total_env_steps
        self.writer = writer
        self.every_seconds = every_seconds
        self.step_offset = step_offset
        self.num_processes = num_processes
        # (time, step) the current row's window started at: the last row's, or the first
        # update's until then; None before any update.
        self._window: tuple[float, int] | None = None
        self._last_row_step: int | None = None
        self._episodes_seen = 0
        self._team_episodes_seen = 0
        # The last update seen: `finish` writes its row unless a row of its step was.
        self._last_update: _Update | None = None
        # The scalars of the last row (step, scalars), waiting for its update's metrics.
        self._held_row: tuple[int, dict[str, float]] | None = None
        self._accounting: Accounting | None = None  # the run's, from its first update
        self._eval_return: float | None = None  # the last evaluation's, for the bar
        self._evaluations_written = 0
        self._videos = ThreadPoolExecutor(1, thread_name_prefix="sebulba-video-writer")
        self._video_writes: list[Future[None]] = []
        self.video_errors: list[BaseException] = []  # the failed video writes, logged
        self._bound = bottleneck.Tracker()  # what bounds the run, for the bar
        self._bar = None
        if progress:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total_env_steps, initial=step_offset, unit="step",
                             unit_scale=True, dynamic_ncols=True)

    def global_step(self, info: UpdateInfo) -> int:
        return self.step_offset + info.accounting.consumed * self.num_processes

    def __call__(self, info: UpdateInfo) -> None:
        if self._accounting is None:
            self._accounting = info.accounting
        elif info.accounting is not self._accounting:
            # Its steps, episodes and evaluations count from a run's start.
            raise ValueError("a Reporter reports one run, and this update is of another: "
                             "make a Reporter for each run (a resumed run's step_offset "
                             "is the env steps before it)")
        step = self.global_step(info)
        if self._bar is not None:
            self._bar.update(step - self._bar.n)
        for evaluation in info.evaluations:  # rare: written as they come
            self._write_evaluation(evaluation)
        self._write_held_row(info.metrics)  # the previous update's metrics
        # Its figures, not the UpdateInfo: that holds the learner's state (replay buffers
        # too), which should not outlive the update.
        update = self._last_update = _Update(
            step, info.version, info.accounting, time.monotonic(),
            self._bound(info.accounting.stage_seconds))
        if self._window is None:
            self._window = (update.at, step)
        if update.at - self._window[0] >= self.every_seconds:
            self._hold_row(update)

    def _hold_row(self, update: _Update) -> None:
        """The row of `update`, held until its metrics come; the bar shows it now."""
        step, now = update.step, update.at
        # One read of the episodes and their total: an episode that ends between two reads
        # would be counted in the total without ever being reported.
        episodes, self._episodes_seen = update.accounting.episodes_since(self._episodes_seen)
        teams, self._team_episodes_seen = update.accounting.team_episodes_since(
            self._team_episodes_seen)
        recent = [r for _, r, _ in episodes]
        start, start_step = self._window
        seconds = now - start
        sps = (step - start_step) / seconds if seconds > 0 else None  # None: no window
        self._window, self._last_row_step = (now, step), step
        scalars = {}
        if sps is not None:
            scalars["throughput/consumed_steps_per_second"] = sps
        scalars["learner/version"] = update.version
        if recent:
            scalars["episode/return"] = float(np.mean(recent))
            scalars["episode/count"] = len(recent)
        if teams:  # multi-agent envs: their env episodes, the sum of their agents' returns
            scalars["episode/team_return"] = float(np.mean([r for _, r, _ in teams]))
            scalars["episode/team_count"] = len(teams)
        if self._bar is not None:
            # The learner's rate over the last window, not the collection's since the
            # start (the summary's env steps/s, compiling included): named for what it is.
            postfix = {} if sps is None else {"consumed/s": f"{sps:,.0f}"}
            if recent:
                # Significant digits: one decimal is useless for returns in [-1, 1].
                postfix["return"] = f"{np.mean(recent):.4g}"
            if self._eval_return is not None:
                postfix["eval"] = f"{self._eval_return:.4g}"
            postfix["bound"] = update.bound.short()
            self._bar.set_postfix(postfix, refresh=False)
        self._held_row = (step, scalars)

    def _write_held_row(self, metrics: Mapping[str, float] | None) -> None:
        """Writes the held row with its update's learner `metrics` (None: unknown)."""
        if self._held_row is None:
            return
        step, scalars = self._held_row
        self._held_row = None
        if self.writer is not None:
            learner = {f"learner/{k}": v for k, v in (metrics or {}).items()}
            self.writer.write(step, {**learner, **scalars})

    def finish(self, result: RunResult) -> None:
        """Writes the last update's row, with the run's last metrics (`result.metrics`),
        also where `every_seconds` held it back (with the episodes counted since the last
        row, those counted as the run stopped included), and the run's evaluations
        (`result.evaluations`) that no `on_update` call carried: those that finished
        after the learner's last update.

        The loop leaves the video frames of those last evaluations in the result for this
        call; they are dropped from `result.evaluations` once handed to the writers, so
        that the result keeps figures, not hundreds of MB.
        """
        if self._last_update is not None and self._last_update.step != self._last_row_step:
            self._hold_row(self._last_update)  # not a second row of one step
        self._write_held_row(result.metrics)
        evaluations = result.evaluations
        for i in range(self._evaluations_written, len(evaluations)):
            self._write_evaluation(evaluations[i])
            if evaluations[i].video_frames is not None and isinstance(evaluations, list):
                evaluations[i] = dataclasses.replace(evaluations[i], video_frames=None)

    def _write_evaluation(self, evaluation: Evaluation) -> None:
        """An evaluation's figures at the step its networks were published at."""
        scalars = evaluation.scalars()
        self._eval_return = scalars["eval/return"]
        self._evaluations_written += 1
        step = self.step_offset + evaluation.env_steps
        if self.writer is None:
            return
        self.writer.write(step, scalars)
        if evaluation.video_frames is not None and hasattr(self.writer, "write_video"):
            # Encoding a video takes seconds: on a thread of its own, not the learner's.
            self._video_writes.append(self._videos.submit(
                self.writer.write_video, step, "eval/video", evaluation.video_frames,
                evaluation.video_fps))
            self._log_video_errors()

    def _log_video_errors(self) -> None:
        """Logs the failures of the video writes that ended. Logged, not raised: a video
        is a by-product of a run whose scalars and checkpoints are safe, and an error
        raised from `close` (a launcher's `finally`) would turn a finished run into a
        crash, hide its summary or the exit code of a preempted run, or mask the error it
        was closing on. `video_errors` keeps them for a caller that wants to fail."""
        # One look per future: one that ends between two looks would be in neither list.
        done = [(f, f.done()) for f in self._video_writes]
        self._video_writes = [f for f, ended in done if not ended]
        for future in (f for f, ended in done if ended):
            if (error := future.exception()) is not None:
                self.video_errors.append(error)
                _log.error("writing an evaluation video to the metric sinks failed",
                           exc_info=error)

    def close(self) -> None:
        self._write_held_row(None)  # a run that raised: its last row, without metrics
        self._videos.shutdown(wait=True)
        self._log_video_errors()
        if self._bar is not None:
            self._bar.close()
        if self.writer is not None:
            self.writer.close()
