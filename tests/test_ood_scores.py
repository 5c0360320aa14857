"""OOD scores against their formulas, written independently in NumPy/SciPy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.special import logsumexp, softmax

import eqx_ensemble as ee


@pytest.fixture
def logits():
    return 3.0 * np.asarray(jax.random.normal(jax.random.key(0), (4, 50, 6)))


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_energy_score_is_the_members_mean_free_energy(logits, temperature):
    expected = np.mean(-temperature * logsumexp(logits / temperature, axis=-1), axis=0)
    got = ee.metrics.energy_score(logits, temperature=temperature)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_energy_score_of_one_member_is_liu_et_al(logits):
    one = logits[:1]
    np.testing.assert_allclose(
        ee.metrics.energy_score(one), -logsumexp(one[0], axis=-1), rtol=1e-5
    )


def test_max_logit_score(logits):
    expected = -np.mean(np.max(logits, axis=-1), axis=0)
    np.testing.assert_allclose(ee.metrics.max_logit_score(logits), expected, rtol=1e-6)


def test_max_probability_score_from_logits_and_probs(logits):
    probs = softmax(logits, axis=-1)
    expected = 1.0 - np.max(np.mean(probs, axis=0), axis=-1)
    np.testing.assert_allclose(
        ee.metrics.max_probability_score(logits, from_logits=True), expected, atol=1e-6
    )
    np.testing.assert_allclose(
        ee.metrics.max_probability_score(probs.astype(np.float32)), expected, atol=1e-6
    )


def test_scores_rank_into_ood_auroc_like_sklearn(logits):
    from sklearn.metrics import roc_auc_score

    shifted = logits - 4.0  # every logit lower: nothing is claimed
    for score in (ee.metrics.energy_score, ee.metrics.max_logit_score):
        s_in, s_out = np.asarray(score(logits)), np.asarray(score(shifted))
        labels = np.r_[np.zeros(len(s_in)), np.ones(len(s_out))]
        np.testing.assert_allclose(
            ee.metrics.ood_auroc(s_in, s_out),
            roc_auc_score(labels, np.r_[s_in, s_out]),
            atol=1e-6,
        )
    # A shift of every logit leaves the softmax unchanged: MSP cannot see it.
    msp_in = ee.metrics.max_probability_score(logits, from_logits=True)
    msp_out = ee.metrics.max_probability_score(shifted, from_logits=True)
    np.testing.assert_allclose(msp_in, msp_out, atol=1e-6)


def test_scores_run_under_jit(logits):
    got = jax.jit(ee.metrics.energy_score)(jnp.asarray(logits))
    np.testing.assert_allclose(got, ee.metrics.energy_score(logits), rtol=1e-6)


@pytest.mark.parametrize("temperature", [0.0, -1.0, float("inf"), float("nan")])
def test_energy_temperature_out_of_range(logits, temperature):
    with pytest.raises(ValueError, match="temperature"):
        ee.metrics.energy_score(logits, temperature=temperature)


def test_scores_name_bad_shapes():
    with pytest.raises((ValueError, TypeError), match="logits"):
        ee.metrics.energy_score(np.ones((5, 3)))
    with pytest.raises((ValueError, TypeError), match="logits"):
        ee.metrics.max_logit_score(np.ones((5,)))
    with pytest.raises(ValueError, match="probs"):
        ee.metrics.max_probability_score(np.full((2, 3, 4), 0.9))
