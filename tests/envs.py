"""Small real gymnasium envs for tests: counting, faulty and slow ones."""

from __future__ import annotations

import copy
import multiprocessing
import os
import signal
import threading
import time

import gymnasium as gym
import numpy as np


class CountingEnv(gym.Env):
    """Observation [env id, episode, step in episode]; reward 1 per step.

    The env id is the seed of its first reset (vector envs seed env i with seed + i).
    Even episodes terminate after `episode_length` steps, odd ones are truncated then,
    so trajectories cross both kinds of episode end.
    """

    observation_space = gym.spaces.Box(-1.0, 1e6, (3,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def __init__(self, episode_length: int = 5):
        self.episode_length = episode_length
        self.env_id = -1
        self.episode = -1
        self.t = 0

    def _obs(self):
        return np.array([self.env_id, self.episode, self.t], np.float32)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        if seed is not None:
            self.env_id = seed
        self.episode += 1
        self.t = 0
        return self._obs(), {}

    def step(self, action):
        self.t += 1
        end = self.t == self.episode_length
        terminated = end and self.episode % 2 == 0
        truncated = end and self.episode % 2 == 1
        return self._obs(), 1.0, terminated, truncated, {}


class FaultyEnv(CountingEnv):
    """Raises on its `fail_at`-th step."""

    def __init__(self, fail_at: int = 20):
        super().__init__()
        self.fail_at = fail_at
        self.steps = 0

    def step(self, action):
        self.steps += 1
        if self.steps == self.fail_at:
            raise RuntimeError(f"env fault at step {self.steps}")
        return super().step(action)


class EnvStepError(Exception):
    """An env's own error type, which callers catch by type."""


class UnpicklableError(Exception):
    """An error holding a lock: it cannot leave its process as it is."""

    def __init__(self, message: str):
        super().__init__(message)
        self.lock = threading.Lock()


class TwoArgumentError(Exception):
    """Pickles, but cannot be unpickled: its args are not its constructor's."""

    def __init__(self, what: str, step: int):
        super().__init__(f"{what} at step {step}")


class RaisingEnv(CountingEnv):
    """Raises an error of kind `kind` (a key of ERRORS) at its first step."""

    ERRORS = {"own": lambda: EnvStepError("the env's own error"),
              "unpicklable": lambda: UnpicklableError("an error holding a lock"),
              "two_arguments": lambda: TwoArgumentError("a two-argument error", 1),
              # What a pipe to a dead worker raises, raised by the env itself (a
              # simulator over a socket): not a worker death.
              "connection": lambda: ConnectionResetError("the simulator hung up")}

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind

    def step(self, action):
        raise self.ERRORS[self.kind]()


class HangingEnv(CountingEnv):
    """Its `hang_at`-th step does not return until `HangingEnv.release` is set (in an
    async worker, a copy of the event that nothing sets: until the worker is ended);
    with `close_hangs`, neither does its close once a step hung (as a close that needs
    the lock the step waits for)."""

    release = threading.Event()
    hanging = threading.Event()  # set once a step hangs (in this process)

    def __init__(self, hang_at: int = 20, close_hangs: bool = False):
        super().__init__()
        self.hang_at = hang_at
        self.close_hangs = close_hangs
        self.steps = 0

    def step(self, action):
        self.steps += 1
        if self.steps == self.hang_at:
            HangingEnv.hanging.set()
            HangingEnv.release.wait()
        return super().step(action)

    def close(self):
        if self.close_hangs and self.steps >= self.hang_at:
            HangingEnv.release.wait()


class MadeOnlyInTheParentEnv(CountingEnv):
    """Cannot be made in a worker process (as an env whose module a worker cannot import)."""

    def __init__(self):
        if multiprocessing.parent_process() is not None:
            raise EnvStepError("this env cannot be made in a worker")
        super().__init__()


class LongErrorEnv(CountingEnv):
    """Raises an error of a 25 KB message at its first step, or with `when="made"` in a
    worker's constructor: three such reports fill a pipe's 64 KiB."""

    def __init__(self, when: str = "step"):
        if when == "made" and multiprocessing.parent_process() is not None:
            raise EnvStepError("cannot be made: " + "y" * 25_000)
        super().__init__()

    def step(self, action):
        raise EnvStepError("the step failed: " + "x" * 25_000)


class SpaceByProcessEnv(CountingEnv):
    """Its observation space's bound is its process id: workers disagree with the parent."""

    def __init__(self):
        super().__init__()
        self.observation_space = gym.spaces.Box(-1.0, float(os.getpid()), (3,), np.float32)


class IgnoresSigtermEnv(CountingEnv):
    """Ignores SIGTERM once reset (in a worker: `terminate()` does not end it); action 1
    is a step that never ends."""

    def reset(self, *, seed=None, options=None):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        return super().reset(seed=seed, options=options)

    def step(self, action):
        while action == 1:
            time.sleep(1.0)
        return super().step(action)


class PidRecordingEnv(CountingEnv):
    """Writes its process id into `pid_dir`, so a test can check the process is gone."""

    def __init__(self, pid_dir: str, step_seconds: float = 0.0):
        super().__init__(episode_length=50)
        self.step_seconds = step_seconds
        with open(os.path.join(pid_dir, f"{os.getpid()}.pid"), "w") as f:
            f.write(str(os.getpid()))

    def step(self, action):
        time.sleep(self.step_seconds)
        return super().step(action)


class SlowToCloseEnv(PidRecordingEnv):
    """Takes `close_seconds` to close (in its worker, where an async env closes it): a
    shutdown waits for it."""

    def __init__(self, pid_dir: str, close_seconds: float):
        super().__init__(pid_dir)
        self.close_seconds = close_seconds

    def close(self):
        time.sleep(self.close_seconds)
        super().close()


class RandomObservationEnv(gym.Env):
    """Random observations of any space; reward 1 when the action matches a bit of the
    observation, so the policy has something to learn; episodes of 8 steps."""

    action_space = gym.spaces.Discrete(2)

    def __init__(self, observation_space: gym.Space):
        # Its own copy: the space draws the observations, and envs in one process would
        # otherwise share (and reseed) one space's generator.
        self.observation_space = copy.deepcopy(observation_space)
        self.t = 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.observation_space.seed(int(self.np_random.integers(2**31)))
        self.t = 0
        self._obs = self.observation_space.sample()
        return self._obs, {}

    def step(self, action):
        first = next(iter(self._obs.values())) if isinstance(self._obs, dict) else self._obs
        target = int(np.asarray(first).reshape(-1)[0]) % 2
        self.t += 1
        self._obs = self.observation_space.sample()
        return self._obs, float(action == target), self.t >= 8, False, {}


class BadOutputEnv(CountingEnv):
    """A CountingEnv whose output goes wrong in one way (a key of BAD) at its `bad_at`-th
    step (0: its first reset) if it is env `bad_env` (the seed of its first reset), or
    every env with `bad_env` None. Episodes of `episode_length` steps."""

    BAD = {
        "four_values": lambda obs, r, term, trunc: (obs, r, term or trunc, {}),
        "reward_none": lambda obs, r, term, trunc: (obs, None, term, trunc, {}),
        "terminated_none": lambda obs, r, term, trunc: (obs, r, None, trunc, {}),
        "wrong_shape": lambda obs, r, term, trunc: (obs[:2], r, term, trunc, {}),
        "nan_observation": lambda obs, r, term, trunc: (
            np.array([obs[0], np.nan, obs[2]], np.float32), r, term, trunc, {}),
        "inf_reward": lambda obs, r, term, trunc: (obs, float("-inf"), term, trunc, {}),
        "huge_reward": lambda obs, r, term, trunc: (obs, 1e39, term, trunc, {}),
        "complex_observation": lambda obs, r, term, trunc: (
            obs.astype(np.complex64), r, term, trunc, {}),
        "observation_alone": None,  # reset returns the observation without its info
    }

    def __init__(self, kind: str, bad_at: int, bad_env: int | None = None,
                 episode_length: int = 1000):
        super().__init__(episode_length)
        self.kind, self.bad_at, self.bad_env = kind, bad_at, bad_env
        self.steps = 0

    def _bad_now(self) -> bool:
        return self.steps == self.bad_at and self.bad_env in (None, self.env_id)

    def reset(self, *, seed=None, options=None):
        obs, info = super().reset(seed=seed, options=options)
        if self.kind == "observation_alone" and self._bad_now():
            return obs
        return obs, info

    def step(self, action):
        self.steps += 1
        result = super().step(action)
        return self.BAD[self.kind](*result[:4]) if self._bad_now() else result


class ClosesIntoAFileEnv(CountingEnv):
    """Writes `path` when closed (in an async worker: proof that its own close ran)."""

    def __init__(self, path: str):
        super().__init__()
        self.path = path

    def close(self):
        with open(self.path, "w") as f:
            f.write(str(os.getpid()))
        super().close()


class SpaceByProcessClosesIntoADirEnv(SpaceByProcessEnv):
    """SpaceByProcessEnv (an async start that fails in the parent's check of the spaces,
    after every worker made its env) that writes a file named after its process in
    `directory` when closed."""

    def __init__(self, directory: str):
        super().__init__()
        self.directory = directory

    def close(self):
        with open(os.path.join(self.directory, str(os.getpid())), "w"):
            pass
        super().close()


class RaisesThenDiesInCloseEnv(CountingEnv):
    """Its step raises; its close then ends the process at once (as a simulator's crash
    in its own close would), before any thread of it can finish its work."""

    def step(self, action):
        raise EnvStepError("the simulator diverged")

    def close(self):
        if multiprocessing.parent_process() is not None:  # in a worker, not the parent's
            os._exit(3)  # probe of the spaces
        super().close()


class StuckStepEnv(CountingEnv):
    """Its steps never return."""

    def step(self, action):
        while True:
            time.sleep(1.0)


class FloatFramesEnv(gym.Env):
    """Observations in [0, 1) as float64 for a uint8 Box (an env that forgot to scale its
    frames back); with `size_one`, one value for a space of 4."""

    observation_space = gym.spaces.Box(0, 255, (4,), np.uint8)
    action_space = gym.spaces.Discrete(2)

    def __init__(self, size_one: bool = False):
        self.size_one = size_one

    def _obs(self):
        return np.full(1 if self.size_one else 4, 0.5)

    def reset(self, *, seed=None, options=None):
        return self._obs(), {}

    def step(self, action):
        return self._obs(), 0.0, False, False, {}


class SlowToMakeEnv(CountingEnv):
    """Takes a minute to make in an async worker (a simulator that does not start)."""

    def __init__(self):
        super().__init__()
        if multiprocessing.parent_process() is not None:
            time.sleep(60)


class PointAtTargetEnv(gym.Env):
    """One-step episodes: observe a target in [-1, 1], act in Box(low, high), and be paid
    minus the distance from the target to the action mapped linearly onto [-1, 1]. A
    policy that acts across the bounds learns it in a few thousand steps, whatever
    their scale."""

    observation_space = gym.spaces.Box(-1.0, 1.0, (1,), np.float32)

    def __init__(self, low: float = -1.0, high: float = 1.0):
        self.action_space = gym.spaces.Box(low, high, (1,), np.float32)
        self.low, self.high = low, high
        self.target = 0.0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.target = float(self.np_random.uniform(-1.0, 1.0))
        return np.array([self.target], np.float32), {}

    def step(self, action):
        mapped = 2.0 * (float(action[0]) - self.low) / (self.high - self.low) - 1.0
        return np.array([self.target], np.float32), -abs(mapped - self.target), True, False, {}
