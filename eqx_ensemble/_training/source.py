"""`fit`'s data behind one interface: arrays or a stream."""

import abc
import dataclasses
import functools
import os
from collections.abc import Callable, Hashable, Iterable, Iterator
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from jaxtyping import Array, Int, PRNGKeyArray, PyTree

from .._core.data import num_examples
from .._execution.placement import DATA, MEMBERS
from .._execution.profile import example_structs, first_member, signature
from .._internal.checks import check_positive_int
from .epochs import EpochIterator, Epochs
from .placement import Placement
from .sampling import MAX_INDICES, Bootstrap, Sampling
from .stream import BatchGroups, batch_digest, example_count, open_stream


class Batches(abc.ABC):
    """What a compiled dispatch reads to make each step's batch (a dataclass)."""

    @abc.abstractmethod
    def scanned(self) -> PyTree[Any]:
        """The inputs scanned over, one slice per step (`None`: nothing)."""

    @abc.abstractmethod
    def maker(
        self,
        first_step: Int[Array, ""],
        length: int,
        placement: Placement,
        count: Int[Array, ""] | None = None,
    ) -> Callable[[Int[Array, ""], Any], PyTree[Any]]:
        """`batch(step, scanned_slice)` for a dispatch's steps."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, eq=False)
class SampledBatches(Batches):
    """Array data, sampled inside compiled code by the run's `Sampling`."""

    data: PyTree[Any]
    sampling: Sampling
    prepared: Array | None  # the sampling's per-run arrays (a bootstrap's draws)
    data_key: PRNGKeyArray
    num_examples: int
    batch_size: int
    size: int

    def scanned(self) -> PyTree[Any]:
        return None

    def maker(self, first_step, length, placement, count=None):
        indices_of = self.indices_maker(first_step, length, count)
        return lambda step, _: placement.gather_batch(self.data, indices_of(step))

    def draw(
        self, first_step: Int[Array, ""], length: int, count: Int[Array, ""]
    ) -> Array:
        """The indices of the `count` steps from `first_step`, in `length` rows."""
        indices_of = self.indices_maker(first_step, length, count)
        shape = jax.eval_shape(indices_of, first_step)
        rows = jnp.zeros((length, *shape.shape), shape.dtype)
        return jax.lax.fori_loop(
            0,
            count,
            lambda p, rows: rows.at[p].set(indices_of(first_step + p)),
            rows,
        )

    def indices_maker(
        self,
        first_step: Int[Array, ""],
        length: int,
        count: Int[Array, ""] | None = None,
    ) -> Callable[[Int[Array, ""]], Array]:
        return self.sampling.chunk_indices(
            self.data_key,
            self.prepared,
            first_step,
            n=self.num_examples,
            batch_size=self.batch_size,
            size=self.size,
            chunk=length,
            count=count,
        )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, eq=False)
class IndexedBatches(Batches):
    """Array data at indices drawn before the dispatch, one row per step."""

    data: PyTree[Any]
    indices: Int[Array, "steps ..."]

    def scanned(self) -> PyTree[Any]:
        return self.indices

    def maker(self, first_step, length, placement, count=None):
        del first_step, length, count
        return lambda step, indices: placement.gather_batch(self.data, indices)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, eq=False)
class StreamedBatches(Batches):
    """A stream's group of batches, stacked on the host along a leading step axis."""

    group: PyTree[Any]
    per_member: bool

    def scanned(self) -> PyTree[Any]:
        return self.group

    def maker(self, first_step, length, placement, count=None):
        del first_step, length, count
        axes = (MEMBERS, DATA) if self.per_member else (DATA,)
        return lambda step, batch: placement.constrain(batch, axes)


class DataSource(abc.ABC):
    """`fit`'s data for one run, on the host."""

    per_member: bool
    batch_size: int
    num_examples: int | None
    # "arrays" (sampled inside compiled code) or "stream" (read on the host).
    kind: ClassVar[str] = "arrays"
    # Whether a dispatch's group is read and padded on the host (a stream).
    pads_on_host: ClassVar[bool] = False

    @abc.abstractmethod
    def member_batch(self) -> PyTree[Any]:
        """One member's batch of one step, as shapes (for the step's profile)."""

    def batch_signature(self) -> Hashable:
        """A hashable record of `member_batch()` (a key of the run's plan)."""
        return signature(self.member_batch())

    @abc.abstractmethod
    def next_group(self, count: int, length: int, placement: Placement) -> int:
        """Read the next `count` steps' batches; returns how many it read."""

    @abc.abstractmethod
    def batches(self) -> Batches:
        """The compiled dispatch's view of the data read last."""

    def position(self, step: int) -> dict[str, Any] | None:
        """What a checkpoint at `step` records of the data (JSON, or `None`)."""
        del step
        return None


class ArraySource(DataSource):
    """Arrays with a leading example axis, sampled inside compiled code."""

    def __init__(
        self,
        data: PyTree[Any],
        sampling: Sampling,
        batch_size: int | None,
        size: int,
        checked: bool = False,
    ):
        # `checked`: data like data checked before (`run.prepare`): no checks.
        if batch_size is None:
            raise TypeError("`fit` on array data needs `batch_size`")
        self.batch_size = check_positive_int(batch_size, "batch_size")
        self.examples = num_examples(data)
        self.num_examples = self.examples
        if not checked:
            sampling.check(self.examples, self.batch_size, size)
            per_member = size if sampling.per_member else 1
            _check_batch_memory(data, self.batch_size, per_member)
        self.per_member = sampling.per_member
        self.data = data
        self.sampling = sampling
        self.size = size
        self._batches: SampledBatches | None = None

    def member_batch(self) -> PyTree[Any]:
        return example_structs(self.data, self.batch_size)

    def batch_signature(self) -> Hashable:
        # `member_batch()`'s, without making its shapes: looked up per `fit` call.
        leaves, treedef = jax.tree.flatten(self.data)
        return (
            self.batch_size,
            treedef,
            tuple((leaf.shape[1:], leaf.dtype) for leaf in leaves),
        )

    def next_group(self, count: int, length: int, placement: Placement) -> int:
        del length, placement
        return count

    def batches(self) -> Batches:
        assert self._batches is not None, "`start` comes first"
        return self._batches

    def start(
        self, data_key: PRNGKeyArray, bootstrap_key: PRNGKeyArray, placement: Placement
    ) -> None:
        """The run's sampling from its keys, placed; once, before any dispatch."""
        batches = SampledBatches(
            data=self.data,
            sampling=self.sampling,
            prepared=self.sampling.prepare(bootstrap_key, self.size, self.examples),
            data_key=data_key,
            num_examples=self.examples,
            batch_size=self.batch_size,
            size=self.size,
        )
        self._batches = placement.on_mesh(batches)


# A stream's group is cut short after this long: progress about once a second.
READ_SECONDS = 1.0


class StreamSource(DataSource):
    """An iterable of batches, or a resumable `step -> iterator`, read in groups."""

    kind: ClassVar[str] = "stream"
    pads_on_host: ClassVar[bool] = True

    def __init__(
        self,
        data: Any,
        sampling: Sampling,
        batch_size: int | None,
        size: int,
        start: int,
        saved: dict[str, Any] | None = None,
    ):
        if isinstance(sampling, Bootstrap):
            raise ValueError(
                "`ee.Bootstrap()` resamples array data; a stream cannot be "
                "resampled. Pass the data as arrays, or bootstrap inside your data "
                "loader and stream per-member batches with "
                "`sampling=ee.Independent()`"
            )
        self.per_member = sampling.per_member
        self.num_examples = None
        saved = saved or {}
        if isinstance(data, Epochs) and saved.get("stream_state") is not None:
            iterator: Iterator[Any] = data.restore(start, saved["stream_state"])
        else:
            iterator = open_stream(data, start)
        self._resumable = callable(data) and not isinstance(data, Iterable)
        self._groups = BatchGroups(
            iterator,
            start=start,
            size=size,
            per_member=sampling.per_member,
            position_state=(
                iterator.get_state if isinstance(iterator, EpochIterator) else None
            ),
        )
        first = self._groups.peek()
        recorded = saved.get("first_batch")
        if recorded is not None and recorded != self.first_batch_digest():
            raise ValueError(
                f"`data` gives a different batch for step {start} than the one the "
                "checkpoint recorded for that step: the stream does not resume to "
                "the same run (a generator seeded with the resumed step, or a loader "
                "shuffled without a seed?). Make `data(step)` give the same batches "
                "for the "
                "same steps, e.g. with `ee.epochs(loader_for_epoch)` and a loader "
                "seeded with its epoch"
            )
        self._first = first
        examples = example_count(
            jax.tree.map(lambda x: x[None], first), sampling.per_member
        )
        if batch_size is not None and batch_size != examples:
            raise ValueError(
                f"`batch_size={batch_size}` but the stream's batches hold {examples} "
                "examples; leave `batch_size` out for a stream"
            )
        self.batch_size = examples
        self._batches: StreamedBatches | None = None

    def member_batch(self) -> PyTree[Any]:
        return first_member(self._first) if self.per_member else self._first

    def first_batch_digest(self) -> str | None:
        """A fingerprint of the first batch of the group read last."""
        first = self._groups.group_first
        return None if first is None else batch_digest(first)

    def position(self, step: int) -> dict[str, Any] | None:
        groups = self._groups
        if groups.group_start != step and self._resumable:
            # The run's last checkpoint: read the batch after it for a continuation.
            groups.group_start, groups.group_state = step, groups.state()
            try:
                groups.peek()
            except Exception:  # noqa: BLE001 - the stream ends (or fails) there
                groups.group_first = None
        if groups.group_start != step or groups.group_first is None:
            return None
        return {
            "step": step,
            "first_batch": self.first_batch_digest(),
            "stream_state": groups.group_state,
        }

    def next_group(self, count: int, length: int, placement: Placement) -> int:
        group, real = self._groups.next_group(count, length, READ_SECONDS)
        self._batches = None
        if group is not None:
            group = placement.on_mesh(jax.device_put(group))
            self._batches = StreamedBatches(group, self.per_member)
        return real

    def batches(self) -> Batches:
        assert self._batches is not None
        return self._batches


@functools.cache
def _physical_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 2**63


def _check_batch_memory(data: PyTree[Any], batch_size: int, members: int) -> None:
    # Before XLA, which aborts the process on an impossible shape.
    per_example = sum(
        leaf.nbytes // max(leaf.shape[0], 1)
        for leaf in jax.tree.leaves(data)
        if hasattr(leaf, "nbytes") and getattr(leaf, "ndim", 0) > 0
    )
    total = per_example * batch_size * members
    memory = _physical_memory()
    if total > memory or batch_size * members > MAX_INDICES:
        raise ValueError(
            f"A batch of {batch_size} examples for {members} member(s) needs "
            f"{total / 2**30:.1f} GiB, more than this machine's "
            f"{memory / 2**30:.1f} GiB; use a smaller `batch_size`"
        )
