"""SNGP (Liu et al. 2020): bounded spectral normalisation, a random-feature
Gaussian-process output layer and its Laplace posterior."""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float, PRNGKeyArray, UInt32

from .._internal.checks import check_positive, check_positive_int


class BoundedSpectralNorm(eqx.nn.StatefulLayer):
    """`eqx.nn.SpectralNorm` with SNGP's norm bound `c`: the weight becomes
    `W / max(1, sigma / c)`, its top singular value at most `c` (Equinox's layer
    alone divides by `sigma`: the bound 1, always reached). `sigma` is Equinox's
    power-iteration estimate, kept in `eqx.nn.State`.

    **Example:**

    ```python
    linear = eqx.nn.Linear(4, 8, key=jax.random.key(0))
    norm = eqx.nn.SpectralNorm(linear, "weight", key=jax.random.key(1))
    layer, state = eqx.nn.make_with_state(ee.nn.BoundedSpectralNorm)(norm, 0.9)
    out, state = layer(jnp.ones(4), state)
    ```
    """

    norm: eqx.nn.SpectralNorm
    bound: float = eqx.field(
        static=True, converter=lambda c: check_positive(c, "bound")
    )

    def __call__(
        self, x: Array, state: eqx.nn.State, *, key: PRNGKeyArray | None = None
    ) -> tuple[Array, eqx.nn.State]:
        _, state = self.norm(x, state)  # advances the power iteration
        u, v = state.get(self.norm.uv_index)
        name, layer = self.norm.weight_name, self.norm.layer
        weight = getattr(layer, name)
        sigma = u @ weight.reshape(weight.shape[0], -1) @ v
        bounded = weight / jnp.maximum(1.0, sigma / self.bound)
        return eqx.tree_at(lambda m: getattr(m, name), layer, bounded)(x), state


class RandomFeatureGP(eqx.Module):
    """SNGP's output layer (Liu et al. 2020): a Gaussian process approximated by
    `D` random Fourier features `phi(h) = sqrt(2 / D) cos(W h + b)`,
    `W ~ N(0, 1 / lengthscale^2)`, `b ~ U(0, 2 pi)` (`phi(h) . phi(h')` tends to
    the RBF kernel `exp(-|h - h'|^2 / (2 lengthscale^2))`), then a trained layer:
    the call returns `beta @ phi(h)`, the logits or the mean. `W` and `b` are
    fixed: the layer holds only their key (`seed`, integers that no optimizer
    changes, weight decay included) and draws them in each call.

    **Arguments:** `in_features`, `out_features` (the widths of `h` and of the
    output), `num_features` (`D`), `lengthscale`, `key` (for `W`, `b`, `beta`).

    **Example:**

    ```python
    head = ee.nn.RandomFeatureGP(8, 3, num_features=128, key=jax.random.key(0))
    head(jnp.ones(8)).shape, head.features(jnp.ones(8)).shape   # (3,), (128,)
    ```
    """

    seed: UInt32[Array, " _"]
    beta: Float[Array, "out features"]
    in_features: int = eqx.field(static=True)
    num_features: int = eqx.field(static=True)
    lengthscale: float = eqx.field(static=True)

    def __init__(
        self,
        in_features: int,
        out_features: int,
        num_features: int = 1024,
        *,
        lengthscale: float = 1.0,
        key: PRNGKeyArray,
    ):
        self.in_features = check_positive_int(in_features, "in_features")
        self.num_features = check_positive_int(num_features, "num_features")
        shape = (check_positive_int(out_features, "out_features"), self.num_features)
        self.lengthscale = check_positive(lengthscale, "lengthscale")
        feature_key, beta_key = jax.random.split(key)
        self.seed = jax.random.key_data(feature_key)
        self.beta = jax.random.normal(beta_key, shape) / math.sqrt(num_features)

    def features(self, h: Float[Array, " in"]) -> Float[Array, " features"]:
        """The random features `phi(h)` of ONE example."""
        if h.shape != (self.in_features,):
            raise ValueError(
                f"RandomFeatureGP: `h` must have shape ({self.in_features},) "
                f"(`in_features`), got {h.shape}; call it on one example"
            )
        w_key, b_key = jax.random.split(jax.random.wrap_key_data(self.seed))
        w = jax.random.normal(w_key, (self.num_features, self.in_features), h.dtype)
        b = jax.random.uniform(b_key, (self.num_features,), h.dtype, 0, 2 * math.pi)
        return math.sqrt(2 / self.num_features) * jnp.cos(w @ h / self.lengthscale + b)

    def __call__(
        self, h: Float[Array, " in"], *, key: PRNGKeyArray | None = None
    ) -> Float[Array, " out"]:
        return self.beta @ self.features(h)


def gp_covariance(
    features: Float[ArrayLike, "*members batch dim"],
    logits: Float[ArrayLike, "*members batch classes"] | None = None,
    *,
    prior_variance: float = 1.0,
    noise_variance: float = 1.0,
) -> Float[Array, "*members dim dim"]:
    """The Laplace posterior covariance of a
    [`RandomFeatureGP`][eqx_ensemble.nn.RandomFeatureGP]'s `beta`, one `D x D`
    matrix per member: `Sigma = (I / prior_variance + sum_i w_i phi_i phi_i^T)^-1`
    over the training inputs' `features` `phi_i`, `(members, batch, D)` (from
    `ee.map`) or `(batch, D)`. The paper sums over the last epoch (with momentum);
    this exact form, one pass after training, is more precise. `w_i` is:

    - regression (`logits=None`): `1 / noise_variance`: the exact GP posterior on
      the features, whose mean for `beta` is `Sigma Phi^T y / noise_variance`.
    - classification (`logits` at the same inputs): `p_i (1 - p_i)`, `p_i` the
      sigmoid of one logit or the largest softmax probability (one covariance
      for all classes, not the paper's one per class).

    **Example:**

    ```python
    heads = ee.ensemble(lambda k: ee.nn.RandomFeatureGP(2, 3, 64, key=k), size=4,
                        key=jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (100, 2))
    phi = ee.map(lambda m, x: jax.vmap(m.features)(x), heads, x)   # (4, 100, 64)
    ee.nn.gp_covariance(phi, ee.predict(heads, x)).shape           # (4, 64, 64)
    ```
    """
    phi, prior = jnp.asarray(features), check_positive(prior_variance, "prior_variance")
    noise = check_positive(noise_variance, "noise_variance")
    out = None if logits is None else jnp.asarray(logits)
    if phi.ndim < 2 or (out is not None and out.shape[:-1] != phi.shape[:-1]):
        raise ValueError(
            f"`features` {phi.shape} and `logits` {getattr(out, 'shape', None)} "
            "must be (..., batch, D) and (..., batch, classes)"
        )
    if out is None:
        weights = jnp.full(phi.shape[:-1], 1 / noise, phi.dtype)
    else:
        p = jax.nn.softmax(out, axis=-1).max(-1)
        p = jax.nn.sigmoid(out[..., 0]) if out.shape[-1] == 1 else p
        weights = (p * (1 - p)).astype(phi.dtype)
    precision = jnp.einsum("...n,...nd,...ne->...de", weights, phi, phi)
    diagonal = jnp.arange(phi.shape[-1])
    return jnp.linalg.inv(precision.at[..., diagonal, diagonal].add(1 / prior))


def gp_variance(
    covariance: Float[ArrayLike, "*members dim dim"],
    features: Float[ArrayLike, "*members batch dim"],
) -> Float[Array, "*members batch"]:
    """The predictive variance `phi*^T Sigma phi*` of each input (without a
    regression's noise), from [`gp_covariance`][eqx_ensemble.nn.gp_covariance].

    **Example:**

    ```python
    phi = jnp.ones((2, 5, 3)) / 3                  # 2 members, 5 inputs, D = 3
    ee.nn.gp_variance(ee.nn.gp_covariance(phi), phi).shape      # (2, 5)
    ```
    """
    sigma, phi = jnp.asarray(covariance), jnp.asarray(features)
    if sigma.shape[:-2] + sigma.shape[-1:] != phi.shape[:-2] + phi.shape[-1:]:
        raise ValueError(
            f"`covariance` {sigma.shape} is not (..., D, D) for `features` {phi.shape}"
        )
    return jnp.einsum("...nd,...de,...ne->...n", phi, sigma, phi)


def mean_field_logits(
    logits: Float[ArrayLike, "*members batch classes"],
    variance: Float[ArrayLike, "*members batch"],
) -> Float[Array, "*members batch classes"]:
    """SNGP's mean-field predictive `logits / sqrt(1 + (pi / 8) variance)`:
    far from the data (large variance) the probabilities flatten.

    **Example:**

    ```python
    ee.nn.mean_field_logits(jnp.array([[4.0, 0.0]]), jnp.array([8 / jnp.pi]))
    # [[2.83, 0.0]]: 4 / sqrt(2)
    ```
    """
    logits, variance = jnp.asarray(logits), jnp.asarray(variance)
    if variance.shape != logits.shape[:-1]:
        raise ValueError(
            f"`variance` {variance.shape} must be `logits.shape[:-1]` ({logits.shape})"
        )
    return logits / jnp.sqrt(1 + (math.pi / 8) * variance)[..., None]
