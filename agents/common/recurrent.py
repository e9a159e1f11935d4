"""An LSTM core that resets where episodes start, the same code for acting and training.

Acting calls it with T = 1 each env step; training unrolls it over [B, T] from the
state the actor had at the first step (from the initial StepState). Both go through one
`nn.scan` over the same step function, so the parameters and the reset rule cannot drift
apart between the two.
"""

from __future__ import annotations

from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp


class LSTMState(NamedTuple):
    """Leaves [B, hidden_size]."""

    cell: jax.Array
    hidden: jax.Array


def initial_lstm_state(batch_size: int, hidden_size: int) -> LSTMState:
    """The state an episode starts from: zeros [B, H]."""
    zeros = jnp.zeros((batch_size, hidden_size), jnp.float32)
    return LSTMState(zeros, zeros)


def reset_where(first: jax.Array, state: LSTMState) -> LSTMState:
    """Zeros the state of the rows [B] where `first` is set (an episode starts)."""
    return jax.tree.map(lambda s: jnp.where(first[:, None], jnp.zeros_like(s), s), state)


class _ResetLSTMStep(nn.Module):
    hidden_size: int

    @nn.compact
    def __call__(
        self, state: LSTMState, inputs: tuple[jax.Array, jax.Array]
    ) -> tuple[LSTMState, jax.Array]:
        x, first = inputs  # [B, D], [B]
        state = reset_where(first, state)
        (cell, hidden), out = nn.OptimizedLSTMCell(self.hidden_size, name="cell")(
            (state.cell, state.hidden), x)
        return LSTMState(cell, hidden), out


class ResetLSTM(nn.Module):
    """LSTM over time with the state zeroed before every step whose `first` is set.

    Maps (state [B, H] leaves, x [B, T, D], first [B, T] bool) to (state after the last
    step, outputs [B, T, H]). A masked scan: no Python per step, one compiled loop.
    """

    hidden_size: int

    @nn.compact
    def __call__(
        self, state: LSTMState, x: jax.Array, first: jax.Array
    ) -> tuple[LSTMState, jax.Array]:
        scan = nn.scan(
            _ResetLSTMStep,
            variable_broadcast="params",
            split_rngs={"params": False},
            in_axes=1,
            out_axes=1,
        )
        return scan(self.hidden_size, name="step")(state, (x, first))
