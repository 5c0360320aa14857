"""`fit`: the training loop users call. It checks its arguments and hands
over: `run.prepare` builds the run (its components checked, the start state or
the resumed one, the data source, the execution plan) and `Run.run` drives it,
one compiled dispatch at a time, with the host work between dispatches done by
the components themselves (history, progress, controllers, checkpoints,
callbacks)."""

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

    Array data is sampled inside compiled code, a stream's batches are grouped on
    the host, and many steps run in one dispatch with `jax.lax.scan`, so the
    Python overhead is paid once per dispatch, not once per step or per member.
    Everything else is a component: evaluation
    ([`ee.Evaluate`][eqx_ensemble.Evaluate]), checkpoints and resume
    ([`ee.Checkpoints`][eqx_ensemble.Checkpoints]), weight-trajectory trackers
    ([`ee.EMA`][eqx_ensemble.EMA], ...), callbacks between dispatches (the
    progress bar, controllers such as [`ee.PBT`][eqx_ensemble.PBT], your own
    functions) and how the run executes
    ([`ee.Execution`][eqx_ensemble.Execution]).

    **Arguments:**

    - `ens`: the ensemble to train.
    - `loss_fn`: the loss of ONE model, `loss_fn(model, batch, key) -> loss` or
      `(loss, aux)`; with a model `state`: `loss_fn(model, state, batch, key) ->
      (loss, new_state)` or `(loss, new_state, aux)`. For an
      [`ee.Heterogeneous`][eqx_ensemble.Heterogeneous], a tuple of such losses,
      one per group, trains each group with its own.
    - `optimizer`: an `optax.GradientTransformation`, applied per member.
    - `data`: a PyTree of arrays sharing a leading example axis, e.g. `(x, y)`
      (batches of `batch_size` examples are drawn inside compiled code); OR a
      stream: any iterable of batches (a generator, a data loader; each batch a
      PyTree of arrays, all of the same shapes), or a function `step -> iterator`
      yielding the batches from `step` on (needed to resume a stream).
    - `steps`: the number of optimisation steps (in total, counting resumed ones).
    - `key`: ONE PRNG key; everything random derives from it (see below).
    - `batch_size`: examples per step (per member) for array data; a stream's
      batches set their own size.
    - `sampling`: [`ee.Shared()`][eqx_ensemble.Shared] (default: all members see
      the same batch), [`ee.Independent()`][eqx_ensemble.Independent] (each
      member shuffles on its own; for a stream: each batch has a leading member
      axis) or [`ee.Bootstrap()`][eqx_ensemble.Bootstrap] (bagging, array data
      only); or their names `"shared"`, `"independent"`, `"bootstrap"`.
    - `opt_state`: a stacked optimizer state to continue from (default: fresh
      [`init_optimizer`][eqx_ensemble.init_optimizer]). Per-member optimizer
      hyperparameters (an optimizer built with `optax.inject_hyperparams`):
      `opt_state=ee.init_optimizer(optimizer, ens, hyperparams={...})`.
    - `state`: the stacked model state for models with `eqx.nn.State`.
    - `hyper`: per-member hyperparameters of the loss and model (weight decay,
      dropout rate, label smoothing, ...): a PyTree of arrays with a leading
      member axis, passed to `loss_fn` as the keyword `hyper` (member `i` sees
      its slice). Traced, so new values do not recompile; controllers may change
      them (they live in `TrainState.hyper`).
    - `evaluate`: an [`ee.Evaluate`][eqx_ensemble.Evaluate]: scores every member
      inside the loop and keeps each member's best in `best_ensemble`.
    - `checkpoints`: an [`ee.Checkpoints`][eqx_ensemble.Checkpoints]: saves the
      run, and resumes it when the folder holds one.
    - `track`: trackers updated inside the loop after every step; their results
      are in `FitResult.tracked`.
    - `callbacks`: what runs on the host between dispatches: any
      [`ee.Callback`][eqx_ensemble.Callback], in the order of its phase
      (then as given): progress meters ([`ee.ProgressBar`][eqx_ensemble.ProgressBar],
      the default, or any [`ee.ProgressMeter`][eqx_ensemble.ProgressMeter]),
      controllers ([`ee.Controller`][eqx_ensemble.Controller], e.g.
      [`ee.PBT`][eqx_ensemble.PBT]: run every `controller.every` steps),
      loggers ([`ee.Logger`][eqx_ensemble.Logger]), your own callbacks, and
      plain functions, called after every dispatch (and after its checkpoint)
      with the current [`FitResult`][eqx_ensemble.FitResult]. `None` (the
      default): `(ee.ProgressBar(),)`; `()`: nothing (no progress bar).
    - `execution`: an [`ee.Execution`][eqx_ensemble.Execution]: steps per
      dispatch, member layout, unrolling, compiler options and the device mesh
      (`Execution(mesh=ee.make_mesh(...))`: the member axis of the ensemble and
      its states is split over `"members"`, each step's batch over `"data"`;
      results equal the single-device run's, see the sharding guide). None of
      it changes the result beyond floating-point rounding.

    **Returns:**

    A [`FitResult`][eqx_ensemble.FitResult]. Errors raised after training
    started (every member diverged, a checkpoint could not be written, a stream
    ended early) carry the run so far as `error.result`.

    **Randomness (exact and documented, so runs are reproducible):**
    `data_key, bootstrap_key, train_key = jax.random.split(key, 3)`. Steps
    count from 1 everywhere (the logs, `FitResult.diverged`, checkpoints); at
    step `s + 1` (`s` steps done before it) member `i`'s `loss_fn` gets key
    `jax.random.split(jax.random.fold_in(train_key, s), len(ens))[i]`. Batches
    of array data are drawn from `data_key` (and `bootstrap_key`) as each
    sampling documents. Evaluations use `jax.random.fold_in(key, 3)`. An
    optimizer that takes extra arguments (`optax.GradientTransformationExtraArgs`,
    e.g. the samplers of [`ee.sgmcmc`][eqx_ensemble.sgmcmc]) gets member `i`'s
    loss key folded with `0x6F707478` as `update(..., key=)`, and its loss at
    that step as `value=` (`optax.contrib.reduce_on_plateau`,
    `optax.polyak_sgd`; a trained shared part: the sum of the members' losses;
    an [`ee.Coupled`][eqx_ensemble.Coupled] loss: its total, for every member).

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
