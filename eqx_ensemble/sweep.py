"""Random search over hyperparameters, trained as ONE ensemble.

A search space is a PyTree (e.g. a dict) whose leaves are distributions (`log_uniform`,
`uniform`, `choice`) or fixed numbers; [`sample`][eqx_ensemble.sweep.sample] draws one
setting per member, as arrays with a leading member axis: what `ee.fit(..., hyper=...)`
(loss and model hyperparameters) and `ee.fit(..., hyperparams=...)` (optimizer
hyperparameters injected with `optax.inject_hyperparams`) take.

```python
space = {"learning_rate": ee.sweep.log_uniform(1e-4, 1e-1),
         "weight_decay": ee.sweep.choice([0.0, 1e-4, 1e-3])}
settings = ee.sweep.sample(jax.random.key(0), space, size=16)
settings["learning_rate"].shape        # (16,)
```
"""

import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, PRNGKeyArray, PyTree

from ._core.ensemble import Ensemble
from ._core.heterogeneous import Heterogeneous
from ._execution.compile import compiled_call
from ._internal.tree import as_array

__all__ = [
    "Architectures",
    "Distribution",
    "architectures",
    "choice",
    "log_uniform",
    "sample",
    "uniform",
]


class Distribution(eqx.Module):
    """A distribution of one hyperparameter (abstract); see
    [`log_uniform`][eqx_ensemble.sweep.log_uniform],
    [`uniform`][eqx_ensemble.sweep.uniform] and [`choice`][eqx_ensemble.sweep.choice].

    **Example:**

    ```python
    ee.sweep.uniform(0.0, 0.5).draw(jax.random.key(0), 4).shape   # (4,)
    ```
    """

    def draw(self, key: PRNGKeyArray, size: int) -> Float[Array, " size"]:
        """`size` independent draws."""
        raise NotImplementedError


class _Uniform(Distribution):
    low: float
    high: float
    log: bool = False

    def draw(self, key: PRNGKeyArray, size: int) -> Float[Array, " size"]:
        if self.log:
            exponent = jax.random.uniform(
                key, (size,), minval=math.log(self.low), maxval=math.log(self.high)
            )
            return jnp.exp(exponent)
        return jax.random.uniform(key, (size,), minval=self.low, maxval=self.high)


class _Choice(Distribution):
    values: tuple[float, ...]

    def draw(self, key: PRNGKeyArray, size: int) -> Float[Array, " size"]:
        index = jax.random.randint(key, (size,), 0, len(self.values))
        return jnp.asarray(self.values, jnp.float32)[index]


def _check_bounds(low: Any, high: Any, name: str) -> tuple[float, float]:
    for bound in (low, high):
        if isinstance(bound, bool) or not isinstance(bound, int | float):
            raise TypeError(f"`{name}` bounds must be numbers, got {bound!r}")
        if not math.isfinite(bound):
            raise ValueError(f"`{name}` bounds must be finite, got {bound}")
    if not low < high:
        raise ValueError(f"`{name}` needs low < high, got low={low}, high={high}")
    return float(low), float(high)


def log_uniform(low: float, high: float) -> Distribution:
    """Log-uniform on `[low, high)`: `exp(U(log low, log high))`, for scales such as
    learning rates and weight decays (`0 < low < high`).

    **Example:**

    ```python
    rates = ee.sweep.log_uniform(1e-4, 1e-1).draw(jax.random.key(0), 8)
    ```
    """
    low, high = _check_bounds(low, high, "log_uniform")
    if low <= 0:
        raise ValueError(
            f"`log_uniform` needs positive bounds (it samples the logarithm), got "
            f"low={low}; use `uniform` for a range that includes zero"
        )
    return _Uniform(low, high, log=True)


def uniform(low: float, high: float) -> Distribution:
    """Uniform on `[low, high)`.

    **Example:**

    ```python
    rates = ee.sweep.uniform(0.0, 0.5).draw(jax.random.key(0), 8)   # dropout
    ```
    """
    low, high = _check_bounds(low, high, "uniform")
    return _Uniform(low, high)


def choice(values: Any) -> Distribution:
    """One of `values`, each equally likely.

    **Example:**

    ```python
    smoothing = ee.sweep.choice([0.0, 0.05, 0.1]).draw(jax.random.key(0), 8)
    ```
    """
    try:
        items = tuple(float(v) for v in values)
    except (TypeError, ValueError):
        raise TypeError(
            f"`choice` takes a sequence of numbers, got {values!r}"
        ) from None
    if not items:
        raise ValueError("`choice` needs at least one value")
    if not all(math.isfinite(v) for v in items):
        raise ValueError(f"`choice` values must be finite, got {items}")
    return _Choice(items)


def sample(
    key: PRNGKeyArray, space: PyTree[Any], size: int
) -> PyTree[Float[Array, " size"]]:
    """One setting per member: every distribution in `space` drawn `size` times (each
    with its own key, `fold_in(key, position)`), every fixed number repeated.

    **Arguments:**

    - `key`: a PRNG key.
    - `space`: a PyTree whose leaves are distributions or numbers.
    - `size`: the number of members.

    **Returns:**

    `space`'s structure with arrays of shape `(size,)`.

    **Example:**

    ```python
    space = {"learning_rate": ee.sweep.log_uniform(1e-4, 1e-1), "momentum": 0.9}
    settings = ee.sweep.sample(jax.random.key(0), space, size=8)
    settings["momentum"]          # 0.9 for every member
    ```
    """
    if isinstance(size, bool) or not isinstance(size, int | np.integer) or size < 1:
        raise ValueError(f"`size` must be a positive int, got {size!r}")
    is_distribution = lambda x: isinstance(x, Distribution)
    leaves, treedef = jax.tree.flatten(space, is_leaf=is_distribution)
    if not leaves:
        raise ValueError("`space` holds no distribution or number")
    drawn = []
    for position, leaf in enumerate(leaves):
        if is_distribution(leaf):
            drawn.append(leaf.draw(jax.random.fold_in(key, position), int(size)))
        elif isinstance(leaf, int | float) and not isinstance(leaf, bool):
            drawn.append(jnp.full((int(size),), float(leaf), jnp.float32))
        else:
            raise TypeError(
                f"`space` leaf {position} is a {type(leaf).__name__}; use a "
                "distribution (`ee.sweep.log_uniform`, `uniform`, `choice`) or a "
                "number"
            )
    return jax.tree.unflatten(treedef, drawn)


class Architectures(NamedTuple):
    """What [`architectures`][eqx_ensemble.sweep.architectures] returns.

    - `ensemble`: an [`ee.Heterogeneous`][eqx_ensemble.Heterogeneous], one group per
      distinct architecture drawn.
    - `settings`: `space`'s structure with one value per member, in the ensemble's
      member order (arrays of shape `(size,)`).
    - `state`: the model states (a tuple, one per group) when `make` returns a
      `(model, eqx.nn.State)` pair, else `None`.

    **Example:**

    ```python
    pool, settings, state = ee.sweep.architectures(
        lambda key, width: eqx.nn.MLP(2, 1, width, 1, key=key),
        {"width": ee.sweep.choice([8, 16])}, size=4, key=jax.random.key(0))
    len(pool), settings["width"].shape, state     # 4, (4,), None
    ```
    """

    ensemble: Heterogeneous
    settings: PyTree[Float[Array, " size"]]
    state: tuple[Any, ...] | None


def _python_number(value: Any) -> int | float:
    value = float(value)
    return int(value) if value.is_integer() else value


def architectures(
    make: Callable[..., Any],
    space: dict[str, Any],
    *,
    size: int,
    key: PRNGKeyArray,
) -> Architectures:
    """A hyper-deep ensemble's pool over architectures (Wenzel, Snoek, Tran & Jenatton
    2020): `size` members, each with an architecture drawn from `space`, built as one
    [`ee.Heterogeneous`][eqx_ensemble.Heterogeneous] with one natively stacked group
    per distinct architecture.

    **Arguments:**

    - `make`: `make(key, **setting) -> model` (or `(model, eqx.nn.State)`); a
      drawn number that is whole is passed as an `int`.
    - `space`: a dict, name -> distribution (`ee.sweep.choice` for discrete choices
      such as widths and depths) or fixed number.
    - `size`: the number of members.
    - `key`: a PRNG key; `split(key)[0]` draws the settings (as
      [`sample`][eqx_ensemble.sweep.sample]), `split(key)[1]` is split into one
      initialisation key per drawn member.

    **Returns:**

    An [`Architectures`][eqx_ensemble.sweep.Architectures] `(ensemble, settings,
    state)`: groups in the order their architecture was first drawn, members
    within a group in draw order. Each group is built as one compiled program,
    cached as [`ee.ensemble`][eqx_ensemble.ensemble]'s builds are. Train the pool
    with one `ee.fit`, pick members with
    [`ee.greedy_selection`][eqx_ensemble.greedy_selection] on its validation
    predictions, and index the pool with the picks (`pool[indices]`).

    **Example:**

    ```python
    pool = ee.sweep.architectures(
        lambda key, width, depth: eqx.nn.MLP(2, 1, width, depth, key=key),
        {"width": ee.sweep.choice([16, 32]), "depth": ee.sweep.choice([1, 2])},
        size=8, key=jax.random.key(0))
    pool.ensemble.sizes         # members per distinct (width, depth)
    pool.settings["width"]      # per member, in the ensemble's order
    ```
    """
    if not isinstance(space, dict) or not space:
        raise TypeError(
            "`space` must be a non-empty dict of keyword arguments of `make` "
            f"(name -> distribution or number), got {space!r}"
        )
    for name in space:
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(f"`space` key {name!r} is not a keyword argument name")
    draw_key, init_key = jax.random.split(key)
    drawn = sample(draw_key, space, size)
    names = list(space)
    values = np.stack([np.asarray(drawn[name]) for name in names], axis=1)
    member_keys = jax.random.split(init_key, size)
    order: list[int] = []
    groups, states = [], []
    seen: dict[tuple[float, ...], list[int]] = {}
    for index, row in enumerate(map(tuple, values.tolist())):
        seen.setdefault(row, []).append(index)
    for row, members in seen.items():
        setting = {
            name: _python_number(value) for name, value in zip(names, row, strict=True)
        }

        try:
            made = compiled_call(
                functools.partial(_build_group, make, setting),
                (member_keys, np.asarray(members, np.int32)),
            )
        except TypeError as error:
            error.add_note(f"(`make` called as make(key, **{setting}))")
            raise
        stateful = (
            isinstance(made, tuple)
            and len(made) == 2
            and isinstance(made[1], eqx.nn.State)
        )
        groups.append(Ensemble(made[0] if stateful else made))
        states.append(made[1] if stateful else None)
        order.extend(members)
    permutation = np.asarray(order)
    # Reordered on the host (`jnp` indexing would compile a program per operation).
    settings = {name: as_array(np.asarray(drawn[name])[permutation]) for name in names}
    with_state = [state is not None for state in states]
    if any(with_state) and not all(with_state):
        raise ValueError(
            "`make` returned a model state for some architectures and not others"
        )
    return Architectures(
        Heterogeneous(groups), settings, tuple(states) if all(with_state) else None
    )


def _build_group(
    make: Callable[..., Any], setting: dict[str, Any], keys_rows: Any
) -> Any:
    """One architecture's members: `make(key, **setting)` under `eqx.filter_vmap`
    over `keys[rows]` (module-level: a stable cache key)."""
    keys, rows = keys_rows
    return eqx.filter_vmap(lambda key: make(key, **setting))(keys[rows])
