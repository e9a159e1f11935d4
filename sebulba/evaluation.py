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
    `vectorization` is a kind whose envs step in order: "sync" or, for ids whose own
    vector env preprocesses (Atari), "vector_entry_point" (`evaluation_vectorization`
    names the one for a run's).
    """
    kind = registry.get(vectorization)
    if kind.multi_agent or not kind.steps_in_order:
        raise ValueError(
            f"evaluate runs single-agent envs that step in order, so not vectorization "
            f"{vectorization!r}: evaluating its policies is not supported yet")
    if num_episodes < 1 or num_envs < 1:
        raise ValueError(f"num_episodes and num_envs must be >= 1, got {num_episodes}, {num_envs}")
    num_envs = min(num_envs, num_episodes)
    quota = np.full(num_envs, num_episodes // num_envs)
    quota[:num_episodes % num_envs] += 1
    per_env: list[list[tuple[float, int]]] = [[] for _ in range(num_envs)]
    act = jax.jit(agent.greedy_step if greedy else agent.step)
    nets = jax.jit(agent.acting_nets)(nets, jnp.zeros((), jnp.int32))
    sources = kind.make_sources(registry.SourceRequest(env, dict(env_kwargs or {}), num_envs))
    try:
        (source,) = sources
        source.reset(seed=seed)
        ids, env_step, _ = source.recv()
        step_state = agent.new_step_state(nets, jax.random.key(seed), num_envs)
        for _ in range(max_env_steps // num_envs):
            output, step_state = act(step_state, nets, env_step)
            source.send(np.asarray(output.action), ids)
            _, env_step, _ = source.recv()
            finished = source.pop_episodes()
            if finished:  # the tracker lists ended episodes in env order
                ended_envs = np.flatnonzero(np.asarray(env_step.terminated | env_step.truncated))
                for i, episode in zip(ended_envs, finished, strict=True):
                    if len(per_env[i]) < quota[i]:
                        per_env[i].append(episode)
                if all(len(eps) == q for eps, q in zip(per_env, quota, strict=True)):
                    break
        else:
            done = sum(len(eps) for eps in per_env)
            raise RuntimeError(f"only {done} of {num_episodes} episodes ended within "
                               f"{max_env_steps} steps")
    finally:
        registry.close_all(sources)
    ended = [episode for eps in per_env for episode in eps]
    return EvaluationResult([r for r, _ in ended], [n for _, n in ended])


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
