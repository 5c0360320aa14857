"""Random-search samplers (`ee.sweep`) and selection (`ee.greedy_selection`,
`ee.greedy_soup`) against distribution tests and hand-written NumPy loops."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tree_equal
from scipy import stats

import eqx_ensemble as ee


def test_log_uniform_is_uniform_in_the_logarithm():
    draws = np.asarray(ee.sweep.log_uniform(1e-4, 1e-1).draw(jax.random.key(0), 4000))
    assert draws.min() >= 1e-4 and draws.max() < 1e-1
    logs = (np.log(draws) - np.log(1e-4)) / (np.log(1e-1) - np.log(1e-4))
    assert stats.kstest(logs, "uniform").pvalue > 1e-3
    # Not uniform in the value itself: most draws are far below the midpoint.
    assert np.mean(draws < 0.05) > 0.9


def test_uniform_choice_and_sample():
    draws = np.asarray(ee.sweep.uniform(-1.0, 3.0).draw(jax.random.key(1), 4000))
    assert stats.kstest((draws + 1) / 4, "uniform").pvalue > 1e-3
    picks = np.asarray(ee.sweep.choice([0.0, 0.5, 2.0]).draw(jax.random.key(2), 3000))
    values, counts = np.unique(picks, return_counts=True)
    assert values.tolist() == [0.0, 0.5, 2.0]
    assert stats.chisquare(counts).pvalue > 1e-3
    space = {
        "lr": ee.sweep.log_uniform(1e-3, 1e-1),
        "wd": ee.sweep.log_uniform(1e-3, 1e-1),
        "momentum": 0.9,
    }
    settings = ee.sweep.sample(jax.random.key(3), space, size=16)
    assert settings["lr"].shape == settings["wd"].shape == (16,)
    assert not np.allclose(settings["lr"], settings["wd"])  # independent keys
    np.testing.assert_allclose(settings["momentum"], 0.9)
    again = ee.sweep.sample(jax.random.key(3), space, size=16)
    assert tree_equal(settings, again)


def test_sampler_errors():
    with pytest.raises(ValueError, match="positive bounds"):
        ee.sweep.log_uniform(0.0, 1.0)
    with pytest.raises(ValueError, match="low < high"):
        ee.sweep.uniform(1.0, 1.0)
    with pytest.raises(ValueError, match="at least one value"):
        ee.sweep.choice([])
    with pytest.raises(TypeError, match="leaf 0 is a str"):
        ee.sweep.sample(jax.random.key(0), {"a": "adam"}, size=2)
    with pytest.raises(ValueError, match="positive int"):
        ee.sweep.sample(jax.random.key(0), {"a": 1.0}, size=0)


def caruana_by_hand(probs, labels, size, replacement=True):
    """Greedy forward selection, NLL of the mean probabilities."""

    def nll(indices):
        mean = probs[indices].mean(0)
        return -np.mean(np.log(mean[np.arange(len(labels)), labels]))

    chosen = [int(np.argmin([nll([i]) for i in range(len(probs))]))]
    while len(chosen) < size:
        candidates = [i for i in range(len(probs)) if replacement or i not in chosen]
        trials = [nll(chosen + [i]) for i in candidates]
        chosen.append(candidates[int(np.argmin(trials))])
    return chosen


@pytest.mark.parametrize("seed", range(3))
def test_greedy_selection_is_caruanas_algorithm(seed):
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 4, 80)
    logits = (
        rng.normal(size=(7, 80, 4)) + 2.0 * rng.random((7, 1, 1)) * np.eye(4)[labels]
    )
    probs = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    picks = ee.greedy_selection(
        jnp.asarray(probs, jnp.float32),
        lambda p: ee.metrics.nll(p, jnp.asarray(labels)),
        size=6,
    )
    assert picks.tolist() == caruana_by_hand(probs.astype(np.float32), labels, 6)
    distinct = ee.greedy_selection(
        jnp.asarray(probs, jnp.float32),
        lambda p: ee.metrics.nll(p, jnp.asarray(labels)),
        size=6,
        replacement=False,
    )
    assert distinct.tolist() == caruana_by_hand(
        probs.astype(np.float32), labels, 6, replacement=False
    )
    assert len(set(distinct.tolist())) == 6


def test_greedy_soup_is_the_papers_loop(getkey):
    base = eqx.nn.MLP(2, 1, 8, 1, key=getkey())
    offsets = [0.0, 0.02, -0.03, 1.5, 0.01]
    models = [
        jax.tree.map(lambda w, d=d: w + d if eqx.is_array(w) else w, base)
        for d in offsets
    ]
    ens = ee.stack(models)
    x = jax.random.normal(getkey(), (20, 2))
    target = jax.vmap(base)(x) + 0.005

    def score(model):
        return jnp.mean((jax.vmap(model)(x) - target) ** 2)

    soup, chosen = ee.greedy_soup(ens, score)
    # By hand: best first; keep a member if the average scores no worse.
    alone = [float(score(m)) for m in models]
    order = np.argsort(alone, kind="stable")
    kept, best = [int(order[0])], alone[int(order[0])]
    for i in order[1:]:
        trial = kept + [int(i)]
        value = float(score(ee.average(ens[np.asarray(trial)])))
        if value <= best:
            kept, best = trial, value
    assert chosen.tolist() == kept
    assert 3 not in kept  # the far-off member spoils the soup
    assert tree_equal(soup, ee.average(ens[np.asarray(kept)]))


def test_selection_errors():
    with pytest.raises(ValueError, match="member axis first"):
        ee.greedy_selection([jnp.ones((3, 4)), jnp.ones((2, 4))], lambda p: 0.0, size=2)
    with pytest.raises(ValueError, match="must return a scalar"):
        ee.greedy_selection(jnp.ones((3, 4)), lambda p: p, size=2)
    with pytest.raises(ValueError, match="`start=4`"):
        ee.greedy_selection(jnp.ones((3, 4)), jnp.sum, size=5, start=4)
    with pytest.raises(TypeError, match="Ensemble"):
        ee.greedy_soup([eqx.nn.Linear(1, 1, key=jax.random.key(0))], lambda m: 0.0)


def test_greedy_selection_never_picks_a_nan_member():
    predictions = jnp.stack([jnp.full((4,), v) for v in (0.3, 0.1, 0.2, 0.0)])

    def score(selected):  # member 3's predictions give a NaN score
        mean = selected.mean(0)
        return jnp.where(jnp.any(mean == 0.0), jnp.nan, jnp.mean((mean - 0.1) ** 2))

    chosen = ee.greedy_selection(predictions, score, size=2)
    assert 3 not in np.asarray(chosen).tolist()
    with pytest.raises(ValueError, match="NaN"):
        ee.greedy_selection(predictions[3:], score, size=1)
