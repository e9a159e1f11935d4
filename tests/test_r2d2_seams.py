"""R2D2's targets and loss mask across a seam: a `first` step that follows a step which
did not end its episode (what a resumed run's reset envs leave in the sequences that join
the pending steps saved before the resume to the steps after it). No target crosses it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agents.common.returns import action_mask
from agents.r2d2 import R2D2, Sequence, n_step_returns
from tests.test_r2d2 import SPEC, random_sequences, small_config


def brute_force_targets(reward, value, terminated, truncated, first, discount, n):
    """{t: G_t} for every step t whose action has an outcome in the stream, from episode
    numbers alone: G_t sums the discounted rewards of steps t+1..j, the steps of t's
    episode at most n ahead, and adds discount^(j-t) value[j] unless j terminated."""
    m = len(reward) - 1
    episode = np.cumsum(first)  # a step's episode: how many starts up to it
    targets = {}
    for t in range(m):
        if episode[t + 1] != episode[t] or terminated[t] or truncated[t]:
            continue  # the action at t was ignored, or its outcome is in another episode
        ahead = [i for i in range(t + 1, min(t + n, m) + 1) if episode[i] == episode[t]]
        j = max(ahead)
        g = sum(discount ** (i - t - 1) * reward[i] for i in ahead)
        targets[t] = g + (0.0 if terminated[j] else discount ** (j - t) * value[j])
    return targets


@pytest.mark.timeout(120)
def test_a_seam_ends_the_targets_before_it():
    # Steps 0..9: a seam at step 5 (step 4 neither terminated nor truncated: the old
    # episode's steps before a resume, then the reset envs' first step).
    reward = np.array([0.0, 1.0, 2.0, 4.0, 8.0, 0.0, 100.0, 200.0, 400.0, 800.0], np.float32)
    value = np.arange(10, 110, 10, dtype=np.float32)
    no = np.zeros(10, bool)
    first = no.copy()
    first[[0, 5]] = True
    got = np.asarray(n_step_returns(jnp.asarray(reward), jnp.asarray(value), jnp.asarray(no),
                                    jnp.asarray(no), 0.5, 3, jnp.asarray(first)))
    mask = np.asarray(action_mask(jnp.asarray(no), jnp.asarray(no), jnp.asarray(first)))
    np.testing.assert_array_equal(mask, [1, 1, 1, 1, 0, 1, 1, 1, 1])
    # Step 2's 3-step target would take step 5's reset and the new episode's value; step
    # 3's would be made of the new episode's rewards: both stop at step 4 instead.
    assert got[2] == pytest.approx(4 + 0.5 * 8 + 0.25 * value[4])
    assert got[3] == pytest.approx(8 + 0.5 * value[4])
    assert got[5] == pytest.approx(100 + 0.5 * 200 + 0.25 * 400 + 0.125 * value[8])
    expected = brute_force_targets(reward, value, no, no, first, 0.5, 3)
    assert sorted(expected) == np.flatnonzero(mask).tolist()
    for t, g in expected.items():
        assert got[t] == pytest.approx(g), t


@pytest.mark.timeout(120)
@pytest.mark.parametrize("seed", range(5))
def test_targets_match_brute_force_sums_with_ends_truncations_and_seams(seed):
    rng = np.random.default_rng(seed)
    m, n, discount = 40, 5, 0.9
    reward = rng.normal(size=m + 1).astype(np.float32)
    value = rng.normal(size=m + 1).astype(np.float32)
    last = rng.uniform(size=m + 1) < 0.15
    terminated = last & (rng.uniform(size=m + 1) < 0.5)
    truncated = last & ~terminated
    seam = rng.uniform(size=m + 1) < 0.1
    first = np.zeros(m + 1, bool)
    first[0] = True
    first[1:] = last[:-1] | seam[1:]  # NEXT_STEP autoreset, and seams besides
    reward[first] = 0.0  # a reset step follows no action
    got = np.asarray(n_step_returns(*map(jnp.asarray, (reward, value, terminated, truncated)),
                                    discount, n, jnp.asarray(first)))
    mask = np.asarray(action_mask(*map(jnp.asarray, (terminated, truncated, first))))
    expected = brute_force_targets(reward, value, terminated, truncated, first, discount, n)
    assert sorted(expected) == np.flatnonzero(mask).tolist()
    for t, g in expected.items():
        assert got[t] == pytest.approx(g, rel=1e-5, abs=1e-5), t


@pytest.mark.timeout(240)
def test_the_loss_treats_a_seam_as_the_old_episodes_truncation():
    # A seam at step s is the old episode cut at s - 1: the same targets, the same mask
    # (the action at s - 1 has no outcome in the sequence), the same LSTM resets.
    cfg = small_config(burn_in=1, n_step=3)
    agent = R2D2(SPEC, cfg)
    nets = agent.new_networks(jax.random.key(0))
    seqs = random_sequences(jax.random.key(1), 4, cfg, first_rate=0.0)
    s = 5
    steps = seqs.env_steps
    seam = steps._replace(first=steps.first.at[:, s].set(True),
                          reward=steps.reward.at[:, s].set(0.0))
    cut = seam._replace(truncated=seam.truncated.at[:, s - 1].set(True))
    losses = jax.jit(agent.sequence_losses)
    seam_losses, seam_priorities, _ = losses(nets, seqs._replace(env_steps=seam))
    cut_losses, cut_priorities, _ = losses(nets, Sequence(cut, *seqs[1:]))
    np.testing.assert_allclose(seam_losses, cut_losses, rtol=1e-6)
    np.testing.assert_allclose(seam_priorities, cut_priorities, rtol=1e-6)
