"""Meshes and placement: the member axis, the data axis and the inside of a member
across devices and hosts.

Three mesh axes, with fixed names: `"members"` splits the leading member axis of an
ensemble (its optimizer and model states too); `"data"` splits the example axis of
data and batches; `"model"` splits the inside of a member (its weights' own axes,
as `ee.shard(ens, mesh, model=spec_fn)` places them: tensor-parallel or FSDP-style
splits), and a shared part's. The library places the member and data axes; a
leaf's `"model"` placement is the user's, and every placement the library makes
keeps it (outside `jit` by reading it from the array, inside by leaving those
array axes to the compiler on Auto meshes and by carrying them over on Explicit
ones). A mesh may have any of the axes.

The same helpers work for `AxisType.Auto` meshes (the compiler propagates shardings;
we pin them with `with_sharding_constraint`) and `AxisType.Explicit` meshes (shardings
are part of the types; we move them with `jax.sharding.reshard` and give gathers an
`out_sharding`). `eqx.filter_shard` is not used: it fails on Explicit meshes.
"""

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jaxtyping import Array, PyTree

from .._execution.placement import (
    DATA,
    MEMBERS,
    MODEL,
    axis_size,
    check_axes,
    check_mesh,
    divisibility_error,
    is_explicit,
    partition_spec,
)
from .._internal.tree import is_traced, keystr
from .data import gather
from .ensemble import member_axis_mask


def _check_leaf(path: Any, leaf: Any, mesh: Mesh, axes: Sequence[str], what: str):
    where = f"{what} leaf `{keystr(path)}`" if path else what
    shape = tuple(np.shape(leaf))
    if len(shape) < len(axes):
        raise ValueError(
            f"{where} has shape {shape}, but splitting it over the mesh needs "
            f"{len(axes)} leading array axes ({', '.join(axes)}); replicate it "
            "instead with `axes=()`"
        )
    for position, name in enumerate(axes):
        devices = axis_size(mesh, name)
        if shape[position] % devices:
            raise divisibility_error(name, shape[position], devices, where)


def _is_key(leaf: Any) -> bool:
    return jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key)


def _same_placement(leaf: Any, sharding: NamedSharding) -> bool:
    return (
        isinstance(leaf, jax.Array)
        and not is_traced(leaf)
        and leaf.sharding.is_equivalent_to(sharding, leaf.ndim)
    )


def _place(leaf: Any, sharding: NamedSharding, process_local: bool) -> Array:
    """Place one array leaf (outside `jit`) with `sharding`."""
    if _is_key(leaf):
        impl = jax.random.key_impl(leaf)
        data = _place(jax.random.key_data(leaf), sharding, process_local)
        return jax.random.wrap_key_data(data, impl=impl)
    if process_local:
        return jax.make_array_from_process_local_data(sharding, np.asarray(leaf))
    if _same_placement(leaf, sharding):
        return leaf
    if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
        # Already global (several processes): move it with a compiled identity.
        return jax.jit(lambda x: x, out_shardings=sharding)(leaf)
    if sharding.is_fully_addressable:
        return jax.device_put(leaf, sharding)
    # Several processes: every process holds the same whole value; each one
    # contributes the shards its own devices hold.
    host = np.asarray(leaf)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def shard(
    tree: PyTree[Any],
    mesh: Mesh,
    *,
    axes: str | Sequence[str] = MEMBERS,
    model: Callable[[Any], PyTree[PartitionSpec | None]] | None = None,
    process_local: bool = False,
) -> PyTree[Any]:
    """Place every array leaf of `tree` on `mesh`: leading axes split, rest replicated.

    - An ensemble, its optimizer state and its model state: `shard(tree, mesh)`
      splits the leading member axis over the mesh axis `"members"`.
    - Data: `shard((x, y), mesh, axes="data")` splits the example axis over `"data"`.
    - Per-member batches `(members, batch, ...)`: `axes=("members", "data")`.
    - `axes=()` replicates every leaf on every device of the mesh.

    An axis the mesh does not have leaves that array axis unsplit (so the same code
    works with member-only, data-only and 2-D meshes). Non-array leaves are
    returned untouched. Works outside `jit`; already placed leaves are not copied.

    **Arguments:**

    - `tree`: any PyTree (an `ee.Ensemble`, an optax state, `(x, y)` data...).
    - `mesh`: a mesh from [`make_mesh`][eqx_ensemble.make_mesh] (or any
      `jax.sharding.Mesh` with axes named `"members"` and/or `"data"`).
    - `axes`: which mesh axes the leading array axes are split over, in order.
    - `model`: for an ensemble on a mesh with a `"model"` axis, a function
      `spec_fn(member) -> specs`: given one member (its leaves
      `jax.ShapeDtypeStruct`s without the member axis; a shared part's leaves
      in their place), a PyTree of `jax.sharding.PartitionSpec`s over the
      member's own array axes naming `"model"` where a leaf splits, or `None`
      (replicated); a prefix of the member's structure is fine (one spec for a
      whole layer). The leaves are `ShapeDtypeStruct`s, not arrays:
      `eqx.is_array` is `False` for them. A spec that splits no leaf over a
      `"model"` axis of more than one device is refused. Each member's leaf
      is then split `("members", *spec)`, a shared part's leaf `spec`
      (replicated over `"members"`).
      `ee.fit`, `ee.make_step`, `ee.init_optimizer` and the placements of the
      library keep a leaf's `"model"` split; an optimizer state's leaves
      follow the weights they belong to (matched by path and shape).
    - `process_local`: in a multi-process run, `tree` holds only THIS process's
      part of the global arrays (e.g. its rows of the data, see
      [`process_rows`][eqx_ensemble.process_rows]); the global arrays are assembled
      with `jax.make_array_from_process_local_data`. Default: every process passes
      the same whole value.

    **Returns:**

    The same tree with every array leaf a `jax.Array` with sharding
    `NamedSharding(mesh, PartitionSpec(*axes))`.

    **Raises:**

    `ValueError` before any transfer if a split axis is not divisible by its number
    of devices (e.g. 6 members on a 4-device `"members"` axis); the message names
    the leaf, both numbers and sizes that work. Sharding never pads.

    **Example:**

    ```python
    mesh = ee.make_mesh(members=4, data=2)
    ens = ee.ensemble(lambda k: eqx.nn.MLP(3, 1, 8, 1, key=k), size=8,
                      key=jax.random.key(0))
    ens = ee.shard(ens, mesh)                 # 2 members per 'members' device
    ens.members.layers[0].weight.sharding.spec   # PartitionSpec('members',)
    x = ee.shard(jnp.ones((32, 3)), mesh, axes="data")
    x.sharding.spec                           # PartitionSpec('data',)

    # Inside each member (Megatron-style): the first layer split by rows, the
    # second by columns, over the 2 devices of the "model" axis.
    mesh = ee.make_mesh(members=2, data=2, model=2)
    P = jax.sharding.PartitionSpec

    def spec_fn(member):
        specs = eqx.tree_at(
            lambda m: (m.layers[0].weight, m.layers[0].bias, m.layers[1].weight),
            member, (P("model", None), P("model"), P(None, "model")))
        return jax.tree.map(lambda s: s if isinstance(s, P) else None, specs)

    big = ee.ensemble(lambda k: eqx.nn.MLP(3, 1, 16, 1, key=k), size=2,
                      key=jax.random.key(0))
    big = ee.shard(big, mesh, model=spec_fn)
    big.members.layers[0].weight.sharding.spec   # P('members', 'model')
    big.members.layers[1].weight.sharding.spec   # P('members', None, 'model')
    ```
    """
    mesh = check_mesh(mesh)
    axes = check_axes(axes)
    if model is not None:
        return _shard_model(tree, mesh, axes, model, process_local)
    spec = partition_spec(mesh, axes)
    sharding = NamedSharding(mesh, spec)
    replicated = NamedSharding(mesh, PartitionSpec())
    leaves = jtu.tree_flatten_with_path(tree)[0]
    # An ensemble's shared part (and its optimizer state) has no member axis: it
    # is replicated wherever the members are split.
    per_member = _per_member_flags(tree, axes)
    what = "the tree" if axes == (MEMBERS,) else "the data"
    for (path, leaf), split in zip(leaves, jtu.tree_leaves(per_member)):
        if eqx.is_array(leaf):
            if is_traced(leaf):
                raise ValueError(
                    "`ee.shard` places arrays outside `jit`; inside compiled code "
                    "the library constrains shardings itself (pass `mesh=` to "
                    "`fit`/`make_step`)"
                )
            if not process_local and split:
                _check_leaf(path, leaf, mesh, axes, what)
    if MODEL in mesh.axis_names:
        # A leaf already split over "model" keeps that split (see the module).
        return jax.tree.map(
            lambda leaf, split: (
                _place(
                    leaf,
                    _with_inner(mesh, axes if split else (), leaf),
                    process_local,
                )
                if eqx.is_array(leaf)
                else leaf
            ),
            tree,
            per_member,
        )
    return jax.tree.map(
        lambda leaf, split: (
            _place(leaf, sharding if split else replicated, process_local)
            if eqx.is_array(leaf)
            else leaf
        ),
        tree,
        per_member,
    )


def _inner_of(leaf: Any, mesh: Mesh) -> tuple[Any, ...] | None:
    """The `"model"` entries of a placed leaf's spec (others `None`), or `None`
    when it is not split over `"model"`. A split made on another mesh with a
    `"model"` axis carries over to `mesh` when it has one too (a run moved to
    another mesh keeps its members' split)."""
    del mesh
    sharding = getattr(leaf, "sharding", None)
    if not isinstance(sharding, NamedSharding) or MODEL not in sharding.mesh.axis_names:
        return None
    entries = tuple(sharding.spec) + (None,) * (leaf.ndim - len(sharding.spec))
    entries = tuple(_single(entry) for entry in entries)
    inner = tuple(entry if entry == MODEL else None for entry in entries)
    return inner if MODEL in inner else None


def _with_inner(mesh: Mesh, axes: Sequence[str], leaf: Any) -> NamedSharding:
    """`leaf`'s leading axes over `axes`, and the `"model"` split it already has
    on its other axes."""
    leading = [name if name in mesh.axis_names else None for name in axes]
    inner = _inner_of(leaf, mesh)
    entries = list(leading)
    if inner is not None:
        entries += list(inner[len(leading) :])
    while entries and entries[-1] is None:
        entries.pop()
    return NamedSharding(mesh, PartitionSpec(*entries))


def _check_inner_spec(
    path: Any, spec: Any, shape: tuple[int, ...], mesh: Mesh, where: str
) -> tuple[Any, ...]:
    name = f"{where} leaf `{keystr(path)}`"
    if spec is None:
        return ()
    if not isinstance(spec, PartitionSpec):
        raise TypeError(
            f"`model=` gave {type(spec).__name__} for {name}; give a "
            "`jax.sharding.PartitionSpec` (over the member's own axes) or None"
        )
    entries = tuple(_single(entry) for entry in spec)
    for entry in entries:
        if entry is not None and entry != MODEL:
            raise ValueError(
                f"`model=` gave {spec} for {name}: inside a member only the mesh "
                f"axis '{MODEL}' may split a leaf ('members' and 'data' are placed by "
                "the library); use P('model', ...) or None"
            )
    if entries.count(MODEL) > 1:
        raise ValueError(f"`model=` names '{MODEL}' twice in {spec} for {name}")
    if len(entries) > len(shape):
        raise ValueError(
            f"`model=` gave {spec} ({len(entries)} axes) for {name}, which has "
            f"shape {shape} ({len(shape)} axes of its own)"
        )
    devices = axis_size(mesh, MODEL)
    for axis, entry in enumerate(entries):
        if entry == MODEL and shape[axis] % devices:
            raise ValueError(
                f"{name} has shape {shape}; its axis {axis} ({shape[axis]}) does not "
                f"split evenly over the {devices} devices of the mesh axis "
                f"'{MODEL}'; choose a leaf axis that is a multiple of {devices}, "
                "or leave this leaf replicated (None)"
            )
    return entries


def _shard_model(
    tree: Any, mesh: Mesh, axes: tuple[str, ...], spec_fn: Any, process_local: bool
) -> Any:
    """`shard(ens, mesh, model=spec_fn)`: each member leaf split over `"members"`
    and its own axes as `spec_fn(member)` says; a shared part's leaves over their
    axes only."""
    from .ensemble import Ensemble

    if not isinstance(tree, Ensemble):
        raise TypeError(
            "`model=` places the inside of an ensemble's members: pass an "
            f"`ee.Ensemble`, got {type(tree).__name__} (an optimizer state made by "
            "`ee.init_optimizer` follows its ensemble's placement)"
        )
    if MODEL not in mesh.axis_names:
        raise ValueError(
            f"`model=` splits leaves over the mesh axis '{MODEL}', which this mesh "
            f"(axes {tuple(mesh.axis_names)}) does not have; build it with "
            "`ee.make_mesh(..., model=n)`"
        )
    if axes != (MEMBERS,):
        raise ValueError("`model=` places an ensemble: leave `axes` at 'members'")
    if process_local:
        raise ValueError(
            "`model=` takes the whole ensemble in every process (as `ee.ensemble` "
            "builds it from the same key everywhere); `process_local=True` is for "
            "each process's rows of the data"
        )
    if not callable(spec_fn):
        raise TypeError(
            f"`model` must be a function member -> PartitionSpecs, got {spec_fn!r}"
        )
    member = eqx.filter_eval_shape(lambda ens: ens.member(_first(ens.members)), tree)
    try:
        prefix = spec_fn(member)
    except Exception as error:
        raise ValueError(
            f"`model=` failed on a member (its leaves are ShapeDtypeStructs): {error!r}"
        ) from error

    def is_spec(x: Any) -> bool:
        return x is None or isinstance(x, PartitionSpec)

    try:
        full = jax.tree.map(
            lambda spec, sub: jax.tree.map(lambda _: spec, sub),
            prefix,
            member,
            is_leaf=is_spec,
        )
    except ValueError as error:
        raise ValueError(
            "`model=` must return a PyTree of PartitionSpecs (or None) whose "
            f"structure is a prefix of the member's: {error}"
        ) from None
    is_none = lambda x: x is None  # noqa: E731
    member_paths = jtu.tree_flatten_with_path(member, is_leaf=is_none)[0]
    specs = jtu.tree_leaves(full, is_leaf=is_spec)
    members_leaves = jtu.tree_leaves(tree.members, is_leaf=is_none)
    shared_leaves = (
        jtu.tree_leaves(tree.shared, is_leaf=is_none)
        if tree.shared is not None
        else [None] * len(members_leaves)
    )
    # Every leaf is checked before any is placed: a bad spec transfers nothing.
    plan: list[tuple[Any, Any]] = []
    splits = False
    for (path, shape_leaf), spec, stacked, held in zip(
        member_paths, specs, members_leaves, shared_leaves, strict=True
    ):
        if not isinstance(shape_leaf, jax.ShapeDtypeStruct):  # not an array
            plan.append((None, None))
            continue
        where = "the shared part" if eqx.is_array(held) else "the members"
        entries = _check_inner_spec(path, spec, tuple(shape_leaf.shape), mesh, where)
        member_sharding = shared_sharding = None
        if eqx.is_array(stacked):
            if not process_local:
                _check_leaf(path, stacked, mesh, (MEMBERS,), "the ensemble")
            member_sharding = NamedSharding(
                mesh, partition_spec(mesh, (MEMBERS, *entries))
            )
        if eqx.is_array(held):
            shared_sharding = NamedSharding(mesh, partition_spec(mesh, entries))
        plan.append((member_sharding, shared_sharding))
        splits = splits or MODEL in entries
    if not splits and mesh.shape[MODEL] > 1:
        raise ValueError(
            f"`model=` split no leaf over the mesh's '{MODEL}' axis (of "
            f"{mesh.shape[MODEL]} devices): every spec it returned is `None` or "
            f"names no '{MODEL}', so each weight would stay whole on every one of "
            "those devices. `spec_fn` receives the member with "
            "`jax.ShapeDtypeStruct` leaves, which `eqx.is_array` does not count "
            "(`eqx.filter(member, eqx.is_array)` filters out everything): select "
            "leaves with `eqx.tree_at` or `lambda x: isinstance(x, "
            "jax.ShapeDtypeStruct)`. A mesh without a model split needs no `model=`."
        )
    members_out = [
        leaf if sharding is None else _place(leaf, sharding, process_local)
        for leaf, (sharding, _) in zip(members_leaves, plan, strict=True)
    ]
    shared_out = [
        leaf if sharding is None else _place(leaf, sharding, process_local)
        for leaf, (_, sharding) in zip(shared_leaves, plan, strict=True)
    ]
    members = jtu.tree_unflatten(
        jtu.tree_structure(tree.members, is_leaf=is_none), members_out
    )
    shared = (
        None
        if tree.shared is None
        else jtu.tree_unflatten(
            jtu.tree_structure(tree.shared, is_leaf=is_none), shared_out
        )
    )
    return Ensemble(members, shared, train_shared=tree.train_shared)


def _first(members: Any) -> Any:
    return jax.tree.map(lambda x: x[0] if eqx.is_array(x) else x, members)


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
        return _place(leaf, NamedSharding(mesh, partition_spec(mesh, entries)), False)

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
            and _inner_of(leaf, mesh) is not None
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


def _single(entry: Any) -> Any:
    # `P(("model",))` names the same split as `P("model")`.
    if isinstance(entry, tuple) and len(entry) == 1:
        return entry[0]
    return entry


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
            inner = _inner_of(leaf, mesh)
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


def _per_member_flags(tree: PyTree[Any], axes: Sequence[str | None]) -> PyTree[Any]:
    if axes and axes[0] == MEMBERS:
        return member_axis_mask(tree)
    return jtu.tree_map(lambda _: True, tree)


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

    return jax.tree.map(pin, tree, _per_member_flags(tree, axes))


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
        return _place(leaf, replicated, False)

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
        return _place(leaf, sharding, False)

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
