"""Segments against brute force: the layout's sizing and its errors for random sizes;
where random episodes begin inside each segment; the recurrent unroll of segments from
the actor's recorded states equals the unroll of the whole streams; the K agents of an
env grouped together.

The LSTM is jitted once per segment horizon (one stream shape, horizons dividing it).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from agents.common.recurrent import ResetLSTM, initial_lstm_state
from sebulba.experience import segments
from tests import brute_force as bf

E, T, D, CELLS = 3, 12, 4, 6  # envs, steps per cycle, observation size, LSTM cells
HORIZONS = [1, 2, 3, 4, 6, 12]  # every H dividing T


@pytest.mark.timeout(60)
@bf.examples(300)
@given(envs=st.integers(1, 40), steps=st.integers(1, 40), bptt=st.integers(0, 45),
       minibatches=st.integers(1, 12), shards=st.integers(1, 4),
       expected=st.sampled_from(["none", "exact", "other"]), other=st.integers(1, 5000))
def test_layout_sizes_exactly_or_names_the_numbers(envs, steps, bptt, minibatches, shards,
                                                   expected, other):
    horizon = bptt or steps
    per_shard = envs * (steps // horizon)
    asked = {"none": 0, "exact": per_shard * shards, "other": other}[expected]
    try:
        layout = segments.segment_layout(envs, steps, bptt, minibatches, shards, asked)
    except ValueError as e:
        message = str(e)
    else:
        message = None
    # Brute force: the first rule broken, in the order a reader checks them.
    if steps % horizon:
        assert f"bptt_horizon={bptt} must divide steps_per_cycle={steps}" in message
    elif asked and asked != per_shard * shards:
        assert f"sized for {asked} segments, but the envs fill {per_shard * shards}" \
            in message
    elif per_shard % minibatches:
        assert f"num_minibatches={minibatches} must divide the {per_shard} segments" \
            in message
    else:
        assert message is None
        assert (layout.horizon, layout.num_segments, layout.total_segments) == (
            horizon, per_shard, per_shard * shards)
        assert layout.minibatch_size * minibatches == per_shard
        cut = segments.to_segments(np.zeros((envs, steps)), layout.horizon)
        assert cut.shape == (layout.num_segments, horizon)  # no empty slot, none left out


@st.composite
def episode_starts(draw) -> np.ndarray:
    """[E, T] bool: where episodes of random lengths (1 to T + 2) start in each env's
    stream; a stream may start inside an episode that began before it."""
    first = np.zeros((E, T), bool)
    for env in range(E):
        t = -draw(st.integers(0, T))  # where the episode under way at step 0 began
        while t < T:
            if t >= 0:
                first[env, t] = True
            t += draw(st.integers(1, T + 2))
    return first


@pytest.mark.timeout(60)
@bf.examples(100)
@given(first=episode_starts(), horizon=st.sampled_from(HORIZONS))
def test_each_segment_holds_its_stretch_and_the_episode_starts_inside_it(first, horizon):
    steps = np.broadcast_to(np.arange(T), (E, T))
    envs = np.broadcast_to(np.arange(E)[:, None], (E, T))
    episode = np.cumsum(first, axis=1)  # episodes begun in this stream so far
    cut = {name: segments.to_segments(x, horizon) for name, x in
           {"first": first, "step": steps, "env": envs, "episode": episode}.items()}
    starts = segments.segment_starts({"step": steps, "env": envs}, horizon)
    chunks = T // horizon
    for i in range(E * chunks):
        env, start = i // chunks, (i % chunks) * horizon
        window = range(start, start + horizon)
        assert cut["env"][i].tolist() == [env] * horizon
        assert cut["step"][i].tolist() == list(window)
        assert (starts["env"][i], starts["step"][i]) == (env, start)
        # Brute force from the episodes themselves: the steps of the window where one
        # begins, and the episodes the window holds (the end of one, the start of the
        # next, ...).
        begins = [k - start for k in window if first[env, k]]
        assert np.flatnonzero(cut["first"][i]).tolist() == begins
        held = sorted({int(episode[env, k]) for k in window})
        assert held == list(range(episode[env, start], episode[env, start] + len(begins)
                                  - (1 if first[env, start] else 0) + 1))


CORE = ResetLSTM(CELLS)
unroll = jax.jit(CORE.apply)


@functools.cache
def params():
    """Built on first use, not when the module is collected."""
    return CORE.init(jax.random.key(0), initial_lstm_state(E, CELLS), jnp.zeros((E, T, D)),
                     jnp.zeros((E, T), bool))


@jax.jit
def acting_states(params, state, obs, first):
    """The state the actor holds before each step (what a recurrent agent records in
    its extras), acting one step at a time: leaves [E, T, CELLS]."""
    def step(state, xs):
        x, f = xs
        new, _ = CORE.apply(params, state, x[:, None], f[:, None])
        return new, state

    _, before = jax.lax.scan(step, state, (jnp.swapaxes(obs, 0, 1), first.T))
    return jax.tree.map(lambda s: jnp.swapaxes(s, 0, 1), before)


@pytest.mark.timeout(120)
@bf.examples(25)
@given(first=episode_starts(), horizon=st.sampled_from(HORIZONS),
       seed=st.integers(0, 2**31 - 1))
def test_unrolling_segments_from_the_recorded_states_is_unrolling_the_streams(
        first, horizon, seed):
    obs_key, state_key = jax.random.split(jax.random.key(seed))
    obs = jax.random.normal(obs_key, (E, T, D))
    # A trajectory that continues episodes: the state at step 0 is not zero.
    state = jax.tree.map(lambda s: s + jax.random.normal(state_key, s.shape),
                         initial_lstm_state(E, CELLS))
    first = jnp.asarray(first)
    _, whole = unroll(params(), state, obs, first)
    starts = segments.segment_starts(acting_states(params(), state, obs, first), horizon)
    cut_obs, cut_first = (segments.to_segments(x, horizon) for x in (obs, first))
    _, pieces = unroll(params(), starts, cut_obs, cut_first)
    np.testing.assert_allclose(np.asarray(pieces).reshape(E, T, CELLS), np.asarray(whole),
                               rtol=1e-5, atol=1e-5)
    # The resets matter: where an episode begins inside a segment (not at its first
    # step), the same unroll without them gives other outputs.
    if np.asarray(cut_first)[:, 1:].any():
        _, unreset = unroll(params(), starts, cut_obs, jnp.zeros_like(cut_first))
        assert not np.allclose(np.asarray(unreset), np.asarray(pieces), atol=1e-4)


@pytest.mark.timeout(60)
@bf.examples(12)
@given(envs=st.integers(1, 4), agents=st.integers(1, 3), chunks=st.integers(1, 3))
def test_the_agents_of_an_env_are_adjacent_segments(envs, agents, chunks):
    rows = envs * agents  # env-major: row e K + j is agent j of env e
    tags = np.array([(row, c) for row in range(rows) for c in range(chunks)])  # to_segments
    grouped = np.asarray(segments.group_by_env(jnp.asarray(tags), agents, rows))
    for e in range(envs):
        for c in range(chunks):
            for j in range(agents):
                assert grouped[(e * chunks + c) * agents + j].tolist() == [e * agents + j, c]
