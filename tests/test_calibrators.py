"""Post-hoc calibrators against independent references: SciPy's L-BFGS-B on the
same objectives written in NumPy (analytic gradients), scikit-learn's isotonic
regression and calibration curve."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.optimize import minimize
from scipy.special import log_softmax, logsumexp, softmax

import eqx_ensemble as ee


@pytest.fixture(scope="module")
def split():
    rng = np.random.default_rng(0)
    members, batch, classes = 3, 400, 4
    labels = rng.integers(0, classes, batch)
    # Informative but miscalibrated logits, with a per-class bias to correct.
    signal = 2.0 * np.eye(classes)[labels]
    logits = 3.0 * (signal + rng.normal(size=(members, batch, classes)))
    logits = logits + np.array([1.0, -0.5, 0.0, 0.5])
    test = 3.0 * (rng.normal(size=(members, 100, classes))) + 1.0
    return logits.astype(np.float32), labels, test.astype(np.float32)


def _numpy_affine_fit(features, labels, *, full, l2):
    """Softmax regression z' = A(z) on fixed features of ONE model, minimising
    mean NLL + l2 * (||W - mean(diag W) I||^2 + ||b||^2) (the distance to
    temperature scaling's family), by SciPy
    with analytic gradients (the mean's own derivative cancels: the deviations
    on the diagonal sum to zero)."""
    n, k = features.shape
    onehot = np.eye(k)[labels]
    eye = np.eye(k)

    def unpack(theta):
        if full:
            return theta[: k * k].reshape(k, k), theta[k * k :]
        return theta[:k], theta[k:]

    def objective(theta):
        w, b = unpack(theta)
        out = features @ w.T + b if full else features * w + b
        logp = log_softmax(out, axis=1)
        value = -np.mean(np.sum(onehot * logp, axis=1))
        residual = (np.exp(logp) - onehot) / n  # d value / d out
        gb = residual.sum(0)
        if full:
            gw = residual.T @ features
            dev = w - np.mean(np.diag(w)) * eye
            value += l2 * (np.sum(dev**2) + np.sum(b**2))
            gw = gw + 2 * l2 * dev
        else:
            gw = np.sum(residual * features, axis=0)
            dev = w - np.mean(w)
            value += l2 * (np.sum(dev**2) + np.sum(b**2))
            gw = gw + 2 * l2 * dev
        gb = gb + 2 * l2 * b
        return value, np.concatenate([gw.ravel(), gb])

    theta0 = np.concatenate([(eye if full else np.ones(k)).ravel(), np.zeros(k)])
    result = minimize(
        objective, theta0, jac=True, method="L-BFGS-B",
        options={"gtol": 1e-10, "ftol": 1e-14, "maxiter": 10_000},
    )  # fmt: skip
    w, b = unpack(result.x)
    return (lambda z: z @ w.T + b) if full else (lambda z: z * w + b)


@pytest.mark.parametrize(
    "fit, full, dirichlet",
    [
        (ee.calibration.fit_vector_scaling, False, False),
        (ee.calibration.fit_matrix_scaling, True, False),
        (ee.calibration.fit_dirichlet_scaling, True, True),
    ],
)
@pytest.mark.parametrize("l2", [0.0, 1e-2])
def test_single_model_fit_matches_scipy(split, fit, full, dirichlet, l2):
    logits, labels, test = split
    one, one_test = logits[:1], test[:1]
    features = log_softmax(one[0].astype(np.float64), axis=1) if dirichlet else one[0]
    reference = _numpy_affine_fit(
        features.astype(np.float64), labels, full=full, l2=l2
    )  # fmt: skip
    calibrator = fit(one, labels, l2=l2)
    for z in (one, one_test):
        expected_features = (
            log_softmax(z[0].astype(np.float64), axis=1) if dirichlet else z[0]
        )
        expected = softmax(reference(expected_features.astype(np.float64)), axis=1)
        got = jax.nn.softmax(calibrator(z)[0], axis=-1)
        np.testing.assert_allclose(got, expected, atol=2e-3)


def test_ensemble_fit_minimises_the_mean_predictions_nll(split):
    logits, labels, _ = split
    logits = logits[:, :120, :3]
    labels = labels[:120] % 3

    def ensemble_nll(theta):
        w, b = theta[:3], theta[3:]
        logp = log_softmax(logits.astype(np.float64) * w + b, axis=-1)
        mixed = logsumexp(logp, axis=0) - np.log(len(logits))
        return -np.mean(mixed[np.arange(len(labels)), labels]) + 1e-4 * (
            np.sum((w - np.mean(w)) ** 2) + np.sum(b**2)
        )

    reference = minimize(ensemble_nll, np.r_[np.ones(3), np.zeros(3)], method="BFGS")
    calibrator = ee.calibration.fit_vector_scaling(logits, labels, l2=1e-4)
    theta = np.r_[np.asarray(calibrator.weight), np.asarray(calibrator.bias)]
    assert ensemble_nll(theta) == pytest.approx(reference.fun, abs=1e-5)
    np.testing.assert_allclose(theta, reference.x, atol=5e-3)


# One per-member path (`calibrators._fit`, by class) serves the three
# calibrators; each one's own fit is checked against SciPy in the default tier
# (`test_single_model_fit_matches_scipy`). Matrix and Dirichlet scaling's
# per-member fits (25 s of L-BFGS at the suite's -O0) run in `make test-all`.
@pytest.mark.parametrize(
    "fit",
    [
        ee.calibration.fit_vector_scaling,
        pytest.param(ee.calibration.fit_matrix_scaling, marks=pytest.mark.slow),
        pytest.param(ee.calibration.fit_dirichlet_scaling, marks=pytest.mark.slow),
    ],
)
def test_per_member_equals_each_member_fitted_alone(split, fit):
    logits, labels, test = split
    together = fit(logits, labels, per_member=True)
    out = together(test)
    for i in range(len(logits)):
        alone = fit(logits[i : i + 1], labels)
        # Probabilities: logits are defined up to a constant per example (free
        # in Dirichlet scaling, whose inputs' exponentials sum to one).
        np.testing.assert_allclose(
            jax.nn.softmax(out[i : i + 1], axis=-1),
            jax.nn.softmax(alone(test[i : i + 1]), axis=-1),
            atol=2e-4,
        )


def test_per_member_fits_alike_on_a_cpu_and_elsewhere(split, monkeypatch):
    # A CPU fits the members one after another (`lax.map`), other backends
    # together (`vmap`): the same calibrators, to rounding.
    from eqx_ensemble._metrics import calibrators

    logits, labels, test = split
    fit = ee.calibration.fit_vector_scaling
    mapped = fit(logits, labels, per_member=True, l2=1e-2)
    monkeypatch.setattr(calibrators.jax, "default_backend", lambda: "gpu")
    # One more member (a copy of the first): another shape, so the fit is
    # traced again, now under the patched backend.
    batched = fit(
        jnp.concatenate([logits, logits[:1]]), labels, per_member=True, l2=1e-2
    )
    out = batched(jnp.concatenate([test, test[:1]]))
    np.testing.assert_allclose(mapped(test), out[:-1], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(out[0], out[-1])


def test_calibrators_lower_the_nll_of_miscalibrated_logits(split):
    logits, labels, _ = split
    before = float(ee.metrics.nll(logits, labels, from_logits=True))
    for fit in (
        ee.calibration.fit_vector_scaling,
        ee.calibration.fit_matrix_scaling,
        ee.calibration.fit_dirichlet_scaling,
    ):
        after = float(
            ee.metrics.nll(fit(logits, labels)(logits), labels, from_logits=True)
        )
        assert after < 0.9 * before, fit.__name__


def test_a_stalled_fit_stops_where_the_full_fit_ends(split, monkeypatch):
    """In float32 some L-BFGS fits never bring the gradient norm under the
    tolerance (here the strongest penalty of the cross-validation grid) and
    idled to `iterations` (500). They stop after 25 steps in a row without
    progress: every fit of a cross-validated fit ends before 500 steps, and a
    fit that idled before ends at the same NLL, to rounding."""
    from eqx_ensemble._metrics import calibrators

    logits, labels, _ = split
    lbfgs, counts = calibrators._lbfgs, []

    def counted(*args):
        params, steps = lbfgs(*args)
        jax.debug.callback(lambda n: counts.append(int(n)), steps)
        return params, steps

    monkeypatch.setattr(calibrators, "_lbfgs", counted)

    def fit(**options):
        counts.clear()
        jax.clear_caches()  # traced anew: the patched function and constant
        calibrator = ee.calibration.fit_dirichlet_scaling(logits, labels, **options)
        nll = float(ee.metrics.nll(calibrator(logits), labels, from_logits=True))
        return nll, list(counts)

    _, steps = fit()  # 5 folds x 6 penalties, then the final fit
    assert len(steps) == 31 and max(steps) < 500, steps
    stopped, [steps] = fit(l2=10.0)
    monkeypatch.setattr(calibrators, "STALL_STEPS", 10**6)
    full, [full_steps] = fit(l2=10.0)
    assert full_steps == 500 and steps < 100, (steps, full_steps)
    np.testing.assert_allclose(stopped, full, rtol=1e-6)


def test_isotonic_matches_sklearn_one_vs_rest(split):
    from sklearn.isotonic import IsotonicRegression

    logits, labels, test = split
    # Rounded: many equal probabilities, so ties are pooled as scikit-learn pools them.
    probs = np.round(softmax(logits.astype(np.float64), axis=-1), 2)
    probs = probs / probs.sum(-1, keepdims=True)
    test_probs = softmax(test.astype(np.float64), axis=-1)
    calibrator = ee.calibration.fit_isotonic_regression(
        probs.astype(np.float32), labels, per_member=True, floor=0
    )
    got = calibrator(test_probs.astype(np.float32))
    for m in range(len(probs)):
        columns = []
        for c in range(probs.shape[-1]):
            iso = IsotonicRegression(out_of_bounds="clip")
            iso.fit(probs[m, :, c], (labels == c).astype(float))
            columns.append(iso.predict(test_probs[m, :, c]))
        raw = np.stack(columns, axis=-1)
        total = raw.sum(-1, keepdims=True)
        expected = np.where(total > 0, raw / np.where(total > 0, total, 1), 0.25)
        np.testing.assert_allclose(got[m], expected, atol=2e-5)


def test_isotonic_of_the_mean_prediction(split):
    from sklearn.isotonic import IsotonicRegression

    logits, labels, test = split
    calibrator = ee.calibration.fit_isotonic_regression(
        logits, labels, from_logits=True, floor=0
    )
    got = calibrator(test, from_logits=True)
    assert got.shape == (1, test.shape[1], 4)
    mean = softmax(logits.astype(np.float64), -1).mean(0)
    mean_test = softmax(test.astype(np.float64), -1).mean(0)
    raw = np.stack(
        [
            IsotonicRegression(out_of_bounds="clip")
            .fit(mean[:, c], labels == c)
            .predict(mean_test[:, c])
            for c in range(4)
        ],
        axis=-1,
    )
    total = raw.sum(-1, keepdims=True)
    expected = np.where(total > 0, raw / np.where(total > 0, total, 1), 0.25)
    np.testing.assert_allclose(got[0], expected, atol=1e-5)


def test_histogram_binning_values_are_sklearn_calibration_curve(split):
    from sklearn.calibration import calibration_curve

    logits, labels, _ = split
    n_bins = 10
    calibrator = ee.calibration.fit_histogram_binning(
        logits, labels, n_bins=n_bins, per_member=True, from_logits=True
    )
    probs = softmax(logits.astype(np.float64), axis=-1)
    for m in range(len(logits)):
        for c in range(4):
            index = np.minimum((probs[m, :, c] * n_bins).astype(int), n_bins - 1)
            filled = np.unique(index)
            prob_true, _ = calibration_curve(
                labels == c, probs[m, :, c], n_bins=n_bins, strategy="uniform"
            )
            np.testing.assert_allclose(
                calibrator.values[m, c, filled], prob_true, atol=1e-6
            )
            empty = np.setdiff1d(np.arange(n_bins), filled)
            np.testing.assert_allclose(
                calibrator.values[m, c, empty], (empty + 0.5) / n_bins, atol=1e-6
            )


def test_histogram_binning_applies_its_bins_and_normalises(split):
    logits, labels, test = split
    calibrator = ee.calibration.fit_histogram_binning(
        logits, labels, n_bins=5, from_logits=True
    )
    got = np.asarray(calibrator(test, from_logits=True))[0]
    mean = softmax(test.astype(np.float64), -1).mean(0)
    index = np.minimum((mean * 5).astype(int), 4)
    raw = np.asarray(calibrator.values)[0][np.arange(4), index]
    floor = 1 / (2 * (len(labels) + 1))  # the default floor, then normalised
    raw = np.clip(raw, floor, 1 - floor)
    np.testing.assert_allclose(got, raw / raw.sum(-1, keepdims=True), atol=1e-6)
    np.testing.assert_allclose(got.sum(-1), 1.0, atol=1e-6)


def test_non_parametric_calibration_lowers_ece_on_its_split(split):
    logits, labels, _ = split
    before = float(
        ee.metrics.expected_calibration_error(logits, labels, from_logits=True)
    )
    for fit in (
        ee.calibration.fit_histogram_binning,
        ee.calibration.fit_isotonic_regression,
    ):
        out = fit(logits, labels, from_logits=True)(logits, from_logits=True)
        assert float(ee.metrics.expected_calibration_error(out, labels)) < before / 2


def test_calibrators_run_under_jit_and_round_trip(split, tmp_path):
    logits, labels, test = split
    for calibrator in (
        ee.calibration.fit_matrix_scaling(logits, labels),
        ee.calibration.fit_isotonic_regression(logits, labels, from_logits=True),
    ):
        kwargs = (
            {}
            if isinstance(calibrator, ee.calibration.MatrixScaling)
            else {"from_logits": True}
        )
        eager = calibrator(test, **kwargs)
        jitted = eqx_filter_jit(lambda c, z: c(z, **kwargs))(
            calibrator, jnp.asarray(test)
        )
        np.testing.assert_allclose(jitted, eager, atol=1e-6)
        ee.save(tmp_path / "c.eqx", calibrator)
        loaded = ee.load(tmp_path / "c.eqx", calibrator)
        np.testing.assert_array_equal(loaded(test, **kwargs), eager)


def eqx_filter_jit(fn):
    import equinox as eqx

    return eqx.filter_jit(fn)


# ------------------------------------------------------------------ bad input


def test_fewer_examples_than_parameters(split):
    logits, labels, _ = split
    with pytest.raises(ValueError, match="20 parameters.*only 10 examples"):
        ee.calibration.fit_matrix_scaling(logits[:, :10], labels[:10])
    with pytest.raises(ValueError, match="8 parameters.*only 5 examples"):
        ee.calibration.fit_vector_scaling(logits[:, :5], labels[:5])
    with pytest.raises(ValueError, match="15 parameters.*only 12 examples"):
        ee.calibration.fit_histogram_binning(
            logits[:, :12], labels[:12], from_logits=True
        )
    with pytest.raises(ValueError, match="only 1 examples"):
        ee.calibration.fit_isotonic_regression(
            logits[:, :1], labels[:1], from_logits=True
        )


@pytest.mark.parametrize("l2", [-1.0, float("inf"), float("nan")])
def test_bad_l2(split, l2):
    logits, labels, _ = split
    with pytest.raises(ValueError, match="`l2`"):
        ee.calibration.fit_vector_scaling(logits, labels, l2=l2)


def test_bad_options(split):
    logits, labels, _ = split
    with pytest.raises(ValueError, match="`iterations`"):
        ee.calibration.fit_vector_scaling(logits, labels, iterations=0)
    with pytest.raises(TypeError, match="per_member"):
        ee.calibration.fit_vector_scaling(logits, labels, per_member=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="`n_bins`"):
        ee.calibration.fit_histogram_binning(logits, labels, n_bins=0, from_logits=True)
    # Under the test suite's jaxtyping hook, beartype's message comes first; both
    # name the argument.
    with pytest.raises((ValueError, TypeError), match="labels"):
        ee.calibration.fit_vector_scaling(logits, labels[:-1])


def test_applied_to_other_classes_or_members(split):
    logits, labels, test = split
    vector = ee.calibration.fit_vector_scaling(logits, labels, per_member=True)
    with pytest.raises(ValueError, match="fitted on 4 classes"):
        vector(test[..., :3])
    with pytest.raises(ValueError, match="per member on 3 members"):
        vector(test[:2])
    binning = ee.calibration.fit_histogram_binning(logits, labels, from_logits=True)
    with pytest.raises(ValueError, match="fitted on 4 classes"):
        binning(test[..., :3], from_logits=True)


# ------------------------- every class kept possible; the default penalty pays


@pytest.mark.parametrize("which", ["isotonic", "histogram"])
def test_non_parametric_calibrators_keep_every_class_possible(which):
    from sklearn.isotonic import IsotonicRegression

    # A calibration split where class 0 never occurs: its map is 0 everywhere.
    n = 300
    p1 = np.random.default_rng(0).uniform(0.5, 1.0, n)
    probs = np.stack([1 - p1, p1], axis=-1)[None].astype(np.float32)
    labels = np.ones(n, np.int32)
    fit = {
        "isotonic": ee.calibration.fit_isotonic_regression,
        "histogram": ee.calibration.fit_histogram_binning,
    }[which]
    test = jnp.asarray([[[0.3, 0.7]]], jnp.float32)
    raw = fit(probs, labels, floor=0)(test)
    assert float(raw[0, 0, 0]) == 0.0  # the raw map: class 0 impossible
    if which == "isotonic":  # ... as scikit-learn's isotonic regression says
        reference = IsotonicRegression(out_of_bounds="clip").fit(
            probs[0, :, 0], labels == 0
        )
        assert reference.predict([0.3])[0] == 0.0
    calibrated = fit(probs, labels)(test)  # the default floor
    floor = 1 / (2 * (n + 1))
    assert float(calibrated[0, 0, 0]) == pytest.approx(floor, rel=1e-5)
    assert float(calibrated.sum()) == pytest.approx(1.0, rel=1e-6)
    nll = ee.metrics.nll(calibrated, jnp.array([0]))
    assert np.isfinite(float(nll)) and float(nll) == pytest.approx(
        -np.log(floor), rel=1e-4
    )
    with pytest.raises(ValueError, match=r"`floor` must be in \[0, 0.5\)"):
        fit(probs, labels, floor=0.7)


def _tempered_problem(n, seed):
    # Labels drawn from softmax(z / 2): temperature scaling is the true map.
    rng = np.random.default_rng(seed)
    z = 3.0 * rng.normal(size=(1, n, 10)).astype(np.float32)
    p = np.asarray(jax.nn.softmax(jnp.asarray(z[0]) / 2.0, axis=-1), np.float64)
    labels = np.array([rng.choice(10, p=row / row.sum()) for row in p], np.int32)
    return jnp.asarray(z), jnp.asarray(labels)


@pytest.mark.parametrize(
    "fit",
    [ee.calibration.fit_vector_scaling, ee.calibration.fit_dirichlet_scaling],
    ids=["vector", "dirichlet"],
)
def test_parametric_calibrators_do_not_lose_to_temperature_scaling_by_default(fit):
    # On a 300-example split, the default penalty (chosen by cross-validation,
    # pulling to temperature scaling's family) stays within rounding of
    # temperature scaling on held-out data, where the true map IS a
    # temperature; a weak fixed penalty overfits the split.
    logits, labels = _tempered_problem(300, 0)
    test_logits, test_labels = _tempered_problem(4000, 1)
    temperature = ee.metrics.fit_temperature(logits, labels)
    reference = float(
        ee.metrics.nll(test_logits / temperature, test_labels, from_logits=True)
    )
    calibrated = fit(logits, labels)(test_logits)
    default = float(ee.metrics.nll(calibrated, test_labels, from_logits=True))
    weak = float(
        ee.metrics.nll(
            fit(logits, labels, l2=1e-4)(test_logits), test_labels, from_logits=True
        )
    )
    assert default <= reference + 0.01, (default, reference)
    assert weak > default, (weak, default)
