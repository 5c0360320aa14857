"""What a per-member function is made of, read from ONE member's jaxpr."""

from collections.abc import Callable
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.extend.core as jex
import numpy as np
from jaxtyping import PyTree

from .cache import keep, owner_table


class StepProfile(NamedTuple):
    """`convolutions`: the loss convolves; `batched_dots`: a matmul has a batch
    dimension of its own (attention heads); `convolution_flops`: as written (each
    counted once, even in a loop); `dot_flops` and `intermediate_bytes` (every
    value computed, for `plan.scratch_chunk`): a `scan`'s body counted per run."""

    convolutions: bool = False
    batched_dots: bool = False
    convolution_flops: float = 0.0
    dot_flops: float = 0.0
    intermediate_bytes: float = 0.0


# Primitives that call a body and return what it computed (counted there).
_CALLS = frozenset(
    {
        "jit",
        "pjit",
        "closed_call",
        "core_call",
        "custom_jvp_call",
        "custom_vjp_call",
        "custom_vjp_call_jaxpr",
        "remat2",
        "checkpoint",
        "shard_map",
    }
)


def inner_jaxprs(params: dict[str, Any]) -> list[Any]:
    """The jaxprs an equation's parameters hold (`jaxprs_in_params`, not in 0.8)."""
    found = []
    for value in params.values():
        for item in value if isinstance(value, tuple | list) else (value,):
            if isinstance(item, jex.ClosedJaxpr):
                found.append(item.jaxpr)
            elif isinstance(item, jex.Jaxpr):
                found.append(item)
    return found


def profile_jaxpr(jaxpr: Any) -> StepProfile:
    convolutions = batched_dots = False
    convolution_flops = dot_flops = intermediate_bytes = 0.0

    def search(inner: Any, times: float) -> None:
        nonlocal convolutions, batched_dots, convolution_flops, dot_flops
        nonlocal intermediate_bytes
        for equation in inner.eqns:
            name = equation.primitive.name
            subs = inner_jaxprs(equation.params)
            if name not in _CALLS:
                written = sum(_bytes(v.aval) for v in equation.outvars)
                intermediate_bytes += times * written
            if name == "conv_general_dilated":
                convolutions = True
                convolution_flops += _convolution_flops(equation)
            elif name == "dot_general":
                (contract_lhs, _), (batch_lhs, _) = equation.params["dimension_numbers"]
                batched_dots = batched_dots or len(batch_lhs) > 0
                dot_flops += times * _dot_flops(equation, contract_lhs)
            repeat = (
                times * equation.params.get("length", 1) if name == "scan" else times
            )
            for sub in subs:
                search(sub, repeat)

    search(jaxpr, 1.0)
    return StepProfile(
        convolutions, batched_dots, convolution_flops, dot_flops, intermediate_bytes
    )


def _bytes(aval: Any) -> float:
    shape, dtype = getattr(aval, "shape", None), getattr(aval, "dtype", None)
    itemsize = getattr(dtype, "itemsize", None)  # a key's dtype has one too
    if shape is None or not isinstance(itemsize, int):
        return 0.0
    return float(np.prod(shape)) * itemsize


def _dot_flops(equation: Any, contracting: Any) -> float:
    # 2 x (output elements) x (the contracted size).
    lhs_shape = equation.invars[0].aval.shape
    inner = float(np.prod([lhs_shape[axis] for axis in contracting]))
    return 2.0 * float(np.prod(equation.outvars[0].aval.shape)) * inner


def _convolution_flops(equation: Any) -> float:
    # 2 x (output elements) x (kernel elements per output feature).
    out_shape = equation.outvars[0].aval.shape
    kernel_shape = equation.invars[1].aval.shape
    out_features = kernel_shape[equation.params["dimension_numbers"].rhs_spec[0]]
    window = float(np.prod(kernel_shape)) / max(int(out_features), 1)
    return 2.0 * float(np.prod(out_shape)) * window


def profile_call(
    fn: Callable[..., Any],
    inputs: tuple[Any, ...],
    *,
    owner: Any = None,
    extra: Any = (),
) -> StepProfile:
    """The profile of `fn(*inputs)` from shapes (empty if tracing fails)."""
    table, key = None, None
    if owner is not None:
        try:
            table = owner_table(owner)
            key = ("profile", extra, signature(inputs))
            if key in table:
                return table[key]
        except TypeError:  # not weakly referable, or an unhashable leaf
            table = None

    dynamic, static = eqx.partition(inputs, _is_array_like)
    structs = jax.tree.map(_struct, dynamic)

    def traced(dynamic: Any) -> Any:
        return fn(*eqx.combine(dynamic, static))

    try:
        jaxpr = jax.make_jaxpr(traced)(structs)
        profile = profile_jaxpr(jaxpr.jaxpr)
    except Exception:  # noqa: BLE001 - the first real call reports it
        profile = StepProfile()
    if table is not None:
        keep(table, key, profile)
    return profile


def signature(tree: Any) -> Any:
    """A hashable record of `tree`'s structure, shapes and dtypes (or TypeError)."""
    leaves, treedef = jax.tree.flatten(tree)
    record = tuple(
        (tuple(leaf.shape), leaf.dtype) if hasattr(leaf, "shape") else leaf
        for leaf in leaves
    )
    hash(record)
    return treedef, record


def _is_array_like(x: Any) -> bool:
    return eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)


def _struct(x: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(np.shape(x), x.dtype)


def first_member(tree: PyTree[Any]) -> PyTree[Any]:
    """Member 0's slice of a stacked tree as `jax.ShapeDtypeStruct`s."""
    if tree is None:
        return None
    return jax.tree.map(
        lambda x: (
            jax.ShapeDtypeStruct(np.shape(x)[1:], x.dtype) if _is_array_like(x) else x
        ),
        tree,
    )


def example_structs(data: PyTree[Any], batch_size: int, axis: int = 0) -> Any:
    """A batch of `batch_size` examples of `data` as `jax.ShapeDtypeStruct`s."""

    def struct(leaf: Any) -> Any:
        shape = list(np.shape(leaf))
        shape[axis] = batch_size
        return jax.ShapeDtypeStruct(tuple(shape), leaf.dtype)

    return jax.tree.map(struct, data)
