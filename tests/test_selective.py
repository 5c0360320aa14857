"""Selective-prediction and OOD metrics against independent references:
scikit-learn's ROC/PR functions, hand-written NumPy loops over every cut-off,
exhaustive enumeration of tie-breaking orders, and Traub et al.'s closed form."""

import itertools

import jax.numpy as jnp
import numpy as np
import pytest
from sklearn.metrics import average_precision_score, roc_auc_score, roc_curve

import eqx_ensemble as ee

m = ee.metrics


def numpy_risks(confidence, losses):
    """Selective risk at k = 1..n by a plain loop (no ties)."""
    order = np.argsort(-confidence, kind="stable")
    return np.array([losses[order[:k]].mean() for k in range(1, len(confidence) + 1)])


@pytest.mark.parametrize("seed", range(5))
def test_aurc_and_augrc_match_numpy_without_ties(seed):
    rng = np.random.default_rng(seed)
    n = 200
    confidence = rng.random(n).astype(np.float32)
    errors = (rng.random(n) < 0.3 + 0.4 * (1 - confidence)).astype(np.float32)
    risks = numpy_risks(confidence, errors)
    coverage, risk = m.risk_coverage_curve(confidence, errors)
    np.testing.assert_allclose(coverage, np.arange(1, n + 1) / n, rtol=1e-6)
    np.testing.assert_allclose(risk, risks, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(
        float(m.aurc(confidence, errors)), risks.mean(), rtol=1e-5
    )
    # AUGRC: Traub et al.'s closed form from accuracy and the failure AUROC.
    accuracy = 1 - errors.mean()
    auroc = roc_auc_score(1 - errors, confidence)  # correct = positive
    closed = (1 - accuracy) * accuracy * (1 - auroc) + 0.5 * (1 - accuracy) ** 2
    np.testing.assert_allclose(float(m.augrc(confidence, errors)), closed, rtol=1e-5)


def test_ties_count_by_their_expected_value_over_random_orders():
    confidence = np.array([0.9, 0.7, 0.7, 0.7, 0.2, 0.2], np.float32)
    errors = np.array([0, 1, 0, 1, 1, 0], np.float32)
    # Every order that keeps the confidence ranking, equally likely.
    groups = [[0], [1, 2, 3], [4, 5]]
    curves = [
        numpy_risks(np.arange(6, 0, -1, dtype=np.float32), errors[list(order)])
        for order in (
            [i for g in perm for i in g]
            for perm in itertools.product(
                *[list(itertools.permutations(g)) for g in groups]
            )
        )
    ]
    _, risk = m.risk_coverage_curve(confidence, errors)
    # Risk at k is E[cumulative loss]/k: average the cumulative losses, then divide.
    k = np.arange(1, 7)
    expected = np.mean([c * k for c in curves], axis=0) / k
    np.testing.assert_allclose(risk, expected, rtol=1e-6)
    auroc = roc_auc_score(1 - errors, confidence)
    accuracy = 1 - errors.mean()
    closed = (1 - accuracy) * accuracy * (1 - auroc) + 0.5 * (1 - accuracy) ** 2
    np.testing.assert_allclose(float(m.augrc(confidence, errors)), closed, rtol=1e-6)


def test_accuracy_at_coverage():
    rng = np.random.default_rng(1)
    confidence = rng.random(100).astype(np.float32)
    correct = rng.random(100) < confidence
    order = np.argsort(-confidence)
    for coverage in (0.1, 0.35, 0.5, 1.0):
        k = int(np.ceil(coverage * 100))
        expected = correct[order[:k]].mean()
        got = float(m.accuracy_at_coverage(confidence, correct, coverage))
        assert got == pytest.approx(expected, rel=1e-6)


def test_an_ensemble_ranks_its_mistakes_better_than_a_random_score():
    rng = np.random.default_rng(2)
    confidence = rng.random(500).astype(np.float32)
    errors = rng.random(500) > confidence  # wrong more often when unsure
    shuffled = rng.permutation(confidence)
    assert float(m.aurc(confidence, errors)) < float(m.aurc(shuffled, errors))
    assert float(m.augrc(confidence, errors)) < float(m.augrc(shuffled, errors))


@pytest.mark.parametrize("seed", range(5))
def test_ood_aupr_and_fpr_match_scikit_learn(seed):
    rng = np.random.default_rng(seed)
    # Integer-valued scores: many ties between and within the two sets.
    in_scores = rng.integers(0, 6, 40).astype(np.float32)
    out_scores = rng.integers(2, 9, 25).astype(np.float32)
    labels = np.r_[np.zeros(40), np.ones(25)]
    scores = np.r_[in_scores, out_scores]
    assert float(m.ood_aupr(in_scores, out_scores)) == pytest.approx(
        average_precision_score(labels, scores), rel=1e-5
    )
    fpr, tpr, _ = roc_curve(labels, scores, drop_intermediate=False)
    for target in (0.95, 0.8, 0.5):
        expected = fpr[np.argmax(tpr >= target - 1e-12)]
        got = float(m.ood_fpr_at_tpr(in_scores, out_scores, tpr=target))
        assert got == pytest.approx(expected, abs=1e-6)
    assert float(m.ood_auroc(in_scores, out_scores)) == pytest.approx(
        roc_auc_score(labels, scores), rel=1e-5
    )


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="`losses` must have one value per example"):
        m.aurc(jnp.ones(3), jnp.ones(4))
    with pytest.raises(ValueError, match="`confidence` has 1 non-finite"):
        m.aurc(jnp.array([0.1, jnp.nan]), jnp.ones(2))
    with pytest.raises(ValueError, match="`coverage` must lie in"):
        m.accuracy_at_coverage(jnp.ones(3), jnp.ones(3, bool), 0.0)
    with pytest.raises(ValueError, match="`correct` must hold 0/1"):
        m.accuracy_at_coverage(jnp.ones(3), jnp.array([0, 2, 1]), 0.5)
    with pytest.raises(ValueError, match="`tpr` must lie in"):
        m.ood_fpr_at_tpr(jnp.ones(3), jnp.ones(3), tpr=1.5)
    with pytest.raises(ValueError, match="NaN"):
        m.ood_aupr(jnp.array([jnp.nan]), jnp.ones(3))
