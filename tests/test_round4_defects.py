"""Issue 47 (round 4): what broke from outside, each with a test that failed
before its fix. Items are numbered as in the issue."""

import re
import tomllib
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import tree_equal

import eqx_ensemble as ee

ROOT = Path(__file__).resolve().parent.parent
KEY = jax.random.key(0)
X = jnp.linspace(-1, 1, 32)[:, None]
Y = jnp.sin(3 * X)
ENS = ee.ensemble(lambda k: eqx.nn.MLP(1, 1, 8, 1, key=k), size=3, key=KEY)


def mse(model, batch, key):
    xb, yb = batch
    return jnp.mean((jax.vmap(model)(xb) - yb) ** 2)


# 2. Laplace refuses non-finite data, naming the argument and the index.


@pytest.mark.parametrize("where", ["x", "y"])
def test_laplace_refuses_a_nan_in_the_data(where):
    x, y = np.asarray(X).copy(), np.asarray(Y).copy()
    (x if where == "x" else y)[5, 0] = np.nan
    with pytest.raises(ValueError, match=rf"`{where}`.*nan at index \(5, 0\)"):
        ee.laplace(ENS, (x, y), likelihood="regression", curvature="diagonal")


# 3. A schedule that turns negative is named in the divergence error.


def test_a_schedule_that_turns_negative_is_named_when_the_members_diverge():
    schedule = optax.linear_schedule(0.05, -5.0, transition_steps=40)
    steep = lambda model, batch, key: jnp.sum(  # noqa: E731
        jax.vmap(model)(batch[0]) ** 2
    )
    with pytest.raises(ee.EnsembleDivergedError) as caught:
        ee.fit(
            ENS, steep, optax.sgd(schedule), (X, Y), steps=400, batch_size=8,
            key=KEY, callbacks=(),
        )  # fmt: skip
    message = str(caught.value)
    # The first negative value of the schedule, computed independently (optax
    # reads it at the count of steps done; the message counts steps from 1):
    first = next(count for count in range(400) if float(schedule(count)) < 0)
    assert f"`learning_rate` schedule is negative from step {first + 1}" in message
    assert "lower the learning rate" not in message


def test_a_constant_learning_rate_keeps_the_usual_advice():
    def explode(model, batch, key):
        return jnp.mean(jax.vmap(model)(batch[0])) * jnp.inf

    with pytest.raises(ee.EnsembleDivergedError, match="lower the learning rate"):
        ee.fit(
            ENS, explode, optax.sgd(0.1), (X, Y), steps=3, batch_size=8, key=KEY,
            callbacks=(),
        )  # fmt: skip


# 10. (tests/test_docs.py::test_no_page_writes_a_keyword_the_library_no_longer_takes)

# 11. One version: the package's, the metadata's and the one the errors name.


def test_the_version_the_errors_name_is_the_package_version():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert meta["version"] == ee.__version__
    with pytest.raises(TypeError) as caught:
        ee.fit(ENS, mse, optax.sgd(0.1), (X, Y), steps=1, key=KEY, unroll=True)
    named = re.search(r"version (\d+\.\d+)", str(caught.value))
    assert named is not None
    assert ee.__version__.startswith(named[1] + ".")


# 14. Bad weights and hyperparameters are named; `ee.stack` refuses to wrap.


def _unchecked(function):
    # The function without the test run's jaxtyping/beartype hook (its error
    # names the parameter too): what a user without the hook calls.
    return getattr(function, "__wrapped__", function)


@pytest.mark.parametrize("weights", ["abc", ["a", "b", "c"], [1.0, None, 2.0]])
def test_weights_that_are_not_numbers_are_named(weights):
    trees = [{"w": jnp.ones(2)}] * 3
    for call in (
        lambda: _unchecked(ee.average)(ENS, weights),
        lambda: _unchecked(ee.tree_weighted_sum)(trees, weights),
    ):
        with pytest.raises(TypeError, match="`weights` must be real numbers"):
            call()
    with pytest.raises(TypeError, match="weights"):  # with the hook, if any
        ee.average(ENS, weights)


def test_hyperparams_that_are_not_a_dict_of_numbers_are_named():
    opt = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
    init = _unchecked(ee.init_optimizer)
    with pytest.raises(TypeError, match="`hyperparams` must be a dict"):
        init(opt, ENS, hyperparams=[0.1, 0.2, 0.3])
    state = ee.init_optimizer(opt, ENS)
    with pytest.raises(TypeError, match=r"`hyperparams\['learning_rate'\]` must be"):
        _unchecked(ee.set_hyperparams)(state, {"learning_rate": "abc"}, size=3)
    with pytest.raises(TypeError, match="`hyperparams` must be a dict"):
        _unchecked(ee.set_hyperparams)(state, [("learning_rate", 0.1)], size=3)


def test_stack_refuses_integers_that_would_wrap():
    assert not jax.config.jax_enable_x64
    fine = [{"w": np.ones(2, np.float32), "n": np.array([7], np.int64)}] * 2
    with pytest.warns(UserWarning, match="stores it as int32"):
        assert int(ee.stack(fine).members["n"][1, 0]) == 7
    big = [
        {"w": np.ones(2, np.float32), "n": np.array([7], np.int64)},
        {"w": np.ones(2, np.float32), "n": np.array([3_000_000_000], np.int64)},
    ]
    with pytest.raises(ValueError, match=r"leaf `\['n'\]` of model 1.*3000000000"):
        ee.stack(big)


# 6. Metrics on 16-bit predictions compute in float32.


def test_metrics_of_bfloat16_predictions_are_computed_in_float32():
    from sklearn.metrics import accuracy_score

    rng = np.random.default_rng(0)
    n = 497
    labels = rng.integers(0, 2, n)
    # Two classes, confidences exact in bfloat16 (and summing to exactly 1), so
    # the same values held in float32 are an exact reference.
    confidence = rng.choice([0.5625, 0.625, 0.75, 0.875, 0.9375], size=(2, n))
    right = rng.permutation(n) < 468  # 468 of 497 right (the numbers)
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


# 8. Non-parametric calibrators never give a class probability 0.


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
    # Issue 47, item 8: on a 300-example split, the default penalty (chosen by
    # cross-validation, pulling to temperature scaling's family) stays within
    # rounding of temperature scaling on held-out data, where the true map IS
    # a temperature; a weak fixed penalty overfits the split.
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


# 12. One step numbering: every step number counts from 1.


def test_every_step_number_counts_from_one(tmp_path):
    # Member 1's learning rate blows SGD up after a few steps. Its divergence
    # step is the same number in the result, the log's event, the progress
    # meter and (when every member diverges) the error; it is the first row of
    # the log whose loss column is NaN from then on, and the log's step column,
    # the evaluations and the checkpoints count the same way (step t: the
    # t-th update, after which t steps are done).
    sgd = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
    rates = jnp.array([0.1, 6.0, 0.1])
    seen = []

    class Meter(ee.ProgressMeter):
        def start(self, total, done, resumed):
            return None

        def update(self, handle, done, losses, diverged_at):
            seen.append(diverged_at.copy())

        def close(self, handle):
            pass

    result = ee.fit(
        ENS, mse, sgd, (X, Y), steps=20, batch_size=8, key=KEY,
        opt_state=ee.init_optimizer(sgd, ENS, hyperparams={"learning_rate": rates}),
        evaluate=ee.Evaluate(mse, (X, Y), every=5),
        checkpoints=ee.Checkpoints(tmp_path / "ckpt", every=10),
        callbacks=[ee.CSVLogger(tmp_path / "logs"), Meter()],
        execution=ee.Execution(steps_per_dispatch=5),
    )  # fmt: skip
    assert set(result.diverged) == {1}
    t = result.diverged[1]
    assert 1 <= t <= 20
    table = np.loadtxt(tmp_path / "logs" / "losses.csv", delimiter=",", skiprows=1)
    np.testing.assert_array_equal(table[:, 0], np.arange(1, 21))
    column = table[:, 2]  # member 1
    assert np.isfinite(column[: t - 1]).all() and np.isnan(column[t:]).all()
    np.testing.assert_allclose(column, result.history.losses[:, 1], rtol=1e-6)
    events = (tmp_path / "logs" / "events.jsonl").read_text()
    assert f'{{"step": {t}, "event": "diverged", "member": 1}}' in events
    assert int(seen[-1][1]) == t and (np.delete(seen[-1], 1) == -1).all()
    # Member 1 keeps its weights after step t - 1: a run of t - 1 steps.
    before = ee.fit(
        ENS, mse, sgd, (X, Y), steps=t - 1, batch_size=8, key=KEY,
        opt_state=ee.init_optimizer(sgd, ENS, hyperparams={"learning_rate": rates}),
        callbacks=(),
    ) if t > 1 else None  # fmt: skip
    if before is not None:
        assert before.diverged == {}
        assert tree_equal(result.ensemble[1], before.ensemble[1])
    np.testing.assert_array_equal(result.history.eval_steps, [5, 10, 15, 20])
    assert [step for step, _ in ee.list_checkpoints(tmp_path / "ckpt")] == [10, 20]

    # Every member diverging: the error names the same numbers.
    with pytest.raises(ee.EnsembleDivergedError) as caught:
        ee.fit(
            ENS, mse, sgd, (X, Y), steps=20, batch_size=8, key=KEY,
            opt_state=ee.init_optimizer(sgd, ENS, hyperparams={"learning_rate": 6.0}),
            callbacks=(),
        )  # fmt: skip
    steps = caught.value.result.diverged  # pyright: ignore[reportAttributeAccessIssue]
    listed = [steps[member] for member in range(3)]
    assert f"at steps {listed}" in str(caught.value)
    assert min(listed) >= 1


# 7. Laplace's prior: tuned on a validation split when one is given.


def test_laplace_tuned_on_validation_does_not_lose_to_the_members_on_digits():
    # Members trained without weight decay (as usual): the marginal likelihood
    # picks a far too weak prior for them (underconfident); the validation
    # split's prior must give a mixture no worse than the members themselves
    # (their mean test NLL), and it is the one `validation=` selects.
    from sklearn.datasets import load_digits

    digits = load_digits()
    order = np.random.default_rng(0).permutation(len(digits.target))
    images = digits.data[order].astype(np.float32)
    labels = digits.target[order].astype(np.int32)
    mean, std = images[:1000].mean(0), images[:1000].std(0) + 1e-3
    x = jnp.asarray((images - mean) / std)
    y = jnp.asarray(labels)
    train, val, test = (
        (x[:1000], y[:1000]),
        (x[1000:1300], y[1000:1300]),
        (x[1300:], y[1300:]),
    )

    def cross_entropy(model, batch, key):
        xs, ys = batch
        logits = jax.vmap(model)(xs)
        return optax.softmax_cross_entropy_with_integer_labels(logits, ys).mean()

    ens = ee.ensemble(
        lambda k: eqx.nn.MLP(64, 10, 64, 2, key=k), size=3, key=jax.random.key(0)
    )
    deep = ee.fit(
        ens, cross_entropy, optax.sgd(0.05, momentum=0.9), train, steps=600,
        batch_size=64, key=jax.random.key(1), callbacks=(),
    ).ensemble  # fmt: skip

    def nll(probs):  # the mixture's, and each member's, by hand
        probs = np.asarray(probs, np.float64)
        rows = np.arange(len(test[1]))
        picked = probs[:, rows, np.asarray(test[1])]
        return -np.log(picked.mean(0)).mean(), -np.log(picked).mean(1)

    _, members_own = nll(jax.nn.softmax(ee.predict(deep, test[0]), axis=-1))
    posterior = ee.laplace(deep, train, likelihood="classification", validation=val)
    mixture, _ = nll(posterior.predict(test[0]))
    assert mixture <= members_own.mean(), (mixture, members_own)
    by_hand = ee.laplace(deep, train, likelihood="classification")
    tuned = by_hand.optimize_prior_precision(val)
    np.testing.assert_array_equal(posterior.prior_precision, tuned.prior_precision)
    with pytest.raises(ValueError, match="pass one of them"):
        ee.laplace(
            deep, train, likelihood="classification", validation=val,
            prior_precision=1.0,
        )  # fmt: skip
