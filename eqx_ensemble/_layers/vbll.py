"""Variational Bayesian last layers (Harrison, Willes & Snoek 2024): a Gaussian
posterior over a last layer's weights, trained by the paper's closed-form bounds."""

import math
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float, PRNGKeyArray

from .._internal.checks import check_positive, check_positive_int
from .._internal.tree import is_traced
from ..predictive import Normal


class _VBLL(eqx.Module):
    """`q(W)`: row `k` of `W` is `N(mean[k], L_k L_k^T)`, `L_k` the lower triangle
    of `cholesky[k]` with the exponential of its diagonal (so positive); the prior
    is `N(0, prior_scale^2 I)`."""

    mean: Float[Array, "out in"]
    cholesky: Float[Array, "out in in"]
    prior_scale: float = eqx.field(static=True)

    def _init(self, in_features: int, out: int, *, prior_scale=1.0, key) -> None:
        check_positive_int(in_features, "in_features")
        check_positive_int(out, "out_features")
        prior_scale = check_positive(prior_scale, "prior_scale")
        self.mean = jax.random.normal(key, (out, in_features)) / in_features**0.5
        log_std = math.log(prior_scale / in_features**0.5)
        self.cholesky = jnp.broadcast_to(
            log_std * jnp.eye(in_features), self.mean.shape + (in_features,)
        )
        self.prior_scale = float(prior_scale)

    def _tril(self) -> Array:
        eye, raw = jnp.eye(self.cholesky.shape[-1], dtype=bool), self.cholesky
        return jnp.where(eye, jnp.exp(jnp.where(eye, raw, 0.0)), jnp.tril(raw, -1))

    def _moments(self, features: Any, ndim: int) -> tuple[Array, Array]:
        """The mean `m_k phi` and variance `phi^T S_k phi` of `W phi` under `q`."""
        features = jnp.asarray(features)
        width = self.mean.shape[1]
        if features.ndim != ndim or features.shape[-1] != width:
            raise ValueError(
                f"`features` must have {ndim} axes, the last of the head's "
                f"in_features={width}, got shape {tuple(features.shape)}"
            )
        projected = jnp.einsum("...i,kij->...kj", features, self._tril())
        return features @ self.mean.T, jnp.sum(projected**2, -1)

    def kl(self) -> Float[Array, ""]:
        """`KL(q(W) || N(0, prior_scale^2 I))`, summed over the outputs."""
        variance, size = self.prior_scale**2, self.mean.size
        log_det = 2 * jnp.trace(self.cholesky, axis1=1, axis2=2).sum()
        squares = jnp.sum(self._tril() ** 2) + jnp.sum(self.mean**2)
        return 0.5 * (squares / variance - size + size * math.log(variance) - log_det)

    def loss(
        self, features: Float[ArrayLike, "batch in"], y: ArrayLike, num_examples: int
    ) -> Float[Array, ""]:
        """The negative ELBO per example, `num_examples` the training set's size."""
        check_positive_int(num_examples, "num_examples")
        bound = self._bound(*self._moments(features, 2), jnp.asarray(y))
        return -jnp.mean(bound) + self.kl() / num_examples

    def _bound(self, mean: Array, variance: Array, y: Array) -> Array:
        raise NotImplementedError


class VBLLRegression(_VBLL):
    """A variational Bayesian last layer for regression (Harrison, Willes & Snoek
    2024, "Variational Bayesian Last Layers"): `y = W phi + noise`, `noise ~ N(0,
    Sigma)` with a learned diagonal `Sigma`, and a Gaussian posterior `q(W)` whose
    row `k` is `N(mean[k], S_k)`, `S_k = L_k L_k^T` (`L_k` lower triangular, its
    diagonal the exponential of a parameter); the prior is `N(0, prior_scale^2 I)`.

    Called on one example's features `phi`, it returns the predictive
    `ee.predictive.Normal(mean @ phi, sqrt(phi^T S_k phi + Sigma_k))`.
    `loss(features, y, num_examples)` is the negative of the paper's ELBO per
    example (no sampling): the mean over the batch of `-log N(y | mean @ phi, Sigma)
    + sum_k phi^T S_k phi / (2 Sigma_k)`, plus `kl() / num_examples`. With one `S`
    shared by the outputs (the paper's matrix normal) the trace term is its
    `phi^T S phi tr(Sigma^-1) / 2`.

    **Arguments:** `in_features`, `out_features` (the widths), `prior_scale` (the
    prior's standard deviation) and `key` (for the posterior mean).

    **Example:**

    ```python
    make = lambda k: eqx.nn.Sequential([eqx.nn.MLP(1, 16, 32, 1, key=k),
        ee.nn.VBLLRegression(16, 1, key=jax.random.fold_in(k, 1))])

    def loss(model, batch, key):       # the features, then the head's bound
        x, y = batch
        return model[-1].loss(jax.vmap(model[:-1])(x), y, num_examples=64)

    x = jnp.linspace(-1, 1, 64)[:, None]
    ens = ee.ensemble(make, size=3, key=jax.random.key(0))
    fitted = ee.fit(ens, loss, optax.adam(1e-2), (x, jnp.sin(3 * x)), steps=50,
                    batch_size=16, key=jax.random.key(1), callbacks=())
    ee.predict(fitted.ensemble, x).variance().shape        # (3, 64, 1)
    ```
    """

    log_noise: Float[Array, " out"]

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        prior_scale: float = 1.0,
        key: PRNGKeyArray,
    ):
        self._init(in_features, out_features, prior_scale=prior_scale, key=key)
        self.log_noise = jnp.zeros(out_features)

    def __call__(
        self, features: Float[ArrayLike, " in"], *, key: PRNGKeyArray | None = None
    ) -> Normal:
        mean, variance = self._moments(features, 1)
        return Normal(mean, jnp.sqrt(variance + jnp.exp(self.log_noise)))

    def _bound(self, mean: Array, variance: Array, y: Array) -> Array:
        if y.shape != mean.shape:
            raise ValueError(
                f"`y` (the targets) must have shape {mean.shape} (batch, "
                f"out_features), got {tuple(y.shape)}"
            )
        noise = jnp.exp(self.log_noise)[None]
        nll = jnp.log(2 * math.pi * noise) + ((y - mean) ** 2 + variance) / noise
        return -0.5 * jnp.sum(nll, -1)


class VBLLClassification(_VBLL):
    """A variational Bayesian last layer for classification, the paper's
    discriminative one (Harrison, Willes & Snoek 2024): logits `W phi` with a
    Gaussian posterior `q(W)` as in
    [`VBLLRegression`][eqx_ensemble.nn.VBLLRegression] (row `k`, class `k`'s
    weights, is `N(mean[k], S_k)`).

    `loss(features, y, num_examples)` (`y` the labels) is the negative of the
    paper's Jensen bound per example, `E_q log softmax(W phi)_y >= mean[y] @ phi -
    logsumexp_k(mean[k] @ phi + phi^T S_k phi / 2)`, averaged over the batch, plus
    `kl() / num_examples`.

    Called on one example's features, it returns the log of the predictive's class
    probabilities by the mean-field approximation (Lu, Ie & Sha 2020):
    `log_softmax(mean @ phi / sqrt(1 + pi/8 phi^T S_k phi))`; pass them to the
    metrics with `from_logits=True`.

    **Arguments:** as [`VBLLRegression`][eqx_ensemble.nn.VBLLRegression]'s,
    `out_features` the number of classes.

    **Example:**

    ```python
    head = ee.nn.VBLLClassification(8, 3, key=jax.random.key(0))
    features = jax.random.normal(jax.random.key(1), (5, 8))
    head.loss(features, jnp.array([0, 1, 2, 0, 1]), num_examples=100)
    jnp.exp(jax.vmap(head)(features)).sum(-1)         # ones: probabilities
    ```
    """

    def __init__(self, in_features: int, out_features: int, **kwargs: Any):
        self._init(in_features, out_features, **kwargs)

    def __call__(
        self, features: Float[ArrayLike, " in"], *, key: PRNGKeyArray | None = None
    ) -> Float[Array, " classes"]:
        mean, variance = self._moments(features, 1)
        return jax.nn.log_softmax(mean / jnp.sqrt(1 + math.pi / 8 * variance))

    def _bound(self, mean: Array, variance: Array, y: Array) -> Array:
        classes = mean.shape[-1]
        ok = y.shape == mean.shape[:1] and y.dtype.kind in "iu"
        if not ok or not (is_traced(y) or 0 <= y.min() <= y.max() < classes):
            raise ValueError(
                f"`y` (the labels) must be integers in [0, {classes}) of shape "
                f"{mean.shape[:1]}, got {y.dtype}{tuple(y.shape)}"
                + ("" if not ok else f" from {y.min()} to {y.max()}")
            )
        chosen = jnp.take_along_axis(mean, y[:, None], -1)[:, 0]
        return chosen - jax.nn.logsumexp(mean + variance / 2, -1)
