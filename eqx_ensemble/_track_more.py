"""More trackers: SWAG (with MultiSWAG sampling) and snapshot collection."""

import math
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Int, PRNGKeyArray, PyTree

from ._ensemble import Ensemble, with_members
from ._optim import trainable
from ._track import Tracker
from ._tree import leading_size


def _check_int(owner: str, name: str, value: Any, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"`{owner}.{name}` must be an int >= {low}, got {value!r}")


def _due(done: Any, start: int, every: int) -> Any:
    return (done >= start) & ((done - start) % every == 0)


def _rest(ensemble: Ensemble) -> Any:
    return eqx.filter(ensemble.members, eqx.is_inexact_array, inverse=True)


def _repeat_rest(rest: Any, repeats: int) -> Any:
    # Non-trainable array leaves (integer buffers) of each member, repeated for
    # its samples or snapshots (member-major).
    return jax.tree.map(
        lambda x: jnp.repeat(x, repeats, axis=0) if eqx.is_array(x) else x, rest
    )


class SWAGPosterior(eqx.Module):
    """Each member's SWAG posterior, made by [`ee.SWAG`][eqx_ensemble.SWAG] (it
    is what `FitResult.tracked` holds for it): a Gaussian with the mean and
    diagonal variance of the collected weights plus a low-rank part from their
    last `rank` deviations (Maddox et al. 2019).

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
                       key=jax.random.key(1), progress=False,
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
        _check_int("SWAGPosterior.sample", "samples", samples, 1)
        if not (isinstance(scale, int | float) and math.isfinite(scale) and scale >= 0):
            raise ValueError(f"`scale` must be finite and >= 0, got {scale!r}")
        means = trainable(self.mean.members)
        size = int(self.count.shape[0])
        used = jnp.minimum(self.count, self.rank)  # (members,)
        denominator = jnp.sqrt(2.0 * jnp.maximum(used - 1, 1).astype(jnp.float32))
        leaves, treedef = jax.tree.flatten(means)
        variances = treedef.flatten_up_to(self.variance)
        deviations = treedef.flatten_up_to(self.deviations)
        key_z1, key_z2 = jax.random.split(key)
        # One low-rank coefficient vector per member and draw, shared by leaves.
        z2 = jax.random.normal(key_z2, (size, samples, self.rank))
        active = jnp.arange(self.rank)[None, None, :] < used[:, None, None]
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
            low_rank = low_rank / denominator.reshape(
                (size, 1) + (1,) * (mean.ndim - 1)
            )
            weight = mean[:, None] + math.sqrt(scale) * (diagonal + low_rank)
            drawn.append(
                weight.reshape(size * samples, *mean.shape[1:]).astype(mean.dtype)
            )
        weights = jax.tree.unflatten(treedef, drawn)
        members = eqx.combine(weights, _repeat_rest(_rest(self.mean), samples))
        return with_members(self.mean, members)


class SWAG(Tracker):
    """SWA-Gaussian (Maddox, Garipov, Izmailov, Vetrov & Wilson 2019) for every
    member, updated inside the compiled loop: over the steps `start, start +
    every, ...` each member's running mean and mean of squares of its weights,
    and its last `rank` deviations from the running mean, in fixed-size buffers
    (the state does not depend on the number of steps).
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
                    key=jax.random.key(1), progress=False,
                    track=[ee.SWAG(start=20, every=2, rank=5)])
    posterior = result.tracked[0]
    multi = posterior.sample(jax.random.key(2), samples=3)   # 6 members
    ```
    """

    start: int
    every: int = 1
    rank: int = 20

    def __check_init__(self):
        _check_int("SWAG", "start", self.start, 1)
        _check_int("SWAG", "every", self.every, 1)
        _check_int("SWAG", "rank", self.rank, 1)

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
            # Every member collects on the same steps: one slot (a scalar) for
            # all, so each buffer gets one row written in place.
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

        # The step count is one scalar for all members: off-period steps skip
        # the work (the identity branch leaves the buffers where they are).
        return jax.lax.cond(
            _due(done, self.start, self.every), collect, lambda s: s, state
        )

    def result(self, state: PyTree[Any], ensemble: Ensemble) -> SWAGPosterior:
        mean = with_members(ensemble, eqx.combine(state["mean"], _rest(ensemble)))
        variance = jax.tree.map(
            lambda sq, m: jnp.maximum(sq - m**2, 0.0), state["square"], state["mean"]
        )
        return SWAGPosterior(
            mean=mean,
            variance=variance,
            deviations=state["deviations"],
            count=state["count"],
            rank=self.rank,
        )


class Snapshots(Tracker):
    """Each member's weights at chosen steps, collected inside the compiled loop
    into a larger `Ensemble`: snapshot ensembles (Huang et al. 2017) and fast
    geometric ensembling (Garipov et al. 2018) with the cyclic schedules of
    [`ee.schedules`][eqx_ensemble.schedules].

    The steps are given up front (`at`), so the buffer has a fixed size and the
    state does not depend on the run's length; checkpoints and resume keep it.

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
                    key=jax.random.key(1), progress=False,
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
            _check_int("Snapshots", "at", value, 1)
        if any(b <= a for a, b in zip(at, at[1:])):
            raise ValueError(f"`Snapshots.at` must increase, got {at}")

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
            # One row per member written in place (not a pass over the buffer).
            slot = jnp.argmax(hits)
            return jax.tree.map(
                lambda buffer, value: jax.lax.dynamic_update_index_in_dim(
                    buffer, value.astype(buffer.dtype), slot, 1
                ),
                state,
                weights,
            )

        # The step count is one scalar for all members: other steps skip the work.
        return jax.lax.cond(jnp.any(hits), take, lambda s: s, state)

    def result(self, state: PyTree[Any], ensemble: Ensemble) -> Ensemble:
        count = len(self.at)
        flat = jax.tree.map(
            lambda x: x.reshape(x.shape[0] * count, *x.shape[2:]), state
        )
        members = eqx.combine(flat, _repeat_rest(_rest(ensemble), count))
        return with_members(ensemble, members)


def _float(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"`{name}` must be a number, got {value!r}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"`{name}` must be finite and >= 0, got {value}")
    return float(value)


def cosine_cycles(peak: float, *, cycle_steps: int, cycles: int) -> Any:
    """Cosine annealing with warm restarts, as in snapshot ensembles (Huang et
    al. 2017): each cycle of `cycle_steps` steps falls from `peak` to 0 along
    half a cosine, `peak / 2 * (cos(pi * t / cycle_steps) + 1)` for the
    `t`-th step of the cycle. An optax schedule (step count -> learning rate).

    **Example:**

    ```python
    schedule = ee.schedules.cosine_cycles(0.1, cycle_steps=100, cycles=5)
    optimizer = optax.sgd(schedule, momentum=0.9)
    snapshots = ee.Snapshots(at=ee.schedules.cycle_ends(100, 5))
    ```
    """
    peak = _float(peak, "peak")
    _check_int("cosine_cycles", "cycle_steps", cycle_steps, 1)
    _check_int("cosine_cycles", "cycles", cycles, 1)

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
    _check_int("cycle_ends", "cycle_steps", cycle_steps, 1)
    _check_int("cycle_ends", "cycles", cycles, 1)
    return tuple(offset + cycle_steps * (k + 1) for k in range(cycles))


def triangular_cycles(
    high: float, low: float, *, cycle_steps: int, start: int = 0
) -> Any:
    """The cyclic schedule of fast geometric ensembling (Garipov et al. 2018):
    after `start` steps (during which it stays at `high`), each cycle of
    `cycle_steps` steps goes linearly from `high` down to `low` in its first half
    and back up in its second. Snapshots are taken at the middle of each cycle,
    where the rate is lowest ([`fge_snapshots`][eqx_ensemble.schedules.fge_snapshots]).

    **Example:**

    ```python
    schedule = ee.schedules.triangular_cycles(0.05, 0.0005, cycle_steps=20,
                                              start=200)
    snapshots = ee.Snapshots(at=ee.schedules.fge_snapshots(20, 5, start=200))
    ```
    """
    high, low = _float(high, "high"), _float(low, "low")
    _check_int("triangular_cycles", "cycle_steps", cycle_steps, 2)
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
    _check_int("fge_snapshots", "cycle_steps", cycle_steps, 2)
    _check_int("fge_snapshots", "cycles", cycles, 1)
    return tuple(start + cycle_steps * k + cycle_steps // 2 for k in range(cycles))
