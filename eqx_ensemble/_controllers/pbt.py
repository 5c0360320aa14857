"""`PBT`: population-based training as a controller between dispatches."""

import dataclasses
import functools
import math
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Int, PyTree

from .._core.ensemble import Ensemble, member_axis_mask
from .._execution.compile import compiled_call
from .._training.controller import Controller
from .._training.history import History
from .._training.optim import (
    hyperparam_nodes,
    map_hyperparam_nodes,
    members_opt_state,
)
from .._training.train_state import TrainState
from .early_stopping import EarlyStopping

# Lineage rows: (step, child, parent); -1 marks an unused row.
_STEP, _CHILD, _PARENT = 0, 1, 2


def _gather(tree: PyTree[Any], source: Array) -> PyTree[Any]:
    """Every per-member array leaf of `tree` with slot `i` taking member `source[i]`."""

    def take(leaf, per_member):
        if not eqx.is_array(leaf) or not per_member or leaf.ndim == 0:
            return leaf
        return leaf[source]

    return jax.tree.map(take, tree, member_axis_mask(tree))


class PBT(Controller):
    """Population-based training (Jaderberg et al. 2017) inside one compiled run:
    every `every` steps, members are ranked on their latest evaluation score
    (lower is better), and each of the worst `fraction` copies a random one of
    the best `fraction` (*exploit*: weights, optimizer, model and tracker states
    and `hyper`), then has its hyperparameters multiplied by a factor drawn
    from `factors` (*explore*).

    **Arguments:**

    - `every`: steps between exploit/explore rounds; the run must evaluate at
      least once in between.
    - `fraction`: the share of members copied from and to, in `(0, 0.5]`.
    - `hyperparams`: names of `optax.inject_hyperparams` hyperparameters to
      perturb (set per member with `ee.init_optimizer(..., hyperparams=...)`
      as `fit`'s `opt_state=`); each a plain value, not a schedule.
    - `perturb_hyper`: whether to perturb every floating-point leaf of the run's
      `hyper=` as well.
    - `factors`: the multipliers explore draws from, uniformly.
    - `seed`: the explore/exploit randomness (round `s` uses
      `fold_in(key(seed), s)`, so a resumed run repeats it exactly).
    - `max_events`: capacity of the lineage record, read with
      [`PBT.lineage`][eqx_ensemble.PBT.lineage].

    **Example:**

    ```python
    def loss(model, batch, key):
        x, y = batch
        return jnp.mean((jax.vmap(model)(x)[:, 0] - y) ** 2)

    x = jax.random.normal(jax.random.key(0), (64, 2))
    data = (x, x.sum(1))
    ens = ee.ensemble(lambda k: eqx.nn.MLP(2, 1, 8, 1, key=k), size=8,
                      key=jax.random.key(1))
    opt = optax.inject_hyperparams(optax.sgd)(learning_rate=0.01)
    pbt = ee.PBT(every=10, fraction=0.25, hyperparams=("learning_rate",))
    result = ee.fit(ens, loss, opt, data, steps=40, batch_size=16,
                    key=jax.random.key(2), callbacks=[pbt],
                    opt_state=ee.init_optimizer(opt, ens, hyperparams={
                        "learning_rate": jnp.logspace(-3, -1, 8)}),
                    evaluate=ee.Evaluate(loss, data, every=10))
    steps, children, parents = pbt.lineage(result)   # 2 copies per round
    ```
    """

    every: int
    fraction: float = 0.25
    hyperparams: tuple[str, ...] = ()
    perturb_hyper: bool = True
    factors: tuple[float, ...] = (0.8, 1.2)
    seed: int = 0
    max_events: int = 4096

    def __check_init__(self):
        if not (isinstance(self.fraction, int | float) and 0 < self.fraction <= 0.5):
            raise ValueError(
                f"`PBT.fraction` must lie in (0, 0.5] (the share copied from the "
                f"best into the worst), got {self.fraction!r}"
            )
        if isinstance(self.hyperparams, str):
            raise TypeError(
                "`PBT.hyperparams` must be a tuple of names, e.g. "
                f"`('learning_rate',)`, got the string {self.hyperparams!r}"
            )
        if not self.factors or not all(
            isinstance(f, int | float) and math.isfinite(f) and f > 0
            for f in self.factors
        ):
            raise ValueError(
                f"`PBT.factors` must be positive finite numbers, got {self.factors!r}"
            )
        if isinstance(self.max_events, bool) or not (
            isinstance(self.max_events, int) and self.max_events >= 1
        ):
            raise ValueError(
                f"`PBT.max_events` must be a positive int, got {self.max_events!r}"
            )

    def init(self, train_state: TrainState) -> PyTree[Any]:
        if train_state.best_score is None:
            raise ValueError(
                "`ee.PBT` ranks members by their evaluation scores, but this run "
                "has no evaluation: pass `evaluate=ee.Evaluate(fn, data, every=...)` "
                f"evaluating at least every {self.every} steps"
            )
        size = len(train_state.ensemble)
        if math.floor(self.fraction * size) < 1:
            raise ValueError(
                f"`PBT.fraction={self.fraction}` of {size} members copies no member; "
                f"use at least {1 / size:.3g} (one member) or more members"
            )
        nodes = hyperparam_nodes(members_opt_state(train_state.opt_state))
        for name in self.hyperparams:
            owners = [node for _, node in nodes if name in node.hyperparams]
            if not owners:
                available = sorted({n for _, node in nodes for n in node.hyperparams})
                raise ValueError(
                    f"`PBT` cannot perturb {name!r}: the optimizer injects "
                    f"{available or 'no hyperparameters'} (build it with "
                    "`optax.inject_hyperparams`)"
                )
            for node in owners:
                if name in getattr(node, "hyperparams_states", {}):
                    raise ValueError(
                        f"`PBT` cannot perturb {name!r}: the optimizer computes it "
                        "from a schedule at every step, which would overwrite the "
                        "perturbed value. Inject a number for it instead."
                    )
        if self.perturb_hyper and train_state.hyper is not None:
            floats = [
                leaf
                for leaf in jax.tree.leaves(train_state.hyper)
                if jnp.issubdtype(leaf.dtype, jnp.floating)
            ]
            if not floats and not self.hyperparams:
                raise ValueError(
                    "`PBT` has nothing to perturb: `hyper` holds no floating-point "
                    "leaf and `hyperparams` names none"
                )
        return {
            "lineage": jnp.full((self.max_events, 3), -1, jnp.int32),
            "count": jnp.array(0, jnp.int32),
            "last": jnp.array(0, jnp.int32),
        }

    def check(self, steps: int, evaluate_every: int | None) -> None:
        """Refuse an evaluation period longer than `every`."""
        del steps
        every = evaluate_every
        if every is not None and every > self.every:
            raise ValueError(
                f"`ee.PBT(every={self.every})` ranks members on an evaluation since "
                f"its last round, but `ee.Evaluate(every={every})` evaluates less "
                f"often: evaluate at least once every {self.every} steps "
                "(`ee.Evaluate(every=...)` with a period of at most `PBT.every`)."
            )

    def check_run(self, ens: Any, controllers: tuple[Controller, ...]) -> None:
        """Refuse an `ee.Heterogeneous` (weights cannot cross architectures) and
        `ee.EarlyStopping` (its per-member record would not follow a copy)."""
        if not isinstance(ens, Ensemble):  # (an `ee.Heterogeneous`)
            raise ValueError(
                "`ee.PBT` copies one member's weights into another, which members "
                "of different architectures cannot take: run PBT on each group of "
                "the `ee.Heterogeneous` on its own"
            )
        if any(isinstance(controller, EarlyStopping) for controller in controllers):
            raise ValueError(
                "`ee.PBT` and `ee.EarlyStopping` cannot be combined in one run: PBT "
                "replaces members by copies of others, which EarlyStopping's "
                "per-member record does not follow; PBT already stops improving "
                "members from training on, by replacing the worst"
            )

    def __call__(
        self, train_state: TrainState, state: PyTree[Any], history: History
    ) -> tuple[TrainState, PyTree[Any]]:
        step = int(train_state.step)
        last = int(state["last"])
        fresh = np.flatnonzero(np.asarray(history.eval_steps) > last)
        if fresh.size == 0:
            raise ValueError(
                f"`ee.PBT` at step {step}: no evaluation since step {last}. Evaluate "
                f"at least once every {self.every} steps (`ee.Evaluate(every=...)` "
                "with a divisor of `PBT.every`)."
            )
        scores = np.asarray(history.eval_scores[fresh[-1]], np.float64)
        size = scores.shape[0]
        count = math.floor(self.fraction * size)
        # NaN (never evaluated or diverged) ranks last; ties keep member order.
        ranked = np.argsort(np.where(np.isnan(scores), np.inf, scores), kind="stable")
        top, bottom = ranked[:count], ranked[size - count :]
        key = jax.random.fold_in(jax.random.key(self.seed), step)
        parent_key, factor_key = jax.random.split(key)
        parents = np.asarray(top)[
            np.asarray(jax.random.randint(parent_key, (count,), 0, count))
        ]
        source = np.arange(size)
        source[bottom] = parents
        # One compiled program per run structure.
        exploit = functools.partial(
            _exploit_explore,
            factors=tuple(self.factors),
            names=tuple(self.hyperparams),
            perturb_hyper=self.perturb_hyper,
        )
        explored = np.isin(np.arange(size), bottom)
        # Only the fields it changes (others could key a program per round).
        parts = {name: getattr(train_state, name) for name in _PARTS}
        parts = compiled_call(exploit, parts, source, explored, factor_key)
        new = dataclasses.replace(train_state, **parts)
        lineage = state["lineage"]
        written = int(state["count"])
        rows = np.stack([np.full(count, step), bottom, parents], axis=1).astype(
            np.int32
        )
        room = max(0, min(count, self.max_events - written))
        if room:
            lineage = lineage.at[written : written + room].set(rows[:room])
        new_state = {
            "lineage": lineage,
            "count": jnp.array(written + count, jnp.int32),
            "last": jnp.array(step, jnp.int32),
        }
        return new, new_state

    def events(self, state: PyTree[Any]) -> list[dict[str, Any]]:
        """Every copy so far: `{"step", "event": "exploit", "member", "parent"}`."""
        count = min(int(state["count"]), self.max_events)
        rows = np.asarray(state["lineage"])[:count]
        return [
            {
                "step": int(row[_STEP]),
                "event": "exploit",
                "member": int(row[_CHILD]),
                "parent": int(row[_PARENT]),
            }
            for row in rows
        ]

    def lineage(
        self, result: Any
    ) -> tuple[
        Int[np.ndarray, " events"],
        Int[np.ndarray, " events"],
        Int[np.ndarray, " events"],
    ]:
        """`(steps, children, parents)` of every copy this controller made in a
        finished run: at `steps[k]`, member `children[k]` became a copy of
        member `parents[k]`.

        **Arguments:**

        - `result`: the [`FitResult`][eqx_ensemble.FitResult] of a run with this
          controller.

        **Example:** see [`PBT`][eqx_ensemble.PBT].
        """
        train_state = getattr(result, "train_state", None)
        if train_state is None:
            raise ValueError("`PBT.lineage` needs the FitResult of a `fit` run")
        states = [
            state
            for state in train_state.controlled
            if isinstance(state, dict) and "lineage" in state
        ]
        if not states:
            raise ValueError("this run had no `ee.PBT` controller")
        state = states[0]
        count = int(state["count"])
        if count > self.max_events:
            raise ValueError(
                f"the run made {count} copies but `max_events={self.max_events}` "
                "kept only the first ones; rerun with a larger `max_events`"
            )
        rows = np.asarray(state["lineage"])[:count]
        return rows[:, _STEP], rows[:, _CHILD], rows[:, _PARENT]


def _exploit_explore(
    parts: dict[str, Any],
    source: Array,
    explored: Array,
    factor_key: Array,
    *,
    factors: tuple[float, ...],
    names: tuple[str, ...],
    perturb_hyper: bool,
) -> dict[str, Any]:
    """`PBT`'s round on the run's `_PARTS`: slot `i` takes member `source[i]`'s;
    the `explored` slots' hyperparameters get a random factor."""
    size = explored.shape[0]
    parts = {
        name: jnp.where(explored, value[source], value)
        if name in ("diverged_at", "stopped_at")
        else _gather(value, source)
        for name, value in parts.items()
    }
    drawn = jnp.asarray(factors, jnp.float32)[
        jax.random.randint(factor_key, (size,), 0, len(factors))
    ]
    scale = jnp.where(explored, drawn, 1.0)

    def perturb_node(node):
        changed = {
            name: (value * scale.astype(value.dtype)).astype(value.dtype)
            if name in names and value.ndim == 1
            else value
            for name, value in node.hyperparams.items()
        }
        return node._replace(hyperparams=changed)

    if names:
        parts["opt_state"] = map_hyperparam_nodes(perturb_node, parts["opt_state"])
    if perturb_hyper and parts["hyper"] is not None:

        def perturb_leaf(leaf):
            if not jnp.issubdtype(leaf.dtype, jnp.floating):
                return leaf
            shaped = scale.reshape(scale.shape + (1,) * (leaf.ndim - 1))
            return (leaf * shaped.astype(leaf.dtype)).astype(leaf.dtype)

        parts["hyper"] = jax.tree.map(perturb_leaf, parts["hyper"])
    return parts


# The fields of the run a round of `PBT` changes.
_PARTS = (
    "ensemble",
    "opt_state",
    "model_state",
    "hyper",
    "tracked",
    "diverged_at",
    "stopped_at",
)
