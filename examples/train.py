"""Train an agent in the Sebulba loop.

    python -m examples.train                      # SPG on CartPole-v1, a few minutes on CPU
    python -m examples.train --num_envs=32 --async_factor=1 --total_env_steps=500000

Devices are chosen by index into this process's local devices. Across machines, run the
same command on every host with its own --process_id:

    python -m examples.train --coordinator_address=HOST0:1234 --num_processes=2 --process_id=0
"""

from __future__ import annotations

import json

import jax
from absl import app, flags

import sebulba
from agents.spg import SPG, SPGConfig
from sebulba import distributed

_ENV = flags.DEFINE_string("env", "CartPole-v1", "A gymnasium.make_vec id.")
_NUM_ENVS = flags.DEFINE_integer("num_envs", 16, "Envs per env group (one inferencer thread).")
_VECTORIZATION = flags.DEFINE_enum(
    "vectorization", "sync", ["sync", "async", "vector_entry_point"], "How env groups step.")
_ASYNC_FACTOR = flags.DEFINE_integer(
    "async_factor", 2, "Env groups per inference device (2 = double buffering).")
_STEPS_PER_CYCLE = flags.DEFINE_integer("steps_per_cycle", 16, "Env steps per inference cycle.")
_INFERENCE_DEVICES = flags.DEFINE_list(
    "inference_devices", ["0"], "Local device indices that run inference.")
_LEARNER_DEVICES = flags.DEFINE_list(
    "learner_devices", ["0"], "Local device indices the learner spans.")
_TOTAL_ENV_STEPS = flags.DEFINE_integer("total_env_steps", 300_000, "Env steps to learn from.")
_SEED = flags.DEFINE_integer("seed", 0, "Seeds networks, agent state and envs.")
_LEARNING_RATE = flags.DEFINE_float(
    "spg_learning_rate", SPGConfig.learning_rate, "SPG: Adam step size.")
_HIDDEN = flags.DEFINE_list(
    "spg_hidden_sizes", [str(h) for h in SPGConfig.hidden_sizes], "SPG: MLP layer sizes.")
_COORDINATOR = flags.DEFINE_string(
    "coordinator_address", None,
    "host:port of process 0 for a multi-process run (jax.distributed); unset: one process.")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Processes in a multi-process run.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's index, 0..num_processes-1.")


def _indices(name: str, values: list[str]) -> list[int]:
    try:
        return [int(v) for v in values]
    except ValueError:
        raise app.UsageError(f"--{name} must be device indices, got {values}") from None


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if _COORDINATOR.value is not None:
        distributed.initialize(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)
    config = sebulba.Config(
        env=_ENV.value,
        envs_per_group=_NUM_ENVS.value,
        vectorization=_VECTORIZATION.value,
        async_factor=_ASYNC_FACTOR.value,
        steps_per_cycle=_STEPS_PER_CYCLE.value,
        inference_devices=_indices("inference_devices", _INFERENCE_DEVICES.value),
        learner_devices=_indices("learner_devices", _LEARNER_DEVICES.value),
        seed=_SEED.value,
    )
    agent_config = SPGConfig(
        hidden_sizes=tuple(int(h) for h in _HIDDEN.value), learning_rate=_LEARNING_RATE.value)
    agent = SPG(sebulba.env_spec(config.env), agent_config)
    result = sebulba.Sebulba(agent, config).run(_TOTAL_ENV_STEPS.value)
    if jax.process_index() == 0:  # every process has the same networks: report once
        print(result.summary())
        print(json.dumps({k: v for k, v in result.as_dict().items() if k != "metrics"}))


if __name__ == "__main__":
    app.run(main)
