"""Calibration of regression ensembles through their predictive CDF: the
calibration error of its quantiles, and quantile recalibration (Kuleshov,
Fenner and Ermon 2018)."""

import numbers
from typing import Any, Literal

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jax.scipy.special import ndtr
from jaxtyping import Array, ArrayLike, Float

from .._internal.tree import as_array, is_traced
from ..combine import gaussian_mixture
from .checks import check_level
from .regression import _means_variances, means_variances_targets

Predictive = Literal["gaussian", "mixture"]


def _check_predictive(predictive: str) -> None:
    if predictive not in ("gaussian", "mixture"):
        raise ValueError(
            f"`predictive` must be 'gaussian' (the moment-matched Gaussian) or "
            f"'mixture' (the members' exact mixture), got {predictive!r}"
        )


def _pit(means: Array, variances: Array, targets: Array, predictive: str) -> Array:
    """The predictive CDF at each target (the probability integral transform)."""
    if predictive == "mixture":
        scale = jnp.sqrt(jnp.maximum(variances, jnp.finfo(variances.dtype).tiny))
        return jnp.mean(ndtr((targets[None] - means) / scale), axis=0)
    return ndtr(_standardised(means, variances, targets))


def _standardised(means: Array, variances: Array, targets: Array) -> Array:
    """Each target's `z` under the moment-matched predictive, `F(y) = Phi(z)`."""
    mean, variance = gaussian_mixture(means, variances)
    return (targets - mean) / jnp.sqrt(
        jnp.maximum(variance, jnp.finfo(variance.dtype).tiny)
    )


def regression_calibration_error(
    means: Float[ArrayLike, " members batch *one"],
    variances: Float[ArrayLike, " members batch *one"],
    targets: Float[ArrayLike, " batch *target_axis"],
    *,
    levels: int = 99,
    predictive: Predictive = "gaussian",
) -> Float[Array, ""]:
    """Calibration error of a regression ensemble's quantiles: the mean over the
    levels `p = 1/(levels+1), ..., levels/(levels+1)` of `|p - freq(p)|`,
    `freq(p)` the fraction of targets with `F(y) <= p` (`F` the predictive CDF):
    0 when calibrated, at most 0.5. Uncertainty Toolbox's "mean absolute
    calibration error" (Kuleshov et al. 2018 sum squared differences).

    **Arguments:**

    - `means`: the members' predicted means, shape `(members, batch)`.
    - `variances`: the members' predicted variances, same shape.
    - `targets`: the observed values, shape `(batch,)`.
    - `levels`: how many quantile levels, evenly spaced in `(0, 1)`.
    - `predictive`: `"gaussian"` (default): the moment-matched Gaussian, as
      [`interval_coverage`][eqx_ensemble.metrics.interval_coverage];
      `"mixture"`: the members' exact Gaussian mixture.

    **Returns:**

    A scalar in `[0, 0.5]`.

    **Example:**

    ```python
    targets = jax.random.normal(jax.random.key(0), (2000,))
    means, variances = jnp.zeros((1, 2000)), jnp.ones((1, 2000))
    ee.metrics.regression_calibration_error(means, variances, targets)  # ~0.01
    ee.metrics.regression_calibration_error(means, 4 * variances, targets)  # ~0.12
    ```
    """
    _check_predictive(predictive)
    if isinstance(levels, bool) or not isinstance(levels, numbers.Integral):
        raise TypeError(f"`levels` must be a positive int, got {levels!r}")
    if levels < 1:
        raise ValueError(f"`levels` must be a positive int, got {levels!r}")
    levels = int(levels)
    means, variances, targets = means_variances_targets(means, variances, targets)
    return _calibration_error(means, variances, targets, levels, predictive)


@eqx.filter_jit
def _calibration_error(means, variances, targets, levels, predictive):
    pit = _pit(means, variances, targets, predictive).reshape(-1)
    p = jnp.arange(1, levels + 1, dtype=pit.dtype) / (levels + 1)
    observed = jnp.mean((pit[None, :] <= p[:, None]).astype(pit.dtype), axis=1)
    return jnp.mean(jnp.abs(p - observed))


class QuantileRecalibration(eqx.Module):
    """Quantile recalibration of a regression ensemble (Kuleshov et al. 2018): a
    non-decreasing map `R` of the predictive CDF's values such that `R(F(y))` is
    calibrated on the calibration split. Fitted by
    [`fit_quantile_recalibration`][eqx_ensemble.calibration.fit_quantile_recalibration].

    `F` is the moment-matched Gaussian, `F(y) = Phi(z)`; `R` is held as a
    function of the standardised residual `z` (points `z`, values `levels`),
    linear between the points and constant beyond. Its methods take the
    members' predictions `(members, batch)`.

    **Example:**

    ```python
    recalibrate = ee.calibration.QuantileRecalibration(
        jnp.array([-1.0, 0.0, 1.0]), jnp.array([0.1, 0.8, 0.9]))
    means, variances = jnp.zeros((1, 2)), jnp.ones((1, 2))
    recalibrate.cdf(means, variances, jnp.array([0.0, 10.0]))   # [0.8, 0.9]
    ```
    """

    z: Float[Array, " points"]
    levels: Float[Array, " points"]

    def _inverse(self, level: Array) -> Array:
        return map_inverse(self.z, self.levels, level)

    def cdf(
        self,
        means: Float[ArrayLike, " members batch *one"],
        variances: Float[ArrayLike, " members batch *one"],
        targets: Float[ArrayLike, " batch *target_axis"],
    ) -> Float[Array, " batch *target_axis"]:
        """The calibrated predictive CDF at each target, `R(F(y))`."""
        means, variances, targets = means_variances_targets(means, variances, targets)
        z = _standardised(means, variances, targets)
        return jnp.interp(z, self.z.astype(z.dtype), self.levels.astype(z.dtype))

    def quantile(
        self,
        means: Float[ArrayLike, " members batch *one"],
        variances: Float[ArrayLike, " members batch *one"],
        level: Float[ArrayLike, ""] | float,
    ) -> Float[Array, " batch *one"]:
        """The calibrated `level`-quantile of each example's predictive."""
        check_level(level)
        means, variances = _means_variances(means, variances)
        mean, variance = gaussian_mixture(means, variances)
        _check_spread(variance, "quantile")
        z = self._inverse(jnp.asarray(level, mean.dtype))
        return mean + jnp.sqrt(variance) * z

    def interval(
        self,
        means: Float[ArrayLike, " members batch *one"],
        variances: Float[ArrayLike, " members batch *one"],
        level: Float[ArrayLike, ""] | float = 0.9,
    ) -> tuple[Float[Array, " batch *one"], Float[Array, " batch *one"]]:
        """The calibrated central interval at `level`: the quantiles at
        `(1 - level) / 2` and `(1 + level) / 2`."""
        return central_interval(lambda p: self.quantile(means, variances, p), level)


def fit_quantile_recalibration(
    means: Float[ArrayLike, " members batch *one"],
    variances: Float[ArrayLike, " members batch *one"],
    targets: Float[ArrayLike, " batch *target_axis"],
) -> QuantileRecalibration:
    """Fit quantile recalibration (Kuleshov, Fenner and Ermon 2018, Algorithm 1)
    on a calibration split: with `p_t = F_t(y_t)` each target's predictive CDF
    value, the isotonic regression `R` of the empirical frequencies
    `#{s : p_s <= p_t} / T` on the `p_t` (as
    `sklearn.isotonic.IsotonicRegression(out_of_bounds="clip")`). Fitted on the
    host (NumPy).

    **Arguments:**

    - `means`, `variances`: the members' predictions on the calibration split,
      shape `(members, batch)`.
    - `targets`: its observed values, shape `(batch,)`; at least 2.

    **Returns:**

    A [`QuantileRecalibration`][eqx_ensemble.calibration.QuantileRecalibration].

    **Example:**

    ```python
    key1, key2 = jax.random.split(jax.random.key(0))
    targets = 2.0 * jax.random.normal(key1, (500,))          # sd 2 ...
    means, variances = jnp.zeros((3, 500)), jnp.ones((3, 500))  # ... predicted 1
    recalibrate = ee.calibration.fit_quantile_recalibration(means, variances,
                                                            targets)
    low, high = recalibrate.interval(means, variances, 0.9)
    float(jnp.mean((low <= targets) & (targets <= high)))   # ~0.9 (was 0.59)
    ```
    """
    means, variances, targets = means_variances_targets(means, variances, targets)
    _check_spread(gaussian_mixture(means, variances)[1], "fit_quantile_recalibration")
    z = np.asarray(_standardised(means, variances, targets), np.float64).ravel()
    if z.size < 2:
        raise ValueError(
            f"quantile recalibration needs at least 2 targets, got {z.size}"
        )
    if not np.isfinite(z).all():
        raise ValueError(
            "the predictive CDF is not finite at some targets: the means, "
            "variances or targets hold NaN or inf"
        )
    # F(y) is increasing in z: the fit depends only on the order of z.
    z_unique, fitted = isotonic_frequencies(z)
    dtype = means.dtype
    return QuantileRecalibration(as_array(z_unique, dtype), as_array(fitted, dtype))


def central_interval(quantile: Any, level: Any) -> tuple[Array, Array]:
    """`quantile` at `(1 - level) / 2` and `(1 + level) / 2`."""
    check_level(level)
    level = as_array(level)
    return quantile((1 - level) / 2), quantile((1 + level) / 2)


def isotonic_frequencies(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct `values` (increasing) and the empirical frequencies `#{s : v_s
    <= v_t} / T` there (non-decreasing already). One value gives two points."""
    empirical = np.searchsorted(np.sort(values), values, side="right") / values.size
    unique, inverse = np.unique(values, return_inverse=True)
    fitted = np.bincount(inverse, empirical) / np.bincount(inverse)
    if len(unique) == 1:
        unique, fitted = np.repeat(unique, 2), np.repeat(fitted, 2)
    return unique, fitted


def map_inverse(points: Array, levels: Array, level: Array) -> Array:
    """`min {x : R(x) >= level}` of the piecewise linear `R` through `(points,
    levels)` (flat segments skipped, clipped to the extreme points)."""
    x, y = points.astype(level.dtype), levels.astype(level.dtype)
    k = jnp.clip(jnp.searchsorted(y, level, side="left"), 1, len(y) - 1)
    y0, y1, x0, x1 = y[k - 1], y[k], x[k - 1], x[k]
    rise = jnp.where(y1 > y0, y1 - y0, 1.0)
    return jnp.clip(x0 + (level - y0) / rise * (x1 - x0), x[0], x[-1])


def _check_spread(variance: Array, who: str) -> None:
    # A predictive variance of 0 has no spread to recalibrate (when concrete).
    if is_traced(variance):
        return
    flat = np.asarray(variance).reshape(-1)
    zero = ~(flat > 0)
    if zero.any():
        raise ValueError(
            f"`{who}`: the predictive variance is not positive at "
            f"{int(zero.sum())} example(s), the first at index "
            f"{int(np.argmax(zero))} (members that agree on the mean and predict "
            "a variance of 0): recalibration scales a spread, and there is none; "
            "floor the members' variances (e.g. `softplus(raw) + 1e-6`)"
        )
