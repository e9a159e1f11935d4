"""Value rescaling h and its inverse."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agents.common.value_rescaling import rescale, unrescale


@pytest.mark.timeout(120)
@pytest.mark.parametrize("eps", [1e-3, 1e-2, 0.0])
def test_inverse_recovers_x_over_a_wide_range(eps):
    magnitudes = np.logspace(-6, 6, 4001)
    x = np.concatenate([-magnitudes[::-1], [0.0], magnitudes]).astype(np.float32)
    back = np.asarray(unrescale(rescale(jnp.asarray(x), eps), eps))
    # float32 tolerance: ~1e-5 relative for large |x|, ~1e-6 absolute near 0.
    np.testing.assert_allclose(back, x, rtol=2e-5, atol=2e-6)
    y = np.linspace(-100, 100, 2001).astype(np.float32)
    np.testing.assert_allclose(rescale(unrescale(jnp.asarray(y), eps), eps), y,
                               rtol=2e-5, atol=2e-6)


@pytest.mark.timeout(120)
def test_h_values():
    eps = 1e-3
    for x in [0.0, 3.0, -8.0, 99.0]:
        expected = np.sign(x) * (np.sqrt(abs(x) + 1) - 1) + eps * x
        assert float(rescale(jnp.float32(x), eps)) == pytest.approx(expected, rel=1e-6)
    # It squashes: h(1000) = sqrt(1001) - 1 + 1 is about 31.6, not 1000.
    assert float(rescale(jnp.float32(1000.0))) == pytest.approx(np.sqrt(1001.0), rel=1e-5)


@pytest.mark.timeout(120)
def test_h_has_its_true_gradient_at_and_near_zero():
    eps = 1e-3
    for x in [0.0, 1e-6, -1e-3, 2.0]:
        want = 0.5 / np.sqrt(abs(x) + 1.0) + eps  # d/dx of sign(x)(sqrt(|x| + 1) - 1)
        got = float(jax.grad(rescale)(jnp.float32(x), eps))
        assert got == pytest.approx(want, rel=1e-5), x
    # Small values keep their digits (no cancellation in sqrt(1 + |x|) - 1).
    tiny = np.float32(1e-7)
    assert float(rescale(jnp.float32(tiny), 0.0)) == pytest.approx(tiny / 2, rel=1e-5)
