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

    - `ensemble`: the trained ensemble.
    - `opt_state`: the stacked optimizer state.
    - `state`: the stacked model state (`eqx.nn.State`) or `None`.
    - `history`: a [`History`][eqx_ensemble.History] of per-member losses and scores.
    - `diverged`: `{member: step}` for members whose loss, gradient or update
      became non-finite at that step (counted from 1); the member keeps its last
      finite parameters and trains no more (`history.losses[step:]` is NaN).
    - `stopped`: `{member: step}` for members stopped before the end (by
      [`ee.EarlyStopping`][eqx_ensemble.EarlyStopping]): the last step each
      trained. When every member has stopped (or diverged), the run ends.
    - `best_ensemble`: with `evaluate=`, each member at its best (lowest) score,
      else `None`; `best_step`: the step of each member's best.
    - `step`: the number of steps done.
    - `tracked`: one result per tracker of `track=`, in order.
    - `train_state`: the full [`TrainState`][eqx_ensemble.TrainState].
    - `resumed_from`: the step this call resumed from, or `None`.
    - `sampling`, `key`, `num_examples`: how the run drew its batches
      (`num_examples`: `None` for a stream), e.g. for
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
    """A `FitResult` from a run's state (`read`: its `diverged_at`, `stopped_at`,
    `step` already on the host)."""
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
    """Raised by [`fit`][eqx_ensemble.fit] when every member has diverged (else
    `FitResult.diverged` reports them). The run so far is `error.result`.

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
