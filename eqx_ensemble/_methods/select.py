"""Ensemble selection (Caruana et al. 2004) and greedy soups (Wortsman et al. 2022)."""

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Int, PyTree

from .._core.ensemble import Ensemble, take_members
from .average import average


def _score_of(score: Callable[..., Any], *args: Any, what: str) -> float:
    value = score(*args)
    if jnp.shape(value) != ():
        raise ValueError(
            f"`score` must return a scalar (lower is better) for {what}, got shape "
            f"{jnp.shape(value)}"
        )
    return float(value)


def greedy_selection(
    predictions: PyTree[ArrayLike],
    score: Callable[[Any], Any],
    *,
    size: int,
    start: int = 1,
    replacement: bool = True,
) -> Int[Array, " size"]:
    """Ensemble selection with replacement (Caruana, Niculescu-Mizil, Crew &
    Ksikes 2004) over a pool of members, on validation predictions: from the
    `start` best members alone, it adds, `size - start` times, the member whose
    addition gives the lowest `score` (ties: the lower index).

    **Arguments:**

    - `predictions`: the pool's validation predictions, the member axis first on
      every leaf (e.g. `ee.predict(ens, x_val)`).
    - `score`: `score(selected_predictions) -> scalar`, lower is better (e.g.
      `lambda p: ee.metrics.nll(p, y_val, from_logits=True)`).
    - `size`: the number of picks (with repeats), at least `start`.
    - `start`: how many of the best single members start the selection (the
      paper's "sorted initialization"; 1 = the best member).
    - `replacement`: whether a member may be picked again (Caruana et al.'s
      default). Without, `size` distinct members (at most the pool).

    **Returns:**

    The member indices picked, in order, shape `(size,)`: `ens[indices]` is the
    selected ensemble (a member chosen twice counts twice).

    **Example:**

    ```python
    logits = jax.random.normal(jax.random.key(0), (6, 100, 3))
    labels = jnp.arange(100) % 3
    picks = ee.greedy_selection(
        logits, lambda p: ee.metrics.nll(p, labels, from_logits=True), size=4)
    # ens[picks] is the selected ensemble
    ```
    """
    leaves = jax.tree.leaves(predictions)
    if not leaves:
        raise ValueError("`predictions` holds no arrays")
    pool = int(jnp.shape(leaves[0])[0])
    for leaf in leaves:
        if jnp.ndim(leaf) == 0 or jnp.shape(leaf)[0] != pool:
            raise ValueError(
                "every leaf of `predictions` needs the member axis first, of the same "
                f"size ({pool}); got shape {jnp.shape(leaf)}"
            )
    for name, value, low in (("size", size, 1), ("start", start, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"`{name}` must be an int >= {low}, got {value!r}")
    if start > min(size, pool):
        raise ValueError(
            f"`start={start}` must be at most `size={size}` and the pool size {pool}"
        )
    if not replacement and size > pool:
        raise ValueError(
            f"`size={size}` distinct members cannot be picked from a pool of {pool} "
            "without replacement"
        )

    # On the device once; `score` runs eagerly, on concrete arrays.
    arrays = jax.tree.map(jnp.asarray, predictions)

    def take(indices):
        return take_members(arrays, np.asarray(indices, np.int32))

    alone = [_score_of(score, take([i]), what=f"member {i}") for i in range(pool)]
    if np.all(np.isnan(alone)):
        raise ValueError(
            "`score` is NaN for every member alone: check the validation "
            "predictions (diverged members) and the score"
        )
    chosen = list(np.argsort(alone, kind="stable")[:start])
    while len(chosen) < size:
        candidates = [i for i in range(pool) if replacement or i not in chosen]
        trials = [
            _score_of(score, take(chosen + [i]), what="a selection") for i in candidates
        ]
        if np.all(np.isnan(trials)):
            raise ValueError(
                "`score` is NaN for every candidate selection: check the "
                "validation predictions (a diverged member) and the score"
            )
        # A NaN score (a diverged member's predictions) never wins.
        chosen.append(candidates[int(np.nanargmin(trials))])
    return jnp.asarray(chosen, jnp.int32)


def greedy_soup(
    ens: Ensemble,
    score: Callable[[Any], Any],
) -> tuple[Any, Int[Array, " chosen"]]:
    """A greedy soup (Wortsman et al. 2022): one model whose weights average a
    subset of the members. Members are visited best first by their own `score`;
    each joins the soup if the averaged weights score no worse without it.
    Only for members fine-tuned from the same starting point (the paper's
    setting).

    **Arguments:**

    - `ens`: the pool, an [`Ensemble`][eqx_ensemble.Ensemble].
    - `score`: `score(model) -> scalar` on held-out data, lower is better.

    **Returns:**

    `(soup, chosen)`: the averaged model (a plain model, as
    [`ee.average`][eqx_ensemble.average] returns) and the member indices in it.

    **Example:**

    ```python
    base = eqx.nn.Linear(2, 1, key=jax.random.key(0))
    ens = ee.stack([eqx.tree_at(lambda m: m.bias, base, base.bias + d)
                    for d in (0.0, 0.1, 3.0)])
    x = jnp.ones((5, 2))
    target = jax.vmap(base)(x) + 0.05
    soup, chosen = ee.greedy_soup(
        ens, lambda m: jnp.mean((jax.vmap(m)(x) - target) ** 2))
    chosen                     # [0, 1]: the far-off member is left out
    ```
    """
    if not isinstance(ens, Ensemble):
        raise TypeError(
            "`greedy_soup` takes the pool as an `ee.Ensemble` (members of one "
            f"structure), got {type(ens).__name__}"
        )
    size = len(ens)
    alone = [_score_of(score, ens[i], what=f"member {i}") for i in range(size)]
    order = np.argsort(alone, kind="stable")
    chosen = [int(order[0])]
    best = alone[int(order[0])]
    for candidate in order[1:]:
        trial = chosen + [int(candidate)]
        value = _score_of(score, average(ens[np.asarray(trial)]), what="a soup")
        if value <= best:
            chosen, best = trial, value
    return average(ens[np.asarray(chosen)]), jnp.asarray(chosen, jnp.int32)
