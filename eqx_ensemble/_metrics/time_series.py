"""Conformal prediction for time series from a bootstrapped ensemble's
out-of-bag predictions: EnbPI (Xu & Xie 2021) and adaptive conformal inference
(Gibbs & Candes 2021), re-exported by `ee.conformal`. `out_of_bag` is shared with
`conformal.jackknife_plus_after_bootstrap`."""

import math
import numbers
import warnings
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Bool, Float, Int

from .._internal.tree import as_array, is_traced
from .checks import check_alpha
from .regression import one_output


class OutOfBag(eqx.Module):
    """Each training example's out-of-bag prediction.

    - `weights`: `(n_kept, members)`, row `i` averages the members that never
      drew example `i` (NumPy float64).
    - `predictions`: `mu_{-i}(x_i)` of each kept example `(n_kept,)`.
    - `targets`: the kept examples' targets.
    - `excluded`: how many examples every member drew (they are left out).
    """

    weights: np.ndarray
    predictions: np.ndarray
    targets: np.ndarray
    excluded: int


def out_of_bag(
    train_means: Any, targets: Any, run: Any, in_bag: Any, method: str
) -> OutOfBag:
    """The out-of-bag predictions of a bootstrapped `FitResult` or of in-bag
    counts."""
    from .._training.sampling import Bootstrap

    means = one_output(as_array(train_means), "train_means", 2)
    target_array = one_output(as_array(targets), "targets", 1)
    if means.ndim != 2 or target_array.shape != means.shape[1:]:
        raise ValueError(
            "`train_means` must be (members, n) and `targets` (n,), got "
            f"{tuple(means.shape)} and {tuple(target_array.shape)}"
        )
    _check_finite(means, "train_means")
    _check_finite(target_array, "targets")
    members, n = (int(size) for size in means.shape)
    if (run is None) == (in_bag is None):
        raise ValueError("pass exactly one of `run` (a FitResult) and `in_bag`")
    if run is not None:
        sampling = getattr(run, "sampling", None)
        if not isinstance(sampling, Bootstrap):
            raise ValueError(
                f"{method} needs the out-of-bag examples of a bootstrapped run, but "
                f"this run's sampling is {sampling!r}; train with "
                "`ee.fit(..., sampling=ee.Bootstrap())`"
            )
        if run.num_examples != n or len(run.ensemble) != members:
            raise ValueError(
                f"the run trained {len(run.ensemble)} members on {run.num_examples} "
                f"examples, but `train_means` has shape ({members}, {n}): predict "
                "with every member on the run's training data, in its order"
            )
        in_bag = sampling.in_bag(run.key, size=members, num_examples=n)
    counts = np.asarray(in_bag)
    if counts.shape != (members, n):
        raise ValueError(
            f"`in_bag` must have shape (members, n) = ({members}, {n}), got "
            f"{counts.shape}"
        )
    out = (counts == 0).T.astype(np.float64)  # (n, members)
    per_example = out.sum(axis=1)
    kept = per_example > 0
    if not kept.any():
        raise ValueError(
            f"{method} needs out-of-bag examples, but every member drew all {n} "
            "training examples (was this a bootstrapped run?)"
        )
    weights = out[kept] / per_example[kept, None]
    rows = np.flatnonzero(kept)
    leave_out = weights @ np.asarray(means, np.float64)  # (n_kept, n)
    return OutOfBag(
        weights=weights,
        predictions=leave_out[np.arange(rows.size), rows],
        targets=np.asarray(target_array, np.float64)[rows],
        excluded=int((~kept).sum()),
    )


def _check_finite(array: Array, name: str) -> None:
    """Refuse non-finite values (when not traced)."""
    if is_traced(array):
        return
    bad = ~np.isfinite(np.asarray(array))
    if bad.any():
        where = np.argwhere(bad)[0].tolist()
        raise ValueError(
            f"`{name}` holds {int(bad.sum())} non-finite value(s), the first at "
            f"index {tuple(where)}; drop diverged members (`result.diverged`) or "
            "missing observations first"
        )


def _is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _traced_ranks(alpha: Array, n: Any) -> tuple[Array, Array]:
    """`k = floor(alpha / 2 (n + 1))` and `n + 1 - k` for a traced `alpha`, nudged
    up by a relative float32 `eps` to agree with `_concrete_ranks` on a rank."""
    x = alpha / 2 * (n + 1)
    k = jnp.floor(x + jnp.finfo(jnp.float32).eps * x)
    return k, n + 1 - k


def _concrete_ranks(alpha: float, beta: float, n: int) -> tuple[int, int]:
    """`floor(beta (n + 1))` and `ceil((1 - alpha + beta)(n + 1))`, nudged by 1e-9
    towards a whole number."""
    low = math.floor(beta * (n + 1) + 1e-9)
    return low, math.ceil((1 - alpha + beta) * (n + 1) - 1e-9)


def _order_statistic(sorted_scores: Array, rank: Array, n: int, infinite: float):
    """The `rank`-th smallest score, or `infinite` where the rank is outside `1..n`."""
    index = jnp.clip(rank.astype(jnp.int32) - 1, 0, n - 1)
    value = sorted_scores[index]
    return jnp.where((rank < 1) | (rank > n), jnp.asarray(infinite, value.dtype), value)


class EnbPI(eqx.Module):
    """EnbPI intervals for a time series; see
    [`enbpi`][eqx_ensemble.conformal.enbpi].

    - `weights`: `(members,)`: the interval's centre is `weights @ means`, the
      average of the training examples' out-of-bag predictors `mu_{-i}`.
    - `residuals`: the window of signed residuals `y - centre`, oldest first
      (the training series' out-of-bag residuals, then whatever
      [`update`][eqx_ensemble.conformal.EnbPI.update] appended).
    - `alpha`: the miscoverage level; `members`; `excluded`: training examples
      every member drew (no out-of-bag prediction, left out).

    **Example:**

    ```python
    counts = ee.Bootstrap(block_length=5).in_bag(
        jax.random.key(0), size=20, num_examples=100)
    train_means = jax.random.normal(jax.random.key(1), (20, 100))
    targets = jax.random.normal(jax.random.key(2), (100,))
    calibrated = ee.conformal.enbpi(train_means, targets, alpha=0.1, in_bag=counts)
    new_means = jnp.zeros((20, 4))
    lower, upper = calibrated.interval(new_means)
    calibrated = calibrated.update(new_means, jnp.ones(4))   # 4 new residuals
    ```
    """

    weights: Float[Array, " members"]
    residuals: Float[Array, " window"]
    alpha: float = eqx.field(static=True)
    members: int = eqx.field(static=True)
    excluded: int = eqx.field(static=True)

    def _means(self, means: Any) -> Array:
        array = one_output(as_array(means), "means", 2)
        if array.ndim != 2 or not jnp.issubdtype(array.dtype, jnp.floating):
            raise ValueError(
                "`means` must be a float array of shape (members, batch), got "
                f"{array.dtype} {tuple(array.shape)}"
            )
        if array.shape[0] != self.members:
            raise ValueError(
                f"`means` has {array.shape[0]} members but the run had "
                f"{self.members}: predict with every member of the bootstrapped "
                "ensemble"
            )
        # A NaN would poison the window; half precision computes in float32.
        _check_finite(array, "means")
        return array.astype(jnp.float32) if jnp.finfo(array.dtype).bits < 32 else array

    def predict(
        self, means: Float[ArrayLike, "members batch *one"]
    ) -> Float[Array, " batch"]:
        """The centre of the intervals, `weights @ means`, from every member's
        mean prediction `(members, batch)`.

        **Example:** see [`EnbPI`][eqx_ensemble.conformal.EnbPI].
        """
        array = self._means(means)
        return self.weights.astype(array.dtype) @ array

    def interval(
        self,
        means: Float[ArrayLike, "members batch *one"],
        *,
        alpha: float | Float[ArrayLike, ""] | None = None,
        optimize_beta: bool = False,
    ) -> tuple[Float[Array, " batch"], Float[Array, " batch"]]:
        """`(lower, upper)`: the centre plus the `beta` and `1 - alpha + beta`
        conformal quantiles of the residual window (`beta = alpha / 2`).

        **Arguments:**

        - `means`: every member's mean prediction on new inputs, `(members, batch)`.
        - `alpha`: the miscoverage level (default: the calibrated one); may be
          traced (adaptive conformal inference): too small for the window gives
          an infinite side, 1 or more the empty interval (`lower = inf`,
          `upper = -inf`).
        - `optimize_beta`: choose `beta` in `[1/(n+1), alpha]` minimising the
          uncorrected quantiles' width (Xu & Xie's `beta-hat`, 100 values, as
          MAPIE); needs a Python float `alpha`.

        **Returns:**

        Two `(batch,)` arrays.

        **Example:** see [`EnbPI`][eqx_ensemble.conformal.EnbPI].
        """
        centre = self.predict(means)
        n = int(self.residuals.shape[0])
        scores = jnp.sort(self.residuals.astype(centre.dtype))
        if alpha is None:
            alpha = self.alpha
        if _is_real(alpha):
            level = check_alpha(alpha)
            beta = self._best_beta(level) if optimize_beta else level / 2
            low, high = _concrete_ranks(level, beta, n)
            if low < 1 or high > n:
                raise ValueError(
                    f"`alpha={level}` is too small for the window of {n} residuals: "
                    f"the smallest possible is about 2 / (n + 1) = {2 / (n + 1):.4g}"
                )
            low_rank, high_rank = as_array(low), as_array(high)
            empty = as_array(False)
        else:
            if optimize_beta:
                raise TypeError(
                    "`optimize_beta=True` needs `alpha` as a Python float, got "
                    f"{type(alpha).__name__}"
                )
            traced = jnp.asarray(alpha, jnp.float32)
            if traced.shape != ():
                raise ValueError(f"`alpha` must be a scalar, got shape {traced.shape}")
            low_rank, high_rank = _traced_ranks(traced, n)
            empty = traced >= 1
        lower = jnp.where(
            empty, jnp.inf, _order_statistic(scores, low_rank, n, -jnp.inf)
        )
        upper = jnp.where(
            empty, -jnp.inf, _order_statistic(scores, high_rank, n, jnp.inf)
        )
        return centre + lower, centre + upper

    def _best_beta(self, alpha: float) -> float:
        """Xu & Xie's `beta-hat`: of 100 values in `[1/(n+1), alpha]`, the one with
        the narrowest quantiles."""
        scores = np.sort(np.asarray(self.residuals, np.float64))
        n = scores.size
        betas = np.linspace(1 - n / (n + 1), alpha, num=100, endpoint=True)
        usable = [
            low >= 1 and high <= n
            for low, high in (_concrete_ranks(alpha, beta, n) for beta in betas)
        ]
        if not any(usable):
            return alpha / 2  # `interval` names the level as too small
        widths = np.quantile(scores, 1 - alpha + betas, method="higher") - np.quantile(
            scores, betas, method="lower"
        )
        return float(betas[int(np.argmin(np.where(usable, widths, np.inf)))])

    def update(
        self,
        means: Float[ArrayLike, "members batch *one"],
        targets: Float[ArrayLike, " batch *target_one"],
    ) -> "EnbPI":
        """A copy whose residual window drops its `batch` oldest residuals and
        appends the new `targets - centre` (at most the window's length at once).

        **Example:** see [`EnbPI`][eqx_ensemble.conformal.EnbPI].
        """
        centre = self.predict(means)
        target_array = one_output(as_array(targets), "targets", 1)
        if target_array.shape != centre.shape:
            raise ValueError(
                f"`targets` must have shape {tuple(centre.shape)} (one per column of "
                f"`means`), got {tuple(target_array.shape)}"
            )
        m, n = int(centre.shape[0]), int(self.residuals.shape[0])
        if m > n:
            raise ValueError(
                f"{m} new observations are more than the window of {n} residuals; "
                "update in smaller batches"
            )
        _check_finite(target_array, "targets")
        fresh = (target_array.astype(centre.dtype) - centre).astype(
            self.residuals.dtype
        )
        window = jnp.concatenate([self.residuals[m:], fresh])
        return eqx.tree_at(lambda e: e.residuals, self, window)


def enbpi(
    train_means: Float[ArrayLike, "members n *one"],
    targets: Float[ArrayLike, " n *target_one"],
    *,
    alpha: float,
    run: Any = None,
    in_bag: Int[ArrayLike, "members n"] | None = None,
) -> EnbPI:
    """EnbPI (Xu & Xie 2021): conformal intervals for a time series from a
    bootstrapped ensemble's own out-of-bag residuals, with no calibration set and
    no refitting.

    Each training example `i` gets its out-of-bag prediction `mu_{-i}(x_i)`
    (the mean of the members that never drew it) and residual `y_i -
    mu_{-i}(x_i)`. A new input's interval is centred on the mean of all
    `mu_{-i}(x)` and runs from the `floor(beta (n + 1))`-th to the
    `ceil((1 - alpha + beta)(n + 1))`-th smallest residual (`beta = alpha / 2`),
    as MAPIE's `TimeSeriesRegressor(method="enbpi", agg_function="mean")`
    (except that an example every member drew is left out).
    [`update`][eqx_ensemble.conformal.EnbPI.update] slides the residual window;
    [`sequential`][eqx_ensemble.conformal.sequential] runs the whole loop.

    Train with `ee.fit(..., sampling=ee.Bootstrap(block_length=L))`: blocks keep
    a member's out-of-bag examples away from its training neighbours in a
    correlated series.

    **Arguments:**

    - `train_means`: every member's prediction on every training example, in
      time order, `(members, n)`.
    - `targets`: the training series `(n,)`.
    - `alpha`: miscoverage in `(0, 1)`.
    - `run`: the [`FitResult`][eqx_ensemble.FitResult] of a bootstrapped `fit`;
      or `in_bag`: its in-bag counts `(members, n)` (exactly one of the two).

    **Returns:**

    An [`EnbPI`][eqx_ensemble.conformal.EnbPI].

    **Example:** see [`EnbPI`][eqx_ensemble.conformal.EnbPI].
    """
    alpha = check_alpha(alpha)
    bag = out_of_bag(train_means, targets, run, in_bag, "EnbPI")
    n_kept = bag.predictions.size
    if math.floor(alpha / 2 * (n_kept + 1) + 1e-9) < 1:
        raise ValueError(
            f"`alpha={alpha}` is too small for the {n_kept} training examples with "
            f"an out-of-bag member: the smallest possible is about 2 / (n + 1) = "
            f"{2 / (n_kept + 1):.4g}"
        )
    return EnbPI(
        weights=as_array(bag.weights.mean(axis=0), jnp.float32),
        residuals=jnp.asarray(bag.targets - bag.predictions, jnp.float32),
        alpha=alpha,
        members=int(bag.weights.shape[1]),
        excluded=bag.excluded,
    )


class Sequential(eqx.Module):
    """The intervals of [`sequential`][eqx_ensemble.conformal.sequential], one
    per time step.

    - `lower`, `upper`: `(T,)` (infinite where the level is too small for the
      window).
    - `alpha`: the level of each interval `(T,)`.
    - `covered`: whether each target fell inside its interval `(T,)`.
    - `calibrated`, `next_alpha`: the [`EnbPI`][eqx_ensemble.conformal.EnbPI]
      after the last update and the next level: pass both to `sequential` to go on.

    **Example:**

    ```python
    counts = ee.Bootstrap().in_bag(jax.random.key(0), size=10, num_examples=60)
    calibrated = ee.conformal.enbpi(
        jax.random.normal(jax.random.key(1), (10, 60)),
        jax.random.normal(jax.random.key(2), (60,)), alpha=0.2, in_bag=counts)
    online = ee.conformal.sequential(calibrated, jnp.zeros((10, 30)),
                                     jnp.ones(30), gamma=0.05)
    widths = online.upper - online.lower        # (30,): widening after misses
    later = ee.conformal.sequential(online.calibrated, jnp.zeros((10, 5)),
                                    jnp.ones(5), gamma=0.05,
                                    start_alpha=online.next_alpha)  # go on
    ```
    """

    lower: Float[Array, " T"]
    upper: Float[Array, " T"]
    alpha: Float[Array, " T"]
    covered: Bool[Array, " T"]
    calibrated: EnbPI
    next_alpha: Float[Array, ""]


@eqx.filter_jit
def _sequential(calibrated, means, targets, gamma, start_alpha, update):
    def step(carry, inputs):
        state, alpha_t = carry
        column, target = inputs
        lower, upper = state.interval(column[:, None], alpha=alpha_t)
        covered = (lower[0] <= target) & (target <= upper[0])
        alpha_next = alpha_t + gamma * (
            calibrated.alpha - 1 + covered.astype(alpha_t.dtype)
        )
        if update:
            state = state.update(column[:, None], target[None])
        return (state, alpha_next), (lower[0], upper[0], alpha_t, covered)

    (state, alpha), outputs = jax.lax.scan(
        step, (calibrated, start_alpha), (means.T, targets)
    )
    return state, alpha, outputs


def sequential(
    calibrated: EnbPI,
    means: Float[ArrayLike, "members T *one"],
    targets: Float[ArrayLike, " T *target_one"],
    *,
    gamma: float = 0.0,
    update: bool = True,
    start_alpha: float | Float[ArrayLike, ""] | None = None,
) -> Sequential:
    """Run conformal intervals along a series, one observation at a time: step
    `t`'s interval is made before its target is seen, then the target updates
    the residual window (EnbPI) and, with `gamma > 0`, the level (adaptive
    conformal inference, Gibbs & Candes 2021): `alpha_{t+1} = alpha_t + gamma
    (alpha - err_t)`, `err_t = 1` when `y_t` fell outside its interval.

    Over any `T` steps the miss rate is within `(max(alpha_1, 1 - alpha_1) +
    gamma) / (gamma T)` of `alpha`, whatever the series does. `alpha_t` is not
    clipped (as in the paper): below the smallest level the window resolves
    (about `2 / (n + 1)`) a side is infinite, from 1 on the interval is empty
    (`lower = inf`, `upper = -inf`); an `UnboundedIntervalWarning` counts them.

    **Arguments:**

    - `calibrated`: an [`EnbPI`][eqx_ensemble.conformal.EnbPI].
    - `means`: every member's prediction at each step, `(members, T)`.
    - `targets`: the series `(T,)`.
    - `gamma`: the step size of the level (`0`: plain EnbPI).
    - `update`: slide the residual window with each new residual; `False`
      keeps the training residuals.
    - `start_alpha`: the first interval's level (default: the calibrated
      `alpha`); pass a previous call's `next_alpha` to go on.

    **Returns:**

    A [`Sequential`][eqx_ensemble.conformal.Sequential] (one compiled scan).

    **Example:**

    ```python
    counts = ee.Bootstrap(block_length=5).in_bag(
        jax.random.key(0), size=20, num_examples=100)
    train_means = jax.random.normal(jax.random.key(1), (20, 100))
    targets = jax.random.normal(jax.random.key(2), (100,))
    calibrated = ee.conformal.enbpi(train_means, targets, alpha=0.1, in_bag=counts)
    test_means = jax.random.normal(jax.random.key(3), (20, 50))
    test_targets = 2 * jax.random.normal(jax.random.key(4), (50,))  # drifted
    online = ee.conformal.sequential(calibrated, test_means, test_targets,
                                     gamma=0.01)
    miss_rate = 1 - online.covered.mean()
    ```
    """
    if not isinstance(calibrated, EnbPI):
        raise TypeError(
            "`calibrated` must be an ee.conformal.EnbPI (from ee.conformal.enbpi), "
            f"got {type(calibrated).__name__}"
        )
    if not _is_real(gamma) or not math.isfinite(gamma) or gamma < 0:
        raise ValueError(f"`gamma` must be a finite float >= 0, got {gamma!r}")
    array = calibrated._means(means)
    target_array = one_output(jnp.asarray(targets), "targets", 1)
    if target_array.shape != array.shape[1:]:
        raise ValueError(
            f"`targets` must have shape ({array.shape[1]},) (one per column of "
            f"`means`), got {tuple(target_array.shape)}"
        )
    if not isinstance(update, bool | np.bool_):
        raise TypeError(f"`update` must be True or False, got {update!r}")
    start = calibrated.alpha if start_alpha is None else start_alpha
    start = jnp.asarray(start, jnp.float32)
    if start.shape != ():
        raise ValueError(f"`start_alpha` must be a scalar, got shape {start.shape}")
    _check_finite(start, "start_alpha")
    _check_finite(array, "means")
    _check_finite(target_array, "targets")
    state, next_alpha, (lower, upper, alpha, covered) = _sequential(
        calibrated,
        array,
        target_array.astype(array.dtype),
        jnp.asarray(gamma, jnp.float32),
        start,
        bool(update),
    )
    _warn_unbounded(lower, upper, int(calibrated.residuals.shape[0]))
    return Sequential(
        lower=lower,
        upper=upper,
        alpha=alpha,
        covered=covered,
        calibrated=state,
        next_alpha=next_alpha,
    )


class UnboundedIntervalWarning(UserWarning):
    """Some intervals of [`sequential`][eqx_ensemble.conformal.sequential] are
    infinite or empty: the adaptive level left the range the window resolves.

    **Example:**

    ```python
    import warnings

    counts = ee.Bootstrap().in_bag(jax.random.key(0), size=10, num_examples=60)
    calibrated = ee.conformal.enbpi(
        jax.random.normal(jax.random.key(1), (10, 60)),
        jax.random.normal(jax.random.key(2), (60,)), alpha=0.2, in_bag=counts)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ee.conformal.sequential(calibrated, jnp.zeros((10, 30)),
                                10 + jnp.zeros(30), gamma=0.5)   # every miss
    caught[0].category is ee.conformal.UnboundedIntervalWarning   # True
    ```
    """


def _warn_unbounded(lower: Array, upper: Array, n: int) -> None:
    if is_traced(lower):
        return
    unbounded = ~(np.isfinite(np.asarray(lower)) & np.isfinite(np.asarray(upper)))
    count = int(unbounded.sum())
    if count:
        warnings.warn(
            f"{count} of {unbounded.size} intervals are unbounded (infinite, or "
            f"empty from a level of 1 on): the adaptive level went below the "
            f"smallest the window of {n} residuals resolves (about "
            f"{2 / (n + 1):.3g}) or reached 1. Their width is infinite; summarise "
            "the finite ones (`np.isfinite`), or take a smaller `gamma` or a "
            "longer window",
            UnboundedIntervalWarning,
            stacklevel=3,
        )
