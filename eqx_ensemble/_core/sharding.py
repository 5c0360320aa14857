"""Placement on a mesh's axes: `"members"` (the member axis), `"data"` (the example
axis) and `"model"` (a member's own axes, the user's via `shard(..., model=)`; every
placement the library makes keeps it). Not `eqx.filter_shard`: it fails on
`AxisType.Explicit` meshes."""

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
    MEMBERS,
    MODEL,
    axis_size,
    check_axes,
    check_mesh,
    divisibility_error,
    partition_spec,
)
from .._internal.tree import is_traced, keystr
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


def place_leaf(leaf: Any, sharding: NamedSharding, process_local: bool) -> Array:
    """Place one array leaf (outside `jit`) with `sharding`."""
    if _is_key(leaf):
        impl = jax.random.key_impl(leaf)
        data = place_leaf(jax.random.key_data(leaf), sharding, process_local)
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
    # Several processes, each holding the whole value: each gives its own shards.
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

    An axis the mesh lacks leaves that array axis unsplit. Non-array leaves are
    returned untouched. Works outside `jit`; placed leaves are not copied.

    **Arguments:**

    - `tree`: any PyTree (an `ee.Ensemble`, an optax state, `(x, y)` data...).
    - `mesh`: a mesh from [`make_mesh`][eqx_ensemble.make_mesh] (or any
      `jax.sharding.Mesh` with axes named `"members"` and/or `"data"`).
    - `axes`: which mesh axes the leading array axes are split over, in order.
    - `model`: for an ensemble on a mesh with a `"model"` axis, a function
      `spec_fn(member) -> specs`: given one member (its leaves
      `jax.ShapeDtypeStruct`s, for which `eqx.is_array` is `False`), a PyTree
      (or a prefix) of `jax.sharding.PartitionSpec`s over the member's own axes
      naming `"model"` where a leaf splits, or `None` (replicated). Specs that
      split no leaf over a `"model"` axis of several devices are refused. Each
      member's leaf is split `("members", *spec)`, a shared leaf `spec`. `fit`,
      `make_step` and `init_optimizer` keep the split (an optimizer state's
      leaves follow their weights).
    - `process_local`: in a multi-process run, `tree` holds only THIS process's
      part of the global arrays (e.g. its rows of the data, see
      [`process_rows`][eqx_ensemble.process_rows]). Default: every process passes
      the same whole value.

    **Returns:**

    The same tree with every array leaf a `jax.Array` with sharding
    `NamedSharding(mesh, PartitionSpec(*axes))`.

    **Raises:**

    `ValueError` before any transfer if a split axis is not divisible by its number
    of devices (the message names the leaf and sizes that work). It never pads.

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
    # A shared part (and its optimizer state) has no member axis: replicated.
    per_member = per_member_flags(tree, axes)
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

    def target(leaf: Any, split: bool) -> NamedSharding:
        if MODEL in mesh.axis_names:
            # A leaf already split over "model" keeps that split (see the module).
            return _with_inner(mesh, axes if split else (), leaf)
        return sharding if split else replicated

    return jax.tree.map(
        lambda leaf, split: (
            place_leaf(leaf, target(leaf, split), process_local)
            if eqx.is_array(leaf)
            else leaf
        ),
        tree,
        per_member,
    )


def inner_of(leaf: Any, mesh: Mesh) -> tuple[Any, ...] | None:
    """The `"model"` entries of a placed leaf's spec (others `None`), or `None`
    when it is not split over `"model"` (a split on another mesh carries over)."""
    del mesh
    sharding = getattr(leaf, "sharding", None)
    if not isinstance(sharding, NamedSharding) or MODEL not in sharding.mesh.axis_names:
        return None
    entries = tuple(sharding.spec) + (None,) * (leaf.ndim - len(sharding.spec))
    entries = tuple(single_axis(entry) for entry in entries)
    inner = tuple(entry if entry == MODEL else None for entry in entries)
    return inner if MODEL in inner else None


def _with_inner(mesh: Mesh, axes: Sequence[str], leaf: Any) -> NamedSharding:
    """`leaf`'s leading axes over `axes`, keeping its `"model"` split."""
    leading = [name if name in mesh.axis_names else None for name in axes]
    inner = inner_of(leaf, mesh)
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
    entries = tuple(single_axis(entry) for entry in spec)
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
    from .ensemble import Ensemble

    _check_model_call(tree, mesh, axes, spec_fn, process_local, Ensemble)
    member = eqx.filter_eval_shape(lambda ens: ens.member(first_of(ens.members)), tree)
    is_none = lambda x: x is None  # noqa: E731
    members_leaves = jtu.tree_leaves(tree.members, is_leaf=is_none)
    shared_leaves = (
        jtu.tree_leaves(tree.shared, is_leaf=is_none)
        if tree.shared is not None
        else [None] * len(members_leaves)
    )
    # Every leaf is checked before any is placed: a bad spec transfers nothing.
    plan = _model_plan(
        mesh, member, _member_specs(spec_fn, member), members_leaves, shared_leaves
    )
    members_out = [
        leaf if sharding is None else place_leaf(leaf, sharding, process_local)
        for leaf, (sharding, _) in zip(members_leaves, plan, strict=True)
    ]
    shared_out = [
        leaf if sharding is None else place_leaf(leaf, sharding, process_local)
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


def _check_model_call(
    tree: Any, mesh: Mesh, axes: tuple[str, ...], spec_fn: Any, process_local: bool,
    ensemble_type: type,
) -> None:  # fmt: skip
    """`shard(..., model=)`'s arguments, before any work."""
    if not isinstance(tree, ensemble_type):
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


def _is_spec(x: Any) -> bool:
    return x is None or isinstance(x, PartitionSpec)


def _member_specs(spec_fn: Any, member: Any) -> list[Any]:
    """`spec_fn(member)` (a prefix) as one spec per leaf of the member."""
    try:
        prefix = spec_fn(member)
    except Exception as error:
        raise ValueError(
            f"`model=` failed on a member (its leaves are ShapeDtypeStructs): {error!r}"
        ) from error
    try:
        full = jax.tree.map(
            lambda spec, sub: jax.tree.map(lambda _: spec, sub),
            prefix,
            member,
            is_leaf=_is_spec,
        )
    except ValueError as error:
        raise ValueError(
            "`model=` must return a PyTree of PartitionSpecs (or None) whose "
            f"structure is a prefix of the member's: {error}"
        ) from None
    return jtu.tree_leaves(full, is_leaf=_is_spec)


def _model_plan(
    mesh: Mesh, member: Any, specs: list[Any], members_leaves: list[Any],
    shared_leaves: list[Any],
) -> list[tuple[Any, Any]]:  # fmt: skip
    """Per leaf, its sharding in the members and in the shared part (`None`:
    not an array there), every spec checked."""
    member_paths = jtu.tree_flatten_with_path(member, is_leaf=lambda x: x is None)[0]
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
    return plan


def first_of(members: Any) -> Any:
    return jax.tree.map(lambda x: x[0] if eqx.is_array(x) else x, members)


def single_axis(entry: Any) -> Any:
    # `P(("model",))` names the same split as `P("model")`.
    if isinstance(entry, tuple) and len(entry) == 1:
        return entry[0]
    return entry


def per_member_flags(tree: PyTree[Any], axes: Sequence[str | None]) -> PyTree[Any]:
    if axes and axes[0] == MEMBERS:
        return member_axis_mask(tree)
    return jtu.tree_map(lambda _: True, tree)
