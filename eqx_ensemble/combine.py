"""Combining the stacked predictions of an ensemble into one prediction.

Every function takes predictions with a leading member axis, as returned by `ens(x)`
or `ee.map`, and an optional weight per member.

```python
import eqx_ensemble as ee
probs = jax.nn.softmax(jnp.zeros((5, 8, 3)), axis=-1)  # (members, batch, classes)
ee.combine.mean_probs(probs)                  # (batch, classes)
```
"""

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Float, Int, Real

from ._execution.compile import one_shot_jit
from ._internal.checks import check_positive_int, normalised_weights
from ._internal.tree import as_array, is_traced

__all__ = [
    "mean_probs",
    "mean_probs_from_logits",
    "log_mean_probs_from_logits",
    "mean_logits",
    "majority_vote",
    "gaussian_mixture",
]


def _check_floating(x: Array, name: str) -> Array:
    """`x` as a float array with a member axis, or an error (integer predictions
    would be averaged with integer weights: zeros)."""
    x = as_array(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(
            f"`{name}` must hold floating-point values, got dtype {x.dtype}; convert "
            f"with `{name}.astype(jnp.float32)`"
        )
    if x.ndim < 1 or x.shape[0] < 1:
        raise ValueError(
            f"`{name}` must have a leading member axis, got shape {tuple(x.shape)}"
        )
    return x


def _check_no_nan_or_inf(x: Array, name: str, *, allow_negative_inf: bool) -> None:
    if is_traced(x):
        return
    host = np.asarray(x)
    bad = np.isnan(host) | (host == np.inf)
    if not allow_negative_inf:
        bad |= host == -np.inf
    if bad.any():
        where = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(
            f"`{name}` holds {host[where]} at index {where}; "
            + (
                "logits must be finite or -inf (a masked class)"
                if allow_negative_inf
                else "values must be finite"
            )
        )


def _weighted_mean(
    x: Any,
    weights: Real[ArrayLike, " members"] | Sequence[float | int] | None,
    name: str,
) -> Array:
    x = _check_floating(x, name)
    _check_no_nan_or_inf(x, name, allow_negative_inf=False)
    w = normalised_weights(weights, x.shape[0], x.dtype, "predictions have")
    return jnp.tensordot(w, x, axes=1)


def mean_probs(
    probs: Float[Array, " members *batch classes"],
    weights: Real[ArrayLike, " members"] | Sequence[float | int] | None = None,
) -> Float[Array, " *batch classes"]:
    """The (weighted) mean of the members' predicted probabilities.

    **Arguments:**

    - `probs`: per-member class probabilities, members first.
    - `weights`: optional weight per member, normalised to sum to one.

    **Example:**

    ```python
    probs = jnp.array([[[0.9, 0.1]], [[0.5, 0.5]]])   # 2 members, 1 input
    ee.combine.mean_probs(probs)                        # [[0.7, 0.3]]
    ```
    """
    return _weighted_mean(probs, weights, "probs")


def mean_probs_from_logits(
    logits: Float[Array, " members *batch classes"],
    weights: Real[ArrayLike, " members"] | Sequence[float | int] | None = None,
) -> Float[Array, " *batch classes"]:
    """The mean of the members' softmax probabilities, from their logits.

    **Example:**

    ```python
    logits = jnp.zeros((5, 8, 3))
    ee.combine.mean_probs_from_logits(logits)          # all 1/3, shape (8, 3)
    ```
    """
    logits, w = _logits_and_weights(logits, weights)
    return _mean_probs(logits, w)


def log_mean_probs_from_logits(
    logits: Float[Array, " members *batch classes"],
    weights: Real[ArrayLike, " members"] | Sequence[float | int] | None = None,
) -> Float[Array, " *batch classes"]:
    """`log(mean_i softmax(logits_i))` computed in log-space (no underflow): for the
    ensemble's negative log-likelihood, where the log of the mean of very small
    probabilities stays finite.

    **Example:**

    ```python
    logits = jnp.array([[[0.0, -200.0]], [[0.0, -300.0]]])
    ee.combine.log_mean_probs_from_logits(logits)      # finite, about [[0, -200.7]]
    ```
    """
    logits, w = _logits_and_weights(logits, weights)
    return _log_mean_probs(logits, w)


def _logits_and_weights(logits: Any, weights: Any) -> tuple[Array, Array]:
    logits = _check_floating(logits, "logits")
    _check_no_nan_or_inf(logits, "logits", allow_negative_inf=True)
    members = logits.shape[0]
    return logits, normalised_weights(
        weights, members, logits.dtype, "predictions have"
    )


# One program per shape each (op by op, a first call compiled twenty).
@one_shot_jit
def _log_mean_probs(logits: Array, w: Array) -> Array:
    log_w = jnp.log(w).reshape((logits.shape[0],) + (1,) * (logits.ndim - 1))
    return jax.nn.logsumexp(jax.nn.log_softmax(logits, axis=-1) + log_w, axis=0)


@one_shot_jit
def _mean_probs(logits: Array, w: Array) -> Array:
    return jnp.exp(_log_mean_probs(logits, w))


def mean_logits(
    logits: Float[Array, " members *batch classes"],
    weights: Real[ArrayLike, " members"] | Sequence[float | int] | None = None,
) -> Float[Array, " *batch classes"]:
    """Logit averaging: the (weighted) mean of the members' logits. Its softmax is a
    normalised geometric mean of the members' probabilities (sharper than
    `mean_probs`).

    **Example:**

    ```python
    logits = jnp.array([[[2.0, 0.0]], [[0.0, 2.0]]])
    ee.combine.mean_logits(logits)                     # [[1.0, 1.0]]
    ```
    """
    return _weighted_mean(logits, weights, "logits")


def majority_vote(
    predictions: Int[Array, " members *batch"],
    num_classes: int,
    weights: Real[ArrayLike, " members"] | Sequence[float | int] | None = None,
) -> Int[Array, " *batch"]:
    """The class predicted by the most members (weighted votes if `weights`). Ties go
    to the **smallest class index** among the tied classes.

    **Arguments:**

    - `predictions`: each member's predicted class labels, e.g.
      `jnp.argmax(logits, axis=-1)`.
    - `num_classes`: the number of classes; labels must lie in `[0, num_classes)`.
    - `weights`: optional weight per member (votes count with that weight).

    **Example:**

    ```python
    votes = jnp.array([[0, 1], [2, 1], [2, 0]])        # 3 members, 2 inputs
    ee.combine.majority_vote(votes, num_classes=3)     # [2, 1]
    ```
    """
    num_classes = check_positive_int(num_classes, "num_classes")
    predictions = jnp.asarray(predictions)
    if not jnp.issubdtype(predictions.dtype, jnp.integer):
        raise TypeError(
            "`predictions` must be integer class labels (e.g. `jnp.argmax(logits, "
            f"-1)`), got dtype {predictions.dtype}"
        )
    if not is_traced(predictions):
        low, high = int(predictions.min()), int(predictions.max())
        if low < 0 or high >= num_classes:
            raise ValueError(
                f"predicted labels must lie in [0, {num_classes}), found labels in "
                f"[{low}, {high}]"
            )
    if weights is None:
        # Integer vote counts: ties are exact.
        one_hot = jax.nn.one_hot(predictions, num_classes, dtype=jnp.int32)
        counts = one_hot.sum(axis=0)
    else:
        one_hot = jax.nn.one_hot(predictions, num_classes, dtype=jnp.float32)
        # Checked, then summed unnormalised: integer weights keep ties exact.
        normalised_weights(weights, len(predictions), jnp.float32, "predictions have")
        raw = jnp.asarray(weights).astype(jnp.float32)
        counts = jnp.tensordot(raw, one_hot, axes=1)
    # argmax returns the first maximal index: ties go to the smallest class.
    return jnp.argmax(counts, axis=-1)


def gaussian_mixture(
    means: Float[Array, " members *batch"],
    variances: Float[Array, " members *batch"],
    weights: Real[ArrayLike, " members"] | Sequence[float | int] | None = None,
) -> tuple[Float[Array, " *batch"], Float[Array, " *batch"]]:
    """Mean and variance of the mixture of the members' Gaussian predictions.

    For members predicting `N(mu_i, sigma_i^2)` with mixture weights `w_i`:
    `mean = sum_i w_i mu_i` and `variance = sum_i w_i sigma_i^2 + sum_i w_i (mu_i -
    mean)^2` (aleatoric plus epistemic; Lakshminarayanan et al. 2017), in the centred
    form, which never goes negative through cancellation.

    **Example:**

    ```python
    mu = jnp.array([[0.0], [2.0]])
    var = jnp.array([[1.0], [1.0]])
    ee.combine.gaussian_mixture(mu, var)               # ([1.0], [2.0])
    ```
    """
    means = _check_floating(means, "means")
    variances = _check_floating(variances, "variances")
    if means.shape != variances.shape:
        raise ValueError(
            f"`means` and `variances` must have the same shape, got "
            f"{tuple(means.shape)} and {tuple(variances.shape)}"
        )
    _check_no_nan_or_inf(means, "means", allow_negative_inf=False)
    _check_no_nan_or_inf(variances, "variances", allow_negative_inf=False)
    if not is_traced(variances) and (np.asarray(variances) < 0).any():
        raise ValueError(
            f"`variances` must be non-negative, found {float(np.min(variances))}"
        )
    size = means.shape[0]
    w = normalised_weights(weights, size, means.dtype, "predictions have")
    # Each term weighted in its own array's dtype (bf16 means, f32 variances).
    w_var = normalised_weights(weights, size, variances.dtype, "predictions have")
    return _mixture(means, variances, w, w_var)


@one_shot_jit
def _mixture(
    means: Array, variances: Array, w: Array, w_var: Array
) -> tuple[Array, Array]:
    mean = jnp.tensordot(w, means, axes=1)
    spread = jnp.tensordot(w, jnp.square(means - mean[None]), axes=1)
    return mean, jnp.tensordot(w_var, variances, axes=1) + spread
