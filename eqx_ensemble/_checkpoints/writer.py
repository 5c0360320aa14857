"""The one checkpoint writer: a format is a list of phases run now or on a
background thread, with a multi-process agreement after each. On several
processes an asynchronous write runs the first `finish` phase on the thread and
the rest in `wait()`, so the collectives stay in program order everywhere.
"""

import contextlib
import errno
import os
import secrets
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import jax
import numpy as np

PARTIAL_SUFFIX = ".sharded.tmp"
# The file that commits a folder checkpoint (the sharded format's manifest).
MANIFEST = "manifest.ckpt"


class Phase(NamedTuple):
    """One step of a format's write: `work`, run on every process
    (`everyone`) or on process 0 only."""

    work: Callable[[], None]
    everyone: bool = False

    def here(self) -> Callable[[], None] | None:
        """This process's part of the phase (`None`: nothing to do here)."""
        return self.work if self.everyone or jax.process_index() == 0 else None


def write(
    path: Path, prepare: list[Phase], finish: list[Phase], asynchronous: bool
) -> "Path | PendingSave":
    """Run `prepare` now, `finish` now or (`asynchronous`) on a `PendingSave`."""
    run_phases(prepare, path)
    if not asynchronous:
        run_phases(finish, path)
        return path
    if jax.process_count() == 1:  # the thread commits too
        return PendingSave(path, lambda: run_phases(finish, path))
    first, *rest = finish

    def agree_and_commit(failure: BaseException | None) -> None:
        agree(failure, path)
        run_phases(rest, path)

    return PendingSave(path, first.here() or (lambda: None), agree_and_commit)


def run_phases(phases: list[Phase], path: Path) -> None:
    for phase in phases:
        on_every_process(phase.here(), path)


def on_every_process(work: Callable[[], None] | None, path: Path) -> None:
    """Run `work` (on the processes given one), then `agree`."""
    failure: BaseException | None = None
    if work is not None:
        try:
            work()
        except Exception as error:
            failure = error
    agree(failure, path)


def failed_processes(failure: BaseException | None) -> list[int]:
    """The processes whose `failure` is not `None` (a collective on several)."""
    if jax.process_count() == 1:
        return [] if failure is None else [0]
    from jax.experimental import multihost_utils

    ok = np.asarray(multihost_utils.process_allgather(np.asarray(failure is None)))
    return [int(p) for p in np.flatnonzero(~ok.astype(bool))]


def agree(failure: BaseException | None, path: Path) -> None:
    """Wait for every process; if any failed, process 0 removes the temporary
    folder and all raise (`failure`: this process's error)."""
    failed = failed_processes(failure)
    if not failed:
        return
    if jax.process_index() == 0:
        with contextlib.suppress(OSError):
            remove_tree(partial_folder(path))
    if failure is not None:
        if isinstance(failure, OSError) and failure.filename is None:
            raise OSError(
                failure.errno,
                f"{failure.strerror or failure}; the checkpoint was not written (a "
                "previous one at that path, if any, is intact)",
                str(path),
            ) from failure
        raise failure
    raise OSError(
        f"process(es) {failed} failed to write their part of the checkpoint "
        f"{path}; it was not written (a previous one at that path, if any, is intact)"
    )


class PendingSave:
    """A checkpoint written on a thread from host copies of its arrays; every
    process must call `wait()` (the commit)."""

    def __init__(
        self,
        path: Path,
        work: Callable[[], None],
        commit: Callable[[BaseException | None], None] | None = None,
    ):
        self.path = path
        self._commit = commit
        self._failure: BaseException | None = None
        self._waited = False
        # Not a daemon: a checkpoint in writing is finished before exit.
        self._thread = threading.Thread(
            target=self._run, args=(work,), name=f"eqx_ensemble save {path.name}"
        )
        self._thread.start()

    def _run(self, work: Callable[[], None]) -> None:
        try:
            work()
        except BaseException as error:  # noqa: BLE001 - raised by `wait`
            self._failure = error

    def wait(self) -> Path:
        """Block until the checkpoint is committed; raise the write's error."""
        self._thread.join()
        if not self._waited:
            self._waited = True
            if self._commit is not None:  # raises the failure, if any, on all
                self._commit(self._failure)
        if self._failure is not None:
            raise self._failure
        return self.path

    def abandon(self) -> BaseException | None:
        """Join the thread without a multi-process commit (the others may not
        reach the barrier); return its error."""
        self._thread.join()
        self._waited = True
        if self._commit is not None and self._failure is None:
            self._failure = RuntimeError(
                f"the checkpoint {self.path} was abandoned before its commit"
            )
        return self._failure


# -- putting a checkpoint in place ---------------------------------------------


def partial_folder(path: Path) -> Path:
    """Where a folder checkpoint `path` is written before its commit."""
    return path.parent / f".{path.name}{PARTIAL_SUFFIX}"


def check_replaceable(path: Path) -> None:
    """Refuse to replace anything at `path` but a checkpoint (a file, or a
    folder committed by its manifest): a folder of the user's is never removed."""
    if path.is_dir() and not (path / MANIFEST).is_file():
        raise IsADirectoryError(
            errno.EISDIR,
            "a folder that is not a checkpoint is in the way (nothing was removed)",
            str(path),
        )


def make_parent(path: Path) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise OSError(
            error.errno,
            f"cannot create the folder {str(path.parent)!r} for the checkpoint "
            f"({error.strerror or error}); nothing was written",
            str(path),
        ) from error


def set_aside(path: Path, *, doomed: bool = False) -> Path:
    """Rename the checkpoint at `path` out of the listing: `.old` (restored by the
    next save after a crash) or, `doomed`, `.deleted`."""
    kind = "deleted" if doomed else "old"
    aside = path.parent / f".{path.name}.{secrets.token_hex(8)}.{kind}{PARTIAL_SUFFIX}"
    os.rename(path, aside)
    return aside


def remove_tree(folder: Path) -> None:
    if folder.is_symlink() or folder.is_file():
        folder.unlink()
    elif folder.exists():
        shutil.rmtree(folder)


def put_in_place(path: Path, write: Callable[[], None], *, folder: bool) -> None:
    """Run `write` (one atomic rename to `path`). What is in the way, unless a
    file replaces a file, is set aside, put back if `write` fails and removed
    once it succeeds (after a crash, `directory._prune` restores it)."""
    in_the_way = path.is_dir() or (folder and (path.exists() or path.is_symlink()))
    aside = set_aside(path) if in_the_way else None
    try:
        write()
    except BaseException:
        if aside is not None:
            os.rename(aside, path)  # the previous checkpoint back in place
        raise
    if aside is not None:
        with contextlib.suppress(OSError):
            remove_tree(aside)
