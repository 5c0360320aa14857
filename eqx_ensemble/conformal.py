"""Conformal prediction from an ensemble's stacked predictions.

- Split conformal regression normalised by the ensemble's predictive standard
  deviation (`split_regression`), and conformalized quantile regression for
  any lower/upper bounds (`cqr`).
- Classification prediction sets: APS and RAPS.
- Jackknife+-after-bootstrap intervals from a bootstrapped run's own
  out-of-bag examples (no calibration set).
- Decisions at a guaranteed risk: conformal risk control (`risk_control`) and
  Learn-then-Test (`learn_then_test`) for any loss on a grid of thresholds.
- Time series: EnbPI intervals from the same out-of-bag residuals, with
  adaptive conformal inference on top (`sequential`).

```python
means = jax.random.normal(jax.random.key(0), (5, 200))     # (members, batch)
variances = jnp.ones((5, 200))
targets = means.mean(0) + jax.random.normal(jax.random.key(1), (200,))
calibrated = ee.conformal.split_regression(means, variances, targets, alpha=0.1)
lower, upper = calibrated.interval(means, variances)       # 90% intervals
```
"""

import functools
import math
import warnings
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Bool, Float, Int, PRNGKeyArray

from ._execution.compile import compiled_call
from ._internal.tree import is_traced
from ._metrics.checks import check_alpha
from ._metrics.classification import (
    member_log_probs,
    prepare_labels,
    prepare_predictions,
)
from ._metrics.regression import means_variances_targets, one_output
from ._metrics.risk import (
    RiskControl as RiskControl,
    RiskNotControlledWarning as RiskNotControlledWarning,
    learn_then_test as learn_then_test,
    risk_control as risk_control,
)
from ._metrics.time_series import (
    EnbPI,
    Sequential,
    UnboundedIntervalWarning,
    enbpi,
    out_of_bag,
    sequential,
)
from .combine import gaussian_mixture

__all__ = [
    "SplitRegression",
    "split_regression",
    "QuantileRegression",
    "cqr",
    "PredictionSets",
    "aps",
    "raps",
    "JackknifePlusAfterBootstrap",
    "jackknife_plus_after_bootstrap",
    "EnbPI",
    "enbpi",
    "Sequential",
    "sequential",
    "UnboundedIntervalWarning",
    "RiskControl",
    "risk_control",
    "learn_then_test",
    "RiskNotControlledWarning",
]


class SplitRegression(eqx.Module):
    """A calibrated split-conformal regressor; see
    [`split_regression`][eqx_ensemble.conformal.split_regression].

    - `quantile`: the calibrated multiple `q` of the predictive std.
    - `alpha`: the miscoverage level it was calibrated for.
    - `members`: the member count of the calibration predictions.
    - `calibration_size`: the number of calibration examples.

    **Example:**

    ```python
    means, variances = jnp.zeros((3, 50)), jnp.ones((3, 50))
    targets = jax.random.normal(jax.random.key(0), (50,))
    calibrated = ee.conformal.split_regression(means, variances, targets,
                                               alpha=0.2)
    lower, upper = calibrated.interval(means, variances)
    ```
    """

    quantile: float
    alpha: float
    members: int
    calibration_size: int

    def interval(
        self,
        means: Float[ArrayLike, " members batch *one"],
        variances: Float[ArrayLike, " members batch *one"],
    ) -> tuple[Float[Array, " batch"], Float[Array, " batch"]]:
        """`(lower, upper)`: `mean -+ quantile * std` of the members' Gaussian
        mixture, for new predictions of the same ensemble.

        **Example:** see [`SplitRegression`][eqx_ensemble.conformal.SplitRegression].
        """
        means = one_output(jnp.asarray(means), "means", 2)
        variances = one_output(jnp.asarray(variances), "variances", 2)
        if means.ndim != 2 or means.shape != variances.shape:
            raise ValueError(
                "`means` and `variances` must both have shape (members, batch), got "
                f"{tuple(means.shape)} and {tuple(variances.shape)}"
            )
        if means.shape[0] != self.members:
            raise ValueError(
                f"The predictions have {means.shape[0]} members but the calibration "
                f"had {self.members}: calibrate and predict with the same ensemble"
            )
        mean, variance = gaussian_mixture(means, variances)
        half = self.quantile * jnp.sqrt(variance)
        return mean - half, mean + half


def split_regression(
    means: Float[ArrayLike, " members batch *one"],
    variances: Float[ArrayLike, " members batch *one"],
    targets: Float[ArrayLike, " batch *target_axis"],
    *,
    alpha: float,
) -> SplitRegression:
    """Calibrate split-conformal intervals on held-out data (Lei et al. 2018;
    Papadopoulos et al. 2002).

    Scores are `|y - mean| / std` with the mean and variance of the members'
    Gaussian mixture (`ee.combine.gaussian_mixture`); the quantile `q` is the
    `ceil((n + 1)(1 - alpha))`-th smallest of the `n` scores, so that `mean +- q
    * std` covers a new exchangeable example with probability at least `1 -
    alpha` (and below `1 - alpha + 1 / (n + 1)` without ties).

    **Arguments:**

    - `means`, `variances`: the members' predictions on the calibration set,
      `(members, batch)` (or `(members, batch, 1)`), never used for training.
    - `targets`: the calibration targets, `(batch,)`.
    - `alpha`: the miscoverage level in `(0, 1)`, e.g. `0.1` for 90% intervals;
      at least `1 / (n + 1)` for `n` calibration examples.

    **Returns:**

    A [`SplitRegression`][eqx_ensemble.conformal.SplitRegression]; its
    `.interval(means, variances)` gives `(lower, upper)` for new predictions.

    **Example:** see [`SplitRegression`][eqx_ensemble.conformal.SplitRegression].
    """
    if isinstance(alpha, bool) or not isinstance(alpha, int | float):
        raise TypeError(f"`alpha` must be a float in (0, 1), got {alpha!r}")
    if not 0 < alpha < 1:
        raise ValueError(f"`alpha` must lie strictly between 0 and 1, got {alpha}")
    means = one_output(jnp.asarray(means), "means", 2)
    variances = one_output(jnp.asarray(variances), "variances", 2)
    targets = one_output(jnp.asarray(targets), "targets", 1)
    means, variances, targets = means_variances_targets(means, variances, targets)
    n = int(targets.shape[0])
    rank = _upper_rank(float(alpha), n)
    mean, variance = gaussian_mixture(means, variances)
    std = np.sqrt(np.maximum(np.asarray(variance), np.finfo(np.float32).tiny))
    scores = np.abs(np.asarray(targets) - np.asarray(mean)) / std
    quantile = float(np.sort(scores)[rank - 1])
    return SplitRegression(
        quantile=quantile,
        alpha=float(alpha),
        members=int(means.shape[0]),
        calibration_size=n,
    )


# `(n + 1)(1 - alpha)` is often a whole number that floating point puts a hair
# above it (150 * 0.82 = 123.00000000000001): both ranks take a 1e-9 nudge.


def _upper_rank(alpha: float, n: int) -> int:
    """`ceil((n + 1)(1 - alpha))`, the rank of the conformal quantile among `n`
    scores; an error when it exceeds `n`."""
    rank = math.ceil((n + 1) * (1 - alpha) - 1e-9)
    if rank > n:
        raise ValueError(
            f"`alpha={alpha}` is too small for {n} calibration examples: the "
            f"smallest possible is 1 / (n + 1) = {1 / (n + 1):.4g}; use more "
            "calibration data or a larger alpha"
        )
    return rank


def _lower_rank(alpha: float, n: int) -> int:
    """`floor(alpha (n + 1))`, the rank of the lower jackknife+ quantile."""
    return math.floor(alpha * (n + 1) + 1e-9)


# --- Classification: prediction sets (APS, RAPS) --------------------------------


def _set_scores(
    probs: Array, u: Array, penalty: float, k_reg: int
) -> Float[Array, "batch classes"]:
    """The (R)APS score of every class of every example: the probability mass of
    the classes ranked above it, plus `u` times its own, plus the rank penalty."""
    order = jnp.argsort(-probs, axis=-1, stable=True)
    sorted_probs = jnp.take_along_axis(probs, order, axis=-1)
    above_sorted = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
    ranks = jnp.argsort(order, axis=-1)  # 0-based rank of each class
    above = jnp.take_along_axis(above_sorted, ranks, axis=-1)
    extra = penalty * jnp.maximum(ranks + 1 - k_reg, 0).astype(probs.dtype)
    return above + u[:, None] * probs + extra


class PredictionSets(eqx.Module):
    """Calibrated conformal prediction sets for classification; made by
    [`aps`][eqx_ensemble.conformal.aps] or [`raps`][eqx_ensemble.conformal.raps].

    - `quantile`: the calibrated score threshold.
    - `alpha`, `members`, `calibration_size`: as in
      [`SplitRegression`][eqx_ensemble.conformal.SplitRegression].
    - `penalty`, `k_reg`: RAPS's rank regularisation (`penalty = 0` for APS).
    - `randomized`: whether scores use a uniform tie-break (exact coverage) or
      not (conservative coverage, never-empty sets).

    **Example:**

    ```python
    logits = jax.random.normal(jax.random.key(0), (4, 300, 5))   # calibration
    labels = jax.random.randint(jax.random.key(1), (300,), 0, 5)
    calibrated = ee.conformal.aps(logits, labels, alpha=0.1, from_logits=True,
                                  key=jax.random.key(2))
    sets = calibrated.sets(logits[:, :10], from_logits=True,
                           key=jax.random.key(3))                # (10, 5) bools
    ```
    """

    quantile: float
    alpha: float
    members: int
    calibration_size: int
    penalty: float = 0.0
    k_reg: int = 0
    randomized: bool = True

    def sets(
        self,
        probs: Float[ArrayLike, "members batch classes"],
        *,
        key: PRNGKeyArray | None = None,
        from_logits: bool = False,
    ) -> Bool[Array, "batch classes"]:
        """The prediction set of each example: `sets[i, c]` is whether class `c`
        is in example `i`'s set.

        **Arguments:**

        - `probs`: the members' predictions on new examples, `(members, batch,
          classes)`: probabilities, or logits with `from_logits=True`.
        - `key`: for randomized sets, a fresh key (one uniform per example).

        **Example:** see [`PredictionSets`][eqx_ensemble.conformal.PredictionSets].
        """
        predictions = prepare_predictions(probs, from_logits=from_logits)
        if jnp.shape(probs)[0] != self.members:
            raise ValueError(
                f"The predictions have {jnp.shape(probs)[0]} members but the "
                f"calibration had {self.members}: calibrate and predict with the "
                "same ensemble"
            )
        _check_key(key, self.randomized)
        # One program per shape, the threshold an argument cast to the scores'
        # precision there (as a Python float is).
        sets = functools.partial(
            _sets,
            from_logits=from_logits,
            penalty=self.penalty,
            k_reg=self.k_reg,
            randomized=self.randomized,
        )
        threshold = np.float64(self.quantile)
        return compiled_call(
            sets, predictions, key if self.randomized else None, threshold
        )


def _check_key(key: Any, randomized: bool) -> None:
    if randomized and key is None:
        raise ValueError(
            "randomized prediction sets need `key=` (one uniform per example); pass "
            "`randomized=False` for the deterministic, conservative sets"
        )


def _mean_scores(
    predictions: Array, key: Any, from_logits: bool, penalty: float, k_reg: int
) -> tuple[Array, Array]:
    """The ensemble's mean probabilities and every class's (R)APS score (`u`
    uniform per example with a key, else 1)."""
    member_probs, _ = member_log_probs(predictions, from_logits=from_logits)
    mean = jnp.mean(member_probs, axis=0)
    batch = mean.shape[0]
    # `u` in the probabilities' precision (with 64-bit floats enabled, a
    # default uniform is float64, which strict dtype promotion refuses).
    if key is None:
        u = jnp.ones((batch,), mean.dtype)
    else:
        u = jax.random.uniform(key, (batch,), mean.dtype)
    return mean, _set_scores(mean, u, penalty, k_reg)


def _sets(
    predictions: Array,
    key: Any,
    threshold: Array,
    *,
    from_logits: bool,
    penalty: float,
    k_reg: int,
    randomized: bool,
) -> Array:
    mean, scores = _mean_scores(predictions, key, from_logits, penalty, k_reg)
    inside = scores <= threshold.astype(scores.dtype)
    if randomized:
        return inside
    # The deterministic set (Romano, Sesia & Candès 2020; RAPS's reference
    # code; MAPIE's `include_last_label=True`) keeps the class that crosses
    # the threshold too, so it is never empty. The scores grow with the
    # class's rank, so `inside` is a prefix of the ranking: one class more.
    ranks = jnp.argsort(jnp.argsort(-mean, axis=-1, stable=True), axis=-1)
    return ranks <= jnp.sum(inside, axis=-1, keepdims=True)


def _true_scores(
    predictions: Array,
    labels: Array,
    key: Any,
    *,
    from_logits: bool,
    penalty: float,
    k_reg: int,
) -> Array:
    _, scores = _mean_scores(predictions, key, from_logits, penalty, k_reg)
    return jnp.take_along_axis(scores, labels[:, None], axis=1)[:, 0]


def _calibrate_sets(
    probs, labels, alpha, key, from_logits, randomized, penalty, k_reg
) -> PredictionSets:
    alpha = check_alpha(alpha)
    predictions = prepare_predictions(probs, from_logits=from_logits)
    labels = prepare_labels(labels, predictions)
    n = int(predictions.shape[1])
    rank = _upper_rank(alpha, n)
    _check_key(key, randomized)
    # The true labels' scores in one program per shape.
    scored = functools.partial(
        _true_scores, from_logits=from_logits, penalty=float(penalty), k_reg=int(k_reg)
    )
    true_scores = np.asarray(
        compiled_call(scored, predictions, labels, key if randomized else None)
    )
    quantile = float(np.sort(true_scores)[rank - 1])
    return PredictionSets(
        quantile=quantile,
        alpha=alpha,
        members=int(predictions.shape[0]),
        calibration_size=n,
        penalty=float(penalty),
        k_reg=int(k_reg),
        randomized=bool(randomized),
    )


def aps(
    probs: Float[ArrayLike, "members batch classes"],
    labels: Int[ArrayLike, " batch"],
    *,
    alpha: float,
    key: PRNGKeyArray | None = None,
    randomized: bool = True,
    from_logits: bool = False,
) -> PredictionSets:
    """Adaptive prediction sets (Romano, Sesia & Candès 2020) calibrated on
    held-out data, from the ensemble's mean probabilities.

    A class's score is the probability mass of the classes ranked above it plus
    `u` times its own (`u ~ U(0, 1)` per example when `randomized`, else 1); the
    threshold is the `ceil((n + 1)(1 - alpha))`-th smallest score of the true
    labels, and a new example's set holds every class scoring at most that: it
    covers the true label with probability at least `1 - alpha` for
    exchangeable data (randomized: also at most `1 - alpha + 1 / (n + 1)`).

    **Arguments:**

    - `probs`: the members' predictions on the calibration set, `(members,
      batch, classes)`, never used for training: probabilities, or logits with
      `from_logits=True`.
    - `labels`: the calibration labels, `(batch,)`.
    - `alpha`: miscoverage in `(0, 1)`, at least `1 / (n + 1)`.
    - `key`: the key for the uniforms of randomized scores.
    - `randomized`: `False` gives deterministic, conservative sets.

    **Returns:**

    A [`PredictionSets`][eqx_ensemble.conformal.PredictionSets].

    **Example:** see [`PredictionSets`][eqx_ensemble.conformal.PredictionSets].
    """
    return _calibrate_sets(probs, labels, alpha, key, from_logits, randomized, 0.0, 0)


def raps(
    probs: Float[ArrayLike, "members batch classes"],
    labels: Int[ArrayLike, " batch"],
    *,
    alpha: float,
    penalty: float = 0.01,
    k_reg: int = 1,
    key: PRNGKeyArray | None = None,
    randomized: bool = True,
    from_logits: bool = False,
) -> PredictionSets:
    """Regularized adaptive prediction sets (Angelopoulos, Bates, Malik & Jordan
    2021): APS scores plus `penalty * max(0, rank - k_reg)` (rank 1 = the most
    probable class), for smaller, more stable sets with the same guarantee.

    **Arguments:** as [`aps`][eqx_ensemble.conformal.aps], and

    - `penalty`: the regularisation weight `lambda >= 0`.
    - `k_reg`: the number of top classes not penalised, `>= 0`.

    **Returns:**

    A [`PredictionSets`][eqx_ensemble.conformal.PredictionSets].

    **Example:**

    ```python
    logits = jax.random.normal(jax.random.key(0), (4, 300, 10))
    labels = jax.random.randint(jax.random.key(1), (300,), 0, 10)
    calibrated = ee.conformal.raps(logits, labels, alpha=0.1, penalty=0.05,
                                   k_reg=2, from_logits=True, key=jax.random.key(2))
    ```
    """
    if not (isinstance(penalty, int | float) and math.isfinite(penalty)) or (
        penalty < 0
    ):
        raise ValueError(f"`penalty` must be a finite number >= 0, got {penalty!r}")
    if isinstance(k_reg, bool) or not isinstance(k_reg, int) or k_reg < 0:
        raise ValueError(f"`k_reg` must be an int >= 0, got {k_reg!r}")
    return _calibrate_sets(
        probs, labels, alpha, key, from_logits, randomized, penalty, k_reg
    )


# --- Regression: conformalized quantile-style intervals (CQR) -------------------


class QuantileRegression(eqx.Module):
    """A calibrated conformalized interval; see
    [`cqr`][eqx_ensemble.conformal.cqr].

    - `quantile`: how far the calibrated interval extends each bound (negative:
      the bounds were too wide and are pulled in).
    - `alpha`, `calibration_size`: as in
      [`SplitRegression`][eqx_ensemble.conformal.SplitRegression].

    **Example:**

    ```python
    lower, upper = -jnp.ones(100), jnp.ones(100)
    targets = 2 * jax.random.normal(jax.random.key(0), (100,))
    calibrated = ee.conformal.cqr(lower, upper, targets, alpha=0.1)
    new_lower, new_upper = calibrated.interval(lower, upper)
    ```
    """

    quantile: float
    alpha: float
    calibration_size: int

    def interval(
        self,
        lower: Float[ArrayLike, " batch *one"],
        upper: Float[ArrayLike, " batch *upper_one"],
    ) -> tuple[Float[Array, " batch"], Float[Array, " batch"]]:
        """`(lower - quantile, upper + quantile)` for new bounds of the same model.

        With a negative `quantile`, an interval narrower than `2 * |quantile|`
        comes out with `lower > upper`: an empty interval (Romano et al. 2019),
        returned as computed, with a warning that counts them.

        **Example:** see
        [`QuantileRegression`][eqx_ensemble.conformal.QuantileRegression].
        """
        lower_array, upper_array = _bounds(lower, upper)
        new_lower = lower_array - self.quantile
        new_upper = upper_array + self.quantile
        if not is_traced(new_lower):
            ill_sorted = int(jnp.sum(new_lower > new_upper))
            if ill_sorted:
                warnings.warn(
                    f"{ill_sorted} of {new_lower.shape[0]} conformalized intervals "
                    "have lower > upper (the calibration pulls the bounds in by "
                    f"{-self.quantile:.4g} each, more than half their width): they "
                    "are empty intervals, returned as computed",
                    stacklevel=2,
                )
        return new_lower, new_upper


def _bounds(lower: Any, upper: Any) -> tuple[Array, Array]:
    lower_array = one_output(jnp.asarray(lower), "lower", 1)
    upper_array = one_output(jnp.asarray(upper), "upper", 1)
    if lower_array.ndim != 1 or lower_array.shape != upper_array.shape:
        raise ValueError(
            "`lower` and `upper` must both have shape (batch,), got "
            f"{tuple(lower_array.shape)} and {tuple(upper_array.shape)}"
        )
    return lower_array, upper_array


def cqr(
    lower: Float[ArrayLike, " batch *one"],
    upper: Float[ArrayLike, " batch *upper_one"],
    targets: Float[ArrayLike, " batch *target_one"],
    *,
    alpha: float,
) -> QuantileRegression:
    """Conformalized quantile regression (Romano, Patterson & Candès 2019): any
    lower and upper bounds (e.g. the members' empirical quantiles,
    quantile-regression heads, or `mean -+ z * std`) are widened or narrowed by
    the same amount so that they cover a new target with probability at least
    `1 - alpha`. The amount is the `ceil((n + 1)(1 - alpha))`-th smallest score
    `max(lower - y, y - upper)` of the calibration examples.

    **Arguments:**

    - `lower`, `upper`: the bounds on the calibration set, `(batch,)`.
    - `targets`: the calibration targets, `(batch,)`.
    - `alpha`: miscoverage in `(0, 1)`, at least `1 / (n + 1)`.

    **Returns:**

    A [`QuantileRegression`][eqx_ensemble.conformal.QuantileRegression].

    **Example:** see [`QuantileRegression`][eqx_ensemble.conformal.QuantileRegression].
    """
    alpha = check_alpha(alpha)
    lower_array, upper_array = _bounds(lower, upper)
    targets_array = one_output(jnp.asarray(targets), "targets", 1)
    if targets_array.shape != lower_array.shape:
        raise ValueError(
            f"`targets` must have shape {tuple(lower_array.shape)} like the bounds, "
            f"got {tuple(targets_array.shape)}"
        )
    host = [
        np.asarray(a, np.float64) for a in (lower_array, upper_array, targets_array)
    ]
    for name, array in zip(("lower", "upper", "targets"), host):
        if not np.isfinite(array).all():
            raise ValueError(
                f"`{name}` has non-finite values, the first at index "
                f"{int(np.argmax(~np.isfinite(array)))}"
            )
    n = len(host[2])
    rank = _upper_rank(alpha, n)
    scores = np.maximum(host[0] - host[2], host[2] - host[1])
    return QuantileRegression(
        quantile=float(np.sort(scores)[rank - 1]),
        alpha=alpha,
        calibration_size=n,
    )


# --- Jackknife+-after-bootstrap --------------------------------------------------


class JackknifePlusAfterBootstrap(eqx.Module):
    """Jackknife+-after-bootstrap intervals; see
    [`jackknife_plus_after_bootstrap`][eqx_ensemble.conformal.jackknife_plus_after_bootstrap].

    - `weights`: `(n, members)`: row `i` averages the members for which training
      example `i` was out of bag (rows of examples with none are dropped).
    - `residuals`: `(n,)`: `|y_i - mu_{-i}(x_i)|`.
    - `alpha`, `members`.
    - `excluded`: how many training examples had no out-of-bag member.

    **Example:**

    ```python
    counts = ee.Bootstrap().in_bag(jax.random.key(0), size=20, num_examples=50)
    train_means = jax.random.normal(jax.random.key(1), (20, 50))
    targets = jax.random.normal(jax.random.key(2), (50,))
    jab = ee.conformal.jackknife_plus_after_bootstrap(
        train_means, targets, alpha=0.2, in_bag=counts)
    lower, upper = jab.interval(jnp.zeros((20, 7)))
    ```
    """

    weights: Float[Array, "n members"]
    residuals: Float[Array, " n"]
    alpha: float
    members: int
    excluded: int

    def interval(
        self, means: Float[ArrayLike, "members batch *one"]
    ) -> tuple[Float[Array, " batch"], Float[Array, " batch"]]:
        """`(lower, upper)` for new inputs, from every member's mean prediction
        on them, `(members, batch)`.

        **Example:** see
        [`JackknifePlusAfterBootstrap`][eqx_ensemble.conformal.JackknifePlusAfterBootstrap].
        """
        array = one_output(jnp.asarray(means), "means", 2)
        if array.ndim != 2:
            raise ValueError(
                f"`means` must have shape (members, batch), got {tuple(array.shape)}"
            )
        if array.shape[0] != self.members:
            raise ValueError(
                f"`means` has {array.shape[0]} members but the run had "
                f"{self.members}: predict with every member of the bootstrapped "
                "ensemble"
            )
        n = self.residuals.shape[0]
        low_rank = _lower_rank(self.alpha, n)
        high_rank = _upper_rank(self.alpha, n)
        leave_out = self.weights @ array  # (n, batch): mu_{-i}(x)
        lower = jnp.sort(leave_out - self.residuals[:, None], axis=0)[low_rank - 1]
        upper = jnp.sort(leave_out + self.residuals[:, None], axis=0)[high_rank - 1]
        return lower, upper


def jackknife_plus_after_bootstrap(
    train_means: Float[ArrayLike, "members n *one"],
    targets: Float[ArrayLike, " n *target_one"],
    *,
    alpha: float,
    run: Any = None,
    in_bag: Int[ArrayLike, "members n"] | None = None,
) -> JackknifePlusAfterBootstrap:
    """Jackknife+-after-bootstrap intervals (Kim, Xu & Barber 2020) from a
    bootstrapped ensemble's OWN out-of-bag examples: no calibration set, no extra
    training.

    For each training example `i`, `mu_{-i}` averages the members whose
    resample left `i` out, and `R_i = |y_i - mu_{-i}(x_i)|`. For a new input the
    interval runs from the `floor(alpha (n + 1))`-th smallest of
    `mu_{-i}(x) - R_i` to the `ceil((1 - alpha)(n + 1))`-th smallest of
    `mu_{-i}(x) + R_i`: coverage at least `1 - 2 alpha`, in practice close to `1
    - alpha`. Examples that every member saw have no out-of-bag prediction and
    are left out (`excluded` counts them; with `M` members about `n e^-M`).

    **Arguments:**

    - `train_means`: every member's prediction on every TRAINING example, in the
      order `fit` saw them, `(members, n)`.
    - `targets`: the training targets, `(n,)`.
    - `alpha`: miscoverage in `(0, 1)`; needs `alpha (n + 1) >= 1`.
    - `run`: the [`FitResult`][eqx_ensemble.FitResult] of an
      `ee.fit(..., sampling=ee.Bootstrap())` run (its resamples are rebuilt from
      the key by [`Bootstrap.in_bag`][eqx_ensemble.Bootstrap.in_bag]); or
    - `in_bag`: the in-bag counts `(members, n)` (exactly one of the two).

    **Returns:**

    A
    [`JackknifePlusAfterBootstrap`][eqx_ensemble.conformal.JackknifePlusAfterBootstrap].

    **Example:** see
    [`JackknifePlusAfterBootstrap`][eqx_ensemble.conformal.JackknifePlusAfterBootstrap].
    """
    alpha = check_alpha(alpha)
    bag = out_of_bag(train_means, targets, run, in_bag, "jackknife+-after-bootstrap")
    n_kept, members = bag.weights.shape
    if _lower_rank(alpha, n_kept) < 1:
        raise ValueError(
            f"`alpha={alpha}` is too small for the {n_kept} training examples with "
            f"an out-of-bag member ({bag.excluded} of {n_kept + bag.excluded} have "
            f"none): the smallest possible is 1 / (n + 1) = {1 / (n_kept + 1):.4g}"
        )
    residuals = np.abs(bag.targets - bag.predictions)
    return JackknifePlusAfterBootstrap(
        weights=jnp.asarray(bag.weights, jnp.float32),
        residuals=jnp.asarray(residuals, jnp.float32),
        alpha=alpha,
        members=members,
        excluded=bag.excluded,
    )
