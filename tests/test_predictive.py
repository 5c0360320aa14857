"""`ee.predictive`: Gaussian, Student-t and mixture predictives against SciPy
(densities, CDFs, quantiles, moments) and numerical integration (CRPS);
their scores against `ee.metrics` where both apply; recalibration and the
conformal path on held-out data; bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.integrate as integrate
import scipy.stats as stats

import eqx_ensemble as ee
from eqx_ensemble import predictive as P

Y = np.array([-3.0, -0.5, 0.0, 0.7, 4.0], np.float32)
LEVELS = np.array([0.001, 0.1, 0.5, 0.9, 0.999], np.float32)


def _crps_by_integration(cdf, y: float) -> float:
    below = integrate.quad(lambda x: cdf(x) ** 2, -np.inf, y, limit=200)[0]
    above = integrate.quad(lambda x: (1 - cdf(x)) ** 2, y, np.inf, limit=200)[0]
    return below + above


@pytest.mark.parametrize("df", [1.0, 2.5, 4.0, 30.0, 1e3, 1e6, np.inf])
def test_student_t_against_scipy(df):
    dist = P.StudentT(jnp.full(5, 0.3), jnp.full(5, 1.7), df)
    ref = stats.t(df, 0.3, 1.7) if np.isfinite(df) else stats.norm(0.3, 1.7)
    np.testing.assert_allclose(dist.log_prob(Y), ref.logpdf(Y), atol=2e-6)
    np.testing.assert_allclose(dist.cdf(Y), ref.cdf(Y), atol=1e-5)
    np.testing.assert_allclose(dist.quantile(LEVELS), ref.ppf(LEVELS), rtol=1e-3)
    want = [_crps_by_integration(ref.cdf, float(y)) for y in Y]
    # (finite for df > 1/2 though there is no mean at df <= 1; by quadrature
    # below df = 2)
    np.testing.assert_allclose(dist.crps(Y), want, rtol=1e-3 if df < 2 else 1e-4)
    if df <= 1:
        assert np.isnan(np.asarray(dist.mean())).all()
        return
    np.testing.assert_allclose(dist.variance(), np.full(5, ref.var()), rtol=1e-5)


def test_normal_against_scipy():
    dist = P.Normal(jnp.full(5, -1.0), jnp.full(5, 0.5))
    ref = stats.norm(-1.0, 0.5)
    np.testing.assert_allclose(dist.log_prob(Y), ref.logpdf(Y), rtol=1e-6)
    np.testing.assert_allclose(dist.cdf(Y), ref.cdf(Y), atol=1e-7)
    np.testing.assert_allclose(dist.quantile(LEVELS), ref.ppf(LEVELS), rtol=1e-5)
    want = [_crps_by_integration(ref.cdf, float(y)) for y in Y]
    np.testing.assert_allclose(dist.crps(Y), want, rtol=1e-5)


@pytest.mark.parametrize("kind", ["normal", "student-t", "weighted"])
def test_mixture_against_its_members_in_scipy(kind):
    loc = np.array([[-1.0], [0.5], [2.0]], np.float32)
    scale = np.array([[0.5], [1.0], [2.0]], np.float32)
    weights = np.array([0.2, 0.5, 0.3]) if kind == "weighted" else np.full(3, 1 / 3)
    if kind == "student-t":
        members = [stats.t(3.0, m, s) for m, s in zip(loc[:, 0], scale[:, 0])]
        dist = P.Mixture(P.StudentT(loc, scale, 3.0))
    else:
        members = [stats.norm(m, s) for m, s in zip(loc[:, 0], scale[:, 0])]
        w = jnp.asarray(weights, jnp.float32) if kind == "weighted" else None
        dist = P.Mixture(P.Normal(loc, scale), w)

    def cdf(x):
        return sum(w * m.cdf(x) for w, m in zip(weights, members))

    for y in (-2.0, 0.3, 5.0):
        at = jnp.array([y])
        density = sum(w * m.pdf(y) for w, m in zip(weights, members))
        np.testing.assert_allclose(dist.log_prob(at), [np.log(density)], rtol=1e-5)
        np.testing.assert_allclose(dist.cdf(at), [cdf(y)], atol=1e-6)
        want = _crps_by_integration(cdf, y)
        np.testing.assert_allclose(dist.crps(at), [want], rtol=1e-4)
    for p in (0.01, 0.5, 0.95):
        q = float(dist.quantile(jnp.array([p]))[0])
        assert abs(cdf(q) - p) < 1e-5
    means = np.array([m.mean() for m in members])
    total = np.sum(weights * np.array([m.var() for m in members]))
    total += np.sum(weights * (means - np.sum(weights * means)) ** 2)
    np.testing.assert_allclose(dist.mean(), [np.sum(weights * means)], rtol=1e-5)
    np.testing.assert_allclose(dist.variance(), [total], rtol=1e-5)


def test_a_mixtures_crps_is_finite_down_to_df_one_half():
    loc, scale = jnp.zeros((2, 3)), jnp.ones((2, 3))
    cauchy = P.Mixture(P.StudentT(loc, scale, jnp.array([[1.0], [5.0]])))
    members = [stats.t(1.0), stats.t(5.0)]
    want = _crps_by_integration(lambda x: np.mean([m.cdf(x) for m in members]), 0.0)
    np.testing.assert_allclose(cauchy.crps(jnp.zeros(3)), [want] * 3, rtol=1e-3)
    diverging = P.Mixture(P.StudentT(loc, scale, jnp.array([[0.4], [5.0]])))
    assert np.isinf(np.asarray(diverging.crps(jnp.zeros(3)))).all()
    # (a member of weight 0 counts for nothing)
    weights = jnp.array([0.0, 1.0])
    assert np.isfinite(
        np.asarray(P.Mixture(diverging.components, weights).crps(0.0 * loc[0]))
    ).all()


def test_scores_of_a_gaussian_mixture_are_the_metrics_own():
    key = jax.random.split(jax.random.key(0), 3)
    means = jax.random.normal(key[0], (4, 300))
    variances = jnp.exp(jax.random.normal(key[1], (4, 300)))
    y = 1.5 * jax.random.normal(key[2], (300,))
    dist = P.Mixture(P.Normal(means, jnp.sqrt(variances)))
    np.testing.assert_allclose(
        P.nll(dist, y),
        -np.mean(
            np.log(np.mean(stats.norm(means, np.sqrt(variances)).pdf(y[None]), 0))
        ),
        rtol=1e-5,
    )
    np.testing.assert_allclose(
        P.calibration_error(dist, y),
        ee.metrics.regression_calibration_error(
            means, variances, y, predictive="mixture"
        ),
        atol=1e-6,
    )
    # One Gaussian member: the metrics' moment-matched interval is its own.
    one = P.Mixture(P.Normal(means[:1], jnp.sqrt(variances[:1])))
    np.testing.assert_allclose(
        P.coverage(one, y, 0.8),
        ee.metrics.interval_coverage(means[:1], variances[:1], y, level=0.8),
        atol=1e-6,
    )


@pytest.mark.parametrize(
    "seed",
    [
        0,
        pytest.param(1, marks=pytest.mark.slow),
        pytest.param(2, marks=pytest.mark.slow),
    ],
)
def test_recalibration_and_a_conformal_interval_cover_held_out_targets(seed):
    # Heavy-tailed targets, wider than a predictive that is too sure.
    keys = jax.random.split(jax.random.key(seed), 2)
    y = 3.0 * jax.random.t(keys[0], 4.0, (2400,))
    loc = 0.2 * jax.random.normal(keys[1], (3, 2400))
    dist = P.Mixture(P.StudentT(loc, jnp.ones((3, 2400)), 6.0))
    cal, test = slice(0, 1200), slice(1200, None)

    def part(d, where):
        return jax.tree.map(lambda a: a[:, where] if a.ndim == 2 else a, d)

    before = float(P.coverage(part(dist, test), y[test], 0.9))
    recal = P.fit_recalibration(part(dist, cal), y[cal])
    low, high = recal.interval(part(dist, test), 0.9)
    after = float(jnp.mean((low <= y[test]) & (y[test] <= high)))
    assert before < 0.75 and abs(after - 0.9) < 0.03, (before, after)
    assert float(P.calibration_error(part(dist, test), y[test])) > 0.1
    # Conformal: the predictive's own interval into CQR.
    lower, upper = part(dist, cal).interval(0.9)
    conformal = ee.conformal.cqr(lower, upper, y[cal], alpha=0.1)
    low, high = conformal.interval(*part(dist, test).interval(0.9))
    covered = float(jnp.mean((low <= y[test]) & (y[test] <= high)))
    assert 0.87 <= covered <= 0.93, covered


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="`Normal`'s `scale` must be positive"):
        P.Normal(jnp.zeros(3), jnp.array([1.0, -1.0, 1.0]))
    with pytest.raises(ValueError, match="`StudentT`'s `df` must be positive"):
        P.StudentT(jnp.zeros(3), jnp.ones(3), 0.0)
    with pytest.raises(ValueError, match=r"`weights` must have shape \(2,\)"):
        P.Mixture(P.Normal(jnp.zeros((2, 3)), jnp.ones((2, 3))), jnp.ones(3) / 3)
    with pytest.raises(ValueError, match="sum to 1"):
        P.Mixture(P.Normal(jnp.zeros((2, 3)), jnp.ones((2, 3))), jnp.ones(2))
    with pytest.raises(ValueError, match="leading member axis"):
        P.Mixture(P.Normal(0.0, 1.0))
    dist = P.Normal(jnp.zeros(3), jnp.ones(3))
    with pytest.raises(ValueError, match=r"batch shape \(3,\), got \(4,\)"):
        P.nll(dist, jnp.zeros(4))
    with pytest.raises(TypeError, match="dist"):
        P.crps((jnp.zeros(3), jnp.ones(3)), jnp.zeros(3))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="`levels` must be a positive int"):
        P.calibration_error(dist, jnp.zeros(3), levels=0)
    with pytest.raises(ValueError, match="at least 2 targets"):
        P.fit_recalibration(P.Normal(jnp.zeros(1), jnp.ones(1)), jnp.zeros(1))
    with pytest.raises(ValueError, match="not finite"):
        P.fit_recalibration(dist, jnp.array([0.0, jnp.nan, 1.0]))


def test_edges_far_targets_and_gradients():
    # CRPS of targets far from a Student-t mixture (the integral in pieces).
    heavy = P.Mixture(P.StudentT(jnp.zeros((2, 2)), jnp.ones((2, 2)), 4.0))
    ref = stats.t(4.0)
    for y in (50.0, 1000.0):
        want = _crps_by_integration(ref.cdf, y)
        np.testing.assert_allclose(heavy.crps(jnp.full(2, y)), [want] * 2, rtol=1e-4)
    assert np.isinf(np.asarray(P.StudentT(0.0, 1.0, 0.4).crps(0.0)))
    # Quantiles at 0 and 1, CDFs at infinities.
    for dist in (P.Normal(0.0, 1.0), P.StudentT(0.0, 1.0, 3.0), heavy):
        q = np.asarray(dist.quantile(jnp.array([0.0, 1.0])))
        np.testing.assert_array_equal(q.reshape(-1, 2)[0], [-np.inf, np.inf])
        with pytest.raises(ValueError, match=r"lie in \[0, 1\]"):
            dist.quantile(1.5)
    t = P.StudentT(0.0, 1.0, jnp.array([3.0, 150.0, jnp.inf]))
    np.testing.assert_array_equal(t.cdf(jnp.full(3, jnp.inf)), [1.0, 1.0, 1.0])
    np.testing.assert_array_equal(t.cdf(jnp.full(3, -jnp.inf)), [0.0, 0.0, 0.0])
    # Far tails of the CDF: monotone, near SciPy (df 60, z -7 and -8).
    tail = np.asarray(P.StudentT(0.0, 1.0, 60.0).cdf(jnp.array([-8.0, -7.0])))
    np.testing.assert_allclose(tail, stats.t(60.0).cdf([-8.0, -7.0]), rtol=1e-2)
    # The quantile's gradient (implicit function theorem) against differences.
    for make in (
        lambda m: P.Mixture(P.Normal(jnp.stack([m, -m]), jnp.ones(2))),
        lambda m: P.Mixture(P.StudentT(jnp.stack([m, -m]), jnp.ones(2), 3.0)),
        lambda m: P.StudentT(m, 1.5, 3.0),
    ):

        def q(m, make=make):
            return make(m).quantile(0.9)

        m = jnp.asarray(0.7)
        difference = (q(m + 1e-2) - q(m - 1e-2)) / 2e-2
        np.testing.assert_allclose(jax.grad(q)(m), difference, rtol=2e-2)


def test_recalibration_says_when_the_cdf_rounds_to_its_ends():
    y = 10.0 * jax.random.normal(jax.random.key(0), (500,))
    dist = P.Normal(jnp.zeros(500), jnp.ones(500))  # 10x too narrow
    with pytest.warns(RuntimeWarning, match="exactly 0 or 1 at"):
        P.fit_recalibration(dist, y)


def test_weights_lists_are_taken_and_complex_parameters_refused():
    members = P.Normal(jnp.zeros((2, 3)), jnp.ones((2, 3)))
    mixed = P.Mixture(members, [0.3, 0.7])  # type: ignore[arg-type]
    np.testing.assert_allclose(mixed.cdf(jnp.zeros(3)), 0.5)
    with pytest.raises(TypeError, match="real"):
        P.Normal(jnp.zeros(2, jnp.complex64), jnp.ones(2))
    y = jnp.zeros(3)
    assert P.calibration_error(members and P.Normal(y, 1.0 + y), y, levels=np.int64(9))
