"""Snapshots: each member's weights at chosen steps (snapshot ensembles, fast
geometric ensembling), as one larger ensemble."""

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import PyTree

from .._core.ensemble import Ensemble, with_members
from .._execution.compile import compiled_call
from .._internal.tree import trainable
from .._training.tracker import Tracker
from .base import check_tracker_int, repeat_members, untrained_leaves


class Snapshots(Tracker):
    """Each member's weights at chosen steps, collected inside the compiled loop
    into a larger `Ensemble`: snapshot ensembles (Huang et al. 2017) and fast
    geometric ensembling (Garipov et al. 2018) with the cyclic schedules of
    [`ee.schedules`][eqx_ensemble.schedules]. The buffer has a fixed size;
    checkpoints and resume keep it.

    **Arguments:**

    - `at`: the step counts (steps done) at which to take a snapshot, increasing.

    `FitResult.tracked` holds an `Ensemble` of `members * len(at)` models,
    member `i`'s snapshots at `i * len(at), ..., (i + 1) * len(at) - 1`.

    **Example:**

    ```python
    ens = ee.ensemble(lambda k: eqx.nn.Linear(1, 1, key=k), size=2,
                      key=jax.random.key(0))
    x = jnp.linspace(0, 1, 8)[:, None]
    loss = lambda m, b, k: jnp.mean((jax.vmap(m)(b) - 2 * b) ** 2)
    schedule = ee.schedules.cosine_cycles(0.1, cycle_steps=10, cycles=3)
    result = ee.fit(ens, loss, optax.sgd(schedule), x, steps=30, batch_size=4,
                    key=jax.random.key(1), callbacks=(),
                    track=[ee.Snapshots(at=ee.schedules.cycle_ends(10, 3))])
    len(result.tracked[0])          # 6: 3 snapshots of each of 2 members
    ```
    """

    at: tuple[int, ...]

    def __check_init__(self):
        at = self.at
        if not isinstance(at, tuple) or not at:
            raise ValueError(f"`Snapshots.at` must be a non-empty tuple, got {at!r}")
        for value in at:
            check_tracker_int("Snapshots", "at", value, 1)
        if any(b <= a for a, b in zip(at, at[1:])):
            raise ValueError(f"`Snapshots.at` must increase, got {at}")

    def events(self, first: int, last: int) -> list[dict[str, Any]]:
        """A `"snapshot"` record at each step of `at` in `(first, last]`."""
        return [
            {"step": step, "event": "snapshot", "snapshot": position}
            for position, step in enumerate(self.at)
            if first < step <= last
        ]

    def check(self, steps: int) -> None:
        late = [s for s in self.at if s > steps]
        if late:
            raise ValueError(
                f"`Snapshots` asks for steps {late}, after the last step ({steps})"
            )

    def init(self, members: PyTree[Any]) -> PyTree[Any]:
        count = len(self.at)
        return jax.tree.map(
            lambda x: jnp.zeros((x.shape[0], count, *x.shape[1:]), x.dtype),
            trainable(members),
        )

    def update(self, state: PyTree[Any], members: PyTree[Any], done: Any) -> Any:
        hits = jnp.asarray(self.at, jnp.int32) == done  # (len(at),)
        weights = trainable(members)

        def take(state):
            slot = jnp.argmax(hits)
            return jax.tree.map(
                lambda buffer, value: jax.lax.dynamic_update_index_in_dim(
                    buffer, value.astype(buffer.dtype), slot, 1
                ),
                state,
                weights,
            )

        return jax.lax.cond(jnp.any(hits), take, lambda s: s, state)

    def result(self, state: PyTree[Any], ensemble: Ensemble) -> Ensemble:
        flat = compiled_call(_member_rows, state)
        members = eqx.combine(
            flat, repeat_members(untrained_leaves(ensemble), len(self.at))
        )
        return with_members(ensemble, members)


def _member_rows(state: PyTree[Any]) -> PyTree[Any]:
    """`(members, snapshots, ...)` leaves as `(members * snapshots, ...)`."""
    return jax.tree.map(
        lambda x: x.reshape(x.shape[0] * x.shape[1], *x.shape[2:]), state
    )
