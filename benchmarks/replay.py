"""Replay costs: the sum tree's O(B log C) against O(C) sampling over every row.

For each capacity C (full replays; an item is an int32 id and a float32 vector), times
jitted calls with batch B, after warm-up, one call at a time (dispatch included, result
waited for), and reports the median and the 10th / 90th percentiles in microseconds:

  - sample: `replay.sample` (prioritized, stratified, sum tree descent) with its items.
  - sample_uniform: `replay.sample_uniform`.
  - update_priorities, insert: with the replay donated, as the framework's learner does
    (without donation XLA copies the written arrays, an O(C) memcpy per call).
  - old_choice: the O(C) baseline, P(i) over all C rows then `jax.random.choice(p=P)`.
  - old_searchsorted: P(i) over all C rows, cumsum, then `searchsorted` of B uniforms.

Records are JSON lines: a meta record, one per (capacity, operation), then a summary with
the 1M-capacity figures against the 2 ms target for sampling.

    python -m benchmarks.replay
    python -m benchmarks.replay --capacities=10000,1000000 --repeats=500
"""

from __future__ import annotations

import argparse
import functools
import time

from benchmarks._util import emit, int_list, meta

TARGET_SAMPLE_MS = 2.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--capacities", type=int_list, default=[10_000, 100_000, 1_000_000])
    parser.add_argument("--batch_size", type=int, default=256)
    parser.add_argument("--vector_size", type=int, default=8,
                        help="float32 entries of an item besides its int32 id")
    parser.add_argument("--repeats", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--alpha", type=float, default=0.9)
    parser.add_argument("--beta", type=float, default=0.6)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def timings(call, repeats: int, warmup: int) -> dict[str, float]:
    """Microseconds per call of `call(i)`, which returns what to wait for."""
    import jax
    import numpy as np

    for i in range(warmup):
        jax.block_until_ready(call(i))
    seconds = []
    for i in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(call(warmup + i))
        seconds.append(time.perf_counter() - t0)
    us = 1e6 * np.asarray(seconds)
    return {"median_us": round(float(np.median(us)), 1),
            "p10_us": round(float(np.percentile(us, 10)), 1),
            "p90_us": round(float(np.percentile(us, 90)), 1)}


def full_replay(capacity: int, vector_size: int, alpha: float, seed: int):
    """A replay of `capacity` items, all held, at random priorities in [0.01, 10)."""
    import jax
    import jax.numpy as jnp

    from sebulba.experience import replay as rp

    example = {"id": jnp.zeros((), jnp.int32), "x": jnp.zeros((vector_size,), jnp.float32)}
    replay = rp.new_replay(example, capacity, priority_exponent=alpha)
    key = jax.random.key(seed)
    ids = jnp.arange(capacity, dtype=jnp.int32)
    items = {"id": ids, "x": jax.random.normal(key, (capacity, vector_size))}
    replay = jax.jit(rp.insert, donate_argnums=0)(replay, items)
    priorities = jax.random.uniform(jax.random.fold_in(key, 1), (capacity,), minval=0.01,
                                    maxval=10.0)
    return jax.jit(rp.update_priorities, donate_argnums=0)(replay, ids, priorities)


def old_sample(replay, key, batch_size: int, alpha: float, beta: float, method: str):
    """The O(C) baseline: P(i) over all rows, then one of two draws."""
    import jax
    import jax.numpy as jnp

    from sebulba.experience import replay as rp

    probs = rp.power_probabilities(replay.priorities, alpha,
                                   jnp.arange(replay.capacity) < replay.size)
    if method == "choice":
        indices = jax.random.choice(key, replay.capacity, (batch_size,), p=probs)
    else:
        cdf = jnp.cumsum(probs)
        u = jax.random.uniform(key, (batch_size,)) * cdf[-1]
        indices = jnp.minimum(jnp.searchsorted(cdf, u, side="right"), replay.capacity - 1)
    p = probs[indices]
    n = jnp.maximum(replay.size, 1).astype(jnp.float32)
    weights = (n * p) ** (-beta)
    items = jax.tree.map(lambda x: x[indices], replay.items)
    return indices, items, p, weights / jnp.max(weights)


def bench_capacity(args: argparse.Namespace, capacity: int) -> dict[str, dict[str, float]]:
    import jax
    import jax.numpy as jnp

    from sebulba.experience import replay as rp

    B, reps, warm = args.batch_size, args.repeats, args.warmup
    replay = full_replay(capacity, args.vector_size, args.alpha, args.seed)
    # Per-call arguments sliced up front: an eager slice costs more than a jitted sample.
    keys = list(jax.random.split(jax.random.key(args.seed + 1), reps + warm))
    results = {}

    sample = jax.jit(rp.sample, static_argnums=2)
    results["sample"] = timings(lambda i: sample(replay, keys[i], B, args.beta), reps, warm)
    uniform = jax.jit(rp.sample_uniform, static_argnums=2)
    results["sample_uniform"] = timings(lambda i: uniform(replay, keys[i], B), reps, warm)
    for method in ["choice", "searchsorted"]:
        old = jax.jit(functools.partial(old_sample, batch_size=B, alpha=args.alpha,
                                        beta=args.beta, method=method))
        results[f"old_{method}"] = timings(lambda i, old=old: old(replay, keys[i]), reps, warm)

    # Writes, the replay donated and fed back. Rows and values drawn up front.
    rows = list(jax.random.randint(jax.random.key(args.seed + 2), (reps + warm, B), 0,
                                   capacity, jnp.int32))
    values = list(jax.random.uniform(jax.random.key(args.seed + 3), (reps + warm, B),
                                     maxval=10.0))
    new_items = {"id": jnp.arange(B, dtype=jnp.int32),
                 "x": jnp.ones((B, args.vector_size), jnp.float32)}
    update = jax.jit(rp.update_priorities, donate_argnums=0)
    insert = jax.jit(rp.insert, donate_argnums=0)
    state = {"replay": replay}

    def write(fn, i, *args_):
        state["replay"] = fn(state["replay"], *args_)
        return state["replay"].tree

    results["update_priorities"] = timings(lambda i: write(update, i, rows[i], values[i]),
                                           reps, warm)
    results["insert"] = timings(lambda i: write(insert, i, new_items), reps, warm)
    return results


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    started = time.perf_counter()
    emit(meta("replay", vars(args)))
    by_capacity = {}
    for capacity in args.capacities:
        by_capacity[capacity] = bench_capacity(args, capacity)
        for op, figures in by_capacity[capacity].items():
            emit({"record": "op", "capacity": capacity, "batch_size": args.batch_size,
                  "op": op, **figures})
    largest = max(args.capacities)
    medians = {op: f["median_us"] for op, f in by_capacity[largest].items()}
    emit({"record": "summary", "capacity": largest, "batch_size": args.batch_size,
          "median_us": medians, "target_sample_ms": TARGET_SAMPLE_MS,
          "sample_within_target": medians["sample"] <= 1000 * TARGET_SAMPLE_MS,
          "speedup_over_old_choice": round(medians["old_choice"] / medians["sample"], 1),
          "seconds": round(time.perf_counter() - started, 1)})


if __name__ == "__main__":
    main()
