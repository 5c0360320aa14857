"""BatchNorm statistics: recomputed for averaged or sampled weights
(`recompute_batch_stats`), and drawn from random training batches to make an
ensemble of one model (`mc_batchnorm`, MC BatchNorm)."""

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jaxtyping import PRNGKeyArray, PyTree

from .._core.data import num_examples
from .._core.ensemble import Ensemble
from .._internal.checks import check_positive_int
from .._internal.keys import check_key
from .._internal.tree import is_traced


def _is_bn(node: Any) -> bool:
    return isinstance(node, eqx.nn.BatchNorm)


def _batch_norms(model: Any) -> list[eqx.nn.BatchNorm]:
    return [node for node in jtu.tree_leaves(model, is_leaf=_is_bn) if _is_bn(node)]


def _training_pass(axis_name: Any) -> Callable[..., Any]:
    """`apply`'s default: one model on a batch in training mode, its new state."""

    def apply(model, xb, member_state):
        return jax.vmap(
            model, axis_name=axis_name, in_axes=(0, None), out_axes=(0, None)
        )(xb, member_state)[1]

    return apply


def _reset(state: Any, layers: list[eqx.nn.BatchNorm]) -> Any:
    for bn in layers:
        ema = bn.mode == "ema"
        stats_index = bn.ema_state_index if ema else bn.batch_state_index
        # "ema": the first-time flag set; "batch": the step counter at 0.
        flag_index = bn.ema_first_time_index if ema else bn.batch_counter
        mean, var = state.get(stats_index)
        flag = state.get(flag_index)
        state = state.set(flag_index, (jnp.ones_like if ema else jnp.zeros_like)(flag))
        state = state.set(stats_index, (jnp.zeros_like(mean), jnp.zeros_like(var)))
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
    (as PyTorch's `update_bn` for SWA), e.g. averaged (`ee.SWA`, `ee.EMA`) or
    sampled (`ee.SWAG`) ones.

    Each batch of `x` runs through each member in training mode from a reset
    state; the running mean and variance become the batch-size-weighted average
    of the batch means and variances, which inference then uses (both
    `eqx.nn.BatchNorm` modes).

    **Arguments:**

    - `ens`: the ensemble (e.g. `result.tracked[0]`).
    - `state`: its stacked model state (e.g. `FitResult.state`).
    - `x`: the training inputs, with a leading example axis.
    - `batch_size`: examples per batch (the last may be smaller).
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

    run = _training_pass(axis_name) if apply is None else apply

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


class _FrozenNorm(eqx.nn.StatefulLayer):
    """An `eqx.nn.BatchNorm` normalising with fixed `mean` and `var` arrays."""

    weight: Any
    bias: Any
    mean: Any
    var: Any
    eps: float = eqx.field(static=True)
    channelwise_affine: bool = eqx.field(static=True)

    def __call__(self, x, state=None, *, key=None, inference=None):
        del key, inference

        def norm(y, m, v, w, b):
            out = (y - m) / jnp.sqrt(v + self.eps)
            if self.channelwise_affine:
                out = out * w + b
            return out

        return jax.vmap(norm)(x, self.mean, self.var, self.weight, self.bias), state


def mc_batchnorm(
    model: Any,
    state: PyTree[Any],
    x: PyTree[Any],
    samples: int,
    *,
    batch_size: int,
    key: PRNGKeyArray,
    apply: Callable[..., Any] | None = None,
) -> tuple[Ensemble, PyTree[Any]]:
    """MC BatchNorm (Teye, Azizpour & Smith 2018): one trained model with
    `eqx.nn.BatchNorm` as an ensemble of `samples` members, each normalising
    with the statistics of its own random training batch.

    Member `t` draws `batch_size` training examples without replacement
    (`jax.random.choice(jax.random.split(key, samples)[t], n, (batch_size,),
    replace=False)`), runs the model on them in training mode from a reset
    state, and normalises every input with each BatchNorm layer's batch mean
    and variance. The weights are held once, as the ensemble's shared part.

    **Arguments:**

    - `model`: a trained model with at least one `eqx.nn.BatchNorm`, called
      as `model(x, state)` for one example.
    - `state`: its `eqx.nn.State`.
    - `x`: the training inputs, with a leading example axis.
    - `samples`: the number of members (batches), `>= 1`.
    - `batch_size`: examples per batch (the training batch size, as the
      paper).
    - `key`: PRNG key of the batches.
    - `apply`: `apply(model, x_batch, state) -> new_state` in training mode, as
      [`ee.recompute_batch_stats`][eqx_ensemble.recompute_batch_stats]'s.

    **Returns:**

    `(ensemble, ensemble_state)`: pass both to `ee.predict(ensemble, x,
    state=ensemble_state)`.

    **Example:**

    ```python
    model, state = eqx.nn.make_with_state(eqx.nn.Sequential)([
        eqx.nn.Linear(3, 16, key=jax.random.key(0)),
        eqx.nn.BatchNorm(16, axis_name="batch", mode="batch"),
        eqx.nn.Lambda(jax.nn.relu),
        eqx.nn.Linear(16, 2, key=jax.random.key(1)),
    ])
    x = jax.random.normal(jax.random.key(2), (200, 3))
    passes, passes_state = ee.mc_batchnorm(model, state, x, samples=10,
                                           batch_size=32, key=jax.random.key(3))
    logits = ee.predict(passes, x[:5], state=passes_state)    # (10, 5, 2)
    ```
    """
    samples = check_positive_int(samples, "samples")
    check_key(key)
    if isinstance(model, Ensemble):
        raise TypeError(
            "`ee.mc_batchnorm` takes ONE model; for an ensemble, call it per "
            "member (`ens[i]`, with that member's state)"
        )
    if not isinstance(state, eqx.nn.State):
        raise TypeError(
            "`state` must be the model's `eqx.nn.State` (from "
            f"`eqx.nn.make_with_state`), got {type(state).__name__}"
        )
    layers = _batch_norms(model)
    if not layers:
        raise ValueError(
            f"`ee.mc_batchnorm` needs a model with `eqx.nn.BatchNorm` layers; "
            f"{type(model).__name__} has none"
        )
    n = num_examples(x, "x")
    # One NaN row reaches every batch that draws it: NaN statistics, NaN members.
    for path, leaf in jax.tree_util.tree_flatten_with_path(x)[0]:
        if is_traced(leaf) or not jnp.issubdtype(jnp.asarray(leaf).dtype, jnp.inexact):
            continue
        bad = ~np.isfinite(np.asarray(leaf))
        if bad.any():
            row = int(np.argwhere(bad)[0][0])
            raise ValueError(
                f"`x{jax.tree_util.keystr(path)}` holds {int(bad.sum())} non-finite "
                f"value(s), the first in example {row}: drop such rows first"
            )
    batch_size = check_positive_int(batch_size, "batch_size")
    if batch_size > n:
        raise ValueError(
            f"`batch_size` ({batch_size}) is larger than the data ({n} examples)"
        )
    training = jax.tree.map(
        lambda node: (
            eqx.tree_at(lambda bn: bn.inference, node, False) if _is_bn(node) else node
        ),
        model,
        is_leaf=_is_bn,
    )
    axis_name = layers[0].axis_name

    run = _training_pass(axis_name) if apply is None else apply

    @eqx.filter_jit
    def draw(training, state, x, keys):
        def one(sample_key):
            rows = jax.random.choice(sample_key, n, (batch_size,), replace=False)
            xb = jax.tree.map(lambda a: a[rows], x)
            fresh = _reset(state, _batch_norms(training))
            return _read(run(training, xb, fresh), _batch_norms(training))

        return jax.vmap(one)(keys)

    stats = draw(training, state, x, jax.random.split(key, samples))
    stats_iter = iter(stats)

    def freeze(node):
        if not _is_bn(node):
            return node
        mean, var = next(stats_iter)
        return _FrozenNorm(  # pyright: ignore[reportCallIssue]
            weight=node.weight,
            bias=node.bias,
            mean=mean,
            var=var,
            eps=node.eps,
            channelwise_affine=node.channelwise_affine,
        )

    frozen = jax.tree.map(freeze, model, is_leaf=_is_bn)
    is_frozen = lambda node: isinstance(node, _FrozenNorm)  # noqa: E731
    # The statistics are the members; every other array, the shared part.
    spec = jax.tree.map(lambda _: False, frozen)
    spec = eqx.tree_at(
        lambda tree: [
            leaf
            for node in jax.tree.leaves(tree, is_leaf=is_frozen)
            if is_frozen(node)
            for leaf in (node.mean, node.var)
        ],
        spec,
        replace_fn=lambda _: True,
    )
    members, shared = eqx.partition(frozen, spec)
    member_state = jax.tree.map(
        lambda leaf: (
            jnp.broadcast_to(leaf, (samples, *jnp.shape(leaf)))
            if eqx.is_array(leaf)
            else leaf
        ),
        state,
    )
    return Ensemble(members, shared), member_state
