"""`Execution`: how a run executes, never what it computes."""

import functools
from collections.abc import Callable
from typing import Any, Literal, cast

from jax.sharding import Mesh

from .._internal.checks import MAX_INT32, check_choice, check_positive_int
from .._internal.component import Component
from .compile import check_compiler_options
from .placement import check_mesh

LayoutChoice = Literal["auto", "vmap", "sequential"]
_LAYOUTS = ("auto", "vmap", "sequential")
# Every field, in order: all of them are `fit`'s.
FIELDS = (
    "steps_per_dispatch",
    "layout",
    "unroll",
    "compiler_options",
    "mesh",
    "member_chunk",
    "guard",
)
_GUARDS = ("auto", "step")


class Execution(Component):
    """How a run executes: speed, memory and placement, never the result.

    **Arguments (all optional; `None` lets the library choose):**

    - `steps_per_dispatch`: `fit` only: steps fused into one compiled call.
      `None`: 1000 for tiny steps (under ~16 MFLOP of matmuls), else 100;
      unrolled, at most about a second of estimated work; 1 with `steps=None`
      and for unrolled steps of a stream. Callbacks and checkpoints run between
      dispatches. On a CPU (array data) any `steps=` reuses the program.
    - `layout`: how a step computes the member axis: `"vmap"` (one vectorised
      computation), `"sequential"` (members one after another inside the
      compiled step; compile time grows with the member count), or `"auto"`
      (the default): sequential for a function that convolves on one CPU
      device with at most 16 members (XLA's CPU backend runs a member-batched
      convolution as a slow grouped one) or on one GPU for large ones, with
      `fit`'s thresholds in the fit guide ("Convolutions: the member layout");
      vectorised otherwise, and always for coupled losses or a trained shared part.
    - `unroll`: `fit` only: one compiled call per step instead of a compiled
      loop over a dispatch's steps (the default, `None`).
    - `compiler_options`: XLA options for the compiled step (a dict of option
      name -> str, bool, int or float). `None`: the library's choice (on a CPU,
      LLVM level 1 unless `XLA_FLAGS` set one, and big steps' matmuls on every
      core); `{}`: XLA's defaults.
    - `mesh`: `fit` and `make_step`: a device mesh from
      [`ee.make_mesh`][eqx_ensemble.make_mesh]; members split over its
      `"members"` axis, each batch over `"data"` (the sharding guide).
    - `member_chunk`: `fit`, `make_step`, `map` and `predict`: compute `k`
      members at a time inside the compiled step, so the step holds only `k`
      members' activations. It must divide the number of members (on a `mesh`,
      each device's). Vectorised layout only; not yet with a trained shared
      part or an `ee.Coupled` loss. `None`: all members at once, except that
      on one CPU device `make_step` chunks a step whose temporaries would pass
      glibc's 32 MiB ceiling (the fit guide; `k` = the member count opts out).
    - `guard`: `fit` only: where the divergence guard checks that every member
      is finite. `"auto"` (the default): once at the end of each dispatch of
      array data (a failed dispatch is rerun in parts to freeze the member at
      its step), every step in the cases the guide "`fit` in detail" lists.
      `"step"`: every step, as `make_step` does: for a loss that checks its
      inputs at run time (`eqx.error_if`), an optimizer that makes non-finite
      gradients finite (`optax.clip`), or a train state too big for device
      memory twice. Both freeze a member at the same step.

    The results are the same whatever these say, to floating-point rounding;
    on a CPU, a run resumed from a checkpoint with the same `Execution` is bit
    for bit the uninterrupted run.

    **Example:**

    ```python
    fast = ee.Execution(steps_per_dispatch=500, layout="vmap")
    x = jnp.linspace(-1, 1, 32)[:, None]
    ens = ee.ensemble(lambda k: eqx.nn.MLP(1, 1, 8, 1, key=k), size=2,
                      key=jax.random.key(0))
    loss = lambda m, b, k: jnp.mean((jax.vmap(m)(b) - b) ** 2)
    result = ee.fit(ens, loss, optax.adam(1e-2), x, steps=10, batch_size=8,
                    key=jax.random.key(1), callbacks=(), execution=fast)
    ```
    """

    steps_per_dispatch: int | None
    layout: LayoutChoice
    unroll: bool | None
    compiler_options: tuple[tuple[str, Any], ...] | None
    mesh: Mesh | None
    member_chunk: int | None
    guard: str

    def __init__(
        self,
        *,
        steps_per_dispatch: int | None = None,
        layout: str | None = None,
        unroll: bool | None = None,
        compiler_options: dict[str, Any] | None = None,
        mesh: Mesh | None = None,
        member_chunk: int | None = None,
        guard: str | None = None,
    ):
        if steps_per_dispatch is not None:
            steps_per_dispatch = check_positive_int(
                steps_per_dispatch, "Execution.steps_per_dispatch", high=MAX_INT32
            )
        layout = check_choice(layout, "Execution.layout", _LAYOUTS, "auto")
        if unroll is not None and not isinstance(unroll, bool):
            raise TypeError(
                "`Execution.unroll` must be a bool or None, got "
                f"{type(unroll).__name__}"
            )
        if mesh is not None:
            mesh = check_mesh(mesh)
            if layout == "sequential":
                raise ValueError(
                    "`Execution(layout='sequential')` runs the members one after "
                    "another on one device; on a mesh the members are split over "
                    "devices and run vectorised: leave `layout` out (or pass 'vmap')"
                )
        if member_chunk is not None:
            member_chunk = check_positive_int(member_chunk, "Execution.member_chunk")
            if layout == "sequential":
                raise ValueError(
                    "`Execution(layout='sequential')` already computes one member at "
                    "a time; `member_chunk` chunks the vectorised layout: pass one "
                    "or the other"
                )
        self.guard = check_choice(guard, "Execution.guard", _GUARDS, "auto")
        self.member_chunk = member_chunk
        self.steps_per_dispatch = steps_per_dispatch
        self.layout = cast(LayoutChoice, layout)
        self.unroll = unroll
        self.compiler_options = check_compiler_options(
            compiler_options, "Execution.compiler_options"
        )
        self.mesh = mesh

    def check_for(self, function: str, fields: tuple[str, ...]) -> "Execution":
        """`self`, after refusing any field set that `function` does not use."""
        for name in FIELDS:
            if name in fields:
                continue
            value = getattr(self, name)
            if value is not None and value != "auto":  # layout's, guard's
                raise ValueError(
                    f"`{function}` does not use `Execution.{name}` (it uses "
                    f"{', '.join(f'`{f}`' for f in fields) or 'no field'}); "
                    f"leave `{name}` out of the `ee.Execution` you pass it"
                )
        return self


DEFAULT = Execution()


def as_execution(execution: Any, function: str, fields: tuple[str, ...]) -> Execution:
    """`execution` checked for `function` (`None`: the defaults)."""
    if execution is None:
        return DEFAULT
    if not isinstance(execution, Execution):
        raise TypeError(
            f"`execution` must be an `ee.Execution(...)`, got "
            f"{type(execution).__name__}"
        )
    return execution.check_for(function, fields)


# The keywords `execution=` replaced (version 0.2), with what to write instead.
MOVED_TO_EXECUTION = {
    "steps_per_dispatch": "execution=ee.Execution(steps_per_dispatch=...)",
    "compiler_options": "execution=ee.Execution(compiler_options=...)",
    "unroll": "execution=ee.Execution(unroll=...)",
    "layout": "execution=ee.Execution(layout=...)",
    "mesh": "execution=ee.Execution(mesh=...)",
}


def refuses_moved(
    function: str, moved: dict[str, str] = MOVED_TO_EXECUTION
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A decorator: a keyword of `moved` raises `refuse_moved`'s `TypeError`."""

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if kwargs.keys() & moved.keys():
                refuse_moved(function, kwargs, moved)
            return fn(*args, **kwargs)

        return wrapper

    return decorate


def refuse_moved(function: str, kwargs: dict[str, Any], moved: dict[str, str]) -> None:
    """A `TypeError` naming the replacement of a keyword that moved."""
    for name in kwargs:
        if name in moved:
            raise TypeError(
                f"`{function}` no longer takes `{name}=` (version 0.2): pass "
                f"`{moved[name]}` instead (see the changelog in the docs)"
            )
