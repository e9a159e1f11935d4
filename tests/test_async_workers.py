"""sebulba's async env worker: subprocess envs step exactly as the same envs in-process."""

from __future__ import annotations

import contextlib
import functools
import multiprocessing
import os
import pathlib
import re
import signal
import threading
import time

import gymnasium as gym
import numpy as np
import pytest

from sebulba.envs import async_workers
from sebulba.envs.async_workers import AsyncVectorEnv, RemoteTraceback, env_worker
from sebulba.envs.gymnasium_source import VectorEnvSource, close_vector_env, make_vector_env
from tests.envs import (
    ClosesIntoAFileEnv,
    CountingEnv,
    EnvStepError,
    IgnoresSigtermEnv,
    LongErrorEnv,
    MadeOnlyInTheParentEnv,
    RaisesThenDiesInCloseEnv,
    RaisingEnv,
    RandomObservationEnv,
    SlowToMakeEnv,
    SpaceByProcessClosesIntoADirEnv,
    SpaceByProcessEnv,
)

SPACES = {
    "box": gym.spaces.Box(-2.0, 2.0, (3,), np.float32),
    "rgb_frames": gym.spaces.Box(0, 255, (6, 8, 3), np.uint8),
    "bool": gym.spaces.Box(0, 1, (5,), bool),
    "discrete": gym.spaces.Discrete(7),
    "multi_discrete": gym.spaces.MultiDiscrete([3, 5]),
    "multi_binary": gym.spaces.MultiBinary(4),
    "float16": gym.spaces.Box(-1.0, 1.0, (2, 2), np.float16),
    # Not one flat array in shared memory: written by gymnasium's own function.
    "dict": gym.spaces.Dict({"position": gym.spaces.Box(-1.0, 1.0, (2,), np.float32),
                             "mode": gym.spaces.Discrete(3)}),
}
GYMNASIUM = tuple(int(x) for x in gym.__version__.split(".")[:2])


def leaves(obs) -> tuple[np.ndarray, ...]:
    return tuple(np.array(obs[k]) for k in sorted(obs)) if isinstance(obs, dict) else (
        np.array(obs),)


def rollout(vec: gym.vector.VectorEnv, steps: int) -> list[tuple[np.ndarray, ...]]:
    """(obs, reward, terminated, truncated) of a reset and `steps` seeded random steps."""
    obs, _ = vec.reset(seed=3)
    out = [leaves(obs)]
    actions = np.random.default_rng(0).integers(0, 2, (steps, vec.num_envs))
    for a in actions:
        obs, reward, terminated, truncated, _ = vec.step(a)
        out.append((*leaves(obs), reward, terminated, truncated))
    return out


@pytest.mark.parametrize("kind", sorted(SPACES))
@pytest.mark.timeout(120)
def test_async_envs_step_as_the_same_envs_in_process(kind, no_leftovers):
    """Each env's observation lands in its own row, every step, over episode ends (the
    step after an episode's last resets it)."""
    if kind == "float16" and GYMNASIUM < (1, 4):
        pytest.skip("gymnasium before 1.4 cannot make shared memory for float16")
    env = functools.partial(RandomObservationEnv, SPACES[kind])
    runs = {}
    for vectorization in ("sync", "async"):
        vec = make_vector_env(env, 3, vectorization)
        try:
            if vectorization == "async":
                assert vec.worker is env_worker
            runs[vectorization] = rollout(vec, 20)  # episodes of 8 steps
        finally:
            close_vector_env(vec)
    for t, (sync, async_) in enumerate(zip(runs["sync"], runs["async"], strict=True)):
        for a, b in zip(sync, async_, strict=True):
            np.testing.assert_array_equal(a, b, err_msg=f"{kind}, step {t}")
    rows = runs["async"][5][0].reshape(3, -1)
    assert len({r.tobytes() for r in rows}) > 1  # envs differ, so a row mix-up shows


@pytest.mark.timeout(60)
@pytest.mark.filterwarnings("ignore:.*(error|exception):UserWarning")
def test_async_env_attributes_and_calls_reach_the_envs(no_leftovers):
    vec = make_vector_env(functools.partial(CountingEnv, 5), 2, "async")
    try:
        vec.reset(seed=10)
        assert vec.get_attr("env_id") == (10, 11)
        vec.set_attr("episode_length", [2, 3])
        assert vec.get_attr("episode_length") == (2, 3)
        _, _, terminated, truncated, _ = vec.step(np.zeros(2, np.int64))
        _, _, terminated2, _, _ = vec.step(np.zeros(2, np.int64))
        assert not terminated.any() and not truncated.any()
        assert terminated2.tolist() == [True, False]  # episode 0 of env 0 ends at step 2
        # A partial reset: env 0 starts an episode, env 1's observation stays as it was.
        before, _, _, _, _ = vec.step(np.zeros(2, np.int64))
        after, _ = vec.reset(options={"reset_mask": np.array([True, False])})
        np.testing.assert_array_equal(after[0], [10, before[0][1] + 1, 0])
        np.testing.assert_array_equal(after[1], before[1])
        with pytest.raises(ValueError, match="step"):
            vec.call("step", 0)
    finally:
        close_vector_env(vec)


@pytest.mark.timeout(60)
@pytest.mark.filterwarnings("ignore:.*(error|exception):UserWarning")
def test_the_worker_refuses_an_autoreset_mode_it_does_not_run(no_leftovers):
    vec = AsyncVectorEnv([functools.partial(CountingEnv, 5)] * 2, context="spawn",
                         worker=env_worker, autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)
    try:
        with pytest.raises(ValueError, match="NEXT_STEP autoreset"):
            vec.reset(seed=0)
    finally:
        close_vector_env(vec)


@pytest.mark.parametrize("kind,raised,message", [
    ("own", EnvStepError, "the env's own error"),
    # Neither can leave the worker as it is: the report names it in a RuntimeError (the
    # queue would lose it, and the parent wait for it forever).
    ("unpicklable", RuntimeError, "UnpicklableError: an error holding a lock"),
    ("two_arguments", RuntimeError, "TwoArgumentError: a two-argument error at step 1"),
    ("connection", ConnectionResetError, "the simulator hung up"),
])
@pytest.mark.timeout(60)
def test_a_workers_error_is_raised_as_the_env_raised_it(kind, raised, message, no_leftovers):
    # Through the env source, as the loop steps it: an env's own pipe error must not pass
    # for a dead worker's.
    source = VectorEnvSource(make_vector_env(functools.partial(RaisingEnv, kind), 2, "async"))
    vec = source.vec
    try:
        source.reset(seed=0)
        with pytest.raises(raised, match=re.escape(message)) as info:
            source.send(np.zeros(2, np.int64), np.arange(2))
        assert type(info.value.args[0]) is str  # the error itself, not one wrapping it
        cause = info.value.__cause__  # the worker's traceback, down to the env's frame
        assert isinstance(cause, RemoteTraceback)
        assert "in step" in str(cause) and "raise self.ERRORS" in str(cause)
        assert "workers [0, 1] of 2 failed" in str(cause)
        # As gymnasium leaves it: the failed workers' pipes closed, no call under way.
        assert vec.parent_pipes == [None, None]
        assert vec._state == gym.vector.async_vector_env.AsyncState.DEFAULT
    finally:
        source.close()


@pytest.mark.timeout(60)
def test_a_failure_without_a_report_is_an_error_not_a_wait(monkeypatch, no_leftovers):
    monkeypatch.setattr(async_workers, "ERROR_REPORT_TIMEOUT_S", 0.2)
    vec = make_vector_env(functools.partial(CountingEnv, 5), 2, "async")
    try:
        with pytest.raises(RuntimeError, match=r"workers \[1\] of 2 failed and sent no"):
            vec._raise_if_errors([True, False])  # worker 1 "failed"; its report never came
    finally:
        close_vector_env(vec)


@pytest.mark.timeout(60)
def test_an_env_factory_spawn_cannot_send_is_its_own_error(no_leftovers):
    """The first worker's start fails (pickling its env factory): the pickling error,
    and the worker that never started is no obstacle to closing."""
    with pytest.raises(TypeError, match="pickle"):
        make_vector_env(functools.partial(CountingEnv, threading.Lock()), 2, "async")


@pytest.mark.timeout(60)
def test_an_env_that_cannot_be_made_in_its_worker_raises_its_own_error(no_leftovers):
    with pytest.raises(EnvStepError, match="cannot be made in a worker") as info:
        make_vector_env(MadeOnlyInTheParentEnv, 2, "async")
    cause = str(info.value.__cause__)  # the worker's traceback, down to the constructor
    assert "in __init__" in cause and 'raise EnvStepError("this env cannot' in cause


@pytest.mark.timeout(60)
@pytest.mark.parametrize("when", ["step", "made"])
def test_many_workers_failing_at_once_raise_the_error_not_a_wait(when, no_leftovers):
    """Their reports share one pipe: once they fill it, a worker that waited for its
    report to be read before it replied waited for ever (the parent reads the replies
    first), and a failed start was a make timeout instead of the env's error."""
    env = functools.partial(LongErrorEnv, when)
    with pytest.raises(EnvStepError, match="the step failed" if when == "step"
                       else "cannot be made") as info:
        vec = make_vector_env(env, 4, "async")
        try:
            vec.reset(seed=0)
            vec.step(np.zeros(4, np.int64))
        finally:
            close_vector_env(vec)
    assert "workers [0, 1, 2, 3] of 4 failed" in str(info.value.__cause__)


@pytest.mark.timeout(60)
def test_no_worker_outlives_a_failed_start(no_leftovers):
    # gymnasium's space check fails in the parent, after the workers started.
    with pytest.raises(RuntimeError, match="observation space"):
        make_vector_env(SpaceByProcessEnv, 2, "async")
    assert multiprocessing.active_children() == []  # at once: no garbage collection needed


@pytest.mark.timeout(60)
def test_a_failed_start_closes_the_envs_its_workers_made(tmp_path, no_leftovers):
    """An env may own processes of its own (a simulator's server), which only its close
    ends: killing its worker would leave them."""
    with pytest.raises(RuntimeError, match="observation space"):
        make_vector_env(functools.partial(SpaceByProcessClosesIntoADirEnv, str(tmp_path)),
                        2, "async")
    closed_in = {int(p.name) for p in tmp_path.iterdir()} - {os.getpid()}
    assert len(closed_in) == 2  # each worker's env


@pytest.mark.timeout(60)
def test_closing_kills_workers_stuck_in_their_steps(monkeypatch, no_leftovers):
    monkeypatch.setattr(async_workers, "CLOSE_TIMEOUT_S", 0.5)
    vec = make_vector_env(IgnoresSigtermEnv, 2, "async")
    vec.reset(seed=0)
    vec.step_async(np.ones(2, np.int64))  # stuck in their steps
    processes = list(vec.processes)
    start = time.monotonic()
    close_vector_env(vec)
    assert time.monotonic() - start < 10
    assert [p.exitcode for p in processes] == [-signal.SIGKILL] * 2


@pytest.mark.timeout(60)
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_workers_leave_ctrl_c_and_sigterm_to_the_parent(signum, no_leftovers):
    """Ctrl-C reaches every process of the terminal's group, a scheduler's SIGTERM often
    every process of the job's; the parent stops the run, so a worker must not die of
    either (it would end the run as an env error)."""
    vec = make_vector_env(functools.partial(CountingEnv, 5), 2, "async")
    try:
        vec.reset(seed=0)
        for p in vec.processes:
            os.kill(p.pid, signum)
        time.sleep(0.5)
        obs, *_ = vec.step(np.zeros(2, np.int64))
        np.testing.assert_array_equal(obs[:, 2], [1, 1])
        assert all(p.is_alive() for p in vec.processes)
    finally:
        close_vector_env(vec)


@pytest.mark.timeout(60)
def test_closing_an_async_env_runs_each_envs_own_close(tmp_path, no_leftovers):
    """An env may own processes or files of its own (a simulator's server, a log): a
    close that only killed the workers left them behind."""
    paths = [str(tmp_path / f"closed_{i}") for i in range(2)]
    vec = AsyncVectorEnv([functools.partial(ClosesIntoAFileEnv, p) for p in paths],
                         autoreset_mode=gym.vector.AutoresetMode.NEXT_STEP,
                         context="spawn", worker=env_worker)
    vec.reset(seed=0)
    pids = sorted(p.pid for p in vec.processes)
    close_vector_env(vec)
    assert sorted(int(pathlib.Path(p).read_text()) for p in paths) == pids


@pytest.mark.timeout(60)
def test_a_workers_error_reaches_the_parent_though_its_env_then_kills_it_in_close(
        no_leftovers):
    vec = make_vector_env(RaisesThenDiesInCloseEnv, 1, "async")
    try:
        vec.reset(seed=0)
        start = time.monotonic()
        with pytest.raises(Exception, match="the simulator diverged"):
            vec.step(np.zeros(1, np.int64))
        assert time.monotonic() - start < async_workers.ERROR_REPORT_TIMEOUT_S / 2
    finally:
        close_vector_env(vec)


_ORPHAN_SCRIPT = """
import functools, sys, time
import numpy as np
from sebulba.envs.gymnasium_source import make_vector_env
from tests.envs import StuckStepEnv
if __name__ == "__main__":
    vec = make_vector_env(StuckStepEnv, 2, "async", async_context=sys.argv[1])
    vec.reset(seed=0)
    vec.step_async(np.zeros(2, np.int64))  # the workers are stuck in their steps
    print(*[p.pid for p in vec.processes], flush=True)
    time.sleep(300)
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("context", ["spawn", "forkserver"])  # a forkserver's workers'
def test_workers_end_when_their_parent_is_killed(tmp_path, context):  # OS parent: the server
    """A parent killed (SIGKILL, out of memory) closes nothing, and a worker stuck in its
    env never reads its pipe again: each watches for its parent instead."""
    import subprocess
    import sys

    script = tmp_path / "orphans.py"
    script.write_text(_ORPHAN_SCRIPT)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    parent = subprocess.Popen([sys.executable, str(script), context], stdout=subprocess.PIPE,
                              text=True, cwd=root, env={**os.environ, "PYTHONPATH": root})
    try:
        pids = [int(x) for x in parent.stdout.readline().split()]
        assert len(pids) == 2
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 10
        alive = pids
        while alive and time.monotonic() < deadline:
            time.sleep(0.1)
            alive = [pid for pid in pids if _alive(pid)]
        assert alive == []
    finally:
        parent.kill()
        for pid in pids if "pids" in locals() else []:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie, dead but not reaped by init yet, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1][0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.timeout(60)
def test_a_worker_that_never_makes_its_env_is_an_error_not_a_hang(monkeypatch,
                                                                  no_leftovers):
    monkeypatch.setattr(async_workers, "MAKE_TIMEOUT_S", 1.0)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=re.escape(
            "async env workers [0, 1] of 2 did not make their env within 1s")):
        make_vector_env(SlowToMakeEnv, 2, "async")
    assert time.monotonic() - start < 20
    assert multiprocessing.active_children() == []
