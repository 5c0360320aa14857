"""Regression calibration: the quantile calibration error against its closed
form, quantile recalibration against scikit-learn's isotonic regression, and the
heteroscedastic losses against SciPy's densities and their gradients by hand."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats
from sklearn.isotonic import IsotonicRegression

import eqx_ensemble as ee

N = 20_000
# A "perfect" standard normal sample: the quantiles at (i + 1/2) / N.
Y = stats.norm.ppf((np.arange(N) + 0.5) / N).astype(np.float32)


def closed_form_error(scale: float, levels: int = 99) -> float:
    # Targets N(0, 1), predictive N(0, scale^2): P(F(y) <= p) = Phi(scale z_p).
    p = np.arange(1, levels + 1) / (levels + 1)
    return float(np.mean(np.abs(p - stats.norm.cdf(scale * stats.norm.ppf(p)))))


@pytest.mark.parametrize("scale", [0.5, 1.0, 2.0])
def test_calibration_error_is_its_closed_form(scale):
    means = np.zeros((1, N), np.float32)
    variances = np.full((1, N), scale**2, np.float32)
    got = ee.metrics.regression_calibration_error(means, variances, Y)
    np.testing.assert_allclose(got, closed_form_error(scale), atol=2e-3)


def test_the_mixture_predictive_is_the_mean_of_the_members_cdfs():
    rng = np.random.default_rng(0)
    means = rng.normal(size=(3, 500)).astype(np.float32)
    variances = rng.uniform(0.5, 2.0, (3, 500)).astype(np.float32)
    targets = rng.normal(size=500).astype(np.float32)
    pit = stats.norm.cdf((targets - means) / np.sqrt(variances)).mean(0)
    p = np.arange(1, 20) / 20
    expected = np.mean(np.abs(p - (pit[None] <= p[:, None]).mean(1)))
    got = ee.metrics.regression_calibration_error(
        means, variances, targets, levels=19, predictive="mixture"
    )
    np.testing.assert_allclose(got, expected, atol=1e-6)
    # The annotation refuses it first under the jaxtyping hook (a TypeError
    # naming the parameter); the check, where none is installed.
    with pytest.raises((TypeError, ValueError), match="predictive"):
        ee.metrics.regression_calibration_error(
            means, variances, targets, predictive="exact"
        )
    with pytest.raises(ValueError, match="levels"):
        ee.metrics.regression_calibration_error(means, variances, targets, levels=0)


def miscalibrated(seed, n, scale=0.5):
    """Targets with sd 1 under a predictive with sd `scale` (overconfident),
    and a bias of 0.3."""
    targets = np.random.default_rng(seed).normal(size=n).astype(np.float32)
    means = np.full((2, n), 0.3, np.float32)
    variances = np.full((2, n), scale**2, np.float32)
    return means, variances, targets


def test_recalibration_is_sklearns_isotonic_regression_of_the_pit():
    means, variances, targets = miscalibrated(0, 400)
    recalibrate = ee.calibration.fit_quantile_recalibration(means, variances, targets)
    z = (targets - 0.3) / 0.5  # F(y) = Phi(z): the same order as the PIT
    empirical = (z[None, :] <= z[:, None]).mean(1)
    reference = IsotonicRegression(out_of_bounds="clip").fit(z, empirical)
    np.testing.assert_allclose(
        recalibrate.cdf(means, variances, targets), reference.predict(z), atol=2e-5
    )
    new = np.linspace(-8, 8, 101).astype(np.float32)  # beyond the points: clipped
    np.testing.assert_allclose(
        recalibrate.cdf(means[:, :101], variances[:, :101], 0.3 + 0.5 * new),
        reference.predict(new),
        atol=2e-5,
    )


def test_a_very_overconfident_model_gets_finite_calibrated_intervals():
    # Predictive sd 0.1 for targets of sd 1: residuals of 10 sd and more,
    # where the CDF's float32 value is exactly 1.
    fit_data = miscalibrated(0, 2000, scale=0.1)
    recalibrate = ee.calibration.fit_quantile_recalibration(*fit_data)
    means, variances, targets = miscalibrated(1, 4000, scale=0.1)
    low, high = recalibrate.interval(means, variances, 0.9)
    assert np.isfinite(np.asarray(low)).all() and np.isfinite(np.asarray(high)).all()
    inside = np.mean((np.asarray(low) <= targets) & (targets <= np.asarray(high)))
    assert abs(inside - 0.9) < 0.025, inside


def test_recalibrated_quantiles_are_calibrated_on_new_data():
    fit_data = miscalibrated(0, 2000)
    recalibrate = ee.calibration.fit_quantile_recalibration(*fit_data)
    means, variances, targets = miscalibrated(1, 4000)
    before = ee.metrics.regression_calibration_error(means, variances, targets)
    cdf = np.asarray(recalibrate.cdf(means, variances, targets))
    p = np.arange(1, 100) / 100
    after = np.mean(np.abs(p - (cdf[None] <= p[:, None]).mean(1)))
    assert before > 0.1 and after < 0.02, (before, after)
    low, high = recalibrate.interval(means, variances, 0.9)
    inside = np.mean((np.asarray(low) <= targets) & (targets <= np.asarray(high)))
    # 4,000 examples: the binomial standard deviation is 0.005.
    assert abs(inside - 0.9) < 0.025, inside
    raw = ee.metrics.interval_coverage(means, variances, targets, level=0.9)
    assert raw < 0.65  # the uncalibrated interval, for contrast
    # The quantile inverts the calibrated CDF.
    for level in (0.1, 0.5, 0.8):
        q = recalibrate.quantile(means, variances, level)
        np.testing.assert_allclose(
            recalibrate.cdf(means, variances, q), level, atol=2e-3
        )


def test_recalibration_refuses_bad_input():
    means, variances, targets = miscalibrated(0, 10)
    with pytest.raises(ValueError, match="at least 2"):
        ee.calibration.fit_quantile_recalibration(
            means[:, :1], variances[:, :1], targets[:1]
        )
    targets[3] = np.nan
    with pytest.raises(ValueError, match="NaN|nan|finite"):
        ee.calibration.fit_quantile_recalibration(means, variances, targets)
    # No spread (members that agree and predict a variance of 0): refused, not
    # intervals of width 0.
    targets[3] = 0.0
    fitted = ee.calibration.fit_quantile_recalibration(means, variances, targets)
    same = np.repeat(means[:1], means.shape[0], axis=0)
    flat = np.asarray(variances).copy()
    flat[:, 5] = 0.0
    with pytest.raises(ValueError, match="not positive at 1 example.*index 5"):
        fitted.interval(same, flat, 0.9)
    with pytest.raises(ValueError, match="not positive"):
        ee.calibration.fit_quantile_recalibration(same, flat, targets)


def test_gaussian_and_student_t_losses_are_scipys_densities():
    rng = np.random.default_rng(0)
    m = rng.normal(size=50).astype(np.float32)
    s = rng.uniform(0.5, 2.0, 50).astype(np.float32)
    y = rng.normal(size=50).astype(np.float32)
    np.testing.assert_allclose(
        ee.losses.gaussian_nll(m, s**2, y),
        -stats.norm.logpdf(y, m, s).mean(),
        rtol=1e-5,
    )
    df = rng.uniform(1.0, 10.0, 50).astype(np.float32)
    np.testing.assert_allclose(
        ee.losses.student_t_nll(m, s, df, y),
        -stats.t.logpdf(y, df, m, s).mean(),
        rtol=1e-5,
    )
    np.testing.assert_allclose(
        ee.losses.student_t_nll(m, s, 3.0, y),
        -stats.t.logpdf(y, 3.0, m, s).mean(),
        rtol=1e-5,
    )
    with pytest.raises((TypeError, ValueError), match="batch|one shape"):
        ee.losses.gaussian_nll(m, s[:10], y)
    with pytest.raises(ValueError, match="`df` must be positive"):
        ee.losses.student_t_nll(m, s, -1.0, y)


@pytest.mark.parametrize("df", [16.5, 1e3, 1e6, 1e12, np.inf])
def test_student_t_nll_at_many_degrees_of_freedom_is_scipys(df):
    # float32 `gammaln` differences lose the digits for a large `df` (1.3468
    # against SciPy's 1.2857 at df = 1e6; NaN at inf): SciPy in float64.
    rng = np.random.default_rng(1)
    m = rng.normal(size=50).astype(np.float32)
    s = rng.uniform(0.5, 2.0, 50).astype(np.float32)
    y = rng.normal(size=50).astype(np.float32)
    expected = -stats.t.logpdf(y.astype(np.float64), df, m, s).mean()
    got = ee.losses.student_t_nll(m, s, np.float32(df), y)
    np.testing.assert_allclose(got, expected, rtol=2e-6)
    # The gradients stay finite at the switch and at infinity.
    grads = jax.grad(lambda m: ee.losses.student_t_nll(m, s, np.float32(df), y))(m)
    assert np.all(np.isfinite(grads))


def test_negative_variances_and_scales_are_refused():
    m, y = jnp.zeros(3), jnp.zeros(3)
    bad = jnp.array([1.0, -1.0, 2.0])
    for loss in (ee.losses.gaussian_nll, ee.losses.beta_nll):
        with pytest.raises(ValueError, match="`variance` must not be negative"):
            loss(m, bad, y)
    with pytest.raises(ValueError, match="`scale` must not be negative"):
        ee.losses.student_t_nll(m, bad, 3.0, y)
    # A NumPy number is a number.
    ee.losses.beta_nll(m, jnp.ones(3), y, beta=np.float32(0.5))


def test_beta_nll_weights_each_nll_by_its_variance_held_constant():
    m, v, y = jnp.array([1.0, -0.5]), jnp.array([4.0, 0.25]), jnp.array([0.0, 0.5])
    nll = 0.5 * (jnp.log(2 * jnp.pi * v) + (y - m) ** 2 / v)
    np.testing.assert_allclose(ee.losses.beta_nll(m, v, y, beta=0.0),
                               ee.losses.gaussian_nll(m, v, y), rtol=1e-6)  # fmt: skip
    np.testing.assert_allclose(ee.losses.beta_nll(m, v, y, beta=0.5),
                               jnp.mean(jnp.sqrt(v) * nll), rtol=1e-6)  # fmt: skip
    # beta = 1: the mean's gradient is the squared error's, (m - y) / n.
    grad_m = jax.grad(lambda m: ee.losses.beta_nll(m, v, y, beta=1.0))(m)
    np.testing.assert_allclose(grad_m, (m - y) / 2, rtol=1e-6)
    # The weight is a constant: the variance's gradient is w * dNLL/dv.
    grad_v = jax.grad(lambda v: ee.losses.beta_nll(m, v, y, beta=0.5))(v)
    expected = jnp.sqrt(v) * (0.5 / v - 0.5 * (y - m) ** 2 / v**2) / 2
    np.testing.assert_allclose(grad_v, expected, rtol=1e-6)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        ee.losses.beta_nll(m, v, y, beta=1.5)
