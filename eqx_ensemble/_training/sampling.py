"""How `fit` draws each member's minibatch: `Shared`, `Independent`, `Bootstrap`.
A chunk computes its epoch permutations up front, not per step."""

import abc
import operator
from collections.abc import Callable
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Int, PRNGKeyArray

from .._core.data import (
    block_resamples,
    bootstrap_resamples,
    epoch_indices,
    permutation,
)
from .._execution.compile import one_shot_jit
from .._internal.checks import check_positive_int
from .._internal.component import Component
from .._internal.keys import run_keys

# Above this many precomputed indices per chunk, permute at every step instead.
_MAX_PRECOMPUTED = 2**26
# A short dispatch (`count`) makes all its epochs' permutations up to this.
_ALL_EPOCHS = 8
_ALL_EPOCHS_INDICES = 2**16
# Index arrays and batch axes are int32 in XLA: nothing may reach 2**31 elements.
MAX_INDICES = 2**31 - 1


class Sampling(Component):
    """How each member's minibatch is drawn from array data (abstract).

    Built in: [`ee.Shared`][eqx_ensemble.Shared],
    [`ee.Independent`][eqx_ensemble.Independent],
    [`ee.Bootstrap`][eqx_ensemble.Bootstrap]. A sampling says whether batches
    carry a member axis (`per_member`), prepares per-run arrays (`prepare`), and
    gives a step's example indices (`indices`).

    **Example:**

    ```python
    sampling = ee.Shared()
    rows = sampling.indices(jax.random.key(0), None, jnp.int32(3), n=10,
                            batch_size=4, size=2)       # step 3's 4 rows, shared
    per_member = ee.Independent().indices(jax.random.key(0), None, jnp.int32(3),
                                          n=10, batch_size=4, size=2)   # (2, 4)
    ```
    """

    per_member: ClassVar[bool]
    name: ClassVar[str]

    def record(self) -> str:
        """The sampling's name in a checkpoint's run record (`name`, else `repr`)."""
        return getattr(self, "name", None) or repr(self)

    def check(self, num_examples: int, batch_size: int, size: int) -> None:
        """Raise before any work if `batch_size` cannot be drawn from the data."""
        if batch_size * (size if self.per_member else 1) > MAX_INDICES:
            raise ValueError(
                f"`batch_size` ({batch_size}) x {size if self.per_member else 1} "
                f"member(s) is more than the {MAX_INDICES} indices XLA can address "
                "in one step; use a smaller batch"
            )

    def prepare(
        self, bootstrap_key: PRNGKeyArray, size: int, num_examples: int
    ) -> Array | None:
        """Per-run arrays the indices need (made once per `fit` call)."""
        del bootstrap_key, size, num_examples
        return None

    @abc.abstractmethod
    def indices(
        self,
        data_key: PRNGKeyArray,
        prepared: Array | None,
        step: Int[Array, ""],
        *,
        n: int,
        batch_size: int,
        size: int,
    ) -> Int[Array, "..."]:
        """Step `step`'s example indices: `(batch_size,)` or `(size, batch_size)`."""

    def chunk_indices(
        self,
        data_key: PRNGKeyArray,
        prepared: Array | None,
        first_step: Int[Array, ""],
        *,
        n: int,
        batch_size: int,
        size: int,
        chunk: int,
        count: Int[Array, ""] | None = None,
    ) -> Callable[[Int[Array, ""]], Array]:
        """`indices` for steps `[first_step, first_step + chunk)`, shared work
        done once (for the first `count` steps only, where given)."""
        del first_step, chunk, count
        return lambda step: self.indices(
            data_key, prepared, step, n=n, batch_size=batch_size, size=size
        )


class _WithoutReplacement(Sampling):
    """Epochs of `E = n // batch_size` steps, as `_core.data.epoch_indices`."""

    def check(self, num_examples: int, batch_size: int, size: int) -> None:
        super().check(num_examples, batch_size, size)
        if batch_size > num_examples:
            raise ValueError(
                f"`batch_size` ({batch_size}) is larger than the data "
                f"({num_examples} examples); use a smaller batch or "
                "`sampling=ee.Bootstrap()` (sampling with replacement)"
            )

    def _data_keys(self, data_key: PRNGKeyArray, size: int) -> Any:
        return jax.random.split(data_key, size) if self.per_member else data_key

    def indices(self, data_key, prepared, step, *, n, batch_size, size):
        del prepared
        keys = self._data_keys(data_key, size)
        if self.per_member:
            return jax.vmap(lambda k: epoch_indices(k, step, n, batch_size))(keys)
        return epoch_indices(keys, step, n, batch_size)

    def chunk_indices(
        self, data_key, prepared, first_step, *, n, batch_size, size, chunk,
        count=None,
    ):  # fmt: skip
        steps_per_epoch = n // batch_size
        num_epochs = -(-chunk // steps_per_epoch) + 1  # most epochs a chunk touches
        streams = size if self.per_member else 1
        if num_epochs >= chunk or num_epochs * streams * n > _MAX_PRECOMPUTED:
            return super().chunk_indices(
                data_key,
                prepared,
                first_step,
                n=n,
                batch_size=batch_size,
                size=size,
                chunk=chunk,
                count=count,
            )
        first_epoch = first_step // steps_per_epoch
        epochs = first_epoch + jnp.arange(num_epochs, dtype=first_epoch.dtype)

        def epoch_permutation(key, epoch):  # exactly `epoch_indices`' permutation
            return permutation(jax.random.fold_in(key, epoch), n)

        def permutations(key):
            if count is None or (
                num_epochs <= _ALL_EPOCHS and num_epochs * n <= _ALL_EPOCHS_INDICES
            ):
                return jax.vmap(lambda epoch: epoch_permutation(key, epoch))(epochs)
            # Only the epochs the dispatch's `count` steps touch.
            last = (first_step + jnp.maximum(count, 1) - 1) // steps_per_epoch
            needed = jnp.minimum(last - first_epoch + 1, num_epochs)
            empty = jnp.zeros((num_epochs, n), jnp.int32)
            return jax.lax.fori_loop(
                0,
                needed,
                lambda i, perms: perms.at[i].set(
                    epoch_permutation(key, first_epoch + i).astype(jnp.int32)
                ),
                empty,
            )

        def take(perms, step):
            epoch = step // steps_per_epoch - first_epoch
            position = step % steps_per_epoch
            perm = jax.lax.dynamic_index_in_dim(perms, epoch, axis=0, keepdims=False)
            return jax.lax.dynamic_slice(perm, (position * batch_size,), (batch_size,))

        keys = self._data_keys(data_key, size)
        if not self.per_member:
            perms = permutations(keys)
            return lambda step: take(perms, step)
        member_perms = jax.vmap(permutations)(keys)
        return lambda step: jax.vmap(lambda perms: take(perms, step))(member_perms)


class Shared(_WithoutReplacement):
    """Every member trains on the same minibatch at each step (the default).

    The member axis folds into the weights: one wide matmul per layer for the
    whole ensemble. Step `s` takes slice `s % E` of
    `jax.random.permutation(jax.random.fold_in(data_key, s // E), n)` with
    `E = n // batch_size`.

    **Example:**

    ```python
    ens = ee.ensemble(lambda k: eqx.nn.Linear(1, 1, key=k), size=2,
                      key=jax.random.key(0))
    x = jnp.linspace(0, 1, 8)[:, None]
    loss = lambda m, b, k: jnp.mean((jax.vmap(m)(b) - 2 * b) ** 2)
    result = ee.fit(ens, loss, optax.sgd(0.1), x, steps=4, batch_size=4,
                    key=jax.random.key(1), sampling=ee.Shared(), callbacks=())
    ```
    """

    per_member: ClassVar[bool] = False
    name: ClassVar[str] = "shared"


class Independent(_WithoutReplacement):
    """Each member shuffles the data on its own (its own epochs, same data).

    Member `i` follows [`ee.Shared`][eqx_ensemble.Shared]'s rule with data key
    `jax.random.split(data_key, size)[i]`. For a streamed source, each batch
    carries a leading member axis (member `i` trains on slice `i`).

    **Example:**

    ```python
    ens = ee.ensemble(lambda k: eqx.nn.Linear(1, 1, key=k), size=2,
                      key=jax.random.key(0))
    x = jnp.linspace(0, 1, 8)[:, None]
    loss = lambda m, b, k: jnp.mean((jax.vmap(m)(b) - 2 * b) ** 2)
    result = ee.fit(ens, loss, optax.sgd(0.1), x, steps=4, batch_size=4,
                    key=jax.random.key(1), sampling=ee.Independent(),
                    callbacks=())
    ```
    """

    per_member: ClassVar[bool] = True
    name: ClassVar[str] = "independent"


class Bootstrap(Sampling):
    """Bagging: each member trains on its own bootstrap resample of the data.

    Member `i`'s resample is
    `jax.random.randint(jax.random.split(bootstrap_key, size)[i], (n,), 0, n)`
    ([`in_bag`][eqx_ensemble.Bootstrap.in_bag] rebuilds it), and step `s` draws
    positions `jax.random.randint(jax.random.fold_in(data_key, s),
    (size, batch_size), 0, n)` into it.

    `block_length=L > 1` draws blocks of `L` consecutive examples (the
    moving-block bootstrap, Kunsch 1989: `ceil(n / L)` starts uniform in
    `0..n - L`, cut to `n`), for ordered data such as time series
    ([`ee.conformal.enbpi`][eqx_ensemble.conformal.enbpi]). The first and last
    `L - 1` examples are drawn less often.

    **Example:**

    ```python
    ens = ee.ensemble(lambda k: eqx.nn.Linear(1, 1, key=k), size=3,
                      key=jax.random.key(0))
    x = jnp.linspace(0, 1, 8)[:, None]
    loss = lambda m, b, k: jnp.mean((jax.vmap(m)(b) - 2 * b) ** 2)
    key = jax.random.key(1)
    result = ee.fit(ens, loss, optax.sgd(0.1), x, steps=4, batch_size=4,
                    key=key, sampling=ee.Bootstrap(), callbacks=())
    counts = ee.Bootstrap().in_bag(key, size=3, num_examples=8)   # (3, 8)
    ```
    """

    block_length: int = eqx.field(default=1, static=True)
    per_member: ClassVar[bool] = True
    name: ClassVar[str] = "bootstrap"

    def __check_init__(self):
        length = self.block_length
        if isinstance(length, bool) or not isinstance(length, int | np.integer):
            raise TypeError(f"`block_length` must be an int >= 1, got {length!r}")
        if length < 1:
            raise ValueError(f"`block_length` must be >= 1, got {length}")

    def record(self) -> str:
        if self.block_length == 1:
            return self.name
        return f"{self.name}(block_length={self.block_length})"

    def _check_length(self, num_examples: int) -> None:
        if self.block_length > num_examples:
            raise ValueError(
                f"`Bootstrap(block_length={self.block_length})` is longer than the "
                f"data ({num_examples} examples)"
            )

    def check(self, num_examples: int, batch_size: int, size: int) -> None:
        super().check(num_examples, batch_size, size)
        self._check_length(num_examples)

    def prepare(self, bootstrap_key, size, num_examples):
        if size * num_examples > MAX_INDICES:
            raise ValueError(
                f"Bootstrap resamples of {num_examples} examples for {size} members "
                f"are more than the {MAX_INDICES} indices XLA can address; use "
                "fewer members or a streamed data source"
            )
        if self.block_length == 1:
            return bootstrap_resamples(bootstrap_key, size, num_examples)
        self._check_length(num_examples)
        return block_resamples(
            bootstrap_key, size, num_examples, int(self.block_length)
        )

    def indices(self, data_key, prepared, step, *, n, batch_size, size):
        assert prepared is not None
        positions = jax.random.randint(
            jax.random.fold_in(data_key, step), (size, batch_size), 0, n
        )
        return jnp.take_along_axis(prepared, positions, axis=1)

    def in_bag(
        self, key: PRNGKeyArray, *, size: int, num_examples: int
    ) -> Int[Array, "members n"]:
        """How many times each member's resample holds each example, rebuilt from
        the `key` given to [`fit`][eqx_ensemble.fit]. Zero marks out-of-bag.

        **Arguments:**

        - `key`: the key of the `fit` call.
        - `size`: the number of members.
        - `num_examples`: the number of training examples.

        **Returns:**

        Integer counts of shape `(size, num_examples)`.

        **Example:**

        ```python
        counts = ee.Bootstrap().in_bag(jax.random.key(1), size=4, num_examples=10)
        out_of_bag = counts == 0      # (4, 10)
        ```
        """
        bootstrap_key = run_keys(key).bootstrap  # the key `fit` drew from
        counts = {"size": size, "num_examples": num_examples}
        for name, value in counts.items():
            try:
                if isinstance(value, bool):
                    raise TypeError
                counts[name] = check_positive_int(operator.index(value), name)
            except TypeError:
                raise TypeError(
                    f"`{name}` must be an int, got {type(value).__name__}"
                ) from None
        return _in_bag(self, bootstrap_key, counts["size"], counts["num_examples"])


@one_shot_jit(static_argnums=(0, 2, 3))
def _in_bag(sampling: Bootstrap, key: Array, size: int, num_examples: int) -> Array:
    resamples = sampling.prepare(key, size, num_examples)
    return jax.vmap(lambda r: jnp.bincount(r, length=num_examples))(resamples)


_BY_NAME: dict[str, type[Sampling]] = {
    cls.name: cls for cls in (Shared, Independent, Bootstrap)
}


def as_sampling(sampling: Any) -> Sampling:
    """A `Sampling` from an instance or one of the accepted names."""
    if isinstance(sampling, Sampling):
        return sampling
    if isinstance(sampling, type) and issubclass(sampling, Sampling):
        raise TypeError(
            f"`sampling` must be an instance, e.g. `ee.{sampling.__name__}()`, "
            f"not the class {sampling.__name__}"
        )
    if isinstance(sampling, str) and sampling in _BY_NAME:
        return _BY_NAME[sampling]()
    raise ValueError(
        "`sampling` must be one of ee.Shared(), ee.Independent(), ee.Bootstrap() "
        f"(or the names {tuple(_BY_NAME)}), got {sampling!r}"
    )


def from_record(record: Any) -> Sampling | None:
    """The sampling a run record names, or `None` if it cannot be rebuilt."""
    if isinstance(record, str) and record.startswith("bootstrap(block_length="):
        length = record[len("bootstrap(block_length=") : -1]
        if record.endswith(")") and length.isdigit():
            return Bootstrap(block_length=int(length))
        return None
    try:
        return as_sampling(record)
    except ValueError:
        return None
