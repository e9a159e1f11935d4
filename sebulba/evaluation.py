"""Acting-only evaluation of a policy: N episodes, their returns, optionally a video."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import gymnasium as gym
import jax
import jax.numpy as jnp
import numpy as np

from sebulba.agent import Agent
from sebulba.envs import registry
from sebulba.envs.base import close_all
from sebulba.envs.gymnasium_source import EnvFactory
from sebulba.types import Nets


@dataclasses.dataclass(frozen=True)
class EvaluationResult:
    returns: list[float]
    lengths: list[int]

    def as_dict(self) -> dict[str, Any]:
        r = np.asarray(self.returns)
        return {"episodes": len(r), "mean_return": float(r.mean()), "std_return": float(r.std()),
                "min_return": float(r.min()), "max_return": float(r.max()),
                "mean_length": float(np.mean(self.lengths))}


def evaluate(
    agent: Agent,
    nets: Nets,
    env: str | EnvFactory,
    num_episodes: int,
    *,
    greedy: bool = True,
    num_envs: int = 8,
    seed: int = 0,
    env_kwargs: Mapping[str, Any] | None = None,
    max_env_steps: int = 10_000_000,
    vectorization: str = "sync",
) -> EvaluationResult:
    """Runs `agent` (greedy or sampled) for `num_episodes` complete episodes.

    `nets` are the learner's networks (as a run or a checkpoint holds them); the agent
    acts on `agent.acting_nets(nets, 0)`, what the learner would publish.

    Each of the `min(num_envs, num_episodes)` envs runs a fixed number of complete
    episodes (the counts differ by at most one), decided before any episode ends, and
    the results are listed env by env. Taking the first `num_episodes` episodes to end,
    whichever env they ran in, would favour short episodes (in a cart-pole, the failures).
    `vectorization` is a single-agent kind that supports evaluation (its `evaluate_as` is
    not None) and whose source of one group returns every env of it at each recv:
    "sync", "envpool" (a pool whose batch is all its envs, returned in any order: rows
    are put in env order) or, for ids whose own vector env preprocesses (Atari),
    "vector_entry_point" (`evaluation_vectorization` names the one for a run's).
    """
    kind = registry.get(vectorization)
    if kind.multi_agent:
        raise ValueError(
            f"evaluate runs single-agent envs, so not vectorization {vectorization!r}: "
            "evaluating its policies is not supported yet")
    if kind.evaluate_as is None:
        raise ValueError(f"vectorization {vectorization!r} does not support evaluation "
                         "(its registry entry has evaluate_as=None)")
    if num_episodes < 1 or num_envs < 1:
        raise ValueError(f"num_episodes and num_envs must be >= 1, got {num_episodes}, {num_envs}")
    num_envs = min(num_envs, num_episodes)
    quota = np.full(num_envs, num_episodes // num_envs)
    quota[:num_episodes % num_envs] += 1
    per_env: list[list[tuple[float, int]]] = [[] for _ in range(num_envs)]
    act = jax.jit(agent.greedy_step if greedy else agent.step)
    nets = jax.jit(agent.acting_nets)(nets, jnp.zeros((), jnp.int32))
    # A source seeded when made (EnvPool) takes the seed here, the others at reset.
    sources = kind.make_sources(registry.SourceRequest(env, dict(env_kwargs or {}), num_envs,
                                                       seed=seed))
    try:
        source = _one_group(sources, vectorization, num_envs)
        source.reset(seed=seed)
        step_state = agent.new_step_state(nets, jax.random.key(seed), num_envs)
        env_ids = np.arange(num_envs)  # the rows acted on, in env order
        for _ in range(max_env_steps // num_envs + 1):
            ids, env_step, _ = source.recv()
            ended, env_step = _in_env_order(ids, env_step, vectorization)
            # The tracker lists ended episodes in the order of recv's rows.
            for i, episode in zip(ended, source.pop_episodes(), strict=True):
                if len(per_env[i]) < quota[i]:
                    per_env[i].append(episode)
            if all(len(eps) == q for eps, q in zip(per_env, quota, strict=True)):
                break
            output, step_state = act(step_state, nets, env_step)
            source.send(np.asarray(output.action), env_ids)
        else:
            done = sum(len(eps) for eps in per_env)
            raise RuntimeError(f"only {done} of {num_episodes} episodes ended within "
                               f"{max_env_steps} steps")
    finally:
        close_all(sources)
    ended = [episode for eps in per_env for episode in eps]
    return EvaluationResult([r for r, _ in ended], [n for _, n in ended])


def _one_group(sources: list, vectorization: str, num_envs: int):
    """The one source of one group of `num_envs` envs evaluation drives."""
    if len(sources) != 1 or sources[0].num_groups != 1 or sources[0].num_envs != num_envs:
        groups = sum(s.num_groups for s in sources)
        raise ValueError(
            f"evaluate drives one source of one group of {num_envs} envs, but vectorization "
            f"{vectorization!r} made {len(sources)} source(s) of {groups} group(s) in all")
    return sources[0]


def _in_env_order(ids: np.ndarray, env_step, vectorization: str):
    """(the envs whose episode ended in recv's rows, in row order; the rows in env order:
    row i is env i). A source of one group returns every env at each recv, in any order."""
    ids = np.asarray(ids)
    ended = ids[np.flatnonzero(np.asarray(env_step.terminated | env_step.truncated))]
    order = np.argsort(ids, kind="stable")
    if not np.array_equal(ids[order], np.arange(len(ids))):
        raise RuntimeError(f"vectorization {vectorization!r}'s recv returned envs "
                           f"{sorted(ids.tolist())}, not each of its group's envs once")
    if not np.array_equal(order, np.arange(len(ids))):
        env_step = jax.tree.map(lambda x: np.asarray(x)[order], env_step)
    return ended, env_step


def evaluation_vectorization(vectorization: str) -> str:
    """The vectorization that evaluates a policy trained with `vectorization`, in process
    and with the same spaces; ValueError where evaluation does not support it."""
    kind = registry.get(vectorization)
    if kind.evaluate_as is None:
        raise ValueError(f"evaluating policies of vectorization {vectorization!r} is not "
                         "supported yet")
    return kind.evaluate_as


def record_video(
    agent: Agent,
    nets: Nets,
    env_id: str,
    video_dir: str,
    *,
    greedy: bool = True,
    seed: int = 0,
    env_kwargs: Mapping[str, Any] | None = None,
) -> float:
    """Records one episode to `video_dir` (gymnasium's RecordVideo, written by moviepy).

    Returns the episode's return. The env must support render_mode="rgb_array".
    """
    def make():
        single = gym.make(env_id, render_mode="rgb_array", **(env_kwargs or {}))
        return gym.wrappers.RecordVideo(single, video_dir, episode_trigger=lambda i: i == 0,
                                        disable_logger=True)

    result = evaluate(agent, nets, make, 1, greedy=greedy, num_envs=1, seed=seed)
    return result.returns[0]
