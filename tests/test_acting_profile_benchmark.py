"""benchmarks/acting_profile.py: a short run times each call of the real acting loop once
per vector step where the loop makes it once, prints every record and leaves nothing
running. Timings are never asserted."""

from __future__ import annotations

import importlib.util

import pytest

from tests.benchmark_runs import run_benchmark

HAS_ENVPOOL = importlib.util.find_spec("envpool") is not None


@pytest.mark.parametrize("vectorization", [
    "sync",
    *(pytest.param(v, marks=pytest.mark.skipif(
        not HAS_ENVPOOL, reason="the EnvPool loops need the envpool extra"))
      for v in ("envpool", "envpool_async")),
])
def test_profile_times_each_call_of_the_real_loop(vectorization, tmp_path):
    args = ["--cycles=3", "--hidden_sizes=8", f"--vectorization={vectorization}"]
    if vectorization != "sync":
        args.append("--async_factor=2")
    run = run_benchmark("benchmarks.acting_profile", *args, out=str(tmp_path / "r.jsonl"))
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.gone, "a process of the run's session outlived it"
    assert run.written == run.printed
    kinds = [r["record"] for r in run.printed]
    bare = ["bare"] if vectorization == "sync" else []
    assert kinds[:2 + len(bare)] == ["meta", *bare, "loop"] and kinds[-1] == "end"
    loop = run.printed[1 + len(bare)]
    groups = 1 if vectorization == "sync" else 2
    assert loop["env_steps"] >= 3 * 100 * 16 * groups
    calls = {r["call"]: r for r in run.printed if r["record"] == "call"}
    # The loop makes one acting call, one recv and one send per batch of 16 envs, and
    # pops the ended episodes once per batch by id, once per cycle of 100 steps (and at
    # the end of each measured run) in order: the wrappers saw each of them.
    for name in ("acting call: dispatch", "source.recv", "source.send",
                 "waiting for the action"):
        assert calls[name]["calls_per_vector_step"] == pytest.approx(1.0, abs=0.05), name
        assert calls[name]["us_per_call"] > 0
    pops = calls["source.pop_episodes"]
    if vectorization == "envpool_async":
        assert pops["calls_per_vector_step"] == pytest.approx(1.0, abs=0.05)
    else:
        assert 0.01 <= pops["calls_per_vector_step"] < 0.03
    assert pops["us_per_call"] > 0
    env_call = ("vec.step (per-env checks included)" if vectorization == "sync"
                else "pool send (C++)")
    assert calls[env_call]["calls_per_vector_step"] == pytest.approx(1.0, abs=0.05)
    # A send includes its env's step: nested timings never exceed their parent's.
    assert calls[env_call]["us_per_vector_step"] <= calls["source.send"]["us_per_vector_step"]
    if bare:
        parts = run.printed[1]["us_per_vector_step"]
        assert set(parts) == {"dispatch", "wait", "env step"} and min(parts.values()) > 0
