"""TensorBoard event files written in bulk.

An event file is a sequence of TFRecords (`uint64` length, its masked CRC-32C,
the data, the data's masked CRC-32C), each one serialized `Event`. A dispatch's
scalars are encoded together with NumPy: records of one length share a layout,
so bytes and checksums are computed column by column. Rare events (text,
hyperparameters) take any serialized `Summary`, one by one.

The wire format (TensorFlow's `event.proto`, `summary.proto`):
`Event{1: double wall_time, 2: int64 step, 3: string file_version, 5: Summary
summary, 7: SessionLog session_log}`, `Summary{1: repeated Value{1: string tag,
2: float simple_value}}`, `SessionLog{1: enum status (1: START)}`.
"""

import functools
import os
import socket
import struct
import time
from pathlib import Path

import numpy as np


def _crc32c_table() -> np.ndarray:
    table = np.zeros(256, np.uint32)
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
        table[byte] = crc
    return table


_TABLE = _crc32c_table()
_TABLE_LIST = _TABLE.tolist()


def _crc32c_of(data: bytes) -> int:
    """CRC-32C of one short message (a Python loop: cheaper than NumPy here)."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _TABLE_LIST[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def crc32c(rows: np.ndarray) -> np.ndarray:
    """CRC-32C (Castagnoli) of every row of a `(records, length)` `uint8` array."""
    crc = np.full(rows.shape[0], 0xFFFFFFFF, np.uint32)
    for column in range(rows.shape[1]):
        crc = _TABLE[(crc ^ rows[:, column]) & 0xFF] ^ (crc >> 8)
    return crc ^ np.uint32(0xFFFFFFFF)


def masked_crc32c(rows: np.ndarray) -> np.ndarray:
    """TFRecord's masked checksum of every row."""
    return _mask(crc32c(rows))


def varint(value: int) -> bytes:
    """Protocol buffers' base-128 encoding of a non-negative integer."""
    if value < 0:
        raise ValueError(f"a step or length must be non-negative, got {value}")
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _mask(crc: np.ndarray) -> np.ndarray:
    rotated = (crc >> np.uint32(15)) | (crc << np.uint32(17))
    return (rotated.astype(np.uint64) + 0xA282EAD8).astype(np.uint32)


@functools.lru_cache(maxsize=64)
def _header(length: int) -> np.ndarray:
    """A record's 12-byte header: the length and its masked checksum."""
    header = np.frombuffer(struct.pack("<Q", length), np.uint8)[None, :]
    return np.concatenate(
        [header[0], masked_crc32c(header).astype("<u4").view(np.uint8)]
    )


@functools.lru_cache(maxsize=64)
def _byte_terms(length: int, positions: tuple[int, ...]) -> np.ndarray:
    """`terms[i, b]`: how byte value `b` at `positions[i]` of a `length`-byte
    message changes its CRC-32C (CRC is affine: `crc(x ^ y) = crc(x) ^ crc(y) ^
    crc(0)`, so a message's CRC is its base's, XORed with one term per byte
    that differs from the base)."""
    units = np.zeros((len(positions), 256, length), np.uint8)
    for i, position in enumerate(positions):
        units[i, :, position] = np.arange(256)
    zero = crc32c(np.zeros((1, length), np.uint8))
    return crc32c(units.reshape(-1, length)).reshape(len(positions), 256) ^ zero


def _records(data: np.ndarray, varying: tuple[int, ...] | None = None) -> np.ndarray:
    """TFRecords of `(records, length)` event bytes, as `(records, length + 16)`.
    With `varying`: the rows differ only at those columns (their checksums are
    then the first row's, updated by one table lookup per varying byte)."""
    count, length = data.shape
    out = np.empty((count, length + 16), np.uint8)
    out[:, :12] = _header(length)
    out[:, 12:-4] = data
    if varying is None or count < 8:
        crc = crc32c(data)
    else:
        base = data[0].copy()
        base[list(varying)] = 0
        crc = np.full(count, _crc32c_of(base.tobytes()), np.uint32)
        terms = _byte_terms(length, varying)
        for i, position in enumerate(varying):
            crc ^= terms[i][data[:, position]]
    out[:, -4:] = _mask(crc).astype("<u4").view(np.uint8).reshape(count, 4)
    return out


def scalar_records(
    tag: str, steps: np.ndarray, values: np.ndarray, wall_time: float
) -> bytes:
    """The records of one scalar `tag` at `steps` (increasing) with `values`."""
    values = np.asarray(values)
    return scalar_columns(tag, steps, values.reshape(-1, 1), wall_time)[0]


def scalar_columns(
    tag: str, steps: np.ndarray, values: np.ndarray, wall_time: float
) -> list[bytes]:
    """For every column of `values` (`(steps, columns)`: one per member's file),
    the records of the scalar `tag` at `steps` (increasing)."""
    columns = values.shape[1]
    steps = np.asarray(steps, np.int64)
    if not steps.size:
        return [b""] * columns
    if steps.min() < 0:
        raise ValueError(f"steps must be non-negative, got {int(steps.min())}")
    # Event{1: wall_time, 2: step, 5: Summary{1: Value{1: tag, 2: simple_value}}}:
    # the float's 4 bytes come last, after the step's varint and this tail.
    name = tag.encode()
    value = b"\x0a" + varint(len(name)) + name + b"\x15"
    summary = b"\x0a" + varint(len(value) + 4) + value
    head = b"\x09" + struct.pack("<d", wall_time) + b"\x10"
    tail = b"\x2a" + varint(len(summary) + 4) + summary
    # Column-major: each file's records are contiguous.
    floats = (
        np.ascontiguousarray(values.T, "<f4").view(np.uint8).reshape(columns, -1, 4)
    )
    sizes = np.ones(steps.shape, np.int64)
    for k in range(1, 9):  # a non-negative int64 takes at most 9 bytes
        sizes += steps >= (1 << (7 * k))
    chunks: list[list[bytes]] = [[] for _ in range(columns)]
    for size in np.unique(sizes).tolist():  # steps increase: each size is one run
        rows = np.flatnonzero(sizes == size)
        group = steps[rows]
        length = len(head) + size + len(tail) + 4
        data = np.empty((columns, rows.size, length), np.uint8)
        data[:, :, : len(head)] = np.frombuffer(head, np.uint8)
        for k in range(size):
            byte = (group >> (7 * k)) & 0x7F
            data[:, :, len(head) + k] = byte | 0x80 if k < size - 1 else byte
        start = len(head) + size
        data[:, :, start : start + len(tail)] = np.frombuffer(tail, np.uint8)
        data[:, :, -4:] = floats[:, rows]
        varying = (*range(len(head), start), *range(length - 4, length))
        records = _records(data.reshape(-1, length), varying)
        records = records.reshape(columns, rows.size * (length + 16))
        for column in range(columns):
            chunks[column].append(records[column].tobytes())
    return [b"".join(parts) for parts in chunks]


def event_record(
    wall_time: float,
    step: int | None = None,
    *,
    summary: bytes | None = None,
    file_version: str | None = None,
    session_start: bool = False,
) -> bytes:
    """One record: an `Event` with a serialized `Summary`, a file version, or a
    session start (TensorBoard drops the earlier events from `step` on)."""
    data = b"\x09" + struct.pack("<d", wall_time)
    if step is not None:
        data += b"\x10" + varint(step)
    if file_version is not None:
        name = file_version.encode()
        data += b"\x1a" + varint(len(name)) + name
    if summary is not None:
        data += b"\x2a" + varint(len(summary)) + summary
    if session_start:
        data += b"\x3a\x02\x08\x01"
    return _records(np.frombuffer(data, np.uint8)[None, :]).tobytes()


class EventFile:
    """An event file of its own in `directory` (TensorBoard reads every
    `*tfevents*` file of a run folder, in name order)."""

    _count = 0

    def __init__(self, directory: str | os.PathLike[str], purge_step: int | None):
        folder = Path(directory)
        folder.mkdir(parents=True, exist_ok=True)
        EventFile._count += 1
        name = (
            f"events.out.tfevents.{time.time():.6f}.{socket.gethostname()}."
            f"{os.getpid()}.{EventFile._count}.eqx_ensemble"
        )
        self.path = folder / name
        self.file = open(self.path, "wb")
        now = time.time()
        self.file.write(event_record(now, 0, file_version="brain.Event:2"))
        if purge_step is not None:
            self.file.write(event_record(now, purge_step, session_start=True))

    def write(self, records: bytes) -> None:
        self.file.write(records)

    def flush(self) -> None:
        self.file.flush()

    def close(self) -> None:
        self.file.close()
