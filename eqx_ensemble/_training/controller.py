"""Controllers: change a `fit` run between dispatches.

The protocol (what `fit` calls for a controller in its `callbacks=[...]`):

- `every`: the controller runs after every `every` steps (dispatches end there).
- `init(train_state) -> state`: once, before the first step (checkpointed and
  resumed with the run; a PyTree of arrays, or `None`).
- `__call__(train_state, state, history) -> (train_state, state)`: on the host,
  between dispatches, with the run's [`TrainState`][eqx_ensemble.TrainState] and
  its [`History`][eqx_ensemble.History] so far. It may return a changed train
  state (e.g. copy the weights and optimizer state of better members into worse
  ones: population-based training) as long as the structure, shapes and dtypes
  stay the same. It runs again on the same step after a resume only if that step
  was not checkpointed after it ran (checkpoints are written after controllers).
"""

import abc
from typing import Any

import equinox as eqx
from jaxtyping import PyTree

from .._internal.checks import MAX_INT32, check_positive_int
from .callback import Callback, RunSetup, RunView
from .history import History
from .train_state import TrainState


class Controller(Callback):
    """Changes a [`fit`][eqx_ensemble.fit] run between dispatches (abstract): see
    the module docs above and the guide "`fit` in detail". Subclasses set `every` and
    implement `__call__`.

    **Example:**

    ```python
    class HalveLearningRate(ee.Controller):
        every: int = 50

        def __call__(self, train_state, state, history):
            opt_state = train_state.opt_state
            halved = opt_state._replace(hyperparams={
                **opt_state.hyperparams,
                "learning_rate": opt_state.hyperparams["learning_rate"] / 2,
            })
            return eqx.tree_at(lambda t: t.opt_state, train_state, halved), state

    ens = ee.ensemble(lambda k: eqx.nn.Linear(1, 1, key=k), size=2,
                      key=jax.random.key(0))
    x = jnp.linspace(0, 1, 8)[:, None]
    loss = lambda m, b, k: jnp.mean((jax.vmap(m)(b) - 2 * b) ** 2)
    opt = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
    result = ee.fit(ens, loss, opt, x, steps=100, batch_size=4,
                    key=jax.random.key(1), callbacks=[HalveLearningRate()])
    result.opt_state.hyperparams["learning_rate"]     # 0.1 / 4 for each member
    ```
    """

    every: eqx.AbstractVar[int]

    # Its `Callback` hooks: phase `CHANGE`, its state checkpointed.
    phase = Callback.CHANGE
    checkpointed = True

    def on_check(self, setup: RunSetup) -> None:
        check_positive_int(self.every, f"{type(self).__name__}.every", high=MAX_INT32)
        self.check(setup.steps, setup.evaluate_every)
        controllers = tuple(c for c in setup.callbacks if isinstance(c, Controller))
        self.check_run(setup.ensemble, controllers)

    def on_dispatch(self, handle: Any, run: RunView) -> None:
        if self.due(run.done):
            train_state, state = self(run.train_state, run.state_of(self), run.history)
            run.update(self, train_state, state)

    def next_stop(self, done: int) -> int:
        """The first step after `done` at which this controller needs the host
        (a dispatch ends there)."""
        return (done // self.every + 1) * self.every

    def due(self, done: int) -> bool:
        """Whether this controller runs after `done` steps."""
        return done % self.every == 0

    def check(self, steps: int, evaluate_every: int | None) -> None:
        """Raise before any work if this controller cannot run in a run of
        `steps` steps evaluating every `evaluate_every` steps (`None`: no
        evaluation). Default: nothing to check."""
        del steps, evaluate_every

    def check_run(self, ens: Any, controllers: tuple["Controller", ...]) -> None:
        """Raise before any work if this controller cannot run on `ens` beside
        `controllers` (the run's controllers, itself included). Default:
        nothing to check."""
        del ens, controllers

    def init(self, train_state: TrainState) -> PyTree[Any]:
        """The controller's own state (default `None`)."""
        del train_state
        return None

    def events(self, state: PyTree[Any]) -> list[dict[str, Any]]:
        """What this controller has done so far, read from its state, as
        records with `"step"` and `"event"` (for loggers; default: none)."""
        del state
        return []

    @abc.abstractmethod
    def __call__(
        self, train_state: TrainState, state: PyTree[Any], history: History
    ) -> tuple[TrainState, PyTree[Any]]:
        """Run between dispatches; return the (possibly changed) train state and
        the controller's state."""
