"""`TrainState`: what a `fit` run carries from step to step, and its start."""

import dataclasses
import functools
import weakref
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jax.extend.core import Var
from jaxtyping import Array, Float, Int, PRNGKeyArray, PyTree

from .._core.ensemble import Ensemble, member_axis_mask
from .._core.heterogeneous import (
    Heterogeneous,
    group_parts,
    groups_of,
    joined,
    regroup,
)
from .._execution.cache import keep
from .._execution.compile import CompiledFunctions, filter_jit, one_shot_options
from .._execution.lift import lifts
from .._internal.keys import RunKeys, run_keys
from .._internal.tree import with_fields
from .optim import init_state


def _field(member_axis: str | None) -> Any:
    # A field's mesh placement: "stacked", "bookkeeping" or replicated (`None`).
    return eqx.field(metadata={"member_axis": member_axis})


class TrainState(eqx.Module):
    """Everything a [`fit`][eqx_ensemble.fit] run carries from step to step, and
    what its checkpoints hold. Controllers receive and return it.

    - `ensemble`, `opt_state`, `model_state`: the stacked model, optimizer state
      and model state (`None` without one).
    - `hyper`: the per-member hyperparameters given to `fit(..., hyper=)` (a
      PyTree with a leading member axis) or `None`; controllers may change them.
    - `tracked`: one state per tracker of `track=` (each with a member axis).
    - `controlled`: one state per controller in `callbacks=`.
    - `step`: the number of steps done.
    - `diverged_at`: per member, the step at which it diverged, or -1.
    - `stopped_at`: per member, the step count at which it was stopped (by a
      controller such as [`ee.EarlyStopping`][eqx_ensemble.EarlyStopping]), or
      -1. A stopped member is frozen like a diverged one.
    - `best_ensemble`, `best_score`, `best_step`: with an `evaluate=`, each
      member at its best (lowest) score so far, that score and its step.

    **Example:**

    ```python
    ens = ee.ensemble(lambda k: eqx.nn.Linear(1, 1, key=k), size=2,
                      key=jax.random.key(0))
    x = jnp.linspace(0, 1, 8)[:, None]
    loss = lambda m, b, k: jnp.mean((jax.vmap(m)(b) - 2 * b) ** 2)

    class Report(ee.Controller):
        every: int = 2

        def __call__(self, train_state, control_state, history):
            print(int(train_state.step), history.losses.shape)
            return train_state, control_state

    ee.fit(ens, loss, optax.sgd(0.1), x, steps=4, batch_size=4,
           key=jax.random.key(1), callbacks=[Report()])
    ```
    """

    ensemble: Ensemble | Heterogeneous = _field("stacked")
    opt_state: PyTree[Any] = _field("stacked")
    model_state: PyTree[Any] = _field("stacked")
    hyper: PyTree[Any] = _field("stacked")
    tracked: tuple[PyTree[Any], ...] = _field("stacked")
    controlled: tuple[PyTree[Any], ...] = _field(None)
    step: Int[Array, ""] = _field(None)
    diverged_at: Int[Array, " members"] = _field("bookkeeping")
    stopped_at: Int[Array, " members"] = _field("bookkeeping")
    best_ensemble: Ensemble | Heterogeneous | None = _field("stacked")
    best_score: Float[Array, " members"] | None = _field("bookkeeping")
    best_step: Int[Array, " members"] | None = _field("bookkeeping")


def member_select(
    better: Any, new: PyTree[Any], old: PyTree[Any], ens: Any = None
) -> PyTree[Any]:
    """Member i takes `new` where `better[i]`, else `old`; `None` stays `None`."""
    if new is None:
        return None
    if ens is None:  # ensembles, group by group
        parts = zip(group_parts(new, members=(better,)), groups_of(old), strict=True)
        return regroup(new, [_select(b, n, o, None) for (n, b), o in parts])
    return joined(
        ens,
        [
            _select(b, n, o, g)
            for g, n, o, b in group_parts(ens, new, old, members=(better,))
        ],
    )


def _select(better: Any, new: PyTree[Any], old: PyTree[Any], ens: Any) -> PyTree[Any]:
    def pick(n, o, per_member=True):
        if not eqx.is_array(n) or not per_member:  # a shared part: the newest
            return n
        mask = better.reshape(better.shape + (1,) * (n.ndim - 1))
        return jnp.where(mask, n, o)

    if ens is not None:
        return jax.tree.map(pick, new, old)
    return jax.tree.map(pick, new, old, member_axis_mask(new))


def track_init(tracker: Any, ens: Any) -> Any:
    """`tracker`'s first state (one per group)."""
    return joined(ens, [tracker.init(group.members) for (group,) in group_parts(ens)])


def track_update(tracker: Any, state: Any, ens: Any, done: Any) -> Any:
    """`tracker`'s state after a step (per group, as `track_init`)."""
    parts = group_parts(ens, state)
    return joined(
        ens, [tracker.update(part, group.members, done) for group, part in parts]
    )


def _joined_results(results: list[Any]) -> Any:
    if all(isinstance(result, Ensemble) for result in results):
        return Heterogeneous(results)
    return tuple(results)


def track_result(tracker: Any, state: Any, ens: Any) -> Any:
    """`tracker`'s result (per group; ensembles joined as an `ee.Heterogeneous`)."""
    parts = group_parts(ens, state)
    results = [tracker.result(part, group) for group, part in parts]
    return joined(ens, results, _joined_results)


def initial_state(
    ens: Ensemble | Heterogeneous,
    opt_state: PyTree[Any],
    model_state: PyTree[Any],
    *,
    hyper: PyTree[Any] = None,
    track: tuple[Any, ...],
    with_eval: bool,
    controllers: tuple[Any, ...] = (),
) -> TrainState:
    """The state before the first step (its arrays may alias the inputs)."""
    size = len(ens)
    train_state = TrainState(
        ensemble=ens,
        opt_state=opt_state,
        model_state=model_state,
        hyper=hyper,
        tracked=tuple(track_init(tracker, ens) for tracker in track),
        controlled=(),
        step=jnp.array(0, dtype=jnp.int32),
        diverged_at=jnp.full((size,), -1, dtype=jnp.int32),
        stopped_at=jnp.full((size,), -1, dtype=jnp.int32),
        best_ensemble=ens if with_eval else None,
        best_score=jnp.full((size,), jnp.inf, jnp.float32) if with_eval else None,
        best_step=jnp.zeros((size,), jnp.int32) if with_eval else None,
    )
    controlled = tuple(controller.init(train_state) for controller in controllers)
    return dataclasses.replace(train_state, controlled=controlled)


def fresh_state(
    init: Any,
    track: tuple[Any, ...],
    with_eval: bool,
    ens: Ensemble | Heterogeneous,
    opt_state: PyTree[Any],
    model_state: PyTree[Any],
    hyper: PyTree[Any],
) -> TrainState:
    """The traced start state (a fresh optimizer state where `opt_state` is None)."""
    if opt_state is None:
        opt_state = init_state(optax.GradientTransformation(init, _no_update), ens)
    train_state = initial_state(
        ens, opt_state, model_state, hyper=hyper, track=track, with_eval=with_eval
    )
    # New buffers for every leaf: the loop donates its state.
    return jax.tree.map(lambda x: jnp.copy(x) if eqx.is_array(x) else x, train_state)


def _no_update(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("internal error: a start program updates nothing")


def _make_start(init: Any, track: tuple[Any, ...], with_eval: bool) -> Any:
    # A function of its own: JAX's caches keyed on it go when it is dropped.
    def start(*args: Any) -> TrainState:
        return fresh_state(init, track, with_eval, *args)

    return filter_jit(start, one_shot_options())


# One start program per optimizer `init`, trackers and evaluation (bounded).
_started = CompiledFunctions(_make_start)


@functools.cache
def _start_generic() -> Any:
    # Made on first use: the options depend on the backend.
    return filter_jit(fresh_state, one_shot_options())


def start_state(
    ens: Ensemble | Heterogeneous,
    optimizer: Any,
    opt_state: PyTree[Any],
    model_state: PyTree[Any],
    *,
    hyper: PyTree[Any],
    track: tuple[Any, ...],
    with_eval: bool,
    key: PRNGKeyArray,
    controlled: tuple[Any, ...] = (),
) -> tuple[TrainState, RunKeys]:
    """The state before the first step in new buffers, and the run's keys."""
    init = optimizer.init
    try:
        # Unhashable, or reading a lifted weight decay (`lift.py`): arguments.
        generic = hash((init, track)) is None or lifts(init)
    except TypeError:
        generic = True
    if generic:
        train_state = _start_generic()(
            init, track, with_eval, ens, opt_state, model_state, hyper
        )
    else:
        train_state = _started(init, track, with_eval)(
            ens, opt_state, model_state, hyper
        )
    keys = derived_keys(key)
    if not controlled:
        return train_state, keys
    states = tuple(item.init(train_state) for item in controlled)
    return dataclasses.replace(train_state, controlled=states), keys


def reads_weights(optimizer: Any, ens: Ensemble | Heterogeneous) -> bool:
    """Whether a fresh optimizer state reads the weights (from `init`'s jaxpr)."""
    closed, _, _ = eqx.filter_make_jaxpr(lambda e: init_state(optimizer, e))(ens)
    jaxpr = closed.jaxpr
    read = set(jaxpr.invars)
    for eqn in jaxpr.eqns:
        if any(isinstance(var, Var) and var in read for var in eqn.invars):
            read.update(eqn.outvars)
    return any(isinstance(var, Var) and var in read for var in jaxpr.outvars)


@dataclasses.dataclass(frozen=True)
class FreshStart:
    """A fresh run's start state without a start program, for a known `fit` call
    that donates nothing."""

    template: TrainState  # no weights; `opt_state` `None`: the call passes its own
    kept: tuple[jax.Array, ...]  # the template's arrays

    @staticmethod
    def of(started: TrainState, fresh_optimizer: bool) -> "FreshStart":
        template = with_fields(
            started,
            ensemble=None,
            opt_state=started.opt_state if fresh_optimizer else None,
            model_state=None,
            hyper=None,
            tracked=(),
            controlled=(),
            best_ensemble=None,
            best_score=None,
            best_step=None,
        )
        kept = [x for x in jax.tree.leaves(template) if isinstance(x, jax.Array)]
        return FreshStart(template, tuple(kept))

    def __call__(
        self, ens: Any, opt_state: Any, model_state: Any, key: PRNGKeyArray
    ) -> tuple[TrainState, RunKeys] | None:
        """The start state and keys, or `None` where a kept array was deleted."""
        if any(leaf.is_deleted() for leaf in self.kept):
            return None
        template = self.template
        if opt_state is None:
            opt_state = template.opt_state
        train_state = with_fields(
            template, ensemble=ens, opt_state=opt_state, model_state=model_state
        )
        return train_state, derived_keys(key)


def derived_keys(key: PRNGKeyArray) -> RunKeys:
    """`run_keys(key)`, cached per key object (weakly) and PRNG setting, off a mesh."""
    if not jax.sharding.get_abstract_mesh().empty:
        return _keys()(key)
    partitionable = jax.config.jax_threefry_partitionable  # pyright: ignore[reportAttributeAccessIssue]
    entry = (id(key), bool(partitionable))
    found = _DERIVED.get(entry)
    if found is not None and found[0]() is key:
        if not any(derived.is_deleted() for derived in found[1]):
            return found[1]
    keys = _keys()(key)
    if isinstance(key, jax.Array):  # (not a NumPy key: it could change in place)
        keep(_DERIVED, entry, (weakref.ref(key), keys))
    return keys


_DERIVED: dict[tuple[int, bool], tuple[Any, RunKeys]] = {}


@functools.cache
def _keys() -> Any:
    # Made on first use: the options depend on the backend.
    return jax.jit(run_keys, compiler_options=dict(one_shot_options()) or None)
