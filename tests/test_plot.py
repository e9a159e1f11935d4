"""`sebulba-plot`: reading, grouping and resampling run logdirs, and the figure it writes.

The real logdir comes from a short launcher run; evaluation rows (and the arithmetic of
means and spreads) are written by hand where the expected numbers are known.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from sebulba import plot

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def write_rows(logdir, rows, *, tail: str = "") -> str:
    os.makedirs(logdir, exist_ok=True)
    with open(os.path.join(logdir, plot.METRICS_FILE), "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
        f.write(tail)
    return str(logdir)


def train_row(step, time, ret=None, sps=1000.0, **more):
    row = {"step": step, "time": time, plot.THROUGHPUT: sps, "learner/version": step // 10}
    if ret is not None:
        row.update({"episode/return": ret, "episode/count": 4})
    return row | more


def eval_row(step, time, ret, **more):
    return {"step": step, "time": time, "eval/return": ret, "eval/return_std": 1.0,
            "eval/episodes": 8, "eval/length": ret, "eval/learner_update": step // 10} | more


@pytest.fixture(scope="module")
def launcher_run(tmp_path_factory) -> str:
    """The logdir of a real PPO CartPole run of the launcher (a few seconds)."""
    logdir = str(tmp_path_factory.mktemp("runs") / "ppo_seed0")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    done = subprocess.run(
        [sys.executable, "-m", "examples.train", "--agent=ppo", "--env=CartPole-v1",
         "--total_env_steps=12000", f"--logdir={logdir}", "--log_every_seconds=0.1",
         "--noprogress", "--checkpoint_every_steps=1000000"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    return logdir


def test_a_launcher_run_reads_as_its_rows(launcher_run):
    run = plot.read_run(launcher_run)
    with open(os.path.join(launcher_run, plot.METRICS_FILE)) as f:
        assert len(run.rows) == sum(1 for _ in f)  # one process, nothing superseded
    (start,) = plot.read_rows(os.path.join(launcher_run, plot.STARTS_FILE))
    assert start["step"] == 0 and start["time"] <= run.rows[0]["time"]  # a fresh run
    steps, returns = run.series("episode/return")
    assert len(steps) >= 3 and np.all(np.diff(steps) > 0) and steps[-1] <= 12000 + 2048
    assert np.all(returns >= 8)  # CartPole episodes last at least 8 steps
    seconds, sps = run.series(plot.THROUGHPUT, "wall_time")
    assert seconds[0] == 0 and np.all(np.diff(seconds) > 0) and np.all(sps > 0)
    assert [p.title for p in plot.panels([run], "env_steps")] == [
        "training return", "throughput (consumed env steps/s)"]


def test_seeds_of_a_real_run_are_one_curve_of_their_mean_and_spread(launcher_run, tmp_path):
    # The real run as seed 0, and as seed 1 with every training return 10 higher.
    seed0 = shutil.copytree(launcher_run, tmp_path / "ppo_seed0")
    rows = plot.read_rows(os.path.join(launcher_run, plot.METRICS_FILE))
    higher = [r | {"episode/return": r["episode/return"] + 10} if "episode/return" in r
              else r for r in rows]
    seed1 = write_rows(tmp_path / "ppo_seed1", higher)
    runs = [plot.read_run(str(seed0)), plot.read_run(seed1)]
    groups = plot.group_runs(runs)
    assert list(groups) == [str(tmp_path / "ppo")] and groups[str(tmp_path / "ppo")] == runs

    [(_, key, curve)] = plot.panel_curves(plot.panels(runs, "env_steps")[0], groups)
    steps, returns = runs[0].series("episode/return")
    assert key == "episode/return" and curve.runs == 2
    assert curve.x[0] == steps[0] and curve.x[-1] == steps[-1] and len(curve.x) == 200
    on_grid = plot.resample(steps, returns, curve.x)
    np.testing.assert_allclose(curve.low, on_grid)
    np.testing.assert_allclose(curve.high, on_grid + 10)
    np.testing.assert_allclose(curve.mean, on_grid + 5)
    # At its own steps, a run resamples to its rows.
    np.testing.assert_allclose(plot.resample(steps, returns, steps), returns)


def test_mean_and_spread_by_hand(tmp_path):
    # A: return = step / 10 over [0, 200]; B: return = 40 - step / 10 over [100, 300].
    a = write_rows(tmp_path / "a", [train_row(0, 0.0, 0.0), train_row(200, 2.0, 20.0)])
    b = write_rows(tmp_path / "b", [train_row(100, 5.0, 30.0), train_row(300, 9.0, 10.0)])
    series = [plot.read_run(d).series("episode/return") for d in (a, b)]
    # Only [100, 200] is covered by both: A is 10, 15, 20 there, B 30, 25, 20.
    minmax = plot.aggregate("ab", series, points=3)
    np.testing.assert_allclose(minmax.x, [100, 150, 200])
    np.testing.assert_allclose(minmax.mean, [20, 20, 20])
    np.testing.assert_allclose(minmax.low, [10, 15, 20])
    np.testing.assert_allclose(minmax.high, [30, 25, 20])
    std = plot.aggregate("ab", series, spread="std", points=3)
    np.testing.assert_allclose(std.low, [10, 15, 20])
    np.testing.assert_allclose(std.high, [30, 25, 20])
    # By wall time A's rows are at 0 and 2 s, B's at 0 and 4 s (each from its first row).
    by_time = plot.aggregate("ab", [plot.read_run(d).series("episode/return", "wall_time")
                                    for d in (a, b)], points=3)
    np.testing.assert_allclose(by_time.x, [0, 1, 2])
    np.testing.assert_allclose(by_time.mean, [15, 17.5, 20])  # A 0, 10, 20; B 30, 25, 20
    single = plot.aggregate("a", series[:1])
    assert single.runs == 1 and single.low is None
    np.testing.assert_array_equal(single.x, [0, 200])


def test_resample_never_extrapolates_and_smoothing_trails():
    got = plot.resample(np.array([100.0, 200.0]), np.array([1.0, 2.0]),
                        np.array([50.0, 150.0, 200.0, 250.0]))
    np.testing.assert_array_equal(got, [np.nan, 1.5, 2.0, np.nan])
    np.testing.assert_allclose(plot.smooth(np.array([1.0, 2.0, 3.0, 7.0]), 2),
                               [1, 1.5, 2.5, 5])
    np.testing.assert_allclose(plot.smooth(np.array([1.0, 2.0]), 5), [1, 1.5])


def test_a_resumed_run_replaces_the_rows_it_logs_again(tmp_path):
    rows = [train_row(100, 0.0, 1.0), train_row(200, 1.0, 2.0),
            eval_row(150, 1.5, 5.0),  # written after the training row of a later step
            train_row(300, 2.0, 3.0), eval_row(250, 2.5, 6.0),
            # Resumed (hours later) from a checkpoint before 250: 250 and 300 are redone.
            train_row(250, 9000.0, 20.0), train_row(350, 9001.0, 30.0),
            eval_row(350, 9001.5, 7.0)]
    run = plot.read_run(write_rows(tmp_path / "resumed", rows, tail='{"step": 40'))
    steps, returns = run.series("episode/return")
    np.testing.assert_array_equal(steps, [100, 200, 250, 350])
    np.testing.assert_array_equal(returns, [1, 2, 20, 30])
    np.testing.assert_array_equal(run.series("eval/return")[0], [150, 350])
    np.testing.assert_array_equal(run.series("episode/return", "wall_time")[0],
                                  [0, 1, 9000, 9001])


def write_starts(logdir, starts) -> None:
    with open(os.path.join(logdir, plot.STARTS_FILE), "w") as f:
        f.writelines(json.dumps({"step": step, "time": time}) + "\n" for step, time in starts)


def test_the_starts_file_drops_what_an_earlier_run_wrote_past_the_step_resumed_from(
        tmp_path):
    # Killed at 52000 (no save after 50000), resumed from 50000: its 52000 rows are not
    # logged again before 60000, and the resumed run's first evaluation (written before
    # its training row of the same step) stays.
    rows = [train_row(10000, 0.0, 1.0), train_row(50000, 5.0, 5.0),
            train_row(52000, 5.2, 6.0), eval_row(52000, 5.3, 60.0),
            eval_row(60000, 100.0, 70.0), train_row(60000, 100.1, 7.0),
            train_row(70000, 101.0, 8.0)]
    logdir = write_rows(tmp_path / "killed", rows)
    write_starts(logdir, [(0, -1.0), (50000, 99.0)])
    run = plot.read_run(logdir)
    np.testing.assert_array_equal(run.series("episode/return")[0], [10000, 50000, 60000,
                                                                    70000])
    np.testing.assert_array_equal(run.series("eval/return")[0], [60000])
    # A fresh run in the logdir of one that died before its first checkpoint: all of the
    # earlier run's rows go, and its wall time starts at the new run's first row.
    rows = [train_row(51200, 0.0, 1.0), train_row(51712, 3600.0, 2.0),
            train_row(103424, 3605.0, 3.0)]
    logdir = write_rows(tmp_path / "restarted", rows)
    write_starts(logdir, [(0, -1.0), (0, 3599.0)])
    run = plot.read_run(logdir)
    np.testing.assert_array_equal(run.series("episode/return")[0], [51712, 103424])
    np.testing.assert_array_equal(run.series("episode/return", "wall_time")[0], [0, 5])


def test_evaluation_and_team_returns_are_curves_of_their_panels(tmp_path):
    rows = [train_row(100, 0.0, 1.0, **{"episode/team_return": 3.0}),
            train_row(200, 1.0, None),  # no episode ended: no return
            train_row(300, 2.0, float("nan")) | {"episode/return": None},  # NaN is null
            eval_row(300, 2.5, 9.0, **{"eval/team_return": 27.0}),
            train_row(400, 3.0, 4.0, **{"episode/team_return": 12.0})]
    run = plot.read_run(write_rows(tmp_path / "team", rows))
    np.testing.assert_array_equal(run.series("episode/return")[0], [100, 400])
    chosen = plot.panels([run], "wall_time")
    assert [(p.title, p.x) for p in chosen] == [
        ("training return", "wall_time"), ("evaluation return", "wall_time"),
        ("throughput (consumed env steps/s)", "wall_time")]
    groups = plot.group_runs([run])
    assert [key for _, key, _ in plot.panel_curves(chosen[0], groups)] == [
        "episode/return", "episode/team_return"]
    (_, _, ret), (_, _, team) = plot.panel_curves(chosen[1], groups)
    np.testing.assert_array_equal(ret.mean, [9.0])
    np.testing.assert_array_equal(team.x, [2.5])  # wall time of the evaluation row


def test_grouping_rules():
    assert plot.group_name("runs/ppo_seed0") == "runs/ppo"
    assert plot.group_name("runs/ppo-Seed_12/") == "runs/ppo"
    assert plot.group_name("runs/ppo/seed3") == "runs/ppo"
    assert plot.group_name("runs/ppo_lr3") == "runs/ppo_lr3"  # a number is not a seed
    assert plot.group_name("seed0") == "seed0"
    assert plot.group_name("runs/ppo/1", "parent") == "runs/ppo"
    assert plot.group_name("runs/ppo_seed0", "none") == "runs/ppo_seed0"
    runs = [plot.Run(d, ()) for d in ("r/a_seed0", "r/b_seed0", "r/a_seed1", "r/c")]
    assert {k: [r.logdir for r in v] for k, v in plot.group_runs(runs).items()} == {
        "r/a": ["r/a_seed0", "r/a_seed1"], "r/b": ["r/b_seed0"], "r/c": ["r/c"]}
    by_label = plot.group_runs(runs, labels=["x", "y", "y", "x"])
    assert {k: [r.logdir for r in v] for k, v in by_label.items()} == {
        "x": ["r/a_seed0", "r/c"], "y": ["r/b_seed0", "r/a_seed1"]}
    assert len(plot.group_runs(runs, "none")) == 4


def image(path: str) -> np.ndarray:
    from matplotlib import image as mpimg

    return mpimg.imread(path)


def not_blank(pixels: np.ndarray) -> bool:
    rgb = pixels[..., :3]
    return rgb.std() > 0.05 and (rgb < 0.9).any(axis=-1).mean() > 0.01


def drawn_in(pixels: np.ndarray, color: str) -> float:
    """The share of the figure's pixels of `color` (a group's curves and spread: axes,
    ticks and titles are black and grey)."""
    from matplotlib import colors

    target = np.asarray(colors.to_rgb(color))
    return float((np.abs(pixels[..., :3] - target).max(axis=-1) < 0.15).mean())


def test_the_command_line_draws_runs_with_evaluation(launcher_run, tmp_path):
    # A second seed of the real run, with evaluation rows added by hand.
    seed1 = shutil.copytree(launcher_run, tmp_path / "ppo_seed1")
    last = plot.read_run(launcher_run).rows[-1]
    with open(seed1 / plot.METRICS_FILE, "a") as f:
        for i in range(1, 4):
            f.write(json.dumps(eval_row(last["step"] * i // 3, last["time"] + i, 10.0 * i))
                    + "\n")
    out = tmp_path / "curves.png"
    done = subprocess.run([sys.executable, "-m", "sebulba.plot", launcher_run, str(seed1),
                           "-o", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == str(out)
    pixels = image(str(out))
    assert pixels.shape[:2] == (390, 3 * 520)  # three panels at 100 dpi: eval is one
    assert not_blank(pixels)
    # the copy's curves (the second group, drawn last: over the first's, which are the
    # same rows) in every panel, the evaluation's its alone
    for panel in np.split(pixels, 3, axis=1):
        assert drawn_in(panel, "C1") > 0.001


def test_main_draws_by_wall_time(launcher_run, tmp_path, capsys, monkeypatch):
    from matplotlib.figure import Figure

    saved, savefig = [], Figure.savefig
    monkeypatch.setattr(Figure, "savefig",
                        lambda fig, *a, **k: saved.append(fig) or savefig(fig, *a, **k))
    out = tmp_path / "by_time.png"
    plot.main([launcher_run, "--x", "wall_time", "--smooth", "3", "-o", str(out),
               "--dpi", "50"])
    assert capsys.readouterr().out.strip() == str(out)
    pixels = image(str(out))
    assert pixels.shape[:2] == (195, 2 * 260)  # two panels: no evaluation rows
    assert not_blank(pixels)
    # Each panel draws its curve: the smoothed rows of the run, as panel_curves has them.
    run = plot.read_run(launcher_run)
    (fig,) = saved
    for panel, ax in zip(plot.panels([run], "wall_time"), fig.axes, strict=True):
        (curve,) = [c for _, _, c in plot.panel_curves(panel, {"run": [run]}, window=3)]
        (line,) = ax.lines
        assert len(curve.mean) >= 2
        np.testing.assert_allclose(line.get_ydata(), curve.mean)


def error_of(argv, capsys) -> str:
    with pytest.raises(SystemExit) as exit_:
        plot.main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err  # one line
    return err


def test_errors_are_one_line_and_exit_code_2(tmp_path, capsys, monkeypatch):
    out = str(tmp_path / "x.png")
    empty = tmp_path / "empty"
    empty.mkdir()
    assert error_of([str(empty), "-o", out], capsys) == (
        f"sebulba-plot: error: {empty} has no metrics.jsonl: expected the --logdir of a run "
        "of examples/train.py\n")
    assert "does not exist" in error_of([str(tmp_path / "nowhere"), "-o", out], capsys)
    early = write_rows(tmp_path / "early", [train_row(100, 0.0), train_row(200, 1.0)])
    assert "early/metrics.jsonl has no row with a return (2 rows" in error_of(
        [early, "-o", out], capsys)
    broken = write_rows(tmp_path / "broken", [train_row(100, 0.0, 1.0)],
                        tail='{"step": 2\n' + json.dumps(train_row(300, 1.0, 2.0)) + "\n")
    assert "broken/metrics.jsonl:2 is not JSON" in error_of([broken, "-o", out], capsys)
    a = write_rows(tmp_path / "a_seed0", [train_row(0, 0.0, 1.0), train_row(100, 1.0, 1.0)])
    b = write_rows(tmp_path / "a_seed1", [train_row(200, 0.0, 1.0), train_row(300, 1.0, 1.0)])
    # Seeds of no common range in a panel (evaluations that fell at different updates)
    # are drawn there run by run, said on stderr; the other panels as usual.
    plot.main([a, b, "-o", out])
    err = capsys.readouterr().err
    assert err.startswith("sebulba-plot: training return: the runs of ")
    assert "share no x range (theirs: [0, 100], [200, 300])" in err
    assert err.endswith("; drawn run by run\n") and err.count("\n") == 1
    assert os.path.exists(out)
    os.remove(out)
    assert "got 1 labels for 2 logdirs" in error_of([a, b, "--labels", "x", "-o", out], capsys)
    assert "cannot write" in error_of([a, "-o", str(tmp_path / "no" / "x.png")], capsys)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    assert error_of([a, "-o", out], capsys) == (
        "sebulba-plot: error: matplotlib is not installed: pip install -e '.[plot]' in "
        "sebulba's checkout\n")
    assert not os.path.exists(out)
