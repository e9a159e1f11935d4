"""Reading the launcher's checkpoints back: the agent, its networks and the run's metadata.

No flags here, so that code which imports the launcher (`examples.train`) can use it too.
"""

from __future__ import annotations

import os

import jax

import sebulba
from agents.registry import AGENTS, changed_since, config_as_written, defaults_message
from sebulba.checkpoint import Checkpointer, DamagedCheckpoint
from sebulba.evaluation import evaluation_vectorization


def checkpoint_dir(path: str) -> str:
    nested = os.path.join(path, "checkpoints")
    return nested if os.path.isdir(nested) else path


def eval_vectorization(meta: dict) -> str:
    """The vectorization that evaluates the checkpoint's policy in process, with the
    spaces it was trained on; ValueError where evaluation does not support its run's."""
    return evaluation_vectorization(meta.get("vectorization", "sync"))


def load_policy(path: str, step: int | None = None,
                skipped: list[int] | None = None) -> tuple[sebulba.Agent, object, dict]:
    """(agent, nets, metadata) from a checkpoint written by examples.train: step `step`,
    or the newest intact one (damaged ones passed over, as a resumed run does, and their
    steps appended to `skipped`); `DamagedCheckpoint` if the one asked for is damaged."""
    directory = checkpoint_dir(path)
    if not os.path.isdir(directory):  # Checkpointer would create it
        raise FileNotFoundError(f"no checkpoint in {os.path.abspath(directory)}: no such "
                                "directory")
    checkpointer = Checkpointer(directory)
    try:
        if step is not None:
            return _load(checkpointer, path, step)
        steps = checkpointer.all_steps()
        if not steps:
            raise FileNotFoundError(f"no checkpoint in {directory}")
        for newest_first in reversed(steps[1:]):
            try:
                return _load(checkpointer, path, newest_first)
            except DamagedCheckpoint:
                if skipped is not None:
                    skipped.append(newest_first)
        return _load(checkpointer, path, steps[0])  # the oldest: its damage is the error
    finally:
        checkpointer.close()


def _load(checkpointer: Checkpointer, path: str, step: int
          ) -> tuple[sebulba.Agent, object, dict]:
    """`load_policy` of step `step`, from an open checkpointer."""
    meta = checkpointer.metadata(step)
    entry = AGENTS.get(meta["agent"])
    if entry is None:
        raise ValueError(f"checkpoint agent {meta['agent']!r} is not one of {sorted(AGENTS)}")
    try:
        vectorization = eval_vectorization(meta)
    except ValueError as e:
        raise ValueError(f"checkpoint {path!r}: {e}") from None
    config = entry.config_class(**{
        k: tuple(v) if isinstance(v, list) else v for k, v in meta["agent_config"].items()})
    spec = sebulba.env_spec(meta["env"], meta["env_kwargs"], vectorization,
                            agent_ids=meta.get("agent_ids", False),
                            env_wrappers=meta.get("env_wrappers") or ())
    version = meta.get("agent_defaults", 1)
    config = config_as_written(version, meta["agent"], config, spec.action_space)
    changes = changed_since(version, meta["agent"], config, spec.action_space)
    if changes:
        raise ValueError(defaults_message(f"checkpoint {path!r}", version, changes)
                         + "; evaluate it with the sebulba that wrote it")
    agent = entry.build(spec, config)
    like = agent.new_networks(jax.random.key(0))
    restored = checkpointer.restore(nets=like, opt=None, metadata=meta, step=step)
    return agent, restored.nets, meta
