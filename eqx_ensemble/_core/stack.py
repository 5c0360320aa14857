"""`stack`, `unstack`, `concatenate`: list-of-structs <-> struct-of-arrays."""

import warnings
from collections.abc import Sequence
from typing import Any, TypeVar, overload

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

from .._execution.compile import one_shot_jit
from .._internal.tree import first_difference, keystr
from .ensemble import (
    Ensemble,
    _take_leaves,
    check_shared_mask,
    one_call_pays,
    resolve_shared,
    shared_filter,
    with_members,
)
from .heterogeneous import Heterogeneous, is_heterogeneous

Member = TypeVar("Member")


def check_same_structure(
    trees: Sequence[Any],
    what: str,
    *,
    ignore_leading_axis: bool = False,
    numbers_are_data: bool = False,
) -> None:
    for position, tree in enumerate(trees[1:], start=1):
        difference = first_difference(
            trees[0],
            tree,
            ignore_leading_axis=ignore_leading_axis,
            numbers_are_data=numbers_are_data,
        )
        if difference is not None:
            raise ValueError(
                f"Cannot combine {what}: {what[:-1]} 0 and {what[:-1]} {position} "
                f"differ. First difference: {difference} (values given for "
                f"{what[:-1]} 0 first)."
            )


def stack(
    models: Sequence[Member], *, shared: Any = None, train_shared: bool = False
) -> Ensemble[Member]:
    """Stack same-structure models into one [`Ensemble`][eqx_ensemble.Ensemble].

    Array leaves are stacked along a new leading member axis; non-array leaves
    (activations, Python numbers, static fields) must be equal across models and
    are kept once. Works for `eqx.Module`s and plain PyTrees.

    **Arguments:**

    - `models`: a non-empty sequence of models with the same structure.
    - `shared`, `train_shared`: as in [`ee.ensemble`][eqx_ensemble.ensemble];
      the shared parts must be identical in every model (checked).

    **Returns:**

    An `Ensemble` with `len(models)` members.

    **Raises:**

    `ValueError` naming the first difference when the models' structures differ.

    **Example:**

    ```python
    params = [(jnp.ones((3, 2)), jnp.zeros(2)) for _ in range(4)]
    ens = ee.stack(params)
    ens.members[0][0].shape    # (4, 3, 2)
    ```
    """
    if isinstance(models, Ensemble | str | bytes) or not isinstance(models, Sequence):
        raise TypeError(
            f"`ee.stack` takes a list (or tuple) of models, got {type(models).__name__}"
        )
    if len(models) == 0:
        raise ValueError("`ee.stack` got an empty list; an ensemble needs a member")
    check_same_structure(models, "models")
    _refuse_overflow(models)
    _warn_if_narrowed(models[0])
    shared_part = None
    if shared is not None:
        mask = resolve_shared(models[0], shared)
        check_shared_mask(mask, models[0])
        parts = [shared_filter(model, mask) for model in models]
        check_same_shared([(f"model {i}", part) for i, part in enumerate(parts)])
        shared_part = parts[0]
        models = [eqx.filter(model, mask, inverse=True) for model in models]
    elif train_shared:
        raise ValueError("`train_shared=True` needs a shared part: pass `shared=`")
    stacked = _by_leaf(models, _stack_columns)
    return Ensemble(stacked, shared_part, train_shared=train_shared)


def check_same_shared(parts: Sequence[tuple[str, Any]]) -> None:
    """Raise unless every shared part equals the first, naming where it differs."""
    first_name, first = parts[0]
    first_leaves = jtu.tree_flatten_with_path(first)[0]
    for name, part in parts[1:]:
        difference = first_difference(first, part)
        if difference is not None:
            raise ValueError(
                f"The shared parts of {first_name} and {name} differ: {difference}"
            )
        for (path, a), b in zip(first_leaves, jtu.tree_leaves(part)):
            if a is b or not eqx.is_array(a):
                continue
            host_a, host_b = np.asarray(a), np.asarray(b)
            if not np.array_equal(host_a, host_b, equal_nan=True):
                gap = np.max(np.abs(host_a.astype(float) - host_b.astype(float)))
                raise ValueError(
                    f"The shared parts of {first_name} and {name} differ at leaf "
                    f"`{keystr(path)}` (largest absolute difference {gap:.3g}); a "
                    "shared part is held once, so it must be identical in every "
                    "model. Stack the differing part instead (leave it out of "
                    "`shared`)."
                )


def _refuse_overflow(models: Sequence[Any]) -> None:
    """Refuse a 64-bit integer leaf that 32 bits (JAX without x64) would wrap."""
    for position, model in enumerate(models):
        for path, leaf in jax.tree_util.tree_flatten_with_path(model)[0]:
            dtype = getattr(leaf, "dtype", None)
            if (
                not isinstance(leaf, np.ndarray | np.integer)
                or dtype is None
                or not np.issubdtype(dtype, np.integer)
                or leaf.size == 0
            ):
                continue
            narrowed = np.dtype(jax.dtypes.canonicalize_dtype(dtype))
            if narrowed == dtype:
                continue
            bounds = np.iinfo(narrowed)
            low, high = leaf.min(), leaf.max()
            if low < bounds.min or high > bounds.max:
                bad = high if high > bounds.max else low
                raise ValueError(
                    f"`ee.stack`: leaf `{keystr(path)}` of model {position} is "
                    f"{dtype} and holds {bad}, which {narrowed} (what JAX stores "
                    f"it as without `jax_enable_x64`) cannot hold: it would wrap. "
                    "Enable x64 (`jax.config.update('jax_enable_x64', True)`) or "
                    "store the value as a float."
                )


def _warn_if_narrowed(model: Any) -> None:
    """Warn, naming the leaf, when JAX without x64 narrows a 64-bit leaf."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(model)[0]:
        dtype = getattr(leaf, "dtype", None)
        if not isinstance(leaf, np.ndarray) or dtype is None:
            continue
        narrowed = jnp.dtype(jax.dtypes.canonicalize_dtype(dtype))
        if narrowed != dtype:
            warnings.warn(
                f"`ee.stack`: leaf `{keystr(path)}` is {dtype}; JAX (without "
                f"`jax_enable_x64`) stores it as {narrowed}. Convert it yourself to "
                "silence this, or enable x64 to keep 64 bits.",
                stacklevel=3,
            )
            return


# Stacked in blocks (one `jnp.stack` of 4096 arrays compiled in 133 s).
_BLOCK = 64
_INPUTS = 256


@one_shot_jit
def _stack_block(columns: list[tuple[Any, ...]]) -> list[Any]:
    return [jnp.stack(column) for column in columns]


@one_shot_jit
def _concatenate_blocks(columns: list[list[Any]]) -> list[Any]:
    return [jnp.concatenate(column, axis=0) for column in columns]


def _stack_columns(columns: list[tuple[Any, ...]]) -> list[Any]:
    """Each column (one leaf of every model) stacked in few compiled calls."""
    if not columns:
        return []
    count = len(columns[0])
    block = min(count, _BLOCK)
    per_call = max(1, _INPUTS // block)
    stacked: list[Any] = []
    for first in range(0, len(columns), per_call):
        part = columns[first : first + per_call]
        if count <= _BLOCK:
            stacked.extend(_stack_block(part))
            continue
        blocks = [
            _stack_block([column[start : start + _BLOCK] for column in part])
            for start in range(0, count, _BLOCK)
        ]
        stacked.extend(
            _concatenate_blocks([list(pieces) for pieces in zip(*blocks, strict=True)])
        )
    return stacked


def _concatenate_columns(columns: list[tuple[Any, ...]]) -> list[Any]:
    """Each column concatenated along the member axis, in few compiled calls."""
    if not columns:
        return []
    per_call = max(1, _INPUTS // len(columns[0]))
    joined: list[Any] = []
    for first in range(0, len(columns), per_call):
        joined.extend(
            _concatenate_blocks([list(c) for c in columns[first : first + per_call]])
        )
    return joined


def _by_leaf(trees: Sequence[Any], combine: Any) -> Any:
    """`trees` joined leaf by leaf: array columns through `combine`."""
    flat = [jax.tree.flatten(tree)[0] for tree in trees]
    first, treedef = jax.tree.flatten(trees[0])
    at = [i for i, leaf in enumerate(first) if eqx.is_array(leaf)]
    leaves = list(first)
    columns = [tuple(f[i] for f in flat) for i in at]
    joined = None
    if one_call_pays([first[i] for i in at]):
        try:
            joined = combine(columns)
        except ValueError:  # leaves committed to different devices
            joined = None
    if joined is None:
        joined = [combine([column])[0] for column in columns]
    for i, leaf in zip(at, joined, strict=True):
        leaves[i] = leaf
    return jax.tree.unflatten(treedef, leaves)


@overload
def unstack(ens: Ensemble[Member]) -> list[Member]: ...


@overload
def unstack(ens: Heterogeneous) -> list[Any]: ...


def unstack(ens: Ensemble[Member] | Heterogeneous) -> list[Any]:
    """Split an ensemble (or an [`ee.Heterogeneous`][eqx_ensemble.Heterogeneous],
    in member order) into a list of plain models, one per member; the inverse of
    [`stack`][eqx_ensemble.stack].

    **Example:**

    ```python
    ens = ee.ensemble(lambda k: eqx.nn.Linear(3, 2, key=k), size=3,
                      key=jax.random.key(0))
    models = ee.unstack(ens)           # three eqx.nn.Linear
    models[1].weight.shape             # (2, 3)
    ```
    """
    if is_heterogeneous(ens):  # each group's members, in member order
        return [model for group in ens.groups for model in unstack(group)]
    if not isinstance(ens, Ensemble):
        raise TypeError(
            "`ee.unstack` takes an `ee.Ensemble` or an `ee.Heterogeneous`, got "
            f"{type(ens).__name__}"
        )
    size = len(ens)
    dynamic, static = eqx.partition(ens.members, eqx.is_array)
    leaves, treedef = jax.tree.flatten(dynamic)
    # One call per member (one program for all took 26 s for 512 members).
    return [
        ens.member(
            eqx.combine(
                jax.tree.unflatten(
                    treedef, _take_leaves(leaves, np.asarray([i], np.int32), True)
                ),
                static,
            )
        )
        for i in range(size)
    ]


def concatenate(ensembles: Sequence[Ensemble[Member]]) -> Ensemble[Member]:
    """Join ensembles of the same structure along the member axis.

    **Example:**

    ```python
    make = lambda k: eqx.nn.Linear(3, 2, key=k)
    a = ee.ensemble(make, size=2, key=jax.random.key(0))
    b = ee.ensemble(make, size=3, key=jax.random.key(1))
    len(ee.concatenate([a, b]))        # 5
    ```
    """
    if isinstance(ensembles, Ensemble) or not isinstance(ensembles, Sequence):
        raise TypeError(
            "`ee.concatenate` takes a list of ensembles, got "
            f"{type(ensembles).__name__}"
        )
    if len(ensembles) == 0:
        raise ValueError("`ee.concatenate` got an empty list of ensembles")
    for position, ens in enumerate(ensembles):
        if not isinstance(ens, Ensemble):
            raise TypeError(
                f"`ee.concatenate`: item {position} is a {type(ens).__name__}, not an "
                "`ee.Ensemble`; use `ee.stack` for plain models"
            )
    check_same_structure(
        [ens.members for ens in ensembles], "ensembles", ignore_leading_axis=True
    )
    trains = {ens.train_shared for ens in ensembles}
    if len(trains) > 1:
        raise ValueError(
            "`ee.concatenate`: some ensembles train their shared part and some "
            "freeze it (`train_shared` differs); make them agree first"
        )
    if ensembles[0].shared is not None:
        check_same_shared(
            [(f"ensemble {i}", ens.shared) for i, ens in enumerate(ensembles)]
        )
    joined = _by_leaf([ens.members for ens in ensembles], _concatenate_columns)
    return with_members(ensembles[0], joined)
