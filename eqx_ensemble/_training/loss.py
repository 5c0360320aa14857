"""The user's loss as the library calls it: signature check, call, output split."""

import inspect
import weakref
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, PyTree

from .._execution.profile import StepProfile, profile_call
from .._internal.tree import is_traced

# A loss function, or (for an `ee.Heterogeneous`) a tuple with one per group.
LossFn = Callable[..., Any] | tuple[Callable[..., Any], ...]


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
    loss_fn: Callable[..., Any],
    model: Any,
    state: Any,
    batch: Any,
    key: Any,
    hyper: Any = None,
) -> tuple[Array, Any, Any]:
    """`loss_fn` on one member as `(loss, aux, new_state)`; errors get a note."""
    stateful = state is not None
    kwargs = {} if hyper is None else {"hyper": hyper}
    try:
        if stateful:
            out = loss_fn(model, state, batch, key, **kwargs)
        else:
            out = loss_fn(model, batch, key, **kwargs)
    except Exception as error:
        error.add_note(loss_context(batch))
        raise
    return _split_loss_output(out, stateful)


# The (stateful, with_hyper) calls each loss was checked for, weakly keyed.
_CHECKED: "weakref.WeakKeyDictionary[Any, set[tuple[bool, bool]]]" = (
    weakref.WeakKeyDictionary()
)


def check_loss_signature(
    loss_fn: Callable[..., Any], stateful: bool, with_hyper: bool = False
) -> None:
    """Raise unless `loss_fn` takes `(model, [state,] batch, key[, hyper=])`."""
    try:
        if (stateful, with_hyper) in _CHECKED.get(loss_fn, ()):
            return
    except TypeError:  # not weakly referable, or unhashable
        pass
    _check_loss_signature(loss_fn, stateful, with_hyper)
    try:
        _CHECKED.setdefault(loss_fn, set()).add((stateful, with_hyper))
    except TypeError:
        pass


def _check_loss_signature(
    loss_fn: Callable[..., Any], stateful: bool, with_hyper: bool
) -> None:
    if not callable(loss_fn):
        raise TypeError(f"`loss_fn` must be callable, got {type(loss_fn).__name__}")
    try:
        signature = inspect.signature(loss_fn)
    except (TypeError, ValueError):
        return  # builtins and some C callables: the call itself will tell

    def takes(count: int, hyper: bool = False) -> bool:
        try:
            signature.bind(*range(count), **({"hyper": None} if hyper else {}))
        except TypeError:
            return False
        return True

    def arity(count: int) -> bool:  # the positional arguments, whatever `hyper`
        return takes(count) or takes(count, hyper=True)

    count = 4 if stateful else 3
    if stateful and not arity(4):
        raise TypeError(
            "A model state was given (`state=`), so `loss_fn` is called as "
            "`loss_fn(model, state, batch, key)` and must return `(loss, new_state)` "
            f"or `(loss, new_state, aux)`; but its signature is {signature}. Add the "
            "`state` argument, or drop `state=` for a model without state."
        )
    if not stateful and not arity(3):
        hint = (
            " It looks like a loss for a model with state: pass the stacked model "
            "state with `state=` (from `ee.ensemble` of `eqx.nn.make_with_state`)."
            if arity(4)
            else ""
        )
        raise TypeError(
            "`loss_fn` is called as `loss_fn(model, batch, key)` and must return a "
            f"scalar loss or `(loss, aux)`; but its signature is {signature}.{hint}"
        )
    if with_hyper and not takes(count, hyper=True):
        raise TypeError(
            "`hyper=` was given, so `loss_fn` is called with the keyword argument "
            "`hyper` (this member's slice of the hyperparameters); but its signature "
            f"is {signature}. Add a `hyper` parameter, e.g. "
            "`def loss_fn(model, batch, key, *, hyper): ...`"
        )
    if not with_hyper and not takes(count):
        raise TypeError(
            f"`loss_fn` requires a `hyper` argument (its signature is {signature}), "
            "but no `hyper=` was given: pass the per-member hyperparameters with "
            "`hyper=`"
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


def check_hyper(hyper: PyTree[Any], size: int) -> None:
    """Raise unless `hyper` is finite real arrays with a leading axis of `size`."""
    leaves = jax.tree_util.tree_flatten_with_path(hyper)[0]
    if not leaves:
        raise ValueError("`hyper` holds no arrays; pass a PyTree of arrays or None")
    for path, leaf in leaves:
        where = f"`hyper` leaf `{jax.tree_util.keystr(path)}`"
        if not eqx.is_array(leaf) and not hasattr(leaf, "dtype"):
            raise TypeError(
                f"{where} is a {type(leaf).__name__}; each hyperparameter must be an "
                f"array with one value per member, e.g. `jnp.full({size}, value)`"
            )
        if leaf.ndim == 0 or leaf.shape[0] != size:
            raise ValueError(
                f"{where} has shape {tuple(leaf.shape)}, but its leading axis must be "
                f"the ensemble size {size} (one value per member)"
            )
        if not (
            jnp.issubdtype(leaf.dtype, jnp.floating)
            or jnp.issubdtype(leaf.dtype, jnp.integer)
            or leaf.dtype == bool
        ):
            raise TypeError(f"{where} has dtype {leaf.dtype}; use real numbers")
        if not is_traced(leaf) and not bool(jnp.all(jnp.isfinite(jnp.asarray(leaf)))):
            raise ValueError(f"{where} holds non-finite values: {leaf}")


def profile_step(
    loss_fn: Callable[..., Any],
    member: Any,
    batch: PyTree[Any],
    state: PyTree[Any] = None,
    hyper: PyTree[Any] = None,
) -> StepProfile:
    """The profile of `loss_fn` on one member and one batch (shapes only)."""

    def loss(model: Any, batch: Any, state: Any, hyper: Any) -> Any:
        return call_loss(loss_fn, model, state, batch, jax.random.key(0), hyper)[0]

    return profile_call(loss, (member, batch, state, hyper), owner=loss_fn)
