"""`map`: the one general primitive, `fn(member, *args)` across members."""

from collections.abc import Callable, Sequence
from typing import Any

from jaxtyping import PRNGKeyArray, PyTree

from .._execution.execution import (
    MOVED_TO_EXECUTION,
    Execution,
    as_execution,
    refuses_moved,
)
from .ensemble import Ensemble
from .heterogeneous import Heterogeneous
from .mapping import map_members, member_chunk_size


@refuses_moved("ee.map", {"layout": MOVED_TO_EXECUTION["layout"]})
def map(
    fn: Callable[..., Any],
    ens: Ensemble | Heterogeneous,
    *args: Any,
    in_axes: int | Sequence[Any] | None = None,
    chunk_size: int | None = None,
    key: PRNGKeyArray | None = None,
    execution: Execution | None = None,
) -> PyTree[Any]:
    """Apply `fn(member, *args)` to every member in one vectorised computation.

    **Arguments:**

    - `fn`: `fn(member, *args) -> output` for ONE model (with `key=member_key`
      if `key` is given).
    - `ens`: the [`Ensemble`][eqx_ensemble.Ensemble], or an
      [`ee.Heterogeneous`][eqx_ensemble.Heterogeneous] (run group by group, the
      outputs concatenated along the member axis where their shapes agree, else
      a tuple with one per group).
    - `*args`: further arguments.
    - `in_axes`: per argument, `None` = shared, `0` = its leading axis (of size
      `len(ens)`) indexes members; a PyTree prefix of `None`/`0` mixes both.
      `None` (default) shares every argument, a bare `0` maps every one.
      Non-array leaves are always shared.
    - `chunk_size`: members are evaluated `chunk_size` at a time (a `lax.scan`
      over chunks, a remainder in one more call), bounding peak memory; the
      same result up to a few ulps. `fn` is traced once (twice with a remainder).
    - `key`: optional; member `i` gets `jax.random.split(key, len(ens))[i]`.
    - `execution`: an [`ee.Execution`][eqx_ensemble.Execution]; `map` uses its
      `member_chunk` (as `chunk_size`; it need not divide the members) and its
      `layout`: `"vmap"`, `"sequential"` (one member after another; inside
      `jax.jit`, one copy of `fn` per member) or `"auto"` (default:
      `"sequential"` when `fn` convolves on one CPU device, with at most 16
      members, no `chunk_size` and, called eagerly, at least 100 MFLOP of
      convolution per member). Results agree to floating-point rounding.

    **Returns:**

    `fn`'s output with a leading member axis on every array leaf.

    **Example:**

    ```python
    ens = ee.ensemble(lambda k: eqx.nn.Linear(3, 1, key=k), size=4,
                      key=jax.random.key(0))
    x = jnp.ones((10, 3))
    shared = ee.map(lambda m, x: jax.vmap(m)(x), ens, x)             # (4, 10, 1)
    per_member = ee.map(lambda m, x: jax.vmap(m)(x), ens,
                        jnp.ones((4, 10, 3)), in_axes=(0,))         # (4, 10, 1)
    chunked = ee.map(lambda m, x: jax.vmap(m)(x), ens, x, chunk_size=2)
    ```
    """
    if not isinstance(ens, Ensemble | Heterogeneous):
        raise TypeError(
            f"`ee.map` expects an `ee.Ensemble` as its second argument, got "
            f"{type(ens).__name__}; build one with `ee.ensemble` or `ee.stack`"
        )
    execution = as_execution(execution, "ee.map", ("layout", "member_chunk"))
    chunk_size = member_chunk_size(chunk_size, execution.member_chunk, len(ens))
    return map_members(fn, ens, args, in_axes, chunk_size, key, execution.layout)
