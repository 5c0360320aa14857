"""The divergence guard's two strategies on the host, as `Run` calls them.

`PerStep`: every step of the program checks its members (the plan's check
form, `_execution.guard`) and freezes a failing one at once; the dispatch
donates its start state and the host has nothing to do after it.

`Deferred` (the optimistic guard): the dispatch runs its steps with no check
or select per step (frozen members compute along and get their weights back
at its end, `loop._settle_members`) and checks every member once, at its
end. Where a member was not finite, the host runs the dispatch again from
its start state (kept: the dispatch donates nothing) with the same program,
in parts, to find the step it failed at and freeze it there (`settle`).
"""

import dataclasses
from typing import Any

import jax.numpy as jnp
import numpy as np

from .._execution.cache import keep
from .coupled import Coupled
from .loop import NOT_FINITE, Chunk, Readout, unpack_readout
from .optim import hides_non_finite
from .placement import restore_placement
from .train_state import TrainState


class PerStep:
    """Each step checks and freezes its members (the plan's check form)."""

    deferred = False

    def settle(
        self, run: Any, kept: Any, end: int, readout: Readout
    ) -> tuple[Readout, TrainState | None]:
        """The dispatch's readout as it is: its steps were checked."""
        del run, kept, end
        return readout, None


class Deferred:
    """One check at the dispatch's end; a failing dispatch replayed in parts."""

    deferred = True

    def part(
        self, run: Any, chunk: Chunk, state: TrainState, start: int, end: int
    ) -> tuple[Readout, TrainState]:
        """Steps `start` (`state.step`) to `end` of a dispatch from `state`
        (kept), as one dispatch of the same program (a CPU's counted loop).
        Off a CPU a dispatch is a scan of fixed length: a longer part runs its
        program with the per-step conditional, and a single step a program of
        one step (the scan would run its whole length of conditional steps for
        it, which the GPU's host waits on: a search step by step would cost
        length squared)."""
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
        run.train_state = state
        values = run.run_dispatch(chunk, end - start).read(run.to_host)
        readout = unpack_readout(values, chunk.size, chunk.evaluate is not None)
        return readout, run.train_state

    def settle(
        self,
        run: Any,
        kept: tuple[Chunk, TrainState, np.ndarray, int],
        end: int,
        first: Readout,
    ) -> tuple[Readout, TrainState | None]:
        """The dispatch's readout where every member was finite (`None`: the
        state stands); else the dispatch run again from its start state
        (`kept`: its chunk, start state, members frozen at its start and
        first step) in parts of the same program (a CPU's counted loop: a
        step computes the same bits in a dispatch of any length, as a
        resumed run does; off a CPU the parts shorter than the dispatch run
        its program with the per-step conditional, and single steps a
        one-step program, the same steps to rounding): up to just before
        the first non-finite loss in one part, then step by step up to the
        failing step. There the failing members are marked diverged (at that
        step's index, as the guarded step marks them) and the step is run
        again with them frozen (off a CPU, with any member that fails only in
        that run too): they keep their last finite weights, trackers and
        evaluation see those, and their loss of that step is the one
        computed. Then the rest of the dispatch, in the same way. Returns
        the readout and the state at the dispatch's end. (The members' marks
        are read from the readouts only: replicated on every process.)"""
        chunk, state, frozen, start = kept
        if not _failing(first, end - start, frozen).any():
            return first, None
        size = chunk.size
        losses = np.full((end - start, size), np.nan, np.float32)
        scores = np.full((end - start, size), np.nan, np.float32)
        position, readout, stepwise, last = start, first, False, first
        marks = first.diverged_at.copy()
        marks[marks == NOT_FINITE] = -1
        while position < end:
            if not stepwise:
                if readout is None:
                    readout, after = self.part(run, chunk, state, position, end)
                else:
                    after = None
                bad = _failing(readout, end - position, frozen)
                if not bad.any():  # the rest ran clean: take it
                    _rows(losses, scores, readout, position - start, end - position)
                    assert after is not None
                    state, last = after, readout
                    break
                rows = ~np.isfinite(readout.losses[: end - position][:, bad])
                hint = int(np.flatnonzero(rows.any(axis=1))[0]) if rows.any() else 0
                if hint > 1:  # clean up to just before the first NaN loss?
                    part, after = self.part(
                        run, chunk, state, position, position + hint - 1
                    )
                    if not _failing(part, hint - 1, frozen).any():
                        _rows(losses, scores, part, position - start, hint - 1)
                        state, position = after, position + hint - 1
                # Then (or where it failed earlier, or no loss says where)
                # step by step up to the failing step.
                stepwise, readout = True, None
            one, after = self.part(run, chunk, state, position, position + 1)
            failed = _failing(one, 1, frozen)
            if failed.any():
                now, computed, again = failed, one.losses[0].copy(), one
                while failed.any():
                    marks = np.where(failed, position, marks).astype(np.int32)
                    frozen = frozen | failed
                    state = dataclasses.replace(
                        state, diverged_at=jnp.asarray(marks, jnp.int32)
                    )
                    state = restore_placement(state, chunk.pinned)
                    again, after = self.part(run, chunk, state, position, position + 1)
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
            state, position, last = after, position + 1, one
        evaluated = chunk.evaluate is not None
        readout = Readout(
            losses, scores if evaluated else None, last.diverged_at, last.stopped_at
        )
        return readout, state


# `hides_non_finite` per optimizer (its state's kinds follow from it): a
# tree walk of the state is tens of microseconds, on every `fit` call.
_HIDES: dict[Any, bool] = {}


def choose_guard(
    guard: str, arrays: bool, unrolled: bool, loss_fn: Any, optimizer: Any,
    groups: Any, opt_state: Any,
) -> PerStep | Deferred:  # fmt: skip
    """The run's guard: `Deferred` (the optimistic guard) on dispatches of
    array data that are not unrolled (a part of one is the same program, or
    on a GPU its variant with the per-step conditional), not where the
    optimizer replaces non-finite gradients itself (the end-of-dispatch check
    could not see them), nor where members share anything trained (a trained
    shared part, a coupled loss: a frozen member must drop out of those at
    every step); `PerStep` otherwise, or where `Execution.guard` says so."""
    deferred = (
        guard == "auto"
        and arrays
        and not unrolled
        and not isinstance(loss_fn, Coupled)
        and not any(getattr(group, "train_shared", False) for group in groups)
        and not _hides_non_finite(optimizer, opt_state)
    )
    return Deferred() if deferred else PerStep()


def _hides_non_finite(optimizer: Any, opt_state: Any) -> bool:
    try:
        return _HIDES[optimizer]
    except (KeyError, TypeError):
        pass
    hides = hides_non_finite(opt_state)
    try:
        keep(_HIDES, optimizer, hides)
    except TypeError:  # unhashable
        pass
    return hides


def frozen(diverged_at: np.ndarray, stopped_at: np.ndarray) -> np.ndarray:
    """The members a dispatch starts with frozen (diverged or stopped)."""
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
