"""Split conformal regression: coverage at the nominal level over many random
splits (within the binomial tolerance), the finite-sample quantile by hand, and
clear errors."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqx_ensemble as ee


def _heteroscedastic(seed, n):
    """An imperfect 5-member ensemble on data whose noise grows with |x|."""
    rng = np.random.default_rng(seed)
    x = rng.uniform(-3, 3, n)
    noise = 0.2 + 0.5 * np.abs(x)
    y = np.sin(x) + noise * rng.standard_normal(n)
    means = np.sin(x)[None] + 0.1 * rng.standard_normal((5, n))
    variances = (0.7 * noise[None]) ** 2 * np.ones((5, 1))  # overconfident
    return (
        jnp.asarray(means, jnp.float32),
        jnp.asarray(variances, jnp.float32),
        jnp.asarray(y, jnp.float32),
    )


@pytest.mark.parametrize("alpha", [0.1, 0.3])
def test_split_conformal_covers_at_the_nominal_level(alpha):
    calibration, test, seeds = 200, 500, 200
    coverages = []
    for seed in range(seeds):
        means, variances, y = _heteroscedastic(seed, calibration + test)
        calibrated = ee.conformal.split_regression(
            means[:, :calibration],
            variances[:, :calibration],
            y[:calibration],
            alpha=alpha,
        )
        lower, upper = calibrated.interval(
            means[:, calibration:], variances[:, calibration:]
        )
        inside = (y[calibration:] >= lower) & (y[calibration:] <= upper)
        coverages.append(float(jnp.mean(inside)))
    # Marginal coverage is in [1 - alpha, 1 - alpha + 1/(n+1)]; the mean over
    # seeds has a standard error of about sqrt(a(1-a)/test/seeds) + the split's.
    mean = float(np.mean(coverages))
    tolerance = 4 * math.sqrt(
        alpha * (1 - alpha) * (1 / test + 1 / calibration) / seeds
    )
    assert (
        1 - alpha - tolerance <= mean <= 1 - alpha + 1 / (calibration + 1) + tolerance
    )
    # The Gaussian interval of the same (overconfident) ensemble undercovers.
    means, variances, y = _heteroscedastic(0, 2000)
    naive = ee.metrics.interval_coverage(means, variances, y, 1 - alpha)
    assert float(naive) < 1 - alpha - 0.05


def test_the_quantile_is_the_finite_sample_one():
    means = jnp.zeros((2, 9))
    variances = jnp.ones((2, 9))
    targets = jnp.arange(1.0, 10.0)  # scores 1..9
    calibrated = ee.conformal.split_regression(means, variances, targets, alpha=0.2)
    # ceil((9 + 1) * 0.8) = 8: the 8th smallest score.
    assert calibrated.quantile == 8.0
    lower, upper = calibrated.interval(means, variances)
    np.testing.assert_allclose(upper, 8.0)
    np.testing.assert_allclose(lower, -8.0)


def test_bad_inputs_are_named():
    means, variances, y = jnp.zeros((3, 9)), jnp.ones((3, 9)), jnp.zeros(9)
    with pytest.raises(
        ValueError, match="smallest possible is 1 / \\(n \\+ 1\\) = 0.1"
    ):
        ee.conformal.split_regression(means, variances, y, alpha=0.05)
    with pytest.raises(ValueError, match="strictly between 0 and 1"):
        ee.conformal.split_regression(means, variances, y, alpha=1.5)
    calibrated = ee.conformal.split_regression(means, variances, y, alpha=0.5)
    with pytest.raises(ValueError, match="have 2 members but the calibration had 3"):
        calibrated.interval(jnp.zeros((2, 4)), jnp.ones((2, 4)))
    with pytest.raises(ValueError, match="holds nan"):
        ee.conformal.split_regression(
            means.at[0, 0].set(jnp.nan), variances, y, alpha=0.5
        )


def test_single_output_axis_is_accepted():
    key = jax.random.key(0)
    means = jax.random.normal(key, (3, 40, 1))
    variances = jnp.ones((3, 40, 1))
    y = jax.random.normal(jax.random.key(1), (40,))
    a = ee.conformal.split_regression(means, variances, y, alpha=0.2)
    b = ee.conformal.split_regression(means[..., 0], variances[..., 0], y, alpha=0.2)
    assert a.quantile == b.quantile
