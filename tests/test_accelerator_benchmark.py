"""benchmarks/accelerator.py: its smoke run prints every field with sane values and a
table, and leaves nothing running; bad flags are errors naming the value; the table
judges the issue's targets on an accelerator. Timings are never asserted."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

from benchmarks import accelerator
from tests.benchmark_runs import run_benchmark

HAS_ENVPOOL = importlib.util.find_spec("envpool") is not None


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """One `--smoke` run in its own process session: (return code, stdout, stderr,
    records printed, records written to --out, whether the session is gone)."""
    out = tmp_path_factory.mktemp("accelerator") / "records.jsonl"
    run = run_benchmark("benchmarks.accelerator", "--smoke", out=str(out))
    return run.returncode, run.stdout, run.stderr, run.printed, run.written, run.gone


def _stages(printed: list[dict]) -> dict[str, dict]:
    return {r["stage"]: r for r in printed if r["record"] == "stage"}


def test_smoke_runs_every_stage_and_leaves_nothing(smoke):
    code, _, stderr, printed, written, gone = smoke
    assert code == 0, stderr
    points = [r for r in printed if r["record"] == "latency_point"]
    assert [r["record"] for r in printed if r not in points] == ["meta"] + ["stage"] * len(
        accelerator.STAGES) + ["end"]
    # The latency stage's points are written as they come, and again in its record.
    assert [{k: v for k, v in p.items() if k not in ("record", "time", "load")}
            for p in points] \
        == _stages(printed)["acting_latency"]["points"]
    assert list(_stages(printed)) == list(accelerator.STAGES)
    assert written == printed  # --out holds the same records
    end = printed[-1]
    assert end["seconds"] > 0 and end["platform"] == "cpu" and end["targets_apply"] is False
    assert end["leftover_threads"] == [] and end["child_processes"] == []
    assert gone, "a process of the smoke run's session outlived it"
    for rec in _stages(printed).values():
        assert "error" not in rec, rec
        if "skipped" in rec:  # only the training stages may be, without their envs
            assert not HAS_ENVPOOL and "envpool" in rec["skipped"]


def test_the_table_of_a_run_is_rendered_again_from_its_records(smoke, tmp_path):
    """`--table_from`: the records a run wrote give its table; a run cut short (no end
    record, the last stages missing) gives the table of the stages it finished."""
    _, stdout, _, _, written, _ = smoke
    path = tmp_path / "records.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in written))
    assert accelerator.table_from(str(path)) in stdout
    cut = [r for r in written if r["record"] in ("meta", "latency_point")]  # cut in it
    path.write_text("".join(json.dumps(r) + "\n" for r in cut))
    text = accelerator.table_from(str(path))
    assert "cut short" in text and "mlp" in text and "acting_only" not in text


def test_smoke_latency_per_network_and_envs_per_call(smoke):
    rec = _stages(smoke[3])["acting_latency"]
    networks = ["mlp", "nature_cnn"] if HAS_ENVPOOL else ["mlp"]
    expected = [(n, e) for n in networks for e in accelerator.SMOKE["envs_per_call"]]
    assert [(p["network"], p["envs"]) for p in rec["points"]] == expected
    for p in rec["points"]:
        assert p["calls"] >= 5
        assert 0 < p["median_us"] <= p["p90_us"]
        assert p["steps_per_second"] > 0 and p["first_call_s"] > 0
        assert p["record_on_device_median_us"] > 0 and p["inputs_on_device_median_us"] > 0
        # Frames are also timed restacked on the device from their newest frame.
        newest = p["newest_frame_median_us"]
        assert (newest > 0) if p["network"] == "nature_cnn" else newest is None


def test_smoke_acting_only_beside_its_bounds(smoke):
    rec = _stages(smoke[3])["acting_only"]
    assert rec["env_only"] > 0 and rec["inference_only"] > 0
    assert rec["bound"] == min(rec["env_only"], rec["inference_only"])
    assert [r["async_factor"] for r in rec["runs"]] == accelerator.SMOKE["acting_async_factors"]
    for run in rec["runs"]:
        assert run["steps_per_second"] > 0 and run["env_steps"] > 0
        assert run["ratio_to_bound"] == pytest.approx(run["steps_per_second"] / rec["bound"],
                                                      abs=2e-3)
        assert run["ratio_to_bare_loop"] == pytest.approx(
            run["steps_per_second"] / rec["bare_loop"], abs=2e-3)


@pytest.mark.skipif(not HAS_ENVPOOL, reason="the training stages run on EnvPool")
@pytest.mark.parametrize("stage", list(accelerator.TRAINING))
def test_smoke_training_beside_its_bounds(smoke, stage):
    rec = _stages(smoke[3])[stage]
    agent, env = accelerator.TRAINING[stage]
    assert (rec["agent"], rec["env"], rec["vectorization"], rec["env_source"]) == (
        agent, env, "envpool", "envpool")
    assert rec["num_env_threads"] == os.cpu_count()  # the default: every core
    _assert_beside_its_bounds(rec)


def _assert_beside_its_bounds(rec: dict) -> None:
    assert rec["learner_updates"] >= 1 and rec["consumed"] > 0
    assert rec["env_steps"] >= rec["consumed"]
    for field in ("steps_per_second", "consumed_steps_per_second", "env_only",
                  "learner_only", "wall_seconds"):
        assert rec[field] > 0, field
    assert rec["bound"] == min(rec["env_only"], rec["learner_only"])
    assert rec["env_only"] == max(rec["env_only_before_after"]) > 0
    assert rec["bounded_by"] == ("env" if rec["env_only"] <= rec["learner_only"]
                                 else "learner")
    assert rec["ratio_to_bound"] == pytest.approx(
        rec["consumed_steps_per_second"] / rec["bound"], abs=2e-3)


@pytest.mark.timeout(300)
def test_without_envpool_breakout_trains_on_ale_py_s_vector_env(tmp_path):
    """A GPU machine's image may lack EnvPool (its wheels and assets exceed what can be
    carried there): `--env_source=gymnasium` is what such a run takes, ale-py's own vector
    env, the same frames for the Nature CNN, its env_only bound the groups' vector envs."""
    run = run_benchmark("benchmarks.accelerator", "--smoke", "--env_source=gymnasium",
                        "--stages=acting_latency,breakout_ppo", out=str(tmp_path / "r.jsonl"))
    assert run.returncode == 0, run.stderr
    assert run.gone
    stages = _stages(run.printed)
    rec = stages["breakout_ppo"]
    assert (rec["env"], rec["vectorization"], rec["env_source"]) == (
        "ALE/Breakout-v5", "vector_entry_point", "ale_py vector env")
    _assert_beside_its_bounds(rec)
    assert [p["network"] for p in stages["acting_latency"]["points"]] == \
        ["mlp"] * 2 + ["nature_cnn"] * 2
    assert "ale_py vector env" in run.stdout[run.stdout.index("accelerator benchmark on"):]


def test_smoke_prints_the_table(smoke):
    stdout = smoke[1]
    table = stdout[stdout.index("accelerator benchmark on"):]
    assert "cpu: targets not applicable" in table
    assert "pass" not in table and "FAIL" not in table
    for name in ["mlp", "acting only"] + (list(accelerator.TRAINING) if HAS_ENVPOOL else []):
        assert name in table


@pytest.mark.parametrize(("flag", "named", "expected"), [
    ("--stages=acting_latency,bogus", "'bogus'", "acting_latency, acting_only"),
    ("--stages=", "''", "acting_latency, acting_only"),
    ("--num_env_threads=0", "'0'", "int >= 1"),
    ("--envs_per_call=16,x", "'x'", "int >= 1"),
    ("--train_seconds=-1", "'-1'", "seconds > 0"),
    ("--latency_seconds=inf", "'inf'", "seconds > 0"),
    ("--ppo_epochs=-2", "'-2'", "int >= 0"),
])
def test_bad_flags_are_errors_naming_the_value(capsys, flag, named, expected):
    with pytest.raises(SystemExit) as exit_info:
        accelerator.parse_args([flag])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert named in err and expected in err, err


def test_smoke_sizes_are_defaults_that_flags_override():
    args = accelerator.parse_args(["--smoke", "--train_seconds=5", "--stages=acting_only"])
    assert args.train_seconds == 5.0 and args.stages == ["acting_only"]
    assert args.envs_per_call == accelerator.SMOKE["envs_per_call"]
    full = accelerator.parse_args([])
    assert full.envs_per_call == [16, 64, 256, 1024] and full.stages == list(accelerator.STAGES)
    assert full.num_env_threads == os.cpu_count()


def _latency(network: str, envs: int, median_us: float) -> dict:
    return {"network": network, "envs": envs, "median_us": median_us, "p90_us": median_us,
            "steps_per_second": 1.0}


def _breakout_ppo(consumed: float, bound: float) -> dict:
    return {"record": "stage", "stage": "breakout_ppo", "steps_per_second": consumed,
            "consumed_steps_per_second": consumed, "env_only": bound,
            "learner_only": bound * 2, "ratio_to_bound": round(consumed / bound, 3)}


def test_the_table_judges_the_targets_on_an_accelerator():
    latency = {"record": "stage", "stage": "acting_latency", "num_groups": 2, "points": [
        _latency("mlp", 256, 150.0), _latency("nature_cnn", 256, 1500.0),
        _latency("nature_cnn", 64, 5000.0)]}  # no target at 64 envs
    lines = accelerator.table([latency, _breakout_ppo(12_000, 20_000)], "cuda:0", True,
                              1.0).splitlines()
    mlp, cnn256, cnn64 = (next(x for x in lines if x.split()[:2] == key)
                          for key in (["mlp", "256"], ["nature_cnn", "256"],
                                      ["nature_cnn", "64"]))
    assert mlp.endswith("<= 200 us: pass") and cnn256.endswith("<= 1,000 us: FAIL")
    assert "pass" not in cnn64 and "FAIL" not in cnn64
    # Where the call restacking the newest frame was timed, the target applies to it: the
    # loop's call on an accelerator.
    latency["points"][1]["newest_frame_median_us"] = 800.0
    cnn256 = next(x for x in accelerator.table([latency], "cuda:0", True, 1.0).splitlines()
                  if x.split()[:2] == ["nature_cnn", "256"])
    assert cnn256.endswith("<= 1,000 us: pass") and "800.0" in cnn256
    row = next(x for x in lines if x.strip().startswith("breakout_ppo"))
    assert ">= 10,000/s: pass" in row and ">= 0.7 of bound: FAIL" in row  # 0.6 of it
    row = next(x for x in accelerator.table([_breakout_ppo(9_000, 10_000)], "cuda:0", True,
                                            1.0).splitlines()
               if x.strip().startswith("breakout_ppo"))
    assert ">= 10,000/s: FAIL" in row and ">= 0.7 of bound: pass" in row
    assert "not applicable" not in "\n".join(lines)


def test_a_failing_stage_is_reported_and_the_others_run(monkeypatch, capsys):
    def broken(args):
        raise RuntimeError("a stage broke")

    monkeypatch.setattr(accelerator, "_stage_functions", lambda: {
        "acting_latency": broken, "acting_only": lambda args: {"runs": [], "env_only": 1.0,
                                                               "inference_only": 1.0,
                                                               "bound": 1.0, "env": "x",
                                                               "envs_per_group": 1,
                                                               "target_steps_per_second": 1}})
    code = accelerator.main(["--stages=acting_latency,acting_only"])
    out = capsys.readouterr().out
    stages = _stages([json.loads(x) for x in out.splitlines() if x.startswith("{")])
    assert code == 1
    assert stages["acting_latency"]["error"] == "RuntimeError: a stage broke"
    assert "error" not in stages["acting_only"]
    assert "acting_latency: error: RuntimeError: a stage broke" in out


def test_the_recording_acting_call_writes_each_step_at_its_cursor():
    """The latency stage's "recording" figure times a call that really records: each
    step's env step and action land at the buffer's cursor, which wraps."""
    import jax
    import numpy as np

    import sebulba
    from agents.spg import SPG, SPGConfig
    from sebulba.envs import example_env_step
    from sebulba.runtime.inferencer import ActingFunctions

    agent = SPG(sebulba.env_spec("CartPole-v1"), SPGConfig(hidden_sizes=(8,)))
    nets = agent.new_networks(jax.random.key(0))
    acting = ActingFunctions(agent, steps_per_cycle=1)
    leaves = acting.networks(nets)
    device = jax.local_devices()[0]
    state = acting.new_state(agent.new_step_state(nets, jax.random.key(1), 3), device,
                             snapshots=False).step_state
    act, new_buffer = accelerator._recording_act(acting, example_env_step(agent.env_spec, 3),
                                                 2)
    rng = np.random.default_rng(0)
    steps = [example_env_step(agent.env_spec, 3)._replace(
        obs=rng.standard_normal((3, 4)).astype(np.float32)) for _ in range(3)]
    buffer = new_buffer(leaves, state, steps[0])
    actions = []
    for env_step in steps:
        output, state, buffer = act(leaves, state, env_step, buffer)
        actions.append(np.asarray(output.action))
    cursor, env_steps, outputs = buffer
    assert int(cursor) == 1  # 3 steps into a buffer of 2: wrapped once
    np.testing.assert_array_equal(np.asarray(env_steps.obs)[:, 0], steps[2].obs)
    np.testing.assert_array_equal(np.asarray(env_steps.obs)[:, 1], steps[1].obs)
    np.testing.assert_array_equal(np.asarray(outputs[0])[:, 0], actions[2])
    np.testing.assert_array_equal(np.asarray(outputs[0])[:, 1], actions[1])
