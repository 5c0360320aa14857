"""Out-of-distribution detection: AUROC, AUPR and FPR at a TPR of an uncertainty
score."""

import math

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Float

from .._execution.compile import one_shot_jit
from .._internal.tree import is_traced
from .checks import as_float_array


def _check_scores(scores: Array, name: str) -> None:
    if scores.ndim != 1 or scores.shape[0] < 1:
        raise ValueError(
            f"`{name}` must be a non-empty 1-D array of scores (one per input), got "
            f"shape {tuple(scores.shape)}"
        )
    if not is_traced(scores):
        nan = np.isnan(np.asarray(scores))
        if nan.any():
            raise ValueError(
                f"`{name}` contains {int(nan.sum())} NaN scores, the first at index "
                f"{int(np.argmax(nan))}; AUROC needs every score to be comparable"
            )


def ood_auroc(
    in_scores: Float[ArrayLike, " n_in"], out_scores: Float[ArrayLike, " n_out"]
) -> Float[Array, ""]:
    """Area under the ROC curve for telling out-of-distribution inputs from
    in-distribution ones by an uncertainty score (higher = more likely OOD).

    The Mann-Whitney statistic: the probability that a random OOD input scores
    higher than a random in-distribution one, ties counting one half (1 is
    perfect, 0.5 chance). Computed by sorting, so it runs under `jax.jit`; equals
    `sklearn.metrics.roc_auc_score` with the OOD inputs as the positive class.

    **Arguments:**

    - `in_scores`: the score of each in-distribution input, shape `(n_in,)`, e.g.
      `ee.metrics.mutual_information(probs_in)`.
    - `out_scores`: the score of each out-of-distribution input, shape `(n_out,)`.

    **Returns:**

    A scalar in `[0, 1]`.

    **Example:**

    ```python
    in_scores = jnp.array([0.1, 0.2, 0.3])
    out_scores = jnp.array([0.25, 0.9])
    ee.metrics.ood_auroc(in_scores, out_scores)   # (2 + 3) / 6 = 0.833
    ```
    """
    in_scores = as_float_array(in_scores, "in_scores")
    out_scores = as_float_array(out_scores, "out_scores")
    _check_scores(in_scores, "in_scores")
    _check_scores(out_scores, "out_scores")
    return _ood_auroc(in_scores, out_scores)


@one_shot_jit
def _ood_auroc(in_scores: Array, out_scores: Array) -> Array:
    dtype = jnp.result_type(in_scores.dtype, out_scores.dtype)
    sorted_in = jnp.sort(in_scores.astype(dtype))
    out_scores = out_scores.astype(dtype)
    below = jnp.searchsorted(sorted_in, out_scores, side="left")
    not_above = jnp.searchsorted(sorted_in, out_scores, side="right")
    # Averaging per-input fractions avoids overflowing the pair count.
    wins = (below + not_above).astype(dtype) / (2 * in_scores.shape[0])
    return jnp.mean(wins)


def ood_fpr_at_tpr(
    in_scores: Float[ArrayLike, " n_in"],
    out_scores: Float[ArrayLike, " n_out"],
    tpr: float = 0.95,
) -> Float[Array, ""]:
    """False-positive rate at a true-positive rate (FPR at 95% TPR by default):
    with the threshold that flags (score at or above) at least `tpr` of the OOD
    inputs, the fraction of in-distribution inputs also flagged; lower is
    better. The FPR of the first point of `sklearn.metrics.roc_curve` whose TPR
    reaches `tpr` (OOD inputs positive).

    **Arguments:**

    - `in_scores`, `out_scores`: as [`ood_auroc`][eqx_ensemble.metrics.ood_auroc]
      (higher = more likely OOD).
    - `tpr`: the true-positive rate to reach, in `(0, 1]`.

    **Returns:**

    A scalar in `[0, 1]`.

    **Example:**

    ```python
    in_scores = jnp.array([0.1, 0.2, 0.3, 0.6])
    out_scores = jnp.array([0.5, 0.7, 0.9])
    ee.metrics.ood_fpr_at_tpr(in_scores, out_scores)   # threshold 0.5: 1/4
    ```
    """
    if isinstance(tpr, bool) or not isinstance(tpr, int | float):
        raise TypeError(f"`tpr` must be a float in (0, 1], got {tpr!r}")
    if not 0 < tpr <= 1:
        raise ValueError(f"`tpr` must lie in (0, 1], got {tpr}")
    in_scores = as_float_array(in_scores, "in_scores")
    out_scores = as_float_array(out_scores, "out_scores")
    _check_scores(in_scores, "in_scores")
    _check_scores(out_scores, "out_scores")
    n_out = out_scores.shape[0]
    # The smallest k reaching `tpr` (the slack absorbs 0.95 * n's rounding).
    k = max(1, math.ceil(tpr * n_out - 1e-9))
    return _fpr_at(in_scores, out_scores, k)


@one_shot_jit(static_argnums=(2,))
def _fpr_at(in_scores: Array, out_scores: Array, k: int) -> Array:
    dtype = jnp.result_type(in_scores.dtype, out_scores.dtype)
    threshold = jnp.sort(out_scores.astype(dtype))[out_scores.shape[0] - k]
    return jnp.mean((in_scores.astype(dtype) >= threshold).astype(jnp.float32))


def ood_aupr(
    in_scores: Float[ArrayLike, " n_in"], out_scores: Float[ArrayLike, " n_out"]
) -> Float[Array, ""]:
    """Area under the precision-recall curve for detecting out-of-distribution
    inputs (AUPR-Out), as average precision: `sklearn.metrics.
    average_precision_score` with the OOD inputs as positives. For AUPR-In,
    swap the arguments and negate the scores.

    **Arguments:**

    - `in_scores`, `out_scores`: as [`ood_auroc`][eqx_ensemble.metrics.ood_auroc].

    **Returns:**

    A scalar in `[0, 1]`; chance level is the fraction of OOD inputs.

    **Example:**

    ```python
    in_scores = jnp.array([0.1, 0.2, 0.3])
    out_scores = jnp.array([0.25, 0.9])
    ee.metrics.ood_aupr(in_scores, out_scores)   # (1 + 2/3) / 2 = 0.833
    ```
    """
    in_scores = as_float_array(in_scores, "in_scores")
    out_scores = as_float_array(out_scores, "out_scores")
    _check_scores(in_scores, "in_scores")
    _check_scores(out_scores, "out_scores")
    return _ood_aupr(in_scores, out_scores)


@one_shot_jit
def _ood_aupr(in_scores: Array, out_scores: Array) -> Array:
    dtype = jnp.promote_types(
        jnp.result_type(in_scores.dtype, out_scores.dtype), jnp.float32
    )
    scores = jnp.concatenate([in_scores, out_scores]).astype(dtype)
    positive = jnp.concatenate(
        [jnp.zeros(in_scores.shape[0], dtype), jnp.ones(out_scores.shape[0], dtype)]
    )
    order = jnp.argsort(-scores, stable=True)
    descending = scores[order]
    true_positives = jnp.cumsum(positive[order])
    flagged = jnp.arange(1, scores.shape[0] + 1, dtype=dtype)
    # One operating point per distinct score: the last index of each tie group.
    last = jnp.concatenate([descending[1:] != descending[:-1], jnp.array([True])])
    precision = true_positives / flagged
    recall = true_positives / out_scores.shape[0]
    previous = jax.lax.cummax(jnp.where(last, recall, 0.0))
    previous = jnp.concatenate([jnp.zeros(1, dtype), previous[:-1]])
    return jnp.sum(jnp.where(last, (recall - previous) * precision, 0.0))
