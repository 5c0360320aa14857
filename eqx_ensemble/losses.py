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
- [`evidential_regression`][eqx_ensemble.losses.evidential_regression] and
  [`evidential_classification`][eqx_ensemble.losses.evidential_classification]:
  single-pass evidential heads (a Normal-Inverse-Gamma, a Dirichlet) whose
  spread stands in for an ensemble's.

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
import numbers

import jax
import jax.numpy as jnp
import numpy as np
from jax.scipy.special import digamma, gammaln
from jaxtyping import Array, ArrayLike, Float

from ._internal.tree import is_traced

__all__ = [
    "gaussian_nll",
    "beta_nll",
    "student_t_nll",
    "evidential_regression",
    "evidential_classification",
]


def _floored(variance: Array) -> Array:
    return jnp.maximum(variance, jnp.finfo(variance.dtype).tiny)


def _check_not_negative(name: str, value: Array) -> None:
    # Outside a trace (a value the caller can see): a negative variance or
    # scale has no likelihood, and flooring it would score it as the smallest
    # one (`gaussian_nll` of a variance of -1: -7.56, not an error).
    if not is_traced(value) and bool(jnp.any(value < 0)):
        raise ValueError(
            f"`{name}` must not be negative, got a minimum of {float(jnp.min(value))}"
            f" (shape {tuple(value.shape)}); pass e.g. `softplus(raw) + 1e-6`"
        )


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
    _check_not_negative("variance", variance)
    return jnp.mean(_elementwise_gaussian_nll(mean, variance, target))


def beta_nll(
    mean: Float[ArrayLike, "*batch"],
    variance: Float[ArrayLike, "*batch"],
    target: Float[ArrayLike, "*batch"],
    *,
    beta: float | np.floating = 0.5,
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
    if isinstance(beta, bool | np.bool_) or not isinstance(beta, numbers.Real):
        raise TypeError(f"`beta` must be a number in [0, 1], got {beta!r}")
    beta = float(beta)
    if not 0 <= beta <= 1:
        raise ValueError(f"`beta` must lie in [0, 1], got {beta}")
    mean, variance, target = _arrays(mean, variance, target)
    _check_not_negative("variance", variance)
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
    _check_not_negative("scale", scale)
    scale = _floored(scale)
    z = (target - mean) / scale
    infinite = jnp.isinf(df)
    finite_df = jnp.where(infinite, 1.0, df)
    # `(df + 1) / 2 * log1p(z^2 / df)`, whose limit at `df = inf` is `z^2 / 2`
    # (the Gaussian's), where `inf * 0` would be NaN.
    tail = jnp.where(
        infinite, 0.5 * z**2, (finite_df + 1) / 2 * jnp.log1p(z**2 / finite_df)
    )
    log_density = _log_t_normaliser(df) - jnp.log(scale) - tail
    return -jnp.mean(log_density)


# Above this many degrees of freedom the normaliser's gamma functions are
# replaced by their asymptotic series (float32's `gammaln` difference loses
# the digits: at df = 1e6 the NLL was 1.3468 against SciPy's 1.2857).
_SERIES_DF = 16.0


def _log_t_normaliser(df: Array) -> Array:
    """`log Gamma((df + 1) / 2) - log Gamma(df / 2) - log(df pi) / 2`, the
    Student-t density's log normaliser, accurate for any `df > 0` up to `inf`:
    for large `df` the series `log Gamma(x + 1/2) - log Gamma(x) = log(x) / 2
    - 1/(8x) + 1/(192 x^3) + 1/(640 x^5) + O(x^-7)` at `x = df / 2`."""
    large = df > _SERIES_DF
    small_df = jnp.where(large, 1.0, df)
    direct = (
        gammaln((small_df + 1) / 2) - gammaln(small_df / 2) - 0.5 * jnp.log(small_df)
    )
    inverse = 1 / jnp.where(large, df, _SERIES_DF)  # 0 at df = inf
    series = -0.5 * math.log(2.0) - inverse / 4 + inverse**3 / 24 + inverse**5 / 20
    return jnp.where(large, series, direct) - 0.5 * math.log(math.pi)


def evidential_regression(
    gamma: Float[ArrayLike, "*batch"],
    nu: Float[ArrayLike, "*batch"],
    alpha: Float[ArrayLike, "*batch"],
    beta: Float[ArrayLike, "*batch"],
    target: Float[ArrayLike, "*batch"],
    *,
    coefficient: float = 0.01,
) -> Float[Array, ""]:
    """Deep evidential regression (Amini et al. 2020): the negative log of
    the Normal-Inverse-Gamma's marginal likelihood of the targets (a
    Student-t with `2 alpha` degrees of freedom, location `gamma` and scale
    `sqrt(beta (1 + nu) / (nu alpha))`) plus `coefficient` times the
    evidence regulariser `|y - gamma| (2 nu + alpha)`, averaged.

    One forward pass predicts the mean `gamma`, the aleatoric variance
    `beta / (alpha - 1)` and the epistemic variance `beta / (nu (alpha - 1))`.

    **Arguments:**

    - `gamma`, `nu`, `alpha`, `beta`: one model's NIG parameters (`nu > 0`,
      `alpha > 1`, `beta > 0`: e.g. softplus outputs, plus 1 for `alpha`).
    - `target`: the targets, all of one shape with the parameters.
    - `coefficient`: the regulariser's weight (the paper's lambda).

    **Returns:**

    A scalar.

    **Example:**

    ```python
    def loss(model, batch, key):
        x, y = batch
        out = jax.vmap(model)(x)                         # (batch, 4)
        nu, beta = jax.nn.softplus(out[:, 1]), jax.nn.softplus(out[:, 3])
        alpha = jax.nn.softplus(out[:, 2]) + 1.0
        return ee.losses.evidential_regression(out[:, 0], nu, alpha, beta, y)

    ens = ee.ensemble(lambda k: eqx.nn.MLP(1, 4, 16, 1, key=k), size=3,
                      key=jax.random.key(0))
    x = jax.random.uniform(jax.random.key(1), (64, 1))
    result = ee.fit(ens, loss, optax.adam(1e-2), (x, jnp.sin(6 * x[:, 0])),
                    steps=50, batch_size=16, key=jax.random.key(2), callbacks=())
    ```
    """
    gamma, nu, alpha, beta, target = _arrays(gamma, nu, alpha, beta, target)
    for name, value, low in (
        ("nu", nu, 0.0),
        ("alpha", alpha, 1.0),
        ("beta", beta, 0.0),
    ):
        if not is_traced(value) and not bool(jnp.all(value > low)):
            raise ValueError(
                f"`{name}` must be greater than {low:g}, got a minimum of "
                f"{float(jnp.min(value))}"
            )
    omega = 2 * beta * (1 + nu)
    nll = (
        0.5 * jnp.log(math.pi / nu)
        - alpha * jnp.log(omega)
        + (alpha + 0.5) * jnp.log((target - gamma) ** 2 * nu + omega)
        + gammaln(alpha)
        - gammaln(alpha + 0.5)
    )
    regulariser = jnp.abs(target - gamma) * (2 * nu + alpha)
    return jnp.mean(nll + coefficient * regulariser)


def evidential_classification(
    evidence: Float[ArrayLike, "*batch classes"],
    labels: ArrayLike,
    *,
    kl_weight: float | Float[ArrayLike, ""] = 0.0,
) -> Float[Array, ""]:
    """Evidential classification (Sensoy et al. 2018): the Dirichlet with
    parameters `evidence + 1`, its expected squared error against the one-hot
    labels (the paper's equation 5), plus `kl_weight` times the KL divergence
    from the uniform Dirichlet of the evidence left on the wrong classes
    (the paper anneals it as `min(1, epoch / 10)`), averaged over the batch.

    The predictive probabilities are `(evidence + 1) / S` and the
    uncertainty `classes / S`, with `S = sum(evidence + 1)`.

    **Arguments:**

    - `evidence`: one model's non-negative evidence per class (e.g. `relu`
      or `softplus` of its outputs).
    - `labels`: integer class labels, the shape of `evidence` without its
      last axis.
    - `kl_weight`: the KL term's weight (a traced value is fine: an annealing
      schedule inside the loss).

    **Returns:**

    A scalar.

    **Example:**

    ```python
    evidence = jax.nn.softplus(jnp.array([[4.0, -2.0, -2.0], [0.0, 0.0, 0.0]]))
    ee.losses.evidential_classification(evidence, jnp.array([0, 2]), kl_weight=0.5)
    ```
    """
    evidence = jnp.asarray(evidence)
    labels = jnp.asarray(labels)
    if labels.shape != evidence.shape[:-1] or not jnp.issubdtype(
        labels.dtype, jnp.integer
    ):
        raise ValueError(
            f"`labels` must be integer labels of shape {evidence.shape[:-1]} (the "
            f"evidence's without its class axis), got {labels.dtype}{labels.shape}"
        )
    _check_not_negative("evidence", evidence)
    classes = evidence.shape[-1]
    alpha = evidence + 1
    strength = alpha.sum(-1, keepdims=True)
    p = alpha / strength
    y = jax.nn.one_hot(labels, classes, dtype=p.dtype)
    squared = jnp.sum((y - p) ** 2 + p * (1 - p) / (strength + 1), axis=-1)
    wrong = y + (1 - y) * alpha  # the evidence of the true class removed
    total = wrong.sum(-1)
    kl = (
        gammaln(total)
        - gammaln(jnp.asarray(classes, p.dtype))
        - gammaln(wrong).sum(-1)
        + jnp.sum((wrong - 1) * (digamma(wrong) - digamma(total)[..., None]), -1)
    )
    return jnp.mean(squared + kl_weight * kl)
