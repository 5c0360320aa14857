"""`CSVLogger`: a run's record as CSV and JSON Lines files (no extra package)."""

import csv
import io
import json
import os
import time
from pathlib import Path
from typing import Any

import equinox as eqx
import numpy as np

from .._training.loggers import LogEntry, Logger, RunInfo, check_writable

LOSSES = "losses.csv"
EVALUATIONS = "evaluations.csv"
HYPERPARAMETERS = "hyperparameters.csv"
EVENTS = "events.jsonl"
RUN = "run.json"
# Files are flushed after a dispatch at most this often (and at the end).
FLUSH_SECONDS = 1.0


class CSVLogger(Logger):
    """Writes a [`fit`][eqx_ensemble.fit] run's record to a folder as plain files
    (NumPy, pandas or a spreadsheet read them):

    - `losses.csv`: `step, member_0, member_1, ...`: every member's training loss
      at every step (`FitResult.history.losses`);
    - `evaluations.csv`: the same for every evaluation
      (`FitResult.history.eval_scores`);
    - `hyperparameters.csv`: `step, name, member_0, ...`: each member's injected
      hyperparameters and `hyper` values, at the start and whenever they change;
    - `events.jsonl`: one JSON record per event (divergence, PBT exploit,
      snapshot, averaging start);
    - `run.json`: the run's description.

    Files are flushed once a second at most, before every checkpoint, and at
    the end. A run resumed from `ee.Checkpoints` drops the rows after its
    resume step and appends; a new run replaces the files.

    **Arguments:**

    - `directory`: the folder (created; checked to be writable before training).

    **Example:**

    ```python
    ens = ee.ensemble(lambda k: eqx.nn.Linear(1, 1, key=k), size=2,
                      key=jax.random.key(0))
    loss = lambda m, b, k: jnp.mean((jax.vmap(m)(b) - b) ** 2)
    result = ee.fit(ens, loss, optax.sgd(0.1), jnp.ones((8, 1)), steps=4,
                    batch_size=4, key=jax.random.key(1),
                    callbacks=[ee.CSVLogger("logs")])
    losses = np.loadtxt("logs/losses.csv", delimiter=",", skiprows=1)
    assert (losses[:, 1:].astype(np.float32) == result.history.losses).all()
    ```
    """

    directory: str | os.PathLike[str] = eqx.field(static=True)

    def __check_init__(self):
        if not isinstance(self.directory, str | os.PathLike):
            raise TypeError(
                "`CSVLogger.directory` must be a path (str or os.PathLike), got "
                f"{type(self.directory).__name__}"
            )

    def check(self) -> None:
        check_writable(self.directory, "CSVLogger.directory")

    def open(self, run: RunInfo) -> dict[str, Any]:
        folder = Path(self.directory)
        folder.mkdir(parents=True, exist_ok=True)
        members = [f"member_{i}" for i in range(run.size)]
        files: dict[str, Any] = {}
        for name, header, step_of in (
            (LOSSES, ["step", *members], _csv_step),
            (EVALUATIONS, ["step", *members], _csv_step),
            (HYPERPARAMETERS, ["step", "name", *members], _csv_step),
            (EVENTS, None, _json_step),
        ):
            path = folder / name
            kept = _rows_up_to(path, run.start, step_of) if run.resumed else []
            if header is not None and not kept:
                line = io.StringIO()
                csv.writer(line).writerow(header)
                kept = [line.getvalue()]
            files[name] = _reopen(path, kept)
        description = {
            **run.hparams,
            "member_hparams": {k: v.tolist() for k, v in run.member_hparams.items()},
        }
        (folder / RUN).write_text(json.dumps(description, indent=1) + "\n")
        state = {"files": files, "hparams": {}, "flushed": time.monotonic()}
        if not run.resumed:
            self._hyperparameters(state, run.start, run.member_hparams)
        else:
            state["hparams"] = dict(run.member_hparams)
        return state

    def write(self, handle: dict[str, Any], entry: LogEntry) -> None:
        files = handle["files"]
        _write_rows(files[LOSSES], entry.steps, entry.losses)
        _write_rows(files[EVALUATIONS], entry.eval_steps, entry.eval_scores)
        self._hyperparameters(handle, int(entry.steps[-1]), entry.member_hparams)
        for event in entry.events:
            files[EVENTS].write(json.dumps(event) + "\n")
        if time.monotonic() - handle["flushed"] >= FLUSH_SECONDS:
            for file in files.values():
                file.flush()
            handle["flushed"] = time.monotonic()

    def flush(self, handle: dict[str, Any]) -> None:
        for file in handle["files"].values():
            file.flush()
            os.fsync(file.fileno())
        handle["flushed"] = time.monotonic()

    def close(self, handle: dict[str, Any]) -> None:
        for file in handle["files"].values():
            file.close()

    def _hyperparameters(
        self, handle: dict[str, Any], step: int, values: dict[str, np.ndarray]
    ) -> None:
        writer = csv.writer(handle["files"][HYPERPARAMETERS])
        for name, value in values.items():
            last = handle["hparams"].get(name)
            if last is None or not np.array_equal(last, value):
                writer.writerow([step, name, *(_number(v) for v in value)])
        handle["hparams"] = dict(values)


def _reopen(path: Path, lines: list[str]) -> Any:
    """`path` holding exactly `lines`, open for appending; written aside and
    renamed, so a kill leaves the old file or the new one whole."""
    for stale in path.parent.glob(f".{path.name}.*.tmp"):  # a killed open's
        stale.unlink(missing_ok=True)
    aside = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(aside, "w", newline="") as file:
        file.writelines(lines)
        file.flush()
        os.fsync(file.fileno())
    os.replace(aside, path)
    return open(path, "a", newline="")


def _number(value: Any) -> str:
    # Nine significant digits read back to the same float32.
    return f"{float(value):.9g}"


def _write_rows(file: Any, steps: np.ndarray, values: np.ndarray) -> None:
    if not len(steps):
        return
    row = "%d" + ",%.9g" * values.shape[1] + "\n"
    file.write(
        "".join(
            row % (step, *numbers)
            for step, numbers in zip(steps.tolist(), values.tolist(), strict=True)
        )
    )


def _csv_step(line: str) -> int | None:
    head = line.split(",", 1)[0]
    return int(head) if head.isdigit() else None


def _json_step(line: str) -> int | None:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None


def _rows_up_to(path: Path, start: int, step_of: Any) -> list[str]:
    """The lines of `path` (its header included) up to step `start`."""
    if not path.exists():
        return []
    kept = []
    with open(path, newline="") as file:
        for line in file:
            if not line.endswith("\n"):  # torn by a kill mid-write
                break
            step = step_of(line)
            if step is None and kept:  # only a header line has no step
                continue
            if step is None or step <= start:
                kept.append(line)
    return kept
