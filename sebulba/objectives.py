"""Several objectives, each with its own part of the networks and its own optimizer.

The learner differentiates one scalar (`Agent.loss`) with respect to the networks'
differentiated part and hands the gradient to `Agent.optimize_from_grads`. An agent with
several objectives (SAC: a critic loss, an actor loss, a temperature loss) wants each
objective's gradient on its own part only: the actor loss reads the critic but must not
train it, the critic's target reads the actor but must not train it.

`own_part_losses` builds that scalar so it cannot be got wrong: the networks are a
NamedTuple with one field per objective (plus fields no objective trains, e.g.
counters, held out by `partition_for_grad`), and objective `f` is called on a view of
the networks in which every field but `f` is a constant. The sum of the objectives
then has, on field `f`, exactly the gradient of objective `f`: no objective needs to
remember a `stop_gradient`, and one added later gets the same isolation.
`per_field_optimizer` then gives each field its own optax optimizer (its own learning
rate and state), so `optimize_from_grads` is one `update` call.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from sebulba.types import Metrics

Objective = Callable[[Any], tuple[jax.Array, Metrics]]


def _check_fields(nets: NamedTuple, names: Any) -> None:
    fields = getattr(nets, "_fields", None)
    if fields is None:
        raise TypeError(f"the networks must be a NamedTuple, got {type(nets).__name__}")
    unknown = [name for name in names if name not in fields]
    if unknown:
        raise ValueError(f"objectives {unknown} name no field of {type(nets).__name__}, "
                         f"whose fields are {fields}")


def own_part_losses(nets: NamedTuple, objectives: Mapping[str, Objective]
                    ) -> tuple[jax.Array, Metrics]:
    """The sum of the objectives, each differentiable only in its own field of `nets`.

    Args:
      nets: NamedTuple of network parts (as the learner passes them to `Agent.loss`).
      objectives: field name -> fn(nets) -> (scalar loss, metrics); fn sees every other
        field as a constant.

    Returns:
      (sum of the losses, the objectives' metrics merged with `<field>_loss` for each).
    """
    _check_fields(nets, objectives)
    total = jnp.zeros((), jnp.float32)
    metrics: Metrics = {}
    for name, objective in objectives.items():
        view = nets._replace(**{f: jax.lax.stop_gradient(getattr(nets, f))
                                for f in nets._fields if f != name})
        loss, extra = objective(view)
        total = total + loss
        metrics = {**metrics, **extra, f"{name}_loss": loss}
    return total, metrics


def per_field_optimizer(optimizers: Mapping[str, optax.GradientTransformation]
                        ) -> optax.GradientTransformation:
    """One optax transformation applying `optimizers[f]` to field `f` of a NamedTuple of
    parameters (and of its gradients); a field named by no optimizer must hold no
    arrays (None, as `partition_for_grad` leaves held-out parts)."""

    def labels(params: NamedTuple) -> NamedTuple:
        _check_fields(params, optimizers)
        for field in params._fields:
            if field not in optimizers and jax.tree.leaves(getattr(params, field)):
                raise ValueError(f"field {field!r} holds parameters but has no optimizer; "
                                 f"optimizers are given for {tuple(optimizers)}")
        return type(params)(*(jax.tree.map(lambda _, f=f: f, getattr(params, f))
                              for f in params._fields))

    return optax.multi_transform(dict(optimizers), labels)
