"""Double buffering: env groups of an env whose step takes a fixed 2 ms of wall time in
its worker (async vectorization). When the env dominates, async_factor 2 (two groups,
one inferring while the other waits on its workers) should nearly double the
steps/second of async_factor 1; the target is 1.9x. Acting only, with the simple policy
gradient agent's own network (two layers of 64).

What the machine allows, measured beside it: the bare vector envs alone, one group, and
two groups stepped at once by two threads with no inference at all. Their ratio is what
the envs themselves reach together: on 2 cores the 16 worker processes of two groups of
8 already step each other's envs slower (1.90x to 1.95x: benchmarks/RESULTS.md, "Overlap:
async_factor 2 over an env whose step takes 2 ms").

Records (JSON lines), for each number of envs per group and each of `--repeats` rounds:
env_only for one and for two groups, then one sebulba record per async_factor; then the
overlap record with the medians' ratios.

    python -m benchmarks.overlap
    python -m benchmarks.overlap --envs_per_group=4 --step_ms=5
"""

from __future__ import annotations

import argparse
import functools
import time

import gymnasium as gym
import numpy as np

from benchmarks._util import (
    acting_agent,
    emit,
    env_only,
    int_list,
    measure,
    median,
    meta,
    ratio,
)

TARGET_RATIO = 1.9  # async_factor 2's steps/second over async_factor 1's


class SleepEnv(gym.Env):
    """Each step sleeps `step_seconds`; episodes are truncated after `episode_length` steps.

    At module level so that spawned workers can import it.
    """

    observation_space = gym.spaces.Box(-1.0, 1.0, (4,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def __init__(self, step_seconds: float = 0.002, episode_length: int = 200):
        self.step_seconds = step_seconds
        self.episode_length = episode_length
        self.t = 0

    def _obs(self) -> np.ndarray:
        return np.array([self.t / self.episode_length, 0.0, 0.0, 0.0], np.float32)

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        self.t = 0
        return self._obs(), {}

    def step(self, action):
        time.sleep(self.step_seconds)
        self.t += 1
        return self._obs(), 1.0, False, self.t >= self.episode_length, {}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.overlap", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--step_ms", type=float, default=2.0, help="wall time of one env step")
    p.add_argument("--envs_per_group", type=int_list, default=[2, 4, 8],
                   help="one overlap figure per value")
    p.add_argument("--steps_per_cycle", type=int, default=50)
    p.add_argument("--cycles", type=int, default=20, help="measured cycles per env group")
    p.add_argument("--hidden_sizes", type=int_list, default=[64, 64])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import sebulba
    from sebulba.envs.gymnasium_source import make_vector_env

    started = time.perf_counter()
    emit(meta("overlap", vars(args)))
    env = functools.partial(SleepEnv, step_seconds=args.step_ms / 1000)
    agent = acting_agent(sebulba.env_spec(env), args.hidden_sizes)
    for e in args.envs_per_group:
        def make_vec(e=e):
            return make_vector_env(env, e, "async")

        loops = {af: sebulba.Sebulba(agent, sebulba.Config(
            env=env, envs_per_group=e, vectorization="async", async_factor=af,
            steps_per_cycle=args.steps_per_cycle, seed=args.seed)) for af in (1, 2)}
        for loop in loops.values():
            measure(loop, cycles=1)  # compiles
        runs: dict[int, list[float]] = {1: [], 2: []}
        envs: dict[int, list[float]] = {1: [], 2: []}
        for repeat in range(args.repeats):
            for groups in (1, 2):
                sps = env_only(make_vec, args.cycles * args.steps_per_cycle, args.seed, groups)
                envs[groups].append(sps)
                emit({"record": "env_only", "repeat": repeat, "envs_per_group": e,
                      "groups": groups, "steps_per_second": round(sps, 1)})
            for af, loop in loops.items():
                rec = measure(loop, args.cycles)
                runs[af].append(rec["steps_per_second"])
                emit({"record": "sebulba", "repeat": repeat, **rec})
        af1, af2 = median(runs[1]), median(runs[2])
        env_cap = ratio(median(envs[2]), median(envs[1]))
        emit({"record": "overlap", "envs_per_group": e, "steps_per_second_af1": af1,
              "steps_per_second_af2": af2, "repeats_af1": runs[1], "repeats_af2": runs[2],
              "ratio_af2_to_af1": ratio(af2, af1), "target_ratio": TARGET_RATIO,
              "meets_target": af2 >= TARGET_RATIO * af1,
              "env_only_one_group": median(envs[1]), "env_only_two_groups": median(envs[2]),
              "env_ratio_two_to_one": env_cap})
    emit({"record": "end", "seconds": round(time.perf_counter() - started, 1)})


if __name__ == "__main__":
    main()
