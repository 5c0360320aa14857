"""`TensorBoardLogger`: a run's record as TensorBoard event files, one run per
member (written with `tensorboardX`, from the `loggers` extra)."""

import os
from pathlib import Path
from typing import Any

import equinox as eqx
import numpy as np

from .._internal.checks import check_positive_int
from .._training.loggers import LogEntry, Logger, RunInfo, check_writable


class TensorBoardLogger(Logger):
    """Writes a [`fit`][eqx_ensemble.fit] run to TensorBoard: one run folder per
    member (`member_000`, `member_001`, ...), so that TensorBoard draws the
    members' curves in one chart and its HParams dashboard compares them.

    Per member: the scalar `loss` at every `every`-th step, `eval` at every
    evaluation, `hparams/<name>` (injected hyperparameters and `hyper` values)
    whenever they change, `diverged` (1.0) at the step a member diverged, and
    the text `events` (PBT exploits with their parent). The run's description
    and the member's hyperparameters at the start are its HParams session.
    A resumed run drops what was written after the step it resumes from
    (TensorBoard's purge step).

    Needs `tensorboardX` (`pip install "eqx_ensemble[loggers]"`); read the files
    with TensorBoard (`tensorboard --logdir <directory>`) or its event reader.

    **Arguments:**

    - `directory`: the folder (created; checked to be writable before any
      training).
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
        writer_class = _summary_writer()
        from tensorboardX.summary import hparams

        writers = []
        for member in range(run.size):
            writer = writer_class(
                str(Path(self.directory) / f"member_{member:03d}"),
                purge_step=run.start + 1,  # drops a cut-off run's later events
                flush_secs=30,
            )
            if not run.resumed:
                values: dict[str, Any] = {"member": member, **run.hparams}
                for name, value in run.member_hparams.items():
                    values[name] = float(value[member])
                for summary in hparams(values, {"loss": 0.0, "eval": 0.0}):
                    writer.file_writer.add_summary(summary)
            writers.append(writer)
        state = {"writers": writers, "hparams": {}}
        self._hyperparameters(state, run.start, run.member_hparams)
        return state

    def write(self, handle: dict[str, Any], entry: LogEntry) -> None:
        writers = handle["writers"]
        keep = entry.steps % self.every == 0
        steps, losses = entry.steps[keep].tolist(), entry.losses[keep]
        for member, writer in enumerate(writers):
            for step, value in zip(steps, losses[:, member].tolist(), strict=True):
                writer.add_scalar("loss", value, step)
            for step, value in zip(
                entry.eval_steps.tolist(),
                entry.eval_scores[:, member].tolist(),
                strict=True,
            ):
                writer.add_scalar("eval", value, step)
        self._hyperparameters(handle, int(entry.steps[-1]), entry.member_hparams)
        for event in entry.events:
            member = event.get("member")
            if not isinstance(member, int) or not 0 <= member < len(writers):
                continue
            if event.get("event") == "diverged":
                writers[member].add_scalar("diverged", 1.0, event["step"])
            text = ", ".join(f"{k}={v}" for k, v in event.items())
            writers[member].add_text("events", text, event["step"])

    def close(self, handle: dict[str, Any]) -> None:
        for writer in handle["writers"]:
            writer.close()

    def _hyperparameters(
        self, handle: dict[str, Any], step: int, values: dict[str, np.ndarray]
    ) -> None:
        for name, value in values.items():
            last = handle["hparams"].get(name)
            if last is not None and np.array_equal(last, value):
                continue
            for member, writer in enumerate(handle["writers"]):
                writer.add_scalar(f"hparams/{name}", float(value[member]), step)
        handle["hparams"] = dict(values)


def _summary_writer() -> Any:
    try:
        from tensorboardX import SummaryWriter
    except ImportError as error:
        raise ImportError(
            "`ee.TensorBoardLogger` writes with `tensorboardX`, which is not "
            'installed: `pip install "eqx_ensemble[loggers]"` (or tensorboardX)'
        ) from error
    return SummaryWriter
