"""Regression metrics for ensembles of Gaussian heads (each member predicts a mean
and a variance): the mixture's moments, its variance decomposition, Gaussian NLL,
RMSE and interval coverage."""

from typing import Literal

import jax
import jax.numpy as jnp
from jax.scipy.special import ndtri
from jaxtyping import Array, ArrayLike, Float

from .._execution.compile import one_shot_jit
from .._internal.tree import as_array
from ..combine import gaussian_mixture
from .checks import (
    as_float_array,
    check_level,
    check_reduction,
    check_regression,
)
from .classification import Reduction, compiled, reduce


def _single_output(array: Array, name: str, rank: int) -> Array:
    # `(members, batch, 1)` (`eqx.nn.MLP(out_size=1)`) as `(members, batch)`;
    # several outputs are kept, and treated as independent.
    if array.ndim == rank + 1 and array.shape[-1] == 1:
        return array[..., 0]
    return array


def one_output(array: Array, name: str, rank: int) -> Array:
    """`_single_output`, refusing several outputs (for functions of ONE output)."""
    if array.ndim == rank + 1 and array.shape[-1] != 1:
        raise ValueError(
            f"`{name}` has shape {tuple(array.shape)}: {array.shape[-1]} outputs per "
            "example. This function works on one output at a time: pass "
            f"`{name}[..., j]` for output j"
        )
    return _single_output(array, name, rank)


def _per_example(values: Array) -> Array:
    # Independent outputs: a joint log-density is the sum over outputs.
    return jnp.sum(values, axis=-1) if values.ndim >= 2 else values


def _means(means: ArrayLike) -> Array:
    array = _single_output(as_float_array(means, "means"), "means", 2)
    check_regression(array)
    return array


def _means_variances(means: ArrayLike, variances: ArrayLike) -> tuple[Array, Array]:
    means_array = _single_output(as_float_array(means, "means"), "means", 2)
    variances_array = _single_output(
        as_float_array(variances, "variances"), "variances", 2
    )
    check_regression(means_array, variances_array)
    return means_array, variances_array


def means_variances_targets(
    means: ArrayLike, variances: ArrayLike, targets: ArrayLike
) -> tuple[Array, Array, Array]:
    means_array, variances_array = _means_variances(means, variances)
    targets_array = _single_output(as_float_array(targets, "targets"), "targets", 1)
    check_regression(means_array, variances_array, targets_array)
    return means_array, variances_array, targets_array


def _floored(variances: Array) -> Array:
    # A variance of 0 would give 0/0 = NaN for an exact prediction.
    return jnp.maximum(variances, jnp.finfo(variances.dtype).tiny)


def predictive_mean(
    means: Float[ArrayLike, " members batch *one"],
) -> Float[Array, " batch *outputs"]:
    """Mean of the ensemble's predictive mixture: the mean of the members' means.

    **Arguments:**

    - `means`: the members' predicted means, shape `(members, batch)`.

    **Returns:**

    Shape `(batch,)`.

    **Example:**

    ```python
    ee.metrics.predictive_mean(jnp.array([[0.0, 1.0], [2.0, 3.0]]))  # [1.0, 2.0]
    ```
    """
    return _mean_over_members(_means(means))


@one_shot_jit
def _mean_over_members(x: Array) -> Array:
    return jnp.mean(x, axis=0)


def predictive_variance(
    means: Float[ArrayLike, " members batch *one"],
    variances: Float[ArrayLike, " members batch *one"],
) -> Float[Array, " batch *outputs"]:
    """Variance of the ensemble's predictive mixture `(1/M) sum_i N(mu_i, s_i^2)`:
    aleatoric plus epistemic, `mean_i s_i^2 + var_i mu_i` (Lakshminarayanan et al.
    2017).

    **Arguments:**

    - `means`: the members' predicted means, shape `(members, batch)`.
    - `variances`: the members' predicted variances (non-negative), same shape.

    **Returns:**

    Shape `(batch,)`.

    **Example:**

    ```python
    means = jnp.array([[0.0], [2.0]])
    variances = jnp.array([[1.0], [1.0]])
    ee.metrics.predictive_variance(means, variances)   # 1 + 1 = [2.0]
    ```
    """
    means, variances = _means_variances(means, variances)
    return _predictive_variance(means, variances)


@one_shot_jit
def _predictive_variance(means: Array, variances: Array) -> Array:
    return gaussian_mixture(means, variances)[1]


def aleatoric_variance(
    variances: Float[ArrayLike, " members batch *one"],
) -> Float[Array, " batch *outputs"]:
    """Aleatoric (data) variance: the mean of the members' predicted variances.

    **Arguments:**

    - `variances`: the members' predicted variances, shape `(members, batch)`.

    **Returns:**

    Shape `(batch,)`.

    **Example:**

    ```python
    ee.metrics.aleatoric_variance(jnp.array([[1.0], [3.0]]))   # [2.0]
    ```
    """
    variances = as_float_array(variances, "variances")
    check_regression(variances, variances, means_name="variances")
    return _mean_over_members(variances)


def epistemic_variance(
    means: Float[ArrayLike, " members batch *one"],
) -> Float[Array, " batch *outputs"]:
    """Epistemic (model) variance: the variance of the members' means over members
    (dividing by `members`); `aleatoric_variance + epistemic_variance ==
    predictive_variance`.

    **Arguments:**

    - `means`: the members' predicted means, shape `(members, batch)`.

    **Returns:**

    Shape `(batch,)`.

    **Example:**

    ```python
    ee.metrics.epistemic_variance(jnp.array([[0.0], [2.0]]))   # [1.0]
    ```
    """
    return _epistemic_variance(_means(means))


@one_shot_jit
def _epistemic_variance(means: Array) -> Array:
    return jnp.mean(jnp.square(means - jnp.mean(means, axis=0)[None]), axis=0)


def _gaussian_log_density(targets: Array, means: Array, variances: Array) -> Array:
    variances = _floored(variances)
    log_two_pi = jnp.log(2 * jnp.pi).astype(means.dtype)
    return -0.5 * (
        log_two_pi + jnp.log(variances) + jnp.square(targets - means) / variances
    )


def gaussian_nll(
    means: Float[ArrayLike, " members batch *one"],
    variances: Float[ArrayLike, " members batch *one"],
    targets: Float[ArrayLike, " batch *target_axis"],
    *,
    predictive: Literal["gaussian", "mixture"] = "gaussian",
    reduction: Reduction = "mean",
) -> Float[Array, ""] | Float[Array, " batch"]:
    """Gaussian negative log-likelihood of the targets under the ensemble, in nats,
    including the constant `0.5 log(2 pi)`.

    A variance of exactly 0 is raised to the dtype's smallest normal number.

    **Arguments:**

    - `means`: the members' predicted means, shape `(members, batch)`.
    - `variances`: the members' predicted variances (non-negative), same shape.
    - `targets`: the observed values, shape `(batch,)`.
    - `predictive`: `"gaussian"` (default): the moment-matched Gaussian
      `N(predictive_mean, predictive_variance)`, as Lakshminarayanan et al.
      (2017); `"mixture"`: the exact mixture `(1/M) sum_i N(mu_i, s_i^2)`.
    - `reduction`: `"mean"`, `"sum"` or `"none"` (one loss per example).

    **Returns:**

    A scalar, or shape `(batch,)` with `reduction="none"`.

    **Example:**

    ```python
    means, variances = jnp.array([[0.0]]), jnp.array([[1.0]])
    ee.metrics.gaussian_nll(means, variances, jnp.array([0.0]))  # 0.5 log(2 pi) = 0.919
    ```
    """
    check_reduction(reduction)
    if predictive not in ("gaussian", "mixture"):
        raise ValueError(
            f"`predictive` must be 'gaussian' or 'mixture', got {predictive!r}"
        )
    means, variances, targets = means_variances_targets(means, variances, targets)
    return _gaussian_nll(means, variances, targets, predictive, reduction)


@compiled("predictive", "reduction")
def _gaussian_nll(
    means: Array,
    variances: Array,
    targets: Array,
    predictive: str,
    reduction: Reduction,
) -> Array:
    if predictive == "gaussian":
        mean, variance = gaussian_mixture(means, variances)
        losses = -_per_example(_gaussian_log_density(targets, mean, variance))
    else:
        members = means.shape[0]
        log_densities = _gaussian_log_density(targets[None], means, variances)
        if log_densities.ndim == 3:  # a member's outputs are independent
            log_densities = jnp.sum(log_densities, axis=-1)
        log_members = jnp.log(members).astype(means.dtype)
        losses = log_members - jax.nn.logsumexp(log_densities, axis=0)
    return reduce(losses, reduction)


def per_member_gaussian_nll(
    means: Float[ArrayLike, " members batch *one"],
    variances: Float[ArrayLike, " members batch *one"],
    targets: Float[ArrayLike, " batch *target_axis"],
) -> Float[Array, " members"]:
    """The mean Gaussian NLL of each member on its own, `N(mu_i, s_i^2)`.

    **Arguments:** as `ee.metrics.gaussian_nll`.

    **Returns:**

    One mean NLL per member, shape `(members,)`.

    **Example:**

    ```python
    means, variances = jnp.array([[0.0], [1.0]]), jnp.array([[1.0], [1.0]])
    targets = jnp.array([0.0])
    ee.metrics.per_member_gaussian_nll(means, variances, targets)  # [0.919, 1.419]
    ```
    """
    means, variances, targets = means_variances_targets(means, variances, targets)
    return _per_member_gaussian_nll(means, variances, targets)


@one_shot_jit
def _per_member_gaussian_nll(means: Array, variances: Array, targets: Array) -> Array:
    log_densities = _gaussian_log_density(targets[None], means, variances)
    if log_densities.ndim == 3:
        log_densities = jnp.sum(log_densities, axis=-1)
    return -jnp.mean(log_densities, axis=1)


def _check_targets(means: Array, targets: ArrayLike) -> Array:
    targets = _single_output(as_float_array(targets, "targets"), "targets", 1)
    check_regression(means, None, targets)
    return targets


def rmse(
    means: Float[ArrayLike, " members batch *one"],
    targets: Float[ArrayLike, " batch *target_axis"],
) -> Float[Array, ""]:
    """Root-mean-square error of the ensemble's predictive mean.

    **Arguments:**

    - `means`: the members' predicted means, shape `(members, batch)`.
    - `targets`: the observed values, shape `(batch,)`.

    **Returns:**

    A non-negative scalar.

    **Example:**

    ```python
    means = jnp.array([[1.0, 2.0], [3.0, 2.0]])   # ensemble mean [2, 2]
    ee.metrics.rmse(means, jnp.array([2.0, 4.0]))  # sqrt((0 + 4) / 2) = 1.414
    ```
    """
    means = _means(means)
    return _rmse(means, _check_targets(means, targets))


@one_shot_jit
def _rmse(means: Array, targets: Array) -> Array:
    return jnp.sqrt(jnp.mean(jnp.square(jnp.mean(means, axis=0) - targets)))


def per_member_rmse(
    means: Float[ArrayLike, " members batch *one"],
    targets: Float[ArrayLike, " batch *target_axis"],
) -> Float[Array, " members"]:
    """The root-mean-square error of each member's mean on its own.

    **Arguments:** as `ee.metrics.rmse`.

    **Returns:**

    Shape `(members,)`.

    **Example:**

    ```python
    means = jnp.array([[1.0, 2.0], [3.0, 2.0]])
    ee.metrics.per_member_rmse(means, jnp.array([2.0, 4.0]))  # [1.581, 1.581]
    ```
    """
    means = _means(means)
    return _per_member_rmse(means, _check_targets(means, targets))


@one_shot_jit
def _per_member_rmse(means: Array, targets: Array) -> Array:
    axes = tuple(range(1, means.ndim))  # examples (and outputs)
    return jnp.sqrt(jnp.mean(jnp.square(means - targets[None]), axis=axes))


def interval_coverage(
    means: Float[ArrayLike, " members batch *one"],
    variances: Float[ArrayLike, " members batch *one"],
    targets: Float[ArrayLike, " batch *target_axis"],
    level: Float[ArrayLike, ""] | float = 0.95,
) -> Float[Array, ""]:
    """Fraction of targets inside the ensemble's central prediction interval at
    `level` (ideally close to `level`).

    The interval is the moment-matched Gaussian's, `mean +- z sqrt(variance)` with
    `z = ndtri((1 + level) / 2)` (1.96 for 0.95), endpoints included.

    **Arguments:** `means`, `variances`, `targets` as `ee.metrics.gaussian_nll`,
    and

    - `level`: the nominal coverage, strictly between 0 and 1.

    **Returns:**

    A scalar in `[0, 1]`.

    **Example:**

    ```python
    means, variances = jnp.zeros((2, 3)), jnp.ones((2, 3))
    targets = jnp.array([0.5, -1.9, 2.5])               # |z| < 1.96 for two of them
    ee.metrics.interval_coverage(means, variances, targets, level=0.95)  # 0.667
    ```
    """
    check_level(level)
    means, variances, targets = means_variances_targets(means, variances, targets)
    return _interval_coverage(means, variances, targets, as_array(level))


@one_shot_jit
def _interval_coverage(
    means: Array, variances: Array, targets: Array, level: Array
) -> Array:
    mean, variance = gaussian_mixture(means, variances)
    level = level.astype(mean.dtype)
    half_width = ndtri((1 + level) / 2) * jnp.sqrt(variance)
    inside = jnp.abs(targets - mean) <= half_width
    return jnp.mean(inside.astype(mean.dtype))
