"""Uncertainty of each prediction of an ensemble classifier: entropy and its
decomposition (total = aleatoric + epistemic), and vote-based disagreement."""

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float

from .classification import (
    compiled,
    ensemble_log_probs,
    entropy,
    member_log_probs,
    prepare_predictions,
)


def predictive_entropy(
    probs: Float[ArrayLike, " members batch classes"], *, from_logits: bool = False
) -> Float[Array, " batch"]:
    """Entropy of the ensemble's mean prediction, `H[(1/M) sum_i p_i]` (total
    uncertainty), per example, in nats.

    Terms with probability 0 contribute 0. It lies in `[0, log(classes)]`.

    **Arguments:**

    - `probs`: per-member class probabilities, shape `(members, batch, classes)`
      (logits if `from_logits=True`).
    - `from_logits`: whether `probs` holds logits.

    **Returns:**

    One entropy per example, shape `(batch,)`.

    **Example:**

    ```python
    probs = jnp.array([[[1.0, 0.0]], [[0.0, 1.0]]])   # two confident members disagree
    ee.metrics.predictive_entropy(probs)              # [log 2] = [0.693]
    ```
    """
    predictions = prepare_predictions(probs, from_logits=from_logits)
    return _predictive_entropy(predictions, from_logits)


@compiled("from_logits")
def _predictive_entropy(predictions: Array, from_logits: bool) -> Array:
    member_probs, log_probs = member_log_probs(predictions, from_logits=from_logits)
    log_mean = ensemble_log_probs(member_probs, log_probs, from_logits=from_logits)
    return entropy(jnp.mean(member_probs, axis=0), log_mean)


def expected_entropy(
    probs: Float[ArrayLike, " members batch classes"], *, from_logits: bool = False
) -> Float[Array, " batch"]:
    """Mean over members of each member's entropy, `(1/M) sum_i H[p_i]` (the
    aleatoric part of the uncertainty), per example, in nats.

    **Arguments:** as `ee.metrics.predictive_entropy`.

    **Returns:**

    One value per example, shape `(batch,)`.

    **Example:**

    ```python
    probs = jnp.array([[[1.0, 0.0]], [[0.0, 1.0]]])   # each member is certain
    ee.metrics.expected_entropy(probs)                # [0.0]
    ```
    """
    predictions = prepare_predictions(probs, from_logits=from_logits)
    return _expected_entropy(predictions, from_logits)


@compiled("from_logits")
def _expected_entropy(predictions: Array, from_logits: bool) -> Array:
    member_probs, log_probs = member_log_probs(predictions, from_logits=from_logits)
    return jnp.mean(entropy(member_probs, log_probs), axis=0)


def mutual_information(
    probs: Float[ArrayLike, " members batch classes"], *, from_logits: bool = False
) -> Float[Array, " batch"]:
    """Mutual information between the prediction and the member (the epistemic
    part of the uncertainty): predictive entropy minus expected entropy, per
    example, in nats (Depeweg et al. 2018; the BALD score of Houlsby et al. 2011).

    It is 0 when all members agree and at most `log(min(members, classes))`;
    rounding below 0 is clipped to 0.

    **Arguments:** as `ee.metrics.predictive_entropy`.

    **Returns:**

    One value per example, shape `(batch,)`.

    **Example:**

    ```python
    probs = jnp.array([[[1.0, 0.0], [0.5, 0.5]],
                       [[0.0, 1.0], [0.5, 0.5]]])
    ee.metrics.mutual_information(probs)   # [log 2, 0]: disagreement vs shared doubt
    ```
    """
    predictions = prepare_predictions(probs, from_logits=from_logits)
    return _mutual_information(predictions, from_logits)


@compiled("from_logits")
def _mutual_information(predictions: Array, from_logits: bool) -> Array:
    member_probs, log_probs = member_log_probs(predictions, from_logits=from_logits)
    log_mean = ensemble_log_probs(member_probs, log_probs, from_logits=from_logits)
    total = entropy(jnp.mean(member_probs, axis=0), log_mean)
    aleatoric = jnp.mean(entropy(member_probs, log_probs), axis=0)
    return jnp.maximum(total - aleatoric, 0.0)


def _vote_counts(predictions: Array) -> Array:
    """`(batch, classes)`: how many members predict each class (their argmax)."""
    votes = jnp.argmax(predictions, axis=-1)
    one_hot = jax.nn.one_hot(votes, predictions.shape[-1], dtype=predictions.dtype)
    return jnp.sum(one_hot, axis=0)


def variation_ratio(
    probs: Float[ArrayLike, " members batch classes"], *, from_logits: bool = False
) -> Float[Array, " batch"]:
    """Variation ratio of the members' votes, `1 - (votes for the modal class) / M`
    (Freeman 1965; Gal 2016), per example.

    Each member votes for its most probable class. It is 0 when all members agree
    and at most `1 - 1/min(members, classes)`.

    **Arguments:** as `ee.metrics.predictive_entropy`.

    **Returns:**

    One value per example, shape `(batch,)`.

    **Example:**

    ```python
    probs = jax.nn.one_hot(jnp.array([[0], [0], [1], [2]]), 3)  # 4 members, 1 example
    ee.metrics.variation_ratio(probs)                          # [1 - 2/4] = [0.5]
    ```
    """
    return _variation_ratio(prepare_predictions(probs, from_logits=from_logits))


@jax.jit
def _variation_ratio(predictions: Array) -> Array:
    members = predictions.shape[0]
    # Differences of whole numbers first: exactly 0 when all members agree.
    return (members - jnp.max(_vote_counts(predictions), axis=-1)) / members


def disagreement(
    probs: Float[ArrayLike, " members batch classes"], *, from_logits: bool = False
) -> Float[Array, " batch"]:
    """Member disagreement: the fraction of pairs of distinct members whose
    most probable classes differ, per example (0 for a single member).

    Averaged over a batch it is the mean pairwise prediction disagreement of
    Fort et al. (2019); see `ee.metrics.pairwise_disagreement` for each pair.

    **Arguments:** as `ee.metrics.predictive_entropy`.

    **Returns:**

    One value in `[0, 1]` per example, shape `(batch,)`.

    **Example:**

    ```python
    probs = jax.nn.one_hot(jnp.array([[0], [0], [1]]), 2)  # 3 members, 1 example
    ee.metrics.disagreement(probs)                        # 2 of 3 pairs: [0.667]
    ```
    """
    return _disagreement(prepare_predictions(probs, from_logits=from_logits))


@jax.jit
def _disagreement(predictions: Array) -> Array:
    members = predictions.shape[0]
    if members == 1:
        return jnp.zeros(predictions.shape[1], predictions.dtype)
    counts = _vote_counts(predictions)
    agreeing_pairs = jnp.sum(counts * (counts - 1.0), axis=-1)
    pairs = members * (members - 1)
    return (pairs - agreeing_pairs) / pairs


def pairwise_disagreement(
    probs: Float[ArrayLike, " members batch classes"], *, from_logits: bool = False
) -> Float[Array, " members members"]:
    """For each pair of members, the fraction of examples on which their most
    probable classes differ (a symmetric matrix with a zero diagonal).

    **Arguments:** as `ee.metrics.predictive_entropy`.

    **Returns:**

    Shape `(members, members)`.

    **Example:**

    ```python
    probs = jax.nn.one_hot(jnp.array([[0, 1], [0, 0], [1, 0]]), 2)  # 3 members
    ee.metrics.pairwise_disagreement(probs)   # [[0, .5, 1], [.5, 0, .5], [1, .5, 0]]
    ```
    """
    return _pairwise_disagreement(prepare_predictions(probs, from_logits=from_logits))


@jax.jit
def _pairwise_disagreement(predictions: Array) -> Array:
    votes = jnp.argmax(predictions, axis=-1)
    # Counted in integers: exact, so the diagonal is exactly 0 and the matrix
    # exactly symmetric (a float einsum gave -1.5e-8 on the diagonal).
    one_hot = jax.nn.one_hot(votes, predictions.shape[-1], dtype=jnp.int32)
    disagree = predictions.shape[1] - jnp.einsum("ibc,jbc->ij", one_hot, one_hot)
    return (disagree / predictions.shape[1]).astype(predictions.dtype)
