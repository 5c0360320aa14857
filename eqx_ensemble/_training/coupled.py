"""Objectives over all members at once: `Coupled` losses and distillation."""

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import PyTree


class Coupled(eqx.Module):
    """A loss over ALL members at once, for objectives that couple them
    (negative correlation learning, diversity terms): the explicit opt-in as
    `fit`'s or `make_step`'s `loss_fn`; every other loss is for ONE member.

    `fn(ensemble, batch, keys, **kwargs)` gets the current
    [`Ensemble`][eqx_ensemble.Ensemble], the batch (with a member axis under
    `ee.Independent()`), one PRNG key per member, and `hyper=` when given. It
    returns one loss per member, `(members,)`, or a scalar total. The SUM is
    differentiated jointly; each member then takes its own optimizer step (and
    keeps its own divergence isolation). `shared_batch=True`: `fn` reads ONE
    batch for all members (`fit` refuses a per-member sampling). Model state
    (`state=`) is not supported.

    **Example:** negative correlation learning (Liu & Yao 1999): member `i`
    minimises `(f_i - y)^2 / 2 - lam (f_i - f_mean)^2 / 2`, the mean held fixed:

    ```python
    def ncl(ens, batch, keys, lam=0.5):
        x, y = batch
        f = ee.map(lambda m, xs: jax.vmap(m)(xs)[:, 0], ens, x)   # (members, batch)
        mean = jax.lax.stop_gradient(f.mean(0))
        return jnp.mean(0.5 * (f - y[None]) ** 2 - 0.5 * lam * (f - mean[None]) ** 2,
                        axis=1)

    ens = ee.ensemble(lambda k: eqx.nn.MLP(1, 1, 16, 1, key=k), size=4,
                      key=jax.random.key(0))
    x = jnp.linspace(-1, 1, 32)[:, None]
    result = ee.fit(ens, ee.Coupled(ncl), optax.adam(1e-2), (x, jnp.sin(3 * x[:, 0])),
                    steps=50, batch_size=16, key=jax.random.key(1), callbacks=())
    ```
    """

    fn: Callable[..., Any]
    shared_batch: bool = eqx.field(default=False, static=True)

    def __check_init__(self):
        if not callable(self.fn):
            raise TypeError(f"`Coupled` needs a function, got {self.fn!r}")

    def __call__(self, ensemble: Any, batch: Any, keys: Any, **kwargs: Any) -> Any:
        return self.fn(ensemble, batch, keys, **kwargs)


def coupled_losses(
    loss: Coupled, ensemble: Any, batch: Any, keys: Any, hyper: Any, frozen: Any
):
    """The per-member losses `(members,)` and the differentiated objective (the
    sum over members not `frozen`, or the scalar total)."""
    size = len(ensemble)
    kwargs = {} if hyper is None else {"hyper": hyper}
    out = loss(ensemble, batch, keys, **kwargs)
    if isinstance(out, tuple | list | dict):
        raise TypeError(
            "an `ee.Coupled` loss must return the members' losses (an array of "
            f"shape ({size},)) or their scalar total, got a {type(out).__name__}; "
            "a coupled loss has no `aux` (record extra values with `ee.Evaluate`)"
        )
    value = jnp.asarray(out)
    if not jnp.issubdtype(value.dtype, jnp.floating):
        raise TypeError(
            "an `ee.Coupled` loss must return floating-point losses (integers "
            f"have no gradient), got dtype {value.dtype}"
        )
    if value.shape == ():
        return jnp.broadcast_to(value, (size,)), value
    if value.shape != (size,):
        raise ValueError(
            "an `ee.Coupled` loss must return a scalar total or one loss per member, "
            f"shape ({size},); got shape {value.shape}"
        )
    return value, jnp.sum(jnp.where(frozen, 0.0, value))


def distillation_loss(
    teacher: Any,
    *,
    temperature: float = 1.0,
    inputs: Callable[[Any], Any] | None = None,
    state: PyTree[Any] = None,
) -> Callable[..., Any]:
    """A loss that trains a student to match an ensemble's mean prediction
    (Hinton, Vinyals & Dean 2015): the KL divergence from the teacher's mean
    probabilities at `temperature` to the student's, times `temperature^2`,
    averaged over the batch. The teacher is frozen (in inference mode).

    **Arguments:**

    - `teacher`: an [`Ensemble`][eqx_ensemble.Ensemble] (or
      [`Heterogeneous`][eqx_ensemble.Heterogeneous]) returning logits.
    - `temperature`: softens both distributions, `> 0`.
    - `inputs`: picks the inputs from a batch (default: `batch[0]` of a tuple,
      else the batch).
    - `state`: the teacher's stacked model state, for stateful teachers.

    **Returns:**

    `loss(student, batch, key) -> scalar`, as `ee.fit` takes it.

    **Example:**

    ```python
    teacher = ee.ensemble(lambda k: eqx.nn.MLP(4, 3, 32, 2, key=k), size=5,
                          key=jax.random.key(0))
    student = ee.ensemble(lambda k: eqx.nn.MLP(4, 3, 16, 1, key=k), size=1,
                          key=jax.random.key(1))
    x = jax.random.normal(jax.random.key(2), (128, 4))
    result = ee.fit(student, ee.distillation_loss(teacher, temperature=2.0),
                    optax.adam(1e-2), x, steps=100, batch_size=32,
                    key=jax.random.key(3), callbacks=())
    distilled = result.ensemble[0]
    ```
    """
    from .._core.heterogeneous import is_ensemble
    from .._core.predict import predict

    if not is_ensemble(teacher):
        raise TypeError(
            "`teacher` must be an `ee.Ensemble` or an `ee.Heterogeneous`, got "
            f"{type(teacher).__name__}"
        )
    if isinstance(temperature, bool) or not isinstance(temperature, int | float):
        raise TypeError(f"`temperature` must be a number, got {temperature!r}")
    if not temperature > 0 or temperature == float("inf"):
        raise ValueError(
            f"`temperature` must be positive and finite, got {temperature}"
        )
    t = float(temperature)

    def pick(batch):
        if inputs is not None:
            return inputs(batch)
        return batch[0] if isinstance(batch, tuple | list) else batch

    def loss(student, batch, key):
        del key
        x = pick(batch)
        teacher_logits = predict(teacher, x, state=state)
        if isinstance(teacher_logits, tuple):  # a Heterogeneous's groups disagree
            raise ValueError(
                "the teacher's groups return logits of different shapes "
                f"{[tuple(g.shape) for g in teacher_logits]}; every member of a "
                "teacher must return `(batch, classes)` logits for the same classes"
            )
        teacher_logits = jax.lax.stop_gradient(teacher_logits)
        teacher_log_probs = jax.nn.log_softmax(teacher_logits / t, axis=-1)
        # The mean of the members' probabilities.
        target = jax.nn.logsumexp(teacher_log_probs, axis=0) - jnp.log(
            teacher_logits.shape[0]
        )
        student_log_probs = jax.nn.log_softmax(jax.vmap(student)(x) / t, axis=-1)
        kl = jnp.sum(jnp.exp(target) * (target - student_log_probs), axis=-1)
        return t**2 * jnp.mean(kl)

    return loss
