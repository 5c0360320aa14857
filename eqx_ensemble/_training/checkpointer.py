"""What `fit` calls of its `checkpoints=` component (`ee.Checkpoints` is it)."""

import abc
from typing import Any, ClassVar

import equinox as eqx

from .._internal.component import Component
from .history import History
from .train_state import TrainState


class Checkpointer(Component):
    """The protocol of `fit(..., checkpoints=)`, on the host: before the first
    step `prepare()`, `has_checkpoints()` and `resume(...)`; at a dispatch's end
    `next_stop(done)`, `due(done, steps)` and `save(...)`. `save` returns a
    handle for a write still in progress (`wait()`, waited for before the
    next save and at the run's end; `abandon()`, when the run fails first;
    `path`, named in errors), or anything else. A failure
    is an `OSError` or an `error`, which `fit` raises as an `error` with the
    trained run attached."""

    directory: eqx.AbstractVar[Any]
    error: ClassVar[type[Exception]] = OSError

    @abc.abstractmethod
    def prepare(self) -> None:
        """Check, before any work, that checkpoints can be written."""

    @abc.abstractmethod
    def has_checkpoints(self) -> bool:
        """Whether there is a checkpoint to resume from."""

    @abc.abstractmethod
    def resume(
        self, template: TrainState, run: Any, steps: int | None
    ) -> tuple[TrainState, History, Any] | None:
        """The newest checkpoint of this run as `(train_state, history, data)`
        (`None`: none)."""

    @abc.abstractmethod
    def next_stop(self, done: int) -> int | None:
        """The first step after `done` at which a checkpoint is due (`None`: at
        the end only)."""

    @abc.abstractmethod
    def due(self, done: int, steps: int) -> bool:
        """Whether to save after `done` of `steps` steps."""

    @abc.abstractmethod
    def save(
        self,
        train_state: TrainState,
        history: History,
        run: dict[str, Any],
        data: dict[str, Any] | None = None,
    ) -> Any:
        """Write the run at its current step."""
