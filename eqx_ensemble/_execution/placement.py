"""The device mesh and its rules, knowing nothing of ensembles: the axes the
library places arrays on (`"members"`, `"data"`, `"model"`), `ee.make_mesh`,
the checks of a mesh and of what splits over it, `ee.process_rows`."""

import math
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import equinox as eqx
import jax
import jax.tree_util as jtu
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec
from jaxtyping import PyTree

from .._internal.checks import check_positive_int
from .._internal.tree import keystr


@runtime_checkable
class Devices(Protocol):
    """What a step's plan reads of where it runs (`_training.placement`'s
    `SingleDevice` or `OnMesh`)."""

    @property
    def sharded(self) -> bool: ...  # on a mesh
    @property
    def devices(self) -> int: ...
    @property
    def local_devices(self) -> int: ...  # this process's
    @property
    def platform(self) -> str: ...


MEMBERS = "members"
DATA = "data"
MODEL = "model"
AXIS_NAMES = (MEMBERS, DATA, MODEL)


def check_axis_size(value: Any, name: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(f"`{name}` must be an int or None, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"`{name}` must be at least 1, got {value}")
    return int(value)


def make_mesh(
    members: int | None = None,
    data: int | None = None,
    model: int | None = None,
    *,
    devices: Sequence[Any] | None = None,
    axis_types: AxisType = AxisType.Auto,
) -> Mesh:
    """A device mesh with a `"members"` axis, a `"data"` axis, a `"model"` axis,
    or several of them.

    **Arguments:**

    - `members`: devices along the member axis: the ensemble's members are split
      into this many equal groups. `None`: no member axis.
    - `data`: devices along the data axis: every batch's examples are split into
      this many equal parts. `None`: no data axis.
    - `model`: devices along the model axis: each member's weights are split
      over them where [`shard(..., model=)`][eqx_ensemble.shard] says. `None`:
      no model axis. With none given, every device goes on the member axis.
    - `devices`: the devices to use, `members * data * model` of them (default:
      the first that many of `jax.devices()`; all of them with several
      processes). The model axis is the innermost (adjacent devices).
    - `axis_types`: `jax.sharding.AxisType.Auto` (the default) or
      `AxisType.Explicit` (shardings in the array types). Same results.

    **Returns:**

    A `jax.sharding.Mesh` with the axes given, in the order `("members",
    "data", "model")`, for [`shard`][eqx_ensemble.shard] and
    `ee.Execution(mesh=...)`.

    **Example:**

    ```python
    mesh = ee.make_mesh(members=4, data=2)       # 8 devices: a 4 x 2 grid
    mesh.shape                                   # {'members': 4, 'data': 2}
    members_only = ee.make_mesh(members=2)       # the first 2 devices
    explicit = ee.make_mesh(data=2, axis_types=jax.sharding.AxisType.Explicit)
    three = ee.make_mesh(members=2, data=2, model=2)
    three.axis_names                             # ('members', 'data', 'model')
    ```
    """
    members = check_axis_size(members, "members")
    data = check_axis_size(data, "data")
    model = check_axis_size(model, "model")
    if not isinstance(axis_types, AxisType):
        raise TypeError(
            "`axis_types` must be a `jax.sharding.AxisType` (Auto or Explicit), "
            f"got {axis_types!r}"
        )
    if axis_types == AxisType.Manual:
        raise ValueError("`axis_types` must be AxisType.Auto or AxisType.Explicit")
    available = list(jax.devices()) if devices is None else list(devices)
    for position, device in enumerate(available):
        if not isinstance(device, jax.Device):
            raise TypeError(
                f"`devices[{position}]` is a {type(device).__name__}, not a "
                "`jax.Device`; pass devices from `jax.devices()`"
            )
    repeated = sorted({str(d) for d in available if available.count(d) > 1})
    if repeated:
        raise ValueError(
            f"`devices` lists {', '.join(repeated)} more than once; a mesh places "
            "each device once"
        )
    if members is None and data is None and model is None:
        members = len(available)
    sizes = (members, data, model)
    shape = tuple(size for size in sizes if size is not None)
    names = tuple(
        name for name, size in zip(AXIS_NAMES, sizes, strict=True) if size is not None
    )
    needed = math.prod(shape)
    if devices is None and needed < len(available):
        if jax.process_count() > 1:
            raise ValueError(
                f"The mesh {dict(zip(names, shape))} has {needed} devices, but a "
                f"multi-process run must use all {len(available)} devices "
                f"({jax.process_count()} processes); choose axis sizes whose "
                f"product is {len(available)}"
            )
        available = available[:needed]
    if needed != len(available):
        raise ValueError(
            f"The mesh {dict(zip(names, shape))} needs {needed} devices, but "
            f"{len(available)} {'are' if len(available) != 1 else 'is'} available"
            + ("" if devices is None else " in `devices`")
        )
    return jax.make_mesh(
        shape, names, axis_types=(axis_types,) * len(shape), devices=available
    )


def check_mesh(mesh: Any) -> Mesh:
    """A `Mesh` with the library's axis names, or a clear error."""
    if not isinstance(mesh, Mesh):
        raise TypeError(
            f"`mesh` must be a `jax.sharding.Mesh` (see `ee.make_mesh`), got "
            f"{type(mesh).__name__}"
        )
    ours = [name for name in mesh.axis_names if name in AXIS_NAMES]
    if not ours:
        raise ValueError(
            f"The mesh has axes {tuple(mesh.axis_names)} but eqx_ensemble places "
            f"arrays on axes named {AXIS_NAMES!r}; build it with `ee.make_mesh` or "
            "name your axes 'members', 'data' and/or 'model'"
        )
    kinds = {name: axis_type(mesh, name) for name in ours}
    if AxisType.Manual in kinds.values() or len(set(kinds.values())) > 1:
        raise ValueError(
            f"The mesh axes {ours} must all be AxisType.Auto or all "
            f"AxisType.Explicit, got {kinds}"
        )
    return mesh


def axis_type(mesh: Mesh, name: str) -> AxisType:
    return dict(zip(mesh.axis_names, mesh.axis_types))[name]


def axis_size(mesh: Mesh, name: str) -> int:
    return int(mesh.shape[name]) if name in mesh.axis_names else 1


def partition_spec(mesh: Mesh, axes: Sequence[str | None]) -> PartitionSpec:
    """Leading array axes split over `axes`, dropping the axes `mesh` lacks (`None`:
    that array axis is not split)."""
    entries = [
        name if name is not None and name in mesh.axis_names else None for name in axes
    ]
    while entries and entries[-1] is None:
        entries.pop()
    return PartitionSpec(*entries)


def is_explicit(mesh: Mesh) -> bool:
    return any(
        axis_type(mesh, name) == AxisType.Explicit
        for name in AXIS_NAMES
        if name in mesh.axis_names
    )


def check_axes(axes: Any) -> tuple[str, ...]:
    if isinstance(axes, str):
        axes = (axes,)
    axes = tuple(axes)
    leading = (MEMBERS, DATA)
    if any(name not in leading for name in axes) or len(set(axes)) != len(axes):
        raise ValueError(
            f"`axes` must name the leading array axes, each one of {leading!r} "
            f"(at most once), e.g. 'members', 'data' or ('members', 'data'); got "
            f"{axes!r}"
        )
    return axes


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def divisibility_error(name: str, length: int, devices: int, where: str) -> ValueError:
    if name == MEMBERS:
        above = (length // devices + 1) * devices
        below = (length // devices) * devices
        sizes = ", ".join(str(size) for size in (below, above) if size > 0)
        divisors = ", ".join(map(str, _divisors(length)))
        return ValueError(
            f"{where} has {length} members, which do not split evenly over the "
            f"{devices} devices of the mesh axis 'members' ({length} is not a "
            f"multiple of {devices}). Use an ensemble size that is a multiple of "
            f"{devices} (e.g. {sizes}), or a 'members' axis whose size divides "
            f"{length} ({divisors}), e.g. `ee.make_mesh(members=..., data=...)` with "
            "the other devices on the data axis"
        )
    return ValueError(
        f"{where} has {length} examples along its leading axis, which do not split "
        f"evenly over the {devices} devices of the mesh axis 'data' ({length} is "
        f"not a multiple of {devices}). Use a multiple of {devices} examples "
        f"(e.g. drop the last {length % devices} or pad), a 'data' axis whose size "
        f"divides {length}, or keep this array replicated"
    )


def process_rows(mesh: Mesh, num_examples: int) -> slice:
    """The rows of the data THIS process must feed in a multi-process run.

    Slice your data (or reader) with it and pass the part to
    `shard(part, mesh, axes="data", process_local=True)`. Without a data axis
    split across processes, every process needs every row.

    **Arguments:**

    - `mesh`: the mesh.
    - `num_examples`: the number of examples of the whole (global) data set; a
      multiple of the `"data"` axis size.

    **Returns:**

    A `slice(start, stop)` of the global example axis.

    **Example:**

    ```python
    mesh = ee.make_mesh(members=2, data=4)
    ee.process_rows(mesh, 100)    # slice(0, 100): one process holds every row
    ```
    """
    mesh = check_mesh(mesh)
    num_examples = check_positive_int(num_examples, "num_examples")
    devices = axis_size(mesh, DATA)
    if num_examples % devices:
        raise divisibility_error(DATA, num_examples, devices, "The data")
    sharding = NamedSharding(mesh, partition_spec(mesh, (DATA,)))
    indices = sharding.addressable_devices_indices_map((num_examples,)).values()
    blocks = sorted(
        {index[0].indices(num_examples)[:2] for index in indices if index is not None}
    )
    start, stop = blocks[0][0], blocks[-1][1]
    covered = sum(b - a for a, b in blocks)
    if covered != stop - start:
        raise ValueError(
            f"This process's devices hold non-contiguous rows {blocks} of the data; "
            "order the mesh's devices so each process's data devices are adjacent"
        )
    return slice(start, stop)


def check_fit_mesh(mesh: Any, size: int, batch_size: int) -> Mesh:
    """`fit`'s checks, before any work: the mesh, the member count, the batch."""
    mesh = check_mesh(mesh)
    members = axis_size(mesh, MEMBERS)
    if size % members:
        raise divisibility_error(MEMBERS, size, members, "The ensemble")
    devices = axis_size(mesh, DATA)
    if batch_size % devices:
        raise ValueError(
            f"`batch_size` ({batch_size}) does not split evenly over the {devices} "
            f"devices of the mesh axis 'data'; use a multiple of {devices}"
        )
    return mesh


def check_step_mesh(
    mesh: Any, size: int, batch: PyTree[Any], per_member_batch: bool
) -> None:
    """`make_step`'s checks (at trace time, before any work): the member count and
    the batch's example axis must split evenly over the mesh."""
    mesh = check_mesh(mesh)
    members = axis_size(mesh, MEMBERS)
    if size % members:
        raise divisibility_error(MEMBERS, size, members, "The ensemble")
    axis = 1 if per_member_batch else 0
    devices = axis_size(mesh, DATA)
    for path, leaf in jtu.tree_flatten_with_path(batch)[0]:
        if eqx.is_array(leaf) and leaf.ndim > axis and leaf.shape[axis] % devices:
            raise divisibility_error(
                DATA, leaf.shape[axis], devices, f"`batch` leaf `{keystr(path)}`"
            )
