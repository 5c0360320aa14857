"""Decisions at a guaranteed risk: conformal risk control and Learn-then-Test.

Both choose a threshold `lambda` from a grid on calibration data, given each
example's loss at every grid value (a set's false negative rate, a
multilabel loss, a miscoverage indicator...), computed in float64 on the host.
"""

import math
import warnings
from typing import Any

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Float

from .checks import check_alpha


class RiskControl(eqx.Module):
    """A threshold chosen on calibration data by
    [`risk_control`][eqx_ensemble.conformal.risk_control] or
    [`learn_then_test`][eqx_ensemble.conformal.learn_then_test].

    Fields: `threshold` (the chosen grid value), `index` (its place in the
    grid), `risk` (the calibration examples' mean loss there) and `controlled`
    (`False` where no grid value met the guarantee's condition: `threshold` is
    then the grid's largest, with a `RiskNotControlledWarning`).

    **Example:**

    ```python
    grid = jnp.linspace(0, 1, 11)
    misses = (jnp.linspace(0, 1, 200)[:, None] > grid[None]).astype(jnp.float32)
    control = ee.conformal.risk_control(misses, grid, alpha=0.2)
    control.threshold, control.risk, control.controlled    # 0.9, 0.1, True
    ```
    """

    threshold: Float[Array, ""]
    risk: Float[Array, ""]
    index: int = eqx.field(static=True)
    controlled: bool = eqx.field(static=True)


class RiskNotControlledWarning(UserWarning):
    """No grid value met the guarantee's condition on the calibration data:
    the returned threshold is the grid's largest, without the guarantee.

    **Example:**

    ```python
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ee.conformal.risk_control(jnp.ones((10, 3)), jnp.arange(3.0), alpha=0.1)
    caught[0].category.__name__        # 'RiskNotControlledWarning'
    ```
    """


def _checked(losses: Any, lambdas: Any, bound: float) -> tuple[np.ndarray, np.ndarray]:
    losses = np.asarray(losses, np.float64)
    lambdas = np.asarray(lambdas, np.float64)
    if lambdas.ndim != 1 or len(lambdas) == 0:
        raise ValueError(f"`lambdas` must be a non-empty 1-D grid, got {lambdas.shape}")
    if np.any(np.diff(lambdas) <= 0) or not np.isfinite(lambdas).all():
        raise ValueError("`lambdas` must be finite and strictly increasing")
    if losses.ndim != 2 or losses.shape[1] != len(lambdas) or len(losses) == 0:
        raise ValueError(
            f"`losses` must be (examples, len(lambdas)) = (n, {len(lambdas)}) with "
            f"n >= 1: one loss per calibration example and grid value, got "
            f"{losses.shape}"
        )
    outside = ~((losses >= 0) & (losses <= bound))
    if outside.any():
        example, column = np.argwhere(outside)[0]
        raise ValueError(
            f"`losses[{example}, {column}]` is {losses[example, column]}: losses "
            f"must lie in [0, {bound}] (`bound`)"
        )
    return losses, lambdas


def _result(lambdas: np.ndarray, risks: np.ndarray, passing: np.ndarray, what: str):
    controlled = bool(passing.any())
    index = int(np.flatnonzero(passing)[0]) if controlled else len(lambdas) - 1
    if not controlled:
        warnings.warn(
            f"{what}: no value of `lambdas` meets the condition on these "
            "calibration losses; the largest is returned without the guarantee "
            "(more calibration examples, a larger `alpha` or a grid reaching "
            "lower risks)",
            RiskNotControlledWarning,
            stacklevel=3,
        )
    return RiskControl(
        threshold=jnp.asarray(lambdas[index], jnp.float32),
        risk=jnp.asarray(risks[index], jnp.float32),
        index=index,
        controlled=controlled,
    )


def risk_control(
    losses: Float[ArrayLike, "examples lambdas"],
    lambdas: Float[ArrayLike, " lambdas"],
    *,
    alpha: float,
    bound: float = 1.0,
) -> RiskControl:
    """Conformal risk control (Angelopoulos et al. 2022, "Conformal Risk
    Control"): the smallest `lambda` of the grid with
    `(n * mean_loss(lambda) + bound) / (n + 1) <= alpha`, so that a new
    exchangeable example's expected loss at it is at most `alpha`.

    **Arguments:**

    - `losses`: `(n, len(lambdas))`, each calibration example's loss at each
      grid value, in `[0, bound]` and non-increasing in `lambda` (a larger
      `lambda`, a larger set: fewer misses).
    - `lambdas`: the grid, strictly increasing.
    - `alpha`: the risk to guarantee, in (0, 1).
    - `bound`: the losses' upper bound `B`.

    **Returns:**

    A [`RiskControl`][eqx_ensemble.conformal.RiskControl].

    **Example:**

    ```python
    # Multilabel sets {k : p_k >= 1 - lambda} at a false negative rate of 10%.
    probs = jax.random.uniform(jax.random.key(0), (500, 5))
    labels = jax.random.uniform(jax.random.key(1), (500, 5)) < probs
    lambdas = jnp.linspace(0, 1, 101)
    in_set = probs[:, None, :] >= 1 - lambdas[None, :, None]
    missed = (labels[:, None, :] & ~in_set).sum(-1)
    fnr = missed / jnp.maximum(labels.sum(-1), 1)[:, None]
    control = ee.conformal.risk_control(fnr, lambdas, alpha=0.1)
    control.threshold                          # the sets' lambda
    ```
    """
    alpha = check_alpha(alpha)
    losses, lambdas = _checked(losses, lambdas, float(bound))
    rising = np.diff(losses, axis=1) > 1e-12
    if rising.any():
        example, column = np.argwhere(rising)[0]
        raise ValueError(
            f"`losses[{example}]` rises from lambdas[{column}] to "
            f"lambdas[{column + 1}]: conformal risk control needs each "
            "example's loss non-increasing in `lambda` (`learn_then_test` "
            "does not)"
        )
    n = len(losses)
    risks = losses.mean(axis=0)
    passing = (n * risks + bound) / (n + 1) <= alpha
    return _result(lambdas, risks, passing, "risk_control")


def learn_then_test(
    losses: Float[ArrayLike, "examples lambdas"],
    lambdas: Float[ArrayLike, " lambdas"],
    *,
    alpha: float,
    delta: float,
) -> RiskControl:
    """Learn-then-Test (Angelopoulos et al. 2021, "Learn then Test"): a
    `lambda` whose risk is at most `alpha` with probability at least
    `1 - delta` over the calibration data. For each grid value the null
    "its risk exceeds `alpha`" gets the Hoeffding-Bentkus p-value of the
    calibration losses (bounded in [0, 1]); the nulls are tested in a fixed
    sequence from the largest `lambda` down, at level `delta`, and the
    smallest `lambda` rejected in that sequence is returned (a family-wise
    error rate of `delta`; no monotonicity needed for validity, only for
    the sequence to reach far).

    **Arguments:**

    - `losses`: `(n, len(lambdas))`, each calibration example's loss at each
      grid value, in `[0, 1]`.
    - `lambdas`: the grid, strictly increasing.
    - `alpha`: the risk bound, in (0, 1).
    - `delta`: the probability allowed of exceeding it, in (0, 1).

    **Returns:**

    A [`RiskControl`][eqx_ensemble.conformal.RiskControl].

    **Example:**

    ```python
    scores = jax.random.uniform(jax.random.key(0), (1000,))
    lambdas = jnp.linspace(0, 1, 101)
    misses = (scores[:, None] > lambdas[None, :]).astype(jnp.float32)
    control = ee.conformal.learn_then_test(misses, lambdas, alpha=0.1, delta=0.1)
    control.threshold      # about 0.91: P(score > it) <= 0.1 with 90% confidence
    ```
    """
    alpha = check_alpha(alpha)
    if not isinstance(delta, int | float) or isinstance(delta, bool):
        raise TypeError(f"`delta` must be a float in (0, 1), got {delta!r}")
    if not 0 < delta < 1:
        raise ValueError(f"`delta` must lie strictly between 0 and 1, got {delta}")
    losses, lambdas = _checked(losses, lambdas, 1.0)
    n = len(losses)
    risks = losses.mean(axis=0)
    cdf = _binomial_cdf(n, alpha)
    p_values = np.array([hoeffding_bentkus(risk, n, alpha, cdf) for risk in risks])
    # The fixed sequence: from the largest lambda down, while nulls are rejected.
    rejected = np.zeros(len(lambdas), bool)
    for index in range(len(lambdas) - 1, -1, -1):
        if p_values[index] > delta:
            break
        rejected[index] = True
    return _result(lambdas, risks, rejected, "learn_then_test")


def hoeffding_bentkus(
    risk: float, n: int, alpha: float, cdf: np.ndarray | None = None
) -> float:
    """The Hoeffding-Bentkus p-value of the null "the risk exceeds `alpha`"
    from the mean `risk` of `n` losses in [0, 1] (Bates et al. 2021, "Distribution-
    Free, Risk-Controlling Prediction Sets", Proposition 3). `cdf`:
    `_binomial_cdf(n, alpha)`, where it was computed once for many risks."""
    cdf = _binomial_cdf(n, alpha) if cdf is None else cdf
    low = min(risk, alpha)
    hoeffding = math.exp(-n * _kl(low, alpha))
    bentkus = math.e * float(cdf[min(math.ceil(n * risk - 1e-9), n)])
    return min(hoeffding, bentkus, 1.0)


def _kl(a: float, b: float) -> float:
    # The Bernoulli relative entropy h1(a, b), with 0 log 0 = 0.
    first = 0.0 if a == 0 else a * math.log(a / b)
    second = 0.0 if a == 1 else (1 - a) * math.log((1 - a) / (1 - b))
    return first + second


def _binomial_cdf(n: int, p: float) -> np.ndarray:
    # P(Binomial(n, p) <= k) for k = 0..n, summed in log space (float64).
    k = np.arange(n + 1)
    log_factorial = np.concatenate([[0.0], np.cumsum(np.log(np.arange(1, n + 1)))])
    log_pmf = (
        log_factorial[n] - log_factorial[k] - log_factorial[n - k]
        + k * math.log(p) + (n - k) * math.log1p(-p)
    )  # fmt: skip
    top = log_pmf.max()
    return np.minimum(1.0, np.cumsum(np.exp(log_pmf - top)) * math.exp(top))
