"""Classification scores of stacked per-member predictions (accuracy, NLL, Brier;
for the ensemble and for each member) and the helpers other metrics share."""

from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Float, Int

from .._execution.compile import one_shot_jit
from .._internal.tree import as_array
from .checks import (
    as_float_array,
    check_classification_predictions,
    check_labels,
    check_reduction,
)

Reduction = Literal["mean", "sum", "none"]


def prepare_predictions(
    probs: ArrayLike, *, from_logits: bool, name: str = "probs"
) -> Array:
    """Validated `(members, batch, classes)` predictions as a float array of at
    least 32 bits."""
    given = getattr(probs, "dtype", None)
    array = as_float_array(probs, name)
    check_classification_predictions(
        array, from_logits=from_logits, name=name, given=given
    )
    return array


def prepare_labels(labels: ArrayLike, predictions: Array) -> Array:
    """Validated `(batch,)` integer labels matching `predictions`."""
    array = as_array(labels)
    _, batch, classes = predictions.shape
    check_labels(array, classes, batch, predictions_shape=tuple(predictions.shape))
    return array


def member_log_probs(predictions: Array, *, from_logits: bool) -> tuple[Array, Array]:
    """Per-member `(probs, log_probs)`; `log_probs` is `-inf` where `probs` is 0."""
    if from_logits:
        log_probs = jax.nn.log_softmax(predictions, axis=-1)
        return jnp.exp(log_probs), log_probs
    # Probabilities may stray from [0, 1] by rounding: keep `log` off negatives.
    probs = jnp.clip(predictions, 0.0, 1.0)
    return probs, safe_log(probs)


def safe_log(probs: Array) -> Array:
    """`log(probs)`, `-inf` at 0, with finite gradients at 0 (the double-`where`)."""
    positive = probs > 0
    return jnp.where(positive, jnp.log(jnp.where(positive, probs, 1.0)), -jnp.inf)


def ensemble_log_probs(probs: Array, log_probs: Array, *, from_logits: bool) -> Array:
    """`log((1/M) sum_i p_i)` over the member axis (from logits in log-space)."""
    if not from_logits:
        return safe_log(jnp.mean(probs, axis=0))
    members = log_probs.shape[0]
    return jax.nn.logsumexp(log_probs, axis=0) - jnp.log(members).astype(
        log_probs.dtype
    )


def log_floor(dtype) -> float:
    """The log-probability a loss uses for a probability of exactly 0: the `log`
    of the smallest subnormal, about -103.3 in float32."""
    return float(np.log(float(jnp.finfo(dtype).smallest_subnormal)))


def entropy(probs: Array, log_probs: Array) -> Array:
    """`-sum_c p_c log p_c` over the last axis, with `0 log 0 = 0` (NaN-free grads)."""
    positive = probs > 0
    safe_log = jnp.where(positive, log_probs, 0.0)
    # `0 - s`, not `-s`: a zero entropy is +0.0, not -0.0.
    return 0.0 - jnp.sum(jnp.where(positive, probs * safe_log, 0.0), axis=-1)


def label_log_probs(log_probs: Array, labels: Array) -> Array:
    """`log_probs[..., labels]`: the log-probability of the true class, floored."""
    index = jnp.broadcast_to(labels[..., None], log_probs.shape[:-1] + (1,))
    picked = jnp.take_along_axis(log_probs, index, axis=-1)[..., 0]
    return jnp.where(picked == -jnp.inf, log_floor(log_probs.dtype), picked)


def compiled(*static_argnames: str):
    """`one_shot_jit` with static options (the public function validates eagerly)."""
    return one_shot_jit(static_argnames=static_argnames)


def reduce(values: Array, reduction: Reduction) -> Array:
    if reduction == "mean":
        return jnp.mean(values)
    if reduction == "sum":
        return jnp.sum(values)
    return values


def accuracy(
    probs: Float[ArrayLike, " members batch classes"],
    labels: Int[ArrayLike, " batch"],
    *,
    from_logits: bool = False,
) -> Float[Array, ""]:
    """Accuracy of the ensemble: the fraction of examples whose most probable class
    under the members' mean probabilities is the label (ties go to the smallest
    class index, as `jnp.argmax`).

    **Arguments:**

    - `probs`: per-member class probabilities, shape `(members, batch, classes)`
      (logits if `from_logits=True`).
    - `labels`: integer class labels, shape `(batch,)`.
    - `from_logits`: whether `probs` holds logits (softmax is applied per member).

    **Returns:**

    A scalar in `[0, 1]`.

    **Example:**

    ```python
    probs = jnp.array([[[0.9, 0.1], [0.4, 0.6]],
                       [[0.7, 0.3], [0.6, 0.4]]])   # 2 members, 2 examples
    ee.metrics.accuracy(probs, jnp.array([0, 1]))    # 0.5: example 1 ties, argmax 0
    ```
    """
    predictions = prepare_predictions(probs, from_logits=from_logits)
    return _accuracy(predictions, prepare_labels(labels, predictions), from_logits)


@compiled("from_logits")
def _accuracy(predictions: Array, labels: Array, from_logits: bool) -> Array:
    member_probs, _ = member_log_probs(predictions, from_logits=from_logits)
    predicted = jnp.argmax(jnp.mean(member_probs, axis=0), axis=-1)
    return jnp.mean((predicted == labels).astype(predictions.dtype))


def per_member_accuracy(
    probs: Float[ArrayLike, " members batch classes"],
    labels: Int[ArrayLike, " batch"],
    *,
    from_logits: bool = False,
) -> Float[Array, " members"]:
    """The accuracy of each member on its own.

    **Arguments:** as `ee.metrics.accuracy`.

    **Returns:**

    One accuracy per member, shape `(members,)`.

    **Example:**

    ```python
    logits = jnp.array([[[2.0, 0.0]], [[0.0, 2.0]]])   # 2 members, 1 example
    ee.metrics.per_member_accuracy(logits, jnp.array([0]), from_logits=True)  # [1, 0]
    ```
    """
    predictions = prepare_predictions(probs, from_logits=from_logits)
    return _per_member_accuracy(predictions, prepare_labels(labels, predictions))


@one_shot_jit
def _per_member_accuracy(predictions: Array, labels: Array) -> Array:
    predicted = jnp.argmax(predictions, axis=-1)
    return jnp.mean((predicted == labels[None]).astype(predictions.dtype), axis=1)


def nll(
    probs: Float[ArrayLike, " members batch classes"],
    labels: Int[ArrayLike, " batch"],
    *,
    from_logits: bool = False,
    reduction: Reduction = "mean",
) -> Float[Array, ""] | Float[Array, " batch"]:
    """Negative log-likelihood of the labels under the ensemble's mean prediction,
    `-log((1/M) sum_i p_i[label])`, in nats.

    With `from_logits=True` the mean is taken in log-space, exact even where
    probabilities underflow. A probability of exactly 0 on the true class counts
    as the smallest positive float (a loss of about 103.3 nats in float32, not
    `inf`).

    **Arguments:** as `ee.metrics.accuracy`, and

    - `reduction`: `"mean"` (default) or `"sum"` over the batch, or `"none"` for
      one loss per example.

    **Returns:**

    A scalar, or shape `(batch,)` with `reduction="none"`.

    **Example:**

    ```python
    probs = jnp.array([[[0.9, 0.1]], [[0.5, 0.5]]])  # mean prediction [0.7, 0.3]
    ee.metrics.nll(probs, jnp.array([0]))            # -log(0.7) = 0.357
    logits = jnp.array([[[0.0, -200.0]], [[0.0, -300.0]]])
    ee.metrics.nll(logits, jnp.array([1]), from_logits=True)  # 200.69, no underflow
    ```
    """
    check_reduction(reduction)
    predictions = prepare_predictions(probs, from_logits=from_logits)
    labels = prepare_labels(labels, predictions)
    return _nll(predictions, labels, from_logits, reduction)


@compiled("from_logits", "reduction")
def _nll(
    predictions: Array, labels: Array, from_logits: bool, reduction: Reduction
) -> Array:
    member_probs, log_probs = member_log_probs(predictions, from_logits=from_logits)
    log_mean = ensemble_log_probs(member_probs, log_probs, from_logits=from_logits)
    return reduce(-label_log_probs(log_mean, labels), reduction)


def per_member_nll(
    probs: Float[ArrayLike, " members batch classes"],
    labels: Int[ArrayLike, " batch"],
    *,
    from_logits: bool = False,
) -> Float[Array, " members"]:
    """The mean negative log-likelihood of each member on its own.

    **Arguments:** as `ee.metrics.nll`.

    **Returns:**

    One mean NLL per member, shape `(members,)`.

    **Example:**

    ```python
    probs = jnp.array([[[0.9, 0.1]], [[0.5, 0.5]]])
    ee.metrics.per_member_nll(probs, jnp.array([0]))  # [-log 0.9, -log 0.5]
    ```
    """
    predictions = prepare_predictions(probs, from_logits=from_logits)
    labels = prepare_labels(labels, predictions)
    return _per_member_nll(predictions, labels, from_logits)


@compiled("from_logits")
def _per_member_nll(predictions: Array, labels: Array, from_logits: bool) -> Array:
    _, log_probs = member_log_probs(predictions, from_logits=from_logits)
    return -jnp.mean(label_log_probs(log_probs, labels[None]), axis=1)


def _brier(probs: Array, labels: Array) -> Array:
    one_hot = jax.nn.one_hot(labels, probs.shape[-1], dtype=probs.dtype)
    return jnp.sum(jnp.square(probs - one_hot), axis=-1)


def brier_score(
    probs: Float[ArrayLike, " members batch classes"],
    labels: Int[ArrayLike, " batch"],
    *,
    from_logits: bool = False,
    reduction: Reduction = "mean",
) -> Float[Array, ""] | Float[Array, " batch"]:
    """Brier score of the ensemble's mean prediction, **summed over classes**:
    `sum_c (pbar_c - onehot(label)_c)^2`, averaged over the batch.

    Brier's (1950) multi-class definition, as Lakshminarayanan et al. (2017) and
    Ovadia et al. (2019), in `[0, 2]`. For two classes it is twice scikit-learn's
    binary `brier_score_loss`.

    **Arguments:** as `ee.metrics.nll`.

    **Returns:**

    A scalar, or shape `(batch,)` with `reduction="none"`.

    **Example:**

    ```python
    probs = jnp.array([[[0.8, 0.2]], [[0.6, 0.4]]])  # mean prediction [0.7, 0.3]
    ee.metrics.brier_score(probs, jnp.array([0]))    # 0.3**2 + 0.3**2 = 0.18
    ```
    """
    check_reduction(reduction)
    predictions = prepare_predictions(probs, from_logits=from_logits)
    labels = prepare_labels(labels, predictions)
    return _brier_score(predictions, labels, from_logits, reduction)


@compiled("from_logits", "reduction")
def _brier_score(
    predictions: Array, labels: Array, from_logits: bool, reduction: Reduction
) -> Array:
    member_probs, _ = member_log_probs(predictions, from_logits=from_logits)
    return reduce(_brier(jnp.mean(member_probs, axis=0), labels), reduction)


def per_member_brier_score(
    probs: Float[ArrayLike, " members batch classes"],
    labels: Int[ArrayLike, " batch"],
    *,
    from_logits: bool = False,
) -> Float[Array, " members"]:
    """The Brier score (summed over classes, averaged over the batch) of each member.

    **Arguments:** as `ee.metrics.brier_score`.

    **Returns:**

    One Brier score per member, shape `(members,)`.

    **Example:**

    ```python
    probs = jnp.array([[[0.8, 0.2]], [[0.6, 0.4]]])
    ee.metrics.per_member_brier_score(probs, jnp.array([0]))  # [0.08, 0.32]
    ```
    """
    predictions = prepare_predictions(probs, from_logits=from_logits)
    labels = prepare_labels(labels, predictions)
    return _per_member_brier_score(predictions, labels, from_logits)


@compiled("from_logits")
def _per_member_brier_score(
    predictions: Array, labels: Array, from_logits: bool
) -> Array:
    member_probs, _ = member_log_probs(predictions, from_logits=from_logits)
    return jnp.mean(_brier(member_probs, labels[None]), axis=1)
