"""Conformal prediction from an ensemble's stacked predictions.

Split conformal regression (Lei et al. 2018; Papadopoulos et al. 2002),
normalised by the ensemble's predictive standard deviation: on a calibration set
the scores `|y - mean| / std` of the Gaussian mixture of the members give a
quantile `q`, and the interval `mean +- q * std` covers a new target with
probability at least `1 - alpha` (for exchangeable data), whatever the model.

```python
means = jax.random.normal(jax.random.key(0), (5, 200))     # (members, batch)
variances = jnp.ones((5, 200))
targets = means.mean(0) + jax.random.normal(jax.random.key(1), (200,))
calibrated = ee.conformal.split_regression(means, variances, targets, alpha=0.1)
lower, upper = calibrated.interval(means, variances)       # 90% intervals
```
"""

import math

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Float

from ._metrics_regression import _means_variances_targets, _single_output
from .combine import gaussian_mixture

__all__ = ["SplitRegression", "split_regression"]


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
        means = _single_output(jnp.asarray(means), "means", 2)
        variances = _single_output(jnp.asarray(variances), "variances", 2)
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
    """Calibrate split-conformal intervals on held-out data.

    Scores are `|y - mean| / std` with the mean and variance of the members'
    Gaussian mixture (`ee.combine.gaussian_mixture`); the quantile is the
    `ceil((n + 1)(1 - alpha))`-th smallest of the `n` scores, the finite-sample
    correction that makes the coverage of a new exchangeable example at least
    `1 - alpha` (and below `1 - alpha + 1 / (n + 1)` without ties).

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
    means, variances, targets = _means_variances_targets(means, variances, targets)
    n = int(targets.shape[0])
    rank = math.ceil((n + 1) * (1 - alpha))
    if rank > n:
        raise ValueError(
            f"`alpha={alpha}` is too small for {n} calibration examples: the "
            f"smallest possible is 1 / (n + 1) = {1 / (n + 1):.4g}; use more "
            "calibration data or a larger alpha"
        )
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
