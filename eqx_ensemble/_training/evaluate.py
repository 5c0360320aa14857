"""`Evaluate`: score every member on held-out data inside the compiled loop."""

import inspect
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, Key, PRNGKeyArray, PyTree, UInt32

from .._core.heterogeneous import group_parts, joined
from .._execution.layout import Layout, member_map
from .._internal.checks import MAX_INT32, check_positive_int
from .._internal.component import Component


class Evaluate(Component):
    """Evaluate every member every `every` steps, inside the compiled loop.

    `fn` has the loss's signature, `fn(model, [state,] data, key)`, and returns
    a scalar score (lower is better) or a tuple starting with it (so the loss
    itself can be passed). Each member's best parameters are kept in
    `FitResult.best_ensemble`, the scores in `FitResult.history`.

    **Arguments:**

    - `fn`: the score of ONE model.
    - `data`: the evaluation data (any PyTree), shared by members.
    - `every`: evaluate after every `every` steps.
    - `inference`: call `fn` on `eqx.nn.inference_mode(model)` (default `True`).

    Member `i`'s key after step `s` is
    `split(fold_in(fold_in(key, 3), s), size)[i]` for `fit`'s `key`.

    **Example:**

    ```python
    ens = ee.ensemble(lambda k: eqx.nn.Linear(1, 1, key=k), size=2,
                      key=jax.random.key(0))
    x = jnp.linspace(0, 1, 8)[:, None]
    loss = lambda m, b, k: jnp.mean((jax.vmap(m)(b) - 2 * b) ** 2)
    result = ee.fit(ens, loss, optax.sgd(0.1), x, steps=10, batch_size=4,
                    key=jax.random.key(1), callbacks=(),
                    evaluate=ee.Evaluate(loss, x[:4], every=5))
    result.history.eval_scores.shape     # (2, 2): 2 evaluations x 2 members
    result.best_step                     # per member, the step of its best score
    ```
    """

    fn: Callable[..., Any]
    data: PyTree[Any]
    every: int = eqx.field(static=True)
    inference: bool = eqx.field(static=True, default=True)

    def __check_init__(self):
        if not callable(self.fn):
            raise TypeError(
                f"`Evaluate`'s `fn` must be callable, got {type(self.fn).__name__}"
            )
        check_positive_int(self.every, "Evaluate.every", high=MAX_INT32)
        if not isinstance(self.inference, bool):
            raise TypeError(
                "`Evaluate.inference` must be a bool, got "
                f"{type(self.inference).__name__}"
            )

    def check(self, stateful: bool) -> None:
        """Raise unless `fn` takes `(model, [state,] data, key)`."""
        try:
            signature = inspect.signature(self.fn)
        except (TypeError, ValueError):  # builtins: the call itself will tell
            return
        count = 4 if stateful else 3
        try:
            signature.bind(*range(count))
        except TypeError:
            call = "fn(model, state, data, key)" if stateful else "fn(model, data, key)"
            raise TypeError(
                f"`Evaluate`'s `fn` is called as `{call}` (the loss's signature) "
                f"and returns a scalar score; but its signature is {signature}. "
                "Add the missing arguments (a function of `(model, data)` from "
                "round 1 takes a `key` now: `lambda model, data, key: ...`)"
            ) from None

    def next_stop(self, done: int) -> int:
        """The first step after `done` at which an evaluation is due."""
        return (done // self.every + 1) * self.every

    def due(self, done: Int[Array, ""]) -> Bool[Array, ""]:
        """Whether an evaluation runs after `done` steps."""
        return done % self.every == 0

    def scores(
        self,
        ensemble: Any,
        model_state: PyTree[Any],
        member_keys: Key[Array, " members"] | UInt32[Array, " members 2"],
        layout: Layout = "vmap",
        member_chunk: int | None = None,
        devices: int = 1,
    ) -> Float[Array, " members"]:
        """Every member's score (member `i` with `member_keys[i]`), laid out as
        the training step; a heterogeneous ensemble group by group."""
        parts = group_parts(ensemble, model_state, members=(member_keys,))
        scores = [
            self._group_scores(group, state, keys, layout, member_chunk, devices)
            for group, state, keys in parts
        ]
        return joined(ensemble, scores, jnp.concatenate)

    def _group_scores(
        self,
        ensemble: Any,
        model_state: PyTree[Any],
        member_keys: Any,
        layout: Layout,
        member_chunk: int | None,
        devices: int,
    ) -> Any:
        stateful = model_state is not None

        def one(member, state, member_key):
            member = ensemble.member(member)  # with the shared part, if any
            model = eqx.nn.inference_mode(member) if self.inference else member
            if stateful:
                out = self.fn(model, state, self.data, member_key)
            else:
                out = self.fn(model, self.data, member_key)
            score = out[0] if isinstance(out, tuple) else out
            if jnp.shape(score) != ():
                raise ValueError(
                    "`Evaluate`'s `fn` must return a scalar score for ONE model (the "
                    f"library vmaps over members), got shape {jnp.shape(score)}"
                )
            return jnp.asarray(score, dtype=jnp.float32)

        in_axes = (eqx.if_array(0),) * 3
        return member_map(
            one, in_axes, layout, len(member_keys), member_chunk, devices
        )(ensemble.members, model_state, member_keys)


def eval_member_keys(key: PRNGKeyArray, done: Int[Array, ""], size: int) -> Any:
    """The members' keys of the evaluation after `done` steps."""
    return jax.random.split(jax.random.fold_in(key, done), size)
