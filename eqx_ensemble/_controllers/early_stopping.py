"""`EarlyStopping`: stop each member whose evaluation has stopped improving."""

import dataclasses
import math
from typing import Any

import jax.numpy as jnp
import numpy as np
from jaxtyping import PyTree

from .._internal.checks import check_positive_int
from .._internal.tree import as_array
from .._training.controller import Controller
from .._training.history import History
from .._training.train_state import TrainState, member_select


class EarlyStopping(Controller):
    """Stop training a member once its evaluation score (from
    [`ee.Evaluate`][eqx_ensemble.Evaluate], lower is better) has not improved by
    more than `min_delta` for `patience` evaluations in a row (Keras' rule; a
    NaN score never improves); the others train on.

    A stopped member is frozen (`TrainState.stopped_at`) at its best weights
    (`TrainState.best_ensemble`); `FitResult.stopped` says when each stopped.
    When every member has stopped (or diverged), `fit` returns at once, with
    `result.step < steps`. A resumed run stops members exactly where the
    uninterrupted run does.

    Not restored: a stopped member's model state (`eqx.nn.State`) is the one at
    the stop, not at the best weights; a trained shared part
    (`train_shared=True`) keeps training on the other members' losses. It
    cannot be combined with [`ee.PBT`][eqx_ensemble.PBT].

    **Arguments:**

    - `every`: the evaluation period: must equal `ee.Evaluate(..., every=)`, so
      the controller runs right after each evaluation.
    - `patience`: evaluations without improvement before a member stops, `>= 1`.
    - `min_delta`: the improvement that counts, `>= 0` (in the score's units).

    A stopped member's step is skipped member by member
    (`ee.Execution(layout="sequential")`), computed and discarded vectorised;
    its later losses are recorded as NaN.

    **Example:**

    ```python
    ens = ee.ensemble(lambda k: eqx.nn.Linear(1, 1, key=k), size=3,
                      key=jax.random.key(0))
    x = jnp.linspace(0, 1, 32)[:, None]
    loss = lambda m, b, k: jnp.mean((jax.vmap(m)(b) - 2 * b) ** 2)
    result = ee.fit(ens, loss, optax.sgd(0.3), x, steps=2000, batch_size=8,
                    key=jax.random.key(1), callbacks=[ee.EarlyStopping(10, patience=3,
                                                                       min_delta=1e-4)],
                    evaluate=ee.Evaluate(loss, x, every=10))
    result.stopped             # {member: step at which it stopped}
    result.step                # < 2000: the run ended when every member stopped
    ```
    """

    every: int
    patience: int
    min_delta: float | int = 0.0

    def __check_init__(self):
        check_positive_int(self.every, "EarlyStopping.every")
        check_positive_int(self.patience, "EarlyStopping.patience")
        delta = self.min_delta
        if isinstance(delta, bool) or not isinstance(delta, int | float):
            raise TypeError(
                f"`EarlyStopping.min_delta` must be a number, got {delta!r}"
            )
        if not (math.isfinite(delta) and delta >= 0):
            raise ValueError(
                f"`EarlyStopping.min_delta` must be finite and >= 0, got {delta}"
            )

    def check(self, steps: int, evaluate_every: int | None) -> None:
        del steps
        if evaluate_every is None:
            raise ValueError(
                "`ee.EarlyStopping` stops members by their evaluation scores: pass "
                "`evaluate=ee.Evaluate(fn, data, every=...)` to `fit`"
            )
        if evaluate_every != self.every:
            raise ValueError(
                f"`ee.EarlyStopping(every={self.every})` must run after each "
                f"evaluation: give it `every={evaluate_every}`, the `every` of "
                "`ee.Evaluate`"
            )

    def init(self, train_state: TrainState) -> PyTree[Any]:
        size = int(np.shape(train_state.diverged_at)[0])
        return {
            "best": jnp.full((size,), jnp.inf, jnp.float32),
            "waited": jnp.zeros((size,), jnp.int32),
            "seen": jnp.zeros((), jnp.int32),
            "stopped_at": jnp.full((size,), -1, jnp.int32),
        }

    def events(self, state: PyTree[Any]) -> list[dict[str, Any]]:
        """A `"stopped"` record for each stopped member, at its step."""
        stopped = np.asarray(state["stopped_at"])
        return sorted(
            (
                {"step": int(step), "event": "stopped", "member": int(member)}
                for member, step in enumerate(stopped)
                if step >= 0
            ),
            key=lambda event: event["step"],
        )

    def __call__(
        self, train_state: TrainState, state: PyTree[Any], history: History
    ) -> tuple[TrainState, PyTree[Any]]:
        best = np.asarray(state["best"]).copy()
        waited = np.asarray(state["waited"]).copy()
        stopped_at = np.asarray(train_state.stopped_at).copy()
        diverged = np.asarray(train_state.diverged_at) >= 0
        seen = int(state["seen"])
        for step, scores in zip(
            history.eval_steps[seen:], history.eval_scores[seen:], strict=True
        ):
            active = (stopped_at < 0) & ~diverged
            improved = active & (scores < best - self.min_delta)
            best = np.where(improved, scores, best)
            waited = np.where(improved, 0, np.where(active, waited + 1, waited))
            stopping = active & (waited >= self.patience)
            stopped_at = np.where(stopping, int(step), stopped_at)
        newly = (stopped_at >= 0) & (np.asarray(train_state.stopped_at) < 0)
        new_state = {
            "best": as_array(best, jnp.float32),
            "waited": as_array(waited, jnp.int32),
            "seen": as_array(len(history.eval_steps), jnp.int32),
            "stopped_at": as_array(stopped_at, jnp.int32),
        }
        if not newly.any():
            return train_state, new_state
        assert train_state.best_ensemble is not None  # `check`: there is evaluation
        # Stopped members take their best weights; the others keep theirs.
        keep = as_array(~newly)
        train_state = dataclasses.replace(
            train_state,
            ensemble=member_select(
                keep, train_state.ensemble, train_state.best_ensemble
            ),
            stopped_at=as_array(stopped_at, jnp.int32),
        )
        return train_state, new_state
