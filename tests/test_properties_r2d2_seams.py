"""R2D2's sequences across a resume seam, for random episodes on both sides of it and a
resume after a random number of cycles.

A resumed run keeps the experience's pending steps and resets its envs: the first
trajectory after the resume starts with a `first` step that follows the last acted step
before it (the old bootstrap step is lost). Every sequence in the replay must then be
the window of the env's joined stream, begin at the actor's state of its first cycle,
and learn nothing across the seam: its n-step targets stop before it (against the
brute-force sums), the action before it is masked, and its losses are those of the same
sequence with the old episode truncated at that action.

Shapes are fixed (2 envs, T = 4, L = 8, a replay of 32), so each function compiles once.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import event, given
from hypothesis import strategies as st

import sebulba
from agents.common.returns import action_mask
from agents.r2d2 import R2D2, R2D2StepState, n_step_returns
from sebulba.types import EnvStep, Trajectory
from tests import brute_force as bf
from tests.test_r2d2 import NUM_ACTIONS, OBS_DIM, SPEC, small_config

E, T, L, N_STEP, DISCOUNT = 2, 4, 8, 3, 0.9  # envs, sequence period, length, n, discount
K = L // T  # cycles per sequence
targets = jax.jit(jax.vmap(n_step_returns, in_axes=(0, 0, 0, 0, None, None, 0)),
                  static_argnums=5)
masks = jax.jit(jax.vmap(action_mask))


class Setup(NamedTuple):
    agent: R2D2
    nets: object
    empty: object  # an experience without sequences (not donated below)
    update: Callable
    losses: Callable


@functools.cache
def setup() -> Setup:
    """Built on first use, not when the module is collected."""
    agent = R2D2(SPEC, small_config(sequence_length=L, sequence_overlap=L - T, burn_in=1,
                                    n_step=N_STEP, discount=DISCOUNT, replay_capacity=32))
    nets = agent.new_networks(jax.random.key(0))
    layout = sebulba.Layout(envs_per_group=E, num_groups=1, steps_per_cycle=T,
                            num_learner_devices=1)
    return Setup(agent, nets, agent.new_experience_state(nets, jax.random.key(2), layout),
                 jax.jit(agent.update_experience), jax.jit(agent.sequence_losses))


def tagged(tag: np.ndarray, like: jax.Array) -> jax.Array:
    """`like`'s shape, env e's entries all tag[e]."""
    return jnp.broadcast_to(jnp.asarray(tag).reshape((E,) + (1,) * (like.ndim - 1)),
                            like.shape)


def cycles(agent: R2D2, envs: list[bf.Stream], actions: np.ndarray, offset: int
           ) -> list[tuple[R2D2StepState, Trajectory]]:
    """The (initial step state, trajectory) of each cycle of the envs' streams [T c + 1],
    their cycles numbered from `offset` on: observations [step in the joined stream, env,
    0], core states tagged with the cycle's number (+ 100 env)."""
    count = (len(envs[0].reward) - 1) // T
    out = []
    for c in range(count):
        steps = slice(c * T, c * T + T + 1)
        obs = np.zeros((E, T + 1, OBS_DIM), np.float32)
        obs[:, :, 0] = offset * T + np.arange(c * T, c * T + T + 1)
        obs[:, :, 1] = np.arange(E)[:, None]
        env_steps = EnvStep(jnp.asarray(obs), *(
            jnp.asarray(np.stack([getattr(s, name)[steps] for s in envs]))
            for name in ("reward", "terminated", "truncated", "first")))
        tag = (offset + c) + 100.0 * np.arange(E, dtype=np.float32)
        core = jax.tree.map(functools.partial(tagged, tag), agent.network.initial_state(E))
        initial = R2D2StepState(core, jax.random.split(jax.random.key(1), E),
                                jnp.zeros(E), jnp.arange(E, dtype=jnp.int32))
        action = jnp.asarray(actions[:, c * T:(c + 1) * T], jnp.int32)
        out.append((initial, Trajectory(env_steps, sebulba.ActorOutput(action))))
    return out


def joined(before: bf.Stream, after: bf.Stream) -> bf.Stream:
    """An env's stream as the sequences completed after the resume see it: the steps
    acted before the resume (not the last trajectory's bootstrap step), then the reset
    env's steps."""
    return bf.Stream(*(np.concatenate([b[:-1], a]) for b, a in zip(before, after,
                                                                    strict=True)))


@pytest.mark.timeout(180)
@bf.examples(25)
@given(data=st.data(), before=st.integers(1, 3), after=st.integers(1, 3),
       seed=st.integers(0, 2**31 - 1))
def test_sequences_across_a_resume_hold_the_joined_streams_and_learn_nothing_across_it(
        data, before, after, seed):
    pre = [data.draw(bf.streams(before * T + 1)) for _ in range(E)]
    post = [data.draw(bf.streams(after * T + 1, starts=True)) for _ in range(E)]
    rng = np.random.default_rng(seed)
    pre_actions = rng.integers(0, NUM_ACTIONS, (E, before * T))
    post_actions = rng.integers(0, NUM_ACTIONS, (E, after * T))
    agent, nets, experience, update, losses = setup()
    for initial, trajectory in (cycles(agent, pre, pre_actions, 0)
                                + cycles(agent, post, post_actions, before)):
        # The resume keeps the experience (a checkpoint restores it bit for bit).
        experience = update(experience, initial, None, trajectory, nets)

    streams = [joined(b, a) for b, a in zip(pre, post, strict=True)]
    actions = np.concatenate([pre_actions, post_actions], axis=1)
    replay = experience.replay
    total = before + after
    assert int(replay.size) == E * max(0, total - K + 1)
    items = jax.tree.map(np.asarray, replay.items)
    for i in range(int(replay.size)):
        j, env = K - 1 + i // E, i % E  # the cycle that completed it; rows in env order
        start = (j - K + 1) * T
        window = slice(start, start + L + 1)
        # Sequences completed before the resume end at the bootstrap step it lost.
        s = streams[env] if j >= before else pre[env]
        assert items.env_index[i] == env
        np.testing.assert_array_equal(items.env_steps.obs[i, :, 0],
                                      np.arange(start, start + L + 1))
        for name in ("reward", "terminated", "truncated", "first"):
            np.testing.assert_array_equal(getattr(items.env_steps, name)[i],
                                          getattr(s, name)[window], err_msg=name)
        np.testing.assert_array_equal(items.action[i], actions[env, start:start + L])
        for leaf in jax.tree.leaves(items.core):  # the actor's state at its first cycle
            assert np.all(leaf[i] == (j - K + 1) + 100.0 * env)

    # Targets and masks of every stored sequence: a random bootstrap value per step.
    steps = jax.tree.map(jnp.asarray, replay.items.env_steps)
    values = jnp.asarray(rng.normal(size=steps.reward.shape), jnp.float32)
    got = np.asarray(targets(steps.reward, values, steps.terminated, steps.truncated,
                             DISCOUNT, N_STEP, steps.first))
    mask = np.asarray(masks(steps.terminated, steps.truncated, steps.first))
    crossed = 0
    for i in range(int(replay.size)):
        seq = bf.Stream(*(np.asarray(x[i]) for x in (steps.reward, values, steps.terminated,
                                                     steps.truncated, steps.first)))
        want = bf.n_step_targets(*seq, DISCOUNT, N_STEP)
        assert np.flatnonzero(mask[i]).tolist() == sorted(want)
        for t, g in want.items():
            scale = np.sum(np.abs(seq.reward)) + np.max(np.abs(seq.value))
            bf.assert_close(got[i, t:t + 1], [g], [scale], f"sequence {i}, target {t}")
        seams = np.flatnonzero(seq.first[1:] & ~seq.last[:-1]) + 1
        assert np.all(mask[i, seams - 1] == 0)  # the action before a seam has no outcome
        crossed += len(seams)
    event(f"sequences crossing a seam: {crossed}")

    # A seam is the old episode truncated at the step before it: the same losses and
    # priorities (targets, masks and LSTM resets alike).
    seam = np.asarray(steps.first[:, 1:] & ~(steps.terminated | steps.truncated)[:, :-1])
    truncated = np.asarray(steps.truncated).copy()
    truncated[:, :-1] |= seam
    cut = replay.items._replace(env_steps=steps._replace(truncated=jnp.asarray(truncated)))
    seam_losses, seam_priorities, _ = losses(nets, replay.items)
    cut_losses, cut_priorities, _ = losses(nets, cut)
    np.testing.assert_allclose(seam_losses, cut_losses, rtol=1e-6)
    np.testing.assert_allclose(seam_priorities, cut_priorities, rtol=1e-6)
