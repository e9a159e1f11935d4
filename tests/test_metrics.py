"""Metric writers and the reporter produce readable files with the run's figures."""

from __future__ import annotations

import functools
import glob
import json
import os
import struct
import time
import types
from collections.abc import Iterator

import numpy as np
import pytest
from tensorboardX.proto import event_pb2
from tensorboardX.proto.event_pb2 import SessionLog

import sebulba
from sebulba.metrics import JsonLinesWriter, Reporter, default_writers
from tests.counting_agent import CountingAgent
from tests.envs import CountingEnv


def read_tensorboard_events(logdir, name: str = "events.out.tfevents.*"
                            ) -> Iterator[event_pb2.Event]:
    """Parses TFRecord-framed Event protos (length, crc, data, crc) from the event files
    (those matching `name`)."""
    for path in glob.glob(f"{logdir}/{name}"):
        with open(path, "rb") as f:
            data = f.read()
        offset = 0
        while offset < len(data):
            (length,) = struct.unpack("<Q", data[offset:offset + 8])
            yield event_pb2.Event.FromString(data[offset + 12:offset + 12 + length])
            offset += 12 + length + 4


def read_tensorboard_scalars(logdir) -> dict[str, list[tuple[int, float]]]:
    scalars: dict[str, list[tuple[int, float]]] = {}
    for event in read_tensorboard_events(logdir):
        for value in event.summary.value:
            if not value.HasField("image"):
                scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
    return scalars


def read_tensorboard_videos(logdir) -> list[tuple[str, int]]:
    """(tag, step) of each video (a GIF image summary) in the event files."""
    return [(value.tag, event.step) for event in read_tensorboard_events(logdir)
            for value in event.summary.value if value.HasField("image")]


def test_writers_record_every_scalar(tmp_path):
    writer = default_writers(str(tmp_path))
    writer.write(10, {"a": 1.5, "b": float("nan")})
    writer.write(20, {"a": 2.5})
    writer.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["a"]) for r in rows] == [(10, 1.5), (20, 2.5)]
    assert rows[0]["b"] is None  # NaN is written as null, keeping the file valid JSON
    assert read_tensorboard_scalars(tmp_path)["a"] == [(10, 1.5), (20, 2.5)]


def read_tensorboard_files(logdir) -> list[list[event_pb2.Event]]:
    """The events of each event file, the files in TensorBoard's order (by name: their
    creation time)."""
    return [list(read_tensorboard_events(os.path.dirname(path), os.path.basename(path)))
            for path in sorted(glob.glob(f"{logdir}/events.out.tfevents.*"))]


def purged_scalars(logdir) -> dict[str, list[tuple[int, float]]]:
    """The scalars as TensorBoard shows them: a session START at step s drops the events
    read before it at step s or past it (its event accumulator's purge)."""
    scalars: dict[str, list[tuple[int, float]]] = {}
    for events in read_tensorboard_files(logdir):
        for event in events:
            if event.HasField("session_log") and event.session_log.status == SessionLog.START:
                scalars = {tag: [(s, v) for s, v in rows if s < event.step]
                           for tag, rows in scalars.items()}
            for value in event.summary.value:
                scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
    return scalars


@pytest.mark.timeout(60)
def test_a_resumed_runs_writer_purges_the_rows_the_earlier_run_wrote_past_its_step(tmp_path):
    from sebulba.metrics import TensorBoardWriter

    crashed = TensorBoardWriter(str(tmp_path))
    for step in (10, 20, 30, 40):  # checkpointed at 20, then killed after 40
        crashed.write(step, {"a": float(step)})
    crashed.close()
    time.sleep(1.1)  # event files are named by the second they were made in
    resumed = TensorBoardWriter(str(tmp_path), purge_step=21)  # resumed at 20
    for step in (25, 35):
        resumed.write(step, {"a": -float(step)})
    resumed.close()
    old, new = read_tensorboard_files(tmp_path)
    assert [e.step for e in new if e.HasField("session_log")
            and e.session_log.status == SessionLog.START] == [21]
    # What TensorBoard draws: the crashed run up to its checkpoint, then the resumed one.
    assert purged_scalars(tmp_path)["a"] == [(10, 10.0), (20, 20.0), (25, -25.0),
                                             (35, -35.0)]


@pytest.mark.timeout(60)
def test_a_tensorboard_row_is_in_its_event_file_once_written(tmp_path):
    """As the JSON line is: a hard kill (or the forced exit after the preemption grace)
    right after a write must not lose the row, so it must not wait in a queue for a
    thread to write it."""
    writer = default_writers(str(tmp_path))  # the launcher's sinks
    try:
        for step in range(1, 6):
            writer.write(step * 64, {"a": float(step), "b": 2.0 * step})
            # read back without closing, after every row (the file as a kill leaves it)
            scalars = read_tensorboard_scalars(tmp_path)
            assert scalars.get("a", [])[-1:] == [(step * 64, float(step))], scalars
            assert scalars.get("b", [])[-1:] == [(step * 64, 2.0 * step)], scalars
    finally:
        writer.close()


def test_the_first_row_of_a_run_has_the_throughput_from_its_first_update_on(monkeypatch):
    """Not from the reporter's making: the envs' start and the compilation before the
    first update would make the first row's throughput a fraction of the run's."""


    from sebulba import metrics
    from sebulba.runtime.accounting import Accounting

    clock = [100.0]
    monkeypatch.setattr(metrics, "time", types.SimpleNamespace(
        monotonic=lambda: clock[0], time=time.time))
    rows = []
    sink = types.SimpleNamespace(write=lambda step, scalars: rows.append((step, scalars)),
                                 close=lambda: None)

    def run(every_seconds: float) -> list[tuple[int, dict]]:
        rows.clear()
        accounting = Accounting()
        reporter = Reporter(10**6, sink, every_seconds=every_seconds, progress=True,
                            step_offset=5000)
        clock[0] += 60.0  # envs, compilation: then the first update
        for _ in range(4):  # an update of 1000 steps every second
            accounting.consumed += 1000
            reporter(types.SimpleNamespace(accounting=accounting, metrics={}, version=1,
                                           evaluations=()))
            clock[0] += 1.0
        reporter.finish(types.SimpleNamespace(evaluations=[], metrics={}))
        reporter.close()
        return [(step, s.get("throughput/consumed_steps_per_second")) for step, s in rows]

    # A row per update: the first has no window, so no throughput (and the bar no sps).
    assert run(0.0) == [(6000, None), (7000, 1000.0), (8000, 1000.0), (9000, 1000.0)]
    # A row per 2 s: the first 2 s after the first update, not at it (60 s after the
    # start); finish writes the last update's.
    assert run(2.0) == [(8000, 1000.0), (9000, 1000.0)]


def test_a_row_holds_its_own_updates_metrics_and_close_writes_the_last_row_without_them():
    """The learner's metrics come one update late: update k's row waits for update k + 1
    (or `finish`); a run that raised never calls `finish`, and its last row is not lost."""
    from sebulba.runtime.accounting import Accounting

    rows = []
    sink = types.SimpleNamespace(write=lambda step, scalars: rows.append((step, scalars)),
                                 close=lambda: None)
    accounting = Accounting()
    reporter = Reporter(10**6, sink, every_seconds=0.0, progress=False)
    for version in (1, 2, 3):
        accounting.consumed += 100
        reporter(types.SimpleNamespace(accounting=accounting, version=version,
                                       metrics={"loss": 10.0 * (version - 1)}, evaluations=()))
    reporter.close()  # no finish: the run raised
    assert [(step, s["learner/version"], s.get("learner/loss")) for step, s in rows] == [
        (100, 1, 10.0), (200, 2, 20.0), (300, 3, None)]
    # A second run's updates (their own Accounting) are refused, not drawn over the first's.
    with pytest.raises(ValueError, match="a Reporter reports one run"):
        reporter(types.SimpleNamespace(accounting=Accounting(), version=1, metrics={},
                                       evaluations=()))


@pytest.mark.timeout(120)
def test_reporter_writes_during_a_run(tmp_path, no_leftovers):
    env = functools.partial(CountingEnv, 5)
    loop = sebulba.Sebulba(CountingAgent(sebulba.env_spec(env)),
                           sebulba.Config(env=env, envs_per_group=4, steps_per_cycle=3))
    reporter = Reporter(30 * 12, JsonLinesWriter(str(tmp_path / "m.jsonl")), every_seconds=0.0,
                        progress=True, step_offset=1000)
    result = loop.run(30 * 12, on_update=reporter)
    reporter.finish(result)  # the last update's row is written: not again
    reporter.close()
    rows = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert len(rows) == 30
    assert [r["step"] for r in rows] == [1000 + 12 * (i + 1) for i in range(30)]
    assert [r["learner/version"] for r in rows] == list(range(1, 31))
    # Each row's learner metrics are its own update's (w before update k's step is
    # 0.98^(k-1)), the last row's too: they come one update late, the last in the result.
    np.testing.assert_allclose([r["learner/w"] for r in rows], 0.98 ** np.arange(30),
                               rtol=1e-5)
    assert any(r.get("episode/return") == 5.0 for r in rows)
    # the first row, at the first update, has no window to measure
    assert "throughput/consumed_steps_per_second" not in rows[0]
    assert all(r["throughput/consumed_steps_per_second"] > 0 for r in rows[1:])


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
    # Each logged row, with the env step it is plotted against (wandb's own step only
    # grows; the evaluation's step is earlier). W&B's own service process writes the
    # run's file, and may still be writing it when `finish` returns (seen once under
    # load: only the file's header was there).
    expected = [{"episode/return": 12.5, "env_steps": 100},
                {"eval/return": 20.0, "env_steps": 50},
                {"eval/video": "video-file 48x32", "env_steps": 50}]
    deadline = time.monotonic() + 20
    while True:
        records = wandb_records(tmp_path / "wandb" / run / run_file)
        rows = [row for row in map(history_row, records) if row is not None]
        if rows == expected or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert rows == expected
    (run_record,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert {u.key: json.loads(u.value_json) for u in run_record.config.update}["agent"] == "ppo"


def wandb_records(path) -> list:
    """The records of a W&B run file: a 7-byte header, then LevelDB's log format (32 KiB
    blocks of chunks: crc32, length, type (1 whole, 2 first, 3 middle, 4 last), data)
    holding one serialized `Record` per whole or joined chunk."""
    from wandb.proto import wandb_internal_pb2

    data, block, records, pending, pos = path.read_bytes(), 32 * 1024, [], b"", 7
    assert data[:4] == b":W&B", data[:7]
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk: padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def history_row(record) -> dict | None:
    """A history record's row (user keys only; a video's fields as one entry, "video-file
    WxH"), else None."""
    if record.WhichOneof("record_type") != "history":
        return None
    items = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
             for item in record.history.item}
    videos = {k[:-len("/_type")] for k, v in items.items()
              if k.endswith("/_type") and v == "video-file"}
    row = {k: v for k, v in items.items()  # not wandb's own (_step, _runtime, ...)
           if not k.startswith("_") and k.rsplit("/", 1)[0] not in videos}
    for tag in videos:
        row[tag] = f"video-file {items[tag + '/width']}x{items[tag + '/height']}"
    return row


def read_rows(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.timeout(120)
def test_finish_writes_the_last_window_that_every_seconds_held_back(tmp_path, no_leftovers):
    env = functools.partial(CountingEnv, 5)
    loop = sebulba.Sebulba(CountingAgent(sebulba.env_spec(env)),
                           sebulba.Config(env=env, envs_per_group=4, steps_per_cycle=3))
    # A run shorter than every_seconds: no row during it, the whole run in the last.
    reporter = Reporter(30 * 12, JsonLinesWriter(str(tmp_path / "m.jsonl")),
                        every_seconds=3600.0, progress=False, step_offset=1000)
    try:
        result = loop.run(30 * 12, on_update=reporter)
        assert not (tmp_path / "m.jsonl").read_text()
        reporter.finish(result)
        reporter.finish(result)  # a step is written once
    finally:
        reporter.close()
    (row,) = read_rows(tmp_path / "m.jsonl")
    assert row["step"] == 1000 + 30 * 12 and row["learner/version"] == 30
    assert "learner/loss" in row and row["throughput/consumed_steps_per_second"] > 0
    # every episode of the run, those counted as it stopped included
    assert row["episode/count"] == result.episodes_total > 0 and row["episode/return"] == 5.0


class _BrokenVideoSink:
    """A sink whose video encoding fails (a missing codec, an upload that breaks)."""

    def write(self, step: int, scalars) -> None:
        pass

    def write_video(self, step: int, tag: str, frames: np.ndarray, fps: int) -> None:
        raise OSError("no video encoder")

    def close(self) -> None:
        raise OSError("the upload broke")


@pytest.mark.timeout(60)
def test_a_failing_video_sink_is_logged_and_leaves_the_others_their_videos(tmp_path, caplog):
    from sebulba.evaluation import EvaluationResult
    from sebulba.metrics import MultiWriter, TensorBoardWriter
    from sebulba.runtime.evaluator import Evaluation

    jsonl = JsonLinesWriter(str(tmp_path / "m.jsonl"))
    writer = MultiWriter([_BrokenVideoSink(), TensorBoardWriter(str(tmp_path)), jsonl])
    reporter = Reporter(1000, writer, every_seconds=0.0, progress=False)
    frames = np.random.default_rng(0).integers(0, 255, (6, 16, 16, 3), np.uint8)
    evaluation = Evaluation(3, 100, EvaluationResult([1.0], [5]), 0.1, None, frames, 10)
    reporter.finish(types.SimpleNamespace(evaluations=[evaluation], metrics={}))
    with caplog.at_level("ERROR", logger="sebulba.metrics"), \
            pytest.raises(OSError, match="the upload broke"):
        reporter.close()  # every sink is closed, then the first close error raised
    assert jsonl._file.closed
    assert read_tensorboard_videos(tmp_path) == [("eval/video", 100)]
    assert [str(e) for e in reporter.video_errors] == ["no video encoder"]
    (record,) = [r for r in caplog.records if "video" in r.getMessage()]
    assert record.exc_info[1] is reporter.video_errors[0]  # the traceback is logged


@pytest.mark.timeout(240)
def test_the_video_of_an_evaluation_that_ends_after_the_last_update_is_written(
        tmp_path, no_leftovers):
    from agents.spg import SPG, SPGConfig
    from sebulba.metrics import TensorBoardWriter

    updates, videos = 10, tmp_path / "videos"
    config = sebulba.Config(envs_per_group=8, steps_per_cycle=16, eval_every_updates=updates,
                            eval_episodes=2, eval_max_share=1.0, eval_video_dir=str(videos),
                            eval_video_every=1)
    reporter = Reporter(updates * 128, TensorBoardWriter(str(tmp_path)), every_seconds=0.0,
                        progress=False)
    seen = []

    def on_update(info) -> None:
        seen.extend(info.evaluations)
        reporter(info)
        if info.version == updates:  # the last: its evaluation ends before the run does
            deadline = time.monotonic() + 120
            while not (videos / f"update_{updates:08d}.mp4").exists():
                assert time.monotonic() < deadline, "the last update's evaluation never ended"
                time.sleep(0.1)
            time.sleep(0.5)  # from its video's file to the evaluator's list of finished

    try:
        result = sebulba.Sebulba(SPG(config.env_spec(), SPGConfig()), config).run(
            updates * 128, on_update=on_update)
        assert not seen and [e.learner_update for e in result.evaluations] == [updates]
        assert result.evaluations[-1].video_frames is not None  # for finish
        reporter.finish(result)
    finally:
        reporter.close()
    assert read_tensorboard_videos(tmp_path) == [("eval/video", result.evaluations[-1].env_steps)]
    assert result.evaluations[-1].video_frames is None  # dropped once written


@pytest.mark.timeout(180)
def test_multi_agent_env_episodes_are_reported_as_team_returns(tmp_path, no_leftovers):
    pytest.importorskip("pettingzoo", reason="multi-agent envs need the 'multiagent' extra")
    from agents.ppo import PPO, PPOConfig
    from sebulba.plot import TRAIN_RETURNS

    config = sebulba.Config(env="sebulba.envs.suite.role_call", vectorization="pettingzoo",
                            agent_ids=True, envs_per_group=8, steps_per_cycle=16)
    reporter = Reporter(3_000, JsonLinesWriter(str(tmp_path / "m.jsonl")),
                        every_seconds=3600.0, progress=False)
    try:
        result = sebulba.Sebulba(PPO(config.env_spec(), PPOConfig()), config).run(
            3_000, on_update=reporter)
        reporter.finish(result)
    finally:
        reporter.close()
    (row,) = read_rows(tmp_path / "m.jsonl")
    assert set(TRAIN_RETURNS) <= set(row)  # both of the plot's training curves
    assert row["episode/team_count"] == result.team_episodes_total > 0
    assert row["episode/team_return"] == pytest.approx(
        np.mean([r for _, r, _ in result.team_episodes]))
