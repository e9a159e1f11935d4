"""Small Gymnasium envs that need memory (ids and optima: `sebulba.envs.suite`)."""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium.envs.classic_control.cartpole import CartPoleEnv
from gymnasium.envs.classic_control.pendulum import PendulumEnv


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


def _check_int(name: str, value: Any, minimum: int, why: str = "") -> int:
    """`value` as an int, or a ValueError naming the argument, its value and the need."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name}={value!r} must be an int >= {minimum}{why}")
    return int(value)


def _check_step(t: int, episode_length: int) -> None:
    if t >= episode_length:
        raise RuntimeError(f"the episode has ended after {episode_length} steps: call reset()")


class RepeatFirst(gym.Env):
    """Shows one of `num_symbols` symbols at step 0; every action must name it.

    Observation [num_symbols]: the one-hot symbol at step 0, zeros at every later step
    (and in the final observation). Action: Discrete(num_symbols), a symbol. Reward:
    1 / episode_length for each step whose action names the first symbol, 0 otherwise.
    Episodes last exactly `episode_length` steps (default 50) and then terminate.

    Optimum 1.0 (up to float rounding). Chance: a memoryless policy can answer step 0 from
    the observation, but afterwards sees only zeros and is right 1 / num_symbols of the
    time, so it scores (1 + (episode_length - 1) / num_symbols) / episode_length on
    average: 0.265 at the defaults, (1 + 49 / 4) / 50.
    """

    metadata: dict[str, Any] = {"render_modes": []}

    def __init__(self, num_symbols: int = 4, episode_length: int = 50):
        self.num_symbols = _check_int("num_symbols", num_symbols, 2)
        self.episode_length = _check_int("episode_length", episode_length, 1)
        self.observation_space = gym.spaces.Box(0.0, 1.0, (self.num_symbols,), np.float32)
        self.action_space = gym.spaces.Discrete(self.num_symbols)
        self._symbol = 0
        self._t = self.episode_length  # stepping before reset() is an error

    def _obs(self) -> np.ndarray:
        obs = np.zeros(self.num_symbols, np.float32)
        if self._t == 0:
            obs[self._symbol] = 1.0
        return obs

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        self._symbol = int(self.np_random.integers(self.num_symbols))
        self._t = 0
        return self._obs(), {}

    def step(self, action):
        _check_step(self._t, self.episode_length)
        reward = 1.0 / self.episode_length if int(action) == self._symbol else 0.0
        self._t += 1
        return self._obs(), reward, self._t == self.episode_length, False, {}


class _SymbolStream(gym.Env):
    """An episode of `episode_length` symbols drawn uniformly from `num_symbols`, shown one
    per step as one-hots (zeros once the episode is over); subclasses score the actions."""

    metadata: dict[str, Any] = {"render_modes": []}

    def __init__(self, num_symbols: int, episode_length: int):
        self.num_symbols = _check_int("num_symbols", num_symbols, 2)
        self.episode_length = _check_int("episode_length", episode_length, 1)
        self.observation_space = gym.spaces.Box(0.0, 1.0, (self.num_symbols,), np.float32)
        self._symbols = np.zeros(self.episode_length, np.int64)
        self._t = self.episode_length  # stepping before reset() is an error

    def _obs(self) -> np.ndarray:
        obs = np.zeros(self.num_symbols, np.float32)
        if self._t < self.episode_length:
            obs[self._symbols[self._t]] = 1.0
        return obs

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        self._symbols = self.np_random.integers(self.num_symbols, size=self.episode_length)
        self._t = 0
        return self._obs(), {}


class RepeatPrevious(_SymbolStream):
    """Shows a fresh random symbol every step; the action must name the one shown k steps ago.

    Observation [num_symbols]: the one-hot symbol s_t drawn uniformly at random at each step
    t (the final observation is zeros). Action: Discrete(num_symbols); at step t >= k it
    must name s_{t-k}, and earns 1 / (episode_length - k) if it does, 0 otherwise; the
    actions at steps t < k are ignored (reward 0). Episodes last exactly `episode_length`
    steps (default 50; k defaults to 4) and then terminate.

    Optimum 1.0 (up to float rounding). Chance 1 / num_symbols (0.25 at the defaults): the
    current observation is independent of s_{t-k}, so any memoryless policy names it with
    probability 1 / num_symbols at each rewarded step.
    """

    def __init__(self, num_symbols: int = 4, k: int = 4, episode_length: int = 50):
        super().__init__(num_symbols, episode_length)
        self.k = _check_int("k", k, 1, " (with k=0 the task needs no memory)")
        if self.k >= self.episode_length:
            raise ValueError(f"k={self.k} must be less than episode_length="
                             f"{self.episode_length}: no step would be rewarded")
        self.action_space = gym.spaces.Discrete(self.num_symbols)

    def step(self, action):
        _check_step(self._t, self.episode_length)
        reward = 0.0
        if self._t >= self.k and int(action) == self._symbols[self._t - self.k]:
            reward = 1.0 / (self.episode_length - self.k)
        self._t += 1
        return self._obs(), reward, self._t == self.episode_length, False, {}


class CountRecall(_SymbolStream):
    """Shows a random symbol every step; the action must report how often symbol 0 came.

    Observation [num_symbols]: the one-hot symbol drawn uniformly at random at each step
    (default 2 symbols; the final observation is zeros). Action: Discrete(max_count + 1);
    at step t it must name the number of times symbol 0 has been shown in the episode so
    far, the current observation included, capped at `max_count`. Reward 1 / episode_length
    per correct step, 0 otherwise. Episodes last exactly `episode_length` steps (default
    20) and then terminate. `max_count` defaults to `episode_length`, so the cap never
    binds and every count has its own action.

    Optimum 1.0 (up to float rounding). Chance with the cap not binding: the best memoryless
    policy answers as if the episode had just begun (1 for symbol 0, else 0), right up to
    and including the first symbol 0, and scores (1 - (1 - 1/num_symbols)^episode_length) *
    num_symbols / episode_length: 0.09999990 at the defaults, (1 - 2^-20) / 10. A uniformly
    random policy scores 1 / (max_count + 1) (1/21). A small cap makes guessing easier (with
    max_count=5 the best memoryless policy scores about 0.550 at the other defaults).
    """

    def __init__(self, num_symbols: int = 2, episode_length: int = 20,
                 max_count: int | None = None):
        super().__init__(num_symbols, episode_length)
        self.max_count = (self.episode_length if max_count is None
                          else _check_int("max_count", max_count, 1))
        self.action_space = gym.spaces.Discrete(self.max_count + 1)
        self._answers = np.zeros(self.episode_length, np.int64)

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        obs, info = super().reset(seed=seed, options=options)
        self._answers = np.minimum(np.cumsum(self._symbols == 0), self.max_count)
        return obs, info

    def step(self, action):
        _check_step(self._t, self.episode_length)
        correct = int(action) == self._answers[self._t]
        reward = 1.0 / self.episode_length if correct else 0.0
        self._t += 1
        return self._obs(), reward, self._t == self.episode_length, False, {}


class RepeatFirstContinuous(gym.Env):
    """Shows a random vector at step 0; every action must name its sign pattern.

    Observation [dim + 1]: at step 0 a vector x drawn uniformly from [-1, 1]^dim followed
    by a flag 1.0; zeros at every later step (and in the final observation). Action:
    Discrete(2^dim), the sign pattern sum_i 2^i * [x_i > 0] (x_i as observed, in float32).
    Reward 1 / episode_length for each step whose action names the pattern, 0 otherwise.
    Episodes last exactly `episode_length` steps (default 50; dim defaults to 2) and then
    terminate.

    Optimum 1.0 (up to float rounding). Chance: a memoryless policy can answer step 0 but
    afterwards sees only zeros and is right 2^-dim of the time, so it scores
    (1 + (episode_length - 1) / 2^dim) / episode_length on average: 0.265 at the defaults.
    """

    metadata: dict[str, Any] = {"render_modes": []}

    MAX_DIM = 30  # 2^dim actions

    def __init__(self, dim: int = 2, episode_length: int = 50):
        self.dim = _check_int("dim", dim, 1)
        if self.dim > self.MAX_DIM:
            raise ValueError(f"dim={self.dim} must be <= {self.MAX_DIM}: the actions are "
                             f"the 2^dim sign patterns")
        self.episode_length = _check_int("episode_length", episode_length, 1)
        self.observation_space = gym.spaces.Box(-1.0, 1.0, (self.dim + 1,), np.float32)
        self.action_space = gym.spaces.Discrete(2 ** self.dim)
        self._x = np.zeros(self.dim, np.float32)
        self._pattern = 0
        self._t = self.episode_length  # stepping before reset() is an error

    def _obs(self) -> np.ndarray:
        if self._t == 0:
            return np.append(self._x, np.float32(1.0))
        return np.zeros(self.dim + 1, np.float32)

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        self._x = self.np_random.uniform(-1.0, 1.0, self.dim).astype(np.float32)
        self._pattern = int(np.sum((self._x > 0) << np.arange(self.dim)))
        self._t = 0
        return self._obs(), {}

    def step(self, action):
        _check_step(self._t, self.episode_length)
        reward = 1.0 / self.episode_length if int(action) == self._pattern else 0.0
        self._t += 1
        return self._obs(), reward, self._t == self.episode_length, False, {}


class PendulumNoVelocity(PendulumEnv):
    """Pendulum-v1 (a torque in [-2, 2]) whose observation is [cos(angle), sin(angle)]:
    the angular velocity, which swinging up needs, must be inferred from consecutive
    observations."""

    def __init__(self, render_mode: str | None = None, g: float = 10.0):
        super().__init__(render_mode=render_mode, g=g)
        self.observation_space = gym.spaces.Box(-1.0, 1.0, (2,), np.float32)

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        obs, info = super().reset(seed=seed, options=options)
        return obs[:2], info

    def step(self, action):
        obs, reward, terminated, truncated, info = super().step(action)
        return obs[:2], reward, terminated, truncated, info


def _register() -> None:
    registry = gym.envs.registration.registry
    if "sebulba/CueRecall-v0" not in registry:
        gym.register("sebulba/CueRecall-v0", entry_point=f"{__name__}:CueRecall")
    if "sebulba/PendulumNoVelocity-v1" not in registry:
        gym.register("sebulba/PendulumNoVelocity-v1",
                     entry_point=f"{__name__}:PendulumNoVelocity", max_episode_steps=200)
    if "sebulba/CartPoleNoVelocity-v1" not in registry:
        gym.register("sebulba/CartPoleNoVelocity-v1",
                     entry_point=f"{__name__}:CartPoleNoVelocity",
                     max_episode_steps=500, reward_threshold=475.0)
    # These end themselves (terminated) after their episode_length: no TimeLimit.
    for name in ("RepeatFirst", "RepeatPrevious", "CountRecall", "RepeatFirstContinuous"):
        if f"sebulba/{name}-v0" not in registry:
            gym.register(f"sebulba/{name}-v0", entry_point=f"{__name__}:{name}")


_register()

