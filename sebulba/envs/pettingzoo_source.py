"""Multi-agent envs: PettingZoo Parallel envs as an env source of agent rows.

An env with K agents (PettingZoo's `possible_agents`) gives K rows, env-major: row
`i * K + j` is agent j of env i. The rest of the framework sees a group of N envs as
N x K acting streams, exactly as it sees N single-agent envs, so agents, trajectories,
`shard_step_state` and the learner need no multi-agent code; a single-agent env is the
case K = 1.

Episodes follow Gymnasium's NEXT_STEP autoreset, per env: once every agent of an env
has left its episode (PettingZoo's `agents` is empty), the next send resets that env,
and its rows start with `first` and a zero reward. An agent that leaves before the
others (its row terminated or truncated while the env goes on) is *padding* until the
reset: its rows hold a zero observation and are marked `first` and `terminated`, so
every agent's loss masks them (an action at a last step is ignored; see
`agents.common.returns.action_mask`), no return crosses them, and no recurrent state
carries over. Padding steps are counted apart (`ParallelEnvSource.padding_steps`).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

import gymnasium as gym
import numpy as np

from sebulba.envs import observations
from sebulba.envs.base import action_to_env, check_spaces, close_all, close_quietly
from sebulba.envs.output_checks import (
    REWARD_LIMIT,
    BadEnvOutput,
    BatchCheck,
    ObservationForm,
    bad_output,
    env_name,
    fields_ok,
    first_field_problem,
    reset_problem,
    step_problem,
)
from sebulba.types import EnvSpec, EnvStep

ParallelEnvFactory = Callable[[], Any]


def check_env(env: str) -> None:
    """ValueError naming `env` unless it is an importable module (PettingZoo's convention:
    one env per module, `mpe2.simple_spread_v3`)."""
    try:
        importlib.import_module(env)
    except ImportError as e:
        raise ValueError(
            f"env {env!r} is not an importable PettingZoo env module (e.g. "
            f"'mpe2.simple_spread_v3'): importing {env!r} failed: {e}") from None


def make_parallel_env(env: str | ParallelEnvFactory,
                      env_kwargs: Mapping[str, Any] | None = None) -> Any:
    """One PettingZoo Parallel env: `env` is a module following PettingZoo's convention
    (`mpe2.simple_spread_v3`, whose `parallel_env(**env_kwargs)` makes one) or a factory."""
    if isinstance(env, str):
        try:
            module = importlib.import_module(env)
        except ImportError as e:
            raise ValueError(
                f"vectorization 'pettingzoo' needs a module with a parallel_env() function "
                f"(e.g. 'mpe2.simple_spread_v3'); importing {env!r} failed: {e}") from None
        if not callable(getattr(module, "parallel_env", None)):
            raise ValueError(f"module {env!r} has no parallel_env() function, so it is not a "
                             "PettingZoo env module")
        parallel = module.parallel_env(**(env_kwargs or {}))
    else:
        if env_kwargs:
            raise ValueError(f"env_kwargs {dict(env_kwargs)!r} given with the factory {env!r}; "
                             "bind them in the factory")
        parallel = env()
    try:
        _check_parallel(parallel, env)
    except TypeError:
        close_quietly([parallel], "the refused env")  # made, so it may hold a process
        raise
    return parallel


def _check_parallel(parallel: Any, env: Any) -> None:
    from pettingzoo import ParallelEnv

    if not isinstance(parallel, ParallelEnv):
        kind = "an AEC env: convert it with pettingzoo.utils.aec_to_parallel" if hasattr(
            parallel, "agent_iter") else f"a {type(parallel).__name__}"
        raise TypeError(f"env {env!r} made {kind}, not a PettingZoo ParallelEnv")


def parallel_env_spec(env: str | ParallelEnvFactory,
                      env_kwargs: Mapping[str, Any] | None = None,
                      agent_ids: bool = False) -> EnvSpec:
    """The spec of a PettingZoo Parallel env: one agent's spaces and K agents per env.

    Every agent must have the same spaces (one shared policy acts for all of them).
    With `agent_ids` the observation is a flat Box extended by a one-hot of the agent.
    """
    parallel = make_parallel_env(env, env_kwargs)
    try:
        agents = list(parallel.possible_agents)
        if not agents:
            raise ValueError(f"env {env!r} has no possible_agents")
        obs_space = parallel.observation_space(agents[0])
        action_space = parallel.action_space(agents[0])
        for agent in agents[1:]:
            if (parallel.observation_space(agent) != obs_space
                    or parallel.action_space(agent) != action_space):
                raise ValueError(
                    f"env {env!r}: agent {agent!r} has observation space "
                    f"{parallel.observation_space(agent)} and action space "
                    f"{parallel.action_space(agent)}, but {agents[0]!r} has {obs_space} and "
                    f"{action_space}; sebulba needs every agent of an env to share its "
                    "spaces (one shared policy); pad them to common spaces")
        if agent_ids:
            obs_space = with_agent_id_space(obs_space, len(agents))
        check_spaces(obs_space, action_space)
        return EnvSpec(obs_space, action_space, agents_per_env=len(agents))
    finally:
        parallel.close()


def with_agent_id_space(space: gym.Space, num_agents: int) -> gym.spaces.Box:
    """A flat Box observation space extended by a one-hot of `num_agents` agents."""
    if not (isinstance(space, gym.spaces.Box) and len(space.shape) == 1):
        raise ValueError(f"agent_ids appends a one-hot to flat Box observations, got {space}")
    low = np.concatenate([space.low, np.zeros(num_agents, space.dtype)])
    high = np.concatenate([space.high, np.ones(num_agents, space.dtype)])
    return gym.spaces.Box(low, high, dtype=space.dtype)


class ParallelEnvSource:
    """N PettingZoo Parallel envs of K agents as one group of N x K rows, env-major.

    The env-source interface of `sebulba.envs.VectorEnvSource`: recv returns every row
    in order. `padding_steps` counts the row steps of agents that had left their episode
    while their env went on; `pop_team_episodes()` returns the (team return, length) of
    the env episodes that ended since the last call, the team return being the sum of
    the env's agents' returns.
    """

    num_groups = 1
    in_order = True

    def __init__(self, envs: list[Any], agent_ids: bool = False, check_output: bool = False,
                 env: str | ParallelEnvFactory | None = None):
        if not envs:
            raise ValueError("ParallelEnvSource needs at least one env")
        self.envs = envs
        self.agents = list(envs[0].possible_agents)
        k = self.agents_per_env = len(self.agents)
        self.num_envs = self.group_size = len(envs) * k
        self._ids = np.arange(self.num_envs)
        space = envs[0].observation_space(self.agents[0])
        self._obs_shape, self._obs_dtype = space.shape, observations.host_dtype(space)
        self._one_hot = np.eye(k, dtype=self._obs_dtype) if agent_ids else None
        self._to_env = action_to_env(envs[0].action_space(self.agents[0]))
        rows = self.num_envs
        self._live = np.zeros(rows, bool)  # the row's agent is in its env's episode
        self._needs_reset = np.ones(len(envs), bool)
        self._returns = np.zeros(rows, np.float64)
        self._lengths = np.zeros(rows, np.int64)
        self._env_lengths = np.zeros(len(envs), np.int64)
        # each env episode's team return: its agents' rewards, whoever left or re-joined
        self._team_returns = np.zeros(len(envs), np.float64)
        self._acted = False
        self._result: tuple | None = None
        self._ended: list[tuple[float, int]] = []
        self._team_ended: list[tuple[int, float, int, np.ndarray]] = []
        self.padding_steps = 0
        # With `check_output`: each agent's fields as they leave its env, and the rows
        # recv returns (`output_checks`); None: no check at all.
        self._name = env_name(env) if env is not None else repr(envs[0])
        self._check = BatchCheck(
            self._name, with_agent_id_space(space, k) if agent_ids else space, rows,
            self._place,
        ) if check_output else None
        self._zero_obs = np.zeros(self._obs_shape, self._obs_dtype)  # a left agent's
        self._obs_form = ObservationForm(space)

    def _place(self, row: int, agent: bool = True) -> str:
        """Row `row`'s agent (or, with `agent` False, its env), named for an error."""
        k, num = self.agents_per_env, len(self.envs)
        env = f"env {row // k} of the {num} in its group"
        return f"agent {self.agents[row % k]!r} of {env}, row {row}" if agent else env

    def _raise_bad(self, row: int, field: str, problem: str, agent: bool = True) -> None:
        raise bad_output(self._name, self._place(row, agent), self._check.step(0),
                         field, problem)

    def _broken_contract(self, row: int, field: str, problem: str) -> BadEnvOutput:
        """An env output no reading of PettingZoo's Parallel API allows, caught whether or
        not the output checks are on (the rows would go wrong without an error); the
        step is the env episode's."""
        return bad_output(self._name, self._place(row),
                          int(self._env_lengths[row // self.agents_per_env]), field, problem)

    def _observation(self, row: int, env_obs: dict, agent: str, when: str) -> Any:
        """Row `row`'s agent's observation, which it must have: it is in `env.agents`."""
        if agent not in env_obs:
            raise self._broken_contract(
                row, "observation", f"is missing {when}, though {agent!r} is in the env's "
                "agents (a Parallel env observes each of its agents)")
        return env_obs[agent]

    def _check_result(self, row: int, result: Any, step: bool) -> None:
        """BadEnvOutput unless a step's (or reset's) result has gymnasium's form, with
        dicts by agent (the env of row `row`)."""
        problem = step_problem(result) if step else reset_problem(result)
        if problem is None and not all(isinstance(x, dict) for x in result[:4 if step else 1]):
            problem = (f"holds {[type(x).__name__ for x in result]}; a Parallel env returns "
                       "a dict by agent for each field")
        if problem is not None:
            self._raise_bad(row, f"{'step' if step else 'reset'}'s result", problem,
                            agent=False)

    def _check_agent(self, row: int, env_obs: dict, env_reward: dict, env_term: dict,
                     env_trunc: dict) -> None:
        """BadEnvOutput unless row `row`'s agent's fields are ones the rows can hold (a
        field the env leaves out is the default the loop fills in)."""
        agent = self.agents[row % self.agents_per_env]
        fields = (env_obs.get(agent, self._zero_obs), env_reward.get(agent, 0.0),
                  env_term.get(agent, False), env_trunc.get(agent, False))
        # The reward's range too: the batch's check sees a row's reward, not one that goes
        # to the team only (an agent's at the step it joins).
        if not (fields_ok(*fields, self._obs_form)
                and -REWARD_LIMIT <= fields[1] <= REWARD_LIMIT):
            bad = first_field_problem(*fields, self._obs_form)
            if bad is not None:
                self._raise_bad(row, *bad)

    def reset(self, seed: int) -> None:
        self._ended.clear()  # episodes of the envs before the reset, never popped
        self._team_ended.clear()
        obs = np.zeros((self.num_envs, *self._obs_shape), self._obs_dtype)
        first = np.zeros(self.num_envs, bool)
        terminated = np.zeros(self.num_envs, bool)
        for i, env in enumerate(self.envs):
            self._reset_env(i, env, seed + i, obs, first, terminated)
        truncated = np.zeros(self.num_envs, bool)
        self._result = (obs, np.zeros(self.num_envs, np.float32), terminated, truncated, first)

    def _reset_env(self, i: int, env: Any, seed: int | None, obs: np.ndarray,
                   first: np.ndarray, terminated: np.ndarray) -> None:
        """Env i's rows after a reset: its agents start; an agent the env does not field
        at the reset (it may join later) is padding."""
        result = env.reset(seed=seed)
        k = self.agents_per_env
        if self._check is not None:
            self._check_result(i * k, result, step=False)
            for j, agent in enumerate(self.agents):
                if agent in env.agents:  # the others' entries, if any, are never read
                    self._check_agent(i * k + j, result[0], {}, {}, {})
        env_obs, _ = result
        rows = slice(i * k, (i + 1) * k)
        for j, agent in enumerate(self.agents):
            row = i * k + j
            self._live[row] = agent in env.agents
            if self._live[row]:
                obs[row] = self._observation(row, env_obs, agent, "at the reset")
            else:
                terminated[row] = True
                self.padding_steps += self._acted  # steps are counted once acting began
        first[rows] = True
        self._returns[rows] = 0.0
        self._lengths[rows] = 0
        self._team_returns[i] = 0.0
        self._env_lengths[i] = 0
        self._needs_reset[i] = False

    def recv(self) -> tuple[np.ndarray, EnvStep, int]:
        obs, reward, terminated, truncated, first = self._result
        if self._one_hot is not None:
            obs = np.concatenate([obs, np.tile(self._one_hot, (len(self.envs), 1))], axis=1)
        steps = self.num_envs if self._acted else 0
        env_step = EnvStep(obs, reward, terminated, truncated, first)
        if self._check is not None:
            self._check(env_step)
        return self._ids, env_step, steps

    def pop_episodes(self) -> list[tuple[float, int]]:
        ended, self._ended = self._ended, []
        return ended

    def pop_team_episodes(self) -> list[tuple[float, int]]:
        return [(ret, length) for _, ret, length, _ in self.pop_env_episodes()]

    def pop_env_episodes(self) -> list[tuple[int, float, int, np.ndarray]]:
        """(env, team return, length, each agent's return [K]) of the env episodes that
        ended since the last call (an agent's return counts from when it last joined)."""
        ended, self._team_ended = self._team_ended, []
        return ended

    def render(self) -> np.ndarray | None:
        """The first env's frame (envs made with render_mode="rgb_array"), else None."""
        env = self.envs[0]
        return (np.asarray(env.render()) if getattr(env, "render_mode", None) == "rgb_array"
                else None)

    def send(self, actions: np.ndarray, ids: np.ndarray) -> None:
        actions = self._to_env(np.asarray(actions), ids)
        k, rows = self.agents_per_env, self.num_envs
        obs = np.zeros((rows, *self._obs_shape), self._obs_dtype)
        reward = np.zeros(rows, np.float32)
        terminated = np.zeros(rows, bool)
        truncated = np.zeros(rows, bool)
        first = np.zeros(rows, bool)
        for i, env in enumerate(self.envs):
            if self._needs_reset[i]:
                self._reset_env(i, env, None, obs, first, terminated)
                continue
            base = i * k
            was_live = self._live[base:base + k].copy()
            result = env.step(
                {a: actions[base + j] for j, a in enumerate(self.agents) if was_live[j]})
            if self._check is not None:
                self._check_result(base, result, step=True)
            env_obs, env_reward, env_term, env_trunc, _ = result
            self._env_lengths[i] += 1
            for j, agent in enumerate(self.agents):
                row = base + j
                present = agent in env.agents
                if self._check is not None and (was_live[j] or present):
                    # (an agent gone before this step: its entries, if any, are not read)
                    self._check_agent(row, env_obs, env_reward, env_term, env_trunc)
                if not was_live[j]:
                    if present:  # joined the running episode: it starts here
                        obs[row] = self._observation(row, env_obs, agent, "as it joins")
                        first[row] = self._live[row] = True
                        self._returns[row] = self._lengths[row] = 0
                        # A reward at its joining step is the team's (its row's is 0).
                        self._team_returns[i] += float(env_reward.get(agent, 0.0))
                    else:  # padding until its env resets
                        first[row] = terminated[row] = True
                        self.padding_steps += 1
                    continue
                term, trunc = env_term.get(agent, False), env_trunc.get(agent, False)
                if present and (term or trunc):
                    raise self._broken_contract(
                        row, "agents", f"still hold {agent!r}, whose episode the step ended "
                        "(terminations or truncations): a Parallel env removes an agent "
                        "whose episode ended from env.agents")
                if present:
                    obs[row] = self._observation(row, env_obs, agent, "after the step")
                elif agent in env_obs:  # PettingZoo envs may omit a leaving agent's
                    obs[row] = env_obs[agent]  # last observation: zeros then
                reward[row] = env_reward.get(agent, 0.0)
                terminated[row] = term
                # an agent gone without either flag is treated as truncated
                truncated[row] = not term and (trunc or not present)
                self._returns[row] += reward[row]
                self._lengths[row] += 1
                if terminated[row] or truncated[row]:
                    self._live[row] = False
                    self._ended.append((float(self._returns[row]), int(self._lengths[row])))
            self._team_returns[i] += float(reward[base:base + k].sum())
            if not env.agents:
                self._needs_reset[i] = True
                self._team_ended.append((i, float(self._team_returns[i]),
                                         int(self._env_lengths[i]),
                                         self._returns[base:base + k].copy()))
        self._acted = True
        self._result = (obs, reward, terminated, truncated, first)

    def close(self) -> None:
        close_parallel_envs(self.envs)


def close_parallel_envs(envs: list[Any]) -> None:
    """Closes every env, even if closing one raises (the first error is re-raised)."""
    close_all(envs)


def make_parallel_envs(env: str | ParallelEnvFactory, env_kwargs: Mapping[str, Any] | None,
                       num_envs: int) -> list[Any]:
    """`num_envs` Parallel envs; those made before one fails are closed."""
    envs: list[Any] = []
    try:
        for _ in range(num_envs):
            envs.append(make_parallel_env(env, env_kwargs))
    except BaseException:
        close_parallel_envs(envs)
        raise
    return envs
