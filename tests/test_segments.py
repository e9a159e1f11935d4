"""Segments: exact sizing, the cut itself, and prioritized sampling by advantage."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sebulba.experience import segments


@pytest.mark.timeout(30)
def test_layout_sizes_the_buffer_from_the_envs():
    layout = segments.segment_layout(envs_per_shard=8, steps_per_cycle=32, bptt_horizon=8,
                                     num_minibatches=4, num_shards=2)
    assert (layout.horizon, layout.num_segments, layout.total_segments) == (8, 32, 64)
    assert layout.minibatch_size == 8
    whole = segments.segment_layout(8, 32, 0, 4)  # 0: one segment per env and trajectory
    assert (whole.horizon, whole.num_segments) == (32, 8)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kwargs,message", [
    # Segments with exact sizing: 2,720 envs x 3 agents = 8,160 streams do not fill a
    # buffer sized for 8,192 segments (a PufferLib-style batch size).
    ({"envs_per_shard": 8160, "steps_per_cycle": 64, "bptt_horizon": 64, "num_minibatches": 32,
      "expected_segments": 8192},
     r"sized for 8192 segments, but the envs fill 8160 per update"),
    ({"envs_per_shard": 8, "steps_per_cycle": 32, "bptt_horizon": 12, "num_minibatches": 1},
     r"bptt_horizon=12 must divide steps_per_cycle=32"),
    ({"envs_per_shard": 8, "steps_per_cycle": 32, "bptt_horizon": 64, "num_minibatches": 1},
     r"bptt_horizon=64 must divide steps_per_cycle=32"),
    ({"envs_per_shard": 6, "steps_per_cycle": 32, "bptt_horizon": 16, "num_minibatches": 5},
     r"num_minibatches=5 must divide the 12 segments of each learner device"),
])
def test_mismatched_sizes_are_construction_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        segments.segment_layout(**kwargs)


@pytest.mark.timeout(30)
def test_segments_cut_each_env_stream_in_order():
    e, t, h = 3, 8, 4
    tags = jnp.arange(e * t).reshape(e, t) + 100 * jnp.arange(e)[:, None]  # env * 100 + ...
    cut = segments.to_segments(tags, h)
    assert cut.shape == (e * t // h, h)
    for i in range(e * t // h):
        env, chunk = divmod(i, t // h)
        np.testing.assert_array_equal(cut[i], np.asarray(tags[env, chunk * h:(chunk + 1) * h]))
    # The cut is a reshape: read back in order, the segments are the streams again.
    np.testing.assert_array_equal(cut.reshape(e, t), tags)
    starts = segments.segment_starts({"s": tags[..., None]}, h)["s"]
    np.testing.assert_array_equal(starts[:, 0], cut[:, 0])


@pytest.mark.timeout(60)
def test_alpha_zero_visits_every_segment_once_per_epoch_with_unit_weights():
    n, epochs, m = 12, 5, 3
    advantages = jax.random.normal(jax.random.key(0), (n, 4))
    plan = jax.jit(segments.plan_minibatches, static_argnums=(2, 3, 4))(
        jax.random.key(1), advantages, epochs, m, 0.0, 0.4)
    assert plan.indices.shape == (epochs * m, n // m)
    for epoch in np.asarray(plan.indices).reshape(epochs, -1):
        assert sorted(epoch.tolist()) == list(range(n))
    assert np.all(np.asarray(plan.weights) == 1.0)  # exactly, not approximately


@pytest.mark.timeout(60)
def test_sampled_frequencies_match_the_priority_formula():
    n, h, alpha = 8, 5, 0.7
    advantages = jax.random.normal(jax.random.key(0), (n, h)) * jnp.arange(1.0, n + 1)[:, None]
    advantages = advantages.at[3].set(0.0)  # a segment with no signal is never drawn
    sums = np.abs(np.asarray(advantages)).sum(1)
    expected = sums**alpha / (sums**alpha).sum()
    epochs, m = 2000, 4
    plan = segments.plan_minibatches(jax.random.key(2), advantages, epochs, m, alpha, 0.5)
    np.testing.assert_allclose(plan.probabilities, expected, rtol=1e-5)
    counts = np.bincount(np.asarray(plan.indices).ravel(), minlength=n)
    draws = epochs * n
    assert counts[3] == 0
    # Pearson chi-square over the 7 drawable segments (6 dof): 22.5 is its 0.999 quantile.
    keep = expected > 0
    chi2 = (((counts - draws * expected) ** 2)[keep] / (draws * expected)[keep]).sum()
    assert chi2 < 22.5, (counts, draws * expected)
    # The same test rejects a uniform sampler by far.
    uniform = draws / n
    assert ((counts - uniform) ** 2 / uniform).sum() > 100


@pytest.mark.timeout(30)
def test_importance_weights_and_beta_schedule():
    p = jnp.array([0.5, 0.25, 0.25, 0.0])
    w = segments.importance_weights(p, 0.5)
    raw = (4 * np.array([0.5, 0.25, 0.25])) ** -0.5
    np.testing.assert_allclose(w[:3], raw / raw.max(), rtol=1e-6)
    assert w[3] == 0.0 and float(w.max()) == 1.0
    np.testing.assert_allclose(
        [segments.annealed_beta(0.4, jnp.array(u), 10) for u in (0, 5, 10, 20)],
        [0.4, 0.7, 1.0, 1.0], rtol=1e-6)
    assert float(segments.annealed_beta(0.4, jnp.array(7), 0)) == pytest.approx(0.4)
