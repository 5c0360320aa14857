"""Variational Bayesian last layers (`ee.nn.VBLLRegression`,
`ee.nn.VBLLClassification`; Harrison, Willes & Snoek 2024) against the paper's
bounds written independently in NumPy/SciPy: the Gaussian KL from the
covariance matrices, the expected log-likelihood in closed form and by Monte
Carlo over sampled weights, the Jensen bound below a Monte-Carlo `E_q log
softmax`, the predictive variance; an ensemble of VBLL regressors trained in one
`fit`, its members equal to themselves alone, and resumed bit for bit."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import scipy.special
import scipy.stats
from conftest import Interrupt, interrupt_at

import eqx_ensemble as ee

IN, OUT, BATCH = 4, 2, 7


def _random_head(cls, out, key=0):
    """A head whose posterior has dense Cholesky factors (off-diagonal, diagonals
    away from their initial value) and, for regression, unequal noise."""
    rng = np.random.default_rng(key)
    head = cls(IN, out, prior_scale=0.7, key=jax.random.key(key))
    raw = rng.normal(0.0, 0.4, (out, IN, IN)).astype(np.float32)
    replace = [(lambda h: h.cholesky, raw)]
    if cls is ee.nn.VBLLRegression:
        noise = np.log(rng.uniform(0.2, 1.5, out)).astype(np.float32)
        replace.append((lambda h: h.log_noise, noise))
    for where, value in replace:
        head = eqx.tree_at(where, head, jnp.asarray(value))
    return head


def _posterior(head):
    """The means (out, in) and covariances (out, in, in) in NumPy, rebuilt from
    the documented parameterisation: lower triangle, exponentiated diagonal."""
    raw = np.asarray(head.cholesky, np.float64)
    tril = np.tril(raw, -1) + np.stack([np.diag(np.exp(np.diag(r))) for r in raw])
    return np.asarray(head.mean, np.float64), tril @ np.swapaxes(tril, -1, -2)


def _gaussian_kl(mean, cov, prior_var):
    # KL(N(m, S) || N(0, s^2 I)), from the covariance matrix itself.
    d = mean.shape[-1]
    return 0.5 * (
        np.trace(cov) / prior_var
        + mean @ mean / prior_var
        - d
        + d * np.log(prior_var)
        - np.linalg.slogdet(cov)[1]
    )


def _data(seed=1):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(BATCH, IN)), rng.normal(size=(BATCH, OUT))


def test_regression_elbo_is_the_papers_against_numpy_and_monte_carlo():
    head = _random_head(ee.nn.VBLLRegression, OUT)
    features, y = _data()
    means, covs = _posterior(head)
    noise = np.exp(np.asarray(head.log_noise, np.float64))
    kl = sum(_gaussian_kl(m, c, 0.7**2) for m, c in zip(means, covs, strict=True))
    assert float(head.kl()) == pytest.approx(kl, rel=1e-5)
    # Closed form: log N(y | M phi, Sigma) - sum_k phi^T S_k phi / (2 sigma_k^2).
    spread = np.einsum("bi,kij,bj->bk", features, covs, features)
    closed = scipy.stats.norm.logpdf(y, features @ means.T, np.sqrt(noise))
    closed = (closed - spread / (2 * noise)).sum(-1)
    # Monte Carlo over W ~ q: 200k sampled weight matrices.
    rng = np.random.default_rng(2)
    chol = np.linalg.cholesky(covs)
    w = means + np.einsum("kij,skj->ski", chol, rng.normal(size=(200_000, OUT, IN)))
    logpdf = scipy.stats.norm.logpdf(y, np.einsum("ski,bi->sbk", w, features),
                                     np.sqrt(noise))  # fmt: skip
    sampled = logpdf.sum(-1)
    standard_error = sampled.std(0) / np.sqrt(len(sampled))
    assert np.all(np.abs(sampled.mean(0) - closed) < 4 * standard_error + 1e-6)
    for n in (10, 1000):
        got = head.loss(
            jnp.asarray(features, jnp.float32), jnp.asarray(y, jnp.float32), n
        )
        assert float(got) == pytest.approx(-closed.mean() + kl / n, rel=1e-5)


def test_regression_predictive_is_the_mean_and_variance_formula():
    head = _random_head(ee.nn.VBLLRegression, OUT)
    features, _ = _data()
    means, covs = _posterior(head)
    noise = np.exp(np.asarray(head.log_noise, np.float64))
    dist = jax.vmap(head)(jnp.asarray(features, jnp.float32))
    assert isinstance(dist, ee.predictive.Normal)
    # N(M phi, phi^T S_k phi + sigma_k^2), output by output.
    variance = np.einsum("bi,kij,bj->bk", features, covs, features) + noise
    np.testing.assert_allclose(dist.mean(), features @ means.T, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dist.variance(), variance, rtol=1e-5)


def test_classification_bound_is_jensens_below_monte_carlo():
    classes = 5
    head = _random_head(ee.nn.VBLLClassification, classes)
    features, _ = _data()
    labels = np.arange(BATCH) % classes
    means, covs = _posterior(head)
    logits = features @ means.T
    spread = np.einsum("bi,kij,bj->bk", features, covs, features)
    bound = logits[np.arange(BATCH), labels] - scipy.special.logsumexp(
        logits + spread / 2, axis=-1
    )
    kl = sum(_gaussian_kl(m, c, 0.7**2) for m, c in zip(means, covs, strict=True))
    got = head.loss(jnp.asarray(features, jnp.float32), jnp.asarray(labels), 50)
    assert float(got) == pytest.approx(-bound.mean() + kl / 50, rel=1e-5)
    # E_q log softmax(W phi)_y by sampling W: the bound lies below it.
    rng = np.random.default_rng(3)
    chol = np.linalg.cholesky(covs)
    w = means + np.einsum("kij,skj->ski", chol, rng.normal(size=(100_000, classes, IN)))
    sampled_logits = np.einsum("ski,bi->sbk", w, features)
    log_softmax = sampled_logits - scipy.special.logsumexp(
        sampled_logits, axis=-1, keepdims=True
    )
    sampled = log_softmax[:, np.arange(BATCH), labels]
    expected = sampled.mean(0)
    standard_error = sampled.std(0) / np.sqrt(len(sampled))
    assert np.all(bound <= expected + 4 * standard_error)
    assert np.all(bound < expected - 0.05)  # a real gap: the sampling can tell
    # The predictive: the mean-field approximation, close to the sampled mean.
    got = np.exp(jax.vmap(head)(jnp.asarray(features, jnp.float32)))
    mean_field = scipy.special.softmax(logits / np.sqrt(1 + np.pi / 8 * spread), -1)
    np.testing.assert_allclose(got, mean_field, rtol=1e-5, atol=1e-7)
    sampled_probs = np.exp(log_softmax).mean(0)
    plug_in = scipy.special.softmax(logits, -1)  # the posterior mean alone
    error = np.abs(got - sampled_probs)
    assert error.mean() < 0.7 * np.abs(plug_in - sampled_probs).mean()
    assert error.max() < 0.15  # an approximation: 0.10 here


class _Net(eqx.Module):
    body: eqx.nn.MLP
    head: ee.nn.VBLLRegression

    def __init__(self, key):
        k_body, k_head = jax.random.split(key)
        self.body = eqx.nn.MLP(1, 16, 32, 2, activation=jnp.tanh, key=k_body)
        self.head = ee.nn.VBLLRegression(16, 1, prior_scale=1.0, key=k_head)

    def __call__(self, x):
        return self.head(self.body(x))


N = 128
X = jnp.linspace(-2, 2, N)[:, None]
Y = jnp.sin(2 * X) + 0.1 * jax.random.normal(jax.random.key(9), (N, 1))


def _loss(model, batch, key):
    x, y = batch
    return model.head.loss(jax.vmap(model.body)(x), y, num_examples=N)


def _fit(**kwargs):
    ens = ee.ensemble(_Net, size=3, key=jax.random.key(0))
    return ee.fit(ens, _loss, optax.adam(1e-2), (X, Y), batch_size=32,
                  key=jax.random.key(1), **kwargs)  # fmt: skip


@pytest.fixture(scope="module")
def trained():
    return _fit(steps=300, callbacks=())


def _nll_per_member(ens):
    dist = ee.predict(ens, X)
    return np.asarray(-dist.log_prob(Y[None]).mean((1, 2)))


def test_an_ensemble_of_vbll_regressors_trains_in_one_fit(trained):
    assert trained.history.losses.shape == (300, 3)
    before = _nll_per_member(ee.ensemble(_Net, size=3, key=jax.random.key(0)))
    after = _nll_per_member(trained.ensemble)
    assert (after < before - 0.5).all(), (before, after)  # every member


def test_member_i_equals_member_i_alone(trained):
    dist = ee.predict(trained.ensemble, X)
    for i, member in enumerate(ee.unstack(trained.ensemble)):
        alone = jax.vmap(member)(X)
        np.testing.assert_allclose(dist.loc[i], alone.loc, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(dist.scale[i], alone.scale, rtol=1e-6, atol=1e-6)


def _leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(eqx.filter(tree, eqx.is_array))]


def test_resume_is_bit_exact(tmp_path):
    common = dict(steps=60, execution=ee.Execution(steps_per_dispatch=20))
    reference = _fit(checkpoints=ee.Checkpoints(tmp_path / "ref", every=20),
                     callbacks=(), **common)  # fmt: skip

    run = ee.Checkpoints(tmp_path / "run", every=20)
    with pytest.raises(Interrupt):
        _fit(checkpoints=run, callbacks=[interrupt_at(40)], **common)
    assert [step for step, _ in ee.list_checkpoints(tmp_path / "run")][-1] == 40
    resumed = _fit(checkpoints=run, callbacks=(), **common)
    assert resumed.step == 60
    for a, b in zip(
        _leaves(resumed.ensemble), _leaves(reference.ensemble), strict=True
    ):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(resumed.history.losses, reference.history.losses)


def test_bad_inputs_are_refused_by_name():
    key = jax.random.key(0)
    for scale in (0.0, -1.0, float("inf")):
        with pytest.raises(ValueError, match="prior_scale"):
            ee.nn.VBLLRegression(3, 1, prior_scale=scale, key=key)
    with pytest.raises(ValueError, match="prior_scale"):
        ee.nn.VBLLClassification(3, 2, prior_scale=0.0, key=key)
    regression = ee.nn.VBLLRegression(3, 2, key=key)
    classification = ee.nn.VBLLClassification(3, 4, key=key)
    with pytest.raises((ValueError, TypeError), match="features"):
        regression(jnp.ones(5))  # wrong width
    with pytest.raises((ValueError, TypeError), match="features"):
        classification.loss(jnp.ones((6, 5)), jnp.zeros(6, jnp.int32), 10)
    with pytest.raises((ValueError, TypeError), match="y"):
        regression.loss(jnp.ones((6, 3)), jnp.ones((6, 1)), 10)  # wrong out width
    with pytest.raises(ValueError, match=r"labels.*\[0, 4\)"):
        classification.loss(jnp.ones((3, 3)), jnp.array([0, 4, 1]), 10)
    with pytest.raises(ValueError, match="labels"):
        classification.loss(jnp.ones((3, 3)), jnp.array([0, -1, 1]), 10)
    with pytest.raises((ValueError, TypeError), match="labels"):
        classification.loss(jnp.ones((3, 3)), jnp.array([0.0, 1.0, 2.0]), 10)
    with pytest.raises(ValueError, match="num_examples"):
        regression.loss(jnp.ones((6, 3)), jnp.ones((6, 2)), 0)
