"""benchmarks/curves.py: a short real run prints its records, draws its plot, and the
plot's title names the agent config the run changed (a run at a non-default setting
must not read as the default config)."""

from __future__ import annotations

import json

import pytest

from benchmarks import curves


@pytest.mark.timeout(120)
def test_a_run_records_its_curve_and_the_plot_names_its_config(tmp_path, capsys,
                                                               no_leftovers):
    png = tmp_path / "curve.png"
    curves.main(["--agent=spg", "--env=CartPole-v1", "--steps=4096", "--seeds=0",
                 "--bins=4", '--agent_config={"learning_rate": 0.003}',
                 '--loop_config={"envs_per_group": 8, "steps_per_cycle": 16}',
                 f"--plot={png}"])
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["record"] for r in records] == ["meta", "run", "end"]
    run = records[1]
    assert run["agent_config"] == {"learning_rate": 0.003}
    assert run["env_steps"] >= 4096
    assert len(run["curve"]) == 4
    assert [s for s, _ in run["curve"]] == sorted(s for s, _ in run["curve"])
    assert run["last_10pct_return"] > 0  # CartPole pays 1 a step: some episode ended
    assert png.stat().st_size > 0 and records[2]["plot"] == str(png)

    assert curves.plot_title([run]).startswith("spg on CartPole-v1, learning_rate=0.003 (")
    assert ", default config (" in curves.plot_title([{**run, "agent_config": {}}])


@pytest.mark.timeout(120)
def test_rewards_scaled_are_recorded_in_the_envs_own_units(capsys, no_leftovers):
    curves.main(["--agent=spg", "--env=CartPole-v1", "--steps=2048", "--seeds=0",
                 "--bins=2", "--reward_scale=1000",
                 '--loop_config={"envs_per_group": 8, "steps_per_cycle": 16}'])
    run = [json.loads(line) for line in capsys.readouterr().out.splitlines()][1]
    assert run["reward_scale"] == 1000.0
    # CartPole pays 1 a step, 1000 here: divided back, a return is an episode's length.
    returns = [r for _, r in run["curve"] if r is not None] + [run["last_10pct_return"]]
    assert returns and all(8 <= r <= 500 for r in returns), returns
    assert curves.plot_title([run]).startswith("spg on CartPole-v1, rewards x1000 (")


@pytest.mark.parametrize("value", ["0", "inf", "nan"])
def test_a_reward_scale_that_scales_nothing_is_refused(value, capsys):
    with pytest.raises(SystemExit):
        curves.parse_args([f"--reward_scale={value}"])
    assert "--reward_scale must be a finite number other than 0" in capsys.readouterr().err
