"""Leaves to bytes and back: what `save` stores per leaf, and where `load` puts it.

Arrays are stored as raw little-endian C-order bytes; typed PRNG keys as their
`jax.random.key_data` plus the implementation name; Python numbers exactly in the
manifest (floats as `float.hex`). Loaded arrays are placed like `like`'s leaf: on
its sharding if it is a committed `jax.Array` or a `jax.ShapeDtypeStruct` with a
sharding, uncommitted on the default device otherwise, weakly typed if it is.
"""

import functools
import math
from typing import Any, TypeGuard

import jax
import jax.numpy as jnp
import numpy as np

from .._internal.tree import as_array, is_traced, keystr
from .file import aligned
from .structure import ARRAY_KINDS, PYTHON_KINDS, classify


def encode_leaves(
    leaves: list[tuple[Any, Any]], *, copy: bool = False
) -> tuple[list[dict], list[Any]]:
    """Manifest records for `(path, leaf)` pairs, and the data section's chunks
    (array bytes and alignment padding, in order). `copy`: the chunks own their
    bytes (they may alias device buffers otherwise, which a run reuses while a
    background write reads them)."""
    records: list[dict[str, Any]] = []
    chunks: list[Any] = []
    offset = 0
    for path, leaf in leaves:
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
            host = _host_bytes(leaf, where, record)
            padding = aligned(offset) - offset
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
    return records, chunks


def _host_bytes(leaf: Any, where: str, record: dict[str, Any]) -> np.ndarray:
    """The leaf's value as a flat little-endian uint8 host array."""
    if record["kind"] == "key":
        record["impl"] = str(jax.random.key_impl(leaf))
        leaf = jax.random.key_data(leaf)
        record["data_dtype"] = np.dtype(leaf.dtype).name
        record["data_shape"] = list(leaf.shape)
    if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
        from jax.experimental import multihost_utils

        host = np.asarray(multihost_utils.process_allgather(leaf, tiled=True))
    else:
        host = np.asarray(leaf)
    if not _restorable(host.dtype):
        raise TypeError(
            f"Cannot save leaf `{where}`: arrays of dtype {host.dtype} are not "
            "supported (use numeric, boolean or ML dtypes such as bfloat16)."
        )
    if host.dtype.byteorder == ">":
        host = host.astype(host.dtype.newbyteorder("<"))
    return np.ascontiguousarray(host).reshape(-1).view(np.uint8)


def _restorable(dtype: np.dtype) -> bool:
    """Whether `jnp.dtype(dtype.name)` gives the dtype back (numeric, ML dtypes)."""
    try:
        return not dtype.hasobject and jnp.dtype(dtype.name) == dtype.newbyteorder("=")
    except TypeError:
        return False


def decode_leaf(record: dict[str, Any], like_leaf: Any, data: bytearray) -> Any:
    """The leaf a verified `record` describes, shaped and placed like `like_leaf`."""
    kind = record["kind"]
    if kind == "static":
        return like_leaf
    if kind == "float":
        return type(like_leaf)(float.fromhex(record["value"]))
    if kind == "complex":
        real, imag = record["value"]
        return type(like_leaf)(complex(float.fromhex(real), float.fromhex(imag)))
    if kind in PYTHON_KINDS:
        return type(like_leaf)(record["value"])
    if kind == "key":
        host = _host_view(data, record, record["data_dtype"], record["data_shape"])
        return _place_key(host, record["impl"], like_leaf)
    host = _host_view(data, record, record["dtype"], record["shape"])
    return _place_array(host, like_leaf)


def _host_view(
    data: bytearray, record: dict[str, Any], dtype_name: str, shape: list[int]
) -> np.ndarray:
    dtype = jnp.dtype(dtype_name)
    count = int(np.prod(shape, dtype=np.int64))
    if count == 0:
        return np.zeros(shape, dtype)
    return np.frombuffer(
        data, dtype=dtype, count=count, offset=record["offset"]
    ).reshape(shape)


def _placement(like_leaf: Any) -> tuple[Any, bool]:
    """The sharding to put a loaded array on (`None`: default device, uncommitted)
    and whether it should be weakly typed."""
    if isinstance(like_leaf, jax.Array):
        sharding = like_leaf.sharding if like_leaf.committed else None
        return sharding, getattr(like_leaf, "weak_type", False)
    if isinstance(like_leaf, jax.ShapeDtypeStruct):
        return like_leaf.sharding, like_leaf.weak_type
    return None, False


def _place_array(host: np.ndarray, like_leaf: Any) -> Any:
    if isinstance(like_leaf, np.ndarray):
        return host.copy()
    if isinstance(like_leaf, np.generic):
        return host.reshape(())[()]
    sharding, weak = _placement(like_leaf)
    value: Any = host
    if weak:
        # `.at[].set` keeps the weak type of the (weakly typed) array it updates.
        base = jnp.full(host.shape, host.dtype.type(0).item())
        if base.dtype == host.dtype:
            value = base.at[...].set(host)
    if sharding is None:
        return as_array(value)
    if sharding.is_fully_addressable:
        return jax.device_put(value, sharding)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def _whole(lazy: Any, like_leaf: Any) -> bool:
    """Whether a lazily read leaf is needed whole here (`like`'s leaf is on this
    process's devices only, or on the host)."""
    if isinstance(like_leaf, np.ndarray | np.generic):
        return True
    sharding, _ = _placement(like_leaf)
    return sharding is None or sharding.is_fully_addressable


def place_array(lazy: Any, like_leaf: Any) -> Any:
    """`_place_array` for a leaf read lazily (`lazy[index]` reads that part,
    `lazy.full()` all of it): across processes, each reads only its devices' parts."""
    if _whole(lazy, like_leaf):
        return _place_array(lazy.full(), like_leaf)
    sharding, _ = _placement(like_leaf)
    return jax.make_array_from_callback(lazy.shape, sharding, lambda i: lazy[i])


def place_key(lazy: Any, impl: str, like_leaf: Any) -> Any:
    """`_place_key` for a key leaf's data read lazily (see `place_array`)."""
    return _place_key(lazy.full() if _whole(lazy, like_leaf) else lazy, impl, like_leaf)


def _place_key(host: Any, impl: str, like_leaf: Any) -> Any:
    sharding, _ = _placement(like_leaf)
    if sharding is None or sharding.is_fully_addressable:
        keys = jax.random.wrap_key_data(as_array(host), impl=impl)
        return keys if sharding is None else jax.device_put(keys, sharding)
    # Across processes: build the global key data on the same (leading-axes)
    # sharding, then wrap it.
    data = jax.make_array_from_callback(host.shape, sharding, lambda i: host[i])
    return jax.random.wrap_key_data(data, impl=impl)


def record_error(record: Any, data_bytes: int) -> str | None:
    """What is wrong with one manifest leaf record on its own (no `like` needed),
    or `None`: a known kind, a restorable dtype, a known PRNG implementation whose
    key data has the recorded shape, a well-formed Python value, and a size and
    offset inside the data section. Run before anything is allocated, so a forged
    shape cannot ask for more memory than the file holds."""
    if not isinstance(record, dict) or not isinstance(record.get("path"), str):
        return f"a leaf entry is malformed: {_short(record)}"
    where = f"the manifest entry of leaf `{record['path']}`"
    kind = record.get("kind")
    if not isinstance(kind, str):
        return f"{where} has a malformed kind {_short(kind)}"
    if kind == "static":
        return None
    if kind in PYTHON_KINDS:
        if not _valid_value(kind, record.get("value")):
            return (
                f"{where} holds a malformed {kind} value {_short(record.get('value'))}"
            )
        return None
    if kind not in ARRAY_KINDS:
        return f"{where} has an unknown kind {_short(kind)}"
    key = kind == "key"
    shape = record.get("data_shape" if key else "shape")
    dtype_name = record.get("data_dtype" if key else "dtype")
    dtype = stored_dtype(dtype_name)
    if dtype is None:
        return f"{where} has an unsupported dtype {_short(dtype_name)}"
    if not _is_shape(shape):
        return f"{where} has a malformed shape {_short(shape)}"
    if key:
        problem = _key_record_error(record, shape)
        if problem is not None:
            return f"{where} {problem}"
    if "store" in record:
        return None  # a sharded checkpoint's stored array: see `sharded.store_error`
    offset, nbytes = record.get("offset"), record.get("nbytes")
    if not (_is_int(offset) and _is_int(nbytes)):
        return (
            f"{where} has a malformed offset {_short(offset)} or size {_short(nbytes)}"
        )
    # Exact integers: a forged shape cannot overflow into a plausible size.
    count = math.prod(shape)
    if nbytes != count * dtype.itemsize or not 0 <= offset <= data_bytes - nbytes:
        return (
            f"{where} is inconsistent: {nbytes} bytes at offset {offset} of "
            f"{data_bytes} for {dtype.name}{tuple(shape)} ({count * dtype.itemsize} "
            "bytes)"
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
    # Only the canonical names `save` writes: `">f4"` would read the
    # (little-endian) bytes in the wrong order.
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
