"""Several processes as one JAX cluster (multi-controller), following JAX's conventions.

Every process runs the whole Sebulba picture on its local devices; the learner's
compiled update spans the learner devices of all processes. Call `initialize` before
anything else touches JAX devices.
"""

from __future__ import annotations

import sys
import traceback

import jax
import numpy as np
from jax.experimental import multihost_utils

from sebulba.runtime.preemption import end_process_now


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    heartbeat_timeout_seconds: int = 100,
    initialization_timeout: int = 300,
) -> None:
    """Joins the cluster with `jax.distributed.initialize`.

    Arguments left None come from JAX's own detection (its environment variables or a
    cluster manager). On CPU, collectives between processes go over gloo. A peer that
    dies or stops answering ends the others within about `heartbeat_timeout_seconds`.
    """
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=coordinator_address,
        num_processes=num_processes,
        process_id=process_id,
        heartbeat_timeout_seconds=heartbeat_timeout_seconds,
        initialization_timeout=initialization_timeout,
    )


def end_failed_process(why: str, code: int = 1) -> None:
    """Ends a process of a multi-process run whose run failed (a peer died), at once:
    prints the error being handled (if any), ends its env workers and exits with `code`.

    Exiting normally would run JAX's exit hook, which waits in the cluster's shutdown
    barrier for every peer, the dead one too, until the heartbeat timeout, and then
    aborts the process. Call it after saving what must be saved.
    """
    if sys.exc_info()[0] is not None:
        traceback.print_exc()
    end_process_now(code, why)


def check_same_on_every_process(value: int, what: str) -> None:
    """ValueError naming each process's `value` unless all processes of the run passed the
    same (a collective: every process calls it): for choices each process makes on its
    own that must agree, such as the checkpoint step a run resumes from."""
    check_same(value_of_every_process(value), what)


def check_same(values: list[int], what: str) -> None:
    """ValueError naming each process's value unless `values` (by process index, as
    `value_of_every_process` gives them) are all the same."""
    if len(set(values)) > 1:
        raise ValueError(f"the processes disagree on {what}: " + ", ".join(
            f"process {i} {v}" for i, v in enumerate(values)))


def value_of_every_process(value: int) -> list[int]:
    """Each process's `value`, by process index (a collective: every process calls it);
    `[value]` in a single-process run, without one."""
    if jax.process_count() == 1:
        return [int(value)]
    return np.asarray(multihost_utils.process_allgather(
        np.asarray(value, np.int64))).reshape(-1).tolist()
