"""Sharded checkpoints: a folder per checkpoint, each process writing the shards it
owns with tensorstore, committed by a verified manifest.

Layout of a sharded checkpoint `<name>/` (written as `.<name>.sharded.tmp/`, then
renamed into place by process 0):

- `manifest.ckpt`: the single-file container of `file.py` (header, the
  manifest's sha256, the manifest, a data section). The manifest is the one of a
  single-file checkpoint, except that the record of each `jax.Array` leaf has a
  `"store"` entry in place of `offset`/`nbytes`; the data section holds the leaves
  that are not `jax.Array`s (NumPy arrays), written by process 0.
- `arrays/<n>/`: the `n`-th leaf of the tree (a typed PRNG key as its key data) as a
  zarr v3 array written with tensorstore: a regular chunk grid whose chunk is the
  leaf's shard (so every stored shard is one chunk file `c/<i>/<j>...`), raw
  little-endian bytes (`bytes` codec), every chunk stored (also one equal to the
  fill value). The `"store"` entry records the stored dtype and shape, the chunk
  shape, and per chunk its grid position, the process that wrote it and the sha256
  of its bytes (C order, little-endian).

Writing, on every process: process 0 creates the temporary folder and each array's
`zarr.json`; a barrier; each process writes the chunks it owns (a shard held by
several devices is written once, by one of its holders' processes, chosen to
balance the bytes each process writes; nothing is gathered), hashes them, and
writes a part file listing its chunks' digests; a barrier; process 0 checks that
the parts cover every chunk, writes `manifest.ckpt` (atomically, fsynced), and
renames the folder into place (atomic: a folder is either absent or complete);
a barrier. On loading, each process reads only the chunks that overlap the parts
of the arrays its devices hold, and checks each chunk it reads against the
manifest's sha256 before using it. No code is executed on load: the
tensorstore spec is built here (driver, path), the files choose only among
tensorstore's built-in decoders, and every chunk's bytes are checked against
the manifest's sha256.
"""

import contextlib
import errno
import hashlib
import itertools
import math
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np

from .._internal.tree import is_traced, keystr
from .file import (
    FORMAT_NAME,
    FORMAT_VERSION,
    CheckpointError,
    CheckpointFile,
    fsync_directory,
    write_file,
)
from .leaves import encode_leaves, stored_dtype
from .structure import classify, is_key_dtype
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
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


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
    """A `jax.Array` leaf to store: its stored array and chunk plan."""

    def __init__(self, index: int, where: str, array: jax.Array):
        self.index = index
        self.where = where
        self.array = array  # key data for a key leaf
        dtype = np.dtype(array.dtype)
        self.dtype = dtype
        self.raw = not _tensorstore_supports(dtype)
        self.shape = list(array.shape) + ([dtype.itemsize] if self.raw else [])
        self.stored_dtype = "uint8" if self.raw else dtype.name
        self.chunk, self.owners = _chunk_plan(array, where)
        if self.raw:
            self.chunk = [*self.chunk, dtype.itemsize]

    def store_record(self) -> dict[str, Any]:
        return {"dtype": self.stored_dtype, "shape": self.shape, "chunk": self.chunk}

    def position(self, start: tuple[int, ...]) -> list[int]:
        """The grid position of the chunk at `start` (a raw leaf's byte axis: 0)."""
        return _grid_position((*start, 0) if self.raw else start, self.chunk)


def _tensorstore_supports(dtype: np.dtype) -> bool:
    ts = _tensorstore()
    try:
        ts.dtype(dtype.name)
    except (TypeError, ValueError):
        return False
    return True


def _chunk_plan(
    array: jax.Array, where: str
) -> tuple[list[int], dict[tuple[int, ...], Any]]:
    """The chunk shape (a shard's) and, per chunk start, the device whose shard is
    written. From the global sharding only, so every process computes the same."""
    shape = array.shape
    indices = array.sharding.devices_indices_map(shape)
    starts: dict[tuple[int, ...], list[Any]] = {}
    extents = [1] * len(shape)
    for device in sorted(indices, key=lambda d: d.id):
        bounds = [slot.indices(size) for slot, size in zip(indices[device], shape)]
        start = tuple(begin for begin, _, _ in bounds)
        for axis, (begin, end, _) in enumerate(bounds):
            extents[axis] = max(extents[axis], end - begin)
        starts.setdefault(start, []).append(device)
    if math.prod(shape) == 0:
        return extents, {}
    for start in starts:
        if any(begin % extent for begin, extent in zip(start, extents)):
            raise ValueError(
                f"Cannot save leaf `{where}` sharded: its sharding "
                f"{array.sharding} splits shape {tuple(shape)} into shards that do "
                "not form a regular grid; reshard it (e.g. with `ee.shard`) or pass "
                "`sharded=False`"
            )
    return extents, {start: holders[0] for start, holders in starts.items()}


def _balance(
    leaves: list[_Leaf], local: list[bool]
) -> dict[tuple[int, tuple[int, ...]], int]:
    """The process that writes each chunk `(leaf, start)`: among the processes of
    the devices holding it, the one that has written the fewest bytes so far (then
    the lowest index). Deterministic, so every process agrees. An array that each
    process holds on its own devices (`local`: fully addressable on every
    process, agreed beforehand) holds each process's own value: process 0's is
    saved, as in one file."""
    written: dict[int, int] = {}
    writers: dict[tuple[int, tuple[int, ...]], int] = {}
    for leaf, own in zip(leaves, local, strict=True):
        if own:  # process 0 writes it; its bytes counted the same on every process
            size = math.prod(leaf.shape) * (1 if leaf.raw else leaf.dtype.itemsize)
            written[0] = written.get(0, 0) + size
            for start in leaf.owners:
                writers[(leaf.index, start)] = 0
            continue
        indices = leaf.array.sharding.devices_indices_map(leaf.array.shape)
        holders: dict[tuple[int, ...], set[int]] = {}
        for device, slots in indices.items():
            start = tuple(
                slot.indices(size)[0] for slot, size in zip(slots, leaf.array.shape)
            )
            holders.setdefault(start, set()).add(device.process_index)
        nbytes = math.prod(leaf.chunk) * (1 if leaf.raw else leaf.dtype.itemsize)
        for start in leaf.owners:
            process = min(holders[start], key=lambda p: (written.get(p, 0), p))
            written[process] = written.get(process, 0) + nbytes
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


def _grid_position(start: tuple[int, ...], chunk: list[int]) -> list[int]:
    return [begin // extent for begin, extent in zip(start, chunk)]


def _chunk_file(folder: Path, position: list[int]) -> Path:
    # zarr v3's default chunk key encoding: c/<i>/<j>...; a 0-d array's chunk is c.
    return folder.joinpath("c", *map(str, position))


def _little_endian(host: np.ndarray) -> np.ndarray:
    if host.dtype.byteorder == ">":
        host = host.astype(host.dtype.newbyteorder("<"))
    return np.asarray(host, order="C")  # (`ascontiguousarray` makes 0-d 1-d)


def _digest(host: np.ndarray) -> str:
    return hashlib.sha256(
        _little_endian(host).reshape(-1).view(np.uint8).data
    ).hexdigest()


def sharded_write(
    path: Path,
    leaves: list[tuple[Any, Any]],
    manifest: dict[str, Any],
    copy: bool,
) -> tuple[list[Phase], list[Phase]]:
    """The phases (`writer.write`'s `prepare` and `finish`) that write the
    flattened tree `leaves` as a sharded checkpoint at `path` (every process
    calls it with its part of the same global tree). `manifest` is completed
    with the leaves' records; `copy`: the host copies must not alias device
    buffers (the write goes on in the background)."""
    process, count = jax.process_index(), jax.process_count()
    inline = [
        (index, (key_path, leaf))
        for index, (key_path, leaf) in enumerate(leaves)
        if not isinstance(leaf, jax.Array) or is_traced(leaf)
    ]
    # NumPy arrays and Python numbers: in the manifest's data section, as in the
    # single-file format (process 0's values). Also refuses traced leaves.
    inline_records, chunks = encode_leaves([pair for _, pair in inline], copy=copy)
    records: list[dict[str, Any] | None] = [None] * len(leaves)
    for (index, _), record in zip(inline, inline_records, strict=True):
        records[index] = record
    stored: list[_Leaf] = []
    ts = _tensorstore()
    for index, (key_path, leaf) in enumerate(leaves):
        if records[index] is None:
            record, array = _stored_record(keystr(key_path), leaf)
            stored.append(_Leaf(index, record["path"], array))
            records[index] = record
    addressable = np.asarray([leaf.array.is_fully_addressable for leaf in stored])
    if count > 1 and stored:
        # Held whole by every process (each its own value), or a global array.
        from jax.experimental import multihost_utils

        every = np.asarray(multihost_utils.process_allgather(addressable))
        addressable = np.all(every.reshape(count, -1), axis=0)
    writers = _balance(stored, [bool(x) for x in np.atleast_1d(addressable)])
    partial = partial_folder(path)

    def create() -> None:
        # Process 0: a fresh temporary folder (a leftover of an interrupted write
        # of the same checkpoint is removed) and every array's metadata.
        check_replaceable(path)
        make_parent(path)
        remove_tree(partial)
        (partial / ARRAYS).mkdir(parents=True)
        for leaf in stored:
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
                    _spec(partial / ARRAYS / str(leaf.index), metadata),
                    create=True,
                ).result()

    # This process's shards on its host now (the run may overwrite the device
    # buffers as soon as `save` returns, when the write goes on in the background).
    own: list[tuple[_Leaf, list[tuple[tuple[int, ...], np.ndarray]]]] = []

    def copy_own() -> None:
        for leaf in stored:
            mine = [
                start
                for start in leaf.owners
                if writers[(leaf.index, start)] == process
            ]
            if not mine:
                continue
            shards = {shard.device: shard for shard in leaf.array.addressable_shards}
            hosts = []
            for start in sorted(mine):
                holder = leaf.owners[start]
                device = holder if holder in shards else _local_holder(leaf, start)
                host = np.array(
                    _little_endian(np.asarray(shards[device].data)), copy=True
                )
                if leaf.raw:
                    host = host.view(np.uint8).reshape(*host.shape, -1)
                hosts.append((start, host))
            own.append((leaf, hosts))

    def write_own() -> None:
        # Every process: the chunks it owns, in parallel; their digests to a part file.
        futures = []
        digests: dict[str, list[dict[str, Any]]] = {}
        for leaf, hosts in own:
            with _as_os_error():
                store = ts.open(
                    _spec(partial / ARRAYS / str(leaf.index)), open=True
                ).result()
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
                        "process": process,
                    }
                )
        with _as_os_error():
            for future in futures:
                future.result()
        write_file(
            partial / f"part_{process}.ckpt",
            {
                "format": FORMAT_NAME,
                "format_version": FORMAT_VERSION,
                "part": _PART_FORMAT,
                "process": process,
                "chunks": digests,
            },
            [],
        )

    def commit() -> None:
        # Process 0: every chunk accounted for, the manifest, the rename.
        chunk_records: dict[int, list[dict[str, Any]]] = {
            leaf.index: [] for leaf in stored
        }
        for part in range(count):
            part_path = partial / f"part_{part}.ckpt"
            with CheckpointFile(part_path) as file:
                for index, entries in file.manifest["chunks"].items():
                    chunk_records[int(index)].extend(entries)
            os.unlink(part_path)
        for leaf in stored:
            found = sorted(tuple(entry["at"]) for entry in chunk_records[leaf.index])
            expected = sorted(tuple(leaf.position(start)) for start in leaf.owners)
            if found != expected:
                raise OSError(
                    f"the shards written of leaf `{leaf.where}` do not cover it "
                    f"({len(found)} of {len(expected)} chunks)"
                )
            record = records[leaf.index]
            assert record is not None
            record["store"] = {
                **leaf.store_record(),
                "chunks": sorted(chunk_records[leaf.index], key=lambda e: e["at"]),
            }
        write_file(partial / MANIFEST, {**manifest, "leaves": records}, chunks)
        fsync_directory(partial)

        def rename() -> None:
            os.rename(partial, path)
            fsync_directory(path.parent)

        put_in_place(path, rename, folder=True)

    prepare = [Phase(create), Phase(copy_own, everyone=True)]
    return prepare, [Phase(write_own, everyone=True), Phase(commit)]


def _stored_record(where: str, leaf: jax.Array) -> tuple[dict[str, Any], jax.Array]:
    """A stored leaf's manifest record (without its `"store"` entry) and the
    array stored for it (a typed key's key data)."""
    record = {"path": where, **classify(leaf)}
    array = leaf
    if is_key_dtype(leaf.dtype):
        record["impl"] = str(jax.random.key_impl(leaf))
        array = jax.random.key_data(leaf)
        record["data_dtype"] = np.dtype(array.dtype).name
        record["data_shape"] = list(array.shape)
    if stored_dtype(np.dtype(array.dtype).name) is None:
        raise TypeError(
            f"Cannot save leaf `{where}`: arrays of dtype {array.dtype} are not "
            "supported (use numeric, boolean or ML dtypes such as bfloat16)."
        )
    return record, array


def _local_holder(leaf: _Leaf, start: tuple[int, ...]) -> Any:
    """An addressable device of this process holding the shard at `start`."""
    indices = leaf.array.sharding.devices_indices_map(leaf.array.shape)
    for shard in leaf.array.addressable_shards:
        slots = indices[shard.device]
        if (
            tuple(slot.indices(size)[0] for slot, size in zip(slots, leaf.array.shape))
            == start
        ):
            return shard.device
    raise AssertionError(f"no local shard of `{leaf.where}` at {start}")


@contextlib.contextmanager
def _as_os_error() -> Iterator[None]:
    """Tensorstore reports I/O failures (a full disk, a file in the way) as
    `ValueError`s: raise them as the `OSError`s every other write raises."""
    try:
        yield
    except ValueError as error:
        raise OSError(errno.EIO, f"tensorstore could not write: {error}") from error


def written_bytes(manifest: dict[str, Any]) -> dict[int, int]:
    """The bytes of stored chunks each process wrote, from a sharded
    checkpoint's manifest (a partial last chunk counted at its real extent)."""
    written: dict[int, int] = {}
    for leaf in manifest["leaves"]:
        store = leaf.get("store")
        if store is None:
            continue
        dtype = stored_dtype(store["dtype"])
        assert dtype is not None
        for chunk in store["chunks"]:
            extents = [
                min(extent, size - i * extent)
                for i, extent, size in zip(chunk["at"], store["chunk"], store["shape"])
            ]
            process = chunk["process"]
            written[process] = (
                written.get(process, 0) + math.prod(extents) * dtype.itemsize
            )
    return written


# -- reading -------------------------------------------------------------------


def store_error(record: dict[str, Any], where: str) -> str | None:
    """What is wrong with a sharded leaf's `"store"` entry on its own, or `None`:
    a supported dtype and a shape agreeing with the leaf's, a positive chunk shape,
    and chunk entries that cover the grid exactly once, each with a sha256."""
    store = record["store"]
    if not isinstance(store, dict):
        return f"{where} has a malformed store entry"
    key = record["kind"] == "key"
    shape = record["data_shape" if key else "shape"]
    dtype_name = record["data_dtype" if key else "dtype"]
    stored, chunk, entries = store.get("shape"), store.get("chunk"), store.get("chunks")
    if store.get("dtype") == dtype_name:
        expected = list(shape)
    elif store.get("dtype") == "uint8":
        dtype = stored_dtype(dtype_name)
        expected = [*shape, dtype.itemsize if dtype is not None else -1]
    else:
        return f"{where} stores a dtype {store.get('dtype')!r} for {dtype_name}"
    if stored != expected:
        return f"{where} stores shape {stored!r} for {expected}"
    if (
        not isinstance(chunk, list)
        or len(chunk) != len(expected)
        or not all(
            isinstance(c, int) and not isinstance(c, bool) and c > 0 for c in chunk
        )
    ):
        return f"{where} has a malformed chunk shape {chunk!r}"
    grid = [-(-size // extent) for size, extent in zip(expected, chunk)]
    if not isinstance(entries, list) or len(entries) != math.prod(grid):
        count = len(entries) if isinstance(entries, list) else "no"
        return (
            f"{where}: the checkpoint's shards do not cover the array ({count} "
            f"chunks recorded, {math.prod(grid)} needed for shape {tuple(expected)} "
            f"in chunks of {tuple(chunk)})"
        )
    seen = set()
    for entry in entries:
        position = entry.get("at") if isinstance(entry, dict) else None
        if (
            not isinstance(position, list)
            or len(position) != len(grid)
            or not all(
                isinstance(i, int) and 0 <= i < n for i, n in zip(position, grid)
            )
            or not isinstance(entry.get("sha256"), str)
            or not _SHA256.match(entry["sha256"])
        ):
            return f"{where} has a malformed chunk entry {str(entry)[:80]}"
        seen.add(tuple(position))
    if len(seen) != len(entries):
        return (
            f"{where}: the checkpoint's shards do not cover the array (a chunk is "
            "recorded twice, another is missing)"
        )
    return None


class ShardedReader:
    """The stored arrays of a sharded checkpoint, read a chunk at a time, each
    chunk checked against the manifest before it is used."""

    def __init__(self, folder: Path, file: CheckpointFile):
        self.folder = folder
        self.file = file
        self._stores: dict[int, Any] = {}
        self._entries: dict[int, dict[tuple[int, ...], dict[str, Any]]] = {}
        self._chunks: dict[tuple[int, tuple[int, ...]], np.ndarray] = {}

    def forget(self) -> None:
        """Drop the chunks read so far (after each leaf: a load holds one
        leaf's chunks at a time)."""
        self._chunks.clear()

    def error(self, message: str) -> CheckpointError:
        return CheckpointError(f"Checkpoint {self.folder}: {message}")

    def _store(self, index: int, record: dict[str, Any]) -> Any:
        if index in self._stores:
            return self._stores[index]
        ts = _tensorstore()
        folder = self.folder / ARRAYS / str(index)
        spec = record["store"]
        try:
            store = ts.open(_spec(folder), open=True, read=True).result()
            grid = store.spec().to_json()["metadata"]["chunk_grid"]
            layout = list(grid["configuration"]["chunk_shape"])
        except (ValueError, RuntimeError, OSError, KeyError, TypeError) as error:
            raise self.error(
                f"the array of leaf `{record['path']}` ({folder / 'zarr.json'}) "
                f"cannot be opened: {error}"
            ) from None
        found = (np.dtype(store.dtype.numpy_dtype).name, list(store.shape), layout)
        if found != (spec["dtype"], spec["shape"], spec["chunk"]):
            raise self.error(
                f"the array of leaf `{record['path']}` ({folder / 'zarr.json'}) holds "
                f"{found[0]}{tuple(found[1])} in chunks of {tuple(found[2])}, the "
                f"manifest records {spec['dtype']}{tuple(spec['shape'])} in chunks "
                f"of {tuple(spec['chunk'])}: the file was altered or swapped"
            )
        self._stores[index] = store
        return store

    def chunk(self, index: int, record: dict[str, Any], position: tuple[int, ...]):
        """One stored chunk, verified (cached for the rest of this load)."""
        cached = self._chunks.get((index, position))
        if cached is not None:
            return cached
        store = self._store(index, record)
        spec = record["store"]
        entries = self._entries.get(index)
        if entries is None:
            entries = {tuple(e["at"]): e for e in spec["chunks"]}
            self._entries[index] = entries
        entry = entries[position]
        path = self.check_file(index, record, position)
        where = f"the chunk file {path} (leaf `{record['path']}`)"
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
        if _digest(host) != entry["sha256"]:
            raise self.error(
                f"{where} is corrupt or was swapped with another: its sha256 does "
                "not match the manifest's"
            )
        self._chunks[(index, position)] = host
        return host

    def check_file(
        self, index: int, record: dict[str, Any], position: tuple[int, ...]
    ) -> Path:
        """The chunk's file, once it is known to exist with the size its raw
        bytes have (before anything is allocated for it)."""
        spec = record["store"]
        path = _chunk_file(self.folder / ARRAYS / str(index), list(position))
        where = f"the chunk file {path} (leaf `{record['path']}`)"
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            raise self.error(f"{where} is missing") from None
        except OSError as error:
            raise self.error(f"{where} cannot be read: {error}") from None
        dtype = stored_dtype(spec["dtype"])
        assert dtype is not None
        expected = math.prod(spec["chunk"]) * dtype.itemsize
        if not path.is_file() or size != expected:
            raise self.error(
                f"{where} has {size} bytes, a chunk of {tuple(spec['chunk'])} "
                f"{dtype.name} has {expected}: it is truncated, padded or was "
                "replaced"
            )
        return path

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
        out = np.empty(
            [end - begin for begin, end in bounds], stored_dtype(spec["dtype"])
        )
        if out.size:
            for position in itertools.product(*ranges):
                data = self.chunk(index, record, position)
                source, target = [], []
                for i, extent, (begin, end) in zip(position, chunk, bounds):
                    low, high = max(begin, i * extent), min(end, (i + 1) * extent)
                    source.append(slice(low - i * extent, high - i * extent))
                    target.append(slice(low - begin, high - begin))
                out[tuple(target)] = data[tuple(source)]
        dtype_name = record["data_dtype" if record["kind"] == "key" else "dtype"]
        if spec["dtype"] != dtype_name:  # stored as bytes (a trailing axis)
            dtype = stored_dtype(dtype_name)
            assert dtype is not None
            out = np.ascontiguousarray(out).view(dtype).reshape(out.shape[:-1])
        return out

    def verify_all(self, records: list[dict[str, Any]]) -> None:
        """Read and check every chunk, one at a time (nothing held)."""
        for index, record in enumerate(records):
            if "store" not in record:
                continue
            for entry in record["store"]["chunks"]:
                self.chunk(index, record, tuple(entry["at"]))
                self.forget()


class LazyLeaf:
    """A stored leaf that `jax.make_array_from_callback` slices: each slice reads
    only the chunks it overlaps."""

    def __init__(self, reader: ShardedReader, index: int, record: dict[str, Any]):
        self.reader, self.index, self.record = reader, index, record
        key = record["kind"] == "key"
        self.shape = tuple(record["data_shape" if key else "shape"])

    def __getitem__(self, region: Any) -> np.ndarray:
        if not isinstance(region, tuple):
            region = (region,)
        return self.reader.read(self.index, self.record, region)

    def full(self) -> np.ndarray:
        return self.reader.read(self.index, self.record)
