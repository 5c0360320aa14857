"""The `Ensemble` module and `ensemble`: weights born stacked."""

import os
from collections.abc import Callable
from typing import Any, Generic, TypeVar, cast, overload

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Key, PRNGKeyArray, PyTree, UInt32

from ._tree import is_traced, leading_size

Member = TypeVar("Member")


class Ensemble(eqx.Module, Generic[Member]):
    """An ensemble of models stored as ONE model whose array leaves are stacked.

    Every array leaf of `members` carries a leading *member* axis of the same size;
    non-array leaves (activation functions, Python floats, static fields) are shared
    by all members. Build one with [`ee.ensemble`][eqx_ensemble.ensemble] (weights
    born stacked) or [`ee.stack`][eqx_ensemble.stack] (from a list of models).

    **Arguments:**

    - `members`: the stacked model: any PyTree, usually an `eqx.Module`.

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

    def __check_init__(self):
        if leading_size(self.members) < 1:
            raise ValueError(
                "An ensemble needs at least one member, but the member axis of "
                "`members` has size 0"
            )

    def __len__(self) -> int:
        return leading_size(self.members)

    @property
    def size(self) -> int:
        """The number of members (same as `len(ens)`)."""
        return len(self)

    def __getitem__(self, index: Any) -> Any:
        """Member `index` as a plain model, or a sub-ensemble for a slice/index array.

        **Arguments:**

        - `index`: an `int` (returns that member as a plain model), a `slice`, a
          1-D integer array of member indices, or a 1-D boolean mask of length
          `len(ens)` (each returns an `Ensemble`).

        Concrete indices are bounds-checked (an `IndexError` names the ensemble
        size). Under `jax.jit` an integer index or index array may be traced; it is
        then not bounds-checked and follows JAX's indexing rules (out-of-range
        indices are clamped). Boolean masks must be concrete.
        """
        size = len(self)
        if isinstance(index, slice):
            positions = np.arange(size)[index]
            return _take(self.members, positions, size)
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
            return jax.tree.map(
                lambda leaf: leaf[position] if eqx.is_array(leaf) else leaf,
                self.members,
            )
        if isinstance(index, list | tuple) or eqx.is_array(index):
            return _take(self.members, _member_positions(index, size), size)
        raise TypeError(
            "An ensemble is indexed by an int, a slice, or a 1-D array of member "
            f"indices or a boolean mask; got {type(index).__name__}."
        )

    def __call__(self, *args: Any, key: PRNGKeyArray | None = None, **kwargs: Any):
        """Call every member on the same inputs; outputs gain a leading member axis.

        **Arguments:**

        - `*args`, `**kwargs`: passed unchanged to every member.
        - `key`: optional PRNG key; it is split so that member `i` is called with its
          own `key=member_keys[i]` (for dropout and other stochastic layers).

        **Returns:**

        The members' outputs stacked along a new leading axis of size `len(ens)`.
        """
        from ._map import map as ensemble_map

        def call_member(member, *member_args, **member_kwargs):
            return member(*member_args, **kwargs, **member_kwargs)

        return ensemble_map(call_member, self, *args, key=key)


def _is_concrete(x: Any) -> bool:
    return not is_traced(x)


def _member_positions(index: Any, size: int) -> Any:
    # `index`: a list/tuple, or a JAX or NumPy integer array or boolean mask (any
    # rank here: a clear IndexError below rejects anything but 1-D).
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


def _take(members: Any, positions: Any, size: int) -> Ensemble:
    if len(positions) == 0:
        raise IndexError(
            f"the index selects no members of the ensemble of {size}; an ensemble "
            "needs at least one member"
        )
    return Ensemble(
        jax.tree.map(
            lambda leaf: leaf[positions] if eqx.is_array(leaf) else leaf, members
        )
    )


# Up to this many members, `ensemble` does not trace `make` a second time to
# check the ensemble fits in memory (`make` is traced once: a promise the tests
# keep).
_TRACE_FREE_SIZE = 4096


def _check_fits_in_memory(make: Callable[..., Any], key: Any, size: int) -> None:
    # An impossible ensemble must be refused here: XLA aborts the whole process on
    # a buffer it cannot allocate (2**40 members of a 2-weight model did).
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


def check_key(key: Any, *, what: str = "key") -> None:
    """Raise a clear error unless `key` is ONE PRNG key (typed, or raw uint32[2])."""
    if not eqx.is_array(key):
        raise TypeError(
            f"`{what}` must be a JAX PRNG key such as `jax.random.key(0)`, got "
            f"{type(key).__name__}"
        )
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        if key.shape != ():
            raise ValueError(
                f"`{what}` must be a single PRNG key of shape (), got a key array of "
                f"shape {tuple(key.shape)}; pass one key and the library splits it"
            )
        return
    if key.dtype != jnp.uint32 or key.shape != (2,):
        raise ValueError(
            f"`{what}` must be a single PRNG key (`jax.random.key(seed)`, or a raw "
            f"uint32 key of shape (2,)), got an array of shape {tuple(key.shape)} and "
            f"dtype {key.dtype}; pass one key and the library splits it"
        )


def split_member_keys(
    key: PRNGKeyArray, size: int
) -> Key[Array, " members"] | UInt32[Array, " members 2"]:
    """The per-member keys used throughout the library: `split(key, size)`."""
    check_key(key)
    return jax.random.split(key, size)


# A model may itself be a tuple, so the two overloads overlap by nature; the
# `(model, State)` one is listed first so that it wins for stateful models.
@overload
def ensemble(  # pyright: ignore[reportOverlappingOverload]
    make: Callable[[PRNGKeyArray], tuple[Member, eqx.nn.State]],
    *,
    size: int,
    key: PRNGKeyArray,
) -> tuple[Ensemble[Member], eqx.nn.State]: ...


@overload
def ensemble(
    make: Callable[[PRNGKeyArray], Member], *, size: int, key: PRNGKeyArray
) -> Ensemble[Member]: ...


def ensemble(
    make: Callable[[PRNGKeyArray], Member | tuple[Member, Any]],
    *,
    size: int,
    key: PRNGKeyArray,
) -> Ensemble[Member] | tuple[Ensemble[Member], PyTree[Any]]:
    """Build an ensemble whose weights are born stacked.

    Calls `make(member_key)` under `eqx.filter_vmap` over
    `jax.random.split(key, size)`: the model is traced once and initialised for all
    members in one vectorised computation, never a Python loop over members.

    **Arguments:**

    - `make`: `make(key) -> model`, e.g. `lambda k: eqx.nn.MLP(2, 1, 32, 2, key=k)`.
      It may also return `(model, state)` as `eqx.nn.make_with_state` does.
    - `size`: the number of members, at least 1.
    - `key`: ONE PRNG key; member `i` is made with `jax.random.split(key, size)[i]`.

    **Returns:**

    An [`Ensemble`][eqx_ensemble.Ensemble]; or `(Ensemble, stacked_state)` when
    `make` returns a `(model, eqx.nn.State)` pair.

    **Example:**

    ```python
    ens = ee.ensemble(lambda k: eqx.nn.MLP(1, 1, 32, 2, key=k), size=5,
                      key=jax.random.key(0))
    ens.members.layers[0].weight.shape   # (5, 32, 1)
    ```
    """
    if isinstance(size, bool) or not isinstance(size, int | np.integer):
        raise TypeError(f"`size` must be an int, got {type(size).__name__}")
    if size < 1:
        raise ValueError(f"`size` must be at least 1, got {size}")
    check_key(key)
    _check_fits_in_memory(make, key, int(size))
    member_keys = split_member_keys(key, int(size))
    made: Any = eqx.filter_vmap(make)(member_keys)
    if isinstance(made, tuple) and len(made) == 2 and isinstance(made[1], eqx.nn.State):
        model, state = made
        return cast(Ensemble[Member], Ensemble(model)), state
    return cast(Ensemble[Member], Ensemble(made))
