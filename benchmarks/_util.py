"""What the benchmarks share: JSON records, the two bounds and one measured Sebulba run.

JAX, sebulba and agents are imported inside the functions: "async" vectorization spawns
worker processes that import the benchmark's main module, and they should start fast.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any


def acting_agent(env_spec, hidden_sizes: Sequence[int]):
    """The acting benchmarks' agent: SPG without reward normalization, whose acting call
    outputs the action and its log-probability, the workload their figures have been
    measured on since the first (normalization adds the discounted return, one more
    output to record)."""
    from agents.spg import SPG, SPGConfig

    return SPG(env_spec, SPGConfig(hidden_sizes=tuple(hidden_sizes), normalize_rewards="off"))


def load() -> list[float]:
    """The 1, 5 and 15 minute load averages: other processes skew the figures."""
    return [round(x, 2) for x in os.getloadavg()]


def emit(record: dict[str, Any]) -> dict[str, Any]:
    """Prints one JSON line, stamped with the time (UTC) and the load average; returns
    the stamped record (e.g. to write it to a file too)."""
    now = datetime.datetime.now(datetime.UTC).strftime("%H:%M:%S")
    stamped = {**record, "time": now, "load": load()}
    print(json.dumps(stamped), flush=True)
    return stamped


@contextlib.contextmanager
def records_to(path: str | None) -> Iterator[Callable[[dict[str, Any]], None]]:
    """A function that `emit`s a record and, with `path` (a benchmark's `--out`), also
    appends the stamped record to that file as a JSON line, flushed at once (a run cut
    short keeps what it measured). The file is closed on leaving."""
    out = open(path, "w") if path else None  # noqa: SIM115 - closed below

    def record(rec: dict[str, Any]) -> None:
        stamped = emit(rec)
        if out is not None:
            out.write(json.dumps(stamped) + "\n")
            out.flush()

    try:
        yield record
    finally:
        if out is not None:
            out.close()


def meta(benchmark: str, args: dict[str, Any]) -> dict[str, Any]:
    """The first record of every benchmark: what ran, where and when."""
    import gymnasium
    import jax

    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        cpu = next((line.split(":", 1)[1].strip() for line in lscpu.splitlines()
                    if line.startswith("Model name:")), "unknown")
    except OSError:
        cpu = platform.processor() or "unknown"
    return {
        "record": "meta", "benchmark": benchmark,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "cpu": cpu, "cpu_count": os.cpu_count(), "python": platform.python_version(),
        "jax": jax.__version__, "gymnasium": gymnasium.__version__,
        "devices": [str(d) for d in jax.devices()], "argv": sys.argv[1:], "args": args,
    }


def random_env_step(spec, num_envs: int, seed: int):
    """An EnvStep of `num_envs` envs of `spec` (sebulba.EnvSpec) with random observations
    (uniform bytes for frames, standard normal otherwise): an acting call's input
    without an env."""
    import numpy as np

    from sebulba.envs import example_env_step

    rng = np.random.default_rng(seed)
    template = example_env_step(spec, num_envs)
    obs = template.obs
    obs = (rng.integers(0, 256, obs.shape).astype(obs.dtype) if obs.dtype == np.uint8
           else rng.standard_normal(obs.shape).astype(obs.dtype))
    return template._replace(obs=obs)


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def str_list(text: str) -> list[str]:
    return [x for x in text.split(",") if x]


def median(values: Sequence[float], digits: int = 1) -> float:
    return round(float(statistics.median(values)), digits)


def ratio(a: float, b: float) -> float:
    return round(a / b, 3)


def env_only(make_vec: Callable[[], Any], vector_steps: int, seed: int,
             groups: int = 1, seconds: float = 0.0) -> float:
    """Steps/second of bare vector envs on uniformly random actions (drawn up front):
    `groups` of them, each stepped by its own thread at once (what double buffering's
    env groups can do together on this machine, with no inference at all), each at least
    `vector_steps` steps and `seconds` (after 10 steps that warm it up)."""
    import concurrent.futures

    import numpy as np

    vecs = []
    try:
        for _ in range(groups):
            vecs.append(make_vec())
        rng = np.random.default_rng(seed)
        actions = [random_actions(v.single_action_space, rng, (vector_steps + 10, v.num_envs))
                   for v in vecs]
        for i, vec in enumerate(vecs):
            vec.reset(seed=seed + i)
            for a in actions[i][:10]:  # async workers finish starting up
                vec.step(a)

        def steps(vec, a, t0: float) -> int:
            n = 0
            while n < vector_steps or time.perf_counter() - t0 < seconds:
                vec.step(a[10 + n % vector_steps])
                n += 1
            return n

        with concurrent.futures.ThreadPoolExecutor(groups) as pool:
            t0 = time.perf_counter()
            # .result() re-raises an env's error
            done = [pool.submit(steps, v, a, t0) for v, a in zip(vecs, actions, strict=True)]
            counts = [d.result() for d in done]
            elapsed = time.perf_counter() - t0
    finally:
        for vec in vecs:
            vec.close()
    return sum(v.num_envs * n for v, n in zip(vecs, counts, strict=True)) / elapsed


def random_actions(space, rng, shape: tuple[int, ...]):
    """Uniformly random actions of a Discrete or bounded Box space, leaves `shape` + the
    space's own: drawn up front, so that drawing costs the timed loop nothing."""
    import gymnasium as gym
    import numpy as np

    if isinstance(space, gym.spaces.Discrete):
        return (space.start + rng.integers(0, space.n, size=shape)).astype(np.int32)
    if isinstance(space, gym.spaces.Box) and space.is_bounded():
        return rng.uniform(space.low, space.high, size=shape + space.shape).astype(space.dtype)
    raise ValueError(f"random actions need a Discrete or bounded Box space, got {space}")


def envpool_only(task_id: str, group_size: int, num_groups: int, batches: int,
                 seed: int, env_kwargs: dict[str, Any] | None = None,
                 seconds: float = 0.0) -> float:
    """Steps/second of a bare EnvPool of num_groups x group_size envs, batch group_size:
    recv, then send random actions for the envs it returned, over and over; at least
    `batches` batches and `seconds` (after 10 batches that warm it up). `env_kwargs` go
    to the pool (e.g. EnvPool's `num_threads`)."""
    import numpy as np

    from sebulba.envs.envpool_source import make_pool

    pool = make_pool(task_id, num_groups * group_size, group_size, seed, env_kwargs)
    try:
        actions = random_actions(pool.action_space, np.random.default_rng(seed),
                                 (batches + 10, group_size))
        pool.async_reset()
        i, t0 = 0, time.perf_counter()  # t0 again after the warm-up
        while i < batches + 10 or time.perf_counter() - t0 < seconds:
            if i == 10:
                t0 = time.perf_counter()
            pool.send(actions[i % len(actions)], pool.recv()[4]["env_id"])
            i += 1
        seconds = time.perf_counter() - t0
    finally:
        pool.close()
    return group_size * (i - 10) / seconds


def envs_alone(config, vector_steps: int, seed: int, *, groups: int = 1,
               seconds: float = 0.0) -> float:
    """Steps/second of `config`'s envs alone (`sebulba.Config`: env, vectorization,
    env_kwargs, envs per group), on random actions: an EnvPool kind's one pool of its
    async_factor groups, pipelined (`envpool_only`); any other kind's vector env of a group,
    `groups` of them stepped at once (`env_only`). At least `vector_steps` per group and
    `seconds`."""
    if config.vectorization in ("envpool", "envpool_async"):
        return envpool_only(config.env, config.envs_per_group, config.async_factor,
                            vector_steps * config.async_factor, seed,
                            dict(config.env_kwargs), seconds=seconds)
    from sebulba.envs.gymnasium_source import make_vector_env

    return env_only(lambda: make_vector_env(config.env, config.envs_per_group,
                                            config.vectorization, config.env_kwargs),
                    vector_steps, seed, groups=groups, seconds=seconds)


def _poll_seconds(poll_s: float | None) -> float:
    """How the calibrations below fetch an action: as the loop does by default, polling
    for it before sleeping on it (`Config.action_poll_seconds`; a sleeping thread wakes
    late). None is the loop's default poll; async vectorization's loop does not poll, so
    its calibrations take 0."""
    from sebulba.config import DEFAULT_ACTION_POLL_S

    return DEFAULT_ACTION_POLL_S if poll_s is None else poll_s


def inference_only(agent, num_envs: int, calls: int, seed: int,
                   poll_s: float | None = None) -> float:
    """Steps/second of `jax.jit(agent.step)` on `num_envs` host observations with the
    action fetched to the host, one call after the other (the framework's work per
    step at the least: it also records the step in the trajectory)."""
    import jax

    import sebulba
    from sebulba.envs import example_env_step
    from sebulba.runtime.inferencer import fetch_polling

    poll_s = _poll_seconds(poll_s)

    key = jax.random.key(seed)
    nets = agent.new_networks(key)
    layout = sebulba.Layout(envs_per_group=num_envs, num_groups=1, steps_per_cycle=1,
                            num_learner_devices=1)
    step_state = agent.new_state(nets, key, layout).step_state
    env_step = example_env_step(agent.env_spec, num_envs)
    step = jax.jit(agent.step)

    def steps(n: int, step_state):
        for _ in range(n):
            out, step_state = step(step_state, nets, env_step)
            fetch_polling(out.action, poll_s)
        return step_state

    step_state = steps(10, step_state)  # compiled and warm
    t0 = time.perf_counter()
    steps(calls, step_state)
    return num_envs * calls / (time.perf_counter() - t0)


def learner_only(loop, updates: int, seed: int = 0, seconds: float = 0.0,
                 state=None, warmup_updates: int = 3) -> float:
    """Env steps/second the loop's learner consumes alone: `updates` learner updates (more
    if `seconds` have not passed by then), each on `trajectories_per_update` copies of
    one zero trajectory of the loop's shapes, with no acting. The learner's work is dense
    (convolutions, matmuls, scans), so its cost does not depend on the values; each
    update waits for the previous one, as in a run. It learns from `state` (an
    AgentState; copied, not changed), by default `loop.initial_state()`, after
    `warmup_updates` that compile (unless the loop has run) and warm it up."""
    import jax

    import sebulba
    from sebulba.runtime import sharding
    from sebulba.runtime.channels import QueueItem

    cfg, agent, devices = loop.config, loop.agent, loop.learner_devices
    state = loop.initial_state() if state is None else state
    size, steps = cfg.envs_per_group, cfg.steps_per_cycle
    step_state = agent.shard_step_state(
        agent.new_step_state(state.nets, jax.random.key(seed), size), devices)
    trajectory = sharding.shard_env_axis(
        sebulba.zeros_trajectory(agent, state.nets, size, steps), devices)
    item = QueueItem(0, 0, step_state, step_state, trajectory, size * steps)
    items = [item] * cfg.trajectories_per_update
    learner = loop.learner
    learner.start(sharding.replicate(state.nets, devices), sharding.replicate(state.opt, devices),
                  sharding.replicate(state.experience, devices))
    for _ in range(warmup_updates):
        learner.update(items)
    learner.finish()
    t0 = time.perf_counter()
    done = 0
    while done < updates or time.perf_counter() - t0 < seconds:
        learner.update(items)  # waits for the update before the last: few are queued
        done += 1
    learner.finish()
    jax.block_until_ready(learner.nets)
    return done * len(items) * size * steps / (time.perf_counter() - t0)


def bare_loop(agent, make_vec: Callable[[], Any], vector_steps: int, seed: int,
              poll_s: float | None = None) -> float:
    """Steps/second of the least a loop must do, with no framework: step the vector env,
    one jitted `agent.step` on its output, fetch the action, repeat. No trajectory, no
    episode accounting, no queue: a calibration for what the machine allows."""
    import jax
    import numpy as np

    import sebulba
    from sebulba.runtime.inferencer import fetch_polling

    poll_s = _poll_seconds(poll_s)

    vec = make_vec()
    try:
        key = jax.random.key(seed)
        nets = agent.new_networks(key)
        step_state = agent.new_step_state(nets, key, vec.num_envs)
        step = jax.jit(agent.step, donate_argnums=0)
        obs, _ = vec.reset(seed=seed)
        flags = np.zeros(vec.num_envs, bool)
        env_step = sebulba.EnvStep(obs, np.zeros(vec.num_envs, np.float32), flags, flags,
                                   flags)

        def steps(n: int, step_state, env_step):
            for _ in range(n):
                out, step_state = step(step_state, nets, env_step)
                action = fetch_polling(out.action, poll_s)
                obs, reward, terminated, truncated, _ = vec.step(action)
                env_step = sebulba.EnvStep(obs, reward.astype(np.float32), terminated,
                                           truncated, flags)
            return step_state, env_step

        step_state, env_step = steps(10, step_state, env_step)  # compiled and warm
        t0 = time.perf_counter()
        steps(vector_steps, step_state, env_step)
        return vec.num_envs * vector_steps / (time.perf_counter() - t0)
    finally:
        vec.close()


def bare_pool_loop(agent, task_id: str, group_size: int, num_groups: int, batches: int,
                   seed: int, poll_s: float | None = None) -> float:
    """`bare_loop` for an EnvPool of num_groups x group_size envs, batch group_size. With
    several groups one batch is held back while the next one's inference runs (as the
    loop pipelines): recv, dispatch the jitted step, fetch the previous batch's actions
    and send them; with one group there is nothing to overlap with."""
    import jax
    import numpy as np

    import sebulba
    from sebulba.envs.envpool_source import make_pool
    from sebulba.runtime.inferencer import fetch_polling

    poll_s = _poll_seconds(poll_s)

    pool = make_pool(task_id, num_groups * group_size, group_size, seed)
    try:
        key = jax.random.key(seed)
        nets = agent.new_networks(key)
        step_state = agent.new_step_state(nets, key, group_size)
        step = jax.jit(agent.step, donate_argnums=0)
        flags = np.zeros(group_size, bool)
        pool.async_reset()
        pending = None
        for i in range(batches + 10):
            if i == 10:
                t0 = time.perf_counter()
            obs, reward, terminated, truncated, info = pool.recv()
            out, step_state = step(step_state, nets, sebulba.EnvStep(
                obs, reward.astype(np.float32), terminated, truncated, flags))
            if pending is not None:
                pool.send(fetch_polling(pending[0].action, poll_s), pending[1])
            pending = (out, info["env_id"])
            if num_groups == 1:
                pool.send(fetch_polling(out.action, poll_s), info["env_id"])
                pending = None
        return group_size * batches / (time.perf_counter() - t0)
    finally:
        pool.close()


def measure(loop, cycles: int) -> dict[str, Any]:
    """One acting-only run (`learn=False`) of `cycles` inference cycles per env group.

    `loop` keeps its compiled functions between runs, so warm it up with one run first.
    Stage times are summed over the inferencer threads and given per vector env step
    of one group, to compare with the bounds. `process_cpu_cores` is this process's CPU
    time over the run's wall time: with as many as the machine has, the run is CPU-bound
    and only less work per step makes it faster.
    """
    import resource

    cfg = loop.config
    rows = loop.rows_per_group  # envs, or envs x agents of a multi-agent env
    cpu0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    result = loop.run(cycles * cfg.steps_per_cycle * rows * cfg.num_groups, learn=False)
    cpu1, t1 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    cpu_seconds = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
    vector_steps = result.env_steps / rows
    return {
        "vectorization": cfg.vectorization, "async_factor": cfg.async_factor,
        "envs_per_group": cfg.envs_per_group, "steps_per_cycle": cfg.steps_per_cycle,
        "steps_per_second": round(result.steps_per_second, 1),
        "env_steps": result.env_steps, "wall_seconds": round(result.wall_seconds, 3),
        # Cores this process kept busy (all its threads: the loop's, XLA's, EnvPool's;
        # not env worker processes), of os.cpu_count(): near it, the run is CPU-bound.
        "process_cpu_cores": round(cpu_seconds / (t1 - t0), 2),
        "us_per_vector_step": {k: round(1e6 * v / vector_steps, 1)
                               for k, v in sorted(result.stage_seconds.items())},
    }
