"""Regression metrics on `(members, batch, outputs)`: outputs are independent, so
every metric is built from the single-output ones (or a NumPy formula) here."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqx_ensemble as ee

m = ee.metrics


@pytest.fixture
def predictions():
    keys = jax.random.split(jax.random.key(0), 3)
    means = jax.random.normal(keys[0], (4, 20, 3))
    variances = jnp.exp(jax.random.normal(keys[1], (4, 20, 3)))
    targets = jax.random.normal(keys[2], (20, 3))
    return means, variances, targets


def test_per_example_quantities_are_per_output(predictions):
    means, variances, _ = predictions
    for fn, args in [
        (m.predictive_mean, (means,)),
        (m.epistemic_variance, (means,)),
        (m.predictive_variance, (means, variances)),
        (m.aleatoric_variance, (variances,)),
    ]:
        got = fn(*args)
        assert got.shape == (20, 3)
        for j in range(3):
            np.testing.assert_allclose(
                got[:, j], fn(*[a[..., j] for a in args]), rtol=1e-6
            )
    mean, variance = ee.combine.gaussian_mixture(means, variances)
    np.testing.assert_allclose(mean, m.predictive_mean(means), rtol=1e-6)
    np.testing.assert_allclose(variance, m.predictive_variance(means, variances))


def test_scores_treat_outputs_as_independent(predictions):
    means, variances, targets = predictions
    outputs = range(3)
    # Gaussian NLL of independent outputs: the sum of the outputs' NLLs.
    np.testing.assert_allclose(
        m.gaussian_nll(means, variances, targets),
        sum(
            m.gaussian_nll(means[..., j], variances[..., j], targets[:, j])
            for j in outputs
        ),
        rtol=1e-5,
    )
    np.testing.assert_allclose(
        m.per_member_gaussian_nll(means, variances, targets),
        sum(
            m.per_member_gaussian_nll(means[..., j], variances[..., j], targets[:, j])
            for j in outputs
        ),
        rtol=1e-5,
    )
    # The exact mixture: each member's density is a product over outputs.
    mu, var, y = (np.asarray(a, np.float64) for a in predictions)
    log_density = -0.5 * (np.log(2 * np.pi * var) + (y[None] - mu) ** 2 / var)
    per_member = log_density.sum(-1)  # (members, batch)
    expected = -np.mean(
        np.log(np.mean(np.exp(per_member - per_member.max(0)), 0)) + per_member.max(0)
    )
    np.testing.assert_allclose(
        m.gaussian_nll(means, variances, targets, predictive="mixture"),
        expected,
        rtol=1e-5,
    )
    # RMSE over every (example, output); coverage over every pair.
    error = mu.mean(0) - y
    np.testing.assert_allclose(
        m.rmse(means, targets), np.sqrt(np.mean(error**2)), rtol=1e-5
    )
    np.testing.assert_allclose(
        m.per_member_rmse(means, targets),
        np.sqrt(np.mean((mu - y[None]) ** 2, axis=(1, 2))),
        rtol=1e-5,
    )
    np.testing.assert_allclose(
        m.interval_coverage(means, variances, targets, 0.9),
        np.mean(
            [
                m.interval_coverage(
                    means[..., j], variances[..., j], targets[:, j], 0.9
                )
                for j in outputs
            ]
        ),
        rtol=1e-6,
    )
    assert m.gaussian_nll(means, variances, targets, reduction="none").shape == (20,)


def test_shapes_are_named_in_errors(predictions):
    means, variances, targets = predictions
    with pytest.raises(ValueError, match=r"\(batch, outputs\) = \(20, 3\)"):
        m.rmse(means, targets[:, :2])
    with pytest.raises(ValueError, match="member 1, example 2, output 0"):
        m.gaussian_nll(means, variances.at[1, 2, 0].set(-1.0), targets)
    with pytest.raises(ValueError, match="3 outputs per example"):
        ee.conformal.split_regression(means, variances, targets, alpha=0.1)
