"""`TensorBoardLogger`: a run's record as TensorBoard event files, one run per
member. Scalars are encoded in bulk (`events.py`); the hyperparameter and text
summaries are built with `tensorboardX` (from the `loaders` extra)."""

import os
import time
from pathlib import Path
from typing import Any

import equinox as eqx
import numpy as np

from .._internal.checks import check_positive_int
from .._training.loggers import LogEntry, Logger, RunInfo, check_writable
from .events import EventFile, event_record, scalar_columns, scalar_records
from .files import FLUSH_SECONDS


class TensorBoardLogger(Logger):
    """Writes a [`fit`][eqx_ensemble.fit] run to TensorBoard: one run folder per
    member (`member_000`, ...), so TensorBoard draws the members' curves in one
    chart and its HParams dashboard compares them.

    Per member: the scalar `loss` at every `every`-th step, `eval` at every
    evaluation, `hparams/<name>` whenever they change, `diverged` (1.0) at the
    step a member diverged, and the text `events` (e.g. PBT exploits); the
    run's description and starting hyperparameters are its HParams session. A
    resumed run drops what was written after its resume step.

    Needs `tensorboardX` (`pip install "eqx_ensemble[loaders]"`).

    **Arguments:**

    - `directory`: the folder (created; checked to be writable before training).
    - `every`: write the loss at every `every`-th step (default 1: all).

    **Example:**

    ```python
    ens = ee.ensemble(lambda k: eqx.nn.Linear(1, 1, key=k), size=2,
                      key=jax.random.key(0))
    loss = lambda m, b, k: jnp.mean((jax.vmap(m)(b) - b) ** 2)
    ee.fit(ens, loss, optax.sgd(0.1), jnp.ones((8, 1)), steps=4, batch_size=4,
           key=jax.random.key(1), callbacks=[ee.TensorBoardLogger("runs")])
    ```
    """

    directory: str | os.PathLike[str] = eqx.field(static=True)
    every: int = eqx.field(static=True, default=1)

    def __check_init__(self):
        if not isinstance(self.directory, str | os.PathLike):
            raise TypeError(
                "`TensorBoardLogger.directory` must be a path (str or os.PathLike), "
                f"got {type(self.directory).__name__}"
            )
        check_positive_int(self.every, "TensorBoardLogger.every")

    def check(self) -> None:
        _summary_writer()
        check_writable(self.directory, "TensorBoardLogger.directory")

    def open(self, run: RunInfo) -> dict[str, Any]:
        _summary_writer()
        from tensorboardX.summary import hparams

        files = []
        now = time.time()
        for member in range(run.size):
            file = EventFile(
                Path(self.directory) / f"member_{member:03d}",
                purge_step=run.start + 1,  # drops a cut-off run's later events
            )
            if not run.resumed:
                values: dict[str, Any] = {"member": member, **run.hparams}
                for name, value in run.member_hparams.items():
                    values[name] = float(value[member])
                for summary in hparams(values, {"loss": 0.0, "eval": 0.0}):
                    file.write(event_record(now, 0, summary=_bytes(summary)))
            files.append(file)
        state = {"files": files, "hparams": {}, "flushed": time.monotonic()}
        if run.resumed:  # written by the run it resumes
            state["hparams"] = dict(run.member_hparams)
        else:
            self._hyperparameters(state, run.start, run.member_hparams, now)
        return state

    def write(self, handle: dict[str, Any], entry: LogEntry) -> None:
        files = handle["files"]
        now = time.time()
        keep = entry.steps % self.every == 0
        steps, losses = entry.steps[keep], entry.losses[keep]
        loss_records = scalar_columns("loss", steps, losses, now)
        eval_records = scalar_columns("eval", entry.eval_steps, entry.eval_scores, now)
        for file, loss, evaluation in zip(
            files, loss_records, eval_records, strict=True
        ):
            file.write(loss)
            file.write(evaluation)
        self._hyperparameters(handle, int(entry.steps[-1]), entry.member_hparams, now)
        for event in entry.events:
            member, step = event.get("member"), int(event["step"])
            if isinstance(member, int) and not 0 <= member < len(files):
                continue
            if event.get("event") == "diverged" and isinstance(member, int):
                records = scalar_records("diverged", np.array([step]), np.ones(1), now)
                files[member].write(records)
            text = ", ".join(f"{k}={v}" for k, v in event.items())
            summary = _bytes(_text_summary("events", text))
            # A member's event goes to its run; the run's (a tracker's) to all.
            for file in files if member is None else [files[member]]:
                file.write(event_record(now, step, summary=summary))
        if time.monotonic() - handle["flushed"] >= FLUSH_SECONDS:
            for file in files:
                file.flush()
            handle["flushed"] = time.monotonic()

    def flush(self, handle: dict[str, Any]) -> None:
        for file in handle["files"]:
            file.flush()
        handle["flushed"] = time.monotonic()

    def close(self, handle: dict[str, Any]) -> None:
        for file in handle["files"]:
            file.close()

    def _hyperparameters(
        self,
        handle: dict[str, Any],
        step: int,
        values: dict[str, np.ndarray],
        now: float,
    ) -> None:
        for name, value in values.items():
            last = handle["hparams"].get(name)
            if last is not None and np.array_equal(last, value):
                continue
            for member, file in enumerate(handle["files"]):
                at = np.array([step])
                records = scalar_records(
                    f"hparams/{name}", at, value[member : member + 1], now
                )
                file.write(records)
        handle["hparams"] = dict(values)


def _bytes(summary: Any) -> bytes:
    return summary.SerializeToString()


def _text_summary(tag: str, text: str) -> Any:
    from tensorboardX.summary import text as text_summary

    return text_summary(tag, text)


def _summary_writer() -> Any:
    try:
        from tensorboardX import SummaryWriter
    except ImportError as error:
        raise ImportError(
            "`ee.TensorBoardLogger` writes with `tensorboardX`, which is not "
            'installed: `pip install "eqx_ensemble[loaders]"` (or tensorboardX)'
        ) from error
    return SummaryWriter
