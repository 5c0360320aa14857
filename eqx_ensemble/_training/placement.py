"""Placement inside `fit` and `make_step`: what the training code alone uses
of a mesh (`_core/sharding.py` places an ensemble; `_execution/placement.py`
holds the rules): optimizer states that follow a member's "model" split, the
sharding constraints of a dispatch, the batch gather, and a train state's
placement recorded outside `jit` and pinned or restored inside it."""

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.tree_util as jtu
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jaxtyping import Array, PyTree

from .._core.data import gather
from .._core.ensemble import member_axis_mask
from .._core.sharding import (
    inner_of,
    per_member_flags,
    place_leaf,
    shard,
)
from .._execution.placement import (
    DATA,
    MEMBERS,
    MODEL,
    is_explicit,
    partition_spec,
)
from .._internal.tree import is_traced


def follow_model(tree: PyTree[Any], ens: Any, mesh: Mesh | None) -> PyTree[Any]:
    """`tree` (an optimizer state, a tracker's state: leaves shaped like an
    ensemble's weights) placed so that each leaf matching a weight of `ens` by
    path suffix and shape keeps that weight's `"model"` split (outside `jit`).
    Unchanged without a `"model"` axis or with no split weight."""
    if mesh is None or MODEL not in mesh.axis_names or not hasattr(ens, "shared"):
        return tree
    table = _model_table(ens, mesh)
    if table is None:
        return tree
    flags = member_axis_mask(tree)

    def place(path: Any, leaf: Any, stacked: bool) -> Any:
        if not eqx.is_array(leaf) or is_traced(leaf):
            return leaf
        inner = _lookup(table, tuple(path), leaf.shape, stacked)
        if inner is None:
            return leaf
        leading = (MEMBERS,) if stacked else ()
        entries = [name if name in mesh.axis_names else None for name in leading]
        entries += list(inner)
        return place_leaf(
            leaf, NamedSharding(mesh, partition_spec(mesh, entries)), False
        )

    return jtu.tree_map_with_path(place, tree, flags)


def model_mesh(ens: Any) -> Mesh | None:
    """The mesh of an ensemble whose weights are split over a `"model"` axis
    (read from its leaves), else `None`."""
    for leaf in jtu.tree_leaves((ens.members, ens.shared)):
        sharding = getattr(leaf, "sharding", None)
        mesh = getattr(sharding, "mesh", None)
        if (
            isinstance(mesh, Mesh)
            and MODEL in mesh.axis_names
            and not is_traced(leaf)
            and inner_of(leaf, mesh) is not None
        ):
            return mesh
    return None


def members_mesh(ens: Any) -> Mesh | None:
    """The mesh an ensemble's members were placed on (`ee.shard`, a mesh with a
    `"members"` axis; read from its leaves outside `jit`), else `None`."""
    for leaf in jtu.tree_leaves(getattr(ens, "members", None)):
        if not eqx.is_array(leaf) or is_traced(leaf):
            continue
        mesh = getattr(getattr(leaf, "sharding", None), "mesh", None)
        if isinstance(mesh, Mesh) and MEMBERS in mesh.axis_names:
            return mesh
    return None


def _model_table(ens: Any, mesh: Mesh) -> dict[Any, Any] | None:
    # (path within a member, whether stacked) -> (the weight's own shape, its
    # inner spec entries), for EVERY weight of `ens` (unsplit ones with no
    # "model" entry), so that the longest path suffix finds the right weight;
    # `None` when no weight is split.
    table: dict[Any, Any] = {}
    split = False
    for part, stacked in ((ens.members, True), (ens.shared, False)):
        if part is None:
            continue
        for path, leaf in jtu.tree_flatten_with_path(part)[0]:
            if not eqx.is_array(leaf):
                continue
            own = tuple(leaf.shape[1:] if stacked else leaf.shape)
            inner = inner_of(leaf, mesh)
            split = split or inner is not None
            entries = (None,) * len(own) if inner is None else inner[-len(own) :]
            table[(tuple(path), stacked)] = (own, entries if own else ())
    return table if split else None


def _lookup(
    table: dict[Any, Any],
    path: tuple[Any, ...],
    shape: tuple[int, ...],
    stacked: bool,
) -> tuple[Any, ...] | None:
    """The inner spec for a state leaf at `path`: that of the weight whose path
    is the longest suffix of `path`, if the leaf's own axes end with the
    weight's shape (an optimizer moment: equal; a SWAG deviation or a
    snapshot buffer: extra leading axes, unsplit)."""
    own = tuple(shape[1:] if stacked else shape)
    for start in range(len(path)):  # the longest suffix first
        found = table.get((path[start:], stacked))
        if found is None:
            continue
        weight_shape, entries = found
        if not weight_shape or MODEL not in entries:
            return None
        extra = len(own) - len(weight_shape)
        if extra < 0 or own[extra:] != weight_shape:
            return None
        return (None,) * extra + tuple(entries)
    return None


# ---------------------------------------------------------------------------
# Inside compiled code (private: used by `fit` and `make_step`).


def constrain(
    tree: PyTree[Any],
    mesh: Mesh | None,
    axes: Sequence[str | None],
    *,
    weights: bool = False,
) -> Any:
    """Pin the sharding of every array leaf of `tree` (inside or outside `jit`).
    `weights=True` (weights and the states that follow them) on a mesh with a
    `"model"` axis: pin only the leading axes and keep the rest of each leaf's
    placement (Auto: those axes left to the compiler, which propagates the
    inputs' split; Explicit: carried over from the leaf's type)."""
    if mesh is None:
        return tree
    sharding = NamedSharding(mesh, partition_spec(mesh, axes))
    replicated = NamedSharding(mesh, PartitionSpec())
    explicit = is_explicit(mesh)
    inner = weights and MODEL in mesh.axis_names

    def pin(leaf, split):
        if not eqx.is_array(leaf):
            return leaf
        target = sharding if split else replicated
        if inner:
            target = _keep_inner_target(leaf, mesh, axes if split else (), explicit)
        if explicit:
            return jax.sharding.reshard(leaf, target)
        return jax.lax.with_sharding_constraint(leaf, target)

    return jax.tree.map(pin, tree, per_member_flags(tree, axes))


def _keep_inner_target(
    leaf: Any, mesh: Mesh, axes: Sequence[str | None], explicit: bool
) -> NamedSharding:
    leading = [name if name in mesh.axis_names else None for name in axes]
    rest = leaf.ndim - len(leading)
    if explicit:
        current = tuple(jax.typeof(leaf).sharding.spec)
        current += (None,) * (leaf.ndim - len(current))
        entries = leading + [e if e == MODEL else None for e in current[len(leading) :]]
    else:
        entries = leading + [PartitionSpec.UNCONSTRAINED] * rest
    return NamedSharding(mesh, PartitionSpec(*entries))


def replicate(tree: PyTree[Any], mesh: Mesh | None) -> Any:
    """Every array leaf replicated over the mesh (inside `jit`)."""
    return constrain(tree, mesh, ())


def gather_batch(data: PyTree[Any], indices: Array, mesh: Mesh | None) -> Any:
    """`gather(data, indices)` with the batch split over the mesh: the example axis
    over `"data"`, and a leading member axis of per-member indices over
    `"members"`. Each device gathers only its own part of the batch."""
    if mesh is None:
        return gather(data, indices)
    axes = (MEMBERS, DATA) if indices.ndim == 2 else (DATA,)
    indices = constrain(indices, mesh, axes)
    if is_explicit(mesh):
        sharding = NamedSharding(mesh, partition_spec(mesh, axes))
        return jax.tree.map(
            lambda x: (
                x.at[indices].get(out_sharding=sharding) if eqx.is_array(x) else x
            ),
            data,
        )
    return constrain(gather(data, indices), mesh, axes)


def on_mesh(tree: PyTree[Any], mesh: Mesh | None) -> Any:
    """Leaves already placed on `mesh` stay as they are; the others are replicated
    on it (outside `jit`)."""
    if mesh is None:
        return tree
    replicated = NamedSharding(mesh, PartitionSpec())

    def put(leaf):
        if not eqx.is_array(leaf):
            return leaf
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, NamedSharding) and sharding.mesh == mesh:
            return leaf
        return place_leaf(leaf, replicated, False)

    return jax.tree.map(put, tree)


def model_placement(state: Any, mesh: Mesh | None) -> Any:
    """On a mesh with a `"model"` axis, the shardings of every array leaf of a
    training state's weight fields (those whose metadata says `"stacked"`:
    the ensemble and what follows its weights), read outside `jit`, as a
    hashable record `((path, sharding), ...)` for `place_state` to pin them
    exactly inside `jit`; `None` otherwise."""
    if mesh is None or MODEL not in mesh.axis_names:
        return None
    placed = []
    for field in dataclasses.fields(state):
        if field.metadata.get("member_axis") != "stacked":
            continue
        value = getattr(state, field.name)
        for path, leaf in jtu.tree_flatten_with_path(value)[0]:
            sharding = getattr(leaf, "sharding", None)
            if eqx.is_array(leaf) and isinstance(sharding, NamedSharding):
                key = (jtu.GetAttrKey(field.name), *path)
                placed.append((key, sharding))
    return tuple(placed) or None


def tree_placement(tree: PyTree[Any], mesh: Mesh | None) -> Any:
    """On a mesh with a `"model"` axis, the shardings of every placed array leaf
    of `tree` (outside `jit`), as `model_placement` records them; else `None`."""
    if mesh is None or MODEL not in mesh.axis_names:
        return None
    placed = tuple(
        (tuple(path), leaf.sharding)
        for path, leaf in jtu.tree_flatten_with_path(tree)[0]
        if eqx.is_array(leaf)
        and not is_traced(leaf)
        and isinstance(getattr(leaf, "sharding", None), NamedSharding)
    )
    return placed or None


def pin_placement(tree: PyTree[Any], placement: Any, mesh: Mesh | None) -> Any:
    """Inside `jit`: `tree`'s leaves recorded in `placement` pinned there."""
    if placement is None or mesh is None:
        return tree
    return _pin_placement(tree, placement, mesh)


def restore_placement(tree: PyTree[Any], placement: Any) -> Any:
    """`tree` (outside `jit`) with the leaves `placement` records put back where
    they were (e.g. after a controller rebuilt some on the host)."""
    if placement is None:
        return tree
    table = dict(placement)

    def put(path, leaf):
        sharding = table.get(tuple(path))
        if sharding is None or not eqx.is_array(leaf):
            return leaf
        return place_leaf(leaf, sharding, False)

    return jtu.tree_map_with_path(put, tree)


def _pin_placement(tree: PyTree[Any], placement: Any, mesh: Mesh) -> Any:
    table = dict(placement)
    explicit = is_explicit(mesh)

    def pin(path, leaf):
        sharding = table.get(tuple(path))
        if sharding is None or not eqx.is_array(leaf):
            return leaf
        if explicit:
            return jax.sharding.reshard(leaf, sharding)
        return jax.lax.with_sharding_constraint(leaf, sharding)

    return jtu.tree_map_with_path(pin, tree)


def place_state(
    state: Any,
    mesh: Mesh | None,
    *,
    inside_jit: bool = False,
    in_loop: bool = False,
    placement: Any = None,
) -> Any:
    """A training state (a dataclass such as `fit`'s `TrainState`) on `mesh`. Each
    field declares its member axis in its metadata (`"member_axis"`):
    `"stacked"` fields are split over `"members"`; `"bookkeeping"` fields (small
    per-member arrays) are split over `"members"` inside the compiled loop
    (`in_loop=True`, so that a step needs no collective) and replicated outside
    it (readable from every process); other fields are replicated. Inside
    `jit`, `placement` (from `model_placement` of the state outside it) pins
    the leaves split over `"model"` exactly where they were."""
    if mesh is None:
        return state
    changes = {}
    for field in dataclasses.fields(state):
        kind = field.metadata.get("member_axis")
        per_member = kind == "stacked" or (in_loop and kind == "bookkeeping")
        axes = (MEMBERS,) if per_member else ()
        value = getattr(state, field.name)
        weights = kind == "stacked"
        if inside_jit:
            changes[field.name] = constrain(value, mesh, axes, weights=weights)
        else:
            if weights and field.name != "ensemble":
                value = follow_model(value, getattr(state, "ensemble", None), mesh)
            changes[field.name] = shard(value, mesh, axes=axes)
    state = dataclasses.replace(state, **changes)
    if inside_jit and placement is not None:
        state = _pin_placement(state, placement, mesh)
    return state


def sharded_update(
    vmapped: Callable[..., Any], mesh: Mesh | None, per_member_batch: bool
) -> Callable[..., Any]:
    """Wrap the member-vmapped update `(members, opt_state, batch, keys, state,
    frozen, hyper) -> (members, opt_state, losses, aux, state, diverged)` so that,
    on a mesh, every member-mapped input and output is split over `"members"` and
    the batch over `"data"` (Explicit meshes need every mapped input of a `vmap`
    sharded alike; Auto meshes get the placement pinned instead of guessed)."""
    if mesh is None:
        return vmapped
    batch_axes = (MEMBERS, DATA) if per_member_batch else (DATA,)

    def update(members, opt_state, batch, keys, state, frozen, hyper):
        members, opt_state, keys, state, frozen, hyper = constrain(
            (members, opt_state, keys, state, frozen, hyper),
            mesh,
            (MEMBERS,),
            weights=True,
        )
        batch = constrain(batch, mesh, batch_axes)
        outputs = vmapped(members, opt_state, batch, keys, state, frozen, hyper)
        return constrain(outputs, mesh, (MEMBERS,), weights=True)

    return update
