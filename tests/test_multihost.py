"""Several processes on 127.0.0.1 as one JAX cluster (gloo collectives on CPU)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from sebulba.runtime.watchdog import EXIT_CODE, describe_progress
from tests.test_failures import _alive

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(num_processes: int, mode: str, out_dir, *args: object) -> list[subprocess.Popen]:
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    return [
        subprocess.Popen(
            [sys.executable, "-u", "-m", "tests.multihost_worker", str(port), str(num_processes),
             str(i), mode, str(out_dir), *map(str, args)],
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


@pytest.mark.timeout(120)
def test_a_choice_the_processes_must_share_is_checked_across_them(tmp_path, no_leftovers):
    """E.g. the checkpoint step a run resumes from, which each process picks on its own."""
    results = _finish(_start(2, "agree", tmp_path), timeout=100)
    for rc, err in results:
        assert rc == 0, err[-3000:]
    for i in range(2):
        with open(tmp_path / f"process{i}.json") as f:
            assert json.load(f)["error"] == ("the processes disagree on the step: process 0 "
                                             "100, process 1 101")


@pytest.mark.parametrize("num_processes", [2, 3])
@pytest.mark.timeout(240)
def test_processes_learn_as_one(num_processes, tmp_path, no_leftovers):
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


@pytest.mark.timeout(240)
def test_a_stop_in_one_process_ends_every_process_after_the_same_update(tmp_path,
                                                                       no_leftovers):
    results = _finish(_start(2, "stop", tmp_path), timeout=200)
    for rc, err in results:
        assert rc == 0, err[-3000:]
    outs = [json.loads((tmp_path / f"process{i}.json").read_text()) for i in range(2)]
    # Process 1 set its event after update 3 (in its callback): it votes in update 4, and
    # the vote is read one update late, so both processes end after update 5, with the
    # same networks at every update.
    for o in outs:
        assert o["result"]["stopped_early"] and o["result"]["learner_updates"] == 5
        r = o["result"]
        assert r["env_steps"] == r["consumed"] + r["dropped"] + r["in_flight"]
    assert outs[0]["nets"] == outs[1]["nets"] and len(outs[0]["nets"]) == 5


@pytest.mark.timeout(240)
def test_a_peer_stuck_in_python_ends_every_process_naming_it(tmp_path, no_leftovers):
    # Process 1 sleeps inside its update callback: its heartbeats go on, so JAX would let
    # process 0 wait in the next update's collective forever.
    procs = _start(2, "stall", tmp_path)
    start = time.monotonic()
    results = _finish(procs, timeout=120)
    elapsed = time.monotonic() - start
    assert elapsed < 100, elapsed
    for rc, err in results:
        # Process 0 is past update 3, in update 4's collective or waiting for actors whose
        # device is queued behind it. Whichever process sees the stall first publishes
        # it, and every process ends with its words.
        assert rc == EXIT_CODE, err[-3000:]
        # Process 1 names itself "(this one)" when it publishes the stall itself.
        assert re.search(r"process 1( \(this one\))? stopped after update 3 \(process 0 ",
                         err), err[-3000:]
        assert "made no progress for 5 s" in err and "the silent peer" in err


def test_the_silent_peer_is_the_process_furthest_behind():
    assert describe_progress({0: 8, 1: 6, 2: 8}, me=0) == (
        "process 1 stopped after update 3 (process 0 after update 4, process 2 after update "
        "4): the silent peer")
    assert describe_progress({0: 7, 1: 6}, me=1) == (
        "process 1 (this one) stopped after update 3 (process 0 in update 4): the silent peer")
    assert describe_progress({0: 7, 1: 7}, me=0) == "every process is in update 4"


@pytest.mark.parametrize("how", ["killed", "hung"])
@pytest.mark.timeout(180)
def test_a_failed_peer_ends_the_others(how, tmp_path, no_leftovers):
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


def _mean_return(reports: list[dict], start_frac: float, end_frac: float) -> float:
    """Mean return of the episodes that ended within [start, end] of their own process's
    env steps, pooled over the processes (RunResult.mean_return over a whole cluster)."""
    returns = [ret for rep in reports for step, ret, _ in rep["episodes"]
               if start_frac * rep["result"]["env_steps"] <= step
               <= end_frac * rep["result"]["env_steps"]]
    assert returns, "no episode ended in the window"
    return float(np.mean(returns))


def _ppo_runs(tmp_path, total_env_steps: int, seed: int, with_reference: bool,
              timeout: float) -> dict[str, tuple[float, float, float]]:
    """PPO on CartPole-v1: 2 processes, each with 8 envs per group and one learner device,
    and, if `with_reference`, at the same time 1 process with 16 envs per group and two
    learner devices. Both have the same learner: 2 devices, each learning from 8 envs x 32
    steps per update (one trajectory from each process, or one split over the devices),
    the same 32 envs in all and the same env steps. The reference splits its batch like
    the cluster because PPO standardizes advantages per device: one learner device with
    16 envs learns faster (mean return over 100k steps about 120, against about 105 with
    two devices). Returns the mean return of the first 10%,
    the last 10% and the whole of each run's env steps."""
    runs = {"two": (2, 8, 1), "one": (1, 16, 2)} if with_reference else {"two": (2, 8, 1)}
    procs = []
    for name, (n, envs_per_group, learners) in runs.items():
        (tmp_path / name).mkdir()
        procs += _start(n, "ppo", tmp_path / name, envs_per_group, learners, total_env_steps,
                        seed)
    for rc, err in _finish(procs, timeout):  # kills every process it started, in any case
        assert rc == 0, err[-3000:]
    out = {}
    for name, (n, _, _) in runs.items():
        reports = [json.loads((tmp_path / name / f"process{i}.json").read_text())
                   for i in range(n)]
        for rep in reports:
            assert rep["accounted"]
            assert rep["result"]["global_consumed"] >= total_env_steps
        assert len({rep["nets_sha256"] for rep in reports}) == 1  # one learner, not two
        out[name] = (_mean_return(reports, 0.0, 0.1), _mean_return(reports, 0.9, 1.0),
                     _mean_return(reports, 0.0, 1.0))
    return out


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_processes_learn_cartpole_like_one(tmp_path, no_leftovers):
    # Both runs at once, 2-4 minutes on 2 shared cores. A random policy scores ~22.
    out = _ppo_runs(tmp_path, 100_000, seed=0, with_reference=True, timeout=540)
    for first, last, _ in out.values():
        assert last >= 150 and last >= 2 * first, out
    # Compared on the mean return over the whole run (the area under the learning curve):
    # the last 10% swings with thread timing (one seed's runs range from about 205 to
    # 400), the whole-run mean much less: at 100k, two processes (91-109) and one process
    # with two learner devices (102-113) are at most 1.24x apart (the cluster's slower
    # learner adds policy lag under load). 1.4x allows that and fails a cluster that
    # learns markedly slower than one process with the same learner: at half the speed
    # its 100k would look like 50k steps, whose whole-run means are about 66 (1.6x below).
    # Learning apart (nets that differ between the processes) is caught by the hashes in
    # _ppo_runs.
    two, one = out["two"][2], out["one"][2]
    assert max(two, one) / min(two, one) <= 1.4, out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_processes_learn_cartpole(tmp_path, no_leftovers):
    # The default suite's shorter variant: the 2-process run alone, 30k steps. The mean
    # return goes from about 20 (first 10%) to 105-149 (last 10% of 30k); a random
    # policy scores ~22 and a broken update stays there.
    (first, last, _), = _ppo_runs(tmp_path, 30_000, seed=0, with_reference=False,
                                  timeout=270).values()
    assert last >= 60 and last >= 3 * first, (first, last)


@pytest.mark.timeout(300)
def test_two_processes_keep_one_set_of_statistics(tmp_path, no_leftovers):
    """Observation and return moments (Box actions) are learnt from both processes'
    trajectories and are the same numbers in both, as are the networks their actors get."""
    for rc, err in _finish(_start(2, "statistics", tmp_path, 4 * 16 * 6), 240):
        assert rc == 0, err[-3000:]
    reports = [json.loads((tmp_path / f"process{i}.json").read_text()) for i in range(2)]
    assert reports[0]["statistics"] == reports[1]["statistics"]
    for rep in reports:
        assert rep["published_equal_learner"]
        # Every consumed step of both processes went into the moments.
        assert rep["reward_count"] == rep["global_consumed"] > rep["consumed"]
    observation = reports[0]["statistics"]["torso"]["layers_0"]["observation"]
    assert observation["var"] != [1.0, 1.0, 1.0]  # moved from the initial moments
