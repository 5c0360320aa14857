"""A sparse variational Gaussian-process output layer: DUE's head."""

import math
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float, Int, PRNGKeyArray

from .._internal.tree import is_traced


class InducingPointGP(eqx.Module):
    """One Gaussian process per output over a network's features, with `M`
    inducing points and a whitened Cholesky variational posterior (Hensman et
    al. 2015): the head of DUE (van Amersfoort et al. 2021, "On Feature
    Collapse and Deep Kernel Learning for Single Forward Pass Uncertainty"),
    on a spectral-normalised feature extractor. RBF kernel with a lengthscale
    and an output scale per output; the inducing points are trained.

    Written for ONE model: `head(h)` gives the mean and variance of `f(h)`
    under the posterior; the losses are the negative ELBO per example
    (`gaussian_loss`, `softmax_loss`). An ensemble of DUE models is one
    `ee.ensemble` and one `ee.fit`.

    **Arguments:**

    - `inducing`: the initial inducing points, `(M, features)`; DUE takes the
      k-means centres of the untrained extractor's features of a random subset.
    - `outputs`: the number of outputs (classes for `softmax_loss`).
    - `lengthscale`, `outputscale`: the kernel's initial values; by default
      the lengthscale is the mean distance between the inducing points (DUE's
      initialisation, from the features' own scale).
    - `jitter`: added to the inducing points' kernel matrix's diagonal.

    ```python
    h = jax.random.normal(jax.random.key(0), (64, 4))     # features of 64 inputs
    head = ee.nn.InducingPointGP(h[:10], outputs=3)
    mean, variance = jax.vmap(head)(h)                    # (64, 3) each
    labels = jnp.zeros(64, jnp.int32)
    loss = head.softmax_loss(h, labels, num_examples=1000, key=jax.random.key(1))
    ```
    """

    inducing: Float[Array, "inducing features"]
    mean: Float[Array, "outputs inducing"]
    scale: Float[Array, "outputs inducing inducing"]  # log diagonal, lower part
    log_lengthscale: Float[Array, " outputs"]
    log_outputscale: Float[Array, " outputs"]
    jitter: float = eqx.field(static=True)

    def __init__(
        self,
        inducing: Float[ArrayLike, "inducing features"],
        outputs: int,
        *,
        lengthscale: float | None = None,
        outputscale: float = 1.0,
        jitter: float = 1e-4,
    ):
        inducing = jnp.asarray(inducing, float)
        bad_scale = outputscale <= 0 or (lengthscale is not None and lengthscale <= 0)
        if inducing.ndim != 2 or outputs < 1 or bad_scale:
            raise ValueError(
                "`inducing` must be (M, features), `outputs` at least 1 and the "
                f"scales positive; got inducing of shape {inducing.shape}, "
                f"outputs={outputs}, lengthscale={lengthscale}, "
                f"outputscale={outputscale}"
            )
        m = inducing.shape[0]
        scale: Any = lengthscale
        if scale is None:  # DUE's: the mean distance between the points
            distances = jnp.sqrt(
                jnp.sum((inducing[:, None] - inducing[None]) ** 2, -1) + 1e-12
            )
            scale = jnp.sum(distances) / max(m * (m - 1), 1)
        self.inducing = inducing
        self.mean = jnp.zeros((outputs, m))
        self.scale = jnp.zeros((outputs, m, m))  # the prior: identity
        self.log_lengthscale = jnp.full((outputs,), jnp.log(scale))
        self.log_outputscale = jnp.full((outputs,), math.log(outputscale))
        self.jitter = jitter

    def _parts(self) -> tuple[Array, Array]:
        """Per output: the inducing kernel's Cholesky factor and the
        variational scale `S` (lower triangular, positive diagonal)."""
        kzz = jax.vmap(self._kernel, (None, None, 0, 0))(
            self.inducing, self.inducing, self.log_lengthscale, self.log_outputscale
        )
        eye = jnp.eye(self.inducing.shape[0])
        chol = jnp.linalg.cholesky(kzz + self.jitter * eye[None])
        diagonal = jnp.exp(jnp.diagonal(self.scale, axis1=-2, axis2=-1))
        scale = jnp.tril(self.scale, -1) + diagonal[:, :, None] * eye[None]
        return chol, scale

    @staticmethod
    def _kernel(a: Array, b: Array, log_lengthscale: Array, log_scale: Array):
        squared = jnp.sum((a[:, None, :] - b[None, :, :]) ** 2, -1)
        return jnp.exp(log_scale - 0.5 * squared * jnp.exp(-2 * log_lengthscale))

    def __call__(
        self, h: Float[Array, " features"]
    ) -> tuple[Float[Array, " outputs"], Float[Array, " outputs"]]:
        """The posterior mean and variance of each output at features `h`."""
        if h.shape != self.inducing.shape[1:]:
            raise ValueError(
                f"the GP head takes features of shape {self.inducing.shape[1:]} "
                f"(its inducing points' width), got {h.shape}"
            )
        chol, scale = self._parts()

        def one(chol, scale, mean, log_lengthscale, log_scale):
            kzx = self._kernel(self.inducing, h[None], log_lengthscale, log_scale)
            a = jax.scipy.linalg.solve_triangular(chol, kzx[:, 0], lower=True)
            variance = jnp.exp(log_scale) - a @ a + jnp.sum((scale.T @ a) ** 2)
            return a @ mean, jnp.maximum(variance, 1e-10)

        return jax.vmap(one)(
            chol, scale, self.mean, self.log_lengthscale, self.log_outputscale
        )

    def kl_divergence(self) -> Float[Array, ""]:
        """KL(q(u) || p(u)), summed over the outputs (whitened: against N(0, I))."""
        _, scale = self._parts()
        m = self.inducing.shape[0]
        log_det = 2 * jnp.sum(jnp.log(jnp.diagonal(scale, axis1=-2, axis2=-1)))
        return 0.5 * (
            jnp.sum(scale**2) + jnp.sum(self.mean**2) - m * len(scale) - log_det
        )

    def gaussian_loss(
        self,
        h: Float[Array, "batch features"],
        targets: Float[Array, "batch outputs"],
        noise_variance: Float[ArrayLike, ""],
        num_examples: int,
    ) -> Float[Array, ""]:
        """The negative ELBO per example for `targets ~ N(f(h), noise_variance)`:
        the expected log-likelihood is closed form, `log N(y | mean,
        noise) - variance / (2 noise)`; the KL is divided by `num_examples`."""
        mean, variance = jax.vmap(self)(h)
        noise = jnp.asarray(noise_variance)
        if not is_traced(noise) and not bool(jnp.all(noise > 0)):
            raise ValueError(f"`noise_variance` must be positive, got {noise}")
        expected = -0.5 * (
            jnp.log(2 * jnp.pi * noise) + ((targets - mean) ** 2 + variance) / noise
        )
        return -jnp.mean(jnp.sum(expected, -1)) + self.kl_divergence() / num_examples

    def softmax_loss(
        self,
        h: Float[Array, "batch features"],
        labels: Int[Array, " batch"],
        num_examples: int,
        *,
        key: PRNGKeyArray,
        samples: int = 8,
    ) -> Float[Array, ""]:
        """The negative ELBO per example for a softmax likelihood, its expected
        log-likelihood a Monte Carlo mean over `samples` draws of `f(h)`."""
        classes = self.mean.shape[0]
        labels = eqx.error_if(
            labels,
            (labels < 0) | (labels >= classes),
            f"`labels` must lie in [0, {classes}) (the GP head's outputs)",
        )
        draws = self._draws(h, key, samples)  # (samples, batch, classes)
        picked = jnp.take_along_axis(
            jax.nn.log_softmax(draws), labels[None, :, None], -1
        )
        return -jnp.mean(picked) + self.kl_divergence() / num_examples

    def probabilities(
        self, h: Float[Array, "batch features"], *, key: PRNGKeyArray, samples: int = 32
    ) -> Float[Array, "batch outputs"]:
        """The predictive class probabilities: the mean softmax over draws."""
        return jnp.mean(jax.nn.softmax(self._draws(h, key, samples)), 0)

    def _draws(self, h: Array, key: PRNGKeyArray, samples: int) -> Array:
        mean, variance = jax.vmap(self)(h)
        noise = jax.random.normal(key, (samples, *mean.shape), mean.dtype)
        return mean[None] + jnp.sqrt(variance)[None] * noise
