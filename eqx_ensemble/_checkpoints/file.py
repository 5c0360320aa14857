"""The checkpoint container: one file holding a JSON manifest and the leaves' bytes.

Layout (in the checkpoints guide): 8 magic bytes, the manifest's length (uint64
LE) and sha256, the JSON manifest, then the data. The file is exactly
`48 + M + D` bytes, so truncation and trailing bytes are caught before decoding.
"""

import contextlib
import errno
import hashlib
import json
import os
import re
import secrets
import stat
import struct
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

# The names `eqx_ensemble` re-exports; the rest serves the other checkpoint modules.
__all__ = ["CheckpointError"]

MAGIC = b"\x89EQXENS\n"
FORMAT_NAME = "eqx_ensemble.checkpoint"
FORMAT_VERSION = 1
ALIGNMENT = 64
TEMP_SUFFIX = ".tmp"

_HEADER = struct.Struct("<8sQ32s")
_MAX_MANIFEST_BYTES = 1 << 34
_READ_CHUNK = 1 << 24
# `save_checkpoint`'s file names; the number is the step the manifest records.
CHECKPOINT_NAME = re.compile(r"^step_([0-9]+)\.ckpt$")
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_FILE_KINDS = {
    stat.S_IFDIR: "directory",
    stat.S_IFIFO: "named pipe (FIFO)",
    stat.S_IFSOCK: "socket",
    stat.S_IFCHR: "character device",
    stat.S_IFBLK: "block device",
}
# The temporaries of writers that lock them (others: `.<target>.<16 hex>.tmp`).
# A live write touches its file at least every leaf.
_LOCKING_WRITER = re.compile(r"-p[0-9]+" + re.escape(TEMP_SUFFIX) + "$")
STALE_AFTER_SECONDS = 3600.0


class CheckpointError(ValueError):
    """A checkpoint file is unreadable, corrupt, or does not match `like`.

    Raised by [`ee.load`][eqx_ensemble.load] and
    [`ee.load_manifest`][eqx_ensemble.load_manifest] for a file that is not a
    checkpoint, is truncated or corrupt, has a newer format version, or differs
    from `like` (the message names the first differing leaf path with both
    shapes/dtypes, or both ensemble sizes). A subclass of `ValueError`.

    **Example:**

    ```python
    ens = ee.ensemble(lambda k: eqx.nn.Linear(2, 2, key=k), size=3,
                      key=jax.random.key(0))
    ee.save("model.ckpt", ens)
    smaller = ee.ensemble(lambda k: eqx.nn.Linear(2, 2, key=k), size=2,
                          key=jax.random.key(0))
    try:
        ee.load("model.ckpt", like=smaller)
    except ee.CheckpointError as error:
        print(error)   # ... an ensemble of 3 members ... `like` has 2 members
    ```
    """


def as_path(value: Any, name: str) -> Path:
    """A path argument as a `Path`: not an int (`os` takes it as a descriptor)
    nor an empty string (`Path` reads it as the current folder)."""
    if not isinstance(value, str | os.PathLike) or isinstance(value, bytes):
        raise TypeError(
            f"`{name}` must be a path (str or os.PathLike), got "
            f"{type(value).__name__} {value!r}"
        )
    if os.fspath(value) == "":
        raise ValueError(
            f"`{name}` is an empty path; pass a file or folder name (use '.' for "
            "the current folder)"
        )
    return Path(value)


def write_file(path: Path, manifest: dict[str, Any], chunks: list[Any]) -> None:
    """Write a checkpoint atomically (temporary file, fsync, rename, folder
    fsync); `chunks` are the data section, its length and sha256 go in the
    manifest. An `OSError` names `path` and leaves nothing partial."""
    digest = hashlib.sha256()
    for chunk in chunks:
        digest.update(chunk)
    size = sum(memoryview(chunk).nbytes for chunk in chunks)
    manifest = {**manifest, "data": {"bytes": size, "sha256": digest.hexdigest()}}
    manifest_bytes = json.dumps(manifest, separators=(",", ":")).encode("utf-8")
    header = _HEADER.pack(
        MAGIC, len(manifest_bytes), hashlib.sha256(manifest_bytes).digest()
    )
    try:
        if path.is_dir():
            raise IsADirectoryError(errno.EISDIR, "a folder is in the way")
        temporary, descriptor = _create_temporary(path)
    except OSError as error:
        raise _naming(error, path) from error
    try:
        # Overwriting keeps the file's permissions; a new file gets the umask's.
        with contextlib.suppress(FileNotFoundError):
            os.fchmod(descriptor, stat.S_IMODE(os.stat(path).st_mode) & 0o777)
        with os.fdopen(descriptor, "wb", closefd=False) as stream:
            stream.write(header)
            stream.write(manifest_bytes)
            for chunk in chunks:
                stream.write(chunk)
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(temporary, path)
    except BaseException as error:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        if isinstance(error, OSError):
            raise _naming(error, path) from error
        raise
    finally:
        os.close(descriptor)  # releases the lock
        with _LIVE_LOCK:
            _LIVE_TEMPORARIES.discard(temporary)
    fsync_directory(path.parent)


def _naming(error: OSError, path: Path) -> OSError:
    """`error` again (same class and errno), with the checkpoint's path in it."""
    reason = error.strerror or str(error) or type(error).__name__
    return OSError(
        error.errno,
        f"{reason}; the checkpoint was not written (a previous file at that path, "
        "if any, is intact)",
        str(path),
    )


# This process's temporaries in writing: never stale (POSIX locks over NFS are
# not exclusive within a process).
_LIVE_TEMPORARIES: set[Path] = set()
_LIVE_LOCK = threading.Lock()


def _create_temporary(path: Path) -> tuple[Path, int]:
    """A new temporary file for `path`, open and `flock`ed while it is open."""
    while True:
        name = f".{path.name}.{secrets.token_hex(8)}-p{os.getpid()}{TEMP_SUFFIX}"
        temporary = path.parent / name
        # O_EXCL: never clobber; mode 0o666 so the umask applies as for any new file.
        descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        with _LIVE_LOCK:
            _LIVE_TEMPORARIES.add(temporary)
        if _lock(descriptor, blocking=True) is False:
            return temporary, descriptor  # no locks here: the age bound protects it
        # A cleaner may have removed it before our lock: then start over.
        with contextlib.suppress(FileNotFoundError):
            if os.stat(temporary).st_ino == os.fstat(descriptor).st_ino:
                return temporary, descriptor
        os.close(descriptor)
        with _LIVE_LOCK:
            _LIVE_TEMPORARIES.discard(temporary)


def _lock(descriptor: int, *, blocking: bool) -> bool | None:
    """`flock` the file exclusively: `True` when locked, `None` when another
    holder has it (non-blocking only), `False` when locks are unsupported here."""
    try:
        import fcntl
    except ImportError:  # Windows
        return False
    flags = fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB)
    try:
        fcntl.flock(descriptor, flags)
    except BlockingIOError:
        return None
    except OSError:  # e.g. ENOLCK, EOPNOTSUPP on some network file systems
        return False
    return True


def temporary_name(target_regex: str) -> re.Pattern[str]:
    """The names of `write_file`'s temporary files for targets whose names match
    `target_regex` (exactly: the temporaries of `a.ckpt.1` are not `a.ckpt`'s)."""
    return re.compile(
        rf"^\.{target_regex}\.[0-9a-f]{{16}}(-p[0-9]+)?" + re.escape(TEMP_SUFFIX) + "$"
    )


def remove_stale_temporaries(target: Path) -> None:
    """Remove the temporary files of earlier, interrupted writes to `target`."""
    pattern = temporary_name(re.escape(target.name))
    try:
        names = os.listdir(target.parent)
    except OSError:
        return
    remove_abandoned(target.parent / name for name in names if pattern.match(name))


def remove_abandoned(temporaries: Iterable[Path]) -> None:
    """Remove those of `temporaries` whose writer is gone. A writer `flock`s its
    temporary until the rename and the kernel drops the lock when it dies, so a
    locking writer's temporary (`-p<pid>.tmp`) we can lock is abandoned; any
    other goes once untouched for `STALE_AFTER_SECONDS`."""
    now = time.time()
    for candidate in temporaries:
        with _LIVE_LOCK:
            if candidate in _LIVE_TEMPORARIES:
                continue
        with contextlib.suppress(OSError):
            status = candidate.lstat()
            if not stat.S_ISREG(status.st_mode):
                continue
            flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | _NONBLOCK
            descriptor = os.open(candidate, flags)
            try:
                if os.fstat(descriptor).st_ino != status.st_ino:
                    continue
                locked = _lock(descriptor, blocking=False)
                if locked is None:
                    continue  # a live writer holds it
                stale = now - status.st_mtime > STALE_AFTER_SECONDS
                if stale or (locked and _LOCKING_WRITER.search(candidate.name)):
                    os.unlink(candidate)
            finally:
                os.close(descriptor)


def fsync_directory(directory: Path) -> None:
    """Make a rename or unlink in `directory` durable (a no-op where unsupported)."""
    flags = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0)
    try:
        descriptor = os.open(directory, flags)
    except OSError:
        return
    try:
        with contextlib.suppress(OSError):
            os.fsync(descriptor)
    finally:
        os.close(descriptor)


class CheckpointFile:
    """An open checkpoint: the verified manifest now, the verified data on request."""

    def __init__(self, path: Path):
        self.path = path
        self.sharded = False  # the manifest of a sharded checkpoint's folder
        try:
            mode = os.stat(path).st_mode
        except FileNotFoundError:
            raise FileNotFoundError(f"no checkpoint file at {path}") from None
        if not stat.S_ISREG(mode):
            kind = _FILE_KINDS.get(stat.S_IFMT(mode), "special file")
            raise self.error(
                f"not a regular file (a {kind}); a checkpoint is a file written by "
                "`ee.save`"
            )
        # O_NONBLOCK: a special file swapped in after the check must not block.
        descriptor = os.open(path, os.O_RDONLY | _NONBLOCK)
        if not stat.S_ISREG(os.fstat(descriptor).st_mode):
            os.close(descriptor)
            raise self.error("not a regular file")
        self._stream = os.fdopen(descriptor, "rb")
        try:
            self.manifest = self._read_manifest()
        except BaseException:
            self._stream.close()
            raise

    def __enter__(self) -> "CheckpointFile":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stream.close()

    def error(self, message: str) -> CheckpointError:
        return CheckpointError(f"Checkpoint {self.path}: {message}")

    def _read_manifest(self) -> dict[str, Any]:
        file_bytes = os.fstat(self._stream.fileno()).st_size
        header = self._stream.read(_HEADER.size)
        if not header:
            raise self.error("the file is empty")
        if len(header) < _HEADER.size or header[: len(MAGIC)] != MAGIC:
            if header[: len(MAGIC)] == MAGIC[: len(header)]:
                raise self.error(
                    f"the file is truncated: {file_bytes} bytes, shorter than the "
                    f"{_HEADER.size}-byte header"
                )
            raise self.error(
                "not an eqx_ensemble checkpoint (wrong magic bytes at the start of "
                "the file); write checkpoints with `ee.save`"
            )
        _, manifest_length, manifest_sha256 = _HEADER.unpack(header)
        if manifest_length > min(file_bytes - _HEADER.size, _MAX_MANIFEST_BYTES):
            raise self.error(
                f"the file is truncated or its header is corrupt: the header "
                f"announces a {manifest_length}-byte manifest but the file has "
                f"{file_bytes} bytes"
            )
        manifest_bytes = self._stream.read(manifest_length)
        if hashlib.sha256(manifest_bytes).digest() != manifest_sha256:
            raise self.error(
                "the manifest is corrupt: its sha256 does not match the one in the "
                "header"
            )
        try:
            manifest = json.loads(manifest_bytes.decode("utf-8"))
            data = manifest["data"]
            data_bytes, data_sha256 = int(data["bytes"]), str(data["sha256"])
            version = manifest["format_version"]
            name = manifest["format"]
        except (ValueError, KeyError, TypeError, RecursionError) as error:
            reason = "nested too deeply" if isinstance(error, RecursionError) else error
            raise self.error(f"the manifest is malformed ({reason})") from None
        if name != FORMAT_NAME or not isinstance(version, int):
            raise self.error(f"unknown format {name!r} version {version!r}")
        if version > FORMAT_VERSION:
            raise self.error(
                f"written with checkpoint format version {version}, newer than the "
                f"version {FORMAT_VERSION} this eqx_ensemble reads; upgrade "
                "eqx_ensemble to load it"
            )
        self.data_offset = _HEADER.size + manifest_length
        self.data_bytes = data_bytes
        self.data_sha256 = data_sha256
        expected_bytes = self.data_offset + data_bytes
        if file_bytes < expected_bytes:
            raise self.error(
                f"the file is truncated: {file_bytes} bytes, the manifest describes "
                f"{expected_bytes} bytes"
            )
        if file_bytes > expected_bytes:
            raise self.error(
                f"the file has {file_bytes - expected_bytes} unexpected trailing bytes "
                f"after the {expected_bytes} bytes its manifest describes"
            )
        return manifest

    def read_data(self, keep: bool = True) -> bytearray:
        """The data section, after checking its sha256 against the manifest
        (`keep=False`: only checked, read a chunk at a time into one buffer)."""
        data = bytearray(self.data_bytes if keep else min(_READ_CHUNK, self.data_bytes))
        buffer = memoryview(data)
        self._stream.seek(self.data_offset)
        digest = hashlib.sha256()
        position = 0
        while position < self.data_bytes:
            end = min(position + _READ_CHUNK, self.data_bytes)
            view = buffer[position:end] if keep else buffer[: end - position]
            count = self._stream.readinto(view)
            if not count:
                raise self.error("the file was truncated while it was being read")
            digest.update(view[:count])
            position += count
        if digest.hexdigest() != self.data_sha256:
            raise self.error(
                "the data is corrupt: its sha256 does not match the manifest's "
                f"({digest.hexdigest()} vs {self.data_sha256})"
            )
        return data
