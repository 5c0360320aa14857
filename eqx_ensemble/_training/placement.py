"""Placement inside `fit` and `make_step`, as one object per run: `SingleDevice`
(no mesh: arrays stay where JAX puts them) or `OnMesh`. `placement_of(mesh)`
chooses; nothing else asks whether there is a mesh."""

import contextlib
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.tree_util as jtu
import numpy as np
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
    axis_size,
    check_fit_mesh,
    check_step_mesh,
    is_explicit,
    partition_spec,
)
from .._internal.tree import is_traced


class SingleDevice:
    """A run on one device, JAX's default (no mesh): placing is a no-op. One
    instance (`SINGLE_DEVICE`): equal programs see the same static value."""

    mesh = None
    sharded = False
    members_devices = 1

    @property
    def devices(self) -> int:
        return 1

    @property
    def local_devices(self) -> int:
        return 1

    @property
    def platform(self) -> str:
        return jax.default_backend()

    def to_host(self, value: Any) -> np.ndarray:
        """One array on the host: `np.asarray` on a CPU (no transfer), else
        `jax.device_get` (explicit: allowed by a `"disallow"` transfer guard)."""
        return np.asarray(value) if self.platform == "cpu" else jax.device_get(value)

    def context(self) -> Any:
        return contextlib.nullcontext()

    def check_fit(self, size: int, batch_size: int) -> None:
        del size, batch_size

    def check_step(self, size: int, batch: Any, per_member_batch: bool) -> None:
        del size, batch, per_member_batch

    def shard(self, tree: PyTree[Any]) -> Any:
        return tree

    def follow_model(self, tree: PyTree[Any], ens: Any) -> PyTree[Any]:
        del ens
        return tree

    def constrain(
        self, tree: PyTree[Any], axes: Sequence[str | None], *, weights: bool = False
    ) -> Any:
        del axes, weights
        return tree

    def replicate(self, tree: PyTree[Any]) -> Any:
        return tree

    def gather_batch(self, data: PyTree[Any], indices: Array) -> Any:
        return gather(data, indices)

    def on_mesh(self, tree: PyTree[Any]) -> Any:
        return tree

    def model_placement(self, state: Any) -> Any:
        del state

    def tree_placement(self, tree: PyTree[Any]) -> Any:
        del tree

    def pin(self, tree: PyTree[Any], placement: Any) -> Any:
        del placement
        return tree

    def place_state(
        self, state: Any, *, inside_jit: bool = False, in_loop: bool = False,
        placement: Any = None,
    ) -> Any:  # fmt: skip
        del inside_jit, in_loop, placement
        return state

    def sharded_update(
        self, vmapped: Callable[..., Any], per_member_batch: bool
    ) -> Callable[..., Any]:
        del per_member_batch
        return vmapped


SINGLE_DEVICE = SingleDevice()


@dataclasses.dataclass(frozen=True)
class OnMesh(SingleDevice):
    """A run on `mesh`: members split over its `"members"` axis, batches over
    `"data"`, weights that `ee.shard` split over `"model"` kept so."""

    mesh: Mesh  # pyright: ignore[reportIncompatibleVariableOverride]
    sharded = True

    @property
    def members_devices(self) -> int:  # pyright: ignore[reportIncompatibleVariableOverride]
        return axis_size(self.mesh, MEMBERS)

    @property
    def devices(self) -> int:
        return self.mesh.size

    @property
    def local_devices(self) -> int:
        index = jax.process_index()
        return sum(d.process_index == index for d in self.mesh.devices.flat)

    @property
    def platform(self) -> str:
        return self.mesh.devices.flat[0].platform

    def to_host(self, value: Any) -> np.ndarray:
        return jax.device_get(value)

    def context(self) -> Any:
        return jax.set_mesh(self.mesh)

    def check_fit(self, size: int, batch_size: int) -> None:
        check_fit_mesh(self.mesh, size, batch_size)

    def check_step(self, size: int, batch: Any, per_member_batch: bool) -> None:
        check_step_mesh(self.mesh, size, batch, per_member_batch)

    def shard(self, tree: PyTree[Any]) -> Any:
        return shard(tree, self.mesh)

    def follow_model(self, tree: PyTree[Any], ens: Any) -> PyTree[Any]:
        return _follow_model(tree, ens, self.mesh)

    def constrain(
        self, tree: PyTree[Any], axes: Sequence[str | None], *, weights: bool = False
    ) -> Any:
        """Pin the sharding of every array leaf of `tree`. `weights=True` on a
        mesh with a `"model"` axis pins only the leading axes, keeping the rest
        of each leaf's placement."""
        mesh = self.mesh
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

    def replicate(self, tree: PyTree[Any]) -> Any:
        """Every array leaf replicated over the mesh (inside `jit`)."""
        return self.constrain(tree, ())

    def gather_batch(self, data: PyTree[Any], indices: Array) -> Any:
        """`gather(data, indices)` split over `"data"` (and `"members"` for
        per-member indices): each device gathers only its own part."""
        axes = (MEMBERS, DATA) if indices.ndim == 2 else (DATA,)
        indices = self.constrain(indices, axes)
        if is_explicit(self.mesh):
            sharding = NamedSharding(self.mesh, partition_spec(self.mesh, axes))
            return jax.tree.map(
                lambda x: (
                    x.at[indices].get(out_sharding=sharding) if eqx.is_array(x) else x
                ),
                data,
            )
        return self.constrain(gather(data, indices), axes)

    def on_mesh(self, tree: PyTree[Any]) -> Any:
        """Leaves not yet on the mesh replicated on it (outside `jit`)."""
        replicated = NamedSharding(self.mesh, PartitionSpec())

        def put(leaf):
            if not eqx.is_array(leaf):
                return leaf
            sharding = getattr(leaf, "sharding", None)
            if isinstance(sharding, NamedSharding) and sharding.mesh == self.mesh:
                return leaf
            return place_leaf(leaf, replicated, False)

        return jax.tree.map(put, tree)

    def model_placement(self, state: Any) -> Any:
        """With a `"model"` axis, the shardings of a training state's `"stacked"`
        fields' leaves, read outside `jit`, as `((path, sharding), ...)` for
        `place_state` to pin inside it; `None` otherwise."""
        if MODEL not in self.mesh.axis_names:
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

    def tree_placement(self, tree: PyTree[Any]) -> Any:
        """With a `"model"` axis, the shardings of every placed array leaf of
        `tree` (outside `jit`), as `model_placement` records them."""
        if MODEL not in self.mesh.axis_names:
            return None
        placed = tuple(
            (tuple(path), leaf.sharding)
            for path, leaf in jtu.tree_flatten_with_path(tree)[0]
            if eqx.is_array(leaf)
            and not is_traced(leaf)
            and isinstance(getattr(leaf, "sharding", None), NamedSharding)
        )
        return placed or None

    def pin(self, tree: PyTree[Any], placement: Any) -> Any:
        """Inside `jit`: `tree`'s leaves recorded in `placement` pinned there."""
        if placement is None:
            return tree
        table, explicit = dict(placement), is_explicit(self.mesh)

        def pin(path, leaf):
            sharding = table.get(tuple(path))
            if sharding is None or not eqx.is_array(leaf):
                return leaf
            if explicit:
                return jax.sharding.reshard(leaf, sharding)
            return jax.lax.with_sharding_constraint(leaf, sharding)

        return jtu.tree_map_with_path(pin, tree)

    def place_state(
        self, state: Any, *, inside_jit: bool = False, in_loop: bool = False,
        placement: Any = None,
    ) -> Any:  # fmt: skip
        """A training state on the mesh, by each field's `"member_axis"`
        metadata: `"stacked"` split over `"members"`; `"bookkeeping"` split
        inside the loop (`in_loop`: no collective per step) and replicated
        outside (readable by every process); others replicated. Inside `jit`,
        `placement` pins the `"model"`-split leaves where they were."""
        changes = {}
        for field in dataclasses.fields(state):
            kind = field.metadata.get("member_axis")
            per_member = kind == "stacked" or (in_loop and kind == "bookkeeping")
            axes = (MEMBERS,) if per_member else ()
            value = getattr(state, field.name)
            weights = kind == "stacked"
            if inside_jit:
                changes[field.name] = self.constrain(value, axes, weights=weights)
            else:
                if weights and field.name != "ensemble":
                    value = _follow_model(
                        value, getattr(state, "ensemble", None), self.mesh
                    )
                changes[field.name] = shard(value, self.mesh, axes=axes)
        state = dataclasses.replace(state, **changes)
        return self.pin(state, placement) if inside_jit else state

    def sharded_update(
        self, vmapped: Callable[..., Any], per_member_batch: bool
    ) -> Callable[..., Any]:
        """The member-vmapped update with its member-mapped inputs and outputs
        pinned over `"members"` and the batch over `"data"` (an Explicit mesh's
        `vmap` needs its inputs sharded alike)."""
        batch_axes = (MEMBERS, DATA) if per_member_batch else (DATA,)

        def update(members, opt_state, batch, keys, state, frozen, hyper):
            members, opt_state, keys, state, frozen, hyper = self.constrain(
                (members, opt_state, keys, state, frozen, hyper),
                (MEMBERS,),
                weights=True,
            )
            batch = self.constrain(batch, batch_axes)
            outputs = vmapped(members, opt_state, batch, keys, state, frozen, hyper)
            return self.constrain(outputs, (MEMBERS,), weights=True)

        return update


Placement = SingleDevice  # (`OnMesh` is one too)


def placement_of(mesh: Mesh | None) -> SingleDevice:
    return SINGLE_DEVICE if mesh is None else OnMesh(mesh)


def _follow_model(tree: PyTree[Any], ens: Any, mesh: Mesh) -> PyTree[Any]:
    """`tree` (an optimizer or tracker state) with each leaf matching a weight
    of `ens` by path suffix and shape given that weight's `"model"` split."""
    if MODEL not in mesh.axis_names or not hasattr(ens, "shared"):
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
    # (path in a member, stacked) -> (own shape, inner spec) for EVERY weight,
    # so the longest path suffix finds the right one; `None`: none is split.
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
    """The inner spec of the weight whose path is the longest suffix of
    `path`, if the leaf's own axes end with its shape (extra leading axes,
    such as a SWAG deviation's, unsplit)."""
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
