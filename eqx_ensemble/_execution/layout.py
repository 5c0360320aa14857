"""How the member axis is laid out in a training step: vectorised or sequential.

On XLA's CPU backend a member-batched (`"vmap"`) convolution is a grouped one,
several times slower than the members' own in turn. `"sequential"` runs them in
turn in one program (compile time grows with the members).
"""

from collections.abc import Callable
from typing import Any, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import PyTree

from .._internal.checks import check_choice
from .._internal.tree import is_traced

Layout = Literal["vmap", "sequential"]

# Past this many members straight-line members cost more compile time than they save.
SEQUENTIAL_MAX_MEMBERS = 16

# Eagerly a member-by-member map pays off from here.
EAGER_SEQUENTIAL_MIN_FLOPS = 1e8

_CHOICES = ("auto", "vmap", "sequential")


def check_layout(layout: Any, sharded: bool) -> str:
    """`layout` checked (`None` means `"auto"`); `"sequential"` refused on a mesh."""
    layout = check_choice(layout, "layout", _CHOICES, "auto")
    if layout == "sequential" and sharded:
        raise ValueError(
            "`layout='sequential'` runs the members one after another on one "
            "device; on a mesh the members are split over devices and run "
            "vectorised: leave `layout` out (or pass 'vmap')"
        )
    return layout


# `fit` run forward convolution FLOPs repaying the sequential compile (CPU).
SEQUENTIAL_MIN_RUN_FLOPS = 1.5e11


# GPU: sequential faster from ~1 GFLOP (docs/benchmarks.md, "Member layout").
GPU_SEQUENTIAL_MIN_FLOPS = 1e9
GPU_SEQUENTIAL_MIN_RUN_FLOPS = 8e13


# Shorter runs loop over members (`Plan.member_chunk = 1`) from this many FLOPs.
GROUP_MIN_FLOPS = 3e7


def run_length_class(steps: int) -> int:
    """`steps` rounded down to a power of two (similar runs share a plan)."""
    return 1 << (max(int(steps), 1).bit_length() - 1)


def choose_layout(
    layout: str,
    *,
    convolutions: bool,
    size: int,
    sharded: bool,
    steps: int | None = None,
    convolution_flops: float = 0.0,
    platform: str | None = None,
) -> Layout:
    """The user's layout, else `"sequential"` for a convolving loss on one device
    where the platform's thresholds are met, else `"vmap"`."""
    if layout == "vmap" or layout == "sequential":
        return layout
    if not convolutions or sharded or size > SEQUENTIAL_MAX_MEMBERS:
        return "vmap"
    platform = jax.default_backend() if platform is None else platform
    run_flops = (
        None if steps is None else run_length_class(steps) * size * convolution_flops
    )
    if platform == "cpu" and (
        run_flops is None or run_flops >= SEQUENTIAL_MIN_RUN_FLOPS
    ):
        return "sequential"
    if (
        platform == "gpu"
        and run_flops is not None
        and convolution_flops >= GPU_SEQUENTIAL_MIN_FLOPS
        and run_flops >= GPU_SEQUENTIAL_MIN_RUN_FLOPS
    ):
        return "sequential"
    return "vmap"


def choose_map_layout(convolution_flops: float, *, traced: bool, size: int) -> Layout:
    """The automatic layout of a map on one CPU device: `"sequential"` for a
    convolving function in a trace, or from `EAGER_SEQUENTIAL_MIN_FLOPS`."""
    if convolution_flops <= 0 or size > SEQUENTIAL_MAX_MEMBERS:
        return "vmap"
    if not traced and convolution_flops < EAGER_SEQUENTIAL_MIN_FLOPS:
        return "vmap"
    return "sequential"


def any_traced(tree: PyTree[Any]) -> bool:
    return any(is_traced(leaf) for leaf in jax.tree.leaves(tree))


def on_one_cpu_device(tree: PyTree[Any]) -> bool:
    if jax.default_backend() != "cpu":
        return False
    leaves = [leaf for leaf in jax.tree.leaves(tree) if eqx.is_array(leaf)]
    if any_traced(leaves):
        return jax.device_count() == 1
    # NumPy arrays go to the default device: only JAX arrays can be spread.
    return all(
        len(leaf.sharding.device_set) == 1
        for leaf in leaves
        if isinstance(leaf, jax.Array)
    )


def member_map(
    fn: Callable[..., Any],
    in_axes: tuple[Any, ...],
    layout: Layout,
    size: int,
    chunk: int | None = None,
    devices: int = 1,
) -> Callable[..., Any]:
    """`eqx.filter_vmap(fn, in_axes=in_axes)`, or the same member by member."""
    if layout == "vmap":
        vmapped = eqx.filter_vmap(fn, in_axes=in_axes)
        if chunk is None or chunk * devices == size:
            return vmapped
        return _chunked_vmap(vmapped, in_axes, size, chunk, devices)

    def sequential(*args: Any) -> Any:
        outputs = []
        for i in range(size):
            member_args = [
                _member_slice(axes, arg, i)
                for arg, axes in zip(args, in_axes, strict=True)
            ]
            outputs.append(fn(*member_args))
        return jax.tree.map(_stack, *outputs)

    return sequential


def check_member_chunk(chunk: int, size: int, devices: int = 1) -> None:
    """`chunk` divides the number of members (of each of `devices`), or an error."""
    if devices > 1 and size % devices == 0:
        local = size // devices
        if local % chunk:
            divisors = [k for k in range(1, local + 1) if local % k == 0]
            raise ValueError(
                f"`Execution.member_chunk={chunk}` must divide the number of "
                f"members per device ({size} members over the {devices} devices of "
                f"the mesh axis 'members': {local} each): choose one of {divisors}"
            )
        return
    if size % chunk:
        divisors = [k for k in range(1, size + 1) if size % k == 0]
        raise ValueError(
            f"`Execution.member_chunk={chunk}` must divide the number of members "
            f"({size}): choose one of {divisors}"
        )


def _chunked_vmap(
    vmapped: Callable[..., Any],
    in_axes: tuple[Any, ...],
    size: int,
    chunk: int,
    devices: int = 1,
) -> Callable[..., Any]:
    """`vmapped` over `chunk` members at a time (a `jax.lax.map` over groups)."""
    check_member_chunk(chunk, size, devices)
    if any(axes is not None and not callable(axes) for axes in in_axes):
        raise NotImplementedError("member chunks take per-argument filters only")
    groups = size // (chunk * devices)
    mapped = [i for i, axes in enumerate(in_axes) if axes is not None]

    def to_groups(x: Any) -> Any:
        # (devices * groups * chunk, ...) -> (groups, devices * chunk, ...)
        split, rest = _explicit_spec(x)
        x = _reshape(
            x, (devices, groups, chunk, *x.shape[1:]), (split, None, None), rest
        )
        x = jnp.swapaxes(x, 0, 1)
        return _reshape(x, (groups, devices * chunk, *x.shape[3:]), (None, split), rest)

    def from_groups(x: Any) -> Any:
        # (groups, devices * chunk, ...) -> (devices * groups * chunk, ...)
        split, rest = _explicit_spec(x, axis=1)
        x = _reshape(
            x, (groups, devices, chunk, *x.shape[2:]), (None, split, None), rest
        )
        x = jnp.swapaxes(x, 0, 1)
        return _reshape(x, (size, *x.shape[3:]), (split,), rest)

    def run(*args: Any) -> Any:
        parts = [eqx.partition(args[i], eqx.is_array) for i in mapped]
        split = tuple(jax.tree.map(to_groups, dynamic) for dynamic, _ in parts)

        def group(dynamic_group: Any) -> Any:
            full = list(args)
            for position, i in enumerate(mapped):
                full[i] = eqx.combine(dynamic_group[position], parts[position][1])
            return vmapped(*full)

        # The outputs' non-array leaves, kept from the map's trace (no retrace).
        statics = []

        def arrays_of(dynamic_group: Any) -> Any:
            arrays, static = eqx.partition(group(dynamic_group), eqx.is_array)
            statics.append(static)
            return arrays

        outputs = jax.lax.map(arrays_of, split)
        outputs = jax.tree.map(from_groups, outputs)
        return eqx.combine(outputs, statics[-1])

    return run


def _explicit_spec(x: Any, axis: int = 0) -> tuple[Any, Any]:
    """On an Explicit mesh: the mesh axis splitting `x`'s `axis`, and the rest."""
    sharding = getattr(jax.typeof(x), "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if not any(  # (no mesh: no axis types)
        kind == jax.sharding.AxisType.Explicit
        for kind in getattr(mesh, "axis_types", ())
    ):
        return None, None
    entries = tuple(getattr(sharding, "spec", ()))
    spec = entries + (None,) * (x.ndim - len(entries))
    return spec[axis], (mesh, spec[axis + 1 :])


def _reshape(
    x: Any, shape: tuple[int, ...], leading: tuple[Any, ...], rest: Any
) -> Any:
    """`x.reshape(shape)`, on an Explicit mesh split `(*leading, *trailing)`."""
    if rest is None:
        return x.reshape(shape)
    mesh, trailing = rest
    spec = jax.sharding.PartitionSpec(*leading, *trailing)
    return jax.lax.reshape(
        x, shape, out_sharding=jax.sharding.NamedSharding(mesh, spec)
    )


def _member_slice(axes: Any, arg: Any, i: int) -> Any:
    return _per_member(axes, arg, lambda x: x[i])


def member_structs(axes: Any, arg: Any) -> Any:
    """One member's slice of `arg` as `jax.ShapeDtypeStruct`s."""
    arg = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if eqx.is_array(x) else x,
        arg,
    )
    return _per_member(
        axes, arg, lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), _is_struct
    )


def _per_member(
    axes: Any, arg: Any, take: Callable[[Any], Any], is_leaf: Any = eqx.is_array
) -> Any:
    """`take` applied to every leaf of `arg` mapped by `axes` (see `member_map`)."""

    def mapped(tree: Any) -> Any:
        return jax.tree.map(lambda x: take(x) if is_leaf(x) else x, tree)

    if axes is None:
        return arg
    if callable(axes):  # a filter such as `eqx.if_array(0)`
        return mapped(arg)
    return jax.tree.map(
        lambda axis, subtree: subtree if axis is None else mapped(subtree),
        axes,
        arg,
        is_leaf=lambda x: x is None,
    )


def _is_struct(x: Any) -> bool:
    return isinstance(x, jax.ShapeDtypeStruct)


def _stack(*leaves: Any) -> Any:
    if eqx.is_array(leaves[0]):
        return jnp.stack(leaves)
    return leaves[0]
