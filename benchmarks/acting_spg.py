"""The 5x200 SPG acting benchmark on CartPole: the simple policy gradient agent with five
hidden layers of 200 acting (no learning) on CartPole-v1, 16 envs per env group, 20
inference cycles of 100 steps per group. Its acting call outputs the action and its
log-probability (`_util.acting_agent`: without reward normalization, whose discounted
return would be one more output), the workload of every figure so far.

Steps/second of the Sebulba loop for each async_factor and vectorization, next to its
bound: the slower of env-only throughput (the bare vector env stepping random actions)
and inference-only throughput (one jitted `agent.step` on the group's observations with
the action back on the host, call after call). For calibration, the bare loop: the same
vector env (or pool, pipelined) and jitted step in a loop with no framework at all, no
trajectory and no accounting (`_util.bare_loop`), what this machine allows such a loop.
It runs just before and just after each repeat's runs of the loop, and
`ratio_to_bare_loop` is the median over the repeats of each run's steps/second over
the mean of those two (`paired_ratios`): on a shared machine whose speed drifts by 10%
within a minute, a ratio of two medians taken apart spreads by as much.
Both fetch the action as the loop does by default: polling for it for up to 0.5 ms
before sleeping on it (not with "async"), since a sleeping thread wakes late.

Records (JSON lines): meta, then per repeat env_only, inference_only and one sebulba
record per configuration (repeats interleave, so a change of machine load hits every
configuration alike), then one summary per configuration with the medians.

    python -m benchmarks.acting_spg
    python -m benchmarks.acting_spg --envs_per_group=8,16,32 --vectorizations=sync
    python -m benchmarks.acting_spg --vectorizations=sync,envpool   # sync against EnvPool

With "envpool" (extra `envpool`) each inference device drives a pool per group from one
thread, the groups in turn; with "envpool_async" one pool of async_factor groups, recv
returning whichever group's envs are ready. The env-only figure of both is a bare
recv/send loop over one pool of all the groups, and their bare loop that pool pipelined.

`--check_env_output=on,off` measures the cost of `Config.check_env_output`: every
configuration runs with the checks and without, the two in alternating order within each
repeat, and a `check_env_output` record per configuration gives the median of the
repeats' on/off ratios of steps/second (benchmarks/RESULTS.md, "Env output checks: cost").
Where other work shares the machine those ratios spread widely, so the record also gives
the checks' own CPU time, each the least of many short timings, and the share of the
loop's time it would take if it never overlapped anything (`estimated_cost`):

    python -m benchmarks.acting_spg --vectorizations=sync,envpool --async_factors=1,2 \
        --check_env_output=on,off --repeats=12
"""

from __future__ import annotations

import argparse
import collections
import os
import time
from typing import Any

from benchmarks._util import (
    acting_agent,
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
# For sync envs; async ones alone are slower (benchmarks/HISTORY.md, "Async versus sync
# vectorization on 2 cores").
TARGET_STEPS_PER_SECOND = 15_000
POOLS = ("envpool", "envpool_async")  # calibrated against one pool of all groups


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
    p.add_argument("--check_env_output", type=str_list, default=["on"],
                   help="on, off or on,off: Config.check_env_output (on,off: an A/B)")
    args = p.parse_args(argv)
    if not args.check_env_output or set(args.check_env_output) - {"on", "off"}:
        p.error(f"--check_env_output takes on, off or on,off, got {args.check_env_output}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import sebulba
    from sebulba.envs.gymnasium_source import make_vector_env

    started = time.perf_counter()
    emit(meta("acting_spg", vars(args)))
    agent = acting_agent(sebulba.env_spec(ENV_ID), args.hidden_sizes)
    vector_steps = args.cycles * args.steps_per_cycle
    checks = list(dict.fromkeys(args.check_env_output))  # "on", "off" or both, once each
    loops = {
        (v, af, e, check): sebulba.Sebulba(agent, sebulba.Config(
            env=ENV_ID, envs_per_group=e, vectorization=v, async_factor=af,
            steps_per_cycle=args.steps_per_cycle, seed=args.seed,
            check_env_output=check == "on"))
        for e in args.envs_per_group for v in args.vectorizations for af in args.async_factors
        for check in checks
    }
    for loop in loops.values():
        measure(loop, cycles=1)  # compiles; every later run reuses what it compiled

    envs, infer, runs, bare, cores = (collections.defaultdict(list) for _ in range(5))
    # The bare loops fetch actions as the loop of their vectorization does by default.
    poll = {v: sebulba.Config(env=ENV_ID, vectorization=v).action_poll_seconds
            for v in args.vectorizations}

    def run_bare(v: str, e: int, af: int, repeat: int, of_repeat: dict) -> None:
        if v in POOLS:
            sps = bare_pool_loop(agent, ENV_ID, e, af, vector_steps * af, args.seed,
                                 poll_s=poll[v])
        else:
            sps = bare_loop(agent, lambda: make_vector_env(ENV_ID, e, v), vector_steps,
                            args.seed, poll_s=poll[v])
        bare[v, e, af].append(sps)
        of_repeat[v, e, af].append(sps)
        emit({"record": "bare_loop", "repeat": repeat, "vectorization": v,
              "async_factor": af, "envs_per_group": e, "steps_per_second": round(sps, 1)})

    paired = collections.defaultdict(list)  # per configuration: each repeat's ratio
    for repeat in range(args.repeats):
        bare_of_repeat = collections.defaultdict(list)
        for e in args.envs_per_group:
            for v in args.vectorizations:
                for af in (args.async_factors if v in POOLS else [1]):
                    if v in POOLS:  # one pool of all groups, pipelined
                        sps = envpool_only(ENV_ID, e, af, vector_steps * af, args.seed)
                    else:
                        sps = env_only(lambda e=e, v=v: make_vector_env(ENV_ID, e, v),
                                       vector_steps, args.seed)
                    envs[v, e, af].append(sps)
                    emit({"record": "env_only", "repeat": repeat, "vectorization": v,
                          "async_factor": af, "envs_per_group": e,
                          "steps_per_second": round(sps, 1)})
                    run_bare(v, e, af, repeat, bare_of_repeat)
            sps = inference_only(agent, e, vector_steps, args.seed)
            infer[e].append(sps)
            emit({"record": "inference_only", "repeat": repeat, "envs_per_group": e,
                  "steps_per_second": round(sps, 1)})
        # With the checks on and off, the first of the two alternates between repeats.
        order = sorted(loops, key=lambda k: (k[:3], (k[3] == "off") == (repeat % 2 == 0)))
        for key in order:
            rec = measure(loops[key], args.cycles)
            runs[key].append(rec["steps_per_second"])
            cores[key].append(rec["process_cpu_cores"])
            emit({"record": "sebulba", "repeat": repeat, "check_env_output": key[3], **rec})
        # The bare loops once more, after the loop's runs: each run is compared with the
        # mean of its bare loop just before and just after it, so that a change of this
        # machine's speed within the repeat (other VMs, other processes) hits both sides.
        for v, af, e in dict.fromkeys(
                (v, af if v in POOLS else 1, e) for v, af, e, _ in loops):
            run_bare(v, e, af, repeat, bare_of_repeat)
        for key in order:
            v, af, e, _ = key
            around = bare_of_repeat[v, e, af if v in POOLS else 1]
            paired[key].append(runs[key][-1] / (sum(around) / len(around)))

    emit_summaries(runs, envs, bare, paired, infer, cores)
    emit_check_ab(loops, runs, cores, args.cycles, args.seed)
    emit({"record": "end", "seconds": round(time.perf_counter() - started, 1)})


def emit_summaries(runs: dict[tuple, list[float]], envs: dict[tuple, list[float]],
                   bare: dict[tuple, list[float]], paired: dict[tuple, list[float]],
                   infer: dict[int, list[float]], cores: dict[tuple, list[float]]) -> None:
    """One summary per configuration (vectorization, async_factor, envs, checks): the
    medians of its repeats, its bounds and its ratios to them."""
    for (v, af, e, check), values in runs.items():
        env_sps = median(envs[v, e, af if v in POOLS else 1])
        bare_sps = median(bare[v, e, af if v in POOLS else 1])
        sps, inf_sps = median(values), median(infer[e])
        bound = min(env_sps, inf_sps)
        serial = 1.0 / (1.0 / env_sps + 1.0 / inf_sps)  # env and inference never overlap
        summary = {
            "record": "summary", "vectorization": v, "async_factor": af, "envs_per_group": e,
            "check_env_output": check, "steps_per_second": sps, "repeats": values,
            "env_only": env_sps,
            "inference_only": inf_sps, "bound": bound,
            "bounded_by": "env" if env_sps <= inf_sps else "inference",
            "ratio_to_bound": ratio(sps, bound),
            "serial_bound": round(serial, 1), "ratio_to_serial_bound": ratio(sps, serial),
            "bare_loop": bare_sps, "ratio_to_bare_loop": median(paired[v, af, e, check], 3),
            "paired_ratios": [round(r, 3) for r in paired[v, af, e, check]],
            "bare_loop_to_bound": ratio(bare_sps, bound),
            "bare_loop_to_serial_bound": ratio(bare_sps, serial),
            "process_cpu_cores": median(cores[v, af, e, check], 2),
            "cpu_count": os.cpu_count(),
        }
        if v == "sync":
            summary["meets_target"] = sps >= TARGET_STEPS_PER_SECOND
        emit(summary)


def emit_check_ab(loops: dict[tuple, Any], runs: dict[tuple, list[float]],
                  cores: dict[tuple, list[float]], cycles: int, seed: int) -> None:
    """For each configuration run with the env output checks on and off: the medians of
    steps/second, the median of the repeats' on/off ratios (repeat i's two runs ran next
    to each other), the same for this process's CPU time per env step (off/on: below 1,
    the checks cost CPU time; less disturbed by other processes than wall time, though
    polling for actions counts in it), and the checks' own cost: `check_costs`, the rows'
    checks timed inside one more run (`rows_in_loop_us`), and the share of the loop's time
    the two would take if nothing hid them (`estimated_cost`, at the median steps/second
    with the checks off)."""
    costs = {}
    for (v, af, e, check), on in runs.items():
        if check != "on" or (v, af, e, "off") not in runs:
            continue
        off = runs[v, af, e, "off"]
        costs[e] = costs.get(e) or check_costs(e, seed)
        in_loop = rows_in_loop_us(loops[v, af, e, "on"], cycles)
        # The checks of one recv of e rows, and for "sync" those of each env too (an
        # "async" env's run in its worker process).
        us = in_loop + (costs[e]["each_env_us"] if v == "sync" else 0.0)
        ratios = [a / b for a, b in zip(on, off, strict=True)]
        cpu_per_step = {c: [k / sps for k, sps in zip(cores[v, af, e, c], runs[v, af, e, c],
                                                     strict=True)] for c in ("on", "off")}
        cpu_ratios = [b / a for a, b in zip(cpu_per_step["on"], cpu_per_step["off"],
                                            strict=True)]
        emit({"record": "check_env_output", "vectorization": v, "async_factor": af,
              "envs_per_group": e, "on": median(on), "off": median(off),
              "ratios": [round(r, 3) for r in ratios], "median_ratio": median(ratios, 3),
              "cpu_ratios": [round(r, 3) for r in cpu_ratios],
              "median_cpu_ratio": median(cpu_ratios, 3), **costs[e],
              "rows_in_loop_us": round(in_loop, 2), "check_us_per_vector_step": round(us, 2),
              "estimated_cost": round(us / e * 1e-6 * median(off), 4)})


def rows_in_loop_us(loop, cycles: int) -> float:
    """The median time of one recv's row checks (`BatchCheck`) inside an acting run of
    `loop` (checks on), where caches are cold after each acting call: 2 to 4 times the
    `check_costs` figure. Two clock reads (about 0.1 us) count in it."""
    from sebulba.envs.output_checks import BatchCheck

    times: list[int] = []
    call = BatchCheck.__call__

    def timed(self, env_step, ids=None):
        t0 = time.perf_counter_ns()
        call(self, env_step, ids)
        times.append(time.perf_counter_ns() - t0)

    BatchCheck.__call__ = timed
    try:
        measure(loop, cycles)
    finally:
        BatchCheck.__call__ = call
    return median(times, 0) / 1e3


def check_costs(num_envs: int, seed: int) -> dict[str, float]:
    """The env output checks' own CPU time, in us per vector step of `num_envs` CartPoles,
    each the least of several timeit repeats of the thread's CPU time (other processes
    taking the cores do not count in it):
    `each_env_us`, the `CheckedEnv` around each env (one CartPole step through it, less the
    same step without it, times `num_envs`), and `rows_*_us`, the checks of one recv's
    rows, of a "sync" vector env (in id order, rewards checked by each env) and of an
    EnvPool (envs addressed by id). In the acting loop the row checks cost 2 to 4 times
    as much (`rows_in_loop_us`)."""
    import timeit

    import gymnasium as gym
    import numpy as np

    from sebulba.envs.output_checks import BatchCheck, CheckedEnv
    from sebulba.types import EnvStep

    class SameStep(gym.Wrapper):
        """A CartPole that returns its first step's output at every step: what the checks
        see, at no cost of the env's own."""

        def step(self, action):
            return self._step

    env = SameStep(gym.make(ENV_ID))
    env.reset(seed=seed)
    env._step = env.env.step(0)
    checked = CheckedEnv(env, repr(ENV_ID), 0, num_envs)

    def least_us(call, number: int = 10_000) -> float:
        return 1e6 * min(timeit.repeat(call, number=number, repeat=15,
                                       timer=time.thread_time)) / number

    each_env = least_us(lambda: checked.step(0)) - least_us(lambda: env.step(0))
    space, flags = env.observation_space, np.zeros(num_envs, bool)
    env_step = EnvStep(np.stack([space.sample() for _ in range(num_envs)]),
                       np.ones(num_envs, np.float32), flags, flags, flags)
    in_order = BatchCheck(repr(ENV_ID), space, num_envs, str, rewards=False)  # as "sync"
    by_id = BatchCheck(repr(ENV_ID), space, 2 * num_envs, str)
    ids = np.arange(num_envs)
    return {"each_env_us": round(max(0.0, each_env) * num_envs, 2),
            "rows_in_order_us": round(least_us(lambda: in_order(env_step)), 2),
            "rows_by_id_us": round(least_us(lambda: by_id(env_step, ids)), 2)}


if __name__ == "__main__":
    main()
