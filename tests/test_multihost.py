"""Several processes on 127.0.0.1 as one JAX cluster (gloo collectives on CPU)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from tests.test_failures import _alive

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(num_processes: int, mode: str, out_dir) -> list[subprocess.Popen]:
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    return [
        subprocess.Popen(
            [sys.executable, "-u", "-m", "tests.multihost_worker", str(port), str(num_processes),
             str(i), mode, str(out_dir)],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for i in range(num_processes)
    ]


def _finish(procs: list[subprocess.Popen], timeout: float) -> list[tuple[int, str]]:
    deadline = time.monotonic() + timeout
    results = []
    try:
        for p in procs:
            _, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            results.append((p.returncode, err))
    finally:
        for p in procs:
            p.kill()
            p.wait()
    return results


@pytest.mark.parametrize("num_processes", [2, 3])
@pytest.mark.timeout(240)
def test_processes_learn_as_one(num_processes, tmp_path):
    results = _finish(_start(num_processes, "counting", tmp_path), timeout=200)
    for rc, err in results:
        assert rc == 0, err[-3000:]
    outs = [json.loads((tmp_path / f"process{i}.json").read_text()) for i in range(num_processes)]
    # Bit-identical networks in every process after every update. The agent's gradient
    # depends on each process's own data, so this holds only if gradients are averaged
    # over the learner devices of all processes.
    per_iteration = num_processes * 4 * 3  # one 4-env, 3-step trajectory per process
    assert len(outs[0]["nets"]) == -(-2 * 20 * 4 * 3 // per_iteration)
    assert all(o["nets"] == outs[0]["nets"] for o in outs)
    # Each process's learner devices got that process's envs (4 envs x 2 groups), split
    # over its two learner devices; together they are every env of the run.
    all_ids = []
    for i, o in enumerate(outs):
        mine = set(range(8 * i, 8 * (i + 1)))
        for ids in o["ids_per_local_learner"]:
            assert set(ids) <= mine and len(ids) == 4
        all_ids += [x for ids in o["ids_per_local_learner"] for x in ids]
        r = o["result"]
        assert r["num_processes"] == num_processes
        assert r["global_consumed"] == r["consumed"] * num_processes >= 2 * 20 * 4 * 3
    assert sorted(all_ids) == list(range(8 * num_processes))


@pytest.mark.parametrize("how", ["killed", "hung"])
@pytest.mark.timeout(180)
def test_a_failed_peer_ends_the_others(how, tmp_path):
    procs = _start(2, "hang", tmp_path)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # wait until both are learning together
            line = procs[1].stdout.readline()
            if "updating" in line or not line:
                break
        assert "updating" in line, procs[1].communicate(timeout=10)[1][-3000:]
        os.kill(procs[1].pid, signal.SIGKILL if how == "killed" else signal.SIGSTOP)
        start = time.monotonic()
        _, err = procs[0].communicate(timeout=60)
        elapsed = time.monotonic() - start
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert procs[0].returncode != 0
    assert elapsed < 40  # heartbeat_timeout_seconds=10 in the worker, plus shutdown
    assert ("peer process probably died" in err
            or "JAX distributed service detected fatal errors" in err), err[-3000:]
    pids = [int(p.stem) for p in tmp_path.glob("*.pid")]
    assert len(pids) >= 8  # 2 processes x 2 groups x 4 async workers
    deadline = time.monotonic() + 15
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in pids if _alive(p)]
