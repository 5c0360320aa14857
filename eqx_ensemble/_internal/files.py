"""The check that a folder can be written, before any work (loggers, checkpoints)."""

import errno
import os
import secrets
from collections.abc import Callable
from pathlib import Path


def probe_folder(path: Path, write: Callable[[Path], object]) -> None:
    """Create the folder `path` if needed and `write` then remove a probe file
    in it, or raise the `OSError` (not a folder, cannot be created, not
    writable, full...). The probe's name is this process's own: the processes
    of a multi-process run probe the same folder at once."""
    probe = path / f".eqx_ensemble_write_probe-p{os.getpid()}-{secrets.token_hex(4)}"
    if path.exists() and not path.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, "it exists and is not a folder")
    path.mkdir(parents=True, exist_ok=True)
    write(probe)
    os.unlink(probe)
