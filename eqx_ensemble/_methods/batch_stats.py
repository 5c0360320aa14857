"""`recompute_batch_stats`: BatchNorm statistics for averaged or sampled weights."""

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
from jaxtyping import PyTree

from .._core.data import num_examples
from .._core.ensemble import Ensemble


def _batch_norms(model: Any) -> list[eqx.nn.BatchNorm]:
    is_bn = lambda x: isinstance(x, eqx.nn.BatchNorm)
    return [node for node in jtu.tree_leaves(model, is_leaf=is_bn) if is_bn(node)]


def _reset(state: Any, layers: list[eqx.nn.BatchNorm]) -> Any:
    for bn in layers:
        if bn.mode == "ema":
            mean, var = state.get(bn.ema_state_index)
            first = state.get(bn.ema_first_time_index)
            state = state.set(bn.ema_first_time_index, jnp.ones_like(first))
            state = state.set(
                bn.ema_state_index, (jnp.zeros_like(mean), jnp.zeros_like(var))
            )
        else:
            mean, var = state.get(bn.batch_state_index)
            counter = state.get(bn.batch_counter)
            state = state.set(bn.batch_counter, jnp.zeros_like(counter))
            state = state.set(
                bn.batch_state_index, (jnp.zeros_like(mean), jnp.zeros_like(var))
            )
    return state


def _read(state: Any, layers: list[eqx.nn.BatchNorm]) -> list[tuple[Any, Any]]:
    """Each layer's statistics of the ONE batch run from a reset state."""
    stats = []
    for bn in layers:
        if bn.mode == "ema":
            stats.append(state.get(bn.ema_state_index))  # the batch's, first time
        else:
            hidden_mean, hidden_var = state.get(bn.batch_state_index)
            scale = 1 - bn.momentum
            stats.append((hidden_mean / scale, hidden_var / scale))
    return stats


def _write(state: Any, layers: list[eqx.nn.BatchNorm], stats: list) -> Any:
    for bn, (mean, var) in zip(layers, stats, strict=True):
        if bn.mode == "ema":
            first = state.get(bn.ema_first_time_index)
            state = state.set(bn.ema_first_time_index, jnp.zeros_like(first))
            state = state.set(bn.ema_state_index, (mean, var))
        else:
            # Inference reads hidden / (1 - momentum^counter): one step's worth.
            scale = 1 - bn.momentum
            counter = state.get(bn.batch_counter)
            state = state.set(bn.batch_counter, jnp.ones_like(counter))
            state = state.set(bn.batch_state_index, (mean * scale, var * scale))
    return state


def recompute_batch_stats(
    ens: Ensemble,
    state: PyTree[Any],
    x: PyTree[Any],
    *,
    batch_size: int,
    apply: Callable[..., Any] | None = None,
) -> PyTree[Any]:
    """BatchNorm running statistics recomputed for every member's CURRENT weights
    (as PyTorch's `update_bn` does for SWA): the statistics a member's
    `eqx.nn.BatchNorm` layers hold are those of its training weights, not of
    averaged (`ee.SWA`, `ee.EMA`) or sampled (`ee.SWAG`) ones.

    Each batch of `x` is run through each member in training mode from a reset
    state; the layers' running mean and variance become the average over the
    batches of the batch means and variances, weighted by batch size (the
    variance is the mean of the per-batch variances, as in PyTorch). Both
    `eqx.nn.BatchNorm` modes (`"ema"` and `"batch"`) are handled; inference then
    uses exactly these statistics.

    **Arguments:**

    - `ens`: the ensemble whose statistics to recompute (e.g. `result.tracked[0]`).
    - `state`: its stacked model state (from `ee.ensemble` of
      `eqx.nn.make_with_state`, or `FitResult.state`).
    - `x`: the inputs (training data), a batch with a leading example axis.
    - `batch_size`: examples per batch (the last batch may be smaller).
    - `apply`: `apply(model, x_batch, state) -> new_state` for ONE member in
      training mode; default `jax.vmap(model, axis_name=<the BatchNorm layers'
      axis name>, in_axes=(0, None), out_axes=(0, None))(x_batch, state)[1]`.

    **Returns:**

    The new stacked state.

    **Example:**

    ```python
    def make(key):
        return eqx.nn.make_with_state(eqx.nn.Sequential)([
            eqx.nn.Linear(3, 8, key=key),
            eqx.nn.BatchNorm(8, axis_name="batch", mode="batch"),
        ])

    ens, state = ee.ensemble(make, size=2, key=jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (100, 3))
    state = ee.recompute_batch_stats(ens, state, x, batch_size=25)
    ```
    """
    if not isinstance(ens, Ensemble):
        raise TypeError(f"expected an `ee.Ensemble`, got {type(ens).__name__}")
    if (
        isinstance(batch_size, bool)
        or not isinstance(batch_size, int)
        or batch_size < 1
    ):
        raise ValueError(f"`batch_size` must be a positive int, got {batch_size!r}")
    layers = _batch_norms(ens[0])
    if not layers:
        raise ValueError(
            "`recompute_batch_stats`: the members have no `eqx.nn.BatchNorm` layer"
        )
    n = num_examples(x, "x")
    axis_name = layers[0].axis_name

    def default_apply(model, xb, member_state):
        return jax.vmap(
            model, axis_name=axis_name, in_axes=(0, None), out_axes=(0, None)
        )(xb, member_state)[1]

    run = default_apply if apply is None else apply

    @eqx.filter_jit
    def batch_stats(ens, state, xb):
        def one(member, member_state):
            model = ens.member(member)
            fresh = _reset(member_state, _batch_norms(model))
            return _read(run(model, xb, fresh), _batch_norms(model))

        return eqx.filter_vmap(one)(ens.members, state)

    totals = None
    for start in range(0, n, batch_size):
        xb = jax.tree.map(lambda a: a[start : start + batch_size], x)
        weight = min(batch_size, n - start) / n
        stats = batch_stats(ens, state, xb)
        scaled = jax.tree.map(lambda s: weight * s, stats)
        totals = scaled if totals is None else jax.tree.map(jnp.add, totals, scaled)

    @eqx.filter_jit
    def write(ens, state, totals):
        def one(member, member_state, member_totals):
            return _write(member_state, _batch_norms(ens.member(member)), member_totals)

        return eqx.filter_vmap(one)(ens.members, state, totals)

    return write(ens, state, totals)
