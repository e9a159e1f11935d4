"""R2D2 in the Sebulba loop: learner updates/second, env steps/second and the replay
ratio achieved, for a few learner steps per trajectory (`updates_per_trajectory`).

The replay ratio is sequences sampled / sequences inserted: every applied learner step
samples batch_size sequences on each learner device; every consumed trajectory inserts
one sequence per env once that env has sent sequence_length / steps_per_cycle of them.
Learner steps taken while the replay warms up (below min_replay_size) are counted in
`learner_steps` but not in `applied_updates`, and sample nothing that is learnt from.

Records (JSON lines): meta; learner_only (updates/second of the compiled learner step
on a full replay, no actors); one sebulba record per updates_per_trajectory value
(after a short run that compiles); end.

    python -m benchmarks.r2d2
    python -m benchmarks.r2d2 --updates_per_trajectory=1,4 --total_env_steps=200000
"""

from __future__ import annotations

import argparse
import time

from benchmarks._util import emit, int_list, meta


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.r2d2", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--env", default="sebulba.envs.suite:sebulba/CartPoleNoVelocity-v1")
    p.add_argument("--total_env_steps", type=int, default=100_000)
    p.add_argument("--updates_per_trajectory", type=int_list, default=[1, 2, 4])
    p.add_argument("--envs_per_group", type=int, default=16)
    p.add_argument("--async_factor", type=int, default=2)
    p.add_argument("--steps_per_cycle", type=int, default=20,
                   help="the sequence period; sequences are twice as long, burn-in half")
    p.add_argument("--batch_size", type=int, default=32)
    p.add_argument("--sizes", type=int, default=64, help="torso, LSTM and head widths")
    p.add_argument("--replay_capacity", type=int, default=5000)
    p.add_argument("--min_replay_size", type=int, default=500)
    p.add_argument("--learner_only_updates", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def agent_config(args: argparse.Namespace, updates: int):
    from agents.r2d2 import R2D2Config

    t = args.steps_per_cycle
    return R2D2Config(torso_sizes=(args.sizes,), lstm_size=args.sizes,
                      head_sizes=(args.sizes,), sequence_length=2 * t, sequence_overlap=t,
                      burn_in=t // 2, n_step=5, discount=0.99, target_update_period=200,
                      learning_rate=5e-4, batch_size=args.batch_size,
                      replay_capacity=args.replay_capacity,
                      min_replay_size=args.min_replay_size, updates_per_trajectory=updates)


def learner_only(args: argparse.Namespace) -> float:
    """Updates/second of the compiled learner step on one device with a full replay."""
    import jax
    import jax.numpy as jnp

    import sebulba
    from agents.r2d2 import R2D2
    from sebulba.experience import replay as rp
    from sebulba.runtime.learner import optimizer_step, per_learner_device

    agent = R2D2(sebulba.env_spec(args.env), agent_config(args, 1))
    device = jax.devices()[:1]
    layout = sebulba.Layout(envs_per_group=args.envs_per_group, num_groups=args.async_factor,
                            steps_per_cycle=args.steps_per_cycle, num_learner_devices=1)
    key = jax.random.key(args.seed)
    state = agent.new_state(agent.new_networks(key), key, layout)
    replay = state.experience.replay
    capacity = replay.capacity
    # Zero sequences cost what real ones do; a full replay at uniform priority.
    replay = rp.update_priorities(replay._replace(size=jnp.int32(capacity)),
                                  jnp.arange(capacity), jnp.ones(capacity))
    experience = state.experience._replace(replay=replay)
    args_ = jax.tree.map(lambda x: x[None], (state.nets, state.opt, experience))
    optimize = per_learner_device(lambda n, o, e: optimizer_step(agent, n, o, e), device,
                                  donate_argnums=(0, 1, 2))
    nets, opt, exp = jax.device_put(args_, device[0])
    for _ in range(3):  # compiles
        nets, opt, exp, metrics = optimize(nets, opt, exp)
    jax.block_until_ready(metrics)
    t0 = time.perf_counter()
    for _ in range(args.learner_only_updates):
        nets, opt, exp, metrics = optimize(nets, opt, exp)
    jax.block_until_ready(metrics)
    return args.learner_only_updates / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import sebulba
    from agents.r2d2 import R2D2

    started = time.perf_counter()
    emit(meta("r2d2", vars(args)))
    emit({"record": "learner_only", "batch_size": args.batch_size,
          "sequence_length": 2 * args.steps_per_cycle,
          "updates_per_second": round(learner_only(args), 1)})
    spec = sebulba.env_spec(args.env)
    for updates in args.updates_per_trajectory:
        cfg = agent_config(args, updates)
        config = sebulba.Config(env=args.env, envs_per_group=args.envs_per_group,
                                async_factor=args.async_factor,
                                steps_per_cycle=args.steps_per_cycle, seed=args.seed)
        loop = sebulba.Sebulba(R2D2(spec, cfg), config)
        per_trajectory = args.envs_per_group * args.steps_per_cycle
        loop.run(2 * config.num_groups * per_trajectory)  # compiles acting and learning
        result = loop.run(args.total_env_steps)
        applied = int(result.state.opt.steps)
        learner_devices = len(config.resolved_local_learner_devices())
        total_envs = args.envs_per_group * config.num_groups
        # The first K - 1 trajectories of each env only fill its pending window.
        waiting = total_envs * (cfg.sequence_length // cfg.sequence_period - 1)
        inserted = result.consumed // cfg.sequence_period - waiting
        sampled = applied * cfg.batch_size * learner_devices
        emit({
            "record": "sebulba", "updates_per_trajectory": updates,
            "env_steps": result.env_steps, "wall_seconds": round(result.wall_seconds, 2),
            "env_steps_per_second": round(result.steps_per_second, 1),
            "learner_updates": result.learner_updates,
            "optimizer_steps": result.optimizer_steps, "applied_updates": applied,
            "optimizer_steps_per_second": round(result.optimizer_steps / result.wall_seconds, 1),
            "sequences_inserted": inserted, "sequences_sampled": sampled,
            "replay_ratio": round(sampled / max(inserted, 1), 3),
            "mean_return_last_10pct": round(result.mean_return(0.9, 1.0), 1),
            "policy_lag_mean": round(sum(result.policy_lags) / len(result.policy_lags), 2),
            "stage_seconds": {k: round(v, 2) for k, v in sorted(result.stage_seconds.items())},
        })
    emit({"record": "end", "seconds": round(time.perf_counter() - started, 1)})


if __name__ == "__main__":
    main()
