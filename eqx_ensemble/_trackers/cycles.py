"""Cyclic learning-rate schedules (snapshot ensembles, fast geometric
ensembling) and the steps at which their snapshots are taken."""

import math
from typing import Any

import jax.numpy as jnp

from .base import check_tracker_int


def _float(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"`{name}` must be a number, got {value!r}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"`{name}` must be finite and >= 0, got {value}")
    return float(value)


def cosine_cycles(peak: float, *, cycle_steps: int, cycles: int) -> Any:
    """Cosine annealing with warm restarts, as in snapshot ensembles (Huang et
    al. 2017): each cycle of `cycle_steps` steps falls from `peak` to 0 as
    `peak / 2 * (cos(pi * t / cycle_steps) + 1)`. An optax schedule.

    **Example:**

    ```python
    schedule = ee.schedules.cosine_cycles(0.1, cycle_steps=100, cycles=5)
    optimizer = optax.sgd(schedule, momentum=0.9)
    snapshots = ee.Snapshots(at=ee.schedules.cycle_ends(100, 5))
    ```
    """
    peak = _float(peak, "peak")
    check_tracker_int("cosine_cycles", "cycle_steps", cycle_steps, 1)
    check_tracker_int("cosine_cycles", "cycles", cycles, 1)

    def schedule(count):
        t = jnp.mod(count, cycle_steps).astype(jnp.float32)
        return peak / 2 * (jnp.cos(jnp.pi * t / cycle_steps) + 1)

    return schedule


def cycle_ends(cycle_steps: int, cycles: int, *, offset: int = 0) -> tuple[int, ...]:
    """The step counts at the ends of `cycles` cycles of `cycle_steps` steps after
    `offset` steps: where snapshot ensembles take their snapshots (pass to
    [`ee.Snapshots(at=...)`][eqx_ensemble.Snapshots]).

    **Example:**

    ```python
    ee.schedules.cycle_ends(100, 3)      # (100, 200, 300)
    ```
    """
    check_tracker_int("cycle_ends", "cycle_steps", cycle_steps, 1)
    check_tracker_int("cycle_ends", "cycles", cycles, 1)
    return tuple(offset + cycle_steps * (k + 1) for k in range(cycles))


def triangular_cycles(
    high: float, low: float, *, cycle_steps: int, start: int = 0
) -> Any:
    """The cyclic schedule of fast geometric ensembling (Garipov et al. 2018):
    `high` for `start` steps, then each cycle of `cycle_steps` steps goes
    linearly from `high` to `low` and back. Snapshots are taken mid-cycle
    ([`fge_snapshots`][eqx_ensemble.schedules.fge_snapshots]).

    **Example:**

    ```python
    schedule = ee.schedules.triangular_cycles(0.05, 0.0005, cycle_steps=20,
                                              start=200)
    snapshots = ee.Snapshots(at=ee.schedules.fge_snapshots(20, 5, start=200))
    ```
    """
    high, low = _float(high, "high"), _float(low, "low")
    check_tracker_int("triangular_cycles", "cycle_steps", cycle_steps, 2)
    if cycle_steps % 2:
        raise ValueError(f"`cycle_steps` must be even, got {cycle_steps}")
    if isinstance(start, bool) or not isinstance(start, int) or start < 0:
        raise ValueError(f"`start` must be an int >= 0, got {start!r}")
    half = cycle_steps // 2

    def schedule(count):
        t = jnp.mod(count - start, cycle_steps).astype(jnp.float32)
        fraction = jnp.where(t <= half, t / half, (cycle_steps - t) / half)
        rate = high + (low - high) * fraction
        return jnp.where(count < start, high, rate)

    return schedule


def fge_snapshots(cycle_steps: int, cycles: int, *, start: int = 0) -> tuple[int, ...]:
    """The step counts at the middle of each FGE cycle (where
    [`triangular_cycles`][eqx_ensemble.schedules.triangular_cycles] is lowest).

    **Example:**

    ```python
    ee.schedules.fge_snapshots(20, 3, start=100)     # (110, 130, 150)
    ```
    """
    check_tracker_int("fge_snapshots", "cycle_steps", cycle_steps, 2)
    check_tracker_int("fge_snapshots", "cycles", cycles, 1)
    return tuple(start + cycle_steps * k + cycle_steps // 2 for k in range(cycles))
