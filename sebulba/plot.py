"""`sebulba-plot`: learning curves and throughput of run logdirs, as one PNG.

    sebulba-plot runs/ppo_seed0 runs/ppo_seed1 runs/ppo_seed2 -o ppo.png
    sebulba-plot runs/ppo_seed* runs/impala_seed* --x wall_time --smooth 5
    sebulba-plot runs/a runs/b runs/c --labels lr3e-4 lr3e-4 lr1e-3 --spread std
    python -m sebulba.plot runs/ppo_seed0                # the same as sebulba-plot

Each LOGDIR is one run: the `metrics.jsonl` the launcher (`examples/train.py`) writes
there. The figure has a panel per quantity: training return (`episode/return`) and, when
any run has evaluation rows, evaluation return (`eval/return`), both against `--x` (env
steps or wall time); and throughput (`throughput/consumed_steps_per_second`) against
wall time. A `*/team_return` (multi-agent envs) is a second, dashed curve of its panel.
Wall time is seconds since the run's first row (a resumed run's includes the time it was
stopped).

Runs are grouped into curves (`--group`):

- `seed` (the default): by the logdir's path with a trailing seed suffix stripped:
  `runs/ppo_seed0`, `runs/ppo-seed1` and `runs/ppo/seed2` are all the group `runs/ppo`;
  a path without one is a group of its own.
- `parent`: by the directory that holds the logdir (`runs/ppo/0`, `runs/ppo/1` -> `runs/ppo`).
- `none`: every run is its own curve.

`--labels` (one per LOGDIR) overrides the rule: runs with the same label are one group.
A group of one run is drawn as its rows are. A group of several is drawn as the mean of
its runs, with the spread between them shaded (`--spread`: min to max, the default, or
mean ± standard deviation): each run is interpolated linearly onto a common grid that
spans the x range every run of the group covers (never extrapolated).

A resumed run appends to its logdir's file, its env steps going on from its checkpoint:
each start of a run in the logdir is a line of `starts.jsonl` (when, and from which env
step: `sebulba.metrics.default_writers` writes it), and the rows written before a start
past its step are dropped (the resumed run logs those steps again; a fresh run in the
logdir of one that died before its first checkpoint starts from 0). For a logdir
without that file, the rows from before a resume at or past the env step of its first
training row are dropped.

The reading, grouping and resampling are plain functions (numpy only); matplotlib
(`pip install -e '.[plot]' in sebulba's checkout`) is needed only to draw.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import sys
from collections.abc import Mapping, Sequence

import numpy as np

METRICS_FILE = "metrics.jsonl"
STARTS_FILE = "starts.jsonl"  # {"time": ..., "step": ...} per start of a run in the logdir
TRAIN_RETURNS = ("episode/return", "episode/team_return")
EVAL_RETURNS = ("eval/return", "eval/team_return")
THROUGHPUT = "throughput/consumed_steps_per_second"
X_AXES = ("env_steps", "wall_time")
GROUP_RULES = ("seed", "parent", "none")
SPREADS = ("minmax", "std")
GRID_POINTS = 200

# A trailing seed suffix: `_seed0`, `-seed_12`, `.seed=3`, `/seed4` (case-insensitive).
_SEED_SUFFIX = re.compile(r"[-_./]?seed[-_=]?\d+$", re.IGNORECASE)


class PlotError(Exception):
    """What the command line reports as its one-line error (exit code 2)."""


@dataclasses.dataclass(frozen=True)
class Run:
    """The rows of one logdir's `metrics.jsonl`, resumes resolved, in file order."""

    logdir: str
    rows: tuple[Mapping[str, float | None], ...]

    @property
    def start_time(self) -> float:
        return float(self.rows[0]["time"])

    def has(self, key: str) -> bool:
        return any(_is_number(row.get(key)) for row in self.rows)

    def series(self, key: str, x: str = "env_steps") -> tuple[np.ndarray, np.ndarray]:
        """(x, values) of the rows with a finite `key`, ordered by x: x is the env step
        (`env_steps`) or seconds since the run's first row (`wall_time`)."""
        if x not in X_AXES:
            raise ValueError(f"x must be one of {X_AXES}, got {x!r}")
        rows = [row for row in self.rows if _is_number(row.get(key))]
        xs = np.array([row["step"] if x == "env_steps" else row["time"] - self.start_time
                       for row in rows], dtype=np.float64)
        ys = np.array([row[key] for row in rows], dtype=np.float64)
        # Evaluation rows may be written after training rows of later steps.
        order = np.argsort(xs, kind="stable")
        return xs[order], ys[order]


@dataclasses.dataclass(frozen=True)
class Curve:
    """One group's curve: its runs' mean, and their spread (None for a single run)."""

    label: str
    runs: int
    x: np.ndarray
    mean: np.ndarray
    low: np.ndarray | None = None
    high: np.ndarray | None = None


def _is_number(value: object) -> bool:
    # NaN and inf are written as null; bools are not metrics.
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(
        value)


def read_rows(path: str) -> list[dict]:
    """The JSON objects of a JSON-lines file; a last line cut short (a run writing it
    right now) is skipped, any other line that is not a JSON object with a numeric
    `step` and `time` is a PlotError naming it."""
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    rows = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            if number == len(lines):  # no newline after it: still being written
                continue
            raise PlotError(f"{path}:{number} is not JSON ({e.msg}): {line[:80]!r}") from None
        if not (isinstance(row, dict) and _is_number(row.get("step"))
                and _is_number(row.get("time"))):
            raise PlotError(f"{path}:{number} is not a metrics row (a JSON object with "
                            f"numeric 'step' and 'time'): {line[:80]!r}")
        rows.append(row)
    return rows


def _is_eval(row: Mapping) -> bool:
    return any(key.startswith("eval/") for key in row)


def resolve_resumes(rows: Sequence[Mapping], starts: Sequence[Mapping] = ()
                    ) -> list[Mapping]:
    """The rows without those a resumed run superseded. With `starts` (the logdir's
    `STARTS_FILE`), a row written before a start and past its env step is dropped.
    Without, a training row whose env step is not past the training row before it starts
    a resumed run's rows, and every earlier row (training or evaluation) at or past its
    step is dropped."""
    for start in starts:
        rows = [r for r in rows if r["time"] >= start["time"] or r["step"] <= start["step"]]
    kept: list[Mapping] = []
    last_train_step = -math.inf
    for row in rows:
        if not _is_eval(row):
            if row["step"] <= last_train_step:
                kept = [r for r in kept if r["step"] < row["step"]]
            last_train_step = row["step"]
        kept.append(row)
    return kept


def read_run(logdir: str) -> Run:
    """The run in `logdir`; PlotError if it has no `metrics.jsonl` or no row with a
    return."""
    path = os.path.join(logdir, METRICS_FILE)
    if not os.path.isfile(path):
        what = "does not exist" if not os.path.exists(logdir) else f"has no {METRICS_FILE}"
        raise PlotError(f"{logdir} {what}: expected the --logdir of a run of "
                        "examples/train.py")
    starts_path = os.path.join(logdir, STARTS_FILE)
    starts = read_rows(starts_path) if os.path.isfile(starts_path) else []
    rows = resolve_resumes(read_rows(path), starts)
    run = Run(logdir, tuple(rows))
    if not any(run.has(key) for key in TRAIN_RETURNS + EVAL_RETURNS):
        raise PlotError(
            f"{path} has no row with a return ({len(rows)} rows, none with "
            f"{' or '.join(TRAIN_RETURNS + EVAL_RETURNS)}): no episode ended before its "
            "last write; run it longer or with a smaller --log_every_seconds")
    return run


def group_name(logdir: str, rule: str = "seed") -> str:
    """The group of `logdir` under `rule` (see the module's doc)."""
    path = os.path.normpath(logdir)
    if rule == "seed":
        return _SEED_SUFFIX.sub("", path) or path
    if rule == "parent":
        return os.path.dirname(path) or "."
    if rule == "none":
        return path
    raise ValueError(f"group rule must be one of {GROUP_RULES}, got {rule!r}")


def group_runs(runs: Sequence[Run], rule: str = "seed",
               labels: Sequence[str] | None = None) -> dict[str, list[Run]]:
    """Groups by label (one per run) if given, else by `rule`; in order of first run."""
    if labels is not None and len(labels) != len(runs):
        raise PlotError(f"--labels: got {len(labels)} labels for {len(runs)} logdirs; give "
                        "one per LOGDIR (runs with the same label are one curve)")
    groups: dict[str, list[Run]] = {}
    for i, run in enumerate(runs):
        name = labels[i] if labels is not None else group_name(run.logdir, rule)
        groups.setdefault(name, []).append(run)
    return groups


def smooth(values: np.ndarray, window: int) -> np.ndarray:
    """The trailing mean over `window` values (fewer at the start)."""
    if window < 1:
        raise ValueError(f"smoothing window must be >= 1, got {window}")
    sums = np.cumsum(np.concatenate([[0.0], values]))
    ends = np.arange(1, len(values) + 1)
    starts = np.maximum(ends - window, 0)
    return (sums[ends] - sums[starts]) / (ends - starts)


def resample(x: np.ndarray, y: np.ndarray, grid: np.ndarray) -> np.ndarray:
    """`y(x)` interpolated linearly at `grid`; NaN outside [x[0], x[-1]]."""
    values = np.interp(grid, x, y)
    return np.where((grid >= x[0]) & (grid <= x[-1]), values, np.nan)


def aggregate(label: str, series: Sequence[tuple[np.ndarray, np.ndarray]], *,
              spread: str = "minmax", points: int = GRID_POINTS) -> Curve:
    """One curve of runs' (x, y) series: a single run's as it is; several runs' mean and
    spread on `points` evenly spaced x over the range all of them cover."""
    if spread not in SPREADS:
        raise ValueError(f"spread must be one of {SPREADS}, got {spread!r}")
    series = [(x, y) for x, y in series if len(x)]
    if not series:
        raise ValueError(f"{label}: no run has a value to draw")
    if len(series) == 1:
        x, y = series[0]
        return Curve(label, 1, x, y)
    lo, hi = max(x[0] for x, _ in series), min(x[-1] for x, _ in series)
    if lo > hi:
        ranges = ", ".join(f"[{x[0]:g}, {x[-1]:g}]" for x, _ in series)
        raise PlotError(f"the runs of {label!r} share no x range (theirs: {ranges}): "
                        "plot them as separate curves (--group none or --labels)")
    grid = np.linspace(lo, hi, points) if hi > lo else np.array([lo])
    values = np.stack([resample(x, y, grid) for x, y in series])
    mean = values.mean(axis=0)
    if spread == "minmax":
        low, high = values.min(axis=0), values.max(axis=0)
    else:
        std = values.std(axis=0)
        low, high = mean - std, mean + std
    return Curve(label, len(series), grid, mean, low, high)


@dataclasses.dataclass(frozen=True)
class Panel:
    title: str
    keys: tuple[str, ...]  # the first the main curve, the others dashed
    x: str


def panels(runs: Sequence[Run], x: str) -> list[Panel]:
    """Training return (if any run has it), evaluation return (if any), throughput."""
    chosen = [Panel("training return", TRAIN_RETURNS, x),
              Panel("evaluation return", EVAL_RETURNS, x),
              Panel("throughput (consumed env steps/s)", (THROUGHPUT,), "wall_time")]
    return [p for p in chosen if any(run.has(key) for run in runs for key in p.keys)]


def panel_curves(panel: Panel, groups: Mapping[str, Sequence[Run]], *, window: int = 1,
                 spread: str = "minmax") -> list[tuple[str, str, Curve]]:
    """(group, key, curve) of every group and key of `panel` some run has."""
    curves = []
    for name, runs in groups.items():
        for key in panel.keys:
            series = [run.series(key, panel.x) for run in runs if run.has(key)]
            if series:
                series = [(x, smooth(y, window)) for x, y in series]
                try:
                    curves.append((name, key, aggregate(name, series, spread=spread)))
                except PlotError as e:  # no common range here (evaluations of seeds
                    # that fell at different updates): each run as it is, said
                    print(f"sebulba-plot: {panel.title}: {e}; drawn run by run",
                          file=sys.stderr)
                    curves += [(name, key, aggregate(f"{name} [{i}]", [one]))
                               for i, one in enumerate(series)]
    return curves


def _time_unit(seconds: float) -> tuple[float, str]:
    if seconds >= 2 * 3600:
        return 3600.0, "h"
    if seconds >= 10 * 60:
        return 60.0, "min"
    return 1.0, "s"


def _legend_label(name: str, key: str, curve: Curve, spread: str) -> str:
    label = name if key in (TRAIN_RETURNS[0], EVAL_RETURNS[0], THROUGHPUT) else (
        f"{name} ({key.split('/')[-1].replace('_', ' ')})")
    if curve.runs > 1:
        band = "min-max" if spread == "minmax" else "± std"
        label += f": mean of {curve.runs} runs, {band}"
    return label


def draw(runs: Sequence[Run], groups: Mapping[str, Sequence[Run]], out: str, *,
         x: str = "env_steps", window: int = 1, spread: str = "minmax", dpi: int = 100
         ) -> None:
    """Writes the figure of `groups` (curves of `runs`) to the PNG `out`."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display needed
        import matplotlib.pyplot as plt
        from matplotlib.ticker import EngFormatter
    except ImportError:
        raise PlotError("matplotlib is not installed: pip install -e '.[plot]' in sebulba's "
                        "checkout") from None

    chosen = panels(runs, x)
    fig, axes = plt.subplots(1, len(chosen), figsize=(5.2 * len(chosen), 3.9), squeeze=False)
    colors = {name: f"C{i % 10}" for i, name in enumerate(groups)}
    handles = {}
    for panel, ax in zip(chosen, axes[0], strict=True):
        curves = panel_curves(panel, groups, window=window, spread=spread)
        scale, unit = 1.0, ""
        if panel.x == "wall_time":
            scale, unit = _time_unit(max(float(c.x[-1]) for _, _, c in curves))
        for name, key, curve in curves:
            style = "-" if key == panel.keys[0] else "--"
            few = len(curve.x) <= 2 or (curve.runs == 1 and key in EVAL_RETURNS)
            (line,) = ax.plot(curve.x / scale, curve.mean, style, color=colors[name],
                              marker="o" if few else None, markersize=3, linewidth=1.5)
            if curve.low is not None:
                ax.fill_between(curve.x / scale, curve.low, curve.high, color=colors[name],
                                alpha=0.2, linewidth=0)
            handles.setdefault(_legend_label(name, key, curve, spread), line)
        ax.set_title(panel.title)
        if panel.x == "env_steps":
            ax.set_xlabel("env steps")
            ax.xaxis.set_major_formatter(EngFormatter(sep=""))
        else:
            ax.set_xlabel(f"wall time ({unit})")
        if panel.keys == (THROUGHPUT,):
            ax.yaxis.set_major_formatter(EngFormatter(sep=""))
        ax.grid(alpha=0.3)
    axes[0][0].legend(handles.values(), handles.keys(), fontsize="small")
    fig.tight_layout()
    try:
        fig.savefig(out, dpi=dpi)
    except OSError as e:
        raise PlotError(f"cannot write {out}: {e.strerror or e}") from None
    finally:
        plt.close(fig)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="sebulba-plot", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("logdirs", nargs="+", metavar="LOGDIR", help="run logdirs (--logdir)")
    p.add_argument("-o", "--out", default="sebulba_plot.png",
                   help="the PNG to write (default: %(default)s)")
    p.add_argument("--x", choices=X_AXES, default="env_steps",
                   help="x axis of the return panels (throughput is always by wall time)")
    p.add_argument("--smooth", type=int, default=1, metavar="N",
                   help="trailing mean over N rows of each run before grouping")
    p.add_argument("--group", choices=GROUP_RULES, default="seed",
                   help="how runs form curves (see above)")
    p.add_argument("--labels", nargs="+", metavar="LABEL",
                   help="one label per LOGDIR: runs with the same label are one curve")
    p.add_argument("--spread", choices=SPREADS, default="minmax",
                   help="the shaded band of a group: min to max, or mean ± std")
    p.add_argument("--dpi", type=int, default=100)
    args = p.parse_args(argv)
    if args.smooth < 1:
        p.error(f"--smooth must be >= 1, got {args.smooth}")
    if args.dpi < 10:
        p.error(f"--dpi must be >= 10, got {args.dpi}")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    """Reads the logdirs, writes the figure and prints its path; a bad logdir, file or
    missing matplotlib is one line on stderr and exit code 2."""
    args = parse_args(argv)
    try:
        runs = [read_run(logdir) for logdir in args.logdirs]
        groups = group_runs(runs, args.group, args.labels)
        draw(runs, groups, args.out, x=args.x, window=args.smooth, spread=args.spread,
             dpi=args.dpi)
    except PlotError as e:
        print(f"sebulba-plot: error: {e}", file=sys.stderr)
        sys.exit(2)
    print(args.out)


if __name__ == "__main__":
    main()
