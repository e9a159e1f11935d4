"""Learning curves: an agent with its default config (the launcher's defaults, no tuning
flags; `--agent_config` changes fields, which the records and the plot's title name) on
one env for several seeds; episode returns against env steps, as JSON and as a PNG plot
(matplotlib, extra `notebooks`).

Records (JSON lines): meta; one run record per seed (steps/second, the mean return over the
last 10% of the budget, the curve binned into `--bins` points); end. The plot shows each
seed's curve (and its evaluations during training, where `--loop_config` asks for
them, as dots).

    python -m benchmarks.curves --agent=ppo --env=InvertedPendulum-v5 --steps=300000
    python -m benchmarks.curves --agent=ppo --env=HalfCheetah-v5 --steps=1000000 \\
        --seeds=0,1,2 --plot=benchmarks/plots/ppo_halfcheetah.png
    python -m benchmarks.curves --agent=ppo --env=sebulba.envs.suite:sebulba/RepeatFirst-v0 \\
        --agent_config='{"use_lstm": true}'
    python -m benchmarks.curves --agent=impala --env=CartPole-v1 --steps=1000000 \\
        --seeds=0,1,2,3 --loop_config='{"envs_per_group": 32, "steps_per_cycle": 32}'
    python -m benchmarks.curves --agent=ppo --env=CartPole-v1 --reward_scale=1e-6

`--reward_scale` multiplies the env's rewards (a gymnasium env id, "sync" or "async"
vectorization): the defaults should learn at any scale. Returns are recorded divided by
it, in the env's own units.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from benchmarks._util import emit, int_list, meta


def reward_scaled_env(env_id: str, scale: float):
    """`env_id`'s env with its rewards multiplied by `scale` (a module-level factory:
    async workers unpickle it)."""
    import gymnasium as gym

    return gym.wrappers.TransformReward(gym.make(env_id), lambda r: r * scale)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.curves", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--agent", default="ppo")
    p.add_argument("--env", default="InvertedPendulum-v5")
    p.add_argument("--steps", type=int, default=300_000, help="env steps per seed")
    p.add_argument("--seeds", type=int_list, default=[0])
    p.add_argument("--agent_config", type=json.loads, default={},
                   help="JSON object of agent config fields (default: none, the defaults)")
    p.add_argument("--loop_config", type=json.loads, default={},
                   help="JSON object of sebulba.Config fields besides env and seed "
                        '(e.g. {"envs_per_group": 32, "steps_per_cycle": 32})')
    p.add_argument("--reward_scale", type=float, default=1.0,
                   help="multiply the env's rewards by this (returns are recorded divided "
                        "by it)")
    p.add_argument("--bins", type=int, default=20, help="points of the binned curve")
    p.add_argument("--plot", default="", help="PNG file to write the curves to")
    args = p.parse_args(argv)
    for name in ("agent_config", "loop_config"):
        if not isinstance(getattr(args, name), dict):
            p.error(f"--{name} must be a JSON object, got {getattr(args, name)!r}")
    if {"env", "seed"} & set(args.loop_config):
        p.error("--loop_config sets neither env nor seed: use --env and --seeds")
    if not (0 < abs(args.reward_scale) < float("inf")):
        p.error(f"--reward_scale must be a finite number other than 0, got "
                f"{args.reward_scale!r}")
    return args


def binned_curve(episodes: list[tuple[int, float, int]], total: int, bins: int
                 ) -> list[tuple[int, float | None]]:
    """(end of bin in env steps, mean return of the episodes that ended in it)."""
    edges = [total * (i + 1) // bins for i in range(bins)]
    curve, start = [], 0
    for end in edges:
        returns = [r for s, r, _ in episodes if start < s <= end]
        curve.append((end, sum(returns) / len(returns) if returns else None))
        start = end
    return curve


def run(args: argparse.Namespace, seed: int) -> dict[str, Any]:
    import dataclasses
    import functools

    import numpy as np

    import sebulba
    from agents.registry import AGENTS

    entry = AGENTS[args.agent]
    agent_config = dataclasses.replace(entry.config_class(), **args.agent_config)
    scale = args.reward_scale
    env = args.env if scale == 1.0 else functools.partial(reward_scaled_env, args.env, scale)
    agent = entry.build(sebulba.env_spec(env), agent_config)
    config = sebulba.Config(env=env, seed=seed, **args.loop_config)
    result = sebulba.Sebulba(agent, config).run(args.steps)
    episodes = [(s, r / scale, n) for s, r, n in result.episodes]  # the env's own units
    return {
        "record": "run", "agent": args.agent, "env": args.env, "seed": seed,
        "reward_scale": scale,
        "agent_config": args.agent_config, "loop_config": args.loop_config,
        "env_steps": result.env_steps,
        "wall_seconds": round(result.wall_seconds, 1),
        "steps_per_second": round(result.steps_per_second, 1),
        "learner_updates": result.learner_updates,
        "learner_updates_per_second": round(result.learner_updates / result.wall_seconds, 2),
        "optimizer_steps": result.optimizer_steps,
        "optimizer_steps_per_second": round(result.optimizer_steps / result.wall_seconds, 1),
        "last_10pct_return": round(result.mean_return(0.9, 1.0) / scale, 2),
        "episodes": result.episodes_total,
        "curve": binned_curve(episodes, result.env_steps, args.bins),
        # Evaluation during training (loop_config's eval_every_updates), at the env step
        # its networks were published: (env steps, mean return, episodes).
        "evaluations": [(e.env_steps, round(float(np.mean(e.result.returns)) / scale, 2),
                         len(e.result.returns)) for e in result.evaluations],
    }


def plot_title(records: list[dict[str, Any]]) -> str:
    """The agent, the env, the agent config's changes from its defaults (or "default
    config"), and the runs' mean steps/s."""
    first = records[0]
    changed = ", ".join(f"{k}={v}" for k, v in (first.get("agent_config") or {}).items())
    if first.get("reward_scale", 1.0) != 1.0:
        changed = ", ".join(x for x in (changed, f"rewards x{first['reward_scale']:g}") if x)
    speed = sum(r["steps_per_second"] for r in records) / len(records)
    return (f"{first['agent']} on {first['env']}, {changed or 'default config'} "
            f"({speed:,.0f} steps/s)")


def plot(records: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for rec in records:
        points = [(s, r) for s, r in rec["curve"] if r is not None]
        line, = ax.plot([s for s, _ in points], [r for _, r in points], alpha=0.5,
                        label=f"seed {rec['seed']}: {rec['last_10pct_return']:.0f}")
        evaluations = rec.get("evaluations") or []
        if evaluations:  # evaluation during training: the same seed's color, as dots
            ax.plot([e[0] for e in evaluations], [e[1] for e in evaluations], "o",
                    color=line.get_color(), alpha=0.7, markersize=4)
    ax.set_title(plot_title(records))
    ax.set_xlabel("env steps")
    ax.set_ylabel("episode return")
    ax.legend(title="last 10% mean" + (" (dots: evaluations)" if any(
        r.get("evaluations") for r in records) else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    started = time.perf_counter()
    emit(meta("curves", vars(args)))
    records = []
    for seed in args.seeds:
        records.append(run(args, seed))
        emit(records[-1])
    if args.plot:
        plot(records, args.plot)
    emit({"record": "end", "seconds": round(time.perf_counter() - started, 1),
          "plot": args.plot or None})


if __name__ == "__main__":
    main()
