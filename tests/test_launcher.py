"""The absl launcher and evaluation, run as a user runs them: as commands."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import socket
import subprocess
import sys
import sysconfig
import time

import pytest

from tests.test_metrics import history_row, read_tensorboard_files, wandb_records

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--envs_per_group=8", "--steps_per_cycle=8", "--progress=false", "--log_every_seconds=0"]


def run(module: str, *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["SDL_VIDEODRIVER"] = "dummy"
    return subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def last_json(stdout: str) -> dict:
    return json.loads([line for line in stdout.splitlines() if line.startswith("{")][-1])


def test_a_multi_process_summary_says_whose_figures_it_shows_and_gives_the_runs():
    from examples.train import run_summary
    from sebulba.runtime.accounting import RunResult

    def result(num_processes: int) -> RunResult:
        return RunResult(env_steps=1100, consumed=1000, dropped=0, in_flight=100,
                         wall_seconds=2.0, episodes=[], policy_lags=[], stage_seconds={},
                         learner_updates=10, metrics={}, num_processes=num_processes)

    alone = result(1)
    assert run_summary(alone, 1000) == alone.summary()
    # Process 0's figures (1,100 env steps of its own envs at 550/s) are not the run's.
    lines = run_summary(result(2), 2000 + 500).splitlines()
    assert lines[:2] == [
        "the run, 2 processes: 2,000 env steps consumed (2,500 with the 500 before the "
        "resume), 1,000 consumed env steps/s",
        "process 0 of 2, its own envs and learner:"]
    assert "\n".join(lines[2:]) == result(2).summary()
    assert "before the resume" not in run_summary(result(2), 2000)  # not resumed


@pytest.mark.timeout(400)
def test_train_logs_checkpoints_resumes_and_evaluates(tmp_path):
    logdir = str(tmp_path / "run")
    first = run("examples.train", f"--logdir={logdir}", "--total_env_steps=4000",
                "--checkpoint_every_steps=1000", "--keep_checkpoints=2", *SMALL)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "env steps" in first.stdout and "policy lag" in first.stdout  # the summary
    done = last_json(first.stdout)["total_consumed"]
    assert done >= 4000
    checkpoints = sorted(int(d) for d in os.listdir(os.path.join(logdir, "checkpoints")))
    assert len(checkpoints) == 2 and checkpoints[-1] == done
    with open(os.path.join(logdir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    assert rows and rows[-1]["step"] <= done and "learner/loss" in rows[-1]
    assert [f for f in os.listdir(logdir) if f.startswith("events.out.tfevents")]

    second = run("examples.train", f"--logdir={logdir}", "--resume", "--total_env_steps=6000",
                 "--checkpoint_every_steps=1000", "--ppo_learning_rate=0.001", "--seed=3",
                 *SMALL)
    assert second.returncode == 0, second.stderr[-3000:]
    # The learner continues: its update count, the envs' step states (acting keys) and
    # PPO's experience (its minibatch key) come from the checkpoint.
    updates = last_json(first.stdout)["learner_updates"]
    assert (f"resumed from {logdir}/checkpoints at {done:,} env steps, learner update "
            f"{updates:,}\n") in second.stdout
    # changed hyperparameters are taken, and said
    assert ("settings that differ from the checkpoint's: --ppo_learning_rate 0.00025 -> "
            "0.001, --seed 0 -> 3\n") in second.stdout
    total = last_json(second.stdout)["total_consumed"]
    assert 6000 <= total < 6000 + 8 * 8 * 2
    assert last_json(second.stdout)["consumed"] == total - done
    # Its TensorBoard file purges the first run's rows past the checkpoint (none here: it
    # ended there, but a crashed or killed one would have written past it); the first
    # run's, those of any run before it in the logdir (one that crashed unsaved).
    first_events, second_events = read_tensorboard_files(logdir)
    assert [e.step for e in first_events if e.HasField("session_log")] == [1]
    assert [e.step for e in second_events if e.HasField("session_log")] == [done + 1]

    third = run("examples.train", f"--logdir={logdir}", "--resume", "--total_env_steps=6000",
                *SMALL)
    assert third.returncode == 0 and "nothing to do" in third.stdout

    video = str(tmp_path / "video")
    evaluation = run("examples.evaluate", f"--checkpoint={logdir}", "--episodes=6",
                     "--sampled", f"--video_dir={video}")
    assert evaluation.returncode == 0, evaluation.stderr[-3000:]
    report = last_json(evaluation.stdout)
    assert report["episodes"] == 6 and report["checkpoint_env_steps"] == total
    assert report["min_return"] <= report["mean_return"] <= report["max_return"]
    assert [f for f in os.listdir(video) if f.endswith(".mp4")]
    greedy = run("examples.evaluate", f"--checkpoint={logdir}", "--episodes=3")
    assert greedy.returncode == 0, greedy.stderr[-3000:]
    assert last_json(greedy.stdout)["greedy"] is True
    assert last_json(greedy.stdout)["episodes"] == 3


@pytest.mark.parametrize("flag,message", [
    ("--envs_per_group=0", "envs_per_group must be an int >= 1, got 0"),
    ("--env_kwargs={bad", "--env_kwargs must be a JSON object, got '{bad'"),
    ("--learner_devices=3", "learner_devices has device index 3, but this process has 1"),
    ("--ppo_hidden_sizes=64,x", "--ppo_hidden_sizes must be comma-separated ints"),
    ("--total_env_steps=0", "--total_env_steps must be >= 1, got 0"),
    ("--agent=nope", "value should be one of"),
    ("--eval_video", "--eval_video needs --logdir"),
    ("--eval_every_updates=-2", "--eval_every_updates must be an int >= 0"),
    # NaN would never write a row, a negative number every update
    ("--log_every_seconds=nan", "--log_every_seconds must be a finite number >= 0 (0: a "
                                "row every learner update), got nan"),
    ("--log_every_seconds=-1", "--log_every_seconds must be a finite number >= 0"),
    ("--log_every_seconds=inf", "--log_every_seconds must be a finite number >= 0"),
    # flags that would do nothing without another
    ("--heartbeat_timeout_seconds=30", "--heartbeat_timeout_seconds=30 watches the peers of "
                                       "a multi-process run: it needs --coordinator_address "
                                       "or --distributed"),
    ("--wandb_mode=offline", "--wandb_mode=offline is the mode of the Weights & Biases run: "
                             "it needs --wandb_project"),
])
@pytest.mark.timeout(60)
def test_bad_flag_is_a_clear_error_before_anything_starts(flag, message):
    result = run("examples.train", flag)
    assert result.returncode != 0
    assert message in result.stderr
    assert "env steps" not in result.stdout


@pytest.mark.parametrize("args,message", [
    # Each would be ignored without evaluation: Config reads them only when it evaluates.
    *[([flag], f"--{flag[2:].split('=')[0].removeprefix('no')} sets up evaluation during "
                "training: it needs --eval_every_updates > 0")
      for flag in ("--eval_episodes=3", "--noeval_greedy", "--eval_max_share=0.1",
                   "--eval_video_every=2", "--eval_device=0")],
    (["--eval_every_updates=0", "--eval_episodes=3"], "--eval_episodes sets up evaluation"),
    (["--eval_every_updates=1", "--eval_video_every=2"],
     "--eval_video_every spaces the evaluation videos: it needs --eval_video"),
    (["--eval_every_updates=1", "--eval_device=5"],
     "--eval_device has device index 5, but this process has 1 local devices"),
    (["--eval_every_updates=1", "--eval_video_dir="], "--eval_video_dir='' is an empty path"),
])
@pytest.mark.timeout(60)
def test_evaluation_flags_that_would_do_nothing_or_cannot_work_are_errors(args, message):
    result = run("examples.train", *args)
    assert result.returncode != 0
    assert message in result.stderr, result.stderr[-3000:]
    assert "env steps" not in result.stdout


@pytest.mark.timeout(180)
def test_evaluations_during_training_reach_every_sink_and_wandb_offline(tmp_path):
    logdir = str(tmp_path / "run")
    result = run("examples.train", f"--logdir={logdir}", "--total_env_steps=6000",
                 "--eval_every_updates=2", "--eval_episodes=2", "--eval_max_share=1",
                 "--wandb_project=sebulba-test", "--wandb_mode=offline", *SMALL)
    assert result.returncode == 0, result.stderr[-3000:]
    with open(os.path.join(logdir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    evaluations = [r for r in rows if "eval/return" in r]
    assert evaluations, rows[-3:]
    for row in evaluations:  # at the step its networks were published: 64 per update
        assert row["step"] == row["eval/learner_update"] * 8 * 8
        assert row["eval/episodes"] == 2 and 1 <= row["eval/return"] <= 500
    # W&B offline: the same scalars (against env_steps) and the run's config, in its
    # run file under the logdir
    (run_file,) = [os.path.join(d, f) for d, _, files in os.walk(os.path.join(logdir, "wandb"))
                   for f in files if f.endswith(".wandb")]
    # every evaluation row, as metrics.jsonl has it, against its env step (W&B's service
    # process may still be writing the file: see the wandb test in test_metrics.py)
    expected = {(r["step"], r["eval/return"]) for r in evaluations}
    deadline = time.monotonic() + 20
    while True:
        records = wandb_records(pathlib.Path(run_file))
        logged = [row for row in map(history_row, records) if row]
        by_step = {(r["env_steps"], r["eval/return"]) for r in logged if "eval/return" in r}
        if by_step == expected or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert by_step == expected
    assert any("episode/return" in r and "learner/loss" in r for r in logged)
    (run_record,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    config = {u.key: json.loads(u.value_json) for u in run_record.config.update}
    assert config["run"]["eval_every_updates"] == 2, config
    assert config["total_env_steps"] == 6000 and "CartPole-v1" in json.dumps(config)


@pytest.mark.timeout(60)
def test_helpfull_documents_agent_flags_and_flagfile_works(tmp_path):
    help_text = run("examples.train", "--helpfull").stdout
    assert "agents.spg:" in help_text
    assert "--spg_learning_rate: SPG: " in help_text
    assert "--envs_per_group: envs in each env group" in help_text  # Config's docstring
    assert "--num_envs" not in help_text
    flagfile = tmp_path / "flags.txt"
    flagfile.write_text("--envs_per_group=0\n")
    result = run("examples.train", f"--flagfile={flagfile}")
    assert result.returncode != 0 and "got 0" in result.stderr


@pytest.mark.timeout(120)
def test_console_script_runs_the_checkouts_launcher_from_anywhere(tmp_path):
    # `sebulba-train` (pyproject's [project.scripts]) finds the checkout beside the editable
    # sebulba package, so it works from another directory, where `examples` and `agents`
    # are not importable (they are not installed).
    script = (shutil.which("sebulba-train", path=sysconfig.get_path("scripts"))
              or shutil.which("sebulba-train"))
    assert script, "no sebulba-train: install the checkout with `pip install -e .`"
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PYTHONPATH")}

    def sebulba_train(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([script, *args], cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=100)

    not_installed = subprocess.run([sys.executable, "-c", "import examples.train"],
                                   cwd=tmp_path, env=env, capture_output=True, text=True)
    assert "No module named 'examples'" in not_installed.stderr
    help_text = sebulba_train("--helpshort")  # absl exits with 1 after the help
    assert "Train an agent in the Sebulba loop" in help_text.stdout, help_text.stderr[-3000:]
    for flag in ("--agent", "--envs_per_group", "--steps_per_cycle", "--env_kwargs",
                 "--total_env_steps"):
        assert f"{flag}:" in help_text.stdout
    assert "--spg_learning_rate" not in help_text.stdout  # agent flags: --helpfull
    result = sebulba_train("--total_env_steps=64", '--env_kwargs={"max_episode_steps": 20}',
                           "--envs_per_group=4", "--steps_per_cycle=4", "--async_factor=1",
                           "--progress=false", "--logdir=run")
    assert result.returncode == 0, result.stderr[-3000:]
    assert last_json(result.stdout)["consumed"] >= 64
    assert os.listdir(tmp_path / "run" / "checkpoints")  # relative to the caller's directory
    bad = sebulba_train("--envs_per_group=0")
    assert bad.returncode != 0 and "envs_per_group must be an int >= 1, got 0" in bad.stderr


def test_console_script_without_a_checkout_says_how_to_get_one(tmp_path, monkeypatch):
    from sebulba import cli

    assert cli.checkout_root() == os.path.realpath(ROOT)
    package = tmp_path / "site-packages" / "sebulba"
    package.mkdir(parents=True)
    assert cli.checkout_root(str(package)) is None
    monkeypatch.setattr(cli, "_PACKAGE_DIR", str(package))
    with pytest.raises(SystemExit) as exit_info:
        cli.main()
    assert "pip install -e ." in str(exit_info.value.code)
    assert "python -m examples.train" in str(exit_info.value.code)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("vectorization", ["sync", "vector_entry_point"])
def test_atari_ids_train_through_ale_py(vectorization, tmp_path):
    # sync: gymnasium's RGB frames (210, 160, 3); vector_entry_point: ale-py's
    # AtariVectorEnv, 84 x 84 grayscale stacks of 4 (channels first). Both go through the
    # Nature CNN, and the checkpoint shows the frames reached it: its first convolution
    # moved, and two different frames give different action probabilities.
    import jax
    import numpy as np

    import sebulba
    from agents.common import networks
    from examples.checkpoints import eval_vectorization, load_policy

    logdir = str(tmp_path / "pong")
    result = run("examples.train", "--agent=spg", "--env=ALE/Pong-v5",
                 f"--vectorization={vectorization}", f"--logdir={logdir}",
                 "--envs_per_group=2", "--steps_per_cycle=4",
                 "--async_factor=1", "--total_env_steps=24", "--spg_hidden_sizes=16",
                 "--progress=false")
    assert result.returncode == 0, result.stderr[-3000:]
    assert last_json(result.stdout)["consumed"] >= 24
    agent, nets, meta = load_policy(logdir)
    config = sebulba.Config(env="ALE/Pong-v5", vectorization=eval_vectorization(meta),
                            envs_per_group=2, async_factor=1, steps_per_cycle=4)
    initial = sebulba.Sebulba(agent, config).initial_state().nets  # the launcher's seed 0
    kernel = nets["params"]["torso"]["Conv_0"]["kernel"]
    assert np.abs(kernel - initial["params"]["torso"]["Conv_0"]["kernel"]).max() > 0
    space = agent.env_spec.observation_space
    rng = np.random.default_rng(0)
    frames = rng.integers(0, 256, (2,) + space.shape).astype(np.uint8)
    _, out = networks.act(agent.network, nets, (), jax.numpy.asarray(frames),
                          np.ones(2, bool))
    assert not np.allclose(out.policy.logits[0], out.policy.logits[1], atol=1e-6)


def run_together(argvs: list[list[str]], envs: list[dict], timeout: float = 200
                 ) -> list[subprocess.CompletedProcess]:
    """Runs `python *argv` once per (argv, env), all at once (the processes of one
    cluster); none outlives the call."""
    procs = [subprocess.Popen([sys.executable, *a], cwd=ROOT, env=e, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
             for a, e in zip(argvs, envs, strict=True)]
    try:
        outputs = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    return [subprocess.CompletedProcess(p.args, p.returncode, out, err)
            for p, (out, err) in zip(procs, outputs, strict=True)]


def run_launchers(args: list[list[str]], envs: list[dict]) -> list[str]:
    """`python -m examples.train` once per (args, env), all at once (`run_together`);
    each must exit 0. Returns their stdouts."""
    done = run_together([["-m", "examples.train", *a] for a in args], envs)
    for result in done:
        assert result.returncode == 0, result.stderr[-3000:]
    return [result.stdout for result in done]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_same_command_on_two_processes_trains_one_cluster(tmp_path):
    # The README's across-machines command, on 127.0.0.1: it must join the cluster
    # before anything touches JAX devices.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    outputs = run_launchers(
        [[f"--coordinator_address=127.0.0.1:{port}", "--num_processes=2", f"--process_id={i}",
          "--total_env_steps=4000", f"--logdir={tmp_path / 'run'}",
          "--checkpoint_every_steps=1500", *SMALL] for i in range(2)],
        [env, env])
    primary = last_json(outputs[0])
    assert primary["num_processes"] == 2 and primary["global_consumed"] >= 4000
    assert primary["consumed"] < primary["global_consumed"]  # the other process fed half
    assert not [line for line in outputs[1].splitlines() if line.startswith("{")]  # logs once
    # every process reports the run's throughput beside its own
    assert primary["global_consumed_steps_per_second"] == pytest.approx(
        primary["global_consumed"] / primary["wall_seconds"], rel=0.01)
    # Process 0 saves the networks with its own envs' step states and experience; process 1
    # saves its own beside them, at the same steps, and each resumes its own.
    run_dir = tmp_path / "run"
    steps = [sorted(int(d) for d in os.listdir(run_dir / "checkpoints") if d.isdigit()),
             sorted(int(f[:-5]) for f in os.listdir(run_dir / "checkpoints_process_1")
                    if f.endswith(".json"))]
    assert len(steps[0]) >= 2 and steps[0] == steps[1]
    # A save cut short in process 1 (killed between process 0's save and its own): both
    # pass over that step, and resume from the one before.
    os.remove(run_dir / "checkpoints_process_1" / f"{steps[0][-1]}.json")
    resumed = run_launchers(
        [[f"--coordinator_address=127.0.0.1:{port}", "--num_processes=2", f"--process_id={i}",
          "--total_env_steps=6000", f"--logdir={run_dir}", "--resume", *SMALL]
         for i in range(2)], [env, env])
    assert f"at {steps[0][-2]:,} env steps" in resumed[0]
    assert last_json(resumed[0])["total_consumed"] >= 6000
    # A save cut short in process 0 instead (its step directory gone): both resume from
    # the step before, and process 1 drops its own part of the newer step. Each keeps
    # one more than --keep_checkpoints (1 here): a cut-short save leaves a common step.
    steps = [sorted(int(d) for d in os.listdir(run_dir / "checkpoints") if d.isdigit()),
             sorted(int(f[:-5]) for f in os.listdir(run_dir / "checkpoints_process_1")
                    if f.endswith(".json"))]
    assert steps[0] == steps[1] and len(steps[0]) >= 2
    shutil.rmtree(run_dir / "checkpoints" / str(steps[0][-1]))
    again = run_launchers(
        [[f"--coordinator_address=127.0.0.1:{port}", "--num_processes=2", f"--process_id={i}",
          "--total_env_steps=8000", f"--logdir={run_dir}", "--resume",
          "--keep_checkpoints=1", "--checkpoint_every_steps=1500", *SMALL]
         for i in range(2)], [env, env])
    assert f"at {steps[0][-2]:,} env steps" in again[0]
    assert f"removed its parts of checkpoints [{steps[0][-1]}]" in again[1]
    after = [sorted(int(d) for d in os.listdir(run_dir / "checkpoints") if d.isdigit()),
             sorted(int(f[:-5]) for f in os.listdir(run_dir / "checkpoints_process_1")
                    if f.endswith(".json"))]
    assert after[0] == after[1] and len(after[0]) == 2


@pytest.mark.timeout(240)
def test_distributed_takes_the_cluster_from_a_slurm_environment():
    # What SLURM's srun sets for 2 tasks on one node; JAX derives the coordinator
    # (the first node, a port from the job id) and each process's index from it.
    port = None
    for job_id in range(1000, 1100):
        candidate = job_id % 2**12 + (65535 - 2**12 + 1)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", candidate))
            except OSError:
                continue
        port, job = candidate, job_id
        break
    assert port is not None, "no free port in JAX's SLURM range"
    base = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    outputs = run_launchers(
        [["--distributed", "--heartbeat_timeout_seconds=30", "--total_env_steps=2000", *SMALL]] * 2,
        [{**base, "SLURM_JOB_ID": str(job), "SLURM_STEP_NODELIST": "127.0.0.1",
          "SLURM_NTASKS": "2", "SLURM_PROCID": str(i), "SLURM_LOCALID": str(i)}
         for i in range(2)])
    primary = last_json(outputs[0])
    assert primary["num_processes"] == 2 and primary["consumed"] < primary["global_consumed"]


@pytest.mark.timeout(240)
def test_a_multiagent_run_with_agent_ids_evaluates_from_its_checkpoint(tmp_path):
    """The README's role_call run: its policy reads observations extended by the agent's
    one-hot, which evaluation must extend too (it restored the networks against the
    plain observations and stopped with a shape mismatch)."""
    logdir = str(tmp_path / "roles")
    trained = run("examples.train", "--agent=ppo", "--vectorization=pettingzoo",
                  "--env=sebulba.envs.suite.role_call", "--agent_ids", f"--logdir={logdir}",
                  "--envs_per_group=4", "--steps_per_cycle=8", "--async_factor=1",
                  "--total_env_steps=256", "--progress=false")
    assert trained.returncode == 0, trained.stderr[-3000:]
    result = run("examples.evaluate", f"--checkpoint={logdir}", "--episodes=4", "--num_envs=2")
    assert result.returncode == 0, result.stderr[-3000:]
    report = last_json(result.stdout)
    assert report["episodes"] >= 4 and report["checkpoint_env_steps"] >= 256
    # absl's INFO lines (orbax logs every checkpoint step) are off unless --verbosity
    assert not [line for line in result.stderr.splitlines() if line.startswith("I")]


def test_a_stopped_process_s_last_line_says_whether_its_own_part_was_saved(
        tmp_path, monkeypatch, capsys):
    """Process 1's orbax checkpointer never saves (process 0 writes the checkpoints); its
    own part of each is in its ProcessCheckpointer, which its last line must look at."""
    import types

    import jax

    from examples.train import report
    from sebulba.checkpoint import ProcessCheckpointer

    class Unsaving:  # process 1's Checkpointer of the shared directory: never saves
        directory = str(tmp_path / "checkpoints")

        def all_steps(self):
            return []

    own = ProcessCheckpointer(str(tmp_path / "checkpoints_process_1"))
    launch = types.SimpleNamespace(checkpointer=Unsaving(), own=own, consumed=0)
    result = types.SimpleNamespace(stopped_early=True, global_consumed=640)
    peer_signal = types.SimpleNamespace(signum=None, exit_code=None)
    monkeypatch.setattr(jax, "process_index", lambda: 1)

    with pytest.raises(SystemExit) as stopped:
        report(launch, result, peer_signal)
    assert stopped.value.code == 143
    assert "no checkpoint saved" in capsys.readouterr().err  # nothing saved yet: true

    own.save(640, counters={"consumed": 640}, metadata={"agent": "ppo"})
    with pytest.raises(SystemExit):
        report(launch, result, peer_signal)
    err = capsys.readouterr().err
    assert "no checkpoint saved" not in err, err
    assert (f"after 640 env steps; checkpoint in {tmp_path / 'checkpoints'} (this "
            f"process's part in {tmp_path / 'checkpoints_process_1'})") in err, err
