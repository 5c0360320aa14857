"""`fit`: the training loop users call (`run.prepare` builds it, `Run.run` runs)."""

from collections.abc import Sequence
from typing import Any

import optax
from jaxtyping import PRNGKeyArray, PyTree

from .._execution.execution import (
    FIELDS,
    MOVED_TO_EXECUTION,
    Execution,
    as_execution,
    refuses_moved,
)
from .checkpointer import Checkpointer
from .evaluate import Evaluate
from .loss import LossFn
from .placement import placement_of
from .progress import ProgressBar
from .result import FitResult
from .run import prepare
from .sampling import Sampling, Shared
from .tracker import Tracker

# The keywords `fit` no longer takes (version 0.2), with their replacements.
_MOVED = {
    **MOVED_TO_EXECUTION,
    "progress": "callbacks=() (no bar) or callbacks=[ee.ProgressBar(), ...]",
    "callback": "callbacks=[your_function]",
    "controllers": "callbacks=[controller, ...]",
    "hyperparams": "opt_state=ee.init_optimizer(optimizer, ens, hyperparams=...)",
}


@refuses_moved("fit", _MOVED)
def fit(
    ens: Any,
    loss_fn: LossFn,
    optimizer: optax.GradientTransformation,
    data: Any,
    *,
    steps: int,
    key: PRNGKeyArray,
    batch_size: int | None = None,
    sampling: Sampling | str = Shared(),
    opt_state: PyTree[Any] = None,
    state: PyTree[Any] = None,
    hyper: PyTree[Any] = None,
    evaluate: Evaluate | None = None,
    checkpoints: Checkpointer | None = None,
    track: Sequence[Tracker] = (),
    callbacks: Sequence[Any] | None = None,
    execution: Execution | None = None,
) -> FitResult:
    """Train every member of an ensemble: the loop users call.

    Many steps run in one dispatch under `jax.lax.scan` (array data is sampled
    inside compiled code), so Python overhead is paid once per dispatch.

    **Arguments:**

    - `ens`: the ensemble to train.
    - `loss_fn`: the loss of ONE model, `loss_fn(model, batch, key) -> loss` or
      `(loss, aux)`; with a model `state`: `loss_fn(model, state, batch, key) ->
      (loss, new_state)` or `(loss, new_state, aux)`. An
      [`ee.Heterogeneous`][eqx_ensemble.Heterogeneous] may take one per group.
    - `optimizer`: an `optax.GradientTransformation`, applied per member.
    - `data`: a PyTree of arrays sharing a leading example axis, e.g. `(x, y)`;
      OR a stream: an iterable of same-shaped batches, or a function
      `step -> iterator` of the batches from `step` on (to resume a stream).
    - `steps`: the number of optimisation steps (in total, counting resumed ones).
    - `key`: ONE PRNG key; everything random derives from it (see below).
    - `batch_size`: examples per step (per member) for array data.
    - `sampling`: [`ee.Shared()`][eqx_ensemble.Shared] (default),
      [`ee.Independent()`][eqx_ensemble.Independent] or
      [`ee.Bootstrap()`][eqx_ensemble.Bootstrap], or their names `"shared"`,
      `"independent"`, `"bootstrap"`.
    - `opt_state`: a stacked optimizer state to continue from (default: fresh
      [`init_optimizer`][eqx_ensemble.init_optimizer]; per-member
      hyperparameters: `ee.init_optimizer(optimizer, ens, hyperparams={...})`).
    - `state`: the stacked model state for models with `eqx.nn.State`.
    - `hyper`: per-member hyperparameters of the loss: a PyTree of arrays with
      a leading member axis, passed to `loss_fn` as the keyword `hyper` (member
      `i`'s slice). Traced: new values do not recompile.
    - `evaluate`: an [`ee.Evaluate`][eqx_ensemble.Evaluate], scoring members
      inside the loop (each member's best kept in `best_ensemble`).
    - `checkpoints`: an [`ee.Checkpoints`][eqx_ensemble.Checkpoints]: saves the
      run, and resumes it when the folder holds one.
    - `track`: trackers ([`ee.EMA`][eqx_ensemble.EMA], ...) updated after every
      step; their results are in `FitResult.tracked`.
    - `callbacks`: [`ee.Callback`][eqx_ensemble.Callback]s run on the host
      between dispatches, by phase: progress meters, controllers (e.g.
      [`ee.PBT`][eqx_ensemble.PBT]), loggers, your own, and plain functions of
      the current [`FitResult`][eqx_ensemble.FitResult] (after every dispatch).
      `None` (default): `(ee.ProgressBar(),)`; `()`: nothing.
    - `execution`: an [`ee.Execution`][eqx_ensemble.Execution]: steps per
      dispatch, member layout, compiler options, the device mesh... None of it
      changes the result beyond floating-point rounding.

    **Returns:**

    A [`FitResult`][eqx_ensemble.FitResult]. Errors raised after training
    started carry the run so far as `error.result`.

    **Randomness (exact, so runs are reproducible):**
    `data_key, bootstrap_key, train_key = jax.random.split(key, 3)`. Steps
    count from 1 everywhere; at step `s + 1` member `i`'s `loss_fn` gets key
    `jax.random.split(jax.random.fold_in(train_key, s), len(ens))[i]`. Array
    batches are drawn from `data_key` (and `bootstrap_key`) as each sampling
    documents. Evaluations use `jax.random.fold_in(key, 3)`. An optimizer
    taking extra arguments (`optax.GradientTransformationExtraArgs`, e.g.
    [`ee.sgmcmc`][eqx_ensemble.sgmcmc]) gets member `i`'s loss key folded with
    `0x6F707478` as `update(..., key=)`, and its loss as `value=` (a trained
    shared part: the members' sum; an [`ee.Coupled`][eqx_ensemble.Coupled]
    loss: its total, for every member).

    **Example:**

    ```python
    x = jnp.linspace(-1, 1, 64)[:, None]
    ens = ee.ensemble(lambda k: eqx.nn.MLP(1, 1, 16, 1, key=k), size=4,
                      key=jax.random.key(0))

    def loss_fn(model, batch, key):
        xb, yb = batch
        return jnp.mean((jax.vmap(model)(xb) - yb) ** 2)

    result = ee.fit(ens, loss_fn, optax.adam(1e-2), (x, x**2), steps=200,
                    batch_size=16, key=jax.random.key(1), callbacks=())
    result.history.losses.shape     # (200, 4)
    ```
    """
    execution = as_execution(execution, "fit", FIELDS)
    with placement_of(execution.mesh).context():
        run = prepare(
            ens,
            loss_fn,
            optimizer,
            data,
            steps=steps,
            key=key,
            batch_size=batch_size,
            sampling=sampling,
            opt_state=opt_state,
            state=state,
            hyper=hyper,
            evaluate=evaluate,
            checkpoints=checkpoints,
            track=track,
            callbacks=(ProgressBar(),) if callbacks is None else callbacks,
            execution=execution,
        )
        return run.run()
