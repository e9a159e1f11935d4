"""Checkpoints written under older agent defaults (`agents.registry.DEFAULTS_VERSION`):
one whose networks would act otherwise here is refused, naming what changed, never
loaded in silence; one that a setting still describes loads with that setting."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from agents.registry import DEFAULTS_VERSION
from examples.checkpoints import load_policy
from tests.test_launcher import SMALL, run

PPO_SMALL = [*SMALL, "--ppo_hidden_sizes=16", "--total_env_steps=1000"]


def as_written_under(logdir: str, version: int, *, dropped: tuple[str, ...] = (),
                     **agent_config) -> None:
    """Rewrites the newest checkpoint's metadata as a sebulba of agents' defaults
    `version` wrote it (1: no "agent_defaults" entry), without the agent config's fields
    `dropped` (then unknown) and with its fields as given."""
    checkpoints = os.path.join(logdir, "checkpoints")
    step = max(int(d) for d in os.listdir(checkpoints) if d.isdigit())
    path = os.path.join(checkpoints, str(step), "meta", "metadata")
    with open(path) as f:
        meta = json.load(f)
    assert meta.pop("agent_defaults") == DEFAULTS_VERSION
    if version > 1:
        meta["agent_defaults"] = version
    for field in dropped:
        del meta["agent_config"][field]
    meta["agent_config"].update(agent_config)
    with open(path, "w") as f:
        json.dump(meta, f)


@pytest.fixture(scope="module")
def raw_rewards_run(tmp_path_factory) -> str:
    """A PPO run on CartPole with raw rewards: what "auto" meant before version 2."""
    logdir = str(tmp_path_factory.mktemp("defaults") / "run")
    result = run("examples.train", f"--logdir={logdir}", "--ppo_normalize_rewards=off",
                 *PPO_SMALL)
    assert result.returncode == 0, result.stderr[-3000:]
    as_written_under(logdir, 1, normalize_rewards="auto")
    return logdir


@pytest.mark.timeout(120)
def test_an_older_discrete_ppo_checkpoint_is_evaluated_as_it_was_written(raw_rewards_run):
    agent, nets, meta = load_policy(raw_rewards_run)
    assert meta["agent_config"]["normalize_rewards"] == "auto"
    assert agent.config.normalize_rewards == "off" and agent.return_discount is None


@pytest.mark.timeout(200)
def test_resuming_it_asks_for_the_setting_that_says_what_auto_was(raw_rewards_run, tmp_path):
    logdir = str(tmp_path / "run")
    shutil.copytree(raw_rewards_run, logdir)
    result = run("examples.train", f"--logdir={logdir}", "--resume", *PPO_SMALL)
    assert result.returncode == 2, result.stderr[-3000:]
    assert ("was written under the agents' defaults of version 1 (this sebulba's: "
            f"{DEFAULTS_VERSION}), and its networks would act otherwise here: PPO's "
            "normalize_rewards 'auto' divides "
            "rewards for discrete actions too since version 2") in result.stderr
    assert "(--ppo_normalize_rewards=off) is what 'auto' was" in result.stderr
    result = run("examples.train", f"--logdir={logdir}", "--resume",
                 "--ppo_normalize_rewards=off", *PPO_SMALL[:-1], "--total_env_steps=2000")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resumed from" in result.stdout


@pytest.mark.timeout(200)
@pytest.mark.parametrize("env,refused", [("Pendulum-v1", True),  # torques in [-2, 2]
                                         ("MountainCarContinuous-v0", False)])  # [-1, 1]
def test_an_older_gaussian_policy_is_refused_where_its_bounds_change_its_scale(
        env, refused, tmp_path):
    logdir = str(tmp_path / "run")
    result = run("examples.train", f"--logdir={logdir}", f"--env={env}", *PPO_SMALL)
    assert result.returncode == 0, result.stderr[-3000:]
    as_written_under(logdir, 1)
    if not refused:
        agent, _, _ = load_policy(logdir)
        assert agent.config.normalize_rewards == "auto"  # Box actions: on before as now
        return
    with pytest.raises(ValueError, match=r"was written under the agents' defaults of version "
                                         r"1 .* the Gaussian policy works in units of the "
                                         r"action space's bounds since version 2 \(Box\(-2\.0, "
                                         r"2\.0, \(1,\), float32\): .*evaluate it with the "
                                         r"sebulba that wrote it"):
        load_policy(logdir)


@pytest.mark.timeout(300)
def test_an_older_spg_checkpoint_is_evaluated_and_resumed_with_raw_rewards(tmp_path):
    """Before version 3 SPG learnt raw rewards (no normalize_rewards field, no reward
    moments in its networks)."""
    logdir = str(tmp_path / "run")
    spg = [*SMALL, "--agent=spg", "--spg_hidden_sizes=16", "--total_env_steps=1000"]
    result = run("examples.train", f"--logdir={logdir}", "--spg_normalize_rewards=off",
                 *spg)
    assert result.returncode == 0, result.stderr[-3000:]
    as_written_under(logdir, 2, dropped=("normalize_rewards",))
    agent, _, _ = load_policy(logdir)
    assert agent.config.normalize_rewards == "off" and agent.return_discount is None

    result = run("examples.train", f"--logdir={logdir}", "--resume", *spg)
    assert result.returncode == 2, result.stderr[-3000:]
    assert ("SPG divides large rewards by the return's std since version 3 (its networks "
            "keep the return's moments); --spg_normalize_rewards=off is what it learnt with"
            ) in result.stderr
    result = run("examples.train", f"--logdir={logdir}", "--resume",
                 "--spg_normalize_rewards=off", *spg[:-1], "--total_env_steps=2000")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resumed from" in result.stdout


SAC_SMALL = [*SMALL, "--env=Pendulum-v1", "--agent=sac", "--sac_hidden_sizes=16",
             "--sac_learning_starts=256", "--sac_batch_size=32",
             "--sac_replay_capacity=4096"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("experience", ["on", "off"])
def test_an_older_sac_checkpoint_evaluates_and_resumes_only_as_it_learnt(experience,
                                                                         tmp_path):
    """Before version 3 SAC learnt raw rewards and its experience held no reward moments:
    its networks still evaluate; a resume that would continue otherwise is refused,
    naming what to do."""
    logdir = str(tmp_path / "run")
    written = [*SAC_SMALL, f"--checkpoint_experience={experience}"]
    result = run("examples.train", f"--logdir={logdir}", *written,
                 "--total_env_steps=1024")
    assert result.returncode == 0, result.stderr[-3000:]
    as_written_under(logdir, 2, dropped=("normalize_rewards",))
    agent, _, meta = load_policy(logdir)
    assert meta["agent_defaults"] == 2 and agent.config.normalize_rewards

    result = run("examples.train", f"--logdir={logdir}", "--resume", *written,
                 "--total_env_steps=2048")
    assert result.returncode == 2, result.stderr[-3000:]
    assert ("was written under the agents' defaults of version 2 (this sebulba's: "
            f"{DEFAULTS_VERSION}), and a run would not continue it as it learnt: SAC's"
            ) in result.stderr
    raw = "--sac_normalize_rewards=false"
    if experience == "on":
        assert "which this checkpoint's replay lacks: start a new run" in result.stderr
        return
    assert f"learnt them raw: {raw} continues as it learnt" in result.stderr
    result = run("examples.train", f"--logdir={logdir}", "--resume", raw, *written,
                 "--total_env_steps=2048")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resumed from" in result.stdout
