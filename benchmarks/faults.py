"""The fault matrix: each fault injected into `--repeats` independent
short runs; per fault, how many runs ended within its deadline (10 s after it here; the
launcher cases of benchmarks/faults_launcher.py have their own) with the original error
visible, how many processes they left behind, and whether nothing was lost (the
accounting identity held; the launcher cases: their checkpoints, as each says).

Every run is a fresh process: tests/counting_agent.py's CountingAgent on tests/envs.py's
CountingEnv (5-step episodes) through the Python API, or SPG on CartPole through the
launcher.

- env_sync: tests.envs.FaultyEnv raises at its step 30; tests/test_failures.py's
  `make_loop` (2 groups x 4 envs), sync.
- env_async: the same in async env workers (8 processes).
- worker_killed: this script SIGKILLs one of the 8 async env workers after update 3.
- agent_step: the agent's step raises from its call 40 on (a jax.debug.callback).
- nan_loss: the loss is NaN from update 3: FloatingPointError naming update 3.
- bad_<kind>_<sync|async>: env 1 of the `make_loop` run returns bad output at its step
  30 (tests.envs.BadOutputEnv: a NaN observation, a -inf reward, a reward of None, an
  observation of the wrong shape, the old API's 4 values): BadEnvOutput naming the env,
  its index, the step and the field.
- sigint, sigterm: the signal to `python -m examples.train --logdir=...` (2 async envs)
  after 2 learner updates: exit 130 / 143, with a checkpoint of the consumed steps.
- peer_killed: SIGKILL to process 1 of a 2-process jax.distributed run on 127.0.0.1
  (gloo; 2 async envs per process; heartbeat timeout 10 s, as in
  tests/multihost_worker.py) once both are past update 3.
- peer_hung: SIGSTOP to process 1 likewise (heartbeat timeout 30 s); process 0's
  watchdog (progress_timeout_s=5) must end it (exit 3) naming process 1 "the silent
  peer". Process 1 gets SIGCONT once process 0 has ended, and must end too.
- and the launcher cases (damaged checkpoints, saves that cannot succeed, resumes into
  another layout, two launchers on one logdir, refused layouts and schedules, signals at
  awkward moments): benchmarks/faults_launcher.py.

Columns:

- ended: the run's end at most 10 s after the fault, with the fault's own words in the
  exception or stderr (the env's and agent's messages, the killed worker's pid and
  SIGKILL, the update's number, "stopped by SIGINT" and the checkpoint saved, a dead
  peer, the silent peer's name). The fault's time is noted where it happens (by the env
  or the agent) or when this script sends the signal; the end is when `run` raised for
  the API faults, and when the process (process 0 of two) exited for the others; for
  peer_killed the time its `run` raised is reported too (`error_seconds`).
- processes left: every process started for a run carries a marker in its environment,
  so its env workers are found even when orphaned. Those alive 5 s after the run ended
  are counted (from /proc), then killed. A process whose `run` raised first counts its
  own workers (and sebulba threads), before its exit could clean them up.
- accounting: a run that raises has no RunResult, so the live Accounting of `on_update`
  must satisfy 0 <= env_steps - consumed - dropped <= what can be in flight (queue,
  popped items, one cycle per group). The signalled launcher runs print a RunResult:
  env_steps == consumed + dropped + in_flight. Process 0 of peer_hung ends in the
  watchdog's exit, with nothing to read: held = the error and no process left.

Processes share a JAX compilation cache in a temporary directory (the launcher runs
otherwise spend most of their time compiling); the faults are the same. How the runs'
processes are started and found: benchmarks/fault_runs.py.

    python -m benchmarks.faults                      # 20 runs of each fault
    python -m benchmarks.faults --repeats=2 --faults=sigint,peer_hung
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import uuid

from benchmarks import faults_launcher
from benchmarks.fault_runs import (
    MARKER,
    kill_all,
    last_json,
    left_behind,
    note,
    noted,
    read,
    run_processes,
    sebulba_threads,
    start,
    wait_for,
)
from tests.envs import BadOutputEnv, FaultyEnv

DEADLINE_S = 10.0  # a run must end this soon after its fault (the launcher cases: theirs)
ENV_FAULT_STEP, AGENT_FAULT_CALL, FAULT_AFTER_UPDATE = 30, 40, 3
HEARTBEAT_S = {"peer_killed": 10, "peer_hung": 30}  # hung: the watchdog must fire first
PROGRESS_TIMEOUT_S = 5.0
BAD_OUTPUT = {  # tests.envs.BadOutputEnv's kinds, and how the error names each
    "nan_observation": r"observation holds nan at index \[1\]; expected finite values",
    "inf_reward": r"reward is -inf; expected a finite number",
    "reward_none": r"reward is None; expected a real number",
    "wrong_shape": r"observation has shape \(2,\), expected \(3,\)",
    "four_values": r"step's result is 4 values, .*the old gym API's",
}
BAD_OUTPUT_FAULTS = {f"bad_{kind}_{vectorization}": (kind, vectorization)
                     for kind in BAD_OUTPUT for vectorization in ("sync", "async")}
API_FAULTS = ("env_sync", "env_async", "worker_killed", "agent_step", "nan_loss",
              *BAD_OUTPUT_FAULTS)
LAUNCHER_FAULTS = ("sigint", "sigterm")
PEER_FAULTS = ("peer_killed", "peer_hung")
FAULTS = API_FAULTS + LAUNCHER_FAULTS + PEER_FAULTS + faults_launcher.FAULTS
EXPECTED = {  # the fault's own words, in the exception or stderr
    "env_sync": f"RuntimeError: env fault at step {ENV_FAULT_STEP}",
    "env_async": f"RuntimeError: env fault at step {ENV_FAULT_STEP}",
    "worker_killed": r"async env worker \d+ of \d+ \(pid {pid}\) was killed by SIGKILL",
    "agent_step": r"ValueError: agent step fault at call \d+",
    "nan_loss": f"FloatingPointError: .*loss is nan after update {FAULT_AFTER_UPDATE}",
    "sigint": "stopped by SIGINT after",
    "sigterm": "stopped by SIGTERM after",
    "peer_killed": "peer process probably died",
    "peer_hung": r"process 1 stopped (in|after) update \d+ \(process 0 .*\): the silent peer",
    **{fault: (r"BadEnvOutput: env made by NotedBadOutputEnv \(env 1 of the 4 in its "
               rf"group\), step {ENV_FAULT_STEP}: {BAD_OUTPUT[kind]}")
       for fault, (kind, _) in BAD_OUTPUT_FAULTS.items()},
}
EXIT_CODE = {"sigint": 130, "sigterm": 143, "peer_killed": 1, "peer_hung": 3}
ACCOUNTING_CHECK = {
    **dict.fromkeys(API_FAULTS + ("peer_killed",),
                    "bounds: the run raised; its live Accounting"),
    **dict.fromkeys(LAUNCHER_FAULTS, "exact: the launcher's RunResult"),
    "peer_hung": "none to read (watchdog exit): error and no process left",
    **faults_launcher.HOW,
}
LAUNCHER = ["--agent=spg", "--spg_hidden_sizes=16", "--vectorization=async",
            "--envs_per_group=2", "--async_factor=1", "--steps_per_cycle=8", "--progress=false",
            "--log_every_seconds=0", "--checkpoint_every_steps=1000000000",
            "--total_env_steps=1000000000"]


class NotedFaultyEnv(FaultyEnv):
    """tests.envs.FaultyEnv, noting when it raises (at module level for async workers)."""

    def __init__(self, fail_at: int, work: str):
        super().__init__(fail_at)
        self.work = work

    def step(self, action):
        if self.steps + 1 == self.fail_at:
            note(self.work)
        return super().step(action)


class NotedBadOutputEnv(BadOutputEnv):
    """tests.envs.BadOutputEnv whose env 1 goes wrong at its step ENV_FAULT_STEP, noting
    when."""

    def __init__(self, kind: str, work: str):
        super().__init__(kind, ENV_FAULT_STEP, bad_env=1)
        self.work = work

    def step(self, action):
        if self.steps + 1 == self.bad_at and self.env_id == self.bad_env:
            note(self.work)
        return super().step(action)


# --- inside a run's process (`--child`): API faults and the peers of a 2-process run ---

def observed_run(loop, on_update, **run_kwargs) -> dict:
    """Runs `loop` until it raises; what its caller can observe right after."""
    seen = {}

    def observe(info):
        seen["accounting"] = info.accounting
        on_update(info)

    try:
        loop.run(10**12, on_update=observe, **run_kwargs)
        error = "the run returned"
    except Exception as e:  # noqa: BLE001 - the fault's error, whichever it is
        error = f"{type(e).__name__}: {e}"
        traceback.print_exc()  # to stderr, as an uncaught error would be
    record = {"ended_at": time.time(), "error": error, "threads_left": sebulba_threads(),
              "left": left_behind(os.environ[MARKER])}
    a, cfg = seen.get("accounting"), loop.config
    if a is not None:
        most = ((cfg.effective_queue_capacity + cfg.trajectories_per_update + cfg.num_groups)
                * cfg.envs_per_group * (cfg.steps_per_cycle + 1))
        in_flight = a.env_steps - a.consumed - a.dropped
        record["accounting"] = {"env_steps": a.env_steps, "consumed": a.consumed,
                                "dropped": a.dropped, "in_flight": in_flight,
                                "in_flight_at_most": most, "held": 0 <= in_flight <= most}
    return record


def api_run(fault: str, work: str) -> dict:
    import jax
    import jax.numpy as jnp

    from tests.counting_agent import CountingAgent
    from tests.test_failures import COUNTING, make_loop

    calls = itertools.count(1)

    def agent_step_call():
        n = next(calls)
        if n >= AGENT_FAULT_CALL:
            note(work)
            raise ValueError(f"agent step fault at call {n}")

    class StepRaisesLater(CountingAgent):
        def step(self, step_state, nets, env_step):
            jax.debug.callback(agent_step_call)
            return super().step(step_state, nets, env_step)

    class NaNLater(CountingAgent):
        def loss(self, nets, opt, experience):
            loss, aux = super().loss(nets, opt, experience)
            return jnp.where(experience.size >= FAULT_AFTER_UPDATE, jnp.nan, loss), aux

    env = functools.partial(NotedFaultyEnv, ENV_FAULT_STEP, work)
    loop = {
        "env_sync": lambda: make_loop(env=env),
        "env_async": lambda: make_loop(env=env, vectorization="async"),
        "worker_killed": lambda: make_loop(env=COUNTING, vectorization="async"),
        "agent_step": lambda: make_loop(StepRaisesLater),
        "nan_loss": lambda: make_loop(NaNLater),
        **{name: functools.partial(
            make_loop, env=functools.partial(NotedBadOutputEnv, kind, work),
            vectorization=vectorization)
           for name, (kind, vectorization) in BAD_OUTPUT_FAULTS.items()},
    }[fault]()
    killed = []

    def on_update(info):
        if fault == "worker_killed" and info.version == FAULT_AFTER_UPDATE:
            killed.append(run_processes(os.environ[MARKER])[0])  # an env worker
            note(work)
            os.kill(killed[0], signal.SIGKILL)
        if fault == "nan_loss" and info.version == FAULT_AFTER_UPDATE - 1:
            note(work)  # the next update's loss is NaN

    return {**observed_run(loop, on_update), "killed": killed}


def peer_run(fault: str, process_id: int, port: int, work: str) -> dict:
    """One process of a 2-process run; notes when it is past update 3."""
    os.environ[MARKER] += f"/{process_id}"  # its env workers: left_behind finds only them
    from sebulba.runtime import distributed

    distributed.initialize(f"127.0.0.1:{port}", 2, process_id,
                           heartbeat_timeout_seconds=HEARTBEAT_S[fault])
    import sebulba
    from tests.counting_agent import CountingAgent
    from tests.test_failures import COUNTING

    cfg = sebulba.Config(env=COUNTING, envs_per_group=2, steps_per_cycle=4, async_factor=1,
                         vectorization="async", shutdown_timeout_s=5.0)
    loop = sebulba.Sebulba(CountingAgent(sebulba.env_spec(COUNTING)), cfg)

    def on_update(info):
        if info.version == FAULT_AFTER_UPDATE:
            note(work, f"learning{process_id}")

    return observed_run(loop, on_update, progress_timeout_s=PROGRESS_TIMEOUT_S)


# --- in this script's process: one run of a fault, measured ---

def measure_api(fault: str, marker: str, work: str) -> dict:
    proc = start(["-m", "benchmarks.faults", f"--child={fault}", f"--work={work}"], marker,
                 os.path.join(work, "p0"))
    proc.wait(timeout=120)
    child = last_json(os.path.join(work, "p0.out"))
    if not child:
        return {"why": f"no record, exit {proc.returncode}: "
                       f"{read(os.path.join(work, 'p0.err'))[-1500:]}"}
    expected = EXPECTED[fault].format(pid=child["killed"][0] if child["killed"] else "")
    at = noted(work)
    return {"seconds": None if at is None else round(child["ended_at"] - at, 2),
            "error_visible": bool(re.search(expected, child["error"])),
            "error": child["error"][:400], "left": child["left"],
            "threads_left": child["threads_left"],
            "accounting_held": child.get("accounting", {}).get("held", False),
            "accounting": child.get("accounting")}


def measure_processes(fault: str, marker: str, work: str) -> dict:
    """sigint and sigterm (the launcher), peer_killed and peer_hung (2 processes)."""
    from tests.test_multihost import _free_port
    from tests.test_preemption import _checkpoint_steps

    logdir = pathlib.Path(work, "run")
    if fault in LAUNCHER_FAULTS:
        procs = [start(["-m", "examples.train", f"--logdir={logdir}", *LAUNCHER], marker,
                       os.path.join(work, "p0"))]
        metrics = logdir / "metrics.jsonl"  # after 2 updates, as tests/test_preemption.py

        def ready():
            return metrics.exists() and metrics.read_text().count("\n") >= 2
    else:
        port = _free_port()
        procs = [start(["-m", "benchmarks.faults", f"--child={fault}", f"--work={work}",
                        f"--process_id={i}", f"--port={port}"], marker,
                       os.path.join(work, f"p{i}")) for i in range(2)]

        def ready():
            return all(noted(work, f"learning{i}") for i in range(2))
    try:
        why = wait_for(ready, procs)
        if why is not None:
            return {"why": f"{why}: {read(os.path.join(work, 'p0.err'))[-1500:]}"}
        signum = {"sigint": signal.SIGINT, "sigterm": signal.SIGTERM,
                  "peer_killed": signal.SIGKILL, "peer_hung": signal.SIGSTOP}[fault]
        sent = time.time()
        procs[-1].send_signal(signum)  # the only process, or process 1 of 2
        try:
            rc = procs[0].wait(timeout=60)
        except subprocess.TimeoutExpired:
            rc = None
        seconds = round(time.time() - sent, 2)
        if fault == "peer_hung":  # the hang is over: process 1 must end too, by itself
            procs[1].send_signal(signal.SIGCONT)
        err = read(os.path.join(work, "p0.err"))
        out = last_json(os.path.join(work, "p0.out"))
        found = re.search(f".*({EXPECTED[fault]}).*", out.get("error", "") + "\n" + err)
        visible = found is not None and rc is not None and (
            rc == EXIT_CODE[fault] if fault in EXIT_CODE else rc != 0)
        record = {"seconds": seconds, "exit": rc, "error_visible": visible,
                  "error": (found.group() if found else err.strip()[-300:])[-300:],
                  "left": left_behind(marker)}
        if fault in LAUNCHER_FAULTS:
            steps = _checkpoint_steps(logdir) if (logdir / "checkpoints").is_dir() else []
            record["checkpoint_saved"] = bool(out) and steps[-1:] == [out["total_consumed"]]
            record["error_visible"] = visible and record["checkpoint_saved"]
            record["accounting"] = {k: out.get(k) for k in
                                    ("env_steps", "consumed", "dropped", "in_flight")}
            record["accounting_held"] = bool(out) and out["env_steps"] == (
                out["consumed"] + out["dropped"] + out["in_flight"])
        elif fault == "peer_killed":  # the run raised: as the API faults, and its exit
            record["error_seconds"] = round(out["ended_at"] - sent, 2) if out else None
            record["run_error"] = out.get("error", "")[:300]
            record["accounting"] = out.get("accounting")
            record["accounting_held"] = bool(out.get("accounting", {}).get("held"))
            record["left"] += out.get("left", [])
            record["threads_left"] = out.get("threads_left", [])
        else:
            record["accounting_held"] = visible and not record["left"]
        return record
    finally:
        for p in procs:
            if p.poll() is None:
                kill_all([p.pid])
            p.wait()


def deadline(fault: str) -> float:
    return faults_launcher.DEADLINE_S.get(fault, DEADLINE_S)


def measure(fault: str, shared: str) -> dict:
    """One run of `fault`; its processes are counted, then killed. `shared`: what every
    run may read (the launcher cases' trained logdirs)."""
    marker = uuid.uuid4().hex
    with tempfile.TemporaryDirectory(prefix=f"fault-{fault}-") as work:
        try:
            if fault in faults_launcher.FAULTS:
                record = faults_launcher.measure(fault, marker, work, shared)
            else:
                record = (measure_api if fault in API_FAULTS else measure_processes)(
                    fault, marker, work)
        except subprocess.TimeoutExpired as e:
            record = {"why": f"timed out: {e}"}
        record["left"] = sorted(set(record.get("left", [])) | set(left_behind(marker)))
        kill_all(run_processes(marker))
    seconds = record.get("seconds")
    record["ended_with_error"] = bool(
        record.get("error_visible") and seconds is not None
        and 0 <= seconds <= deadline(fault))
    return record


def summarize(fault: str, records: list[dict]) -> dict:
    seconds = sorted(r["seconds"] for r in records if r.get("seconds") is not None)
    errors = [r["error_seconds"] for r in records if r.get("error_seconds") is not None]
    failures = [{"run": i, **{k: v for k, v in r.items() if k != "ended_with_error"}}
                for i, r in enumerate(records)
                if not (r["ended_with_error"] and r.get("accounting_held")) or r["left"]
                or r.get("threads_left")]
    return {
        "record": "fault", "fault": fault, "runs": len(records), "deadline_s": deadline(fault),
        "ended_with_error": sum(r["ended_with_error"] for r in records),
        "seconds_median": seconds[len(seconds) // 2] if seconds else None,
        "seconds_max": seconds[-1] if seconds else None,
        "processes_left": sum(len(r["left"]) for r in records),
        "threads_left": sum(len(r.get("threads_left", [])) for r in records),
        "accounting_held": sum(bool(r.get("accounting_held")) for r in records),
        "accounting_check": ACCOUNTING_CHECK[fault],
        **({"error_seconds_max": max(errors)} if errors else {}),
        "failures": failures,
    }


def table(rows: list[dict]) -> str:
    lines = ["| fault | runs | ended within its deadline, its own words visible | "
             "seconds to the end, median (max) | processes left | nothing lost (accounting "
             "identity held) | how it was checked |", "|" + " --- |" * 7]
    for r in rows:
        threads = f" (+{r['threads_left']} threads)" if r["threads_left"] else ""
        raised = (f"; `run` raised in at most {r['error_seconds_max']}"
                  if "error_seconds_max" in r else "")
        lines.append(f"| {r['fault']} | {r['runs']} | {r['ended_with_error']}/{r['runs']} "
                     f"({r['deadline_s']:g} s) | {r['seconds_median']} ({r['seconds_max']})"
                     f"{raised} | {r['processes_left']}{threads} | "
                     f"{r['accounting_held']}/{r['runs']} | {r['accounting_check']} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.faults", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=20, help="runs of each fault")
    p.add_argument("--faults", default=",".join(FAULTS), help="comma-separated, of: "
                   + ", ".join(FAULTS))
    for internal in ("--child", "--work", "--process_id", "--port"):  # a run's process
        p.add_argument(internal, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.child in API_FAULTS:
        print(json.dumps({"killed": [], **api_run(args.child, args.work)}), flush=True)
        return
    if args.child in PEER_FAULTS:
        record = peer_run(args.child, int(args.process_id), int(args.port), args.work)
        print(json.dumps(record), flush=True)
        if record["error"] != "the run returned":  # as the launcher ends a failed process
            from sebulba.runtime import distributed
            distributed.end_failed_process("the run failed (traceback above)")
        return
    if args.child in faults_launcher.CHILDREN:
        print(json.dumps(faults_launcher.CHILDREN[args.child](args.work)), flush=True)
        return
    from benchmarks._util import emit, meta, str_list

    faults = str_list(args.faults)
    if set(faults) - set(FAULTS):
        raise SystemExit(f"unknown faults {sorted(set(faults) - set(FAULTS))}; known: "
                         + ", ".join(FAULTS))
    with tempfile.TemporaryDirectory(prefix="fault-shared-") as shared:
        os.environ.update(JAX_COMPILATION_CACHE_DIR=os.path.join(shared, "jax-cache"),
                          JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
        emit(meta("faults", vars(args)))
        rows = []
        for fault in faults:
            records = []
            for i in range(args.repeats):
                records.append(measure(fault, shared))
                print(f"{fault} {i}: {json.dumps(records[-1])[:600]}", file=sys.stderr,
                      flush=True)
            rows.append(summarize(fault, records))
            emit(rows[-1])
    print(table(rows))


if __name__ == "__main__":
    main()
