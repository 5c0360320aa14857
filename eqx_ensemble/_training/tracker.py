"""Trackers: weight-trajectory methods updated inside `fit`'s compiled loop."""

import abc
from typing import Any

from jaxtyping import Array, Int, PyTree

from .._core.ensemble import Ensemble
from .._internal.component import Component


class Tracker(Component):
    """A weight-trajectory method run inside [`fit`][eqx_ensemble.fit]'s compiled
    loop (abstract); see [`ee.EMA`][eqx_ensemble.EMA] and the guide "`fit` in
    detail". Its state carries the member axis; `update` must not couple members.

    **Example:**

    ```python
    class LastWeights(ee.Tracker):
        def init(self, members):
            return eqx.filter(members, eqx.is_inexact_array)

        def update(self, state, members, done):
            return eqx.filter(members, eqx.is_inexact_array)

    ens = ee.ensemble(lambda k: eqx.nn.Linear(1, 1, key=k), size=2,
                      key=jax.random.key(0))
    x = jnp.linspace(0, 1, 8)[:, None]
    loss = lambda m, b, k: jnp.mean((jax.vmap(m)(b) - 2 * b) ** 2)
    result = ee.fit(ens, loss, optax.sgd(0.1), x, steps=3, batch_size=4,
                    key=jax.random.key(1), track=[LastWeights()], callbacks=())
    ```
    """

    @abc.abstractmethod
    def init(self, members: PyTree[Any]) -> PyTree[Any]:
        """The initial state, from the stacked members before the first step."""

    @abc.abstractmethod
    def update(
        self, state: PyTree[Any], members: PyTree[Any], done: Int[Array, ""]
    ) -> PyTree[Any]:
        """The state after a step (`done`: steps done so far, traced int32)."""

    def result(self, state: PyTree[Any], ensemble: Ensemble) -> Any:
        """What `FitResult.tracked` holds for this tracker (default: the state)."""
        del ensemble
        return state

    def events(self, first: int, last: int) -> list[dict[str, Any]]:
        """Its `{"step", "event", ...}` records for steps `first + 1` to `last`."""
        del first, last
        return []

    def check(self, steps: int) -> None:
        """Raise before any work if this tracker cannot run for `steps` steps."""
        del steps
