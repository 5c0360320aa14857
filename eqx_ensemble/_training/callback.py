"""`Callback`: the one protocol of `fit`'s host-side components, and `RunView`."""

import dataclasses
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import equinox as eqx
import numpy as np
from jaxtyping import PyTree

from .._internal.component import Component
from .history import History
from .train_state import TrainState

if TYPE_CHECKING:
    from .result import FitResult


@dataclasses.dataclass(frozen=True)
class RunSetup:
    """What a [`Callback`][eqx_ensemble.Callback] is shown before any work
    (`on_check`): `steps`, `size` (members), the `ensemble`, `evaluate_every`
    (`None`: never) and all `callbacks` in the order they run.

    **Example:**

    ```python
    class NeedsEvaluation(ee.Callback):
        def on_check(self, run):
            if run.evaluate_every is None:
                raise ValueError("NeedsEvaluation needs `fit(..., evaluate=)`")

    ens = ee.ensemble(lambda k: eqx.nn.Linear(1, 1, key=k), size=2,
                      key=jax.random.key(0))
    loss = lambda m, b, k: jnp.mean((jax.vmap(m)(b) - b) ** 2)
    try:
        ee.fit(ens, loss, optax.sgd(0.1), jnp.ones((8, 1)), steps=4,
               batch_size=4, key=jax.random.key(1), callbacks=[NeedsEvaluation()])
    except ValueError as error:
        print(error)    # raised before any work
    ```
    """

    steps: int
    size: int
    ensemble: Any
    evaluate_every: int | None
    callbacks: tuple["Callback", ...]


class RunView:
    """A [`fit`][eqx_ensemble.fit] run between two dispatches, as its
    [`Callback`][eqx_ensemble.Callback]s see it. Read:

    - `steps`, `done` (steps done), `size` (members), `resumed_from` (or `None`);
    - `losses`: the last dispatch's `(steps, members)` training losses;
    - `diverged`: each member's divergence step from 1 (`-1`: healthy);
    - `finished`: every member stopped or diverged, at least one stopped (the
      run ends after this dispatch); `last`: `steps`, or `done` when finished;
    - `train_state`, `history`, `result()`: the run so far.

    Change: `state_of(callback)` and `update(callback, train_state, state)` (a
    train state of the same structure, shapes and dtypes); `sync()`. For
    loggers and checkpoints: `run_info()`, `log_entry()` (from the `RECORD`
    phase on), `run_record()` and `data_position()`.

    **Example:**

    ```python
    class Losses(ee.Callback):
        def on_start(self, run):
            return []
        def on_dispatch(self, handle, run):
            handle.append((run.done, float(run.losses[-1].mean())))
        def on_end(self, handle, error):
            print(handle)

    ens = ee.ensemble(lambda k: eqx.nn.Linear(1, 1, key=k), size=2,
                      key=jax.random.key(0))
    loss = lambda m, b, k: jnp.mean((jax.vmap(m)(b) - b) ** 2)
    ee.fit(ens, loss, optax.sgd(0.1), jnp.ones((8, 1)), steps=4, batch_size=4,
           key=jax.random.key(1), callbacks=[Losses()])
    ```
    """

    __slots__ = ("_run",)

    def __init__(self, run: Any):
        self._run = run

    @property
    def steps(self) -> int:
        return self._run.steps

    @property
    def done(self) -> int:
        return self._run.done

    @property
    def size(self) -> int:
        return self._run.chunk.size

    @property
    def resumed_from(self) -> int | None:
        return self._run.resumed_from

    @property
    def losses(self) -> np.ndarray:
        return self._run.losses

    @property
    def diverged(self) -> np.ndarray:
        return self._run.diverged_steps()

    @property
    def finished(self) -> bool:
        return self._run.finished()

    @property
    def last(self) -> int:
        return self._run.done if self._run.finished() else self._run.steps

    @property
    def train_state(self) -> TrainState:
        return self._run.train_state

    @property
    def history(self) -> History:
        return self._run.recorder.history()

    def result(self, copy: bool = True) -> "FitResult":
        """The run so far as a `FitResult` (`copy`: safe from the next dispatch)."""
        return self._run.result(copy_state=copy)

    def state_of(self, callback: "Callback") -> PyTree[Any]:
        """`callback`'s own state (checkpointed callbacks only)."""
        return self._run.train_state.controlled[self._run.slot(callback)]

    def update(
        self, callback: "Callback", train_state: TrainState, state: PyTree[Any]
    ) -> None:
        """Replace the train state and `callback`'s own state (else `None`)."""
        self._run.update(callback, train_state, state)

    def sync(self) -> None:
        """Every callback's `on_sync` (what they wrote so far made durable)."""
        self._run.sync()

    def run_info(self) -> Any:
        """The run's description for loggers (an `ee.RunInfo`)."""
        return self._run.run_info()

    def log_entry(self) -> Any:
        """The last dispatch's `ee.LogEntry`, from the `RECORD` phase on."""
        return self._run.log_entry()

    def run_record(self) -> dict[str, Any]:
        """What identifies the run, for its checkpoints."""
        return self._run.record.as_json()

    def data_position(self) -> dict[str, Any] | None:
        """Where the run's data stands after `done` steps (for a resume)."""
        return self._run.source.position(self._run.done)


class Callback(Component):
    """A component of a [`fit`][eqx_ensemble.fit] run on the host
    (`fit(..., callbacks=[...])`). Every hook defaults to nothing.

    - `on_check(setup: RunSetup) -> None`: before any work; raise to refuse.
    - `next_stop(done) -> int | None`: the first step after `done` at which
      this callback needs the host (`None`: only at dispatch ends).
    - `on_start(run: RunView) -> handle`: before the first dispatch.
    - `on_dispatch(handle, run: RunView) -> None`: after every dispatch.
    - `on_sync(handle) -> None`: before the run is saved (make writes durable).
    - `on_end(handle, error) -> None`: when the run ends (`error`: or `None`),
      in phase order (the last checkpoint is committed before `REACT` ends).

    `phase` orders the callbacks (then the order given): `OBSERVE` (10,
    progress meters), `CHANGE` (20, controllers), `RECORD` (30, loggers),
    `SAVE` (40, checkpoints), `REACT` (50, the default). When every member
    diverged, only `OBSERVE` and `RECORD` callbacks see the dispatch, and the
    run fails. With `checkpointed = True` a callback keeps its own state in the
    train state (`init`; `RunView.state_of`); `events(state)` says what it did.
    A hook's error ends the run (as `error.result`); every started callback
    still gets `on_end`.

    **Example:** stop every member once all losses are small:

    ```python
    class StopAtLoss(ee.Callback):
        threshold: float = 0.01
        phase = ee.Callback.CHANGE

        def on_dispatch(self, handle, run):
            if run.losses[-1].max() < self.threshold:
                state = run.train_state
                stopped = jnp.full_like(state.stopped_at, run.done)
                run.update(self, eqx.tree_at(lambda s: s.stopped_at, state,
                                             stopped), None)

    ens = ee.ensemble(lambda k: eqx.nn.Linear(1, 1, key=k), size=2,
                      key=jax.random.key(0))
    x = jnp.linspace(0, 1, 8)[:, None]
    loss = lambda m, b, k: jnp.mean((jax.vmap(m)(b) - b) ** 2)
    result = ee.fit(ens, loss, optax.sgd(0.5), x, steps=2000, batch_size=8,
                    key=jax.random.key(1), callbacks=[StopAtLoss()],
                    execution=ee.Execution(steps_per_dispatch=50))
    result.history.losses.shape    # stopped early: (steps run, 2)
    ```
    """

    OBSERVE: ClassVar[int] = 10
    CHANGE: ClassVar[int] = 20
    RECORD: ClassVar[int] = 30
    SAVE: ClassVar[int] = 40
    REACT: ClassVar[int] = 50

    phase: ClassVar[int] = 50
    checkpointed: ClassVar[bool] = False

    def on_check(self, setup: RunSetup) -> None:
        """Raise before any work if this callback cannot run in `setup`."""
        del setup

    def next_stop(self, done: int) -> int | None:
        """The first step after `done` at which this callback needs the host."""
        del done
        return None

    def init(self, train_state: TrainState) -> PyTree[Any]:
        """A checkpointed callback's own state at the start (default `None`)."""
        del train_state
        return None

    def events(self, state: PyTree[Any]) -> list[dict[str, Any]]:
        """What it did, from its state: `{"step", "event", ...}` records."""
        del state
        return []

    def on_start(self, run: RunView) -> Any:
        """Called before the first dispatch; returns this callback's handle."""
        del run

    def on_dispatch(self, handle: Any, run: RunView) -> None:
        """Called after every dispatch."""
        del handle, run

    def on_sync(self, handle: Any) -> None:
        """Called before the run is saved."""
        del handle

    def on_end(self, handle: Any, error: BaseException | None) -> None:
        """Called when the run ends (`error`: what ends it, or `None`)."""
        del handle, error


class _Function(Callback):
    """A function of the `FitResult` (weakly referenced if `weak`), per dispatch."""

    target: Any
    weak: bool = False

    def on_dispatch(self, handle: Any, run: RunView) -> None:
        function = self.target() if self.weak else self.target
        function(run.result(copy=True))


# Functions wrapped once each (a Module is slow to build), held weakly.
_WRAPPED: dict[int, _Function] = {}


def _wrap(function: Callable[..., Any]) -> Callback:
    wrapped = _WRAPPED.get(id(function))
    if wrapped is not None and wrapped.target() is function:
        return wrapped
    try:
        reference = weakref.ref(function)
    except TypeError:  # a builtin: wrapped every time
        return _Function(function)
    wrapped = _Function(reference, weak=True)
    if len(_WRAPPED) > 64:
        _WRAPPED.clear()
    _WRAPPED[id(function)] = wrapped
    return wrapped


def as_callbacks(callbacks: Sequence[Any]) -> tuple[Callback, ...]:
    """`fit`'s `callbacks` as `Callback`s, sorted by `phase` (stable)."""
    if not isinstance(callbacks, Sequence) or isinstance(callbacks, str):
        raise TypeError(
            "`callbacks` must be a list (progress meters, controllers, loggers, "
            f"functions of the `FitResult`), got {type(callbacks).__name__}"
        )
    items: list[Callback] = []
    for position, item in enumerate(callbacks):
        if isinstance(item, Callback):
            items.append(item)
        elif callable(item) and not isinstance(item, eqx.Module | type):
            items.append(_wrap(item))
        else:
            raise TypeError(
                f"`callbacks[{position}]` must be an `ee.Callback` (a progress "
                "meter, a controller, a logger, or your own) or a function of the "
                f"`FitResult`, got {type(item).__name__}"
            )
    return tuple(sorted(items, key=lambda item: item.phase))


def stateful(callbacks: tuple[Callback, ...]) -> tuple[Callback, ...]:
    """The callbacks with state in the train state (`TrainState.controlled`)."""
    return tuple(item for item in callbacks if item.checkpointed)
