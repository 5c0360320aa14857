"""DUE's head (`ee.nn.InducingPointGP`) against the sparse variational GP
written independently in NumPy, in the unwhitened form (q(u) = N(L m, L S L^T)
against the prior N(0, K_zz)); an ensemble of DUE models trained in one `fit`,
distance-aware, resumed bit for bit."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import scipy.special
from conftest import Interrupt, interrupt_at

import eqx_ensemble as ee


def _head(seed=0, outputs=2, m=6, features=3):
    rng = np.random.default_rng(seed)
    head = ee.nn.InducingPointGP(
        rng.normal(size=(m, features)) * 1.5, outputs, lengthscale=1.3, outputscale=0.8
    )
    # A posterior away from the prior: a mean, a full lower triangle, scales.
    return eqx.tree_at(
        lambda g: (g.mean, g.scale, g.log_lengthscale, g.log_outputscale),
        head,
        (
            jnp.asarray(rng.normal(size=(outputs, m)), jnp.float32),
            jnp.asarray(rng.normal(size=(outputs, m, m)) * 0.3, jnp.float32),
            jnp.asarray(rng.normal(size=outputs) * 0.2, jnp.float32),
            jnp.asarray(rng.normal(size=outputs) * 0.2, jnp.float32),
        ),
    )


def _numpy_posterior(head, h):
    """Per output: the predictive mean and variance and KL(q(u) || p(u))."""
    z = np.asarray(head.inducing, np.float64)
    means, variances, kls = [], [], []
    for o in range(head.mean.shape[0]):
        ell = np.exp(float(head.log_lengthscale[o]))
        s2 = np.exp(float(head.log_outputscale[o]))

        def k(a, b, ell=ell, s2=s2):
            d = ((a[:, None, :] - b[None, :, :]) ** 2).sum(-1)
            return s2 * np.exp(-0.5 * d / ell**2)

        kzz = k(z, z) + head.jitter * np.eye(len(z))
        chol = np.linalg.cholesky(kzz)
        raw = np.asarray(head.scale[o], np.float64)
        s_chol = np.tril(raw, -1) + np.diag(np.exp(np.diag(raw)))
        mu_u = chol @ np.asarray(head.mean[o], np.float64)  # unwhitened
        cov_u = chol @ s_chol @ s_chol.T @ chol.T
        kxz = k(h, z)
        proj = np.linalg.solve(kzz, kxz.T).T  # K_xz K_zz^-1
        means.append(proj @ mu_u)
        variances.append(
            s2 - (proj * kxz).sum(1) + np.einsum("ij,jk,ik->i", proj, cov_u, proj)
        )
        kzz_inv = np.linalg.inv(kzz)
        kls.append(
            0.5
            * (
                np.trace(kzz_inv @ cov_u)
                + mu_u @ kzz_inv @ mu_u
                - len(z)
                + np.linalg.slogdet(kzz)[1]
                - np.linalg.slogdet(cov_u)[1]
            )
        )
    return np.stack(means, 1), np.stack(variances, 1), float(np.sum(kls))


def test_the_posterior_and_kl_are_the_unwhitened_svgp():
    head = _head()
    h = np.random.default_rng(1).normal(size=(20, 3)) * 2
    mean, variance = jax.vmap(head)(jnp.asarray(h, jnp.float32))
    want_mean, want_variance, want_kl = _numpy_posterior(head, h)
    np.testing.assert_allclose(mean, want_mean, rtol=2e-3, atol=2e-4)
    np.testing.assert_allclose(variance, want_variance, rtol=2e-3, atol=2e-4)
    assert float(head.kl_divergence()) == pytest.approx(want_kl, rel=2e-3)


def test_the_gaussian_loss_is_the_negative_elbo_per_example():
    head = _head(seed=2)
    rng = np.random.default_rng(3)
    h, y = rng.normal(size=(30, 3)), rng.normal(size=(30, 2))
    noise, n = 0.3, 500
    got = head.gaussian_loss(
        jnp.asarray(h, jnp.float32), jnp.asarray(y, jnp.float32), noise, n
    )
    mean, variance, kl = _numpy_posterior(head, h)
    # E_q[log N(y | f, noise)] by Monte Carlo over f ~ N(mean, variance).
    f = mean + np.sqrt(variance) * rng.normal(size=(40_000, *mean.shape))
    log_lik = -0.5 * (np.log(2 * np.pi * noise) + (y - f) ** 2 / noise)
    want = -log_lik.mean(0).sum(1).mean() + kl / n
    assert float(got) == pytest.approx(want, rel=5e-3)


def test_the_softmax_loss_and_probabilities_are_monte_carlo_means():
    head = _head(seed=4, outputs=3)
    rng = np.random.default_rng(5)
    h, labels = rng.normal(size=(10, 3)), rng.integers(0, 3, 10)
    hj = jnp.asarray(h, jnp.float32)
    got = head.softmax_loss(
        hj, jnp.asarray(labels), 100, key=jax.random.key(0), samples=8_000
    )
    mean, variance, kl = _numpy_posterior(head, h)
    f = mean + np.sqrt(variance) * rng.normal(size=(100_000, *mean.shape))
    log_p = f - scipy.special.logsumexp(f, -1, keepdims=True)
    want = -np.take_along_axis(log_p, labels[None, :, None], -1).mean() + kl / 100
    assert float(got) == pytest.approx(want, abs=0.02)
    probabilities = head.probabilities(hj, key=jax.random.key(1), samples=8_000)
    np.testing.assert_allclose(probabilities, np.exp(log_p).mean(0), atol=0.02)


class DUE(eqx.Module):
    """A residual spectral-normalised extractor and a GP head (the paper's form)."""

    embed: eqx.nn.Linear
    block: eqx.nn.SpectralNorm
    head: ee.nn.InducingPointGP

    def __init__(self, key, x):
        embed_key, block_key, norm_key, pick_key = jax.random.split(key, 4)
        self.embed = eqx.nn.Linear(2, 16, key=embed_key)
        self.block = eqx.nn.SpectralNorm(
            eqx.nn.Linear(16, 16, key=block_key), "weight", key=norm_key
        )
        picked = jax.random.choice(pick_key, len(x), (10,), replace=False)
        self.head = ee.nn.InducingPointGP(jax.vmap(self.embed)(x[picked]), 2)

    def features(self, x, state):
        h = self.embed(x)
        out, state = self.block(h, state)
        return h + jax.nn.relu(out), state


def _blobs():
    rng = np.random.default_rng(0)
    y = rng.integers(0, 2, 128)
    x = rng.normal(size=(128, 2)) * 0.5 + np.where(y[:, None] == 1, 1.5, -1.5)
    return jnp.asarray(x, jnp.float32), jnp.asarray(y, jnp.int32)


def _loss(model, state, batch, key):
    x, y = batch
    h, state = jax.vmap(
        model.features, in_axes=(0, None), out_axes=(0, None), axis_name="batch"
    )(x, state)
    return model.head.softmax_loss(h, y, 128, key=key), state


def _train(steps, tmp=None, callbacks=()):
    x, y = _blobs()
    ens, state = ee.ensemble(
        eqx.nn.make_with_state(lambda k: DUE(k, x)), size=3, key=jax.random.key(0)
    )
    return ee.fit(
        ens, _loss, optax.adam(1e-2), (x, y), steps=steps, batch_size=32,
        key=jax.random.key(1), state=state, callbacks=list(callbacks),
        checkpoints=None if tmp is None else ee.Checkpoints(tmp, every=20),
    )  # fmt: skip


def test_an_ensemble_of_due_models_is_one_fit_and_distance_aware():
    result = _train(150)
    losses = result.history.losses
    assert losses.shape == (150, 3)
    assert (losses[-20:].mean(0) < losses[:20].mean(0)).all()
    x, y = _blobs()
    far = jnp.full((4, 2), 12.0)

    def predict(model, state, inputs):
        model = eqx.nn.inference_mode(model)
        h, _ = jax.vmap(model.features, (0, None), (0, None))(inputs, state)
        return jax.vmap(model.head)(h)

    mean, variance = ee.map(
        predict, result.ensemble, result.state, x, in_axes=(0, None)
    )
    far_mean, far_variance = ee.map(
        predict, result.ensemble, result.state, far, in_axes=(0, None)
    )
    assert (jnp.mean(jnp.argmax(mean, -1) == y[None], axis=1) > 0.9).all()
    # Far from every inducing point the variance returns to the prior's.
    assert (far_variance.min(axis=(1, 2)) > 2 * variance.mean(axis=(1, 2))).all()
    for i, member in enumerate(ee.unstack(result.ensemble)):
        state = jax.tree.map(lambda leaf, i=i: leaf[i], result.state)
        alone = predict(member, state, x)
        np.testing.assert_allclose(alone[0], mean[i], rtol=1e-5, atol=1e-6)


def test_an_interrupted_due_run_resumes_bit_for_bit(tmp_path):
    reference = _train(60)

    with pytest.raises(Interrupt):
        _train(60, tmp_path, [interrupt_at(40)])
    resumed = _train(60, tmp_path)
    assert resumed.resumed_from == 40
    for a, b in zip(
        jax.tree.leaves((resumed.ensemble, resumed.state, resumed.opt_state)),
        jax.tree.leaves((reference.ensemble, reference.state, reference.opt_state)),
        strict=True,
    ):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(resumed.history.losses, reference.history.losses)


def test_bad_inputs_are_refused_by_name():
    head, key = _head(), jax.random.key(0)
    with pytest.raises(ValueError, match=r"features of shape \(3,\).*\(4,\)"):
        head(jnp.ones(4))
    with pytest.raises((ValueError, TypeError), match="inducing"):
        ee.nn.InducingPointGP(jnp.ones(5), 2)
    with pytest.raises(ValueError, match="lengthscale"):
        ee.nn.InducingPointGP(jnp.ones((5, 3)), 2, lengthscale=0.0)
    with pytest.raises(ValueError, match="noise_variance"):
        head.gaussian_loss(jnp.ones((2, 3)), jnp.ones((2, 2)), 0.0, 10)
    with pytest.raises(Exception, match="labels"):
        eqx.filter_jit(lambda h, labels: head.softmax_loss(h, labels, 10, key=key))(
            jnp.ones((2, 3)), jnp.array([0, 2])
        )
