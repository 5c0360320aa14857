"""Silent numerics and unactionable errors found by the adversarial review
(issue 13): each test failed on the code before the fix."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import eqx_ensemble as ee


@pytest.fixture(scope="module")
def ens():
    return ee.ensemble(
        lambda k: eqx.nn.Linear(2, 1, key=k), size=2, key=jax.random.key(0)
    )


def test_average_with_large_integer_weights_is_exact(ens):
    big = 2**31 - 1
    soup = ee.average(ens, jnp.array([big, big], dtype=jnp.int32))
    np.testing.assert_allclose(soup.weight, ens.members.weight.mean(0), rtol=1e-6)


def test_average_with_float16_weights_does_not_overflow(ens):
    soup = ee.average(ens, jnp.array([60000.0, 60000.0], dtype=jnp.float16))
    np.testing.assert_allclose(soup.weight, ens.members.weight.mean(0), rtol=1e-6)


def test_fit_temperature_refuses_nonpositive_iterations():
    logits = jnp.zeros((2, 4, 3))
    labels = jnp.array([0, 1, 2, 0])
    with pytest.raises(ValueError, match="`iterations` must be between 1"):
        ee.metrics.fit_temperature(logits, labels, iterations=-5)


def test_pairwise_disagreement_has_an_exact_zero_diagonal():
    probs = jax.nn.softmax(jax.random.normal(jax.random.key(1), (5, 97, 7)), -1)
    matrix = np.asarray(ee.metrics.pairwise_disagreement(probs))
    assert (np.diag(matrix) == 0).all()
    np.testing.assert_array_equal(matrix, matrix.T)
    votes = np.asarray(jnp.argmax(probs, -1))
    expected = (votes[:, None, :] != votes[None, :, :]).mean(-1)
    np.testing.assert_allclose(matrix, expected, rtol=1e-6)


def test_set_hyperparams_with_another_size_is_refused(ens):
    opt = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
    state = ee.init_optimizer(opt, ens)
    with pytest.raises(ValueError, match="`size` is 3 but the optimizer state holds 2"):
        ee.set_hyperparams(state, {"learning_rate": 0.1}, size=3)


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_non_finite_hyperparameters_are_refused(ens, value):
    opt = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
    state = ee.init_optimizer(opt, ens)
    with pytest.raises(ValueError, match="not finite for members \\[1\\]"):
        ee.set_hyperparams(state, {"learning_rate": jnp.array([0.1, value])}, size=2)


def test_complex_hyperparameters_are_refused(ens):
    opt = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
    state = ee.init_optimizer(opt, ens)
    with pytest.raises(TypeError, match="real numbers|hyperparams"):
        ee.set_hyperparams(state, {"learning_rate": jnp.array([0.1, 1j])}, size=2)


def test_an_optimizer_name_gets_an_actionable_error(ens):
    # (the suite's runtime type checker may answer first; both name the problem)
    with pytest.raises(TypeError, match="optax|optimizer"):
        ee.init_optimizer("adam", ens)  # type: ignore[arg-type]


def test_make_mesh_with_a_repeated_device_is_refused():
    device = jax.devices()[0]
    with pytest.raises(ValueError, match="more than once"):
        ee.make_mesh(members=2, devices=[device, device])


def test_combination_rules_refuse_integer_predictions():
    from eqx_ensemble.combine import _check_floating

    with pytest.raises(TypeError, match="`probs` must hold floating-point values"):
        _check_floating(jnp.ones((2, 3, 4), dtype=jnp.int32), "probs")


def test_majority_vote_refuses_float_labels():
    votes = jnp.array([[0.0, 1.0], [1.0, 1.0]])
    with pytest.raises(TypeError, match="predictions|Int"):
        ee.combine.majority_vote(votes, num_classes=2)  # type: ignore[arg-type]


def test_gaussian_mixture_refuses_negative_variances():
    means = jnp.zeros((2, 3))
    with pytest.raises(ValueError, match="`variances` must be non-negative"):
        ee.combine.gaussian_mixture(means, jnp.full((2, 3), -1.0))


def test_positive_infinite_logits_are_named_not_nan():
    logits = jnp.array([[[0.0, jnp.inf]], [[0.0, 1.0]]])
    with pytest.raises(ValueError, match="`logits` holds inf at index \\(0, 0, 1\\)"):
        ee.combine.mean_probs_from_logits(logits)
    masked = jnp.array([[[0.0, -jnp.inf]], [[0.0, 1.0]]])
    assert np.isfinite(np.asarray(ee.combine.mean_probs_from_logits(masked))).all()


def test_nan_regression_inputs_are_named():
    with pytest.raises(ValueError, match="`means` holds nan"):
        ee.combine.gaussian_mixture(
            jnp.array([[0.0, jnp.nan]]), jnp.array([[1.0, 1.0]])
        )


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
