"""Where an acting step's time goes: the 5x200 SPG acting benchmark's loop (CartPole-v1,
acting only) with a timer around each call of interest, against the bare loop's parts.

Each call is timed inside the real loop (a wrapper adds about 0.3 us a call) and reported
per vector step of one group: microseconds and calls. Timings nest: a source's `send`
includes its env's step, a `recv` its tracker and checks. For one inferencer thread
(sync with async_factor 1, or EnvPool with any async_factor: one thread per device);
several threads would add into the same counters. The bare loop's parts: its acting call's
dispatch, the wait for the action, the env's step.

    python -m benchmarks.acting_profile --vectorization=sync
    python -m benchmarks.acting_profile --vectorization=envpool --async_factor=2
    python -m benchmarks.acting_profile --vectorization=envpool_async --async_factor=2

Records (JSON lines, also to `--out`): meta, `bare` (the bare loop's parts), `loop`
(steps/second, the loop's stage times), one `call` record per timed call, largest first;
end.
"""

from __future__ import annotations

import argparse
import collections
import functools
import time
from typing import Any

from benchmarks._util import acting_agent, int_list, measure, meta, records_to

ENV_ID = "CartPole-v1"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.acting_profile", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vectorization", default="sync", choices=["sync", "envpool", "envpool_async"])
    p.add_argument("--async_factor", type=int, default=1)
    p.add_argument("--envs_per_group", type=int, default=16)
    p.add_argument("--cycles", type=int, default=100, help="cycles of 100 steps per group")
    p.add_argument("--hidden_sizes", type=int_list, default=[200] * 5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=str, default=None, help="also write the records here (JSONL)")
    args = p.parse_args(argv)
    if args.vectorization == "sync" and args.async_factor != 1:
        p.error("sync with async_factor > 1 runs one thread per group; profile async_factor 1")
    return args


class Timers:
    """Seconds and calls per label, of the callables wrapped with `wrap`."""

    def __init__(self):
        self.seconds: collections.Counter[str] = collections.Counter()
        self.calls: collections.Counter[str] = collections.Counter()

    def wrap(self, owner: Any, name: Any, label: str, *, static: bool = False,
             item: bool = False) -> None:
        """Replaces `owner.name` (a class's method, or an instance's attribute; with
        `item`, `owner[name]`) with a timed call of it."""
        f = owner[name] if item else getattr(owner, name)
        clock = time.perf_counter

        @functools.wraps(f)
        def timed(*args, **kwargs):
            t0 = clock()
            try:
                return f(*args, **kwargs)
            finally:
                self.seconds[label] += clock() - t0
                self.calls[label] += 1

        if item:
            owner[name] = timed
        else:
            setattr(owner, name, staticmethod(timed) if static else timed)

    def after_init(self, cls: type, wrap_instance) -> None:
        """Calls `wrap_instance(instance)` after each `cls(...)`: for the attributes an
        instance makes (its env, its compiled functions)."""
        init = cls.__init__

        @functools.wraps(init)
        def wrapped(instance, *args, **kwargs):
            init(instance, *args, **kwargs)
            wrap_instance(instance)

        cls.__init__ = wrapped

    def clear(self) -> None:
        self.seconds.clear()
        self.calls.clear()


def instrument(timers: Timers) -> None:
    """Wraps the acting loop's calls (classes patched in this process only)."""
    from sebulba.envs import envpool_source, gymnasium_source
    from sebulba.runtime import accounting, inferencer

    def source_parts(source) -> None:
        for tracker in getattr(source, "_trackers", [getattr(source, "_tracker", None)]):
            timers.wrap(tracker, "observe", "tracker.observe (by id)")
            timers.wrap(tracker, "observe_all", "tracker.observe_all")
        for i in range(len(getattr(source, "_checks", None) or [])):
            timers.wrap(source._checks, i, "rows' check", item=True)
        if getattr(source, "_check", None) is not None:
            timers.wrap(source, "_check", "rows' check")
        if hasattr(source, "vec"):
            timers.wrap(source.vec, "step", "vec.step (per-env checks included)")

    sources = (gymnasium_source.VectorEnvSource, envpool_source.EnvPoolSource,
               envpool_source.EnvPoolGroups)
    for cls in sources:
        for name in ("recv", "send", "pop_episodes"):
            timers.wrap(cls, name, f"source.{name}")
        timers.after_init(cls, source_parts)
    timers.wrap(envpool_source._Pool, "recv", "pool recv (C++)")
    timers.wrap(envpool_source._Pool, "send", "pool send (C++)")
    timers.wrap(accounting.Accounting, "add_episodes", "accounting: episodes")
    timers.wrap(accounting.Accounting, "add_env_steps", "accounting: env steps")

    def acting_parts(acting) -> None:
        timers.wrap(acting, "act_all", "acting call: dispatch")
        timers.wrap(acting, "act", "acting call: dispatch")
        timers.wrap(acting, "snapshot", "snapshot: dispatch")

    timers.after_init(inferencer.ActingFunctions, acting_parts)
    timers.wrap(inferencer, "fetch_polling", "waiting for the action")
    timers.wrap(inferencer, "_write_outputs", "outputs into the cycle (in order)")
    timers.wrap(inferencer._Cycle, "write_env_step", "rows into the cycle")
    timers.wrap(inferencer.EnvGroupRunner, "_record_env_steps", "rows into cycles (by id)")
    timers.wrap(inferencer.EnvGroupRunner, "_record_sent", "outputs into cycles (by id)",
                static=True)
    timers.wrap(inferencer.EnvGroupRunner, "_push", "push a cycle")


def bare_parts(agent, num_envs: int, vector_steps: int, seed: int) -> dict[str, float]:
    """The bare sync loop's parts, us per vector step: dispatch, wait, env step."""
    import jax
    import numpy as np

    import sebulba
    from sebulba.envs.gymnasium_source import make_vector_env
    from sebulba.runtime.inferencer import fetch_polling

    vec = make_vector_env(ENV_ID, num_envs, "sync")
    try:
        key = jax.random.key(seed)
        nets = agent.new_networks(key)
        step_state = agent.new_step_state(nets, key, num_envs)
        step = jax.jit(agent.step, donate_argnums=0)
        obs, _ = vec.reset(seed=seed)
        flags = np.zeros(num_envs, bool)
        env_step = sebulba.EnvStep(obs, np.zeros(num_envs, np.float32), flags, flags, flags)
        poll = sebulba.Config(env=ENV_ID).action_poll_seconds
        totals = collections.Counter()
        clock = time.perf_counter
        for i in range(vector_steps + 10):
            t0 = clock()
            out, step_state = step(step_state, nets, env_step)
            t1 = clock()
            action = fetch_polling(out.action, poll)
            t2 = clock()
            obs, reward, terminated, truncated, _ = vec.step(action)
            env_step = sebulba.EnvStep(obs, reward.astype(np.float32), terminated, truncated,
                                       flags)
            if i >= 10:  # compiled and warm
                totals["dispatch"] += t1 - t0
                totals["wait"] += t2 - t1
                totals["env step"] += clock() - t2
        return {k: round(1e6 * v / vector_steps, 1) for k, v in totals.items()}
    finally:
        vec.close()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import sebulba

    started = time.perf_counter()
    with records_to(args.out) as record:
        record(meta("acting_profile", vars(args)))
        agent = acting_agent(sebulba.env_spec(ENV_ID), args.hidden_sizes)
        if args.vectorization == "sync":
            parts = bare_parts(agent, args.envs_per_group, args.cycles * 100, args.seed)
            record({"record": "bare", "us_per_vector_step": parts,
                    "total": round(sum(parts.values()), 1)})
        timers = Timers()
        instrument(timers)
        loop = sebulba.Sebulba(agent, sebulba.Config(
            env=ENV_ID, envs_per_group=args.envs_per_group, vectorization=args.vectorization,
            async_factor=args.async_factor, steps_per_cycle=100, seed=args.seed))
        measure(loop, cycles=1)  # compiles
        timers.clear()
        rec = measure(loop, args.cycles)
        record({"record": "loop", **rec})
        vector_steps = rec["env_steps"] / args.envs_per_group
        for label, seconds in timers.seconds.most_common():
            record({"record": "call", "call": label,
                    "us_per_vector_step": round(1e6 * seconds / vector_steps, 1),
                    "calls_per_vector_step": round(timers.calls[label] / vector_steps, 3),
                    "us_per_call": round(1e6 * seconds / timers.calls[label], 1)})
        record({"record": "end", "seconds": round(time.perf_counter() - started, 1)})


if __name__ == "__main__":
    main()
