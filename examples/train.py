"""Train an agent in the Sebulba loop.

    sebulba-train                                 # the same as python -m examples.train
    python -m examples.train                      # PPO on CartPole-v1, a few minutes on CPU
    python -m examples.train --envs_per_group=32 --async_factor=1 --total_env_steps=500000
    python -m examples.train --logdir=runs/cp --checkpoint_every_steps=50000
    python -m examples.train --logdir=runs/cp --resume --total_env_steps=1000000
    python -m examples.train --helpfull           # every flag, agent flags grouped per agent

The run flags are generated from `sebulba.Config`, one per field and named as it
(`--envs_per_group`, `--steps_per_cycle`, ...), with its defaults and docs; the agent flags
from the agent's config (`--<agent>_<field>`). `--steps_per_cycle` defaults to R2D2's
sequence period (`--r2d2_sequence_length` - `--r2d2_sequence_overlap`) for R2D2, which
builds its sequences from whole cycles. Devices are chosen by index into this
process's local devices. Across machines, run the same command on every host with its
own --process_id:

    python -m examples.train --coordinator_address=HOST0:1234 --num_processes=2 --process_id=0
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import math
import os
import re
import signal
import sys
from collections.abc import Iterator

import jax
from absl import app, flags
from absl import logging as absl_logging

import sebulba
from agents.registry import (
    AGENTS,
    DEFAULTS_VERSION,
    SHIPPED,
    changed_since,
    defaults_message,
    unresumable_since,
)
from examples.config_flags import define_config_flags, define_run_flags, run_main
from sebulba.checkpoint import (
    Checkpointer,
    CheckpointMismatch,
    CheckpointSaveError,
    DamagedCheckpoint,
    ProcessCheckpointer,
    cause_line,
    check_writable,
    process_directory,
    process_part_steps,
)
from sebulba.envs import registry
from sebulba.metrics import MultiWriter, Reporter, WandbWriter, default_writers, json_line
from sebulba.runtime import distributed
from sebulba.runtime.preemption import Preemption

# --checkpoint_experience=auto saves experiences up to this size per process.
EXPERIENCE_AUTO_MIB = 256

_AGENT = flags.DEFINE_enum("agent", "ppo", sorted(AGENTS), "Which agent to train.")
_TOTAL_ENV_STEPS = flags.DEFINE_integer(
    "total_env_steps", 400_000, "Env steps (all envs, all processes) to learn from.")
_LOGDIR = flags.DEFINE_string(
    "logdir", None, "Where metrics (TensorBoard events, metrics.jsonl) and checkpoints go.")
_LOG_EVERY = flags.DEFINE_float(
    "log_every_seconds", 5.0,
    "Seconds between metric writes, the first this long after the first learner update "
    "(the throughput is measured from it on); a finite number >= 0, 0: every update.")
_PROGRESS = flags.DEFINE_bool("progress", True, "Show a progress bar.")
_CHECKPOINT_EVERY = flags.DEFINE_integer(
    "checkpoint_every_steps", 100_000, "Env steps between checkpoints (needs --logdir).")
_KEEP = flags.DEFINE_integer(
    "keep_checkpoints", 3, "Checkpoints to keep (one more in a multi-process run, so that a "
    "save cut short in one process leaves a step every process holds).")
_SAVE_EXPERIENCE = flags.DEFINE_enum(
    "checkpoint_experience", "auto", ["auto", "on", "off"],
    "Checkpoint the learner's experience (PPO's batch and minibatch key, R2D2's replay) so "
    "that a resumed run continues it; auto: when it is at most "
    f"{EXPERIENCE_AUTO_MIB} MiB per process (a large replay is refilled instead).")
_RESUME = flags.DEFINE_bool(
    "resume", False, "Continue from the latest checkpoint in --logdir; an error if there is "
    "none (or it is of another agent or env).")
_RESUME_IF_PRESENT = flags.DEFINE_bool(
    "resume_if_present", False,
    "Continue from the latest checkpoint in --logdir if there is one, else start there: one "
    "command for a job that a cluster preempts and requeues (SIGTERM saves a checkpoint).")
_COORDINATOR = flags.DEFINE_string(
    "coordinator_address", None,
    "host:port of process 0 for a multi-process run (jax.distributed); unset: one process.")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Processes in a multi-process run.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's index, 0..num_processes-1.")
_DISTRIBUTED = flags.DEFINE_bool(
    "distributed", False,
    "Join a multi-process run whose settings JAX detects from the environment (SLURM, cloud "
    "TPU and GPU schedulers); --coordinator_address, --num_processes and --process_id, "
    "where given, override them.")
_GRACE = flags.DEFINE_float(
    "preemption_grace_seconds", 30.0,
    "After SIGTERM or SIGINT the run stops after the learner update under way, saves a "
    "checkpoint (with --logdir) and exits with 128 + the signal's number; if that takes "
    "longer than this, it ends its env workers and exits at once.")
_PROGRESS_TIMEOUT = flags.DEFINE_float(
    "progress_timeout_seconds", 600.0,
    "Single-process runs: a learner that waits this long for a trajectory while no env "
    "steps (an env step that never returns) ends the run with an error showing where each "
    "inferencer thread is. "
    "Multi-process runs: a learner that finishes no update for this long ends every "
    "process, naming the processes that are behind (one stuck in Python keeps its "
    "heartbeats going). The first env step and update (start-up, compilation) may take "
    "600 s if that is longer.")
_EVAL_VIDEO = flags.DEFINE_bool(
    "eval_video", False,
    "Record one evaluation episode every --eval_video_every evaluations to LOGDIR/videos "
    "(and to TensorBoard and W&B); needs --logdir and --eval_every_updates, and an env "
    "that renders. --eval_video_dir records elsewhere.")
_WANDB_PROJECT = flags.DEFINE_string(
    "wandb_project", None,
    "Also log metrics, the config and videos to this Weights & Biases project (the wandb "
    "extra); TensorBoard and metrics.jsonl (with --logdir) stay.")
_WANDB_MODE = flags.DEFINE_enum(
    "wandb_mode", "online", ["online", "offline", "disabled"],
    "wandb's mode (needs --wandb_project): offline writes under --logdir (or ./wandb) for "
    "`wandb sync` later.")
_HEARTBEAT = flags.DEFINE_integer(
    "heartbeat_timeout_seconds", 100,
    "Multi-process runs (--coordinator_address or --distributed): a peer that stops "
    "answering for this long ends every process.")

# One flag per field of sebulba.Config, named as the field (--envs_per_group, ...), with
# Config's defaults and docs.
_RUN_FLAGS = define_run_flags()
# One flag per field of each agent's config: --<agent>_<field>, grouped per agent.
_AGENT_FLAGS = {
    name: define_config_flags(name, entry.config_class, module_name=f"agents.{name}")
    for name, entry in AGENTS.items()
}


def build(agent_name: str, agent_config, config: sebulba.Config) -> sebulba.Sebulba:
    spec = config.env_spec()
    try:
        agent = AGENTS[agent_name].build(spec, agent_config)
    except ValueError as e:
        if flag_message(str(e), agent_name) != str(e):
            raise  # it names a setting of the agent: `flag_message` gives its flag
        # The agent refused the env (its spaces): say which pair of flags did not fit.
        raise ValueError(f"--agent={agent_name} on --env={config.env}: {e}") from None
    return sebulba.Sebulba(agent, config)


def run_metadata(agent_name: str, agent_config, config: sebulba.Config) -> dict:
    """What a checkpoint records to rebuild (and check) the agent and its env."""
    return {"agent": agent_name, "agent_config": dataclasses.asdict(agent_config),
            "agent_defaults": DEFAULTS_VERSION,
            "env": config.env, "env_kwargs": dict(config.env_kwargs),
            "env_wrappers": list(config.env_wrappers),
            "vectorization": config.vectorization, "agent_ids": config.agent_ids,
            "seed": config.seed}


def changed_settings(saved: dict, now: dict) -> list[str]:
    """The settings a resumed run takes that differ from its checkpoint's (the agent's
    hyperparameters, the seed): allowed, and said. `saved` went through JSON."""
    now = json.loads(json.dumps(now))  # tuples as the checkpoint holds them: lists
    agent, changes = now["agent"], []
    for field, value in now["agent_config"].items():
        old = saved.get("agent_config", {}).get(field, value)
        if old != value:
            changes.append(f"--{agent}_{field} {old!r} -> {value!r}")
    if saved.get("seed", now["seed"]) != now["seed"]:
        changes.append(f"--seed {saved['seed']} -> {now['seed']}")
    return changes


def run_layout(loop: sebulba.Sebulba) -> dict:
    """What the envs' step states and the experience of a checkpoint are shaped by
    (`sebulba.checkpoint.LAYOUT_KEYS`: a resumed run must have the same;
    `EXPERIENCE_LAYOUT_KEYS`: named where the experience does not fit)."""
    return {"envs_per_group": loop.config.envs_per_group,
            "async_factor": loop.config.async_factor,
            "inference_devices": len(loop.inference_devices),
            "num_processes": loop.num_processes,
            "agents_per_env": loop.layout.agents_per_env,
            "learner_devices": len(loop.local_learner_devices),
            "steps_per_cycle": loop.config.steps_per_cycle,
            "trajectories_per_update": loop.config.trajectories_per_update}


# The lock file of this process's run on its --logdir, open (and locked) until the process
# ends: the kernel releases an flock when its holder dies, so a killed run never blocks
# the next.
_LOGDIR_LOCK: int | None = None


def lock_logdir(logdir: str) -> None:
    """Takes the run's lock on `logdir` (fcntl.flock of `logdir/.lock`; process i > 0 of a
    multi-process run locks `.lock_process_i`), holding it for the process's life;
    ValueError naming the pid that holds it if another run does."""
    global _LOGDIR_LOCK
    index = jax.process_index()
    path = os.path.join(logdir, ".lock" if index == 0 else f".lock_process_{index}")
    try:
        os.makedirs(logdir, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise ValueError(f"--logdir: cannot open the lock file {path}: {cause_line(e)}"
                         ) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise ValueError(
            f"--logdir={logdir} is in use by another run (pid {holder} holds {path}): one "
            "run per logdir; wait for it to end, or choose another --logdir") from None
    with contextlib.suppress(OSError):  # the pid only names the holder to a second run
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    _LOGDIR_LOCK = fd


def check_agent_flags(agent_name: str) -> None:
    """UsageError for a flag of another agent (`--agent=spg --ppo_learning_rate=...`): it
    would be silently ignored."""
    for other, agent_flags in _AGENT_FLAGS.items():
        if other == agent_name:
            continue
        for field, holder in agent_flags.holders.items():
            if flags.FLAGS[holder.name].present:
                own = _AGENT_FLAGS[agent_name].holders.get(field)
                hint = f"; did you mean --{own.name}?" if own is not None else ""
                raise app.UsageError(
                    f"--{holder.name} is a flag of agent {other!r}, but this run's agent is "
                    f"{agent_name!r} (--agent={agent_name}), so it would be ignored{hint}")


def flag_message(message: str, agent_name: str) -> str:
    """A config error as the command line says it: a message that starts with a field of
    Config or of the agent's config names its flag (`envs_per_group must ...` ->
    `--envs_per_group must ...`, `sequence_overlap=...` -> `--r2d2_sequence_overlap=...`)."""
    match = re.match(r"\w+", message)
    if match is None:
        return message
    names = {field: holder.name for field, holder in _AGENT_FLAGS[agent_name].holders.items()}
    names.update({field: holder.name for field, holder in _RUN_FLAGS.holders.items()})
    name = names.get(match.group())
    return f"--{name}{message[match.end():]}" if name else message


def no_checkpoint_error(directory: str) -> ValueError:
    # Silently starting afresh would overwrite what the user meant to extend.
    return ValueError(f"--resume: there is no checkpoint in {directory} to continue from "
                      "(drop --resume to start a run there)")


def skipped(damage: DamagedCheckpoint) -> None:
    print(f"--resume: skipping checkpoint {damage.step} in {damage.directory}: it is damaged, "
          f"its {damage.part} cannot be read ({damage.cause}); trying the one before it",
          file=sys.stderr)


def no_intact_error(directory: str, damaged: list[int]) -> ValueError:
    return ValueError(f"--resume: no intact checkpoint in {directory}: every one of "
                      f"{sorted(damaged)} is damaged (see above)")


def checkpoint_to_resume(checkpointer: Checkpointer, metadata: dict,
                         agent: sebulba.Agent | None = None) -> tuple[list[int], list[int]]:
    """(the steps --resume may continue from, newest first; the damaged steps passed over)
    from the newest checkpoint whose metadata reads on: the first of them is checked
    against the run (the same agent, env and layout; with `agent`, the run's, networks
    that act here as they did and learn on as they learnt: `agents.registry.changed_since`,
    `unresumable_since`). ValueError if there is no checkpoint, no intact one, or the
    first is not this run's."""
    steps = sorted(checkpointer.all_steps(), reverse=True)
    if not steps:
        raise no_checkpoint_error(checkpointer.directory)
    damaged = []
    for i, step in enumerate(steps):
        try:
            meta = checkpointer.check_metadata(metadata, step)
        except DamagedCheckpoint as e:
            skipped(e)
            damaged.append(step)
            continue
        version = meta.get("agent_defaults", 1)
        # Agents registered from elsewhere need not keep their config: the versions'
        # changes are the shipped agents'.
        config = getattr(agent, "config", None)
        changes = [] if config is None else changed_since(
            version, metadata["agent"], config, agent.env_spec.action_space)
        where = f"checkpoint {step} in {checkpointer.directory}"
        if changes:
            raise ValueError(defaults_message(where, version, changes))
        changes = [] if config is None else unresumable_since(
            version, metadata["agent"], config, bool(meta.get("has_experience")))
        if changes:
            raise ValueError(defaults_message(
                where, version, changes, "a run would not continue it as it learnt"))
        if "layout" not in meta and jax.process_index() == 0:
            print(f"checkpoint {step} in {checkpointer.directory} records no run layout (it "
                  "was saved before checkpoints did): its envs_per_group, async_factor, "
                  "processes and learner devices are not checked", file=sys.stderr)
        return steps[i:], damaged
    raise no_intact_error(checkpointer.directory, damaged)


@contextlib.contextmanager
def quiet_info() -> Iterator[None]:
    """No INFO logs while the run is checked: orbax logs its every step at INFO (and JAX the
    backends it does not find), which would bury a usage error's one line."""
    verbosity = absl_logging.get_verbosity()
    absl_logging.set_verbosity(absl_logging.WARNING)
    try:
        yield
    finally:
        absl_logging.set_verbosity(verbosity)


def experience_mib(experience) -> float:
    return sum(x.nbytes for x in jax.tree.leaves(experience)) / 2**20


def save_experience(experience, num_local_learners: int) -> bool:
    """Whether checkpoints hold the experience (--checkpoint_experience)."""
    if _SAVE_EXPERIENCE.value != "auto":
        return _SAVE_EXPERIENCE.value == "on"
    return experience_mib(experience) * num_local_learners <= EXPERIENCE_AUTO_MIB


@dataclasses.dataclass
class Launch:
    """What `main` prepares before the run: the loop, its checkpoints and where it starts."""

    loop: sebulba.Sebulba
    metadata: dict
    checkpointer: Checkpointer | None  # the run's checkpoints (written by process 0)
    resume_steps: list[int] = dataclasses.field(default_factory=list)  # newest first
    damaged: list[int] = dataclasses.field(default_factory=list)  # passed over
    own: Checkpointer | None = None  # this process's part of each checkpoint
    state: sebulba.AgentState | None = None
    local_experience: object = None
    with_experience: bool = False
    consumed: int = 0
    learner_updates: int = 0

    def close(self) -> None:
        for c in {self.checkpointer, self.own} - {None}:
            c.close()


def check_command_line(argv: list[str]) -> None:
    """UsageError for flags that contradict each other, before any flag is converted."""
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    for holder in (_RESUME, _RESUME_IF_PRESENT):
        if holder.value and not _LOGDIR.value:
            raise app.UsageError(f"--{holder.name} needs --logdir")
    if _RESUME.value and _RESUME_IF_PRESENT.value:
        raise app.UsageError("--resume and --resume_if_present exclude each other: --resume "
                             "requires a checkpoint, --resume_if_present takes one if present")
    check_agent_flags(_AGENT.value)
    if not _PROGRESS_TIMEOUT.value > 0:
        raise app.UsageError(
            f"--progress_timeout_seconds must be > 0, got {_PROGRESS_TIMEOUT.value}")
    if not _GRACE.value > 0:
        raise app.UsageError(f"--preemption_grace_seconds must be > 0, got {_GRACE.value}")
    # NaN would never write a row (no time is >= NaN), a negative value would every update.
    if not (math.isfinite(_LOG_EVERY.value) and _LOG_EVERY.value >= 0):
        raise app.UsageError("--log_every_seconds must be a finite number >= 0 (0: a row "
                             f"every learner update), got {_LOG_EVERY.value}")
    for holder in (_TOTAL_ENV_STEPS, _CHECKPOINT_EVERY, _KEEP):
        if holder.value < 1:
            raise app.UsageError(f"--{holder.name} must be >= 1, got {holder.value}")
    check_watching_flags()
    if _HEARTBEAT.value < 1:
        raise app.UsageError(
            f"--heartbeat_timeout_seconds must be >= 1, got {_HEARTBEAT.value}")


def check_watching_flags() -> None:
    """UsageError for --eval_video or --wandb_project that cannot work."""
    if _EVAL_VIDEO.value and not _LOGDIR.value:
        raise app.UsageError("--eval_video needs --logdir (videos go to LOGDIR/videos)")
    if _EVAL_VIDEO.value and not flags.FLAGS["eval_every_updates"].value:
        raise app.UsageError("--eval_video records evaluation episodes: it needs "
                             "--eval_every_updates > 0")
    if _WANDB_PROJECT.value is not None:
        try:
            import wandb  # noqa: F401 - only whether it is installed
        except ImportError:
            raise app.UsageError("--wandb_project needs the wandb extra: pip install "
                                 "-e '.[wandb]' in sebulba's checkout") from None


def check_flags_that_need_others() -> None:
    """A flag that would do nothing without another is an error, not ignored."""
    if (_NUM_PROCESSES.value is not None or _PROCESS_ID.value is not None) and not (
            _COORDINATOR.value is not None or _DISTRIBUTED.value):
        raise ValueError(
            "--num_processes and --process_id join a multi-process run: give "
            "--coordinator_address (host:port of process 0) or --distributed too; without "
            "them this process would train alone, as if it were the whole run")
    if flags.FLAGS[_HEARTBEAT.name].present and not (
            _COORDINATOR.value is not None or _DISTRIBUTED.value):
        raise ValueError(
            f"--heartbeat_timeout_seconds={_HEARTBEAT.value} watches the peers of a "
            "multi-process run: it needs --coordinator_address or --distributed (without "
            "them this process trains alone and has no peers)")
    if flags.FLAGS[_WANDB_MODE.name].present and _WANDB_PROJECT.value is None:
        raise ValueError(f"--wandb_mode={_WANDB_MODE.value} is the mode of the Weights & "
                         "Biases run: it needs --wandb_project (without it nothing goes to "
                         "W&B)")
    if not _LOGDIR.value:
        for flag in (_CHECKPOINT_EVERY, _KEEP, _SAVE_EXPERIENCE):
            if flags.FLAGS[flag.name].present:
                raise ValueError(f"--{flag.name} needs --logdir (where checkpoints go)")
    # Config reads the evaluation's settings only when it evaluates.
    given = {field: flags.FLAGS[_RUN_FLAGS.flag_name(field)] for field in (
        "eval_episodes", "eval_greedy", "eval_max_share", "eval_device", "eval_video_dir",
        "eval_video_every")}
    if not flags.FLAGS[_RUN_FLAGS.flag_name("eval_every_updates")].value:
        for flag in given.values():
            if flag.present:
                raise ValueError(f"--{flag.name} sets up evaluation during training: it needs "
                                 "--eval_every_updates > 0 (without it no evaluation runs)")
    video = given["eval_video_every"]
    if video.present and not (_EVAL_VIDEO.value or given["eval_video_dir"].value is not None):
        raise ValueError(f"--{video.name} spaces the evaluation videos: it needs --eval_video "
                         "(or --eval_video_dir) to record any")


def make_config() -> tuple[object, sebulba.Config]:
    """(agent config, run config) from the flags, joining the cluster of a multi-process
    run on the way; a bad value is a UsageError naming its flag."""
    try:
        agent_config = _AGENT_FLAGS[_AGENT.value].config()
        run_values = _RUN_FLAGS.values()
        if _EVAL_VIDEO.value and run_values["eval_video_dir"] is None:
            run_values["eval_video_dir"] = os.path.join(_LOGDIR.value, "videos")
        # An agent that builds sequences from whole cycles (R2D2) fixes T unless it is set.
        period = getattr(agent_config, "sequence_period", None)
        if period is not None and not flags.FLAGS[_RUN_FLAGS.flag_name("steps_per_cycle")].present:
            run_values["steps_per_cycle"] = period
        if isinstance(run_values["env"], str):  # Config checks it too, after the cluster
            registry.get(run_values["vectorization"]).check_env(run_values["env"])
        check_flags_that_need_others()
        # Join the cluster before anything touches JAX devices (Config resolves them).
        if _COORDINATOR.value is not None or _DISTRIBUTED.value:
            distributed.initialize(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value,
                                   heartbeat_timeout_seconds=_HEARTBEAT.value)
        with quiet_info():
            return agent_config, sebulba.Config(**run_values)
    except (ValueError, TypeError) as e:
        raise app.UsageError(flag_message(str(e), _AGENT.value)) from None


def check_agent(loop: sebulba.Sebulba) -> None:
    """Checks an agent makes as it sizes its state for the run (R2D2's steps_per_cycle
    against its sequence length), traced without computing: in a fraction of a second
    instead of after the networks' initialization. Anything but a ValueError here is left
    to the real initial_state, which reports it in full."""
    try:
        jax.eval_shape(loop.initial_state)
    except ValueError:
        raise
    except Exception:  # noqa: BLE001 - reported by the real initial_state
        pass


def open_checkpoints() -> Checkpointer:
    """The run's checkpointer in --logdir, after taking the logdir's lock and checking that
    this process can write its checkpoints there (before any env starts); ValueError
    naming the path otherwise."""
    directory = os.path.join(_LOGDIR.value, "checkpoints")
    if _RESUME.value and not os.path.isdir(directory):  # and do not create it
        raise no_checkpoint_error(directory)
    lock_logdir(_LOGDIR.value)
    check_writable(process_directory(os.path.abspath(directory), jax.process_index()))
    # Process 0 writes the directory (the others their own parts, beside it), under the
    # lock: it alone removes the partial saves of a run killed while it saved.
    return Checkpointer(directory, max_to_keep=checkpoints_to_keep(), primary_only=True,
                        clean_partial_saves=jax.process_index() == 0)


def checkpoints_to_keep() -> int:
    """--keep_checkpoints, and one more in a multi-process run: each process prunes its own
    part, so a save cut short in one (a kill in the grace, a full disk) must leave a step
    that every process still holds."""
    return _KEEP.value + (jax.process_count() > 1)


def check_fresh_start(checkpointer: Checkpointer) -> None:
    """A run that does not resume must not start in a logdir with checkpoints: its saves
    up to their latest step would not be written, and a later --resume would continue
    the earlier run. Nor, in a multi-process run, where a process's own parts of an
    earlier run's checkpoints are left (`checkpoints_process_N`, without process 0's
    checkpoints): the new run's parts would be mixed with them. Every process checks
    every process's directory (they see the same ones), so all refuse alike."""
    if _RESUME.value or _RESUME_IF_PRESENT.value:
        return
    steps = checkpointer.all_steps()
    if steps:
        raise ValueError(
            f"--logdir={_LOGDIR.value} holds checkpoints of an earlier run (steps "
            f"{steps[0]:,} to {steps[-1]:,} in {checkpointer.directory}): pass --resume to "
            "continue it, or another --logdir to start afresh")
    for p in range(1, jax.process_count()):
        directory = process_directory(checkpointer.directory, p)
        steps = process_part_steps(directory)
        if steps:
            raise ValueError(
                f"--logdir={_LOGDIR.value} holds process {p}'s parts of an earlier run's "
                f"checkpoints (steps {steps[0]:,} to {steps[-1]:,} in {directory}), but "
                f"not the checkpoints themselves (none in {checkpointer.directory}), so "
                f"they cannot be resumed: remove {directory}, or pass another --logdir to "
                "start afresh")


def prepare(agent_config, config: sebulba.Config) -> Launch:
    """The loop (the agent checked against the env and the run, nothing compiled), its
    checkpointer and the steps to resume from; a bad combination is a UsageError."""
    checkpointer = None
    try:
        with quiet_info():
            loop = build(_AGENT.value, agent_config, config)
            check_agent(loop)
            metadata = {**run_metadata(_AGENT.value, agent_config, config),
                        "layout": run_layout(loop)}
            if _LOGDIR.value:
                checkpointer = open_checkpoints()
                check_fresh_start(checkpointer)
            steps, damaged = [], []
            if _RESUME.value or (_RESUME_IF_PRESENT.value and checkpointer.all_steps()):
                steps, damaged = checkpoint_to_resume(checkpointer, metadata, loop.agent)
    except ValueError as e:
        if checkpointer is not None:
            with quiet_info():
                checkpointer.close()
        raise app.UsageError(flag_message(str(e), _AGENT.value)) from None
    return Launch(loop, metadata, checkpointer,
                  resume_steps=steps, damaged=damaged)


def restore(launch: Launch) -> None:
    """The state the run starts from: the initial one, or the checkpoint's to resume."""
    loop, checkpointer, primary = launch.loop, launch.checkpointer, jax.process_index() == 0
    state = loop.initial_state()
    num_local_learners = len(loop.local_learner_devices)
    launch.with_experience = save_experience(state.experience, num_local_learners)
    # Each process's own part of a checkpoint (its envs' step state and its learner
    # devices' experience); process 0's is in the checkpoint itself.
    launch.own = checkpointer
    if checkpointer is not None and not primary:
        launch.own = ProcessCheckpointer(
            process_directory(checkpointer.directory, jax.process_index()),
            max_to_keep=checkpoints_to_keep())
    launch.state = state
    if not launch.resume_steps:
        return
    try:
        restored, mine = restore_agreed(launch, state)
    except ValueError as e:
        message = flag_message(str(e), _AGENT.value)
        if isinstance(e, CheckpointMismatch):  # networks of another shape: say which flags
            changes = settings_changed_since(launch)
            if changes:
                message += f" (settings that differ from the checkpoint's: {', '.join(changes)})"
        raise app.UsageError(message) from None
    if not primary:  # newer parts of its own, stale (process 0 sets its own aside)
        stale = launch.own.discard_after(restored.counters["consumed"])
        if stale:
            print(f"process {jax.process_index()}: removed its parts of checkpoints "
                  f"{stale}, newer than the one resumed")
    launch.state = state._replace(
        nets=restored.nets, opt=restored.opt,
        step_state=state.step_state if mine.step_state is None else mine.step_state)
    launch.local_experience = mine.local_experience
    launch.consumed = restored.counters["consumed"]
    launch.learner_updates = restored.counters.get("learner_updates", 0)
    if primary:
        set_aside_damaged(launch)
        kept = "" if launch.local_experience is not None else "; experience starts empty"
        print(f"resumed from {checkpointer.directory} at {launch.consumed:,} env steps, "
              f"learner update {launch.learner_updates:,}{kept}")
        changes = changed_settings(restored.metadata, launch.metadata)
        if changes:
            print(f"settings that differ from the checkpoint's: {', '.join(changes)}")


def settings_changed_since(launch: Launch) -> list[str]:
    """`changed_settings` against the newest checkpoint to resume, or none where its
    metadata cannot be read."""
    try:
        with quiet_info():
            saved = launch.checkpointer.metadata(launch.resume_steps[0])
    except (DamagedCheckpoint, FileNotFoundError):
        return []
    return changed_settings(saved, launch.metadata)


_FAILED = -1  # what a process whose restore failed contributes (see `restore_agreed`)


def restore_agreed(launch: Launch, state: sebulba.AgentState):
    """`restore_intact`, the same step in every process, or the same error in every
    process (a ValueError) rather than one process failing alone and the others timing
    out in the next collective. Each process chooses on its own; a read error on one host
    only (a damaged part of its own) would have them resume from different steps."""
    error = None
    try:
        with quiet_info():
            restored, mine = restore_intact(launch, state)
        chosen = restored.counters["consumed"]
    except ValueError as e:
        if jax.process_count() == 1:
            raise
        # A damaged part of its own at step s is -(s + 2), any other error -1.
        error = e
        chosen = -(e.step + 2) if isinstance(e, DamagedCheckpoint) else _FAILED
    values = distributed.value_of_every_process(chosen)
    failed = {p: v for p, v in enumerate(values) if v < 0}
    if failed and len(failed) < len(values):
        # Only some failed: every process says which, at which step, and where.
        what = "; ".join(
            f"process {p} could not read its own part of checkpoint {-v - 2:,} (in "
            f"{process_directory(launch.checkpointer.directory, p)}: damaged)"
            if v != _FAILED else f"process {p} could not restore (see its log)"
            for p, v in failed.items())
        cause = f" [this process: {error}]" if error is not None else ""
        raise ValueError(
            f"--resume: {what}; the processes must resume from one checkpoint, so none "
            "does: restore that part, or move that step's checkpoint (and every process's "
            f"part of it) out of {launch.checkpointer.directory} to resume from an earlier "
            f"one{cause}")
    if error is not None:  # every process failed: each says why
        raise error
    distributed.check_same(
        values, "the checkpoint step to resume from (one could not read a part the others "
        "read: see each process's log)")
    return restored, mine


def restore_intact(launch: Launch, state: sebulba.AgentState):
    """(the shared part, this process's part) of the newest intact checkpoint of
    `launch.resume_steps`, passing over damaged ones (saying so); ValueError if none is
    intact, or one is not this run's. Every process reads the shared part, so all see its
    damage alike; a damaged part of one process's own in a multi-process run is an error
    (the processes must resume from one step)."""
    checkpointer = launch.checkpointer
    num_local_learners = len(launch.loop.local_learner_devices)
    like_experience = jax.tree.map(lambda x: jax.numpy.stack([x] * num_local_learners),
                                   state.experience)
    every_part = steps_of_every_process(checkpointer)
    for step in launch.resume_steps:
        if every_part is not None and step not in every_part:
            # A save cut short in some process (a kill inside the grace): every process
            # sees the same directories, so all pass over the same steps.
            print(f"checkpoint {step} lacks a process's own part (a save cut short): "
                  "passed over", file=sys.stderr)
            launch.damaged.append(step)
            continue
        try:
            restored = checkpointer.restore(nets=state.nets, opt=state.opt,
                                            metadata=launch.metadata, step=step)
        except DamagedCheckpoint as e:
            skipped(e)
            launch.damaged.append(step)
            continue
        try:
            mine = launch.own.restore(
                nets=None, opt=None, metadata=launch.metadata, step=step,
                local_experience=like_experience, step_state=state.step_state)
        except DamagedCheckpoint as e:
            if jax.process_count() > 1:  # read by this process alone
                raise
            skipped(e)
            launch.damaged.append(step)
            continue
        return restored, mine
    raise no_intact_error(checkpointer.directory, launch.damaged)


def steps_of_every_process(checkpointer: Checkpointer) -> set[int] | None:
    """In a multi-process run, the steps of which every process > 0 saved its own part
    (process 0's is the checkpoint itself), read from their directories beside the
    checkpoints, which every process reads alike (the checkpoint's directory is shared,
    as the networks in it are); None with one process."""
    if jax.process_count() == 1:
        return None
    parts = [set(process_part_steps(process_directory(checkpointer.directory, p)))
             for p in range(1, jax.process_count())]
    return set.intersection(*parts)


def set_aside_damaged(launch: Launch) -> None:
    """Moves the damaged checkpoints passed over (all newer than the one resumed) out of the
    checkpoint directory, into `checkpoints_damaged` beside it: left there, the newest
    would be resumed from again, and orbax saves no step below its newest."""
    checkpointer = launch.checkpointer
    aside = checkpointer.directory + "_damaged"
    for step in sorted(launch.damaged):
        if step in checkpointer.all_steps():
            where = checkpointer.move_aside(step, aside)
            print(f"moved the damaged checkpoint {step} to {where}", file=sys.stderr)


def run_writers(launch: Launch) -> MultiWriter | None:
    """Where process 0 writes metrics: TensorBoard and metrics.jsonl in --logdir, and
    W&B with --wandb_project (the run's metadata and flags as its config).

    The rows' steps are the run's consumed env steps (`Reporter.global_step`): a run that
    starts at `launch.consumed` writes its first at launch.consumed + 1 or later, so
    TensorBoard purges the rows from there on that an earlier run in the logdir wrote
    (past the checkpoint resumed from: a crash, a kill, a damaged newer checkpoint), and
    keeps the one at the checkpoint's step."""
    writers = []
    if _LOGDIR.value:
        writers = default_writers(_LOGDIR.value, purge_step=launch.consumed + 1).writers
    if _WANDB_PROJECT.value is not None:
        config = {**launch.metadata, "run": {k: v if isinstance(v, int | float | str | bool)
                                             else repr(v)
                                             for k, v in _RUN_FLAGS.values().items()},
                  "total_env_steps": _TOTAL_ENV_STEPS.value}
        writers.append(WandbWriter(_WANDB_PROJECT.value, _LOGDIR.value, config,
                                   mode=_WANDB_MODE.value))
    return MultiWriter(writers) if writers else None


def train(launch: Launch, preemption: Preemption) -> sebulba.RunResult:
    """Runs the loop to --total_env_steps, reporting metrics and saving checkpoints every
    --checkpoint_every_steps and at the end."""
    primary, own = jax.process_index() == 0, launch.own
    writer = run_writers(launch) if primary else None
    reporter = Reporter(_TOTAL_ENV_STEPS.value, writer, every_seconds=_LOG_EVERY.value,
                        progress=_PROGRESS.value and primary, step_offset=launch.consumed,
                        num_processes=jax.process_count())
    next_save = launch.consumed + _CHECKPOINT_EVERY.value

    def save(step: int, info) -> None:
        """Every process saves its own part at the same update (their steps agree)."""
        nets, opt, experience = info.learner_state()
        own.save(step, nets=nets if primary else None, opt=opt if primary else None,
                 metadata=launch.metadata,
                 counters={"consumed": step, "learner_updates": info.version},
                 local_experience=experience if launch.with_experience else None,
                 step_state=info.actor_state())

    last_info = None

    def on_update(info) -> None:
        nonlocal next_save, last_info
        last_info = info
        reporter(info)
        step = reporter.global_step(info)
        if own is not None and step >= next_save:
            save(step, info)
            next_save = step + _CHECKPOINT_EVERY.value

    def save_last() -> None:
        """The last update's state, unless saved already. A stopped run calls it (as
        `on_stop`) before its threads and envs are shut down, to stay within the grace:
        after the update it stopped after, the same in every process (a part saved by
        the signalled process alone, at the update it saw the signal, would restore
        nothing); a run that ends calls it last."""
        if own is not None and last_info is not None:
            step = reporter.global_step(last_info)
            if step not in own.all_steps():
                save(step, last_info)

    try:
        result = launch.loop.run(
            _TOTAL_ENV_STEPS.value - launch.consumed, launch.state, on_update=on_update,
            local_experience=launch.local_experience, stop=preemption.event, on_stop=save_last,
            progress_timeout_s=_PROGRESS_TIMEOUT.value,
            learner_updates=launch.learner_updates)
        reporter.finish(result)
        save_last()
    finally:
        reporter.close()
        launch.close()
    return result


def report(launch: Launch, result: sebulba.RunResult, preemption: Preemption) -> None:
    """Prints the summary; a run stopped by a signal exits with 128 + its number."""
    consumed = launch.consumed + result.global_consumed
    if jax.process_index() == 0:  # every process has the same networks: report once
        print(run_summary(result, consumed))
        summary = {k: v for k, v in result.as_dict().items() if k != "metrics"}
        print(json_line({"total_consumed": consumed, **summary}))
    if result.stopped_early:
        # A process stopped by a peer's signal exits as if it had got SIGTERM itself, so
        # a job script can requeue the run on one exit code.
        why = (signal.Signals(preemption.signum).name if preemption.signum is not None
               else "a signal to another process of the run")
        saved = ""
        if launch.checkpointer is not None:
            # This process's own saves: process 0's are the checkpoints themselves, the
            # others' their parts of them (their orbax checkpointer never saves).
            own = launch.own
            part = ("" if own is launch.checkpointer
                    else f" (this process's part in {own.directory})")
            saved = (f"; checkpoint in {launch.checkpointer.directory}{part}"
                     if own.all_steps() else "; no checkpoint saved")
        print(f"stopped by {why} after {consumed:,} env steps{saved}", file=sys.stderr)
        sys.exit(preemption.exit_code or 128 + signal.SIGTERM)


def run_summary(result: sebulba.RunResult, total_consumed: int) -> str:
    """`result.summary()`; in a multi-process run, whose figures are process 0's own (its
    envs, its learner), said so, after the run's: every process's consumed env steps and
    their rate (`total_consumed`: with those before a resume)."""
    if result.num_processes == 1:
        return result.summary()
    d = result.as_dict()
    before = total_consumed - d["global_consumed"]
    resumed = f" ({total_consumed:,} with the {before:,} before the resume)" if before else ""
    return "\n".join([
        f"the run, {d['num_processes']} processes: {d['global_consumed']:,} env steps "
        f"consumed{resumed}, {d['global_consumed_steps_per_second']:,.0f} consumed env "
        "steps/s",
        f"process 0 of {d['num_processes']}, its own envs and learner:",
        result.summary()])


def main(argv: list[str]) -> None:
    # Every bad value is reported before envs, threads or devices start.
    check_command_line(argv)
    agent_config, config = make_config()
    # Signals from here on stop the run cleanly (SIGTERM is how clusters preempt); one
    # that comes before training starts ends a single-process launcher with one line. A
    # process of a multi-process run must not end alone (its exit would wait in the
    # cluster's shutdown barrier for the others, which wait for it in their first
    # collective): it starts training with its stop event set, and the stop vote ends
    # every process after the same first updates, saved, with 128 + the signal.
    with Preemption(_GRACE.value) as preemption:
        launch = prepare(agent_config, config)
        restore(launch)
        if preemption.signum is not None and jax.process_count() > 1:
            print(f"process {jax.process_index()}: {signal.Signals(preemption.signum).name} "
                  "before training started: every process stops after its first updates",
                  file=sys.stderr)
        elif preemption.signum is not None:
            launch.close()
            print(f"stopped by {signal.Signals(preemption.signum).name} before training "
                  "started", file=sys.stderr)
            sys.exit(preemption.exit_code)
        train_and_report(launch, preemption)


def train_and_report(launch: Launch, preemption: Preemption) -> None:
    """`train`, its errors as one line (or as this process's end in a cluster), `report`."""
    if launch.consumed >= _TOTAL_ENV_STEPS.value:
        if jax.process_index() == 0:
            print(f"nothing to do: {launch.consumed:,} of {_TOTAL_ENV_STEPS.value:,} env "
                  "steps done")
        launch.close()
        return
    try:
        result = train(launch, preemption)
    except CheckpointSaveError as e:
        # The run stops at a failed save: it would go on without a way to keep its work.
        if jax.process_count() == 1:
            sys.exit(f"train.py: error: {e}")
        distributed.end_failed_process(f"this process's run failed: {e}")
    except Exception:
        if jax.process_count() == 1:
            raise
        distributed.end_failed_process("this process's run failed (traceback above); not "
                                       "waiting for the cluster's shutdown")
    report(launch, result, preemption)


def run() -> None:
    """Parses the command line and trains, as `python -m examples.train` does; a launcher
    of your own calls it after `agents.registry.register` adds its agent."""
    script = sys.argv[0]
    if sys.modules.get("__main__") is not sys.modules[__name__]:
        # A launcher of one's own: absl's --helpshort lists the main script's key flags,
        # so they are this launcher's run flags and the registered agents' flags.
        modules = [__name__, *(f"agents.{name}" for name in AGENTS if name not in SHIPPED)]
        for module in modules:
            for flag in flags.FLAGS.get_key_flags_for_module(module):
                flags.FLAGS.register_key_flag_for_module(script, flag)
    run_main(main)


if __name__ == "__main__":
    run()
