"""Loggers: a `fit` run's record, written on a thread of its own."""

import abc
import dataclasses
import os
import queue
import threading
from pathlib import Path
from typing import Any

import numpy as np

from .._internal.files import probe_folder
from .callback import Callback, RunSetup, RunView


@dataclasses.dataclass(frozen=True)
class RunInfo:
    """What a logger is told before the first dispatch.

    - `steps`: the run's step count; `size`: its number of members.
    - `start`: the step it starts from (`> 0`: `resumed`; anything logged after
      `start` belongs to a run that was cut off).
    - `hparams`: the run's description (numbers and strings).
    - `member_hparams`: each member's injected hyperparameters at the start
      (`name -> (members,)` values; empty without `optax.inject_hyperparams`).

    **Example:** a logger's `open` receives it:

    ```python
    class Describe(ee.Logger):
        def open(self, run):
            print(f"{run.size} members, steps {run.start} to {run.steps}")
        def write(self, handle, entry):
            pass

    ens = ee.ensemble(lambda k: eqx.nn.Linear(1, 1, key=k), size=2,
                      key=jax.random.key(0))
    loss = lambda m, b, k: jnp.mean((jax.vmap(m)(b) - b) ** 2)
    ee.fit(ens, loss, optax.sgd(0.1), jnp.ones((8, 1)), steps=4, batch_size=4,
           key=jax.random.key(1), callbacks=[Describe()])
    ```
    """

    steps: int
    size: int
    start: int
    resumed: bool
    hparams: dict[str, float | int | str]
    member_hparams: dict[str, np.ndarray]


@dataclasses.dataclass(frozen=True)
class LogEntry:
    """One dispatch's record, on the host.

    - `steps`: `(n,)` the steps it ran (1-based: the step count after each).
    - `losses`: `(n, members)` every member's training loss at those steps.
    - `eval_steps`, `eval_scores`: `(e,)` and `(e, members)`: evaluations it ran.
    - `diverged_at`: `(members,)` each member's divergence step (`-1`: healthy).
    - `member_hparams`: each member's injected hyperparameters after it.
    - `events`: what happened in it, as records with `"step"` and `"event"`:
      `"diverged"` with `"member"`, `"exploit"` with `"member"` and `"parent"`
      (PBT), `"snapshot"` (`ee.Snapshots`), `"averaging_starts"` (`ee.SWA`).

    **Example:** a logger's `write` receives one per dispatch:

    ```python
    class Worst(ee.Logger):
        def open(self, run):
            return []
        def write(self, handle, entry):
            handle.append((int(entry.steps[-1]), float(entry.losses[-1].max())))
        def close(self, handle):
            print("worst member's loss after each dispatch:", handle)

    ens = ee.ensemble(lambda k: eqx.nn.Linear(1, 1, key=k), size=2,
                      key=jax.random.key(0))
    loss = lambda m, b, k: jnp.mean((jax.vmap(m)(b) - b) ** 2)
    ee.fit(ens, loss, optax.sgd(0.1), jnp.ones((8, 1)), steps=4, batch_size=4,
           key=jax.random.key(1), callbacks=[Worst()])
    ```
    """

    steps: np.ndarray
    losses: np.ndarray
    eval_steps: np.ndarray
    eval_scores: np.ndarray
    diverged_at: np.ndarray
    member_hparams: dict[str, np.ndarray]
    events: tuple[dict[str, Any], ...]


class Logger(Callback):
    """Writes a [`fit`][eqx_ensemble.fit] run's record somewhere (abstract),
    e.g. [`ee.CSVLogger`][eqx_ensemble.CSVLogger]; called from a thread of its
    own, one call at a time and in order:

    - `check() -> None`: before any work (e.g. refuse an unwritable folder).
    - `open(run: RunInfo) -> handle`: before the first dispatch.
    - `write(handle, entry: LogEntry) -> None`: after every dispatch.
    - `flush(handle) -> None`: before each checkpoint (optional).
    - `close(handle) -> None`: when the run ends (also on an error).

    Its error ends the run at the next dispatch or the end. A
    [`Callback`][eqx_ensemble.Callback] of phase `RECORD`.

    **Example:**

    ```python
    class Mean(ee.Logger):
        def open(self, run):
            return []
        def write(self, handle, entry):
            handle.extend(entry.losses.mean(axis=1).tolist())
        def close(self, handle):
            print(f"{len(handle)} steps logged")

    ens = ee.ensemble(lambda k: eqx.nn.Linear(1, 1, key=k), size=2,
                      key=jax.random.key(0))
    loss = lambda m, b, k: jnp.mean((jax.vmap(m)(b) - b) ** 2)
    ee.fit(ens, loss, optax.sgd(0.1), jnp.ones((8, 1)), steps=4, batch_size=4,
           key=jax.random.key(1), callbacks=[Mean()])
    ```
    """

    phase = Callback.RECORD

    def on_check(self, setup: RunSetup) -> None:
        self.check()

    def on_start(self, run: RunView) -> "LogWriter":
        return LogWriter(self, run.run_info())

    def on_dispatch(self, handle: "LogWriter", run: RunView) -> None:
        handle.write(run.log_entry())

    def on_sync(self, handle: "LogWriter") -> None:
        handle.sync()

    def on_end(self, handle: "LogWriter", error: BaseException | None) -> None:
        handle.close()

    def check(self) -> None:
        """Raise before any work if this logger cannot write (default: nothing)."""

    @abc.abstractmethod
    def open(self, run: RunInfo) -> Any:
        """Called once before the first dispatch; returns the logger's handle."""

    @abc.abstractmethod
    def write(self, handle: Any, entry: LogEntry) -> None:
        """Called after every dispatch."""

    def flush(self, handle: Any) -> None:
        """Called before each checkpoint: make what was written so far durable."""
        del handle

    def close(self, handle: Any) -> None:
        """Called when the run ends (also when it fails)."""
        del handle


def check_writable(directory: str | os.PathLike[str], name: str) -> Path:
    """Create `directory` if needed, or raise an `OSError` if it is unwritable."""
    path = Path(directory)
    try:
        probe_folder(path, lambda probe: probe.write_bytes(b"probe"))
    except OSError as error:
        reason = getattr(error, "strerror", None) or str(error)
        raise type(error)(
            f"`{name}`: cannot write logs to {str(path)!r}: {reason}. Choose a "
            "folder that can be created and written (nothing was trained yet)"
        ) from error
    return path


_STOP = object()


class _Sync:
    """A marker: the writer flushes every logger and sets `done`."""

    def __init__(self):
        self.done = threading.Event()


class LogWriter:
    """A logger behind a queue, written on its own thread; its error is
    re-raised at the next `write`, `sync` or `close`."""

    def __init__(self, logger: Logger, run: RunInfo):
        self.error: BaseException | None = None
        self.queue: queue.Queue[Any] = queue.Queue()
        self.logger = logger
        self.handle = logger.open(run)  # on the run's thread: errors come at once
        self.thread = threading.Thread(
            target=self._work, name="eqx_ensemble-logger", daemon=True
        )
        self.thread.start()

    def _work(self) -> None:
        while (entry := self.queue.get()) is not _STOP:
            try:
                if self.error is not None:
                    continue
                if isinstance(entry, _Sync):
                    self.logger.flush(self.handle)
                else:
                    self.logger.write(self.handle, entry)
            except BaseException as error:  # noqa: BLE001 - re-raised on the run's thread
                self.error = error
            finally:
                if isinstance(entry, _Sync):
                    entry.done.set()

    def write(self, entry: LogEntry) -> None:
        self.raise_error()
        self.queue.put(entry)

    def sync(self) -> None:
        """Wait until everything queued is written and flushed."""
        marker = _Sync()
        self.queue.put(marker)
        marker.done.wait()
        self.raise_error()

    def raise_error(self) -> None:
        if self.error is not None:
            error, self.error = self.error, None
            raise error

    def close(self) -> None:
        """Wait for the queue, close the logger, raise its first error."""
        self.queue.put(_STOP)
        self.thread.join()
        try:
            self.logger.close(self.handle)
        except BaseException as error:  # noqa: BLE001 - raised below
            self.error = self.error or error
        self.raise_error()
