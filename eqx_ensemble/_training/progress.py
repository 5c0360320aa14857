"""Progress meters (after Diffrax's `ProgressMeter`): how a `fit` run is shown."""

import abc
from typing import Any

import numpy as np

from .callback import Callback, RunView


class ProgressMeter(Callback):
    """Shows a [`fit`][eqx_ensemble.fit] run's progress (abstract) between
    dispatches; [`ee.ProgressBar`][eqx_ensemble.ProgressBar] is the default.

    - `start(total, done, resumed) -> handle`: before the first dispatch.
    - `update(handle, done, losses, diverged_at) -> None`: after each dispatch:
      the steps done, its `(steps, members)` losses and each member's divergence
      step, counted from 1 (`-1`: healthy).
    - `close(handle) -> None`: when the run ends, also on an error.

    A [`Callback`][eqx_ensemble.Callback] of phase `OBSERVE`.

    **Example:**

    ```python
    class Printer(ee.ProgressMeter):
        def start(self, total, done, resumed):
            return []
        def update(self, handle, done, losses, diverged_at):
            handle.append(done)
        def close(self, handle):
            print("dispatches ended at", handle)

    ens = ee.ensemble(lambda k: eqx.nn.Linear(1, 1, key=k), size=2,
                      key=jax.random.key(0))
    loss = lambda m, b, k: jnp.mean((jax.vmap(m)(b) - b) ** 2)
    ee.fit(ens, loss, optax.sgd(0.1), jnp.ones((8, 1)), steps=4, batch_size=4,
           key=jax.random.key(1), callbacks=[Printer()])
    ```
    """

    phase = Callback.OBSERVE

    def on_start(self, run: RunView) -> Any:
        return self.start(run.steps, run.done, run.resumed_from is not None)

    def on_dispatch(self, handle: Any, run: RunView) -> None:
        self.update(handle, run.done, run.losses, run.diverged)

    def on_end(self, handle: Any, error: BaseException | None) -> None:
        self.close(handle)

    @abc.abstractmethod
    def start(self, total: int, done: int, resumed: bool) -> Any:
        """Called once before the first dispatch; returns the meter's handle."""

    @abc.abstractmethod
    def update(
        self, handle: Any, done: int, losses: np.ndarray, diverged_at: np.ndarray
    ) -> None:
        """Called after every dispatch."""

    def close(self, handle: Any) -> None:
        """Called when the run ends (also when it fails)."""
        del handle


class ProgressBar(ProgressMeter):
    """`fit`'s default meter: a tqdm bar with the mean, min and max member loss
    (and how many diverged); a resumed run says so in its description.

    **Example:**

    ```python
    ens = ee.ensemble(lambda k: eqx.nn.Linear(1, 1, key=k), size=2,
                      key=jax.random.key(0))
    loss = lambda m, b, k: jnp.mean((jax.vmap(m)(b) - b) ** 2)
    ee.fit(ens, loss, optax.sgd(0.1), jnp.ones((8, 1)), steps=4, batch_size=4,
           key=jax.random.key(1), callbacks=[ee.ProgressBar()])
    ```
    """

    def start(self, total: int, done: int, resumed: bool) -> Any:
        from tqdm.auto import tqdm

        description = f"fit (resumed at step {done})" if resumed else "fit"
        return tqdm(total=total, initial=done, desc=description, unit="step")

    def update(
        self, handle: Any, done: int, losses: np.ndarray, diverged_at: np.ndarray
    ) -> None:
        handle.update(done - handle.n)
        handle.set_postfix_str(loss_summary(losses[-1], diverged_at))

    def close(self, handle: Any) -> None:
        handle.close()


def loss_summary(last_losses: np.ndarray, diverged_at: np.ndarray) -> str:
    """`loss mean=... min=... max=...` of the healthy members, and the diverged."""
    healthy = last_losses[(diverged_at < 0) & np.isfinite(last_losses)]
    text = "diverged: all"
    if healthy.size:
        text = (
            f"loss mean={healthy.mean():.4g} min={healthy.min():.4g} "
            f"max={healthy.max():.4g}"
        )
    if (diverged_at >= 0).any():
        text += f" diverged={int((diverged_at >= 0).sum())}"
    return text
