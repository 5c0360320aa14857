"""Argument checks shared by every family: one home, one wording."""

import math
import numbers
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .tree import as_array, is_traced

# The largest step count or period: compiled code counts steps in int32.
MAX_INT32 = 2**31 - 1


def check_int(
    value: Any,
    name: str,
    *,
    low: int | None = None,
    high: int | None = None,
    error: type[Exception] = TypeError,
) -> int:
    """`value` as an `int` in `[low, high]`: a non-integer raises `error`, one
    out of range `ValueError`."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        if error is TypeError:
            raise TypeError(f"`{name}` must be an int, got {type(value).__name__}")
        raise error(_range_message(name, low, high, value))
    if (low is not None and value < low) or (high is not None and value > high):
        raise ValueError(_range_message(name, low, high, value))
    return int(value)


def _range_message(name: str, low: int | None, high: int | None, value: Any) -> str:
    if high is None:
        return f"`{name}` must be an int >= {low}, got {value!r}"
    if low is None:
        return f"`{name}` must be an int <= {high}, got {value!r}"
    return f"`{name}` must be an int between {low} and {high}, got {value!r}"


def check_positive_int(value: Any, name: str, *, high: int | None = None) -> int:
    """`value` as an int in `[1, high]`, or an error naming `name`."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(f"`{name}` must be an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"`{name}` must be at least 1, got {value}")
    if high is not None and value > high:
        raise ValueError(
            f"`{name}` must be at most {high} (steps are counted in int32 inside "
            f"compiled code), got {value}"
        )
    return int(value)


def check_positive(value: Any, name: str) -> float:
    """`value` as a positive finite float, or a `ValueError` naming `name`."""
    real = isinstance(value, numbers.Real) and not isinstance(value, bool)
    number = float(value) if real else math.nan
    if not 0 < number < math.inf:
        raise ValueError(f"`{name}` must be a positive finite number, got {value!r}")
    return number


def real_array(value: Any, name: str) -> jax.Array:
    """`value` as a JAX array of real numbers, or a `TypeError` naming `name`."""
    if isinstance(value, str | bytes):
        raise TypeError(f"`{name}` must be real numbers, got the string {value!r}")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # NumPy's on a list of strings
            array = as_array(value)  # lists of traced scalars too
    except (TypeError, ValueError):
        array = None
    if array is not None and jnp.issubdtype(array.dtype, jnp.complexfloating):
        raise TypeError(f"`{name}` must be real, got complex values {value!r:.80}")
    if array is None or not (
        jnp.issubdtype(array.dtype, jnp.integer)
        or jnp.issubdtype(array.dtype, jnp.floating)  # bfloat16 included
        or array.dtype == jnp.bool_
    ):
        raise TypeError(
            f"`{name}` must be real numbers (an array, a number or a list of "
            f"numbers), got {type(value).__name__} {value!r:.80}"
        )
    return array


def first_non_finite(values: Any) -> tuple[tuple[int, ...], Any] | None:
    """`(index, value)` of a concrete array's first NaN or infinity, or `None`."""
    host = np.asarray(values)
    if not np.issubdtype(host.dtype, np.inexact):
        return None
    bad = ~np.isfinite(host)
    if not bad.any():
        return None
    where = tuple(int(i) for i in np.argwhere(bad)[0])
    return where, host[where]


def check_choice(
    value: Any, name: str, choices: tuple[str, ...], default: str | None = None
) -> str:
    """`value` if in `choices` (`None`: `default`, if any), else a `ValueError`."""
    if value is None and default is not None:
        return default
    if not isinstance(value, str) or value not in choices:
        also = "" if default is None else f" (or None for {default!r})"
        raise ValueError(f"`{name}` must be one of {choices}{also}, got {value!r}")
    return value


def normalised_weights(weights: Any, size: int, dtype: Any, holder: str) -> jax.Array:
    """One non-negative weight per member summing to one, as `dtype` (`None`:
    equal). Concrete weights are normalised in float64 (int32 sums overflow,
    float16 ones reach infinity); `holder` words the errors."""
    if weights is None:
        return as_array(np.full((size,), 1.0 / size, dtype=dtype))
    array = real_array(weights, "weights")
    if array.ndim != 1 or array.shape[0] != size:
        raise ValueError(
            f"`weights` must have one entry per member: {holder} {size} members, "
            f"weights have shape {tuple(array.shape)}"
        )
    if is_traced(array):
        wide = array.astype(jnp.promote_types(array.dtype, jnp.float32))
        return (wide / wide.sum()).astype(dtype)
    host = np.asarray(array, dtype=np.float64)
    if not np.isfinite(host).all() or (host < 0).any() or host.sum() <= 0:
        raise ValueError(
            "`weights` must be finite and non-negative with a positive sum, got "
            f"{np.asarray(array)}"
        )
    return as_array(host / host.sum(), dtype=dtype)
