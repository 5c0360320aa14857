"""A folder of numbered checkpoints: `save_checkpoint`, `list_checkpoints`,
`latest_checkpoint`. One writer per folder (process 0 in a multi-host run)."""

import contextlib
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Int, PyTree

from .._internal.files import probe_folder
from .file import (
    CHECKPOINT_NAME,
    CheckpointError,
    as_path,
    fsync_directory,
    remove_abandoned,
    remove_stale_temporaries,
    temporary_name,
    write_file,
)
from .io import checked_records, open_manifest, save_tree
from .sharded import ShardedReader
from .writer import MANIFEST, PARTIAL_SUFFIX, PendingSave, remove_tree, set_aside

# The names `eqx_ensemble` re-exports; the rest serves the other checkpoint modules.
__all__ = [
    "latest_checkpoint",
    "list_checkpoints",
    "save_checkpoint",
    "verify_checkpoint",
]

# Left behind by a writer killed mid-save (see `file.write_file`).
_TEMPORARY_NAME = temporary_name(r"step_[0-9]+\.ckpt")
_PARTIAL_FOLDER = re.compile(
    r"^\.(step_[0-9]+\.ckpt)(?:\.[0-9a-f]{16}\.(old|deleted))?"
    + re.escape(PARTIAL_SUFFIX)
    + "$"
)


def list_checkpoints(directory: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """The checkpoints [`ee.save_checkpoint`][eqx_ensemble.save_checkpoint] wrote in a
    folder, as `(step, path)` pairs sorted by step.

    Only complete checkpoints are listed: the temporary files (and a sharded
    checkpoint's temporary folder) of an interrupted write are never picked.

    **Arguments:**

    - `directory`: the checkpoint folder (a missing folder has no checkpoints).

    **Returns:**

    A list of `(step, path)`, oldest step first.

    **Example:**

    ```python
    for step in (10, 20, 30):
        ee.save_checkpoint("run", step, {"w": jnp.full(3, float(step))})
    [step for step, _ in ee.list_checkpoints("run")]   # [10, 20, 30]
    ```
    """
    directory = as_path(directory, "directory")
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    found = []
    for name in names:
        match = CHECKPOINT_NAME.match(name)
        path = directory / name
        # (not a named pipe; a folder is a sharded checkpoint if it has a manifest)
        if match is not None and (path.is_file() or (path / MANIFEST).is_file()):
            found.append((int(match.group(1)), path))
    return sorted(found)


def latest_checkpoint(directory: str | os.PathLike[str]) -> Path | None:
    """The checkpoint with the highest step in a folder, or `None` if there is none.

    **Arguments:**

    - `directory`: a folder written by
      [`ee.save_checkpoint`][eqx_ensemble.save_checkpoint].

    **Returns:**

    The path of the newest complete checkpoint (temporary files of an interrupted
    write are ignored), or `None`.

    **Example:**

    ```python
    state = {"w": jnp.zeros(3), "step": 0}
    assert ee.latest_checkpoint("run") is None
    ee.save_checkpoint("run", 100, state)
    ee.save_checkpoint("run", 200, state)
    path = ee.latest_checkpoint("run")          # run/step_0000000200.ckpt
    restored = ee.load(path, like=state)
    ```
    """
    checkpoints = list_checkpoints(directory)
    return checkpoints[-1][1] if checkpoints else None


def verify_checkpoint(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Verify a whole checkpoint file without a `like`, and return its manifest.

    Checks everything [`ee.load`][eqx_ensemble.load] checks without `like`: the
    header, the manifest's sha256, the file's length, every leaf entry, and the
    data's sha256 (read in chunks); for a `step_<n>.ckpt` name, that the manifest
    records step `n`; for a sharded checkpoint, every shard's sha256.

    **Arguments:**

    - `path`: a file written by [`ee.save`][eqx_ensemble.save] or
      `ee.save_checkpoint`.

    **Returns:**

    The manifest, as [`ee.load_manifest`][eqx_ensemble.load_manifest] returns it.

    **Raises:**

    [`ee.CheckpointError`][eqx_ensemble.CheckpointError] naming the file and what
    is wrong; `FileNotFoundError` when there is no file at `path`.

    **Example:**

    ```python
    ee.save_checkpoint("verified_run", 7, {"w": jnp.ones(3)})
    manifest = ee.verify_checkpoint("verified_run/step_0000000007.ckpt")
    manifest["step"]   # 7
    ```
    """
    with open_manifest(as_path(path, "path")) as file:
        try:
            records = checked_records(file)
            step = file.manifest.get("step")
        except (TypeError, ValueError, KeyError, AttributeError) as error:
            raise file.error(f"the manifest is malformed ({error!r})") from None
        if step is not None and (
            not isinstance(step, int) or isinstance(step, bool) or step < 0
        ):
            raise file.error(f"the manifest's step {step!r} is not a step number")
        folder = file.path.parent if file.sharded else file.path
        named = CHECKPOINT_NAME.match(folder.name)
        if named is not None and step is not None and int(named.group(1)) != step:
            raise file.error(
                f"its manifest records step {step} but its name says step "
                f"{int(named.group(1))}: the file was renamed or copied; rename it "
                f"back to step_{step:010d}.ckpt or remove it"
            )
        file.read_data(keep=False)
        if file.sharded:
            ShardedReader(folder, file).verify_all(records)
        return file.manifest


def save_checkpoint(
    directory: str | os.PathLike[str],
    step: int | np.integer | Int[Array, ""],
    tree: PyTree,
    *,
    metadata: dict[str, Any] | None = None,
    keep: int | np.integer | None = None,
    sharded: bool | None = None,
) -> Path:
    """Save `tree` as checkpoint number `step` in a folder, keeping the last `keep`.

    Writes `directory/step_<step>.ckpt` atomically with [`ee.save`][eqx_ensemble.save]
    (replacing a checkpoint of the same step), records `step` in the manifest,
    then deletes all but the `keep` highest steps (never the one just written) and
    temporaries of interrupted writes. One writer per folder; in a multi-host run
    every process calls it.

    **Arguments:**

    - `directory`: the checkpoint folder.
    - `step`: a non-negative integer, usually the training step.
    - `tree`: the PyTree to save (ensemble, optimizer state, keys, counters...).
    - `metadata`: optional JSON-serialisable dict stored in the manifest.
    - `keep`: how many checkpoints to keep (at least 1); `None` keeps all.
    - `sharded`: the format, as for [`ee.save`][eqx_ensemble.save] (`None`: a
      sharded folder when `jax.process_count() > 1`, else one file).

    **Returns:**

    The path written.

    **Example:**

    ```python
    state = {"w": jnp.zeros(3), "key": jax.random.key(0)}
    for step in range(0, 500, 100):
        ee.save_checkpoint("run", step, state, keep=2)
    [step for step, _ in ee.list_checkpoints("run")]   # [300, 400]
    ```
    """
    path = _save_checkpoint(
        directory, step, tree, metadata=metadata, keep=keep, sharded=sharded
    )
    assert isinstance(path, Path)
    return path


def _save_checkpoint(
    directory: Any,
    step: Any,
    tree: Any,
    *,
    metadata: dict[str, Any] | None,
    keep: Any,
    sharded: bool | None,
    asynchronous: bool = False,
) -> "Path | PendingSave":
    """`save_checkpoint`; `asynchronous`: written on a thread (a `PendingSave`)."""
    step = _step_number(step)
    if keep is not None and (
        isinstance(keep, bool | np.bool_)
        or not isinstance(keep, int | np.integer)
        or keep < 1
    ):
        raise ValueError(f"`keep` must be None or an integer >= 1, got {keep!r}")
    keep = None if keep is None else int(keep)
    directory = as_path(directory, "directory")
    path = directory / f"step_{step:010d}.ckpt"

    def prune() -> None:
        _prune(directory, keep=keep, written=path)

    return save_tree(
        path,
        tree,
        metadata=metadata,
        step=step,
        after_write=prune,
        sharded=sharded,
        asynchronous=asynchronous,
    )


def _step_number(step: Any) -> int:
    """`step` as a Python int: an `int`, a NumPy integer or a 0-d integer array."""
    is_integer = isinstance(step, int | np.integer) or (
        isinstance(step, jax.Array | np.ndarray)
        and step.shape == ()
        and jnp.issubdtype(step.dtype, jnp.integer)
    )
    if isinstance(step, bool | np.bool_) or not is_integer:
        raise TypeError(
            f"`step` must be a non-negative integer, got {type(step).__name__} {step!r}"
        )
    if int(step) < 0:
        raise ValueError(f"`step` must be a non-negative integer, got {int(step)}")
    return int(step)


def _prune(directory: Path, *, keep: int | None, written: Path) -> None:
    """Remove abandoned temporaries, then all but the `keep` newest checkpoints."""
    names = os.listdir(directory)
    remove_abandoned(directory / name for name in names if _TEMPORARY_NAME.match(name))
    # A sharded temporary folder of an interrupted write is removed, except a
    # checkpoint set aside for a replacement that never arrived: it goes back.
    for name in names:
        match = _PARTIAL_FOLDER.match(name)
        if match is None:
            continue
        target = directory / match.group(1)
        with contextlib.suppress(OSError):
            if match.group(2) == "old" and not (target.exists() or target.is_symlink()):
                os.rename(directory / name, target)
            else:
                remove_tree(directory / name)
    if keep is None:
        return
    newest_first = [path for _, path in reversed(list_checkpoints(directory))]
    doomed = [path for path in newest_first[keep:] if path != written]
    for path in doomed:
        # Out of the listing first: a half-removed folder is never listed.
        with contextlib.suppress(OSError):
            remove_tree(set_aside(path, doomed=True) if path.is_dir() else path)
    if doomed:
        fsync_directory(directory)


def check_writable_directory(directory: str | os.PathLike[str]) -> Path:
    """Create `directory` and write a probe file there the way checkpoints are
    written, before any work; a `CheckpointError` names the folder and reason."""
    path = as_path(directory, "directory")

    def write(probe: Path) -> None:
        remove_stale_temporaries(probe)
        write_file(probe, {"format": "probe"}, [b"probe"])

    try:
        probe_folder(path, write)
    except OSError as error:
        reason = error.strerror or str(error)
        raise CheckpointError(
            f"Cannot write checkpoints to {str(path)!r}: {reason}. Choose a folder "
            "that can be created and written (nothing was trained yet)"
        ) from error
    return path


def newest_intact_checkpoint(
    directory: str | os.PathLike[str], verify: Callable[[Path], object]
) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The newest checkpoint `verify` accepts (it raises `CheckpointError` or
    `OSError` to refuse), or `None`, and the newer refused ones with the reason."""
    skipped: list[tuple[Path, str]] = []
    for _, path in reversed(list_checkpoints(directory)):
        try:
            verify(path)
        except (CheckpointError, OSError) as error:
            skipped.append((path, str(error)))
            continue
        return path, skipped
    return None, skipped
