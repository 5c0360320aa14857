"""Leaves to bytes and back: what `save` stores per leaf, how a manifest's leaf
records are checked, and where `load` puts each leaf (like `like`'s leaf)."""

import functools
import math
import re
from collections.abc import Callable
from typing import Any, TypeGuard

import jax
import jax.numpy as jnp
import numpy as np

from .._internal.tree import as_array, is_traced, keystr
from .file import ALIGNMENT
from .structure import ARRAY_KINDS, PYTHON_KINDS, classify

_SHA256 = re.compile(r"^[0-9a-f]{64}$")


def encode_leaves(
    leaves: list[tuple[Any, Any]],
    *,
    copy: bool = False,
    stored: Callable[[Any], bool] = lambda leaf: False,
) -> tuple[list[dict], list[Any], list[tuple[int, dict[str, Any], Any]]]:
    """Manifest records for `(path, leaf)` pairs, and the data section's chunks.
    `copy`: the chunks own their bytes (else they may alias device buffers that
    the run reuses during a background write). The leaves `stored` picks are
    returned as `(index, record, array)` instead (a sharded checkpoint's)."""
    records: list[dict[str, Any]] = []
    chunks: list[Any] = []
    elsewhere = []
    offset = 0
    for index, (path, leaf) in enumerate(leaves):
        where = keystr(path)
        if is_traced(leaf):
            raise TypeError(
                f"Cannot save leaf `{where}`: it is traced (inside `jit`, `vmap`, "
                "`grad`...). Call `ee.save` outside transformed code."
            )
        if isinstance(leaf, jax.ShapeDtypeStruct):
            raise TypeError(
                f"Cannot save leaf `{where}`: it is a `jax.ShapeDtypeStruct`, which "
                "has no values (structs are for `like` in `ee.load`)."
            )
        record = {"path": where, **classify(leaf)}
        kind = record["kind"]
        if kind in ARRAY_KINDS:
            array = leaf
            if kind == "key":
                record["impl"] = str(jax.random.key_impl(leaf))
                array = jax.random.key_data(leaf)
                record["data_dtype"] = np.dtype(array.dtype).name
                record["data_shape"] = list(array.shape)
            if not _restorable(np.dtype(array.dtype)):
                raise TypeError(
                    f"Cannot save leaf `{where}`: arrays of dtype {array.dtype} are "
                    "not supported (use numeric, boolean or ML dtypes such as "
                    "bfloat16)."
                )
            if stored(leaf):
                elsewhere.append((index, record, array))
                records.append(record)
                continue
            if isinstance(array, jax.Array) and not array.is_fully_addressable:
                from jax.experimental import multihost_utils

                array = multihost_utils.process_allgather(array, tiled=True)
            host = little_endian(np.asarray(array)).reshape(-1).view(np.uint8)
            padding = -offset % ALIGNMENT
            if padding:
                chunks.append(bytes(padding))
                offset += padding
            record["offset"], record["nbytes"] = offset, host.nbytes
            chunks.append(np.array(host, copy=True) if copy else host)
            offset += host.nbytes
        elif kind == "float":
            record["value"] = float(leaf).hex()
        elif kind == "complex":
            record["value"] = [complex(leaf).real.hex(), complex(leaf).imag.hex()]
        elif kind in PYTHON_KINDS:
            record["value"] = int(leaf)
        records.append(record)
    return records, chunks, elsewhere


def little_endian(host: np.ndarray) -> np.ndarray:
    """`host` little-endian in C order (`ascontiguousarray` would make 0-d 1-d)."""
    if host.dtype.byteorder == ">":
        host = host.astype(host.dtype.newbyteorder("<"))
    return np.asarray(host, order="C")


def _restorable(dtype: np.dtype) -> bool:
    """Whether `jnp.dtype(dtype.name)` gives the dtype back (numeric, ML dtypes)."""
    try:
        return not dtype.hasobject and jnp.dtype(dtype.name) == dtype.newbyteorder("=")
    except TypeError:
        return False


def data_of(record: dict[str, Any]) -> tuple[Any, Any]:
    """The shape and dtype name an array record stores (a key's key data's)."""
    if record.get("kind") == "key":
        return record.get("data_shape"), record.get("data_dtype")
    return record.get("shape"), record.get("dtype")


def decode_value(record: dict[str, Any], like_leaf: Any) -> Any:
    """The leaf a verified non-array `record` describes, of `like_leaf`'s type."""
    kind = record["kind"]
    if kind == "static":
        return like_leaf
    if kind == "float":
        return type(like_leaf)(float.fromhex(record["value"]))
    if kind == "complex":
        real, imag = record["value"]
        return type(like_leaf)(complex(float.fromhex(real), float.fromhex(imag)))
    return type(like_leaf)(record["value"])


def host_view(data: bytearray, record: dict[str, Any]) -> np.ndarray:
    """A single file's array leaf (a key's key data) in its data section."""
    shape, dtype_name = data_of(record)
    dtype = jnp.dtype(dtype_name)
    if math.prod(shape) == 0:
        return np.zeros(shape, dtype)
    return np.frombuffer(
        data, dtype=dtype, count=math.prod(shape), offset=record["offset"]
    ).reshape(shape)


def _placement(like_leaf: Any) -> tuple[Any, bool]:
    """The loaded array's sharding (`None`: default device) and weak type."""
    if isinstance(like_leaf, jax.Array):
        sharding = like_leaf.sharding if like_leaf.committed else None
        return sharding, getattr(like_leaf, "weak_type", False)
    if isinstance(like_leaf, jax.ShapeDtypeStruct):
        return like_leaf.sharding, like_leaf.weak_type
    return None, False


def _whole(source: Any) -> np.ndarray:
    return source if isinstance(source, np.ndarray) else source.full()


def place_array(source: Any, like_leaf: Any) -> Any:
    """An array leaf from `source` (a host array, or a `LazyLeaf` read per part),
    placed like `like_leaf`."""
    if isinstance(like_leaf, np.ndarray):
        return _whole(source).copy()
    if isinstance(like_leaf, np.generic):
        return _whole(source).reshape(())[()]
    sharding, weak = _placement(like_leaf)
    if sharding is not None and not sharding.is_fully_addressable:
        return jax.make_array_from_callback(source.shape, sharding, lambda i: source[i])
    host = _whole(source)
    value: Any = host
    if weak:
        # `.at[].set` keeps the weak type of the (weakly typed) array it updates.
        base = jnp.full(host.shape, host.dtype.type(0).item())
        if base.dtype == host.dtype:
            value = base.at[...].set(host)
    return as_array(value) if sharding is None else jax.device_put(value, sharding)


def place_key(source: Any, impl: str, like_leaf: Any) -> Any:
    """A key leaf from its key data's `source` (see `place_array`)."""
    sharding, _ = _placement(like_leaf)
    if sharding is None or sharding.is_fully_addressable:
        keys = jax.random.wrap_key_data(as_array(_whole(source)), impl=impl)
        return keys if sharding is None else jax.device_put(keys, sharding)
    # Across processes: the global key data on the same (leading-axes) sharding.
    data = jax.make_array_from_callback(source.shape, sharding, lambda i: source[i])
    return jax.random.wrap_key_data(data, impl=impl)


def record_error(record: Any, data_bytes: int, sharded: bool) -> str | None:
    """What is wrong with one manifest leaf record on its own, or `None`. Run
    before anything is allocated: a forged shape cannot ask for more memory
    than the file holds."""
    if not isinstance(record, dict) or not isinstance(record.get("path"), str):
        return f"a leaf entry is malformed: {_short(record)}"
    where = f"the manifest entry of leaf `{record['path']}`"
    kind = record.get("kind")
    if not isinstance(kind, str):
        return f"{where} has a malformed kind {_short(kind)}"
    value = record.get("value")
    if kind in PYTHON_KINDS and not _valid_value(kind, value):
        return f"{where} holds a malformed {kind} value {_short(value)}"
    if kind not in (*ARRAY_KINDS, *PYTHON_KINDS, "static"):
        return f"{where} has an unknown kind {_short(kind)}"
    if kind not in ARRAY_KINDS:
        return _store_error(record, where, sharded) if "store" in record else None
    shape, dtype_name = data_of(record)
    dtype = stored_dtype(dtype_name)
    if dtype is None:
        return f"{where} has an unsupported dtype {_short(dtype_name)}"
    if not _is_shape(shape):
        return f"{where} has a malformed shape {_short(shape)}"
    if kind == "key":
        problem = _key_record_error(record, shape)
        if problem is not None:
            return f"{where} {problem}"
    if "store" in record:
        return _store_error(record, where, sharded)
    offset, nbytes = record.get("offset"), record.get("nbytes")
    if not (_is_int(offset) and _is_int(nbytes)):
        return (
            f"{where} has a malformed offset {_short(offset)} or size {_short(nbytes)}"
        )
    # Exact integers: a forged shape cannot overflow into a plausible size.
    size = math.prod(shape) * dtype.itemsize
    if nbytes != size or not 0 <= offset <= data_bytes - nbytes:
        return (
            f"{where} is inconsistent: {nbytes} bytes at offset {offset} of "
            f"{data_bytes} for {dtype.name}{tuple(shape)} ({size} bytes)"
        )
    return None


def _store_error(record: dict[str, Any], where: str, sharded: bool) -> str | None:
    """What is wrong with a sharded leaf's `"store"` entry: its chunks must cover
    the grid exactly once, each with a sha256."""
    store = record["store"]
    if not sharded:
        return f"{where} names stored shards, which a single file has not"
    if record["kind"] not in ARRAY_KINDS or not isinstance(store, dict):
        return f"{where} has a malformed store entry"
    shape, dtype_name = data_of(record)
    stored, chunk, entries = store.get("shape"), store.get("chunk"), store.get("chunks")
    if store.get("dtype") == dtype_name:
        expected = list(shape)
    elif store.get("dtype") == "uint8":  # a dtype tensorstore lacks, as bytes
        expected = [*shape, jnp.dtype(dtype_name).itemsize]
    else:
        return f"{where} stores a dtype {store.get('dtype')!r} for {dtype_name}"
    if stored != expected:
        return f"{where} stores shape {stored!r} for {expected}"
    if (
        not isinstance(chunk, list)
        or len(chunk) != len(expected)
        or not all(_is_int(c) and c > 0 for c in chunk)
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


def stored_dtype(name: Any) -> np.dtype | None:
    """The dtype a manifest names, if it is one `save` can write, else `None`."""
    if not isinstance(name, str):
        return None
    try:
        dtype = jnp.dtype(name)
    except TypeError:
        return None
    # Only the canonical names `save` writes (`">f4"` would swap the bytes).
    return dtype if _restorable(dtype) and dtype.name == name else None


@functools.lru_cache(maxsize=64)
def key_impl_shapes(impl: str) -> tuple[Any, tuple[int, ...], str] | None:
    """For a PRNG implementation name: the typed key dtype, the key data's
    trailing shape and dtype name; `None` if JAX knows no such implementation."""
    try:
        key = jax.eval_shape(lambda: jax.random.key(0, impl=impl))
        data = jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0, impl=impl)))
    except (TypeError, ValueError, KeyError):
        return None
    return key.dtype, tuple(data.shape), np.dtype(data.dtype).name


def _key_record_error(record: dict[str, Any], data_shape: list[int]) -> str | None:
    impl = record.get("impl")
    found = key_impl_shapes(impl) if isinstance(impl, str) else None
    if found is None:
        return f"names an unknown PRNG implementation {_short(impl)}"
    _, trailing, data_dtype = found
    shape = record.get("shape")
    if (
        not _is_shape(shape)
        or list(data_shape) != [*shape, *trailing]
        or record.get("data_dtype") != data_dtype
    ):
        return (
            f"holds key data {_short(record.get('data_dtype'))}{_short(data_shape)} "
            f"for keys of shape {_short(shape)}, but {impl!r} keys are "
            f"{data_dtype}{list(trailing)} each"
        )
    return None


def _is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_shape(shape: Any) -> TypeGuard[list[int]]:
    return isinstance(shape, list) and all(_is_int(d) and d >= 0 for d in shape)


def _valid_value(kind: str, value: Any) -> bool:
    if kind == "bool":  # stored as 0 or 1
        return _is_int(value) and value in (0, 1)
    if kind == "int":
        return _is_int(value)
    if kind == "float":
        return _is_hex_float(value)
    return (
        isinstance(value, list) and len(value) == 2 and all(map(_is_hex_float, value))
    )


def _is_hex_float(value: Any) -> bool:
    try:
        float.fromhex(value)
    except (TypeError, ValueError, OverflowError):
        return False
    return True


def _short(value: Any) -> str:
    """`repr(value)`, cut short (a forged manifest may hold anything)."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
