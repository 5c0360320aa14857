"""Time-series conformal prediction (EnbPI, adaptive conformal inference) against
MAPIE's `TimeSeriesRegressor` on the same members and resamples, and against
Gibbs & Candes's coverage bound; the block bootstrap that feeds them."""

import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import eqx_ensemble as ee

mapie_regression = pytest.importorskip("mapie.regression")
mapie_subsample = pytest.importorskip("mapie.subsample")
linear_model = pytest.importorskip("sklearn.linear_model")


def _series(T=320, train=200):
    """A seasonal series with a trend whose noise triples after step 240 (a
    shift the training residuals never saw)."""
    rng = np.random.default_rng(0)
    t = np.arange(T)
    noise = rng.normal(size=T) * 0.3 * (1 + 2.0 * (t > 240))
    y = np.sin(t / 10) + 0.01 * t + noise
    x = np.stack([np.sin(t / 10), t / 100, np.cos(t / 7)], axis=1)
    return x[:train], y[:train], x[train:], y[train:]


def _mapie(method):
    """MAPIE fitted on the series with 20 ridge regressions on non-overlapping
    block-bootstrap resamples, and the same members for the library: their
    predictions, float32, and in-bag counts from MAPIE's out-of-bag mask."""
    x_train, y_train, x_test, y_test = _series()
    mapie = mapie_regression.TimeSeriesRegressor(
        linear_model.Ridge(),
        method=method,
        cv=mapie_subsample.BlockBootstrap(
            n_resamplings=20, length=10, overlapping=False, random_state=0
        ),
        agg_function="mean",
    )
    mapie.fit(x_train, y_train)
    members = mapie.estimator_.estimators_
    out_of_bag = np.nan_to_num(mapie.estimator_.k_) == 1  # (n, members)
    in_bag = (~out_of_bag).T.astype(np.int32)
    train_means = np.stack([m.predict(x_train) for m in members])
    test_means = np.stack([m.predict(x_test) for m in members])
    calibrated = ee.conformal.enbpi(
        jnp.asarray(train_means, jnp.float32),
        jnp.asarray(y_train, jnp.float32),
        alpha=0.1,
        in_bag=in_bag,
    )
    assert calibrated.excluded == 0  # MAPIE keeps such examples as NaN scores
    return mapie, members, calibrated, x_test, y_test, test_means


def test_enbpi_matches_mapie_intervals_and_sliding_window():
    mapie, _, calibrated, x_test, y_test, test_means = _mapie("enbpi")
    np.testing.assert_allclose(
        calibrated.residuals, mapie.conformity_scores_, rtol=0, atol=1e-5
    )
    means = jnp.asarray(test_means, jnp.float32)
    for optimize_beta in (False, True):
        centre, bounds = mapie.predict(
            x_test, ensemble=True, confidence_level=0.9, optimize_beta=optimize_beta
        )
        lower, upper = calibrated.interval(means, optimize_beta=optimize_beta)
        np.testing.assert_allclose(calibrated.predict(means), centre, atol=1e-5)
        np.testing.assert_allclose(lower, bounds[:, 0, 0], atol=1e-5)
        np.testing.assert_allclose(upper, bounds[:, 1, 0], atol=1e-5)
    # One step at a time: predict, then slide the window with the observation.
    lowers, uppers = [], []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # MAPIE's notice on `update`
        for t in range(len(y_test)):
            _, bounds = mapie.predict(
                x_test[t : t + 1], ensemble=True, confidence_level=0.9
            )
            lowers.append(bounds[0, 0, 0])
            uppers.append(bounds[0, 1, 0])
            mapie.update(x_test[t : t + 1], y_test[t : t + 1], ensemble=True)
    online = ee.conformal.sequential(calibrated, means, jnp.asarray(y_test, "f4"))
    np.testing.assert_allclose(online.lower, lowers, atol=1e-5)
    np.testing.assert_allclose(online.upper, uppers, atol=1e-5)
    np.testing.assert_allclose(
        online.calibrated.residuals, mapie.conformity_scores_, atol=1e-5
    )
    assert np.all(np.asarray(online.alpha) == np.float32(0.1))
    # The same window, slid by hand in one batch.
    by_batch = calibrated.update(means, jnp.asarray(y_test, jnp.float32))
    np.testing.assert_allclose(
        by_batch.residuals, online.calibrated.residuals, atol=1e-6
    )


def test_adaptive_conformal_inference_matches_mapie():
    """MAPIE's ACI centres its intervals on one model fitted to all the data; we
    hand it the EnbPI centre instead, so both make the same intervals and the
    level follows the same rule. gamma is small enough that MAPIE's clipping of
    the level to [0, 1] never acts (checked)."""
    mapie, members, calibrated, x_test, y_test, test_means = _mapie("aci")
    weights = np.asarray(calibrated.weights, np.float64)

    class Centre:
        def predict(self, x):
            return weights @ np.stack([m.predict(x) for m in members])

    mapie.estimator_.single_estimator_ = Centre()
    gamma = 0.005
    lowers, uppers, alphas = [], [], []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for t in range(len(y_test)):
            x, y = x_test[t : t + 1], y_test[t : t + 1]
            _, bounds = mapie.predict(
                x, ensemble=True, confidence_level=0.9, allow_infinite_bounds=True
            )
            alphas.append(getattr(mapie, "current_alpha", {0.1: 0.1})[0.1])
            lowers.append(bounds[0, 0, 0])
            uppers.append(bounds[0, 1, 0])
            mapie.adapt_conformal_inference(
                x, y, gamma=gamma, confidence_level=0.9, ensemble=True
            )
            mapie.update(x, y, ensemble=True)
    assert 0 < min(alphas) < 0.1 < max(alphas) < 1  # it adapted, never clipped
    online = ee.conformal.sequential(
        calibrated,
        jnp.asarray(test_means, jnp.float32),
        jnp.asarray(y_test, jnp.float32),
        gamma=gamma,
    )
    np.testing.assert_allclose(online.alpha, alphas, atol=1e-6)
    np.testing.assert_allclose(online.lower, lowers, atol=1e-5)
    np.testing.assert_allclose(online.upper, uppers, atol=1e-5)
    # In two calls, the second going on from the first's window and level.
    means, targets = jnp.asarray(test_means, "f4"), jnp.asarray(y_test, "f4")
    first = ee.conformal.sequential(
        calibrated, means[:, :70], targets[:70], gamma=gamma
    )
    second = ee.conformal.sequential(
        first.calibrated,
        means[:, 70:],
        targets[70:],
        gamma=gamma,
        start_alpha=first.next_alpha,
    )
    np.testing.assert_allclose(
        jnp.concatenate([first.upper, second.upper]), online.upper, atol=1e-6
    )
    np.testing.assert_allclose(second.next_alpha, online.next_alpha, atol=1e-6)


def test_aci_keeps_the_long_run_miss_rate_on_a_shifting_series():
    """Gibbs & Candes (2021), Prop. 4.1: for any series, the miss rate over T
    steps is within (max(alpha_1, 1 - alpha_1) + gamma) / (gamma T) of alpha.
    Plain EnbPI with the training residuals misses far more after the shift."""
    key_means, key_targets, key_train = jax.random.split(jax.random.key(0), 3)
    members, n, T, alpha, gamma = 10, 200, 2000, 0.1, 0.05
    centre = jnp.sin(jnp.arange(n + T, dtype=jnp.float32) / 20)
    means = centre[None] + 0.05 * jax.random.normal(key_means, (members, n + T))
    scale = jnp.where(jnp.arange(n + T) < n + T // 4, 0.2, 1.0)  # the shift
    targets = centre + scale * jax.random.normal(key_targets, (n + T,))
    counts = ee.Bootstrap(block_length=5).in_bag(
        key_train, size=members, num_examples=n
    )
    calibrated = ee.conformal.enbpi(
        means[:, :n], targets[:n], alpha=alpha, in_bag=counts
    )
    with pytest.warns(ee.conformal.UnboundedIntervalWarning) as caught:
        adaptive = ee.conformal.sequential(
            calibrated, means[:, n:], targets[n:], gamma=gamma
        )
    unbounded = ~(np.isfinite(adaptive.lower) & np.isfinite(adaptive.upper))
    assert f"{int(unbounded.sum())} of {T} intervals" in str(caught[0].message)
    miss = 1 - float(jnp.mean(adaptive.covered))
    assert abs(miss - alpha) <= (1 - alpha + gamma) / (gamma * T)
    fixed = ee.conformal.sequential(calibrated, means[:, n:], targets[n:], update=False)
    assert 1 - float(jnp.mean(fixed.covered)) > 0.4
    # Below 0 the level gives the whole line; it went there after the shift.
    infinite = np.asarray(adaptive.alpha) < 0
    assert infinite.any()
    assert np.all(np.isinf(np.asarray(adaptive.lower)[infinite]))
    assert np.all(np.asarray(adaptive.covered)[infinite])


def test_enbpi_from_a_block_bootstrapped_fit():
    """`run=` rebuilds the run's block resamples; a run that was not
    bootstrapped, bad shapes and levels are refused by name."""
    t = jnp.arange(120, dtype=jnp.float32)
    x = jnp.stack([jnp.sin(t / 8), jnp.cos(t / 8)], axis=1)
    y = jnp.sin(t / 8 + 0.3) + 0.1 * jax.random.normal(jax.random.key(0), (120,))

    def loss(model, batch, key):
        xs, ys = batch
        return jnp.mean((jax.vmap(model)(xs) - ys) ** 2)

    ens = ee.ensemble(
        lambda k: eqx.nn.Linear(2, "scalar", key=k), size=8, key=jax.random.key(1)
    )
    sampling = ee.Bootstrap(block_length=6)
    run = ee.fit(ens, loss, optax.adam(5e-2), (x, y), steps=60, batch_size=16,
                 key=jax.random.key(2), sampling=sampling, callbacks=())  # fmt: skip
    assert run.sampling == sampling
    train_means = ee.predict(run.ensemble, x)
    from_run = ee.conformal.enbpi(train_means, y, alpha=0.2, run=run)
    counts = sampling.in_bag(run.key, size=8, num_examples=120)
    by_hand = ee.conformal.enbpi(train_means, y, alpha=0.2, in_bag=counts)
    assert jnp.array_equal(from_run.residuals, by_hand.residuals)
    assert jnp.array_equal(from_run.weights, by_hand.weights)
    lower, upper = from_run.interval(train_means[:, :5])
    assert bool(jnp.all(lower < upper))

    with pytest.raises(ValueError, match="bootstrapped run"):
        shared = ee.fit(ens, loss, optax.adam(5e-2), (x, y), steps=2,
                        batch_size=16, key=jax.random.key(2), callbacks=())  # fmt: skip
        ee.conformal.enbpi(train_means, y, alpha=0.2, run=shared)
    with pytest.raises(ValueError, match="exactly one of"):
        ee.conformal.enbpi(train_means, y, alpha=0.2)
    with pytest.raises(ValueError, match="too small"):
        ee.conformal.enbpi(train_means, y, alpha=0.01, in_bag=counts)
    with pytest.raises(ValueError, match="has 7 members but the run had 8"):
        from_run.interval(train_means[:7])
    with pytest.raises(ValueError, match="more than the window"):
        from_run.update(jnp.zeros((8, 200)), jnp.zeros(200))
    with pytest.raises((TypeError, ValueError), match="targets"):
        from_run.update(train_means[:, :3], jnp.zeros(4))
    with pytest.raises(TypeError, match="Python float"):
        from_run.interval(train_means, alpha=jnp.float32(0.2), optimize_beta=True)
    with pytest.raises((TypeError, ValueError), match="EnbPI"):
        ee.conformal.sequential(by_hand.residuals, train_means, y)  # type: ignore
    with pytest.raises(ValueError, match="gamma"):
        ee.conformal.sequential(from_run, train_means, y, gamma=-0.1)


def test_block_bootstrap_follows_its_recipe():
    key, size, n, length = jax.random.key(3), 3, 23, 5
    bootstrap_key = jax.random.split(key, 3)[1]  # the key `fit` draws from
    counts = np.asarray(
        ee.Bootstrap(block_length=length).in_bag(key, size=size, num_examples=n)
    )
    for i, member_key in enumerate(jax.random.split(bootstrap_key, size)):
        starts = np.asarray(jax.random.randint(member_key, (5,), 0, n - length + 1))
        resample = (starts[:, None] + np.arange(length)).reshape(-1)[:n]
        np.testing.assert_array_equal(counts[i], np.bincount(resample, minlength=n))
    assert counts.sum(axis=1).tolist() == [n] * size
    # A block length of 1 is the ordinary bootstrap, bit for bit.
    np.testing.assert_array_equal(
        ee.Bootstrap(block_length=1).in_bag(key, size=size, num_examples=n),
        ee.Bootstrap().in_bag(key, size=size, num_examples=n),
    )
    with pytest.raises(ValueError, match="longer than the data"):
        ee.Bootstrap(block_length=30).in_bag(key, size=size, num_examples=n)
    with pytest.raises((TypeError, ValueError), match="block_length"):
        ee.Bootstrap(block_length=0)
    with pytest.raises((TypeError, ValueError), match="block_length"):
        ee.Bootstrap(block_length=2.5)  # type: ignore[arg-type]


def test_a_checkpoint_remembers_the_block_length(tmp_path):
    """A run resumed with another block length is refused (its resamples would
    differ), and `Checkpoints.latest` gives back the block bootstrap."""
    x = jnp.linspace(0, 1, 40)[:, None]
    ens = ee.ensemble(lambda k: eqx.nn.Linear(1, 1, key=k), size=2,
                      key=jax.random.key(0))  # fmt: skip

    def loss(model, batch, key):
        return jnp.mean((jax.vmap(model)(batch) - 2 * batch) ** 2)

    def run(sampling, steps):
        return ee.fit(ens, loss, optax.sgd(0.1), x, steps=steps, batch_size=8,
                      key=jax.random.key(1), sampling=sampling,
                      checkpoints=ee.Checkpoints(tmp_path, every=2),
                      callbacks=())  # fmt: skip

    run(ee.Bootstrap(block_length=4), 2)
    latest = ee.Checkpoints(tmp_path).latest(ens, optax.sgd(0.1))
    assert latest is not None and latest.sampling == ee.Bootstrap(block_length=4)
    with pytest.raises(Exception, match="different `sampling`"):
        run(ee.Bootstrap(block_length=3), 4)


def _calibrated(members, n, alpha):
    """EnbPI on random predictions, members 1.. out of bag of every example."""
    counts = jnp.zeros((members, n), jnp.int32).at[0].set(1)
    return ee.conformal.enbpi(
        jax.random.normal(jax.random.key(0), (members, n)),
        jax.random.normal(jax.random.key(1), (n,)),
        alpha=alpha,
        in_bag=counts,
    )


def test_a_traced_level_gives_the_python_levels_interval():
    """`sequential` makes its intervals at a traced (float32) level: its ranks
    equal `interval`'s at the same Python level for every window size up to
    5000 (float32 rounding puts `(1 - alpha / 2)(n + 1)` a hair above whole
    numbers such as 27 at alpha = 0.2, n = 29: that must not move the rank),
    and so do the intervals at alpha = 0.2, n = 29."""
    from eqx_ensemble._metrics.time_series import _concrete_ranks, _traced_ranks

    sizes = np.arange(5, 5001)
    random = np.random.default_rng(0).uniform(0.01, 0.5, 20)
    for alpha in (0.02, 0.05, 0.06, 0.1, 0.2, 0.3, 0.45, 0.099999, *random):
        low, high = _traced_ranks(jnp.float32(alpha), jnp.asarray(sizes, "f4"))
        expected = np.array([_concrete_ranks(alpha, alpha / 2, int(n)) for n in sizes])
        # (A rank within float32's resolution of a whole number, without
        # being one, cannot be told apart from a float32 level.)
        x = alpha / 2 * (sizes + 1)
        distinct = np.abs(x - np.round(x)) > 2e-7 * x
        distinct |= np.isclose(x, np.round(x), rtol=1e-12, atol=0)
        for got, want in ((low, expected[:, 0]), (high, expected[:, 1])):
            np.testing.assert_array_equal(
                np.asarray(got)[distinct], want[distinct], str(alpha)
            )
    calibrated = _calibrated(members=4, n=29, alpha=0.2)
    means = jnp.zeros((4, 1))
    traced = jax.jit(lambda a: calibrated.interval(means, alpha=a))(jnp.float32(0.2))
    expected = calibrated.interval(means)
    assert jnp.array_equal(traced[0], expected[0])
    assert jnp.array_equal(traced[1], expected[1])
    online = ee.conformal.sequential(calibrated, means, jnp.zeros(1))
    assert jnp.array_equal(online.upper, expected[1])


def test_a_traced_level_near_a_rank_keeps_the_python_levels_interval():
    # 999 residuals, alpha 0.099999: the lower rank is 49 (49.9995); an
    # absolute nudge made it 50, intervals 0.0133 apart.
    calibrated = _calibrated(members=3, n=999, alpha=0.1)
    means = jnp.zeros((3, 1))
    python = calibrated.interval(means, alpha=0.099999)
    traced = jax.jit(lambda a: calibrated.interval(means, alpha=a))(
        jnp.float32(0.099999)
    )
    assert jnp.array_equal(python[0], traced[0])
    assert jnp.array_equal(python[1], traced[1])


def test_levels_outside_zero_one_and_bad_values():
    counts = jnp.zeros((3, 50), jnp.int32).at[0].set(1)
    calibrated = ee.conformal.enbpi(
        jax.random.normal(jax.random.key(0), (3, 50)),
        jax.random.normal(jax.random.key(1), (50,)),
        alpha=0.2,
        in_bag=counts,
    )
    means = jnp.zeros((3, 2))
    for level, (low, high) in {1.0: (jnp.inf, -jnp.inf), 1.3: (jnp.inf, -jnp.inf),
                               -0.1: (-jnp.inf, jnp.inf)}.items():  # fmt: skip
        lower, upper = calibrated.interval(means, alpha=jnp.float32(level))
        assert bool(jnp.all(lower == low)) and bool(jnp.all(upper == high)), level
    # Half-precision predictions with float32 targets (strict promotion).
    half = calibrated.update(means.astype(jnp.bfloat16), jnp.array([1.0, 2.0]))
    full = calibrated.update(means, jnp.array([1.0, 2.0]))
    assert jnp.array_equal(half.residuals, full.residuals)
    # np.float32 levels are numbers like any other.
    np.testing.assert_array_equal(
        calibrated.interval(means, alpha=np.float32(0.25))[1],
        calibrated.interval(means, alpha=0.25)[1],
    )
    bad = jax.random.normal(jax.random.key(0), (3, 50)).at[1, 7].set(jnp.nan)
    with pytest.raises(ValueError, match=r"`train_means` holds 1 non-finite"):
        ee.conformal.enbpi(bad, jnp.zeros(50), alpha=0.2, in_bag=counts)
    with pytest.raises(ValueError, match="`targets` holds"):
        ee.conformal.sequential(calibrated, means, jnp.array([0.0, jnp.inf]))
    with pytest.raises(ValueError, match="`targets` holds"):
        calibrated.update(means, jnp.array([0.0, jnp.nan]))
    # A NaN prediction: refused, not NaN bounds or a NaN in the window.
    nan_means = means.at[1, 0].set(jnp.nan)
    with pytest.raises(ValueError, match="`means` holds 1 non-finite"):
        calibrated.update(nan_means, jnp.array([0.0, 1.0]))
    with pytest.raises(ValueError, match="`means` holds 1 non-finite"):
        calibrated.interval(nan_means)
    # Half-precision means give float32 bounds, as float32 means would.
    lower, upper = calibrated.interval(means.astype(jnp.bfloat16))
    assert lower.dtype == upper.dtype == jnp.float32
    with pytest.raises(TypeError, match="update"):
        ee.conformal.sequential(calibrated, means, jnp.zeros(2), update="no")
    for gamma in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="gamma"):
            ee.conformal.sequential(calibrated, means, jnp.zeros(2), gamma=gamma)
    with pytest.raises(ValueError, match="start_alpha"):
        ee.conformal.sequential(calibrated, means, jnp.zeros(2),
                                start_alpha=float("nan"))  # fmt: skip


def test_optimize_beta_keeps_to_levels_whose_ranks_exist():
    """A left-skewed window where the narrowest uncorrected quantiles sit at
    beta = alpha, whose upper conformal rank would be n + 1: the chosen beta is
    one with both ranks inside the window, and the interval is finite."""
    n = 199
    residuals = -(jnp.abs(jax.random.normal(jax.random.key(0), (n,))) ** 3)
    counts = jnp.zeros((2, n), jnp.int32).at[0].set(1)
    calibrated = ee.conformal.enbpi(jnp.zeros((2, n)), residuals, alpha=0.1,
                                    in_bag=counts)  # fmt: skip
    lower, upper = calibrated.interval(jnp.zeros((2, 3)), optimize_beta=True)
    assert bool(jnp.all(jnp.isfinite(lower) & jnp.isfinite(upper)))
    plain = calibrated.interval(jnp.zeros((2, 3)))
    assert float((upper - lower)[0]) <= float((plain[1] - plain[0])[0])
