"""`History`: the per-member record of a run, and its host-side recorder."""

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class History:
    """Per-member training history.

    - `losses`: `(steps, members)` training losses (row `t - 1` is step `t`;
      NaN once a member has diverged or stopped).
    - `eval_steps`: `(evaluations,)` the step count after which each evaluation ran.
    - `eval_scores`: `(evaluations, members)` each member's evaluation score.

    **Example:**

    ```python
    ens = ee.ensemble(lambda k: eqx.nn.Linear(1, 1, key=k), size=2,
                      key=jax.random.key(0))
    x = jnp.linspace(0, 1, 8)[:, None]
    loss = lambda m, b, k: jnp.mean((jax.vmap(m)(b) - 2 * b) ** 2)
    history = ee.fit(ens, loss, optax.sgd(0.1), x, steps=5, batch_size=4,
                     key=jax.random.key(1), callbacks=()).history
    history.losses.shape        # (5, 2): one loss per step per member
    ```
    """

    losses: np.ndarray
    eval_steps: np.ndarray
    eval_scores: np.ndarray


class Recorder:
    """Collects what each dispatch reports (host side) into a `History`."""

    def __init__(self, size: int, history: History | None = None):
        self.size = size
        self.losses: list[np.ndarray] = []
        self.eval_steps: list[int] = []
        self.eval_scores: list[np.ndarray] = []
        if history is not None:
            self.losses.append(np.asarray(history.losses))
            self.eval_steps.extend(int(s) for s in history.eval_steps)
            self.eval_scores.extend(np.asarray(history.eval_scores))

    def record(
        self,
        losses: np.ndarray,
        scores: np.ndarray | None,
        first_step: int,
        every: int | None,
    ) -> None:
        """A dispatch's losses and scores (`first_step` 0-based; an evaluation
        ran after step `s` when `s % every == 0`)."""
        self.losses.append(losses)
        if scores is None or every is None:
            return
        for offset in range(losses.shape[0]):
            done = first_step + offset + 1
            if done % every == 0:
                self.eval_steps.append(done)
                self.eval_scores.append(scores[offset])

    def history(self) -> History:
        empty = np.zeros((0, self.size), dtype=np.float32)
        losses = (
            np.concatenate(self.losses).astype(np.float32) if self.losses else empty
        )
        scores = (
            np.stack(self.eval_scores).astype(np.float32) if self.eval_scores else empty
        )
        return History(
            losses=losses,
            eval_steps=np.asarray(self.eval_steps, dtype=np.int64),
            eval_scores=scores,
        )
