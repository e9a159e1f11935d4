"""Errors a user can act on: a mistake on the command line or in the Python API is one
clear line naming the flag (or field) and its value, early, never a traceback or a page
of help; env wrappers by name; figures readable at any scale."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import time
import types

import gymnasium as gym
import numpy as np
import pytest

import sebulba
from examples.config_flags import USAGE_EXIT_CODE
from sebulba.checkpoint import Checkpointer
from sebulba.envs import env_spec
from sebulba.envs.gymnasium_source import make_vector_env
from sebulba.envs.wrappers import parse_wrappers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--envs_per_group=4", "--steps_per_cycle=8", "--async_factor=1", "--progress=false",
         "--log_every_seconds=0"]


def launcher(*args: str, module: str = "examples.train", timeout: float = 60,
             code: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    command = [sys.executable, "-c", code, *args] if code else [sys.executable, "-m", module,
                                                                 *args]
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def assert_usage_error(result: subprocess.CompletedProcess, message: str) -> None:
    """Exit code 2, the message on one line of stderr, no traceback, no help text."""
    assert result.returncode == USAGE_EXIT_CODE, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert ".py: error: " in lines[0] and message in lines[0], result.stderr[-3000:]
    assert len(lines) == 2 and "--helpfull" in lines[1], result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert "Train an agent" not in result.stdout + result.stderr  # absl's help text
    assert "env steps" not in result.stdout  # nothing ran


@pytest.mark.parametrize("args,message", [
    # An unknown id, or a module:Id whose module does not import: the flag and the value.
    (["--env=NoSuchEnv-v0"], "--env 'NoSuchEnv-v0' is not a registered gymnasium id: "
                             "Environment `NoSuchEnv` doesn't exist"),
    (["--env=Cartpole-v1"], "Did you mean: `CartPole`?"),
    (["--env=no_such_module:Foo-v0"], "--env 'no_such_module:Foo-v0': importing "
                                      "'no_such_module', which the `module:Id` form imports"),
    (["--vectorization=pettingzoo", "--env=no_such_module"],
     "--env 'no_such_module' is not an importable PettingZoo env module"),
    (['--env_kwargs={"foo": 1}'], "--env_kwargs {'foo': 1} do not fit env 'CartPole-v1'"),
    # absl's own parse errors are reported the same way.
    (["--agent=nope"], "flag --agent=nope: value should be one of <impala|ppo|r2d2|sac|spg>"),
    (["--no_such_flag=1"], "Unknown command line flag 'no_such_flag'"),
    (["--envs_per_group=0"], "--envs_per_group must be an int >= 1, got 0"),
    (["--seed=-1"], "--seed must be an int in [0, 2**63) (JAX's PRNG keys and the envs are "
                    "seeded from it), got -1"),
    (["--shutdown_timeout_s=nan"], "--shutdown_timeout_s must be finite seconds > 0, got nan"),
    (["--ppo_learning_rate=nan"], "--ppo_learning_rate must be a finite number > 0, got nan"),
    (["--num_processes=2", "--process_id=1"], "--num_processes and --process_id join a "
     "multi-process run: give --coordinator_address (host:port of process 0) or "
     "--distributed too"),
    (["--checkpoint_every_steps=256"], "--checkpoint_every_steps needs --logdir"),
    (["--keep_checkpoints=1"], "--keep_checkpoints needs --logdir"),
    # Another agent's flag would be ignored.
    (["--agent=spg", "--ppo_learning_rate=0.1"],
     "--ppo_learning_rate is a flag of agent 'ppo', but this run's agent is 'spg' "
     "(--agent=spg), so it would be ignored; did you mean --spg_learning_rate?"),
    (["--r2d2_lstm_size=8"], "--r2d2_lstm_size is a flag of agent 'r2d2', but this run's "
                             "agent is 'ppo' (--agent=ppo), so it would be ignored"),
    # Checks of the agent against the run: one-line errors, not tracebacks.
    (["--agent=r2d2", "--steps_per_cycle=32"],
     "--steps_per_cycle=32 must equal the sequence period"),
    (["--agent=r2d2", "--env=Pendulum-v1", "--steps_per_cycle=40"],
     "--agent=r2d2 on --env=Pendulum-v1: R2D2 acts in Discrete action spaces only"),
    (["--agent=sac"], "--agent=sac on --env=CartPole-v1: SAC needs a Box action space "
                      "(continuous actions), got Discrete(2); use PPO, IMPALA or SPG"),
    (["--agent=r2d2", "--r2d2_sequence_overlap=100"],
     "--r2d2_sequence_overlap=100 must be < sequence_length=80"),
    (["--env_wrappers=FrameStack(4)"], "--env_wrappers: 'FrameStack' is not a wrapper in "
                                       "gymnasium.wrappers; did you mean FrameStackObservation?"),
    (["--env_wrappers=FlattenObservation", "--vectorization=vector_entry_point"],
     "--env_wrappers wrap each env, so they need vectorization 'sync' or 'async', got "
     "'vector_entry_point'"),
])
@pytest.mark.timeout(60)
def test_a_usage_error_is_one_line_naming_the_flag_and_value(args, message):
    assert_usage_error(launcher(*args, "--total_env_steps=64"), message)


def test_the_evaluation_command_reports_usage_errors_alike(tmp_path):
    missing = tmp_path / "nowhere"
    assert_usage_error(launcher(f"--checkpoint={missing}", module="examples.evaluate"),
                       f"--checkpoint={missing}: no checkpoint in {missing}: no such directory")
    # With a step, the missing directory is still the checkpoint's fault, not the step's.
    assert_usage_error(launcher(f"--checkpoint={missing}", "--step=5",
                                module="examples.evaluate"),
                       f"--checkpoint={missing}: no checkpoint in {missing}: no such directory")
    assert not missing.exists()


# Counts the networks R2D2 initializes for real (not traced by jax.eval_shape).
COUNT_INITIALIZATIONS = textwrap.dedent("""
    import sys
    import jax
    from agents import r2d2
    from examples import train
    from examples.config_flags import run_main

    new_networks = r2d2.R2D2.new_networks

    def counted(self, key):
        if not isinstance(key, jax.core.Tracer):
            print("networks initialized", flush=True)
        return new_networks(self, key)

    r2d2.R2D2.new_networks = counted
    sys.argv = ["train.py", *sys.argv[1:]]
    run_main(train.main)
""")


@pytest.mark.timeout(60)
def test_an_agents_check_against_the_run_fires_before_its_networks_are_initialized():
    # R2D2 checks steps_per_cycle as it sizes its replay, after its networks: the launcher
    # traces the initial state first (jax.eval_shape), which computes nothing.
    result = launcher("--agent=r2d2", "--steps_per_cycle=32", code=COUNT_INITIALIZATIONS)
    assert_usage_error(result, "--steps_per_cycle=32 must equal the sequence period")
    assert "networks initialized" not in result.stdout


@pytest.mark.timeout(150)
def test_r2d2_takes_its_sequence_period_as_steps_per_cycle_unless_it_is_set():
    result = launcher(
        "--agent=r2d2", "--r2d2_sequence_length=12", "--r2d2_sequence_overlap=6",
        "--r2d2_burn_in=2", "--r2d2_min_replay_size=4", "--r2d2_batch_size=4",
        "--envs_per_group=4", "--async_factor=1", "--progress=false", "--log_every_seconds=0",
        "--total_env_steps=480", timeout=140)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    # Trajectories of 4 envs x T = 12 - 6 steps: 20 updates for 480 steps (T = 32 would
    # make updates of 128 steps).
    assert summary["consumed"] == 480 and summary["learner_updates"] == 20


@pytest.mark.timeout(60)
def test_resume_without_a_checkpoint_is_an_error_naming_the_directory(tmp_path):
    missing = tmp_path / "never_ran"
    assert_usage_error(launcher("--resume", f"--logdir={missing}"),
                       f"--resume: there is no checkpoint in {missing}/checkpoints to continue "
                       "from (drop --resume to start a run there)")
    assert not missing.exists()  # a typo in --logdir leaves no directory behind
    empty = tmp_path / "empty"
    (empty / "checkpoints").mkdir(parents=True)
    assert_usage_error(launcher("--resume", f"--logdir={empty}"),
                       f"--resume: there is no checkpoint in {empty}/checkpoints")


@pytest.mark.timeout(60)
def test_a_fresh_run_in_a_logdir_with_checkpoints_is_refused(tmp_path):
    checkpointer = Checkpointer(str(tmp_path / "checkpoints"))
    for step in (512, 1024):
        checkpointer.save(step, nets={"w": np.ones(3, np.float32)}, opt=(),
                          counters={"consumed": step}, metadata={})
    checkpointer.close()
    assert_usage_error(launcher(f"--logdir={tmp_path}"),
                       f"--logdir={tmp_path} holds checkpoints of an earlier run (steps 512 "
                       f"to 1,024 in {tmp_path}/checkpoints): pass --resume to continue it, "
                       "or another --logdir to start afresh")


@pytest.mark.timeout(60)
def test_resume_refuses_a_checkpoint_of_another_env_before_anything_runs(tmp_path):
    # CartPole-v0 has CartPole-v1's spaces, so every network shape would match. (Other
    # differences, env_kwargs and wrappers, are in test_checkpoint.py.)
    checkpointer = Checkpointer(str(tmp_path / "checkpoints"))
    metadata = {"agent": "ppo", "env": "CartPole-v0", "env_kwargs": {}, "env_wrappers": [],
                "vectorization": "sync", "agent_ids": False}
    checkpointer.save(1000, nets={"w": np.ones(2, np.float32)}, opt=(),
                      counters={"consumed": 1000}, metadata=metadata)
    checkpointer.close()
    assert_usage_error(
        launcher("--resume", f"--logdir={tmp_path}"),  # the default env, CartPole-v1
        f"checkpoint 1000 in {tmp_path}/checkpoints was trained on another env: env "
        "'CartPole-v0' (this run: 'CartPole-v1')")


# --- env wrappers by name ---------------------------------------------------------------


def test_wrappers_are_parsed_to_one_canonical_spelling():
    assert parse_wrappers("") == ()
    assert parse_wrappers(" FlattenObservation ,FrameStackObservation( 4 ),"
                          "ResizeObservation(shape=(8, 8))") == (
        "FlattenObservation", "FrameStackObservation(4)", "ResizeObservation(shape=(8, 8))")
    assert parse_wrappers(["ClipReward(max_reward=1)"]) == ("ClipReward(max_reward=1)",)
    config = sebulba.Config(env_wrappers="FlattenObservation, ClipReward(-1, 1)")
    assert config.env_wrappers == ("FlattenObservation", "ClipReward(-1, 1)")
    assert config == sebulba.Config(env_wrappers=("FlattenObservation", "ClipReward(-1, 1)"))
    flip = gym.wrappers.FlattenObservation  # from Python, any env -> env callable
    assert sebulba.Config(env_wrappers=[flip]).env_wrappers == (flip,)


@pytest.mark.parametrize("wrappers,message", [
    ("FrameStak(4)", r"'FrameStak' is not a wrapper in gymnasium.wrappers; did you mean "
                     r"FrameStackObservation\?"),
    ("Nonsense", r"'Nonsense' is not a wrapper .* the names are AddRenderObservation, "),
    ("Autoreset", r"Autoreset cannot be used: the vector env around each env resets it"),
    ("TimeLimit", r"'TimeLimit' does not fit TimeLimit\(max_episode_steps\): missing a "
                  r"required argument: 'max_episode_steps'"),
    ("TimeLimit(steps=5)", r"does not fit TimeLimit\(max_episode_steps\)"),
    ("ClipReward(max_reward=abs)", r"the arguments of 'ClipReward\(max_reward=abs\)' must be "
                                   r"literals"),
    ("gymnasium.wrappers.ClipReward", r"is not a comma-separated list of gymnasium wrapper "
                                      r"names"),
    (["A, B"], r"entry 'A, B' must name one wrapper, got 2"),
    ([3], r"entries must be wrapper names or callables, got 3"),
])
def test_a_bad_wrapper_is_an_error_naming_it(wrappers, message):
    with pytest.raises(ValueError, match="env_wrappers.*" + message):
        sebulba.Config(env_wrappers=wrappers)


def test_wrappers_need_per_env_vectorization():
    with pytest.raises(ValueError, match="env_wrappers wrap each env, so they need "
                                         "vectorization 'sync' or 'async', got 'envpool'"):
        sebulba.Config(env="CartPole-v1", vectorization="envpool",
                       env_wrappers="FlattenObservation")


def test_positional_wrapper_arguments_follow_the_env():
    """`FrameStackObservation(4)` is `FrameStackObservation(env, 4)`, as in Python."""
    spec = sebulba.Config(env_wrappers="FrameStackObservation(3),TimeLimit(7)").env_spec()
    assert spec.observation_space.shape == (3, 4)
    vec = make_vector_env("CartPole-v1", 1, "sync", env_wrappers="TimeLimit(2)")
    try:
        vec.reset(seed=0)
        vec.step(np.zeros(1, np.int64))
        assert vec.step(np.zeros(1, np.int64))[3].all()  # truncated after 2 steps
    finally:
        vec.close()


@pytest.mark.parametrize("vectorization", ["sync", "async"])
@pytest.mark.timeout(60)
def test_wrappers_wrap_each_env_of_a_vector_env_in_order(vectorization, no_leftovers):
    wrappers = "TimeLimit(max_episode_steps=3),FrameStackObservation(stack_size=2)"
    spec = env_spec("CartPole-v1", env_wrappers=wrappers)
    assert spec.observation_space.shape == (2, 4)
    assert spec == sebulba.Config(env_wrappers=wrappers).env_spec()
    vec = make_vector_env("CartPole-v1", 2, vectorization, env_wrappers=wrappers)
    try:
        obs, _ = vec.reset(seed=0)
        assert obs.shape == (2, 2, 4)
        np.testing.assert_array_equal(obs[:, 0], obs[:, 1])  # padded with the reset obs
        for _ in range(2):
            obs, _, terminated, truncated, _ = vec.step(np.zeros(2, np.int64))
        assert not truncated.any()
        _, _, terminated, truncated, _ = vec.step(np.zeros(2, np.int64))
        assert truncated.all()  # the TimeLimit inside: 3 steps
    finally:
        vec.close()


@pytest.mark.timeout(120)
def test_the_launcher_trains_evaluates_and_checkpoints_wrapped_envs(tmp_path):
    from examples.checkpoints import load_policy
    from sebulba.evaluation import evaluate

    logdir = tmp_path / "run"
    wrappers = "FrameStackObservation(stack_size=2),ClipReward(max_reward=0.5)"
    result = launcher("--agent=spg", f"--env_wrappers={wrappers}", "--total_env_steps=64",
                      f"--logdir={logdir}", *SMALL, timeout=100)
    assert result.returncode == 0, result.stderr[-3000:]
    agent, nets, meta = load_policy(str(logdir))
    assert meta["env_wrappers"] == ["FrameStackObservation(stack_size=2)",
                                    "ClipReward(max_reward=0.5)"]
    assert agent.env_spec.observation_space.shape == (2, 4)
    evaluation = evaluate(agent, nets, meta["env"], 2, num_envs=2,
                          env_kwargs=meta["env_kwargs"], env_wrappers=meta["env_wrappers"])
    assert max(evaluation.returns) <= 0.5 * 500  # rewards clipped to 0.5
    # The example evaluates and records the wrapped env as it was trained.
    video = tmp_path / "video"
    report = launcher(f"--checkpoint={logdir}", "--episodes=2", f"--video_dir={video}",
                      module="examples.evaluate", timeout=100)
    assert report.returncode == 0, report.stderr[-3000:]
    assert json.loads(report.stdout.splitlines()[-1])["episodes"] == 2
    assert [f for f in os.listdir(video) if f.endswith(".mp4")]
    # A resume without the wrappers is another env.
    again = launcher("--agent=spg", "--resume", f"--logdir={logdir}", *SMALL)
    assert again.returncode == USAGE_EXIT_CODE and "env_wrappers" in again.stderr


# --- figures -----------------------------------------------------------------------------


def test_the_progress_bar_shows_returns_in_significant_digits():
    # One decimal would show 0.0 for a mean return of 0.0432.
    from sebulba.metrics import Reporter
    from sebulba.runtime.accounting import Accounting

    accounting = Accounting()
    accounting.add_episodes([(0.0123, 5), (0.0741, 5)])
    accounting.consumed = 64
    info = types.SimpleNamespace(accounting=accounting, metrics={}, version=1, evaluations=())
    reporter = Reporter(1000, every_seconds=0.0, progress=True)
    try:
        time.sleep(0.01)
        reporter(info)
        assert "return=0.0432," in reporter._bar.postfix, reporter._bar.postfix
        # From the second update on, the learner's rate over the window, named as such.
        accounting.consumed = 128
        time.sleep(0.01)
        reporter(types.SimpleNamespace(accounting=accounting, metrics={}, version=2,
                                       evaluations=()))
        assert re.search(r"consumed/s=[\d,]+", reporter._bar.postfix), reporter._bar.postfix
    finally:
        reporter.close()



class SmallRewards(gym.Wrapper):
    """CountingEnv's episodes of 5 steps, each rewarded 0.0123: returns of 0.0615."""

    def __init__(self):
        from tests.envs import CountingEnv

        super().__init__(CountingEnv(5))

    def step(self, action):
        obs, _, terminated, truncated, info = self.env.step(action)
        return obs, 0.0123, terminated, truncated, info


@pytest.mark.timeout(60)
def test_the_run_summary_shows_returns_in_significant_digits(no_leftovers):
    from tests.counting_agent import CountingAgent

    config = sebulba.Config(env=SmallRewards, envs_per_group=2, steps_per_cycle=5,
                            async_factor=1)
    result = sebulba.Sebulba(CountingAgent(sebulba.env_spec(SmallRewards)), config).run(100)
    assert "mean return (last 10%) 0.0615" in result.summary()  # not 0.1


@pytest.mark.timeout(60)
@pytest.mark.parametrize("flag,message", [
    ("--episodes=0", "--episodes must be >= 1, got 0"),
    ("--num_envs=0", "--num_envs must be >= 1, got 0"),
    ("--seed=-1", "--seed must be >= 0, got -1"),
])
def test_evaluate_refuses_bad_counts_before_loading_anything(tmp_path, flag, message):
    assert_usage_error(launcher(f"--checkpoint={tmp_path}", flag, module="examples.evaluate"),
                       message)


@pytest.mark.timeout(120)
def test_the_summary_line_is_strict_json_when_no_episode_ended():
    # Pendulum's episodes are 200 steps: none ends in 8 envs x 32 steps, and a mean of no
    # returns is NaN, which Python's json writes but JSON readers refuse.
    result = launcher("--env=Pendulum-v1", "--envs_per_group=8", "--async_factor=1",
                      "--total_env_steps=256", "--progress=false", timeout=100)
    assert result.returncode == 0, result.stderr[-3000:]

    def refuse(constant):
        raise AssertionError(f"{constant} is not JSON")

    summary = json.loads(result.stdout.strip().splitlines()[-1], parse_constant=refuse)
    assert summary["episodes"] == 0 and summary["mean_return_last_10pct"] is None
