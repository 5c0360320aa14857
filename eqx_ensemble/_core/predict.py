"""`predict`: every member on a batch, in inference mode, with its own state."""

from typing import Any

import equinox as eqx
import jax
from jaxtyping import PRNGKeyArray, PyTree

from .._execution.compile import CompiledFunctions, cpu_codegen_options, filter_jit
from .._execution.execution import (
    MOVED_TO_EXECUTION,
    Execution,
    as_execution,
    refuses_moved,
)
from .._execution.layout import any_traced
from .._internal.keys import split_member_keys
from .data import check_leading, num_examples
from .ensemble import Ensemble
from .groups import join_groups
from .heterogeneous import Heterogeneous, check_group_states, per_group
from .mapping import MEMBER_NOTE, map_members, member_chunk_size


def _example_context(x: Any, example: Any) -> str:
    """The note added to an error raised by a member on one example of `x`."""
    shapes = jax.tree.map(lambda a: tuple(a.shape), eqx.filter(x, eqx.is_array))
    one = jax.tree.map(lambda a: tuple(a.shape), eqx.filter(example, eqx.is_array))
    return (
        f"{MEMBER_NOTE} a member called by `ee.predict` on ONE example of `x`: `x` has "
        f"shape {shapes}, so each example has shape {one}. `predict` maps every "
        "member over the leading (example) axis of `x`: give `x` as a batch of "
        "examples of the shape one member takes (a single example `xi`: pass "
        "`xi[None]`).)"
    )


@refuses_moved("ee.predict", {"layout": MOVED_TO_EXECUTION["layout"]})
def predict(
    ens: Ensemble | Heterogeneous,
    x: PyTree[Any],
    *,
    state: PyTree[Any] = None,
    key: PRNGKeyArray | None = None,
    chunk_size: int | None = None,
    execution: Execution | None = None,
) -> PyTree[Any]:
    """Every member's predictions on a batch, in inference mode.

    `ee.map(lambda m, xs: jax.vmap(m)(xs), ens, xs)` with each member in
    `eqx.nn.inference_mode`, compiled once per batch shape and structure (as
    `jax.jit`: a global the model reads is read when first compiled).

    **Arguments:**

    - `ens`: the ensemble.
    - `x`: a batch: an array, or a PyTree of arrays sharing a leading example axis
      (each member is called on one example, e.g. `model(x_i)`).
    - `state`: the stacked model state (`eqx.nn.State`, one per member, as `fit`
      returns it). Member `i` is called as `model(x_i, state_i)` and its first
      output is kept.
    - `key`: for stochastic models: split per member, then per example (`key=`).
    - `chunk_size`: run the members this many at a time (bounds peak memory; see
      [`ee.map`][eqx_ensemble.map]).
    - `execution`: an [`ee.Execution`][eqx_ensemble.Execution]; `predict` uses
      its `layout` and `member_chunk`, as [`ee.map`][eqx_ensemble.map] does.

    **Returns:**

    The outputs with leading axes `(members, examples, ...)`; of an
    [`ee.Heterogeneous`][eqx_ensemble.Heterogeneous] (`state`: one per group),
    as [`ee.map`][eqx_ensemble.map] joins groups.

    **Example:**

    ```python
    ens = ee.ensemble(lambda k: eqx.nn.MLP(2, 1, 8, 1, key=k), size=4,
                      key=jax.random.key(0))
    x = jnp.ones((10, 2))
    ee.predict(ens, x).shape          # (4, 10, 1)
    ```
    """
    if not isinstance(ens, Ensemble | Heterogeneous):
        raise TypeError(
            "`ee.predict` takes an `ee.Ensemble` (or an `ee.Heterogeneous`), got "
            f"{type(ens).__name__}"
        )
    num_examples(x, "x")  # checks `x`
    inference = eqx.nn.inference_mode(ens)
    stateful = state is not None
    if isinstance(ens, Heterogeneous):
        check_group_states(ens, state, "`state`")
    elif stateful:
        check_leading(state, len(ens), "`state`")
    execution = as_execution(execution, "ee.predict", ("layout", "member_chunk"))
    chunk_size = member_chunk_size(chunk_size, execution.member_chunk, len(ens))
    member_keys = None if key is None else split_member_keys(key, len(ens))
    args = (inference, x, state, member_keys, chunk_size, execution.layout)
    if any_traced(args):
        return _predict(*args)  # (inside a trace: part of the caller's program)
    try:
        return _predictors.call(*args, unhashable=_predict)
    except jax.errors.JaxRuntimeError:
        # A member's `eqx.error_if` failed: rerun op by op to raise it with a note.
        return _predict(*args)


# The member axis of `predict`'s arguments `(x, state)`, without and with state.
_AXES = {False: (None, None), True: (None, 0)}


def _one_member(stateful: bool, examples: int, x: Any) -> Any:
    """One member's predictions on the `examples` examples of `x`."""

    def one_member(member, x_arg, member_state, *, key=None):
        example_keys = None if key is None else jax.random.split(key, examples)

        def one_example(xi, example_key):
            kwargs = {} if example_key is None else {"key": example_key}
            try:
                if stateful:
                    return member(xi, member_state, **kwargs)[0]
                return member(xi, **kwargs)
            except Exception as error:
                error.add_note(_example_context(x, xi))
                raise

        return jax.vmap(one_example)(x_arg, example_keys)

    return one_member


def _predict(
    inference: Any,
    x: Any,
    state: Any,
    member_keys: Any,
    chunk_size: int | None,
    layout: str | None,
) -> Any:
    """`predict` of the inference-mode ensemble, after its checks."""
    stateful = state is not None
    one_member = _one_member(stateful, num_examples(x, "x"), x)
    if not isinstance(inference, Heterogeneous):
        return map_members(
            one_member,
            inference,
            (x, state),
            _AXES[stateful],
            chunk_size,
            None,
            layout,
            profile_owner=predict,
            member_keys=member_keys,
        )
    # Group by group: each group's state is its own (not cut from one axis).
    return join_groups(
        [
            map_members(
                one_member,
                group,
                (x, group_state),
                _AXES[stateful],
                None if chunk_size is None else min(chunk_size, len(group)),
                None,
                layout,
                profile_owner=predict,
                member_keys=None if member_keys is None else member_keys[start:stop],
            )
            for group, group_state, (start, stop) in zip(
                inference.groups,
                per_group(inference, state, "`state`"),
                inference.bounds,
                strict=True,
            )
        ]
    )


def _make_predictor(*program: Any) -> Any:
    del program  # what the function is compiled for: its key
    return filter_jit(_predict, cpu_codegen_options())


# `_predict` compiled, one function per structure, shapes and layout.
_predictors = CompiledFunctions(_make_predictor)
