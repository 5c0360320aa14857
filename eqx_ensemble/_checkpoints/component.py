"""`Checkpoints`: where and when `fit` saves its run, and how it resumes it."""

import os
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar, NamedTuple

import equinox as eqx
import jax
import numpy as np
import optax
from jaxtyping import PyTree

from .._core.ensemble import Ensemble
from .._core.heterogeneous import Heterogeneous
from .._internal.checks import MAX_INT32, check_positive_int
from .._training.callback import as_callbacks, stateful
from .._training.checkpointer import Checkpointer
from .._training.evaluate import Evaluate
from .._training.history import History
from .._training.optim import init_optimizer
from .._training.result import FitResult, make_result
from .._training.sampling import from_record
from .._training.tracker import Tracker
from .._training.train_state import TrainState, initial_state
from .directory import (
    _save_checkpoint,
    check_writable_directory,
    list_checkpoints,
    newest_intact_checkpoint,
)
from .file import CheckpointError
from .io import load, load_manifest
from .writer import PendingSave

_KIND = "eqx_ensemble.fit"
_ON_CORRUPT = ("raise", "previous")


class Resumed(NamedTuple):
    """What a checkpoint gives back to `fit` (`data`: the data source's position)."""

    train_state: TrainState
    history: History
    data: dict[str, Any] | None


class RunMismatchError(CheckpointError):
    """An intact checkpoint of another run (never a reason to fall back)."""


class Checkpoints(Checkpointer):
    """Save a [`fit`][eqx_ensemble.fit] run to a folder, and resume it from there.

    Every `every` steps, and at the end, the whole run (train state and
    history) is written atomically with
    [`ee.save_checkpoint`][eqx_ensemble.save_checkpoint], keeping the newest
    `keep`. If the folder already holds a checkpoint of this run, `fit`
    **resumes** from the newest one and continues bit for bit as the
    uninterrupted run would. The folder is checked to be writable before the
    first step.

    **Arguments:**

    - `directory`: the folder.
    - `every`: the period in steps (`None`: at the end only).
    - `keep`: how many checkpoints to keep (`None`: all).
    - `on_corrupt`: what resuming does when the newest checkpoint cannot be
      read: `"raise"` (default) or `"previous"`: fall back to the newest intact
      one (the skipped files are left in place and named in a message).
    - `sharded`: the format written, as for [`ee.save`][eqx_ensemble.save]
      (`None`: sharded folders when `jax.process_count() > 1`). Resuming reads
      either, onto any mesh and number of processes.
    - `asynchronous`: copy the arrays to the host when a checkpoint is due and
      write them on a thread while training goes on. The next checkpoint and
      the end of `fit` wait for it (a failed write is raised there, with the
      run attached); on several processes it is committed at that wait.

    **Example:**

    ```python
    ens = ee.ensemble(lambda k: eqx.nn.Linear(1, 1, key=k), size=2,
                      key=jax.random.key(0))
    x = jnp.linspace(0, 1, 8)[:, None]
    loss = lambda m, b, k: jnp.mean((jax.vmap(m)(b) - 2 * b) ** 2)
    opt = optax.sgd(0.1)
    run = ee.Checkpoints("fit_run", every=5)
    ee.fit(ens, loss, opt, x, steps=10, batch_size=4, key=jax.random.key(1),
           checkpoints=run, callbacks=())
    latest = run.latest(ens, opt)          # the run at step 10, as a FitResult
    assert latest.step == 10
    ```
    """

    error: ClassVar[type[Exception]] = CheckpointError
    directory: str | os.PathLike[str] = eqx.field(static=True)
    every: int | None = eqx.field(static=True, default=None)
    keep: int | None = eqx.field(static=True, default=3)
    on_corrupt: str = eqx.field(static=True, default="raise")
    sharded: bool | None = eqx.field(static=True, default=None)
    asynchronous: bool = eqx.field(static=True, default=False)

    def __check_init__(self):
        if not isinstance(self.directory, str | os.PathLike):
            raise TypeError(
                "`Checkpoints.directory` must be a path (str or os.PathLike), got "
                f"{type(self.directory).__name__}"
            )
        if self.every is not None:
            check_positive_int(self.every, "Checkpoints.every", high=MAX_INT32)
        if self.keep is not None:
            check_positive_int(self.keep, "Checkpoints.keep")
        if self.on_corrupt not in _ON_CORRUPT:
            raise ValueError(
                f"`Checkpoints.on_corrupt` must be one of {_ON_CORRUPT}, got "
                f"{self.on_corrupt!r}"
            )
        if not isinstance(self.asynchronous, bool):
            raise TypeError(
                "`Checkpoints.asynchronous` must be True or False, got "
                f"{self.asynchronous!r}"
            )
        if self.sharded is not None and not isinstance(self.sharded, bool):
            raise TypeError(
                "`Checkpoints.sharded` must be True, False or None, got "
                f"{self.sharded!r}"
            )

    def prepare(self) -> None:
        """Create the folder and check it is writable (before any training)."""
        check_writable_directory(self.directory)

    def has_checkpoints(self) -> bool:
        """Whether the folder holds a checkpoint (`fit` would resume)."""
        return bool(list_checkpoints(self.directory))

    def next_stop(self, done: int) -> int | None:
        """The first step after `done` with a checkpoint due (`None`: the end)."""
        if self.every is None:
            return None
        return (done // self.every + 1) * self.every

    def due(self, done: int, steps: int) -> bool:
        return done == steps or (self.every is not None and done % self.every == 0)

    def save(
        self,
        train_state: TrainState,
        history: History,
        run: dict[str, Any],
        data: dict[str, Any] | None = None,
    ) -> "Path | PendingSave":
        """Write the run at its current step (`data`: the data source's position)."""
        step = int(train_state.step)
        return _save_checkpoint(
            self.directory,
            step,
            {
                "train_state": train_state,
                "losses": history.losses,
                "eval_steps": history.eval_steps,
                "eval_scores": history.eval_scores,
            },
            metadata={
                "kind": _KIND,
                "step": step,
                "num_evaluations": int(history.eval_steps.shape[0]),
                "run": run,
                "data": data,
            },
            keep=self.keep,
            sharded=self.sharded,
            asynchronous=self.asynchronous,
        )

    def resume(
        self, template: TrainState, run: Any, steps: int | None
    ) -> Resumed | None:
        """The newest checkpoint of this run (`None`: none); a `CheckpointError`
        if it is of another run or past `steps`."""
        checkpoints = list_checkpoints(self.directory)
        if not checkpoints:
            return None
        if self.on_corrupt == "raise":
            return self._read(checkpoints[-1][1], template, run, steps)
        loaded: dict[Path, Resumed] = {}
        refused: list[RunMismatchError] = []

        def verify(path: Path) -> None:
            try:
                loaded[path] = self._read(path, template, run, steps)
            except RunMismatchError as error:  # intact, but another run: no fallback
                refused.append(error)

        path, skipped = newest_intact_checkpoint(self.directory, verify)
        if refused:
            raise refused[0]
        if path is None:
            reasons = "; ".join(f"{p.name}: {why}" for p, why in skipped)
            raise CheckpointError(
                f"No intact checkpoint in {self.directory} ({reasons}); use another "
                "folder to start a new run"
            )
        if skipped:
            names = ", ".join(p.name for p, _ in skipped)
            warnings.warn(
                f"Resuming from {path.name}: the newer checkpoints {names} in "
                f"{self.directory} cannot be read ({skipped[0][1]}); they are left "
                "in place and will be replaced as the run continues",
                stacklevel=4,
            )
        return loaded[path]

    def _read(
        self,
        path: Path,
        template: TrainState,
        run: Any,
        steps: int | None,
    ) -> Resumed:
        metadata = load_manifest(path).get("metadata", {})
        if metadata.get("kind") != _KIND:
            raise RunMismatchError(
                f"{path} was not written by `ee.fit`; point `Checkpoints` at a folder "
                "of fit checkpoints (or an empty one)"
            )
        step = metadata.get("step")
        named = {p: s for s, p in list_checkpoints(self.directory)}.get(path)
        if not isinstance(step, int) or (named is not None and named != step):
            raise CheckpointError(
                f"{path}: its manifest says step {step!r} but its name says step "
                f"{named}; the file was renamed or altered"
            )
        saved_run = metadata.get("run", {})
        if not isinstance(saved_run, dict):
            saved_run = {}
        difference = run.mismatch(saved_run)
        if difference is not None:
            field, saved, now = difference
            raise RunMismatchError(_mismatch_message(path, field, saved, now))
        if steps is not None and step > steps:
            raise RunMismatchError(
                f"{path} holds a run at step {step}, past the `steps={steps}` asked "
                f"for; ask for at least {step} steps (or use another folder)"
            )
        size = len(template.ensemble)
        evaluations = int(metadata.get("num_evaluations", 0))
        # Shapes only: a forged step count must not allocate anything.
        like = {
            "train_state": template,
            "losses": jax.ShapeDtypeStruct((step, size), np.float32),
            "eval_steps": jax.ShapeDtypeStruct((evaluations,), np.int64),
            "eval_scores": jax.ShapeDtypeStruct((evaluations, size), np.float32),
        }
        restored = load(path, like)
        history = History(
            losses=np.asarray(restored["losses"]),
            eval_steps=np.asarray(restored["eval_steps"]),
            eval_scores=np.asarray(restored["eval_scores"]),
        )
        data = metadata.get("data")
        return Resumed(
            restored["train_state"], history, data if isinstance(data, dict) else None
        )

    def latest(
        self,
        ens: Ensemble | Heterogeneous,
        optimizer: optax.GradientTransformation,
        *,
        opt_state: PyTree[Any] = None,
        state: PyTree[Any] = None,
        hyper: PyTree[Any] = None,
        evaluate: Evaluate | None = None,
        track: list[Tracker] | tuple[Tracker, ...] = (),
        callbacks: Sequence[Any] = (),
    ) -> FitResult | None:
        """The run's newest checkpoint as a [`FitResult`][eqx_ensemble.FitResult]
        (`None` if the folder holds none). The arguments describe the run as
        given to `fit`, so the saved arrays can be checked against them.

        **Example:**

        ```python
        ens = ee.ensemble(lambda k: eqx.nn.Linear(1, 1, key=k), size=2,
                          key=jax.random.key(0))
        result = ee.Checkpoints("empty_folder").latest(ens, optax.sgd(0.1))
        assert result is None
        ```
        """
        if opt_state is None:
            opt_state = init_optimizer(optimizer, ens)
        track = tuple(track)
        template = initial_state(
            ens,
            opt_state,
            state,
            hyper=hyper,
            track=track,
            with_eval=evaluate is not None,
            controllers=stateful(as_callbacks(callbacks)),
        )
        checkpoints = list_checkpoints(self.directory)
        if not checkpoints:
            return None
        saved_run = load_manifest(checkpoints[-1][1]).get("metadata", {}).get("run")
        if not isinstance(saved_run, dict):
            raise CheckpointError(f"{checkpoints[-1][1]} was not written by `ee.fit`")
        resumed = self.resume(template, _SameSize(len(ens)), None)
        assert resumed is not None
        train_state, history, _ = resumed
        return make_result(
            train_state,
            history,
            track,
            sampling=from_record(saved_run.get("sampling")),
            num_examples=saved_run.get("num_examples"),
            resumed_from=int(train_state.step),
        )


class _SameSize:
    """The one thing `latest` can check of a saved run: its ensemble size."""

    def __init__(self, size: int):
        self.size = size

    def mismatch(self, saved: dict[str, Any]) -> tuple[str, Any, Any] | None:
        if saved.get("size") != self.size:
            return "size", saved.get("size"), self.size
        return None


_FIELD_NAMES = {
    "key": "PRNG key",
    "hyperparams": "optimizer hyperparameters (of the `opt_state` given)",
    "optimizer": "optimizer (its structure or its fixed hyperparameters, such as "
    "the learning rate)",
}


def _mismatch_message(path: Path, field: str, saved: Any, now: Any) -> str:
    shown = _FIELD_NAMES.get(field, f"`{field}`")
    values = "" if field == "optimizer" else f" ({saved!r} there, {now!r} now)"
    return (
        f"Cannot resume from {path}: it was written by a run with a different "
        f"{shown}{values}; exact resume needs the same run. Use another folder for "
        "a new run."
    )
