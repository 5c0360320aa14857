"""Out-of-distribution detectors in the members' feature space: Mahalanobis
distance to the class means (Lee et al. 2018), the class-conditional Gaussian
density of DDU (Mukhoti et al. 2023) and the k-th nearest neighbour distance
(Sun et al. 2022), each fitted per member."""

import numbers
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.scipy.special import logsumexp
from jaxtyping import Array, ArrayLike, Float, Int

from .._core.ensemble import Ensemble
from .._core.predict import predict
from .._execution.compile import one_shot_jit
from .._internal.tree import is_traced
from .checks import as_float_array


def _features(features: Any, name: str = "features") -> Array:
    array = as_float_array(features, name)
    if array.ndim != 3:
        raise ValueError(
            f"`{name}` must have shape (members, batch, dim): each member's feature "
            f"vector of each example (e.g. from `ee.map`), got shape "
            f"{tuple(array.shape)}"
        )
    if array.shape[1] == 0 or array.shape[2] == 0:
        raise ValueError(
            f"`{name}` must hold at least one example of at least one feature, got "
            f"shape {tuple(array.shape)} (members, batch, dim)"
        )
    if not np.isfinite(np.asarray(array)).all():
        raise ValueError(f"`{name}` holds NaN or inf")
    return array


def _labels(labels: Any, batch: int) -> tuple[np.ndarray, int]:
    y = np.asarray(labels)
    if y.shape != (batch,) or not np.issubdtype(y.dtype, np.integer):
        raise ValueError(
            f"`labels` must be {batch} integer class labels (one per example of "
            f"`features`), got {y.dtype} of shape {y.shape}"
        )
    if y.min() < 0:
        raise ValueError(f"`labels` must be non-negative, got {int(y.min())}")
    classes = int(y.max()) + 1
    missing = sorted(set(range(classes)) - set(y.tolist()))
    if missing:
        raise ValueError(
            f"classes {missing} have no example in `labels`: every class up to the "
            "largest label needs its features to fit its Gaussian"
        )
    return y, classes


def _class_means(f: np.ndarray, y: np.ndarray, classes: int) -> np.ndarray:
    return np.stack([f[:, y == c].mean(axis=1) for c in range(classes)], axis=1)


def _applied(features: Any, members: int, dim: int, who: str) -> Array:
    """`features` as a float array `(members, batch, dim)` matching the fit."""
    f = as_float_array(features, "features")
    if f.ndim != 3 or f.shape[0] != members or f.shape[2] != dim:
        raise ValueError(
            f"{who} was fitted on {members} members' features of dimension {dim}, "
            f"got features of shape {tuple(f.shape)} (members, batch, dim)"
        )
    if not is_traced(f):
        bad = ~np.isfinite(np.asarray(f))
        if bad.any():
            member, example, _ = np.argwhere(bad)[0].tolist()
            raise ValueError(
                f"{who}: `features` holds {int(bad.sum())} non-finite value(s), the "
                f"first of member {member}, example {example}; drop diverged "
                "members or bad inputs first"
            )
    return f


class Mahalanobis(eqx.Module):
    """The Mahalanobis OOD score (Lee et al. 2018): each example's smallest
    squared Mahalanobis distance to a class mean, under one shared covariance;
    higher is more likely OOD. Fitted by
    [`fit_mahalanobis`][eqx_ensemble.ood.fit_mahalanobis]; maps features
    `(members, batch, dim)` to each member's scores `(members, batch)` (average
    over axis 0 for the ensemble's).

    **Example:**

    ```python
    detector = ee.ood.Mahalanobis(jnp.zeros((1, 2, 3)), jnp.eye(3)[None])
    detector(jnp.ones((1, 4, 3))).shape          # (1, 4)
    ```
    """

    means: Float[Array, "members classes dim"]
    precision: Float[Array, "members dim dim"]
    # `W` with `W' W = P`: a distance is `|W c|^2`, a sum of squares, where
    # `c' P c` cancels in float32 (71% off scikit-learn at feature scale 1e-4).
    # `fit_mahalanobis` computes it in float64 from the covariance.
    whitening: Float[Array, "members dim dim"]

    def __init__(
        self,
        means: Float[ArrayLike, "members classes dim"],
        precision: Float[ArrayLike, "members dim dim"],
        whitening: Float[ArrayLike, "members dim dim"] | None = None,
    ):
        self.means = jnp.asarray(means)
        self.precision = jnp.asarray(precision)
        self.whitening = (
            _square_root(precision, self.precision.dtype)
            if whitening is None
            else jnp.asarray(whitening, self.precision.dtype)
        )

    def __call__(
        self, features: Float[ArrayLike, "members batch dim"]
    ) -> Float[Array, "members batch"]:
        members, dim = self.precision.shape[:2]
        f = _applied(features, members, dim, "Mahalanobis")
        return _mahalanobis(self.means, self.whitening, f)


def _square_root(precision: Any, dtype: Any) -> Array:
    """`W` with `W' W = precision` for each member, in float64 on the host."""
    if is_traced(precision):
        values, vectors = jnp.linalg.eigh(precision)
        root = jnp.sqrt(jnp.maximum(values, 0))
        return root[:, :, None] * jnp.swapaxes(vectors, -1, -2)
    array = np.asarray(precision, np.float64)
    values, vectors = np.linalg.eigh((array + np.swapaxes(array, -1, -2)) / 2)
    root = np.sqrt(np.maximum(values, 0))
    return jnp.asarray(root[:, :, None] * np.swapaxes(vectors, -1, -2), dtype)


def _inverse_square_root(covariance: np.ndarray) -> np.ndarray:
    """`W` with `W' W = pinv(covariance)` for each member, in float64."""
    values, vectors = np.linalg.eigh(covariance)
    cutoff = 1e-15 * np.max(np.abs(values), axis=-1, keepdims=True)
    kept = values > cutoff
    scale = np.where(kept, 1 / np.sqrt(np.where(kept, values, 1.0)), 0.0)
    return scale[:, :, None] * np.swapaxes(vectors, -1, -2)


@one_shot_jit
def _mahalanobis(means: Array, whitening: Array, f: Array) -> Array:
    centred = f[:, :, None, :] - means[:, None, :, :]  # (members, batch, classes, dim)
    whitened = jnp.einsum("mde,mbce->mbcd", whitening, centred)
    return jnp.min(jnp.sum(whitened**2, axis=-1), axis=-1)


def fit_mahalanobis(
    features: Float[ArrayLike, "members batch dim"], labels: Int[ArrayLike, " batch"]
) -> Mahalanobis:
    """Fit the Mahalanobis detector on training features (Lee et al. 2018): per
    member, the class means and the pooled covariance around them
    (`sklearn.covariance.EmpiricalCovariance`), pseudo-inverted.

    **Arguments:**

    - `features`: each member's feature vector of each training example, shape
      `(members, batch, dim)` (e.g. the penultimate layer, through `ee.map`).
    - `labels`: the integer class labels, shape `(batch,)`.

    **Returns:**

    A [`Mahalanobis`][eqx_ensemble.ood.Mahalanobis] detector.

    **Example:**

    ```python
    key1, key2 = jax.random.split(jax.random.key(0))
    features = jax.random.normal(key1, (3, 200, 8))       # 3 members, 8 features
    labels = jax.random.randint(key2, (200,), 0, 4)
    detector = ee.ood.fit_mahalanobis(features, labels)
    scores = detector(features + 5.0)                      # (3, 200): far away
    ```
    """
    f = _features(features)
    y, classes = _labels(labels, f.shape[1])
    array = np.asarray(f, np.float64)
    means = _class_means(array, y, classes)
    centred = array - means[:, y]
    covariance = np.einsum("mbd,mbe->mde", centred, centred) / array.shape[1]
    precision = np.stack([np.linalg.pinv(c, hermitian=True) for c in covariance])
    return Mahalanobis(
        jnp.asarray(means, f.dtype),
        jnp.asarray(precision, f.dtype),
        jnp.asarray(_inverse_square_root(covariance), f.dtype),
    )


class GaussianDensity(eqx.Module):
    """The feature-density OOD score of DDU (Mukhoti et al. 2023): minus the log
    density of each example's features under a mixture of class-conditional
    Gaussians weighted by the classes' frequencies; higher is more likely OOD.
    Fitted by [`fit_gaussian_density`][eqx_ensemble.ood.fit_gaussian_density];
    returns `(members, batch)`.

    **Example:**

    ```python
    detector = ee.ood.GaussianDensity(jnp.zeros((1, 1, 2)),
                                      jnp.eye(2)[None, None], jnp.zeros((1,)))
    detector(jnp.zeros((1, 1, 2)))           # [[log(2 pi)]] = [[1.838]]
    ```
    """

    means: Float[Array, "members classes dim"]
    cholesky: Float[Array, "members classes dim dim"]
    log_priors: Float[Array, " classes"]

    def __call__(
        self, features: Float[ArrayLike, "members batch dim"]
    ) -> Float[Array, "members batch"]:
        members, _, dim = self.means.shape
        f = _applied(features, members, dim, "GaussianDensity")
        return _negative_log_density(self.means, self.cholesky, self.log_priors, f)


@one_shot_jit
def _negative_log_density(means, cholesky, log_priors, f):
    centred = f[:, :, None, :] - means[:, None, :, :]  # (members, batch, classes, dim)
    # Solve L z = x - mu for each member and class: |z|^2 is the Mahalanobis term.
    solve = jax.vmap(  # members
        jax.vmap(  # classes
            lambda chol, x: jax.scipy.linalg.solve_triangular(chol, x.T, lower=True).T,
            in_axes=(0, 1),
            out_axes=1,
        )
    )
    z = solve(cholesky, centred)
    log_det = 2 * jnp.sum(jnp.log(jnp.diagonal(cholesky, axis1=-2, axis2=-1)), -1)
    dim = f.shape[-1]
    log_density = -0.5 * (
        jnp.sum(z**2, -1) + log_det[:, None, :] + dim * jnp.log(2 * jnp.pi)
    )
    return -logsumexp(log_density + log_priors[None, None, :], axis=-1)


def fit_gaussian_density(
    features: Float[ArrayLike, "members batch dim"],
    labels: Int[ArrayLike, " batch"],
    *,
    jitter: float = 0.0,
) -> GaussianDensity:
    """Fit DDU's class-conditional Gaussians (Mukhoti et al. 2023) on training
    features: per member and class, the mean and covariance (`np.cov(bias=True)`)
    plus `jitter` times the identity and, where still not positive definite,
    the smallest power of ten that makes it so (as DDU).

    **Arguments:**

    - `features`: as [`fit_mahalanobis`][eqx_ensemble.ood.fit_mahalanobis].
    - `labels`: the integer class labels, shape `(batch,)`.
    - `jitter`: added to every covariance's diagonal (default 0).

    **Returns:**

    A [`GaussianDensity`][eqx_ensemble.ood.GaussianDensity] detector.

    **Example:**

    ```python
    key1, key2 = jax.random.split(jax.random.key(0))
    features = jax.random.normal(key1, (2, 300, 4))
    labels = jax.random.randint(key2, (300,), 0, 3)
    detector = ee.ood.fit_gaussian_density(features, labels)
    detector(features).mean(axis=0).shape          # (300,): the ensemble's score
    ```
    """
    if (
        isinstance(jitter, bool)
        or not isinstance(jitter, numbers.Real)
        or not np.isfinite(jitter)
        or jitter < 0
    ):
        raise ValueError(
            f"`jitter` must be a finite, non-negative number, got {jitter!r}"
        )
    f = _features(features)
    y, classes = _labels(labels, f.shape[1])
    array = np.asarray(f, np.float64)
    means = _class_means(array, y, classes)
    dim = array.shape[2]
    factors = np.empty((array.shape[0], classes, dim, dim))
    for m in range(array.shape[0]):
        for c in range(classes):
            centred = array[m, y == c] - means[m, c]
            covariance = centred.T @ centred / len(centred) + jitter * np.eye(dim)
            factors[m, c] = _cholesky(
                covariance, float(np.mean(np.var(array[m], axis=0))),
                f"member {m}, class {c}",
            )  # fmt: skip
    counts = np.bincount(y, minlength=classes)
    return GaussianDensity(
        jnp.asarray(means, f.dtype),
        jnp.asarray(factors, f.dtype),
        jnp.asarray(np.log(counts / counts.sum()), f.dtype),
    )


def _cholesky(covariance: np.ndarray, pooled: float, where: str) -> np.ndarray:
    """The Cholesky factor of `covariance` plus the smallest power of ten times its
    mean variance (or `pooled`) that makes it positive definite in float32."""
    scale = float(np.mean(np.diag(covariance)))
    if not scale > 0:
        scale = pooled if pooled > 0 else 1.0
    for extra in [0.0, *(scale * 10.0**power for power in range(-10, 1))]:
        try:
            factor = np.linalg.cholesky(covariance + extra * np.eye(len(covariance)))
        except np.linalg.LinAlgError:
            continue
        diagonal = np.diag(factor).astype(np.float32)
        if np.all(np.isfinite(np.log(np.maximum(diagonal, 0.0)))):
            return factor
    raise ValueError(
        f"the features' covariance of {where} is not positive definite even with "
        f"{scale:.3g} added to its diagonal"
    )


class KNN(eqx.Module):
    """The k-th nearest neighbour OOD score (Sun et al. 2022): the distance from
    each example's normalised features to the `k`-th nearest normalised
    training features; higher is more likely OOD. Fitted by
    [`fit_knn`][eqx_ensemble.ood.fit_knn]; returns `(members, batch)`.

    **Example:**

    ```python
    bank = jnp.array([[[1.0, 0.0], [0.0, 1.0]]])     # one member, 2 features
    ee.ood.KNN(bank, k=1)(jnp.array([[[2.0, 0.0]]]))  # [[0.0]]: its direction
    ```
    """

    bank: Float[Array, "members n dim"]
    k: int = eqx.field(static=True)

    def __call__(
        self, features: Float[ArrayLike, "members batch dim"]
    ) -> Float[Array, "members batch"]:
        members, _, dim = self.bank.shape
        f = _applied(features, members, dim, "KNN")
        return _kth_distance(self.bank, f, self.k)


def _normalised(f: Array) -> Array:
    norm = jnp.linalg.norm(f, axis=-1, keepdims=True)
    return f / jnp.maximum(norm, jnp.finfo(f.dtype).tiny)


@eqx.filter_jit
def _kth_distance(bank: Array, f: Array, k: int) -> Array:
    f = _normalised(f)
    # |a - b|^2 = 2 - 2 a.b for unit vectors (clipped at 0 against rounding).
    similarity = jnp.einsum("mbd,mnd->mbn", f, bank)
    nearest = -jax.lax.top_k(-(2 - 2 * similarity), k)[0][..., -1]
    return jnp.sqrt(jnp.maximum(nearest, 0.0))


def fit_knn(
    features: Float[ArrayLike, "members batch dim"], *, k: int | np.integer = 50
) -> KNN:
    """Keep the normalised training features for the KNN OOD score (Sun et al.
    2022; `k=50` as in the paper for CIFAR-10 with all training data).

    **Arguments:**

    - `features`: each member's training features, shape `(members, n, dim)`.
    - `k`: the neighbour whose distance is the score, `1 <= k <= n`.

    **Returns:**

    A [`KNN`][eqx_ensemble.ood.KNN] detector.

    **Example:**

    ```python
    features = jax.random.normal(jax.random.key(0), (2, 100, 8))
    detector = ee.ood.fit_knn(features, k=5)
    detector(features).shape                     # (2, 100)
    ```
    """
    f = _features(features)
    if (
        isinstance(k, bool | np.bool_)
        or not isinstance(k, numbers.Integral)
        or not 1 <= k <= f.shape[1]
    ):
        raise ValueError(
            f"`k` must be an int from 1 to the number of training examples "
            f"({f.shape[1]}), got {k!r}"
        )
    return KNN(_normalised(f), int(k))


def penultimate_features(
    ens: Ensemble,
    x: Float[ArrayLike, " batch *input"],
    *,
    chunk_size: int | None = None,
) -> Float[Array, "members batch dim"]:
    """Every member's features before its last layer: each `eqx.nn.MLP` or
    `eqx.nn.Sequential` member with its last layer (and an MLP's
    `final_activation`) replaced by the identity, run by
    [`ee.predict`][eqx_ensemble.predict]. For any other model, map a function of
    one member: `ee.map(lambda m, xs: jax.vmap(m.features)(xs), ens, x)`.

    **Arguments:**

    - `ens`: an [`ee.Ensemble`][eqx_ensemble.Ensemble] of MLPs or Sequentials.
    - `x`: a batch of inputs, `(batch, ...)`.
    - `chunk_size`: as `ee.predict`'s (members at a time, to bound memory).

    **Returns:**

    The features, `(members, batch, dim)`.

    **Example:**

    ```python
    ens = ee.ensemble(lambda k: eqx.nn.MLP(2, 3, 16, 2, key=k), size=4,
                      key=jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (300, 2))
    labels = (x[:, 0] > 0).astype(jnp.int32)
    train = ee.ood.penultimate_features(ens, x)           # (4, 300, 16)
    detector = ee.ood.fit_mahalanobis(train, labels)
    scores = detector(ee.ood.penultimate_features(ens, x + 10.0)).mean(0)
    ```
    """
    if not isinstance(ens, Ensemble):
        raise TypeError(
            "`ee.ood.penultimate_features` takes an ee.Ensemble, got "
            f"{type(ens).__name__}; for an ee.Heterogeneous, take each group's"
        )
    members = ens.members
    if isinstance(members, eqx.nn.MLP):
        if members.out_size == "scalar":
            raise ValueError(
                "an eqx.nn.MLP with out_size='scalar' indexes its last layer's "
                "output: write its features with ee.map (see the docstring)"
            )

        def cut(model: Any) -> Any:
            model = eqx.tree_at(lambda m: m.layers[-1], model, eqx.nn.Identity())
            return eqx.tree_at(lambda m: m.final_activation, model, _identity)

    elif isinstance(members, eqx.nn.Sequential):

        def cut(model: Any) -> Any:
            return eqx.tree_at(lambda m: m.layers[-1], model, eqx.nn.Identity())

    else:
        raise TypeError(
            "`ee.ood.penultimate_features` knows the last layer of an eqx.nn.MLP "
            f"or eqx.nn.Sequential, not of {type(members).__name__}: write the "
            "features as a function of one member and map it, e.g. "
            "`ee.map(lambda m, xs: jax.vmap(m.features)(xs), ens, x)`"
        )
    cut_ens = eqx.tree_at(lambda e: e.members, ens, cut(members))
    if ens.shared is not None:
        cut_ens = eqx.tree_at(
            lambda e: e.shared, cut_ens, cut(ens.shared), is_leaf=lambda v: v is None
        )
    return predict(cut_ens, x, chunk_size=chunk_size)


def _identity(x: Any) -> Any:
    return x
