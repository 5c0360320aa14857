"""Helpers of the trackers (the protocol, `Tracker`, is `_training/tracker.py`'s)."""

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

from .._core.ensemble import Ensemble
from .._internal.checks import check_int


def due(done: Any, start: int, every: int) -> Any:
    """Whether a tracker acting from `start` every `every` steps acts at `done`."""
    return (done >= start) & ((done - start) % every == 0)


def untrained_leaves(ensemble: Ensemble) -> Any:
    """The members' non-trainable leaves, to complete averaged or sampled weights."""
    return eqx.filter(ensemble.members, eqx.is_inexact_array, inverse=True)


def repeat_members(rest: Any, repeats: int) -> Any:
    """Each member's leaves of `rest` repeated `repeats` times (member-major)."""
    return jax.tree.map(
        lambda x: jnp.repeat(x, repeats, axis=0) if eqx.is_array(x) else x, rest
    )


def check_tracker_int(owner: str, name: str, value: Any, low: int) -> None:
    """`owner.name` as an int >= `low`, or a `ValueError` naming it."""
    check_int(value, f"{owner}.{name}", low=low, error=ValueError)
