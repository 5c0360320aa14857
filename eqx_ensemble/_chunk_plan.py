"""Per-chunk precomputation for `fit`'s fused loop (a speed-up, same numbers).

`fit` samples minibatches inside compiled code. Without replacement
(`"shared"`/`"independent"`), step `s` takes slice `s % E` of the permutation of
epoch `s // E` (`E = n // batch_size`, see `_data.epoch_indices`). Recomputing that
permutation at every step costs a sort of `n` indices (per member for
`"independent"`) on every step; on small models it was a quarter of the step time.
A chunk of `chunk` steps touches at most `ceil(chunk / E) + 1` epochs, so the chunk
computes those permutations once, up front, with the same keys, and every step
slices its batch out of them: the indices are bit-for-bit those of
`_data.batch_indices`.
"""

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Int, PRNGKeyArray

from ._data import batch_indices

# Above this many precomputed indices (int32) per chunk, fall back to computing the
# permutation at every step rather than holding all of them at once.
_MAX_PRECOMPUTED = 2**26


def epochs_spanned(chunk: int, steps_per_epoch: int) -> int:
    """The most epochs that `chunk` consecutive steps can touch."""
    return -(-chunk // steps_per_epoch) + 1


def chunk_sampler(
    sampling: str,
    data_key: PRNGKeyArray,
    resamples: Int[Array, " members n"] | None,
    first_step: Int[Array, ""],
    *,
    n: int,
    batch_size: int,
    size: int,
    chunk: int,
) -> Callable[[Int[Array, ""]], Any]:
    """`indices(step)` equal to `batch_indices(sampling, ..., step, ...)` for every
    `step` in `[first_step, first_step + chunk)`, with the epoch permutations of
    the chunk computed once."""

    def per_step(step):
        return batch_indices(
            sampling, data_key, resamples, step, n=n, batch_size=batch_size, size=size
        )

    if sampling not in ("shared", "independent"):
        return per_step  # bootstrap draws fresh positions per step: nothing to hoist
    steps_per_epoch = n // batch_size
    num_epochs = epochs_spanned(chunk, steps_per_epoch)
    members = 1 if sampling == "shared" else size
    if num_epochs >= chunk or num_epochs * members * n > _MAX_PRECOMPUTED:
        return per_step
    first_epoch = first_step // steps_per_epoch
    epochs = first_epoch + jnp.arange(num_epochs, dtype=first_epoch.dtype)

    def permutations(key):  # (num_epochs, n), exactly `epoch_indices`' permutations
        return jax.vmap(
            lambda epoch: jax.random.permutation(jax.random.fold_in(key, epoch), n)
        )(epochs)

    def take(perms, step):
        epoch = step // steps_per_epoch - first_epoch
        position = step % steps_per_epoch
        perm = jax.lax.dynamic_index_in_dim(perms, epoch, axis=0, keepdims=False)
        return jax.lax.dynamic_slice(perm, (position * batch_size,), (batch_size,))

    if sampling == "shared":
        perms = permutations(data_key)
        return lambda step: take(perms, step)
    member_perms = jax.vmap(permutations)(jax.random.split(data_key, size))
    return lambda step: jax.vmap(lambda perms: take(perms, step))(member_perms)
