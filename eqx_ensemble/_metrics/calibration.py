"""Calibration errors of binned top-label confidence: equal-width and equal-mass
(adaptive) bins, expected and maximum calibration error, reliability-diagram data."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Float, Int

from .checks import check_n_bins
from .classification import (
    compiled,
    member_log_probs,
    prepare_labels,
    prepare_predictions,
)


class CalibrationBins(eqx.Module):
    """Per-bin statistics of top-label confidence, from
    `ee.metrics.calibration_bins`, each of shape `(n_bins,)`.

    - `count`: number of examples in the bin (as a float).
    - `accuracy`: fraction of them whose predicted class is the label (0 if empty).
    - `confidence`: their mean confidence (0 if empty).
    - `lower`, `upper`: the bin's range: equal-width, the edges `k / n_bins`;
      equal-mass, its smallest and largest confidence (NaN if empty).

    **Example:**

    ```python
    probs = jnp.array([[[0.9, 0.1], [0.6, 0.4], [0.3, 0.7]]])
    bins = ee.metrics.calibration_bins(probs, jnp.array([0, 1, 1]), n_bins=2)
    bins.count, bins.accuracy          # [0, 3], [0, 2/3]
    ```
    """

    count: Float[Array, " bins"]
    accuracy: Float[Array, " bins"]
    confidence: Float[Array, " bins"]
    lower: Float[Array, " bins"]
    upper: Float[Array, " bins"]


def _equal_width_bins(confidence: Array, n_bins: int) -> Array:
    # Bin k holds confidences in (k / n_bins, (k + 1) / n_bins]; 0 joins bin 0
    # (the right-closed bins of Guo et al. 2017).
    edges = jnp.linspace(0.0, 1.0, n_bins + 1, dtype=confidence.dtype)
    index = jnp.searchsorted(edges, confidence, side="left") - 1
    return jnp.clip(index, 0, n_bins - 1)


def _equal_mass_bins(confidence: Array, n_bins: int) -> Array:
    # Sorted (stably) by confidence and cut as `numpy.array_split` does.
    batch = confidence.shape[0]
    size, larger = divmod(batch, n_bins)
    rank = np.arange(batch)
    boundary = larger * (size + 1)
    bin_of_rank = np.where(
        rank < boundary,
        rank // (size + 1),
        larger + (rank - boundary) // max(size, 1),
    )
    order = jnp.argsort(confidence, stable=True)
    return jnp.zeros(batch, jnp.int32).at[order].set(jnp.asarray(bin_of_rank))


def _top_label(probs: Array, labels: Array) -> tuple[Array, Array]:
    """Confidence (largest probability) and correctness of the predicted class."""
    confidence = jnp.max(probs, axis=-1)
    correct = (jnp.argmax(probs, axis=-1) == labels).astype(probs.dtype)
    return confidence, correct


def _bin_sums(
    confidence: Array, correct: Array, n_bins: int, adaptive: bool
) -> tuple[Array, Array, Array, Array]:
    """Bin index per example and per-bin count, sum of correctness, of confidence."""
    if adaptive:
        index = _equal_mass_bins(confidence, n_bins)
    else:
        index = _equal_width_bins(confidence, n_bins)
    segment = lambda x: jax.ops.segment_sum(x, index, num_segments=n_bins)
    count = segment(jnp.ones_like(confidence))
    return index, count, segment(correct), segment(confidence)


def _calibration_error(probs: Array, labels: Array, n_bins: int, adaptive: bool):
    confidence, correct = _top_label(probs, labels)
    _, _, correct_sum, confidence_sum = _bin_sums(confidence, correct, n_bins, adaptive)
    # sum_b (n_b / N) |acc_b - conf_b| = sum_b |sum_correct_b - sum_conf_b| / N.
    return jnp.sum(jnp.abs(correct_sum - confidence_sum)) / confidence.shape[0]


def _validate(
    probs: ArrayLike, labels: ArrayLike, from_logits: bool, n_bins: int
) -> tuple[Array, Array]:
    check_n_bins(n_bins)
    predictions = prepare_predictions(probs, from_logits=from_logits)
    return predictions, prepare_labels(labels, predictions)


def _mean_probs(predictions: Array, from_logits: bool) -> Array:
    member_probs, _ = member_log_probs(predictions, from_logits=from_logits)
    return jnp.mean(member_probs, axis=0)


@compiled("n_bins", "adaptive", "from_logits")
def _ensemble_calibration_error(
    predictions: Array, labels: Array, n_bins: int, adaptive: bool, from_logits: bool
) -> Array:
    mean_probs = _mean_probs(predictions, from_logits)
    return _calibration_error(mean_probs, labels, n_bins, adaptive)


def calibration_bins(
    probs: Float[ArrayLike, " members batch classes"],
    labels: Int[ArrayLike, " batch"],
    n_bins: int = 15,
    *,
    adaptive: bool = False,
    from_logits: bool = False,
) -> CalibrationBins:
    """Bin the ensemble's top-label confidence (its largest mean probability)
    and compare it with accuracy: the data of a reliability diagram.
    Equal-width bins are right-closed, `(k/n, (k+1)/n]` (0 falls in the first);
    equal-mass bins cut the examples sorted by confidence as `numpy.array_split`.

    **Arguments:** `probs`, `labels`, `from_logits` as `ee.metrics.accuracy`, and

    - `n_bins`: the number of bins, a Python int of at least 1.
    - `adaptive`: equal-mass bins instead of equal-width bins.

    **Returns:**

    A [`CalibrationBins`][eqx_ensemble.metrics.CalibrationBins].

    **Example:**

    ```python
    probs = jax.nn.softmax(jax.random.normal(jax.random.key(0), (5, 100, 3)), -1)
    labels = jax.random.randint(jax.random.key(1), (100,), 0, 3)
    bins = ee.metrics.calibration_bins(probs, labels, n_bins=10)
    bins.count.sum()                                   # 100
    ```
    """
    predictions, labels = _validate(probs, labels, from_logits, n_bins)
    return _calibration_bins(predictions, labels, n_bins, adaptive, from_logits)


@compiled("n_bins", "adaptive", "from_logits")
def _calibration_bins(
    predictions: Array, labels: Array, n_bins: int, adaptive: bool, from_logits: bool
) -> CalibrationBins:
    confidence, correct = _top_label(_mean_probs(predictions, from_logits), labels)
    index, count, correct_sum, confidence_sum = _bin_sums(
        confidence, correct, n_bins, adaptive
    )
    occupied = count > 0
    safe_count = jnp.where(occupied, count, 1.0)
    accuracy = jnp.where(occupied, correct_sum / safe_count, 0.0)
    mean_confidence = jnp.where(occupied, confidence_sum / safe_count, 0.0)
    if adaptive:
        nan = jnp.array(jnp.nan, confidence.dtype)
        lower = jax.ops.segment_min(confidence, index, num_segments=n_bins)
        upper = jax.ops.segment_max(confidence, index, num_segments=n_bins)
        lower, upper = jnp.where(occupied, lower, nan), jnp.where(occupied, upper, nan)
    else:
        edges = jnp.linspace(0.0, 1.0, n_bins + 1, dtype=confidence.dtype)
        lower, upper = edges[:-1], edges[1:]
    return CalibrationBins(
        count=count,
        accuracy=accuracy,
        confidence=mean_confidence,
        lower=lower,
        upper=upper,
    )


def expected_calibration_error(
    probs: Float[ArrayLike, " members batch classes"],
    labels: Int[ArrayLike, " batch"],
    n_bins: int = 15,
    *,
    from_logits: bool = False,
) -> Float[Array, ""]:
    """Expected calibration error (ECE) of the ensemble's mean prediction with
    equal-width bins (Naeini et al. 2015; Guo et al. 2017):
    `sum_b (n_b / N) |accuracy_b - confidence_b|`, the top-label confidence
    binned as `ee.metrics.calibration_bins`.

    **Arguments:** as `ee.metrics.calibration_bins` (no `adaptive`).

    **Returns:**

    A scalar in `[0, 1]`.

    **Example:**

    ```python
    probs = jnp.array([[[0.9, 0.1], [0.9, 0.1]]])   # one model, 90% confident
    ee.metrics.expected_calibration_error(probs, jnp.array([0, 1]))  # |0.5 - 0.9| = 0.4
    ```
    """
    predictions, labels = _validate(probs, labels, from_logits, n_bins)
    return _ensemble_calibration_error(predictions, labels, n_bins, False, from_logits)


def adaptive_calibration_error(
    probs: Float[ArrayLike, " members batch classes"],
    labels: Int[ArrayLike, " batch"],
    n_bins: int = 15,
    *,
    from_logits: bool = False,
) -> Float[Array, ""]:
    """ECE with equal-mass (adaptive) bins, as
    `ee.metrics.calibration_bins(adaptive=True)` (Nguyen & O'Connor 2015; Nixon
    et al. 2019): less sensitive to near-empty bins when confidences bunch up
    near 1.

    **Arguments:** as `ee.metrics.expected_calibration_error`.

    **Returns:**

    A scalar in `[0, 1]`.

    **Example:**

    ```python
    probs = jnp.array([[[0.9, 0.1], [0.8, 0.2], [0.6, 0.4], [0.7, 0.3]]])
    labels = jnp.array([0, 0, 1, 0])
    ee.metrics.adaptive_calibration_error(probs, labels, n_bins=2)
    # bins {0.6, 0.7}: |0.5 - 0.65|; {0.8, 0.9}: |1 - 0.85|; ECE = 0.15
    ```
    """
    predictions, labels = _validate(probs, labels, from_logits, n_bins)
    return _ensemble_calibration_error(predictions, labels, n_bins, True, from_logits)


def max_calibration_error(
    probs: Float[ArrayLike, " members batch classes"],
    labels: Int[ArrayLike, " batch"],
    n_bins: int = 15,
    *,
    adaptive: bool = False,
    from_logits: bool = False,
) -> Float[Array, ""]:
    """Maximum calibration error (MCE): the largest `|accuracy_b - confidence_b|`
    over the non-empty bins (Naeini et al. 2015).

    **Arguments:** as `ee.metrics.calibration_bins` (equal-width bins unless
    `adaptive=True`).

    **Returns:**

    A scalar in `[0, 1]`.

    **Example:**

    ```python
    probs = jnp.array([[[0.9, 0.1], [0.9, 0.1], [0.55, 0.45]]])
    ee.metrics.max_calibration_error(probs, jnp.array([0, 1, 0]), n_bins=10)  # 0.45
    ```
    """
    predictions, labels = _validate(probs, labels, from_logits, n_bins)
    return _max_calibration_error(predictions, labels, n_bins, adaptive, from_logits)


@compiled("n_bins", "adaptive", "from_logits")
def _max_calibration_error(
    predictions: Array, labels: Array, n_bins: int, adaptive: bool, from_logits: bool
) -> Array:
    bins = _calibration_bins(predictions, labels, n_bins, adaptive, from_logits)
    gaps = jnp.where(bins.count > 0, jnp.abs(bins.accuracy - bins.confidence), 0.0)
    return jnp.max(gaps)


def per_member_calibration_error(
    probs: Float[ArrayLike, " members batch classes"],
    labels: Int[ArrayLike, " batch"],
    n_bins: int = 15,
    *,
    adaptive: bool = False,
    from_logits: bool = False,
) -> Float[Array, " members"]:
    """The expected calibration error of each member on its own.

    **Arguments:** as `ee.metrics.calibration_bins`.

    **Returns:**

    One ECE per member, shape `(members,)`.

    **Example:**

    ```python
    probs = jnp.array([[[0.9, 0.1], [0.9, 0.1]],     # member 0: overconfident
                       [[0.5, 0.5], [0.5, 0.5]]])    # member 1: calibrated
    ee.metrics.per_member_calibration_error(probs, jnp.array([0, 1]))  # [0.4, 0.0]
    ```
    """
    predictions, labels = _validate(probs, labels, from_logits, n_bins)
    return _per_member_calibration_error(
        predictions, labels, n_bins, adaptive, from_logits
    )


@compiled("n_bins", "adaptive", "from_logits")
def _per_member_calibration_error(
    predictions: Array, labels: Array, n_bins: int, adaptive: bool, from_logits: bool
) -> Array:
    member_probs, _ = member_log_probs(predictions, from_logits=from_logits)
    return jax.vmap(lambda p: _calibration_error(p, labels, n_bins, adaptive))(
        member_probs
    )
