"""`WandbLogger`: a run's record in Weights & Biases (offline by default)."""

import os
from typing import Any

import equinox as eqx
import numpy as np

from .._internal.checks import check_positive_int
from .._training.loggers import LogEntry, Logger, RunInfo, check_writable

_MODES = ("offline", "online", "disabled")


class WandbLogger(Logger):
    """Writes a [`fit`][eqx_ensemble.fit] run to Weights & Biases: one W&B run
    with every member's curves (`loss/member_<i>`, `eval/member_<i>`),
    hyperparameters (`hparams/<name>/member_<i>`, at the start and on change),
    divergences (`diverged/member_<i>`: 1 at the step), PBT exploits
    (`exploit/member_<i>`: the parent) and trackers' events
    (`events/snapshot`, `events/averaging_starts`); the run's description and
    the starting hyperparameters are its config.

    `mode="offline"` (the default) writes under `directory` only (`wandb sync`
    uploads it). A run resumed from `ee.Checkpoints` is a new W&B run (config
    `resumed_from`) logging the steps after it. Needs the `wandb` package.

    **Arguments:**

    - `project`: the W&B project (`None`: W&B's default).
    - `directory`: where W&B writes (`None`: the working directory); checked to
      be writable before training.
    - `mode`: `"offline"`, `"online"` or `"disabled"`.
    - `name`, `group`: the W&B run's name and group.
    - `every`: log the loss at every `every`-th step (default 1: all).

    **Example:**

    ```python
    ens = ee.ensemble(lambda k: eqx.nn.Linear(1, 1, key=k), size=2,
                      key=jax.random.key(0))
    loss = lambda m, b, k: jnp.mean((jax.vmap(m)(b) - b) ** 2)
    logger = ee.WandbLogger(project="ensembles", directory="wandb_runs",
                            mode="disabled")       # "offline" writes files
    ee.fit(ens, loss, optax.sgd(0.1), jnp.ones((8, 1)), steps=4, batch_size=4,
           key=jax.random.key(1), callbacks=[logger])
    ```
    """

    project: str | None = eqx.field(static=True, default=None)
    directory: str | os.PathLike[str] | None = eqx.field(static=True, default=None)
    mode: str = eqx.field(static=True, default="offline")
    name: str | None = eqx.field(static=True, default=None)
    group: str | None = eqx.field(static=True, default=None)
    every: int = eqx.field(static=True, default=1)

    def __check_init__(self):
        if self.mode not in _MODES:
            raise ValueError(
                f"`WandbLogger.mode` must be one of {_MODES}, got {self.mode!r}"
            )
        check_positive_int(self.every, "WandbLogger.every")

    def check(self) -> None:
        _wandb()
        if self.directory is not None:
            check_writable(self.directory, "WandbLogger.directory")

    def open(self, run: RunInfo) -> dict[str, Any]:
        wandb = _wandb()
        config: dict[str, Any] = dict(run.hparams)
        for name, values in run.member_hparams.items():
            config[name] = np.asarray(values).tolist()
        # An absolute folder: W&B's service resolves a relative one against the
        # directory it started in (after a `chdir`, a run lost its data file).
        directory = os.getcwd() if self.directory is None else self.directory
        handle = wandb.init(
            project=self.project,
            dir=os.path.abspath(directory),
            mode=self.mode,
            name=self.name,
            group=self.group,
            config=config,
            reinit="create_new",
        )
        state = {"run": handle, "hparams": dict(run.member_hparams)}
        if not run.resumed:
            first = _hyperparameter_rows(run.member_hparams)
            if first:
                handle.log(first, step=run.start)
        return state

    def write(self, handle: dict[str, Any], entry: LogEntry) -> None:
        rows: dict[int, dict[str, float]] = {}
        for step, losses in zip(entry.steps.tolist(), entry.losses.tolist()):
            if step % self.every == 0:
                rows[step] = {f"loss/member_{i}": v for i, v in enumerate(losses)}
        for step, scores in zip(entry.eval_steps.tolist(), entry.eval_scores.tolist()):
            rows.setdefault(step, {}).update(
                {f"eval/member_{i}": v for i, v in enumerate(scores)}
            )
        last = int(entry.steps[-1])
        changed = {
            name: value
            for name, value in entry.member_hparams.items()
            if not np.array_equal(handle["hparams"].get(name), value)
        }
        handle["hparams"] = dict(entry.member_hparams)
        if changed:
            rows.setdefault(last, {}).update(_hyperparameter_rows(changed))
        for event in entry.events:
            member, kind, step = event.get("member"), event.get("event"), event["step"]
            if isinstance(member, int) and kind in ("diverged", "exploit"):
                value = 1.0 if kind == "diverged" else float(event.get("parent", -1))
                rows.setdefault(int(step), {})[f"{kind}/member_{member}"] = value
            elif member is None and isinstance(kind, str):  # a tracker's event
                rows.setdefault(int(step), {})[f"events/{kind}"] = 1.0
        run = handle["run"]
        for step in sorted(rows):
            run.log(rows[step], step=step)

    def close(self, handle: dict[str, Any]) -> None:
        handle["run"].finish()


def _hyperparameter_rows(values: dict[str, np.ndarray]) -> dict[str, float]:
    return {
        f"hparams/{name}/member_{i}": float(v)
        for name, value in values.items()
        for i, v in enumerate(np.asarray(value).tolist())
    }


def _wandb() -> Any:
    try:
        import wandb
    except ImportError as error:
        raise ImportError(
            "`ee.WandbLogger` writes with `wandb`, which is not installed: "
            '`pip install "eqx_ensemble[loaders]"` (or wandb)'
        ) from error
    return wandb
