"""Split conformal regression: coverage at the nominal level over many random
splits (within the binomial tolerance), the finite-sample quantile by hand, and
clear errors."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import repeat

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


@pytest.mark.parametrize("alpha", [0.1, repeat(0.3)])
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
    # A NumPy scalar level (e.g. from `np.linspace`) is the same level, as in
    # the time-series methods (one `check_alpha`); a bool is no level.
    numpy_level = ee.conformal.split_regression(
        means, variances, targets, alpha=np.float64(0.2)
    )
    assert numpy_level.quantile == 8.0
    with pytest.raises(TypeError, match="`alpha` must be a float|parameter 'alpha'"):
        ee.conformal.split_regression(means, variances, targets, alpha=True)


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


# --- Classification sets: APS and RAPS ------------------------------------------


def _classification(seed, n, classes=6, members=4):
    """Labels drawn from true probabilities; an imperfect ensemble of them."""
    rng = np.random.default_rng(seed)
    true = rng.dirichlet(np.full(classes, 0.5), size=n)
    labels = np.array([rng.choice(classes, p=p) for p in true])
    logits = np.log(true + 1e-6)[None] + 0.7 * rng.standard_normal(
        (members, n, classes)
    )
    return jnp.asarray(logits, jnp.float32), jnp.asarray(labels, jnp.int32)


@pytest.mark.parametrize(
    "method", ["aps", "aps-deterministic", "raps"], ids=lambda m: m
)
def test_prediction_sets_cover_at_the_nominal_level(method):
    alpha, calibration, test, seeds = 0.1, 300, 700, 40
    coverages, sizes = [], []
    for seed in range(seeds):
        logits, labels = _classification(seed, calibration + test)
        key_cal, key_test = jax.random.split(jax.random.key(seed))
        randomized = method != "aps-deterministic"
        kwargs = dict(alpha=alpha, from_logits=True, randomized=randomized)
        if randomized:
            kwargs["key"] = key_cal
        if method == "raps":
            calibrated = ee.conformal.raps(
                logits[:, :calibration],
                labels[:calibration],
                penalty=0.05,
                k_reg=2,
                **kwargs,
            )
        else:
            calibrated = ee.conformal.aps(
                logits[:, :calibration], labels[:calibration], **kwargs
            )
        sets = calibrated.sets(
            logits[:, calibration:],
            from_logits=True,
            key=key_test if randomized else None,
        )
        covered = sets[jnp.arange(test), labels[calibration:]]
        coverages.append(float(jnp.mean(covered)))
        sizes.append(float(jnp.mean(sets.sum(-1))))
    mean = float(np.mean(coverages))
    tolerance = 4 * math.sqrt(
        alpha * (1 - alpha) * (1 / test + 1 / calibration) / seeds
    )
    assert mean >= 1 - alpha - tolerance
    if method != "aps-deterministic":  # exact: also at most 1 - a + 1/(n+1)
        assert mean <= 1 - alpha + 1 / (calibration + 1) + tolerance
    assert 1 < np.mean(sizes) < 6  # informative: neither singletons nor everything


def test_set_scores_and_sets_follow_the_papers_rule_by_hand():
    probs = jnp.array([[[0.5, 0.3, 0.2], [0.1, 0.6, 0.3]]])  # 1 member, 2 examples
    labels = jnp.array([1, 2])
    key = jax.random.key(7)
    u = np.asarray(jax.random.uniform(key, (2,)))
    # APS: mass of the classes ranked above the label, plus u times its own.
    aps_scores = [0.5 + u[0] * 0.3, 0.6 + u[1] * 0.3]
    # RAPS: plus penalty * max(0, rank - k_reg) (rank 1 = most probable).
    raps_scores = [aps_scores[0] + 0.1 * (2 - 1), aps_scores[1] + 0.1 * (2 - 1)]
    for scores, calibrate in [
        (aps_scores, lambda: ee.conformal.aps(probs, labels, alpha=0.5, key=key)),
        (
            raps_scores,
            lambda: ee.conformal.raps(
                probs, labels, alpha=0.5, penalty=0.1, k_reg=1, key=key
            ),
        ),
    ]:
        calibrated = calibrate()
        # rank ceil(3 * 0.5) = 2 of 2 scores: the larger one.
        assert calibrated.quantile == pytest.approx(max(scores), rel=1e-6)
    # The sets: every class whose score is at most the threshold, by a NumPy loop.
    rng = np.random.default_rng(0)
    new = rng.dirichlet(np.ones(5), size=(1, 30)).astype(np.float32)
    calibrated = ee.conformal.raps(
        jnp.asarray(new),
        jnp.zeros(30, jnp.int32),
        alpha=0.2,
        penalty=0.05,
        k_reg=1,
        key=key,
    )
    sets = np.asarray(calibrated.sets(jnp.asarray(new), key=jax.random.key(3)))
    u = np.asarray(jax.random.uniform(jax.random.key(3), (30,)))
    for i in range(30):
        p = new[0, i]
        order = np.argsort(-p, kind="stable")
        for rank, c in enumerate(order):
            score = p[order[:rank]].sum() + u[i] * p[c] + 0.05 * max(0, rank + 1 - 1)
            assert (
                sets[i, c] == (score <= calibrated.quantile + 1e-6)
                or abs(score - calibrated.quantile) < 1e-5
            )


def test_prediction_set_errors():
    logits, labels = _classification(0, 50)
    with pytest.raises(ValueError, match="need `key=`"):
        ee.conformal.aps(logits, labels, alpha=0.1, from_logits=True)
    with pytest.raises(ValueError, match="smallest possible is 1 / \\(n \\+ 1\\)"):
        ee.conformal.aps(logits, labels, alpha=0.01, from_logits=True, randomized=False)
    calibrated = ee.conformal.aps(
        logits, labels, alpha=0.2, from_logits=True, randomized=False
    )
    with pytest.raises(ValueError, match="3 members but the calibration had 4"):
        calibrated.sets(logits[:3], from_logits=True)
    probs = jax.nn.softmax(logits, axis=-1).at[1, 7, 0].add(0.2)
    with pytest.raises(ValueError, match="member 1, example 7"):
        ee.conformal.aps(probs, labels, alpha=0.2, randomized=False)
    with pytest.raises(ValueError, match="`penalty` must be"):
        ee.conformal.raps(
            logits, labels, alpha=0.2, penalty=-1.0, from_logits=True, randomized=False
        )


# --- Conformalized quantile regression ------------------------------------------


def test_cqr_covers_and_uses_the_papers_score():
    alpha, calibration, test, seeds = 0.1, 200, 500, 100
    coverages = []
    for seed in range(seeds):
        means, variances, y = _heteroscedastic(seed, calibration + test)
        mean, variance = ee.combine.gaussian_mixture(means, variances)
        std = jnp.sqrt(variance)
        lower, upper = mean - std, mean + std  # too narrow for 90%
        calibrated = ee.conformal.cqr(
            lower[:calibration], upper[:calibration], y[:calibration], alpha=alpha
        )
        new_lower, new_upper = calibrated.interval(
            lower[calibration:], upper[calibration:]
        )
        inside = (y[calibration:] >= new_lower) & (y[calibration:] <= new_upper)
        coverages.append(float(jnp.mean(inside)))
    tolerance = 4 * math.sqrt(
        alpha * (1 - alpha) * (1 / test + 1 / calibration) / seeds
    )
    mean = float(np.mean(coverages))
    assert 1 - alpha - tolerance <= mean <= 1 - alpha + 1 / 201 + tolerance
    # The quantile by hand: the ceil(11 * 0.9) = 10th smallest of the 10 scores.
    lower, upper = jnp.zeros(10), jnp.ones(10)
    y = jnp.linspace(-1.0, 2.0, 10)
    scores = np.maximum(0 - np.asarray(y), np.asarray(y) - 1)
    calibrated = ee.conformal.cqr(lower, upper, y, alpha=0.1)
    assert calibrated.quantile == pytest.approx(np.sort(scores)[9])


# --- Jackknife+-after-bootstrap -------------------------------------------------


def _bootstrap_members(x, y, counts, degree=3):
    """Polynomial least squares on each member's resample (weights = counts)."""
    features = np.vander(x, degree + 1)
    coefficients = []
    for weights in np.asarray(counts, np.float64):
        w = np.sqrt(weights)[:, None]
        coef, *_ = np.linalg.lstsq(features * w, y * w[:, 0], rcond=None)
        coefficients.append(coef)
    return lambda new_x: np.stack(
        [np.vander(new_x, degree + 1) @ c for c in coefficients]
    )


def _jab_by_hand(train_means, y, counts, test_means, alpha):
    n = y.shape[0]
    lows, highs = [], []
    for i in range(n):
        oob = counts[:, i] == 0
        if not oob.any():
            continue
        mu_train = train_means[oob, i].mean()
        residual = abs(y[i] - mu_train)
        mu_test = test_means[oob].mean(axis=0)
        lows.append(mu_test - residual)
        highs.append(mu_test + residual)
    lows, highs = np.sort(np.array(lows), axis=0), np.sort(np.array(highs), axis=0)
    kept = len(lows)
    return (
        lows[math.floor(alpha * (kept + 1)) - 1],
        highs[math.ceil((1 - alpha) * (kept + 1)) - 1],
    )


def test_jackknife_plus_after_bootstrap_covers_and_matches_the_papers_formula():
    alpha, n, test, members, seeds = 0.1, 150, 400, 20, 30
    coverages = []
    for seed in range(seeds):
        rng = np.random.default_rng(seed)
        x = rng.uniform(-3, 3, n + test)
        y = np.sin(x) + (0.2 + 0.3 * np.abs(x)) * rng.standard_normal(n + test)
        counts = np.asarray(
            ee.Bootstrap().in_bag(jax.random.key(seed), size=members, num_examples=n)
        )
        predict = _bootstrap_members(x[:n], y[:n], counts)
        train_means, test_means = predict(x[:n]), predict(x[n:])
        jab = ee.conformal.jackknife_plus_after_bootstrap(
            jnp.asarray(train_means, jnp.float32),
            jnp.asarray(y[:n], jnp.float32),
            alpha=alpha,
            in_bag=counts,
        )
        lower, upper = jab.interval(jnp.asarray(test_means, jnp.float32))
        if seed < 3:
            hand_lower, hand_upper = _jab_by_hand(
                train_means, y[:n], counts, test_means, alpha
            )
            np.testing.assert_allclose(lower, hand_lower, rtol=1e-4, atol=1e-4)
            np.testing.assert_allclose(upper, hand_upper, rtol=1e-4, atol=1e-4)
        coverages.append(np.mean((y[n:] >= lower) & (y[n:] <= upper)))
    mean = float(np.mean(coverages))
    tolerance = 4 * math.sqrt(alpha * (1 - alpha) * (1 / test + 1 / n) / seeds)
    assert mean >= 1 - alpha - tolerance, mean
    assert mean <= 1 - alpha + 0.06, mean  # not trivially wide


def test_jackknife_from_a_bootstrap_run_rebuilds_its_resamples(getkey):
    import equinox as eqx
    import optax

    x = jnp.linspace(-2, 2, 40)[:, None]
    y = jnp.sin(x[:, 0])

    def loss(model, batch, key):
        xs, ys = batch
        return jnp.mean((jax.vmap(model)(xs)[:, 0] - ys) ** 2)

    ens = ee.ensemble(lambda k: eqx.nn.MLP(1, 1, 8, 1, key=k), size=6, key=getkey())
    run = ee.fit(
        ens,
        loss,
        optax.adam(1e-2),
        (x, y),
        steps=20,
        batch_size=8,
        key=getkey(),
        sampling=ee.Bootstrap(),
        callbacks=(),
    )
    train_means = ee.predict(run.ensemble, x)
    from_run = ee.conformal.jackknife_plus_after_bootstrap(
        train_means, y, alpha=0.2, run=run
    )
    counts = ee.Bootstrap().in_bag(run.key, size=6, num_examples=40)
    by_hand = ee.conformal.jackknife_plus_after_bootstrap(
        train_means, y, alpha=0.2, in_bag=counts
    )
    assert jnp.array_equal(from_run.weights, by_hand.weights)
    assert from_run.excluded == int(np.sum(np.all(np.asarray(counts) > 0, axis=0)))
    shared_run = ee.fit(
        ens,
        loss,
        optax.adam(1e-2),
        (x, y),
        steps=2,
        batch_size=8,
        key=getkey(),
        callbacks=(),
    )
    with pytest.raises(ValueError, match="not bootstrapped|bootstrapped run"):
        ee.conformal.jackknife_plus_after_bootstrap(
            train_means, y, alpha=0.2, run=shared_run
        )
    with pytest.raises(ValueError, match="exactly one of"):
        ee.conformal.jackknife_plus_after_bootstrap(train_means, y, alpha=0.2)
    with pytest.raises(ValueError, match="too small"):
        ee.conformal.jackknife_plus_after_bootstrap(
            train_means, y, alpha=0.01, in_bag=counts
        )
    with pytest.raises(ValueError, match="has 5 members but the run had 6"):
        from_run.interval(train_means[:5])


def test_sets_with_64_bit_floats_cover_the_calibration_rank():
    """With `jax_enable_x64` the uniforms and so the scores are float64
    while the predictions are float32: the threshold is compared in the
    scores' precision (rounded to float32 it dropped a calibration example
    whose score equals it). The calibration data's own sets then cover at
    least the conformal rank of its examples, for every seed."""
    members, batch, classes = 4, 500, 10
    rank = math.ceil((batch + 1) * 0.9 - 1e-9)
    with jax.enable_x64(True):
        for seed in range(6):
            logits = 2 * jax.random.normal(
                jax.random.key(seed), (members, batch, classes), jnp.float32
            )
            probs = jax.nn.softmax(logits, -1)
            labels = jax.random.randint(
                jax.random.key(seed + 100), (batch,), 0, classes
            )
            key = jax.random.key(seed + 200)
            calibrated = ee.conformal.aps(probs, labels, alpha=0.1, key=key)
            sets = np.asarray(calibrated.sets(probs, key=key))
            covered = int(sets[np.arange(batch), np.asarray(labels)].sum())
            assert covered >= rank, (seed, covered, rank)


# ------------------------------- one rank rule; deterministic sets never empty


def test_split_regression_and_sets_use_the_same_rank():
    # n = 149, alpha = 0.18: (n + 1)(1 - alpha) = 123 exactly; in floating point
    # 150 * 0.82 is 123.00000000000001, whose ceiling is 124.
    n, alpha = 149, 0.18
    assert math.ceil((n + 1) * (1 - alpha)) == 124  # the float trap
    scores = np.arange(1, n + 1, dtype=np.float32)  # |y - mean| / std = i
    means = np.zeros((1, n), np.float32)
    variances = np.ones((1, n), np.float32)
    calibrated = ee.conformal.split_regression(means, variances, scores, alpha=alpha)
    assert calibrated.quantile == 123.0  # the 123rd smallest score


@pytest.mark.parametrize("method", ["aps", "raps"])
def test_deterministic_sets_are_never_empty(method):
    key = jax.random.key(0)
    # Confident predictions: the top probability is above any low quantile.
    logits = 6.0 * jax.random.normal(key, (3, 400, 6))
    labels = jnp.argmax(logits.mean(0), axis=-1)
    calibrate = getattr(ee.conformal, method)
    calibrated = calibrate(
        logits[:, :200], labels[:200], alpha=0.3, from_logits=True, randomized=False
    )
    sets = np.asarray(calibrated.sets(logits[:, 200:], from_logits=True))
    assert sets.sum(axis=1).min() >= 1
    # The class that crosses the threshold is the only one added: the set is the
    # prefix of classes (by the ensemble's probability) up to it.
    probs = np.asarray(jax.nn.softmax(logits[:, 200:], axis=-1).mean(0))
    order = np.argsort(-probs, axis=1, kind="stable")
    sizes = sets.sum(axis=1)
    for row in range(sets.shape[0]):
        assert set(np.flatnonzero(sets[row])) == set(order[row, : sizes[row]])
