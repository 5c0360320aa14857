"""Conformal risk control and Learn-then-Test (`ee.conformal.risk_control`,
`ee.conformal.learn_then_test`): thresholds against direct NumPy/SciPy
implementations of the papers' rules, and each guarantee checked over many
calibration draws of a distribution whose risk is known in closed form."""

import math
import warnings

import numpy as np
import pytest
import scipy.stats
from conftest import repeat

import eqx_ensemble as ee
from eqx_ensemble._metrics.risk import hoeffding_bentkus

GRID = np.linspace(0.0, 1.0, 201)


def _misses(n, rng):
    # Scores uniform on (0, 1); the loss at lambda: the score exceeds lambda.
    # Its risk is 1 - lambda exactly.
    scores = rng.uniform(size=n)
    return (scores[:, None] > GRID[None, :]).astype(np.float64)


def _crc_reference(losses, lambdas, alpha, bound):
    n = len(losses)
    for j, lam in enumerate(lambdas):
        if (n / (n + 1)) * losses[:, j].mean() + bound / (n + 1) <= alpha:
            return lam
    return lambdas[-1]


def _ltt_reference(losses, lambdas, alpha, delta):
    n = len(losses)
    chosen = None
    for j in range(len(lambdas) - 1, -1, -1):
        r = losses[:, j].mean()
        a = min(r, alpha)
        h1 = (a * math.log(a / alpha) if a > 0 else 0.0) + (
            (1 - a) * math.log((1 - a) / (1 - alpha)) if a < 1 else 0.0
        )
        p = min(
            math.exp(-n * h1),
            math.e * scipy.stats.binom.cdf(math.ceil(n * r - 1e-9), n, alpha),
        )
        if p > delta:
            break
        chosen = lambdas[j]
    return lambdas[-1] if chosen is None else chosen


def test_thresholds_are_the_papers_rules():
    rng = np.random.default_rng(0)
    for trial in range(20):
        n = int(rng.integers(20, 400))
        # Monotone losses in [0, 2]: a random non-increasing staircase each.
        steps = rng.uniform(size=(n, len(GRID))) < 0.02
        losses = 2.0 * (1.0 - np.minimum(np.cumsum(steps, axis=1), 4) / 4)
        alpha = float(rng.uniform(0.1, 0.6))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ee.conformal.RiskNotControlledWarning)
            got = ee.conformal.risk_control(losses, GRID, alpha=alpha, bound=2.0)
        assert float(got.threshold) == pytest.approx(
            _crc_reference(losses, GRID, alpha, 2.0), abs=1e-7
        ), trial
        binary = _misses(n, rng)
        delta = float(rng.uniform(0.05, 0.2))
        got = ee.conformal.learn_then_test(binary, GRID, alpha=0.2, delta=delta)
        assert float(got.threshold) == pytest.approx(
            _ltt_reference(binary, GRID, 0.2, delta), abs=1e-7
        ), trial
        assert float(got.risk) == pytest.approx(binary[:, got.index].mean(), abs=1e-6)


def test_hoeffding_bentkus_p_value_against_scipy():
    for n, risk, alpha in [(100, 0.05, 0.1), (1000, 0.08, 0.1), (50, 0.3, 0.2),
                           (200, 0.0, 0.05), (30, 0.5, 0.5)]:  # fmt: skip
        a = min(risk, alpha)
        h1 = (a * math.log(a / alpha) if a else 0.0) + (1 - a) * math.log(
            (1 - a) / (1 - alpha)
        )
        bentkus = math.e * scipy.stats.binom.cdf(math.ceil(n * risk), n, alpha)
        expected = min(math.exp(-n * h1), bentkus, 1.0)
        assert hoeffding_bentkus(risk, n, alpha) == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize("n", [50, repeat(200)])
def test_the_guarantees_hold_over_calibration_draws(n):
    rng = np.random.default_rng(n)
    draws, alpha, delta = 1000, 0.1, 0.1
    crc_risks, ltt_risks = [], []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ee.conformal.RiskNotControlledWarning)
        for _ in range(draws):
            losses = _misses(n, rng)
            crc = ee.conformal.risk_control(losses, GRID, alpha=alpha)
            ltt = ee.conformal.learn_then_test(losses, GRID, alpha=alpha, delta=delta)
            crc_risks.append(1.0 - float(crc.threshold))  # the population risk
            ltt_risks.append(1.0 - float(ltt.threshold))
    crc_risks, ltt_risks = np.array(crc_risks), np.array(ltt_risks)
    # Conformal risk control: E[risk] <= alpha, and tight (the rule's slack is
    # at most 1 / (n + 1), plus the grid's step).
    se = crc_risks.std() / math.sqrt(draws)
    assert crc_risks.mean() <= alpha + 3 * se
    assert crc_risks.mean() >= alpha - 1 / (n + 1) - 0.005 - 3 * se
    # Learn-then-Test: P(risk > alpha) <= delta.
    exceeded = (ltt_risks > alpha + 1e-9).mean()
    assert exceeded <= delta + 3 * math.sqrt(delta * (1 - delta) / draws)
    assert ltt_risks.mean() < alpha  # the price of the high-probability bound


def test_not_controlled_is_said():
    losses = np.ones((10, len(GRID)))  # every example missed everywhere
    with pytest.warns(ee.conformal.RiskNotControlledWarning, match="no value"):
        got = ee.conformal.risk_control(losses, GRID, alpha=0.1)
    assert not got.controlled and float(got.threshold) == GRID[-1]
    with pytest.warns(ee.conformal.RiskNotControlledWarning):
        got = ee.conformal.learn_then_test(losses, GRID, alpha=0.1, delta=0.1)
    assert not got.controlled


def test_bad_inputs_are_refused_by_name():
    good = np.zeros((5, 3))
    grid = np.array([0.0, 0.5, 1.0])
    with pytest.raises(ValueError, match="strictly increasing"):
        ee.conformal.risk_control(good, grid[::-1], alpha=0.1)
    with pytest.raises((ValueError, TypeError), match="lambdas"):
        ee.conformal.risk_control(np.zeros((5, 4)), grid, alpha=0.1)
    with pytest.raises(ValueError, match=r"losses\[2, 1\]"):
        bad = good.copy()
        bad[2, 1] = 1.5
        ee.conformal.risk_control(bad, grid, alpha=0.1)
    with pytest.raises(ValueError, match=r"losses\[1\]` rises"):
        rising = good.copy()
        rising[1] = [0.0, 0.5, 0.5]
        ee.conformal.risk_control(rising, grid, alpha=0.1)
    # Learn-then-Test takes losses that are not monotone.
    ee.conformal.learn_then_test(np.tile([0.0, 0.5, 0.0], (5, 1)), grid,
                                 alpha=0.9, delta=0.5)  # fmt: skip
    with pytest.raises(ValueError, match="alpha"):
        ee.conformal.risk_control(good, grid, alpha=1.5)
    with pytest.raises(ValueError, match="delta"):
        ee.conformal.learn_then_test(good, grid, alpha=0.1, delta=0.0)
    with pytest.raises(ValueError, match="non-empty"):
        ee.conformal.risk_control(np.zeros((5, 0)), np.zeros(0), alpha=0.1)
