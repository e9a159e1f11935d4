"""Faults on purpose: each ends the run promptly with the original error, leaving nothing behind."""

from __future__ import annotations

import functools
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time

import jax
import jax.numpy as jnp
import pytest

import sebulba
import sebulba.runtime.watchdog
from sebulba.runtime.watchdog import EnvStall
from tests.conftest import sebulba_threads
from tests.counting_agent import CountingAgent
from tests.envs import CountingEnv, FaultyEnv, HangingEnv, RaisingEnv

COUNTING = functools.partial(CountingEnv, 5)


def make_loop(agent_cls=CountingAgent, env=COUNTING, **config):
    config = {"shutdown_timeout_s": 5.0, **config}
    cfg = sebulba.Config(env=env, envs_per_group=4, steps_per_cycle=4, async_factor=2,
                         **config)
    return sebulba.Sebulba(agent_cls(sebulba.env_spec(env)), cfg)


@pytest.mark.parametrize("vectorization", ["sync", "async"])
@pytest.mark.timeout(120)
def test_env_error_reraises_in_caller(vectorization, no_leftovers):
    loop = make_loop(env=functools.partial(FaultyEnv, 30), vectorization=vectorization)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="env fault at step 30"):
        loop.run(10**9)
    assert time.monotonic() - start < 60


@pytest.mark.timeout(120)
def test_an_env_error_that_cannot_leave_its_worker_still_stops_the_run(no_leftovers):
    loop = make_loop(env=functools.partial(RaisingEnv, "unpicklable"), vectorization="async")
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="UnpicklableError: an error holding a lock"):
        loop.run(10**9)
    assert time.monotonic() - start < 60


@pytest.mark.parametrize("vectorization,close_hangs,where", [
    # The env's own code, in the inferencer thread.
    ("sync", False, "in step\n    HangingEnv.release.wait()"),
    # The same, with a close that waits for the step's lock: closing must not hang.
    ("sync", True, "in step\n    HangingEnv.release.wait()"),
    ("async", False, "in step_wait"),  # the inferencer waits for its worker
])
@pytest.mark.timeout(120)
def test_an_env_step_that_never_returns_ends_the_run(vectorization, close_hangs, where,
                                                      no_leftovers):
    env = functools.partial(HangingEnv, 30, close_hangs=close_hangs)
    loop = make_loop(env=env, vectorization=vectorization, shutdown_timeout_s=1.0)
    start = time.monotonic()
    try:
        with pytest.raises(RuntimeError, match="no env stepped for 2 s") as caught:
            loop.run(10**9, progress_timeout_s=2.0)
        elapsed = time.monotonic() - start
    finally:
        HangingEnv.release.set()  # lets an inferencer stuck in the env's step end
        deadline = time.monotonic() + 10
        while sebulba_threads() and time.monotonic() < deadline:
            time.sleep(0.05)
        HangingEnv.release.clear()
    # Each group's thread is shown where it stopped.
    sections = re.split(r"^(sebulba-inferencer-\d+), innermost \d+ frames:$",
                        str(caught.value), flags=re.MULTILINE)
    stacks = dict(zip(sections[1::2], sections[2::2], strict=True))
    assert sorted(stacks) == ["sebulba-inferencer-0", "sebulba-inferencer-1"], sections
    for name, stack in stacks.items():
        assert where in stack, (name, stack)
    assert elapsed < 30, elapsed  # startup, 2 s of stall, one shutdown_timeout_s


class HangsInGroup0FailsInGroup1(CountingEnv):
    """Group 0's envs (seeds 0 and 1 of 2-env groups) never return from their third step
    until `HangingEnv.release` is set; group 1's raise at their tenth."""

    def __init__(self):
        super().__init__()
        self.steps = 0

    def step(self, action):
        self.steps += 1
        if self.env_id < 2 and self.steps == 3:
            HangingEnv.release.wait()
        if self.env_id >= 2 and self.steps == 10:
            raise RuntimeError(f"group 1's env {self.env_id} failed")
        return super().step(action)


@pytest.mark.timeout(60)
def test_an_error_names_the_threads_its_shutdown_left_stuck(no_leftovers):
    env = HangsInGroup0FailsInGroup1
    loop = sebulba.Sebulba(CountingAgent(sebulba.env_spec(env)), sebulba.Config(
        env=env, vectorization="sync", envs_per_group=2, async_factor=2, steps_per_cycle=4,
        shutdown_timeout_s=1.0))
    try:
        with pytest.raises(RuntimeError, match="group 1's env [23] failed") as caught:
            loop.run(10**9)
    finally:
        HangingEnv.release.set()
        deadline = time.monotonic() + 10
        while sebulba_threads() and time.monotonic() < deadline:
            time.sleep(0.05)
        HangingEnv.release.clear()
    # The env's error, as raised, with the thread still stuck in group 0's step said.
    notes = "\n".join(getattr(caught.value, "__notes__", []))
    assert "threads did not stop within the shutdown's waits of shutdown_timeout_s=1.0s" \
        in notes and "['sebulba-inferencer-0']" in notes, notes


@pytest.mark.timeout(60)
def test_env_stall_counts_only_waiting_without_env_steps(monkeypatch):
    now = [100.0]  # a fake clock: seconds advance only when the test says so
    monkeypatch.setattr(sebulba.runtime.watchdog.time, "monotonic", lambda: now[0])
    stall = EnvStall(2.0, threads=[], first_step_s=4.0)
    stall.waiting(0)
    now[0] += 3.0
    stall.check(0)  # before the first env step the limit is first_step_s
    now[0] += 1.5
    with pytest.raises(RuntimeError, match="no env stepped for 4 s"):
        stall.check(0)
    assert stall.fired
    stall = EnvStall(2.0, threads=[])
    stall.waiting(10)
    now[0] += 2.5
    stall.check(11)  # an env stepped: the clock restarts
    now[0] += 2.5
    stall.check(11, busy=True)  # the learner's update still runs: the clock restarts
    now[0] += 1.0
    stall.check(11)
    stall.waiting(11)  # a new wait restarts the clock
    now[0] += 1.5
    stall.check(11)
    now[0] += 1.0
    with pytest.raises(RuntimeError, match=r"no env stepped for 2 s .*\(11 env steps"):
        stall.check(11)
    assert stall.fired


def test_progress_timeout_must_be_positive():
    with pytest.raises(ValueError, match="progress_timeout_s must be > 0 or None, got 0"):
        make_loop().run(100, progress_timeout_s=0)


class StepRaisesInItsThread(CountingAgent):
    """Raises where an inferencer thread traces its acting call (the memory estimate
    traces the step first, in the caller's thread: there it must not raise)."""

    def step(self, step_state, nets, env_step):
        if threading.current_thread() is not threading.main_thread():
            raise ValueError("bad agent step")
        return super().step(step_state, nets, env_step)


@pytest.mark.timeout(60)
def test_agent_step_error_reraises_with_original_traceback(no_leftovers):
    with pytest.raises(ValueError, match="bad agent step") as info:
        make_loop(StepRaisesInItsThread).run(10**9)
    frames = [entry.name for entry in info.traceback]
    # The agent's own frame and the inferencer thread's that called it, re-raised here.
    assert "step" in frames and "_group_steps" in frames, frames


class NaNLoss(CountingAgent):
    def loss(self, nets, opt, experience):
        loss, aux = super().loss(nets, opt, experience)
        return loss * jnp.nan, aux


@pytest.mark.timeout(60)
def test_nan_loss_stops_the_run(no_leftovers):
    with pytest.raises(FloatingPointError, match="loss is nan after update 1"):
        make_loop(NaNLoss).run(10**9)


class NaNOnlyInActingNets(CountingAgent):
    """The loss reads only w; the optimizer step writes NaN into b, which acting reads."""

    def new_networks(self, key):
        return {"w": jnp.ones(()), "b": jnp.zeros(())}

    def loss(self, nets, opt, experience):
        return jnp.square(nets["w"]), (experience, {})

    def optimize_from_grads(self, nets, opt, grads):
        return {"w": nets["w"] - 0.01 * grads["w"], "b": nets["b"] + jnp.nan}, opt


@pytest.mark.timeout(60)
def test_nan_in_the_published_networks_stops_the_run(no_leftovers):
    with pytest.raises(FloatingPointError,
                       match=r"networks published after update 1 hold NaN or inf, first in "
                             r"\['b'\] \(1 of 2 leaves\)"):
        make_loop(NaNOnlyInActingNets).run(10**9)


class NaNStatistics(CountingAgent):
    """Learns in its statistics alone (no optimizer step), which turn NaN."""

    def optimizer_steps_per_update(self, layout):
        return 0

    def update_statistics(self, nets, trajectory):
        return jax.tree.map(lambda x: x * jnp.nan, nets)


@pytest.mark.timeout(60)
def test_nan_published_by_an_agent_without_optimizer_steps_stops_the_run(no_leftovers):
    with pytest.raises(FloatingPointError,
                       match=r"networks published after update 1 hold NaN or inf"):
        make_loop(NaNStatistics).run(20 * 4 * 3)


@pytest.mark.timeout(60)
def test_a_nan_state_is_an_error_before_on_update_copies_it_for_a_checkpoint(no_leftovers):
    copied = []
    with pytest.raises(FloatingPointError, match="loss is nan after update 1"):
        make_loop(NaNLoss).run(10**9, on_update=lambda info: copied.append(
            info.learner_state()))
    assert copied == []


class UpdateRaises(CountingAgent):
    def update_experience(self, *args):
        raise KeyError("bad update_experience")


@pytest.mark.timeout(60)
def test_learner_error_stops_inferencers(no_leftovers):
    with pytest.raises(KeyError, match="bad update_experience"):
        make_loop(UpdateRaises, vectorization="async").run(10**9)


class KilledInWorker(CountingEnv):
    """Killed by `signum` in an async worker process (never in the test's own), at its
    construction (`at_step=0`) or at step `at_step`."""

    def __init__(self, signum: int = signal.SIGKILL, at_step: int = 10):
        super().__init__()
        self.signum, self.at_step, self.steps = signum, at_step, 0
        self._maybe_die()

    def _maybe_die(self):
        if self.steps == self.at_step and multiprocessing.parent_process() is not None:
            os.kill(os.getpid(), self.signum)

    def step(self, action):
        self.steps += 1
        self._maybe_die()
        return super().step(action)


@pytest.mark.parametrize("at_step,signum,during", [
    (10, signal.SIGKILL, "stepping its env"),
    (0, signal.SIGSEGV, "starting"),
])
@pytest.mark.timeout(60)
def test_an_async_worker_killed_by_a_signal_is_named(at_step, signum, during, no_leftovers):
    # gymnasium reports a dead worker as the bare EOFError of its pipe.
    env = functools.partial(KilledInWorker, signum, at_step)
    cfg = sebulba.Config(env=env, envs_per_group=2, steps_per_cycle=4, async_factor=1,
                         vectorization="async", shutdown_timeout_s=5.0)
    loop = sebulba.Sebulba(CountingAgent(sebulba.env_spec(env)), cfg)
    name = signal.Signals(signum).name
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=rf"async env worker \d of 2 \(pid \d+\) was killed "
                                           rf"by {name}.* while {during}") as info:
        loop.run(10**9)
    assert time.monotonic() - start < 30
    assert isinstance(info.value.__cause__, EOFError | ConnectionResetError | BrokenPipeError)
    pids = [int(pid) for pid in re.findall(r"\(pid (\d+)\)", str(info.value))]
    assert pids and not [pid for pid in pids if _alive(pid)]


NO_MAIN_GUARD = textwrap.dedent("""
    import functools
    import sebulba
    from tests.counting_agent import CountingAgent
    from tests.envs import CountingEnv
    env = functools.partial(CountingEnv, 5)
    cfg = sebulba.Config(env=env, envs_per_group=2, steps_per_cycle=4, async_factor=1,
                         vectorization="async")
    sebulba.Sebulba(CountingAgent(sebulba.env_spec(env)), cfg).run(64)
""")


@pytest.mark.parametrize("layout", ["no guard", "guarded", "run above the guard"])
@pytest.mark.timeout(60)
def test_async_envs_in_a_script_without_a_main_guard_say_what_to_add(tmp_path, layout):
    # With "spawn" each worker imports the main script again; without the guard it would
    # start the run again in every worker (and the parent would see ConnectionResetError).
    script = tmp_path / "train_script.py"
    guard = 'if __name__ == "__main__":\n'
    script.write_text({
        "no guard": NO_MAIN_GUARD,
        "guarded": ("def main():\n" + textwrap.indent(NO_MAIN_GUARD, "    ") + guard
                    + "    main()\n"),
        # Seen only once the workers fail: named as they are, with the same advice.
        "run above the guard": NO_MAIN_GUARD + guard + "    pass\n",
    }[layout])
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root}
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=50)
    if layout == "guarded":
        assert result.returncode == 0, result.stderr[-3000:]
        return
    assert result.returncode != 0
    # The workers that failed while bootstrapping never released the semaphores they had
    # made; multiprocessing's resource tracker may say so after the parent's traceback.
    lines = result.stderr.strip().splitlines()
    while "resource_tracker" in lines[-1] or "warnings.warn(" in lines[-1]:
        lines.pop()
    last = lines[-1]
    advice = (f"with the 'spawn' start method each async env worker imports the main script "
              f'{script} again, running its top-level code: put the code that starts the run '
              'under `if __name__ == "__main__":`')
    assert advice in last, result.stderr[-3000:]
    if layout == "no guard":
        assert last.startswith("RuntimeError: vectorization 'async': ")
        assert "ConnectionResetError" not in result.stderr
        assert "bootstrapping phase" not in result.stderr  # no worker was started
    else:
        assert re.match(r"RuntimeError: async env worker \d of 2 \(pid \d+\) exited with code 1",
                        last)


CTRL_C_SCRIPT = textwrap.dedent("""
    import faulthandler, functools, os, signal, sys, threading
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the test's view of a hang
    # Ctrl-C as a terminal delivers it: a process started by a test runner's worker may
    # inherit SIGINT ignored or blocked (seen under pytest-xdist: the run went on as if
    # no signal had come), which no user's terminal session does.
    inherited = (signal.getsignal(signal.SIGINT),
                 signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, []))
    print(f"inherited SIGINT handler, blocked: {inherited}", file=sys.stderr, flush=True)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])
    import sebulba
    from tests.counting_agent import CountingAgent
    from tests.envs import PidRecordingEnv, SlowToCloseEnv
    when = sys.argv[2]
    if when == "running":
        env = functools.partial(PidRecordingEnv, sys.argv[1], 0.001)
    else:  # in the shutdown, while the envs' 4 s closes are waited for
        env = functools.partial(SlowToCloseEnv, sys.argv[1], 4.0)
    cfg = sebulba.Config(env=env, envs_per_group=2, steps_per_cycle=4, vectorization="async")
    loop = sebulba.Sebulba(CountingAgent(sebulba.env_spec(env)), cfg)

    def on_update(info):
        if when == "closing" and info.version == 3:  # the last update: 1 s into the closes
            threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT)).start()

    print("running", flush=True)
    loop.run(10**12 if when == "running" else 3 * loop.env_steps_per_update,
             on_update=on_update)
""")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie has exited; only its parent's wait is missing
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):  # it went between the two looks
        return False


@pytest.mark.timeout(120)
@pytest.mark.parametrize("when", ["running", "closing"])
def test_ctrl_c_shuts_down_cleanly(tmp_path, when):
    """Ctrl-C while the run steps, or while its shutdown waits for the envs' closes (a
    Ctrl-C there once left the workers alive, and the process hung at exit waiting for
    workers that ignore SIGTERM)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.Popen([sys.executable, "-c", CTRL_C_SCRIPT, str(tmp_path), when],
                            cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout.readline().strip() == "running"
        if when == "running":
            deadline = time.monotonic() + 60  # wait until the env workers exist and step
            while len(list(tmp_path.glob("*.pid"))) < 5 and time.monotonic() < deadline:
                time.sleep(0.1)
            time.sleep(2.0)
            proc.send_signal(signal.SIGINT)
        try:
            _, stderr = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:  # every thread's stack, then fail with them
            proc.send_signal(signal.SIGUSR1)
            time.sleep(2.0)
            proc.kill()
            _, stderr = proc.communicate(timeout=10)
            pytest.fail(f"the run did not end within 30 s of Ctrl-C:\n{stderr[-6000:]}")
    finally:
        proc.kill()
    assert "KeyboardInterrupt" in stderr
    assert proc.returncode != 0
    worker_pids = [int(p.stem) for p in tmp_path.glob("*.pid") if int(p.stem) != proc.pid]
    assert len(worker_pids) >= 4  # 2 groups x 2 async workers
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in worker_pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in worker_pids if _alive(p)]
