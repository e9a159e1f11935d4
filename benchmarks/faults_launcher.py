"""The fault matrix's launcher cases: what a user meets around `python -m examples.train`,
measured as benchmarks/faults.py measures its other faults (and run by it).

Each run is a fresh launcher process on tiny SPG (16 hidden units, 2 sync CartPole envs, 8
steps per cycle: 16 env steps per learner update). The checkpoint cases start from a copy
of one logdir trained once per invocation (checkpoints 16, 32 and 48; for disk_full one
with 512 x 512 hidden units, about 1 MiB of networks).

- damaged_<part>_<how>: checkpoint 48 damaged as tests/test_checkpoint_damage.py's
  `damage` does (its nets' data truncated, deleted or garbled, meta/metadata garbled or
  deleted, the step's directory emptied); `--resume --total_env_steps=64` must skip 48
  naming it and the part, resume from 32, move 48 to checkpoints_damaged/ and exit 0.
- damaged_all: every checkpoint damaged: one line naming the directory, exit 2.
- checkpoints_file: `logdir/checkpoints` is a file: a usage error naming it.
- disk_full: the resumed run under RLIMIT_FSIZE=300 kB (as tests/test_checkpoint_save.py
  simulates a full disk): one line naming the checkpoint's path and the cause, exit 1.
- layout_envs, layout_groups: `--resume` with `--envs_per_group=4` or `--async_factor=2`
  (saved: 2 and 1): refused in one line naming the saved and the requested values.
- second_launcher: a second launcher on the logdir of a training one stops at once
  naming the first's pid; the first goes on (then gets SIGTERM).
- too_large: `--envs_per_group=1000000000`: the memory estimate, refused in one line.
- refused_schedule: `--lockstep --drop_when_full --trajectories_per_update=2`.
- stop_slow_env (the Python API, tests/test_signals.py's SlowStepEnv: a 2 s cycle): a stop
  0.3 s into the second cycle, while the learner waits for it.
- update_cut: PPO with 60,000 epochs of one minibatch (an update of about 17 s here, far
  longer than the grace), `--preemption_grace_seconds=6`, SIGTERM 1 s into update 2: the
  update cut between optimizer steps, a checkpoint saved, exit 143 within the grace.
  (20,000 epochs made updates of 4 to 5.5 s on this machine: the rest of one fits in the
  3 s the grace leaves the update, and is rightly not cut.)
- hard_exit: SIGTERM (grace 2 s) while the main thread waits in a 120 s XLA call
  (tests/test_signals.py's BusyLearnerAgent; 2 async env workers): exit 143 at the grace.
- sigint_restore: SIGINT while `--resume` restores: "stopped by SIGINT before training
  started", exit 130.

The fault's time is the launch where the fault is in place before it (damage, files,
flags), the signal's or stop's otherwise; "processes left" as for the other faults. No
case may print a traceback; a usage error must be the only "train.py: error:" line.
"Nothing lost" is each case's `how`.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import pathlib
import re
import shutil
import signal
import textwrap
import threading
import time
import uuid
from collections.abc import Callable

from benchmarks.fault_runs import (
    last_json,
    left_behind,
    note,
    noted,
    read,
    sebulba_threads,
    start,
    wait_for,
    wait_timed,
)


def sigterm_when(proc, ready: Callable[[], bool], delay_s: float
                 ) -> tuple[str | None, float, int | None, float | None]:
    """SIGTERM to `proc` `delay_s` after `ready()` holds: (why it never did, or None; the
    time the signal was sent; `wait_timed`'s exit code and end time). The process is
    killed if it is still alive at the end."""
    try:
        why = wait_for(ready, [proc])
        if why is not None:
            return why, 0.0, None, None
        time.sleep(delay_s)
        sent = time.time()
        proc.send_signal(signal.SIGTERM)
        return (None, sent, *wait_timed(proc, 60))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


SPG = ["--agent=spg", "--vectorization=sync", "--envs_per_group=2", "--async_factor=1",
       "--steps_per_cycle=8", "--progress=false", "--log_every_seconds=0"]
SMALL_NETS, BIG_NETS = "--spg_hidden_sizes=16", "--spg_hidden_sizes=512,512"
SAVED = [16, 32, 48]  # the trained logdir's checkpoints, one per learner update
RESUMED = ["--resume", "--total_env_steps=64", "--checkpoint_every_steps=16"]
REFUSED_S = 15.0  # a usage error comes before any env or compilation: the imports, mostly
SHORT_RUN_S = 60.0  # a resume and one learner update
GRACE_S = {"update_cut": 6.0, "hard_exit": 2.0}
UPDATE_CUT_EPOCHS = 60_000  # optimizer steps of update_cut's updates
FILE_SIZE_LIMIT = 300_000  # bytes: the 1 MiB networks do not fit, the run's other files do
ABSL_LINE = re.compile(r"[IWE]\d{4} ")


# --- what a run left in its logdir ---

def snapshot(directory: pathlib.Path) -> dict[str, str]:
    """Every file under `directory` (but the lock file, which holds the last pid) and a
    digest of its bytes."""
    found = {}
    for root, _, files in os.walk(directory):
        for name in files:
            path = os.path.join(root, name)
            relative = os.path.relpath(path, directory)
            if relative != ".lock":
                with open(path, "rb") as f:
                    found[relative] = hashlib.sha1(f.read()).hexdigest()
    return found


def steps_in(directory: pathlib.Path) -> list[int]:
    if not directory.is_dir():
        return []
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())


def exact_accounting(summary: dict) -> bool:
    return bool(summary) and summary["env_steps"] == (
        summary["consumed"] + summary["dropped"] + summary["in_flight"])


def saved_its_end(logdir: pathlib.Path, summary: dict) -> bool:
    """The run's newest checkpoint is the steps it consumed, and its accounting is exact."""
    return exact_accounting(summary) and steps_in(logdir / "checkpoints")[-1:] == [
        summary.get("total_consumed")]


def last_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.strip() and not ABSL_LINE.match(line)]


# --- the trained logdirs the checkpoint cases copy ---

def trained(shared: str, nets: str) -> pathlib.Path:
    """A logdir with checkpoints SAVED of SPG with `nets`, trained once into `shared`."""
    logdir = pathlib.Path(shared, "trained" + re.sub(r"\W", "_", nets), "run")
    if not logdir.is_dir():
        logdir.parent.mkdir(parents=True, exist_ok=True)
        log = str(logdir.parent / "train")
        proc = start(["-m", "examples.train", f"--logdir={logdir}", nets, *SPG,
                      "--total_env_steps=48", "--checkpoint_every_steps=16",
                      "--keep_checkpoints=3"], uuid.uuid4().hex, log)
        if proc.wait(timeout=600) != 0 or steps_in(logdir / "checkpoints") != SAVED:
            raise RuntimeError(f"training the logdir the checkpoint cases copy failed (exit "
                               f"{proc.returncode}): {read(log + '.err')[-2000:]}")
    return logdir


def copy_trained(work: str, shared: str, nets: str = SMALL_NETS) -> pathlib.Path:
    logdir = pathlib.Path(work, "run")
    shutil.copytree(trained(shared, nets), logdir)
    return logdir


# --- cases whose fault is in place before the launcher starts ---

@dataclasses.dataclass(frozen=True)
class Ended:
    """What a launcher run left: its logdir (and a snapshot of it before the run), its
    output and its summary (the last JSON line, if it printed one)."""

    logdir: pathlib.Path
    before: dict[str, str]
    out: str
    err: str
    summary: dict


@dataclasses.dataclass(frozen=True)
class Case:
    """A launcher run with its fault in place before it starts."""

    setup: Callable[[str, str], tuple[pathlib.Path, list[str]]]  # (work, shared) -> logdir, flags
    words: str  # a regex of the fault's own words in stderr; {checkpoints} is filled in
    exit_code: int
    deadline_s: float
    kept: Callable[[Ended], bool]  # nothing lost
    how: str
    file_size_limit: int | None = None


def damaged(*damages: tuple[str, str]) -> Callable:
    """A setup: the trained logdir with checkpoints 48, 32, ... damaged as `damages` say,
    (part, how) each, for tests/test_checkpoint_damage.py's `damage`."""
    def setup(work: str, shared: str) -> tuple[pathlib.Path, list[str]]:
        from tests.test_checkpoint_damage import damage

        logdir = copy_trained(work, shared)
        for step, (part, how) in zip(SAVED[::-1], damages, strict=False):
            damage(str(logdir / "checkpoints" / str(step)), part, how)
        return logdir, [SMALL_NETS, *SPG, *RESUMED]
    return setup


def fell_back(e: Ended) -> bool:
    """Resumed from 32, checkpoint 48 moved aside as it was, the short run saved."""
    checkpoints = e.logdir / "checkpoints"
    was = {k.split("/", 2)[2]: v for k, v in e.before.items() if k.startswith("checkpoints/48/")}
    aside = e.logdir / "checkpoints_damaged" / "48"
    return (f"resumed from {checkpoints} at 32 env steps" in e.out and aside.is_dir()
            and snapshot(aside) == was and e.summary.get("total_consumed", 0) >= 64
            and saved_its_end(e.logdir, e.summary))


def untouched(e: Ended) -> bool:
    return snapshot(e.logdir) == e.before


def checkpoints_intact(e: Ended) -> bool:
    """Every earlier checkpoint byte for byte as it was; no partial directory."""
    checkpoints = e.logdir / "checkpoints"
    return (snapshot(checkpoints) == {k.split("/", 1)[1]: v for k, v in e.before.items()
                                      if k.startswith("checkpoints/")}
            and not [d for d in os.listdir(checkpoints) if ".orbax-checkpoint-tmp" in d])


def fresh(flags: list[str], prepare: Callable[[pathlib.Path], None] = lambda logdir: None):
    """A setup: an empty logdir (`prepare`d) and `flags`."""
    def setup(work: str, shared: str) -> tuple[pathlib.Path, list[str]]:
        logdir = pathlib.Path(work, "run")
        logdir.mkdir()
        prepare(logdir)
        return logdir, [SMALL_NETS, *SPG, *flags]
    return setup


def resumed_with(*flags: str, nets: str = SMALL_NETS):
    def setup(work: str, shared: str) -> tuple[pathlib.Path, list[str]]:
        return copy_trained(work, shared, nets), [nets, *SPG, *RESUMED, *flags]
    return setup


SKIPPED = (r"--resume: skipping checkpoint 48 in {checkpoints}: it is damaged, its {part} "
           r"cannot be read \(.+\); trying the one before it")
FELL_BACK = "resumed from 32, 48 moved aside as it was; the run's checkpoint is its end, exact"
UNTOUCHED = "the logdir untouched (every file as it was, none added)"
LAYOUT = (r"checkpoint 48 in {checkpoints} was saved by a run of another layout: {what}\. ")
CASES: dict[str, Case] = {
    **{f"damaged_{part}_{how}": Case(
        damaged((part, how)), SKIPPED.replace("{part}", "meta" if part == "step" else part),
        0, SHORT_RUN_S, fell_back, FELL_BACK)
       for part, how in [("nets", "truncated"), ("nets", "deleted"), ("nets", "garbled"),
                         ("meta", "garbled"), ("meta", "deleted"), ("step", "emptied")]},
    "damaged_all": Case(
        damaged(("nets", "garbled"), ("opt", "deleted"), ("meta", "garbled")),
        r"--resume: no intact checkpoint in {checkpoints}: every one of \[16, 32, 48\] is "
        r"damaged \(see above\)$", 2, REFUSED_S, untouched, UNTOUCHED),
    "checkpoints_file": Case(
        fresh(["--total_env_steps=64"],
              lambda logdir: (logdir / "checkpoints").write_text("not a directory")),
        r"cannot save checkpoints in {checkpoints}: it is not a directory$", 2, REFUSED_S,
        untouched, UNTOUCHED),
    "disk_full": Case(
        resumed_with(nets=BIG_NETS),
        r"could not save checkpoint \d+ in {checkpoints}: \[Errno 27\] File too large; the "
        r"earlier checkpoints are intact$", 1, SHORT_RUN_S, checkpoints_intact,
        "every earlier checkpoint byte for byte as it was; no partial directory",
        file_size_limit=FILE_SIZE_LIMIT),
    "layout_envs": Case(
        resumed_with("--envs_per_group=4"),
        LAYOUT.replace("{what}", r"envs_per_group 2 \(this run: 4\)"), 2, REFUSED_S,
        untouched, UNTOUCHED),
    "layout_groups": Case(
        resumed_with("--async_factor=2"),
        LAYOUT.replace("{what}", r"async_factor 1 \(this run: 2\)"), 2, REFUSED_S,
        untouched, UNTOUCHED),
    "too_large": Case(
        fresh(["--envs_per_group=1000000000"]),
        r"the layout \(1 env groups? of 1,000,000,000 envs, 8 steps per cycle\) needs about "
        r"[\d.]+ TiB of host memory \(.*\), more than the [\d.]+ \w+ available", 2,
        REFUSED_S, untouched, UNTOUCHED),
    "refused_schedule": Case(
        fresh(["--lockstep", "--drop_when_full", "--trajectories_per_update=2"]),
        r"--lockstep with drop_when_full needs trajectories_per_update=1, got 2: ", 2,
        REFUSED_S, untouched, UNTOUCHED),
}


# `python -c LIMITED LIMIT ARGS...`: `python ARGS...` with writes past LIMIT bytes of a file
# failing with EFBIG, as on a full disk (an ignored signal stays ignored across exec).
LIMITED = textwrap.dedent("""
    import os, resource, signal, sys
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[1]), resource.RLIM_INFINITY))
    os.execv(sys.executable, [sys.executable, *sys.argv[2:]])
""")


def visible(words: str, err: str, exit_code: int, rc: int | None) -> tuple[bool, str]:
    """(whether the run ended with `exit_code` and `words` in stderr, with no traceback:
    in its only error line if it failed; the line that says it)."""
    errors = [line for line in err.splitlines() if line.startswith("train.py: error:")]
    if exit_code == 0:
        found = re.search(f".*{words}.*", err)
        ok, line = found is not None and not errors, found.group() if found else ""
    else:
        ok = len(errors) == 1 and re.search(words, errors[0]) is not None
        line = errors[-1] if errors else ""
    return ok and rc == exit_code and "Traceback" not in err, line[-300:]


def measure_case(case: Case, marker: str, work: str, shared: str) -> dict:
    logdir, flags = case.setup(work, shared)
    before = snapshot(logdir)
    log = os.path.join(work, "p0")
    launched = time.time()
    limit = [] if case.file_size_limit is None else ["-c", LIMITED, str(case.file_size_limit)]
    proc = start([*limit, "-m", "examples.train", f"--logdir={logdir}", *flags], marker, log)
    rc, ended = wait_timed(proc, 300)
    if rc is None:
        proc.kill()
        proc.wait()
    out, err = read(log + ".out"), read(log + ".err")
    words = case.words.replace("{checkpoints}", re.escape(str(logdir / "checkpoints")))
    ok, line = visible(words, err, case.exit_code, rc)
    summary = last_json(log + ".out")
    return {"seconds": round(ended - launched, 2), "exit": rc, "error_visible": ok,
            "error": line if ok else err.strip()[-600:], "left": left_behind(marker),
            "accounting_held": case.kept(Ended(logdir, before, out, err, summary))}


# --- cases with a moment: a second launcher, signals, a stop ---

def measure_second_launcher(marker: str, work: str, shared: str) -> dict:
    logdir = pathlib.Path(work, "run")
    flags = [f"--logdir={logdir}", SMALL_NETS, *SPG]
    first = start(["-m", "examples.train", *flags, "--total_env_steps=1000000000",
                   "--checkpoint_every_steps=1000000000"], marker, os.path.join(work, "p0"))
    procs = [first]
    try:
        why = wait_for((logdir / "metrics.jsonl").exists, [first])
        if why is not None:
            return {"why": f"{why}: {read(os.path.join(work, 'p0.err'))[-1500:]}"}
        launched = time.time()
        procs.append(start(["-m", "examples.train", *flags, "--total_env_steps=1000"],
                           marker, os.path.join(work, "p1")))
        rc, ended = wait_timed(procs[1], 120)
        first_went_on = first.poll() is None
        err = read(os.path.join(work, "p1.err"))
        words = (rf"--logdir={re.escape(str(logdir))} is in use by another run \(pid "
                 rf"{first.pid} holds {re.escape(str(logdir))}/\.lock\): one run per logdir")
        ok, line = visible(words, err, 2, rc)
        first.send_signal(signal.SIGTERM)  # the first run's own end: a checkpoint
        first_exit, _ = wait_timed(first, 60)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    summary = last_json(os.path.join(work, "p0.out"))
    return {"seconds": round(ended - launched, 2), "exit": rc, "error_visible": ok,
            "error": line if ok else err.strip()[-600:], "left": left_behind(marker),
            "first_went_on": first_went_on, "first_exit": first_exit,
            "accounting_held": first_went_on and first_exit == 128 + signal.SIGTERM
            and saved_its_end(logdir, summary)}


def measure_update_cut(marker: str, work: str, shared: str) -> dict:
    logdir = pathlib.Path(work, "run")
    grace = GRACE_S["update_cut"]
    log = os.path.join(work, "p0")
    proc = start(["-m", "examples.train", f"--logdir={logdir}", "--agent=ppo",
                  "--ppo_hidden_sizes=16", "--vectorization=sync", "--envs_per_group=4",
                  "--steps_per_cycle=8", "--async_factor=1",
                  f"--ppo_num_epochs={UPDATE_CUT_EPOCHS}", "--ppo_num_minibatches=1",
                  f"--preemption_grace_seconds={grace:g}", "--progress=false",
                  "--log_every_seconds=0",
                  "--checkpoint_every_steps=1000000000", "--total_env_steps=1000000000"],
                 marker, log)
    metrics = logdir / "metrics.jsonl"
    # 1 s into update 2's optimizer steps
    why, sent, rc, ended = sigterm_when(
        proc, lambda: metrics.exists() and metrics.read_text().count("\n") >= 1, 1.0)
    if why is not None:
        return {"why": f"{why}: {read(log + '.err')[-1500:]}"}
    out, err, summary = read(log + ".out"), read(log + ".err"), last_json(log + ".out")
    found = re.search(r"stopped by SIGTERM after [\d,]+ env steps; checkpoint in .*", err)
    ok = (found is not None and "cut short by" in out and "did not stop within" not in err
          and rc == 128 + signal.SIGTERM and "Traceback" not in err)
    cut = re.search(r".*cut short by.*", out)
    return {"seconds": round(ended - sent, 2), "exit": rc, "error_visible": ok,
            "error": f"{cut.group() if cut else ''} / {found.group() if found else err[-600:]}",
            "left": left_behind(marker), "accounting_held": saved_its_end(logdir, summary)}


def began(work: str, w):
    note(work, "busy")
    return w


def hard_exit_child(work: str) -> None:
    """A run whose first update is one 120 s XLA call (noted as it begins), under a
    2 s grace; ends in the hard exit (or is killed)."""
    import jax

    import sebulba
    from sebulba.runtime.preemption import Preemption
    from tests.envs import CountingEnv
    from tests.test_signals import BusyLearnerAgent, _config

    class NotedBusyLearnerAgent(BusyLearnerAgent):
        def loss(self, nets, opt, experience):
            w = jax.lax.stop_gradient(nets["w"])
            at = jax.pure_callback(functools.partial(began, work),
                                   jax.ShapeDtypeStruct(w.shape, w.dtype), w)
            # The long loop starts from the callback's result: after it.
            return super().loss({**nets, "w": nets["w"] + 0.0 * at}, opt, experience)

    env = functools.partial(CountingEnv, 5)
    loop = sebulba.Sebulba(NotedBusyLearnerAgent(sebulba.env_spec(env), 120.0),
                           _config(env, vectorization="async"))
    with Preemption(grace_seconds=GRACE_S["hard_exit"]) as preemption:
        loop.run(10**9, stop=preemption.event)


def measure_hard_exit(marker: str, work: str, shared: str) -> dict:
    grace = GRACE_S["hard_exit"]
    log = os.path.join(work, "p0")
    proc = start(["-m", "benchmarks.faults", "--child=hard_exit", f"--work={work}"], marker,
                 log)
    # 0.5 s into the call
    why, sent, rc, ended = sigterm_when(proc, lambda: noted(work, "busy") is not None, 0.5)
    if why is not None:
        return {"why": f"{why}: {read(log + '.err')[-1500:]}"}
    err = read(log + ".err")
    found = re.search(rf".*the run did not stop within {grace:g} s of SIGTERM.*", err)
    ok = found is not None and rc == 128 + signal.SIGTERM and "Traceback" not in err
    left = left_behind(marker)
    return {"seconds": round(ended - sent, 2), "exit": rc, "error_visible": ok,
            "error": found.group() if found else err.strip()[-600:], "left": left,
            "accounting_held": ok and not left}


SIGINT_IN_RESTORE = textwrap.dedent("""
    import os, signal, sys
    import examples.train as train
    from benchmarks.fault_runs import note

    work, sys.argv = sys.argv[1], ["train.py", *sys.argv[2:]]
    original = train.restore

    def restore(launch):
        note(work)
        os.kill(os.getpid(), signal.SIGINT)  # as a Ctrl-C while the checkpoint is read
        original(launch)

    train.restore = restore
    train.run_main(train.main)
""")


def measure_sigint_restore(marker: str, work: str, shared: str) -> dict:
    logdir = copy_trained(work, shared)
    before = snapshot(logdir)
    log = os.path.join(work, "p0")
    proc = start(["-c", SIGINT_IN_RESTORE, work, f"--logdir={logdir}", SMALL_NETS, *SPG,
                  *RESUMED], marker, log)
    rc, ended = wait_timed(proc, 120)
    if rc is None:
        proc.kill()
        proc.wait()
    err, at = read(log + ".err"), noted(work)
    lines = last_lines(err)
    ok = (rc == 128 + signal.SIGINT and "Traceback" not in err
          and "KeyboardInterrupt" not in err
          and lines[-1:] == ["stopped by SIGINT before training started"])
    return {"seconds": None if at is None else round(ended - at, 2), "exit": rc,
            "error_visible": ok, "error": (lines or [""])[-1][-600:],
            "left": left_behind(marker),
            "accounting_held": untouched(Ended(logdir, before, "", "", {}))}


def stop_slow_env_child(work: str) -> dict:
    """A stop 0.3 s into the second 2 s cycle: the learner waits for it."""
    import sebulba
    from tests.counting_agent import CountingAgent
    from tests.test_signals import SlowStepEnv, _config

    loop = sebulba.Sebulba(CountingAgent(sebulba.env_spec(SlowStepEnv)),
                           _config(SlowStepEnv))
    stop = threading.Event()

    def stop_now():
        note(work)
        stop.set()

    def on_update(info):
        if info.version == 1:
            threading.Timer(0.3, stop_now).start()

    result = loop.run(10**9, on_update=on_update, stop=stop)
    return {"ended_at": time.time(), "stopped_early": result.stopped_early,
            "learner_updates": result.learner_updates, "env_steps": result.env_steps,
            "consumed": result.consumed, "dropped": result.dropped,
            "in_flight": result.in_flight, "threads_left": sebulba_threads()}


def measure_stop_slow_env(marker: str, work: str, shared: str) -> dict:
    log = os.path.join(work, "p0")
    proc = start(["-m", "benchmarks.faults", "--child=stop_slow_env", f"--work={work}"],
                 marker, log)
    rc, _ = wait_timed(proc, 120)
    child, at = last_json(log + ".out"), noted(work)
    if not child or at is None:
        return {"why": f"no record, exit {rc}: {read(log + '.err')[-1500:]}"}
    ok = child["stopped_early"] and child["learner_updates"] == 1
    return {"seconds": round(child["ended_at"] - at, 2), "exit": rc, "error_visible": ok,
            "error": f"stopped early after {child['learner_updates']} update(s)",
            "left": left_behind(marker), "threads_left": child["threads_left"],
            "accounting": {k: child[k] for k in ("env_steps", "consumed", "dropped",
                                                   "in_flight")},
            "accounting_held": exact_accounting(child)}


MOMENTS: dict[str, tuple[Callable[[str, str, str], dict], float, str]] = {
    # name: (measure, deadline in seconds, how nothing lost was checked)
    "second_launcher": (measure_second_launcher, REFUSED_S,
                        "the first run went on; at its SIGTERM, its checkpoint is its end"),
    "stop_slow_env": (measure_stop_slow_env, 1.0,
                      "exact: the RunResult (1 update, not after the cycle and another)"),
    "update_cut": (measure_update_cut, GRACE_S["update_cut"],
                   "exact: the RunResult; its checkpoint is its end (the cut update's)"),
    "hard_exit": (measure_hard_exit, GRACE_S["hard_exit"] + 1.0,
                  "none to read (hard exit, no checkpoint by design): exit, no process left"),
    "sigint_restore": (measure_sigint_restore, 10.0, UNTOUCHED),
}
CHILDREN = {"hard_exit": hard_exit_child, "stop_slow_env": stop_slow_env_child}
FAULTS = tuple(CASES) + tuple(MOMENTS)
DEADLINE_S = {**{name: case.deadline_s for name, case in CASES.items()},
              **{name: deadline for name, (_, deadline, _) in MOMENTS.items()}}
HOW = {**{name: case.how for name, case in CASES.items()},
       **{name: how for name, (_, _, how) in MOMENTS.items()}}


def measure(fault: str, marker: str, work: str, shared: str) -> dict:
    """One run of launcher case `fault`, its processes under `marker`, in `work`."""
    if fault in CASES:
        return measure_case(CASES[fault], marker, work, shared)
    return MOMENTS[fault][0](marker, work, shared)
