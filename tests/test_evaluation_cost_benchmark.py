"""benchmarks/evaluation_cost.py: its `--quick` run prints every record with consistent
figures (evaluation off takes no evaluator step, on evaluates) and leaves nothing
running; bad flags are errors naming the value. Timings are never asserted.

One quick run per setup: CartPole's in the default suite; Pong's (EnvPool, a Nature CNN
to compile twice) is marked slow."""

from __future__ import annotations

import importlib.util

import pytest

from benchmarks import evaluation_cost
from tests.benchmark_runs import run_benchmark

HAS_ENVPOOL = importlib.util.find_spec("envpool") is not None


@pytest.fixture(scope="module", params=[
    pytest.param("cartpole", marks=pytest.mark.slow),  # 30 s: with the slow tests
    pytest.param("pong", marks=[pytest.mark.slow, pytest.mark.skipif(
        not HAS_ENVPOOL, reason="Pong is EnvPool's Pong-v5: needs the envpool extra")]),
])
def quick(request, tmp_path_factory):
    """One `--quick` run of one setup in its own process session: (setup, return code,
    stderr, records printed, records written to --out, whether the session is gone)."""
    setup = request.param
    out = tmp_path_factory.mktemp("evaluation_cost") / "records.jsonl"
    run = run_benchmark("benchmarks.evaluation_cost", "--quick", f"--setups={setup}",
                        out=str(out))
    return setup, run.returncode, run.stderr, run.printed, run.written, run.gone


def test_quick_run_records_each_arm_and_leaves_nothing(quick):
    setup, code, stderr, printed, written, gone = quick
    assert code == 0, stderr[-3000:]
    assert gone, "a process of the --quick run's session outlived it"
    assert written == printed  # --out holds the same records
    assert [r["record"] for r in printed] == (
        ["meta"] + ["run"] * len(evaluation_cost.ARMS) + ["summary", "end"])  # one round
    assert printed[0]["benchmark"] == "evaluation_cost" and printed[0]["args"]["quick"]
    assert {r["setup"] for r in printed[1:-1]} == {setup}


def test_quick_run_figures_are_consistent(quick):
    printed = quick[3]
    runs = [r for r in printed if r["record"] == "run"]
    assert sorted(r["arm"] for r in runs) == sorted(evaluation_cost.ARMS)
    for run in runs:
        assert run["consumed_steps_per_second"] > 0 and run["timed_updates"] >= 1
        assert run["cpu_ms_per_1k_steps"] > 0 and run["process_cpu_cores"] > 0
        assert run["consumed"] <= run["env_steps"]
        assert run["evaluator_share"] == round(run["evaluator_env_steps"] / run["env_steps"], 4)
        if run["arm"] == "on":  # it runs until an evaluation has finished
            assert run["evaluations"] >= 1 and run["evaluator_env_steps"] > 0
            assert len(run["evaluated_updates"]) == run["evaluations"]
            assert all(1 <= u <= run["learner_updates"] for u in run["evaluated_updates"])
            assert 0 < run["evaluator_cpu_share"] <= 1  # Linux: its thread was found
            assert run["evaluator_compile_seconds"] >= 0
        else:
            assert run["evaluations"] == 0 and run["evaluator_env_steps"] == 0
            assert run["evaluator_cpu_share"] is None and run["evaluator_compile_seconds"] == 0
    by_arm = {r["arm"]: r for r in runs}
    (summary,) = [r for r in printed if r["record"] == "summary"]
    for field in ("consumed_steps_per_second", "cpu_ms_per_1k_steps"):
        values = {arm: by_arm[arm][field] for arm in evaluation_cost.ARMS}
        arms = summary[field]
        assert arms["median"] == values  # one round: its figures
        assert arms["on_over_off"] == round(values["on"] / values["off"], 3)
        assert arms["on_over_off_by_round"] == [arms["on_over_off"]]
        assert arms["control_over_off"] == round(values["off_control"] / values["off"], 3)
    assert summary["evaluations_by_run"] == [by_arm["on"]["evaluations"]]
    assert summary["evaluator_share"] == by_arm["on"]["evaluator_share"]
    assert summary["evaluator_cpu_share_median"] == by_arm["on"]["evaluator_cpu_share"]


@pytest.mark.parametrize("flag,message", [
    ("--rounds=0", "--rounds must be >= 1, got 0"),
    ("--pong_seconds=0", "--pong_seconds must be > 0, got 0.0"),
    ("--setups=breakout", "--setups must name some of cartpole, pong, got ['breakout']"),
])
def test_bad_flags_name_the_value(flag, message, capsys):
    with pytest.raises(SystemExit) as e:
        evaluation_cost.parse_args([flag])
    assert e.value.code == 2
    # The error line itself, not the usage line (which names every flag).
    assert capsys.readouterr().err.splitlines()[-1].endswith(f": error: {message}")
