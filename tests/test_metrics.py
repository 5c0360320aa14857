"""`ee.metrics` against independent references: scikit-learn, SciPy, closed forms and
hand-written NumPy loops."""

import itertools
import warnings

import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import jaxtyping
import numpy as np
import pytest
import scipy.optimize
import scipy.special
import scipy.stats
import sklearn.metrics
from hypothesis import given, settings, strategies as st

import eqx_ensemble as ee

M = ee.metrics


# ---------------------------------------------------------------------------
# Data and NumPy references.


def _probs(seed, members, batch, classes, scale=2.0):
    rng = np.random.default_rng(seed)
    logits = scale * rng.standard_normal((members, batch, classes))
    probs = scipy.special.softmax(logits, axis=-1)
    labels = rng.integers(0, classes, batch)
    return probs.astype(np.float32), labels.astype(np.int32), logits.astype(np.float32)


def _f64(probs):
    """Float32 probabilities in float64, renormalised (scikit-learn checks sums)."""
    probs = np.asarray(probs, np.float64)
    return probs / probs.sum(-1, keepdims=True)


def _numpy_ece(probs, labels, n_bins):
    """ECE with right-closed equal-width bins, one bin at a time."""
    confidence = probs.max(axis=1).astype(np.float64)
    correct = probs.argmax(axis=1) == labels
    total = 0.0
    for b in range(n_bins):
        lower, upper = b / n_bins, (b + 1) / n_bins
        in_bin = (confidence > lower) & (confidence <= upper)
        if b == 0:
            in_bin |= confidence == 0.0
        if in_bin.any():
            gap = abs(correct[in_bin].mean() - confidence[in_bin].mean())
            total += in_bin.mean() * gap
    return total


def _numpy_bins_adaptive(probs, n_bins):
    confidence = probs.max(axis=1)
    order = np.argsort(confidence, kind="stable")
    return np.array_split(order, n_bins)


def _numpy_adaptive_ece(probs, labels, n_bins):
    confidence = probs.max(axis=1).astype(np.float64)
    correct = probs.argmax(axis=1) == labels
    total = 0.0
    for members_of_bin in _numpy_bins_adaptive(probs, n_bins):
        if len(members_of_bin):
            gap = abs(
                correct[members_of_bin].mean() - confidence[members_of_bin].mean()
            )
            total += len(members_of_bin) / len(labels) * gap
    return total


def _numpy_mce(probs, labels, n_bins):
    confidence = probs.max(axis=1).astype(np.float64)
    correct = probs.argmax(axis=1) == labels
    worst = 0.0
    for b in range(n_bins):
        in_bin = (confidence > b / n_bins) & (confidence <= (b + 1) / n_bins)
        if in_bin.any():
            gap = abs(correct[in_bin].mean() - confidence[in_bin].mean())
            worst = max(worst, gap)
    return worst


def _numpy_entropy(p):
    p = np.asarray(p, np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        return -np.sum(np.where(p > 0, p * np.log(p), 0.0), axis=-1)


# ---------------------------------------------------------------------------
# Scores of the ensemble's prediction.


@pytest.mark.parametrize("members,classes", [(1, 3), (5, 4), (3, 10)])
def test_accuracy_matches_sklearn(members, classes):
    probs, labels, logits = _probs(0, members, 200, classes)
    expected = sklearn.metrics.accuracy_score(labels, probs.mean(0).argmax(1))
    assert float(M.accuracy(probs, labels)) == pytest.approx(expected)
    assert float(M.accuracy(logits, labels, from_logits=True)) == pytest.approx(
        sklearn.metrics.accuracy_score(
            labels, scipy.special.softmax(logits, -1).mean(0).argmax(1)
        )
    )


def test_per_member_accuracy_and_nll_match_sklearn_member_by_member():
    probs, labels, logits = _probs(1, 4, 150, 5)
    accuracy = M.per_member_accuracy(probs, labels)
    nll = M.per_member_nll(probs, labels)
    nll_logits = M.per_member_nll(logits, labels, from_logits=True)
    assert accuracy.shape == nll.shape == (4,)
    for member in range(4):
        expected_accuracy = sklearn.metrics.accuracy_score(
            labels, probs[member].argmax(1)
        )
        expected_nll = sklearn.metrics.log_loss(
            labels, _f64(probs[member]), labels=range(5)
        )
        assert float(accuracy[member]) == pytest.approx(expected_accuracy)
        assert float(nll[member]) == pytest.approx(expected_nll, rel=1e-5)
        assert float(nll_logits[member]) == pytest.approx(expected_nll, rel=1e-5)


@pytest.mark.parametrize("members,classes", [(1, 2), (5, 3), (4, 10)])
def test_nll_matches_sklearn_log_loss(members, classes):
    probs, labels, logits = _probs(2, members, 300, classes)
    mean_probs = _f64(probs.mean(0, dtype=np.float64))
    expected = sklearn.metrics.log_loss(labels, mean_probs, labels=range(classes))
    assert float(M.nll(probs, labels)) == pytest.approx(expected, rel=1e-5)
    assert float(M.nll(logits, labels, from_logits=True)) == pytest.approx(
        expected, rel=1e-5
    )
    per_example = M.nll(probs, labels, reduction="none")
    assert per_example.shape == (300,)
    np.testing.assert_allclose(
        per_example,
        -np.log(mean_probs[np.arange(300), labels]),
        rtol=1e-5,
        atol=1e-6,
    )
    assert float(M.nll(probs, labels, reduction="sum")) == pytest.approx(
        300 * expected, rel=1e-5
    )


def test_nll_from_logits_stays_exact_where_probabilities_underflow():
    logits = jnp.array([[[0.0, -200.0, -150.0]], [[0.0, -300.0, -250.0]]])
    labels = jnp.array([1])
    reference = -(
        scipy.special.logsumexp([-200.0, -300.0]) - np.log(2)
    )  # the softmax's normaliser is 1 up to exp(-150)
    assert float(M.nll(logits, labels, from_logits=True)) == pytest.approx(
        reference, rel=1e-6
    )


@pytest.mark.parametrize("classes", [3, 7])
def test_brier_score_matches_numpy_and_sklearn_multiclass(classes):
    probs, labels, logits = _probs(3, 5, 250, classes)
    mean_probs = _f64(probs.mean(0, dtype=np.float64))
    one_hot = np.eye(classes)[labels]
    per_example = np.sum((mean_probs - one_hot) ** 2, axis=1)
    np.testing.assert_allclose(
        M.brier_score(probs, labels, reduction="none"), per_example, rtol=1e-5
    )
    assert float(M.brier_score(probs, labels)) == pytest.approx(
        per_example.mean(), rel=1e-5
    )
    sklearn_score = sklearn.metrics.brier_score_loss(
        labels, mean_probs, labels=range(classes), scale_by_half=False
    )
    assert float(M.brier_score(probs, labels)) == pytest.approx(sklearn_score, rel=1e-5)
    assert float(M.brier_score(logits, labels, from_logits=True)) == pytest.approx(
        float(M.brier_score(jax.nn.softmax(logits, -1), labels)), rel=1e-5
    )
    per_member = M.per_member_brier_score(probs, labels)
    for member in range(5):
        expected = np.mean(np.sum((probs[member] - one_hot) ** 2, axis=1))
        assert float(per_member[member]) == pytest.approx(expected, rel=1e-5)


def test_binary_brier_score_is_twice_sklearn_binary_score():
    probs, labels, _ = _probs(4, 3, 400, 2)
    positive = _f64(probs.mean(0, dtype=np.float64))[:, 1]
    binary = sklearn.metrics.brier_score_loss(labels, positive)
    assert float(M.brier_score(probs, labels)) == pytest.approx(2 * binary, rel=1e-5)


# ---------------------------------------------------------------------------
# Uncertainty decomposition.


@pytest.mark.parametrize("classes", [2, 5, 10])
def test_entropy_of_uniform_is_log_classes(classes):
    probs = jnp.full((3, 4, classes), 1.0 / classes)
    np.testing.assert_allclose(M.predictive_entropy(probs), np.log(classes), rtol=1e-6)
    np.testing.assert_allclose(M.expected_entropy(probs), np.log(classes), rtol=1e-6)
    np.testing.assert_allclose(M.mutual_information(probs), 0.0, atol=1e-6)
    logits = jnp.zeros((3, 4, classes))
    np.testing.assert_allclose(
        M.predictive_entropy(logits, from_logits=True), np.log(classes), rtol=1e-6
    )


def test_entropy_of_one_hot_is_positive_zero():
    # Certain members: every entropy is exactly 0.0, with a positive sign (a
    # printed "-0.0" would read as a bug).
    probs = jnp.tile(jnp.eye(3)[None, :, :], (4, 1, 1))
    for value in (M.predictive_entropy(probs), M.expected_entropy(probs)):
        value = np.asarray(value)
        np.testing.assert_array_equal(value, 0.0)
        assert not np.signbit(value).any()


def test_entropies_match_numpy():
    probs, _, logits = _probs(5, 6, 50, 4)
    expected_total = _numpy_entropy(probs.astype(np.float64).mean(0))
    expected_aleatoric = _numpy_entropy(probs).mean(0)
    np.testing.assert_allclose(M.predictive_entropy(probs), expected_total, rtol=1e-5)
    np.testing.assert_allclose(M.expected_entropy(probs), expected_aleatoric, rtol=1e-5)
    np.testing.assert_allclose(
        M.mutual_information(probs),
        expected_total - expected_aleatoric,
        rtol=1e-4,
        atol=1e-6,
    )
    np.testing.assert_allclose(
        M.mutual_information(logits, from_logits=True),
        expected_total - expected_aleatoric,
        rtol=1e-4,
        atol=1e-5,
    )


def test_mutual_information_of_identical_members_is_zero():
    probs, _, _ = _probs(6, 1, 40, 5)
    identical = np.repeat(probs, 7, axis=0)
    np.testing.assert_allclose(M.mutual_information(identical), 0.0, atol=1e-6)
    one_hot = jax.nn.one_hot(jnp.zeros((4, 10), jnp.int32), 3)  # exact zeros and ones
    np.testing.assert_array_equal(M.mutual_information(one_hot), 0.0)


@pytest.mark.parametrize("members,classes", [(2, 2), (3, 5), (4, 4)])
def test_mutual_information_of_disjoint_one_hot_members_is_log_members(
    members, classes
):
    votes = jnp.arange(members)[:, None] * jnp.ones((1, 6), jnp.int32)
    probs = jax.nn.one_hot(votes, classes)
    np.testing.assert_allclose(M.mutual_information(probs), np.log(members), rtol=1e-6)
    np.testing.assert_array_equal(M.expected_entropy(probs), 0.0)
    np.testing.assert_allclose(M.predictive_entropy(probs), np.log(members), rtol=1e-6)
    np.testing.assert_allclose(M.variation_ratio(probs), 1 - 1 / members, rtol=1e-6)
    np.testing.assert_allclose(M.disagreement(probs), 1.0, rtol=1e-6)


def test_vote_based_measures_match_numpy_loops():
    probs, _, logits = _probs(7, 5, 60, 3, scale=1.0)
    votes = probs.argmax(-1)
    variation = np.empty(60)
    disagreement = np.empty(60)
    for example in range(60):
        counts = np.bincount(votes[:, example], minlength=3)
        variation[example] = 1 - counts.max() / 5
        pairs = list(itertools.permutations(range(5), 2))
        disagreement[example] = np.mean(
            [votes[i, example] != votes[j, example] for i, j in pairs]
        )
    np.testing.assert_allclose(M.variation_ratio(probs), variation, rtol=1e-6)
    np.testing.assert_allclose(M.disagreement(probs), disagreement, rtol=1e-6)
    np.testing.assert_allclose(
        M.disagreement(logits, from_logits=True), disagreement, rtol=1e-6
    )
    pairwise = M.pairwise_disagreement(probs)
    for i, j in itertools.product(range(5), repeat=2):
        expected = np.mean(votes[i] != votes[j])
        assert float(pairwise[i, j]) == pytest.approx(expected, abs=1e-6)


def test_disagreement_of_one_member_is_zero():
    probs, _, _ = _probs(8, 1, 10, 3)
    np.testing.assert_array_equal(M.disagreement(probs), 0.0)
    np.testing.assert_array_equal(M.variation_ratio(probs), 0.0)


_FIXED_PROBS = hnp.arrays(
    np.float64,
    (4, 3, 5),
    elements=st.floats(0.0, 1.0, allow_nan=False, allow_infinity=False),
)


@settings(max_examples=40, deadline=None)
@given(raw=_FIXED_PROBS)
def test_uncertainty_bounds_property(raw):
    raw = raw + 1e-3 * (raw.sum(-1, keepdims=True) == 0)  # avoid all-zero rows
    probs = jnp.asarray(raw / raw.sum(-1, keepdims=True), jnp.float32)
    total = np.asarray(M.predictive_entropy(probs))
    aleatoric = np.asarray(M.expected_entropy(probs))
    epistemic = np.asarray(M.mutual_information(probs))
    assert np.all(np.isfinite(total)) and np.all(np.isfinite(epistemic))
    assert np.all(epistemic >= 0)
    assert np.all(epistemic <= total + 1e-6)
    assert np.all(aleatoric <= total + 1e-5)
    assert np.all(total <= np.log(5) + 1e-5)
    assert np.all(epistemic <= np.log(4) + 1e-5)


# ---------------------------------------------------------------------------
# Calibration.


@pytest.mark.parametrize("n_bins", [1, 5, 15])
def test_ece_matches_numpy_loop(n_bins):
    probs, labels, _ = _probs(9, 1, 1000, 4)
    expected = _numpy_ece(probs[0], labels, n_bins)
    got = M.expected_calibration_error(probs, labels, n_bins)
    assert float(got) == pytest.approx(expected, rel=1e-5, abs=1e-6)
    expected_mce = _numpy_mce(probs[0], labels, n_bins)
    got_mce = M.max_calibration_error(probs, labels, n_bins)
    assert float(got_mce) == pytest.approx(expected_mce, rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("batch,n_bins", [(1000, 15), (103, 10), (7, 10), (50, 1)])
def test_adaptive_ece_matches_numpy_loop(batch, n_bins):
    probs, labels, _ = _probs(10, 1, batch, 3)
    expected = _numpy_adaptive_ece(probs[0], labels, n_bins)
    got = M.adaptive_calibration_error(probs, labels, n_bins)
    assert float(got) == pytest.approx(expected, rel=1e-5, abs=1e-6)
    bins = M.calibration_bins(probs, labels, n_bins, adaptive=True)
    groups = _numpy_bins_adaptive(probs[0], n_bins)
    np.testing.assert_array_equal(bins.count, [len(group) for group in groups])
    confidence = probs[0].max(1)
    for b, group in enumerate(groups):
        if len(group):
            assert float(bins.lower[b]) == confidence[group].min()
            assert float(bins.upper[b]) == confidence[group].max()
        else:
            assert np.isnan(bins.lower[b]) and np.isnan(bins.upper[b])


def test_adaptive_ece_with_ties_matches_numpy_loop():
    # Many equal confidences: the stable sorted order decides where ties are cut.
    rng = np.random.default_rng(11)
    top = rng.choice([0.5, 0.7, 0.9], size=90).astype(np.float32)
    probs = np.stack([top, 1 - top], axis=-1)[None]
    labels = rng.integers(0, 2, 90).astype(np.int32)
    expected = _numpy_adaptive_ece(probs[0], labels, 4)
    got = M.adaptive_calibration_error(probs, labels, 4)
    assert float(got) == pytest.approx(expected, rel=1e-5, abs=1e-6)


def test_calibration_bins_match_numpy_loop():
    probs, labels, _ = _probs(12, 1, 500, 5)
    bins = M.calibration_bins(probs, labels, 10)
    confidence = probs[0].max(1)
    correct = probs[0].argmax(1) == labels
    for b in range(10):
        in_bin = (confidence > b / 10) & (confidence <= (b + 1) / 10)
        assert float(bins.count[b]) == in_bin.sum()
        if in_bin.any():
            assert float(bins.accuracy[b]) == pytest.approx(correct[in_bin].mean())
            assert float(bins.confidence[b]) == pytest.approx(
                confidence[in_bin].mean(), rel=1e-5
            )
        else:
            assert float(bins.accuracy[b]) == 0.0
    np.testing.assert_allclose(bins.lower, np.arange(10) / 10, atol=1e-7)
    np.testing.assert_allclose(bins.upper, np.arange(1, 11) / 10, atol=1e-7)


def test_calibration_of_ensemble_uses_the_mean_prediction():
    probs, labels, logits = _probs(13, 5, 400, 3)
    mean_probs = jnp.mean(jnp.asarray(probs), axis=0)[None]
    for function in (
        M.expected_calibration_error,
        M.adaptive_calibration_error,
        M.max_calibration_error,
    ):
        assert float(function(probs, labels, 10)) == pytest.approx(
            float(function(mean_probs, labels, 10)), abs=1e-6
        )
        assert float(function(logits, labels, 10, from_logits=True)) == pytest.approx(
            float(function(probs, labels, 10)), abs=1e-5
        )


def test_per_member_calibration_error_matches_numpy_loop():
    probs, labels, _ = _probs(14, 4, 300, 3)
    equal_width = M.per_member_calibration_error(probs, labels, 10)
    equal_mass = M.per_member_calibration_error(probs, labels, 10, adaptive=True)
    for member in range(4):
        assert float(equal_width[member]) == pytest.approx(
            _numpy_ece(probs[member], labels, 10), rel=1e-5, abs=1e-6
        )
        assert float(equal_mass[member]) == pytest.approx(
            _numpy_adaptive_ece(probs[member], labels, 10), rel=1e-5, abs=1e-6
        )


def test_calibration_error_of_confident_wrong_predictions():
    # Closed form: every prediction has confidence 1 and half are wrong.
    probs = jax.nn.one_hot(jnp.array([[0, 0, 1, 1]]), 2)
    labels = jnp.array([0, 1, 1, 0])
    assert float(M.expected_calibration_error(probs, labels)) == pytest.approx(0.5)
    assert float(M.adaptive_calibration_error(probs, labels)) == pytest.approx(0.5)
    assert float(M.max_calibration_error(probs, labels)) == pytest.approx(0.5)


@settings(max_examples=30, deadline=None)
@given(
    raw=hnp.arrays(np.float64, (2, 12, 3), elements=st.floats(0.01, 1.0)),
    labels=hnp.arrays(np.int32, (12,), elements=st.integers(0, 2)),
)
def test_calibration_error_bounds_property(raw, labels):
    probs = jnp.asarray(raw / raw.sum(-1, keepdims=True), jnp.float32)
    for adaptive in (False, True):
        ece = float(
            M.adaptive_calibration_error(probs, labels, 4)
            if adaptive
            else M.expected_calibration_error(probs, labels, 4)
        )
        mce = float(M.max_calibration_error(probs, labels, 4, adaptive=adaptive))
        assert 0.0 <= ece <= mce + 1e-6 <= 1.0 + 1e-6


# ---------------------------------------------------------------------------
# Temperature scaling.


def _numpy_temperature(logits, labels, bounds):
    logits = np.asarray(logits, np.float64)

    def objective(log_temperature):
        log_probs = scipy.special.log_softmax(logits / np.exp(log_temperature), -1)
        log_mean = scipy.special.logsumexp(log_probs, axis=0) - np.log(len(logits))
        return -log_mean[np.arange(len(labels)), labels].mean()

    result = scipy.optimize.minimize_scalar(
        objective,
        bounds=np.log(bounds),
        method="bounded",
        options={"xatol": 1e-9},
    )
    return np.exp(result.x)


@pytest.mark.parametrize("members,true_temperature", [(1, 3.0), (4, 0.5), (3, 2.0)])
def test_fit_temperature_matches_scipy(members, true_temperature):
    rng = np.random.default_rng(15)
    base = rng.standard_normal((members, 600, 5)) * 2
    # Labels drawn from the softened/sharpened predictions of the first member.
    target = scipy.special.softmax(base[0] / true_temperature, -1)
    labels = np.array([rng.choice(5, p=row) for row in target], np.int32)
    logits = base.astype(np.float32)
    expected = _numpy_temperature(logits, labels, (0.01, 100.0))
    fitted = ee.metrics.fit_temperature(logits, labels)
    assert float(fitted) == pytest.approx(expected, rel=1e-2)
    assert float(jax.jit(M.fit_temperature)(logits, labels)) == pytest.approx(
        float(fitted), rel=1e-6
    )
    scaled = M.apply_temperature(logits, fitted)
    np.testing.assert_allclose(scaled, logits / float(fitted), rtol=1e-6)
    before = float(M.nll(logits, labels, from_logits=True))
    after = float(M.nll(scaled, labels, from_logits=True))
    assert after <= before + 1e-6
    assert (
        float(M.accuracy(scaled, labels, from_logits=True))
        == float(M.accuracy(logits, labels, from_logits=True))
        or members > 1
    )  # the argmax of the mean may move for an ensemble


def test_fit_temperature_returns_the_bound_when_the_optimum_lies_outside():
    rng = np.random.default_rng(16)
    logits = rng.standard_normal((1, 300, 4)).astype(np.float32)
    labels = logits[0].argmax(1).astype(np.int32)  # always right: sharpen forever
    # Said: such a temperature does not generalise (breast cancer, one seed of
    # the results page: 0.01, test NLL 0.220 -> 2.604 with no word).
    with pytest.warns(M.TemperatureAtBoundWarning, match="lower bound 0.5"):
        fitted = float(M.fit_temperature(logits, labels, bounds=(0.5, 2.0)))
    assert fitted == pytest.approx(0.5, rel=1e-4)
    with pytest.warns(M.TemperatureAtBoundWarning, match="lower bound 0.01"):
        M.fit_temperature(logits, labels)
    # Uniform predictions: the NLL falls as T grows, to the upper bound.
    confident = 3 * rng.standard_normal((1, 300, 4)).astype(np.float32)
    with pytest.warns(M.TemperatureAtBoundWarning, match="upper bound 2"):
        M.fit_temperature(confident, rng.integers(0, 4, 300), bounds=(0.5, 2.0))


def test_per_member_temperatures_by_vmap():
    rng = np.random.default_rng(17)
    logits = (
        rng.standard_normal((3, 400, 4)) * np.array([1, 3, 6])[:, None, None]
    ).astype(np.float32)
    labels = rng.integers(0, 4, 400).astype(np.int32)
    per_member = jax.vmap(lambda x: M.fit_temperature(x[None], labels))(logits)
    for member in range(3):
        expected = _numpy_temperature(logits[member : member + 1], labels, (0.01, 100))
        assert float(per_member[member]) == pytest.approx(expected, rel=1e-2)


# ---------------------------------------------------------------------------
# Regression.


def _regression(seed, members=5, batch=80):
    rng = np.random.default_rng(seed)
    means = rng.standard_normal((members, batch)).astype(np.float32)
    variances = rng.uniform(0.1, 2.0, (members, batch)).astype(np.float32)
    targets = rng.standard_normal(batch).astype(np.float32)
    return means, variances, targets


def test_mixture_moments_match_numpy():
    means, variances, _ = _regression(20)
    m64, v64 = means.astype(np.float64), variances.astype(np.float64)
    expected_mean = m64.mean(0)
    expected_variance = np.mean(v64 + m64**2, axis=0) - expected_mean**2
    np.testing.assert_allclose(M.predictive_mean(means), expected_mean, atol=1e-6)
    np.testing.assert_allclose(
        M.predictive_variance(means, variances), expected_variance, rtol=1e-5
    )
    np.testing.assert_allclose(M.aleatoric_variance(variances), v64.mean(0), rtol=1e-6)
    np.testing.assert_allclose(M.epistemic_variance(means), m64.var(0), rtol=1e-5)


@settings(max_examples=40, deadline=None)
@given(
    means=hnp.arrays(np.float32, (3, 6), elements=st.floats(-100, 100, width=32)),
    variances=hnp.arrays(np.float32, (3, 6), elements=st.floats(0, 100, width=32)),
)
def test_total_variance_is_aleatoric_plus_epistemic_property(means, variances):
    total = np.asarray(M.predictive_variance(means, variances))
    parts = np.asarray(M.aleatoric_variance(variances)) + np.asarray(
        M.epistemic_variance(means)
    )
    np.testing.assert_allclose(total, parts, rtol=1e-5, atol=1e-3)
    assert np.all(total >= 0)


def test_gaussian_nll_matches_scipy():
    means, variances, targets = _regression(21)
    m64, v64 = means.astype(np.float64), variances.astype(np.float64)
    mean = m64.mean(0)
    variance = np.mean(v64 + m64**2, axis=0) - mean**2
    expected = -scipy.stats.norm.logpdf(targets, mean, np.sqrt(variance))
    np.testing.assert_allclose(
        M.gaussian_nll(means, variances, targets, reduction="none"),
        expected,
        rtol=1e-5,
    )
    assert float(M.gaussian_nll(means, variances, targets)) == pytest.approx(
        expected.mean(), rel=1e-5
    )
    mixture = -np.log(
        np.mean(scipy.stats.norm.pdf(targets[None], m64, np.sqrt(v64)), axis=0)
    )
    np.testing.assert_allclose(
        M.gaussian_nll(
            means, variances, targets, predictive="mixture", reduction="none"
        ),
        mixture,
        rtol=1e-5,
    )
    per_member = M.per_member_gaussian_nll(means, variances, targets)
    for member in range(5):
        expected_member = -scipy.stats.norm.logpdf(
            targets, m64[member], np.sqrt(v64[member])
        ).mean()
        assert float(per_member[member]) == pytest.approx(expected_member, rel=1e-5)


def test_gaussian_nll_of_a_single_member_equals_its_own_nll():
    means, variances, targets = _regression(22, members=1)
    np.testing.assert_allclose(
        M.gaussian_nll(means, variances, targets, reduction="none"),
        M.gaussian_nll(
            means, variances, targets, predictive="mixture", reduction="none"
        ),
        rtol=1e-5,
    )


def test_rmse_matches_sklearn():
    means, _, targets = _regression(23)
    expected = sklearn.metrics.root_mean_squared_error(targets, means.mean(0))
    assert float(M.rmse(means, targets)) == pytest.approx(expected, rel=1e-5)
    per_member = M.per_member_rmse(means, targets)
    for member in range(5):
        assert float(per_member[member]) == pytest.approx(
            sklearn.metrics.root_mean_squared_error(targets, means[member]), rel=1e-5
        )


@pytest.mark.parametrize("level", [0.5, 0.9, 0.95])
def test_interval_coverage_matches_numpy(level):
    means, variances, targets = _regression(24, batch=500)
    m64, v64 = means.astype(np.float64), variances.astype(np.float64)
    mean = m64.mean(0)
    std = np.sqrt(np.mean(v64 + m64**2, axis=0) - mean**2)
    low, high = scipy.stats.norm.interval(level, mean, std)
    expected = np.mean((targets >= low) & (targets <= high))
    assert float(M.interval_coverage(means, variances, targets, level)) == (
        pytest.approx(expected, abs=1 / 500 + 1e-9)
    )


def test_interval_coverage_is_calibrated_for_the_true_distribution():
    key_noise, key_members = jax.random.split(jax.random.key(25))
    targets = jax.random.normal(key_noise, (20_000,))
    means = jnp.zeros((3, 20_000))
    variances = jnp.ones((3, 20_000))
    for level in (0.5, 0.8, 0.95):
        coverage = float(M.interval_coverage(means, variances, targets, level))
        assert coverage == pytest.approx(level, abs=0.015)


# ---------------------------------------------------------------------------
# Out-of-distribution AUROC.


@pytest.mark.parametrize("ties", [False, True])
def test_ood_auroc_matches_sklearn(ties):
    rng = np.random.default_rng(30)
    in_scores = rng.standard_normal(300)
    out_scores = rng.standard_normal(200) + 0.7
    if ties:
        in_scores, out_scores = np.round(in_scores), np.round(out_scores)
    in_scores = in_scores.astype(np.float32)
    out_scores = out_scores.astype(np.float32)
    truth = np.concatenate([np.zeros(300), np.ones(200)])
    expected = sklearn.metrics.roc_auc_score(
        truth, np.concatenate([in_scores, out_scores])
    )
    got = M.ood_auroc(in_scores, out_scores)
    assert float(got) == pytest.approx(expected, rel=1e-6)
    assert float(jax.jit(M.ood_auroc)(in_scores, out_scores)) == pytest.approx(
        expected, rel=1e-6
    )


@settings(max_examples=40, deadline=None)
@given(
    in_scores=hnp.arrays(np.float32, (7,), elements=st.integers(-3, 3)),
    out_scores=hnp.arrays(np.float32, (5,), elements=st.integers(-3, 3)),
)
def test_ood_auroc_with_ties_property(in_scores, out_scores):
    truth = np.concatenate([np.zeros(7), np.ones(5)])
    expected = sklearn.metrics.roc_auc_score(
        truth, np.concatenate([in_scores, out_scores])
    )
    forward = float(M.ood_auroc(in_scores, out_scores))
    backward = float(M.ood_auroc(out_scores, in_scores))
    assert forward == pytest.approx(expected, abs=1e-6)
    assert forward + backward == pytest.approx(1.0, abs=1e-6)


def test_ood_auroc_with_an_ensembles_uncertainty():
    # OOD inputs: members disagree; in-distribution: members agree.
    rng = np.random.default_rng(31)
    agree = np.repeat(rng.standard_normal((1, 100, 4)), 5, axis=0)
    disagree = 3 * rng.standard_normal((5, 80, 4))
    in_scores = M.mutual_information(agree, from_logits=True)
    out_scores = M.mutual_information(disagree, from_logits=True)
    assert float(M.ood_auroc(in_scores, out_scores)) == 1.0


# ---------------------------------------------------------------------------
# Exact zeros and ones, jit, gradients.


def _temperature_of_any_data(logits, labels):
    # Random labels: the fitted temperature may lie at its bound (warned).
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", M.TemperatureAtBoundWarning)
        return M.fit_temperature(logits, labels)


_CLASSIFICATION = {
    "accuracy": lambda p, y: M.accuracy(p, y),
    "nll": lambda p, y: M.nll(p, y),
    "nll_none": lambda p, y: M.nll(p, y, reduction="none"),
    "brier_score": lambda p, y: M.brier_score(p, y),
    "per_member_accuracy": lambda p, y: M.per_member_accuracy(p, y),
    "per_member_nll": lambda p, y: M.per_member_nll(p, y),
    "per_member_brier_score": lambda p, y: M.per_member_brier_score(p, y),
    "per_member_calibration_error": lambda p, y: M.per_member_calibration_error(p, y),
    "predictive_entropy": lambda p, y: M.predictive_entropy(p),
    "expected_entropy": lambda p, y: M.expected_entropy(p),
    "mutual_information": lambda p, y: M.mutual_information(p),
    "variation_ratio": lambda p, y: M.variation_ratio(p),
    "disagreement": lambda p, y: M.disagreement(p),
    "pairwise_disagreement": lambda p, y: M.pairwise_disagreement(p),
    "expected_calibration_error": lambda p, y: M.expected_calibration_error(p, y),
    "adaptive_calibration_error": lambda p, y: M.adaptive_calibration_error(p, y, 4),
    "max_calibration_error": lambda p, y: M.max_calibration_error(p, y),
    "calibration_bins": lambda p, y: M.calibration_bins(p, y, 5),
    "fit_temperature": lambda p, y: _temperature_of_any_data(jnp.log(p + 0.1), y),
}


@pytest.mark.parametrize("name", sorted(_CLASSIFICATION))
def test_classification_jit_matches_eager(name):
    probs, labels, _ = _probs(40, 3, 30, 4)
    function = _CLASSIFICATION[name]
    eager = function(jnp.asarray(probs), jnp.asarray(labels))
    jitted = jax.jit(function)(jnp.asarray(probs), jnp.asarray(labels))
    for a, b in zip(jax.tree.leaves(eager), jax.tree.leaves(jitted), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", sorted(_CLASSIFICATION))
def test_exact_zero_and_one_probabilities_give_finite_values(name):
    # Confident members, some wrong: probabilities of exactly 0 on the true class.
    probs = jax.nn.one_hot(jnp.array([[0, 1, 2, 0], [0, 2, 2, 1]]), 3)
    labels = jnp.array([0, 1, 0, 2])
    for leaf in jax.tree.leaves(_CLASSIFICATION[name](probs, labels)):
        assert np.all(np.isfinite(np.asarray(leaf))), name


def test_nll_of_a_zero_probability_is_large_but_finite():
    probs = jnp.array([[[1.0, 0.0]]])
    loss = float(M.nll(probs, jnp.array([1])))
    smallest = np.finfo(np.float32).smallest_subnormal
    assert loss == pytest.approx(-np.log(float(smallest)), rel=1e-6)
    tiny = jnp.array([[[1.0, 1e-37]]])  # a tiny positive probability costs less
    assert float(M.nll(tiny / tiny.sum(-1, keepdims=True), jnp.array([1]))) < loss
    assert float(M.nll(probs, jnp.array([0]))) == 0.0


def test_gradients_are_finite_at_exact_zeros():
    probs = jax.nn.one_hot(jnp.array([[0, 1], [0, 0]]), 3)
    for function in (M.predictive_entropy, M.expected_entropy, M.mutual_information):
        grad = jax.grad(lambda p, f=function: jnp.sum(f(p)))(probs)
        assert np.all(np.isfinite(np.asarray(grad)))
    logits = jnp.array([[[0.0, -1e4, 3.0]], [[2.0, 1.0, -1e4]]])
    grad = jax.grad(lambda x: M.nll(x, jnp.array([1]), from_logits=True))(logits)
    assert np.all(np.isfinite(np.asarray(grad)))


_REGRESSION = {
    "predictive_mean": lambda m, v, t: M.predictive_mean(m),
    "predictive_variance": lambda m, v, t: M.predictive_variance(m, v),
    "aleatoric_variance": lambda m, v, t: M.aleatoric_variance(v),
    "epistemic_variance": lambda m, v, t: M.epistemic_variance(m),
    "gaussian_nll": lambda m, v, t: M.gaussian_nll(m, v, t),
    "gaussian_nll_mixture": lambda m, v, t: M.gaussian_nll(
        m, v, t, predictive="mixture"
    ),
    "per_member_gaussian_nll": lambda m, v, t: M.per_member_gaussian_nll(m, v, t),
    "rmse": lambda m, v, t: M.rmse(m, t),
    "per_member_rmse": lambda m, v, t: M.per_member_rmse(m, t),
    "interval_coverage": lambda m, v, t: M.interval_coverage(m, v, t, 0.9),
}


@pytest.mark.parametrize("name", sorted(_REGRESSION))
def test_regression_jit_matches_eager(name):
    means, variances, targets = _regression(41, batch=20)
    function = _REGRESSION[name]
    eager = function(means, variances, targets)
    jitted = jax.jit(function)(means, variances, targets)
    np.testing.assert_allclose(eager, jitted, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", sorted(_REGRESSION))
def test_zero_variances_give_no_nan(name):
    means = jnp.array([[0.0, 1.0], [0.0, 2.0]])
    targets = jnp.array([0.0, 1.0])
    value = _REGRESSION[name](means, jnp.zeros((2, 2)), targets)
    assert not np.any(np.isnan(np.asarray(value)))


def test_level_may_be_traced():
    means, variances, targets = _regression(42, batch=20)
    levels = jnp.array([0.5, 0.9])
    coverage = jax.vmap(lambda q: M.interval_coverage(means, variances, targets, q))(
        levels
    )
    for level, value in zip([0.5, 0.9], coverage, strict=True):
        assert float(value) == float(
            M.interval_coverage(means, variances, targets, level)
        )


# ---------------------------------------------------------------------------
# Errors. Runtime type checking (the jaxtyping hook the test suite runs with) would
# catch some of these shapes first with its own TypeError; the library's own
# messages are what users without the hook see, so they are tested with it off.


@pytest.fixture
def without_runtime_typecheck(monkeypatch):
    monkeypatch.setattr(jaxtyping.config, "jaxtyping_disable", True)


_ERRORS = [
    (
        lambda: M.nll(jnp.array([[[0.5, 0.6]]]), jnp.array([0])),
        r"must sum to one along the class \(last\) axis.*shape \(1, 1, 2\).*member 0, "
        r"example 0, which sums to 1\.1.*from_logits=True",
    ),
    (
        lambda: M.accuracy(jnp.array([[[2.0, -1.0]]]), jnp.array([0])),
        r"must hold probabilities in \[0, 1\].*\[-1, 2\].*from_logits=True",
    ),
    (
        lambda: M.predictive_entropy(jnp.array([[[jnp.nan, 1.0]]])),
        r"contains NaN or infinite values, first at index \(0, 0, 0\)",
    ),
    (
        lambda: M.nll(jnp.array([[[0.5, 0.5]]]), jnp.array([2])),
        r"`labels` must lie in \[0, 2\).*lie in \[2, 2\].*label is 2 at index 0",
    ),
    (
        lambda: M.brier_score(jnp.full((3, 4, 2), 0.5), jnp.array([0, 1, -1, 0])),
        r"`labels` must lie in \[0, 2\).*label is -1 at index 2",
    ),
    (
        lambda: M.nll(jnp.full((3, 4, 2), 0.5), jnp.array([0, 1, 1])),
        r"`labels` must have shape \(batch,\) = \(4,\).*\(3, 4, 2\).*shape \(3,\)",
    ),
    (
        lambda: M.nll(jnp.full((4, 2), 0.5), jnp.array([0, 1, 1, 0])),
        r"shape \(members, batch, classes\), got shape \(4, 2\).*x\[None\]",
    ),
    (
        lambda: M.expected_calibration_error(
            jnp.full((1, 2, 2), 0.5), jnp.array([0, 1]), 0
        ),
        r"`n_bins` must be at least 1, got 0",
    ),
    (
        lambda: M.predictive_variance(
            jnp.zeros((2, 3)), jnp.array([[1.0, -0.5, 1.0], [1.0, 1.0, -2.0]])
        ),
        r"`variances` must be non-negative.*2 of its 6 entries \(shape \(2, 3\)\).*"
        r"smallest -2.*member 0, example 1",
    ),
    (
        lambda: M.gaussian_nll(jnp.zeros((2, 3)), jnp.ones((2, 4)), jnp.zeros(3)),
        r"`variances` must have the same shape as `means`.*\(2, 3\), got shape "
        r"\(2, 4\)",
    ),
    (
        lambda: M.rmse(jnp.zeros((2, 3)), jnp.zeros(4)),
        r"`targets` must have shape \(batch,\) = \(3,\).*\(2, 3\).*shape \(4,\)",
    ),
    (
        lambda: M.interval_coverage(
            jnp.zeros((2, 3)), jnp.ones((2, 3)), jnp.zeros(3), 1.5
        ),
        r"`level` must lie strictly between 0 and 1",
    ),
    (
        lambda: M.fit_temperature(
            jnp.zeros((1, 2, 2)), jnp.array([0, 1]), bounds=(2, 1)
        ),
        r"0 < lower < upper, got \(2, 1\)",
    ),
    (
        lambda: M.apply_temperature(jnp.zeros((1, 2, 2)), -1.0),
        r"`temperature` must be positive and finite, got -1",
    ),
    (
        lambda: M.ood_auroc(jnp.array([0.1, jnp.nan]), jnp.array([0.5])),
        r"`in_scores` contains 1 NaN scores, the first at index 1",
    ),
    (
        lambda: M.nll(jnp.full((1, 2, 2), 0.5), jnp.array([0, 1]), reduction="avg"),
        r"`reduction` must be 'mean', 'sum' or 'none', got 'avg'",
    ),
]


@pytest.mark.parametrize("index", range(len(_ERRORS)))
def test_bad_input_messages(index, without_runtime_typecheck):
    call, message = _ERRORS[index]
    with pytest.raises(ValueError, match=message):
        call()


def test_float_labels_are_rejected(without_runtime_typecheck):
    with pytest.raises(TypeError, match=r"`labels` must be integer class indices"):
        M.nll(jnp.full((1, 2, 2), 0.5), jnp.array([0.0, 1.0]))


def test_non_integer_n_bins_is_rejected(without_runtime_typecheck):
    with pytest.raises(TypeError, match=r"`n_bins` must be a Python int"):
        M.calibration_bins(jnp.full((1, 2, 2), 0.5), jnp.array([0, 1]), 2.5)  # type: ignore


def test_mismatched_shapes_fail_under_runtime_typecheck_too():
    with pytest.raises(TypeError):
        M.nll(jnp.full((3, 4, 2), 0.5), jnp.array([0, 1, 1]))


def test_value_checks_are_skipped_under_jit():
    # Values are unknown while tracing; only shapes are checked.
    unnormalised = jnp.array([[[0.5, 0.6]]])
    assert np.isfinite(float(jax.jit(M.nll)(unnormalised, jnp.array([0]))))
    with pytest.raises((ValueError, TypeError), match="labels"):
        jax.jit(M.nll)(jnp.full((3, 4, 2), 0.5), jnp.array([0, 1, 1]))


# ---------------------------- bad input named: strings, infinities, NaN, shapes


def test_a_metric_given_a_string_names_the_argument():
    # The library's message, or (the suite runs under jaxtyping's import hook)
    # beartype's, which also names the parameter; never JAX's dtype error.
    with pytest.raises(TypeError, match="confidence"):
        ee.metrics.aurc("abc", jnp.ones(3))
    with pytest.raises(TypeError, match="probs"):
        ee.metrics.nll([["a", "b"]], jnp.zeros(1, jnp.int32))
    # A level given as a string: named, not NumPy's conversion error.
    with pytest.raises(TypeError, match="level"):
        ee.metrics.interval_coverage(jnp.zeros((2, 4)), jnp.ones((2, 4)),
                                     jnp.zeros(4), "0.9")  # fmt: skip
    from eqx_ensemble._metrics.checks import check_level  # (without the hook)

    with pytest.raises(TypeError, match="`level` must be a number.*str '0.9'"):
        check_level("0.9")


def test_non_finite_logits_and_temperatures_are_refused():
    logits = jnp.array([[[jnp.inf, 0.0], [0.0, 1.0]]])
    labels = jnp.array([0, 1])
    with pytest.raises(ValueError, match=r"contains \+inf"):
        ee.metrics.nll(logits, labels, from_logits=True)
    with pytest.raises(ValueError, match=r"`logits`.*contains \+inf"):
        ee.metrics.fit_temperature(logits, labels)
    with pytest.raises(ValueError, match="positive and finite"):
        ee.metrics.apply_temperature(jnp.ones((1, 2, 2)), jnp.inf)
    # -inf stays allowed: a class of probability 0, against the closed form.
    masked = jnp.array([[[-jnp.inf, 0.0], [0.0, 0.0]]])
    np.testing.assert_allclose(
        ee.metrics.nll(masked, jnp.array([1, 1]), from_logits=True),
        np.log(2) / 2,  # example 0: p = 1; example 1: p = 1/2
        rtol=1e-6,
    )


def test_fit_temperature_refuses_nonpositive_iterations():
    logits = jnp.zeros((2, 4, 3))
    labels = jnp.array([0, 1, 2, 0])
    with pytest.raises(ValueError, match="`iterations` must be between 1"):
        ee.metrics.fit_temperature(logits, labels, iterations=-5)


def test_regression_metrics_refuse_nan_predictions():
    means = jnp.zeros((2, 4)).at[1, 2].set(jnp.nan)
    with pytest.raises(ValueError, match=r"`means` .* holds nan at index \(1, 2\)"):
        ee.metrics.rmse(means, jnp.zeros(4))
    with pytest.raises(ValueError, match="`targets`.* holds inf"):
        ee.metrics.rmse(jnp.zeros((2, 4)), jnp.array([0.0, jnp.inf, 0.0, 0.0]))


def test_regression_metrics_take_one_output_axis():
    # What `eqx.nn.MLP(out_size=1)` returns: (members, batch, 1).
    means = jax.random.normal(jax.random.key(0), (3, 6, 1))
    variances = jnp.full((3, 6, 1), 0.5)
    targets = jax.random.normal(jax.random.key(1), (6,))
    np.testing.assert_allclose(
        ee.metrics.rmse(means, targets), ee.metrics.rmse(means[..., 0], targets)
    )
    np.testing.assert_allclose(
        ee.metrics.gaussian_nll(means, variances, targets[:, None]),
        ee.metrics.gaussian_nll(means[..., 0], variances[..., 0], targets),
    )
    # Several outputs are accepted (tests/test_metrics_multi_output.py); targets
    # must then carry the output axis too, and the message says so.
    with pytest.raises(ValueError, match=r"\(batch, outputs\) = \(6, 2\)"):
        ee.metrics.rmse(jnp.zeros((3, 6, 2)), targets)


# ------------------------------------------------ exact and float32 computation


def test_pairwise_disagreement_has_an_exact_zero_diagonal():
    probs = jax.nn.softmax(jax.random.normal(jax.random.key(1), (5, 97, 7)), -1)
    matrix = np.asarray(ee.metrics.pairwise_disagreement(probs))
    assert (np.diag(matrix) == 0).all()
    np.testing.assert_array_equal(matrix, matrix.T)
    votes = np.asarray(jnp.argmax(probs, -1))
    expected = (votes[:, None, :] != votes[None, :, :]).mean(-1)
    np.testing.assert_allclose(matrix, expected, rtol=1e-6)


def test_metrics_of_bfloat16_predictions_are_computed_in_float32():
    from sklearn.metrics import accuracy_score

    rng = np.random.default_rng(0)
    n = 497
    labels = rng.integers(0, 2, n)
    # Two classes, confidences exact in bfloat16 (and summing to exactly 1), so
    # the same values held in float32 are an exact reference.
    confidence = rng.choice([0.5625, 0.625, 0.75, 0.875, 0.9375], size=(2, n))
    right = rng.permutation(n) < 468  # 468 of 497 right (0.9453 in bfloat16)
    top = np.where(right, labels, 1 - labels)
    probs = np.empty((2, n, 2), np.float32)
    probs[:, np.arange(n), top] = confidence
    probs[:, np.arange(n), 1 - top] = 1 - confidence
    narrow = jnp.asarray(probs, jnp.bfloat16)
    wide = jnp.asarray(probs)
    assert (np.asarray(narrow.astype(jnp.float32)) == probs).all()
    exact = accuracy_score(labels, probs.mean(0).argmax(-1))
    assert exact == pytest.approx(468 / 497)
    assert float(ee.metrics.accuracy(narrow, labels)) == pytest.approx(exact, abs=1e-6)
    for metric in (
        ee.metrics.expected_calibration_error,
        ee.metrics.nll,
        ee.metrics.brier_score,
    ):
        value = metric(narrow, labels)
        assert value.dtype == jnp.float32, metric
        assert float(value) == pytest.approx(float(metric(wide, labels)), abs=1e-6)
