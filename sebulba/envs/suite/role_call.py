"""RoleCall: a cooperative PettingZoo Parallel env with a known optimum whose agents must
take different roles, for fast tests.

K agents see the same symbol s in {0, .., K-1} (a one-hot) at every step; agent i's
right answer is (s + i) mod K, so the agents must answer differently from one another
and one shared policy can only do it if it knows which agent it acts for
(`Config.agent_ids`). Each agent's reward mixes its own and the team's success, as
MPE's `local_ratio` does: `local_ratio` x (1 if it answered right) + (1 - local_ratio)
x (the fraction of the agents acting at that step that answered right), divided by the
episode length. An episode of `episode_length` steps is therefore worth at most 1.0 to
each agent (and K to the team); answering uniformly at random is worth 1/K.

`local_ratio` is 0.5 by default, as in MPE's simple_spread: half of each agent's reward
is the team's, so an agent's return also moves with the others' answers (the credit
assignment a cooperative task poses), half its own (so one shared policy learns it in a
few hundred thousand agent steps). 1 credits each agent with its own answer only; 0
gives every agent the team's reward alone (benchmarks/RESULTS.md, "Multi-agent").

With `leave_after` = n, the last agent leaves the episode (terminated) after n steps
while the others go on: the case of agents leaving early that the framework masks.

`parallel_env(**kwargs)` makes one, following PettingZoo's module convention, so
`Config(env="sebulba.envs.suite.role_call", vectorization="pettingzoo")` runs it.
"""

from __future__ import annotations

import gymnasium as gym
import numpy as np
from pettingzoo import ParallelEnv


class RoleCall(ParallelEnv):
    metadata = {"name": "role_call_v0", "render_modes": []}
    render_mode = None

    def __init__(self, num_agents: int = 3, episode_length: int = 16,
                 leave_after: int | None = None, local_ratio: float = 0.5):
        if num_agents < 2:
            raise ValueError(f"RoleCall needs num_agents >= 2, got {num_agents}")
        if episode_length < 1:
            raise ValueError(f"RoleCall needs episode_length >= 1, got {episode_length}")
        if leave_after is not None and not 1 <= leave_after < episode_length:
            raise ValueError(f"leave_after must be in [1, episode_length={episode_length}), "
                             f"got {leave_after}")
        if not 0.0 <= local_ratio <= 1.0:
            raise ValueError(f"local_ratio must be in [0, 1], got {local_ratio}")
        self.local_ratio = local_ratio
        self.possible_agents = [f"agent_{i}" for i in range(num_agents)]
        self.agents: list[str] = []
        self.episode_length, self.leave_after = episode_length, leave_after
        self._observation_space = gym.spaces.Box(0.0, 1.0, (num_agents,), np.float32)
        self._action_space = gym.spaces.Discrete(num_agents)
        self._rng = np.random.default_rng()
        self._symbol = 0
        self._t = 0

    def observation_space(self, agent: str) -> gym.spaces.Box:
        return self._observation_space

    def action_space(self, agent: str) -> gym.spaces.Discrete:
        return self._action_space

    def _observations(self) -> dict[str, np.ndarray]:
        one_hot = np.eye(len(self.possible_agents), dtype=np.float32)[self._symbol]
        return {a: one_hot for a in self.agents}

    def reset(self, seed: int | None = None, options: dict | None = None):
        if seed is not None:
            self._rng = np.random.default_rng(seed)
        self.agents = list(self.possible_agents)
        self._t = 0
        self._symbol = int(self._rng.integers(len(self.possible_agents)))
        return self._observations(), {a: {} for a in self.agents}

    def step(self, actions: dict[str, int]):
        k = len(self.possible_agents)
        right = {a: float(int(actions[a]) == (self._symbol + self.possible_agents.index(a)) % k)
                 for a in self.agents}
        team = float(np.mean(list(right.values())))
        self._t += 1
        self._symbol = int(self._rng.integers(k))
        acting = list(self.agents)
        truncated = self._t >= self.episode_length
        terminations = {a: False for a in acting}
        if self.leave_after is not None and self._t == self.leave_after:
            terminations[self.possible_agents[-1]] = True
        observations = {a: np.eye(k, dtype=np.float32)[self._symbol] for a in acting}
        rewards = {a: (self.local_ratio * right[a] + (1.0 - self.local_ratio) * team)
                   / self.episode_length for a in acting}
        truncations = {a: truncated for a in acting}
        infos = {a: {} for a in acting}
        self.agents = [a for a in acting if not (terminations[a] or truncations[a])]
        return observations, rewards, terminations, truncations, infos


def parallel_env(**kwargs) -> RoleCall:
    return RoleCall(**kwargs)
