"""The memory a run's layout needs, estimated before anything is allocated.

A layout that cannot fit (ten million envs per group, a replay of a billion frames)
would otherwise start its envs, allocate for a minute and end in the kernel's OOM
killer, or swap so hard that it cannot stop within a preemption's grace. The estimate
is the lower bound of what the run allocates, from the shapes the agent declares
(traced with `jax.eval_shape`, so nothing is allocated to find them):

- trajectories: one being recorded on the host per env group (a source driven by env
  id, "envpool_async", holds up to 3 of a group open while its envs drift apart, more
  while they cannot wait, and StepState snapshots beside them: not counted), and the
  queue's items
  (plus the K an update takes, with their initial and final step states, and their
  join's copy where K > 1) on the learner devices;
- step states: every env's, on the inference devices, and the learner's copy of the
  step states it consumed up to (the cut a checkpoint saves);
- networks on every device, optimizer state and experience (a replay) on every
  learner device.

On a CPU platform every part is host memory and is compared with the memory available
(`MemAvailable`); on an accelerator each device's parts are compared with what its
allocator can still give (`Device.memory_stats`), where the platform reports it.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence

import jax
import numpy as np

from sebulba.agent import Agent, Layout
from sebulba.envs.base import example_env_step
from sebulba.types import PyTree


def tree_bytes(tree: PyTree) -> int:
    """Bytes of the arrays (or shape-dtype structs) of `tree`."""
    return sum(int(np.prod(x.shape)) * x.dtype.itemsize  # PRNG key dtypes have one too
               for x in jax.tree.leaves(tree))


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Bytes a run needs, by part, where they live.

    Attributes:
      host: part -> bytes in host memory (every part, on a CPU platform).
      per_device: device -> part -> bytes on that accelerator.
    """

    host: dict[str, int]
    per_device: dict[jax.Device, dict[str, int]]

    @property
    def host_total(self) -> int:
        return sum(self.host.values())


def estimate(agent: Agent, layout: Layout, inference_devices: Sequence[jax.Device],
             learner_devices: Sequence[jax.Device], queue_capacity: int) -> MemoryEstimate:
    """The memory of a run of `agent` on this process's devices (`learner_devices`: the
    local ones)."""
    key = jax.random.key(0)
    nets = jax.eval_shape(agent.new_networks, key)
    rows, steps = layout.envs_per_group, layout.steps_per_cycle
    step_state = jax.eval_shape(lambda n, k: agent.new_step_state(n, k, rows), nets, key)
    env_step = example_env_step(agent.env_spec, rows)
    acting = jax.eval_shape(agent.acting_nets, nets, jax.ShapeDtypeStruct((), np.int32))
    actor_output, _ = jax.eval_shape(agent.step, step_state, acting, env_step)
    trajectory = (tree_bytes(env_step) * (steps + 1) + tree_bytes(actor_output) * steps)
    learners, inferers = len(learner_devices), len(inference_devices)
    k = layout.trajectories_per_update
    on_learners = {  # over all learner devices
        "queued trajectories": trajectory * (queue_capacity + k),
        "queued step states": 2 * tree_bytes(step_state) * (queue_capacity + k),
        # an update joins its K items along the env axis: a second copy while it runs
        **({"joined trajectories": (trajectory + 2 * tree_bytes(step_state)) * k}
           if k > 1 else {}),
        "networks (learner)": tree_bytes(nets) * learners,
        "optimizer state": tree_bytes(jax.eval_shape(agent.new_opt_state, nets, key)) * learners,
        "experience": tree_bytes(jax.eval_shape(
            lambda n, k: agent.new_experience_state(n, k, layout), nets, key)) * learners,
    }
    on_inferers = {  # over all inference devices
        "step states": tree_bytes(step_state) * layout.num_groups * 2,
        "networks (inference)": tree_bytes(acting) * inferers,
    }
    host = {"recorded trajectories": trajectory * layout.num_groups}
    per_device: dict[jax.Device, dict[str, int]] = {}
    for devices, parts in ((learner_devices, on_learners), (inference_devices, on_inferers)):
        if all(d.platform == "cpu" for d in devices):
            for part, size in parts.items():
                host[part] = host.get(part, 0) + size
        else:
            for d in devices:
                for part, size in parts.items():
                    entry = per_device.setdefault(d, {})
                    entry[part] = entry.get(part, 0) + size // len(devices)
    return MemoryEstimate(host, per_device)


def available_host_bytes() -> int | None:
    """Memory the kernel can give this process now without swapping (`MemAvailable`),
    or None where /proc/meminfo does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return None


def available_device_bytes(device: jax.Device) -> int | None:
    """What `device`'s allocator can still give, or None where the platform says not."""
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001 - platforms without the call raise various errors
        return None
    if not stats or "bytes_limit" not in stats:
        return None
    return stats["bytes_limit"] - stats.get("bytes_in_use", 0)


def human_bytes(size: float) -> str:
    """`size` bytes in B, KiB, MiB, GiB or TiB, three significant digits."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024:
            return f"{size:.3g} {unit}"
        size /= 1024
    return f"{size:,.0f} TiB"


def _listing(parts: dict[str, int]) -> str:
    return ", ".join(f"{part} {human_bytes(size)}"
                     for part, size in sorted(parts.items(), key=lambda p: -p[1]) if size)


def check_fits(need: MemoryEstimate, what: str) -> None:
    """Raises a ValueError naming the estimate, its parts and the memory available when
    `need` cannot fit; `what` names the layout in the message."""
    host = available_host_bytes()
    if host is not None and need.host_total > host:
        raise ValueError(
            f"{what} needs about {human_bytes(need.host_total)} of host memory "
            f"({_listing(need.host)}), more than the {human_bytes(host)} available: use "
            "fewer envs per group, shorter cycles or a smaller replay")
    for device, parts in need.per_device.items():
        free = available_device_bytes(device)
        if free is not None and sum(parts.values()) > free:
            raise ValueError(
                f"{what} needs about {human_bytes(sum(parts.values()))} on {device} "
                f"({_listing(parts)}), more than the {human_bytes(free)} it has free: use "
                "fewer envs per group, shorter cycles or a smaller replay")
