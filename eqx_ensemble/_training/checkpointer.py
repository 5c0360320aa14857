"""What `fit` calls of its `checkpoints=` component (`ee.Checkpoints` is it)."""

import abc
from typing import Any, ClassVar

import equinox as eqx

from .callback import Callback, RunView
from .history import History
from .train_state import TrainState


class Checkpointer(Callback):
    """The protocol of `fit(..., checkpoints=)`. `save` may return a pending write
    (`wait()`, `abandon()`, `path`); its `OSError` or `error` is raised as `error`."""

    directory: eqx.AbstractVar[Any]
    error: ClassVar[type[Exception]] = OSError

    phase = Callback.SAVE

    def on_start(self, run: RunView) -> list[Any]:
        return [None]  # a write still in progress

    def on_dispatch(self, handle: list[Any], run: RunView) -> None:
        if not self.due(run.done, run.last):
            return
        run.sync()  # the logs reach this step before the checkpoint
        self._wait(handle)
        try:
            saved = self.save(
                run.train_state, run.history, run.run_record(), run.data_position()
            )
        except (OSError, self.error) as error:
            raise self.error(
                f"Writing the checkpoint of step {run.done} to {self.directory} "
                f"failed ({error}); the trained run is attached to this error as "
                "`error.result`"
            ) from error
        if callable(getattr(saved, "wait", None)):
            handle[0] = saved

    def on_end(self, handle: list[Any], error: BaseException | None) -> None:
        if error is None:
            self._wait(handle)
        elif handle[0] is not None:  # the run failed first: the write ends
            pending, handle[0] = handle[0], None
            failed = pending.abandon()
            if failed is not None:
                error.add_note(f"(the checkpoint being written failed: {failed})")

    def _wait(self, handle: list[Any]) -> None:
        """Wait until a checkpoint written in the background is committed."""
        pending, handle[0] = handle[0], None
        if pending is None:
            return
        try:
            pending.wait()
        except (OSError, self.error) as error:
            raise self.error(
                f"Writing the checkpoint {pending.path.name} to {self.directory} "
                f"in the background failed ({error}); the trained run is attached "
                "to this error as `error.result`"
            ) from error

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
        """The newest checkpoint as `(train_state, history, data)`, or `None`."""

    @abc.abstractmethod
    def next_stop(self, done: int) -> int | None:
        """The first step after `done` with a checkpoint due (`None`: the end)."""

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
