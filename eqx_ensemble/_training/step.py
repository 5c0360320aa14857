"""`make_step`: one compiled optimisation step for every member at once."""

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh
from jaxtyping import Array, Bool, Float, PRNGKeyArray, PyTree

from .._core.ensemble import Ensemble, check_shared_shapes, with_members
from .._core.groups import join_members
from .._core.heterogeneous import (
    Heterogeneous,
    check_group_losses,
    group_parts,
    groups_of,
    is_ensemble,
    joined,
    per_group_values,
    regroup,
)
from .._core.mapping import check_per_member_args
from .._execution.compile import (
    CompiledFunctions,
    Options,
    filter_jit,
)
from .._execution.execution import (
    Execution,
    as_execution,
    refuses_moved,
)
from .._execution.guard import FiniteCheck
from .._execution.intern import canonical_tree
from .._execution.layout import Layout, member_map
from .._execution.lift import lifts
from .._execution.plan import Plan, plan_step
from .._execution.profile import StepProfile, first_member, profile_jaxpr, signature
from .._internal.keys import optimizer_key
from .._internal.tree import is_traced, keystr
from .coupled import Coupled, coupled_losses
from .inputs import (
    check_chunkable,
    check_inputs,
    check_losses,
    independent_members,
)
from .loss import (
    LossFn,
    call_loss,
    check_optimizer,
    profile_step,
)
from .optim import SharedOptState, optimizer_update, trainable
from .placement import SINGLE_DEVICE, Placement, placement_of


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

    ensemble: Ensemble | Heterogeneous
    opt_state: PyTree[Any]
    losses: Float[Array, " members"]
    aux: PyTree[Any]
    state: PyTree[Any]


def all_finite(
    *trees: PyTree[Any], check: FiniteCheck, state: PyTree[Any] = None
) -> Bool[Array, ""]:
    """Whether every floating-point element of `trees` is finite; of `state` (one
    member's optimizer state), scalars need only not be NaN."""
    pairs = [(leaf, False) for leaf in jax.tree.leaves(trees)]
    pairs += [(leaf, jnp.ndim(leaf) == 0) for leaf in jax.tree.leaves(state)]
    pairs = [(leaf, scalar) for leaf, scalar in pairs if eqx.is_inexact_array(leaf)]
    if not pairs:
        return jnp.array(True)
    if check == "per_leaf":
        ok = [
            ~jnp.isnan(x) if scalar else jnp.all(jnp.isfinite(x)) for x, scalar in pairs
        ]
        return jnp.all(jnp.stack(ok))
    # By shape: `x * 0` is NaN exactly where x is not finite (0 for an inf scalar).
    groups: dict[Any, Any] = {}
    for leaf, scalar in pairs:
        key = (leaf.shape, leaf.dtype)
        zero = leaf * jnp.zeros((), leaf.dtype)
        if scalar:
            zero = jnp.where(jnp.isinf(leaf), jnp.zeros((), leaf.dtype), zero)
        groups[key] = zero if key not in groups else groups[key] + zero
    return jnp.all(jnp.stack([jnp.isfinite(jnp.sum(g)) for g in groups.values()]))


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
    hyper: Any = None,
    shared: Any = None,
    *,
    check: FiniteCheck = "per_leaf",
) -> tuple[Any, Any, Any, Any, Any, Any]:
    """One step for ONE member: a non-finite or `frozen` member keeps its states."""
    stateful = state is not None
    # `loss_fn` may consume its state (`state.set`): keep a copy to fall back on.
    kept_state = jax.tree.map(lambda x: x, state) if stateful else None

    def loss_of(part):
        model = part if shared is None else eqx.combine(part, shared)
        loss, aux, new_state = call_loss(loss_fn, model, state, batch, key, hyper)
        return loss, (aux, new_state)

    (loss, (aux, new_state)), grads = eqx.filter_value_and_grad(loss_of, has_aux=True)(
        member
    )
    new_member, new_opt_state, new_state, diverged = apply_member(
        optimizer,
        member,
        opt_state,
        grads,
        loss,
        new_state,
        kept_state,
        frozen,
        key,
        check=check,
    )
    loss = jnp.where(frozen, jnp.nan, loss)
    return new_member, new_opt_state, loss, aux, new_state, diverged


def apply_member(
    optimizer: optax.GradientTransformation,
    member: Any,
    opt_state: Any,
    grads: Any,
    loss: Any,
    new_state: Any,
    kept_state: Any,
    frozen: Any,
    key: Any,
    value: Any = None,
    *,
    check: FiniteCheck = "per_leaf",
) -> tuple[Any, Any, Any, Any]:
    """ONE member's optimizer update, kept only if finite and not `frozen`."""
    updates, new_opt_state = optimizer_update(
        optimizer,
        grads,
        opt_state,
        trainable(member),
        optimizer_key(key),
        loss if value is None else value,
    )
    new_member = eqx.apply_updates(member, updates)
    if check == "deferred":  # checked once per dispatch (`loop.run_chunk`)
        return new_member, new_opt_state, new_state, jnp.zeros((), bool)
    # The update too: a huge per-member learning rate makes non-finite weights.
    finite = jnp.isfinite(loss) & all_finite(
        grads, trainable(new_member), check=check, state=new_opt_state
    )
    keep_new = finite & jnp.logical_not(frozen)
    new_member = _select(keep_new, new_member, member)
    new_opt_state = _select(keep_new, new_opt_state, opt_state)
    if kept_state is not None:
        new_state = _select(keep_new, new_state, kept_state)
    diverged = jnp.logical_not(finite) & jnp.logical_not(frozen)
    return new_member, new_opt_state, new_state, diverged


def _gate(shared: Any, drop: Bool[Array, ""]) -> Any:
    """`shared`, whose gradient is exactly zero where `drop` (a select: no NaN)."""

    def gate(leaf: Any) -> Any:
        if not eqx.is_inexact_array(leaf):
            return leaf
        return jnp.where(drop, jax.lax.stop_gradient(leaf), leaf)

    return jax.tree.map(gate, shared)


def _stand_ins(members: Any, frozen: Bool[Array, " members"]) -> Any:
    """`members` with frozen members zeroed: no `0 * inf` in the shared gradient."""

    def replace(leaf):
        if not eqx.is_inexact_array(leaf):
            return leaf
        mask = jnp.reshape(frozen, (-1,) + (1,) * (leaf.ndim - 1))
        return jnp.where(mask, jnp.zeros((), leaf.dtype), leaf)

    return jax.tree.map(replace, members)


def _coupled_update(
    loss_fn: Callable[..., Any],
    optimizer: optax.GradientTransformation,
    batch_axes: Any,
    ens: Ensemble,
    opt_state: Any,
    batch: Any,
    keys: Any,
    state: Any,
    frozen: Any,
    hyper: Any,
    check: FiniteCheck,
) -> tuple[Any, Any, Any, Any, Any, Any]:
    """One step with a trained shared part (the members' summed loss). Where the
    shared gradient is not finite it is recomputed without the dropped members."""
    member_axis = eqx.if_array(0)
    stateful = state is not None
    kept_state = jax.tree.map(lambda x: x, state) if stateful else None
    redo_state = jax.tree.map(lambda x: x, state) if stateful else None

    def total_loss(parts, dropped, gated, state):
        members, shared = parts
        members = _stand_ins(members, dropped)

        def one(member, member_batch, key, member_state, member_hyper, drop):
            own = _gate(shared, drop) if gated else shared
            model = eqx.combine(member, own)
            return call_loss(
                loss_fn, model, member_state, member_batch, key, member_hyper
            )

        losses, aux, new_state = eqx.filter_vmap(
            one,
            in_axes=(member_axis, batch_axes) + (member_axis,) * 4,
        )(members, batch, keys, state, hyper, dropped)
        return jnp.sum(jnp.where(dropped, 0.0, losses)), (losses, aux, new_state)

    (_, (losses, aux, new_state)), (grads, shared_grads) = eqx.filter_value_and_grad(
        total_loss, has_aux=True
    )((ens.members, ens.shared), frozen, False, state)
    losses = jnp.where(frozen, jnp.nan, losses)  # a stand-in's, not the member's
    members, members_opt, new_state, diverged = eqx.filter_vmap(
        functools.partial(apply_member, optimizer, check=check),
        in_axes=(member_axis,) * 8,
    )(
        ens.members,
        opt_state.members,
        grads,
        losses,
        new_state,
        kept_state,
        frozen,
        keys,
    )

    def healthy_sum() -> Any:
        dropped = frozen | diverged
        (_, gated), _ = eqx.filter_grad(
            lambda parts: total_loss(parts, dropped, True, redo_state), has_aux=True
        )((ens.members, ens.shared))
        return gated

    redo = jnp.any(diverged) | ~all_finite(shared_grads, check=check)
    shared_grads = jax.lax.cond(redo, healthy_sum, lambda: shared_grads)
    # Its loss: the sum its gradient is of (the members left in it).
    shared_loss = jnp.sum(jnp.where(frozen | diverged, 0.0, losses))
    new_shared, new_shared_opt = _shared_update(
        optimizer, ens.shared, shared_grads, shared_loss, opt_state.shared, check
    )
    return (
        with_members(eqx.tree_at(lambda e: e.shared, ens, new_shared), members),
        SharedOptState(members_opt, new_shared_opt),
        losses,
        aux,
        new_state,
        diverged,
    )


def _shared_update(
    optimizer: optax.GradientTransformation,
    shared: Any,
    grads: Any,
    loss: Any,
    opt_state: Any,
    check: FiniteCheck,
) -> tuple[Any, Any]:
    """The shared part's optimizer step, kept only if everything is finite."""
    updates, new_opt_state = optimizer_update(
        optimizer, grads, opt_state, trainable(shared), value=loss
    )
    new_shared = eqx.apply_updates(shared, updates)
    keep = all_finite(grads, trainable(new_shared), check=check, state=new_opt_state)
    return _select(keep, new_shared, shared), _select(keep, new_opt_state, opt_state)


def _joint_update(
    loss_fn: "Coupled",
    optimizer: optax.GradientTransformation,
    ens: Ensemble,
    opt_state: Any,
    batch: Any,
    keys: Any,
    state: Any,
    frozen: Any,
    hyper: Any,
    check: FiniteCheck,
) -> tuple[Any, Any, Any, Any, Any, Any]:
    """One step of an `ee.Coupled` loss, then each member's guarded update."""
    if state is not None:
        raise ValueError(
            "an `ee.Coupled` loss does not take a model state (`state=`); write the "
            "coupled objective for a model without state"
        )
    member_axis = eqx.if_array(0)
    train_shared = ens.train_shared

    def total_loss(parts):
        members, shared = parts
        current = with_members(
            ens if shared is None else eqx.tree_at(lambda e: e.shared, ens, shared),
            members,
        )
        losses, total = coupled_losses(loss_fn, current, batch, keys, hyper, frozen)
        return total, losses

    shared = ens.shared if train_shared else None
    (total, losses), (grads, shared_grads) = eqx.filter_value_and_grad(
        total_loss, has_aux=True
    )((ens.members, shared))
    members_opt = opt_state.members if train_shared else opt_state
    # Every member's gradient is of the coupled total: its `value` (optax's).
    members, new_members_opt, _, diverged = eqx.filter_vmap(
        functools.partial(apply_member, optimizer, check=check),
        in_axes=(member_axis,) * 8 + (None,),
    )(ens.members, members_opt, grads, losses, None, None, frozen, keys, total)
    new_ens = with_members(ens, members)
    new_opt = new_members_opt
    if train_shared:
        new_shared, new_shared_opt = _shared_update(
            optimizer, ens.shared, shared_grads, total, opt_state.shared, check
        )
        new_ens = with_members(
            eqx.tree_at(lambda e: e.shared, ens, new_shared), members
        )
        new_opt = SharedOptState(new_members_opt, new_shared_opt)
    return new_ens, new_opt, losses, None, None, diverged


def _skip_if_frozen(
    compute: Callable[[Any], Any], frozen: Any, member: Any, opt_state: Any, state: Any
) -> Any:
    """ONE member's `member_update`, skipped for a frozen member (not for a step
    that convolves: slow inside a conditional on a CPU)."""

    def fresh():
        return compute(jax.tree.map(lambda x: x, state))

    jaxpr, out_dynamic, out_static = eqx.filter_make_jaxpr(fresh)()
    if profile_jaxpr(jaxpr.jaxpr).convolutions:
        return fresh()
    shapes = eqx.combine(out_dynamic, out_static)
    static = out_static

    def run(_):
        return eqx.filter(fresh(), eqx.is_array)

    def skip(_):
        _, _, loss, aux, _, _ = shapes
        kept = (
            member,
            opt_state,
            jnp.full(loss.shape, jnp.nan, loss.dtype),
            jax.tree.map(
                lambda x: (
                    jnp.zeros(x.shape, x.dtype)
                    if isinstance(x, jax.ShapeDtypeStruct)
                    else x
                ),
                aux,
            ),
            state,
            jnp.zeros((), bool),
        )
        return eqx.filter(kept, eqx.is_array)

    dynamic = jax.lax.cond(frozen, skip, run, None)
    return eqx.combine(dynamic, static)


def group_loss(loss_fn: LossFn, index: int) -> Callable[..., Any]:
    return loss_fn[index] if isinstance(loss_fn, tuple) else loss_fn


def vmapped_update(
    loss_fn: LossFn,
    optimizer: optax.GradientTransformation,
    per_member_batch: bool,
    placement: Placement = SINGLE_DEVICE,
    layout: Layout = "vmap",
    member_chunk: int | None = None,
    check: FiniteCheck = "per_leaf",
) -> Callable[..., Any]:
    """`(ens, opt_state, batch, keys, state, frozen, hyper) -> (ens, opt_state,
    losses, aux, state, diverged)`."""
    # A shared batch is not mapped: the member axis folds into the weights.
    batch_axes = eqx.if_array(0) if per_member_batch else None

    def update(ens, opt_state, batch, keys, state, frozen, hyper):
        # Every ensemble is a tuple of groups, each updated on its own slice.
        if isinstance(loss_fn, tuple):
            check_group_losses(ens, loss_fn)
        per_member = (keys, frozen, hyper, batch if per_member_batch else None)
        parts = group_parts(ens, opt_state, state, members=per_member)
        outputs = [
            _plain_update(
                group_loss(loss_fn, index),
                optimizer,
                batch_axes,
                layout,
                member_chunk,
                placement.members_devices,
                check,
                group,
                group_opt,
                group_batch if per_member_batch else batch,
                group_keys,
                group_state,
                group_frozen,
                group_hyper,
            )  # fmt: skip
            for index, (
                group,
                group_opt,
                group_state,
                group_keys,
                group_frozen,
                group_hyper,
                group_batch,
            ) in enumerate(parts)  # fmt: skip
        ]
        return joined(ens, outputs, functools.partial(_join_updates, ens, state))

    return placement.sharded_update(update, per_member_batch)


def _plain_update(
    loss_fn: Callable[..., Any],
    optimizer: optax.GradientTransformation,
    batch_axes: Any,
    layout: Layout,
    member_chunk: int | None,
    members_devices: int,
    check: FiniteCheck,
    ens: Ensemble,
    opt_state: Any,
    batch: PyTree[Any],
    keys: Any,
    state: Any,
    frozen: Any,
    hyper: Any,
) -> tuple:
    """One group's step: `_joint_update`, `_coupled_update` or `member_update`s."""
    member_axis = eqx.if_array(0)
    check_shared_shapes(ens)
    if member_chunk is not None:
        check_chunkable(loss_fn, ens)
    inputs = (ens, opt_state, batch, keys, state, frozen, hyper, check)
    if isinstance(loss_fn, Coupled):
        return _joint_update(loss_fn, optimizer, *inputs)
    if ens.train_shared:
        return _coupled_update(loss_fn, optimizer, batch_axes, *inputs)

    single = loss_fn

    def one(member, opt_state, batch, key, state, frozen, hyper):
        def compute(state):
            return member_update(
                single,
                optimizer,
                member,
                opt_state,
                batch,
                key,
                state,
                frozen,
                hyper,
                ens.shared,
                check=check,
            )

        if layout != "sequential":
            return compute(state)
        return _skip_if_frozen(compute, frozen, member, opt_state, state)

    members, *rest = member_map(
        one,
        (
            member_axis,
            member_axis,
            batch_axes,
            member_axis,
            member_axis,
            member_axis,
            member_axis,
        ),
        layout,
        len(ens),
        member_chunk,
        members_devices,
    )(ens.members, opt_state, batch, keys, state, frozen, hyper)
    return (with_members(ens, members), *rest)


def _join_updates(ens: Any, state: Any, outputs: list[tuple]) -> tuple:
    """The groups' updates of an `ee.Heterogeneous` joined (states: one per group)."""
    groups, opt_states, losses, aux, states, diverged = zip(*outputs, strict=True)
    return (
        regroup(ens, groups),
        tuple(opt_states),
        jnp.concatenate(losses),
        join_members(aux, "The loss's `aux`"),
        None if state is None else tuple(states),
        jnp.concatenate(diverged),
    )


def _examples(batch: PyTree[Any], per_member_batch: bool) -> int:
    # Examples per member in a batch (1 without an example axis), for the plan.
    axis = 1 if per_member_batch else 0
    for leaf in jax.tree.leaves(batch):
        shape = getattr(leaf, "shape", ())
        if len(shape) > axis:
            return int(shape[axis])
    return 1


class Step(eqx.Module):
    """A compiled training step for every member at once; made by
    [`make_step`][eqx_ensemble.make_step] (see there for the arguments).

    `step(ens, opt_state, batch, key, state=None, *, hyper=None)` returns a
    [`StepOutput`][eqx_ensemble.StepOutput]; `step.lower(...)` lowers it ahead
    of time. Steps built with equal arguments share their compilations.

    **Example:**

    ```python
    ens = ee.ensemble(lambda k: eqx.nn.Linear(1, 1, key=k), size=2,
                      key=jax.random.key(0))
    opt = optax.sgd(0.1)
    step = ee.make_step(lambda m, b, k: jnp.mean(jax.vmap(m)(b) ** 2), opt)
    args = (ens, ee.init_optimizer(opt, ens), jnp.ones((4, 1)), jax.random.key(1))
    out = step(*args)
    compiled = step.lower(*args).compile()
    ```
    """

    loss_fn: LossFn
    optimizer: optax.GradientTransformation
    per_member_batch: bool = False
    mesh: Mesh | None = None
    compiler_options: Options | None = None
    layout: str = "auto"
    member_chunk: int | None = None
    # On a mesh with a "model" axis: where the call's inputs lived (`_placed`).
    pinned: Any = None

    @property
    def placement(self) -> Placement:
        return placement_of(self.mesh)

    def __call__(
        self,
        ens: Ensemble | Heterogeneous,
        opt_state: PyTree[Any],
        batch: PyTree[Any],
        key: PRNGKeyArray,
        state: PyTree[Any] = None,
        *,
        hyper: PyTree[Any] = None,
    ) -> StepOutput:
        # (Module-level helpers: Equinox wraps each method read.)
        placement, step = _placed(self, (ens, opt_state, state))
        compiled = _compiled_step(step, step._plan(ens, batch, state, hyper))
        with placement.context():
            return compiled(ens, opt_state, batch, key, state, hyper)

    def lower(
        self,
        ens: Ensemble | Heterogeneous,
        opt_state: PyTree[Any],
        batch: PyTree[Any],
        key: PRNGKeyArray,
        state: PyTree[Any] = None,
        *,
        hyper: PyTree[Any] = None,
    ) -> Any:
        """Ahead-of-time lowering, as `eqx.filter_jit(...).lower`."""
        placement, step = _placed(self, (ens, opt_state, state))
        with placement.context():
            compiled: Any = _compiled_step(step, step._plan(ens, batch, state, hyper))
            if isinstance(compiled, functools.partial):  # a step holding arrays
                generic: Any = compiled.func
                lowered = generic.lower(step, ens, opt_state, batch, key, state, hyper)
                return _LoweredStep(lowered, step)
            lowered = compiled.lower(ens, opt_state, batch, key, state, hyper)
            return _LoweredStep(lowered, None)

    def _plan(self, ens: Any, batch: Any, state: Any = None, hyper: Any = None) -> Plan:
        if not is_ensemble(ens):  # refused when traced
            layout = "sequential" if self.layout == "sequential" else "vmap"
            return Plan(
                layout, self.compiler_options or (), member_chunk=self.member_chunk
            )
        try:
            structure: Any = (
                signature((ens.members, state, hyper)),
                signature(batch),
                self.per_member_batch,
            )
        except TypeError:  # an unhashable leaf: planned every time
            structure = None

        def profile() -> StepProfile:
            check_losses(self.loss_fn, ens, state is not None, hyper is not None)
            return _profile_of(self, (ens, batch, state, hyper))

        return plan_step(
            self,
            profile,
            owner=self.loss_fn,
            structure=structure,
            members=ens.members,
            examples=_examples(batch, self.per_member_batch),
            size=len(ens),
            placement=self.placement,
            # No automatic member chunks inside a user's trace.
            groupable=independent_members(self.loss_fn, ens)
            and not any(is_traced(x) for x in jax.tree.leaves(ens.members)),
        )


def _placed(step: Step, inputs: Any) -> tuple[Placement, Step]:
    """Its placement, and `step` with `pinned`: where the inputs live on "model"."""
    placement = placement_of(step.mesh)
    pinned = placement.tree_placement(inputs)
    if pinned is None or pinned == step.pinned:
        return placement, step
    return placement, dataclasses.replace(step, pinned=pinned)


class _LoweredStep:
    """`Step.lower(...)`: `.as_text()`, and `.compile()` with the step's signature."""

    def __init__(self, lowered: Any, step: "Step | None"):
        self._lowered, self._step = lowered, step

    def as_text(self) -> str:
        return self._lowered.as_text()

    def compile(self) -> Callable[..., StepOutput]:
        compiled = self._lowered.compile()
        step = self._step

        def call(
            ens: Ensemble | Heterogeneous,
            opt_state: PyTree[Any],
            batch: PyTree[Any],
            key: PRNGKeyArray,
            state: PyTree[Any] = None,
            *,
            hyper: PyTree[Any] = None,
        ) -> StepOutput:
            args = (ens, opt_state, batch, key, state, hyper)
            return compiled(*args) if step is None else compiled(step, *args)

        call.compiled = compiled.compiled  # type: ignore[attr-defined]
        return call


def _profile_of(step: "Step", inputs: Any) -> Any:
    ens, batch, state, hyper = inputs
    member_batch = first_member(batch) if step.per_member_batch else batch
    return ensemble_profile(step.loss_fn, ens, member_batch, state, hyper)


def ensemble_profile(
    loss_fn: LossFn,
    ens: "Ensemble | Heterogeneous",
    member_batch: PyTree[Any],
    state: PyTree[Any],
    hyper: PyTree[Any],
) -> StepProfile:
    """The step's profile from one member per group (FLOPs: the size-weighted mean)."""
    groups = groups_of(ens)
    profiles = [
        profile_step(
            group_loss(loss_fn, index),
            group.member(first_member(group.members)),
            member_batch,
            first_member(group_state),
            first_member(hyper),
        )
        for index, (group, group_state) in enumerate(
            zip(groups, per_group_values(ens, state, "`state`"), strict=True)
        )
    ]
    if len(profiles) == 1:
        return profiles[0]
    sizes = [len(group) for group in groups]

    def per_member(flops: Callable[[StepProfile], float]) -> float:
        total = sum(size * flops(p) for size, p in zip(sizes, profiles, strict=True))
        return total / sum(sizes)

    return StepProfile(
        convolutions=any(p.convolutions for p in profiles),
        batched_dots=any(p.batched_dots for p in profiles),
        convolution_flops=per_member(lambda p: p.convolution_flops),
        dot_flops=per_member(lambda p: p.dot_flops),
        intermediate_bytes=per_member(lambda p: p.intermediate_bytes),
    )


def _step_impl(
    step: Step,
    plan: Plan,
    ens: Ensemble | Heterogeneous,
    opt_state: PyTree[Any],
    batch: PyTree[Any],
    key: PRNGKeyArray,
    state: PyTree[Any] = None,
    hyper: PyTree[Any] = None,
) -> StepOutput:
    size = check_inputs(
        ens, step.loss_fn, step.optimizer, key, state=state, hyper=hyper,
        opt_state=opt_state, runner=step, where="make_step",
    )  # fmt: skip
    if step.per_member_batch:
        check_per_member_args((batch,), (0,), size)
    _check_not_empty(batch, step.per_member_batch)
    placement = step.placement
    placement.check_step(size, batch, step.per_member_batch)
    member_keys = jax.random.split(key, size)
    frozen = jnp.zeros((size,), dtype=bool)
    update = vmapped_update(
        step.loss_fn,
        step.optimizer,
        step.per_member_batch,
        placement,
        plan.layout,
        plan.member_chunk,
        plan.check,
    )
    new_ens, new_opt_state, losses, aux, new_state, _ = update(
        ens, opt_state, batch, member_keys, state, frozen, hyper
    )
    losses = placement.replicate(losses)
    new_ens, new_opt_state, new_state = placement.pin(
        (new_ens, new_opt_state, new_state), step.pinned
    )
    return StepOutput(new_ens, new_opt_state, losses, aux, new_state)


def _check_not_empty(batch: PyTree[Any], per_member_batch: bool) -> None:
    # At trace time: a step on no example has a NaN mean loss.
    axis = 1 if per_member_batch else 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(batch)[0]:
        shape = getattr(leaf, "shape", ())
        if len(shape) > axis and shape[axis] == 0:
            raise ValueError(
                f"The batch holds no examples: leaf `{keystr(path)}` has shape "
                f"{tuple(shape)}; a step needs at least one example per member"
            )


def _compiled_step(step: Step, plan: Plan) -> Callable[..., StepOutput]:
    """The compiled step, one per step and plan (else a traced argument)."""
    try:
        hash(step)
    except TypeError:
        return functools.partial(_compiled_generic(plan), step)
    if lifts(step.optimizer):
        return functools.partial(_compiled_generic(plan), step)
    return _compiled_for(step, plan)


def _make_compiled_for(step: Step, plan: Plan) -> Callable[..., StepOutput]:
    # A closure, not a partial: no hashing of the step's fields per call.
    def compiled(*args: Any) -> StepOutput:
        return _step_impl(step, plan, *args)

    return filter_jit(compiled, plan.compiler_options)


_compiled_for = CompiledFunctions(_make_compiled_for)


def _make_compiled_generic(plan: Plan) -> Callable[..., StepOutput]:
    def generic(step: Step, *args: Any) -> StepOutput:
        return _step_impl(step, plan, *args)

    return filter_jit(generic, plan.compiler_options)


_compiled_generic = CompiledFunctions(_make_compiled_generic)


@refuses_moved("make_step")
def make_step(
    loss_fn: LossFn,
    optimizer: optax.GradientTransformation,
    *,
    per_member_batch: bool = False,
    execution: Execution | None = None,
) -> Step:
    """A compiled training step that updates every member at once.

    `eqx.filter_value_and_grad(loss_fn)` and the optax update for each member
    under `eqx.filter_vmap`: one compile, one dispatch for the whole ensemble.
    Every optax transformation keeps its per-member meaning.

    **Arguments:**

    - `loss_fn`: the loss of ONE model: `loss_fn(model, batch, key) -> loss` or
      `-> (loss, aux)`. For models with `eqx.nn.State` (e.g. BatchNorm):
      `loss_fn(model, state, batch, key) -> (loss, new_state)` or
      `(loss, new_state, aux)`. The loss must be a scalar. For an
      [`ee.Heterogeneous`][eqx_ensemble.Heterogeneous], a tuple with one loss
      per group may be given.
    - `optimizer`: an `optax.GradientTransformation`; its state comes from
      [`init_optimizer`][eqx_ensemble.init_optimizer].
    - `per_member_batch`: `False`: every member gets the same `batch`; `True`: every
      array leaf of `batch` has a leading member axis and member `i` gets slice `i`.
    - `execution`: an [`ee.Execution`][eqx_ensemble.Execution]; `make_step`
      uses its `mesh` (members and states over `"members"`, examples over
      `"data"`; place the inputs with [`ee.shard`][eqx_ensemble.shard] to avoid
      a transfer per call), `compiler_options`, `layout` and `member_chunk`.
      The results are the same whatever it says, to floating-point rounding.

    **Returns:**

    A [`Step`][eqx_ensemble.Step] module: `step(ens, opt_state, batch, key,
    state=None) -> StepOutput`, a `(ensemble, opt_state, losses, aux, state)`
    named tuple with per-member `losses` of shape `(len(ens),)`. Member `i` is
    called with key `jax.random.split(key, len(ens))[i]` (an optimizer taking
    extra arguments gets keys and values as in [`fit`][eqx_ensemble.fit]). A
    member whose loss, gradient or update is not finite keeps its previous
    parameters and optimizer state (its loss is reported as non-finite).

    Per-member hyperparameters: `step(..., hyper=h)` with `h` a PyTree of
    arrays with a leading member axis calls `loss_fn(..., hyper=h_i)`; traced,
    so new values do not recompile.

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
    check_optimizer(optimizer)
    execution = as_execution(execution, "make_step", STEP_FIELDS)
    if not isinstance(per_member_batch, bool):
        raise TypeError(
            f"`per_member_batch` must be a bool, got {type(per_member_batch).__name__}"
        )
    return Step(
        canonical_tree(loss_fn),  # equal losses and optimizers: one program
        canonical_tree(optimizer),
        per_member_batch=per_member_batch,
        mesh=execution.mesh,
        compiler_options=execution.compiler_options,
        layout=execution.layout,
        member_chunk=execution.member_chunk,
    )


STEP_FIELDS = ("layout", "compiler_options", "mesh", "member_chunk")
