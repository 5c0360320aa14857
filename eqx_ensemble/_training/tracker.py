"""Trackers: weight-trajectory methods updated inside `fit`'s compiled loop.

The protocol (what `fit(..., track=[...])` calls):

- `init(members) -> state`: called once, before the first step, with the stacked
  members; `state` is a PyTree whose array leaves carry the member axis (it is
  checkpointed, resumed and sharded like the ensemble).
- `update(state, members, done) -> state`: called inside the compiled loop after
  every step with the updated stacked members and the number of steps done
  (a traced int32 scalar). It must be a pure JAX function and must not couple
  members (each member's state from that member's weights).
- `result(state, ensemble) -> Any`: turns the final state into what
  `FitResult.tracked` holds for this tracker (e.g. an `Ensemble`).
- `check(steps)`: optional, raises before any work if the tracker cannot do its
  job in a run of `steps` steps (e.g. it would start after the last step).
"""

import abc
from typing import Any

from jaxtyping import Array, Int, PyTree

from .._core.ensemble import Ensemble
from .._internal.component import Component


class Tracker(Component):
    """A weight-trajectory method run inside [`fit`][eqx_ensemble.fit]'s compiled
    loop (abstract). See [`ee.EMA`][eqx_ensemble.EMA] for a complete example and
    the guide "`fit` in detail" for the protocol: `init`, `update`, `result`, `check`.

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
        """The state after a step (`members`: the updated stacked members;
        `done`: the steps done so far)."""

    def result(self, state: PyTree[Any], ensemble: Ensemble) -> Any:
        """What `FitResult.tracked` holds for this tracker (default: the state)."""
        del ensemble
        return state

    def events(self, first: int, last: int) -> list[dict[str, Any]]:
        """What this tracker does after steps `first + 1` to `last`, as records
        with `"step"` and `"event"` (for loggers; default: none)."""
        del first, last
        return []

    def check(self, steps: int) -> None:
        """Raise before any work if this tracker cannot run for `steps` steps."""
        del steps
