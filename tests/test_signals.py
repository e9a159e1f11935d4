"""Signals at every moment: a stop honoured while the learner waits, an update cut short
between optimizer steps by the stop's deadline, a checkpoint saved within the grace, a
hard exit that exits at once, and a signal before training ends the launcher in one line.
"""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sebulba
from sebulba.runtime.preemption import StopEvent
from tests.counting_agent import CountingAgent
from tests.envs import CountingEnv
from tests.test_preemption import _checkpoint_steps, _launch, _wait_until_training

STEP_S = 0.25  # one slow env step; a cycle of 8 steps takes 2 s


class SlowStepEnv(CountingEnv):
    def step(self, action):
        time.sleep(STEP_S)
        return super().step(action)


class SlowLearnerAgent(CountingAgent):
    """CountingAgent whose update is `steps` optimizer steps of `step_s` seconds each (a
    host callback sleeps inside the compiled step, as a long device step would)."""

    def __init__(self, env_spec, steps: int, step_s: float):
        super().__init__(env_spec)
        self.steps, self.step_s = steps, step_s

    def num_off_policy_optims_per_cycle(self) -> int:
        return self.steps

    def loss(self, nets, opt, experience):
        def sleep(w):
            time.sleep(self.step_s)
            return w

        slept = jax.pure_callback(sleep, jax.ShapeDtypeStruct((), jnp.float32),
                                  jax.lax.stop_gradient(nets["w"]))
        return jnp.square(nets["w"]) + 0.0 * slept, (experience, {"w": slept})


def _config(env, **overrides) -> sebulba.Config:
    return sebulba.Config(**{"env": env, "envs_per_group": 2, "steps_per_cycle": 8,
                             "async_factor": 1, "shutdown_timeout_s": 5.0, **overrides})


def _set_later(event: threading.Event, seconds: float) -> threading.Timer:
    timer = threading.Timer(seconds, event.set)
    timer.start()
    return timer


@pytest.mark.timeout(120)
def test_a_stop_is_honoured_while_the_learner_waits_for_a_trajectory(no_leftovers):
    env = SlowStepEnv
    loop = sebulba.Sebulba(CountingAgent(sebulba.env_spec(env)), _config(env))
    stop, stopped_at = threading.Event(), []

    def on_update(info):
        # Update 1 is done and the next cycle has just begun: it takes 8 x STEP_S = 2 s.
        if info.version == 1:
            stopped_at.append(time.monotonic() + 0.3)
            _set_later(stop, 0.3)

    result = loop.run(10**9, on_update=on_update, stop=stop)
    waited = time.monotonic() - stopped_at[0]
    assert result.stopped_early and result.learner_updates == 1
    # Not after the cycle (2 s) and another update: the learner left its wait at once,
    # then the inferencer thread ended after the env step under way (STEP_S).
    assert waited < 1.0, waited
    assert result.env_steps == result.consumed + result.dropped + result.in_flight
    assert result.consumed == 16 and result.in_flight > 0


@pytest.mark.timeout(120)
def test_an_update_that_would_pass_the_deadline_is_cut_between_optimizer_steps(
        no_leftovers):
    env = functools.partial(CountingEnv, 5)
    steps, step_s = 40, 0.1  # a 4 s update
    loop = sebulba.Sebulba(SlowLearnerAgent(sebulba.env_spec(env), steps, step_s),
                           _config(env))
    stop, set_at = StopEvent(), []

    def on_update(info):
        if info.version == 1:  # stop 1 s into update 2, with 0.5 s to end it by
            set_at.append(time.monotonic() + 1.0)
            stop.deadline = set_at[0] + 0.5
            _set_later(stop, 1.0)

    result = loop.run(10**9, on_update=on_update, stop=stop)
    ended = time.monotonic() - set_at[0]
    assert result.stopped_early and result.learner_updates == 2
    # Update 2 ran about 10 + 5 steps (1 s, then 0.5 s): cut, counted, and consistent.
    assert 0 < result.optimizer_steps_cut < steps
    assert result.optimizer_steps + result.optimizer_steps_cut == 2 * steps
    assert "cut short by" in result.summary()
    assert ended < 0.5 + 3 * step_s + 1.0, ended  # the deadline, queued steps, shutdown
    # What the learner holds is what it ran: w decays by 2% per optimizer step.
    w = float(np.asarray(result.state.nets["w"]))
    assert w == pytest.approx(0.98 ** result.optimizer_steps, rel=1e-4)
    assert result.consumed == 2 * 16


@pytest.mark.timeout(120)
def test_a_plain_stop_event_lets_the_update_under_way_finish(no_leftovers):
    """Without a deadline there is nothing to cut for: the update ends as planned."""
    env = functools.partial(CountingEnv, 5)
    loop = sebulba.Sebulba(SlowLearnerAgent(sebulba.env_spec(env), 10, 0.05), _config(env))
    stop = threading.Event()

    def on_update(info):
        if info.version == 1:
            _set_later(stop, 0.2)

    result = loop.run(10**9, on_update=on_update, stop=stop)
    assert result.stopped_early and result.optimizer_steps_cut == 0
    assert result.optimizer_steps == 10 * result.learner_updates


class BusyLearnerAgent(CountingAgent):
    """CountingAgent whose one optimizer step computes for `seconds` in XLA, with no
    Python in between: the main thread waits in one C call, as for a long device step."""

    def __init__(self, env_spec, seconds: float):
        super().__init__(env_spec)
        spin = jax.jit(lambda x, n: jax.lax.fori_loop(0, n, lambda i, x: x * 0.999 + 1e-3, x))
        spin(jnp.float32(1), 10).block_until_ready()
        start = time.perf_counter()
        spin(jnp.float32(1), 10**7).block_until_ready()
        self.rounds = max(1, round(seconds / (time.perf_counter() - start)))

    def num_off_policy_optims_per_cycle(self) -> int:
        return 1

    def loss(self, nets, opt, experience):
        busy = jax.lax.fori_loop(0, self.rounds, lambda i, x: jax.lax.fori_loop(
            0, 10**7, lambda j, y: y * 0.999 + 1e-3, x), jax.lax.stop_gradient(nets["w"]))
        return jnp.square(nets["w"]) + 0.0 * busy, (experience, {"w": busy})


def _sigterm_after(proc: subprocess.Popen, delay_s: float) -> tuple[str, str, float]:
    """SIGTERM to `proc` after `delay_s`; its stdout, stderr and the seconds it took to
    end after the signal (killed if it has not ended 60 s after)."""
    try:
        time.sleep(delay_s)
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
        return out, err, time.monotonic() - sent
    finally:
        proc.kill()


HARD_EXIT_SCRIPT = textwrap.dedent("""
    import functools, sys
    import sebulba
    from sebulba.runtime.preemption import Preemption
    from tests.envs import CountingEnv
    from tests.test_signals import BusyLearnerAgent, _config

    env = functools.partial(CountingEnv, 5)
    loop = sebulba.Sebulba(BusyLearnerAgent(sebulba.env_spec(env), 120.0), _config(env))

    def on_update(info):
        print("update", info.version, flush=True)

    with Preemption(grace_seconds=float(sys.argv[1])) as preemption:
        print("training", flush=True)
        loop.run(10**9, on_update=on_update, stop=preemption.event)
""")


@pytest.mark.timeout(120)
def test_the_hard_exit_comes_at_the_grace_even_while_the_main_thread_waits_in_c():
    grace = 2.0
    proc = subprocess.Popen([sys.executable, "-c", HARD_EXIT_SCRIPT, str(grace)],
                            cwd=os.path.dirname(os.path.dirname(__file__)),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if proc.stdout.readline() != "training\n":
        proc.kill()
        raise AssertionError(proc.stderr.read())
    # 8 s: compiled, and in update 1's 120 s optimizer step.
    _, err, took = _sigterm_after(proc, 8.0)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "did not stop within 2 s of SIGTERM" in err, err
    assert grace <= took < grace + 3.0, took  # not when the 120 s wait returns
    assert "Traceback" not in err


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_launcher_cuts_a_long_update_and_saves_within_the_grace(tmp_path):
    logdir = tmp_path / "run"
    grace = 6.0
    # Tiny PPO batches and many epochs: an update of 60,000 optimizer steps, far longer
    # than the grace (about 17 s on a loaded 2-core VM; with 20,000 an update of 4-5 s
    # could end within the half grace it gets, rightly uncut).
    proc = _launch([f"--logdir={logdir}", "--agent=ppo", "--vectorization=sync",
                    "--envs_per_group=4", "--steps_per_cycle=8", "--async_factor=1",
                    "--ppo_num_epochs=60000", "--ppo_num_minibatches=1",
                    f"--preemption_grace_seconds={grace}", "--progress=false",
                    "--log_every_seconds=0", "--checkpoint_every_steps=1000000000",
                    "--total_env_steps=1000000000"])
    try:
        _wait_until_training(proc, logdir, timeout=180)
    except BaseException:
        proc.kill()
        raise
    out, err, took = _sigterm_after(proc, 1.0)
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert took < grace, (took, err[-3000:])  # a clean stop, not the hard exit
    assert "did not stop within" not in err
    assert "cut short by" in out, out
    steps = _checkpoint_steps(logdir)
    assert steps and steps[-1] >= 2 * 32, steps  # the update under way counted
    assert "stopped by SIGTERM" in err and "checkpoint in" in err


SIGNAL_BEFORE_TRAINING_SCRIPT = textwrap.dedent("""
    import os, signal, sys
    import examples.train as train

    original = train.restore

    def restore(launch):
        os.kill(os.getpid(), signal.SIGINT)  # as if Ctrl-C came during compilation
        original(launch)

    train.restore = restore
    sys.argv = ["train.py", *sys.argv[1:]]
    train.run_main(train.main)
""")


@pytest.mark.timeout(120)
def test_a_signal_before_training_ends_the_launcher_with_one_line(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.run(
        [sys.executable, "-c", SIGNAL_BEFORE_TRAINING_SCRIPT, f"--logdir={tmp_path}",
         "--envs_per_group=4", "--steps_per_cycle=8", "--total_env_steps=10000"],
        cwd=os.path.dirname(os.path.dirname(__file__)), env=env, capture_output=True,
        text=True, timeout=100)
    assert proc.returncode == 128 + signal.SIGINT, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "KeyboardInterrupt" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == "stopped by SIGINT before training started"
    assert not (tmp_path / "metrics.jsonl").exists() or not (
        tmp_path / "metrics.jsonl").read_text().strip()


HARD_EXIT_WITH_WORKERS_SCRIPT = textwrap.dedent("""
    import multiprocessing, signal, sys, time
    from sebulba.runtime.preemption import end_process_now

    def ignores_sigterm():
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # as env workers do
        time.sleep(300)

    if __name__ == "__main__":
        workers = [multiprocessing.get_context("spawn").Process(target=ignores_sigterm)
                   for _ in range(4)]
        for w in workers:
            w.start()
        time.sleep(3.0)  # each has installed its handler
        print(*[w.pid for w in workers], flush=True)
        end_process_now(7, "the grace is over")
""")


@pytest.mark.timeout(60)
def test_the_hard_exit_does_not_wait_for_workers_that_ignore_sigterm(tmp_path):
    script = tmp_path / "hard_exit.py"
    script.write_text(HARD_EXIT_WITH_WORKERS_SCRIPT)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=root,
                            env={**os.environ, "PYTHONPATH": root})
    try:
        pids = [int(x) for x in proc.stdout.readline().split()]
        start = time.monotonic()
        proc.wait(timeout=30)
        took = time.monotonic() - start
    finally:
        proc.kill()
    assert proc.returncode == 7
    assert took < 2.0, took  # a wait of 2 s per worker took 8
    assert not [pid for pid in pids if os.path.exists(f"/proc/{pid}")]  # killed, reaped
