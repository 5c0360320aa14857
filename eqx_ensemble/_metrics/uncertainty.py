"""Uncertainty of each prediction of an ensemble classifier: entropy and its
decomposition (total = aleatoric + epistemic), and vote-based disagreement."""

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float

from .._execution.compile import one_shot_jit
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
    uncertainty), per example, in nats, in `[0, log(classes)]`.

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
    example, in nats, in `[0, log(min(members, classes))]` (Depeweg et al. 2018;
    the BALD score of Houlsby et al. 2011).

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
    """Variation ratio of the members' votes (each its most probable class),
    `1 - (votes for the modal class) / M` (Freeman 1965; Gal 2016), per example:
    0 when all members agree, at most `1 - 1/min(members, classes)`.

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


@one_shot_jit
def _variation_ratio(predictions: Array) -> Array:
    members = predictions.shape[0]
    # Differences of whole numbers first: exactly 0 when all members agree.
    return (members - jnp.max(_vote_counts(predictions), axis=-1)) / members


def disagreement(
    probs: Float[ArrayLike, " members batch classes"], *, from_logits: bool = False
) -> Float[Array, " batch"]:
    """Member disagreement: the fraction of pairs of distinct members whose
    most probable classes differ, per example (0 for a single member); averaged
    over a batch, Fort et al. (2019)'s mean pairwise disagreement.

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


@one_shot_jit
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


@one_shot_jit
def _pairwise_disagreement(predictions: Array) -> Array:
    votes = jnp.argmax(predictions, axis=-1)
    # In integers: an exact zero diagonal and symmetry.
    one_hot = jax.nn.one_hot(votes, predictions.shape[-1], dtype=jnp.int32)
    disagree = predictions.shape[1] - jnp.einsum("ibc,jbc->ij", one_hot, one_hot)
    return (disagree / predictions.shape[1]).astype(predictions.dtype)


def _check_temperature(temperature: float | int) -> float:
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise TypeError(
            f"`temperature` must be a Python float, got {type(temperature).__name__}"
        )
    if not 0 < temperature < float("inf"):
        raise ValueError(
            f"`temperature` must be positive and finite, got {temperature}"
        )
    return float(temperature)


def energy_score(
    logits: Float[ArrayLike, " members batch classes"],
    *,
    temperature: float | int = 1.0,
) -> Float[Array, " batch"]:
    """The free energy of each input, `-T logsumexp(f(x) / T)` (Liu et al. 2020,
    "Energy-based out-of-distribution detection"), averaged over members: an OOD
    score, higher for inputs more likely out of distribution. Unlike softmax
    scores it keeps the logits' scale.

    **Arguments:**

    - `logits`: per-member logits, shape `(members, batch, classes)`.
    - `temperature`: the temperature `T > 0` (the paper uses 1).

    **Returns:**

    One score per example, shape `(batch,)`, ready for `ee.metrics.ood_auroc`.

    **Example:**

    ```python
    logits = jnp.array([[[10.0, 0.0], [0.0, 0.0]]])   # 1 member, 2 inputs
    ee.metrics.energy_score(logits)   # [-10.00005, -log 2]: the second is more OOD
    ```
    """
    temperature = _check_temperature(temperature)
    predictions = prepare_predictions(logits, from_logits=True, name="logits")
    return _energy_score(predictions, temperature)


@compiled("temperature")
def _energy_score(predictions: Array, temperature: float) -> Array:
    energies = -temperature * jax.nn.logsumexp(predictions / temperature, axis=-1)
    return jnp.mean(energies, axis=0)


def max_logit_score(
    logits: Float[ArrayLike, " members batch classes"],
) -> Float[Array, " batch"]:
    """Minus the largest logit, `-max_c f_c(x)` (Hendrycks et al. 2022, "Scaling
    out-of-distribution detection for real-world settings"), averaged over members:
    an OOD score, higher for inputs more likely OOD.

    **Arguments:**

    - `logits`: per-member logits, shape `(members, batch, classes)`.

    **Returns:**

    One score per example, shape `(batch,)`.

    **Example:**

    ```python
    logits = jnp.array([[[3.0, 1.0]], [[0.0, 5.0]]])   # 2 members, 1 input
    ee.metrics.max_logit_score(logits)                 # [-(3 + 5) / 2] = [-4.0]
    ```
    """
    predictions = prepare_predictions(logits, from_logits=True, name="logits")
    return _max_logit_score(predictions)


@one_shot_jit
def _max_logit_score(predictions: Array) -> Array:
    return 0.0 - jnp.mean(jnp.max(predictions, axis=-1), axis=0)


def max_probability_score(
    probs: Float[ArrayLike, " members batch classes"], *, from_logits: bool = False
) -> Float[Array, " batch"]:
    """One minus the ensemble's largest mean class probability (the
    maximum-softmax-probability baseline of Hendrycks and Gimpel 2017): an OOD
    score in `[0, 1 - 1/classes]`, higher for inputs more likely OOD.

    **Arguments:** as `ee.metrics.predictive_entropy`.

    **Returns:**

    One score per example, shape `(batch,)`.

    **Example:**

    ```python
    probs = jnp.array([[[0.9, 0.1]], [[0.5, 0.5]]])   # 2 members, 1 input
    ee.metrics.max_probability_score(probs)           # [1 - 0.7] = [0.3]
    ```
    """
    predictions = prepare_predictions(probs, from_logits=from_logits)
    return _max_probability_score(predictions, from_logits)


@compiled("from_logits")
def _max_probability_score(predictions: Array, from_logits: bool) -> Array:
    member_probs, _ = member_log_probs(predictions, from_logits=from_logits)
    return 1.0 - jnp.max(jnp.mean(member_probs, axis=0), axis=-1)
