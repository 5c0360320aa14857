"""The members as interacting particles, as coupled losses: Stein variational
gradient descent in weight space (`svgd`, Liu & Wang 2016), and repulsive deep
ensembles in weight or function space (`repulsive`, D'Angelo & Fortuin
2021)."""

import math
import numbers
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

from .._core.ensemble import Ensemble
from .._core.map import map as ensemble_map
from .._internal.checks import check_positive_int
from .._training.coupled import Coupled


def _flat(tree: Any, size: int) -> jax.Array:
    leaves = jax.tree.leaves(eqx.filter(tree, eqx.is_inexact_array))
    return jnp.concatenate([leaf.reshape(size, -1) for leaf in leaves], axis=1)


def _rbf_kernel(
    points: jax.Array, finite: jax.Array, bandwidth: float | None
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The RBF kernel `exp(-|f_i - f_j|^2 / h)` between the finite points, `h`
    (given, or the median heuristic) and the count of finite points."""
    count = jnp.sum(finite).astype(points.dtype)
    squared = jnp.sum((points[:, None, :] - points[None, :, :]) ** 2, axis=-1)
    pair = finite[:, None] & finite[None, :]
    if bandwidth is not None:
        h = jnp.asarray(bandwidth, squared.dtype)
    else:
        size = squared.shape[0]
        upper = jnp.triu(jnp.ones((size, size), bool), k=1) & pair
        median = jnp.nanmedian(jnp.where(upper, squared, jnp.nan))
        h = median / jnp.log(jnp.maximum(count, 2.0))
        h = jnp.where(jnp.isfinite(h) & (h > 0), h, 1.0)
        h = jax.lax.stop_gradient(jnp.maximum(h, jnp.finfo(squared.dtype).tiny))
    return jnp.where(pair, jnp.exp(-squared / h), 0.0), h, count


def _check_bandwidth(bandwidth: float | None) -> None:
    if bandwidth is not None and not (
        isinstance(bandwidth, numbers.Real)
        and not isinstance(bandwidth, bool)
        and math.isfinite(bandwidth)
        and bandwidth > 0
    ):
        raise ValueError(f"`bandwidth` must be a positive number, got {bandwidth!r}")


def _check_particles(ens: Any, name: str) -> int:
    if not isinstance(ens, Ensemble) or ens.shared is not None:
        raise TypeError(
            f"`ee.{name}` moves the members' whole weights as particles: it takes "
            "an `ee.Ensemble` without shared parts"
        )
    if len(ens) < 2:
        raise ValueError(f"`ee.{name}` needs at least 2 members (particles)")
    return len(ens)


def _per_member(keys: Any, kwargs: dict[str, Any]) -> tuple[Any, ...]:
    # `hyper=`: one value per member, each member's loss gets its own.
    return (keys,) if "hyper" not in kwargs else (keys, kwargs["hyper"])


def svgd_direction(
    theta: jax.Array, log_prob_grads: jax.Array, bandwidth: float | None = None
) -> jax.Array:
    """The SVGD direction of every particle, `(members, parameters)`:
    `phi_j = (1/M) sum_i [k(t_i, t_j) grad log p(t_i) + grad_{t_i} k(t_i, t_j)]`
    with the RBF kernel `k = exp(-|t_i - t_j|^2 / h)`, `h` the median heuristic
    unless given. A non-finite particle takes no part and gets a NaN direction,
    so `fit`'s guard freezes it alone."""
    finite = jnp.all(jnp.isfinite(theta), axis=1) & jnp.all(
        jnp.isfinite(log_prob_grads), axis=1
    )
    theta = jnp.where(finite[:, None], theta, 0.0)
    grads = jnp.where(finite[:, None], log_prob_grads, 0.0)
    kernel, h, count = _rbf_kernel(theta, finite, bandwidth)
    driving = kernel @ grads
    # grad_{t_i} k(t_i, t_j) = -(2/h)(t_i - t_j) k_ij, summed over i.
    repulsive = (2 / h) * (theta * jnp.sum(kernel, axis=0)[:, None] - kernel @ theta)
    phi = (driving + repulsive) / jnp.maximum(count, 1.0)
    return jnp.where(finite[:, None], phi, jnp.nan)


def svgd(
    loss_fn: Callable[..., Any],
    *,
    num_data: int,
    bandwidth: float | None = None,
) -> Coupled:
    """Stein variational gradient descent (Liu & Wang 2016) with the members as
    particles: each member moves along the kernel-weighted average of every
    member's log-posterior gradient plus a repulsion from the others, so the
    ensemble approximates the posterior instead of collapsing on its modes.

    A member's log posterior is `-num_data * loss_fn(model, batch, key)`: write
    `loss_fn` as the batch's mean NLL plus the negative log prior over
    `num_data`. With `optax.sgd(lr)` every step is exactly `theta_j += lr *
    phi_j`; Adam preconditions it per member. Each member reports its own
    `loss_fn` value. Every member sees the same batch (`sampling=ee.Shared()`,
    the default; a per-member sampling is refused).

    **Arguments:**

    - `loss_fn`: the loss of ONE model, `(model, batch, key) -> scalar`.
    - `num_data`: the number of training examples (the posterior's scale).
    - `bandwidth`: a fixed bandwidth `h` of the RBF kernel `exp(-|d|^2 / h)` on
      the flattened weights; default the median heuristic (`median of squared
      distances / log(members)`).

    **Returns:**

    An [`ee.Coupled`][eqx_ensemble.Coupled] loss.

    **Example:**

    ```python
    def loss(model, batch, key):
        x, y = batch
        prior = 0.5 * sum(jnp.sum(w**2) for w in jax.tree.leaves(
            eqx.filter(model, eqx.is_inexact_array)))
        # A Gaussian likelihood of noise scale 0.1 (a bare MSE is variance 0.5).
        nll = jnp.mean((jax.vmap(model)(x)[:, 0] - y) ** 2) / (2 * 0.1**2)
        return nll + prior / 64

    ens = ee.ensemble(lambda k: eqx.nn.MLP(1, 1, 16, 1, key=k), size=5,
                      key=jax.random.key(0))
    x = jax.random.uniform(jax.random.key(1), (64, 1), minval=-1, maxval=1)
    result = ee.fit(ens, ee.svgd(loss, num_data=64), optax.adam(1e-2),
                    (x, jnp.sin(3 * x[:, 0])), steps=100, batch_size=64,
                    key=jax.random.key(2), callbacks=())
    ```
    """
    if not callable(loss_fn):
        raise TypeError(f"`loss_fn` must be callable, got {type(loss_fn).__name__}")
    num_data = check_positive_int(num_data, "num_data")
    _check_bandwidth(bandwidth)

    def objective(ens: Any, batch: Any, keys: Any, **kwargs: Any) -> jax.Array:
        size = _check_particles(ens, "svgd")
        per_member = _per_member(keys, kwargs)

        def value_and_grad(model, key, *hyper):
            extra = {"hyper": hyper[0]} if hyper else {}
            return eqx.filter_value_and_grad(lambda m: loss_fn(m, batch, key, **extra))(
                model
            )

        losses, grads = ensemble_map(
            value_and_grad, ens, *per_member, in_axes=(0,) * len(per_member)
        )
        theta = _flat(ens.members, size)
        # A member whose loss is not finite takes no part either.
        log_prob_grads = jnp.where(
            jnp.isfinite(losses)[:, None], -num_data * _flat(grads, size), jnp.nan
        )
        phi = svgd_direction(
            jax.lax.stop_gradient(theta),
            jax.lax.stop_gradient(log_prob_grads),
            bandwidth,
        )
        # Value: each member's loss; gradient with respect to its weights: -phi.
        step = -jnp.sum(jax.lax.stop_gradient(phi) * theta, axis=1)
        return jax.lax.stop_gradient(losses) + step - jax.lax.stop_gradient(step)

    return Coupled(objective, shared_batch=True)


def repulsive(
    loss_fn: Callable[..., Any],
    *,
    num_data: int,
    features: Callable[..., Any] | None = None,
    bandwidth: float | None = None,
) -> Coupled:
    """Repulsive deep ensembles (D'Angelo & Fortuin 2021): each member climbs
    its own log posterior and is pushed away from the others by the gradient of
    a kernel density estimate of the members, in weight space or, with
    `features`, in function space. Member `i` moves along

    `grad log p(theta_i | D) - J_i^T [sum_j grad_{f_i} k(f_i, f_j) / sum_j k(f_i, f_j)]`

    where `log p(theta | D) = -num_data * loss_fn(model, batch, key)`, `f_i` is
    the member's point in the kernel's space and `J_i` its Jacobian:

    - weight space (`features=None`): `f_i` its flattened weights, `J_i = I`;
    - function space: `f_i = features(model, batch)` flattened, e.g. the
      member's outputs on the batch or on points beyond the data (the
      functional prior's gradient is approximated by the weight prior's, in
      `loss_fn`, as the paper does).

    `k` is the RBF kernel and the loss is coupled as in
    [`ee.svgd`][eqx_ensemble.svgd] (one batch for every member, each reporting
    its own `loss_fn`). A member whose loss or features are not finite takes no
    part in that step's repulsion and is frozen by `fit`'s guard. Unlike
    `svgd`, the repulsion is per member (one extra backward pass through
    `features`), and the function-space kernel sidesteps the weights'
    symmetries (permuted hidden units are the same function).

    **Arguments:**

    - `loss_fn`: the loss of ONE model, `(model, batch, key) -> scalar`: the
      mean negative log likelihood of the batch plus the negative log prior
      over `num_data`.
    - `num_data`: the number of training examples.
    - `features`: `(model, batch) -> array` for function-space repulsion (the
      same shape for every member); `None` repels in weight space.
    - `bandwidth`: a fixed kernel bandwidth `h` (default: median heuristic).

    **Returns:**

    An [`ee.Coupled`][eqx_ensemble.Coupled] loss.

    **Example:**

    ```python
    x = jax.random.uniform(jax.random.key(1), (64, 1), minval=-1, maxval=1)
    beyond = jnp.linspace(-3, 3, 16)[:, None]      # where the members should differ

    def loss(model, batch, key):
        xs, ys = batch
        weights = jax.tree.leaves(eqx.filter(model, eqx.is_inexact_array))
        prior = 0.5 * sum(jnp.sum(w**2) for w in weights)
        nll = jnp.mean((jax.vmap(model)(xs)[:, 0] - ys) ** 2) / (2 * 0.1**2)
        return nll + prior / 64

    ens = ee.ensemble(lambda k: eqx.nn.MLP(1, 1, 16, 1, key=k), size=5,
                      key=jax.random.key(0))
    repel = ee.repulsive(loss, num_data=64,
                         features=lambda model, batch: jax.vmap(model)(beyond))
    result = ee.fit(ens, repel, optax.adam(1e-2), (x, jnp.sin(3 * x[:, 0])),
                    steps=100, batch_size=64, key=jax.random.key(2), callbacks=())
    ```
    """
    if not callable(loss_fn):
        raise TypeError(f"`loss_fn` must be callable, got {type(loss_fn).__name__}")
    if features is not None and not callable(features):
        raise TypeError(
            f"`features` must be a function (model, batch) -> array, got "
            f"{type(features).__name__}"
        )
    num_data = check_positive_int(num_data, "num_data")
    _check_bandwidth(bandwidth)

    def member_terms(model, key, *hyper, batch):
        extra = {"hyper": hyper[0]} if hyper else {}
        loss = loss_fn(model, batch, key, **extra)
        if features is None:
            leaves = jax.tree.leaves(eqx.filter(model, eqx.is_inexact_array))
            point = jnp.concatenate([leaf.reshape(-1) for leaf in leaves])
        else:
            point = jnp.asarray(features(model, batch))
            if not jnp.issubdtype(point.dtype, jnp.floating):
                raise TypeError(
                    f"`features` must return a float array, got {point.dtype}"
                )
            point = point.reshape(-1)
        return loss, point

    def objective(ens: Any, batch: Any, keys: Any, **kwargs: Any) -> jax.Array:
        _check_particles(ens, "repulsive")
        per_member = _per_member(keys, kwargs)
        losses, points = ensemble_map(
            lambda model, *args: member_terms(model, *args, batch=batch),
            ens,
            *per_member,
            in_axes=(0,) * len(per_member),
        )
        fixed = jax.lax.stop_gradient(points)
        finite = jnp.isfinite(jax.lax.stop_gradient(losses)) & jnp.all(
            jnp.isfinite(fixed), axis=1
        )
        fixed = jnp.where(finite[:, None], fixed, 0.0)
        kernel, h, _ = _rbf_kernel(fixed, finite, bandwidth)
        # sum_j grad_{f_i} k(f_i, f_j) = -(2/h) sum_j (f_i - f_j) k_ij
        grad_sum = -(2 / h) * (fixed * kernel.sum(1)[:, None] - kernel @ fixed)
        density_grad = grad_sum / jnp.maximum(kernel.sum(1), 1e-30)[:, None]
        density_grad = jnp.where(finite[:, None], density_grad, jnp.nan)
        # d/dtheta_i: num_data * grad loss_i + J_i^T (density gradient of i).
        pulled = jnp.sum(jax.lax.stop_gradient(density_grad) * points, axis=1)
        step = num_data * losses + pulled
        return jax.lax.stop_gradient(losses) + step - jax.lax.stop_gradient(step)

    return Coupled(objective, shared_batch=True)
