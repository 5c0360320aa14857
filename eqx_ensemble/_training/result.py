"""`FitResult` and `EnsembleDivergedError`: what `fit` returns or raises."""

import dataclasses
from typing import Any

import numpy as np
from jaxtyping import PRNGKeyArray, PyTree

from .._core.ensemble import Ensemble
from .._core.heterogeneous import Heterogeneous
from .history import History
from .sampling import Sampling
from .train_state import TrainState, track_result


@dataclasses.dataclass(frozen=True)
class FitResult:
    """What [`fit`][eqx_ensemble.fit] returns.

    - `ensemble`: the trained ensemble (after the last step).
    - `opt_state`: the stacked optimizer state.
    - `state`: the stacked model state (`eqx.nn.State`) or `None`.
    - `history`: a [`History`][eqx_ensemble.History] of per-member losses and scores.
    - `diverged`: `{member: step}` for members whose loss, gradient or update
      became non-finite at that step (steps count from 1, as everywhere: the
      logs, `steps=`, checkpoints); the member keeps its parameters after the
      step before (its last finite ones) and trains no more, the others train
      on. Row `step - 1` of `history.losses` holds the loss computed at
      that step (finite where only the gradient or the update was not), and
      its losses after it are NaN: `history.losses[step:]`.
    - `stopped`: `{member: step}` for members stopped before the end (by
      [`ee.EarlyStopping`][eqx_ensemble.EarlyStopping]): the last step each
      trained; from then on they were frozen. When every member has
      stopped (or diverged), the run ends there: `step` is less than `steps`.
    - `best_ensemble`: with `evaluate=`, each member at its best evaluation score
      (lowest), else `None`; `best_step` holds the step of each member's best.
    - `step`: the number of steps done.
    - `tracked`: one result per tracker of `track=` (e.g. an `Ensemble` of
      averaged weights for [`ee.EMA`][eqx_ensemble.EMA]), in order.
    - `train_state`: the full [`TrainState`][eqx_ensemble.TrainState] (what a
      checkpoint holds).
    - `resumed_from`: the step this call of `fit` resumed from (a checkpoint in
      `ee.Checkpoints`' folder), or `None` when it started afresh.
    - `sampling`, `key`, `num_examples`: how the run drew its batches (for array
      data; `num_examples` is `None` for a stream), e.g. to rebuild a bootstrap
      run's out-of-bag examples with
      [`Bootstrap.in_bag`][eqx_ensemble.Bootstrap.in_bag].

    **Example:**

    ```python
    ens = ee.ensemble(lambda k: eqx.nn.Linear(1, 1, key=k), size=3,
                      key=jax.random.key(0))
    x = jnp.linspace(0, 1, 8)[:, None]
    loss = lambda m, b, k: jnp.mean((jax.vmap(m)(b) - 2 * b) ** 2)
    result = ee.fit(ens, loss, optax.sgd(0.1), x, steps=20, batch_size=4,
                    key=jax.random.key(1), callbacks=())
    trained, history, diverged = result.ensemble, result.history, result.diverged
    assert result.step == 20 and diverged == {}
    ```
    """

    ensemble: Ensemble | Heterogeneous
    opt_state: PyTree[Any]
    state: PyTree[Any]
    history: History
    diverged: dict[int, int]
    best_ensemble: Ensemble | Heterogeneous | None
    best_step: np.ndarray | None
    step: int
    tracked: tuple[Any, ...] = ()
    train_state: TrainState | None = None
    sampling: Sampling | None = None
    key: PRNGKeyArray | None = None
    num_examples: int | None = None
    resumed_from: int | None = None
    stopped: dict[int, int] = dataclasses.field(default_factory=dict)


def make_result(
    train_state: TrainState,
    history: History,
    track: tuple[Any, ...],
    *,
    sampling: Sampling | None = None,
    key: PRNGKeyArray | None = None,
    num_examples: int | None = None,
    resumed_from: int | None = None,
    read: tuple[np.ndarray, np.ndarray, int] | None = None,
) -> FitResult:
    """A `FitResult` from a run's state; `read`: its `diverged_at`, `stopped_at`
    and `step` already on the host (read from the state otherwise)."""
    if read is None:
        read = (
            np.asarray(train_state.diverged_at),
            np.asarray(train_state.stopped_at),
            int(train_state.step),
        )
    diverged_at, stopped_at, step = read
    best_step = train_state.best_step
    return FitResult(
        ensemble=train_state.ensemble,
        opt_state=train_state.opt_state,
        state=train_state.model_state,
        history=history,
        diverged={  # counted from 1: `diverged_at` is the step's index
            int(member): int(step) + 1
            for member, step in enumerate(diverged_at)
            if step >= 0
        },
        best_ensemble=train_state.best_ensemble,
        best_step=None if best_step is None else np.asarray(best_step),
        step=step,
        tracked=tuple(
            track_result(tracker, state, train_state.ensemble)
            for tracker, state in zip(track, train_state.tracked, strict=True)
        ),
        train_state=train_state,
        stopped={
            int(member): int(step)
            for member, step in enumerate(stopped_at)
            if step >= 0
        },
        sampling=sampling,
        key=key,
        num_examples=num_examples,
        resumed_from=resumed_from,
    )


class EnsembleDivergedError(FloatingPointError):
    """Raised by [`fit`][eqx_ensemble.fit] when every member has diverged
    (non-finite loss, gradient or update). While some members are healthy, `fit`
    keeps training them and reports the others in `FitResult.diverged` instead.
    The run so far is attached as `error.result`.

    **Example:**

    ```python
    ens = ee.ensemble(lambda k: eqx.nn.Linear(1, 1, key=k), size=2,
                      key=jax.random.key(0))
    x = jnp.linspace(0, 1, 8)[:, None]
    loss = lambda m, b, k: jnp.mean(jnp.log(-jnp.abs(jax.vmap(m)(b))))  # NaN
    try:
        ee.fit(ens, loss, optax.sgd(0.1), x, steps=5, batch_size=4,
               key=jax.random.key(1), callbacks=())
    except ee.EnsembleDivergedError as error:
        print(error, error.result.diverged)
    ```
    """

    result: FitResult | None = None
