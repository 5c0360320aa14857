"""Array data for `fit`: checks, epoch permutations, bootstrap resamples, gathers."""

from functools import partial
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
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
    """Step `s` takes slice `s % E` of epoch `s // E`'s permutation
    (`E = n // batch_size`; each epoch's remainder is dropped)."""
    steps_per_epoch = n // batch_size
    epoch = step // steps_per_epoch
    position = step % steps_per_epoch
    indices = permutation(jax.random.fold_in(data_key, epoch), n)
    return jax.lax.dynamic_slice(indices, (position * batch_size,), (batch_size,))


# From here a CPU sorts keys alone (~0.12 s more compilation; 60,000: 39 -> 11.6 ms).
SORT_ALONE_FROM = 16384


def permutation(key: PRNGKeyArray, n: int) -> Int[Array, " n"]:
    """`jax.random.permutation(key, n)`, bit for bit; on a CPU from
    `SORT_ALONE_FROM` each round sorts its keys alone (XLA's CPU sort of one
    array beats key-value)."""

    def reference(key: PRNGKeyArray) -> Array:
        return jax.random.permutation(key, n)

    if n < SORT_ALONE_FROM:
        return reference(key)
    return jax.lax.platform_dependent(
        key, cpu=partial(_permutation_sorting_alone, n=n), default=reference
    )


def rounds(n: int) -> int:
    """The rounds of JAX's `_shuffle`, computed as JAX computes them."""
    return int(np.ceil(3 * np.log(max(1, n)) / np.log(np.iinfo(np.uint32).max)))


def _permutation_sorting_alone(key: PRNGKeyArray, n: int) -> Array:
    """`jax.random.permutation`'s rounds with `_sorted_alone`, in a loop."""

    def one_round(_: Array, carry: tuple[Array, Array]) -> tuple[Array, Array]:
        key, indices = carry
        key, subkey = jax.random.split(key)
        bits = jax.random.bits(subkey, (n,), jnp.uint32)
        return key, _sorted_alone(bits, indices)

    return jax.lax.fori_loop(0, rounds(n), one_round, (key, jnp.arange(n)))[1]


def _sorted_alone(keys: Array, values: Array) -> Array:
    """`lax.sort_key_val(keys, values)[1]` by sorting the keys alone: a value
    goes to its key's first sorted position plus the equal keys before it (ties
    settled in rounds)."""
    n = keys.shape[0]
    index = jnp.arange(n, dtype=jnp.int32)
    first = _first_positions(jnp.sort(keys), keys)

    def unplaced(carry: tuple[Array, Array]) -> Array:
        _, placed = carry
        return ~placed.all()

    def place(carry: tuple[Array, Array]) -> tuple[Array, Array]:
        slot, placed = carry
        earliest = (
            jnp.full((n,), n, jnp.int32).at[slot].min(jnp.where(placed, n, index))
        )
        takes = ~placed & (earliest[slot] == index)
        moved = (~placed & ~takes).astype(jnp.int32)
        return slot + moved, placed | takes

    init = (first, jnp.zeros((n,), bool))
    slot, _ = jax.lax.while_loop(unplaced, place, init)
    return jnp.zeros_like(values).at[slot].set(values, unique_indices=True)


def _first_positions(sorted_keys: Array, keys: Array) -> Array:
    """`jnp.searchsorted(sorted_keys, keys)` as a loop (JAX 0.10.2's cannot
    batch over an Explicit mesh axis)."""
    n = sorted_keys.shape[0]
    steps = n.bit_length()  # the first step is the largest power of two <= n

    def halve(i: Array, position: Array) -> Array:
        candidate = position + jnp.left_shift(jnp.int32(1), steps - 1 - i)
        below = sorted_keys[jnp.minimum(candidate, n) - 1] < keys
        return jnp.where((candidate <= n) & below, candidate, position)

    return jax.lax.fori_loop(0, steps, halve, jnp.zeros(keys.shape, jnp.int32))


def bootstrap_resamples(
    bootstrap_key: PRNGKeyArray, size: int, n: int
) -> Int[Array, " members n"]:
    """Member `i`'s `n` draws with replacement (key `split(bootstrap_key, size)[i]`)."""
    member_keys = jax.random.split(bootstrap_key, size)
    return jax.vmap(lambda k: jax.random.randint(k, (n,), 0, n))(member_keys)


def block_resamples(
    bootstrap_key: PRNGKeyArray, size: int, n: int, length: int
) -> Int[Array, " members n"]:
    """The moving-block bootstrap (Kunsch 1989): `ceil(n / length)` uniform
    block starts per member, blocks end to end, cut to `n`."""
    blocks = -(-n // length)
    member_keys = jax.random.split(bootstrap_key, size)

    def resample(key):
        starts = jax.random.randint(key, (blocks,), 0, n - length + 1)
        return (starts[:, None] + jnp.arange(length)[None, :]).reshape(-1)[:n]

    return jax.vmap(resample)(member_keys)


def gather(data: PyTree[Any], indices: Array) -> PyTree[Any]:
    """`data[indices]` on every array leaf (indices may carry a member axis)."""
    return jax.tree.map(lambda x: x[indices] if eqx.is_array(x) else x, data)
