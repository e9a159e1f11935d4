"""benchmarks/acting_anatomy.py: a short run times each phase of an acting call beside
the platform's floor, counts the call's kernels, writes readable profiler traces of a
call and of a loop run, and leaves nothing running. Timings are never asserted."""

from __future__ import annotations

import os

import pytest

from benchmarks import acting_anatomy
from tests.benchmark_runs import run_benchmark


@pytest.mark.timeout(300)
def test_anatomy_times_each_phase_and_traces_a_call_and_a_loop(tmp_path):
    traces = tmp_path / "traces"
    run = run_benchmark("benchmarks.acting_anatomy", "--seconds=0.2",
                        "--points=mlp:4,nature_cnn:2", f"--trace_dir={traces}",
                        out=str(tmp_path / "r.jsonl"))
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.gone, "a process of the run's session outlived it"
    assert run.written == run.printed
    assert [r["record"] for r in run.printed] == ["meta", "point", "point", "loop"]
    mlp, cnn = run.printed[1:3]
    assert (mlp["network"], mlp["envs"], cnn["network"], cnn["envs"]) == (
        "mlp", 4, "nature_cnn", 2)
    for p in (mlp, cnn):
        for form in ("", "resident_", "no_early_copy_"):
            parts = [p[f"{form}{phase}_us"] for phase in ("dispatch", "wait", "read")]
            assert all(x > 0 for x in parts), p
        assert p["floor_resident_us"] > 0 and p["floor_from_host_us"] > 0
        # The networks' layers are kernels: a call that computed nothing would have none.
        assert p["kernels"].get("fusion", 0) + p["kernels"].get("custom-call", 0) >= 3, p
    # The first point's calls, traced and summarized per thread: the acting call is there.
    trace = traces / mlp["trace_call_mlp_4"]
    assert trace.is_file()
    summary = mlp["summary_call_mlp_4"]
    names = {row[0] for rows in summary.values() for row in rows}
    assert any("_act_all" in n for n in names), sorted(names)[:40]
    assert "trace_call_nature_cnn_2" not in cnn  # the first point only
    loop = run.printed[3]
    assert (traces / loop["trace_loop"]).is_file()
    assert {"env_step", "dispatch", "inference", "record"} <= set(
        loop["loop_us_per_vector_step"])
    # The two traces and nothing else (the profiler's own files go elsewhere).
    assert sorted(p.name for p in traces.iterdir()) == sorted(
        [mlp["trace_call_mlp_4"], loop["trace_loop"]])
    # --summarize reads a written trace again.
    again = acting_anatomy.summarize(str(trace))
    assert again == summary
    assert os.path.getsize(trace) > 1000


def test_a_point_that_is_not_network_and_envs_is_a_usage_error(capsys):
    for bad in ("mlp", "cnn:4", "mlp:0", "mlp:x"):
        with pytest.raises(SystemExit) as e:
            acting_anatomy.main([f"--points={bad}"])
        assert e.value.code == 2
        assert f"--points: {bad!r} is not network:envs" in capsys.readouterr().err
