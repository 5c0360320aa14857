"""A golden-section search inside compiled code (temperature, Laplace prior)."""

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jaxtyping import Array

_INVERSE_GOLDEN = (math.sqrt(5.0) - 1.0) / 2.0


def golden_section(
    objective: Callable[[Array], Array], low: Array, high: Array, iterations: int
) -> Array:
    """Minimise a unimodal `objective` over `[low, high]` elementwise: the
    middle of the bracket after `iterations` golden-section steps."""
    inner_low = high - _INVERSE_GOLDEN * (high - low)
    inner_high = low + _INVERSE_GOLDEN * (high - low)

    def step(_, state):
        low, high, inner_low, inner_high, value_low, value_high = state
        keep_left = value_low < value_high
        # Keep the better interior point; evaluate once, at the new one.
        low = jnp.where(keep_left, low, inner_low)
        high = jnp.where(keep_left, inner_high, high)
        new_point = jnp.where(
            keep_left,
            high - _INVERSE_GOLDEN * (high - low),
            low + _INVERSE_GOLDEN * (high - low),
        )
        value_new = objective(new_point)
        return (
            low,
            high,
            jnp.where(keep_left, new_point, inner_high),
            jnp.where(keep_left, inner_low, new_point),
            jnp.where(keep_left, value_new, value_high),
            jnp.where(keep_left, value_low, value_new),
        )

    state = (
        low,
        high,
        inner_low,
        inner_high,
        objective(inner_low),
        objective(inner_high),
    )
    low, high, *_ = jax.lax.fori_loop(0, iterations, step, state)
    return (low + high) / 2
