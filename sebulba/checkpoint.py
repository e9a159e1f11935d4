"""Checkpoints of the learner state on disk, with orbax-checkpoint.

A checkpoint holds the networks, the optimizer state, the step counters (the learner's
updates among them), the acting state of the envs (`UpdateInfo.actor_state()`) and, when
asked, each local learner device's experience, plus JSON metadata naming the agent, its
config, the env and the shapes of its networks. Restoring checks the metadata against the
run that restores it and refuses a checkpoint of another agent, another env or network
shape.

In a multi-process run the networks and optimizer state are the same everywhere and
process 0 saves them with its own acting state and experience; process i > 0 saves its
acting state and experience in a directory of its own (`process_directory`), with a
`ProcessCheckpointer`: orbax's handlers write host arrays on one primary host only, so
they cannot write a part that only process i holds.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from sebulba.types import PyTree


class CheckpointMismatch(ValueError):
    """A checkpoint that is intact but not this run's to restore: of another agent, env,
    network shape or run layout."""


class DamagedCheckpoint(ValueError):
    """A checkpoint step that cannot be read back: a part of it is missing, truncated or
    garbled (what orbax or tensorstore raised is the `cause`)."""

    def __init__(self, directory: str, step: int, part: str, cause: BaseException):
        self.directory, self.step, self.part = directory, step, part
        self.cause = cause_line(cause)
        super().__init__(f"checkpoint {step} in {directory} is damaged: its {part} cannot "
                         f"be read ({self.cause})")


class CheckpointSaveError(OSError):
    """A save that failed (a full disk, a directory that became unwritable); its partial
    directory is removed and the earlier checkpoints are intact."""


def cause_line(error: BaseException) -> str:
    """One line for what went wrong in orbax or tensorstore: an OS error as Python says it
    (`[Errno 28] No space left on device`), else the error's first line."""
    chain = []
    while error is not None and error not in chain:
        chain.append(error)
        error = error.__cause__ or error.__context__
    for e in chain:
        if isinstance(e, OSError) and e.errno is not None:
            return f"[Errno {e.errno}] {e.strerror}"
    for e in chain:  # tensorstore: "... Failed to write ...: File too large [os_error_code='27']"
        code = re.search(r"\[os_error_code='(\d+)'\]", str(e))
        if code:
            return f"[Errno {code.group(1)}] {os.strerror(int(code.group(1)))}"
    text = str(chain[0]).strip()
    first = text.splitlines()[0] if text else ""
    status = re.match(r"([A-Z_]+): (.*)", first)
    if status:  # tensorstore: "CODE: context: context: ...: what [source locations=...]"
        what = re.sub(r"\s*\[(source locations|tensorstore_spec)=.*$", "", status.group(2))
        return f"{status.group(1)}: {what.split(': ')[-1]}"[:300]
    return f"{type(chain[0]).__name__}: {first}"[:300]


def _closed_loop_callback(unraisable) -> bool:
    """Whether an unraisable exception is tensorstore calling back into the event loop of
    an orbax read or write that has already failed (the other arrays' reads or writes
    finish after it): one traceback per array, about nothing the run can act on."""
    return (isinstance(unraisable.exc_value, RuntimeError)
            and str(unraisable.exc_value) == "Event loop is closed")


class _OrbaxTaskLeftovers(logging.Filter):
    """Drops asyncio's "Task exception was never retrieved" for orbax's array reads and
    writes (tensorstore's, named by their spec): when one array of a save or restore
    fails, orbax raises it and leaves the others' tasks, whose errors (the same cause,
    already reported) asyncio logs when they are collected, after the run's one-line
    error."""

    _CHECKPOINT_IO = re.compile(r"orbax|tensorstore|ocdbt|zarr|\"driver\"", re.IGNORECASE)

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not ("Task exception was never retrieved" in message
                    and self._CHECKPOINT_IO.search(message))


def _quiet_closed_loop_callbacks() -> None:
    """Installs, once per process, the filters of what failed orbax reads and writes leave
    behind (`_closed_loop_callback`, `_OrbaxTaskLeftovers`)."""
    hook = sys.unraisablehook
    if getattr(hook, "_sebulba_quiet", False):
        return

    def quiet(unraisable):
        if not _closed_loop_callback(unraisable):
            hook(unraisable)

    quiet._sebulba_quiet = True
    sys.unraisablehook = quiet
    logging.getLogger("asyncio").addFilter(_OrbaxTaskLeftovers())


def check_writable(directory: str) -> None:
    """Makes `directory` if needed and writes (and removes) a small file there, synced to
    disk; ValueError naming the path and the cause if it cannot: a run learns that its
    checkpoints cannot be saved before it starts, not at its first save."""
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise ValueError(f"cannot save checkpoints in {directory}: it is not a directory")
    try:
        os.makedirs(directory, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=directory, prefix=".write-probe-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(b"\0" * 4096)
                f.flush()
                os.fsync(f.fileno())
        finally:
            os.remove(probe)
    except OSError as e:
        raise ValueError(f"cannot save checkpoints in {directory}: {cause_line(e)}") from None


class _HeldOrbaxErrors(logging.Filter):
    """Holds back the errors orbax logs (a traceback of dozens of lines) while a save is
    under way: a failed save raises `CheckpointSaveError` with the cause in one line; a
    save that succeeds logs them after all."""

    def __init__(self):
        super().__init__()
        self.held: list[logging.LogRecord] = []

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR and "orbax" in record.pathname:
            self.held.append(record)
            return False
        return True


@contextlib.contextmanager
def _orbax_errors_held() -> Iterator[_HeldOrbaxErrors]:
    logger = logging.getLogger("absl")
    held = _HeldOrbaxErrors()
    logger.addFilter(held)
    try:
        yield held
    finally:
        logger.removeFilter(held)


# What a checkpoint's step state and experience are shaped by, recorded in its metadata
# ("layout") by the launcher: a run of another layout would restore arrays of the wrong
# shape (orbax restores an array as saved, whatever the target's shape). The learner
# devices count only where the checkpoint holds experience (one part per local learner
# device); the step states are per env.
LAYOUT_KEYS = ("envs_per_group", "async_factor", "inference_devices", "num_processes",
               "agents_per_env", "learner_devices")
# Recorded in the layout too, but a run may change them: they shape some agents'
# experience only (a trajectory's T and K in PPO's, not a replay of transitions). An
# experience that then does not fit is refused naming them.
EXPERIENCE_LAYOUT_KEYS = ("steps_per_cycle", "trajectories_per_update")


def layout_differences(checkpoint: Mapping[str, Any], run: Mapping[str, Any]) -> list[str]:
    """"key checkpoint's value (this run: its value)" for each entry of the run layout in
    which a checkpoint and a run differ; nothing when either records no layout."""
    theirs, ours = checkpoint.get("layout"), run.get("layout")
    if theirs is None or ours is None:
        return []
    keys = [k for k in LAYOUT_KEYS
            if k != "learner_devices" or checkpoint.get("has_experience")]
    return [f"{k} {theirs.get(k)} (this run: {ours.get(k)})" for k in keys
            if k in theirs and theirs.get(k) != ours.get(k)]


def _shaped_by(part: str, checkpoint: Mapping[str, Any], run: Mapping[str, Any]
               ) -> list[str]:
    """The settings that shape `part` of a checkpoint (its experience: the run layout's
    `EXPERIENCE_LAYOUT_KEYS`) in which the run differs from it, named."""
    theirs, ours = checkpoint.get("layout") or {}, run.get("layout") or {}
    return [f"{key} {theirs[key]} (this run: {ours[key]})"
            for key in (EXPERIENCE_LAYOUT_KEYS if part == "experience" else ())
            if key in theirs and key in ours and theirs[key] != ours[key]]


def _check_like(where: str, part: str, restored: PyTree, like: PyTree,
                causes: Sequence[str] = ()) -> None:
    """CheckpointMismatch if a restored part's arrays are not shaped as the run's; it
    names `causes`, the run's settings that differ from the checkpoint's and shape it."""
    saved, wanted = tree_signature(restored), tree_signature(_to_savable(like))
    differ = sorted(k for k in set(saved) | set(wanted) if saved.get(k) != wanted.get(k))
    if differ:
        because = (f"; this run differs in {', '.join(causes)}: resume with the "
                   "checkpoint's, or start a new run") if causes else ""
        raise CheckpointMismatch(
            f"{where} holds {part} of another shape: " + ", ".join(
                f"{k} (checkpoint {saved.get(k)}, run {wanted.get(k)})" for k in differ[:5])
            + because)


@dataclasses.dataclass(frozen=True)
class Restored:
    nets: PyTree | None
    opt: PyTree | None
    local_experience: PyTree | None  # leaves [num_local_learners, ...], if it was saved
    step_state: PyTree | None  # this process's envs' StepState, if it was saved
    counters: dict[str, int]  # version, consumed (global), env_steps (this process)
    metadata: dict[str, Any]


def tree_signature(tree: PyTree) -> dict[str, str]:
    """Path -> 'dtype[shape]' of every leaf: what must match to restore into `tree`."""
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    return {jax.tree_util.keystr(p): f"{_dtype(x)}{list(np.shape(x))}" for p, x in leaves}


def _dtype(x) -> str:
    dtype = getattr(x, "dtype", np.asarray(x).dtype)
    return str(dtype)


# The metadata entries that say which env a run trains on, with their value when a
# checkpoint (or a run) does not record them. Two envs with the same spaces are not the
# same env: networks trained on one mean nothing on the other, so a restore into a run of
# another env is refused even though every shape matches.
ENV_KEYS: dict[str, Any] = {
    "env": None, "env_kwargs": {}, "env_wrappers": [], "vectorization": "sync",
    "agent_ids": False,
}
# Vectorizations that make the same envs (each env stepped in the thread or in a worker
# process; EnvPool's in a pool per group or one pool of all); the others may preprocess
# (an id's own vector env) or be another implementation of the id (EnvPool).
_SAME_ENVS = {"async": "sync", "envpool_async": "envpool"}


def _json(value: Any) -> Any:
    """`value` as JSON reads it back (tuples are lists), to compare a run's metadata with a
    checkpoint's."""
    return json.loads(json.dumps(value))


def env_differences(checkpoint: Mapping[str, Any], run: Mapping[str, Any]) -> list[str]:
    """"key checkpoint's value (this run: its value)" for each env entry in which a
    checkpoint's metadata and a run's differ; nothing when either does not name its env."""
    if checkpoint.get("env") is None or run.get("env") is None:
        return []
    differ = []
    for key, default in ENV_KEYS.items():
        theirs, ours = _json(checkpoint.get(key, default)), _json(run.get(key, default))
        if key == "vectorization":
            theirs, ours = _SAME_ENVS.get(theirs, theirs), _SAME_ENVS.get(ours, ours)
        if theirs != ours:
            differ.append(f"{key} {checkpoint.get(key, default)!r} (this run: "
                          f"{run.get(key, default)!r})")
    return differ


def _is_key(x) -> bool:
    return hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _to_savable(tree: PyTree) -> PyTree:
    """Host numpy arrays; typed PRNG keys become their raw key data."""
    return jax.tree.map(
        lambda x: np.asarray(jax.random.key_data(x) if _is_key(x) else x), tree
    )


def _from_saved(saved: PyTree, like: PyTree) -> PyTree:
    def back(s, t):
        if _is_key(t):
            return jax.random.wrap_key_data(np.asarray(s), impl=jax.random.key_impl(t))
        return np.asarray(s)

    return jax.tree.map(back, saved, like)


def process_directory(directory: str, process_index: int) -> str:
    """Where process `process_index` of a multi-process run keeps its own part of the
    checkpoints in `directory` (process 0 keeps its part in `directory` itself)."""
    return directory if process_index == 0 else f"{directory}_process_{process_index}"


class Checkpointer:
    """Keeps the last `max_to_keep` checkpoints in `directory`.

    In a multi-process run only process 0 should make one (every process holds the same
    networks); pass `primary_only=True` there so orbax does not wait for the others.
    `clean_partial_saves`: remove what saves cut short left (a process killed while it
    saved: a preemption's grace that ran out), for the one writer of `directory` only
    (a reader would remove a save under way).
    """

    def __init__(self, directory: str, *, max_to_keep: int = 3, primary_only: bool = False,
                 clean_partial_saves: bool = False):
        if max_to_keep < 1:
            raise ValueError(f"max_to_keep must be >= 1, got {max_to_keep}")
        self.directory = os.path.abspath(directory)
        _quiet_closed_loop_callbacks()  # they come before orbax raises
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep, create=True, enable_async_checkpointing=False
        )
        if primary_only and jax.process_count() > 1:
            # orbax will not create the root for a subset of processes; every process
            # reads the checkpoints (to resume), so all make sure the directory exists.
            os.makedirs(self.directory, exist_ok=True)
            options = dataclasses.replace(
                options,
                create=False,
                multiprocessing_options=ocp.options.MultiprocessingOptions(
                    primary_host=jax.process_index(), active_processes={jax.process_index()}
                ),
            )
        if clean_partial_saves:  # (orbax 0.12's manager does not act on its own option)
            for tmp in ocp.path.step.all_temporary_paths(self.directory):
                shutil.rmtree(tmp.get(), ignore_errors=True)
        self._manager = ocp.CheckpointManager(
            self.directory, options=options,
            item_names=("nets", "opt", "experience", "step_state", "meta"))

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def save(
        self,
        step: int,
        *,
        nets: PyTree | None,
        opt: PyTree | None,
        counters: Mapping[str, int],
        metadata: Mapping[str, Any],
        local_experience: PyTree | None = None,
        step_state: PyTree | None = None,
    ) -> None:
        """Writes checkpoint `step` (blocking, so a crash right after loses nothing).

        None leaves a part out: a process other than 0 saves only its own step state and
        experience."""
        trees = {"nets": nets, "opt": opt, "experience": local_experience,
                 "step_state": step_state}
        # Orbax refuses empty trees (an optimizer state of ()); they need no saving.
        items = {name: ocp.args.StandardSave(_to_savable(tree))
                 for name, tree in trees.items() if tree is not None and jax.tree.leaves(tree)}
        meta = {
            **metadata,
            "counters": {k: int(v) for k, v in counters.items()},
            "nets_signature": None if nets is None else tree_signature(nets),
            "has_experience": local_experience is not None,
            "has_step_state": step_state is not None,
        }
        json.dumps(meta)  # fail here, not inside orbax, on metadata that is not JSON
        with _orbax_errors_held() as held:
            try:
                saved = self._manager.save(step, args=ocp.args.Composite(
                    meta=ocp.args.JsonSave(meta), **items))
                self._manager.wait_until_finished()
            except Exception as e:
                self._remove_partial(step)
                raise CheckpointSaveError(
                    f"could not save checkpoint {step} in {self.directory}: {cause_line(e)}; "
                    "the earlier checkpoints are intact") from e
        for record in held.held:
            logging.getLogger("absl").handle(record)
        if not saved:  # orbax writes no step at or below its latest, and says nothing
            raise CheckpointSaveError(
                f"checkpoint {step} was not written: {self.directory} already holds step "
                f"{self._manager.latest_step()}, and checkpoints only move forward (a run "
                "that starts afresh needs a directory of its own)")

    def _remove_partial(self, step: int, settle_s: float = 0.3, limit_s: float = 10.0) -> None:
        """Removes what a failed save of `step` left: orbax's temporary directory. The
        writes of other arrays may still land after the first one failed (and recreate
        the directory), so it is removed until it stays gone for `settle_s`."""
        deadline = time.monotonic() + limit_s
        gone_since = None
        while time.monotonic() < deadline:
            partial = [tmp.get() for tmp in ocp.path.step.all_temporary_paths(self.directory)
                       if tmp.get().name.split(".")[0] == str(step)]
            for path in partial:
                shutil.rmtree(path, ignore_errors=True)
            if partial:
                gone_since = None
            elif gone_since is None:
                gone_since = time.monotonic()
            elif time.monotonic() - gone_since >= settle_s:
                break
            time.sleep(0.05)
        with contextlib.suppress(Exception):
            self._manager.reload()

    def move_aside(self, step: int, to: str) -> str:
        """Moves checkpoint `step` out of the directory into `to`/<step> (a damaged step that
        a resumed run passes over, so that it neither resumes from it nor keeps the run
        from saving its own steps: orbax saves no step at or below its latest); returns
        where it went."""
        os.makedirs(to, exist_ok=True)
        target, n = os.path.join(to, str(step)), 1
        while os.path.exists(target):
            n += 1
            target = os.path.join(to, f"{step}-{n}")
        shutil.move(os.path.join(self.directory, str(step)), target)
        self._manager.reload()
        return target

    def restore(
        self,
        *,
        nets: PyTree | None,
        opt: PyTree | None,
        metadata: Mapping[str, Any],
        local_experience: PyTree | None = None,
        step_state: PyTree | None = None,
        step: int | None = None,
    ) -> Restored:
        """Restores checkpoint `step` (default: the latest) into the shapes of the given trees.

        `nets`, `opt`, `local_experience` and `step_state` are this run's freshly built
        state, used as the target (None: not restored; the last two only if saved);
        `metadata` is this run's, and its "agent" entry and the network signature must
        match the checkpoint's.
        """
        step = self.latest_step() if step is None else step
        meta = self.check_metadata(metadata, step)
        where = f"checkpoint {step} in {self.directory}"
        signature = None if nets is None else tree_signature(nets)
        if nets is not None and meta.get("nets_signature") != signature:
            differ = sorted(
                k for k in set(signature) | set(meta.get("nets_signature") or {})
                if signature.get(k) != (meta.get("nets_signature") or {}).get(k)
            )
            raise CheckpointMismatch(
                f"{where} holds networks of another shape: differing parameters "
                + ", ".join(
                    f"{k} (checkpoint {(meta.get('nets_signature') or {}).get(k)}, "
                    f"run {signature.get(k)})"
                    for k in differ[:5]
                )
            )
        # Each part is its own item: a run that does not want one (evaluation needs no
        # optimizer, a run may start with empty experience) does not read it.
        wanted = {"nets": nets, "opt": opt,
                  "experience": local_experience if meta.get("has_experience") else None,
                  "step_state": step_state if meta.get("has_step_state") else None}
        wanted = {k: v for k, v in wanted.items() if v is not None}
        out = {}
        for k, v in wanted.items():
            if not jax.tree.leaves(v):
                out[k] = v
                continue
            args = ocp.args.Composite(**{k: ocp.args.StandardRestore(_to_savable(v))})
            try:
                saved = self._read(step, k,
                                   lambda args=args: self._manager.restore(step, args=args))
            except DamagedCheckpoint as e:
                if not self._reads_as_saved(step, k):
                    raise
                # Intact, but not of this run's structure: the optimizer state's and the
                # experience's follow the agent's settings (an optimizer, a clip left out).
                differ = _agent_setting_differences(meta, metadata)
                settings = (f", whose agent settings differ from the checkpoint's "
                            f"({'; '.join(differ[:5])})" if differ else "")
                raise CheckpointMismatch(
                    f"{where}: its {k} is intact but does not fit this run's{settings}: "
                    f"resume with the checkpoint's settings, or start a new run "
                    f"({e.cause})") from e
            _check_like(where, k, saved[k], v, _shaped_by(k, meta, metadata))
            out[k] = _from_saved(saved[k], v)
        return Restored(
            nets=out.get("nets"),
            opt=out.get("opt"),
            local_experience=out.get("experience"),
            step_state=out.get("step_state"),
            counters=dict(meta.get("counters") or {}),
            metadata=meta,
        )

    def _reads_as_saved(self, step: int, part: str) -> bool:
        """Whether part `part` of checkpoint `step` reads back in the structure it was
        saved in (it is intact) where it did not read into this run's."""
        args = ocp.args.Composite(**{part: ocp.args.StandardRestore()})
        try:
            self._manager.restore(step, args=args)
        except Exception:  # noqa: BLE001 - any failure: damage after all
            return False
        return True

    def check_metadata(self, metadata: Mapping[str, Any], step: int | None = None
                       ) -> dict[str, Any]:
        """The metadata of checkpoint `step` (default: the latest), after checking that a run
        whose metadata is `metadata` may restore it: the same agent and the same env
        (`ENV_KEYS`) and, where both record it, the same run layout (`LAYOUT_KEYS`);
        `CheckpointMismatch` naming both otherwise, `DamagedCheckpoint` if the metadata
        cannot be read. Reads no arrays, so a run can check before it builds anything."""
        step = self.latest_step() if step is None else step
        meta = self.metadata(step)
        where = f"checkpoint {step} in {self.directory}"
        if meta.get("agent") != metadata.get("agent"):
            raise CheckpointMismatch(
                f"{where} was written by agent {meta.get('agent')!r}; this run's agent is "
                f"{metadata.get('agent')!r}"
            )
        differ = env_differences(meta, metadata)
        if differ:
            raise CheckpointMismatch(
                f"{where} was trained on another env: {'; '.join(differ)}. Its networks "
                "restore only into a run of the env they were trained on")
        differ = layout_differences(meta, metadata)
        if differ:
            raise CheckpointMismatch(
                f"{where} was saved by a run of another layout: {'; '.join(differ)}. Its "
                "envs' step states (and experience) fit only that layout: resume with the "
                "same values, or start a new run")
        return meta

    def metadata(self, step: int | None = None) -> dict[str, Any]:
        """The JSON metadata of checkpoint `step` (default: the latest)."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        if step not in self.all_steps():
            raise FileNotFoundError(
                f"no checkpoint {step} in {self.directory}; there are {self.all_steps()}")
        args = ocp.args.Composite(meta=ocp.args.JsonRestore())
        meta = self._read(step, "meta", lambda: self._manager.restore(step, args=args))["meta"]
        if not isinstance(meta, dict):
            raise DamagedCheckpoint(self.directory, step, "meta",
                                    ValueError(f"metadata is {type(meta).__name__}"))
        return meta

    def _read(self, step: int, part: str, read: Callable[[], Any]) -> Any:
        """`read()`, whose failure (a missing, truncated or garbled file: whatever orbax or
        tensorstore raises) is a `DamagedCheckpoint` naming the step and the part."""
        try:
            return read()
        except Exception as e:  # noqa: BLE001 - any failure to read is damage
            raise DamagedCheckpoint(self.directory, step, part, e) from e

    def close(self) -> None:
        self._manager.close()


def _agent_setting_differences(saved: Mapping[str, Any], run: Mapping[str, Any]) -> list[str]:
    """The agent settings (metadata "agent_config") in which a run differs from a
    checkpoint, as "field: checkpoint X, run Y" (compared as JSON holds them)."""
    saved_config = saved.get("agent_config") or {}
    run_config = json.loads(json.dumps(run.get("agent_config") or {}))
    return [f"{k}: checkpoint {saved_config.get(k)!r}, run {run_config.get(k)!r}"
            for k in sorted(set(saved_config) | set(run_config))
            if saved_config.get(k) != run_config.get(k)]


_PART_SUFFIXES = (".npz", ".json", ".npz.tmp", ".json.tmp")  # a process part's files


def _flush_to_disk(f) -> None:
    f.flush()
    os.fsync(f.fileno())


def _sync_directory(directory: str) -> None:
    """fsync a directory, so that renames in it survive a power loss (where the platform
    can: not on Windows)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        with contextlib.suppress(OSError):
            os.fsync(fd)
    finally:
        os.close(fd)


def process_part_steps(directory: str) -> list[int]:
    """The steps a `ProcessCheckpointer` holds whole in `directory` (none if it is not
    there), read without making anything."""
    if not os.path.isdir(directory):
        return []
    return sorted(int(name[:-5]) for name in os.listdir(directory)
                  if name.endswith(".json") and name[:-5].isdigit())


class ProcessCheckpointer:
    """One process's own part of a multi-process checkpoint (its envs' step state and its
    learner devices' experience), as one `.npz` of host arrays and one JSON of metadata
    per step, written to temporary names, flushed to disk and renamed, the JSON last, so
    a step is complete or absent (also after a power loss). What a save killed midway
    leaves (a `.tmp`, an `.npz` whose JSON never came) is removed by the next save.

    The same `save` / `restore` / `all_steps` as `Checkpointer` for these parts. As
    orbax's checkpoints, the parts only move forward: a save of step S removes the parts
    of steps after S (left by an earlier run in the directory, or by a save cut short
    elsewhere), which no checkpoint the run makes from here on can pair with, and then
    keeps the last `max_to_keep` steps; so a save never prunes the part it just wrote.
    A damaged part (a truncated `.npz`, a garbled JSON) restores as a `DamagedCheckpoint`
    naming the directory, the step and the part.
    """

    def __init__(self, directory: str, *, max_to_keep: int = 3):
        if max_to_keep < 1:
            raise ValueError(f"max_to_keep must be >= 1, got {max_to_keep}")
        self.directory = os.path.abspath(directory)
        self.max_to_keep = max_to_keep
        os.makedirs(self.directory, exist_ok=True)

    def _path(self, step: int, suffix: str) -> str:
        return os.path.join(self.directory, f"{step}{suffix}")

    def all_steps(self) -> list[int]:
        return process_part_steps(self.directory)

    def latest_step(self) -> int | None:
        steps = self.all_steps()
        return steps[-1] if steps else None

    def save(self, step: int, *, counters: Mapping[str, int], metadata: Mapping[str, Any],
             local_experience: PyTree | None = None, step_state: PyTree | None = None,
             nets: None = None, opt: None = None) -> None:
        if nets is not None or opt is not None:
            raise ValueError("a process's own part holds no networks or optimizer state: "
                             "process 0's Checkpointer saves them")
        arrays = {}
        for part, tree in (("experience", local_experience), ("step_state", step_state)):
            if tree is not None:
                for path, x in jax.tree_util.tree_leaves_with_path(_to_savable(tree)):
                    arrays[part + jax.tree_util.keystr(path)] = x
        meta = {**metadata, "counters": {k: int(v) for k, v in counters.items()},
                "has_experience": local_experience is not None,
                "has_step_state": step_state is not None}
        try:
            # An earlier part of this step (an earlier run's, a save cut short) is not
            # this save's: the step is absent until this save's JSON commits it.
            with contextlib.suppress(FileNotFoundError):
                os.remove(self._path(step, ".json"))
            self._write(step, arrays, meta)
        except OSError as e:
            for suffix in (".npz.tmp", ".json.tmp"):
                with contextlib.suppress(OSError):
                    os.remove(self._path(step, suffix))
            raise CheckpointSaveError(
                f"could not save checkpoint {step} in {self.directory}: {cause_line(e)}; "
                "the earlier checkpoints are intact") from e
        self.discard_after(step)  # stale: see the class's docstring
        kept = self.all_steps()[-self.max_to_keep:]
        # The JSONs first: a step is gone once its JSON is, whatever else a kill leaves.
        for name in sorted(os.listdir(self.directory), key=lambda n: not n.endswith(".json")):
            stem = name.split(".", 1)[0]
            if stem.isdigit() and int(stem) not in kept and name.endswith(_PART_SUFFIXES):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(os.path.join(self.directory, name))

    def discard_after(self, step: int) -> list[int]:
        """Removes the parts of steps after `step` (the JSON first), which a run resumed
        from `step` can never use: a save cut short elsewhere left them, and one at the
        same step later must not find a stale part there. Returns those steps."""
        stale = [s for s in self.all_steps() if s > step]
        for s in stale:
            for suffix in (".json", ".npz"):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(self._path(s, suffix))
        if stale:
            _sync_directory(self.directory)
        return stale

    def _write(self, step: int, arrays: dict[str, np.ndarray], meta: dict[str, Any]) -> None:
        with open(self._path(step, ".npz.tmp"), "wb") as f:
            np.savez(f, **arrays)
            _flush_to_disk(f)
        os.replace(self._path(step, ".npz.tmp"), self._path(step, ".npz"))
        with open(self._path(step, ".json.tmp"), "w") as f:
            json.dump(meta, f)
            _flush_to_disk(f)
        os.replace(self._path(step, ".json.tmp"), self._path(step, ".json"))  # the commit
        _sync_directory(self.directory)  # the renames themselves

    def restore(self, *, metadata: Mapping[str, Any], local_experience: PyTree | None = None,
                step_state: PyTree | None = None, step: int | None = None,
                nets: None = None, opt: None = None) -> Restored:
        step = self.latest_step() if step is None else step
        if step is None or step not in self.all_steps():
            raise FileNotFoundError(f"no checkpoint {step} in {self.directory}; there are "
                                    f"{self.all_steps()}")
        meta = self._read(step, "meta", lambda: self._read_meta(step))
        if meta.get("agent") != metadata.get("agent"):
            raise CheckpointMismatch(f"checkpoint {step} in {self.directory} was written by agent "
                             f"{meta.get('agent')!r}; this run's agent is "
                             f"{metadata.get('agent')!r}")
        wanted = [(part, like) for part, like in (("experience", local_experience),
                                                  ("step_state", step_state))
                  if like is not None and meta[f"has_{part}"]]
        out = {}
        if wanted:
            saved = self._read(step, "arrays", lambda: np.load(self._path(step, ".npz")))
            with saved:
                for part, like in wanted:
                    paths, treedef = jax.tree_util.tree_flatten_with_path(like)
                    keys = [part + jax.tree_util.keystr(p) for p, _ in paths]
                    missing = [k for k in keys if k not in saved.files]
                    if missing:  # an intact part of another structure
                        raise CheckpointMismatch(
                            f"checkpoint {step} in {self.directory} has no {missing[0]} "
                            f"(its {part} has another structure than this run's)")
                    leaves = self._read(step, part, lambda keys=keys: [
                        np.asarray(saved[k]) for k in keys])
                    tree = jax.tree.unflatten(treedef, leaves)
                    _check_like(f"checkpoint {step} in {self.directory}", part, tree, like,
                                _shaped_by(part, meta, metadata))
                    out[part] = _from_saved(tree, like)
        return Restored(nets=None, opt=None, local_experience=out.get("experience"),
                        step_state=out.get("step_state"), counters=dict(meta["counters"]),
                        metadata=meta)

    def _read_meta(self, step: int) -> dict[str, Any]:
        with open(self._path(step, ".json")) as f:
            meta = json.load(f)
        if not isinstance(meta, dict) or not isinstance(meta.get("counters"), dict):
            raise ValueError(f"metadata is {type(meta).__name__} without counters")
        for key in ("has_experience", "has_step_state"):
            if not isinstance(meta.get(key), bool):
                raise ValueError(f"metadata lacks {key}")
        return meta

    def _read(self, step: int, part: str, read: Callable[[], Any]) -> Any:
        """`read()`, whose failure (a missing, truncated or garbled file) is a
        `DamagedCheckpoint` naming the directory, the step and the part."""
        try:
            return read()
        except Exception as e:  # noqa: BLE001 - any failure to read is damage
            raise DamagedCheckpoint(self.directory, step, part, e) from e

    def close(self) -> None:
        pass
