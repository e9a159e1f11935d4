"""Where an acting call's time goes, beside the platform's least round trip; and, with
`--trace_dir`, profiler traces of a call and of the acting loop. Prints JSON lines.

The loop's acting call on a group's env step (DESIGN.md, "The path of one trajectory")
is, on the host: dispatch (the env step's arrays copied in, the compiled call enqueued),
then the action's copy to the host started, waited for and read. Each phase is timed
alone here, as the loop makes it (`dispatch_us`; `wait_us`, which starts the copy and
polls until the call is done; `read_us`; `whole_us` their sum), per network and envs
per call, beside:

- `floor_resident_us`: a compiled `x + 1` on a device array of E int32, its result read
  on the host: the platform's least round trip (a dispatch, a kernel, a copy back);
- `floor_from_host_us`: the same on a host array (one copy in as well);
- the acting call on an env step already on the device (`resident_*`): the difference
  to the first is the env step's copies;
- the acting call whose action's copy to the host starts only when it is read
  (`no_early_copy_*`), where the loop starts it at dispatch on an accelerator;
- `kernels`: the compiled acting call's top-level instructions that launch work (fusions,
  custom calls such as cuBLAS and cuDNN, copies), from its optimized HLO.

With `--trace_dir`: a Perfetto trace (JSON, gzip) of 30 calls of the first point and a
trace of an acting-only loop run (CartPole-v1, 16 envs, one group: the
acting-only benchmark's), with a summary record of each trace's host events per thread
(`--summarize FILE` prints one for a trace already written).

    python -m benchmarks.acting_anatomy --points=mlp:16,mlp:256,nature_cnn:256
    python -m benchmarks.acting_anatomy --points=mlp:16 --trace_dir=traces
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np

MLP_ENV_ID = "CartPole-v1"
# Breakout-v5's frames (4 x 84 x 84 uint8) for the Nature CNN, without an env.
FRAMES_SHAPE = (4, 84, 84)
LOOP_ENVS, LOOP_STEPS_PER_CYCLE = 16, 100  # the acting-only benchmark's group
# A trace file larger than this is not kept (a GPU machine's tool brings back 16 MiB a
# file): its summary is.
MAX_TRACE_BYTES = 15 * 2**20


def _median_us(times: list[float]) -> float:
    return round(float(np.median(times)) * 1e6, 1)


def _timed(fn: Callable[[], Any], seconds: float) -> list[Any]:
    """`fn()`'s results, called for `seconds` (at least 20 times) after 20 that warm up."""
    for _ in range(20):
        fn()
    out, start = [], time.perf_counter()
    while len(out) < 20 or time.perf_counter() - start < seconds:
        out.append(fn())
    return out


def kernels(compiled_text: str) -> dict[str, int]:
    """Counts of the ENTRY computation's instructions that launch device work."""
    entry = compiled_text[compiled_text.find("\nENTRY"):]
    entry = entry[:entry.find("\n}")]
    counts: dict[str, int] = {}
    for op in ("fusion", "custom-call", "dot", "convolution", "copy", "while", "conditional",
               "all-reduce", "rng-bit-generator", "sort"):
        n = len(re.findall(rf"= [^=]*? {op}\(", entry))
        if n:
            counts[op] = n
    return counts


def _agent(network: str):
    import gymnasium as gym

    import sebulba
    from agents.ppo import PPO

    if network == "mlp":
        return PPO(sebulba.env_spec(MLP_ENV_ID))
    return PPO(sebulba.EnvSpec(gym.spaces.Box(0, 255, FRAMES_SHAPE, np.uint8),
                               gym.spaces.Discrete(4)))


def _floors(num_envs: int, seconds: float, device) -> dict[str, float]:
    """The platform's least round trips: `x + 1` on [E] int32, from the device and from
    the host, its result read on the host."""
    import jax

    add_one = jax.jit(lambda x: x + 1)
    x_host = np.zeros(num_envs, np.int32)
    x_dev = jax.device_put(x_host, device)

    def floor(x) -> float:
        t0 = time.perf_counter()
        np.asarray(add_one(x))
        return time.perf_counter() - t0

    return {"floor_resident_us": _median_us(_timed(lambda: floor(x_dev), seconds)),
            "floor_from_host_us": _median_us(_timed(lambda: floor(x_host), seconds))}


def point(network: str, num_envs: int, seconds: float, seed: int,
          trace_dir: str | None = None) -> dict[str, Any]:
    """One point's phases, floors and kernels (and traces, with `trace_dir`)."""
    import jax

    from benchmarks._util import random_env_step
    from sebulba.runtime.inferencer import ActingFunctions

    agent = _agent(network)
    device = jax.local_devices()[0]
    nets = agent.new_networks(jax.random.key(seed))
    env_step = random_env_step(agent.env_spec, num_envs, seed)
    acting = ActingFunctions(agent, steps_per_cycle=1)
    leaves = acting.networks(jax.device_put(nets, device))
    state = [acting.new_state(agent.new_step_state(nets, jax.random.key(seed), num_envs),
                              device, snapshots=False).step_state]

    def phases(inputs, early_copy: bool = True) -> tuple[float, float, float]:
        t0 = time.perf_counter()
        output, state[0], _ = acting.act_all(leaves, state[0], None, inputs)
        t1 = time.perf_counter()
        if early_copy:  # as the loop does on an accelerator (`copies_early_to_host`)
            output.action.copy_to_host_async()
        while not output.action.is_ready():  # as the loop polls (`fetch_polling`)
            pass
        t2 = time.perf_counter()
        np.asarray(output.action)
        return t1 - t0, t2 - t1, time.perf_counter() - t2

    result: dict[str, Any] = {"network": network, "envs": num_envs,
                              **_floors(num_envs, seconds / 6, device)}
    forms = (("", env_step, True), ("resident_", jax.device_put(env_step, device), True),
             ("no_early_copy_", env_step, False))
    for form, inputs, early in forms:
        parts = _timed(lambda inputs=inputs, early=early: phases(inputs, early), seconds / 4)
        result[f"{form}whole_us"] = _median_us([sum(p) for p in parts])
        for i, phase in enumerate(("dispatch", "wait", "read")):
            result[f"{form}{phase}_us"] = _median_us([p[i] for p in parts])
    compiled = acting.act_all.lower(leaves, state[0], None, env_step).compile()
    result["kernels"] = kernels(compiled.as_text())
    if trace_dir:
        result.update(_traced(trace_dir, f"call_{network}_{num_envs}",
                              lambda: [phases(env_step) for _ in range(30)]))
    return result


def _traced(trace_dir: str, name: str, work: Callable[[], Any]) -> dict[str, Any]:
    """Runs `work` under the profiler; its Perfetto trace as trace_dir/trace_{name}.json.gz
    (unless larger than MAX_TRACE_BYTES: the summary stays) and a summary of its events
    per thread. The profiler's own files go to a temporary directory: a run cut short
    leaves nothing of them in trace_dir."""
    import jax

    tmp = tempfile.mkdtemp(prefix=f"profile_{name}_")
    out: dict[str, Any] = {}
    try:
        with jax.profiler.trace(tmp, create_perfetto_trace=True):
            work()
        (found,) = glob.glob(os.path.join(tmp, "**", "*.trace.json.gz"), recursive=True)
        out[f"summary_{name}"] = summarize(found)
        size = os.path.getsize(found)
        if size > MAX_TRACE_BYTES:
            out[f"trace_{name}_left_out"] = f"{size} bytes, over {MAX_TRACE_BYTES}"
        else:
            path = os.path.join(trace_dir, f"trace_{name}.json.gz")
            shutil.copy(found, path)
            out[f"trace_{name}"] = os.path.basename(path)
    except Exception as e:  # noqa: BLE001 - a profiler the platform lacks: say so
        out[f"trace_{name}_error"] = repr(e)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def loop_trace(trace_dir: str, seed: int) -> dict[str, Any]:
    """A trace of an acting-only loop run: SPG's 5x200 MLP on CartPole-v1, sync envs, one
    group of LOOP_ENVS, after a run that compiles."""
    import sebulba
    from benchmarks._util import acting_agent

    agent = acting_agent(sebulba.env_spec(MLP_ENV_ID), (200,) * 5)
    loop = sebulba.Sebulba(agent, sebulba.Config(
        env=MLP_ENV_ID, envs_per_group=LOOP_ENVS, async_factor=1,
        steps_per_cycle=LOOP_STEPS_PER_CYCLE, seed=seed))
    steps = 4 * LOOP_ENVS * LOOP_STEPS_PER_CYCLE
    loop.run(steps, learn=False)  # compiles
    # Stage times of a run without the profiler, whose Python tracer slows every call.
    r = loop.run(steps, learn=False)
    out = {"loop_us_per_vector_step": {k: round(1e6 * v * LOOP_ENVS / r.env_steps, 1)
                                       for k, v in sorted(r.stage_seconds.items())}}
    out.update(_traced(trace_dir, "loop", lambda: loop.run(steps, learn=False)))
    return out


def summarize(path: str, top: int = 25) -> dict[str, list[list[Any]]]:
    """Per host thread of a Perfetto trace, its `top` events by total time:
    [name, count, total us, mean us]."""
    with gzip.open(path, "rt") as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    totals: dict[str, dict[str, list[float]]] = collections.defaultdict(
        lambda: collections.defaultdict(lambda: [0, 0.0]))
    for e in events:
        if e.get("ph") == "X":
            thread = str(threads.get((e["pid"], e["tid"]), e["tid"]))
            t = totals[thread][e["name"][:80]]
            t[0] += 1
            t[1] += e.get("dur", 0.0)
    return {thread: [[name, int(n), round(us, 1), round(us / n, 1)]
                     for name, (n, us) in sorted(rows.items(), key=lambda kv: -kv[1][1])[:top]]
            for thread, rows in totals.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--points", default="mlp:16,mlp:256,nature_cnn:256",
                   help="network:envs,... (network: mlp or nature_cnn)")
    p.add_argument("--seconds", type=float, default=3.0, help="per point")
    p.add_argument("--trace_dir", default=None,
                   help="write traces of the first point's calls and of a loop run here")
    p.add_argument("--summarize", default=None, metavar="FILE",
                   help="print the summary of a trace written by --trace_dir, and stop")
    p.add_argument("--out", default=None, help="also write the records here (JSONL)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.summarize:
        print(json.dumps({"record": "summary", **summarize(args.summarize)}))
        return 0
    points = []
    for spec in args.points.split(","):
        network, _, envs = spec.partition(":")
        if network not in ("mlp", "nature_cnn") or not envs.isdigit() or int(envs) < 1:
            p.error(f"--points: {spec!r} is not network:envs (mlp or nature_cnn, envs >= 1)")
        points.append((network, int(envs)))
    import jax

    from benchmarks._util import meta, records_to

    device = jax.local_devices()[0]
    with records_to(args.out) as record:
        record({**meta("acting_anatomy", vars(args)), "device_kind": device.device_kind,
                "xla_flags": os.environ.get("XLA_FLAGS", "")})
        if args.trace_dir:
            os.makedirs(args.trace_dir, exist_ok=True)
        for i, (network, envs) in enumerate(points):
            record({"record": "point", **point(network, envs, args.seconds, args.seed,
                                               args.trace_dir if i == 0 else None)})
        if args.trace_dir:
            record({"record": "loop", **loop_trace(args.trace_dir, args.seed)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
