"""Metric writers and the reporter produce readable files with the run's figures."""

from __future__ import annotations

import functools
import glob
import json
import os
import struct
import time

import numpy as np
import pytest
from tensorboardX.proto import event_pb2

import sebulba
from sebulba.metrics import JsonLinesWriter, Reporter, default_writers
from tests.counting_agent import CountingAgent
from tests.envs import CountingEnv


def read_tensorboard_scalars(logdir) -> dict[str, list[tuple[int, float]]]:
    """Parses TFRecord-framed Event protos (length, crc, data, crc) from the event files."""
    scalars: dict[str, list[tuple[int, float]]] = {}
    for path in glob.glob(f"{logdir}/events.out.tfevents.*"):
        with open(path, "rb") as f:
            data = f.read()
        offset = 0
        while offset < len(data):
            (length,) = struct.unpack("<Q", data[offset:offset + 8])
            event = event_pb2.Event.FromString(data[offset + 12:offset + 12 + length])
            offset += 12 + length + 4
            for value in event.summary.value:
                scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
    return scalars


def test_writers_record_every_scalar(tmp_path):
    writer = default_writers(str(tmp_path))
    writer.write(10, {"a": 1.5, "b": float("nan")})
    writer.write(20, {"a": 2.5})
    writer.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["a"]) for r in rows] == [(10, 1.5), (20, 2.5)]
    assert rows[0]["b"] is None  # NaN is written as null, keeping the file valid JSON
    assert read_tensorboard_scalars(tmp_path)["a"] == [(10, 1.5), (20, 2.5)]


@pytest.mark.timeout(120)
def test_reporter_writes_during_a_run(tmp_path, no_leftovers):
    env = functools.partial(CountingEnv, 5)
    loop = sebulba.Sebulba(CountingAgent(sebulba.env_spec(env)),
                           sebulba.Config(env=env, envs_per_group=4, steps_per_cycle=3))
    reporter = Reporter(30 * 12, JsonLinesWriter(str(tmp_path / "m.jsonl")), every_seconds=0.0,
                        progress=True, step_offset=1000)
    loop.run(30 * 12, on_update=reporter)
    reporter.close()
    rows = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert len(rows) == 30
    assert [r["step"] for r in rows] == [1000 + 12 * (i + 1) for i in range(30)]
    assert [r["learner/version"] for r in rows] == list(range(1, 31))
    assert any(r.get("episode/return") == 5.0 for r in rows)
    assert all(r["throughput/consumed_steps_per_second"] > 0 for r in rows)


@pytest.mark.timeout(60)
def test_accounting_keeps_bounded_records_and_whole_run_totals():
    from sebulba.runtime.accounting import EPISODE_WINDOW, LAG_WINDOW, Accounting

    acc = Accounting()
    n = 250_000  # a long run: more episodes and trajectories than the windows hold
    for i in range(n // 100):
        acc.add_env_steps(100)
        acc.add_episodes([(float(i * 100 + j), 1) for j in range(100)])
        acc.add_consumed(100, policy_lag=i % 7)
    assert len(acc.episodes) == EPISODE_WINDOW and acc.episodes_total == n
    assert acc.episodes[-1] == (n, float(n - 1), 1)  # the most recent are the ones kept
    assert acc.recent_episodes(n - 3) == list(acc.episodes)[-3:]
    assert len(acc.recent_episodes(0)) == EPISODE_WINDOW  # at most the window
    assert len(acc.policy_lags) == min(LAG_WINDOW, n // 100)
    assert acc.lag_max == 6 and acc.lag_sum == sum(i % 7 for i in range(n // 100))


class _EpisodeEndsAfterEachRead:
    """An Accounting whose inferencer thread ends an episode right after each of the
    reporter's reads: the interleaving that lost episodes when the reporter read the
    recent episodes and the total apart."""

    def __init__(self):
        from sebulba.runtime.accounting import Accounting

        self.accounting = Accounting()
        self.consumed = 0
        self.ended = 0

    def _end_one(self) -> None:
        self.ended += 1
        self.accounting.add_episodes([(float(self.ended), self.ended)])

    def recent_episodes(self, since_total):
        episodes = self.accounting.recent_episodes(since_total)
        self._end_one()
        return episodes

    def episodes_since(self, since_total):
        read = self.accounting.episodes_since(since_total)
        self._end_one()
        return read

    def __getattr__(self, name):  # episodes_total and the rest
        return getattr(self.accounting, name)


@pytest.mark.timeout(60)
def test_the_reporter_reports_every_episode_once():
    import types

    accounting = _EpisodeEndsAfterEachRead()
    rows = []
    writer = types.SimpleNamespace(write=lambda step, scalars: rows.append(dict(scalars)),
                                   close=lambda: None)
    reporter = Reporter(100, writer, every_seconds=0.0, progress=False)
    info = types.SimpleNamespace(accounting=accounting, metrics={}, version=1, evaluations=())
    for _ in range(5):
        reporter(info)
    reporter.close()
    reported = sum(r.get("episode/count", 0) for r in rows)
    # Every episode but the one that ended after the last read (the next report's).
    assert reported == accounting.episodes_total - 1 == 4
    # Episodes 1..4, each once: their returns are their numbers.
    assert sum(r.get("episode/return", 0.0) * r.get("episode/count", 0) for r in rows) == 10.0


@pytest.mark.timeout(60)
def test_team_episodes_are_counted_over_the_run_not_the_window(monkeypatch):
    from sebulba.runtime import accounting as accounting_module

    monkeypatch.setattr(accounting_module, "EPISODE_WINDOW", 10)
    acc = accounting_module.Accounting()
    for i in range(25):
        acc.add_env_steps(8)
        acc.add_team_episodes(0, [(float(i), 4)])
    assert len(acc.team_episodes) == 10 and acc.team_episodes_total == 25
    result = accounting_module.RunResult(
        env_steps=acc.env_steps, consumed=acc.env_steps, dropped=0, in_flight=0,
        wall_seconds=1.0, episodes=[], policy_lags=[], stage_seconds={}, learner_updates=1,
        metrics={}, agents_per_env=2, team_episodes=list(acc.team_episodes),
        team_episodes_total=acc.team_episodes_total)
    assert result.as_dict()["team_episodes"] == 25
    assert "25 env episodes" in result.summary()


@pytest.mark.timeout(120)
def test_wandb_offline_takes_scalars_against_env_steps_and_videos(tmp_path):
    from sebulba.metrics import WandbWriter

    writer = WandbWriter("sebulba-test", str(tmp_path), {"agent": "ppo"}, mode="offline")
    writer.write(100, {"episode/return": 12.5})
    writer.write(50, {"eval/return": 20.0})  # an evaluation, at its earlier step
    frames = np.random.default_rng(0).integers(0, 255, (12, 32, 48, 3), np.uint8)
    writer.write_video(50, "eval/video", frames, 10)
    writer.close()
    (run,) = [d for d in os.listdir(tmp_path / "wandb") if d.startswith("offline-run-")]
    videos = os.listdir(tmp_path / "wandb" / run / "files" / "media" / "videos" / "eval")
    assert len(videos) == 1 and videos[0].endswith(".mp4")
    (run_file,) = [f for f in os.listdir(tmp_path / "wandb" / run) if f.endswith(".wandb")]
    # W&B's own service process writes the run's file, and may still be writing it
    # when `finish` returns (seen once under load: only the file's header was there).
    expected = (b"episode/return", b"eval/return", b"env_steps", b"ppo")
    deadline = time.monotonic() + 20
    while True:
        recorded = (tmp_path / "wandb" / run / run_file).read_bytes()
        if all(x in recorded for x in expected) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert [x for x in expected if x not in recorded] == [], recorded[:200]
