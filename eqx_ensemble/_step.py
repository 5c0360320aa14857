"""`make_step`: one compiled optimisation step for every member at once."""

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh
from jaxtyping import Array, Bool, Float, PRNGKeyArray, PyTree

from ._data import check_leading
from ._ensemble import Ensemble, check_key
from ._map import _check_per_member_args
from ._optim import check_opt_state, trainable
from ._sharding import (
    call_within_mesh,
    check_step_mesh,
    replicate,
    sharded_update,
)
from ._xla import Options, check_compiler_options, filter_jit, step_compiler_options


class StepOutput(NamedTuple):
    """What a [`make_step`][eqx_ensemble.make_step] step returns.

    Fields: `ensemble`, `opt_state`, `losses` (one per member), `aux` (stacked
    `aux` of `loss_fn`, or `None`) and `state` (the new model state, or `None`).

    **Example:**

    ```python
    ens = ee.ensemble(lambda k: eqx.nn.Linear(1, 1, key=k), size=2,
                      key=jax.random.key(0))
    opt = optax.sgd(0.1)
    step = ee.make_step(lambda m, b, k: jnp.mean(jax.vmap(m)(b) ** 2), opt)
    out = step(ens, ee.init_optimizer(opt, ens), jnp.ones((4, 1)), jax.random.key(1))
    ens, opt_state, losses, aux, state = out      # or out.ensemble, out.losses...
    ```
    """

    ensemble: Ensemble
    opt_state: PyTree[Any]
    losses: Float[Array, " members"]
    aux: PyTree[Any]
    state: PyTree[Any]


def _split_loss_output(out: Any, stateful: bool) -> tuple[Array, Any, Any]:
    if stateful:
        if not isinstance(out, tuple) or len(out) not in (2, 3):
            raise TypeError(
                "With a model state, `loss_fn(model, state, batch, key)` must return "
                "`(loss, new_state)` or `(loss, new_state, aux)`; got "
                f"{type(out).__name__}"
            )
        loss, new_state = out[0], out[1]
        aux = out[2] if len(out) == 3 else None
    else:
        if isinstance(out, tuple):
            if len(out) != 2:
                raise TypeError(
                    "`loss_fn(model, batch, key)` must return a scalar loss or "
                    f"`(loss, aux)`; got a tuple of length {len(out)}"
                )
            loss, aux = out
        else:
            loss, aux = out, None
        new_state = None
    loss = jnp.asarray(loss)
    if loss.shape != ():
        raise ValueError(
            "`loss_fn` must return a scalar loss for ONE model (the library vmaps "
            f"over members), but it returned a loss of shape {tuple(loss.shape)}; "
            "reduce it, e.g. with `.mean()`"
        )
    if not jnp.issubdtype(loss.dtype, jnp.floating):
        raise TypeError(f"`loss_fn` must return a floating loss, got {loss.dtype}")
    return loss, aux, new_state


def _all_finite(tree: PyTree[Any]) -> Bool[Array, ""]:
    leaves = [
        jnp.all(jnp.isfinite(leaf))
        for leaf in jax.tree.leaves(tree)
        if eqx.is_inexact_array(leaf)
    ]
    if not leaves:
        return jnp.array(True)
    return jnp.all(jnp.stack(leaves))


def _select(keep_new: Bool[Array, ""], new: Any, old: Any) -> Any:
    def pick(n, o):
        if not eqx.is_array(n) or jnp.issubdtype(n.dtype, jax.dtypes.prng_key):
            return n
        return jnp.where(keep_new, n, o)

    return jax.tree.map(pick, new, old)


def member_update(
    loss_fn: Callable[..., Any],
    optimizer: optax.GradientTransformation,
    member: Any,
    opt_state: Any,
    batch: Any,
    key: Any,
    state: Any,
    frozen: Any,
) -> tuple[Any, Any, Any, Any, Any, Any]:
    """One step for ONE member (vmapped over members by the callers).

    A member whose loss or gradients are not finite, or that is `frozen`, keeps its
    parameters, optimizer state and model state; `diverged` reports the former.
    """
    stateful = state is not None

    def loss_of(model):
        if stateful:
            out = loss_fn(model, state, batch, key)
        else:
            out = loss_fn(model, batch, key)
        loss, aux, new_state = _split_loss_output(out, stateful)
        return loss, (aux, new_state)

    (loss, (aux, new_state)), grads = eqx.filter_value_and_grad(loss_of, has_aux=True)(
        member
    )
    # Optax relies on standard dtype promotion (e.g. `decay**count` with an int32
    # count in Adam's bias correction); trace it that way even when the user runs
    # with `jax_numpy_dtype_promotion="strict"`.
    with jax.numpy_dtype_promotion("standard"):
        updates, new_opt_state = optimizer.update(grads, opt_state, trainable(member))
    new_member = eqx.apply_updates(member, updates)
    finite = jnp.isfinite(loss) & _all_finite(grads)
    keep_new = finite & jnp.logical_not(frozen)
    new_member = _select(keep_new, new_member, member)
    new_opt_state = _select(keep_new, new_opt_state, opt_state)
    if stateful:
        new_state = _select(keep_new, new_state, state)
    diverged = jnp.logical_not(finite) & jnp.logical_not(frozen)
    return new_member, new_opt_state, loss, aux, new_state, diverged


def vmapped_update(
    loss_fn: Callable[..., Any],
    optimizer: optax.GradientTransformation,
    per_member_batch: bool,
    mesh: Mesh | None = None,
) -> Callable[..., Any]:
    """`member_update` under `eqx.filter_vmap` over the member axis (on `mesh`:
    members split over its `"members"` axis, the batch over `"data"`)."""

    def update(member, opt_state, batch, key, state, frozen):
        return member_update(
            loss_fn, optimizer, member, opt_state, batch, key, state, frozen
        )

    batch_axes = eqx.if_array(0) if per_member_batch else None
    vmapped = eqx.filter_vmap(
        update,
        in_axes=(
            eqx.if_array(0),
            eqx.if_array(0),
            batch_axes,
            eqx.if_array(0),
            eqx.if_array(0),
            eqx.if_array(0),
        ),
    )
    return sharded_update(vmapped, mesh, per_member_batch)


def _examples(batch: PyTree[Any], per_member_batch: bool) -> int:
    # Examples per member in a batch (its first array leaf's example axis), for the
    # compiler options' cost estimate; 1 when the batch has no such leaf.
    axis = 1 if per_member_batch else 0
    for leaf in jax.tree.leaves(batch):
        shape = getattr(leaf, "shape", ())
        if len(shape) > axis:
            return int(shape[axis])
    return 1


def make_step(
    loss_fn: Callable[..., Any],
    optimizer: optax.GradientTransformation,
    *,
    per_member_batch: bool = False,
    mesh: Mesh | None = None,
    compiler_options: dict[str, Any] | None = None,
) -> Callable[..., StepOutput]:
    """A compiled training step that updates every member at once.

    The step applies `eqx.filter_value_and_grad(loss_fn)` and the optax update to
    each member under `eqx.filter_vmap`: one trace, one compile, one dispatch for the
    whole ensemble. Every optax transformation keeps its per-member meaning
    (`optax.clip_by_global_norm` clips each member by its own norm).

    **Arguments:**

    - `loss_fn`: the loss of ONE model: `loss_fn(model, batch, key) -> loss` or
      `-> (loss, aux)`. For models with `eqx.nn.State` (e.g. BatchNorm):
      `loss_fn(model, state, batch, key) -> (loss, new_state)` or
      `(loss, new_state, aux)`. The loss must be a scalar.
    - `optimizer`: an `optax.GradientTransformation`; its state comes from
      [`init_optimizer`][eqx_ensemble.init_optimizer].
    - `per_member_batch`: `False`: every member gets the same `batch`; `True`: every
      array leaf of `batch` has a leading member axis and member `i` gets slice `i`.
    - `mesh`: a mesh from [`ee.make_mesh`][eqx_ensemble.make_mesh]: inside the step
      the members (of the ensemble and both states) are split over its `"members"`
      axis and the batch's example axis over `"data"`; the returned ensemble and
      states keep that placement (`losses` are replicated). Place the inputs with
      [`ee.shard`][eqx_ensemble.shard] to avoid a transfer per call.
    - `compiler_options`: XLA options for the compiled step, as in
      [`fit`][eqx_ensemble.fit] (`None`: the library's choice, which on a
      multi-core CPU runs big steps' batched matmuls on every core).

    **Returns:**

    `step(ens, opt_state, batch, key, state=None) -> StepOutput`, a
    `(ensemble, opt_state, losses, aux, state)` named tuple with per-member
    `losses` of shape `(len(ens),)`. Member `i` is called with key
    `jax.random.split(key, len(ens))[i]`. A member whose loss or gradient is not
    finite keeps its previous parameters and optimizer state (its loss is
    reported as non-finite), so it cannot corrupt anything.

    **Example:**

    ```python
    ens = ee.ensemble(lambda k: eqx.nn.MLP(1, 1, 16, 1, key=k), size=3,
                      key=jax.random.key(0))
    opt = optax.adam(1e-2)
    opt_state = ee.init_optimizer(opt, ens)

    def loss_fn(model, batch, key):
        x, y = batch
        return jnp.mean((jax.vmap(model)(x) - y) ** 2)

    step = ee.make_step(loss_fn, opt)
    x = jnp.linspace(-1, 1, 32)[:, None]
    ens, opt_state, losses, aux, _ = step(ens, opt_state, (x, x**2),
                                          jax.random.key(1))
    losses.shape     # (3,)
    ```
    """
    user_options = check_compiler_options(compiler_options)

    def step_impl(
        ens: Ensemble,
        opt_state: PyTree[Any],
        batch: PyTree[Any],
        key: PRNGKeyArray,
        state: PyTree[Any] = None,
    ) -> StepOutput:
        if not isinstance(ens, Ensemble):
            raise TypeError(f"expected an `ee.Ensemble`, got {type(ens).__name__}")
        check_key(key)
        size = len(ens)
        check_opt_state(optimizer, ens.members, opt_state)
        if state is not None:
            check_leading(state, size, "`state`")
        if per_member_batch:
            _check_per_member_args((batch,), (0,), size)
        if mesh is not None:
            check_step_mesh(mesh, size, batch, per_member_batch)
        member_keys = jax.random.split(key, size)
        frozen = jnp.zeros((size,), dtype=bool)
        members, new_opt_state, losses, aux, new_state, _ = vmapped_update(
            loss_fn, optimizer, per_member_batch, mesh
        )(ens.members, opt_state, batch, member_keys, state, frozen)
        losses = replicate(losses, mesh)
        return StepOutput(Ensemble(members), new_opt_state, losses, aux, new_state)

    @functools.cache
    def compiled(options: Options) -> Callable[..., StepOutput]:
        return filter_jit(step_impl, options)

    def for_inputs(ens: Any, batch: Any) -> Callable[..., Any]:
        # The compiled step for these inputs (the options depend on their sizes).
        options = user_options
        if options is None:
            options = ()
            if isinstance(ens, Ensemble):
                options = step_compiler_options(
                    None,
                    ens.members,
                    _examples(batch, per_member_batch),
                    len(ens),
                    mesh,
                )
        return compiled(options)

    def step(
        ens: Ensemble,
        opt_state: PyTree[Any],
        batch: PyTree[Any],
        key: PRNGKeyArray,
        state: PyTree[Any] = None,
    ) -> StepOutput:
        return for_inputs(ens, batch)(ens, opt_state, batch, key, state)

    def lower(
        ens: Ensemble,
        opt_state: PyTree[Any],
        batch: PyTree[Any],
        key: PRNGKeyArray,
        state: PyTree[Any] = None,
    ) -> Any:
        """Ahead-of-time lowering, as `eqx.filter_jit(...).lower`."""
        jitted: Any = for_inputs(ens, batch)
        return jitted.lower(ens, opt_state, batch, key, state)

    step.lower = lower  # pyright: ignore[reportFunctionMemberAccess]

    return step if mesh is None else call_within_mesh(step, mesh)
