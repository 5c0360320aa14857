"""The check that a folder can be written, before any work (loggers, checkpoints)."""

import errno
import os
import secrets
from collections.abc import Callable
from pathlib import Path


def probe_folder(path: Path, write: Callable[[Path], object]) -> None:
    """Create `path` if needed and `write` then remove a probe file in it (named
    per process: several may probe at once), or raise the `OSError`."""
    probe = path / f".eqx_ensemble_write_probe-p{os.getpid()}-{secrets.token_hex(4)}"
    if path.exists() and not path.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, "it exists and is not a folder")
    path.mkdir(parents=True, exist_ok=True)
    write(probe)
    os.unlink(probe)
