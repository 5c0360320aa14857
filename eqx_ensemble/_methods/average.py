"""`tree_weighted_sum` and `average` (a "model soup")."""

from collections.abc import Sequence
from typing import Any, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jaxtyping import ArrayLike, PyTree, Real

from .._core.ensemble import Ensemble
from .._core.stack import check_same_structure
from .._internal.checks import normalised_weights, real_array
from .._internal.tree import as_array, is_traced, keystr

T = TypeVar("T")


def _is_summable(leaf: Any) -> bool:
    return eqx.is_array(leaf) or (
        isinstance(leaf, int | float | complex) and not isinstance(leaf, bool)
    )


def tree_weighted_sum(
    trees: Sequence[PyTree[Any]],
    weights: Real[ArrayLike, " n"] | Sequence[float | int],
) -> PyTree[Any]:
    """`sum_i weights[i] * trees[i]`, leaf by leaf, for same-structure PyTrees.

    Array and number leaves are summed; any other leaf must be equal across the
    trees and is kept once.

    **Arguments:**

    - `trees`: a non-empty sequence of PyTrees with the same structure.
    - `weights`: one weight per tree.

    **Example:**

    ```python
    a = {"w": jnp.array([1.0, 2.0]), "b": 1.0}
    b = {"w": jnp.array([3.0, 4.0]), "b": 3.0}
    ee.tree_weighted_sum([a, b], jnp.array([0.25, 0.75]))
    # {"w": [2.5, 3.5], "b": 2.5}
    ```
    """
    if not isinstance(trees, Sequence) or isinstance(trees, Ensemble):
        raise TypeError(
            "`tree_weighted_sum` takes a list of PyTrees; for an ensemble use "
            "`ee.average`"
        )
    if len(trees) == 0:
        raise ValueError("`tree_weighted_sum` got an empty list of trees")
    array = real_array(weights, "weights")
    if array.ndim != 1 or array.shape[0] != len(trees):
        raise ValueError(
            f"`weights` must have one entry per tree: got {len(trees)} trees and "
            f"weights of shape {tuple(array.shape)}"
        )
    if not is_traced(array) and not np.isfinite(np.asarray(array)).all():
        raise ValueError(f"`weights` must be finite, got {np.asarray(array)}")
    check_same_structure(list(trees), "trees", numbers_are_data=True)

    for path, leaf in jtu.tree_flatten_with_path(trees[0])[0]:
        if eqx.is_array(leaf) and jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            raise TypeError(
                f"`tree_weighted_sum`: leaf `{keystr(path)}` is a PRNG key array, "
                "which has no weighted sum; filter keys out first (e.g. "
                "`eqx.partition`) or keep one tree's keys"
            )

    def combine(*leaves):
        if not _is_summable(leaves[0]):
            return leaves[0]
        stacked = jnp.stack([as_array(leaf) for leaf in leaves])
        if jnp.issubdtype(stacked.dtype, jnp.inexact):
            dtype = stacked.dtype
        elif jnp.issubdtype(array.dtype, jnp.inexact):
            dtype = array.dtype
        else:
            dtype = jnp.float32
        return jnp.tensordot(array.astype(dtype), stacked.astype(dtype), axes=1)

    return jax.tree.map(combine, *trees)


def average(
    ens: Ensemble[T],
    weights: Real[ArrayLike, " members"] | Sequence[float | int] | None = None,
) -> T:
    """One model whose weights are the (weighted) mean of the members' weights.

    A "model soup" (Wortsman et al. 2022): for members fine-tuned from one model;
    averaging independently initialised networks usually gives a poor model.

    **Arguments:**

    - `ens`: the ensemble.
    - `weights`: optional non-negative weight per member, normalised to sum to one;
      uniform when `None`.

    Floating-point leaves are averaged. Integer and boolean array leaves cannot be
    averaged: they must be identical across members (checked when concrete) and
    member 0's copy is kept.

    **Example:**

    ```python
    ens = ee.ensemble(lambda k: eqx.nn.Linear(3, 2, key=k), size=4,
                      key=jax.random.key(0))
    soup = ee.average(ens)                        # a plain eqx.nn.Linear
    soup.weight                                   # == ens.members.weight.mean(0)
    ```
    """
    if not isinstance(ens, Ensemble):
        raise TypeError(
            f"`ee.average` takes an `ee.Ensemble`, got {type(ens).__name__}"
        )
    normalised = normalised_weights(weights, len(ens), jnp.float32, "the ensemble has")

    def mean_leaf(leaf):
        if not eqx.is_array(leaf):
            return leaf
        if jnp.issubdtype(leaf.dtype, jnp.inexact):
            w = normalised.astype(leaf.dtype)
            return jnp.tensordot(w, leaf, axes=1)
        if not is_traced(leaf):
            host = np.asarray(leaf)
            if not (host == host[:1]).all():
                raise ValueError(
                    "`ee.average` cannot average an integer/boolean leaf that differs "
                    f"across members (dtype {leaf.dtype}, shape {tuple(leaf.shape)})"
                )
        return leaf[0]

    return ens.member(jax.tree.map(mean_leaf, ens.members))
