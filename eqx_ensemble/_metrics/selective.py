"""Selective prediction: the risk of answering only where the model is confident.

A model that may abstain answers the most confident fraction (the *coverage*) of
inputs. Here: the risk-coverage curve, its area (AURC, Geifman, Uziel & El-Yaniv
2019), the generalized one's (AUGRC, Traub et al. 2024), and the accuracy at a
coverage. Ties in the confidence count by their expected value under a random
order, not an arbitrary tie-break.
"""

import math

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Bool, Float, Real

from .._execution.compile import one_shot_jit
from .._internal.tree import as_array, is_traced
from .checks import as_float_array


def _check_selective(confidence: ArrayLike, losses: ArrayLike, loss_name: str):
    confidence = as_float_array(confidence, "confidence")
    losses = as_array(losses)
    if losses.dtype == bool:
        losses = losses.astype(confidence.dtype)
    losses = as_float_array(losses, loss_name)
    if confidence.ndim != 1 or confidence.shape[0] < 1:
        raise ValueError(
            "`confidence` must be a non-empty 1-D array (one score per example, "
            f"higher = more confident), got shape {tuple(confidence.shape)}"
        )
    if losses.shape != confidence.shape:
        raise ValueError(
            f"`{loss_name}` must have one value per example, shape "
            f"{tuple(confidence.shape)} like `confidence`, got shape "
            f"{tuple(losses.shape)}"
        )
    for name, array in (("confidence", confidence), (loss_name, losses)):
        if not is_traced(array):
            bad = ~np.isfinite(np.asarray(array))
            if bad.any():
                raise ValueError(
                    f"`{name}` has {int(bad.sum())} non-finite values, the first at "
                    f"index {int(np.argmax(bad))}"
                )
    return confidence, losses


@one_shot_jit
def _expected_cumulative(confidence: Array, losses: Array) -> Array:
    """`C[k-1]`: the expected total loss of the `k` most confident examples,
    ties in `confidence` broken at random (k = 1..n)."""
    dtype = jnp.promote_types(losses.dtype, jnp.float32)
    order = jnp.argsort(-confidence, stable=True)
    descending = -confidence[order]  # ascending
    cumulative = jnp.concatenate(
        [jnp.zeros(1, dtype), jnp.cumsum(losses[order].astype(dtype))]
    )
    k = jnp.arange(1, confidence.shape[0] + 1)
    start = jnp.searchsorted(descending, descending, side="left")
    end = jnp.searchsorted(descending, descending, side="right")
    width = (end - start).astype(dtype)
    fraction = (k - start).astype(dtype) / width
    return cumulative[start] + fraction * (cumulative[end] - cumulative[start])


def risk_coverage_curve(
    confidence: Float[ArrayLike, " batch"],
    losses: Float[ArrayLike, " _batch"] | Bool[ArrayLike, " _batch"],
) -> tuple[Float[Array, " batch"], Float[Array, " batch"]]:
    """The risk-coverage curve: answering the `k` most confident examples
    (coverage `k / n`), the mean loss of those answered (the selective risk).

    **Arguments:**

    - `confidence`: one score per example, higher = more confident, shape
      `(batch,)`; e.g. the maximum of the ensemble's mean probabilities, or
      `-ee.metrics.mutual_information(probs)`.
    - `losses`: the loss of each example, shape `(batch,)`: 0/1 errors (a bool
      array of mistakes works) for classification, squared errors for regression.

    **Returns:**

    `(coverage, risk)`, each of shape `(batch,)`, for `k = 1, ..., n`.

    **Example:**

    ```python
    confidence = jnp.array([0.9, 0.8, 0.6, 0.3])
    errors = jnp.array([False, False, True, True])
    coverage, risk = ee.metrics.risk_coverage_curve(confidence, errors)
    # coverage [0.25, 0.5, 0.75, 1.0], risk [0, 0, 1/3, 1/2]
    ```
    """
    confidence, losses = _check_selective(confidence, losses, "losses")
    cumulative = _expected_cumulative(confidence, losses)
    n = confidence.shape[0]
    k = jnp.arange(1, n + 1, dtype=cumulative.dtype)
    return k / n, cumulative / k


def aurc(
    confidence: Float[ArrayLike, " batch"],
    losses: Float[ArrayLike, " _batch"] | Bool[ArrayLike, " _batch"],
) -> Float[Array, ""]:
    """Area under the risk-coverage curve (Geifman, Uziel & El-Yaniv 2019): the
    mean selective risk over the `n` coverages `k / n`; lower is better.

    **Arguments:** as [`risk_coverage_curve`][eqx_ensemble.metrics.risk_coverage_curve].

    **Returns:**

    A scalar.

    **Example:**

    ```python
    confidence = jnp.array([0.9, 0.8, 0.6, 0.3])
    errors = jnp.array([False, False, True, True])
    ee.metrics.aurc(confidence, errors)     # (0 + 0 + 1/3 + 1/2) / 4
    ```
    """
    _, risk = risk_coverage_curve(confidence, losses)
    return jnp.mean(risk)


def augrc(
    confidence: Float[ArrayLike, " batch"],
    losses: Float[ArrayLike, " _batch"] | Bool[ArrayLike, " _batch"],
) -> Float[Array, ""]:
    """Area under the generalized risk-coverage curve (Traub et al. 2024): the
    generalized risk at coverage `k / n` is the total loss of the `k` answered
    examples over `n` (for 0/1 losses, P(answered AND wrong)); trapezoid rule
    from coverage 0. Lower is better. For 0/1 losses it equals Traub et al.'s
    `(1 - acc) acc (1 - AUROC) + (1 - acc)^2 / 2` exactly (`AUROC` of the
    confidence separating correct from wrong, ties one half).

    **Arguments:** as [`risk_coverage_curve`][eqx_ensemble.metrics.risk_coverage_curve].

    **Returns:**

    A scalar.

    **Example:**

    ```python
    confidence = jnp.array([0.9, 0.8, 0.6, 0.3])
    errors = jnp.array([False, False, True, True])
    ee.metrics.augrc(confidence, errors)    # 0.125
    ```
    """
    confidence, losses = _check_selective(confidence, losses, "losses")
    cumulative = _expected_cumulative(confidence, losses)
    n = confidence.shape[0]
    generalized = cumulative / n
    # Trapezoids between coverages (k-1)/n and k/n, starting from (0, 0).
    return (jnp.sum(generalized) - generalized[-1] / 2) / n


def accuracy_at_coverage(
    confidence: Float[ArrayLike, " batch"],
    correct: Bool[ArrayLike, " _batch"] | Real[ArrayLike, " _batch"],
    coverage: float,
) -> Float[Array, ""]:
    """The accuracy on the `ceil(coverage * n)` most confident examples.

    **Arguments:**

    - `confidence`: one score per example, higher = more confident.
    - `correct`: whether each prediction is right, shape `(batch,)` (bool or 0/1).
    - `coverage`: the fraction answered, in `(0, 1]`.

    **Returns:**

    A scalar in `[0, 1]` (ties at the cut count by their expected value).

    **Example:**

    ```python
    probs = jax.nn.softmax(jax.random.normal(jax.random.key(0), (5, 100, 10)))
    labels = jnp.arange(100) % 10
    mean = probs.mean(0)
    correct = mean.argmax(-1) == labels
    ee.metrics.accuracy_at_coverage(mean.max(-1), correct, 0.5)
    ```
    """
    if isinstance(coverage, bool) or not isinstance(coverage, int | float):
        raise TypeError(f"`coverage` must be a float in (0, 1], got {coverage!r}")
    if not 0 < coverage <= 1:
        raise ValueError(f"`coverage` must lie in (0, 1], got {coverage}")
    correct = as_array(correct)
    if not (correct.dtype == bool or jnp.issubdtype(correct.dtype, jnp.number)):
        raise TypeError(f"`correct` must be bool or 0/1, got dtype {correct.dtype}")
    errors = 1.0 - correct.astype(jnp.float32)
    confidence, errors = _check_selective(confidence, errors, "correct")
    if not is_traced(correct):
        values = np.unique(np.asarray(correct))
        if not np.isin(values, [0, 1]).all():
            raise ValueError(f"`correct` must hold 0/1 or bools, got values {values}")
    n = confidence.shape[0]
    k = max(1, math.ceil(coverage * n - 1e-9))
    cumulative = _expected_cumulative(confidence, errors)
    return 1.0 - cumulative[k - 1] / k
