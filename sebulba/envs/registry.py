"""Env sources by name: what each vectorization needs, in one place.

`Config.vectorization` names an entry here. The config asks its entry what the run may
ask of it (wrappers, desync, lockstep, agent ids), `env_spec` asks it for the env's
spaces, and the loop asks it for the env sources of each inference device; nothing
outside this module branches on the name. A new source is one module and one `register`
call (DESIGN.md, "Env sources", has a worked example).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from sebulba.envs import envpool_source, gymnasium_source, pettingzoo_source
from sebulba.envs.base import EnvSource, close_quietly
from sebulba.envs.wrappers import EnvWrapper, parse_wrappers
from sebulba.types import EnvSpec


@dataclasses.dataclass(frozen=True)
class SourceRequest:
    """What a source factory is asked to make: the env sources of one inference device.

    Attributes:
      env: the run's env: an id (or module, for multi-agent sources) or a factory.
      env_kwargs: keyword arguments for the env.
      env_wrappers: parsed wrappers around each env (only for `wraps_each_env` kinds).
      group_size: envs per group (`Config.envs_per_group`).
      num_groups: groups to make (`Config.async_factor`), covered by the sources in order.
      seed: the seed of the first group's first env; group g's envs follow at
        `seed + g * group_size`. A source that takes its seed when made uses it; the
        others are seeded by `EnvSource.reset`.
      async_context: start method of env worker processes.
      desync_episodes: cut each env's first episode at a random length.
      agent_ids: multi-agent sources: append the agent's one-hot to its observation.
      check_env_output: check what the envs return (`Config.check_env_output`).
      inference_on_cpu: the acting calls run on the CPU, on the cores the envs step on
        (EnvPool's pools then share the cores rather than take a thread each per core).
    """

    env: Any
    env_kwargs: Mapping[str, Any]
    group_size: int
    num_groups: int = 1
    seed: int = 0
    env_wrappers: tuple[EnvWrapper, ...] = ()
    async_context: str = "spawn"
    desync_episodes: bool = False
    agent_ids: bool = False
    check_env_output: bool = True
    inference_on_cpu: bool = True


SpecFactory = Callable[[SourceRequest], EnvSpec]
SourceFactory = Callable[[SourceRequest], list[EnvSource]]


@dataclasses.dataclass(frozen=True)
class EnvSourceKind:
    """One vectorization: how its sources are made and what a run may ask of them.

    Attributes:
      name: the `Config.vectorization` value.
      make_sources: the sources of one inference device: `request.num_groups` groups,
        in order (one source per group, or one source of several groups).
      env_spec: the env's spaces as this kind's sources emit them (one env made and
        closed; `request.group_size` is 1); it also checks what only a made env tells
        (a step limit for `request.desync_episodes`).
      check_env: a fast check of an env id that makes no env: ValueError naming it.
      needs_env_id: refuses env factories.
      wraps_each_env: makes each env itself, so `env_wrappers` and `desync_episodes` apply.
      steps_in_order: recv returns every env of a group, in id order: needed by
        `Config.lockstep`. (Evaluation needs less: one source of one group whose recv
        returns all its envs, in any order, as EnvPool's does when its batch is all of
        them.)
      multi_agent: K agents per env as K rows; `Config.agent_ids` applies.
      env_processes: envs step in worker processes, which need the cores a polling
        inferencer thread would hold (`Config.action_poll_s` defaults to 0).
      evaluate_as: the in-process kind that evaluates a policy trained on this one with
        the same spaces (None: evaluation does not support it); it must make one source
        of one group for a request of one group, whose recv returns all its envs.
      help: one line for the launcher's flag help.
    """

    name: str
    make_sources: SourceFactory
    env_spec: SpecFactory
    check_env: Callable[[str], None]
    needs_env_id: bool = False
    wraps_each_env: bool = False
    steps_in_order: bool = True
    multi_agent: bool = False
    env_processes: bool = False
    evaluate_as: str | None = None
    help: str = ""


_KINDS: dict[str, EnvSourceKind] = {}


def register(kind: EnvSourceKind, *, replace: bool = False) -> None:
    """Makes `kind.name` a valid `Config.vectorization`."""
    if kind.name in _KINDS and not replace:
        raise ValueError(f"vectorization {kind.name!r} is registered already "
                         "(pass replace=True to replace it)")
    _KINDS[kind.name] = kind


def unregister(name: str) -> None:
    """Removes a registered kind (a test's toy source, for example)."""
    _KINDS.pop(name, None)


def names() -> tuple[str, ...]:
    """The registered vectorizations, in registration order."""
    return tuple(_KINDS)


def get(name: str) -> EnvSourceKind:
    """The kind registered as `name`, or ValueError listing the registered ones."""
    kind = _KINDS.get(name) if isinstance(name, str) else None
    if kind is None:
        raise ValueError(f"vectorization must be one of {names()}, got {name!r}")
    return kind


def check_request(kind: EnvSourceKind, env: Any, env_wrappers: Sequence[EnvWrapper] = (),
                  desync_episodes: bool = False, agent_ids: bool = False) -> None:
    """ValueError naming the setting that `kind` cannot honour."""
    if not (isinstance(env, str) or callable(env)):
        raise TypeError(f"env must be an env id or a factory, got {env!r}")
    if kind.needs_env_id and not isinstance(env, str):
        raise ValueError(f"vectorization {kind.name!r} needs an env id, got the factory {env!r}")
    if env_wrappers and not kind.wraps_each_env:
        raise ValueError(f"env_wrappers wrap each env, so they need vectorization "
                         f"{_either(k for k in _KINDS.values() if k.wraps_each_env)}, got "
                         f"{kind.name!r}")
    if desync_episodes and not kind.wraps_each_env:
        raise ValueError(f"desync_episodes wraps each env, so it needs vectorization "
                         f"{_either(k for k in _KINDS.values() if k.wraps_each_env)}, got "
                         f"{kind.name!r}")
    if agent_ids and not kind.multi_agent:
        raise ValueError(f"agent_ids is for multi-agent envs (vectorization "
                         f"{_either(k for k in _KINDS.values() if k.multi_agent)}), got "
                         f"vectorization {kind.name!r}")
    # Before any device or env is set up: an unknown id is an error naming it.
    if isinstance(env, str):
        kind.check_env(env)


def env_spec(
    env: Any,
    env_kwargs: Mapping[str, Any] | None = None,
    vectorization: str = "sync",
    agent_ids: bool = False,
    env_wrappers: str | Sequence[EnvWrapper] = (),
    desync_episodes: bool = False,
) -> EnvSpec:
    """The spaces of `env` as `vectorization`'s sources emit them (one env made, then
    closed). `env_wrappers` (`parse_wrappers`) wrap the env, in order; with `agent_ids`
    a multi-agent env's observation is extended by the agent's one-hot; with
    `desync_episodes` the env is checked for the step limit desync needs."""
    kind = get(vectorization)
    wrappers = parse_wrappers(env_wrappers)
    check_request(kind, env, wrappers, desync_episodes, agent_ids)
    return kind.env_spec(SourceRequest(env, dict(env_kwargs or {}), group_size=1,
                                       env_wrappers=wrappers, agent_ids=agent_ids,
                                       desync_episodes=desync_episodes))


def _either(kinds: Iterable[EnvSourceKind]) -> str:
    """'a', 'a' or 'b', 'a', 'b' or 'c': the names of `kinds`."""
    quoted = [repr(k.name) for k in kinds]
    return " or ".join([", ".join(quoted[:-1]), quoted[-1]] if len(quoted) > 1 else quoted)


# The sources sebulba ships.

def _vector_sources(vectorization: str) -> SourceFactory:
    def make(request: SourceRequest) -> list[EnvSource]:
        sources: list[EnvSource] = []
        unwrapped: list = []  # made, and not in a source yet: closed on an error too
        try:
            for _ in range(request.num_groups):
                unwrapped = [gymnasium_source.make_vector_env(
                    request.env, request.group_size, vectorization, request.env_kwargs,
                    request.async_context, request.desync_episodes, request.env_wrappers,
                    request.check_env_output)]
                envs_checked = request.check_env_output and (
                    vectorization in gymnasium_source.PER_ENV_VECTORIZATIONS)
                sources.append(gymnasium_source.VectorEnvSource(
                    unwrapped[0], request.check_env_output, request.env, envs_checked))
                unwrapped = []
        except BaseException:
            close_quietly(sources + unwrapped)
            raise
        return sources

    return make


def _gym_spec(vectorization: str) -> SpecFactory:
    return lambda r: gymnasium_source.env_spec(r.env, r.env_kwargs, vectorization,
                                               r.env_wrappers, r.desync_episodes)


def _gym_check(vectorization: str) -> Callable[[str], None]:
    return lambda env: gymnasium_source.check_env_id(env, vectorization)


def _pettingzoo_sources(request: SourceRequest) -> list[EnvSource]:
    sources: list[EnvSource] = []
    unwrapped: list = []  # made, and not in a source yet: closed on an error too
    try:
        for _ in range(request.num_groups):
            unwrapped = pettingzoo_source.make_parallel_envs(request.env, request.env_kwargs,
                                                             request.group_size)
            sources.append(pettingzoo_source.ParallelEnvSource(
                unwrapped, request.agent_ids, request.check_env_output, request.env))
            unwrapped = []
    except BaseException:
        close_quietly(sources + list(unwrapped))
        raise
    return sources


register(EnvSourceKind(
    "sync", _vector_sources("sync"), _gym_spec("sync"), _gym_check("sync"),
    wraps_each_env=True, evaluate_as="sync",
    help="gymnasium envs stepped one after another in the inferencer thread"))
register(EnvSourceKind(
    "async", _vector_sources("async"), _gym_spec("async"), _gym_check("async"),
    wraps_each_env=True, env_processes=True, evaluate_as="sync",
    help="a worker process per env (pays off when one env step is expensive)"))
register(EnvSourceKind(
    "vector_entry_point", _vector_sources("vector_entry_point"),
    _gym_spec("vector_entry_point"), _gym_check("vector_entry_point"),
    needs_env_id=True, evaluate_as="vector_entry_point",
    help="the id's own vectorized implementation (ale-py's Atari vector env)"))
register(EnvSourceKind(
    "envpool",
    lambda r: [envpool_source.EnvPoolGroups(r.env, r.num_groups, r.group_size, r.seed,
                                            r.env_kwargs, r.check_env_output,
                                            share_cores=r.inference_on_cpu)],
    lambda r: envpool_source.pool_spec(r.env, r.env_kwargs),
    envpool_source.check_env,
    needs_env_id=True, evaluate_as="envpool",
    help="an EnvPool task id: a pool per env group, stepped in C++ threads; one thread "
         "per inference device acts for its groups in turn"))
register(EnvSourceKind(
    "envpool_async",
    lambda r: [envpool_source.EnvPoolSource(r.env, r.num_groups, r.group_size, r.seed,
                                            r.env_kwargs, r.check_env_output)],
    lambda r: envpool_source.pool_spec(r.env, r.env_kwargs),
    envpool_source.check_env,
    needs_env_id=True, steps_in_order=False, evaluate_as="envpool",
    help="an EnvPool task id: one pool of async_factor groups per inference device, "
         "recv returning whichever envs are ready (envs whose step times vary)"))
register(EnvSourceKind(
    "pettingzoo", _pettingzoo_sources,
    lambda r: pettingzoo_source.parallel_env_spec(r.env, r.env_kwargs, r.agent_ids),
    pettingzoo_source.check_env,
    multi_agent=True, evaluate_as="pettingzoo",
    help="PettingZoo Parallel envs (a module such as mpe2.simple_spread_v3): K agents "
         "per env as K rows"))
