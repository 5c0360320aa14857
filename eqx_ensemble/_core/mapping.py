"""The engine under `ee.map`, `ee.predict` and `ens(x)` (duck-typed: no cycle)."""

from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
from jaxtyping import PRNGKeyArray, PyTree

from .._execution.layout import (
    SEQUENTIAL_MAX_MEMBERS,
    Layout,
    any_traced,
    check_layout,
    choose_map_layout,
    member_map,
    member_structs,
    on_one_cpu_device,
)
from .._execution.profile import profile_call, signature
from .._internal.keys import split_member_keys
from .._internal.tree import keystr
from .groups import join_groups


def _check_in_axes(in_axes: Any, num_args: int) -> tuple[Any, ...]:
    if in_axes is None:
        return (None,) * num_args
    if isinstance(in_axes, int) and not isinstance(in_axes, bool):
        in_axes = (in_axes,) * num_args
    if not isinstance(in_axes, Sequence) or isinstance(in_axes, str):
        raise TypeError(
            "`in_axes` must be None (all arguments shared), 0 (all per-member), or a "
            f"tuple with one entry per argument; got {in_axes!r}"
        )
    in_axes = tuple(in_axes)
    if len(in_axes) != num_args:
        raise ValueError(
            f"`in_axes` has {len(in_axes)} entries but {num_args} positional "
            f"argument(s) were given after the ensemble; give one entry per argument "
            "(None = shared by all members, 0 = one slice per member)"
        )
    for position, spec in enumerate(in_axes):
        for leaf in jtu.tree_leaves(spec, is_leaf=lambda x: x is None):
            if leaf is not None and (leaf != 0 or isinstance(leaf, bool)):
                raise ValueError(
                    f"`in_axes[{position}]` must be None (shared) or 0 (per member) "
                    f"(or a PyTree prefix of those), got {leaf!r}"
                )
    return in_axes


def _mapped_mask(spec: Any, arg: Any, position: int) -> Any:
    """`arg`'s structure with `True` at each array leaf mapped over members."""
    if spec is None:
        return jtu.tree_map(lambda _: False, arg)
    try:
        # `spec` is a PyTree prefix of `arg`: one bool per leaf of `arg`.
        return jtu.tree_map(
            lambda axis, subtree: jtu.tree_map(
                lambda leaf: axis is not None and eqx.is_array(leaf), subtree
            ),
            spec,
            arg,
            is_leaf=lambda x: x is None,
        )
    except (ValueError, TypeError) as error:
        raise ValueError(
            f"`in_axes[{position}]` = {spec!r} is not a PyTree prefix of argument "
            f"{position} (a {type(arg).__name__}): {error}"
        ) from None


def check_per_member_args(args: tuple, in_axes: tuple, size: int) -> tuple:
    """Check that every per-member array leaf has leading size `size`; return
    each argument's `_mapped_mask`."""
    masks = tuple(
        _mapped_mask(spec, arg, position)
        for position, (spec, arg) in enumerate(zip(in_axes, args, strict=True))
    )
    for position, (arg, mask) in enumerate(zip(args, masks, strict=True)):
        for (path, leaf), mapped in zip(
            jtu.tree_flatten_with_path(arg)[0], jtu.tree_leaves(mask), strict=True
        ):
            if not mapped:
                continue
            if leaf.ndim == 0 or leaf.shape[0] != size:
                where = f"argument {position}" + (
                    f" at leaf `{keystr(path)}`" if path else ""
                )
                raise ValueError(
                    f"{where} is per-member (in_axes 0) so its leading axis must be "
                    f"the ensemble size {size}, but it has shape {tuple(leaf.shape)}"
                )
    return masks


def member_chunk_size(
    chunk_size: int | None, member_chunk: int | None, size: int
) -> int | None:
    """`chunk_size` or `Execution.member_chunk` (the same setting; both must agree)."""
    if member_chunk is None:
        return chunk_size
    if member_chunk > size:
        raise ValueError(
            f"`Execution.member_chunk={member_chunk}` is more than the ensemble's "
            f"{size} members: choose at most {size}"
        )
    if chunk_size is not None and chunk_size != member_chunk:
        raise ValueError(
            f"`chunk_size={chunk_size}` and `Execution(member_chunk={member_chunk})` "
            "disagree: they set the same thing, pass one"
        )
    return member_chunk


def map_members(
    fn: Callable[..., Any],
    ens: Any,
    args: tuple[Any, ...],
    in_axes: Any,
    chunk_size: int | None,
    key: PRNGKeyArray | None,
    layout: str | None,
    profile_owner: Any = None,
    member_keys: Any = None,
) -> PyTree[Any]:
    """`map`, with `profile_owner` (what the layout profile is cached under,
    default `fn`) and `member_keys` (instead of a `key` to split). A
    heterogeneous ensemble is mapped group by group and the outputs joined."""
    size = len(ens)
    axes = _check_in_axes(in_axes, len(args))
    masks = check_per_member_args(args, axes, size)
    if member_keys is None and key is not None:
        member_keys = split_member_keys(key, size)
    if chunk_size is not None:
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int):
            raise TypeError(f"`chunk_size` must be an int, got {chunk_size!r}")
        if not 1 <= chunk_size <= size:
            raise ValueError(
                f"`chunk_size` must be between 1 and the ensemble size {size}, got "
                f"{chunk_size}"
            )
    groups = getattr(ens, "groups", None)
    if groups is not None:
        return _map_groups(
            fn, ens, args, axes, masks, chunk_size, member_keys, layout, profile_owner
        )
    choice = check_layout(layout, False)
    if choice == "sequential" and chunk_size is not None and chunk_size != size:
        raise ValueError(
            "`Execution(layout='sequential')` already computes one member at a time; "
            "`chunk_size` chunks the vectorised layout: pass one or the other"
        )

    def apply(member, member_args, member_key):
        member = ens.member(member)
        try:
            if member_key is None:
                return fn(member, *member_args)
            return fn(member, *member_args, key=member_key)
        except Exception as error:
            notes = getattr(error, "__notes__", ())
            if not any(note.startswith(MEMBER_NOTE) for note in notes):
                error.add_note(_member_context(member_args))
            raise

    arg_axes = tuple(
        None
        if spec is None
        else jtu.tree_map(lambda mapped: 0 if mapped else None, mask)
        for spec, mask in zip(axes, masks)
    )
    member_axes = (eqx.if_array(0), arg_axes, eqx.if_array(0))
    member_layout: Layout
    if choice == "vmap" or choice == "sequential":
        member_layout = choice
    else:
        member_layout = _auto_layout(
            apply,
            member_axes,
            (ens.members, args, member_keys),
            size,
            chunk_size,
            profile_owner or fn,
            ens.shared,
        )
    vmapped = member_map(apply, member_axes, member_layout, size)
    if chunk_size is None or chunk_size == size:
        return vmapped(ens.members, args, member_keys)
    return _chunked(vmapped, ens.members, args, masks, member_keys, size, chunk_size)


def _map_groups(
    fn, het, args, axes, masks, chunk_size, member_keys, layout, profile_owner
):
    outputs = []
    for group, (start, stop) in zip(het.groups, het.bounds, strict=True):
        group_args = tuple(
            jtu.tree_map(
                lambda leaf, mapped, a=start, b=stop: leaf[a:b] if mapped else leaf,
                arg,
                mask,
            )
            for arg, mask in zip(args, masks, strict=True)
        )
        outputs.append(
            map_members(
                fn,
                group,
                group_args,
                axes,
                None if chunk_size is None else min(chunk_size, len(group)),
                None,
                layout,
                profile_owner,
                member_keys=None if member_keys is None else member_keys[start:stop],
            )
        )
    return join_groups(outputs)


def _auto_layout(
    apply: Callable[..., Any],
    in_axes: tuple[Any, ...],
    inputs: tuple[Any, ...],
    size: int,
    chunk_size: int | None,
    owner: Any,
    shared: Any,
) -> Layout:
    """`choose_map_layout`; traces `apply` only where it could pick "sequential"."""
    if (
        chunk_size is not None
        or size > SEQUENTIAL_MAX_MEMBERS
        or not on_one_cpu_device(inputs)
    ):
        return "vmap"
    member = tuple(
        member_structs(axes, arg) for axes, arg in zip(in_axes, inputs, strict=True)
    )
    try:  # a shared part is closed over: its shapes are part of the profile's key
        extra = signature(shared)
    except TypeError:
        owner, extra = None, ()
    profile = profile_call(apply, member, owner=owner, extra=extra)
    return choose_map_layout(
        profile.convolution_flops, traced=any_traced(inputs), size=size
    )


# How a member-error note begins (only the innermost caller's note is added).
MEMBER_NOTE = "(raised inside"


def _member_context(member_args: tuple) -> str:
    """The note added to an error raised inside a member's call."""
    shapes = [
        jax.tree.map(lambda x: tuple(x.shape), eqx.filter(arg, eqx.is_array))
        for arg in member_args
    ]
    return (
        f"{MEMBER_NOTE} the function applied to ONE member: the ensemble maps over "
        f"members, not examples; the arguments had shapes {shapes}. A model takes "
        "ONE example: for a batch, map the model over it, e.g. `jax.vmap(model)(x)` "
        "or `ee.map(lambda m, x: jax.vmap(m)(x), ens, xs)`.)"
    )


def _chunked(vmapped, members, args, masks, member_keys, size, chunk_size):
    # Full chunks are scanned, a remainder runs as one more call.
    per_member = (members, _select_per_member(args, masks), member_keys)
    shared_args = _select_shared(args, masks)
    dynamic, static = eqx.partition(per_member, eqx.is_array)
    num_chunks, remainder = divmod(size, chunk_size)
    main = num_chunks * chunk_size

    def run(dynamic_chunk):
        chunk_members, chunk_args, chunk_keys = eqx.combine(dynamic_chunk, static)
        return vmapped(chunk_members, _merge(chunk_args, shared_args), chunk_keys)

    out_static_box = []

    def body(carry, dynamic_chunk):
        out = run(dynamic_chunk)
        out_dynamic, out_static = eqx.partition(out, eqx.is_array)
        if not out_static_box:
            out_static_box.append(out_static)
        return carry, out_dynamic

    def take_chunk(carry, chunk_index):
        # Sliced inside the loop: the ensemble is never copied into chunks.
        start = chunk_index * chunk_size
        dynamic_chunk = jax.tree.map(
            lambda x: jax.lax.dynamic_slice_in_dim(x, start, chunk_size, axis=0),
            dynamic,
        )
        return body(carry, dynamic_chunk)

    _, stacked = jax.lax.scan(take_chunk, None, jnp.arange(num_chunks, dtype=jnp.int32))
    stacked = jax.tree.map(lambda x: x.reshape(main, *x.shape[2:]), stacked)
    if remainder:
        tail = jax.tree.map(lambda x: x[main:], dynamic)
        tail_out, _ = eqx.partition(run(tail), eqx.is_array)
        stacked = jax.tree.map(
            lambda a, b: jnp.concatenate([a, b], axis=0), stacked, tail_out
        )
    return eqx.combine(stacked, out_static_box[0])


class _Shared:
    """Placeholder for a shared argument inside the per-member half of `args`."""


_SHARED = _Shared()


def _select_per_member(args: tuple, masks: tuple) -> tuple:
    return tuple(
        eqx.filter(arg, mask) if _any_mapped(mask) else _SHARED
        for arg, mask in zip(args, masks)
    )


def _select_shared(args: tuple, masks: tuple) -> tuple:
    return tuple(
        eqx.filter(arg, mask, inverse=True) if _any_mapped(mask) else arg
        for arg, mask in zip(args, masks)
    )


def _any_mapped(mask: Any) -> bool:
    return any(jtu.tree_leaves(mask))


def _merge(per_member: tuple, shared: tuple) -> tuple:
    return tuple(
        s if p is _SHARED else eqx.combine(p, s) for p, s in zip(per_member, shared)
    )
