"""`fit`: the training loop, several steps fused per dispatch with `lax.scan`."""

import dataclasses
import functools
import os
from collections.abc import Callable
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh
from jaxtyping import Array, Float, Int, PRNGKeyArray, PyTree

from ._checkpoint import load, load_manifest
from ._checkpoint_dir import latest_checkpoint, save_checkpoint
from ._checkpoint_file import CheckpointError
from ._chunk_plan import chunk_sampler
from ._data import (
    SAMPLINGS,
    bootstrap_resamples,
    check_leading,
    num_examples,
)
from ._ensemble import Ensemble, check_key
from ._optim import (
    check_hyperparams_kept,
    check_opt_state,
    init_optimizer_fast,
    set_hyperparams,
)
from ._sharding import (
    check_fit_mesh,
    constrain,
    gather_batch,
    on_mesh,
    place_state,
    replicate,
    within_mesh,
)
from ._step import vmapped_update
from ._xla import (
    Options,
    check_compiler_options,
    default_steps_per_dispatch,
    filter_jit,
    step_compiler_options,
)


class TrainState(eqx.Module):
    """Everything a run carries from step to step (and what a checkpoint holds).

    Internal to [`fit`][eqx_ensemble.fit]; users get a `FitResult`.
    """

    ensemble: Ensemble
    opt_state: PyTree[Any]
    model_state: PyTree[Any]
    step: Int[Array, ""]
    diverged_at: Int[Array, " members"]
    best_ensemble: Ensemble | None
    best_score: Float[Array, " members"] | None
    best_step: Int[Array, " members"] | None


@dataclasses.dataclass(frozen=True)
class History:
    """Per-member training history.

    - `losses`: `(steps, members)` training loss of every member at every step.
    - `eval_steps`: `(evaluations,)` the step count after which each evaluation ran.
    - `eval_scores`: `(evaluations, members)` each member's `eval_fn` score.

    **Example:**

    ```python
    ens = ee.ensemble(lambda k: eqx.nn.Linear(1, 1, key=k), size=2,
                      key=jax.random.key(0))
    x = jnp.linspace(0, 1, 8)[:, None]
    loss = lambda m, b, k: jnp.mean((jax.vmap(m)(b) - 2 * b) ** 2)
    history = ee.fit(ens, loss, optax.sgd(0.1), x, steps=5, batch_size=4,
                     key=jax.random.key(1), progress=False).history
    history.losses.shape        # (5, 2): one loss per step per member
    ```
    """

    losses: np.ndarray
    eval_steps: np.ndarray
    eval_scores: np.ndarray


@dataclasses.dataclass(frozen=True)
class FitResult:
    """What [`fit`][eqx_ensemble.fit] returns.

    - `ensemble`: the trained ensemble (after the last step).
    - `opt_state`: the stacked optimizer state.
    - `state`: the stacked model state (`eqx.nn.State`) or `None`.
    - `history`: a [`History`][eqx_ensemble.History] of per-member losses and scores.
    - `diverged`: `{member: step}` for members whose loss or gradient became
      non-finite; from that step on they were frozen (the others trained on).
    - `best_ensemble`: with `eval_fn`, each member at its best evaluation score
      (lowest), else `None`; `best_step` holds the step of each member's best.
    - `step`: the number of steps done.

    **Example:**

    ```python
    ens = ee.ensemble(lambda k: eqx.nn.Linear(1, 1, key=k), size=3,
                      key=jax.random.key(0))
    x = jnp.linspace(0, 1, 8)[:, None]
    loss = lambda m, b, k: jnp.mean((jax.vmap(m)(b) - 2 * b) ** 2)
    result = ee.fit(ens, loss, optax.sgd(0.1), x, steps=20, batch_size=4,
                    key=jax.random.key(1), progress=False)
    trained, history, diverged = result.ensemble, result.history, result.diverged
    assert result.step == 20 and diverged == {}
    ```
    """

    ensemble: Ensemble
    opt_state: PyTree[Any]
    state: PyTree[Any]
    history: History
    diverged: dict[int, int]
    best_ensemble: Ensemble | None
    best_step: np.ndarray | None
    step: int


class EnsembleDivergedError(FloatingPointError):
    """Raised by [`fit`][eqx_ensemble.fit] when every member has diverged
    (non-finite loss or gradient). While some members are healthy, `fit` keeps
    training them and reports the others in `FitResult.diverged` instead.

    **Example:**

    ```python
    ens = ee.ensemble(lambda k: eqx.nn.Linear(1, 1, key=k), size=2,
                      key=jax.random.key(0))
    x = jnp.linspace(0, 1, 8)[:, None]
    loss = lambda m, b, k: jnp.mean(jnp.log(-jnp.abs(jax.vmap(m)(b))))  # NaN
    try:
        ee.fit(ens, loss, optax.sgd(0.1), x, steps=5, batch_size=4,
               key=jax.random.key(1), progress=False)
    except ee.EnsembleDivergedError as error:
        print(error)
    ```
    """


class _Config(NamedTuple):
    loss_fn: Callable[..., Any]
    optimizer: optax.GradientTransformation
    eval_fn: Callable[..., Any] | None
    sampling: str
    batch_size: int
    num_examples: int
    size: int
    chunk: int
    eval_every: int
    stateful: bool
    mesh: Mesh | None = None


def _member_select(better: Any, new: PyTree[Any], old: PyTree[Any]) -> PyTree[Any]:
    # Per-member choice over stacked leaves: member i takes `new` where better[i].
    def pick(n, o):
        if not eqx.is_array(n):
            return n
        mask = better.reshape(better.shape + (1,) * (n.ndim - 1))
        return jnp.where(mask, n, o)

    return jax.tree.map(pick, new, old)


@functools.cache
def _chunk_runner(options: Options) -> Callable[..., Any]:
    """`_run_chunk` compiled with XLA `options` (one cached wrapper per set of
    options, so each keeps its own compilation cache)."""
    return filter_jit(_run_chunk, options, donate="all-except-first")


def _run_chunk(inputs: tuple, train_state: TrainState):
    config, data, eval_data, data_key, train_key, resamples, end = inputs
    dynamic, static = eqx.partition(train_state, eqx.is_array)
    update = vmapped_update(
        config.loss_fn,
        config.optimizer,
        per_member_batch=config.sampling != "shared",
        mesh=config.mesh,
    )
    nan_row = constrain(
        jnp.full((config.size,), jnp.nan, dtype=jnp.float32),
        config.mesh,
        ("members",),
    )

    def evaluate(ts: TrainState) -> Array:
        def scalar(score):
            if jnp.shape(score) != ():
                raise ValueError(
                    "`eval_fn` must return a scalar score for ONE model (the library "
                    f"vmaps over members), got shape {jnp.shape(score)}"
                )
            return score

        if config.stateful:
            scores = eqx.filter_vmap(
                lambda m, s: scalar(config.eval_fn(m, s, eval_data))  # type: ignore[misc]
            )(ts.ensemble.members, ts.model_state)
        else:
            scores = eqx.filter_vmap(
                lambda m: scalar(config.eval_fn(m, eval_data))  # type: ignore[misc]
            )(ts.ensemble.members)
        scores = jnp.asarray(scores, dtype=jnp.float32).reshape(config.size)
        return constrain(scores, config.mesh, ("members",))

    # The chunk's epoch permutations, computed once (same indices as
    # `batch_indices` at every step; see `_chunk_plan`).
    sample_indices = chunk_sampler(
        config.sampling,
        data_key,
        resamples,
        train_state.step,
        n=config.num_examples,
        batch_size=config.batch_size,
        size=config.size,
        chunk=config.chunk,
    )

    def active(ts: TrainState):
        step = ts.step
        indices = sample_indices(step)
        batch = gather_batch(data, indices, config.mesh)
        member_keys = jax.random.split(jax.random.fold_in(train_key, step), config.size)
        frozen = ts.diverged_at >= 0
        members, opt_state, losses, _, model_state, diverged = update(
            ts.ensemble.members,
            ts.opt_state,
            batch,
            member_keys,
            ts.model_state,
            frozen,
        )
        ts = dataclasses.replace(
            ts,
            ensemble=Ensemble(members),
            opt_state=opt_state,
            model_state=model_state,
            step=step + 1,
            diverged_at=jnp.where(diverged, step, ts.diverged_at),
        )
        scores = nan_row
        if config.eval_fn is not None:
            ts_dynamic, ts_static = eqx.partition(ts, eqx.is_array)
            scores = jax.lax.cond(
                (step + 1) % config.eval_every == 0,
                lambda d: evaluate(eqx.combine(d, ts_static)),
                lambda _: nan_row,
                ts_dynamic,
            )
            assert ts.best_score is not None and ts.best_step is not None
            better = scores < ts.best_score
            ts = dataclasses.replace(
                ts,
                best_ensemble=_member_select(
                    constrain(better, config.mesh, ("members",)),
                    ts.ensemble,
                    ts.best_ensemble,
                ),
                best_score=jnp.where(better, scores, ts.best_score),
                best_step=jnp.where(better, step + 1, ts.best_step),
            )
        # Per-member outputs stay split over the members inside the loop (no
        # collective per step); they are replicated once, after the loop.
        losses = constrain(
            jnp.asarray(losses, dtype=jnp.float32), config.mesh, ("members",)
        )
        scores = constrain(scores, config.mesh, ("members",))
        ts = place_state(ts, config.mesh, inside_jit=True, in_loop=True)
        return eqx.filter(ts, eqx.is_array), (losses, scores)

    def inactive(ts: TrainState):
        return eqx.filter(ts, eqx.is_array), (nan_row, nan_row)

    def body(carry, _):
        return jax.lax.cond(
            carry.step < end,
            lambda d: active(eqx.combine(d, static)),
            lambda d: inactive(eqx.combine(d, static)),
            carry,
        )

    dynamic = place_state(dynamic, config.mesh, inside_jit=True, in_loop=True)
    dynamic, (losses, scores) = jax.lax.scan(body, dynamic, None, length=config.chunk)
    dynamic = place_state(dynamic, config.mesh, inside_jit=True)
    losses, scores = replicate((losses, scores), config.mesh)
    return eqx.combine(dynamic, static), losses, scores


@eqx.filter_jit
def _compiled_copy(tree: PyTree[Any]) -> PyTree[Any]:
    return jax.tree.map(lambda x: jnp.copy(x) if eqx.is_array(x) else x, tree)


def _copy(tree: PyTree[Any]) -> PyTree[Any]:
    """A copy of every array leaf of `tree`, in one compiled call where the leaves
    share their devices (one dispatch per leaf otherwise)."""
    try:
        return _compiled_copy(tree)
    except ValueError:  # leaves committed to different devices
        return jax.tree.map(
            lambda x: jnp.array(x, copy=True) if eqx.is_array(x) else x, tree
        )


def _check_positive_int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(f"`{name}` must be an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"`{name}` must be at least 1, got {value}")
    return int(value)


@within_mesh
def fit(
    ens: Ensemble,
    loss_fn: Callable[..., Any],
    optimizer: optax.GradientTransformation,
    data: PyTree[Any],
    *,
    steps: int,
    batch_size: int,
    key: PRNGKeyArray,
    sampling: str = "shared",
    opt_state: PyTree[Any] = None,
    state: PyTree[Any] = None,
    hyperparams: dict[str, Any] | None = None,
    steps_per_dispatch: int | None = None,
    eval_fn: Callable[..., Any] | None = None,
    eval_data: PyTree[Any] = None,
    eval_every: int | None = None,
    checkpoint_dir: str | os.PathLike[str] | None = None,
    checkpoint_every: int | None = None,
    keep_checkpoints: int | None = 3,
    callback: Callable[[FitResult], Any] | None = None,
    progress: bool = True,
    mesh: Mesh | None = None,
    compiler_options: dict[str, Any] | None = None,
) -> FitResult:
    """Train every member of an ensemble: the loop users call.

    Minibatches are sampled inside compiled code and `steps_per_dispatch` steps are
    fused into one dispatch with `jax.lax.scan`, so the Python overhead is paid once
    per dispatch, not once per step or per member.

    **Arguments:**

    - `ens`: the ensemble to train.
    - `loss_fn`: the loss of ONE model, `loss_fn(model, batch, key) -> loss` or
      `(loss, aux)`; with a model `state`: `loss_fn(model, state, batch, key) ->
      (loss, new_state)` or `(loss, new_state, aux)`. `batch` has the structure of
      `data` with `batch_size` examples.
    - `optimizer`: an `optax.GradientTransformation`, applied per member.
    - `data`: a PyTree of arrays sharing a leading example axis, e.g. `(x, y)`.
    - `steps`: the number of optimisation steps (in total, counting resumed ones).
    - `batch_size`: examples per step (per member).
    - `key`: ONE PRNG key; everything random derives from it (see below).
    - `sampling`: `"shared"`: all members see the same minibatch; `"independent"`:
      each member shuffles the data on its own; `"bootstrap"`: each member trains
      on its own bootstrap resample of the data (bagging).
    - `opt_state`: a stacked optimizer state to continue from (default: fresh
      [`init_optimizer`][eqx_ensemble.init_optimizer]).
    - `state`: the stacked model state for models with `eqx.nn.State`.
    - `hyperparams`: per-member hyperparameters for an optimizer built with
      `optax.inject_hyperparams`, name -> array of shape `(len(ens),)`.
    - `steps_per_dispatch`: steps fused into one compiled call. `None` (the
      default): 1000 for tiny steps (under ~16 MFLOP of matmuls, where the ~1 ms
      that each dispatch costs in Python, sampling set-up and synchronisation
      would show), else 100. The progress bar, `callback` and checkpoints run
      between dispatches.
    - `eval_fn`: optional `eval_fn(model, eval_data) -> scalar` (lower is better;
      `eval_fn(model, state, eval_data)` with a model state), run every
      `eval_every` steps inside the compiled loop. Each member's best parameters
      are kept in `FitResult.best_ensemble`.
    - `checkpoint_dir`: a folder for checkpoints. Every `checkpoint_every` steps
      (and at the end) the ensemble, optimizer state, model state, step count,
      divergence record, best members and history are saved atomically with
      [`ee.save_checkpoint`][eqx_ensemble.save_checkpoint], keeping the last
      `keep_checkpoints`. If the folder already holds a checkpoint, `fit`
      **resumes** from the newest one and continues exactly as the uninterrupted
      run would (same parameters, same random stream); the other arguments must
      describe the same run (same `key`, `batch_size`, `sampling`, ensemble size).
    - `checkpoint_every`: checkpoint period in steps (default: at the end only).
    - `keep_checkpoints`: how many checkpoints to keep (`None`: all).
    - `callback`: called after every dispatch (and after its checkpoint, if any)
      with the current `FitResult`.
    - `progress`: show a tqdm progress bar with the step and the mean/min/max
      member loss.
    - `mesh`: a device mesh from [`ee.make_mesh`][eqx_ensemble.make_mesh] to train
      on several devices (or processes): the member axis of the ensemble and its
      states is split over the mesh axis `"members"`, each step's batch over
      `"data"`, and the shardings are kept through the compiled loop (the results
      carry them). `data` is used as placed when it is already on the mesh (e.g.
      `ee.shard(data, mesh, axes="data")`), else replicated. The results equal
      the single-device run's. See the sharding guide.
    - `compiler_options`: XLA options for the compiled loop, passed to `jax.jit`.
      `None` (the default) lets the library choose: on a multi-core CPU, a step of
      at least ~16 MFLOP of matmuls is compiled with
      `{"xla_cpu_experimental_ynn_fusion_type": ""}` so that its batched matmuls
      run on every core (1.1 to 1.25x faster; see the benchmarks page), anything
      else with XLA's defaults. `{}` forces XLA's defaults. Results agree with the
      default compilation to floating-point rounding, not bit for bit.

    **Returns:**

    A [`FitResult`][eqx_ensemble.FitResult].

    **Randomness (exact and documented, so runs are reproducible):**
    `data_key, bootstrap_key, train_key = jax.random.split(key, 3)`. At step `s`
    (from 0) member `i`'s `loss_fn` gets key
    `jax.random.split(jax.random.fold_in(train_key, s), len(ens))[i]`. Batches:
    `"shared"` uses epochs of `E = n // batch_size` steps; step `s` takes slice
    `s % E` (of `batch_size` indices) of
    `jax.random.permutation(jax.random.fold_in(data_key, s // E), n)`.
    `"independent"` does the same per member with data key
    `jax.random.split(data_key, len(ens))[i]`. `"bootstrap"`: member `i`'s resample
    is `jax.random.randint(split(bootstrap_key, len(ens))[i], (n,), 0, n)` and step
    `s` draws positions `jax.random.randint(fold_in(data_key, s),
    (len(ens), batch_size), 0, n)` into it.

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
    if not isinstance(ens, Ensemble):
        raise TypeError(f"`fit` expects an `ee.Ensemble`, got {type(ens).__name__}")
    size = len(ens)
    steps = _check_positive_int(steps, "steps")
    batch_size = _check_positive_int(batch_size, "batch_size")
    if mesh is not None:
        mesh = check_fit_mesh(mesh, size, batch_size)
    user_options = check_compiler_options(compiler_options)
    if steps_per_dispatch is None:
        steps_per_dispatch = default_steps_per_dispatch(
            ens.members, batch_size, size, mesh
        )
    chunk = _check_positive_int(steps_per_dispatch, "steps_per_dispatch")
    check_key(key)
    if sampling not in SAMPLINGS:
        raise ValueError(f"`sampling` must be one of {SAMPLINGS}, got {sampling!r}")
    n = num_examples(data)
    if sampling != "bootstrap" and batch_size > n:
        raise ValueError(
            f"`batch_size` ({batch_size}) is larger than the data ({n} examples); "
            "use a smaller batch or `sampling='bootstrap'` (sampling with "
            "replacement)"
        )
    if eval_fn is None and (eval_data is not None or eval_every is not None):
        raise ValueError("`eval_data`/`eval_every` need an `eval_fn`")
    if eval_fn is not None:
        if eval_every is None:
            raise ValueError("`eval_fn` needs `eval_every` (evaluate every N steps)")
        eval_every = _check_positive_int(eval_every, "eval_every")
    if checkpoint_dir is None and checkpoint_every is not None:
        raise ValueError("`checkpoint_every` needs a `checkpoint_dir`")
    if checkpoint_every is not None:
        checkpoint_every = _check_positive_int(checkpoint_every, "checkpoint_every")
    if keep_checkpoints is not None:
        keep_checkpoints = _check_positive_int(keep_checkpoints, "keep_checkpoints")
    if opt_state is None:
        opt_state = init_optimizer_fast(optimizer, ens)
    else:
        check_opt_state(optimizer, ens.members, opt_state)
    if hyperparams:
        opt_state = set_hyperparams(opt_state, hyperparams, size)
        check_hyperparams_kept(optimizer, ens.members, opt_state, hyperparams)
    stateful = state is not None
    if stateful:
        check_leading(state, size, "`state`")

    data_key, bootstrap_key, train_key = jax.random.split(key, 3)
    resamples = (
        bootstrap_resamples(bootstrap_key, size, n) if sampling == "bootstrap" else None
    )
    config = _Config(
        loss_fn=loss_fn,
        optimizer=optimizer,
        eval_fn=eval_fn,
        sampling=sampling,
        batch_size=batch_size,
        num_examples=n,
        size=size,
        chunk=min(chunk, steps),
        eval_every=eval_every or 1,
        stateful=stateful,
        mesh=mesh,
    )
    # The loop donates its state to each dispatch: copy so the caller's arrays stay
    # valid.
    with_eval = eval_fn is not None
    train_state = TrainState(
        ensemble=_copy(ens),
        # Always copied: even a state made here holds the caller's arrays when
        # `hyperparams` are given (set_hyperparams keeps them as they are).
        opt_state=_copy(opt_state),
        model_state=_copy(state),
        step=jnp.array(0, dtype=jnp.int32),
        diverged_at=jnp.full((size,), -1, dtype=jnp.int32),
        best_ensemble=_copy(ens) if with_eval else None,
        best_score=jnp.full((size,), jnp.inf, jnp.float32) if with_eval else None,
        best_step=jnp.zeros((size,), jnp.int32) if with_eval else None,
    )
    losses_seen: list[np.ndarray] = []
    eval_steps: list[int] = []
    eval_scores: list[np.ndarray] = []
    run_record = {
        "size": size,
        "batch_size": batch_size,
        "sampling": sampling,
        "num_examples": n,
        "key": np.asarray(jax.random.key_data(key)).ravel().tolist()
        if jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
        else np.asarray(key).ravel().tolist(),
    }
    if checkpoint_dir is not None:
        resumed = _resume(checkpoint_dir, train_state, run_record)
        if resumed is not None:
            train_state, losses, resumed_eval_steps, resumed_eval_scores = resumed
            losses_seen.append(losses)
            eval_steps.extend(int(s) for s in resumed_eval_steps)
            eval_scores.extend(resumed_eval_scores)
    train_state = place_state(train_state, mesh)
    run_chunk = _chunk_runner(
        step_compiler_options(user_options, ens.members, batch_size, size, mesh)
    )
    data, eval_data, data_key, train_key, resamples = on_mesh(
        (data, eval_data, data_key, train_key, resamples), mesh
    )
    done = int(train_state.step)

    bar = _progress_bar(steps, done, progress)
    try:
        while done < steps:
            end = min(steps, done + config.chunk)
            if checkpoint_every is not None:
                end = min(end, (done // checkpoint_every + 1) * checkpoint_every)
            inputs = (
                config,
                data,
                eval_data,
                data_key,
                train_key,
                resamples,
                jnp.array(end, dtype=jnp.int32),
            )
            train_state, chunk_losses, chunk_scores = run_chunk(
                on_mesh(inputs, mesh), train_state
            )
            active = end - done
            chunk_losses = np.asarray(chunk_losses)[:active]
            losses_seen.append(chunk_losses)
            if with_eval:
                chunk_scores = np.asarray(chunk_scores)[:active]
                for offset in range(active):
                    if (done + offset + 1) % config.eval_every == 0:
                        eval_steps.append(done + offset + 1)
                        eval_scores.append(chunk_scores[offset])
            done = end
            diverged_at = np.asarray(train_state.diverged_at)
            if bar is not None:
                bar.update(active)
                bar.set_postfix_str(_loss_summary(chunk_losses[-1], diverged_at))
            if (diverged_at >= 0).all():
                raise EnsembleDivergedError(
                    f"All {size} members diverged (non-finite loss or gradient) at "
                    f"steps {diverged_at.tolist()}; lower the learning rate or check "
                    "the loss"
                )
            if checkpoint_dir is not None and (
                done == steps
                or (checkpoint_every is not None and done % checkpoint_every == 0)
            ):
                _save(
                    checkpoint_dir,
                    train_state,
                    losses_seen,
                    eval_steps,
                    eval_scores,
                    size,
                    run_record,
                    keep_checkpoints,
                )
            if callback is not None:
                # The next dispatch donates `train_state`'s buffers: give the
                # callback a copy it may keep.
                callback(
                    _result(
                        _copy(train_state), losses_seen, eval_steps, eval_scores, size
                    )
                )
    finally:
        if bar is not None:
            bar.close()
    return _result(train_state, losses_seen, eval_steps, eval_scores, size)


def _history_arrays(
    losses_seen: list[np.ndarray],
    eval_steps: list[int],
    eval_scores: list[np.ndarray],
    size: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    losses = (
        np.concatenate(losses_seen).astype(np.float32)
        if losses_seen
        else np.zeros((0, size), dtype=np.float32)
    )
    scores = (
        np.stack(eval_scores).astype(np.float32)
        if eval_scores
        else np.zeros((0, size), dtype=np.float32)
    )
    return losses, np.asarray(eval_steps, dtype=np.int64), scores


def _save(
    directory: str | os.PathLike[str],
    train_state: TrainState,
    losses_seen: list[np.ndarray],
    eval_steps: list[int],
    eval_scores: list[np.ndarray],
    size: int,
    run_record: dict[str, Any],
    keep: int | None,
) -> None:
    losses, steps, scores = _history_arrays(losses_seen, eval_steps, eval_scores, size)
    step = int(train_state.step)
    save_checkpoint(
        directory,
        step,
        {
            "train_state": train_state,
            "losses": losses,
            "eval_steps": steps,
            "eval_scores": scores,
        },
        metadata={
            "kind": "eqx_ensemble.fit",
            "step": step,
            "num_evaluations": int(steps.shape[0]),
            "run": run_record,
        },
        keep=keep,
    )


def _resume(
    directory: str | os.PathLike[str],
    train_state: TrainState,
    run_record: dict[str, Any],
) -> tuple[TrainState, np.ndarray, np.ndarray, list[np.ndarray]] | None:
    path = latest_checkpoint(directory)
    if path is None:
        return None
    metadata = load_manifest(path).get("metadata", {})
    if metadata.get("kind") != "eqx_ensemble.fit":
        raise CheckpointError(
            f"{path} was not written by `ee.fit`; point `checkpoint_dir` at a folder "
            "of fit checkpoints (or an empty one)"
        )
    saved_run = metadata["run"]
    for field, value in run_record.items():
        if saved_run.get(field) != value:
            shown = "PRNG key" if field == "key" else f"`{field}`"
            raise CheckpointError(
                f"Cannot resume from {path}: it was written by a run with a different "
                f"{shown} ({saved_run.get(field)!r} there, {value!r} now); exact "
                "resume needs the same run. Use another `checkpoint_dir` for a new run."
            )
    size = run_record["size"]
    step = int(metadata["step"])
    evaluations = int(metadata["num_evaluations"])
    like = {
        "train_state": train_state,
        "losses": np.zeros((step, size), np.float32),
        "eval_steps": np.zeros((evaluations,), np.int64),
        "eval_scores": np.zeros((evaluations, size), np.float32),
    }
    restored = load(path, like)
    return (
        restored["train_state"],
        np.asarray(restored["losses"]),
        np.asarray(restored["eval_steps"]),
        list(np.asarray(restored["eval_scores"])),
    )


def _result(
    train_state: TrainState,
    losses_seen: list[np.ndarray],
    eval_steps: list[int],
    eval_scores: list[np.ndarray],
    size: int,
) -> FitResult:
    diverged_at = np.asarray(train_state.diverged_at)
    losses, steps, scores = _history_arrays(losses_seen, eval_steps, eval_scores, size)
    history = History(losses=losses, eval_steps=steps, eval_scores=scores)
    return FitResult(
        ensemble=train_state.ensemble,
        opt_state=train_state.opt_state,
        state=train_state.model_state,
        history=history,
        diverged={
            int(member): int(step)
            for member, step in enumerate(diverged_at)
            if step >= 0
        },
        best_ensemble=train_state.best_ensemble,
        best_step=(
            None if train_state.best_step is None else np.asarray(train_state.best_step)
        ),
        step=int(train_state.step),
    )


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
