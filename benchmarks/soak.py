"""A long run's memory: PPO on CartPole-v1 with the launcher's defaults for about
`--seconds`, the process's resident set size (RSS, from /proc/self/status) sampled every
`--sample_seconds` from the learner's update callback. After warm-up (compilation, the
first queue fills) RSS should stay flat: the per-episode and per-trajectory records are
bounded windows (`sebulba.runtime.accounting`), nothing else grows with the run.

Records (JSON lines): meta, calibration (steps/s of a short run, which sizes the long
one), one sample per interval, then a summary: RSS after warm-up (at 10% of the run) and
at the end, and the growth in between, in MiB per minute.

    python -m benchmarks.soak                 # about 10 minutes
    python -m benchmarks.soak --seconds=60    # a quick look
"""

from __future__ import annotations

import argparse
import time

from benchmarks._util import emit, meta


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=600.0, help="length of the long run")
    p.add_argument("--sample_seconds", type=float, default=10.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--window", type=int, default=0,
                   help="episode and policy-lag records kept (0: sebulba.runtime.accounting's "
                        "100,000); a smaller window fills within a 10-minute run, so the "
                        "plateau after it shows")
    return p.parse_args(argv)


def rss_mib() -> float:
    """This process's resident set size in MiB (Linux)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import sebulba
    from agents.ppo import PPO
    from sebulba.runtime import accounting

    if args.window:  # read when a run's Accounting is made
        accounting.EPISODE_WINDOW = accounting.LAG_WINDOW = args.window

    emit(meta("soak", vars(args)))
    config = sebulba.Config(env="CartPole-v1", seed=args.seed)
    loop = sebulba.Sebulba(PPO(config.env_spec()), config)
    calibration = loop.run(200_000)
    sps = calibration.consumed_steps_per_second
    emit({"record": "calibration", "steps_per_second": round(sps, 1)})

    samples: list[dict] = []
    start = time.perf_counter()
    next_sample = 0.0

    def on_update(info) -> None:
        nonlocal next_sample
        elapsed = time.perf_counter() - start
        if elapsed >= next_sample:
            sample = {"record": "sample", "seconds": round(elapsed, 1),
                      "rss_mib": round(rss_mib(), 1), "consumed": info.accounting.consumed,
                      "episodes_total": info.accounting.episodes_total,
                      "episodes_kept": len(info.accounting.episodes),
                      "lags_kept": len(info.accounting.policy_lags)}
            samples.append(sample)
            emit(sample)
            next_sample = elapsed + args.sample_seconds

    result = loop.run(int(sps * args.seconds), on_update=on_update)
    warm = next(s for s in samples if s["seconds"] >= 0.1 * samples[-1]["seconds"])
    end = samples[-1]
    minutes = (end["seconds"] - warm["seconds"]) / 60
    # Once both windows are full, nothing the run keeps should grow.
    window = accounting.EPISODE_WINDOW
    full = next((x for x in samples if x["episodes_kept"] == window
                 and x["lags_kept"] == accounting.LAG_WINDOW), None)
    full_minutes = (end["seconds"] - full["seconds"]) / 60 if full else 0
    emit({"record": "summary", "seconds": round(result.wall_seconds, 1),
          "env_steps": result.env_steps, "episodes": result.episodes_total,
          "window": window,
          "rss_mib_after_warm_up": warm["rss_mib"], "rss_mib_at_end": end["rss_mib"],
          "growth_mib_per_minute": round((end["rss_mib"] - warm["rss_mib"]) / minutes, 2)
          if minutes > 0 else None,
          "windows_full_at_seconds": full["seconds"] if full else None,
          "rss_mib_when_windows_full": full["rss_mib"] if full else None,
          "growth_mib_per_minute_after_windows_full":
              round((end["rss_mib"] - full["rss_mib"]) / full_minutes, 2)
              if full_minutes > 0 else None})


if __name__ == "__main__":
    main()
