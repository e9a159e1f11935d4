"""Metric writers and the reporter produce readable files with the run's figures."""

from __future__ import annotations

import functools
import glob
import json
import struct

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
