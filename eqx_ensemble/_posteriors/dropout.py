"""`mc_dropout`: one trained model with dropout as an ensemble of stochastic
forward passes (Gal & Ghahramani 2016), its weights held once."""

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import PRNGKeyArray

from .._core.ensemble import Ensemble
from .._core.heterogeneous import is_ensemble
from .._internal.checks import check_positive_int
from .._internal.keys import check_key


def _is_dropout(node: Any) -> bool:
    return isinstance(node, eqx.nn.Dropout)


class _AlwaysOn(eqx.Module):
    """`eqx.nn.Dropout`'s computation, always in training mode (even under
    `ee.predict`'s inference mode)."""

    p: Any

    def __call__(self, x: Any, *, key: Any = None, inference: Any = None) -> Any:
        if isinstance(self.p, int | float) and self.p == 0:
            return x
        if key is None:
            raise RuntimeError("an MC dropout pass needs its key")
        q = 1 - jax.lax.stop_gradient(self.p)
        mask = jax.random.bernoulli(key, q, x.shape)
        return jnp.where(mask, x / q, 0)


class DropoutPass(eqx.Module):
    """One stochastic forward pass of a model with dropout (its dropout layers
    switched on) and the key of its masks: a member of
    [`ee.mc_dropout`][eqx_ensemble.mc_dropout]'s ensemble.

    **Example:**

    ```python
    model = eqx.nn.Sequential([eqx.nn.Linear(2, 8, key=jax.random.key(0)),
                               eqx.nn.Dropout(0.5),
                               eqx.nn.Linear(8, 1, key=jax.random.key(1))])
    passes = ee.mc_dropout(model, samples=4, key=jax.random.key(2))
    one = passes[0]                         # an ee.DropoutPass
    one(jnp.ones(2)).shape                  # (1,): this pass's masks
    ```
    """

    model: Any
    key: Any  # one key per pass (stacked), or one pass's

    def __call__(self, x: Any, *, key: PRNGKeyArray | None = None) -> Any:
        return self.model(x, key=self.key if key is None else key)


def mc_dropout(model: Any, samples: int, *, key: PRNGKeyArray) -> Ensemble:
    """MC dropout (Gal & Ghahramani 2016): `samples` stochastic forward passes
    of one trained model, as an ensemble whose members are the passes.

    Every `eqx.nn.Dropout` layer of `model` is switched on for good (whatever
    its `inference` flag and `ee.predict`'s inference mode; other layers follow
    the mode as usual), and each member holds one PRNG key of its masks; the
    weights are held ONCE, as the ensemble's shared part. So
    [`ee.predict`][eqx_ensemble.predict] and every metric take the passes'
    predictions `(samples, batch, ...)` as members'.

    A pass applies its masks to every example (one sampled network, like a
    member); `ee.predict(passes, x, key=k)` instead draws masks per example
    (the same per-example predictive distribution).

    **Arguments:**

    - `model`: a trained model with at least one `eqx.nn.Dropout`, called as
      `model(x, key=key)` (the key goes to its dropout layers).
    - `samples`: the number of passes, `>= 1`.
    - `key`: PRNG key; pass `i` uses `jax.random.split(key, samples)[i]`.

    **Returns:**

    An [`ee.Ensemble`][eqx_ensemble.Ensemble] of `samples`
    [`ee.DropoutPass`][eqx_ensemble.DropoutPass] members.

    **Example:**

    ```python
    class Net(eqx.Module):
        layers: list

        def __init__(self, key):
            k1, k2 = jax.random.split(key)
            self.layers = [eqx.nn.Linear(4, 32, key=k1), eqx.nn.Dropout(0.2),
                           eqx.nn.Linear(32, 3, key=k2)]

        def __call__(self, x, *, key=None):
            x = jax.nn.relu(self.layers[0](x))
            return self.layers[2](self.layers[1](x, key=key))

    trained = eqx.nn.inference_mode(Net(jax.random.key(0)))  # as after training
    passes = ee.mc_dropout(trained, samples=20, key=jax.random.key(1))
    x = jax.random.normal(jax.random.key(2), (16, 4))
    logits = ee.predict(passes, x)                            # (20, 16, 3)
    ee.metrics.mutual_information(logits, from_logits=True).shape   # (16,)
    ```
    """
    samples = check_positive_int(samples, "samples")
    check_key(key)
    if is_ensemble(model):  # an `ee.Ensemble` or `ee.Heterogeneous`
        raise TypeError(
            f"`ee.mc_dropout` takes ONE model, got an `{type(model).__name__}`; for "
            "every member of an ensemble, call it per member (`ens[i]`): one "
            "ensemble of passes per member"
        )
    if not any(map(_is_dropout, jax.tree.leaves(model, is_leaf=_is_dropout))):
        raise ValueError(
            f"`ee.mc_dropout` needs a model with `eqx.nn.Dropout` layers; "
            f"{type(model).__name__} has none"
        )

    model = jax.tree.map(
        lambda node: _AlwaysOn(node.p) if _is_dropout(node) else node,
        model,
        is_leaf=_is_dropout,
    )
    # The keys are the members; the model's arrays, the shared part (its
    # other leaves on both sides, as `ee.ensemble(shared=...)` keeps them).
    members = DropoutPass(
        eqx.filter(model, eqx.is_array, inverse=True), jax.random.split(key, samples)
    )
    shared = DropoutPass(model, None)
    return Ensemble(members, shared)
