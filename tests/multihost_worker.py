"""One process of a multi-process Sebulba run on this machine (used by test_multihost.py
and test_device_invariance.py).

    python -m tests.multihost_worker PORT NUM_PROCESSES PROCESS_ID MODE OUT_DIR [ARGS...]

MODE "agree" checks `distributed.check_same_on_every_process` (process i passes 100 + i).
MODE "ppo" takes ARGS ENVS_PER_GROUP NUM_LEARNER_DEVICES TOTAL_ENV_STEPS SEED; with
NUM_PROCESSES 1 it is a plain single-process run (no jax.distributed), the reference a
cluster is compared with. MODE "statistics" runs PPO on Pendulum-v1 (Box actions: the
networks keep observation and return moments) and reports them. MODE "stop" is "counting"
with no step limit, process 1 setting its `stop` event after its third update; MODE
"stall" has process 1 sleep forever after it instead (its learner watchdog: 5 s). MODE
"lockstep_spg" takes ARGS STEP_STATE_NPZ: tests/lockstep_spg.py's run with the envs split
over the processes (one learner device each) and SPG's means over the whole batch, twice:
from the loop's own initial state (processID_own.npz: the networks), then with each
process's envs given their rows of the one-process step state saved in STEP_STATE_NPZ
(processID_sliced.npz).
"""

from __future__ import annotations

import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
os.environ["JAX_PLATFORMS"] = "cpu"

import functools  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import sebulba  # noqa: E402
from agents.ppo import PPO, PPOConfig  # noqa: E402
from sebulba.runtime import distributed  # noqa: E402
from tests import lockstep_spg as spg  # noqa: E402
from tests.counting_agent import CountingAgent  # noqa: E402
from tests.envs import CountingEnv, PidRecordingEnv  # noqa: E402


class DataDependentCounting(CountingAgent):
    """Its gradient depends on the data: nets agree across processes only if gradients
    are averaged over every process's learner devices."""

    def loss(self, nets, opt, experience):
        i = jnp.maximum(experience.size - 1, 0)
        target = jnp.mean(experience.obs[i, :, :, 0])  # env ids of the latest trajectory
        return jnp.square(nets["w"] - target), (experience, {"w": nets["w"]})


def train_ppo(envs_per_group: int, num_learners: int, total_env_steps: int, seed: int) -> dict:
    """PPO on CartPole-v1 with test_ppo_learning's settings except envs and learner devices."""
    config = sebulba.Config(env="CartPole-v1", envs_per_group=envs_per_group, steps_per_cycle=32,
                            async_factor=2, vectorization="sync", inference_devices=[0],
                            learner_devices=list(range(num_learners)), seed=seed)
    result = sebulba.Sebulba(PPO(sebulba.env_spec(config.env), PPOConfig()), config).run(
        total_env_steps)
    nets = b"".join(np.asarray(x).tobytes() for x in jax.tree.leaves(result.state.nets))
    return {"result": {k: v for k, v in result.as_dict().items() if k != "metrics"},
            "episodes": result.episodes,
            "accounted": result.env_steps == result.consumed + result.dropped + result.in_flight,
            "nets_sha256": hashlib.sha256(nets).hexdigest()}


def train_with_statistics(total_env_steps: int) -> dict:
    """PPO on Pendulum-v1 with the statistics its networks keep; one learner device and one
    inference device per process (so each process's actors get their own learner's copy)."""
    from agents.common import normalization

    config = sebulba.Config(env="Pendulum-v1", envs_per_group=4, steps_per_cycle=16,
                            async_factor=1, vectorization="sync", inference_devices=[0],
                            learner_devices=[1], seed=0)
    agent = PPO(sebulba.env_spec(config.env), PPOConfig(num_minibatches=2))
    published = []
    result = sebulba.Sebulba(agent, config).run(
        total_env_steps, on_update=lambda info: published.append(info.nets))
    stats = result.state.nets[normalization.COLLECTION]
    last = published[-1][normalization.COLLECTION]  # what this process's actors got last
    return {"consumed": result.consumed, "global_consumed": result.global_consumed,
            "reward_count": float(stats["reward"]["count"]),
            "statistics": jax.tree.map(lambda x: np.asarray(x).tolist(), stats),
            "published_equal_learner": all(jax.tree.leaves(jax.tree.map(
                lambda a, b: bool(np.array_equal(a, b)), last, stats)))}


def train_lockstep_spg(num_processes: int, process_id: int, step_state_npz: str,
                       out: str) -> None:
    """Mode "lockstep_spg" (see the module docstring)."""
    envs = spg.ENVS // num_processes
    loop = spg.make_loop(envs, 1)
    spg.save(out + "_own.npz", spg.run(loop).state.nets)
    mine = spg.envs_slice(loop.initial_state().step_state, spg.load(step_state_npz),
                          process_id * envs)
    spg.save(out + "_sliced.npz", spg.run(loop, mine).state.nets)


def main(port: str, num_processes: str, process_id: str, mode: str, out_dir: str,
         *args: str) -> None:
    out = os.path.join(out_dir, f"process{process_id}")
    if mode == "lockstep_spg":
        distributed.initialize(f"127.0.0.1:{port}", int(num_processes), int(process_id),
                               heartbeat_timeout_seconds=30)
        train_lockstep_spg(int(num_processes), int(process_id), args[0], out)
        return
    if mode == "statistics":
        distributed.initialize(f"127.0.0.1:{port}", int(num_processes), int(process_id),
                               heartbeat_timeout_seconds=30)
        with open(out + ".json", "w") as f:
            json.dump(train_with_statistics(int(args[0])), f)
        return
    if mode == "ppo":
        if int(num_processes) > 1:
            distributed.initialize(f"127.0.0.1:{port}", int(num_processes), int(process_id),
                                   heartbeat_timeout_seconds=30)
        report = train_ppo(*(int(a) for a in args))
        with open(out + ".json", "w") as f:
            json.dump(report, f)
        return
    distributed.initialize(f"127.0.0.1:{port}", int(num_processes), int(process_id),
                           heartbeat_timeout_seconds=10)
    if mode == "agree":  # the same value, then one value per process
        distributed.check_same_on_every_process(100, "a value")
        try:
            distributed.check_same_on_every_process(100 + int(process_id), "the step")
            error = None
        except ValueError as e:
            error = str(e)
        with open(out + ".json", "w") as f:
            json.dump({"error": error}, f)
        return
    if mode in ("counting", "hang", "stop", "stall"):
        if mode == "hang":  # async workers that record their pids, to check they end
            env = functools.partial(PidRecordingEnv, out_dir)
            vectorization = "async"
        else:
            env = functools.partial(CountingEnv, 5)
            vectorization = "sync"
        cfg = sebulba.Config(env=env, envs_per_group=4, steps_per_cycle=3, async_factor=2,
                             inference_devices=[0], learner_devices=[0, 1],
                             vectorization=vectorization)
        loop = sebulba.Sebulba(DataDependentCounting(sebulba.env_spec(env)), cfg)
        nets_log = []
        total = 10**12 if mode in ("hang", "stop", "stall") else 2 * 20 * 4 * 3
        stop = threading.Event()

        def record(info):
            nets_log.append(np.asarray(info.nets["w"]).tobytes().hex())
            if mode == "hang" and len(nets_log) == 5:
                print("updating", flush=True)
            if mode == "stop" and int(process_id) == 1 and len(nets_log) == 3:
                stop.set()  # as a SIGTERM handler would, in this process only
            if mode == "stall" and int(process_id) == 1 and len(nets_log) == 3:
                print("stalling", flush=True)
                time.sleep(10**6)  # stuck in Python: JAX's heartbeats go on

        result = loop.run(total, on_update=record, stop=stop,
                          progress_timeout_s=5.0 if mode == "stall" else 600.0)
        log = result.learner_experience
        local = [np.asarray(s.data) for s in sorted(log.obs.addressable_shards,
                                                    key=lambda s: s.index[0].start)]
        sizes = [int(np.asarray(s.data)[0]) for s in sorted(log.size.addressable_shards,
                                                           key=lambda s: s.index[0].start)]
        ids = [sorted({int(x) for x in obs[0, :size, :, :, 0].ravel()})
               for obs, size in zip(local, sizes, strict=True)]
        with open(out + ".json", "w") as f:
            json.dump({"nets": nets_log, "ids_per_local_learner": ids,
                       "result": result.as_dict(), "devices": str(jax.devices())}, f)
    else:
        raise ValueError(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main(*sys.argv[1:])
