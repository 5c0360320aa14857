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

    - `fn`: `fn(member, *args) -> output`, written for ONE model. If `key` is given
      it is called as `fn(member, *args, key=member_key)`.
    - `ens`: the [`Ensemble`][eqx_ensemble.Ensemble], or an
      [`ee.Heterogeneous`][eqx_ensemble.Heterogeneous]: then `fn` runs group by
      group (per-member arguments and keys cut at the groups' bounds) and the
      groups' outputs are concatenated along the member axis where their shapes
      agree, else returned as a tuple with one output per group.
    - `*args`: further arguments.
    - `in_axes`: per argument, `None` = shared by all members, `0` = its leading axis
      indexes members (it must have size `len(ens)`); a PyTree prefix of `None`/`0`
      mixes both inside one argument. `None` (the default) shares every argument;
      a bare `0` makes every argument per-member. Non-array leaves are always shared.
    - `chunk_size`: if given, members are evaluated `chunk_size` at a time (a
      `jax.lax.scan` over chunks, any remainder in one more call), which bounds peak
      memory by the chunk instead of the whole ensemble. The result is the same
      up to floating-point rounding (XLA may order a reduction differently for
      a chunk than for the whole ensemble: differences of a few ulps).
      `fn` is traced once (twice when `chunk_size` does not divide `len(ens)`),
      whatever the ensemble size.
    - `key`: optional PRNG key split into one key per member:
      member `i` gets `jax.random.split(key, len(ens))[i]`.
    - `execution`: an [`ee.Execution`][eqx_ensemble.Execution]; `map` uses its
      `member_chunk` (the same as `chunk_size`; here it need not divide the
      members, unlike in `fit`) and its `layout`, how the member
      axis is computed, as in
      [`make_step`][eqx_ensemble.make_step]. `"vmap"`: one vectorised
      computation. `"sequential"`: `fn` on one member after another, the results
      stacked (inside `jax.jit`: straight-line code, one copy of `fn` per
      member). `"auto"` (the default): `"sequential"` when `fn` convolves, the
      arrays sit on one CPU device, there are at most 16 members and no
      `chunk_size` is given, and, called eagerly (outside `jit`), the
      convolutions take at least 100 MFLOP per member (each operation is then
      dispatched once per member); else `"vmap"`. XLA's CPU backend runs a
      member-batched convolution as a grouped convolution, several times
      slower than the members' own (see the guide "`fit` in detail"). Deciding traces
      `fn` once per function and input shapes. The results are the same
      either way, to floating-point rounding.

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
