"""Controllers: change a `fit` run between dispatches."""

import abc
from typing import Any

import equinox as eqx
from jaxtyping import PyTree

from .._internal.checks import MAX_INT32, check_positive_int
from .callback import Callback, RunSetup, RunView
from .history import History
from .train_state import TrainState


class Controller(Callback):
    """Changes a [`fit`][eqx_ensemble.fit] run between dispatches (abstract); see
    the guide "`fit` in detail".

    - `every`: it runs after every `every` steps (dispatches end there).
    - `init(train_state) -> state`: its own state (arrays or `None`), checkpointed.
    - `__call__(train_state, state, history) -> (train_state, state)`: on the
      host; it may change the [`TrainState`][eqx_ensemble.TrainState], keeping
      structure, shapes and dtypes. Checkpoints are written after it.

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
        """The first step after `done` at which this controller needs the host."""
        return (done // self.every + 1) * self.every

    def due(self, done: int) -> bool:
        """Whether this controller runs after `done` steps."""
        return done % self.every == 0

    def check(self, steps: int, evaluate_every: int | None) -> None:
        """Raise before any work if this controller cannot run for `steps` steps
        evaluating every `evaluate_every` (`None`: never)."""
        del steps, evaluate_every

    def check_run(self, ens: Any, controllers: tuple["Controller", ...]) -> None:
        """Raise before any work if this controller cannot run on `ens` beside
        `controllers` (itself included)."""
        del ens, controllers

    @abc.abstractmethod
    def __call__(
        self, train_state: TrainState, state: PyTree[Any], history: History
    ) -> tuple[TrainState, PyTree[Any]]:
        """Run between dispatches; return the train state and its own state."""
