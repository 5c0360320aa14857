"""`Heterogeneous`: ensembles of different architectures held as one."""

from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import numpy as np
from jaxtyping import ArrayLike, Bool, Int, PRNGKeyArray
from typing_extensions import TypeIs

from .data import check_leading
from .ensemble import Ensemble
from .groups import join_groups, split_members
from .mapping import map_members


class Heterogeneous(eqx.Module):
    """Several [`ee.Ensemble`][eqx_ensemble.Ensemble]s whose members differ in
    architecture, held and trained as one ensemble: members are numbered across
    the groups in order. Each group stays stacked: one vectorised computation
    per group, all in one compiled program.

    [`ee.fit`][eqx_ensemble.fit], [`ee.predict`][eqx_ensemble.predict],
    [`ee.map`][eqx_ensemble.map] and calling it take it like an `Ensemble`:
    `fit` holds one optimizer and model state per group (tuples), and member
    `i` gets exactly the key, batches, `hyper=` row and guard of member `i` of
    an `Ensemble` of `len(het)` members; `predict`/`map` concatenate the groups'
    outputs along the member axis where they agree, else give a tuple.

    **Arguments:**

    - `groups`: a non-empty sequence of `ee.Ensemble`s.

    **Example:**

    ```python
    key = jax.random.key(0)
    make = lambda width: lambda k: eqx.nn.MLP(2, 1, width, 1, key=k)
    het = ee.Heterogeneous([ee.ensemble(make(w), size=2, key=jax.random.fold_in(key, w))
                            for w in (8, 16, 32)])
    len(het), het.sizes                 # 6, (2, 2, 2)
    het[3]                              # group 1's second member: an eqx.nn.MLP
    ee.predict(het, jnp.ones((5, 2))).shape   # (6, 5, 1)
    ```
    """

    groups: tuple[Ensemble, ...]

    def __init__(self, groups: Sequence[Ensemble]):
        if isinstance(groups, Ensemble) or not isinstance(groups, Sequence):
            raise TypeError(
                "`ee.Heterogeneous` takes a list or tuple of `ee.Ensemble`s (one per "
                f"architecture), got {type(groups).__name__}"
            )
        if not groups:
            raise ValueError("`ee.Heterogeneous` needs at least one group, got none")
        for index, group in enumerate(groups):
            if isinstance(group, Heterogeneous):
                raise TypeError(
                    f"group {index} is itself an `ee.Heterogeneous`: pass its groups "
                    "(`[*het.groups, ...]`)"
                )
            if not isinstance(group, Ensemble):
                raise TypeError(
                    f"group {index} must be an `ee.Ensemble`, got "
                    f"{type(group).__name__}; build each group with `ee.ensemble`"
                )
            try:
                size = len(group)
            except ValueError:  # abstract leaves (e.g. inside `eval_shape`)
                continue
            if size < 1:
                raise ValueError(f"group {index} is empty (0 members)")
        self.groups = tuple(groups)

    @property
    def sizes(self) -> tuple[int, ...]:
        """The number of members of each group."""
        return tuple(len(group) for group in self.groups)

    @property
    def bounds(self) -> tuple[tuple[int, int], ...]:
        """`(start, stop)` of each group's members in the global numbering."""
        stops = np.cumsum(self.sizes)
        return tuple(
            (int(stop - size), int(stop))
            for stop, size in zip(stops, self.sizes, strict=True)
        )

    def __len__(self) -> int:
        return sum(self.sizes)

    @property
    def size(self) -> int:
        """The number of members over all groups (same as `len(het)`)."""
        return len(self)

    @property
    def members(self) -> tuple[Any, ...]:
        """Each group's stacked members (a tuple, one entry per group)."""
        return tuple(group.members for group in self.groups)

    def locate(self, index: int) -> tuple[int, int]:
        """`(group, position in the group)` of global member `index`."""
        size = len(self)
        if isinstance(index, bool) or not isinstance(index, int | np.integer):
            raise TypeError(
                "a heterogeneous ensemble is indexed by an int member index (its "
                f"members have different structures), got {type(index).__name__}; "
                "for a group use `het.groups[g]`"
            )
        if not -size <= index < size:
            raise IndexError(
                f"member index {index} is out of range for a heterogeneous ensemble "
                f"of {size} members"
            )
        index = int(index) % size
        for group, (start, stop) in enumerate(self.bounds):
            if start <= index < stop:
                return group, index - start
        raise AssertionError("unreachable")

    def __getitem__(
        self,
        index: int
        | Int[ArrayLike, ""]
        | Sequence[int]
        | Int[ArrayLike, " k"]
        | Bool[ArrayLike, " n"],
    ) -> Any:
        """Global member `index` as a plain model; or, for a 1-D array of member
        indices or a boolean mask, an `ee.Heterogeneous` of those members,
        regrouped by group ([`order`][eqx_ensemble.Heterogeneous.order])."""
        if isinstance(index, int | np.integer) and not isinstance(index, bool):
            group, position = self.locate(int(index))
            return self.groups[group][position]
        if isinstance(index, slice):
            raise TypeError(
                "a heterogeneous ensemble is indexed by member indices (an int, or a "
                "list/array of ints), not a slice; for a group use `het.groups[g]`"
            )
        indices = np.asarray(index)
        if indices.ndim == 0 and np.issubdtype(indices.dtype, np.integer):
            return self[int(indices)]
        located = self._located(indices)
        groups = []
        for group_index, group in enumerate(self.groups):
            positions = [p for g, p in located if g == group_index]
            if positions:
                groups.append(group[np.asarray(positions)])
        return Heterogeneous(groups)

    def order(
        self, index: Sequence[int] | Int[ArrayLike, " k"] | Bool[ArrayLike, " n"]
    ) -> Int[np.ndarray, " k"]:
        """The global member indices of `het[index]`'s members, in its member
        order: index per-member values of `het` with it to match `het[index]`.

        **Example:**

        ```python
        pool, settings, _ = ee.sweep.architectures(
            lambda key, width: eqx.nn.MLP(2, 1, width, 1, key=key),
            {"width": ee.sweep.choice([8, 16])}, size=6, key=jax.random.key(0))
        picks = [4, 0, 1]                   # e.g. from ee.greedy_selection
        chosen = pool[picks]
        widths = settings["width"][pool.order(picks)]   # member i of `chosen`
        assert [m.width_size for m in (chosen[i] for i in range(3))] == list(widths)
        ```
        """
        located = self._located(np.asarray(index))
        starts = [start for start, _ in self.bounds]
        return np.asarray(
            [
                starts[g] + p
                for group_index in range(len(self.groups))
                for g, p in located
                if g == group_index
            ],
            dtype=np.int64,
        )

    def _located(self, indices: np.ndarray) -> list[tuple[int, int]]:
        if indices.dtype == bool:
            if indices.shape != (len(self),):
                raise IndexError(
                    f"a boolean mask over the members must have shape ({len(self)},) "
                    f"(one entry per member), got {indices.shape}"
                )
            indices = np.flatnonzero(indices)
        if indices.ndim != 1 or not (
            np.issubdtype(indices.dtype, np.integer) or indices.size == 0
        ):
            raise TypeError(
                "a heterogeneous ensemble is indexed by an int or a 1-D list/array of "
                f"int member indices, got {indices.dtype} of shape {indices.shape}"
            )
        if indices.size == 0:
            raise IndexError("the index selects no members; an ensemble needs one")
        return [self.locate(int(i)) for i in indices]

    def __call__(self, *args: Any, key: PRNGKeyArray | None = None, **kwargs: Any):
        """Call every member (with `split(key, len(het))[i]`); outputs joined."""
        keys = None if key is None else jax.random.split(key, len(self))
        outputs = [
            group(*args, **kwargs)
            if keys is None
            else _call_with_keys(group, keys[start:stop], args, kwargs)
            for group, (start, stop) in zip(self.groups, self.bounds, strict=True)
        ]
        return join_groups(outputs)


def _call_with_keys(group: Ensemble, keys: Any, args: Any, kwargs: Any) -> Any:
    def call_member(member, *member_args, key):
        return member(*member_args, key=key, **kwargs)

    return map_members(
        call_member, group, args, None, None, None, None, member_keys=keys
    )


def is_heterogeneous(x: Any) -> TypeIs[Heterogeneous]:
    return isinstance(x, Heterogeneous)


def is_ensemble(x: Any) -> TypeIs[Ensemble | Heterogeneous]:
    return isinstance(x, Ensemble | Heterogeneous)


# The groups interface: a plain `ee.Ensemble` is one group.


def groups_of(ens: Any) -> tuple[Ensemble, ...]:
    """`ens`'s groups: an `ee.Heterogeneous`'s, or `(ens,)`."""
    return ens.groups if isinstance(ens, Heterogeneous) else (ens,)


def per_group_values(
    ens: Any, value: Any, what: str = "A value held per group"
) -> tuple[Any, ...]:
    """`value` held once per group: `(value,)`, or a heterogeneous one's tuple."""
    if not isinstance(ens, Heterogeneous):
        return (value,)
    return per_group(ens, value, what)


def group_parts(
    ens: Any,
    *values: Any,
    members: Sequence[Any] = (),
    what: str = "A value held per group",
) -> list[tuple[Any, ...]]:
    """`(group, *per-group values, *member trees cut)` for each group."""
    if not isinstance(ens, Heterogeneous):
        return [(ens, *values, *members)]
    held = [per_group_values(ens, value, what) for value in values]
    cut = [split_by_group(ens, tree) for tree in members]
    return list(zip(ens.groups, *held, *cut, strict=True))


def joined(
    ens: Any, results: list[Any], join: Callable[[list[Any]], Any] = tuple
) -> Any:
    """The per-group `results` as `ens` holds them: the one result, or `join`ed."""
    return join(results) if isinstance(ens, Heterogeneous) else results[0]


def regroup(like: Any, groups: Sequence[Any]) -> Any:
    """`groups` (ensembles) held as `like` holds its own: an `ee.Heterogeneous`
    of them, or a plain ensemble's one group as it is."""
    return Heterogeneous(groups) if isinstance(like, Heterogeneous) else groups[0]


def per_group_slices(
    ens: Any, value: Any, cut: Callable[[Any, int, int], Any]
) -> tuple[Any, ...]:
    """`value`, given per member over all groups, as `cut(value, start, stop)`
    per group (a plain ensemble: `(value,)`)."""
    if not isinstance(ens, Heterogeneous):
        return (value,)
    return tuple(cut(value, start, stop) for start, stop in ens.bounds)


def labelled(ens: Any, value: Any) -> list[tuple[str, Any]]:
    """`value`, held per group, as `(label, entry)` pairs: a plain ensemble's
    `("", value)`; an `ee.Heterogeneous`'s `("[g]", value[g])` per group."""
    if not isinstance(ens, Heterogeneous):
        return [("", value)]
    return [(f"[{index}]", entry) for index, entry in enumerate(value)]


def check_group_run(
    ens: Any, *, coupled: bool, mesh: bool, member_chunk: bool, where: str
) -> None:
    """What an `ee.Heterogeneous` does not (yet) train with, refused by name
    before any work: an `ee.Coupled` loss, a mesh, member chunks."""
    if not isinstance(ens, Heterogeneous):
        return
    if coupled:
        raise ValueError(
            f"`{where}` of an `ee.Heterogeneous` takes a loss of ONE model; an "
            "`ee.Coupled` loss (a function of the whole ensemble) needs every member "
            "to have one structure"
        )
    if mesh:
        raise ValueError(
            f"`{where}` of an `ee.Heterogeneous` does not yet run on a mesh "
            "(`Execution(mesh=...)`); shard each group's run on its own, or leave "
            "`mesh` out"
        )
    if member_chunk:
        raise ValueError(
            f"`{where}` of an `ee.Heterogeneous` does not yet take "
            "`Execution(member_chunk=...)`; leave it out (each group is vectorised "
            "on its own already)"
        )


def check_group_losses(ens: Any, losses: tuple[Any, ...]) -> None:
    """A tuple of losses is one per group of an `ee.Heterogeneous`."""
    if not isinstance(ens, Heterogeneous):
        raise TypeError(
            f"`loss_fn` is a tuple of {len(losses)}: a loss per group, which only "
            "an `ee.Heterogeneous` takes; pass one loss function"
        )
    if len(losses) != len(ens.groups):
        raise ValueError(
            f"`loss_fn` is a tuple of {len(losses)} losses but the "
            f"`ee.Heterogeneous` has {len(ens.groups)} groups: give one loss per "
            "group, in the groups' order (or one loss for all)"
        )


def per_group(het: Heterogeneous, value: Any, what: str) -> tuple[Any, ...]:
    """`value` as a tuple with one entry per group, or an error naming `what`."""
    if value is None:
        return (None,) * len(het.groups)
    if not isinstance(value, tuple) or len(value) != len(het.groups):
        got = (
            f"a tuple of {len(value)}"
            if isinstance(value, tuple)
            else type(value).__name__
        )
        raise ValueError(
            f"{what} of an `ee.Heterogeneous` of {len(het.groups)} groups must be a "
            f"tuple with one entry per group (each stacked like its group), got {got}"
        )
    return value


def check_group_states(het: Any, state: Any, what: str) -> None:
    """A model state per group, each with its group's member axis (a plain
    ensemble's: with its member axis; `None`: none)."""
    if state is None:
        return
    if not isinstance(het, Heterogeneous):
        check_leading(state, len(het), what)
        return
    states = per_group(het, state, what)
    missing = [index for index, group_state in enumerate(states) if group_state is None]
    if state is not None and missing:
        raise ValueError(
            f"{what} of an `ee.Heterogeneous` is None for groups {missing} but given "
            "for the others: the loss is called with a state for every member or "
            "for none. Give every group a model state (each stacked like its "
            "group), or pass `state=None` if no group has one"
        )
    for index, (group, group_state) in enumerate(zip(het.groups, states, strict=True)):
        check_leading(group_state, len(group), f"{what}[{index}] (group {index})")


def split_by_group(het: Heterogeneous, tree: Any) -> tuple[Any, ...]:
    """A tree with the global member axis cut into one tree per group."""
    if tree is None:
        return (None,) * len(het.groups)
    return split_members(tree, het.bounds)
