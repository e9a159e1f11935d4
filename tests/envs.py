"""Small real gymnasium envs for tests: counting, faulty and slow ones."""

from __future__ import annotations

import copy
import os
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
