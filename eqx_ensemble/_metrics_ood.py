"""Out-of-distribution detection: AUROC of an uncertainty score."""

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Float

from ._metrics_checks import as_float_array
from ._tree import is_traced


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

    It is the Mann-Whitney statistic: the probability that a random OOD input
    scores higher than a random in-distribution one, ties counting one half.
    1 separates perfectly, 0.5 is chance. Computed by sorting (`O(n log n)`,
    `searchsorted` for the ties), so it runs under `jax.jit`. It equals
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


@jax.jit
def _ood_auroc(in_scores: Array, out_scores: Array) -> Array:
    dtype = jnp.result_type(in_scores.dtype, out_scores.dtype)
    sorted_in = jnp.sort(in_scores.astype(dtype))
    out_scores = out_scores.astype(dtype)
    below = jnp.searchsorted(sorted_in, out_scores, side="left")
    not_above = jnp.searchsorted(sorted_in, out_scores, side="right")
    # Per OOD input: the fraction of in-distribution inputs it outscores (ties
    # half). Averaging fractions avoids integer overflow of the pair count.
    wins = (below + not_above).astype(dtype) / (2 * in_scores.shape[0])
    return jnp.mean(wins)
