"""The memory suite: every recurrent agent with its defaults on the memory tasks, and its
feed-forward twin beside it, for several seeds.

An agent runs with its default config (only `use_lstm` set; the launcher's defaults for
the loop, and R2D2's sequence period as steps_per_cycle, which it requires). A score is
the mean episode return over the last 10% of the budget divided by the task's optimum;
"steps to 0.8" is the end of the first curve bin whose mean return reaches 0.8 of the
optimum (None: never).

Records (JSON lines): meta; one run record per (agent, twin, task, seed); end, with the
table in Markdown. `--plots DIR` writes one PNG per task (matplotlib, extra
`notebooks`): each run's curve, normalized by the optimum.

    python -m benchmarks.memory_suite --agents=ppo --tasks=repeat_first --seeds=0
    python -m benchmarks.memory_suite --seeds=0,1,2 --plots=benchmarks/plots
    python -m benchmarks.memory_suite --records=a.jsonl,b.jsonl --plots=benchmarks/plots

`--records` runs nothing: it makes the table and the plots from the run records of
earlier runs' output.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from typing import Any

from benchmarks._util import emit, int_list, meta, str_list
from benchmarks.curves import binned_curve


@dataclasses.dataclass(frozen=True)
class Task:
    env: str
    optimum: float
    chance: float


TASKS = {
    "repeat_first": Task("sebulba.envs.suite:sebulba/RepeatFirst-v0", 1.0, 0.265),
    "repeat_previous": Task("sebulba.envs.suite:sebulba/RepeatPrevious-v0", 1.0, 0.25),
    "cartpole_no_velocity": Task("sebulba.envs.suite:sebulba/CartPoleNoVelocity-v1", 500.0,
                                 22.0),
    "count_recall": Task("sebulba.envs.suite:sebulba/CountRecall-v0", 1.0, 0.1),
    "repeat_first_continuous": Task(
        "sebulba.envs.suite:sebulba/RepeatFirstContinuous-v0", 1.0, 0.265),
}
THRESHOLD = 0.8


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.memory_suite", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--agents", type=str_list, default=["ppo", "impala", "r2d2"])
    p.add_argument("--tasks", type=str_list,
                   default=["repeat_first", "repeat_previous", "cartpole_no_velocity"],
                   help=f"of {', '.join(TASKS)}")
    p.add_argument("--seeds", type=int_list, default=[0])
    p.add_argument("--steps", type=int, default=1_000_000, help="env steps per run")
    p.add_argument("--feed_forward", action="store_true",
                   help="also run each agent's feed-forward twin (use_lstm False)")
    p.add_argument("--agent_config", type=json.loads, default={},
                   help="JSON object of config fields for every agent (default: none)")
    p.add_argument("--bins", type=int, default=20, help="points of each binned curve")
    p.add_argument("--plots", default="", help="directory for one PNG per task")
    p.add_argument("--records", type=str_list, default=[],
                   help="JSON-lines files of earlier runs: table and plots from their runs")
    p.add_argument("--defaults_only", action="store_true",
                   help="with --records: only the runs that set no agent_config field")
    args = p.parse_args(argv)
    unknown = [t for t in args.tasks if t not in TASKS]
    if unknown:
        p.error(f"unknown tasks {unknown}: expected some of {sorted(TASKS)}")
    if "use_lstm" in args.agent_config:
        p.error("--agent_config sets use_lstm: every run has an LSTM, and --feed_forward "
                "adds the twins without")
    return args


def steps_to(curve: list[tuple[int, float | None]], level: float) -> int | None:
    """The end of the first bin whose mean return reaches `level`; None if none does."""
    return next((end for end, r in curve if r is not None and r >= level), None)


def run(agent_name: str, use_lstm: bool, task_name: str, seed: int,
        args: argparse.Namespace) -> dict[str, Any]:
    import sebulba
    from agents.registry import AGENTS

    task = TASKS[task_name]
    entry = AGENTS[agent_name]
    config = dataclasses.replace(entry.config_class(), use_lstm=use_lstm, **args.agent_config)
    agent = entry.build(sebulba.env_spec(task.env), config)
    # R2D2 builds its sequences from whole cycles: its period is its steps_per_cycle.
    period = getattr(config, "sequence_period", None)
    loop = sebulba.Config(env=task.env, seed=seed,
                          **({"steps_per_cycle": period} if period else {}))
    result = sebulba.Sebulba(agent, loop).run(args.steps)
    curve = binned_curve(result.episodes, result.env_steps, args.bins)
    last = result.mean_return(0.9, 1.0)
    return {
        "record": "run", "agent": agent_name, "use_lstm": use_lstm, "task": task_name,
        "seed": seed, "agent_config": args.agent_config, "env_steps": result.env_steps,
        "wall_seconds": round(result.wall_seconds, 1),
        "steps_per_second": round(result.steps_per_second, 1),
        "last_10pct_return": round(last, 3),
        "score": round(last / task.optimum, 3),
        "steps_to_0.8": steps_to(curve, THRESHOLD * task.optimum),
        "curve": curve,
    }


def _name(record: dict[str, Any]) -> str:
    """The agent, its core and any config fields set: what a table row or a line shows."""
    name = f"{record['agent']}, {'LSTM' if record['use_lstm'] else 'feed-forward'}"
    config = record.get("agent_config") or {}
    return name + "".join(f", {k}={v}" for k, v in sorted(config.items()))


def table(records: list[dict[str, Any]]) -> str:
    """Markdown: one row per agent (and twin), one column per task; each cell the scores
    per seed and the steps to 0.8 per seed."""
    tasks = list(dict.fromkeys(r["task"] for r in records))
    rows = list(dict.fromkeys(_name(r) for r in records))
    lines = ["| agent | " + " | ".join(tasks) + " |", "| --- |" + " --- |" * len(tasks)]
    for name in rows:
        cells = []
        for task in tasks:
            runs = [r for r in records if (_name(r), r["task"]) == (name, task)]
            scores = ", ".join(f"{r['score']:.2f}" for r in runs)
            reached = ", ".join("-" if r["steps_to_0.8"] is None
                                else f"{r['steps_to_0.8'] / 1e3:.0f}k" for r in runs)
            cells.append(f"{scores} ({reached})" if runs else "")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(records: list[dict[str, Any]], directory: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(directory, exist_ok=True)
    paths = []
    for task_name in dict.fromkeys(r["task"] for r in records):
        task = TASKS[task_name]
        fig, ax = plt.subplots(figsize=(6, 4))
        runs = [r for r in records if r["task"] == task_name]
        labels = list(dict.fromkeys(_name(r) for r in runs))
        for i, name in enumerate(labels):
            for j, r in enumerate(x for x in runs if _name(x) == name):
                points = [(s, v / task.optimum) for s, v in r["curve"] if v is not None]
                ax.plot([s for s, _ in points], [v for _, v in points], color=f"C{i}",
                        linestyle="-" if r["use_lstm"] else ":", alpha=0.7,
                        label=name if j == 0 else None)
        ax.axhline(THRESHOLD, color="grey", linewidth=0.8)
        ax.axhline(task.chance / task.optimum, color="grey", linewidth=0.8, linestyle="--")
        ax.set_ylim(0, 1.05)
        ax.set_title(f"{task.env.split('/')[-1]}: defaults, one line per seed")
        ax.set_xlabel("env steps")
        ax.set_ylabel("return / optimum (dashed: chance)")
        ax.legend(loc="lower right")
        fig.tight_layout()
        path = os.path.join(directory, f"memory_{task_name}.png")
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths


def _lines(paths: list[str]) -> list[str]:
    lines = []
    for path in paths:
        with open(path) as f:
            lines += [line for line in f if line.strip()]
    return lines


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    started = time.perf_counter()
    emit(meta("memory_suite", vars(args)))
    records = [r for r in map(json.loads, _lines(args.records)) if r["record"] == "run"
               and not (args.defaults_only and r.get("agent_config"))]
    twins = (True, False) if args.feed_forward else (True,)
    for task in args.tasks if not args.records else ():
        for agent in args.agents:
            for lstm in twins:
                for seed in args.seeds:
                    records.append(run(agent, lstm, task, seed, args))
                    emit(records[-1])
    paths = plot(records, args.plots) if args.plots else []
    emit({"record": "end", "seconds": round(time.perf_counter() - started, 1),
          "plots": paths, "table": table(records)})


if __name__ == "__main__":
    main()
