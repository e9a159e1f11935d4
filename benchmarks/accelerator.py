"""The accelerator benchmark: one prepared run of at most 8 minutes on whatever
`jax.devices()` lists (acting and learning on the first device), every stage measured for
a fixed wall time rather than a fixed number of steps. `--max_seconds` (450) is the run's
budget: a stage that would start after it is skipped, and a training stage's measured
run is shortened to end within it.

Stages (`--stages` picks some):

- acting_latency: one acting call as the EnvPool loop makes it (`ActingFunctions.act_all`
  for one group's envs, alternating between async_factor groups, the observations copied
  from the host, the action fetched back as the loop fetches it), median and p90 over many
  calls after a warm-up, for each of `--envs_per_call`; PPO's MLP (CartPole-v1) and its
  Nature CNN (EnvPool Breakout-v5 frames, 4 x 84 x 84 uint8). Beside it ("recording"),
  the median of the same call writing the step into a device buffer as well: what
  assembling the trajectory on the device rather than in host memory would cost a call;
  and ("inputs in") of the call on observations already on the device: the round trip
  without their transfer; and, for the Nature CNN ("newest"), of the call that takes each
  observation's newest frame and restacks it on the device, as the loop does on an
  accelerator (`Config.stack_frames_on_device`): the figure the target applies to there.
- acting_only: the 5x200 SPG acting benchmark (`benchmarks/acting_spg.py`: CartPole-v1,
  sync envs, acting only) beside its bounds, env-only and inference-only, and beside
  its framework-free loop (`bare_loop`).
- breakout_ppo, breakout_impala: training on EnvPool Breakout-v5 with the Nature CNN, the
  pool's `num_threads` = `--num_env_threads` (every core steps envs), beside its bounds
  measured in the same run: the envs alone (`env_only`: the same pool, threads, envs and
  batch, random actions; the better of a measurement before the run and one after it,
  `env_only_before_after`) and the learner alone (`learner_only`: updates on a fixed
  trajectory of the training shape).
- halfcheetah_ppo: the same for PPO on EnvPool HalfCheetah-v5 (MLP, Gaussian policy).

Where EnvPool is not installed, or with `--env_source=gymnasium`, the training stages
and the Nature CNN's latency take the closest source there is (`env_source` in their
records): ale-py's own C++ vector env for Breakout ("ALE/Breakout-v5", the same 4 x 84 x
84 frames, `--num_env_threads` threads per group) and gymnasium's MuJoCo HalfCheetah-v5
in "sync" vector envs; their `env_only` bound is the groups' vector envs stepped at once,
a thread each. A GPU machine whose image lacks EnvPool can be given them as wheels
(ale-py's is 3 MB; EnvPool's, with its assets, is more than a call may carry).

Records (JSON lines, also to `--out`): meta, one per stage (a stage that cannot run here
says `skipped` and why; one that fails says `error`, and the exit status is 1), end
(elapsed seconds, threads or processes left behind); then a table with the issue's
targets beside the figures (pass/fail on an accelerator; on the CPU they do not apply).

    python -m benchmarks.accelerator                       # the full run
    python -m benchmarks.accelerator --smoke               # tiny sizes, about a minute
    python -m benchmarks.accelerator --stages=acting_latency,breakout_ppo --out=acc.jsonl

A training stage compiles its agent in a warm-up run first; the measured run starts where
it ended, and its steps/second count from its first env step (`RunResult`). The targets
(issue 29, on an H100 with 16 CPU cores): Breakout-v5 PPO consumes >= 10,000 env steps/s
and >= 0.7 of min(envs alone, learner-only); an acting call for 256 envs takes <= 1 ms
with the Nature CNN and <= 200 us with the MLP (median).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import multiprocessing
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from benchmarks import acting_spg
from benchmarks._util import (
    acting_agent,
    bare_loop,
    env_only,
    envs_alone,
    inference_only,
    learner_only,
    measure,
    meta,
    random_env_step,
    ratio,
    records_to,
)

STAGES = ("acting_latency", "acting_only", "breakout_ppo", "breakout_impala",
          "halfcheetah_ppo")
BREAKOUT_ID = "Breakout-v5"
HALFCHEETAH_ID = "HalfCheetah-v5"
MLP_ENV_ID = "CartPole-v1"
# Steps of the device buffer the latency stage's recording acting call writes into.
RECORD_STEPS = 32
# The stage's (agent, EnvPool task) of each training stage.
TRAINING = {"breakout_ppo": ("ppo", BREAKOUT_ID), "breakout_impala": ("impala", BREAKOUT_ID),
            "halfcheetah_ppo": ("ppo", HALFCHEETAH_ID)}
ENV_SOURCES = ("auto", "envpool", "gymnasium")
# Without EnvPool, for each EnvPool task: (env id, vectorization, the module it needs,
# whether num_threads is its env_kwarg, the records' name for it).
GYMNASIUM_SOURCES = {
    BREAKOUT_ID: ("ALE/Breakout-v5", "vector_entry_point", "ale_py", True, "ale_py vector env"),
    HALFCHEETAH_ID: ("HalfCheetah-v5", "sync", "mujoco", False, "gymnasium sync"),
}

# Issue 29's targets, on an H100 with 16 CPU cores.
LATENCY_TARGET_ENVS = 256
LATENCY_TARGET_US = {"mlp": 200.0, "nature_cnn": 1000.0}  # median of one acting call
BREAKOUT_PPO_STEPS_PER_SECOND = 10_000  # consumed env steps/s (40,000 frames/s)
BREAKOUT_PPO_TO_BOUND = 0.7  # of min(envs alone, learner-only)

# The full run's sizes; `--smoke` replaces them (flags given still win).
SMOKE = {
    "envs_per_call": [4, 16], "latency_seconds": 0.2, "acting_envs": 4,
    "acting_steps_per_cycle": 10, "acting_cycles": 2, "acting_async_factors": [2],
    "envs_per_group": 4, "steps_per_cycle": 8, "ppo_epochs": 1, "ppo_minibatches": 1,
    "warmup_cycles": 1, "train_seconds": 1.0, "bound_seconds": 0.3,
}


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not an int >= 1")
    return value


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not an int >= 0")
    return value


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds > 0")
    return value


def _positive_ints(text: str) -> list[int]:
    values = [_positive_int(x) for x in text.split(",") if x.strip()]
    if not values:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of ints >= 1")
    return values


def _stage_list(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [x for x in names if x not in STAGES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown stage(s) {', '.join(map(repr, unknown)) or repr(text)}; "
            f"expected a comma-separated subset of {', '.join(STAGES)}")
    return names


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.accelerator", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true",
                   help="tiny sizes and budgets: checks that every stage runs")
    p.add_argument("--out", type=str, default=None, help="also write the records here (JSONL)")
    p.add_argument("--stages", type=_stage_list, default=list(STAGES),
                   help=f"comma-separated, of {','.join(STAGES)}")
    p.add_argument("--num_env_threads", type=_positive_int, default=os.cpu_count() or 1,
                   help="EnvPool's (or ale-py's) num_threads in the training stages and "
                        "their bound")
    p.add_argument("--env_source", choices=ENV_SOURCES, default="auto",
                   help="the training stages' envs: EnvPool, gymnasium's (ale-py's vector "
                        "env, MuJoCo), or auto: EnvPool where it is installed")
    p.add_argument("--envs_per_call", type=_positive_ints, default=[16, 64, 256, 1024],
                   help="acting_latency: envs of one acting call")
    p.add_argument("--latency_seconds", type=_positive_seconds, default=2.0,
                   help="acting_latency: measured seconds per network and envs per call")
    p.add_argument("--acting_envs", type=_positive_int, default=None,
                   help="acting_only: envs per group (default: acting_spg's)")
    p.add_argument("--acting_steps_per_cycle", type=_positive_int, default=None,
                   help="acting_only: env steps per cycle (default: acting_spg's)")
    p.add_argument("--acting_cycles", type=_positive_int, default=None,
                   help="acting_only: measured cycles per group (default: acting_spg's)")
    p.add_argument("--acting_async_factors", type=_positive_ints, default=[1, 2],
                   help="acting_only: one measured run per async_factor")
    p.add_argument("--envs_per_group", type=_positive_int, default=64,
                   help="training stages: envs per group (the pool's batch)")
    p.add_argument("--async_factor", type=_positive_int, default=2,
                   help="training stages and acting_latency: groups in the pool")
    p.add_argument("--steps_per_cycle", type=_positive_int, default=32,
                   help="training stages: the trajectory length T")
    p.add_argument("--ppo_epochs", type=_non_negative_int, default=0,
                   help="PPO's num_epochs (0: the agent's default for the action space)")
    p.add_argument("--ppo_minibatches", type=_non_negative_int, default=0,
                   help="PPO's num_minibatches (0: the agent's default)")
    p.add_argument("--warmup_cycles", type=_positive_int, default=2,
                   help="training stages: cycles per group of the compiling run")
    p.add_argument("--train_seconds", type=_positive_seconds, default=30.0,
                   help="training stages: wall seconds of the measured run")
    p.add_argument("--bound_seconds", type=_positive_seconds, default=8.0,
                   help="training stages: seconds of each bound (envs alone, learner-only)")
    p.add_argument("--max_seconds", type=_positive_seconds, default=450.0,
                   help="the run's budget (see above)")
    p.add_argument("--table_from", type=str, default=None,
                   help="print the table of the records in this JSONL file (--out of a "
                        "run cut short, whose end and table were not written) and exit")
    p.add_argument("--seed", type=int, default=0)
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The flags; with `--smoke` the SMOKE sizes are the defaults (flags given win)."""
    p = _parser()
    if p.parse_known_args(argv)[0].smoke:
        p.set_defaults(**SMOKE)
    return p.parse_args(argv)


# Acting-call latency.

def _recording_act(acting, env_step, steps: int):
    """(act, new_buffer): the acting call `act(nets, step_state, env_step, buffer)` that
    also writes the step (the env step and the agent's outputs) at the buffer's cursor
    in a donated device buffer of `steps` steps, as assembling the trajectory on the
    device would; `new_buffer()` an empty one. For the latency stage's comparison only:
    the loop records in host memory (DESIGN.md, "The path of one trajectory")."""
    import jax
    import jax.numpy as jnp

    def act(nets, step_state, env_step, buffer):
        cursor, env_steps, outputs = buffer
        output, step_state, _ = acting._act_all(nets, step_state, None, env_step)

        def write(buf, x):
            return jax.lax.dynamic_update_index_in_dim(buf, x, cursor, axis=1)

        env_steps = jax.tree.map(write, env_steps, env_step)
        outputs = [write(b, x) for b, x in zip(outputs, jax.tree.leaves(output), strict=True)]
        return output, step_state, ((cursor + 1) % steps, env_steps, outputs)

    def new_buffer(nets, step_state, env_step):
        output, _, _ = jax.eval_shape(acting._act_all, nets, step_state, None, env_step)
        return (jnp.zeros((), jnp.int32),
                jax.tree.map(lambda x: jnp.zeros((x.shape[0], steps + 1) + x.shape[1:],
                                                 x.dtype), env_step),
                [jnp.zeros((x.shape[0], steps) + x.shape[1:], x.dtype)
                 for x in jax.tree.leaves(output)])

    return jax.jit(act, donate_argnums=(1, 3)), jax.jit(new_buffer)


def _acting_round_trips(agent, nets, num_envs: int, num_groups: int, seconds: float,
                        seed: int, frame_stack=None) -> dict[str, Any]:
    """Per-call seconds of the loop's acting call for one group of `num_envs` envs, the
    calls alternating between `num_groups` groups (each its own StepState), as the loop
    drives EnvPool's groups in turn: the host's observations copied in, the action
    fetched back (after starting its copy, as the loop does on an accelerator).

    Then the same with the step also written into a device buffer of RECORD_STEPS steps
    per group (`record_on_device_median_us`): what assembling the trajectory on the
    device instead of in host memory would add to each acting call; and the same on an
    env step already on the device (`inputs_on_device_median_us`): the round trip less
    the observations' transfer (five arrays, each its own copy). With a `frame_stack`
    (frames), also the call that takes each observation's newest frame and restacks it
    on the device (`newest_frame_median_us`), as the loop does by default on an
    accelerator (`Config.stack_frames_on_device`)."""
    import jax
    import numpy as np

    from sebulba.config import DEFAULT_ACTION_POLL_S
    from sebulba.runtime.inferencer import (
        ActingFunctions,
        copies_early_to_host,
        fetch_polling,
        start_host_copies,
    )

    device = jax.local_devices()[0]
    acting = ActingFunctions(agent, steps_per_cycle=1)
    leaves = acting.networks(jax.device_put(nets, device))
    step_states = [
        acting.new_state(agent.new_step_state(nets, jax.random.key(seed + g), num_envs),
                         device, snapshots=False).step_state
        for g in range(num_groups)]
    env_step = random_env_step(agent.env_spec, num_envs, seed)
    copies_early = copies_early_to_host(device)

    frames, newest = [], None
    if frame_stack is not None:
        frames = [acting.new_state(agent.new_step_state(nets, jax.random.key(seed + g),
                                                        num_envs), device, snapshots=False,
                                   frame_stack=frame_stack, num_envs=num_envs).frames
                  for g in range(num_groups)]
        newest = env_step._replace(obs=frame_stack.newest(env_step.obs))
    act_recording, new_buffer = _recording_act(acting, env_step, RECORD_STEPS)
    buffers = [new_buffer(leaves, s, env_step) for s in step_states]
    env_step_on_device = jax.device_put(env_step, device)

    def call(i: int, env_step=env_step, kept: list | None = None) -> float:
        """One call; with `kept` (each group's frames on the device), on newest frames."""
        g = i % num_groups
        kept = kept or [None] * num_groups
        t0 = time.perf_counter()
        output, step_states[g], kept[g] = acting.act_all(leaves, step_states[g], kept[g],
                                                         env_step)
        if copies_early:
            start_host_copies(output.action)
        fetch_polling(output.action, DEFAULT_ACTION_POLL_S)
        return time.perf_counter() - t0

    def call_recording(i: int) -> float:
        g = i % num_groups
        t0 = time.perf_counter()
        output, step_states[g], buffers[g] = act_recording(leaves, step_states[g],
                                                           env_step, buffers[g])
        if copies_early:
            start_host_copies(output.action)
        fetch_polling(output.action, DEFAULT_ACTION_POLL_S)
        return time.perf_counter() - t0

    def timed(call: Callable[[int], float], seconds: float) -> tuple[float, np.ndarray]:
        compile_s = call(0)
        start = time.perf_counter()
        for i in range(1, 11):  # warm: at most 10 calls, a quarter of the budget
            call(i)
            if time.perf_counter() - start > seconds / 4:
                break
        times: list[float] = []
        start = time.perf_counter()
        while len(times) < 5 or time.perf_counter() - start < seconds:
            times.append(call(len(times)))
        return compile_s, np.asarray(times)

    compile_s, times = timed(call, seconds)
    _, recording = timed(call_recording, seconds / 4)
    _, resident = timed(lambda i: call(i, env_step_on_device), seconds / 4)
    newest_us = None
    if frame_stack is not None:
        _, newest_times = timed(lambda i: call(i, newest, frames), seconds / 2)
        newest_us = round(float(np.median(newest_times)) * 1e6, 1)
    us = times * 1e6
    return {"envs": num_envs, "calls": len(times), "first_call_s": round(compile_s, 2),
            "median_us": round(float(np.median(us)), 1),
            "p90_us": round(float(np.percentile(us, 90)), 1),
            # Calls back to back, each waiting for its action.
            "steps_per_second": round(num_envs * len(times) / float(np.sum(times)), 1),
            "record_on_device_median_us": round(float(np.median(recording)) * 1e6, 1),
            # The same call on an env step already on the device: the round trip without
            # the observations' transfer, which this one's difference to median_us is.
            "inputs_on_device_median_us": round(float(np.median(resident)) * 1e6, 1),
            # Frames only: the call on each observation's newest frame, restacked on the
            # device (None for vector observations).
            "newest_frame_median_us": newest_us}


def acting_latency(args: argparse.Namespace) -> dict[str, Any]:
    """Per network and envs per call: median and p90 microseconds, env steps/second."""
    import jax

    import sebulba
    from agents.ppo import PPO
    from sebulba.envs.frame_stacks import FrameStack

    frames, missing = choose_env(BREAKOUT_ID, 1, args.env_source)
    specs = {"mlp": (sebulba.env_spec(MLP_ENV_ID), None),
             "nature_cnn": (frames and frames.spec, missing)}
    points, skipped = [], {}
    for network, (spec, missing) in specs.items():
        if missing:
            skipped[network] = missing
            continue
        agent = PPO(spec)  # its MLP on vector observations, the Nature CNN on frames
        nets = agent.new_networks(jax.random.key(args.seed))
        # Breakout's 4 frames of 1 x 84 x 84 (the padding does not change the cost).
        stack = FrameStack(spec.observation_space.shape[0]) if network == "nature_cnn" \
            else None
        for e in args.envs_per_call:
            point = _acting_round_trips(agent, nets, e, args.async_factor,
                                        args.latency_seconds, args.seed, stack)
            points.append({"network": network, **point})
            # Written as it comes: a later point that fails keeps the ones before.
            args.record({"record": "latency_point", **points[-1]})
    return {"num_groups": args.async_factor, "points": points,
            **({"skipped_networks": skipped} if skipped else {})}


# The acting-only benchmark.

def acting_only(args: argparse.Namespace) -> dict[str, Any]:
    """acting_spg's sync configuration beside its bounds, once per async factor."""
    import sebulba
    from sebulba.envs.gymnasium_source import make_vector_env

    spg = acting_spg.parse_args([])  # the benchmark's own sizes
    envs = args.acting_envs or spg.envs_per_group[0]
    steps = args.acting_steps_per_cycle or spg.steps_per_cycle
    cycles = args.acting_cycles or spg.cycles
    agent = acting_agent(sebulba.env_spec(acting_spg.ENV_ID), spg.hidden_sizes)
    def make_vec():
        return make_vector_env(acting_spg.ENV_ID, envs, "sync")

    env_sps = env_only(make_vec, cycles * steps, args.seed)
    inf_sps = inference_only(agent, envs, cycles * steps, args.seed)
    # The least a loop does, framework-free: what the machine allows such a loop.
    bare_sps = bare_loop(agent, make_vec, cycles * steps, args.seed)
    bound = min(env_sps, inf_sps)
    runs = []
    for af in args.acting_async_factors:
        loop = sebulba.Sebulba(agent, sebulba.Config(
            env=acting_spg.ENV_ID, envs_per_group=envs, vectorization="sync",
            async_factor=af, steps_per_cycle=steps, seed=args.seed))
        measure(loop, cycles=1)  # compiles
        rec = measure(loop, cycles)
        runs.append({**rec, "ratio_to_bound": ratio(rec["steps_per_second"], bound),
                     "ratio_to_bare_loop": ratio(rec["steps_per_second"], bare_sps)})
    return {"env": acting_spg.ENV_ID, "hidden_sizes": list(spg.hidden_sizes),
            "envs_per_group": envs, "steps_per_cycle": steps, "cycles": cycles,
            "env_only": round(env_sps, 1), "inference_only": round(inf_sps, 1),
            "bound": round(bound, 1), "bare_loop": round(bare_sps, 1), "runs": runs,
            "target_steps_per_second": acting_spg.TARGET_STEPS_PER_SECOND}


# Training on EnvPool (or the closest source), beside its bounds.

@dataclasses.dataclass(frozen=True)
class EnvChoice:
    """Where a stage's envs come from: a Config's env, vectorization and env_kwargs, the
    env spec, and the name the records give the source."""

    env: str
    vectorization: str
    env_kwargs: dict[str, Any]
    spec: Any
    source: str


def choose_env(task_id: str, num_threads: int, source: str = "auto"
               ) -> tuple[EnvChoice | None, str | None]:
    """(EnvPool's `task_id` where `source` allows and it is installed, else gymnasium's
    closest (`GYMNASIUM_SOURCES`), None), or (None, why neither can be made here)."""
    import sebulba

    reasons = []
    if source in ("auto", "envpool"):
        if importlib.util.find_spec("envpool") is None:
            reasons.append("envpool is not installed (pip install -e '.[envpool]' in "
                           "sebulba's checkout)")
        else:
            kwargs = {"num_threads": num_threads}
            try:
                spec = sebulba.env_spec(task_id, kwargs, vectorization="envpool")
                return EnvChoice(task_id, "envpool", kwargs, spec, "envpool"), None
            except Exception as e:  # noqa: BLE001 - a missing ROM or asset: say so
                reasons.append(f"EnvPool cannot make {task_id!r}: {type(e).__name__}: {e}")
    if source in ("auto", "gymnasium"):
        env, vectorization, module, threaded, name = GYMNASIUM_SOURCES[task_id]
        kwargs = {"num_threads": num_threads} if threaded else {}
        if importlib.util.find_spec(module) is None:
            reasons.append(f"{module} is not installed, for gymnasium's {env!r}")
        else:
            try:
                spec = sebulba.env_spec(env, kwargs, vectorization=vectorization)
                return EnvChoice(env, vectorization, kwargs, spec, name), None
            except Exception as e:  # noqa: BLE001
                reasons.append(f"gymnasium cannot make {env!r}: {type(e).__name__}: {e}")
    return None, "; ".join(reasons)


def _training_loop(args: argparse.Namespace, agent_name: str, choice: EnvChoice):
    import sebulba
    from agents.registry import AGENTS

    entry = AGENTS[agent_name]
    agent_cfg = entry.config_class()
    if agent_name == "ppo":
        agent_cfg = dataclasses.replace(agent_cfg, num_epochs=args.ppo_epochs,
                                        num_minibatches=args.ppo_minibatches)
    elif choice.spec.observation_space.dtype == "uint8":  # IMPALA on Atari: clipped rewards
        agent_cfg = dataclasses.replace(agent_cfg, reward_clip=1.0)
    config = sebulba.Config(env=choice.env, env_kwargs=choice.env_kwargs,
                            vectorization=choice.vectorization,
                            envs_per_group=args.envs_per_group,
                            async_factor=args.async_factor,
                            steps_per_cycle=args.steps_per_cycle, seed=args.seed)
    return sebulba.Sebulba(entry.build(choice.spec, agent_cfg), config)


def _run_for(loop, seconds: float, state):
    """One learning run from `state` that stops after the first learner update past
    `seconds`."""
    stop = threading.Event()
    deadline = time.perf_counter() + seconds

    def on_update(_) -> None:
        if time.perf_counter() >= deadline:
            stop.set()

    return loop.run(2**62, state, on_update=on_update, stop=stop)


def _short_of_time(args: argparse.Namespace, after: str, warmup_s: float = 0.0
                   ) -> str | None:
    """Why a training stage stops here, if what is left of the run's budget cannot hold
    a warm-up of `warmup_s`, its bounds and a shortest measured run, plus a few seconds
    for the rest."""
    left = args.deadline - time.perf_counter()
    if left < warmup_s + 3 * args.bound_seconds + min(args.train_seconds, 5.0) + 10:
        return f"{left:.0f} s of the run's budget left {after}"
    return None


def training(args: argparse.Namespace, agent_name: str, task_id: str) -> dict[str, Any]:
    """Warm-up, the two bounds, then the measured run of `--train_seconds` (shorter if the
    run's budget is short); skipped once that budget cannot hold them."""
    choice, missing = choose_env(task_id, args.num_env_threads, args.env_source)
    # A stage that cannot fit a warm-up as long as the last stage's is not started: its
    # warm-up would be spent for nothing.
    missing = missing or _short_of_time(args, "at the start", args.last_warmup_s)
    if missing:
        return {"skipped": missing}
    loop = _training_loop(args, agent_name, choice)
    cfg = loop.config
    t0 = time.perf_counter()
    warm = loop.run(args.warmup_cycles * cfg.num_groups * cfg.envs_per_group
                    * cfg.steps_per_cycle)
    warmup_s = args.last_warmup_s = time.perf_counter() - t0
    late = _short_of_time(args, f"after a warm-up of {warmup_s:.0f} s")
    if late:
        return {"skipped": late}
    # The loop's groups stepped at once (vector envs: a thread each), before the run and
    # again after it: on a shared machine one measurement alone can be far off (on an
    # H200 machine the same envs gave 17.9k and 13.1k steps/s in one run's two stages).
    def envs_sps() -> float:
        return envs_alone(cfg, 10, args.seed, groups=cfg.async_factor,
                          seconds=args.bound_seconds)

    env_before = envs_sps()
    # Compiled by the warm-up: one update to start, then as many as fit in the seconds.
    learner_sps = learner_only(loop, 1, args.seed, seconds=args.bound_seconds,
                               state=warm.state, warmup_updates=1)
    train_s = max(1.0, min(args.train_seconds,
                           args.deadline - time.perf_counter() - args.bound_seconds - 10))
    result = _run_for(loop, train_s, warm.state)  # from where the warm-up ended
    env_after = after_error = None
    try:  # a failure here must not lose the run measured above
        env_after = envs_sps()
    except Exception as e:  # noqa: BLE001 - recorded with the stage
        after_error = f"{type(e).__name__}: {e}"
    env_sps = max(env_before, env_after or 0.0)  # the envs' best
    bound = min(env_sps, learner_sps)
    lags = result.policy_lags
    agent_cfg = loop.agent.config
    return {
        "agent": agent_name, "env": choice.env, "env_source": choice.source,
        "vectorization": cfg.vectorization,
        "num_env_threads": args.num_env_threads, "envs_per_group": cfg.envs_per_group,
        "async_factor": cfg.async_factor, "steps_per_cycle": cfg.steps_per_cycle,
        **({"num_epochs": agent_cfg.num_epochs, "num_minibatches": agent_cfg.num_minibatches}
           if agent_name == "ppo" else {}),
        "warmup_seconds": round(warmup_s, 1), "train_seconds": round(train_s, 1),
        "env_steps": result.env_steps, "consumed": result.consumed,
        "wall_seconds": round(result.wall_seconds, 2),
        "steps_per_second": round(result.steps_per_second, 1),
        # What the learner learnt from; steps still in flight at the end are left out.
        "consumed_steps_per_second": round(result.consumed_steps_per_second, 1),
        "learner_updates": result.learner_updates,
        "policy_lag_mean": round(sum(lags) / len(lags), 2) if lags else None,
        "stage_seconds": {k: round(v, 2) for k, v in sorted(result.stage_seconds.items())},
        "env_only": round(env_sps, 1),
        "env_only_before_after": [round(env_before, 1),
                                  None if env_after is None else round(env_after, 1)],
        **({"env_only_after_error": after_error} if after_error else {}),
        "learner_only": round(learner_sps, 1),
        "bound": round(bound, 1), "bounded_by": "env" if env_sps <= learner_sps else "learner",
        "ratio_to_bound": ratio(result.consumed_steps_per_second, bound),
    }


def _stage_functions() -> dict[str, Callable[[argparse.Namespace], dict[str, Any]]]:
    functions: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {
        "acting_latency": acting_latency, "acting_only": acting_only}
    for name, (agent_name, task_id) in TRAINING.items():
        functions[name] = lambda a, agent_name=agent_name, task_id=task_id: training(
            a, agent_name, task_id)
    return functions


# The table.

def _verdict(passed: bool, on_accelerator: bool) -> str:
    if not on_accelerator:
        return "n/a"
    return "pass" if passed else "FAIL"


def _latency_rows(rec: dict[str, Any], on_accelerator: bool) -> list[str]:
    rows = ["acting call latency (one group's envs, groups in turn: "
            f"{rec['num_groups']}; host -> device -> action on host)",
            f"  {'network':<11} {'envs':>5} {'median us':>10} {'p90 us':>10} "
            f"{'env steps/s':>12} {'recording':>10} {'inputs in':>10} {'newest':>10}  target"]
    for p in rec["points"]:
        target = LATENCY_TARGET_US[p["network"]]
        # The loop's call on an accelerator: frames restacked from the newest one.
        loops = p.get("newest_frame_median_us") or p["median_us"]
        check = ""
        if p["envs"] == LATENCY_TARGET_ENVS:
            check = f"<= {target:,.0f} us: {_verdict(loops <= target, on_accelerator)}"
        recording, resident, newest = (
            "" if p.get(k) is None else f"{p[k]:,.1f}"
            for k in ("record_on_device_median_us", "inputs_on_device_median_us",
                      "newest_frame_median_us"))
        rows.append(f"  {p['network']:<11} {p['envs']:>5} {p['median_us']:>10,.1f} "
                    f"{p['p90_us']:>10,.1f} {p['steps_per_second']:>12,.0f} "
                    f"{recording:>10} {resident:>10} {newest:>10}  {check}")
    rows += [f"  {net}: skipped ({why})" for net, why in rec.get("skipped_networks", {}).items()]
    return rows


def _acting_only_rows(rec: dict[str, Any], on_accelerator: bool) -> list[str]:
    target = rec["target_steps_per_second"]
    bare = rec.get("bare_loop")  # records written before it was measured lack it
    rows = [f"acting only: 5x200 SPG, {rec['env']}, sync, {rec['envs_per_group']} envs per "
            f"group; env-only {rec['env_only']:,.0f}, inference-only "
            f"{rec['inference_only']:,.0f}" + (f", bare loop {bare:,.0f}" if bare else "")
            + " steps/s",
            f"  {'async_factor':>12} {'steps/s':>10} {'to bound':>9} {'to bare':>8}  target"]
    for r in rec["runs"]:
        to_bare = r.get("ratio_to_bare_loop")
        rows.append(f"  {r['async_factor']:>12} {r['steps_per_second']:>10,.0f} "
                    f"{r['ratio_to_bound']:>9.3f} "
                    f"{'' if to_bare is None else format(to_bare, '.3f'):>8}  "
                    f">= {target:,} steps/s: "
                    f"{_verdict(r['steps_per_second'] >= target, on_accelerator)}")
    return rows


def _training_rows(stages: list[dict[str, Any]], on_accelerator: bool) -> list[str]:
    rows = ["training (consumed env steps/s beside its bounds: the envs alone, the learner "
            "alone)",
            f"  {'stage':<16} {'env steps/s':>11} {'consumed/s':>10} {'envs':>9} "
            f"{'learner':>9} {'to bound':>8}  envs from; target"]
    for rec in stages:
        check = ""
        if rec["stage"] == "breakout_ppo":
            sps, to_bound = rec["consumed_steps_per_second"], rec["ratio_to_bound"]
            check = (f">= {BREAKOUT_PPO_STEPS_PER_SECOND:,}/s: "
                     f"{_verdict(sps >= BREAKOUT_PPO_STEPS_PER_SECOND, on_accelerator)}, "
                     f">= {BREAKOUT_PPO_TO_BOUND} of bound: "
                     f"{_verdict(to_bound >= BREAKOUT_PPO_TO_BOUND, on_accelerator)}")
        rows.append(f"  {rec['stage']:<16} {rec['steps_per_second']:>11,.0f} "
                    f"{rec['consumed_steps_per_second']:>10,.0f} {rec['env_only']:>9,.0f} "
                    f"{rec['learner_only']:>9,.0f} {rec['ratio_to_bound']:>8.3f}  "
                    f"{rec.get('env_source', 'envpool')}; {check}")
    return rows


def table(records: list[dict[str, Any]], device: str, on_accelerator: bool,
          seconds: float) -> str:
    """The stage records as a human-readable table, targets beside the figures."""
    lines = [f"accelerator benchmark on {device}, {os.cpu_count()} CPU cores, "
             f"{seconds:.1f} s in all"]
    if not on_accelerator:
        lines.append("cpu: targets not applicable (they are for an H100 with 16 cores)")
    trained = []
    for rec in records:
        if "skipped" in rec or "error" in rec:
            why = rec.get("skipped") or rec.get("error")
            lines.append(f"{rec['stage']}: {'skipped' if 'skipped' in rec else 'error'}: {why}")
        elif rec["stage"] == "acting_latency":
            lines += _latency_rows(rec, on_accelerator)
        elif rec["stage"] == "acting_only":
            lines += _acting_only_rows(rec, on_accelerator)
        else:
            trained.append(rec)
    if trained:
        lines += _training_rows(trained, on_accelerator)
    return "\n".join(lines)


def _leftovers() -> dict[str, list[str]]:
    """Threads and child processes a stage left behind (there should be none)."""
    return {"leftover_threads": sorted(t.name for t in threading.enumerate()
                                       if t.name.startswith("sebulba-")),
            "child_processes": sorted(str(p.pid) for p in multiprocessing.active_children())}


def table_from(path: str) -> str:
    """`table` of a run's records, read from its `--out` file."""
    with open(path) as f:
        lines = [json.loads(line) for line in f if line.strip()]
    stages = [r for r in lines if r.get("record") == "stage"]
    end = next((r for r in lines if r.get("record") == "end"), None)
    head = next((r for r in lines if r.get("record") == "meta"), {})
    points = [{k: v for k, v in r.items() if k not in ("record", "time", "load")}
              for r in lines if r.get("record") == "latency_point"]
    if points and not any(r["stage"] == "acting_latency" for r in stages):  # cut in it
        stages.insert(0, {"stage": "acting_latency", "points": points,
                          "num_groups": head.get("args", {}).get("async_factor", "?")})
    if end is not None:
        return table(stages, f"{end['device']} ({end['device_kind']})",
                     end["targets_apply"], end["seconds"])
    device = (head.get("devices") or ["unknown"])[0]
    seconds = sum(r.get("elapsed_seconds", 0.0) for r in stages)
    return table(stages, f"{device} (cut short: stages after these not run)",
                 not device.startswith("cpu") and device != "unknown", seconds)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.table_from:
        print(table_from(args.table_from))
        return 0
    import jax

    started = time.perf_counter()
    with records_to(args.out) as record:
        record(meta("accelerator", vars(args)))
        device = jax.local_devices()[0]
        on_accelerator = device.platform != "cpu"
        functions = _stage_functions()
        records, failed = [], False
        args.deadline = started + args.max_seconds
        args.record, args.last_warmup_s = record, 0.0
        for name in args.stages:
            t0 = time.perf_counter()
            if t0 > args.deadline:
                rec = {"skipped": f"the run's budget of {args.max_seconds:.0f} s was spent"}
            else:
                try:
                    rec = functions[name](args)
                except Exception as e:  # noqa: BLE001 - report it, run the other stages
                    traceback.print_exc()
                    rec, failed = {"error": f"{type(e).__name__}: {e}"}, True
            rec = {"record": "stage", "stage": name, **rec,
                   "elapsed_seconds": round(time.perf_counter() - t0, 1)}
            records.append(rec)
            record(rec)
        seconds = time.perf_counter() - started
        record({"record": "end", "seconds": round(seconds, 1), "device": str(device),
                "device_kind": device.device_kind, "platform": device.platform,
                "targets_apply": on_accelerator, **_leftovers()})
        print(table(records, f"{device} ({device.device_kind})", on_accelerator,
                    seconds), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
