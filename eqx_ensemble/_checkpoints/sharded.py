"""Sharded checkpoints: a folder per checkpoint, each process writing the shards it
owns with tensorstore, committed by a verified manifest.

Layout (in the checkpoints guide): `manifest.ckpt`, the single-file container whose
`jax.Array` records hold a `"store"` entry (dtype, shapes, per chunk its position,
writer and sha256), and `arrays/<n>/`, leaf `n` as a zarr v3 array whose chunk is
its shard. No code runs on load: the tensorstore spec is built here, and every
chunk is checked against its sha256 before use.
"""

import contextlib
import errno
import hashlib
import itertools
import math
import os
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .file import (
    FORMAT_NAME,
    FORMAT_VERSION,
    CheckpointError,
    CheckpointFile,
    fsync_directory,
    write_file,
)
from .leaves import data_of, encode_leaves, little_endian
from .writer import (
    MANIFEST,
    Phase,
    check_replaceable,
    make_parent,
    partial_folder,
    put_in_place,
    remove_tree,
)

ARRAYS = "arrays"
_PART_FORMAT = "eqx_ensemble.checkpoint-part"


def _tensorstore() -> Any:
    try:
        import tensorstore
    except ImportError:
        raise ImportError(
            "Sharded checkpoints are written and read with tensorstore, which is "
            "not installed: `pip install 'eqx_ensemble[distributed]'` (or "
            "`pip install tensorstore`). To write the single-file format instead, "
            "pass `sharded=False`."
        ) from None
    return tensorstore


# -- writing -------------------------------------------------------------------


class _Leaf:
    """A `jax.Array` leaf to store and its chunk plan (`holders`: each chunk's
    start to the devices holding it), from the global sharding only."""

    def __init__(self, index: int, record: dict[str, Any], array: jax.Array):
        self.index, self.record, self.array = index, record, array
        dtype = np.dtype(array.dtype)
        try:
            _tensorstore().dtype(dtype.name)
            self.raw = False
        except (TypeError, ValueError):
            self.raw = True  # a dtype tensorstore lacks: stored as bytes
        self.stored_dtype = "uint8" if self.raw else dtype.name
        indices = array.sharding.devices_indices_map(array.shape)
        self.holders: dict[tuple[int, ...], list[Any]] = {}
        extents = [1] * array.ndim
        for device in sorted(indices, key=lambda d: d.id):
            bounds = [s.indices(n)[:2] for s, n in zip(indices[device], array.shape)]
            for axis, (begin, end) in enumerate(bounds):
                extents[axis] = max(extents[axis], end - begin)
            self.holders.setdefault(tuple(b for b, _ in bounds), []).append(device)
        if math.prod(array.shape) == 0:
            self.holders = {}
        elif any(b % e for start in self.holders for b, e in zip(start, extents)):
            raise ValueError(
                f"Cannot save leaf `{record['path']}` sharded: its sharding "
                f"{array.sharding} splits shape {tuple(array.shape)} into shards "
                "that do not form a regular grid; reshard it (e.g. with `ee.shard`) "
                "or pass `sharded=False`"
            )
        self.shard_bytes = math.prod(extents) * dtype.itemsize
        self.shape = [*array.shape, *([dtype.itemsize] if self.raw else [])]
        self.chunk = [*extents, *([dtype.itemsize] if self.raw else [])]

    def position(self, start: tuple[int, ...]) -> list[int]:
        """The grid position of the chunk at `start` (a raw leaf's byte axis: 0)."""
        return [b // e for b, e in zip(start, self.chunk)] + [0] * self.raw


def _balance(leaves: list[_Leaf], local: list[bool]) -> dict[tuple[int, Any], int]:
    """The process that writes each chunk `(leaf index, start)`: of its holders,
    the one with the fewest bytes so far. An array each process holds whole
    (`local`) is process 0's, as in one file."""
    written: Counter[int] = Counter()
    writers = {}
    for leaf, own in zip(leaves, local, strict=True):
        if own:
            written[0] += (
                math.prod(leaf.array.shape) * np.dtype(leaf.array.dtype).itemsize
            )
        for start, devices in leaf.holders.items():
            process = 0
            if not own:
                processes = {device.process_index for device in devices}
                process = min(processes, key=lambda p: (written[p], p))
                written[process] += leaf.shard_bytes
            writers[(leaf.index, start)] = process
    return writers


def _spec(folder: Path, metadata: dict[str, Any] | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "driver": "zarr3",
        "kvstore": {"driver": "file", "path": str(folder)},
        # Every chunk is a file, also one equal to the fill value (zeros).
        "store_data_equal_to_fill_value": True,
    }
    if metadata is not None:
        spec["metadata"] = metadata
    return spec


def _digest(host: np.ndarray) -> str:
    return hashlib.sha256(
        little_endian(host).reshape(-1).view(np.uint8).data
    ).hexdigest()


def sharded_write(
    path: Path, leaves: list[tuple[Any, Any]], manifest: dict[str, Any], copy: bool
) -> tuple[list[Phase], list[Phase]]:
    """The `prepare` and `finish` phases that write `leaves` as a sharded
    checkpoint at `path`, completing `manifest` (`copy`: as `encode_leaves`)."""
    write = _ShardedWrite(path, leaves, manifest, copy)
    prepare = [Phase(write.create), Phase(write.copy_own, everyone=True)]
    return prepare, [Phase(write.write_own, everyone=True), Phase(write.commit)]


class _ShardedWrite:
    """One sharded write's state, shared by its phases."""

    def __init__(
        self, path: Path, leaves: list[tuple[Any, Any]], manifest: dict[str, Any],
        copy: bool,
    ):  # fmt: skip
        self.path, self.manifest, self.ts = path, manifest, _tensorstore()
        self.process, self.count = jax.process_index(), jax.process_count()
        # NumPy arrays and Python numbers: in the manifest's data section.
        manifest["leaves"], self.chunks, elsewhere = encode_leaves(
            leaves, copy=copy, stored=lambda leaf: isinstance(leaf, jax.Array)
        )
        self.stored = [_Leaf(*leaf) for leaf in elsewhere]
        local = [leaf.array.is_fully_addressable for leaf in self.stored]
        if self.count > 1 and self.stored:
            # Held whole by every process (each its own value), or a global array.
            from jax.experimental import multihost_utils

            every = np.asarray(multihost_utils.process_allgather(np.asarray(local)))
            local = [bool(x) for x in np.all(every.reshape(self.count, -1), axis=0)]
        self.writers = _balance(self.stored, local)
        self.partial = partial_folder(path)
        # This process's shards on its host (the run may reuse the device buffers).
        self.own: list[tuple[_Leaf, list[tuple[tuple[int, ...], np.ndarray]]]] = []

    def create(self) -> None:
        """Process 0: a fresh temporary folder and every array's metadata."""
        ts, partial = self.ts, self.partial
        check_replaceable(self.path)
        make_parent(self.path)
        remove_tree(partial)
        (partial / ARRAYS).mkdir(parents=True)
        for leaf in self.stored:
            metadata = {
                "shape": leaf.shape,
                "data_type": leaf.stored_dtype,
                "chunk_grid": {
                    "name": "regular",
                    "configuration": {"chunk_shape": leaf.chunk},
                },
                "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}],
            }
            with _as_os_error():
                ts.open(
                    _spec(partial / ARRAYS / str(leaf.index), metadata), create=True
                ).result()

    def copy_own(self) -> None:
        """Every process: the shards it writes, copied to its host."""
        for leaf in self.stored:
            shards = {shard.device: shard for shard in leaf.array.addressable_shards}
            hosts = []
            for start in sorted(leaf.holders):
                if self.writers[(leaf.index, start)] != self.process:
                    continue
                device = next(d for d in leaf.holders[start] if d in shards)
                host = np.array(little_endian(np.asarray(shards[device].data)))
                if leaf.raw:
                    host = host.view(np.uint8).reshape(*host.shape, -1)
                hosts.append((start, host))
            if hosts:
                self.own.append((leaf, hosts))

    def write_own(self) -> None:
        """Every process: its chunks, their digests to a part file."""
        futures = []
        digests: dict[str, list[dict[str, Any]]] = {}
        for leaf, hosts in self.own:
            with _as_os_error():
                path = self.partial / ARRAYS / str(leaf.index)
                store = self.ts.open(_spec(path), open=True).result()
            for start, host in hosts:
                domain = tuple(
                    slice(begin, begin + extent)
                    for begin, extent in zip(start, host.shape)
                )
                futures.append(store[domain].write(host))
                digests.setdefault(str(leaf.index), []).append(
                    {
                        "at": leaf.position(start),
                        "sha256": _digest(host),
                        "process": self.process,
                    }
                )
        with _as_os_error():
            for future in futures:
                future.result()
        write_file(
            self.partial / f"part_{self.process}.ckpt",
            {
                "format": FORMAT_NAME,
                "format_version": FORMAT_VERSION,
                "part": _PART_FORMAT,
                "process": self.process,
                "chunks": digests,
            },
            [],
        )

    def commit(self) -> None:
        """Process 0: every chunk accounted for, the manifest, the rename."""
        partial, path = self.partial, self.path
        found: dict[int, list[dict[str, Any]]] = {
            leaf.index: [] for leaf in self.stored
        }
        for part in range(self.count):
            part_path = partial / f"part_{part}.ckpt"
            with CheckpointFile(part_path) as file:
                for index, entries in file.manifest["chunks"].items():
                    found[int(index)].extend(entries)
            os.unlink(part_path)
        for leaf in self.stored:
            entries = sorted(found[leaf.index], key=lambda entry: entry["at"])
            expected = sorted(leaf.position(start) for start in leaf.holders)
            if [entry["at"] for entry in entries] != expected:
                raise OSError(
                    f"the shards written of leaf `{leaf.record['path']}` do not "
                    f"cover it ({len(entries)} of {len(expected)} chunks)"
                )
            leaf.record["store"] = {
                "dtype": leaf.stored_dtype,
                "shape": leaf.shape,
                "chunk": leaf.chunk,
                "chunks": entries,
            }
        write_file(partial / MANIFEST, self.manifest, self.chunks)
        fsync_directory(partial)

        def rename() -> None:
            os.rename(partial, path)
            fsync_directory(path.parent)

        put_in_place(path, rename, folder=True)


@contextlib.contextmanager
def _as_os_error() -> Iterator[None]:
    """Tensorstore's I/O failures (`ValueError`s) as the `OSError`s of a write."""
    try:
        yield
    except ValueError as error:
        raise OSError(errno.EIO, f"tensorstore could not write: {error}") from error


def written_bytes(manifest: dict[str, Any]) -> dict[int, int]:
    """The bytes of stored chunks each process wrote, from a sharded
    checkpoint's manifest (a partial last chunk counted at its real extent)."""
    written: Counter[int] = Counter()
    for store in (leaf["store"] for leaf in manifest["leaves"] if "store" in leaf):
        itemsize = jnp.dtype(store["dtype"]).itemsize
        for chunk in store["chunks"]:
            extents = [
                min(extent, size - i * extent)
                for i, extent, size in zip(chunk["at"], store["chunk"], store["shape"])
            ]
            written[chunk["process"]] += math.prod(extents) * itemsize
    return dict(written)


# -- reading -------------------------------------------------------------------


class ShardedReader:
    """The stored arrays of a sharded checkpoint, read a chunk at a time, each
    chunk checked against the manifest before it is used."""

    def __init__(self, folder: Path, file: CheckpointFile):
        self.folder = folder
        self.file = file
        self._stores: dict[int, tuple[Any, dict[tuple[int, ...], Any]]] = {}
        self._chunks: dict[tuple[int, tuple[int, ...]], np.ndarray] = {}

    def forget(self) -> None:
        """Drop the chunks read so far (a load holds one leaf's at a time)."""
        self._chunks.clear()

    def error(self, message: str) -> CheckpointError:
        return CheckpointError(f"Checkpoint {self.folder}: {message}")

    def _open(self, index: int, record: dict[str, Any]) -> tuple[Any, dict]:
        """The leaf's array, checked against the manifest, and its chunk
        entries by grid position."""
        if index in self._stores:
            return self._stores[index]
        folder = self.folder / ARRAYS / str(index)
        spec = record["store"]
        where = f"the array of leaf `{record['path']}` ({folder / 'zarr.json'})"
        try:
            store = _tensorstore().open(_spec(folder), open=True, read=True).result()
            grid = store.spec().to_json()["metadata"]["chunk_grid"]
            layout = list(grid["configuration"]["chunk_shape"])
        except (ValueError, RuntimeError, OSError, KeyError, TypeError) as error:
            raise self.error(f"{where} cannot be opened: {error}") from None
        found = (np.dtype(store.dtype.numpy_dtype).name, list(store.shape), layout)
        if found != (spec["dtype"], spec["shape"], spec["chunk"]):
            raise self.error(
                f"{where} holds {found[0]}{tuple(found[1])} in chunks of "
                f"{tuple(found[2])}, the manifest records "
                f"{spec['dtype']}{tuple(spec['shape'])} in chunks of "
                f"{tuple(spec['chunk'])}: the file was altered or swapped"
            )
        entries = {tuple(entry["at"]): entry for entry in spec["chunks"]}
        self._stores[index] = store, entries
        return store, entries

    def chunk(self, index: int, record: dict[str, Any], position: tuple[int, ...]):
        """One stored chunk, verified (cached for the rest of this load)."""
        cached = self._chunks.get((index, position))
        if cached is not None:
            return cached
        store, entries = self._open(index, record)
        spec = record["store"]
        where = self.check_file(index, record, position)
        domain = tuple(
            slice(i * extent, min((i + 1) * extent, size))
            for i, extent, size in zip(position, spec["chunk"], spec["shape"])
        )
        try:
            host = np.asarray(store[domain].read().result())
        except (ValueError, RuntimeError, OSError) as error:
            raise self.error(
                f"{where} cannot be read (truncated or corrupt): {error}"
            ) from None
        if _digest(host) != entries[position]["sha256"]:
            raise self.error(
                f"{where} is corrupt or was swapped with another: its sha256 does "
                "not match the manifest's"
            )
        self._chunks[(index, position)] = host
        return host

    def check_file(
        self, index: int, record: dict[str, Any], position: tuple[int, ...]
    ) -> str:
        """The chunk's file, once known to have its raw bytes' size (before any
        allocation), and its description for errors."""
        spec = record["store"]
        # zarr v3's default chunk key encoding: c/<i>/<j>...; a 0-d array's is c.
        path = self.folder.joinpath(ARRAYS, str(index), "c", *map(str, position))
        where = f"the chunk file {path} (leaf `{record['path']}`)"
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            raise self.error(f"{where} is missing") from None
        except OSError as error:
            raise self.error(f"{where} cannot be read: {error}") from None
        dtype = jnp.dtype(spec["dtype"])  # (checked with the manifest)
        expected = math.prod(spec["chunk"]) * dtype.itemsize
        if not path.is_file() or size != expected:
            raise self.error(
                f"{where} has {size} bytes, a chunk of {tuple(spec['chunk'])} "
                f"{dtype.name} has {expected}: it is truncated, padded or was "
                "replaced"
            )
        return where

    def read(
        self, index: int, record: dict[str, Any], region: Any = None
    ) -> np.ndarray:
        """The leaf's stored values in `region` (a tuple of slices over its own
        axes; `None`: all), from the chunks overlapping it."""
        spec = record["store"]
        shape, chunk = spec["shape"], spec["chunk"]
        region = tuple(region or ()) + (slice(None),) * (len(shape) - len(region or ()))
        bounds = [slot.indices(size)[:2] for slot, size in zip(region, shape)]
        ranges = [
            range(begin // extent, (end - 1) // extent + 1) if end > begin else range(0)
            for (begin, end), extent in zip(bounds, chunk)
        ]
        for position in itertools.product(*ranges):
            self.check_file(index, record, position)
        out = np.empty([end - begin for begin, end in bounds], jnp.dtype(spec["dtype"]))
        if out.size:
            for position in itertools.product(*ranges):
                data = self.chunk(index, record, position)
                source, target = [], []
                for i, extent, (begin, end) in zip(position, chunk, bounds):
                    low, high = max(begin, i * extent), min(end, (i + 1) * extent)
                    source.append(slice(low - i * extent, high - i * extent))
                    target.append(slice(low - begin, high - begin))
                out[tuple(target)] = data[tuple(source)]
        _, dtype_name = data_of(record)
        if spec["dtype"] != dtype_name:  # stored as bytes (a trailing axis)
            dtype = jnp.dtype(dtype_name)
            out = np.ascontiguousarray(out).view(dtype).reshape(out.shape[:-1])
        return out

    def verify_all(self, records: list[dict[str, Any]]) -> None:
        """Read and check every chunk, one at a time (nothing held)."""
        for index, record in enumerate(records):
            for entry in record["store"]["chunks"] if "store" in record else []:
                self.chunk(index, record, tuple(entry["at"]))
                self.forget()


class LazyLeaf:
    """A stored leaf that `jax.make_array_from_callback` slices: each slice reads
    only the chunks it overlaps."""

    def __init__(self, reader: ShardedReader, index: int, record: dict[str, Any]):
        self.reader, self.index, self.record = reader, index, record
        self.shape = tuple(data_of(record)[0])

    def __getitem__(self, region: Any) -> np.ndarray:
        if not isinstance(region, tuple):
            region = (region,)
        return self.reader.read(self.index, self.record, region)

    def full(self) -> np.ndarray:
        return self.reader.read(self.index, self.record)
