"""`adversarial`: a loss plus the loss at fast-gradient-sign examples."""

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Float

from .._internal.tree import keystr


def _loss_value(out: Any) -> Any:
    return out[0] if isinstance(out, tuple) else out


class Adversarial(eqx.Module):
    """A loss with adversarial examples, made by
    [`ee.adversarial`][eqx_ensemble.adversarial]; called as the loss it wraps
    (`hyper=` passed through).

    **Example:**

    ```python
    def loss(model, batch, key):
        x, y = batch
        return jnp.mean((jax.vmap(model)(x)[:, 0] - y) ** 2)

    wrapped = ee.adversarial(loss, epsilon=0.1)       # an ee.Adversarial
    model = eqx.nn.MLP(2, 1, 8, 1, key=jax.random.key(0))
    x = jnp.ones((4, 2))
    wrapped(model, (x, jnp.zeros(4)), None)   # mean of the losses at x, x + 0.1 sign(g)
    ```
    """

    loss_fn: Callable[..., Any]
    epsilon: float | Array
    inputs: Callable[[Any], Any] | None = None

    def _inputs(self, batch: Any) -> Any:
        if self.inputs is not None:
            return self.inputs(batch)
        return batch[0] if isinstance(batch, tuple | list) else batch

    def _with_inputs(self, batch: Any, new: Any) -> Any:
        if self.inputs is not None:
            return eqx.tree_at(self.inputs, batch, new)
        if isinstance(batch, tuple | list):
            return type(batch)([new, *batch[1:]])
        return new

    def _step(self, grad: Array) -> Array:
        if not isinstance(self.epsilon, jax.Array):
            return self.epsilon * jnp.sign(grad)
        # Broadcast explicitly (rank promotion may be "raise").
        try:
            epsilon = jnp.broadcast_to(self.epsilon, grad.shape)
        except ValueError:
            raise ValueError(
                f"`epsilon` of shape {self.epsilon.shape} does not broadcast to "
                f"the perturbed inputs' shape {grad.shape} (batch first)"
            ) from None
        return epsilon * jnp.sign(grad)

    def __call__(self, model: Any, *args: Any, **kwargs: Any) -> Any:
        if len(args) not in (2, 3):
            raise TypeError(
                "`ee.adversarial` losses are called as `(model, batch, key)` or "
                f"`(model, state, batch, key)`; got {len(args) + 1} arguments"
            )
        state, (batch, key) = (args[0] if len(args) == 3 else None), args[-2:]
        stateful = len(args) == 3
        x = self._inputs(batch)
        for path, leaf in jax.tree_util.tree_flatten_with_path(x)[0]:
            if not jnp.issubdtype(jnp.result_type(leaf), jnp.floating):
                raise TypeError(
                    "adversarial examples need floating-point inputs, but input "
                    f"leaf `{keystr(path)}` has dtype {jnp.result_type(leaf)}; pick "
                    "the perturbed inputs with `inputs=`"
                )

        def loss_at(inputs):
            perturbed = self._with_inputs(batch, inputs)
            # A copy of the state: the probe must not consume the real one.
            probe_state = (jax.tree.map(lambda s: s, state),) if stateful else ()
            out = self.loss_fn(model, *probe_state, perturbed, key, **kwargs)
            return _loss_value(out)

        grads = jax.grad(loss_at)(x)
        # Fast gradient sign (Goodfellow et al. 2015), no gradient through it.
        adversarial_x = jax.lax.stop_gradient(
            jax.tree.map(
                lambda value, g: value + self._step(g).astype(value.dtype),
                x,
                grads,
            )
        )
        adversarial_batch = self._with_inputs(batch, adversarial_x)
        if not stateful:
            clean = self.loss_fn(model, batch, key, **kwargs)
            adv = self.loss_fn(model, adversarial_batch, key, **kwargs)
            if isinstance(clean, tuple):
                return ((clean[0] + _loss_value(adv)) / 2, *clean[1:])
            return (clean + _loss_value(adv)) / 2
        clean = self.loss_fn(model, state, batch, key, **kwargs)
        adv = self.loss_fn(model, clean[1], adversarial_batch, key, **kwargs)
        # The state threads through both passes (as in PyTorch).
        return ((clean[0] + adv[0]) / 2, adv[1], *clean[2:])


def adversarial(
    loss_fn: Callable[..., Any],
    *,
    epsilon: float | Float[ArrayLike, "..."],
    inputs: Callable[[Any], Any] | None = None,
) -> Adversarial:
    """Wrap a loss with fast-gradient-sign adversarial examples, as in the deep
    ensembles paper (Lakshminarayanan, Pritzel & Blundell 2017): each member's
    loss becomes `(loss(x) + loss(x + epsilon * sign(grad_x loss(x)))) / 2`, the
    perturbation computed for THAT member (the paper sums the two terms).

    **Arguments:**

    - `loss_fn`: a loss as [`fit`][eqx_ensemble.fit] takes it, for ONE model:
      `(model, batch, key)` or `(model, state, batch, key)`, returning a scalar
      or a tuple starting with it.
    - `epsilon`: the step in input units, `>= 0` and finite: a number, or an
      array broadcasting against every perturbed input leaf (the paper uses 1%
      of each dimension's range, `0.01 * (x.max(0) - x.min(0))`).
    - `inputs`: which part of the batch to perturb, as a function of the batch
      (as in `eqx.tree_at`); default: `batch[0]` for a tuple `(x, y)`, else the
      whole batch. Its leaves must be floating point.

    **Returns:**

    An [`Adversarial`][eqx_ensemble.Adversarial] loss with `loss_fn`'s calling
    convention; a model state is threaded through the clean pass, then the
    adversarial one.

    **Example:**

    ```python
    def loss(model, batch, key):
        x, y = batch
        return jnp.mean((jax.vmap(model)(x)[:, 0] - y) ** 2)

    ens = ee.ensemble(lambda k: eqx.nn.MLP(2, 1, 16, 1, key=k), size=4,
                      key=jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (64, 2))
    y = x.sum(1)
    result = ee.fit(ens, ee.adversarial(loss, epsilon=0.05), optax.adam(1e-2),
                    (x, y), steps=20, batch_size=16, key=jax.random.key(2),
                    callbacks=())
    ```
    """
    if not callable(loss_fn):
        raise TypeError(f"`loss_fn` must be callable, got {type(loss_fn).__name__}")
    if isinstance(epsilon, bool) or not isinstance(
        epsilon, int | float | np.ndarray | jax.Array
    ):
        raise TypeError(f"`epsilon` must be a number or an array, got {epsilon!r}")
    if isinstance(epsilon, np.ndarray | jax.Array):
        if not jnp.issubdtype(epsilon.dtype, jnp.floating):
            raise TypeError(f"`epsilon` must be floating point, got {epsilon.dtype}")
        values = np.asarray(epsilon)
        epsilon = jnp.asarray(epsilon)
    else:
        values = np.asarray(float(epsilon))
        epsilon = float(epsilon)
    if not (np.isfinite(values) & (values >= 0)).all():
        raise ValueError(
            f"`epsilon` must be finite and non-negative, got {values.tolist()}; it "
            "is the size of the fast-gradient-sign step in input units"
        )
    if inputs is not None and not callable(inputs):
        raise TypeError(
            "`inputs` must be a function of the batch returning the inputs to "
            f"perturb (e.g. `lambda batch: batch[0]`), got {inputs!r}"
        )
    return Adversarial(loss_fn, epsilon, inputs)
