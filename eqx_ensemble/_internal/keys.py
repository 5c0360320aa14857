"""Key derivation: checks, per-member splits, and a `fit` run's streams."""

from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Key, PRNGKeyArray, UInt32


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
            + (
                " (a raw key of another implementation, e.g. rbg's shape (4,), "
                "is taken typed: `jax.random.wrap_key_data(key, impl=...)`)"
                if key.dtype == jnp.uint32 and key.shape != (2,) and key.ndim == 1
                else ""
            )
        )


def split_member_keys(
    key: PRNGKeyArray, size: int
) -> Key[Array, " members"] | UInt32[Array, " members 2"]:
    """The per-member keys used throughout the library: `split(key, size)`."""
    check_key(key)
    return jax.random.split(key, size)


class RunKeys(NamedTuple):
    """A `fit` run's keys (documented on `fit`): `split(key, 3)` and
    `fold_in(key, 3)`. A NamedTuple: a Module costs ~10 us per `fit` call."""

    data: PRNGKeyArray
    bootstrap: PRNGKeyArray
    train: PRNGKeyArray
    eval: PRNGKeyArray


def run_keys(key: PRNGKeyArray) -> RunKeys:
    data_key, bootstrap_key, train_key = jax.random.split(key, 3)
    return RunKeys(data_key, bootstrap_key, train_key, jax.random.fold_in(key, 3))


# An optimizer's own randomness (SG-MCMC noise), apart from the loss's key.
OPTIMIZER_STREAM = 0x6F707478  # "optx"


def optimizer_key(member_key: PRNGKeyArray) -> PRNGKeyArray:
    """The `key` a member's optimizer update receives."""
    return jax.random.fold_in(member_key, OPTIMIZER_STREAM)
