"""Evaluation during training: what it costs the training's throughput.

Two settings of one training run, in one process: evaluation off, and on at its default
cadence (`Config.eval_every_updates` small, so that an evaluation is due at every update,
and `Config.eval_max_share` left at 0.02: the share of the training's env steps the
evaluator may take is what bounds how often it evaluates). Repeats interleave in rounds
of three runs (off, on, and off again as an A/A control that shows the noise), the order
rotating from round to round so that a change of load hits each alike.

- cartpole: PPO on CartPole-v1, sync vectorization (the settings of `train_speed`).
- pong: IMPALA on EnvPool's `Pong-v5` (`train_speed`'s "pong_envpool"), two groups.
  Evaluation's default is 10 episodes of one env each and an evaluation lasts until the
  longest ends (a Pong episode is 800 to 20,000 steps), so Pong evaluates 1 episode
  (`--pong_eval_episodes`): 10 episodes are some 8,000 steps, 2% of 400k training
  steps, far more than a run here trains (and the first evaluation is taken whatever
  its size).

Each run starts from a fresh initial state and reuses its loop's compiled functions (a
warm-up run of each loop compiled them). It is timed from the `--warmup_updates`-th learner update
(the threads started, the envs reset; the evaluator's first evaluation starts after the
first update, inside the timed window) until `--cartpole_seconds` / `--pong_seconds`
have passed, by `on_update`'s timestamps and consumed env steps, and with evaluation on
until its first evaluation has finished too (later only in a smoke run); the run is then
stopped. The evaluator's env steps are counted over the whole run (an evaluation under
way at the end included) and given as a share of the training's env steps.

On two cores shared with other work, throughput spreads by 20% or more from run to run;
each run therefore also gives the process's CPU time per consumed step in the same
window (all its threads), which other processes' load disturbs less: where training
keeps the machine busy, what evaluation adds to it is what it costs. The evaluator's own
work is given apart: its thread's CPU time (its CartPole envs step on it; EnvPool's
threads and XLA's pool are not counted) and the seconds JAX spent compiling on it.

Records (JSON lines, also to `--out`): meta; warmup; one `run` per run; one `summary`
per setup: each arm's median consumed steps/second and CPU ms per 1,000 steps, on/off
and off_control/off (A/A) of those medians and each round's, the evaluator's share of
the env steps, of the CPU time, its compile seconds and its evaluations; end.

    python -m benchmarks.evaluation_cost                    # about 8 minutes
    python -m benchmarks.evaluation_cost --setups=cartpole --rounds=5
    python -m benchmarks.evaluation_cost --quick            # a smoke run, about 30 s
"""

from __future__ import annotations

import argparse
import dataclasses
import resource
import threading
import time
from typing import Any

from benchmarks import train_speed
from benchmarks._util import median, meta, ratio, records_to, str_list

SETUPS = {  # setup: (agent, train_speed's env)
    "cartpole": ("ppo", "cartpole"),
    "pong": ("impala", "pong_envpool"),
}
ARMS = ("off", "on", "off_control")  # off_control: the same loop as off, an A/A control
# A run stops once its timed window has passed; it never consumes this many steps.
UNBOUNDED_STEPS = 10**12
# A run that evaluates waits this long at most past its timed seconds for its first
# evaluation to finish (a smoke run's seconds are shorter than one evaluation).
FIRST_EVALUATION_S = 120.0
EVALUATOR_THREAD = "sebulba-evaluator"  # sebulba.runtime.evaluator's thread
COMPILE_EVENTS = "/jax/core/compile/"  # tracing, lowering, compiling: JAX's events


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.evaluation_cost",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--setups", type=str_list, default=list(SETUPS),
                   help=f"some of {','.join(SETUPS)}")
    p.add_argument("--rounds", type=int, default=3,
                   help="rounds of three runs (off, on, off_control) per setup")
    p.add_argument("--cartpole_seconds", type=float, default=10.0,
                   help="timed seconds of each CartPole run")
    p.add_argument("--pong_seconds", type=float, default=30.0,
                   help="timed seconds of each Pong run")
    p.add_argument("--warmup_updates", type=int, default=2,
                   help="a run is timed from this learner update on")
    p.add_argument("--eval_every_updates", type=int, default=1)
    p.add_argument("--eval_max_share", type=float, default=None,
                   help="Config.eval_max_share (default: Config's, 0.02)")
    p.add_argument("--cartpole_eval_episodes", type=int, default=None,
                   help="Config.eval_episodes on CartPole (default: Config's, 10)")
    p.add_argument("--pong_eval_episodes", type=int, default=1)
    p.add_argument("--cartpole_async_factor", type=int, default=1)
    p.add_argument("--pong_async_factor", type=int, default=2)
    p.add_argument("--cartpole_envs", type=int, default=16, help="envs per group")
    p.add_argument("--pong_envs", type=int, default=8, help="envs per group")
    p.add_argument("--steps_per_cycle", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true",
                   help="a smoke run: one round of short runs, small Pong groups, no warm-up "
                   "runs (the timed runs compile)")
    p.add_argument("--out", type=str, default=None, help="also write the records here (JSONL)")
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.cartpole_seconds, args.pong_seconds = 1, 1.0, 1.0
        args.pong_envs, args.steps_per_cycle = 2, 16
    for name in ("rounds", "warmup_updates", "eval_every_updates", "pong_eval_episodes"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    for name in ("cartpole_seconds", "pong_seconds"):
        if not getattr(args, name) > 0:
            p.error(f"--{name} must be > 0, got {getattr(args, name)}")
    unknown = [s for s in args.setups if s not in SETUPS]
    if unknown or not args.setups:
        p.error(f"--setups must name some of {', '.join(SETUPS)}, got {args.setups}")
    return args


def build_loops(args: argparse.Namespace, setup: str) -> dict[str, Any]:
    """The setup's loop without evaluation (arms off and off_control) and with it (on):
    `train_speed`'s agent, env and config, the evaluation fields changed."""
    import sebulba

    agent_name, env = SETUPS[setup]
    base = train_speed.parse_args([
        f"--cartpole_envs={args.cartpole_envs}", f"--pong_envs={args.pong_envs}",
        f"--steps_per_cycle={args.steps_per_cycle}", f"--seed={args.seed}"])
    async_factor = args.cartpole_async_factor if setup == "cartpole" else args.pong_async_factor
    off, _ = train_speed.build_loop(base, agent_name, env, async_factor)
    evaluation: dict[str, Any] = {"eval_every_updates": args.eval_every_updates}
    episodes = args.cartpole_eval_episodes if setup == "cartpole" else args.pong_eval_episodes
    if episodes is not None:
        evaluation["eval_episodes"] = episodes
    if args.eval_max_share is not None:
        evaluation["eval_max_share"] = args.eval_max_share
    on = sebulba.Sebulba(off.agent, dataclasses.replace(off.config, **evaluation))
    return {"off": off, "on": on, "off_control": off}


class EvaluatorWork:
    """What the evaluator's thread (`EVALUATOR_THREAD`) costs: its CPU time (Linux's
    schedstat; its envs' own threads and XLA's pool not included) and the seconds JAX
    spent on that thread tracing, lowering and compiling (its compilations)."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        """For a new run: its evaluator is a new thread."""
        self.compile_seconds = 0.0
        self._tid: int | None = None

    def on_jax_event(self, event: str, seconds: float, **_: Any) -> None:
        if (event.startswith(COMPILE_EVENTS)
                and threading.current_thread().name == EVALUATOR_THREAD):
            self.compile_seconds += seconds

    def cpu_seconds(self) -> float | None:
        """The evaluator thread's CPU time so far; None with no evaluator running."""
        if self._tid is None:
            self._tid = next((t.native_id for t in threading.enumerate()
                              if t.name == EVALUATOR_THREAD), None)
        try:
            with open(f"/proc/self/task/{self._tid}/schedstat", encoding="ascii") as f:
                return int(f.read().split()[0]) / 1e9
        except (OSError, ValueError, IndexError):  # none, or not Linux
            return None


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)  # all the process's threads
    return usage.ru_utime + usage.ru_stime


def timed_run(loop, seconds: float, warmup_updates: int, work: EvaluatorWork
              ) -> dict[str, Any]:
    """One learning run from a fresh initial state, stopped `seconds` after its
    `warmup_updates`-th learner update, or later, once an evaluation has finished if the
    loop evaluates (for at most `FIRST_EVALUATION_S` more): consumed env steps/second and
    the process's CPU time per consumed step from that update on, and the evaluator's
    work (`work` is listening to JAX's compile events)."""
    # After each learner update: (time, consumed, process CPU, evaluator thread CPU).
    marks: list[tuple[float, int, float, float | None]] = []
    evaluated = not loop.config.eval_every_updates
    stop = threading.Event()
    work.reset()

    def on_update(info) -> None:
        nonlocal evaluated
        marks.append((time.perf_counter(), info.accounting.consumed, _cpu_seconds(),
                      work.cpu_seconds() if loop.config.eval_every_updates else None))
        evaluated = evaluated or bool(info.evaluations)
        if len(marks) > warmup_updates:
            timed = marks[-1][0] - marks[warmup_updates - 1][0]
            if timed >= seconds and (evaluated or timed >= seconds + FIRST_EVALUATION_S):
                stop.set()

    result = loop.run(UNBOUNDED_STEPS, on_update=on_update, stop=stop)
    (t0, consumed0, cpu0, eval0), (t1, consumed1, cpu1, eval1) = (
        marks[warmup_updates - 1], marks[-1])
    evaluations = result.evaluations
    return {
        "consumed_steps_per_second": round((consumed1 - consumed0) / (t1 - t0), 1),
        "timed_seconds": round(t1 - t0, 2),
        "timed_updates": len(marks) - warmup_updates,
        # The process's CPU time (every thread: the loop's, XLA's, EnvPool's) per 1,000
        # steps consumed, and the cores it kept busy, in the timed window.
        "cpu_ms_per_1k_steps": round(1e6 * (cpu1 - cpu0) / (consumed1 - consumed0), 1),
        "process_cpu_cores": round((cpu1 - cpu0) / (t1 - t0), 2),
        "wall_seconds": round(result.wall_seconds, 2),
        "env_steps": result.env_steps, "consumed": result.consumed,
        "learner_updates": result.learner_updates,
        "evaluator_env_steps": result.evaluator_env_steps,
        "evaluator_share": round(result.evaluator_env_steps / result.env_steps, 4),
        # The evaluator thread's share of the process's CPU time in the timed window.
        "evaluator_cpu_share": (round((eval1 - eval0) / (cpu1 - cpu0), 4)
                                if eval0 is not None and eval1 is not None else None),
        "evaluator_compile_seconds": round(work.compile_seconds, 2),
        "evaluations": len(evaluations),
        "evaluated_updates": [e.learner_update for e in evaluations],
        "evaluation_seconds": [round(e.seconds, 2) for e in evaluations],
        "evaluation_mean_length": [round(e.result.as_dict()["mean_length"], 1)
                                   for e in evaluations],
    }


def _arms(runs: list[dict[str, Any]], field: str, digits: int = 1) -> dict[str, Any]:
    """`field`'s median in each arm, on/off and off_control/off of those medians, and
    each round's."""
    values = {arm: [r[field] for r in runs if r["arm"] == arm] for arm in ARMS}
    medians = {arm: median(v, digits) for arm, v in values.items()}
    by_round = {(r["round"], r["arm"]): r[field] for r in runs}
    rounds = sorted({r["round"] for r in runs})
    return {
        "median": medians,
        "spread": {arm: [min(v), max(v)] for arm, v in values.items()},
        "on_over_off": ratio(medians["on"], medians["off"]),
        "control_over_off": ratio(medians["off_control"], medians["off"]),
        "on_over_off_by_round": [ratio(by_round[i, "on"], by_round[i, "off"]) for i in rounds],
        "control_over_off_by_round": [ratio(by_round[i, "off_control"], by_round[i, "off"])
                                      for i in rounds],
    }


def summarize(setup: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Throughput and CPU per step in each arm, and what the evaluator did."""
    on_runs = [r for r in runs if r["arm"] == "on"]
    evaluator_steps = sum(r["evaluator_env_steps"] for r in on_runs)
    training_steps = sum(r["env_steps"] for r in on_runs)
    seconds = [x for r in on_runs for x in r["evaluation_seconds"]]
    cpu_shares = [r["evaluator_cpu_share"] for r in on_runs
                  if r["evaluator_cpu_share"] is not None]
    return {
        "setup": setup, "repeats": len({r["round"] for r in runs}),
        "consumed_steps_per_second": _arms(runs, "consumed_steps_per_second"),
        "cpu_ms_per_1k_steps": _arms(runs, "cpu_ms_per_1k_steps"),
        "process_cpu_cores": _arms(runs, "process_cpu_cores", 2)["median"],
        "evaluator_share": round(evaluator_steps / training_steps, 4),
        "evaluator_share_by_run": [r["evaluator_share"] for r in on_runs],
        "evaluator_cpu_share_median": median(cpu_shares, 4) if cpu_shares else None,
        "evaluator_compile_seconds_by_run": [r["evaluator_compile_seconds"] for r in on_runs],
        "evaluations_by_run": [r["evaluations"] for r in on_runs],
        "evaluation_seconds_median": median(seconds, 2) if seconds else None,
    }


def measure_setup(args: argparse.Namespace, setup: str, record, work: EvaluatorWork
                  ) -> None:
    """Warm-up runs that compile, then the rounds of runs of one setup, and its summary."""
    loops = build_loops(args, setup)
    seconds = args.cartpole_seconds if setup == "cartpole" else args.pong_seconds
    for arm in ("off", "on") if not args.quick else ():  # compiles; reused after
        t0 = time.perf_counter()
        timed_run(loops[arm], 0.0, args.warmup_updates, work)
        record({"record": "warmup", "setup": setup, "arm": arm,
                "seconds": round(time.perf_counter() - t0, 1)})
    runs = []
    for i in range(args.rounds):
        for j in range(len(ARMS)):  # the order rotates from round to round
            arm = ARMS[(i + j) % len(ARMS)]
            rec = {"record": "run", "setup": setup, "round": i, "arm": arm,
                   **timed_run(loops[arm], seconds, args.warmup_updates, work)}
            record(rec)
            runs.append(rec)
    record({"record": "summary", **summarize(setup, runs)})


def main(argv: list[str] | None = None) -> None:
    import jax

    args = parse_args(argv)
    work = EvaluatorWork()
    jax.monitoring.register_event_duration_secs_listener(work.on_jax_event)
    try:
        with records_to(args.out) as record:
            started = time.perf_counter()
            record(meta("evaluation_cost", vars(args)))
            for setup in args.setups:
                measure_setup(args, setup, record, work)
            record({"record": "end", "seconds": round(time.perf_counter() - started, 1)})
    finally:
        jax.monitoring.unregister_event_duration_listener(work.on_jax_event)


if __name__ == "__main__":
    main()
