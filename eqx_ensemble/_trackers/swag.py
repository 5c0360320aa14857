"""SWAG (Maddox et al. 2019): a Gaussian over each member's weights from the
moments of its trajectory, and MultiSWAG sampling from the members' posteriors."""

import functools
import math
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Int, PRNGKeyArray, PyTree

from .._core.ensemble import Ensemble, with_members
from .._execution.compile import compiled_call
from .._internal.tree import leading_size, trainable
from .._training.tracker import Tracker
from .base import (
    check_tracker_int,
    due,
    repeat_members,
    untrained_leaves,
)


class SWAGPosterior(eqx.Module):
    """Each member's SWAG posterior, what `FitResult.tracked` holds for
    [`ee.SWAG`][eqx_ensemble.SWAG]: a Gaussian with the collected weights' mean
    and diagonal variance plus a low-rank part from their last `rank`
    deviations (Maddox et al. 2019).

    - `mean`: the SWA means, an `Ensemble` (like `ee.SWA`'s result).
    - `variance`: per-member diagonal variances of the trainable leaves.
    - `deviations`: per member, `(rank, ...)` per leaf: the last deviations
      from the running mean (a ring buffer; unused rows are zero).
    - `count`: `(members,)` how many weights each member collected.
    - `rank`: the low-rank part's maximum rank.

    **Example:**

    ```python
    ens = ee.ensemble(lambda k: eqx.nn.Linear(1, 1, key=k), size=2,
                      key=jax.random.key(0))
    x = jnp.linspace(0, 1, 8)[:, None]
    loss = lambda m, b, k: jnp.mean((jax.vmap(m)(b) - 2 * b) ** 2)
    posterior = ee.fit(ens, loss, optax.sgd(0.1), x, steps=30, batch_size=4,
                       key=jax.random.key(1), callbacks=(),
                       track=[ee.SWAG(start=10, rank=4)]).tracked[0]
    posterior.count                       # [21, 21]: weights collected per member
    swa = posterior.mean                  # the SWA means, an Ensemble
    draws = posterior.sample(jax.random.key(2), samples=10)   # 20 members
    ```
    """

    mean: Ensemble
    variance: PyTree[Any]
    deviations: PyTree[Any]
    count: Int[Array, " members"]
    rank: int = eqx.field(static=True)

    def sample(
        self, key: PRNGKeyArray, samples: int = 1, *, scale: float = 0.5
    ) -> Ensemble:
        """Draw weights from every member's posterior: MultiSWAG (Wilson &
        Izmailov 2020) is the ensemble of these draws.

        `w = mean + sqrt(scale) * (sqrt(variance / 2) z1 + D^T z2 / sqrt(2 (K - 1)))`
        with `z1, z2` standard normal, `D` the member's `K = min(count, rank)`
        deviations; `scale=0.5` is the paper's choice, `scale=0` gives the SWA
        means.

        **Arguments:**

        - `key`: PRNG key.
        - `samples`: draws per member.
        - `scale`: the covariance scale, `>= 0`.

        **Returns:**

        An `Ensemble` of `members * samples` models, member `i`'s draws at
        `i * samples, ..., (i + 1) * samples - 1`.

        **Example:** see [`ee.SWAG`][eqx_ensemble.SWAG].
        """
        check_tracker_int("SWAGPosterior.sample", "samples", samples, 1)
        if not (isinstance(scale, int | float) and math.isfinite(scale) and scale >= 0):
            raise ValueError(f"`scale` must be finite and >= 0, got {scale!r}")
        draw = functools.partial(_draw, samples=samples, root_scale=math.sqrt(scale))
        return compiled_call(draw, self, key)


def _draw(
    posterior: SWAGPosterior, key: PRNGKeyArray, *, samples: int, root_scale: float
) -> Ensemble:
    """`SWAGPosterior.sample`'s draws (module-level: `compiled_call` keys by it)."""
    means = trainable(posterior.mean.members)
    size = int(posterior.count.shape[0])
    used = jnp.minimum(posterior.count, posterior.rank)  # (members,)
    denominator = jnp.sqrt(2.0 * jnp.maximum(used - 1, 1).astype(jnp.float32))
    leaves, treedef = jax.tree.flatten(means)
    variances = treedef.flatten_up_to(posterior.variance)
    deviations = treedef.flatten_up_to(posterior.deviations)
    key_z1, key_z2 = jax.random.split(key)
    # One low-rank coefficient vector per member and draw, shared by leaves.
    z2 = jax.random.normal(key_z2, (size, samples, posterior.rank))
    active = jnp.arange(posterior.rank)[None, None, :] < used[:, None, None]
    z2 = jnp.where(active, z2, 0.0)
    drawn = []
    for index, (mean, variance, deviation) in enumerate(
        zip(leaves, variances, deviations, strict=True)
    ):
        if mean is None:
            drawn.append(None)
            continue
        z1 = jax.random.normal(
            jax.random.fold_in(key_z1, index), (size, samples, *mean.shape[1:])
        )
        diagonal = jnp.sqrt(variance / 2.0)[:, None] * z1
        low_rank = jnp.einsum("msr,mr...->ms...", z2, deviation)
        low_rank = low_rank / denominator.reshape((size, 1) + (1,) * (mean.ndim - 1))
        weight = mean[:, None] + root_scale * (diagonal + low_rank)
        drawn.append(weight.reshape(size * samples, *mean.shape[1:]).astype(mean.dtype))
    weights = jax.tree.unflatten(treedef, drawn)
    members = eqx.combine(
        weights, repeat_members(untrained_leaves(posterior.mean), samples)
    )
    return with_members(posterior.mean, members)


class SWAG(Tracker):
    """SWA-Gaussian (Maddox, Garipov, Izmailov, Vetrov & Wilson 2019) for every
    member, inside the compiled loop: over the steps `start, start + every, ...`
    each member's running mean and mean of squares, and its last `rank`
    deviations from the running mean, in fixed-size buffers.
    `FitResult.tracked` holds a [`SWAGPosterior`][eqx_ensemble.SWAGPosterior];
    its `.sample(key, samples)` gives MultiSWAG (Wilson & Izmailov 2020).

    **Arguments:**

    - `start`: the first step collected (at least 1).
    - `every`: the period in steps (at least 1).
    - `rank`: the low-rank part's rank (at least 1; the paper uses 20).

    **Example:**

    ```python
    ens = ee.ensemble(lambda k: eqx.nn.Linear(1, 1, key=k), size=2,
                      key=jax.random.key(0))
    x = jnp.linspace(0, 1, 8)[:, None]
    loss = lambda m, b, k: jnp.mean((jax.vmap(m)(b) - 2 * b) ** 2)
    result = ee.fit(ens, loss, optax.sgd(0.1), x, steps=40, batch_size=4,
                    key=jax.random.key(1), callbacks=(),
                    track=[ee.SWAG(start=20, every=2, rank=5)])
    posterior = result.tracked[0]
    multi = posterior.sample(jax.random.key(2), samples=3)   # 6 members
    ```
    """

    start: int
    every: int = 1
    rank: int = 20

    def __check_init__(self):
        check_tracker_int("SWAG", "start", self.start, 1)
        check_tracker_int("SWAG", "every", self.every, 1)
        check_tracker_int("SWAG", "rank", self.rank, 1)

    def check(self, steps: int) -> None:
        if self.start > steps:
            raise ValueError(
                f"`SWAG(start={self.start})` starts after the last step ({steps}): "
                "nothing would be collected"
            )
        collected = (steps - self.start) // self.every + 1
        if self.rank > collected:
            raise ValueError(
                f"`SWAG(rank={self.rank})` needs at least {self.rank} collected "
                f"weights, but steps {self.start}..{steps} every {self.every} give "
                f"{collected}; lower `rank` or `every`, or train longer"
            )

    def events(self, first: int, last: int) -> list[dict[str, Any]]:
        """An `"averaging_starts"` record at step `start` if it is in
        `(first, last]`."""
        if first < self.start <= last:
            return [
                {"step": self.start, "event": "averaging_starts", "tracker": "SWAG"}
            ]
        return []

    def init(self, members: PyTree[Any]) -> PyTree[Any]:
        weights = trainable(members)
        size = leading_size(members)
        zeros = jax.tree.map(jnp.zeros_like, weights)
        deviations = jax.tree.map(
            lambda x: jnp.zeros((x.shape[0], self.rank, *x.shape[1:]), x.dtype),
            weights,
        )
        return {
            "mean": zeros,
            "square": jax.tree.map(jnp.zeros_like, weights),
            "deviations": deviations,
            "count": jnp.zeros((size,), jnp.int32),
        }

    def update(self, state: PyTree[Any], members: PyTree[Any], done: Any) -> Any:
        weights = trainable(members)

        def collect(state):
            count = state["count"] + 1
            step = 1.0 / count.astype(jnp.float32)

            def running(average, value):
                w = step.reshape(step.shape + (1,) * (average.ndim - 1))
                return (average + w.astype(average.dtype) * (value - average)).astype(
                    average.dtype
                )

            mean = jax.tree.map(running, state["mean"], weights)
            square = jax.tree.map(
                running, state["square"], jax.tree.map(jnp.square, weights)
            )
            # Every member collects on the same steps: one slot for all.
            slot = (jnp.max(count) - 1) % self.rank

            def write(buffer, value, average):
                return jax.lax.dynamic_update_index_in_dim(
                    buffer, (value - average).astype(buffer.dtype), slot, 1
                )

            deviations = jax.tree.map(write, state["deviations"], weights, mean)
            return {
                "mean": mean,
                "square": square,
                "deviations": deviations,
                "count": count,
            }

        # One step count for all members: off-period steps skip the work.
        return jax.lax.cond(
            due(done, self.start, self.every), collect, lambda s: s, state
        )

    def result(self, state: PyTree[Any], ensemble: Ensemble) -> SWAGPosterior:
        mean = with_members(
            ensemble, eqx.combine(state["mean"], untrained_leaves(ensemble))
        )
        # The squares in their own program, so XLA cannot fuse them into the
        # subtraction (the bits of op by op).
        squares = compiled_call(_squares, state["mean"])
        variance = compiled_call(_variance, state["square"], squares)
        return SWAGPosterior(
            mean=mean,
            variance=variance,
            deviations=state["deviations"],
            count=state["count"],
            rank=self.rank,
        )


def _squares(tree: PyTree[Any]) -> PyTree[Any]:
    return jax.tree.map(lambda x: x**2, tree)


def _variance(square: PyTree[Any], squared_mean: PyTree[Any]) -> PyTree[Any]:
    return jax.tree.map(lambda sq, m2: jnp.maximum(sq - m2, 0.0), square, squared_mean)
