"""Small Gymnasium envs that need memory, to tell recurrent agents from feed-forward ones.

Registered when this module is imported, which gymnasium does for an id written in
its `module:Id` form, so `import sebulba` registers nothing and these work with
`gymnasium.make_vec` and the launcher's --env, in subprocess workers too:

  gymnasium.make("sebulba.memory_envs:sebulba/CueRecall-v0")

  sebulba/CueRecall-v0           a cue at the first step, recalled `delay` steps later
  sebulba/CartPoleNoVelocity-v1  CartPole-v1 observing only cart position and pole angle
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium.envs.classic_control.cartpole import CartPoleEnv


class CueRecall(gym.Env):
    """Shows one of `num_cues` cues at step 0, then `delay` blank steps, then a query.

    Observation [num_cues + 1]: the one-hot cue at step 0, zeros while waiting, and a 1
    in the last entry at the query step. The action at the query step ends the episode
    with reward 1 if it names the cue, 0 otherwise; earlier actions do nothing. A policy
    without memory scores 1 / num_cues on average, a perfect one 1. Episodes last
    `delay + 2` steps (cue, delay blanks, query).
    """

    metadata: dict[str, Any] = {"render_modes": []}

    def __init__(self, num_cues: int = 2, delay: int = 5):
        if num_cues < 2:
            raise ValueError(f"num_cues must be >= 2, got {num_cues!r}")
        if delay < 0:
            raise ValueError(f"delay must be >= 0, got {delay!r}")
        self.num_cues, self.delay = num_cues, delay
        self.observation_space = gym.spaces.Box(0.0, 1.0, (num_cues + 1,), np.float32)
        self.action_space = gym.spaces.Discrete(num_cues)
        self._cue = 0
        self._t = 0

    def _obs(self) -> np.ndarray:
        obs = np.zeros(self.num_cues + 1, np.float32)
        if self._t == 0:
            obs[self._cue] = 1.0
        elif self._t == self.delay + 1:
            obs[-1] = 1.0
        return obs

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        self._cue = int(self.np_random.integers(self.num_cues))
        self._t = 0
        return self._obs(), {}

    def step(self, action):
        if self._t == self.delay + 1:  # the query step: this action is the answer
            reward = float(int(action) == self._cue)
            return self._obs(), reward, True, False, {}
        self._t += 1
        return self._obs(), 0.0, False, False, {}


class CartPoleNoVelocity(CartPoleEnv):
    """CartPole whose observation is [cart position, pole angle]: the velocities, which
    a policy needs, must be inferred from consecutive observations."""

    _KEPT = np.array([0, 2])

    def __init__(self, render_mode: str | None = None):
        super().__init__(render_mode=render_mode)
        high = self.observation_space.high[self._KEPT]
        self.observation_space = gym.spaces.Box(-high, high, dtype=np.float32)

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        obs, info = super().reset(seed=seed, options=options)
        return obs[self._KEPT], info

    def step(self, action):
        obs, reward, terminated, truncated, info = super().step(action)
        return obs[self._KEPT], reward, terminated, truncated, info


def _register() -> None:
    registry = gym.envs.registration.registry
    if "sebulba/CueRecall-v0" not in registry:
        gym.register("sebulba/CueRecall-v0", entry_point=f"{__name__}:CueRecall")
    if "sebulba/CartPoleNoVelocity-v1" not in registry:
        gym.register("sebulba/CartPoleNoVelocity-v1",
                     entry_point=f"{__name__}:CartPoleNoVelocity",
                     max_episode_steps=500, reward_threshold=475.0)


_register()

# The ids in `module:Id` form, which import this module (and so register the envs).
CUE_RECALL = f"{__name__}:sebulba/CueRecall-v0"
CARTPOLE_NO_VELOCITY = f"{__name__}:sebulba/CartPoleNoVelocity-v1"
