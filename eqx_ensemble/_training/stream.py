"""Streamed data for `fit`: batches stacked a dispatch's worth at a time."""

import hashlib
import inspect
import json
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jaxtyping import PyTree

from .._internal.tree import keystr


def is_array_data(data: Any) -> bool:
    """Whether `data` is a PyTree of arrays (not a source of batches)."""
    leaves = jax.tree.leaves(data, is_leaf=is_source)
    return bool(leaves) and all(isinstance(x, np.ndarray | jax.Array) for x in leaves)


def is_source(x: Any) -> bool:
    # Iterables that are not PyTree containers (generators, loaders) are leaves.
    return isinstance(x, Iterable) and not isinstance(
        x, tuple | list | dict | np.ndarray | jax.Array
    )


def check_data(data: Any) -> bool:
    """Whether `data` is array data (else a stream); raise if it is neither."""
    if is_array_data(data):
        return True
    if isinstance(data, str | bytes):
        raise TypeError("`data` is a string; pass arrays or an iterable of batches")
    if callable(data) or isinstance(data, Iterable):
        return False
    leaves = jax.tree.leaves(data, is_leaf=is_source)
    kinds = sorted({type(x).__name__ for x in leaves}) or ["nothing"]
    raise TypeError(
        f"`data` must be a PyTree of arrays (sampled inside compiled code), an "
        "iterable of batches (a generator, a data loader: the streaming path), or "
        f"a function `step -> iterator of batches`; got {type(data).__name__} "
        f"holding {', '.join(kinds)}. Convert Python lists to arrays with "
        "`np.asarray`."
    )


def host_array(leaf: Any) -> Any:
    """A batch leaf as a stackable array (a PyTorch tensor as a NumPy array)."""
    if isinstance(leaf, np.ndarray | jax.Array | np.generic):
        return leaf
    if callable(getattr(leaf, "detach", None)) and callable(getattr(leaf, "cpu", None)):
        tensor: Any = leaf  # a torch tensor
        return np.asarray(tensor.detach().cpu().numpy())
    return np.asarray(leaf)


def open_stream(
    data: Iterable[PyTree[Any]] | Callable[[int], Iterable[PyTree[Any]]], start: int
) -> Iterator[Any]:
    """The iterator of a stream's batches from step `start` on."""
    if callable(data) and not isinstance(data, Iterable):
        _check_factory(data)
        return _checked_iterator(data(start), start)
    if start > 0:
        raise ValueError(
            f"Resuming at step {start} from a stream needs the batches from "
            f"step {start} on, which a plain iterable cannot promise: pass "
            "`data` as a function `step -> iterator` that starts at `step` "
            "(the resumed step), e.g. `ee.epochs(loader_for_epoch)` or "
            "`lambda step: loader(skip=step)`"
        )
    return iter(data)


def _check_factory(data: Callable[..., Any]) -> None:
    try:
        signature = inspect.signature(data)
    except (TypeError, ValueError):  # builtins: the call itself will tell
        return
    try:
        signature.bind(0)
    except TypeError:
        raise TypeError(
            "`data` is a function, so `fit` calls it as `data(step)` (the step the "
            f"run starts or resumes from); but its signature is {signature}. Give "
            "it a `step` argument, or pass the iterable itself (`data()`)"
        ) from None


def _checked_iterator(batches: Any, start: int) -> Iterator[Any]:
    if batches is None or not isinstance(batches, Iterable):
        raise TypeError(
            f"The stream factory `data` returned {type(batches).__name__} for step "
            f"{start}; `data(step)` must return an iterable of the batches from "
            "`step` on (a generator, a data loader)"
        )
    return iter(batches)


def batch_digest(leaves: list[Any]) -> str:
    """A fingerprint of one batch (shapes, dtypes and bytes of its leaves)."""
    digest = hashlib.sha256()
    for leaf in leaves:
        array = np.ascontiguousarray(np.asarray(leaf))
        digest.update(f"{array.dtype}{array.shape}".encode())
        digest.update(array.data)
    return digest.hexdigest()


class BatchGroups:
    """Reads batches from a stream in stacked groups, keeping where the last
    group starts (step, first batch, stream state) for checkpoints."""

    def __init__(
        self,
        iterator: Iterator[Any],
        *,
        start: int,
        size: int,
        per_member: bool,
        position_state: Callable[[], Any] | None = None,
    ):
        self.iterator = iterator
        self.position_state = position_state
        self.size = size
        self.per_member = per_member
        self.position = start
        self.first: tuple[Any, list[tuple[str, tuple[int, ...], Any]]] | None = None
        self.pending: list[list[Any]] = []
        self.group_start = start
        self.group_state = self.state()
        self.group_first: list[Any] | None = None

    def state(self) -> Any:
        """The stream's own position record (a JSON copy), or `None`."""
        if self.position_state is None:
            return None
        return json.loads(json.dumps(self.position_state()))

    def _read(self) -> list[Any] | None:
        if self.pending:
            return self.pending.pop(0)
        try:
            batch = next(self.iterator)
        except StopIteration:
            return None
        leaves = self._check(batch)
        self.position += 1
        return leaves

    def peek(self) -> PyTree[Any]:
        """The next batch, read now and still returned by the next group."""
        leaves = self._read()
        if leaves is None:
            raise ValueError("The data stream yielded no batch at all")
        self.pending.append(leaves)
        self.group_first = leaves
        assert self.first is not None
        return jtu.tree_unflatten(self.first[0], leaves)

    def _check(self, batch: Any) -> Any:
        leaves, treedef = jtu.tree_flatten_with_path(batch)
        arrays = [(keystr(path), _array(leaf, path)) for path, leaf in leaves]
        if self.first is None:
            if not arrays:
                raise ValueError(
                    f"The batch for step {self.position} holds no arrays; each "
                    "batch must be a PyTree of arrays, e.g. `(x, y)`"
                )
            axis = 0
            for path, leaf in arrays:
                if leaf.dtype.kind not in "biufc":
                    raise TypeError(
                        f"Batch leaf `{path}` at step {self.position} is not an "
                        f"array of numbers (dtype {leaf.dtype}); convert strings "
                        "or objects to numbers in the data loader"
                    )
                if leaf.ndim <= axis or (
                    self.per_member and leaf.shape[0] != self.size
                ):
                    raise ValueError(
                        f"Batch leaf `{path}` at step {self.position} has shape "
                        f"{leaf.shape}, but a per-member stream needs a leading "
                        f"member axis of size {self.size}"
                        if self.per_member
                        else f"Batch leaf `{path}` at step {self.position} is a "
                        "scalar; each array needs a leading example axis"
                    )
            self.first = (treedef, [(p, x.shape, x.dtype) for p, x in arrays])
            return [x for _, x in arrays]
        first_treedef, specs = self.first
        if treedef != first_treedef:
            raise ValueError(
                f"The batch for step {self.position} has a different structure "
                f"from the first batch:\n{treedef}\nvs\n{first_treedef}"
            )
        for (path, leaf), (_, shape, dtype) in zip(arrays, specs, strict=True):
            if leaf.shape != shape or leaf.dtype != dtype:
                raise ValueError(
                    f"Batch leaf `{path}` at step {self.position} has "
                    f"{leaf.dtype}{list(leaf.shape)}, but the first batch had "
                    f"{dtype}{list(shape)}: every batch of a stream must have the "
                    "same shapes (drop or pad a short last batch)"
                )
        return [x for _, x in arrays]

    def next_group(
        self, count: int, length: int, seconds: float | None = None
    ) -> tuple[PyTree[Any], int]:
        """Up to `count` next batches stacked, padded to `length` with the last,
        and how many are real (fewer at the stream's end or after `seconds`)."""
        deadline = None if seconds is None else time.monotonic() + seconds
        self.group_first = None  # until this group's first batch is read
        if not self.pending:
            self.group_start, self.group_state = self.position, self.state()
        else:
            self.group_start = self.position - len(self.pending)
        leaves: list[list[Any]] = []
        for _ in range(count):
            batch = self._read()
            if batch is None:
                break
            leaves.append(batch)
            if deadline is not None and time.monotonic() >= deadline:
                break
        if not leaves:
            self.group_first = None
            return None, 0
        self.group_first = leaves[0]
        real = len(leaves)
        leaves += [leaves[-1]] * (length - real)
        assert self.first is not None
        stacked = [
            jnp.stack(column) if isinstance(column[0], jax.Array) else np.stack(column)
            for column in zip(*leaves, strict=True)
        ]
        return jtu.tree_unflatten(self.first[0], stacked), real


def _array(leaf: Any, path: Any) -> Any:
    try:
        return host_array(leaf)
    except Exception as error:  # noqa: BLE001 - re-raised with the leaf's path
        raise TypeError(
            f"Batch leaf `{keystr(path)}` ({type(leaf).__name__}) is not an array: "
            f"{error}"
        ) from error


def example_count(group: PyTree[Any], per_member: bool) -> int:
    """Examples per member in one batch of a stacked group."""
    axis = 2 if per_member else 1
    for leaf in jax.tree.leaves(group):
        if eqx.is_array_like(leaf) and np.ndim(leaf) > axis:
            return int(np.shape(leaf)[axis])
    return 1
