"""The 5x200 SPG acting benchmark on CartPole: the simple policy gradient agent with five
hidden layers of 200 acting (no learning) on CartPole-v1, 16 envs per env group, 20
inference cycles of 100 steps per group.

Steps/second of the Sebulba loop for each async_factor and vectorization, next to its
bound: the slower of env-only throughput (the bare vector env stepping random actions)
and inference-only throughput (one jitted `agent.step` on the group's observations with
the action back on the host, call after call). For calibration, the bare loop: the same
vector env (or pool, pipelined) and jitted step in a loop with no framework at all, no
trajectory and no accounting (`_util.bare_loop`), what this machine allows such a loop.
Both fetch the action as the loop does by default: polling for it for up to 0.5 ms
before sleeping on it (not with "async"), since a sleeping thread wakes late.

Records (JSON lines): meta, then per repeat env_only, inference_only and one sebulba
record per configuration (repeats interleave, so a change of machine load hits every
configuration alike), then one summary per configuration with the medians.

    python -m benchmarks.acting_spg
    python -m benchmarks.acting_spg --envs_per_group=8,16,32 --vectorizations=sync
    python -m benchmarks.acting_spg --vectorizations=sync,envpool   # sync against EnvPool

With "envpool" (extra `envpool`) each inference device drives one pool of async_factor
groups from one thread, recv returning whichever group's envs are ready; its env-only
figure is a bare recv/send loop over the same pool.
"""

from __future__ import annotations

import argparse
import collections
import os
import time

from benchmarks._util import (
    bare_loop,
    bare_pool_loop,
    emit,
    env_only,
    envpool_only,
    inference_only,
    int_list,
    measure,
    median,
    meta,
    ratio,
    str_list,
)

ENV_ID = "CartPole-v1"
# For sync envs; async ones alone are slower (benchmarks/RESULTS.md, "Async versus sync
# vectorization").
TARGET_STEPS_PER_SECOND = 15_000


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.acting_spg", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--envs_per_group", type=int_list, default=[16])
    p.add_argument("--async_factors", type=int_list, default=[1, 2])
    p.add_argument("--vectorizations", type=str_list, default=["sync", "async"])
    p.add_argument("--steps_per_cycle", type=int, default=100)
    p.add_argument("--cycles", type=int, default=20, help="measured cycles per env group")
    p.add_argument("--hidden_sizes", type=int_list, default=[200] * 5)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import sebulba
    from agents.spg import SPG, SPGConfig
    from sebulba.envs.gymnasium_source import make_vector_env

    started = time.perf_counter()
    emit(meta("acting_spg", vars(args)))
    agent = SPG(sebulba.env_spec(ENV_ID), SPGConfig(hidden_sizes=tuple(args.hidden_sizes)))
    vector_steps = args.cycles * args.steps_per_cycle
    loops = {
        (v, af, e): sebulba.Sebulba(agent, sebulba.Config(
            env=ENV_ID, envs_per_group=e, vectorization=v, async_factor=af,
            steps_per_cycle=args.steps_per_cycle, seed=args.seed))
        for e in args.envs_per_group for v in args.vectorizations for af in args.async_factors
    }
    for loop in loops.values():
        measure(loop, cycles=1)  # compiles; every later run reuses what it compiled

    envs, infer, runs, bare, cores = (collections.defaultdict(list) for _ in range(5))
    # The bare loops fetch actions as the loop of their vectorization does by default.
    poll = {v: sebulba.Config(env=ENV_ID, vectorization=v).action_poll_seconds
            for v in args.vectorizations}
    for repeat in range(args.repeats):
        for e in args.envs_per_group:
            for v in args.vectorizations:
                for af in (args.async_factors if v == "envpool" else [1]):
                    if v == "envpool":  # one pool of all groups, as the loop drives it
                        sps = envpool_only(ENV_ID, e, af, vector_steps * af, args.seed)
                    else:
                        sps = env_only(lambda e=e, v=v: make_vector_env(ENV_ID, e, v),
                                       vector_steps, args.seed)
                    envs[v, e, af].append(sps)
                    emit({"record": "env_only", "repeat": repeat, "vectorization": v,
                          "async_factor": af, "envs_per_group": e,
                          "steps_per_second": round(sps, 1)})
                    if v == "envpool":
                        sps = bare_pool_loop(agent, ENV_ID, e, af, vector_steps * af,
                                             args.seed, poll_s=poll[v])
                    else:
                        sps = bare_loop(agent, lambda e=e, v=v: make_vector_env(ENV_ID, e, v),
                                        vector_steps, args.seed, poll_s=poll[v])
                    bare[v, e, af].append(sps)
                    emit({"record": "bare_loop", "repeat": repeat, "vectorization": v,
                          "async_factor": af, "envs_per_group": e,
                          "steps_per_second": round(sps, 1)})
            sps = inference_only(agent, e, vector_steps, args.seed)
            infer[e].append(sps)
            emit({"record": "inference_only", "repeat": repeat, "envs_per_group": e,
                  "steps_per_second": round(sps, 1)})
        for key, loop in loops.items():
            rec = measure(loop, args.cycles)
            runs[key].append(rec["steps_per_second"])
            cores[key].append(rec["process_cpu_cores"])
            emit({"record": "sebulba", "repeat": repeat, **rec})

    for (v, af, e), values in runs.items():
        env_sps = median(envs[v, e, af if v == "envpool" else 1])
        bare_sps = median(bare[v, e, af if v == "envpool" else 1])
        sps, inf_sps = median(values), median(infer[e])
        bound = min(env_sps, inf_sps)
        serial = 1.0 / (1.0 / env_sps + 1.0 / inf_sps)  # env and inference never overlap
        summary = {
            "record": "summary", "vectorization": v, "async_factor": af, "envs_per_group": e,
            "steps_per_second": sps, "repeats": values, "env_only": env_sps,
            "inference_only": inf_sps, "bound": bound,
            "bounded_by": "env" if env_sps <= inf_sps else "inference",
            "ratio_to_bound": ratio(sps, bound),
            "serial_bound": round(serial, 1), "ratio_to_serial_bound": ratio(sps, serial),
            "bare_loop": bare_sps, "ratio_to_bare_loop": ratio(sps, bare_sps),
            "bare_loop_to_bound": ratio(bare_sps, bound),
            "bare_loop_to_serial_bound": ratio(bare_sps, serial),
            "process_cpu_cores": median(cores[v, af, e], 2), "cpu_count": os.cpu_count(),
        }
        if v == "sync":
            summary["meets_target"] = sps >= TARGET_STEPS_PER_SECOND
        emit(summary)
    emit({"record": "end", "seconds": round(time.perf_counter() - started, 1)})


if __name__ == "__main__":
    main()
