"""`fit`: the training loop, an orchestrator of small components.

`fit` checks its arguments, builds the first `TrainState` (or resumes one from
`Checkpoints`), and then alternates: one compiled dispatch of up to
`steps_per_dispatch` steps (`_loop.run_chunk`), then, on the host, the history,
the progress bar, the divergence report, controllers, checkpoints and the
callback. Everything a run can be asked to do is a component: the sampling
(`_sampling`), the evaluation (`_evaluate`), trackers (`_track`), controllers
(`_control`), checkpoints (`_fit_checkpoints`) and streamed data (`_stream`).
"""

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import optax
from jax.sharding import Mesh
from jaxtyping import PRNGKeyArray, PyTree

from .._checkpoints.component import Checkpoints
from .._controllers.base import Controller
from .._core.sharding import within_mesh
from .._trackers.base import Tracker
from .evaluate import Evaluate
from .result import EnsembleDivergedError, FitResult
from .run import prepare
from .sampling import Sampling, Shared


@within_mesh
def fit(
    ens: Any,
    loss_fn: Callable[..., Any],
    optimizer: optax.GradientTransformation,
    data: Any,
    *,
    steps: int,
    key: PRNGKeyArray,
    batch_size: int | None = None,
    sampling: Sampling | str = Shared(),
    opt_state: PyTree[Any] = None,
    state: PyTree[Any] = None,
    hyperparams: dict[str, Any] | None = None,
    hyper: PyTree[Any] = None,
    evaluate: Evaluate | None = None,
    checkpoints: Checkpoints | None = None,
    track: Sequence[Tracker] = (),
    controllers: Sequence[Controller] = (),
    callback: Callable[[FitResult], Any] | None = None,
    progress: bool = True,
    mesh: Mesh | None = None,
    steps_per_dispatch: int | None = None,
    compiler_options: dict[str, Any] | None = None,
    unroll: bool | None = None,
    layout: str | None = None,
) -> FitResult:
    """Train every member of an ensemble: the loop users call.

    Array data is sampled inside compiled code, a stream's batches are grouped on
    the host, and `steps_per_dispatch` steps run in one dispatch with
    `jax.lax.scan`, so the Python overhead is paid once per dispatch, not once
    per step or per member. Everything else is a component: evaluation
    ([`ee.Evaluate`][eqx_ensemble.Evaluate]), checkpoints and resume
    ([`ee.Checkpoints`][eqx_ensemble.Checkpoints]), weight-trajectory trackers
    ([`ee.EMA`][eqx_ensemble.EMA], ...) and controllers
    ([`ee.Controller`][eqx_ensemble.Controller]).

    **Arguments:**

    - `ens`: the ensemble to train.
    - `loss_fn`: the loss of ONE model, `loss_fn(model, batch, key) -> loss` or
      `(loss, aux)`; with a model `state`: `loss_fn(model, state, batch, key) ->
      (loss, new_state)` or `(loss, new_state, aux)`.
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
      [`init_optimizer`][eqx_ensemble.init_optimizer]).
    - `state`: the stacked model state for models with `eqx.nn.State`.
    - `hyperparams`: per-member hyperparameters for an optimizer built with
      `optax.inject_hyperparams`, name -> array of shape `(len(ens),)`.
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
    - `controllers`: [`ee.Controller`][eqx_ensemble.Controller]s run between
      dispatches, every `controller.every` steps.
    - `callback`: called after every dispatch (and after its checkpoint) with
      the current `FitResult`.
    - `progress`: show a tqdm progress bar with the step and the mean/min/max
      member loss.
    - `mesh`: a device mesh from [`ee.make_mesh`][eqx_ensemble.make_mesh]: the
      member axis of the ensemble and its states is split over `"members"`, each
      step's batch over `"data"`; results equal the single-device run's. See the
      sharding guide.
    - `steps_per_dispatch`: steps fused into one compiled call. `None`: 1000
      for tiny steps (under ~16 MFLOP of matmuls), else 100. Progress, callbacks,
      controllers and checkpoints run between dispatches.
    - `compiler_options`: XLA options for the compiled loop, passed to `jax.jit`
      (`None`: the library's choice, see the benchmarks page; `{}`: XLA's
      defaults).
    - `unroll`: run each dispatch's steps as straight-line code instead of a
      `lax.scan` loop. `None` (the default): unrolled on a CPU when the loss
      uses convolutions (XLA's CPU backend runs a convolution inside a loop in
      a slow layout: 17x slower on a small CNN), with 10 steps per dispatch
      (`max(1, 10 // members)` with the sequential `layout`, whose steps hold
      a copy of every member); the results are the same either way, to
      floating-point rounding. On a
      mesh the library does not look: pass `unroll=True` for a convolutional
      model on CPU devices.
    - `layout`: how each step computes the member axis, as in
      [`make_step`][eqx_ensemble.make_step]: `"vmap"` (vectorised),
      `"sequential"` (members one after another in the compiled step), or
      `None` (`"auto"`: sequential on one CPU device for a convolving loss and
      at most 16 members, where it is several times faster; vectorised
      otherwise). Coupled losses and a trained shared part are always
      vectorised. The results are the same either way, to rounding.

    **Returns:**

    A [`FitResult`][eqx_ensemble.FitResult]. Errors raised after training
    started (every member diverged, a checkpoint could not be written, a stream
    ended early) carry the run so far as `error.result`.

    **Randomness (exact and documented, so runs are reproducible):**
    `data_key, bootstrap_key, train_key = jax.random.split(key, 3)`. At step `s`
    (from 0) member `i`'s `loss_fn` gets key
    `jax.random.split(jax.random.fold_in(train_key, s), len(ens))[i]`. Batches
    of array data are drawn from `data_key` (and `bootstrap_key`) as each
    sampling documents. Evaluations use `jax.random.fold_in(key, 3)`.

    **Example:**

    ```python
    x = jnp.linspace(-1, 1, 64)[:, None]
    ens = ee.ensemble(lambda k: eqx.nn.MLP(1, 1, 16, 1, key=k), size=4,
                      key=jax.random.key(0))

    def loss_fn(model, batch, key):
        xb, yb = batch
        return jnp.mean((jax.vmap(model)(xb) - yb) ** 2)

    result = ee.fit(ens, loss_fn, optax.adam(1e-2), (x, x**2), steps=200,
                    batch_size=16, key=jax.random.key(1), progress=False)
    result.history.losses.shape     # (200, 4)
    ```
    """
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
        hyperparams=hyperparams,
        hyper=hyper,
        evaluate=evaluate,
        checkpoints=checkpoints,
        track=track,
        controllers=controllers,
        mesh=mesh,
        steps_per_dispatch=steps_per_dispatch,
        compiler_options=compiler_options,
        unroll=unroll,
        layout=layout,
    )
    bar = _progress_bar(run.steps, run.done, progress)
    try:
        group = run.read_group(run.done)
        while run.done < run.steps:
            if group is not None and group[1] == 0:
                run.fail(ValueError, run.stream_ended_message())
            end = run.dispatch_end(run.done, group)
            outputs = run.dispatch(group, end)  # asynchronous: overlaps the next read
            group = run.read_group(end) if end < run.steps else None
            losses = run.record(outputs, end)
            if bar is not None:
                bar.update(losses.shape[0])
                bar.set_postfix_str(_loss_summary(losses[-1], run.diverged_at()))
            if (run.diverged_at() >= 0).all():
                run.fail(EnsembleDivergedError, run.diverged_message())
            run.control()
            run.checkpoint()
            if callback is not None:
                callback(run.result(copy_state=True))
    finally:
        if bar is not None:
            bar.close()
    return run.result()


def _loss_summary(last_losses: np.ndarray, diverged_at: np.ndarray) -> str:
    healthy = last_losses[(diverged_at < 0) & np.isfinite(last_losses)]
    text = "diverged: all"
    if healthy.size:
        text = (
            f"loss mean={healthy.mean():.4g} min={healthy.min():.4g} "
            f"max={healthy.max():.4g}"
        )
    if (diverged_at >= 0).any():
        text += f" diverged={int((diverged_at >= 0).sum())}"
    return text


def _progress_bar(total: int, initial: int, enabled: bool):
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, desc="fit", unit="step", leave=True)
