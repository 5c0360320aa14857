"""A `fit` run in progress, on the host: checks, set-up, and the work between
dispatches (history, controllers, checkpoints, results)."""

import dataclasses
from collections.abc import Hashable, Sequence
from typing import Any, NoReturn

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh
from jaxtyping import PRNGKeyArray, PyTree

from .._core.ensemble import Ensemble
from .._core.heterogeneous import Heterogeneous, groups_of, is_heterogeneous
from .._execution.compile import (
    Options,
    platform_of,
)
from .._execution.execution import Execution
from .._execution.intern import canonical_tree
from .._execution.layout import (
    check_member_chunk,
)
from .._execution.placement import check_fit_mesh, members_devices
from .._execution.plan import Plan, owner_table, plan_step
from .._execution.profile import signature
from .._internal.checks import MAX_INT32, check_positive_int
from .._internal.tree import first_difference, with_fields
from .callback import Callback, RunSetup, RunView, as_callbacks, stateful
from .coupled import Coupled
from .evaluate import Evaluate
from .history import Recorder
from .inputs import (
    check_callbacks,
    check_chunkable,
    check_components,
    check_inputs,
    independent_members,
)
from .loggers import LogEntry, RunInfo
from .loop import (
    NOT_FINITE,
    Chunk,
    Readout,
    copy,
    dispatch_chunk,
    unpack_readout,
)
from .loss import (
    LossFn,
    check_optimizer,
)
from .optim import (
    hides_non_finite,
    member_hparams,
    schedule_problem,
)
from .placement import model_placement, on_mesh, place_state, restore_placement
from .record import (
    RunRecord,
    hyperparams_record,
    key_record,
    optimizer_record,
    start_record,
)
from .result import EnsembleDivergedError, FitResult, make_result
from .sampling import Sampling, as_sampling
from .source import ArraySource, Batches, DataSource, StreamSource
from .step import ensemble_profile
from .stream import check_data, is_source
from .tracker import Tracker
from .train_state import FreshStart, TrainState, reads_weights, start_state


def prepare(
    ens: Any, loss_fn: LossFn, optimizer: optax.GradientTransformation, data: Any,
    *, steps: int, key: PRNGKeyArray, batch_size: int | None, sampling: Any,
    opt_state: PyTree[Any], state: PyTree[Any], hyper: PyTree[Any],
    evaluate: Evaluate | None, checkpoints: Callback | None,
    track: Sequence[Tracker], callbacks: Sequence[Any], execution: Execution,
) -> "Run":  # fmt: skip
    """Every check `fit` makes, in order, before any work; then the start (or
    resumed) state, the data source, the plan and the compiled loop's inputs."""
    check_optimizer(optimizer)
    # Equal losses and optimizers are one program (`_execution.intern`).
    loss_fn, optimizer = canonical_tree(loss_fn), canonical_tree(optimizer)
    call = (ens, opt_state, state, hyper, key, data)
    settings = (optimizer, execution, sampling, steps, batch_size)
    known = fresh = None
    simple = hyper is None and evaluate is None and checkpoints is None
    if simple and _empty(track) and _empty(callbacks):
        known = _checked(loss_fn, settings, call)
    source: DataSource | None
    if known is not None:  # a call like one checked before: the same checks pass
        size, plan, fresh = known
        steps = check_positive_int(steps, "steps", high=MAX_INT32)  # (as an int)
        sampling = as_sampling(sampling)
        track, components = (), ()
        source = ArraySource(data, sampling, batch_size, size, checked=True)
    else:
        size = check_inputs(
            ens, loss_fn, optimizer, key, state=state, hyper=hyper,
            opt_state=opt_state, runner=execution, where="fit",
        )  # fmt: skip
        steps = check_positive_int(steps, "steps", high=MAX_INT32)
        sampling = check_sampling(loss_fn, as_sampling(sampling))
        track, components = _components(
            ens, size, steps, state, evaluate, checkpoints, track, callbacks
        )
        # Arrays are checked and planned now, before any work; a stream where
        # the run starts, below (its plan needs its first batch).
        source = (
            ArraySource(data, sampling, batch_size, size) if check_data(data) else None
        )
        plan = _plan(execution, loss_fn, ens, size, source, state, hyper, steps)
    started = None
    if isinstance(fresh, FreshStart):  # (a known call: of arrays, planned)
        assert source is not None and plan is not None
        if optimistic(
            execution.guard, source, plan.unroll, loss_fn, optimizer, ens,
            fresh.template.opt_state if opt_state is None else opt_state,
        ):  # fmt: skip
            started = fresh(ens, opt_state, state, key)  # (None: deleted since)
    fresh_started = started is not None
    if started is None:
        started = start_state(
            ens, optimizer, opt_state, state, hyper=hyper, track=track,
            with_eval=evaluate is not None, key=key, controlled=stateful(components),
        )  # fmt: skip
    train_state, keys = started
    mesh = execution.mesh
    record = None if checkpoints is None else run_record(
        ens, optimizer, opt_state, train_state, source, sampling, batch_size, key,
        evaluate, track, hyper,
    )  # fmt: skip
    train_state, history, saved_data = _resumed(
        checkpoints, train_state, record, steps, mesh, size
    )
    # A run not resumed starts at step 0 (`initial_state`): no host read, which
    # would wait for the start state's program before the dispatch is queued.
    done = 0 if history is None else int(train_state.step)
    if source is None:
        source = StreamSource(data, sampling, batch_size, size, done, saved_data)
        plan = _plan(execution, loss_fn, ens, size, source, state, hyper, steps)
    else:
        source.start(keys.data, keys.bootstrap, mesh)
    assert plan is not None
    train_state = place_state(train_state, mesh)
    chunk = Chunk(
        loss_fn=loss_fn, optimizer=optimizer, sampling=sampling, evaluate=evaluate,
        track=track, batches=source.batches() if source.kind == "arrays" else None,
        train_key=keys.train, eval_key=keys.eval, end=np.int32(0), size=size,
        length=plan.length, mesh=mesh, unrolled=plan.unroll, layout=plan.layout,
        check=plan.check, counted=plan.counted, member_chunk=plan.member_chunk,
        placement=model_placement(train_state, mesh),
    )  # fmt: skip
    run = Run(
        chunk=on_mesh(chunk, mesh), options=plan.compiler_options,
        train_state=train_state, recorder=Recorder(size, history), steps=steps,
        source=source, callbacks=components, track=track, record=record,
        sampling=sampling, key=key, guard=execution.guard,
        resumed_from=None if history is None else done,
    )  # fmt: skip
    if fresh_started:  # (its arrays are the caller's: never donated)
        assert run.optimistic, "internal error: a fresh start for a donating run"
    elif known is None:
        if simple and source.kind == "arrays" and not components:
            _remember(loss_fn, settings, call, (size, plan, None))
    elif fresh is not False:  # seen again (or its kept arrays deleted since)
        kept = _fresh_start(run, optimizer, opt_state, (ens, opt_state, state))
        _remember(loss_fn, settings, call, (size, plan, kept or False))
    return run


# What `prepare` found for a call of array data with no components (no
# trackers, evaluation, checkpoints or callbacks) nor `hyper` (whose values
# are checked): its checks read only the inputs' structure, types, shapes and
# dtypes and the call's settings, so a call that matches one checked before
# (`_call_key`) skips them and the plan's lookup, ~0.1 ms of a `fit` call in
# a loop. Kept with the loss's plans (`plan.owner_table`: held weakly, bounded,
# emptied with them); a key holds the optimizer, the settings and the inputs'
# non-array leaves (no arrays) for as long as its loss lives. A call seen a
# second time also keeps how it starts (`FreshStart`: a fresh optimizer
# state's arrays, not the weights), or `False` where it cannot; a sweep whose
# every call differs keeps no arrays.


def _call_key(settings: tuple[Any, ...], call: Any) -> Hashable:
    """`call`: `fit`'s inputs, `data` last. The settings (numbers with their
    types: `steps=True` is not `1`), the backend, the default device and x64
    mode, and every leaf of the inputs (a stream is one leaf): an array as
    its type, shape, dtype and (committed) sharding, anything else as itself
    (hashed where it is looked up: TypeError there where a part is
    unhashable)."""
    *inputs, data = call
    leaves, treedef = jax.tree.flatten(inputs)
    # (a stream is a leaf: not flattened, nor warned about, as an iterable)
    data_leaves, data_def = jax.tree.flatten(data, is_leaf=is_source)
    record = []
    for leaf in leaves + data_leaves:
        shape = getattr(leaf, "shape", None)
        if shape is None:
            record.append(leaf)
        else:  # (a committed array's device too: only calls of arrays
            # committed to no device start from kept ones, `FreshStart`)
            placed = leaf.sharding if getattr(leaf, "committed", False) else None
            record.append((type(leaf), shape, leaf.dtype, placed))
    return (
        "fit call",  # (apart from the plans' keys in the same table)
        *settings,
        *(type(value) for value in settings[-2:]),
        jax.default_backend(),
        # `jax.default_device`'s (a config value pyright's stubs do not list)
        jax.config.jax_default_device,  # pyright: ignore[reportAttributeAccessIssue]
        jax.dtypes.canonicalize_dtype(np.float64),  # x64 on or off
        treedef,
        data_def,
        tuple(record),
    )


def _fresh_start(
    run: "Run", optimizer: Any, opt_state: Any, inputs: Any
) -> FreshStart | None:
    """How a call like `run`'s starts without a start program (`FreshStart`),
    kept from `run`'s start state: where its dispatches donate nothing (the
    optimistic guard, no mesh), its `inputs` (the ensemble, optimizer and
    model states) are JAX arrays on no device of their own (so that the
    dispatch sees what the start program gave it: no other program), and a
    fresh optimizer state reads no weight."""
    if not run.optimistic or run.chunk.mesh is not None:
        return None
    for leaf in jax.tree.leaves(inputs):
        if eqx.is_array(leaf) and not (
            isinstance(leaf, jax.Array) and not leaf.committed
        ):
            return None
    if opt_state is None and reads_weights(optimizer, inputs[0]):
        return None
    return FreshStart.of(run.train_state, fresh_optimizer=opt_state is None)


def _empty(components: Any) -> bool:
    # (not `None` or `""`: refused by the checks, never skipped)
    return isinstance(components, list | tuple) and not components


def _checked(loss_fn: Any, settings: tuple[Any, ...], call: Any) -> Any:
    """`(size, plan)` of a call checked before with these settings and inputs,
    or `None`."""
    try:
        return owner_table(loss_fn).get(_call_key(settings, call))
    # An unhashable setting or leaf, a loss not weakly held, a leaf with a
    # shape and no dtype (a data frame): checked, and refused there.
    except (TypeError, AttributeError):
        return None


def _remember(
    loss_fn: Any,
    settings: tuple[Any, ...],
    call: Any,
    found: tuple[int, Plan, FreshStart | bool | None],
) -> None:
    try:
        table = owner_table(loss_fn)
        if len(table) > 64:  # (as the plans)
            table.clear()
        table[_call_key(settings, call)] = found
    except (TypeError, AttributeError):  # as in `_checked`
        return


def _plan(
    execution: Execution, loss_fn: LossFn, ens: Any, size: int,
    source: DataSource | None, state: Any, hyper: Any, steps: int,
) -> Plan | None:  # fmt: skip
    """The run's plan, once its source is known (the mesh checked against the
    members and the batch first)."""
    if source is None:
        return None
    if execution.mesh is not None:
        check_fit_mesh(execution.mesh, size, source.batch_size)
    return plan_fit(
        execution, loss_fn, ens, size, source, state, hyper, execution.mesh, steps
    )


def check_sampling(loss_fn: LossFn, sampling: Sampling) -> Sampling:
    """`sampling`, checked: a coupled loss that reads one batch for all members
    takes no per-member sampling."""
    if isinstance(loss_fn, Coupled) and loss_fn.shared_batch and sampling.per_member:
        raise ValueError(
            f"this coupled loss reads one batch for all members, but "
            f"`sampling={type(sampling).__name__}(...)` gives each member its own; "
            "use `sampling=ee.Shared()` (the default)"
        )
    return sampling


def _components(
    ens: Any,
    size: int,
    steps: int,
    state: PyTree[Any],
    evaluate: Evaluate | None,
    checkpoints: Callback | None,
    track: Sequence[Tracker],
    callbacks: Sequence[Any],
) -> tuple[tuple[Tracker, ...], tuple[Callback, ...]]:
    """The run's trackers and its host components in the order they run
    (`Callback.phase`), each checked: what a callback can check of the run (a
    logger's folder; that `ee.PBT` gets a fresh evaluation for every round)
    is refused before any work."""
    track = check_components(evaluate, checkpoints, track)
    check_callbacks(callbacks)
    components = as_callbacks(
        [*callbacks, *([] if checkpoints is None else [checkpoints])]
    )
    for tracker in track:
        tracker.check(steps)
    if components:
        every = None if evaluate is None else evaluate.every
        setup = RunSetup(steps, size, ens, every, components)
        for component in components:
            component.on_check(setup)
    if evaluate is not None:
        evaluate.check(state is not None)
    return track, components


def _resumed(
    checkpoints: Any,
    train_state: TrainState,
    record: RunRecord | None,
    steps: int,
    mesh: Mesh | None,
    size: int,
) -> tuple[TrainState, Any, Any]:
    """The newest checkpoint's `(train_state, history, data position)`, or the
    start state with no history (also without checkpoints)."""
    if checkpoints is None:
        return train_state, None, None
    checkpoints.prepare()
    template = train_state
    if mesh is not None and checkpoints.has_checkpoints():
        # Loaded straight onto the mesh: from a sharded checkpoint, each
        # process reads only the shards its devices hold.
        template = place_state(train_state, check_fit_mesh(mesh, size, 0))
    resumed = checkpoints.resume(template, record, steps)
    return (train_state, None, None) if resumed is None else resumed


def run_record(
    ens: Ensemble | Heterogeneous,
    optimizer: optax.GradientTransformation,
    opt_state: PyTree[Any],
    train_state: TrainState,
    source: DataSource | None,
    sampling: Sampling,
    batch_size: int | None,
    key: PRNGKeyArray,
    evaluate: Evaluate | None,
    track: tuple[Tracker, ...],
    hyper: PyTree[Any],
) -> RunRecord:
    """What identifies the run, for its checkpoints (`opt_state`: as given, or
    `None`)."""
    return RunRecord(
        size=len(ens),
        batch_size=batch_size if source is None else source.batch_size,
        sampling=sampling.record(),
        num_examples=None if source is None else source.num_examples,
        key=key_record(key),
        eval_every=None if evaluate is None else evaluate.every,
        track=[repr(tracker) for tracker in track],
        hyperparams=None
        if opt_state is None
        else hyperparams_record(
            opt_state, len(ens.groups) if is_heterogeneous(ens) else None
        ),
        hyper=start_record([("", hyper)] if hyper is not None else []),
        optimizer=optimizer_record(optimizer, train_state.opt_state),
    )


def plan_fit(
    execution: Execution,
    loss_fn: LossFn,
    ens: Ensemble | Heterogeneous,
    size: int,
    source: DataSource,
    state: PyTree[Any],
    hyper: PyTree[Any],
    mesh: Mesh | None,
    steps: int,
) -> Plan:
    """`execution`'s choices, with the library's where it leaves them open
    (`_execution.plan`), looked up per loss, execution, input structure, mesh
    and run length class."""
    if execution.member_chunk is not None:
        check_member_chunk(execution.member_chunk, size, members_devices(mesh))
        check_chunkable(loss_fn, ens)
    try:
        structure: Any = (
            signature((ens.members, state, hyper)),
            source.batch_signature(),
        )
    except TypeError:  # an unhashable leaf: planned every time
        structure = None
    return plan_step(
        execution,
        lambda: ensemble_profile(loss_fn, ens, source.member_batch(), state, hyper),
        owner=loss_fn,
        structure=structure,
        members=ens.members,
        examples=source.batch_size,
        size=size,
        mesh=mesh,
        steps=steps,
        pads_on_host=source.pads_on_host,
        groupable=independent_members(loss_fn, ens),
    )


def _skips_conditional(chunk: Chunk) -> bool:
    """Whether a dispatch known to be full may run a program compiled without the
    per-step conditional. Not on a CPU: there the conditional costs nothing
    measurable, and one program for full and partial dispatches keeps a resumed
    run bitwise equal to an uninterrupted one (two programs may round one step
    differently, by an ulp). On a GPU a conditional waits for its predicate on the
    host (a measurable share of a small step)."""
    return platform_of(chunk.mesh) != "cpu"


@dataclasses.dataclass
class Run:
    """A run between dispatches: it owns the train state and the history, and
    calls its host components (`Callback`: progress meters, controllers,
    loggers, checkpoints, functions) through their one protocol, in the
    order of their phase."""

    chunk: Chunk
    options: Options
    train_state: TrainState
    recorder: Recorder
    steps: int
    source: DataSource
    callbacks: tuple[Callback, ...]
    track: tuple[Tracker, ...]
    record: RunRecord | None
    sampling: Sampling
    key: PRNGKeyArray
    resumed_from: int | None = None
    guard: str = "auto"  # `Execution.guard`

    def __post_init__(self):
        if self.resumed_from is None:  # fresh: known without reading the state
            self.done = 0
            self._diverged_at = np.full((self.chunk.size,), -1, np.int32)
            self._stopped_at = np.full((self.chunk.size,), -1, np.int32)
        else:
            self.done = int(self.train_state.step)
            self._diverged_at = np.asarray(self.train_state.diverged_at)
            self._stopped_at = np.asarray(self.train_state.stopped_at)
        # Members stop only by a callback's change (or were stopped before a
        # resume): until then there is nothing to read.
        self._may_stop = self.resumed_from is not None
        self.losses = np.zeros((0, self.chunk.size), np.float32)  # last dispatch's
        self._stateful = stateful(self.callbacks)
        # Where the callbacks after `OBSERVE` begin: when every member diverged
        # only the observers and recorders see the dispatch.
        self._observers = sum(item.phase <= Callback.OBSERVE for item in self.callbacks)
        self._handles: list[Any] = []
        self._attached: set[int] = set()  # errors carrying this run
        self._phase: int | None = None  # of the callback being called
        self._info: RunInfo | None = None
        self._entry: tuple[int, LogEntry] | None = None
        # What the loggers were given so far (`log_entry`): a resumed run's
        # earlier events and evaluations were logged (a fresh run: nothing).
        self._logged: tuple[np.ndarray, int, list[int]] | None = None
        if self.resumed_from is not None:
            self._logged = (
                self._diverged_at.copy(),
                len(self.recorder.eval_steps),
                [
                    len(item.events(state))
                    for item, state in zip(
                        self._stateful, self.train_state.controlled, strict=True
                    )
                ],
            )
        self._hparams: bool | None = None  # whether the members have any
        # The optimistic guard (`dispatch`): on dispatches of array data that
        # are not unrolled (a part of one is the same program, or on a GPU
        # its variant with the per-step conditional), not where the
        # optimizer replaces non-finite gradients itself (the end-of-dispatch
        # check could not see them), nor where members share anything
        # trained (a trained shared part, a coupled loss: a frozen member
        # must drop out of those at every step).
        chunk, train_state = self.chunk, self.train_state
        self.optimistic = optimistic(
            self.guard, self.source, chunk.unrolled, chunk.loss_fn, chunk.optimizer,
            train_state.ensemble, train_state.opt_state,
        )  # fmt: skip
        if self.optimistic:
            self.chunk = dataclasses.replace(self.chunk, check="deferred")
        self._replay: tuple[Chunk, TrainState, np.ndarray] | None = None

    def run(self) -> FitResult:
        """Drive the run to its last step: one dispatch, then the host's work
        (history, then the callbacks in phase order). A failure to read the
        next batches comes after the dispatch that ran is recorded and
        checkpointed, and carries the run as `error.result`."""
        view = RunView(self)
        try:
            for item in self.callbacks:
                self._handles.append(self._call(item.on_start, view))
            finished = self.finished()  # a resumed run whose members all stopped
            group = (None, 0) if finished else self.read_group(self.done)
            while self.done < self.steps and not finished:
                if group[1] == 0:
                    self.fail(ValueError, self.stream_ended_message())
                end = self.dispatch_end(self.done, group[1])
                values = self.dispatch(group[0], end)  # asynchronous: overlaps
                read_error = None
                try:  # the next group, read while the dispatch runs
                    group = self.read_group(end) if end < self.steps else (None, 0)
                except Exception as error:  # noqa: BLE001 - raised below, with the run
                    read_error = error
                self.losses = self.record_dispatch(values, end)
                self.after_dispatch(view)
                finished = self.finished()
                if read_error is not None and not finished:
                    self._attach(read_error)
                    raise read_error
        except BaseException as error:
            # The run's own error wins: the callbacks end quietly, a note each
            # (a checkpoint being written ends; on one process it commits).
            self.end(error)
            raise
        self.end(None)
        return self.result()

    def end(self, error: BaseException | None) -> None:
        """Every started callback's `on_end`, in phase order (the checkpoint is
        committed before `REACT` callbacks end), with the error ending the run.
        After a clean run the first error an `on_end` raises becomes the
        run's: the callbacks after it end with it, and it is raised."""
        raised = None
        for item, handle in zip(self.callbacks, self._handles, strict=False):
            if error is None:
                try:
                    self._call(item.on_end, handle, None)
                except BaseException as failed:  # the others end with it
                    error = raised = failed
                continue
            try:
                item.on_end(handle, error)
            except Exception as other:  # noqa: BLE001 - reported as a note
                error.add_note(f"(ending {type(item).__name__} failed: {other!r})")
        if raised is not None:
            raise raised

    def after_dispatch(self, view: RunView) -> None:
        """The callbacks' work after a dispatch, in phase order; when every
        member diverged, only the observers and recorders, then the error."""
        pairs = list(zip(self.callbacks, self._handles, strict=True))
        for item, handle in pairs[: self._observers]:
            self._phase = item.phase
            self._call(item.on_dispatch, handle, view)
        if (self._diverged_at >= 0).all():
            for item, handle in pairs[self._observers :]:
                if item.phase == Callback.RECORD:
                    self._phase = item.phase
                    self._call(item.on_dispatch, handle, view)
            self.fail(EnsembleDivergedError, self.diverged_message())
        for item, handle in pairs[self._observers :]:
            self._phase = item.phase
            self._call(item.on_dispatch, handle, view)
        self._phase = None

    def _call(self, hook: Any, *args: Any) -> Any:
        """A callback's hook; its error carries the run as `error.result`."""
        try:
            return hook(*args)
        except Exception as error:
            if id(error) not in self._attached:  # (not one of this run's own)
                self._attach(error)
            raise

    def sync(self) -> None:
        """Every callback's `on_sync` (before the run is saved)."""
        for item, handle in zip(self.callbacks, self._handles, strict=True):
            item.on_sync(handle)

    def slot(self, callback: Callback) -> int:
        """`callback`'s place in `TrainState.controlled`."""
        for position, item in enumerate(self._stateful):
            if item is callback:
                return position
        raise ValueError(
            f"`{type(callback).__name__}` keeps no state in the run (a callback "
            "with `checkpointed = True`, in this run's `callbacks`, does)"
        )

    def update(self, callback: Callback, new_state: TrainState, own: Any) -> None:
        """A callback's new train state (values only) and its own state."""
        difference = first_difference(
            jax.tree.map(_spec, eqx.filter(self.state(), eqx.is_array)),
            jax.tree.map(_spec, eqx.filter(new_state, eqx.is_array)),
        )
        if difference is not None:
            self.fail(
                TypeError,
                f"The callback `{type(callback).__name__}` (in `callbacks`) changed "
                f"the structure, shapes or dtypes of the train state at step "
                f"{self.done}: {difference}. A callback may change values only; "
                "the run up to this step is `error.result`",
            )
        # Host-side edits (PBT's copies) may move leaves; put a "model"-split
        # state back where it was.
        new_state = restore_placement(new_state, self.chunk.placement)
        states = list(self.train_state.controlled)
        if callback.checkpointed:
            states[self.slot(callback)] = own
        self.train_state = dataclasses.replace(new_state, controlled=tuple(states))
        # A callback may stop members (or revive them).
        self._diverged_at = np.asarray(self.state().diverged_at)
        self._stopped_at = np.asarray(self.state().stopped_at)
        self._may_stop = True

    def run_info(self) -> RunInfo:
        """The run's description for loggers."""
        if self._info is None:
            start_hparams = member_hparams(self.state())
            self._hparams = bool(start_hparams)  # none at the start: none later
            self._info = RunInfo(
                steps=self.steps,
                size=len(self._diverged_at),
                start=self.done,
                resumed=self.resumed_from is not None,
                hparams={
                    "members": self.chunk.size,
                    "steps": self.steps,
                    "batch_size": self.source.batch_size,
                    "sampling": type(self.sampling).__name__,
                    "data": self.source.kind,
                    "resumed_from": self.resumed_from or 0,
                },  # fmt: skip
                member_hparams=start_hparams,
            )
        return self._info

    def log_entry(self) -> LogEntry:
        """The last dispatch's record for loggers: built once per dispatch,
        after the controllers ran (from the `RECORD` phase on)."""
        if self._phase is not None and self._phase < Callback.RECORD:
            raise RuntimeError(
                "`RunView.log_entry()` is the dispatch's record after the "
                "controllers ran: read it from a callback of phase `RECORD` or later"
            )
        if self._entry is not None and self._entry[0] == self.done:
            return self._entry[1]
        if self._hparams is None:
            self._hparams = bool(member_hparams(self.state()))
        losses, end = self.losses, self.done
        events: list[dict[str, Any]] = []
        if self._logged is None:
            self._logged = (
                np.full_like(self._diverged_at, -1),
                0,
                [0] * len(self._stateful),
            )
        diverged, evaluations, counts = self._logged
        newly = (diverged < 0) & (self._diverged_at >= 0)
        for member in np.flatnonzero(newly):
            step = int(self._diverged_at[member]) + 1  # counted like `steps`
            events.append({"step": step, "event": "diverged", "member": int(member)})
        for position, item in enumerate(self._stateful):
            made = item.events(self.state().controlled[position])
            events += made[counts[position] :]
            counts[position] = len(made)
        for tracker in self.track:
            events += tracker.events(end - len(losses), end)
        events.sort(key=lambda event: event["step"])  # stable: by step, then kind
        recorded = self.recorder.eval_steps[evaluations:]
        scores = self.recorder.eval_scores[evaluations:]
        self._logged = (self._diverged_at.copy(), len(self.recorder.eval_steps), counts)
        size = len(self._diverged_at)
        entry = LogEntry(
            steps=np.arange(end - len(losses) + 1, end + 1),
            losses=np.asarray(losses, np.float32),
            eval_steps=np.asarray(recorded, np.int64),
            eval_scores=np.asarray(scores, np.float32).reshape(len(recorded), size),
            diverged_at=self.diverged_steps(),
            member_hparams=member_hparams(self.state()) if self._hparams else {},
            events=tuple(events),
        )
        self._entry = (end, entry)
        return entry

    def _attach(self, error: Exception) -> None:
        attached: Any = error
        attached.result = self.result()
        self._attached.add(id(error))

    def dispatch_end(self, done: int, available: int | None = None) -> int:
        """Where the dispatch starting at `done` ends: after the plan's steps per
        dispatch, where a component next needs the host, or where the data
        available ends."""
        ends = [self.steps, done + self.chunk.length]
        for item in self.callbacks:
            stop = item.next_stop(done)
            if stop is not None:
                if stop <= done:
                    raise ValueError(
                        f"`{type(item).__name__}.next_stop({done})` gave {stop}: a "
                        "callback's next stop must come after the steps done "
                        "(`None`: it needs no stop of its own)"
                    )
                ends.append(stop)
        if available is not None:
            ends.append(done + available)
        return min(ends)

    def read_group(self, start: int) -> tuple[Batches | None, int]:
        """The data for the dispatch that starts at `start`, and how many steps
        it holds."""
        count = self.dispatch_end(start) - start
        real = self.source.next_group(count, self.chunk.length, self.chunk.mesh)
        return (self.source.batches() if real else None), real

    def dispatch(self, batches: Batches | None, end: int) -> Any:
        chunk = dataclasses.replace(
            self.chunk,
            end=np.int32(end),
            batches=batches,
            full=_skips_conditional(self.chunk)
            and end - self.done == self.chunk.length,
        )
        # The optimistic guard: the dispatch runs the step with no finiteness
        # check or select per step (frozen members compute along and get
        # their weights back at its end) and checks every member's state
        # once, at its end. Where a member was not finite, `record_dispatch`
        # runs the dispatch again from its start state (kept: an optimistic
        # dispatch donates nothing) with the same program, in parts, to find
        # the step it failed at and freeze it there (`_settle`).
        self._replay = None
        if self.optimistic:
            frozen = _frozen(self._diverged_at, self._stopped_at)
            self._replay = (chunk, self.train_state, frozen)
        return self._run_dispatch(chunk, end - self.done)

    def _run_dispatch(self, chunk: Chunk, steps: int) -> Any:
        # The controllers' states stay on the host side of the run (they run
        # between dispatches): the program is the same with or without
        # controllers.
        controlled = self.train_state.controlled
        state, values = dispatch_chunk(
            self.options,
            chunk,
            with_fields(self.train_state, controlled=()),
            steps,
        )
        self.train_state = with_fields(state, controlled=controlled)
        return values

    def record_dispatch(self, values: Any, end: int) -> np.ndarray:
        """The dispatch's history from its `loop.readout` (`values`, one read of
        everything the host needs); returns its `(steps, members)` losses."""
        active = end - self.done
        evaluated = self.chunk.evaluate is not None
        cpu = self.chunk.mesh is None and jax.default_backend() == "cpu"
        values = values.read(lambda value: _to_host(value, cpu))
        losses, scores, self._diverged_at, self._stopped_at = unpack_readout(
            values, self.chunk.size, evaluated
        )
        replay, self._replay = self._replay, None
        if replay is not None:
            chunk, start, frozen = replay
            readout = Readout(losses, scores, self._diverged_at, self._stopped_at)
            if _failing(readout, active, frozen).any():
                readout = self._settle(chunk, start, frozen, self.done, end, readout)
                losses, scores, self._diverged_at, self._stopped_at = readout
        losses = losses[:active]
        if scores is not None:
            scores = scores[:active]
        every = None if self.chunk.evaluate is None else self.chunk.evaluate.every
        self.recorder.record(losses, scores, self.done, every)
        self.done = end
        return losses

    def _part(self, chunk: Chunk, state: TrainState, start: int, end: int) -> Readout:
        """Steps `start` (`state.step`) to `end` of an optimistic dispatch,
        from `state` (kept), as one dispatch of the same program (a CPU's
        counted loop). Off a CPU a dispatch is a scan of fixed length: a
        longer part runs its program with the per-step conditional, and a
        single step a program of one step (the scan would run its whole
        length of conditional steps for it, which the GPU's host waits on:
        a search step by step would cost length squared)."""
        if chunk.counted:
            chunk = dataclasses.replace(chunk, end=np.int32(end))
        else:
            one = end - start == 1
            chunk = dataclasses.replace(
                chunk,
                end=np.int32(end),
                full=one or (chunk.full and end - start == chunk.length),
                length=1 if one else chunk.length,
            )
        self.train_state = state
        cpu = self.chunk.mesh is None and jax.default_backend() == "cpu"
        values = self._run_dispatch(chunk, end - start).read(
            lambda value: _to_host(value, cpu)
        )
        return unpack_readout(values, self.chunk.size, self.chunk.evaluate is not None)

    def _settle(
        self,
        chunk: Chunk,
        state: TrainState,
        frozen: np.ndarray,
        start: int,
        end: int,
        first: Readout,
    ) -> Readout:
        """An optimistic dispatch in which a member was not finite, run again
        from its start `state` in parts of the same program (a CPU's counted
        loop: a step computes the same bits in a dispatch of any length, as a
        resumed run does; off a CPU the parts shorter than the dispatch run
        its program with the per-step conditional, and single steps a
        one-step program, the same steps to rounding): up to just before the
        first non-finite loss in one part, then step by step up to the
        failing step. There the failing members are marked diverged (at that
        step's index, as the guarded step marks them) and the step is run
        again with them frozen (off a CPU, with any member that fails only in
        that run too): they
        keep their last finite weights, trackers and evaluation see those,
        and their loss of that step is the one computed. Then the rest of
        the dispatch, in the same way. `frozen`: the members frozen at its
        start. Returns the dispatch's readout. (The members' marks are read
        from the readouts only: replicated on every process.)"""
        size, evaluated = self.chunk.size, self.chunk.evaluate is not None
        losses = np.full((end - start, size), np.nan, np.float32)
        scores = np.full((end - start, size), np.nan, np.float32)
        position, readout, stepwise, last = start, first, False, first
        marks = first.diverged_at.copy()
        marks[marks == NOT_FINITE] = -1
        while position < end:
            if not stepwise:
                if readout is None:
                    readout = self._part(chunk, state, position, end)
                bad = _failing(readout, end - position, frozen)
                if not bad.any():  # the rest ran clean: take it
                    _rows(losses, scores, readout, position - start, end - position)
                    state, last = self.train_state, readout
                    break
                rows = ~np.isfinite(readout.losses[: end - position][:, bad])
                hint = int(np.flatnonzero(rows.any(axis=1))[0]) if rows.any() else 0
                if hint > 1:  # clean up to just before the first NaN loss?
                    part = self._part(chunk, state, position, position + hint - 1)
                    if not _failing(part, hint - 1, frozen).any():
                        _rows(losses, scores, part, position - start, hint - 1)
                        state, position = self.train_state, position + hint - 1
                # Then (or where it failed earlier, or no loss says where)
                # step by step up to the failing step.
                stepwise, readout = True, None
            one = self._part(chunk, state, position, position + 1)
            failed = _failing(one, 1, frozen)
            if failed.any():
                now, computed, again = failed, one.losses[0].copy(), one
                while failed.any():
                    marks = np.where(failed, position, marks).astype(np.int32)
                    frozen = frozen | failed
                    state = dataclasses.replace(
                        state, diverged_at=jnp.asarray(marks, jnp.int32)
                    )
                    state = restore_placement(state, self.chunk.placement)
                    again = self._part(chunk, state, position, position + 1)
                    failed = _failing(again, 1, frozen)
                    if failed.any() and chunk.counted:  # one program: determined
                        raise RuntimeError(
                            f"internal error: step {position + 1} failed again "
                            "with its failing members frozen; please report it"
                        )
                    # Off a CPU the step ran as another program, whose kernels
                    # may round otherwise (a GPU's atomic scatter-adds): a
                    # member at the edge failed in it; frozen at it too.
                    computed[failed] = again.losses[0, failed]
                    now = now | failed
                row = again.losses[:1].copy()
                row[0, now] = computed[now]
                one, stepwise = again._replace(losses=row), False
            _rows(losses, scores, one, position - start, 1)
            state, position, last = self.train_state, position + 1, one
        self.train_state = state
        return Readout(
            losses, scores if evaluated else None, last.diverged_at, last.stopped_at
        )

    def finished(self) -> bool:
        """Whether every member has stopped or diverged, at least one stopped
        (the run ends early; all diverged is an error). Stops come from
        callbacks' changes, so without one there is nothing to read."""
        if not self._may_stop:
            return False
        stopped = self._stopped_at >= 0
        return bool(stopped.any() and (stopped | (self._diverged_at >= 0)).all())

    def state(self) -> TrainState:
        """The run's train state."""
        return self.train_state

    def result(self, copy_state: bool = False) -> FitResult:
        state = copy(self.state()) if copy_state else self.state()
        return make_result(
            state,
            self.recorder.history(),
            self.track,
            sampling=self.sampling,
            key=self.key,
            num_examples=self.source.num_examples,
            resumed_from=self.resumed_from,
            read=(self._diverged_at, self._stopped_at, self.done),
        )

    def fail(self, cls: type[Exception], message: str) -> NoReturn:
        error: Any = cls(message)
        self._attach(error)
        raise error

    def diverged_steps(self) -> np.ndarray:
        """Each member's divergence step counted from 1, as every step number
        users read (`-1`: healthy); `diverged_at` holds the step's index."""
        return np.where(self._diverged_at >= 0, self._diverged_at + 1, -1)

    def diverged_message(self) -> str:
        steps = self.diverged_steps().tolist()
        problem = schedule_problem(self.chunk.optimizer, self._diverged_at.tolist())
        advice = (
            problem
            if problem is not None
            else "lower the learning rate or check the loss"
        )
        return (
            f"All {len(self._diverged_at)} members diverged (non-finite loss, "
            f"gradient or update) at steps {steps}; {advice}"
        )

    def stream_ended_message(self) -> str:
        return (
            f"The data stream ended after step {self.done}, before `steps="
            f"{self.steps}`; give `steps` at most the number of batches, or a "
            "stream that does not end. The run so far is `error.result`"
        )


# `hides_non_finite` per optimizer (its state's kinds follow from it): a
# tree walk of the state is tens of microseconds, on every `fit` call.
_HIDES: dict[Any, bool] = {}


def optimistic(
    guard: str, source: DataSource, unrolled: bool, loss_fn: Any, optimizer: Any,
    ens: Any, opt_state: Any,
) -> bool:  # fmt: skip
    """Whether a run's dispatches take the optimistic guard (`Run.dispatch`)."""
    return (
        guard == "auto"
        and source.kind == "arrays"
        and not unrolled
        and not isinstance(loss_fn, Coupled)
        and not _trains_shared(ens)
        and not _hides_non_finite(optimizer, opt_state)
    )


def _hides_non_finite(optimizer: Any, opt_state: Any) -> bool:
    try:
        return _HIDES[optimizer]
    except (KeyError, TypeError):
        pass
    hides = hides_non_finite(opt_state)
    try:
        if len(_HIDES) > 64:
            _HIDES.clear()
        _HIDES[optimizer] = hides
    except TypeError:  # unhashable
        pass
    return hides


def _trains_shared(ens: Any) -> bool:
    return any(getattr(group, "train_shared", False) for group in groups_of(ens))


def _frozen(diverged_at: np.ndarray, stopped_at: np.ndarray) -> np.ndarray:
    return (diverged_at >= 0) | (stopped_at >= 0)


def _failing(readout: Readout, steps: int, frozen: np.ndarray) -> np.ndarray:
    """The members an optimistic dispatch's `readout` (of `steps` steps) shows
    not finite: a non-finite loss, or the end check's mark; frozen members
    (their losses NaN, their state restored) are not failing."""
    bad = readout.diverged_at == NOT_FINITE
    bad |= ~np.isfinite(readout.losses[:steps]).all(axis=0)
    return bad & ~frozen


def _rows(
    losses: np.ndarray, scores: np.ndarray, readout: Readout, at: int, steps: int
) -> None:
    losses[at : at + steps] = readout.losses[:steps]
    if readout.scores is not None:
        scores[at : at + steps] = readout.scores[:steps]


def _to_host(value: Any, cpu: bool) -> np.ndarray:
    """`jax.device_get` of one array. On a CPU without its per-call tree work
    (`np.asarray` of a CPU array is no transfer, so no transfer guard
    applies); elsewhere `jax.device_get` itself, an explicit transfer that
    `jax.transfer_guard("disallow")` allows."""
    return np.asarray(value) if cpu else jax.device_get(value)


def _spec(x: Any) -> str:
    return f"{x.dtype}{list(np.shape(x))}"
