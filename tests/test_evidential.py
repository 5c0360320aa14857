"""Evidential heads (`ee.losses.evidential_regression`,
`ee.losses.evidential_classification`) against the papers' formulas written
independently: the NIG marginal as SciPy's Student-t, Sensoy et al.'s
equation 5 and the Dirichlet KL in NumPy/SciPy; members of one ensemble
trained in one `fit`."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import scipy.special
import scipy.stats

import eqx_ensemble as ee


def test_evidential_regression_is_the_nig_marginal_plus_the_regulariser():
    rng = np.random.default_rng(0)
    n = 50
    gamma, y = rng.normal(size=n), rng.normal(size=n) * 2
    nu, beta = rng.uniform(0.1, 5, n), rng.uniform(0.1, 3, n)
    alpha = 1 + rng.uniform(0.05, 6, n)
    # Amini et al. (2020): the marginal is a Student-t with 2 alpha degrees of
    # freedom, location gamma and scale^2 beta (1 + nu) / (nu alpha).
    scale = np.sqrt(beta * (1 + nu) / (nu * alpha))
    nll = -scipy.stats.t.logpdf(y, df=2 * alpha, loc=gamma, scale=scale)
    regulariser = np.abs(y - gamma) * (2 * nu + alpha)
    args = [jnp.asarray(v, jnp.float32) for v in (gamma, nu, alpha, beta, y)]
    for coefficient in (0.0, 0.01, 1.0):
        got = ee.losses.evidential_regression(*args, coefficient=coefficient)
        want = np.mean(nll + coefficient * regulariser)
        assert float(got) == pytest.approx(want, rel=2e-5)
    grads = jax.grad(ee.losses.evidential_regression, argnums=(0, 1, 2, 3))(*args)
    assert all(bool(jnp.isfinite(g).all()) for g in grads)


def _sensoy(evidence, labels, weight):
    # Equation 5 of Sensoy et al. (2018) and the KL of their equation 7.
    alpha = evidence + 1
    strength = alpha.sum(-1, keepdims=True)
    p = alpha / strength
    y = np.eye(evidence.shape[-1])[labels]
    risk = ((y - p) ** 2 + p * (1 - p) / (strength + 1)).sum(-1)
    tilde = y + (1 - y) * alpha
    k = evidence.shape[-1]
    kl = (
        scipy.special.gammaln(tilde.sum(-1))
        - scipy.special.gammaln(k)
        - scipy.special.gammaln(tilde).sum(-1)
        + ((tilde - 1) * (scipy.special.digamma(tilde)
                          - scipy.special.digamma(tilde.sum(-1, keepdims=True)))
           ).sum(-1)
    )  # fmt: skip
    return np.mean(risk + weight * kl)


def test_evidential_classification_is_sensoys_loss():
    rng = np.random.default_rng(1)
    evidence = rng.exponential(3.0, size=(40, 5))
    labels = rng.integers(0, 5, 40)
    for weight in (0.0, 0.3, 1.0):
        got = ee.losses.evidential_classification(
            jnp.asarray(evidence, jnp.float32), jnp.asarray(labels), kl_weight=weight
        )
        assert float(got) == pytest.approx(_sensoy(evidence, labels, weight), rel=1e-5)
    # The KL is 0 where every wrong class has no evidence.
    clean = np.zeros((3, 4))
    clean[np.arange(3), [0, 1, 2]] = 7.0
    only_kl = ee.losses.evidential_classification(
        jnp.asarray(clean), jnp.array([0, 1, 2]), kl_weight=1.0
    ) - ee.losses.evidential_classification(jnp.asarray(clean), jnp.array([0, 1, 2]))
    assert abs(float(only_kl)) < 1e-5  # (float32 rounding of O(1) terms)


def test_an_ensemble_of_evidential_regressors_trains_in_one_fit():
    def loss(model, batch, key):
        x, y = batch
        out = jax.vmap(model)(x)
        nu, beta = jax.nn.softplus(out[:, 1]), jax.nn.softplus(out[:, 3])
        alpha = jax.nn.softplus(out[:, 2]) + 1.0
        return ee.losses.evidential_regression(out[:, 0], nu, alpha, beta, y)

    ens = ee.ensemble(
        lambda k: eqx.nn.MLP(1, 4, 32, 2, key=k),
        size=3,
        key=jax.random.key(0),
    )
    x = jax.random.uniform(jax.random.key(1), (256, 1), minval=-1, maxval=1)
    y = jnp.sin(3 * x[:, 0])
    result = ee.fit(ens, loss, optax.adam(1e-2), (x, y), steps=300, batch_size=64,
                    key=jax.random.key(2), callbacks=())  # fmt: skip
    losses = result.history.losses
    assert losses.shape == (300, 3)
    assert (losses[-20:].mean(0) < losses[:20].mean(0) - 0.5).all()  # every member


def test_bad_inputs_are_refused_by_name():
    ones = jnp.ones(3)
    with pytest.raises(ValueError, match="alpha"):
        ee.losses.evidential_regression(ones, ones, ones, ones, ones)  # alpha = 1
    with pytest.raises(ValueError, match="nu"):
        ee.losses.evidential_regression(ones, 0 * ones, 2 * ones, ones, ones)
    with pytest.raises((ValueError, TypeError), match="target"):
        ee.losses.evidential_regression(ones, ones, 2 * ones, ones, jnp.ones(4))
    with pytest.raises(ValueError, match="evidence"):
        ee.losses.evidential_classification(-jnp.ones((2, 3)), jnp.array([0, 1]))
    with pytest.raises(ValueError, match="labels"):
        ee.losses.evidential_classification(jnp.ones((2, 3)), jnp.array([0.0, 1.0]))
    with pytest.raises(ValueError, match="labels"):
        ee.losses.evidential_classification(jnp.ones((2, 3)), jnp.array([0, 1, 2]))
