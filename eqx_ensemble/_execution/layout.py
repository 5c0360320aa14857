"""How the member axis is laid out in a training step: vectorised or sequential.

`"vmap"` (the default everywhere) runs every member in one vectorised
computation: a member-batched matmul or convolution per layer. On XLA's CPU
backend a member-batched convolution becomes a grouped convolution
(`feature_group_count = members`), which runs several times slower than the
members' plain convolutions one after another (a 5-member CNN on 8x8 images,
value and gradient: 88 ms vectorised, 44 ms as an im2col matmul, 11 ms one
member after another; `benchmarks/bench_families.py`). `"sequential"` runs the
members one after another inside the same compiled step (straight-line code).
Each member then computes exactly what it computes alone; the results equal
the vectorised step's to floating-point rounding. (A convolution runs at full
speed inside a compiled loop only in the form the library's programs lower it
to, `_execution/convolution.py`.)

The cost of `"sequential"` is the one thing `"vmap"` never has: the compiled
step holds one copy of the member's computation per member, so trace and
compile time grow with the ensemble. The automatic rule therefore picks it only
without a mesh, for a loss that convolves, and for at most
`SEQUENTIAL_MAX_MEMBERS` members: on a CPU (for `fit`, once the run is long
enough), and on a GPU for `fit` only, once a member's convolutions are large
(`GPU_SEQUENTIAL_MIN_FLOPS`) and the run long (`GPU_SEQUENTIAL_MIN_RUN_FLOPS`).
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

# Past this many members the compile time of straight-line members outweighs
# their speed (and the design's promise of size-independent compile time holds).
SEQUENTIAL_MAX_MEMBERS = 16

# Called eagerly (outside `jit`), a member-by-member map dispatches each of its
# operations once per member (about 2 ms per member for a small CNN's forward
# pass on 2 cores), which pays off only once a member's convolutions outweigh
# that (`ee.predict` on 5 CNNs, `benchmarks/bench_layout.py`, two runs: 78 MFLOP
# of convolutions per member 0.7-1.1x, 157 MFLOP 1.5-2.3x, 629 MFLOP 3.9-5.0x
# the vectorised call). Inside `jit` the member-by-member map wins from the
# smallest batch (2.3-3.4x at 78 MFLOP).
EAGER_SEQUENTIAL_MIN_FLOPS = 1e8

_CHOICES = ("auto", "vmap", "sequential")


def check_layout(layout: Any, sharded: bool) -> str:
    """`layout` as given (`None` means `"auto"`), refused with the choices when
    it is not one of them, and `"sequential"` refused on a mesh."""
    layout = check_choice(layout, "layout", _CHOICES, "auto")
    if layout == "sequential" and sharded:
        raise ValueError(
            "`layout='sequential'` runs the members one after another on one "
            "device; on a mesh the members are split over devices and run "
            "vectorised: leave `layout` out (or pass 'vmap')"
        )
    return layout


# The sequential layout compiles one copy of the step per member: for a run of
# `fit`, it is chosen only when the run is long enough for its faster steps to
# repay that compile time. What a step saves grows with its convolutions, and
# so does the extra compile time with the members: on 2 cores, 5 CNNs on 8x8
# images (0.39 GFLOP of forward convolutions per step) save 11 ms per step
# against 3.5 s more to compile (even at about 320 steps), 8 CNNs on 16x16
# images (2.5 GFLOP) 85 ms against 4.8 s (even at about 56 steps): in both, at
# about 1.3e11 FLOPs of forward convolutions over the run.
SEQUENTIAL_MIN_RUN_FLOPS = 1.5e11


# On a GPU the vectorised members' convolutions are one grouped convolution
# too, which cuDNN runs well on small images and far below the card on larger
# ones: on an H100, `fit` on 9 CNNs of 8 members, the vectorised step was as
# fast or faster under 1 GFLOP of forward convolutions per member and step,
# the sequential one mostly faster from 1.25 GFLOP, its longer compilation
# repaid after about 8e13 FLOPs over the run (docs/benchmarks.md,
# "Member layout").
GPU_SEQUENTIAL_MIN_FLOPS = 1e9
GPU_SEQUENTIAL_MIN_RUN_FLOPS = 8e13


# A run too short for the sequential layout's compile time need not run
# vectorised: its members can run one at a time in a loop inside the step
# (`Plan.member_chunk = 1`: a `jax.lax.map` over the members, each with its
# plain convolutions), whose program compiles like one member's and steps
# about as fast as the sequential layout (2-vCPU AMD EPYC, round 4 session
# 18, 20-step `fit` calls, first call and ms per step: 5 CNNs on 8x8 images
# 2.3-3.2 s and 17.7-17.9 ms one at a time, 3.6-3.8 s and 15.9-16.5 ms
# sequential, against 17.5-17.7 ms for a `make_step` loop; 8 CNNs on 16x16,
# 5.9 s and 129 ms, 7.3 s and 119 ms, against 162 ms). Until session 18 it
# was one call of a one-member program per member and step (the host's call,
# about 0.3 ms, repaid once a member convolves about 8 MFLOP forward per
# step, hence the threshold's margin): 18.5-18.9 ms at 8x8, 127 ms at 16x16.
# In the loop there is no such call; the threshold stands (below it a run
# stays vectorised and unrolled, as before), not re-measured since.
GROUP_MIN_FLOPS = 3e7


def run_length_class(steps: int) -> int:
    """`steps` rounded down to a power of two: what the layout rule reads of a
    run's length (so that runs of similar lengths share a plan)."""
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
    """The layout a step runs with: the user's choice, else `"sequential"` for a
    convolving loss on one device with at most `SEQUENTIAL_MAX_MEMBERS` members
    where the platform's rule says so, else `"vmap"`. `convolution_flops`: the
    members' forward convolutions per member and step; `steps`: the run's
    length (`None` for one step per call), read as `run_length_class(steps)`;
    `platform`: JAX's default backend unless given.

    - CPU: a run whose forward convolutions add up to
      `SEQUENTIAL_MIN_RUN_FLOPS` over the run (always for `steps=None`).
    - GPU: a run of `fit` (`steps` given) whose member convolves at least
      `GPU_SEQUENTIAL_MIN_FLOPS` per step and `GPU_SEQUENTIAL_MIN_RUN_FLOPS`
      over the run.
    """
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
    """The automatic layout of a map (`ee.map`, `ee.predict`, `ens(x)`) whose
    arrays sit on one CPU device and whose function convolves
    `convolution_flops` per member: `"sequential"` inside a trace, or eagerly
    from `EAGER_SEQUENTIAL_MIN_FLOPS`, for at most `SEQUENTIAL_MAX_MEMBERS`."""
    if convolution_flops <= 0 or size > SEQUENTIAL_MAX_MEMBERS:
        return "vmap"
    if not traced and convolution_flops < EAGER_SEQUENTIAL_MIN_FLOPS:
        return "vmap"
    return "sequential"


def any_traced(tree: PyTree[Any]) -> bool:
    """Whether any leaf of `tree` is a tracer (inside `jit`, `grad`, ...)."""
    return any(is_traced(leaf) for leaf in jax.tree.leaves(tree))


def on_one_cpu_device(tree: PyTree[Any]) -> bool:
    """Whether the arrays of `tree` sit on one CPU device (for traced arrays,
    whose placement is not known here: whether the process has just one)."""
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
    """`eqx.filter_vmap(fn, in_axes=in_axes)`, or the same mapping run member by
    member and stacked. Each entry of `in_axes` is `None` (shared), a filter such
    as `eqx.if_array(0)` (every array leaf per member), or a PyTree prefix of
    `0`/`None` over its argument. With `chunk` (the vectorised layout, entries
    `None` or a filter): `chunk` members at a time, a `jax.lax.map` over groups
    (`Execution.member_chunk`); with the members split over `devices` devices
    (a mesh's `"members"` axis), `chunk` of each device's members at a time."""
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
    """`chunk` divides the number of members (of each device's, on a mesh whose
    `"members"` axis has `devices` devices), or an error naming both."""
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
    """`vmapped` over `chunk` members at a time: the per-member arrays are split
    into `size // chunk` groups and `jax.lax.map` runs one group after another,
    so only one group's intermediate values are alive at once. Shared arguments
    (`None` axes) are closed over. With the members split in blocks over
    `devices` devices, group `g` holds the `g`-th `chunk` of every device's
    block (`devices * chunk` members, still split over the devices): each
    device computes `chunk` of its own members at a time, with no transfer."""
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

        # The outputs' non-array leaves, kept from the map's own trace of
        # `group` (not a second trace: a member's step is most of a first
        # call's trace time).
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
    """On a mesh with Explicit axes (where a reshape of a split axis must say
    where its output goes): the mesh axis splitting `x`'s member axis (`axis`)
    and the entries of its trailing axes; `(None, None)` otherwise."""
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
    """`x.reshape(shape)`; on an Explicit mesh (`rest` = (mesh, trailing
    entries)) with its output split `(*leading, *trailing)`."""
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
    """One member's slice of `arg` as shapes only (`jax.ShapeDtypeStruct`s;
    shared arrays keep their shapes; nothing is computed)."""
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
