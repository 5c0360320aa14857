"""The loss a user writes, as the library calls it: the signature check before
any work, the call for one member, and the split of what it returns."""

import inspect
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, PyTree


def _split_loss_output(out: Any, stateful: bool) -> tuple[Array, Any, Any]:
    if stateful:
        if not isinstance(out, tuple) or len(out) not in (2, 3):
            raise TypeError(
                "With a model state, `loss_fn(model, state, batch, key)` must return "
                "`(loss, new_state)` or `(loss, new_state, aux)`; got "
                f"{type(out).__name__}"
            )
        loss, new_state = out[0], out[1]
        aux = out[2] if len(out) == 3 else None
    else:
        if isinstance(out, tuple):
            if len(out) != 2:
                raise TypeError(
                    "`loss_fn(model, batch, key)` must return a scalar loss or "
                    f"`(loss, aux)`; got a tuple of length {len(out)}"
                )
            loss, aux = out
        else:
            loss, aux = out, None
        new_state = None
    loss = jnp.asarray(loss)
    if loss.shape != ():
        raise ValueError(
            "`loss_fn` must return a scalar loss for ONE model (the library vmaps "
            f"over members), but it returned a loss of shape {tuple(loss.shape)}; "
            "reduce it, e.g. with `.mean()`"
        )
    if not jnp.issubdtype(loss.dtype, jnp.floating):
        raise TypeError(f"`loss_fn` must return a floating loss, got {loss.dtype}")
    return loss, aux, new_state


def loss_context(batch: PyTree[Any]) -> str:
    """The note added to an error raised inside `loss_fn`."""
    shapes = jax.tree.map(lambda x: tuple(x.shape), eqx.filter(batch, eqx.is_array))
    return (
        "(raised inside `loss_fn`, traced for ONE member: the library vmaps over "
        "members, so `model` is a single model and `batch` holds the whole "
        f"minibatch, with shapes {shapes}. A model takes ONE example: map it over "
        "the batch with `jax.vmap(model)(x)`.)"
    )


def call_loss(
    loss_fn: Callable[..., Any], model: Any, state: Any, batch: Any, key: Any
) -> tuple[Array, Any, Any]:
    """`loss_fn` on one member, split into `(loss, aux, new_state)`; an error raised
    inside it gets a note saying what the library passed."""
    stateful = state is not None
    try:
        if stateful:
            out = loss_fn(model, state, batch, key)
        else:
            out = loss_fn(model, batch, key)
    except Exception as error:
        error.add_note(loss_context(batch))
        raise
    return _split_loss_output(out, stateful)


def check_loss_signature(loss_fn: Callable[..., Any], stateful: bool) -> None:
    """Raise before any work if `loss_fn` cannot be called the way the library
    calls it: `(model, batch, key)`, or `(model, state, batch, key)` with a model
    state."""
    if not callable(loss_fn):
        raise TypeError(f"`loss_fn` must be callable, got {type(loss_fn).__name__}")
    try:
        signature = inspect.signature(loss_fn)
    except (TypeError, ValueError):
        return  # builtins and some C callables: the call itself will tell

    def takes(count: int) -> bool:
        try:
            signature.bind(*range(count))
        except TypeError:
            return False
        return True

    if stateful and not takes(4):
        raise TypeError(
            "A model state was given (`state=`), so `loss_fn` is called as "
            "`loss_fn(model, state, batch, key)` and must return `(loss, new_state)` "
            f"or `(loss, new_state, aux)`; but its signature is {signature}. Add the "
            "`state` argument, or drop `state=` for a model without state."
        )
    if not stateful and not takes(3):
        hint = (
            " It looks like a loss for a model with state: pass the stacked model "
            "state with `state=` (from `ee.ensemble` of `eqx.nn.make_with_state`)."
            if takes(4)
            else ""
        )
        raise TypeError(
            "`loss_fn` is called as `loss_fn(model, batch, key)` and must return a "
            f"scalar loss or `(loss, aux)`; but its signature is {signature}.{hint}"
        )


def check_optimizer(optimizer: Any) -> None:
    """An `optax.GradientTransformation`, or a clear error naming what was given."""
    if not (
        callable(getattr(optimizer, "init", None))
        and callable(getattr(optimizer, "update", None))
    ):
        raise TypeError(
            "`optimizer` must be an `optax.GradientTransformation` (e.g. "
            f"`optax.adam(1e-3)`), got {optimizer!r}"
        )
