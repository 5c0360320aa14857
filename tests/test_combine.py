"""`ee.combine`: every combination rule against a NumPy reference."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jaxtyping
import numpy as np
import pytest

import eqx_ensemble as ee
from eqx_ensemble._internal.checks import normalised_weights

MEMBERS, BATCH, CLASSES = 5, 11, 4


def _softmax(logits):
    logits = np.asarray(logits, dtype=np.float64)
    shifted = logits - logits.max(axis=-1, keepdims=True)
    exp = np.exp(shifted)
    return exp / exp.sum(axis=-1, keepdims=True)


@pytest.fixture
def logits():
    return jnp.asarray(
        np.random.default_rng(0).normal(scale=3.0, size=(MEMBERS, BATCH, CLASSES)),
        dtype=jnp.float32,
    )


@pytest.fixture
def weights():
    return jnp.asarray([0.1, 0.4, 0.2, 0.0, 1.3], dtype=jnp.float32)


def test_all_names_exported():
    assert set(ee.combine.__all__) == {
        "mean_probs",
        "mean_probs_from_logits",
        "log_mean_probs_from_logits",
        "mean_logits",
        "majority_vote",
        "gaussian_mixture",
    }


def test_mean_probs(logits, weights):
    probs = jax.nn.softmax(logits, axis=-1)
    np.testing.assert_allclose(
        ee.combine.mean_probs(probs), np.mean(np.asarray(probs), axis=0), rtol=1e-5
    )
    np.testing.assert_allclose(
        ee.combine.mean_probs(probs, weights),
        np.average(np.asarray(probs), axis=0, weights=np.asarray(weights)),
        rtol=1e-5,
    )
    # Weights are normalised: scaling them changes nothing.
    np.testing.assert_allclose(
        ee.combine.mean_probs(probs, 10 * weights),
        ee.combine.mean_probs(probs, weights),
        rtol=1e-6,
    )
    # Equal weights are the plain mean; a one-hot weight picks that member.
    np.testing.assert_allclose(
        ee.combine.mean_probs(probs, jnp.ones(MEMBERS)),
        ee.combine.mean_probs(probs),
        rtol=1e-6,
    )
    np.testing.assert_allclose(
        ee.combine.mean_probs(probs, jnp.eye(MEMBERS)[2]), probs[2], rtol=1e-6
    )


def test_mean_probs_no_batch_axis(logits):
    probs = jax.nn.softmax(logits[:, 0], axis=-1)  # (members, classes)
    np.testing.assert_allclose(
        ee.combine.mean_probs(probs), np.mean(np.asarray(probs), axis=0), rtol=1e-5
    )


def test_mean_probs_from_logits(logits, weights):
    expected = _softmax(logits).mean(axis=0)
    got = ee.combine.mean_probs_from_logits(logits)
    assert got.shape == (BATCH, CLASSES)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(got.sum(-1), 1.0, rtol=1e-5)
    weighted = np.average(_softmax(logits), axis=0, weights=np.asarray(weights))
    np.testing.assert_allclose(
        ee.combine.mean_probs_from_logits(logits, weights),
        weighted,
        rtol=1e-5,
        atol=1e-7,
    )


def test_log_mean_probs_from_logits(logits, weights):
    expected = np.log(_softmax(logits).mean(axis=0))
    np.testing.assert_allclose(
        ee.combine.log_mean_probs_from_logits(logits), expected, rtol=1e-5, atol=1e-5
    )
    weighted = np.log(np.average(_softmax(logits), axis=0, weights=np.asarray(weights)))
    np.testing.assert_allclose(
        ee.combine.log_mean_probs_from_logits(logits, weights),
        weighted,
        rtol=1e-5,
        atol=1e-5,
    )


def test_log_mean_probs_stays_finite_where_probs_underflow():
    # softmax gives exactly 0 in float32 for the second class; log of the mean is
    # still finite: log((e^-200 + e^-300) / 2) ~ -200 - log 2.
    logits = jnp.array([[[0.0, -200.0]], [[0.0, -300.0]], [[0.0, -250.0]]])
    assert float(jax.nn.softmax(logits, axis=-1)[0, 0, 1]) == 0.0
    out = ee.combine.log_mean_probs_from_logits(logits)
    assert bool(jnp.all(jnp.isfinite(out)))
    # Reference in float64 log-space: log(mean_i exp(log_softmax_i)).
    log_probs = np.stack(
        [
            np.asarray(row, dtype=np.float64)
            - np.logaddexp.reduce(np.asarray(row, dtype=np.float64), axis=-1)[..., None]
            for row in np.asarray(logits)
        ]
    )
    expected = np.logaddexp.reduce(log_probs, axis=0) - np.log(3.0)
    np.testing.assert_allclose(out, expected, rtol=1e-6, atol=1e-4)
    np.testing.assert_allclose(out[0, 1], -200.0 - np.log(3.0), atol=1e-3)


def test_zero_weight_member_is_ignored(logits):
    weights = jnp.array([1.0, 0.0, 1.0, 0.0, 0.0])
    np.testing.assert_allclose(
        ee.combine.log_mean_probs_from_logits(logits, weights),
        ee.combine.log_mean_probs_from_logits(logits[jnp.array([0, 2])]),
        rtol=1e-5,
        atol=1e-6,
    )


def test_mean_logits(logits, weights):
    np.testing.assert_allclose(
        ee.combine.mean_logits(logits), np.mean(np.asarray(logits), axis=0), rtol=1e-5
    )
    np.testing.assert_allclose(
        ee.combine.mean_logits(logits, weights),
        np.average(np.asarray(logits), axis=0, weights=np.asarray(weights)),
        rtol=1e-5,
        atol=1e-6,
    )
    # softmax(mean logits) is the normalised geometric mean of the probabilities.
    geometric = np.exp(np.log(_softmax(logits)).mean(axis=0))
    geometric /= geometric.sum(-1, keepdims=True)
    np.testing.assert_allclose(
        jax.nn.softmax(ee.combine.mean_logits(logits), axis=-1), geometric, rtol=1e-5
    )


def _vote_reference(votes, num_classes, weights=None):
    votes = np.asarray(votes)
    weights = np.ones(votes.shape[0]) if weights is None else np.asarray(weights)
    result = np.zeros(votes.shape[1:], dtype=np.int64)
    for index in np.ndindex(*votes.shape[1:]):
        tally = [0.0] * num_classes
        for member in range(votes.shape[0]):
            tally[int(votes[(member, *index)])] += float(weights[member])
        best = max(tally)
        result[index] = min(c for c in range(num_classes) if tally[c] == best)
    return result


@pytest.mark.parametrize("members", [2, 4, 6, 12])
def test_majority_vote_matches_loop_with_ties(members):
    rng = np.random.default_rng(members)
    votes = rng.integers(0, 3, size=(members, 300))
    got = ee.combine.majority_vote(jnp.asarray(votes, dtype=jnp.int32), num_classes=3)
    expected = _vote_reference(votes, 3)
    np.testing.assert_array_equal(got, expected)
    # Ties happen in this data, so the tie rule is really exercised.
    counts = np.stack([(votes == c).sum(0) for c in range(3)])
    tied = (counts == counts.max(0)).sum(0) > 1
    assert tied.sum() > 10


def test_majority_vote_tie_goes_to_smallest_class():
    votes = jnp.array([[2, 1, 0], [1, 2, 3], [1, 3, 3], [2, 0, 0]])
    np.testing.assert_array_equal(
        ee.combine.majority_vote(votes, num_classes=4), [1, 0, 0]
    )


def test_majority_vote_weighted_and_batched():
    rng = np.random.default_rng(1)
    votes = rng.integers(0, 4, size=(5, 6, 7))
    weights = rng.uniform(0.1, 2.0, size=5).astype(np.float32)
    got = ee.combine.majority_vote(
        jnp.asarray(votes, dtype=jnp.int32), num_classes=4, weights=jnp.asarray(weights)
    )
    assert got.shape == (6, 7)
    np.testing.assert_array_equal(got, _vote_reference(votes, 4, weights))
    # A heavy member outvotes the rest.
    heavy = jnp.array([10.0, 1.0, 1.0, 1.0, 1.0])
    np.testing.assert_array_equal(
        ee.combine.majority_vote(
            jnp.asarray(votes, dtype=jnp.int32), num_classes=4, weights=heavy
        ),
        votes[0],
    )


def test_majority_vote_errors():
    votes = jnp.array([[0, 1], [2, 3]])
    with pytest.raises(
        ValueError, match=r"labels must lie in \[0, 3\), found .*\[0, 3\]"
    ):
        ee.combine.majority_vote(votes, num_classes=3)
    with pytest.raises(ValueError, match=r"found labels in \[-1, 1\]"):
        ee.combine.majority_vote(jnp.array([[-1, 1]]), num_classes=3)
    with pytest.raises(ValueError, match="`num_classes` must be at least 1"):
        ee.combine.majority_vote(votes, num_classes=0)
    with pytest.raises(jaxtyping.TypeCheckError):
        ee.combine.majority_vote(jnp.ones((2, 3)), num_classes=3)


def test_gaussian_mixture_law_of_total_variance():
    rng = np.random.default_rng(2)
    means = rng.normal(size=(MEMBERS, 8))
    variances = rng.uniform(0.1, 2.0, size=(MEMBERS, 8))
    for weights in (None, rng.uniform(0.0, 1.0, size=MEMBERS)):
        w = (
            np.full(MEMBERS, 1.0 / MEMBERS)
            if weights is None
            else weights / weights.sum()
        )
        mean, variance = ee.combine.gaussian_mixture(
            jnp.asarray(means, dtype=jnp.float32),
            jnp.asarray(variances, dtype=jnp.float32),
            None if weights is None else jnp.asarray(weights, dtype=jnp.float32),
        )
        expected_mean = (w[:, None] * means).sum(0)
        # E[Var] + Var[E], written as E[sigma^2 + mu^2] - mean^2 (uncentred form).
        expected_variance = (w[:, None] * (variances + means**2)).sum(
            0
        ) - expected_mean**2
        np.testing.assert_allclose(mean, expected_mean, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(variance, expected_variance, rtol=1e-5, atol=1e-5)


def test_gaussian_mixture_matches_samples():
    # Moments of samples drawn from the mixture.
    rng = np.random.default_rng(3)
    means = np.array([[-1.0], [0.5], [3.0]])
    variances = np.array([[0.25], [1.0], [0.5]])
    component = rng.integers(0, 3, size=400_000)
    samples = rng.normal(means[component, 0], np.sqrt(variances[component, 0]))
    mean, variance = ee.combine.gaussian_mixture(
        jnp.asarray(means, dtype=jnp.float32), jnp.asarray(variances, dtype=jnp.float32)
    )
    np.testing.assert_allclose(mean[0], samples.mean(), atol=0.02)
    np.testing.assert_allclose(variance[0], samples.var(), rtol=0.02)


def test_gaussian_mixture_no_cancellation():
    # Large equal means: the uncentred formula would lose the small variance.
    means = jnp.full((4, 3), 1e4)
    variances = jnp.full((4, 3), 1e-3)
    _, variance = ee.combine.gaussian_mixture(means, variances)
    np.testing.assert_allclose(variance, 1e-3, rtol=1e-5)


def test_gaussian_mixture_shape_mismatch():
    with pytest.raises((ValueError, jaxtyping.TypeCheckError)):
        ee.combine.gaussian_mixture(jnp.ones((3, 2)), jnp.ones((3, 4)))


def test_combine_under_jit_with_traced_weights(logits, weights):
    run = jax.jit(ee.combine.mean_probs_from_logits)
    np.testing.assert_allclose(
        run(logits, weights),
        ee.combine.mean_probs_from_logits(logits, weights),
        rtol=1e-6,
    )
    votes = jnp.argmax(logits, axis=-1)
    vote = eqx.filter_jit(ee.combine.majority_vote)
    np.testing.assert_array_equal(
        vote(votes, CLASSES, weights), _vote_reference(votes, CLASSES, weights)
    )


# --------------------------------------------------------------------------------
# Bad weights: beartype sees the member count through the shape annotations; the
# library's own check covers what annotations cannot.
# --------------------------------------------------------------------------------


def test_beartype_catches_wrong_member_count(logits):
    probs = jax.nn.softmax(logits, axis=-1)
    with pytest.raises(jaxtyping.TypeCheckError):
        ee.combine.mean_probs(probs, jnp.ones(MEMBERS + 1))
    with pytest.raises(jaxtyping.TypeCheckError):
        ee.combine.mean_probs_from_logits(logits, jnp.ones((MEMBERS, 1)))
    with pytest.raises(jaxtyping.TypeCheckError):
        ee.combine.gaussian_mixture(jnp.ones((3, 2)), jnp.ones((3, 2)), jnp.ones(2))


def test_beartype_catches_wrong_rank_and_dtype(logits):
    with pytest.raises(jaxtyping.TypeCheckError):
        ee.combine.mean_probs(jnp.ones(MEMBERS))  # no class axis
    with pytest.raises(jaxtyping.TypeCheckError):
        ee.combine.mean_logits(jnp.ones((MEMBERS, 3), dtype=jnp.int32))


def test_bfloat16_weights_are_taken():
    # NumPy calls bfloat16 kind "V" (not a number): the check reads JAX's dtype.
    probs = jax.nn.softmax(jax.random.normal(jax.random.key(0), (3, 4, 5)))
    expected = ee.combine.mean_probs(probs, weights=jnp.array([1.0, 2.0, 1.0]))
    half = ee.combine.mean_probs(probs, weights=jnp.array([1, 2, 1], jnp.bfloat16))
    np.testing.assert_allclose(half, expected, rtol=1e-6)


def test_weight_count_message():
    with pytest.raises(
        ValueError, match=r"predictions have 5 members, weights have shape \(3,\)"
    ):
        # Users without the jaxtyping hook get this message from the combiners.
        normalised_weights(jnp.ones(3), 5, jnp.float32, "predictions have")


@pytest.mark.parametrize(
    "bad", [[1.0, -1.0, 1.0], [0.0, 0.0, 0.0], [1.0, float("nan"), 1.0]]
)
def test_bad_weight_values(bad):
    with pytest.raises(ValueError, match="finite and non-negative with a positive sum"):
        ee.combine.mean_probs(jnp.ones((3, 2, 2)) / 2, jnp.asarray(bad))


def test_weights_as_lists_and_integers(logits):
    # Regression: a Python list (or integer counts) of weights failed the type check.
    probs = jax.nn.softmax(logits, axis=-1)
    counts = [1, 2, 0, 3, 1]
    expected = np.average(np.asarray(probs), axis=0, weights=counts)
    for weights in (counts, [float(c) for c in counts], jnp.asarray(counts)):
        np.testing.assert_allclose(
            ee.combine.mean_probs(probs, weights), expected, rtol=1e-5
        )
    votes = jnp.argmax(logits, axis=-1)
    np.testing.assert_array_equal(
        ee.combine.majority_vote(votes, CLASSES, counts),
        _vote_reference(votes, CLASSES, counts),
    )


# -------------------------------- integer, negative and non-finite inputs named


def test_combination_rules_refuse_integer_predictions():
    from eqx_ensemble.combine import _check_floating

    with pytest.raises(TypeError, match="`probs` must hold floating-point values"):
        _check_floating(jnp.ones((2, 3, 4), dtype=jnp.int32), "probs")


def test_majority_vote_refuses_float_labels():
    votes = jnp.array([[0.0, 1.0], [1.0, 1.0]])
    with pytest.raises(TypeError, match="predictions|Int"):
        ee.combine.majority_vote(votes, num_classes=2)  # type: ignore[arg-type]


def test_gaussian_mixture_refuses_negative_variances():
    means = jnp.zeros((2, 3))
    with pytest.raises(ValueError, match="`variances` must be non-negative"):
        ee.combine.gaussian_mixture(means, jnp.full((2, 3), -1.0))


def test_positive_infinite_logits_are_named_not_nan():
    logits = jnp.array([[[0.0, jnp.inf]], [[0.0, 1.0]]])
    with pytest.raises(ValueError, match="`logits` holds inf at index \\(0, 0, 1\\)"):
        ee.combine.mean_probs_from_logits(logits)
    masked = jnp.array([[[0.0, -jnp.inf]], [[0.0, 1.0]]])
    assert np.isfinite(np.asarray(ee.combine.mean_probs_from_logits(masked))).all()


def test_nan_regression_inputs_are_named():
    with pytest.raises(ValueError, match="`means` holds nan"):
        ee.combine.gaussian_mixture(
            jnp.array([[0.0, jnp.nan]]), jnp.array([[1.0, 1.0]])
        )
