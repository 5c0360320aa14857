"""A `fit` run in progress, on the host: checks, set-up, and the work between
dispatches (history, controllers, checkpoints, results)."""

import dataclasses
import hashlib
import os
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh
from jaxtyping import PRNGKeyArray, PyTree

from .._checkpoints.component import Checkpoints
from .._checkpoints.file import CheckpointError
from .._controllers.base import Controller
from .._core.data import check_leading, num_examples
from .._core.ensemble import Ensemble
from .._core.sharding import check_fit_mesh, on_mesh, place_state
from .._execution.compile import (
    default_steps_per_dispatch,
    platform_of,
    step_compiler_options,
)
from .._execution.execution import Execution
from .._execution.layout import choose_layout
from .._execution.profile import (
    StepProfile,
    example_structs,
    first_member,
    profile_step,
)
from .._internal.checks import check_positive_int
from .._internal.keys import check_key
from .._internal.tree import first_difference, keystr
from .._trackers.base import Tracker
from .evaluate import Evaluate, eval_key
from .history import Recorder
from .loop import Chunk, chunk_runner, copy, initial_state
from .loss import check_hyper, check_loss_signature, check_optimizer
from .optim import (
    check_opt_state,
    hyperparam_nodes,
    init_optimizer_fast,
)
from .progress import ProgressBar, ProgressMeter
from .result import EnsembleDivergedError, FitResult, key_record, make_result
from .sampling import MAX_INDICES, Bootstrap, as_sampling
from .stream import BatchGroups, check_data, example_count, is_array_data
from .train_state import TrainState


def _check_components(evaluate, checkpoints, track, controllers) -> tuple[tuple, tuple]:
    if evaluate is not None and not isinstance(evaluate, Evaluate):
        raise TypeError(
            f"`evaluate` must be an `ee.Evaluate(fn, data, every=...)`, got "
            f"{type(evaluate).__name__}"
        )
    if checkpoints is not None and not isinstance(checkpoints, Checkpoints):
        raise TypeError(
            "`checkpoints` must be an `ee.Checkpoints(directory, every=...)`, got "
            f"{type(checkpoints).__name__}"
        )
    for name, items, cls in (
        ("track", track, Tracker),
        ("controllers", controllers, Controller),
    ):
        if not isinstance(items, Sequence) or isinstance(items, str):
            raise TypeError(f"`{name}` must be a list, got {type(items).__name__}")
        for position, item in enumerate(items):
            if not isinstance(item, cls):
                raise TypeError(
                    f"`{name}[{position}]` must be an `ee.{cls.__name__}`, got "
                    f"{type(item).__name__}"
                )
    for position, controller in enumerate(controllers):
        check_positive_int(controller.every, f"controllers[{position}].every")
    return tuple(track), tuple(controllers)


def split_callbacks(
    callbacks: Sequence[Any] | None,
) -> tuple[tuple[ProgressMeter, ...], tuple[Controller, ...], tuple[Any, ...]]:
    """`fit`'s `callbacks` as (progress meters, controllers, plain functions),
    each in the order given (`None`: the default progress bar)."""
    if callbacks is None:
        return (ProgressBar(),), (), ()
    if not isinstance(callbacks, Sequence) or isinstance(callbacks, str):
        raise TypeError(
            "`callbacks` must be a list (progress meters, controllers, functions of "
            f"the `FitResult`), got {type(callbacks).__name__}"
        )
    meters, controllers, functions = [], [], []
    for position, item in enumerate(callbacks):
        if isinstance(item, ProgressMeter):
            meters.append(item)
        elif isinstance(item, Controller):
            controllers.append(item)
        elif callable(item) and not isinstance(item, eqx.Module | type):
            functions.append(item)
        else:
            raise TypeError(
                f"`callbacks[{position}]` must be an `ee.ProgressMeter`, an "
                "`ee.Controller` or a function of the `FitResult`, got "
                f"{type(item).__name__}"
            )
    return tuple(meters), tuple(controllers), tuple(functions)


def _check_batch_memory(data: PyTree[Any], batch_size: int, members: int) -> None:
    # A step's batch must fit in memory (and XLA's int32 dimensions) before it
    # reaches XLA, which aborts the process on an impossible shape.
    per_example = sum(
        leaf.nbytes // max(leaf.shape[0], 1)
        for leaf in jax.tree.leaves(data)
        if hasattr(leaf, "nbytes") and getattr(leaf, "ndim", 0) > 0
    )
    total = per_example * batch_size * members
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        memory = 2**63
    if total > memory or batch_size * members > MAX_INDICES:
        raise ValueError(
            f"A batch of {batch_size} examples for {members} member(s) needs "
            f"{total / 2**30:.1f} GiB, more than this machine's "
            f"{memory / 2**30:.1f} GiB; use a smaller `batch_size`"
        )


def prepare(
    ens: Any,
    loss_fn: Callable[..., Any],
    optimizer: optax.GradientTransformation,
    data: Any,
    *,
    steps: int,
    key: PRNGKeyArray,
    batch_size: int | None,
    sampling: Any,
    opt_state: PyTree[Any],
    state: PyTree[Any],
    hyper: PyTree[Any],
    evaluate: Evaluate | None,
    checkpoints: Checkpoints | None,
    track: Sequence[Tracker],
    callbacks: Sequence[Any] | None,
    execution: Execution,
) -> "Run":
    """Every check `fit` makes, in order, before any work; then the first state
    (or the resumed one) and the compiled loop's inputs."""
    if not isinstance(ens, Ensemble):
        raise TypeError(f"`fit` expects an `ee.Ensemble`, got {type(ens).__name__}")
    size = len(ens)
    check_optimizer(optimizer)
    steps = check_positive_int(steps, "steps")
    check_key(key)
    sampling = as_sampling(sampling)
    mesh = execution.mesh
    meters, controllers, functions = split_callbacks(callbacks)
    track, controllers = _check_components(evaluate, checkpoints, track, controllers)
    for tracker in track:
        tracker.check(steps)
    if state is not None:
        check_leading(state, size, "`state`")
    check_loss_signature(loss_fn, state is not None, hyper is not None)
    if hyper is not None:
        check_hyper(hyper, size)
    check_data(data)
    user_options = execution.compiler_options
    layout = execution.layout
    unroll = execution.unroll
    steps_per_dispatch = execution.steps_per_dispatch
    streamed = not is_array_data(data)
    n = None
    if not streamed:
        if batch_size is None:
            raise TypeError("`fit` on array data needs `batch_size`")
        batch_size = check_positive_int(batch_size, "batch_size")
        n = num_examples(data)
        sampling.check(n, batch_size, size)
        _check_batch_memory(data, batch_size, size if sampling.per_member else 1)
        if mesh is not None:
            mesh = check_fit_mesh(mesh, size, batch_size)
    elif isinstance(sampling, Bootstrap):
        raise ValueError(
            "`ee.Bootstrap()` resamples array data; a stream cannot be resampled. "
            "Pass the data as arrays, or bootstrap inside your data loader and "
            "stream per-member batches with `sampling=ee.Independent()`"
        )
    given_opt_state = opt_state is not None
    if opt_state is None:
        opt_state = init_optimizer_fast(optimizer, ens)
    else:
        check_opt_state(optimizer, ens, opt_state)

    run_record = {
        "size": size,
        "batch_size": batch_size,
        "sampling": sampling.name if hasattr(sampling, "name") else repr(sampling),
        "num_examples": n,
        "key": key_record(key),
        "eval_every": None if evaluate is None else evaluate.every,
        "track": [repr(tracker) for tracker in track],
        # The hyperparameters the run STARTED with (controllers such as `ee.PBT`
        # change them as it goes): a resume must start from the same ones.
        # (`None` when not given: a resume may leave them out and continue with
        # the saved optimizer state.)
        "hyperparams": _start_record(
            [("", dict(node.hyperparams)) for _, node in hyperparam_nodes(opt_state)]
            if given_opt_state
            else []
        ),
        "hyper": _start_record([("", hyper)] if hyper is not None else []),
    }
    # Copied: the loop donates its state, and the caller's arrays stay valid.
    train_state = copy(
        initial_state(
            ens,
            opt_state,
            state,
            hyper=hyper,
            track=track,
            with_eval=evaluate is not None,
            controllers=controllers,
        )
    )
    history = None
    if checkpoints is not None:
        checkpoints.prepare()
        resumed = checkpoints.resume(train_state, run_record, steps)
        if resumed is not None:
            train_state, history = resumed
    done = int(train_state.step)

    stream = None
    if streamed:
        stream = BatchGroups(
            data, start=done, size=size, per_member=sampling.per_member
        )
        first = stream.peek()
        examples = example_count(
            jax.tree.map(lambda x: x[None], first), sampling.per_member
        )
        if batch_size is not None and batch_size != examples:
            raise ValueError(
                f"`batch_size={batch_size}` but the stream's batches hold {examples} "
                "examples; leave `batch_size` out for a stream"
            )
        batch_size = examples
        data = None
    assert batch_size is not None
    if streamed and mesh is not None:
        mesh = check_fit_mesh(mesh, size, batch_size)
    profile = _profile(
        ens, loss_fn, data, stream, batch_size, sampling, state, hyper, mesh
    )
    if unroll is None:
        unroll = profile.convolutions
    member_layout = choose_layout(
        layout, convolutions=profile.convolutions, size=size, mesh=mesh
    )
    if steps_per_dispatch is None:
        if not unroll:
            steps_per_dispatch = default_steps_per_dispatch(
                ens.members, batch_size, size, mesh
            )
        elif member_layout == "sequential":
            # Each step holds a copy of every member: bound the copies a
            # dispatch compiles (5 members: 2 steps, ~10 s to compile on 2 cores).
            steps_per_dispatch = max(1, UNROLLED_STEPS_PER_DISPATCH // size)
        else:
            steps_per_dispatch = UNROLLED_STEPS_PER_DISPATCH
    length = min(steps_per_dispatch, steps)

    data_key, bootstrap_key, train_key = jax.random.split(key, 3)
    prepared = None if streamed else sampling.prepare(bootstrap_key, size, n or 0)
    chunk = Chunk(
        loss_fn=loss_fn,
        optimizer=optimizer,
        sampling=sampling,
        evaluate=evaluate,
        track=track,
        data=data,
        prepared=prepared,
        batches=None,
        data_key=data_key,
        train_key=train_key,
        eval_key=eval_key(key),
        end=jnp.array(0, jnp.int32),
        size=size,
        batch_size=batch_size,
        num_examples=n or 0,
        length=length,
        mesh=mesh,
        unrolled=unroll,
        layout=member_layout,
    )
    options = step_compiler_options(
        user_options, ens.members, batch_size, size, mesh, profile.batched_dots
    )
    return Run(
        chunk=on_mesh(chunk, mesh),
        runner=chunk_runner(options),
        train_state=place_state(train_state, mesh),
        recorder=Recorder(size, history),
        steps=steps,
        stream=stream,
        checkpoints=checkpoints,
        controllers=controllers,
        track=track,
        run_record=run_record,
        info={"sampling": sampling, "key": key, "num_examples": n},
        meters=meters,
        functions=functions,
        resumed=history is not None,
    )


def _skips_conditional(chunk: Chunk) -> bool:
    """Whether a dispatch known to be full may run a program compiled without the
    per-step conditional. Not on a CPU: there the conditional costs nothing
    measurable, and one program for full and partial dispatches keeps a resumed
    run bitwise equal to an uninterrupted one (two programs may round one step
    differently, by an ulp). On a GPU a conditional waits for its predicate on the
    host (+20% of a small step on an H100)."""
    return platform_of(chunk.mesh) != "cpu"


# Unrolled dispatches compile every step they hold: keep them short.
UNROLLED_STEPS_PER_DISPATCH = 10


def _profile(
    ens: Ensemble,
    loss_fn: Callable[..., Any],
    data: Any,
    stream: BatchGroups | None,
    batch_size: int,
    sampling: Any,
    state: PyTree[Any],
    hyper: PyTree[Any],
    mesh: Mesh | None,
) -> StepProfile:
    """The step's profile on one CPU device (on other platforms nothing depends on
    it; on a mesh the loss is not traced outside the sharded step: pass
    `unroll=True` for a convolutional model on a mesh of CPU devices)."""
    if mesh is not None or jax.default_backend() != "cpu":
        return StepProfile()
    if stream is not None:
        first = stream.peek()
        batch = first_member(first) if sampling.per_member else first
    else:
        batch = example_structs(data, batch_size)
    return profile_step(
        loss_fn,
        ens.member(first_member(ens.members)),
        batch,
        first_member(state),
        first_member(hyper),
    )


def _start_record(trees: list[tuple[str, Any]]) -> dict[str, Any] | None:
    """JSON-comparable values of hyperparameter PyTrees (`None` if there are
    none): a list of numbers per leaf, or a digest for a leaf of over 256."""
    record: dict[str, Any] = {}
    for prefix, tree in trees:
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
            if not eqx.is_array(leaf):
                continue
            host = np.asarray(leaf)
            name = prefix + keystr(path)
            if host.size <= 256:
                record[name] = host.ravel().tolist()
            else:
                record[name] = hashlib.sha256(
                    host.tobytes() + str(host.dtype).encode()
                ).hexdigest()
    return record or None


@dataclasses.dataclass
class Run:
    """A run between dispatches."""

    chunk: Chunk
    runner: Callable[..., Any]
    train_state: TrainState
    recorder: Recorder
    steps: int
    stream: BatchGroups | None
    checkpoints: Checkpoints | None
    controllers: tuple[Controller, ...]
    track: tuple[Tracker, ...]
    run_record: dict[str, Any]
    info: dict[str, Any]
    meters: tuple[ProgressMeter, ...] = ()
    functions: tuple[Callable[[FitResult], Any], ...] = ()
    resumed: bool = False

    def run(self) -> FitResult:
        """Drive the run to its last step: one dispatch, then the host's work
        (history, progress, divergence, controllers, checkpoint, callbacks)."""
        handles = [
            meter.start(self.steps, self.done, self.resumed) for meter in self.meters
        ]
        try:
            group = self.read_group(self.done)
            while self.done < self.steps:
                if group is not None and group[1] == 0:
                    self.fail(ValueError, self.stream_ended_message())
                end = self.dispatch_end(self.done, group)
                outputs = self.dispatch(group, end)  # asynchronous: overlaps the read
                group = self.read_group(end) if end < self.steps else None
                losses = self.record(outputs, end)
                for meter, handle in zip(self.meters, handles, strict=True):
                    meter.update(handle, self.done, losses, self._diverged_at)
                if (self._diverged_at >= 0).all():
                    self.fail(EnsembleDivergedError, self.diverged_message())
                self.control()
                self.checkpoint()
                for function in self.functions:
                    function(self.result(copy_state=True))
        finally:
            for meter, handle in zip(self.meters, handles, strict=True):
                meter.close(handle)
        return self.result()

    def __post_init__(self):
        self.done = int(self.train_state.step)
        self._diverged_at = np.asarray(self.train_state.diverged_at)

    def dispatch_end(self, done: int, group: Any = None) -> int:
        """Where the dispatch starting at `done` ends: after `steps_per_dispatch`
        steps, at the next checkpoint or controller, or where a stream ends."""
        ends = [self.steps, done + self.chunk.length]
        if self.checkpoints is not None and self.checkpoints.every is not None:
            ends.append(self.checkpoints.boundary(done) or self.steps)
        ends += [(done // c.every + 1) * c.every for c in self.controllers]
        if self.chunk.unrolled and self.chunk.evaluate is not None:
            every = self.chunk.evaluate.every
            ends.append((done // every + 1) * every)
        if group is not None:
            ends.append(done + group[1])
        return min(ends)

    def read_group(self, start: int) -> tuple[Any, int] | None:
        """A stream's next group of batches (placed on the devices), or `None`."""
        if self.stream is None:
            return None
        count = self.dispatch_end(start) - start
        length = count if self.chunk.unrolled else self.chunk.length
        group, real = self.stream.next_group(count, length)
        if group is not None:
            group = on_mesh(jax.device_put(group), self.chunk.mesh)
        return group, real

    def dispatch(self, group: tuple[Any, int] | None, end: int) -> tuple[Any, Any]:
        chunk = dataclasses.replace(
            self.chunk,
            end=jnp.array(end, jnp.int32),
            batches=None if group is None else group[0],
            full=_skips_conditional(self.chunk)
            and end - self.done == self.chunk.length,
        )
        if chunk.unrolled:  # exactly the steps of this dispatch, no padding
            every = None if chunk.evaluate is None else chunk.evaluate.every
            chunk = dataclasses.replace(
                chunk,
                length=end - self.done,
                evaluate_last=every is not None and end % every == 0,
            )
        self.train_state, losses, scores = self.runner(chunk, self.train_state)
        return losses, scores

    def record(self, outputs: tuple[Any, Any], end: int) -> np.ndarray:
        """The dispatch's history; returns its `(steps, members)` losses."""
        active = end - self.done
        losses = np.asarray(outputs[0])[:active]
        scores = None
        if self.chunk.evaluate is not None:
            scores = np.asarray(outputs[1])[:active]
        every = None if self.chunk.evaluate is None else self.chunk.evaluate.every
        self.recorder.record(losses, scores, self.done, every)
        self.done = end
        self._diverged_at = np.asarray(self.train_state.diverged_at)
        return losses

    def diverged_at(self) -> np.ndarray:
        return self._diverged_at

    def control(self) -> None:
        """Run the controllers due at this step."""
        for position, controller in enumerate(self.controllers):
            if self.done % controller.every:
                continue
            states = list(self.train_state.controlled)
            new_state, states[position] = controller(
                self.train_state, states[position], self.recorder.history()
            )
            difference = first_difference(
                jax.tree.map(_spec, eqx.filter(self.train_state, eqx.is_array)),
                jax.tree.map(_spec, eqx.filter(new_state, eqx.is_array)),
            )
            if difference is not None:
                raise TypeError(
                    f"`controllers[{position}]` changed the structure, shapes or "
                    f"dtypes of the train state: {difference}"
                )
            self.train_state = dataclasses.replace(new_state, controlled=tuple(states))

    def checkpoint(self) -> None:
        if self.checkpoints is None or not self.checkpoints.due(self.done, self.steps):
            return
        try:
            self.checkpoints.save(
                self.train_state, self.recorder.history(), self.run_record
            )
        except (OSError, CheckpointError) as error:
            self.fail(
                CheckpointError,
                f"Writing the checkpoint of step {self.done} to "
                f"{self.checkpoints.directory} failed ({error}); the trained run is "
                "attached to this error as `error.result`",
            )

    def result(self, copy_state: bool = False) -> FitResult:
        state = copy(self.train_state) if copy_state else self.train_state
        return make_result(state, self.recorder.history(), self.track, self.info)

    def fail(self, cls: type[Exception], message: str) -> NoReturn:
        error: Any = cls(message)
        error.result = self.result()
        raise error

    def diverged_message(self) -> str:
        return (
            f"All {len(self._diverged_at)} members diverged (non-finite loss, "
            f"gradient or update) at steps {self._diverged_at.tolist()}; lower the "
            "learning rate or check the loss"
        )

    def stream_ended_message(self) -> str:
        return (
            f"The data stream ended after step {self.done}, before `steps="
            f"{self.steps}`; give `steps` at most the number of batches, or a "
            "stream that does not end. The run so far is `error.result`"
        )


def _spec(x: Any) -> str:
    return f"{x.dtype}{list(np.shape(x))}"
