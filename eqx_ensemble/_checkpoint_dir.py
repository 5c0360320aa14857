"""A folder of numbered checkpoints: `save_checkpoint`, `list_checkpoints`,
`latest_checkpoint`. One writer per folder (process 0 in a multi-host run)."""

import contextlib
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from jaxtyping import PyTree

from ._checkpoint import save_tree
from ._checkpoint_file import (
    TEMP_SUFFIX,
    CheckpointError,
    as_path,
    fsync_directory,
    write_file,
)

# The names `eqx_ensemble` re-exports; the rest serves the other checkpoint modules.
__all__ = ["latest_checkpoint", "list_checkpoints", "save_checkpoint"]

_CHECKPOINT_NAME = re.compile(r"^step_(\d+)\.ckpt$")
# Left behind by a writer killed mid-save (see `_checkpoint_file.write_file`).
_TEMPORARY_NAME = re.compile(
    r"^\.step_\d+\.ckpt\.[0-9a-f]+" + re.escape(TEMP_SUFFIX) + "$"
)


def checkpoint_path(directory: str | os.PathLike[str], step: int) -> Path:
    """Where `save_checkpoint(directory, step, ...)` writes: `step_<step>.ckpt`."""
    return Path(directory) / f"step_{step:010d}.ckpt"


def list_checkpoints(directory: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """The checkpoints [`ee.save_checkpoint`][eqx_ensemble.save_checkpoint] wrote in a
    folder, as `(step, path)` pairs sorted by step.

    Only complete checkpoints are listed: the temporary files of an interrupted
    write are never picked.

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
        match = _CHECKPOINT_NAME.match(name)
        if match is not None and (directory / name).is_file():
            # (a folder or a named pipe under a checkpoint's name is not one)
            found.append((int(match.group(1)), directory / name))
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


def save_checkpoint(
    directory: str | os.PathLike[str],
    step: int | np.integer,
    tree: PyTree,
    *,
    metadata: dict[str, Any] | None = None,
    keep: int | None = None,
) -> Path:
    """Save `tree` as checkpoint number `step` in a folder, keeping the last `keep`.

    Writes `directory/step_<step>.ckpt` atomically with [`ee.save`][eqx_ensemble.save]
    (the folder is created if needed; an existing checkpoint of the same step is
    replaced), records `step` in the manifest, then deletes the oldest checkpoints
    beyond the `keep` highest steps, and leftover temporary files of interrupted
    writes. The checkpoint just written is never deleted. Find the newest with
    [`ee.latest_checkpoint`][eqx_ensemble.latest_checkpoint]. Assumes one writer per
    folder; in a multi-host run every process calls it and process 0 writes.

    **Arguments:**

    - `directory`: the checkpoint folder.
    - `step`: a non-negative integer, usually the training step.
    - `tree`: the PyTree to save (ensemble, optimizer state, keys, counters...).
    - `metadata`: optional JSON-serialisable dict stored in the manifest.
    - `keep`: how many checkpoints to keep (at least 1); `None` keeps all.

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
    if isinstance(step, bool) or not isinstance(step, int | np.integer) or step < 0:
        raise ValueError(f"`step` must be a non-negative integer, got {step!r}")
    if keep is not None and (
        isinstance(keep, bool) or not isinstance(keep, int) or keep < 1
    ):
        raise ValueError(f"`keep` must be None or an integer >= 1, got {keep!r}")
    step = int(step)
    directory = as_path(directory, "directory")
    path = checkpoint_path(directory, step)

    def prune() -> None:
        _prune(directory, keep=keep, written=path)

    return save_tree(path, tree, metadata=metadata, step=step, after_write=prune)


def _prune(directory: Path, *, keep: int | None, written: Path) -> None:
    doomed = [
        directory / name
        for name in os.listdir(directory)
        if _TEMPORARY_NAME.match(name)
    ]
    if keep is not None:
        newest_first = [path for _, path in reversed(list_checkpoints(directory))]
        doomed += [path for path in newest_first[keep:] if path != written]
    for path in doomed:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    if doomed:
        fsync_directory(directory)


def check_writable_directory(directory: str | os.PathLike[str]) -> Path:
    """Create `directory` if needed and check a checkpoint can be written there
    (by writing and removing a probe file the way checkpoints are written), or
    raise a `CheckpointError` naming the folder and the reason: called before
    training, so a bad path costs no work."""
    path = as_path(directory, "directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / ".eqx_ensemble_write_probe"
        write_file(probe, {"format": "probe"}, [b"probe"])
        os.unlink(probe)
    except OSError as error:
        raise CheckpointError(
            f"Cannot write checkpoints to {path}: {error.strerror or error}. Choose "
            "a folder that can be created and written (nothing was trained yet)"
        ) from error
    return path


def newest_intact_checkpoint(
    directory: str | os.PathLike[str], verify: Callable[[Path], None]
) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The newest checkpoint of a folder that `verify` accepts (it raises a
    `CheckpointError` or `OSError` for one it cannot use), and the newer ones
    skipped, with the reason."""
    skipped: list[tuple[Path, str]] = []
    for _, path in reversed(list_checkpoints(directory)):
        try:
            verify(path)
        except (CheckpointError, OSError) as error:
            skipped.append((path, str(error)))
            continue
        return path, skipped
    return None, skipped
