"""Where run metrics go: TensorBoard event files, JSON lines, a progress bar.

`MetricWriter` is the one interface: `write(step, scalars)` and `close()`. Writers are
cheap to combine (`MultiWriter`); `Reporter` turns the loop's `on_update` calls into
periodic writes and a live tqdm bar.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Mapping, Sequence
from typing import Protocol

import numpy as np

from sebulba.runtime.loop import UpdateInfo


class MetricWriter(Protocol):
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
    """Scalars as TensorBoard event files (tensorboardX: no TensorFlow or torch needed)."""

    def __init__(self, logdir: str):
        from tensorboardX import SummaryWriter

        self._writer = SummaryWriter(logdir)

    def write(self, step: int, scalars: Mapping[str, float]) -> None:
        for name, value in scalars.items():
            self._writer.add_scalar(name, value, global_step=int(step))
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class MultiWriter:
    def __init__(self, writers: Sequence[MetricWriter]):
        self.writers = list(writers)

    def write(self, step: int, scalars: Mapping[str, float]) -> None:
        for w in self.writers:
            w.write(step, scalars)

    def close(self) -> None:
        for w in self.writers:
            w.close()


def default_writers(logdir: str) -> MultiWriter:
    """TensorBoard events and `metrics.jsonl` in `logdir`."""
    return MultiWriter([TensorBoardWriter(logdir),
                        JsonLinesWriter(os.path.join(logdir, "metrics.jsonl"))])


def _finite_or_none(v: float) -> float | None:
    v = float(v)
    return v if math.isfinite(v) else None


class Reporter:
    """An `on_update` callback: writes metrics every `every_seconds`, drives a tqdm bar.

    Steps are global env steps consumed (`step_offset` adds those of a resumed run).
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
        self._last_write = time.monotonic()
        self._last_steps = step_offset
        self._episodes_seen = 0
        self._bar = None
        if progress:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total_env_steps, initial=step_offset, unit="step",
                             unit_scale=True, dynamic_ncols=True)

    def global_step(self, info: UpdateInfo) -> int:
        return self.step_offset + info.accounting.consumed * self.num_processes

    def __call__(self, info: UpdateInfo) -> None:
        step = self.global_step(info)
        if self._bar is not None:
            self._bar.update(step - self._bar.n)
        now = time.monotonic()
        if now - self._last_write < self.every_seconds:
            return
        # One read of the episodes and their total: an episode that ends between two reads
        # would be counted in the total without ever being reported.
        episodes, self._episodes_seen = info.accounting.episodes_since(self._episodes_seen)
        recent = [r for _, r, _ in episodes]
        sps = (step - self._last_steps) / (now - self._last_write)
        self._last_write, self._last_steps = now, step
        scalars = {f"learner/{k}": v for k, v in info.metrics.items()}
        scalars["throughput/consumed_steps_per_second"] = sps
        scalars["learner/version"] = info.version
        if recent:
            scalars["episode/return"] = float(np.mean(recent))
            scalars["episode/count"] = len(recent)
        if self._bar is not None:
            postfix = {"sps": f"{sps:,.0f}"}
            if recent:
                # Significant digits: one decimal is useless for returns in [-1, 1].
                postfix["return"] = f"{np.mean(recent):.4g}"
            self._bar.set_postfix(postfix, refresh=False)
        if self.writer is not None:
            self.writer.write(step, scalars)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self.writer is not None:
            self.writer.close()
