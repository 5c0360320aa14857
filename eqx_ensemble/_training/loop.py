"""The compiled part of `fit`: one dispatch runs a chunk of steps (`lax.scan`),
and returns one int32 vector to the host (`readout`)."""

import dataclasses
from collections.abc import Callable, Hashable
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import Array, ArrayLike, Float, Int, PRNGKeyArray, PyTree

from .._core.heterogeneous import group_parts, joined
from .._execution.compile import (
    CompiledFunctions,
    Options,
    filter_jit,
    one_shot_options,
    split_arguments,
)
from .._execution.guard import FiniteCheck
from .._execution.layout import Layout
from .._execution.placement import MEMBERS
from .evaluate import Evaluate, eval_member_keys
from .loss import LossFn
from .placement import Placement
from .sampling import Sampling
from .source import Batches, IndexedBatches, SampledBatches
from .step import all_finite, vmapped_update
from .tracker import Tracker
from .train_state import (
    TrainState,
    member_select,
    track_update,
)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, eq=False)
class Chunk:
    """Everything one dispatch reads but the (donated) train state (a dataclass)."""

    loss_fn: LossFn
    optimizer: optax.GradientTransformation
    sampling: Sampling
    evaluate: Evaluate | None
    track: tuple[Tracker, ...]
    batches: (
        Batches | None
    )  # the data source's view: sampled arrays or a stream's group
    train_key: PRNGKeyArray
    eval_key: PRNGKeyArray
    end: Int[ArrayLike, ""]  # a NumPy int32 scalar: no dispatch to make it
    size: int
    length: int
    placement: Placement  # one device, or a mesh
    # Unrolled: a call runs the step of row `row` (an input) of the scanned inputs.
    unrolled: bool = False
    evaluate_last: bool = False
    row: Int[ArrayLike, ""] | None = None
    # Every one of the `length` steps runs (known on the host): no conditional.
    full: bool = False
    # A loop of a traced trip count, no conditional (CPU): see `_counted`.
    counted: bool = False
    layout: Layout = "vmap"  # the members vectorised, or one after another
    member_chunk: int | None = None  # vectorised members per group (`Execution`)
    check: FiniteCheck = "per_leaf"  # the guard's form (`_execution.guard`)
    # The train state's leaves split over a "model" mesh axis, kept exactly.
    pinned: Any = None


def _make_chunk_runner(options: Options, *program: Hashable) -> Callable[..., Any]:
    deferred = program[-1]  # (the key's last entry)

    # A function of its own: JAX's caches keyed on it go when it is dropped.
    def run(chunk: Chunk, train_state: TrainState) -> Any:
        train_state, losses, scores = run_chunk(chunk, train_state)
        return train_state, _readout(chunk, train_state, losses, scores)

    # An optimistic dispatch keeps its start state (the host may replay from it).
    return filter_jit(run, options, donate=None if deferred else "all-except-first")


# `run_chunk` compiled, one function per program (`dispatch_chunk`), bounded.
chunk_runner = CompiledFunctions(_make_chunk_runner)


def dispatch_chunk(
    options: Options, chunk: Chunk, train_state: TrainState, steps: int | None = None
) -> tuple[TrainState, "DispatchReadout"]:
    """One compiled dispatch of `chunk` from `train_state` (donated)."""
    if chunk.unrolled:
        assert steps is not None, "an unrolled dispatch is told its steps"
        return _dispatch_steps(options, chunk, train_state, steps)
    static, first, rest = split_arguments((chunk, train_state))
    shapes = tuple((leaf.shape, leaf.dtype) for leaf in rest)
    deferred = chunk.check == "deferred"
    runner = chunk_runner(options, static, shapes, deferred)
    train_state, values = runner.call_split(static, first, rest)
    return train_state, DispatchReadout(
        [values], chunk.size, chunk.evaluate is not None
    )


def _dispatch_steps(
    options: Options, chunk: Chunk, train_state: TrainState, steps: int
) -> tuple[TrainState, "DispatchReadout"]:
    """An unrolled dispatch: a host loop of calls of one compiled step."""
    start = int(np.asarray(chunk.end)) - steps
    if isinstance(chunk.batches, SampledBatches):
        indices = _drawers.call(
            dataclasses.replace(chunk.batches, data=None),
            np.int32(start),
            chunk.length,
            np.int32(steps),
        )
        chunk = dataclasses.replace(
            chunk, batches=IndexedBatches(chunk.batches.data, indices)
        )
    every = None if chunk.evaluate is None else chunk.evaluate.every
    row = np.zeros((), np.int32)  # the markers, found by identity
    forms: dict[bool, tuple[Hashable, list[Any], int, Any]] = {}
    rest, readouts, static_out = None, [], None
    for position in range(steps):
        evaluates = every is not None and (start + position + 1) % every == 0
        if evaluates not in forms:
            call = dataclasses.replace(  # (`full` means nothing to one step)
                chunk, row=row, evaluate_last=evaluates, full=False
            )
            static, leaves, state_leaves = split_arguments((call, train_state))
            shapes = tuple((leaf.shape, leaf.dtype) for leaf in state_leaves)
            forms[evaluates] = (
                static,
                leaves,
                _position_of(row, leaves),
                chunk_runner(options, static, shapes, chunk.check == "deferred"),
            )
            rest = state_leaves if rest is None else rest
        static, leaves, at_row, runner = forms[evaluates]
        leaves[at_row] = np.array(position, np.int32)
        arrays, static_out = runner.call_arrays(static, leaves, rest)
        rest = arrays[:-1]  # the state's, in the order they came in
        readouts.append(arrays[-1])
    assert static_out is not None and rest is not None
    train_state, _ = static_out.unflatten([*rest, readouts[-1]])
    return train_state, DispatchReadout(
        readouts, chunk.size, chunk.evaluate is not None
    )


def _position_of(marker: np.ndarray, leaves: list[Any]) -> int:
    return next(i for i, leaf in enumerate(leaves) if leaf is marker)


@dataclasses.dataclass(frozen=True)
class DispatchReadout:
    """A dispatch's `readout` (an unrolled one's per step) until `read`."""

    parts: list[Any]
    members: int
    evaluated: bool

    def read(self, to_host: Callable[[Any], np.ndarray]) -> np.ndarray:
        if len(self.parts) == 1:
            return to_host(self.parts[0])
        parts = [
            unpack_readout(to_host(values), self.members, self.evaluated)
            for values in self.parts
        ]

        def joined(name: str) -> np.ndarray:
            return np.concatenate([getattr(part, name) for part in parts], axis=0)

        return pack_readout(
            joined("losses"),
            joined("scores") if self.evaluated else None,
            parts[-1].diverged_at,
            parts[-1].stopped_at,
        )


def _make_drawer(*program: Hashable) -> Callable[..., Any]:
    del program  # what the function is compiled for: its key
    return filter_jit(SampledBatches.draw, one_shot_options())


# `SampledBatches.draw` compiled, one function per configuration (bounded).
_drawers = CompiledFunctions(_make_drawer)


def readout(
    losses: Float[Array, "steps members"],
    scores: Float[Array, "steps members"] | None,
    diverged_at: Int[Array, " members"],
    stopped_at: Int[Array, " members"],
    placement: Placement,
) -> Int[Array, " n"]:
    """What the host reads after a dispatch, as one int32 vector (bit-cast)."""
    floats = [losses] if scores is None else [losses, scores]
    *floats, diverged_at, stopped_at = placement.replicate(
        [*floats, diverged_at, stopped_at]
    )
    ints = [
        jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32).reshape(-1)
        for x in floats
    ]
    ints += [diverged_at.astype(jnp.int32), stopped_at.astype(jnp.int32)]
    return placement.replicate(jnp.concatenate(ints))


def _readout(chunk: Chunk, ts: TrainState, losses: Any, scores: Any) -> Any:
    scores = scores if chunk.evaluate is not None else None
    return readout(losses, scores, ts.diverged_at, ts.stopped_at, chunk.placement)


class Readout(NamedTuple):
    """A dispatch's `readout` on the host, as views of the one array read."""

    losses: np.ndarray  # (steps, members) float32
    scores: np.ndarray | None  # (steps, members) float32, where evaluated
    diverged_at: np.ndarray  # (members,) int32
    stopped_at: np.ndarray  # (members,) int32


def pack_readout(
    losses: np.ndarray,
    scores: np.ndarray | None,
    diverged_at: np.ndarray,
    stopped_at: np.ndarray,
) -> np.ndarray:
    """`readout` on the host, from its parts (what `unpack_readout` returns)."""
    floats = [losses] if scores is None else [losses, scores]
    ints = [
        np.ascontiguousarray(x, np.float32).reshape(-1).view(np.int32) for x in floats
    ]
    ints += [diverged_at.astype(np.int32), stopped_at.astype(np.int32)]
    return np.concatenate(ints)


def unpack_readout(values: np.ndarray, size: int, evaluated: bool) -> Readout:
    """`readout`'s parts from the host's copy of it (`size` members)."""
    per_step = size * (2 if evaluated else 1)
    steps, rest = divmod(len(values) - 2 * size, per_step)
    if steps < 0 or rest:
        raise ValueError(
            f"a readout of {len(values)} values is not {2 * size} step counts "
            f"plus whole steps of {per_step} ({size} members"
            f"{', evaluated' if evaluated else ''}): the dispatch and the host "
            "disagree on what it holds"
        )
    cut = steps * size
    floats = values[: len(values) - 2 * size].view(np.float32)
    marks = values[len(values) - 2 * size :]
    return Readout(
        losses=floats[:cut].reshape(steps, size),
        scores=floats[cut : 2 * cut].reshape(steps, size) if evaluated else None,
        diverged_at=marks[:size],
        stopped_at=marks[size:],
    )


def _nan_row(chunk: Chunk) -> Float[Array, " members"]:
    row = jnp.full((chunk.size,), jnp.nan, dtype=jnp.float32)
    return chunk.placement.constrain(row, (MEMBERS,))


def _train_step(
    chunk: Chunk,
    ts: TrainState,
    batch: PyTree[Any],
    evaluate: Any = "due",
    kept: TrainState | None = None,
) -> tuple:
    """One step of every member, then trackers, evaluation and best members;
    `kept`: an optimistic dispatch's start state."""
    update = vmapped_update(
        chunk.loss_fn,
        chunk.optimizer,
        chunk.sampling.per_member,
        chunk.placement,
        chunk.layout,
        chunk.member_chunk,
        chunk.check,
    )
    step = ts.step
    member_keys = jax.random.split(
        jax.random.fold_in(chunk.train_key, step), chunk.size
    )
    new_ens, opt_state, losses, _, model_state, diverged = update(
        ts.ensemble,
        ts.opt_state,
        batch,
        member_keys,
        ts.model_state,
        (ts.diverged_at >= 0) | (ts.stopped_at >= 0),
        ts.hyper,
    )
    done = step + 1
    seen_ens, seen_state = new_ens, model_state
    if kept is not None and (chunk.track or chunk.evaluate is not None):
        training = (ts.diverged_at < 0) & (ts.stopped_at < 0)
        training = chunk.placement.constrain(training, (MEMBERS,))
        seen_ens = member_select(training, new_ens, kept.ensemble)
        seen_state = member_select(training, model_state, kept.model_state, new_ens)
    ts = dataclasses.replace(
        ts,
        ensemble=seen_ens,
        opt_state=opt_state,
        model_state=seen_state,
        tracked=tuple(
            track_update(tracker, state, seen_ens, done)
            for tracker, state in zip(chunk.track, ts.tracked, strict=True)
        ),
        step=done,
        diverged_at=jnp.where(diverged, step, ts.diverged_at),
    )
    nan_row = _nan_row(chunk)
    scores = nan_row
    if chunk.evaluate is not None and evaluate is not False:
        scores, ts = _evaluate(chunk, chunk.evaluate, ts, nan_row, evaluate == "due")
    if seen_ens is not new_ens:
        ts = dataclasses.replace(ts, ensemble=new_ens, model_state=model_state)
    constrain = chunk.placement.constrain
    losses = constrain(jnp.asarray(losses, jnp.float32), (MEMBERS,))
    return ts, losses, constrain(scores, (MEMBERS,))


def _evaluate(
    chunk: Chunk,
    evaluate: Evaluate,
    ts: TrainState,
    nan_row: Float[Array, " m"],
    conditional: bool,
) -> tuple[Float[Array, " members"], TrainState]:
    dynamic, static = eqx.partition(ts, eqx.is_array)

    def run(dynamic_ts):
        current = eqx.combine(dynamic_ts, static)
        member_keys = chunk.placement.constrain(
            eval_member_keys(chunk.eval_key, current.step, chunk.size), (MEMBERS,)
        )
        scores = evaluate.scores(
            current.ensemble,
            current.model_state,
            member_keys,
            chunk.layout,
            chunk.member_chunk,
            chunk.placement.members_devices,
        )
        return chunk.placement.constrain(scores, (MEMBERS,))

    if conditional:
        scores = jax.lax.cond(evaluate.due(ts.step), run, lambda _: nan_row, dynamic)
    else:
        scores = run(dynamic)
    assert ts.best_score is not None and ts.best_step is not None
    better = chunk.placement.constrain(scores < ts.best_score, (MEMBERS,))
    ts = dataclasses.replace(
        ts,
        best_ensemble=member_select(better, ts.ensemble, ts.best_ensemble),
        best_score=jnp.where(better, scores, ts.best_score),
        best_step=jnp.where(better, ts.step, ts.best_step),
    )
    return scores, ts


def run_chunk(
    chunk: Chunk, train_state: TrainState
) -> tuple[TrainState, Float[Array, "steps members"], Float[Array, "steps members"]]:
    """`chunk.length` steps (those before `chunk.end`) from `train_state`."""
    placement, pinned = chunk.placement, chunk.pinned
    dynamic, static = eqx.partition(train_state, eqx.is_array)
    nan_row = _nan_row(chunk)
    assert chunk.batches is not None, "a dispatch is given its data"
    count = jnp.asarray(chunk.end - train_state.step) if chunk.counted else None
    batch_of = chunk.batches.maker(train_state.step, chunk.length, placement, count)

    kept = train_state if chunk.check == "deferred" else None

    def active(carry, scanned):
        ts = eqx.combine(carry, static)
        batch = batch_of(ts.step, scanned)
        ts, losses, scores = _train_step(chunk, ts, batch, kept=kept)
        ts = placement.place_state(ts, inside_jit=True, in_loop=True, placement=pinned)
        return eqx.filter(ts, eqx.is_array), (losses, scores)

    def inactive(carry, scanned):
        del scanned
        return carry, (nan_row, nan_row)

    def body(carry, scanned):
        if chunk.full:
            return active(carry, scanned)
        return jax.lax.cond(carry.step < chunk.end, active, inactive, carry, scanned)

    dynamic = placement.place_state(
        dynamic, inside_jit=True, in_loop=True, placement=pinned
    )
    if chunk.unrolled:
        dynamic, losses, scores = _unrolled(chunk, dynamic, static, batch_of)
    elif count is not None:
        dynamic, losses, scores = _counted(chunk, active, dynamic, nan_row, count)
    else:
        dynamic, (losses, scores) = jax.lax.scan(
            body, dynamic, chunk.batches.scanned(), length=chunk.length
        )
    dynamic = placement.place_state(dynamic, inside_jit=True, placement=pinned)
    losses, scores = placement.replicate((losses, scores))
    state = eqx.combine(dynamic, static)
    if chunk.check == "deferred":
        state = _settle_members(train_state, state, placement)
    return state, losses, scores


def _settle_members(
    start: TrainState, end: TrainState, placement: Placement
) -> TrainState:
    """The end of an optimistic dispatch: frozen members restored, any other
    non-finite member marked `NOT_FINITE`."""
    frozen = (start.diverged_at >= 0) | (start.stopped_at >= 0)
    frozen = placement.constrain(frozen, (MEMBERS,))
    ens, opt_state, model_state = end.ensemble, end.opt_state, end.model_state
    finite = placement.constrain(_members_finite(ens, opt_state), (MEMBERS,))
    return dataclasses.replace(
        end,
        ensemble=member_select(~frozen, ens, start.ensemble),
        opt_state=member_select(~frozen, opt_state, start.opt_state, ens),
        model_state=member_select(~frozen, model_state, start.model_state, ens),
        diverged_at=jnp.where(
            frozen | finite, end.diverged_at, jnp.int32(NOT_FINITE)
        ).astype(end.diverged_at.dtype),
    )


def _members_finite(ens: Any, opt_state: Any) -> Any:
    """Per member: whether its own weights and optimizer state are finite."""

    finite = eqx.filter_vmap(
        lambda members, state: all_finite(members, check="by_shape", state=state)
    )
    parts = group_parts(ens, opt_state)
    return joined(
        ens, [finite(group.members, group_opt) for group, group_opt in parts],
        jnp.concatenate,
    )  # fmt: skip


# `diverged_at` of a member an optimistic dispatch found not finite at its end.
NOT_FINITE = -2


def _counted(
    chunk: Chunk,
    active: Callable[..., Any],
    dynamic: Any,
    nan_row: Array,
    count: Int[Array, ""],
) -> tuple[Any, Array, Array]:
    """The `count` steps before `chunk.end` in a loop of traced trip count."""
    scanned = chunk.batches.scanned() if chunk.batches is not None else None
    rows = chunk.placement.constrain(
        jnp.broadcast_to(nan_row, (chunk.length, chunk.size)), (None, MEMBERS)
    )

    def body(loop):
        position, carry, losses, scores = loop
        inputs = jax.tree.map(
            lambda x: jax.lax.dynamic_index_in_dim(x, position, keepdims=False),
            scanned,
        )
        carry, (step_losses, step_scores) = active(carry, inputs)
        losses = losses.at[position].set(step_losses)
        return position + 1, carry, losses, scores.at[position].set(step_scores)

    _, dynamic, losses, scores = jax.lax.while_loop(
        lambda loop: loop[0] < count, body, (jnp.int32(0), dynamic, rows, rows)
    )
    return dynamic, losses, scores


def _unrolled(
    chunk: Chunk, dynamic: Any, static: Any, batch_of: Any
) -> tuple[Any, Array, Array]:
    """One step of row `chunk.row` of the scanned inputs, no conditional."""
    ts = eqx.combine(dynamic, static)
    assert chunk.batches is not None and chunk.row is not None
    row = jnp.asarray(chunk.row, jnp.int32)
    inputs = jax.tree.map(
        lambda x: jax.lax.dynamic_index_in_dim(x, row, keepdims=False),
        chunk.batches.scanned(),
    )
    ts, losses, scores = _train_step(
        chunk, ts, batch_of(ts.step, inputs), evaluate=chunk.evaluate_last
    )
    ts = chunk.placement.place_state(
        ts, inside_jit=True, in_loop=True, placement=chunk.pinned
    )
    return eqx.filter(ts, eqx.is_array), losses[None], scores[None]


@eqx.filter_jit
def _compiled_copy(tree: PyTree[Any]) -> PyTree[Any]:
    return jax.tree.map(lambda x: jnp.copy(x) if eqx.is_array(x) else x, tree)


def copy(tree: PyTree[Any]) -> PyTree[Any]:
    """A copy of every array leaf of `tree` (distinct buffers)."""
    try:
        return _compiled_copy(tree)
    except ValueError:  # leaves committed to different devices
        return jax.tree.map(
            lambda x: jnp.array(x, copy=True) if eqx.is_array(x) else x, tree
        )
