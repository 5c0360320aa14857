"""The divergence guard's two strategies on the host, as `Run` calls them.

`PerStep`: every step checks its members and freezes a failing one at once.
`Deferred` (the optimistic guard): no check per step, one at the dispatch's end;
where a member was not finite, the host replays the dispatch from its kept start
state with the same program, in parts, to freeze the member at its failing step.
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
        """Steps `start` to `end` of a dispatch from `state`, as one dispatch of
        the same program (off a CPU, with the per-step conditional, and a single
        step as a one-step program: a step-by-step search would cost length
        squared)."""
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
        state stands). Else the dispatch is replayed from `kept` (its chunk,
        start state, frozen members, first step) in parts: up to just before
        the first non-finite loss, then step by step to the failing step,
        which is run again with its failing members marked diverged and
        frozen (they keep their last finite weights and that step's computed
        loss); then the rest in the same way. Returns the readout and the
        state at the dispatch's end (marks read from readouts: the same on
        every process)."""
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
                # Then step by step up to the failing step.
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
                    # Off a CPU another program may round otherwise (a GPU's
                    # atomic scatter-adds): a member failing only there too.
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


# `hides_non_finite` per optimizer (its state's kinds follow from it).
_HIDES: dict[Any, bool] = {}


def choose_guard(
    guard: str, arrays: bool, unrolled: bool, loss_fn: Any, optimizer: Any,
    groups: Any, opt_state: Any,
) -> PerStep | Deferred:  # fmt: skip
    """`Deferred` on non-unrolled dispatches of array data, unless the optimizer
    hides non-finite gradients (the end check could not see them) or members
    share anything trained (a frozen member must drop out at every step);
    else, or where `Execution.guard` says so, `PerStep`."""
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


def _failing(readout: Readout, steps: int, frozen: np.ndarray) -> np.ndarray:
    """The members not already `frozen` that `readout` (of `steps` steps) shows
    not finite: a non-finite loss, or the end check's mark."""
    bad = readout.diverged_at == NOT_FINITE
    bad |= ~np.isfinite(readout.losses[:steps]).all(axis=0)
    return bad & ~frozen


def _rows(
    losses: np.ndarray, scores: np.ndarray, readout: Readout, at: int, steps: int
) -> None:
    losses[at : at + steps] = readout.losses[:steps]
    if readout.scores is not None:
        scores[at : at + steps] = readout.scores[:steps]
