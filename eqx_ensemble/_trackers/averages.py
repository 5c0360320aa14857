"""Weight averages along the trajectory: an exponential moving average (`EMA`)
and stochastic weight averaging (`SWA`)."""

import math
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

from .._core.ensemble import with_members
from .._internal.tree import leading_size, trainable
from .._training.tracker import Tracker


class EMA(Tracker):
    """An exponential moving average of every member's weights.

    After each step, `average = decay * average + (1 - decay) * weights`, per
    member, from the weights before the first step. `FitResult.tracked` holds
    the averages as an `Ensemble` (non-trainable leaves from the trained one).

    **Arguments:**

    - `decay`: in `[0, 1)`; e.g. `0.999`.

    **Example:**

    ```python
    ens = ee.ensemble(lambda k: eqx.nn.Linear(1, 1, key=k), size=2,
                      key=jax.random.key(0))
    x = jnp.linspace(0, 1, 8)[:, None]
    loss = lambda m, b, k: jnp.mean((jax.vmap(m)(b) - 2 * b) ** 2)
    result = ee.fit(ens, loss, optax.sgd(0.1), x, steps=20, batch_size=4,
                    key=jax.random.key(1), track=[ee.EMA(0.9)], callbacks=())
    averaged = result.tracked[0]            # an ee.Ensemble of the averages
    ```
    """

    decay: float

    def __check_init__(self):
        if isinstance(self.decay, bool) or not isinstance(self.decay, int | float):
            raise TypeError(
                f"`EMA.decay` must be a float, got {type(self.decay).__name__}"
            )
        if not (math.isfinite(self.decay) and 0 <= self.decay < 1):
            raise ValueError(f"`EMA.decay` must be in [0, 1), got {self.decay}")

    def init(self, members):
        return jax.tree.map(lambda x: x.copy(), trainable(members))

    def update(self, state, members, done):
        del done
        return jax.tree.map(
            lambda average, weight: (
                self.decay * average + (1 - self.decay) * weight
            ).astype(average.dtype),
            state,
            trainable(members),
        )

    def result(self, state, ensemble):
        rest = eqx.filter(ensemble.members, eqx.is_inexact_array, inverse=True)
        return with_members(ensemble, eqx.combine(state, rest))


class SWA(Tracker):
    """Stochastic weight averaging (Izmailov et al. 2018), for every member.

    Each member's weights are averaged, with equal weight, over the steps
    `start, start + every, ...` (steps done). `FitResult.tracked` holds the
    averages as an `Ensemble`. With BatchNorm, recompute the statistics of the
    averaged weights ([`ee.recompute_batch_stats`][eqx_ensemble.recompute_batch_stats]).

    **Arguments:**

    - `start`: the first step averaged (at least 1).
    - `every`: the period in steps (at least 1).

    **Example:**

    ```python
    ens = ee.ensemble(lambda k: eqx.nn.Linear(1, 1, key=k), size=2,
                      key=jax.random.key(0))
    x = jnp.linspace(0, 1, 8)[:, None]
    loss = lambda m, b, k: jnp.mean((jax.vmap(m)(b) - 2 * b) ** 2)
    result = ee.fit(ens, loss, optax.sgd(0.1), x, steps=40, batch_size=4,
                    key=jax.random.key(1), track=[ee.SWA(start=20, every=5)],
                    callbacks=())
    averaged = result.tracked[0]   # the mean of the weights after 20, 25, ... 40
    ```
    """

    start: int
    every: int = 1

    def __check_init__(self):
        for name in ("start", "every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"`SWA.{name}` must be an int >= 1, got {value!r}")

    def check(self, steps):
        if self.start > steps:
            raise ValueError(
                f"`SWA(start={self.start})` starts after the last step ({steps}): "
                "nothing would be averaged"
            )

    def events(self, first: int, last: int) -> list[dict[str, Any]]:
        """An `"averaging_starts"` record at step `start` if in `(first, last]`."""
        if first < self.start <= last:
            return [{"step": self.start, "event": "averaging_starts", "tracker": "SWA"}]
        return []

    def init(self, members):
        weights = trainable(members)
        count = jnp.zeros((leading_size(members),), jnp.int32)
        return (jax.tree.map(lambda x: x.copy(), weights), count)

    def update(self, state, members, done):
        average, count = state
        due = (done >= self.start) & ((done - self.start) % self.every == 0)
        new_count = count + due.astype(jnp.int32)
        weight = jnp.where(
            due, 1.0 / jnp.maximum(new_count, 1).astype(jnp.float32), 0.0
        )

        def step(mean, value):
            w = weight.reshape(weight.shape + (1,) * (mean.ndim - 1))
            return (mean + w.astype(mean.dtype) * (value - mean)).astype(mean.dtype)

        return jax.tree.map(step, average, trainable(members)), new_count

    def result(self, state, ensemble):
        average, _ = state
        rest = eqx.filter(ensemble.members, eqx.is_inexact_array, inverse=True)
        return with_members(ensemble, eqx.combine(average, rest))
