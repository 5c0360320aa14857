"""Input validation for `ee.metrics`: value checks run eagerly on concrete inputs
and are skipped for traced ones; shape checks always run."""

import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array

from .._execution.compile import one_shot_jit
from .._internal.checks import first_non_finite
from .._internal.tree import as_array, is_traced

_SINGLE_MODEL_HINT = (
    "metrics take stacked per-member predictions with a leading member axis; "
    "for a single model add one with `x[None]`"
)


def as_float_array(x: Any, name: str) -> Array:
    """`x` as a JAX array of a floating dtype of at least 32 bits (a 16-bit
    one is converted); a clear error for other dtypes."""
    if isinstance(x, str | bytes):
        raise TypeError(f"`{name}` must be a floating-point array, got a string")
    try:
        array = as_array(x)
    except TypeError as error:  # strings in a list, objects
        raise TypeError(
            f"`{name}` must be a floating-point array, got {type(x).__name__} that "
            f"is not an array of numbers ({error})"
        ) from None
    if not jnp.issubdtype(array.dtype, jnp.floating):
        raise TypeError(
            f"`{name}` must be a floating-point array, got dtype {array.dtype} "
            f"(shape {tuple(array.shape)})"
        )
    # At least float32: bfloat16 sums are wrong in the third digit.
    return array.astype(jnp.float32) if array.dtype.itemsize < 4 else array


def probability_tolerance(dtype: Any) -> float:
    """How far from one a row of probabilities may sum (looser for 16-bit floats)."""
    return max(1e-3, 16 * float(jnp.finfo(dtype).eps))


def check_classification_predictions(
    predictions: Array, *, from_logits: bool, name: str, given: Any = None
) -> None:
    """`predictions` is `(members, batch, classes)`: probabilities unless logits."""
    shape = tuple(predictions.shape)
    if predictions.ndim != 3:
        raise ValueError(
            f"`{name}` must have shape (members, batch, classes), got shape {shape}; "
            + _SINGLE_MODEL_HINT
        )
    members, batch, classes = shape
    if members < 1 or batch < 1 or classes < 1:
        raise ValueError(
            f"`{name}` must have at least one member, one example and one class, "
            f"got shape {shape} (members, batch, classes)"
        )
    if is_traced(predictions):
        return
    # Reductions on the device; a few scalars come to the host.
    with jax.ensure_compile_time_eval():
        _check_concrete_predictions(predictions, from_logits, name, shape, given)


def _check_concrete_predictions(
    predictions: Array,
    from_logits: bool,
    name: str,
    shape: tuple[int, ...],
    given: Any,
) -> None:
    if from_logits:  # -inf is a class of probability 0; NaN and +inf have none
        if bool(_any_nan_or_inf(predictions)):
            host = np.asarray(predictions)
            where = tuple(int(i) for i in np.argwhere(~(host < np.inf))[0])
            what = "NaN" if np.isnan(host[where]) else "+inf"
            raise ValueError(
                f"`{name}` (logits of shape {shape}) contains {what}, first at index "
                f"{where} (member, example, class): a {what} logit gives no "
                "probability (its softmax is NaN); clip the logits to a finite "
                "range (-inf is allowed: a class of probability 0)"
            )
        return
    summary = jax.device_get(_probability_summary(predictions))
    finite, low, high, low_sum, high_sum, worst, worst_sum, worst_error = summary
    if not finite:
        not_finite = ~np.isfinite(np.asarray(predictions))
        where = tuple(int(i) for i in np.argwhere(not_finite)[0])
        raise ValueError(
            f"`{name}` (probabilities of shape {shape}) contains NaN or infinite "
            f"values, first at index {where} (member, example, class)"
        )
    tolerance = probability_tolerance(predictions.dtype if given is None else given)
    low, high = float(low), float(high)
    if low < -tolerance or high > 1 + tolerance:
        raise ValueError(
            f"`{name}` must hold probabilities in [0, 1], but values of `{name}` "
            f"(shape {shape}) lie in [{low:.6g}, {high:.6g}]. If these are logits, "
            "pass `from_logits=True`."
        )
    if float(worst_error) > tolerance:
        member, example = np.unravel_index(int(worst), shape[:2])
        raise ValueError(
            f"`{name}` must sum to one along the class (last) axis within "
            f"{tolerance:.3g}: `{name}` has shape {shape} (members, batch, classes) "
            f"and its sums over classes lie in [{float(low_sum):.6g}, "
            f"{float(high_sum):.6g}]; the worst is member {member}, example "
            f"{example}, which sums to {float(worst_sum):.6g}. If these are "
            "logits, pass `from_logits=True`; otherwise normalise them, e.g. with "
            "`jax.nn.softmax`."
        )


# The checks' reductions, one program per shape.
@one_shot_jit
def _any_nan_or_inf(logits: Array) -> Array:
    return jnp.any(jnp.isnan(logits) | (logits == jnp.inf))


@one_shot_jit
def _bounds(x: Array) -> tuple[Array, Array]:
    return jnp.min(x), jnp.max(x)


@one_shot_jit
def _probability_summary(probs: Array) -> tuple[Array, ...]:
    """Finiteness, range, and the row sum furthest from one (flat index, value)."""
    sums = jnp.sum(probs.astype(jnp.promote_types(probs.dtype, jnp.float32)), axis=-1)
    error = jnp.abs(sums - 1.0).ravel()
    worst = jnp.argmax(error)
    return (
        jnp.all(jnp.isfinite(probs)),
        jnp.min(probs),
        jnp.max(probs),
        jnp.min(sums),
        jnp.max(sums),
        worst,
        sums.ravel()[worst],
        error[worst],
    )


def check_labels(
    labels: Array, classes: int, batch: int, *, predictions_shape: tuple[int, ...]
) -> None:
    """`labels` is `(batch,)` of integers in `[0, classes)`."""
    shape = tuple(labels.shape)
    if not jnp.issubdtype(labels.dtype, jnp.integer):
        raise TypeError(
            f"`labels` must be integer class indices, got dtype {labels.dtype} "
            f"(shape {shape})"
        )
    if labels.ndim != 1 or shape[0] != batch:
        raise ValueError(
            f"`labels` must have shape (batch,) = ({batch},) to match the predictions "
            f"of shape {predictions_shape} (members, batch, classes), but `labels` "
            f"has shape {shape}"
        )
    if is_traced(labels):
        return
    with jax.ensure_compile_time_eval():
        bounds = _bounds(labels)
    low, high = (int(bound) for bound in jax.device_get(bounds))
    if low < 0 or high >= classes:
        values = np.asarray(labels)
        bad = int(np.argmax((values < 0) | (values >= classes)))
        raise ValueError(
            f"`labels` must lie in [0, {classes}) (the predictions have {classes} "
            f"classes), but they lie in [{low}, {high}]; the first out-of-range "
            f"label is {int(values[bad])} at index {bad}"
        )


def check_n_bins(n_bins: Any) -> None:
    """`n_bins` is a Python integer of at least one (it fixes an array shape)."""
    if isinstance(n_bins, bool) or not isinstance(n_bins, int | np.integer):
        raise TypeError(
            f"`n_bins` must be a Python int (it sets the number of bins, a shape), "
            f"got {type(n_bins).__name__} {n_bins!r}"
        )
    if n_bins < 1:
        raise ValueError(f"`n_bins` must be at least 1, got {n_bins}")


def check_regression(
    means: Array,
    variances: Array | None = None,
    targets: Array | None = None,
    *,
    means_name: str = "means",
) -> None:
    """`means` (and `variances`) are `(members, batch)`, `targets` is `(batch,)`,
    all finite (when concrete)."""
    shape = tuple(means.shape)
    for name, values in (
        (means_name, means),
        ("variances", variances),
        ("targets", targets),
    ):
        if values is None or is_traced(values):
            continue
        found = first_non_finite(values)
        if found is not None:
            where, value = found
            raise ValueError(
                f"`{name}` (shape {tuple(np.shape(values))}) holds {value} at index "
                f"{where}; regression metrics need finite predictions and targets"
            )
    if means.ndim not in (2, 3):
        raise ValueError(
            f"`{means_name}` must have shape (members, batch) or (members, batch, "
            f"outputs), got shape {shape}; " + _SINGLE_MODEL_HINT
        )
    if shape[0] < 1 or shape[1] < 1:
        raise ValueError(
            f"`{means_name}` must have at least one member and one example, got "
            f"shape {shape}"
        )
    if variances is not None:
        if tuple(variances.shape) != shape:
            raise ValueError(
                f"`variances` must have the same shape as `means`, (members, batch) = "
                f"{shape}, got shape {tuple(variances.shape)}"
            )
        if not is_traced(variances) and _below_zero(variances):
            values = np.asarray(variances)
            negative = values < 0
            first = [int(i) for i in np.argwhere(negative)[0]]
            where = f"member {first[0]}, example {first[1]}" + (
                f", output {first[2]}" if len(first) > 2 else ""
            )
            raise ValueError(
                f"`variances` must be non-negative, but {int(negative.sum())} of "
                f"its {values.size} entries (shape {shape}) are negative, the "
                f"smallest {float(values.min()):.6g}; the first is at {where}. "
                "Pass variances, not log-variances "
                "(e.g. `jax.nn.softplus(raw) + 1e-6`)."
            )
    if targets is not None:
        if tuple(targets.shape) != shape[1:]:
            layout = (
                "(members, batch)" if len(shape) == 2 else "(members, batch, outputs)"
            )
            wanted = "(batch,)" if len(shape) == 2 else "(batch, outputs)"
            raise ValueError(
                f"`targets` must have shape {wanted} = {shape[1:]} to match "
                f"`{means_name}` of shape {shape} {layout}, got shape "
                f"{tuple(targets.shape)}"
            )


def check_alpha(alpha: Any) -> float:
    """A miscoverage level: a real number (NumPy scalars too, not a bool)
    strictly between 0 and 1, as a Python float."""
    if not isinstance(alpha, numbers.Real) or isinstance(alpha, bool):
        raise TypeError(f"`alpha` must be a float in (0, 1), got {alpha!r}")
    value = float(alpha)
    if not 0 < value < 1:
        raise ValueError(f"`alpha` must lie strictly between 0 and 1, got {alpha}")
    return value


def check_level(level: Any) -> None:
    """A probability level strictly between 0 and 1 (when concrete)."""
    if is_traced(level):
        return
    if (
        isinstance(level, str | bytes | bool)
        or np.asarray(level).dtype.kind not in "iuf"
    ):
        raise TypeError(
            f"`level` must be a number strictly between 0 and 1 (e.g. 0.95), got "
            f"{type(level).__name__} {level!r}"
        )
    value = float(np.asarray(level))
    if not 0.0 < value < 1.0:
        raise ValueError(
            f"`level` must lie strictly between 0 and 1 (e.g. 0.95), got {value}"
        )


def check_reduction(reduction: Any) -> None:
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(
            f"`reduction` must be 'mean', 'sum' or 'none', got {reduction!r}"
        )


def _below_zero(values: Array) -> bool:
    """Whether a concrete array holds a negative value (also where it is
    closed over by a caller's trace)."""
    with jax.ensure_compile_time_eval():
        return bool(jnp.min(values) < 0)
