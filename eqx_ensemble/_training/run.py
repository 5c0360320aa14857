"""A `fit` run in progress, on the host: checks, set-up, and the work between
dispatches (history, controllers, checkpoints, results)."""

import dataclasses
from collections.abc import Hashable, Sequence
from typing import Any, NoReturn

import equinox as eqx
import jax
import numpy as np
import optax
from jaxtyping import PRNGKeyArray, PyTree

from .._core.ensemble import Ensemble
from .._core.heterogeneous import Heterogeneous, groups_of, labelled
from .._execution.cache import keep, owner_table
from .._execution.compile import (
    Options,
)
from .._execution.execution import Execution
from .._execution.intern import canonical_tree
from .._execution.layout import (
    check_member_chunk,
)
from .._execution.plan import Plan, plan_step
from .._execution.profile import signature
from .._internal.checks import MAX_INT32, check_positive_int
from .._internal.tree import first_difference, with_fields
from .callback import Callback, RunSetup, RunView, as_callbacks, stateful
from .coupled import Coupled
from .evaluate import Evaluate
from .guard import Deferred, PerStep, choose_guard
from .history import Recorder
from .inputs import (
    check_callbacks,
    check_chunkable,
    check_components,
    check_inputs,
    independent_members,
)
from .logbook import LogBook
from .loggers import LogEntry, RunInfo
from .loop import (
    Chunk,
    copy,
    dispatch_chunk,
    unpack_readout,
)
from .loss import (
    LossFn,
    check_optimizer,
)
from .optim import (
    schedule_problem,
)
from .placement import Placement, placement_of, restore_placement
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


@dataclasses.dataclass
class FitCall:
    """`fit`'s arguments as `prepare` checks them (or knows them from a call
    checked before): `size`, `source` and `plan` are filled in as it goes."""

    ens: Any
    loss_fn: LossFn
    optimizer: optax.GradientTransformation
    data: Any
    steps: int
    key: PRNGKeyArray
    batch_size: int | None
    sampling: Any
    opt_state: PyTree[Any]
    state: PyTree[Any]
    hyper: PyTree[Any]
    evaluate: Evaluate | None
    checkpoints: Any
    track: Sequence[Tracker]
    callbacks: Sequence[Any]
    execution: Execution
    components: tuple[Callback, ...] = ()
    size: int = 0
    source: ArraySource | None = None  # (a stream's is made where it starts)
    plan: Plan | None = None


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
    call = FitCall(
        ens, canonical_tree(loss_fn), canonical_tree(optimizer), data, steps, key,
        batch_size, sampling, opt_state, state, hyper, evaluate, checkpoints, track,
        callbacks, execution,
    )  # fmt: skip
    inputs = (ens, opt_state, state, hyper, key, data)
    settings = (call.optimizer, execution, sampling, steps, batch_size)
    simple = hyper is None and evaluate is None and checkpoints is None
    known = None
    if simple and _empty(track) and _empty(callbacks):
        known = _checked(call.loss_fn, settings, inputs)
    if known is None:
        _check(call)
    else:  # a call like one checked before: the same checks pass
        call.size, call.plan = known.size, known.plan
        call.steps = check_positive_int(steps, "steps", high=MAX_INT32)  # (an int)
        call.sampling, call.track = as_sampling(sampling), ()
        call.source = ArraySource(data, call.sampling, batch_size, call.size, True)
    started = _fresh(call, known)
    from_kept = started is not None
    if started is None:
        started = start_state(
            ens, call.optimizer, opt_state, state, hyper=hyper, track=tuple(call.track),
            with_eval=evaluate is not None, key=key,
            controlled=stateful(call.components),
        )  # fmt: skip
    run = _assemble(call, *started, None if known is None else known.guard)
    if known is None:
        if simple and run.source.kind == "arrays" and not call.components:
            _remember(call, settings, inputs, run, None)
    elif not from_kept and known.fresh is not False:  # seen again, or deleted
        kept = _fresh_start(run, call.optimizer, opt_state, (ens, opt_state, state))
        _remember(call, settings, inputs, run, kept or False)
    return run


@dataclasses.dataclass(frozen=True)
class Prepared:
    """What a `fit` call of array data without components or `hyper` decided.
    Its checks read only the inputs' structure, shapes, dtypes and the
    settings, so a matching call (`_call_key`, per loss) skips them, the plan
    and the guard's choice. `fresh`: how a call seen again starts (`False`: it
    cannot; `None`: not yet seen again)."""

    size: int
    plan: Plan
    guard: PerStep | Deferred
    fresh: FreshStart | bool | None


def _check(call: FitCall) -> None:
    """The checks of a call not known; array data planned now (a stream where
    the run starts: its plan needs its first batch)."""
    call.size = check_inputs(
        call.ens, call.loss_fn, call.optimizer, call.key, state=call.state,
        hyper=call.hyper, opt_state=call.opt_state, runner=call.execution,
        where="fit",
    )  # fmt: skip
    call.steps = check_positive_int(call.steps, "steps", high=MAX_INT32)
    call.sampling = check_sampling(call.loss_fn, as_sampling(call.sampling))
    call.track, call.components = _components(call)
    if check_data(call.data):
        call.source = ArraySource(call.data, call.sampling, call.batch_size, call.size)
        call.plan = _plan(call, call.source)


def _fresh(call: FitCall, known: Prepared | None) -> tuple[TrainState, Any] | None:
    """A known call's start from its kept `FreshStart` (`None`: none, or a kept
    array was deleted since)."""
    if known is None or not isinstance(known.fresh, FreshStart):
        return None
    assert known.guard.deferred, "internal error: a donating fresh start"
    return known.fresh(call.ens, call.opt_state, call.state, call.key)


def _assemble(
    call: FitCall, train_state: TrainState, keys: Any, guard: PerStep | Deferred | None
) -> "Run":
    """The run from its start state: resumed, its source started, placed, its
    guard chosen (`guard`: a known call's)."""
    placement = placement_of(call.execution.mesh)
    record = None if call.checkpoints is None else run_record(call, train_state)
    train_state, history, saved_data = _resumed(
        call.checkpoints, train_state, record, call.steps, placement, call.size
    )
    # Not resumed: step 0, without a host read that would wait for the start.
    done = 0 if history is None else int(train_state.step)
    source: ArraySource | StreamSource | None = call.source
    if source is None:
        source = StreamSource(
            call.data, call.sampling, call.batch_size, call.size, done, saved_data
        )
        call.plan = _plan(call, source)
    else:
        source.start(keys.data, keys.bootstrap, placement)
    plan = call.plan
    assert plan is not None
    train_state = placement.place_state(train_state)
    if guard is None:
        guard = choose_guard(
            call.execution.guard, source.kind == "arrays", plan.unroll, call.loss_fn,
            call.optimizer, groups_of(call.ens), train_state.opt_state,
        )  # fmt: skip
    chunk = Chunk(
        loss_fn=call.loss_fn, optimizer=call.optimizer, sampling=call.sampling,
        evaluate=call.evaluate, track=tuple(call.track),
        batches=source.batches() if source.kind == "arrays" else None,
        train_key=keys.train, eval_key=keys.eval, end=np.int32(0), size=call.size,
        length=plan.length, placement=placement, unrolled=plan.unroll,
        layout=plan.layout, check="deferred" if guard.deferred else plan.check,
        counted=plan.counted,
        member_chunk=plan.member_chunk, pinned=placement.model_placement(train_state),
    )  # fmt: skip
    return Run(
        chunk=placement.on_mesh(chunk), options=plan.compiler_options,
        train_state=train_state, recorder=Recorder(call.size, history),
        steps=call.steps, source=source, callbacks=call.components,
        track=tuple(call.track), record=record, sampling=call.sampling,
        key=call.key, guard_strategy=guard,
        resumed_from=None if history is None else done,
    )  # fmt: skip


def _call_key(settings: tuple[Any, ...], call: Any) -> Hashable:
    """The key of `fit`'s `call` (its inputs, `data` last): the settings with
    their types (`steps=True` is not `1`), backend, default device, x64 mode,
    and each input leaf (an array as type, shape, dtype and committed sharding)."""
    *inputs, data = call
    leaves, treedef = jax.tree.flatten(inputs)
    # (a stream is a leaf: not flattened, nor warned about, as an iterable)
    data_leaves, data_def = jax.tree.flatten(data, is_leaf=is_source)
    record = []
    for leaf in leaves + data_leaves:
        shape = getattr(leaf, "shape", None)
        if shape is None:
            record.append(leaf)
        else:  # (a committed array's device too: see `FreshStart`)
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
    """How a call like `run`'s starts without a start program, kept from its
    start state: only where dispatches donate nothing, the `inputs` are
    uncommitted JAX arrays (the dispatch sees what the start program gave it)
    and a fresh optimizer state reads no weight."""
    if not run.guard_strategy.deferred or run.chunk.placement.sharded:
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


def _checked(loss_fn: Any, settings: tuple[Any, ...], call: Any) -> Prepared | None:
    """What a call checked before with these settings and inputs decided."""
    try:
        return owner_table(loss_fn).get(_call_key(settings, call))
    # Unhashable, not weakly held, or a shape without a dtype: checked in full.
    except (TypeError, AttributeError):
        return None


def _remember(
    call: FitCall, settings: tuple[Any, ...], inputs: Any, run: "Run", fresh: Any
) -> None:
    assert call.plan is not None
    prepared = Prepared(call.size, call.plan, run.guard_strategy, fresh)
    try:
        keep(owner_table(call.loss_fn), _call_key(settings, inputs), prepared)
    except (TypeError, AttributeError):  # as in `_checked`
        return


def _plan(call: FitCall, source: DataSource) -> Plan:
    """The run's plan, once its source is known (the mesh checked against the
    members and the batch first)."""
    placement = placement_of(call.execution.mesh)
    placement.check_fit(call.size, source.batch_size)
    return plan_fit(
        call.execution, call.loss_fn, call.ens, call.size, source, call.state,
        call.hyper, placement, call.steps,
    )  # fmt: skip


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


def _components(call: FitCall) -> tuple[tuple[Tracker, ...], tuple[Callback, ...]]:
    """The run's trackers and its callbacks in phase order, each checked
    before any work."""
    evaluate, checkpoints = call.evaluate, call.checkpoints
    track = check_components(evaluate, checkpoints, call.track)
    check_callbacks(call.callbacks)
    components = as_callbacks(
        [*call.callbacks, *([] if checkpoints is None else [checkpoints])]
    )
    for tracker in track:
        tracker.check(call.steps)
    if components:
        every = None if evaluate is None else evaluate.every
        setup = RunSetup(call.steps, call.size, call.ens, every, components)
        for component in components:
            component.on_check(setup)
    if evaluate is not None:
        evaluate.check(call.state is not None)
    return track, components


def _resumed(
    checkpoints: Any,
    train_state: TrainState,
    record: RunRecord | None,
    steps: int,
    placement: Placement,
    size: int,
) -> tuple[TrainState, Any, Any]:
    """The newest checkpoint's `(train_state, history, data position)`, or the
    start state with no history (also without checkpoints)."""
    if checkpoints is None:
        return train_state, None, None
    checkpoints.prepare()
    template = train_state
    if checkpoints.has_checkpoints():
        # Loaded straight onto the mesh: each process reads only its shards.
        placement.check_fit(size, 0)
        template = placement.place_state(train_state)
    resumed = checkpoints.resume(template, record, steps)
    return (train_state, None, None) if resumed is None else resumed


def run_record(call: FitCall, train_state: TrainState) -> RunRecord:
    """What identifies the run, for its checkpoints."""
    source, opt_state, evaluate = call.source, call.opt_state, call.evaluate
    return RunRecord(
        size=len(call.ens),
        batch_size=call.batch_size if source is None else source.batch_size,
        sampling=call.sampling.record(),
        num_examples=None if source is None else source.num_examples,
        key=key_record(call.key),
        eval_every=None if evaluate is None else evaluate.every,
        track=[repr(tracker) for tracker in call.track],
        hyperparams=None
        if opt_state is None
        else hyperparams_record(labelled(call.ens, opt_state)),
        hyper=start_record([("", call.hyper)] if call.hyper is not None else []),
        optimizer=optimizer_record(call.optimizer, train_state.opt_state),
    )


def plan_fit(
    execution: Execution,
    loss_fn: LossFn,
    ens: Ensemble | Heterogeneous,
    size: int,
    source: DataSource,
    state: PyTree[Any],
    hyper: PyTree[Any],
    placement: Placement,
    steps: int,
) -> Plan:
    """`execution`'s choices, with the library's where it leaves them open."""
    if execution.member_chunk is not None:
        check_member_chunk(execution.member_chunk, size, placement.members_devices)
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
        placement=placement,
        steps=steps,
        pads_on_host=source.pads_on_host,
        groupable=independent_members(loss_fn, ens),
    )


def _skips_conditional(chunk: Chunk) -> bool:
    """Whether a full dispatch may run a program without the per-step
    conditional: not on a CPU, where it costs nothing and one program keeps a
    resume bitwise (two may round differently); a GPU's waits on the host."""
    return chunk.placement.platform != "cpu"


@dataclasses.dataclass
class Run:
    """A run between dispatches: it owns the train state and the history, and
    calls its `Callback`s in phase order."""

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
    guard_strategy: PerStep | Deferred
    resumed_from: int | None = None

    def __post_init__(self):
        if self.resumed_from is None:  # fresh: known without reading the state
            self.done = 0
            self.diverged_at = np.full((self.chunk.size,), -1, np.int32)
            self._stopped_at = np.full((self.chunk.size,), -1, np.int32)
        else:
            self.done = int(self.train_state.step)
            self.diverged_at = np.asarray(self.train_state.diverged_at)
            self._stopped_at = np.asarray(self.train_state.stopped_at)
        # Members stop only by a callback's change (or before a resume).
        self._may_stop = self.resumed_from is not None
        self.losses = np.zeros((0, self.chunk.size), np.float32)  # last dispatch's
        self.stateful = stateful(self.callbacks)
        # Where the callbacks after `OBSERVE` begin (see `after_dispatch`).
        self._observers = sum(item.phase <= Callback.OBSERVE for item in self.callbacks)
        self._handles: list[Any] = []
        self._attached: set[int] = set()  # errors carrying this run
        self._phase: int | None = None  # of the callback being called
        self._logbook = LogBook(self)
        self._kept: Any = None  # what the guard keeps of a dispatch's start
        self.to_host = self.chunk.placement.to_host

    def run(self) -> FitResult:
        """Drive the run to its last step, dispatch by dispatch. A failure to read
        the next batches is raised after the dispatch that ran is recorded."""
        view = RunView(self)
        try:
            for item in self.callbacks:
                self._handles.append(self._call(item.on_start, view))
            finished = self.finished()  # a resumed run whose members all stopped
            group = (None, 0) if finished else self.read_group(self.done)
            while self.done < self.steps and not finished:
                if group[1] == 0:
                    self.fail(ValueError, _stream_ended_message(self))
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
            # The run's own error wins: the callbacks end quietly, a note each.
            self.end(error)
            raise
        self.end(None)
        return self.result()

    def end(self, error: BaseException | None) -> None:
        """Every started callback's `on_end`, in phase order. After a clean run
        the first error an `on_end` raises becomes the run's, and is raised."""
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
        if (self.diverged_at >= 0).all():
            for item, handle in pairs[self._observers :]:
                if item.phase == Callback.RECORD:
                    self._phase = item.phase
                    self._call(item.on_dispatch, handle, view)
            self.fail(EnsembleDivergedError, _diverged_message(self))
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
        for position, item in enumerate(self.stateful):
            if item is callback:
                return position
        raise ValueError(
            f"`{type(callback).__name__}` keeps no state in the run (a callback "
            "with `checkpointed = True`, in this run's `callbacks`, does)"
        )

    def update(self, callback: Callback, new_state: TrainState, own: Any) -> None:
        """A callback's new train state (values only) and its own state."""
        problem = _changed_structure(callback, self.done, self.train_state, new_state)
        if problem:
            self.fail(TypeError, problem)
        # Host-side edits (PBT's copies) may move "model"-split leaves: put back.
        new_state = restore_placement(new_state, self.chunk.pinned)
        states = list(self.train_state.controlled)
        if callback.checkpointed:
            states[self.slot(callback)] = own
        self.train_state = dataclasses.replace(new_state, controlled=tuple(states))
        # A callback may stop members (or revive them).
        self.diverged_at = np.asarray(self.state().diverged_at)
        self._stopped_at = np.asarray(self.state().stopped_at)
        self._may_stop = True

    def run_info(self) -> RunInfo:
        return self._logbook.info(self)

    def log_entry(self) -> LogEntry:
        """The last dispatch's record for loggers: built once per dispatch,
        after the controllers ran (from the `RECORD` phase on)."""
        if self._phase is not None and self._phase < Callback.RECORD:
            raise RuntimeError(
                "`RunView.log_entry()` is the dispatch's record after the "
                "controllers ran: read it from a callback of phase `RECORD` or later"
            )
        return self._logbook.entry(self)

    def _attach(self, error: Exception) -> None:
        attached: Any = error
        attached.result = self.result()
        self._attached.add(id(error))

    def dispatch_end(self, done: int, available: int | None = None) -> int:
        """Where the dispatch starting at `done` ends: the plan's length, a
        callback's next stop, or the data available."""
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
        real = self.source.next_group(count, self.chunk.length, self.chunk.placement)
        return (self.source.batches() if real else None), real

    def dispatch(self, batches: Batches | None, end: int) -> Any:
        chunk = dataclasses.replace(
            self.chunk,
            end=np.int32(end),
            batches=batches,
            full=_skips_conditional(self.chunk)
            and end - self.done == self.chunk.length,
        )
        if self.guard_strategy.deferred:  # (its dispatch donates nothing)
            frozen = (self.diverged_at >= 0) | (self._stopped_at >= 0)
            self._kept = (chunk, self.train_state, frozen, self.done)
        return self.run_dispatch(chunk, end - self.done)

    def run_dispatch(self, chunk: Chunk, steps: int) -> Any:
        """`chunk`'s dispatch of `steps` steps (the controllers' states stay on
        the host: one program with or without)."""
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
        """Record the dispatch's readout; return its `(steps, members)` losses."""
        active = end - self.done
        evaluated = self.chunk.evaluate is not None
        readout = unpack_readout(values.read(self.to_host), self.chunk.size, evaluated)
        kept, self._kept = self._kept, None
        readout, settled = self.guard_strategy.settle(self, kept, end, readout)
        if settled is not None:
            self.train_state = settled
        losses, scores, self.diverged_at, self._stopped_at = readout
        losses = losses[:active]
        if scores is not None:
            scores = scores[:active]
        every = None if self.chunk.evaluate is None else self.chunk.evaluate.every
        self.recorder.record(losses, scores, self.done, every)
        self.done = end
        return losses

    def finished(self) -> bool:
        """Whether every member has stopped or diverged, at least one stopped."""
        if not self._may_stop:
            return False
        stopped = self._stopped_at >= 0
        return bool(stopped.any() and (stopped | (self.diverged_at >= 0)).all())

    def state(self) -> TrainState:
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
            read=(self.diverged_at, self._stopped_at, self.done),
        )

    def fail(self, cls: type[Exception], message: str) -> NoReturn:
        error: Any = cls(message)
        self._attach(error)
        raise error

    def diverged_steps(self) -> np.ndarray:
        """Each member's divergence step counted from 1 (`-1`: healthy)."""
        return np.where(self.diverged_at >= 0, self.diverged_at + 1, -1)


def _diverged_message(run: Run) -> str:
    steps = run.diverged_steps().tolist()
    problem = schedule_problem(run.chunk.optimizer, run.diverged_at.tolist())
    advice = problem or "lower the learning rate or check the loss"
    return (
        f"All {len(run.diverged_at)} members diverged (non-finite loss, "
        f"gradient or update) at steps {steps}; {advice}"
    )


def _stream_ended_message(run: Run) -> str:
    return (
        f"The data stream ended after step {run.done}, before `steps="
        f"{run.steps}`; give `steps` at most the number of batches, or a "
        "stream that does not end. The run so far is `error.result`"
    )


def _changed_structure(callback: Callback, done: int, old: Any, new: Any) -> str:
    """The error for a callback's train state of another structure (`""`: none)."""
    difference = first_difference(
        jax.tree.map(_spec, eqx.filter(old, eqx.is_array)),
        jax.tree.map(_spec, eqx.filter(new, eqx.is_array)),
    )
    if difference is None:
        return ""
    return (
        f"The callback `{type(callback).__name__}` (in `callbacks`) changed "
        f"the structure, shapes or dtypes of the train state at step "
        f"{done}: {difference}. A callback may change values only; "
        "the run up to this step is `error.result`"
    )


def _spec(x: Any) -> str:
    return f"{x.dtype}{list(np.shape(x))}"
