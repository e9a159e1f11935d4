"""Training speed (learning on) of PPO and IMPALA in the Sebulba loop, on CartPole-v1
and on Atari Pong, and of PPO and SAC on HalfCheetah-v5, for each async_factor: env
steps/second, learner updates and optimizer steps per second, policy lag and where the
time goes (`RunResult.stage_seconds`, summed over threads).

CartPole-v1: the agents' default configs, sync vectorization, 16 envs per group, T = 32.
Pong: `ALE/Pong-v5` through ale-py's AtariVectorEnv ("vector_entry_point": 84 x 84
grayscale stacks of 4, frame skip 4, its own threads), so the agents use the Nature CNN;
a config small enough for 2 cores: 8 envs per group, T = 32, PPO with 2 epochs of 2
minibatches (its default 4 x 4 would make PPO's learner 4x costlier than IMPALA's), and
rewards clipped to [-1, 1] for IMPALA as in the paper. One env step is 4 frames.
HalfCheetah-v5 ("halfcheetah", extra `mujoco`): the agents' default configs, sync
vectorization, the launcher's 16 envs per group; SAC's measured run starts with its
`learning_starts` env steps of random actions, as every SAC run does.

Each configuration first runs a few cycles that compile acting and learning (the loop
keeps its compiled functions), then the measured run from a fresh initial state.

Records (JSON lines): meta; one train record per (agent, env, async_factor) and repeat
(repeats interleave, so a change of load hits every configuration alike); end.

    python -m benchmarks.train_speed
    python -m benchmarks.train_speed --envs=pong --agents=ppo --async_factors=2
    python -m benchmarks.train_speed --envs=pong,pong_envpool --agents=impala --async_factors=2
    python -m benchmarks.train_speed --envs=pong_envpool --agents=impala --async_factors=2 --bounds
    python -m benchmarks.train_speed --envs=halfcheetah --agents=ppo,sac --async_factors=2

With `--bounds`, each repeat also measures, alone, the env (a bare loop over the same
vector env or pool, random actions) and the learner (`learner_only`: updates on a fixed
trajectory, no acting), and each train record gets `ratio_to_bound`: consumed steps/second
over the slower of the two.

"pong_envpool" is EnvPool's `Pong-v5` (extra `envpool`): the same 84 x 84 stacks of 4,
a pool per group, the async_factor groups of an inference device driven in turn by one
thread (vectorization "envpool").
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from benchmarks._util import emit, int_list, meta, str_list

PONG_ID = "ALE/Pong-v5"
HALFCHEETAH_ID = "HalfCheetah-v5"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.train_speed", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--agents", type=str_list, default=["ppo", "impala"])
    p.add_argument("--envs", type=str_list, default=["cartpole", "pong"])
    p.add_argument("--async_factors", type=int_list, default=[1, 2])
    p.add_argument("--cartpole_steps", type=int, default=150_000,
                   help="measured env steps per CartPole configuration")
    p.add_argument("--pong_steps", type=int, default=10_240,
                   help="measured env steps per Pong configuration")
    p.add_argument("--halfcheetah_steps", type=int, default=40_960,
                   help="consumed env steps per HalfCheetah run")
    p.add_argument("--cartpole_envs", type=int, default=16, help="envs per group")
    p.add_argument("--halfcheetah_envs", type=int, default=16, help="envs per group")
    p.add_argument("--pong_envs", type=int, default=8, help="envs per group")
    p.add_argument("--steps_per_cycle", type=int, default=32)
    p.add_argument("--pong_ppo_epochs", type=int, default=2)
    p.add_argument("--pong_ppo_minibatches", type=int, default=2)
    p.add_argument("--warmup_cycles", type=int, default=3,
                   help="cycles per env group of the compiling run")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bounds", action="store_true",
                   help="also measure env-only and learner-only throughput alone")
    p.add_argument("--bound_updates", type=int, default=20,
                   help="learner updates of the learner-only measurement")
    return p.parse_args(argv)


def measure_bounds(args: argparse.Namespace, loop) -> dict[str, float]:
    """Env-only and learner-only env steps/second for `loop`'s configuration, alone."""
    from benchmarks._util import envs_alone, learner_only

    # With vector envs, one group's alone: the loop's groups share the 2 cores.
    env_sps = envs_alone(loop.config, 200, args.seed)
    learner_sps = learner_only(loop, args.bound_updates, args.seed)
    return {"env_only": round(env_sps, 1), "learner_only": round(learner_sps, 1),
            "bound": round(min(env_sps, learner_sps), 1),
            "bounded_by": "env" if env_sps <= learner_sps else "learner"}


def build_loop(args: argparse.Namespace, agent_name: str, env: str, async_factor: int):
    """The agent (default config on CartPole, the small one on Pong) in its loop."""
    import dataclasses

    import sebulba
    from agents.registry import AGENTS

    entry = AGENTS[agent_name]
    if env == "cartpole":
        env_id, vectorization, envs = "CartPole-v1", "sync", args.cartpole_envs
        agent_cfg = entry.config_class()
    elif env in ("pong", "pong_envpool"):
        env_id, vectorization, envs = PONG_ID, "vector_entry_point", args.pong_envs
        if env == "pong_envpool":  # EnvPool's Pong: the same preprocessing, C++ threads
            env_id, vectorization = "Pong-v5", "envpool"
        agent_cfg = entry.config_class()
        if agent_name == "ppo":
            agent_cfg = dataclasses.replace(agent_cfg, num_epochs=args.pong_ppo_epochs,
                                            num_minibatches=args.pong_ppo_minibatches)
        elif agent_name == "impala":
            agent_cfg = dataclasses.replace(agent_cfg, reward_clip=1.0)
    elif env == "halfcheetah":
        env_id, vectorization, envs = HALFCHEETAH_ID, "sync", args.halfcheetah_envs
        agent_cfg = entry.config_class()
    else:
        raise ValueError(f"unknown env {env!r}: cartpole, pong, pong_envpool or halfcheetah")
    spec = sebulba.env_spec(env_id, vectorization=vectorization)
    config = sebulba.Config(env=env_id, envs_per_group=envs, vectorization=vectorization,
                            async_factor=async_factor, steps_per_cycle=args.steps_per_cycle,
                            seed=args.seed)
    return sebulba.Sebulba(entry.build(spec, agent_cfg), config), agent_cfg


def measure_training(loop, env_steps: int) -> dict[str, Any]:
    """One learning run of `env_steps` consumed steps from a fresh initial state."""
    cfg = loop.config
    result = loop.run(env_steps)
    wall = result.wall_seconds
    lags = result.policy_lags
    return {
        "env_steps": result.env_steps, "consumed": result.consumed,
        "wall_seconds": round(wall, 2),
        "steps_per_second": round(result.steps_per_second, 1),
        # Steps acted but not learnt from (in flight at the end) are left out of this one.
        "consumed_steps_per_second": round(result.consumed_steps_per_second, 1),
        "learner_updates": result.learner_updates,
        "learner_updates_per_second": round(result.learner_updates / wall, 2),
        "optimizer_steps": result.optimizer_steps,
        "optimizer_steps_per_second": round(result.optimizer_steps / wall, 1),
        # In learner updates (trajectories learnt from).
        "policy_lag_mean": round(sum(lags) / len(lags), 2) if lags else None,
        "policy_lag_max": max(lags) if lags else None,
        # Summed over threads: with 2 groups, env_step + inference can exceed the wall.
        "stage_seconds": {k: round(v, 2) for k, v in sorted(result.stage_seconds.items())},
        "stage_fraction_of_wall": {k: round(v / wall, 2)
                                   for k, v in sorted(result.stage_seconds.items())},
        "trajectory_steps": cfg.envs_per_group * cfg.steps_per_cycle,
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    started = time.perf_counter()
    emit(meta("train_speed", vars(args)))
    loops = {}
    for env in args.envs:
        for agent_name in args.agents:
            for af in args.async_factors:
                loop, agent_cfg = build_loop(args, agent_name, env, af)
                cfg = loop.config
                t0 = time.perf_counter()
                # Compiles step, update_experience and optimize; every later run reuses them.
                # An agent that learns only after a warm-up of random actions (SAC's
                # learning_starts) compiles optimize only once past it.
                loop.run(args.warmup_cycles * cfg.num_groups * cfg.envs_per_group
                         * cfg.steps_per_cycle
                         + getattr(agent_cfg, "learning_starts", 0))
                emit({"record": "warmup", "agent": agent_name, "env": env,
                      "async_factor": af, "seconds": round(time.perf_counter() - t0, 1)})
                loops[agent_name, env, af] = loop, agent_cfg

    for repeat in range(args.repeats):
        for (agent_name, env, af), (loop, _) in loops.items():
            steps = {"cartpole": args.cartpole_steps,
                     "halfcheetah": args.halfcheetah_steps}.get(env, args.pong_steps)
            bounds = measure_bounds(args, loop) if args.bounds else {}
            rec = measure_training(loop, steps)
            if bounds:
                bounds["ratio_to_bound"] = round(
                    rec["consumed_steps_per_second"] / bounds["bound"], 3)
            cfg = loop.config
            extra = ({"num_epochs": loop.agent.config.num_epochs,
                      "num_minibatches": loop.agent.config.num_minibatches}
                     if agent_name == "ppo" else {})
            emit({"record": "train", "repeat": repeat, "agent": agent_name, "env": cfg.env,
                  "vectorization": cfg.vectorization, "async_factor": af,
                  "envs_per_group": cfg.envs_per_group, "steps_per_cycle": cfg.steps_per_cycle,
                  **extra, **rec, **bounds})
    emit({"record": "end", "seconds": round(time.perf_counter() - started, 1)})


if __name__ == "__main__":
    main()
