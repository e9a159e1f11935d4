"""Acting-only evaluation of a policy: N complete episodes, their returns, and videos."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import gymnasium as gym
import jax
import jax.numpy as jnp
import numpy as np
from gymnasium.envs.registration import load_env_creator

from sebulba.agent import Agent, checked_step_state, strongly_typed
from sebulba.envs import registry
from sebulba.envs.base import EnvSource, close_all, close_quietly
from sebulba.envs.gymnasium_source import EnvFactory
from sebulba.envs.output_checks import env_name
from sebulba.envs.wrappers import EnvWrapper, parse_wrappers
from sebulba.types import Nets


@dataclasses.dataclass(frozen=True)
class EvaluationResult:
    """Complete episodes, env by env.

    Attributes:
      returns: each episode's return; of a multi-agent env, the team return (the sum of
        its agents' returns).
      lengths: each episode's length in env steps.
      agent_returns: multi-agent envs: for each agent (by name), its return in each
        episode, in the order of `returns` (counted from when it last joined the
        episode); empty for single-agent envs.
    """

    returns: list[float]
    lengths: list[int]
    agent_returns: dict[str, list[float]] = dataclasses.field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        r = np.asarray(self.returns)
        out = {"episodes": len(r), "mean_return": float(r.mean()),
               "std_return": float(r.std()), "min_return": float(r.min()),
               "max_return": float(r.max()), "mean_length": float(np.mean(self.lengths))}
        if self.agent_returns:
            out["mean_agent_return"] = float(np.mean(list(self.agent_returns.values())))
            out["mean_return_by_agent"] = {
                agent: float(np.mean(rets)) for agent, rets in self.agent_returns.items()}
        return out


class StopFlag(Protocol):
    """What a `stop` argument needs: a `threading.Event`, or anything with its `is_set`."""

    def is_set(self) -> bool: ...


def check_greedy(agent: Agent, greedy: bool, setting: str = "greedy") -> None:
    """Refuses greedy evaluation of an agent that has no `greedy_step` (`Agent`'s is
    optional), where it is asked for rather than at the first step it would take."""
    if greedy and type(agent).greedy_step is Agent.greedy_step:
        raise ValueError(f"{setting}=True evaluates with Agent.greedy_step, which "
                         f"{type(agent).__name__} does not define: define it, or set "
                         f"{setting}=False to evaluate with sampling (Agent.step)")


class EpisodeRunner:
    """Runs a policy for complete episodes on one env source of one group, whose recv
    returns every env of it (in any order).

    Each evaluation resets the envs and gives each of them a fixed number of complete
    episodes (the counts differ by at most one), decided before any episode ends; the
    results are listed env by env. Taking the first N episodes to end, whichever env
    they ran in, would favour short episodes (in a cart-pole, the failures). A
    multi-agent source's episodes are its envs' episodes (`pop_env_episodes`).
    """

    def __init__(self, agent: Agent, source: EnvSource, *, greedy: bool = True,
                 name: str = "evaluation"):
        check_greedy(agent, greedy)
        if source.num_groups != 1:
            raise ValueError(f"{name} drives one source of one group, got a source of "
                             f"{source.num_groups} groups")
        self.agent, self.source = agent, source
        self.multi_agent = hasattr(source, "pop_env_episodes")
        self.agents: list[str] = list(getattr(source, "agents", []))
        self.rows_per_env = len(self.agents) if self.multi_agent else 1
        self.num_envs = source.num_envs // self.rows_per_env
        self.env_steps = 0  # rows stepped over all runs (agent steps for multi-agent)
        step = agent.greedy_step if greedy else agent.step

        def act(step_state, nets, env_step):
            output, new_state = step(step_state, nets, env_step)
            return output, checked_step_state(step_state, new_state)

        self._act = jax.jit(act)
        self._rows = np.arange(source.num_envs)

    def run(self, acting_nets: Nets, num_episodes: int, seed: int, *,
            max_env_steps: int = 10_000_000, stop: StopFlag | None = None,
            frames: list[np.ndarray] | None = None, max_frames: int = 1000
            ) -> EvaluationResult | None:
        """`num_episodes` complete episodes of the policy `acting_nets` (what the learner
        publishes: `Agent.acting_nets` of its networks); None if `stop` is set first.
        With `frames`, the first env's frames (`source.render()`) are appended, the first
        `max_frames` of them."""
        if num_episodes < 1:
            raise ValueError(f"num_episodes must be >= 1, got {num_episodes}")
        source, envs = self.source, self.num_envs
        quota = np.full(envs, num_episodes // envs)
        quota[:num_episodes % envs] += 1
        per_env: list[list[tuple]] = [[] for _ in range(envs)]
        source.reset(seed=seed)
        # On the networks' device and strongly typed, as the acting call returns it:
        # otherwise the call would compile a second time.
        step_state = strongly_typed(self.agent.new_step_state(
            acting_nets, jax.random.key(seed), source.num_envs))
        leaves = jax.tree.leaves(acting_nets)
        if leaves:
            step_state = jax.device_put(step_state, leaves[0].device)
        for _ in range(max_env_steps // source.num_envs + 1):
            ids, env_step, _ = source.recv()
            ended, env_step = _in_env_order(ids, env_step)
            if frames is not None and len(frames) < max_frames:
                frames.append(source.render())
            for env, episode in self._ended_episodes(ended):
                if len(per_env[env]) < quota[env]:
                    per_env[env].append(episode)
            if all(len(eps) == q for eps, q in zip(per_env, quota, strict=True)):
                break
            # Stopped here, between a recv and a send, the source holds no step in flight
            # and no ended episode unread: the next run's reset starts it clean.
            if stop is not None and stop.is_set():
                return None
            output, step_state = self._act(step_state, acting_nets, env_step)
            source.send(np.asarray(output.action), self._rows)
            self.env_steps += source.num_envs
        else:
            done = sum(len(eps) for eps in per_env)
            raise RuntimeError(f"only {done} of {num_episodes} episodes ended within "
                               f"{max_env_steps} steps")
        ended = [episode for eps in per_env for episode in eps]
        agent_returns = {agent: [float(e[2][i]) for e in ended]
                         for i, agent in enumerate(self.agents)} if self.multi_agent else {}
        return EvaluationResult([e[0] for e in ended], [e[1] for e in ended], agent_returns)

    def _ended_episodes(self, ended_rows: np.ndarray) -> list[tuple[int, tuple]]:
        """(env, (return, length[, agent returns])) of the episodes that ended."""
        if self.multi_agent:
            self.source.pop_episodes()  # agents' episodes: their env's are what counts
            return [(env, (ret, length, agents))
                    for env, ret, length, agents in self.source.pop_env_episodes()]
        # The tracker lists ended episodes in the order of recv's rows.
        return list(zip(ended_rows.tolist(), self.source.pop_episodes(), strict=True))


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
    agent_ids: bool = False,
    env_wrappers: str | Sequence[EnvWrapper] = (),
    learner_updates: int = 0,
) -> EvaluationResult:
    """Runs `agent` (greedy or sampled) for `num_episodes` complete episodes on
    `min(num_envs, num_episodes)` envs (see `EpisodeRunner`).

    `nets` are the learner's networks (as a run or a checkpoint holds them); the agent
    acts on `agent.acting_nets(nets, learner_updates)`, what the learner publishes after
    that many updates (a schedule the acting networks follow: an exploration epsilon).
    A checkpoint's counters hold them.
    `vectorization` is a kind that supports evaluation (its `evaluate_as` is not None)
    and whose source of one group returns every env of it at each recv (in any order:
    rows are put in env order): "sync", "envpool" (one synchronous pool), "pettingzoo"
    (episodes are env episodes, returns team returns, with
    each agent's in `agent_returns`) or, for ids whose own vector env preprocesses
    (Atari), "vector_entry_point" (`evaluation_vectorization` names the one for a run's).
    `agent_ids` and `env_wrappers` as the run's (`Config.agent_ids`, multi-agent envs;
    `Config.env_wrappers`). An env whose spaces are not the agent's is a ValueError naming
    both, before any episode.
    """
    kind = registry.get(vectorization)
    if kind.evaluate_as is None:
        raise ValueError(f"vectorization {vectorization!r} does not support evaluation "
                         "(its registry entry has evaluate_as=None)")
    check_greedy(agent, greedy)
    if num_episodes < 1 or num_envs < 1:
        raise ValueError(f"num_episodes and num_envs must be >= 1, got {num_episodes}, {num_envs}")
    num_envs = min(num_envs, num_episodes)
    nets = jax.jit(agent.acting_nets)(nets, jnp.asarray(learner_updates, jnp.int32))
    # A source seeded when made (EnvPool) takes the seed here, the others at reset.
    request = registry.SourceRequest(env, dict(env_kwargs or {}), num_envs, seed=seed,
                                     agent_ids=agent_ids,
                                     env_wrappers=parse_wrappers(env_wrappers))
    check_agent_fits(agent, vectorization, request)
    sources = kind.make_sources(request)
    try:
        source = _one_group(sources, vectorization, num_envs)
        runner = EpisodeRunner(agent, source, greedy=greedy)
        result = runner.run(nets, num_episodes, seed, max_env_steps=max_env_steps)
    finally:  # an error in a close must not take the place of the evaluation's
        close_quietly(sources)
    assert result is not None  # no stop event
    return result


def check_agent_fits(agent: Agent, vectorization: str, request: registry.SourceRequest
                     ) -> None:
    """ValueError naming both specs where the envs of `request` do not have the spaces
    `agent` was built for, or naming a setting `vectorization` cannot honour (wrappers of
    envs it does not make, agent ids of a single-agent env), as `Config` does for a run."""
    kind = registry.get(vectorization)
    registry.check_request(kind, request.env, request.env_wrappers,
                           agent_ids=request.agent_ids)
    spec = kind.env_spec(
        dataclasses.replace(request, group_size=1, num_groups=1))
    if agent.env_spec != spec:
        wrapped = (f" wrapped in {', '.join(map(str, request.env_wrappers))}"
                   if request.env_wrappers else "")
        raise ValueError(f"the agent was built for {agent.env_spec}, but env "
                         f"{env_name(request.env)}{wrapped} has {spec}")


def _one_group(sources: list, vectorization: str, num_envs: int):
    """The one source of one group of `num_envs` envs evaluation drives."""
    rows = num_envs * getattr(sources[0], "agents_per_env", 1) if sources else num_envs
    if len(sources) != 1 or sources[0].num_groups != 1 or sources[0].num_envs != rows:
        groups = sum(s.num_groups for s in sources)
        raise ValueError(
            f"evaluate drives one source of one group of {num_envs} envs, but vectorization "
            f"{vectorization!r} made {len(sources)} source(s) of {groups} group(s) in all")
    return sources[0]


def _in_env_order(ids: np.ndarray, env_step):
    """(the envs whose episode ended in recv's rows, in row order; the rows in env order:
    row i is env i). A source of one group returns every env at each recv, in any order."""
    ids = np.asarray(ids)
    ended = ids[np.flatnonzero(np.asarray(env_step.terminated | env_step.truncated))]
    order = np.argsort(ids, kind="stable")
    if not np.array_equal(ids[order], np.arange(len(ids))):
        raise RuntimeError(f"the env source's recv returned envs "
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


class VideoRecorder:
    """Records episodes of a policy as frames: one env of `request` made to render
    (render_mode="rgb_array"), driven by an `EpisodeRunner`.

    Made where a run is configured, so that an env that cannot render is refused before
    anything runs: ValueError naming it.
    """

    def __init__(self, agent: Agent, vectorization: str, request: registry.SourceRequest,
                 *, greedy: bool = True):
        kind = registry.get(vectorization)
        check_agent_fits(agent, vectorization, request)
        request = dataclasses.replace(
            request, env_kwargs={**request.env_kwargs, "render_mode": "rgb_array"},
            group_size=1, num_groups=1)
        what = f"env {env_name(request.env)} (vectorization {vectorization!r})"
        try:
            self._sources = kind.make_sources(request)
        except Exception as e:  # noqa: BLE001 - any failure to make it means it cannot render
            raise ValueError(f"{what} cannot record videos: made with "
                             f"render_mode='rgb_array' it fails ({type(e).__name__}: {e})"
                             ) from None
        try:
            source = _one_group(self._sources, vectorization, 1)
            # Received too: an EnvPool would hold this reset's batch in flight, and every
            # recording's first recv return it (a step behind for the source's life).
            source.reset(seed=request.seed)
            source.recv()
            frame = source.render() if hasattr(source, "render") else None
            if frame is None or np.ndim(frame) != 3:
                raise ValueError(f"{what} cannot record videos: it renders no rgb_array "
                                 f"frame (got {type(frame).__name__})")
            self.runner = EpisodeRunner(agent, source, greedy=greedy, name="a video")
            self.fps = _render_fps(source, request.env)
        except BaseException:
            close_quietly(self._sources)
            raise

    def record(self, acting_nets: Nets, seed: int, *, stop: StopFlag | None = None,
               max_env_steps: int = 100_000, max_frames: int = 1000
               ) -> tuple[np.ndarray, float] | None:
        """(frames [T, H, W, 3] uint8: the first `max_frames` of the episode, its return)
        of one episode; None if `stop` is set first."""
        frames: list[np.ndarray] = []
        result = self.runner.run(acting_nets, 1, seed, stop=stop, frames=frames,
                                 max_env_steps=max_env_steps, max_frames=max_frames)
        if result is None:
            return None
        return np.stack(frames).astype(np.uint8), result.returns[0]

    def close(self) -> None:
        close_all(self._sources)


def check_video_writer(what: str) -> None:
    """ValueError, naming `what` records videos, unless moviepy (which encodes them) is
    there: checked where a run is configured, not at its first video hours later, and
    with this checkout's extra rather than gymnasium's install hint."""
    import gymnasium as gym

    try:
        import gymnasium.utils.save_video  # noqa: F401 - imports moviepy, or raises
    except (ImportError, gym.error.DependencyNotInstalled) as e:
        cause = e.__cause__ or e  # gymnasium's error wraps moviepy's ImportError
        raise ValueError(f"{what} records videos, which needs moviepy ({cause}): pip install "
                         "-e '.[video]' in sebulba's checkout") from None


def save_video(frames: np.ndarray, directory: str, name: str, fps: int = 30) -> str:
    """Writes `frames` [T, H, W, 3] as `directory/name.mp4` (gymnasium's save_video,
    encoded by moviepy); returns the path."""
    check_video_writer(f"saving {name!r}")
    from gymnasium.utils.save_video import save_video as write

    os.makedirs(directory, exist_ok=True)
    write(list(frames), directory, fps=fps, name_prefix=name, episode_trigger=lambda _: True)
    # save_video names the file after the episode index it is given (0).
    written, path = os.path.join(directory, f"{name}-episode-0.mp4"), os.path.join(
        directory, f"{name}.mp4")
    os.replace(written, path)
    return path


def _render_fps(source: EnvSource, env_id: str | EnvFactory) -> int:
    """The frame rate the env's metadata asks for (30 if it names none): of the source's
    envs, or for a source that holds none (EnvPool) of the class gymnasium registers
    under its id."""
    env = getattr(source, "vec", None) or next(iter(getattr(source, "envs", [])), None)
    metadata = getattr(env, "metadata", None)
    if metadata is None and isinstance(env_id, str):
        try:
            entry = gym.spec(env_id).entry_point
            metadata = getattr(load_env_creator(entry) if isinstance(entry, str) else entry,
                               "metadata", None)
        except (gym.error.Error, ImportError, AttributeError):  # (EnvPool's Atari ids)
            pass
    fps = (metadata or {}).get("render_fps")
    return int(fps) if fps else 30


def record_video(
    agent: Agent,
    nets: Nets,
    env: str | EnvFactory,
    video_dir: str,
    *,
    greedy: bool = True,
    seed: int = 0,
    env_kwargs: Mapping[str, Any] | None = None,
    vectorization: str = "sync",
    name: str = "episode",
    env_wrappers: str | Sequence[EnvWrapper] = (),
    learner_updates: int = 0,
) -> float:
    """Records one episode to `video_dir/name.mp4`; returns the episode's return. The env
    must render (render_mode="rgb_array"): ValueError otherwise. `env_wrappers` wrap it as
    `Config.env_wrappers` wrap a run's envs (vectorizations that make each env: "sync",
    "async"), so a policy trained through wrappers sees what it learnt from; the frames
    are the env's own. `learner_updates` as `evaluate`'s."""
    recorder = VideoRecorder(agent, vectorization, registry.SourceRequest(
        env, dict(env_kwargs or {}), 1, seed=seed, env_wrappers=parse_wrappers(env_wrappers)),
        greedy=greedy)
    try:
        acting = jax.jit(agent.acting_nets)(nets, jnp.asarray(learner_updates, jnp.int32))
        frames, episode_return = recorder.record(acting, seed)
        save_video(frames, video_dir, name, recorder.fps)
    finally:
        recorder.close()
    return episode_return
