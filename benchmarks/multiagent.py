"""Env groups alternating on one inference device, with K agents per env, scaled to this
machine: MPE2's `simple_spread_v3` (3 agents), async_factor 1 and 2, acting only
with PPO's default network. Steps/second are given in agent steps (rows: what the
learner consumes) and env steps (agent steps / K), each next to its bound: the slower of
env-only throughput (the groups' PettingZoo envs stepped through the env source on
random actions, `ParallelEnvSource` recv/send with no inference) and inference-only
throughput (one jitted `agent.step` on the group's rows, the action back on the host).

Records (JSON lines): meta, then per repeat env_only, inference_only and one sebulba
record per async_factor, then a summary per async_factor with the medians.

    python -m benchmarks.multiagent
    python -m benchmarks.multiagent --envs_per_group=8,32 --repeats=3
"""

from __future__ import annotations

import argparse
import time

from benchmarks._util import emit, inference_only, int_list, measure, median, meta, ratio

ENV = "mpe2.simple_spread_v3"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.multiagent", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--envs_per_group", type=int_list, default=[16])
    p.add_argument("--async_factors", type=int_list, default=[1, 2])
    p.add_argument("--steps_per_cycle", type=int, default=64)
    p.add_argument("--cycles", type=int, default=10, help="measured cycles per env group")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def source_only(num_envs: int, vector_steps: int, seed: int) -> float:
    """Agent steps/second of one group's env source alone, on uniformly random actions."""
    import numpy as np

    from sebulba.envs.pettingzoo_source import ParallelEnvSource, make_parallel_env

    source = ParallelEnvSource([make_parallel_env(ENV) for _ in range(num_envs)])
    try:
        space = source.envs[0].action_space(source.agents[0])
        actions = np.random.default_rng(seed).integers(
            0, space.n, size=(vector_steps + 10, source.num_envs))
        source.reset(seed)
        for i, a in enumerate(actions):
            if i == 10:
                t0 = time.perf_counter()
            ids, *_ = source.recv()
            source.send(a, ids)
        seconds = time.perf_counter() - t0
    finally:
        source.close()
    return source.num_envs * vector_steps / seconds


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import sebulba
    from agents.ppo import PPO

    started = time.perf_counter()
    emit(meta("multiagent", vars(args)))
    for e in args.envs_per_group:
        configs = {af: sebulba.Config(env=ENV, vectorization="pettingzoo", envs_per_group=e,
                                      async_factor=af, steps_per_cycle=args.steps_per_cycle,
                                      seed=args.seed) for af in args.async_factors}
        spec = configs[args.async_factors[0]].env_spec()
        k = spec.agents_per_env
        agent = PPO(spec)
        loops = {af: sebulba.Sebulba(agent, cfg) for af, cfg in configs.items()}
        for loop in loops.values():
            measure(loop, cycles=1)  # compiles
        runs: dict[str, list[float]] = {"env": [], "inference": []}
        runs.update({f"af{af}": [] for af in loops})
        for repeat in range(args.repeats):
            vector_steps = args.cycles * args.steps_per_cycle
            runs["env"].append(source_only(e, vector_steps, args.seed))
            runs["inference"].append(inference_only(agent, e * k, vector_steps, args.seed))
            emit({"record": "bounds", "repeat": repeat, "envs_per_group": e,
                  "env_only_agent_steps_per_second": round(runs["env"][-1], 1),
                  "inference_only_agent_steps_per_second": round(runs["inference"][-1], 1)})
            for af, loop in loops.items():
                rec = measure(loop, args.cycles)
                runs[f"af{af}"].append(rec["steps_per_second"])
                emit({"record": "sebulba", "repeat": repeat, "agents_per_env": k, **rec})
        bound = min(median(runs["env"]), median(runs["inference"]))
        for af in loops:
            sps = median(runs[f"af{af}"])
            emit({"record": "summary", "envs_per_group": e, "agents_per_env": k,
                  "async_factor": af, "agent_steps_per_second": sps,
                  "env_steps_per_second": round(sps / k, 1),
                  "bound_agent_steps_per_second": bound,
                  "bound_env_steps_per_second": round(bound / k, 1),
                  "env_only": median(runs["env"]), "inference_only": median(runs["inference"]),
                  "ratio_to_bound": ratio(sps, bound), "repeats": runs[f"af{af}"]})
    emit({"record": "end", "seconds": round(time.perf_counter() - started, 1)})


if __name__ == "__main__":
    main()
