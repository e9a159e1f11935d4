"""One process of a multi-process Sebulba run on this machine (used by test_multihost.py).

    python -m tests.multihost_worker PORT NUM_PROCESSES PROCESS_ID MODE OUT_DIR
"""

from __future__ import annotations

import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
os.environ["JAX_PLATFORMS"] = "cpu"

import functools  # noqa: E402
import json  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import sebulba  # noqa: E402
from sebulba import distributed  # noqa: E402
from tests.counting_agent import CountingAgent  # noqa: E402
from tests.envs import CountingEnv, PidRecordingEnv  # noqa: E402


class DataDependentCounting(CountingAgent):
    """Its gradient depends on the data: nets agree across processes only if gradients
    are averaged over every process's learner devices."""

    def loss(self, nets, opt, experience):
        i = jnp.maximum(experience.size - 1, 0)
        target = jnp.mean(experience.obs[i, :, :, 0])  # env ids of the latest trajectory
        return jnp.square(nets["w"] - target), (experience, {"w": nets["w"]})


def main(port: str, num_processes: str, process_id: str, mode: str, out_dir: str) -> None:
    distributed.initialize(f"127.0.0.1:{port}", int(num_processes), int(process_id),
                           heartbeat_timeout_seconds=10)
    out = os.path.join(out_dir, f"process{process_id}")
    if mode in ("counting", "hang"):
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
        total = 10**12 if mode == "hang" else 2 * 20 * 4 * 3

        def record(info):
            nets_log.append(np.asarray(info.nets["w"]).tobytes().hex())
            if mode == "hang" and len(nets_log) == 5:
                print("updating", flush=True)

        result = loop.run(total, on_update=record)
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
