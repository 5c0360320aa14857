"""Epinets (Osband et al. 2023): one network, predictions indexed by `z`."""

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray

from .._core.ensemble import Ensemble
from .._internal.checks import check_positive_int


class Epinet(eqx.Module):
    """An epinet (Osband et al. 2023): `f(x, z) = mu(x) + g([phi, z])^T z +
    prior_scale * h(phi)^T z`, with the base `mu(x) = head(torso(x))`, its
    features `phi = stop_gradient(torso(x))` (then `x` flattened, with
    `include_input=True`) and an index `z ~ N(0, I)` of `index_dim` numbers.
    `g` (`learnable`) and the fixed prior `h` (`prior`) are MLPs whose outputs
    are reshaped `(out_size, index_dim)` and contracted with `z`. The prior's
    weights are held as their bits (unsigned ints, not parameters): no
    optimizer, weight decay included, can change them. The base trains with
    the same loss, or is frozen as a shared part (`shared=lambda m: (m.torso,
    m.head)`).
    `model(x, z)` is one example's prediction at `z`, `model(x)` the base's.

    **Arguments:**

    - `torso`: the base up to its last hidden layer; `head`: the rest.
    - `feature_size`: the width of `phi`; `out_size`: the head's output width.
    - `index_dim`: the size of `z` (small: the paper uses e.g. 8).
    - `width`, `depth`: the hidden layers of `g` and `h`, as `eqx.nn.MLP`'s.
    - `prior_scale`: the prior's weight, the paper's `alpha`.
    - `key`: PRNG key for `g` and `h`.

    **Example:**

    ```python
    def make(key):
        k1, k2, k3 = jax.random.split(key, 3)
        torso = eqx.nn.MLP(1, 16, 16, 1, final_activation=jax.nn.relu, key=k1)
        head = eqx.nn.Linear(16, 1, key=k2)
        return ee.nn.Epinet(torso, head, 16, 1, index_dim=4, key=k3)

    model = make(jax.random.key(0))
    model(jnp.ones(1), jnp.ones(4)).shape          # (1,): at one index
    indices = model.samples(10, key=jax.random.key(1))
    ee.predict(indices, jnp.ones((5, 1))).shape    # (10, 5, 1)
    ens = ee.ensemble(make, size=3, key=jax.random.key(2))   # 3 epinets
    ```
    """

    torso: Any
    head: Any
    learnable: eqx.nn.MLP
    prior_bits: eqx.nn.MLP
    feature_size: int = eqx.field(static=True)
    index_dim: int = eqx.field(static=True)
    out_size: int = eqx.field(static=True)
    prior_scale: float = eqx.field(static=True)
    include_input: bool = eqx.field(static=True)

    def __init__(
        self, torso: Any, head: Any, feature_size: int, out_size: int, *,
        index_dim: int = 8, width: int = 50, depth: int = 2,
        prior_scale: float = 1.0, include_input: bool = False, key: PRNGKeyArray,
    ):  # fmt: skip
        self.feature_size = check_positive_int(feature_size, "feature_size")
        self.out_size = check_positive_int(out_size, "out_size")
        self.index_dim = check_positive_int(index_dim, "index_dim")
        mlp = lambda n, k: eqx.nn.MLP(n, out_size * index_dim, width, depth, key=k)
        learnable_key, prior_key = jax.random.split(key)
        self.learnable = mlp(feature_size + index_dim, learnable_key)
        self.prior_bits = _bitcast(mlp(feature_size, prior_key), "uint")
        self.torso, self.head, self.prior_scale = torso, head, float(prior_scale)
        self.include_input = include_input

    @property
    def prior(self) -> eqx.nn.MLP:
        """The fixed prior network `h` (its weights read from their bits)."""
        return _bitcast(self.prior_bits, "float")

    def __call__(
        self, x: Array, z: Float[Array, " index_dim"] | None = None, *,
        key: PRNGKeyArray | None = None,
    ) -> Float[Array, " out"]:  # fmt: skip
        features = self.torso(x) if key is None else self.torso(x, key=key)
        mean, phi = self.head(features), features
        if self.include_input:
            phi = jnp.concatenate([features, jnp.ravel(x)])
        shapes = (jnp.shape(phi), jnp.shape(mean))
        if shapes != ((self.feature_size,), (self.out_size,)):
            raise ValueError(
                f"`feature_size={self.feature_size}` and `out_size={self.out_size}` "
                f"must match the features {jnp.shape(phi)} (the torso's output"
                f"{', then x flattened' if self.include_input else ''}) and the "
                f"head's output {jnp.shape(mean)}"
            )
        if z is None:
            return mean
        if jnp.shape(z) != (self.index_dim,):
            raise ValueError(
                f"`z` must have shape ({self.index_dim},) (`index_dim`), got "
                f"{jnp.shape(z)}"
            )
        phi, shape = jax.lax.stop_gradient(phi), (self.out_size, self.index_dim)
        learned = self.learnable(jnp.concatenate([phi, z])).reshape(shape) @ z
        return mean + learned + self.prior_scale * (self.prior(phi).reshape(shape) @ z)

    def samples(self, num: int, *, key: PRNGKeyArray) -> Ensemble:
        """`num` indices `z = jax.random.normal(key, (num, index_dim))` as the
        members of ONE ensemble (the model shared), so `ee.predict` and
        `ee.metrics` take their `(num, batch, ...)` predictions as members'; of
        an ensemble, as groups: `ee.Heterogeneous([ens[i].samples(...), ...])`."""
        num = check_positive_int(num, "num")
        z = jax.random.normal(key, (num, self.index_dim))
        members = _AtIndex(eqx.filter(self, eqx.is_array, inverse=True), z)
        return Ensemble(members, _AtIndex(self, None))


def _bitcast(tree: Any, kind: str) -> Any:
    cast = lambda w: jax.lax.bitcast_convert_type(w, f"{kind}{8 * w.dtype.itemsize}")
    return jax.tree.map(lambda w: cast(w) if eqx.is_array(w) else w, tree)


class _AtIndex(eqx.Module):
    model: Any
    z: Any

    def __call__(self, x: Any, **kwargs: Any) -> Any:
        return self.model(x, self.z, **kwargs)


def epinet_loss(
    loss: Callable[[Any, Any, PRNGKeyArray], Any], *, num_indices: int, l2: float = 0.0
) -> Callable[[Epinet, Any, PRNGKeyArray], Float[Array, ""]]:
    """The epinet paper's loss for [`ee.fit`][eqx_ensemble.fit]: `loss` (one
    model's usual `loss(model, batch, key) -> scalar`) at `num_indices` sampled
    indices, averaged, plus `l2` times the sum of the squared float parameters
    (a frozen, shared base adds a constant).

    With `index_key, loss_key = jax.random.split(key)`, the indices are
    `z = jax.random.normal(index_key, (num_indices, index_dim))`, and index `m`
    adds `loss(lambda x: model(x, z[m]), batch, split(loss_key, num_indices)[m])`.

    **Example:**

    ```python
    def mse(model, batch, key):
        x, y = batch
        return jnp.mean((jax.vmap(model)(x) - y) ** 2)

    torso = eqx.nn.MLP(1, 8, 8, 1, final_activation=jax.nn.relu, key=jax.random.key(0))
    model = ee.nn.Epinet(torso, eqx.nn.Linear(8, 1, key=jax.random.key(1)), 8, 1,
                         index_dim=4, width=8, key=jax.random.key(2))
    x = jax.random.uniform(jax.random.key(3), (32, 1))
    loss = ee.nn.epinet_loss(mse, num_indices=4, l2=1e-4)
    result = ee.fit(ee.stack([model]), loss, optax.adam(1e-2), (x, jnp.sin(6 * x)),
                    steps=20, batch_size=8, key=jax.random.key(4), callbacks=())
    ```
    """
    num_indices = check_positive_int(num_indices, "num_indices")

    def epinet(model: Epinet, batch: Any, key: PRNGKeyArray) -> Float[Array, ""]:
        if not isinstance(model, Epinet):
            raise TypeError(f"`epinet_loss` trains an `Epinet`, got {type(model)}")
        index_key, loss_key = jax.random.split(key)
        z = jax.random.normal(index_key, (num_indices, model.index_dim))
        keys = jax.random.split(loss_key, num_indices)
        losses = jax.vmap(lambda z, k: loss(_AtIndex(model, z), batch, k))(z, keys)
        params = jax.tree.leaves(eqx.filter(model, eqx.is_inexact_array))
        return jnp.mean(losses) + l2 * sum(jnp.sum(w**2) for w in params)

    return epinet
