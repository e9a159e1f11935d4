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


def _blockwise_orthogonal(key: jax.Array, shape: tuple[int, ...], dtype=jnp.float32
                          ) -> jax.Array:
    """[H, 4H]: an orthogonal [H, H] block per gate, as for four separate cells."""
    rows, cols = shape
    keys = jax.random.split(key, cols // rows)
    init = nn.initializers.orthogonal()
    return jnp.concatenate([init(k, (rows, rows), dtype) for k in keys], axis=-1)


class LSTMCell(nn.Module):
    """An LSTM cell whose forget gate starts biased open.

    Maps ((cell, hidden) [B, H] each, x [B, D]) to ((cell, hidden), hidden). The gates
    (input, forget, candidate, output) come from one [D, 4H] and one [H, 4H] matmul. The
    forget gate's bias starts at `forget_bias` (Jozefowicz et al., 2015: 1.0), so at
    initialization a cell keeps sigmoid(1) = 0.73 of its content per step instead of half:
    what was seen k steps back still reaches the loss, and memory can be learnt.
    """

    hidden_size: int
    forget_bias: float = 1.0

    @nn.compact
    def __call__(self, carry: tuple[jax.Array, jax.Array], x: jax.Array
                 ) -> tuple[tuple[jax.Array, jax.Array], jax.Array]:
        cell, hidden = carry
        size = self.hidden_size

        def bias_init(key: jax.Array, shape: tuple[int, ...], dtype=jnp.float32) -> jax.Array:
            return jnp.zeros(shape, dtype).at[size:2 * size].set(self.forget_bias)

        gates = (nn.Dense(4 * size, use_bias=False, name="input")(x)
                 + nn.Dense(4 * size, kernel_init=_blockwise_orthogonal, bias_init=bias_init,
                            name="recurrent")(hidden))
        i, f, g, o = jnp.split(gates, 4, axis=-1)
        cell = nn.sigmoid(f) * cell + nn.sigmoid(i) * jnp.tanh(g)
        hidden = nn.sigmoid(o) * jnp.tanh(cell)
        return (cell, hidden), hidden


class _ResetLSTMStep(nn.Module):
    hidden_size: int
    forget_bias: float

    @nn.compact
    def __call__(
        self, state: LSTMState, inputs: tuple[jax.Array, jax.Array]
    ) -> tuple[LSTMState, jax.Array]:
        x, first = inputs  # [B, D], [B]
        state = reset_where(first, state)
        (cell, hidden), out = LSTMCell(self.hidden_size, self.forget_bias, name="cell")(
            (state.cell, state.hidden), x)
        return LSTMState(cell, hidden), out


class ResetLSTM(nn.Module):
    """LSTM over time with the state zeroed before every step whose `first` is set.

    Maps (state [B, H] leaves, x [B, T, D], first [B, T] bool) to (state after the last
    step, outputs [B, T, H]). A masked scan: no Python per step, one compiled loop.
    """

    hidden_size: int
    forget_bias: float = 1.0

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
        return scan(self.hidden_size, self.forget_bias, name="step")(state, (x, first))
