"""PyTree helpers shared by the package: leaf paths, structure comparison, sizes."""

import dataclasses
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax.core import Tracer
from jaxtyping import PyTree


def with_fields(module: Any, **changes: Any) -> Any:
    """`dataclasses.replace` without re-running `__init__` (~60 us for a
    `TrainState`): only for modules with no converters or init checks."""
    fields = {field.name for field in dataclasses.fields(module)}
    unknown = set(changes) - fields
    if unknown:
        raise TypeError(f"{type(module).__name__} has no field(s) {sorted(unknown)}")
    new = object.__new__(type(module))
    new.__dict__.update(module.__dict__)
    new.__dict__.update(changes)
    return new


def keystr(path: tuple[Any, ...]) -> str:
    """Human-readable leaf path, e.g. `.layers[0].weight`; `<root>` for the root."""
    text = jtu.keystr(path)
    return text if text else "<root>"


def describe(x: Any) -> str:
    """Short description of a leaf for error messages."""
    if eqx.is_array(x):
        return f"array of shape {tuple(x.shape)} and dtype {x.dtype}"
    if callable(x) and not isinstance(x, type) and hasattr(x, "__name__"):
        # Functions (e.g. activations) by name: their repr is an address.
        module = getattr(x, "__module__", None) or ""
        name = getattr(x, "__qualname__", None) or x.__name__
        return f"function `{module + '.' if module else ''}{name}`"
    text = repr(x)
    if len(text) > 80:
        text = text[:77] + "..."
    return f"{type(x).__name__} {text}"


def _children_with_keys(node: Any) -> tuple[list[tuple[Any, Any]], Any]:
    """One level of flattening: `[(key, child), ...]` and the one-level treedef."""
    leaves_with_path, treedef = jtu.tree_flatten_with_path(
        node, is_leaf=lambda child: child is not node
    )
    return [(path[0], child) for path, child in leaves_with_path], treedef


def _is_leaf(x: Any) -> bool:
    treedef = jtu.tree_structure(x)
    return jtu.treedef_is_leaf(treedef) and treedef.num_leaves == 1


def _static_field_difference(a: Any, b: Any, path: str) -> str | None:
    if not dataclasses.is_dataclass(a) or isinstance(a, type):
        return None
    for field in dataclasses.fields(a):
        if not field.metadata.get("static", False):
            continue
        value_a = getattr(a, field.name, None)
        value_b = getattr(b, field.name, None)
        if not _leaves_equal(value_a, value_b):
            return (
                f"static field `{path}.{field.name}` differs: "
                f"{value_a!r} vs {value_b!r}"
            )
    return None


def _leaves_equal(a: Any, b: Any) -> bool:
    if a is b:
        return True
    try:
        result = a == b
        if isinstance(result, np.ndarray):
            return bool(result.all())
        return bool(result)
    except Exception:
        return False


def first_difference(
    a: Any, b: Any, *, ignore_leading_axis: bool = False, numbers_are_data: bool = False
) -> str | None:
    """Describe where two PyTrees first differ in structure (arrays by shape and
    dtype, other leaves by equality), or `None`. `numbers_are_data`: Python
    numbers may differ."""
    if _same(a, b, ignore_leading_axis, numbers_are_data):  # the common case
        return None
    return _first_difference(a, b, (), ignore_leading_axis, numbers_are_data)


def _same(a: Any, b: Any, ignore_leading: bool, numbers: bool) -> bool:
    """`_first_difference(...) is None`, fast: one flatten each."""
    leaves_a, treedef_a = jtu.tree_flatten(a)
    leaves_b, treedef_b = jtu.tree_flatten(b)
    if treedef_a != treedef_b:
        return False
    for x, y in zip(leaves_a, leaves_b, strict=True):
        if eqx.is_array(x) and eqx.is_array(y):
            shape_x, shape_y = tuple(x.shape), tuple(y.shape)
            if ignore_leading:
                shape_x, shape_y = shape_x[1:], shape_y[1:]
            if shape_x != shape_y or x.dtype != y.dtype:
                return False
        elif not (numbers and _is_number(x) and _is_number(y)) and (
            type(x) is not type(y) or not _leaves_equal(x, y)
        ):
            return False
    return True


def _is_number(x: Any) -> bool:
    return isinstance(x, int | float | complex) and not isinstance(x, bool)


def _first_difference(
    a: Any, b: Any, path: tuple[Any, ...], ignore_leading: bool, numbers: bool
) -> str | None:
    where = keystr(path)
    if numbers and _is_number(a) and _is_number(b):
        return None
    a_is_array, b_is_array = eqx.is_array(a), eqx.is_array(b)
    if a_is_array or b_is_array:
        if not (a_is_array and b_is_array):
            return f"leaf `{where}` differs: {describe(a)} vs {describe(b)}"
        shape_a, shape_b = tuple(a.shape), tuple(b.shape)
        if ignore_leading:
            shape_a, shape_b = shape_a[1:], shape_b[1:]
        if shape_a != shape_b or a.dtype != b.dtype:
            return f"leaf `{where}` differs: {describe(a)} vs {describe(b)}"
        return None
    if type(a) is not type(b):
        return (
            f"`{where}` differs in type: {type(a).__name__} vs {type(b).__name__} "
            f"({describe(a)} vs {describe(b)})"
        )
    if _is_leaf(a) or _is_leaf(b):
        if not _leaves_equal(a, b):
            message = f"leaf `{where}` differs: {describe(a)} vs {describe(b)}"
            if callable(a) and callable(b) and describe(a) == describe(b):
                message += (
                    " (two distinct function objects, e.g. one lambda per model: "
                    "build every model with the same function object)"
                )
            return message
        return None
    children_a, treedef_a = _children_with_keys(a)
    children_b, treedef_b = _children_with_keys(b)
    if treedef_a != treedef_b:
        static = _static_field_difference(a, b, "" if not path else where)
        if static is not None:
            return static
        keys_a = [keystr((key,)) for key, _ in children_a]
        keys_b = [keystr((key,)) for key, _ in children_b]
        if keys_a != keys_b:
            return f"node `{where}` has children {keys_a} vs {keys_b}"
        return f"node `{where}` differs in its metadata: {treedef_a} vs {treedef_b}"
    for (key, child_a), (_, child_b) in zip(children_a, children_b, strict=True):
        found = _first_difference(
            child_a, child_b, (*path, key), ignore_leading, numbers
        )
        if found is not None:
            return found
    return None


def array_leaves_with_path(tree: Any) -> list[tuple[str, jax.Array]]:
    return [
        (keystr(path), leaf)
        for path, leaf in jtu.tree_flatten_with_path(tree)[0]
        if eqx.is_array(leaf)
    ]


def agreed_leading_size(tree: Any) -> int | None:
    """The leading-axis size all array leaves share, or `None` (no paths: cheap)."""
    arrays = [leaf for leaf in jtu.tree_leaves(tree) if eqx.is_array(leaf)]
    if not arrays or arrays[0].ndim == 0:
        return None
    size = arrays[0].shape[0]
    if all(leaf.ndim > 0 and leaf.shape[0] == size for leaf in arrays):
        return int(size)
    return None


def leading_size(tree: Any, *, what: str = "ensemble") -> int:
    """The common leading-axis size of every array leaf; a clear error otherwise."""
    size = agreed_leading_size(tree)
    if size is not None:
        return size
    leaves = array_leaves_with_path(tree)
    if not leaves:
        raise ValueError(
            f"The {what} has no array leaves, so it has no member axis. An ensemble "
            "needs at least one array (e.g. a weight) with a leading member axis."
        )
    first_path, first_leaf = leaves[0]
    if first_leaf.ndim == 0:
        raise ValueError(
            f"The {what}'s leaf `{first_path}` is a scalar (shape ()), so it has no "
            "leading member axis. Build ensembles with `ee.ensemble` or `ee.stack`."
        )
    size = first_leaf.shape[0]
    for path, leaf in leaves[1:]:
        if leaf.ndim == 0 or leaf.shape[0] != size:
            raise ValueError(
                f"The {what}'s array leaves disagree on the member axis: leaf "
                f"`{first_path}` has shape {tuple(first_leaf.shape)} (leading size "
                f"{size}) but leaf `{path}` has shape {tuple(leaf.shape)}."
            )
    return int(size)


def is_traced(x: Any) -> bool:
    return isinstance(x, Tracer)


def as_array(value: Any, dtype: Any = None) -> jax.Array:
    """`jnp.asarray(value, dtype)` without compiling per shape and dtype
    (jax-ml/jax#27460); NumPy arrays are copied first, since on a CPU
    `device_put` may alias a buffer the caller reuses."""
    if (
        isinstance(value, np.ndarray | np.generic | int | float | complex)
        and not isinstance(value, np.ma.MaskedArray)  # refused, not unmasked
        and getattr(jax.config, "jax_transfer_guard_host_to_device", None)
        in (None, "allow")
    ):
        if dtype is not None:  # one rounding, to the dtype JAX will hold
            dtype = jax.dtypes.canonicalize_dtype(dtype)
        if isinstance(value, np.ndarray):
            value = np.array(value, dtype=dtype, copy=True)
        elif dtype is not None:
            value = np.asarray(value, dtype)
        return jax.device_put(value)
    return jnp.asarray(value, dtype)


def trainable(members: PyTree[Any]) -> PyTree[Any]:
    """The parameters an optimizer sees: the floating-point array leaves."""
    return eqx.filter(members, eqx.is_inexact_array)
