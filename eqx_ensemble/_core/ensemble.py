"""The `Ensemble` module and `ensemble`: weights born stacked."""

import functools
import os
from collections.abc import Callable
from typing import Any, Generic, TypeVar, cast, overload

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jaxtyping import PRNGKeyArray, PyTree

from .._execution.compile import (
    compiled_call,
    one_shot_jit,
)
from .._internal.keys import check_key, split_member_keys
from .._internal.tree import is_traced, keystr, leading_size
from .mapping import map_members

Member = TypeVar("Member")


class Ensemble(eqx.Module, Generic[Member]):
    """An ensemble of models stored as ONE model whose array leaves are stacked.

    Every array leaf of `members` carries a leading *member* axis; non-array
    leaves are shared by all members. Build one with
    [`ee.ensemble`][eqx_ensemble.ensemble] or [`ee.stack`][eqx_ensemble.stack].

    Members may *share parts* (a frozen backbone under stacked heads): those array
    leaves are held ONCE in `shared`, with `None` in their place in `members`;
    member `i` is `eqx.combine(<member i>, shared)` (the shared-parts guide).

    **Arguments:**

    - `members`: the stacked model, any PyTree (`None` where a leaf is shared).
    - `shared`: `None` (default), or the array leaves held once: the structure
      of `members` with `None` at every stacked leaf.
    - `train_shared`: whether training updates the shared part (one optimizer
      state, the members' summed gradients) or keeps it frozen (the default).

    **Example:**

    ```python
    import equinox as eqx, jax, jax.numpy as jnp
    import eqx_ensemble as ee

    ens = ee.ensemble(lambda k: eqx.nn.Linear(3, 2, key=k), size=4,
                      key=jax.random.key(0))
    assert len(ens) == 4
    ens(jnp.ones(3)).shape          # (4, 2): one output per member
    ens[0]                          # member 0 as a plain eqx.nn.Linear
    ens[1:3]                        # a sub-ensemble of 2 members
    ```
    """

    members: Member
    shared: Any = None
    train_shared: bool = eqx.field(static=True, default=False)
    # Shared leaf shapes at build time: one that later gains a member axis is refused.
    shared_shapes: tuple[tuple[str, tuple[int, ...]], ...] | None = eqx.field(
        static=True, default=None, repr=False
    )

    def __init__(
        self, members: Member, shared: Any = None, *, train_shared: bool = False
    ):
        self.members = members
        self.shared = shared
        self.train_shared = train_shared
        self.shared_shapes = None if shared is None else _leaf_shapes(shared)

    def __check_init__(self):
        if leading_size(self.members) < 1:
            raise ValueError(
                "An ensemble needs at least one member, but the member axis of "
                "`members` has size 0"
            )
        if self.shared is None:
            if self.train_shared:
                raise ValueError(
                    "`train_shared=True` needs a shared part (`shared=`); this "
                    "ensemble shares nothing"
                )
            return
        _check_shared_layout(self.members, self.shared)

    def member(self, stacked_member: Any) -> Any:
        """One member's stacked part completed with the shared part: a plain model."""
        if self.shared is None:
            return stacked_member
        check_shared_shapes(self)
        return eqx.combine(stacked_member, self.shared)

    def __len__(self) -> int:
        return leading_size(self.members)

    @property
    def size(self) -> int:
        """The number of members (same as `len(ens)`)."""
        return len(self)

    def __getitem__(self, index: Any) -> Any:
        """Member `index` as a plain model, or a sub-ensemble for a slice/index array.

        **Arguments:**

        - `index`: an `int` (a plain model), or a `slice`, a 1-D integer array or
          a boolean mask of length `len(ens)` (an `Ensemble`).

        Concrete indices are bounds-checked; traced ones are clamped, as JAX
        indexes. Boolean masks must be concrete.
        """
        size = len(self)
        if isinstance(index, slice):
            positions = np.arange(size)[index]
            return _take(self, positions, size)
        if isinstance(index, bool | np.bool_) or (
            eqx.is_array(index) and jnp.ndim(index) == 0 and index.dtype == bool
        ):
            raise TypeError(
                "An ensemble cannot be indexed by a single bool; use an int member "
                f"index or a boolean mask of length {size}."
            )
        if eqx.is_array(index) and jnp.ndim(index) == 0:
            if not jnp.issubdtype(index.dtype, jnp.integer):
                raise TypeError(
                    f"A member index must be an integer, got dtype {index.dtype}"
                )
        if isinstance(index, int | np.integer) or (
            eqx.is_array(index) and jnp.ndim(index) == 0
        ):
            if _is_concrete(index):
                position = int(index)
                if not -size <= position < size:
                    raise IndexError(
                        f"member index {position} is out of range for an ensemble "
                        f"of {size} members"
                    )
                position %= size
            else:
                position = index
            return self.member(take_members(self.members, position, one=True))
        if isinstance(index, list | tuple) or eqx.is_array(index):
            return _take(self, _member_positions(index, size), size)
        raise TypeError(
            "An ensemble is indexed by an int, a slice, or a 1-D array of member "
            f"indices or a boolean mask; got {type(index).__name__}."
        )

    def __call__(self, *args: Any, key: PRNGKeyArray | None = None, **kwargs: Any):
        """Call every member on the same inputs; outputs gain a leading member axis.

        **Arguments:**

        - `*args`, `**kwargs`: passed unchanged to every member.
        - `key`: optional; member `i` is called with `key=split(key, len(ens))[i]`.

        **Returns:**

        The members' outputs stacked along a new leading axis of size `len(ens)`.
        """

        def call_member(member, *member_args, **member_kwargs):
            return member(*member_args, **kwargs, **member_kwargs)

        # `call_member` is new each call: cache the layout profile under the class.
        return map_members(
            call_member, self, args, None, None, key, None, profile_owner=Ensemble
        )


def _is_concrete(x: Any) -> bool:
    return not is_traced(x)


def _member_positions(index: Any, size: int) -> Any:
    if isinstance(index, list | tuple) and len(index) == 0:
        raise IndexError(
            f"the index {index!r} is empty: it selects no members of the ensemble of "
            f"{size}, and an ensemble needs at least one member"
        )
    array: Any = index if eqx.is_array(index) else np.asarray(index)
    if array.ndim != 1:
        raise IndexError(
            f"an index array must be 1-D, got shape {tuple(array.shape)}; use an int "
            "to get a single member"
        )
    if array.dtype == bool:
        if array.shape[0] != size:
            raise IndexError(
                f"a boolean member mask must have length {size} (the ensemble size), "
                f"got length {array.shape[0]}"
            )
        if not _is_concrete(array):
            raise IndexError("a boolean member mask must be concrete (not traced)")
        return np.nonzero(np.asarray(array))[0]
    if not jnp.issubdtype(array.dtype, jnp.integer):
        raise IndexError(f"member indices must be integers, got dtype {array.dtype}")
    if _is_concrete(array):
        host = np.asarray(array)
        bad = host[(host < -size) | (host >= size)]
        if bad.size:
            raise IndexError(
                f"member indices {bad.tolist()} are out of range for an ensemble of "
                f"{size} members"
            )
        return host % size
    return array


def _take(ens: Ensemble, positions: Any, size: int) -> Ensemble:
    if len(positions) == 0:
        raise IndexError(
            f"the index selects no members of the ensemble of {size}; an ensemble "
            "needs at least one member"
        )
    return with_members(ens, take_members(ens.members, positions))


@one_shot_jit(static_argnames=("one",))
def _take_leaves(leaves: list[Any], rows: Any, one: bool) -> list[Any]:
    # A one-row gather: on a member-split mesh a dynamic slice gathers the leaf.
    return [leaf[rows][0] if one else leaf[rows] for leaf in leaves]


def take_members(members: Any, index: Any, *, one: bool = False) -> Any:
    """`leaf[index]` of every array leaf: one member (`one`) or a 1-D index array,
    in one compiled call when it pays (op by op compiles a program per op)."""
    leaves, treedef = jax.tree.flatten(members)
    arrays = [leaf for leaf in leaves if eqx.is_array(leaf)]
    if _takes_in_one_call(arrays, index):
        rows = np.asarray([index] if one else index, np.int32)
        try:
            taken = iter(_take_leaves(arrays, rows, one))
        except ValueError:  # leaves committed to different devices
            pass
        else:
            return jax.tree.unflatten(
                treedef, [next(taken) if eqx.is_array(x) else x for x in leaves]
            )
    return jax.tree.map(lambda x: x[index] if eqx.is_array(x) else x, members)


def _takes_in_one_call(arrays: list[Any], index: Any) -> bool:
    if not arrays or is_traced(index) or isinstance(index, jax.Array):
        return False
    if not all(isinstance(x, jax.Array) and not is_traced(x) for x in arrays):
        return False
    return one_call_pays(arrays)


def one_call_pays(arrays: list[Any]) -> bool:
    """Whether one call for all `arrays` beats one per shape (not when many
    arrays share few shapes, e.g. a deep stack of equal layers)."""
    return len(arrays) <= 2 * len({(np.shape(x), x.dtype) for x in arrays})


def _leaf_shapes(shared: Any) -> tuple[tuple[str, tuple[int, ...]], ...]:
    return tuple(
        (keystr(path), tuple(leaf.shape))
        for path, leaf in jtu.tree_flatten_with_path(shared)[0]
        if _is_arrayish(leaf)
    )


def check_shared_shapes(ens: Ensemble) -> None:
    """Raise if a shared leaf's shape changed since the ensemble was built."""
    if ens.shared is None or ens.shared_shapes is None:
        return
    now = dict(_leaf_shapes(ens.shared))
    for path, shape in ens.shared_shapes:
        current = now.get(path)
        if current is not None and current != shape:
            axis = (
                " (it gained a leading member axis)"
                if current[1:] == shape and current[:1] == (len(ens),)
                else ""
            )
            raise ValueError(
                f"shared leaf `{path}` has shape {current} but had shape {shape} "
                f"when the ensemble was built{axis}. A shared leaf is held once for "
                "all members; to give it one value per member, rebuild the "
                "ensemble without it in `shared=` (e.g. `ee.stack(ee.unstack(ens), "
                "shared=...)`)."
            )


def with_members(ens: Ensemble, members: Any) -> Ensemble:
    """`ens` with new stacked members, keeping its shared part (if any)."""
    return Ensemble(members, ens.shared, train_shared=ens.train_shared)


def _is_none(x: Any) -> bool:
    return x is None


def _check_shared_layout(members: Any, shared: Any) -> None:
    member_def = jtu.tree_structure(members, is_leaf=_is_none)
    shared_def = jtu.tree_structure(shared, is_leaf=_is_none)
    if member_def != shared_def:
        raise ValueError(
            "`shared` must have the structure of `members` (an `eqx.partition` of "
            f"one model, `None` where the other holds a leaf); got {shared_def} for "
            f"`shared` and {member_def} for `members`"
        )
    flat_members = jtu.tree_flatten_with_path(members, is_leaf=_is_none)[0]
    flat_shared = jtu.tree_leaves(shared, is_leaf=_is_none)
    found_shared = False
    for (path, member_leaf), shared_leaf in zip(flat_members, flat_shared):
        if shared_leaf is None:
            continue
        if not _is_arrayish(shared_leaf):
            # Non-array leaves may be on both sides; `members`' copy is used.
            continue
        if member_leaf is not None:
            raise ValueError(
                f"leaf `{keystr(path)}` is in both `members` and `shared`; an "
                "array leaf is either stacked or shared"
            )
        found_shared = True
    if not found_shared:
        raise ValueError("`shared` holds no array leaf; pass `shared=None` instead")


class SharedOptState(eqx.Module):
    """The optimizer state of an ensemble with `train_shared=True`: one state per
    member and ONE for the shared part. Made by
    [`ee.init_optimizer`][eqx_ensemble.init_optimizer].

    **Fields:**

    - `members`: the stacked optimizer state of the members' own parameters.
    - `shared`: the optimizer state of the shared part (no member axis).

    **Example:**

    ```python
    ens = ee.ensemble(lambda k: eqx.nn.MLP(2, 1, 8, 1, key=k), size=4,
                      key=jax.random.key(0), shared=lambda m: m.layers[0],
                      train_shared=True)
    state = ee.init_optimizer(optax.adam(1e-3), ens)
    state.shared[0].mu.layers[0].weight.shape     # (8, 2): one state
    state.members[0].mu.layers[1].weight.shape    # (4, 1, 8): per member
    ```
    """

    members: PyTree[Any]
    shared: PyTree[Any]


def has_shared(x: Any) -> bool:
    """Whether `x` is a node with a per-member part and a shared part."""
    return isinstance(x, Ensemble | SharedOptState) and x.shared is not None


def member_axis_mask(tree: PyTree[Any]) -> PyTree[bool]:
    """`tree`'s structure with `False` at every leaf held once for all members (an
    ensemble's shared part and its optimizer state) and `True` elsewhere."""
    flags = []
    for node in jtu.tree_leaves(tree, is_leaf=has_shared):
        if has_shared(node):
            flags += [True] * len(jtu.tree_leaves(node.members))
            flags += [False] * len(jtu.tree_leaves(node.shared))
        else:
            flags.append(True)
    return jtu.tree_unflatten(jtu.tree_structure(tree), flags)


def resolve_shared(model: Any, shared: Any) -> PyTree[bool]:
    """`model`'s structure with `True` at each array leaf `shared` picks: a
    function `model -> node(s)` as in `eqx.tree_at`, or an `eqx.partition` filter."""
    if callable(shared) and not isinstance(shared, eqx.Module | bool):
        # Picked leaves are found by identity.
        try:
            nodes = shared(model)
        except Exception as error:
            raise ValueError(
                "`shared` must pick parts of the model, e.g. "
                "`shared=lambda m: m.backbone` (a node or a tuple of nodes, as in "
                f"`eqx.tree_at`), but calling it failed: {error!r}"
            ) from error
        picked_ids = {id(leaf) for leaf in jtu.tree_leaves(nodes) if _is_arrayish(leaf)}
        mask = jtu.tree_map(lambda leaf: id(leaf) in picked_ids, model)
    else:
        try:
            picked = eqx.filter(model, shared, replace=_NOT_PICKED)
        except Exception as error:
            raise ValueError(
                "`shared` must be a function of the model returning the shared "
                "part, or a filter specification (a PyTree prefix of the model of "
                f"bools or `leaf -> bool` callables); it failed: {error}"
            ) from error
        mask = jtu.tree_map(lambda leaf: leaf is not _NOT_PICKED, picked)
    return jtu.tree_map(
        lambda flag, leaf: bool(flag) and _is_arrayish(leaf), mask, model
    )


class _NotPicked:
    def __repr__(self) -> str:
        return "<not picked>"


_NOT_PICKED = _NotPicked()


def _is_arrayish(leaf: Any) -> bool:
    return eqx.is_array(leaf) or isinstance(leaf, jax.ShapeDtypeStruct)


def shared_filter(model: Any, mask: PyTree[bool]) -> Any:
    """The array leaves `mask` picks, and every non-array leaf."""
    keep = jtu.tree_map(
        lambda flag, leaf: bool(flag) or not _is_arrayish(leaf), mask, model
    )
    return eqx.filter(model, keep)


def check_shared_mask(mask: PyTree[bool], model: Any) -> None:
    """Refuse a selection that picks no array leaf or every array leaf."""
    arrays = [
        flag
        for flag, leaf in zip(jtu.tree_leaves(mask), jtu.tree_leaves(model))
        if _is_arrayish(leaf)
    ]
    if not any(arrays):
        raise ValueError(
            "`shared` picks no array leaf of the model: nothing would be shared "
            "(check the selection; pass `shared=None` for a plain ensemble)"
        )
    if all(arrays):
        raise ValueError(
            "`shared` picks every array leaf of the model: all members would be "
            "the same model. Leave at least one part per member (e.g. the head)."
        )


# Up to this size `make` is not traced a second time for the memory check.
_TRACE_FREE_SIZE = 4096


def _check_fits_in_memory(make: Callable[..., Any], key: Any, size: int) -> None:
    # XLA aborts the process on a buffer it cannot allocate: refuse it here.
    if size > 2**31 - 1:
        raise ValueError(
            f"`size` {size} is more members than XLA can index (2**31 - 1)"
        )
    if size <= _TRACE_FREE_SIZE:
        return  # small enough not to trace `make` an extra time for the check
    shapes = eqx.filter_eval_shape(make, key)
    member_bytes = sum(
        int(np.prod(leaf.shape)) * np.dtype(leaf.dtype).itemsize
        for leaf in jax.tree.leaves(shapes)
        if hasattr(leaf, "shape")
        and hasattr(leaf, "dtype")
        and not jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key)
    )
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return
    if member_bytes * size > memory:
        raise ValueError(
            f"{size} members of {member_bytes} bytes each need "
            f"{member_bytes * size / 2**30:.1f} GiB, more than this machine's "
            f"{memory / 2**30:.1f} GiB; use fewer members (or shard them over "
            "devices with `ee.shard` after building a smaller ensemble per device)"
        )


# A model may be a tuple: the `(model, State)` overload comes first to win.
@overload
def ensemble(  # pyright: ignore[reportOverlappingOverload]
    make: Callable[[PRNGKeyArray], tuple[Member, eqx.nn.State]],
    *,
    size: int,
    key: PRNGKeyArray,
    shared: Any = None,
    train_shared: bool = False,
) -> tuple[Ensemble[Member], eqx.nn.State]: ...


@overload
def ensemble(
    make: Callable[[PRNGKeyArray], Member],
    *,
    size: int,
    key: PRNGKeyArray,
    shared: Any = None,
    train_shared: bool = False,
) -> Ensemble[Member]: ...


def ensemble(
    make: Callable[[PRNGKeyArray], Member | tuple[Member, Any]],
    *,
    size: int,
    key: PRNGKeyArray,
    shared: Any = None,
    train_shared: bool = False,
) -> Ensemble[Member] | tuple[Ensemble[Member], PyTree[Any]]:
    """Build an ensemble whose weights are born stacked.

    Calls `make(member_key)` under `eqx.filter_vmap` over
    `jax.random.split(key, size)`: one compiled program for all members, reused
    by a `make` with the same code and values. As under `jax.jit`, side effects
    happen at trace time and other objects `make` reads are keyed by identity
    (not read again if changed in place).

    **Arguments:**

    - `make`: `make(key) -> model`, e.g. `lambda k: eqx.nn.MLP(2, 1, 32, 2, key=k)`.
      It may also return `(model, state)` as `eqx.nn.make_with_state` does.
    - `size`: the number of members, at least 1.
    - `key`: ONE PRNG key; member `i` is made with `jax.random.split(key, size)[i]`.
    - `shared`: optional; the parts held ONCE (member 0's): a function of the
      model returning node(s) as in `eqx.tree_at` (`lambda m: m.backbone`), or
      an `eqx.partition` filter. See the shared-parts guide.
    - `train_shared`: `False` (default): the shared part is frozen. `True`:
      training updates it with ONE optimizer state and the members' summed
      gradients.

    **Returns:**

    An [`Ensemble`][eqx_ensemble.Ensemble]; or `(Ensemble, stacked_state)` when
    `make` returns a `(model, eqx.nn.State)` pair.

    **Example:**

    ```python
    ens = ee.ensemble(lambda k: eqx.nn.MLP(1, 1, 32, 2, key=k), size=5,
                      key=jax.random.key(0))
    ens.members.layers[0].weight.shape   # (5, 32, 1)

    # 8 heads over ONE frozen first layer:
    heads = ee.ensemble(lambda k: eqx.nn.MLP(1, 1, 32, 2, key=k), size=8,
                        key=jax.random.key(0), shared=lambda m: m.layers[0])
    heads.shared.layers[0].weight.shape  # (32, 1): held once
    heads[3]                             # member 3: a plain eqx.nn.MLP
    ```
    """
    if isinstance(size, bool) or not isinstance(size, int | np.integer):
        raise TypeError(f"`size` must be an int, got {type(size).__name__}")
    if size < 1:
        raise ValueError(f"`size` must be at least 1, got {size}")
    check_key(key)
    _check_fits_in_memory(make, key, int(size))
    member_keys = split_member_keys(key, int(size))
    if shared is not None:
        return _ensemble_with_shared(make, member_keys, shared, train_shared)
    if train_shared:
        raise ValueError("`train_shared=True` needs a shared part: pass `shared=`")
    made: Any = compiled_call(lambda keys: eqx.filter_vmap(make)(keys), member_keys)
    if _is_with_state(made):
        model, state = made
        return cast(Ensemble[Member], Ensemble(model)), state
    return cast(Ensemble[Member], Ensemble(made))


def _is_with_state(made: Any) -> bool:
    return (
        isinstance(made, tuple) and len(made) == 2 and isinstance(made[1], eqx.nn.State)
    )


def _ensemble_with_shared(
    make: Callable[..., Any], member_keys: Any, shared: Any, train_shared: bool
) -> Any:
    if not isinstance(train_shared, bool):
        raise TypeError(f"`train_shared` must be a bool, got {train_shared!r}")
    shapes = eqx.filter_eval_shape(make, member_keys[0])
    stateful = _is_with_state(shapes)
    model_shapes = shapes[0] if stateful else shapes
    mask = resolve_shared(model_shapes, shared)
    check_shared_mask(mask, model_shapes)

    # Compiled, so the shared part is not built `size` times and dropped.
    stacked, shared_part = compiled_call(
        functools.partial(_shared_parts, make, stateful, mask), member_keys
    )
    if stateful:
        part, state = stacked
        return Ensemble(part, shared_part, train_shared=train_shared), state
    return Ensemble(stacked, shared_part, train_shared=train_shared)


def _shared_parts(
    make: Callable[..., Any], stateful: bool, mask: PyTree[bool], member_keys: Any
) -> Any:
    """The members' own parts under `eqx.filter_vmap`, and the shared part built
    once (module-level: a cache key stable under jaxtyping's import hook)."""

    def stacked_part(member_key: Any) -> Any:
        made = make(member_key)
        model = made[0] if stateful else made
        part = eqx.filter(model, mask, inverse=True)
        return (part, made[1]) if stateful else part

    first = make(member_keys[0])
    shared_part = shared_filter(first[0] if stateful else first, mask)
    return eqx.filter_vmap(stacked_part)(member_keys), shared_part
