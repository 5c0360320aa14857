"""Per-member results of a heterogeneous ensemble's groups: cut and joined."""

from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
from jaxtyping import PyTree

from .._internal.tree import first_difference


def split_members(tree: PyTree[Any], bounds: Sequence[tuple[int, int]]) -> tuple:
    """`tree`'s array leaves cut at `bounds` along the member axis, per group."""
    return tuple(
        jax.tree.map(
            lambda leaf, a=start, b=stop: leaf[a:b] if eqx.is_array(leaf) else leaf,
            tree,
        )
        for start, stop in bounds
    )


def joinable(outputs: Sequence[PyTree[Any]]) -> bool:
    """Whether the groups' outputs concatenate along the member axis."""
    first = jtu.tree_structure(outputs[0])
    if any(jtu.tree_structure(out) != first for out in outputs[1:]):
        return False
    for leaves in zip(*(jtu.tree_leaves(out) for out in outputs), strict=True):
        if not all(eqx.is_array(leaf) and jnp.ndim(leaf) >= 1 for leaf in leaves):
            if all(not eqx.is_array(leaf) for leaf in leaves) and all(
                leaf == leaves[0] for leaf in leaves
            ):
                continue
            return False
        if len({(leaf.shape[1:], leaf.dtype) for leaf in leaves}) != 1:
            return False
    return True


def join_groups(outputs: Sequence[PyTree[Any]]) -> Any:
    """The groups' outputs concatenated if `joinable`, else their tuple."""
    outputs = tuple(outputs)
    if not joinable(outputs):
        return outputs
    return jax.tree.map(
        lambda *leaves: (
            jnp.concatenate(leaves, axis=0) if eqx.is_array(leaves[0]) else leaves[0]
        ),
        *outputs,
    )


def join_members(outputs: Sequence[PyTree[Any]], what: str) -> Any:
    """As `join_groups`, but raise (naming `what`) unless they join."""
    outputs = tuple(outputs)
    if joinable(outputs):
        return join_groups(outputs)
    for group, other in enumerate(outputs[1:], start=1):
        difference = first_difference(outputs[0], other, ignore_leading_axis=True)
        if difference is not None:
            raise ValueError(
                f"{what} of group 0 and group {group} differ ({difference}): every "
                "group of an `ee.Heterogeneous` must return the same structure and "
                "per-member shapes, so that they form one member axis"
            )
    raise ValueError(f"{what} of the groups cannot be joined along the member axis")
