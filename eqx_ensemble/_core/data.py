"""Array data for `fit`: checks, epoch permutations, bootstrap resamples, gathers."""

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Int, PRNGKeyArray, PyTree

from .._internal.tree import agreed_leading_size, keystr


def check_leading(tree: PyTree[Any], size: int, what: str) -> None:
    """Every array leaf of `tree` must have leading axis `size` (a member axis)."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if eqx.is_array(leaf) and (leaf.ndim == 0 or leaf.shape[0] != size):
            raise ValueError(
                f"{what} leaf `{keystr(path)}` has shape {tuple(leaf.shape)}, but its "
                f"leading axis must be the ensemble size {size}"
            )


def num_examples(data: PyTree[Any], what: str = "data") -> int:
    """The common leading (example) axis of every array leaf of `data`."""
    n = agreed_leading_size(data)
    if n:  # else an error, with the leaves' paths (0 examples is one too)
        return n
    leaves = [
        (keystr(path), leaf)
        for path, leaf in jax.tree_util.tree_flatten_with_path(data)[0]
        if eqx.is_array(leaf)
    ]
    if not leaves:
        raise ValueError(f"`{what}` has no arrays; pass a PyTree of arrays")
    for path, leaf in leaves:
        if leaf.ndim == 0:
            raise ValueError(
                f"`{what}` leaf `{path}` is a scalar; every array needs a leading "
                "example axis"
            )
    sizes = {path: leaf.shape[0] for path, leaf in leaves}
    if len(set(sizes.values())) > 1:
        listing = ", ".join(f"`{path}`: {size}" for path, size in sizes.items())
        raise ValueError(
            f"The arrays of `{what}` disagree on the number of examples (leading "
            f"axis): {listing}"
        )
    n = int(leaves[0][1].shape[0])
    if n == 0:
        raise ValueError(f"`{what}` has 0 examples (leading axis of size 0)")
    return n


def epoch_indices(
    data_key: PRNGKeyArray, step: Int[Array, ""], n: int, batch_size: int
) -> Int[Array, " batch"]:
    """Without replacement: step `s` takes the `s % E`-th slice of epoch `s // E`'s
    permutation (`E = n // batch_size`; the remainder of each epoch is dropped)."""
    steps_per_epoch = n // batch_size
    epoch = step // steps_per_epoch
    position = step % steps_per_epoch
    permutation = jax.random.permutation(jax.random.fold_in(data_key, epoch), n)
    return jax.lax.dynamic_slice(permutation, (position * batch_size,), (batch_size,))


def bootstrap_resamples(
    bootstrap_key: PRNGKeyArray, size: int, n: int
) -> Int[Array, " members n"]:
    """Member `i`'s bootstrap resample of the data: `n` indices drawn with
    replacement with key `split(bootstrap_key, size)[i]`."""
    member_keys = jax.random.split(bootstrap_key, size)
    return jax.vmap(lambda k: jax.random.randint(k, (n,), 0, n))(member_keys)


def block_resamples(
    bootstrap_key: PRNGKeyArray, size: int, n: int, length: int
) -> Int[Array, " members n"]:
    """The moving-block bootstrap (Kunsch 1989): member `i` draws
    `ceil(n / length)` block starts uniformly from `0..n - length` with key
    `split(bootstrap_key, size)[i]`, and its resample is those blocks of
    `length` consecutive indices, end to end, cut to `n`."""
    blocks = -(-n // length)
    member_keys = jax.random.split(bootstrap_key, size)

    def resample(key):
        starts = jax.random.randint(key, (blocks,), 0, n - length + 1)
        return (starts[:, None] + jnp.arange(length)[None, :]).reshape(-1)[:n]

    return jax.vmap(resample)(member_keys)


def gather(data: PyTree[Any], indices: Array) -> PyTree[Any]:
    """`data[indices]` on every array leaf (indices may carry a member axis)."""
    return jax.tree.map(lambda x: x[indices] if eqx.is_array(x) else x, data)
