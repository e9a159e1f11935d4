"""One lockstep SPG run on CartPole-v1, as test_device_invariance.py runs it in pytest's
process and tests/multihost_worker.py (mode "lockstep_spg") in each process of a cluster.

Import it after XLA_FLAGS is set: it imports JAX.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import sebulba
from agents.spg import SPG, SPGConfig
from sebulba.types import PyTree

ENV = "CartPole-v1"
ENVS = 4  # envs of the whole run (all processes), one group per process
STEPS = 8  # steps per cycle: some CartPole episodes end within the 24 steps of 3 updates
UPDATES = 3
SEED = 3


def make_loop(envs_per_group: int, num_learner_devices: int) -> sebulba.Sebulba:
    """Lockstep SPG with tiny networks; one group of `envs_per_group` envs in this process
    (acting on device 0), learning on its first `num_learner_devices` devices."""
    config = sebulba.Config(env=ENV, envs_per_group=envs_per_group, steps_per_cycle=STEPS,
                            async_factor=1, vectorization="sync", inference_devices=[0],
                            learner_devices=list(range(num_learner_devices)),
                            lockstep=True, seed=SEED)
    agent = SPG(sebulba.env_spec(ENV), SPGConfig(hidden_sizes=(8,), learning_rate=1e-2))
    return sebulba.Sebulba(agent, config)


def run(loop: sebulba.Sebulba, step_state: PyTree | None = None) -> sebulba.RunResult:
    """UPDATES learner updates from the loop's initial state (its step state replaced by
    `step_state` if given). `total_env_steps` counts every process's steps."""
    state = loop.initial_state()
    if step_state is not None:
        state = state._replace(step_state=step_state)
    result = loop.run(ENVS * STEPS * UPDATES, state)
    assert result.learner_updates == UPDATES, result.learner_updates
    return result


def leaves(tree: PyTree) -> list[np.ndarray]:
    """The tree's leaves as host arrays (typed PRNG keys as their key data)."""
    def host(x):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        return np.asarray(x)

    return [host(x) for x in jax.tree.leaves(tree)]


def save(path: str, tree: PyTree) -> None:
    np.savez(path, *leaves(tree))


def load(path: str) -> list[np.ndarray]:
    with np.load(path) as f:
        return [f[f"arr_{i}"] for i in range(len(f.files))]


def envs_slice(like: PyTree, whole: list[np.ndarray], start: int) -> PyTree:
    """`like`'s structure with its per-env leaves [n, ...] taken from `whole`'s rows
    [start, start + n) (a key leaf's from its key data)."""
    def take(x, w):
        rows = w[start:start + x.shape[0]]
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            return jax.random.wrap_key_data(jnp.asarray(rows), impl=jax.random.key_impl(x))
        return jnp.asarray(rows, x.dtype)

    flat, tree = jax.tree.flatten(like)
    assert len(flat) == len(whole), (len(flat), len(whole))
    return jax.tree.unflatten(tree, [take(x, w) for x, w in zip(flat, whole, strict=True)])
