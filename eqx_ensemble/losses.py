"""Losses of ONE model's probabilistic outputs, to write a `fit` loss with:
heteroscedastic regression beyond the Gaussian NLL.

- [`gaussian_nll`][eqx_ensemble.losses.gaussian_nll]: the Gaussian negative
  log-likelihood of a predicted mean and variance (the deep-ensembles paper's
  proper scoring rule).
- [`beta_nll`][eqx_ensemble.losses.beta_nll]: each example's Gaussian NLL
  weighted by its predicted variance to the power `beta`, held constant (Seitzer
  et al. 2022): the mean is no longer neglected where the variance is large.
- [`student_t_nll`][eqx_ensemble.losses.student_t_nll]: the Student-t negative
  log-likelihood (heavy tails: robust to outliers).

Each takes one model's outputs for a batch (any matching shapes) and returns
the mean over its elements; wrap it in a loss of the model:

```python
def loss(model, batch, key):
    x, y = batch
    out = jax.vmap(model)(x)                        # (batch, 2): mean, raw variance
    variance = jax.nn.softplus(out[:, 1]) + 1e-6
    return ee.losses.beta_nll(out[:, 0], variance, y, beta=0.5)

ens = ee.ensemble(lambda k: eqx.nn.MLP(1, 2, 16, 1, key=k), size=3,
                  key=jax.random.key(0))
x = jax.random.uniform(jax.random.key(1), (64, 1))
result = ee.fit(ens, loss, optax.adam(1e-2), (x, jnp.sin(6 * x[:, 0])), steps=50,
                batch_size=16, key=jax.random.key(2), callbacks=())
```
"""

import math

import jax
import jax.numpy as jnp
from jax.scipy.special import gammaln
from jaxtyping import Array, ArrayLike, Float

from ._internal.tree import is_traced

__all__ = ["gaussian_nll", "beta_nll", "student_t_nll"]


def _floored(variance: Array) -> Array:
    return jnp.maximum(variance, jnp.finfo(variance.dtype).tiny)


def _elementwise_gaussian_nll(mean: Array, variance: Array, target: Array) -> Array:
    variance = _floored(variance)
    return 0.5 * (jnp.log(2 * math.pi * variance) + (target - mean) ** 2 / variance)


def _arrays(*values: ArrayLike) -> list[Array]:
    arrays = [jnp.asarray(value) for value in values]
    shapes = {tuple(array.shape) for array in arrays}
    if len(shapes) != 1:
        raise ValueError(
            "the predictions and targets must have one shape (one model's outputs "
            f"for a batch), got shapes {[tuple(a.shape) for a in arrays]}"
        )
    return arrays


def gaussian_nll(
    mean: Float[ArrayLike, "*batch"],
    variance: Float[ArrayLike, "*batch"],
    target: Float[ArrayLike, "*batch"],
) -> Float[Array, ""]:
    """The Gaussian negative log-likelihood `0.5 log(2 pi s^2) + (y - m)^2 /
    (2 s^2)`, averaged over the elements (a variance of 0 is raised to the
    smallest normal number).

    **Arguments:**

    - `mean`, `variance`, `target`: one model's predicted means and variances
      and the targets, all of one shape.

    **Returns:**

    A scalar.

    **Example:**

    ```python
    ee.losses.gaussian_nll(jnp.zeros(3), jnp.ones(3), jnp.zeros(3))  # 0.919
    ```
    """
    mean, variance, target = _arrays(mean, variance, target)
    return jnp.mean(_elementwise_gaussian_nll(mean, variance, target))


def beta_nll(
    mean: Float[ArrayLike, "*batch"],
    variance: Float[ArrayLike, "*batch"],
    target: Float[ArrayLike, "*batch"],
    *,
    beta: float = 0.5,
) -> Float[Array, ""]:
    """beta-NLL (Seitzer et al. 2022): each element's Gaussian NLL times its
    predicted variance to the power `beta`, the weight held constant
    (`stop_gradient`), averaged. `beta=0` is the Gaussian NLL; `beta=1` gives
    the mean the gradient of the squared error `(m - y)`; the paper recommends
    `0.5`.

    **Arguments:**

    - `mean`, `variance`, `target`: as in
      [`gaussian_nll`][eqx_ensemble.losses.gaussian_nll].
    - `beta`: the exponent, in `[0, 1]`.

    **Returns:**

    A scalar.

    **Example:**

    ```python
    grad = jax.grad(ee.losses.beta_nll)(jnp.array([1.0]), jnp.array([4.0]),
                                         jnp.array([0.0]), beta=1.0)
    grad                                             # [1.0]: m - y, as MSE's
    ```
    """
    if isinstance(beta, bool) or not isinstance(beta, int | float):
        raise TypeError(f"`beta` must be a number in [0, 1], got {beta!r}")
    if not 0 <= beta <= 1:
        raise ValueError(f"`beta` must lie in [0, 1], got {beta}")
    mean, variance, target = _arrays(mean, variance, target)
    weight = jax.lax.stop_gradient(_floored(variance) ** beta)
    return jnp.mean(weight * _elementwise_gaussian_nll(mean, variance, target))


def student_t_nll(
    mean: Float[ArrayLike, "*batch"],
    scale: Float[ArrayLike, "*batch"],
    df: Float[ArrayLike, "*batch"] | float,
    target: Float[ArrayLike, "*batch"],
) -> Float[Array, ""]:
    """The Student-t negative log-likelihood of the targets under location
    `mean`, `scale` and `df` degrees of freedom (`scipy.stats.t(df, mean,
    scale)`), averaged over the elements: heavy tails, so an outlier costs
    logarithmically, not quadratically.

    **Arguments:**

    - `mean`, `scale`: one model's predicted locations and (positive) scales.
    - `df`: the degrees of freedom (positive), one for all or one per element
      (e.g. predicted, through a softplus).
    - `target`: the targets, the shape of `mean`.

    **Returns:**

    A scalar.

    **Example:**

    ```python
    ee.losses.student_t_nll(jnp.zeros(2), jnp.ones(2), 3.0, jnp.array([0.0, 10.0]))
    ```
    """
    mean, scale, target = _arrays(mean, scale, target)
    df = jnp.broadcast_to(jnp.asarray(df, mean.dtype), mean.shape)
    if not is_traced(df) and not bool(jnp.all(df > 0)):
        raise ValueError(
            f"`df` must be positive (degrees of freedom), got a minimum of "
            f"{float(jnp.min(df))}"
        )
    scale = _floored(scale)
    z = (target - mean) / scale
    log_density = (
        gammaln((df + 1) / 2)
        - gammaln(df / 2)
        - 0.5 * jnp.log(df * math.pi)
        - jnp.log(scale)
        - (df + 1) / 2 * jnp.log1p(z**2 / df)
    )
    return -jnp.mean(log_density)
