"""The learner's compiled functions, mapped over the learner devices.

Each function is `jax.jit(jax.shard_map(...))` over the 1-D learner mesh: the modern
form of `pmap` (JAX's own `pmap` is implemented this way since 0.8). Arguments and
results carry a leading learner axis; the agent's functions see one device's entry,
without that axis. Gradients and metrics are averaged with `pmean` over the mesh.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
from jax.sharding import PartitionSpec as P

from sebulba import sharding
from sebulba.agent import Agent, combine_partitions
from sebulba.types import Experience, Metrics, Nets, OptState, StepState, Trajectory

LEARNER_AXIS = sharding.LEARNER_AXIS


def per_learner_device(
    fn: Callable, devices: Sequence[jax.Device], donate_argnums: tuple[int, ...]
) -> Callable:
    """Compiles `fn` to run on each learner device on its own entry of every argument."""

    def on_one_device(*args):
        out = fn(*jax.tree.map(lambda x: x[0], args))
        return jax.tree.map(lambda x: x[None], out)

    mesh = sharding.learner_mesh(tuple(devices))
    spec = P(LEARNER_AXIS)
    mapped = jax.shard_map(on_one_device, mesh=mesh, in_specs=spec, out_specs=spec)
    return jax.jit(mapped, donate_argnums=donate_argnums)


class LearnerFunctions:
    """`update_experience` and one optimizer step, compiled over the learner devices."""

    def __init__(self, agent: Agent, devices: Sequence[jax.Device]):
        self.agent = agent
        self.update_experience: Callable[
            [Experience, StepState, StepState, Trajectory, Nets], Experience
        ] = per_learner_device(agent.update_experience, devices, donate_argnums=(0,))
        self.optimize: Callable[
            [Nets, OptState, Experience], tuple[Nets, OptState, Experience, Metrics]
        ] = per_learner_device(self._optimize, devices, donate_argnums=(0, 1, 2))

    def _optimize(self, nets: Nets, opt: OptState, experience: Experience):
        agent = self.agent
        diff, fixed = agent.partition_for_grad(nets)

        def loss_fn(diff_nets):
            return agent.loss(combine_partitions(diff_nets, fixed), opt, experience)

        (loss, (experience, metrics)), grads = jax.value_and_grad(loss_fn, has_aux=True)(diff)
        grads = jax.lax.pmean(grads, LEARNER_AXIS)
        nets, opt = agent.optimize_from_grads(nets, opt, grads)
        metrics = jax.lax.pmean({**metrics, "loss": loss}, LEARNER_AXIS)
        return nets, opt, experience, metrics
