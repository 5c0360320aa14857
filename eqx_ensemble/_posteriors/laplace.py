"""`laplace`: a Laplace approximation per member around its trained weights, for
one part of the model (the last layer by default), and the mixture over members
(Eschenhagen et al. 2021)."""

import math
import warnings
from collections.abc import Callable
from typing import Any, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax.flatten_util import ravel_pytree
from jaxtyping import Array, ArrayLike, Float, Int, PRNGKeyArray, PyTree

from .._core.ensemble import Ensemble, with_members
from .._core.heterogeneous import is_ensemble
from .._internal.checks import check_choice, check_positive_int, first_non_finite
from .._internal.keys import check_key
from .._internal.search import golden_section
from .._internal.tree import keystr

Likelihood = Literal["classification", "regression"]
Curvature = Literal["diagonal", "kfac", "full"]
_LIKELIHOODS = ("classification", "regression")
_CURVATURES = ("kfac", "diagonal", "full")

# A dense curvature holds P x P numbers per member.
FULL_MAX_PARAMETERS = 4096
# The range searched for the prior precision, and the golden-section steps.
PRIOR_BOUNDS = (1e-6, 1e8)
PRIOR_ITERATIONS = 100


def last_linear(model: Any) -> Any:
    """The last `eqx.nn.Linear` of `model` (in the order of its fields)."""
    found = [
        node
        for node in jtu.tree_leaves(
            model, is_leaf=lambda x: isinstance(x, eqx.nn.Linear)
        )
        if isinstance(node, eqx.nn.Linear)
    ]
    if not found:
        raise ValueError(
            "`ee.laplace` takes the last `eqx.nn.Linear` of the model as its part by "
            "default, and this model has none: pass `part=lambda model: ...` "
            "selecting the weights to approximate"
        )
    return found[-1]


def _part_arrays(part: Any, model: Any) -> Any:
    try:
        selected = part(model)
    except Exception as error:  # noqa: BLE001 - reported with its cause
        raise ValueError(
            f"`part` failed on the model ({type(error).__name__}: {error}); it must "
            "select a sub-tree of ONE member, e.g. `lambda model: model.layers[-1]`"
        ) from error
    arrays = eqx.filter(selected, eqx.is_inexact_array)
    if not jtu.tree_leaves(arrays):
        raise ValueError(
            f"`part` selects no floating-point array of the model (it selected "
            f"{type(selected).__name__}); select the weights to approximate, e.g. "
            "`lambda model: model.layers[-1]`"
        )
    return selected, arrays


class _Tapped(eqx.Module):
    """A linear layer whose output gets `delta` added: the Jacobian with respect
    to `delta` is the one with respect to the layer's output."""

    linear: eqx.nn.Linear
    delta: Array

    def __call__(self, x: Array, *, key: Any = None) -> Array:
        out = self.linear(x, key=key)  # `()` for `out_features="scalar"`
        return out + self.delta.reshape(jnp.shape(out))


class LaplacePosterior(eqx.Module):
    """Each member's Laplace approximation, made by
    [`ee.laplace`][eqx_ensemble.laplace]: a Gaussian over the member's part with
    mean the trained weights and precision `H + prior_precision * I`.

    - `ensemble`: the trained ensemble (the means).
    - `prior_precision`, `log_likelihood`: `(members,)` each member's prior
      precision and log likelihood of the data.
    - `mean`: `(members, P)` the part's weights, flattened (`ravel_pytree`
      order).
    - the curvature's eigendecomposition: `eigenvalues` (diagonal: the diagonal
      itself; full: of `H`) and `eigenvectors` (full), or for KFAC `H = G (x) A`
      `out_eigenvalues`, `out_eigenvectors` (`G`, over the layer's outputs) and
      `in_eigenvalues`, `in_eigenvectors` (`A`, inputs and a bias column).
    - `sigma_noise`, `num_data`: the regression noise's standard deviation and
      the number of examples fitted on.

    Saved as any tree: `ee.save(path, posterior)`, then
    `ee.load(path, ee.LaplacePosterior.like(ens, likelihood=...))`.

    **Example:**

    ```python
    x = jax.random.normal(jax.random.key(0), (50, 2))
    y = (x[:, 0] > 0).astype(jnp.int32)
    ens = ee.ensemble(lambda k: eqx.nn.MLP(2, 2, 8, 1, key=k), size=3,
                      key=jax.random.key(1))
    posterior = ee.laplace(ens, (x, y), likelihood="classification",
                           prior_precision="marglik")
    posterior.prior_precision                # (3,)
    posterior.mean.shape                     # (3, 18): the last layer's weights
    ```
    """

    ensemble: Ensemble
    prior_precision: Float[Array, " members"]
    log_likelihood: Float[Array, " members"]
    mean: Float[Array, "members parameters"]
    eigenvalues: Array | None
    eigenvectors: Array | None
    out_eigenvalues: Array | None
    out_eigenvectors: Array | None
    in_eigenvalues: Array | None
    in_eigenvectors: Array | None
    sigma_noise: Float[Array, ""]
    num_data: Int[Array, ""]
    likelihood: str = eqx.field(static=True)
    curvature: str = eqx.field(static=True)
    part: Callable[[Any], Any] = eqx.field(static=True)

    @classmethod
    def like(
        cls,
        ens: Ensemble,
        *,
        likelihood: Likelihood,
        curvature: Curvature = "kfac",
        part: Callable[[Any], Any] | None = None,
    ) -> "LaplacePosterior":
        """The structure `ee.laplace(ens, ..., likelihood=, curvature=, part=)`
        returns, as shapes: the `like` of [`ee.load`][eqx_ensemble.load] for a
        saved posterior. `ens` may be freshly built, of the same architecture and
        size.

        **Example:**

        ```python
        ens = ee.ensemble(lambda k: eqx.nn.MLP(2, 2, 8, 1, key=k), size=3,
                          key=jax.random.key(1))
        x = jax.random.normal(jax.random.key(0), (50, 2))
        posterior = ee.laplace(ens, (x, (x[:, 0] > 0).astype(jnp.int32)),
                               likelihood="classification", prior_precision="marglik")
        ee.save("posterior.ckpt", posterior)
        like = ee.LaplacePosterior.like(ens, likelihood="classification")
        loaded = ee.load("posterior.ckpt", like)
        loaded.prior_precision.shape     # (3,)
        ```
        """
        likelihood = check_choice(likelihood, "likelihood", _LIKELIHOODS)  # type: ignore[assignment]
        curvature = check_choice(curvature, "curvature", _CURVATURES)  # type: ignore[assignment]
        part = last_linear if part is None else part
        selected, arrays = _part_arrays(part, ens[0])
        theta = ravel_pytree(arrays)[0]  # the sums are in the part's dtype
        size, parameters = len(ens), int(theta.shape[0])

        def zeros(*shape: int) -> jax.ShapeDtypeStruct:
            return jax.ShapeDtypeStruct((size, *shape), theta.dtype)

        if curvature == "kfac":
            _check_kfac_part(selected)
        shapes = _curvature_shapes(selected, parameters, curvature)
        sums = (zeros(parameters), tuple(zeros(*shape) for shape in shapes), zeros())
        return eqx.filter_eval_shape(
            lambda e, s: _finish(e, s, 1, likelihood, part, curvature, 1.0), ens, sums
        )

    def _unravel(self) -> Callable[[Array], Any]:
        _, arrays = _part_arrays(self.part, self.ensemble[0])
        return ravel_pytree(arrays)[1]

    def _kfac_order(self) -> np.ndarray:
        """Index into the row-major `(out, in [+ 1])` KFAC order of each weight
        of the flattened part (`weight` then `bias`)."""
        linear = self.part(self.ensemble[0])
        out_size, in_size = linear.weight.shape
        columns = in_size + (1 if linear.bias is not None else 0)
        weight = (np.arange(out_size)[:, None] * columns + np.arange(in_size)).ravel()
        if linear.bias is None:
            return weight
        return np.concatenate([weight, np.arange(out_size) * columns + in_size])

    def _kfac_factors(self) -> tuple[Array, Array, Array, Array]:
        """`G`'s eigenvalues and eigenvectors, then `A`'s."""
        assert self.out_eigenvalues is not None and self.out_eigenvectors is not None
        assert self.in_eigenvalues is not None and self.in_eigenvectors is not None
        return (
            self.out_eigenvalues,
            self.out_eigenvectors,
            self.in_eigenvalues,
            self.in_eigenvectors,
        )

    def _log_eigenvalues_sum(self, prior: Array) -> Array:
        """`log det(H + prior I)` per member, `prior` `(members,)`."""
        if self.curvature == "kfac":
            g_values, _, a_values, _ = self._kfac_factors()
            values = g_values[:, :, None] * a_values[:, None, :]
            values = values.reshape(values.shape[0], -1)
        else:
            assert self.eigenvalues is not None
            values = self.eigenvalues
        return jnp.sum(jnp.log(values + prior[:, None]), axis=-1)

    def log_marginal_likelihood(
        self,
        prior_precision: Float[ArrayLike, " members"]
        | Float[ArrayLike, ""]
        | float
        | None = None,
    ) -> Float[Array, " members"]:
        """Each member's Laplace log marginal likelihood, `log p(D | theta) -
        prior/2 |theta|^2 + P/2 log(prior) - 1/2 log det(H + prior I)` (MacKay
        1992; Immer et al. 2021), at the given prior precision (default: its own).

        **Arguments:**

        - `prior_precision`: a positive scalar or one per member.

        **Returns:**

        Shape `(members,)`.

        **Example:**

        ```python
        x = jax.random.normal(jax.random.key(0), (50, 2))
        y = (x[:, 0] > 0).astype(jnp.int32)
        ens = ee.ensemble(lambda k: eqx.nn.MLP(2, 2, 8, 1, key=k), size=3,
                          key=jax.random.key(1))
        posterior = ee.laplace(ens, (x, y), likelihood="classification",
                               prior_precision="marglik")
        posterior.log_marginal_likelihood()        # (3,): at the tuned priors
        posterior.log_marginal_likelihood(10.0)    # (3,): lower
        ```
        """
        size = self.mean.shape[0]
        prior = (
            self.prior_precision
            if prior_precision is None
            else _check_prior(prior_precision, size)
        )
        return _log_marginal_likelihood(self, prior)

    def optimize_prior_precision(
        self,
        validation: tuple[PyTree[Any], ArrayLike] | None = None,
        *,
        grid: Float[ArrayLike, " values"] | None = None,
    ) -> "LaplacePosterior":
        """The posterior with each member's prior precision tuned.

        - Without `validation`: the prior precision maximising each member's log
          marginal likelihood (golden-section search over `log prior` in
          `[1e-6, 1e8]`). Trusts the trained weights to be the MAP of that
          prior: without the matching weight decay it can pick a far too weak
          prior (underconfident predictions).
        - With `validation=(x, y)`: for each member, the value of `grid` whose
          linearised predictive has the lowest NLL on the held-out data
          (laplace-torch's `gridsearch`). Default grid: 41 log-spaced values
          from `1e-4` to `1e4`, extended by 20 values over 4 more decades past
          an end a member chose (up to `1e8`, the trained weights' own
          predictive). A best value at the grid's lowest (or either end of a
          given `grid`) raises an
          [`ee.PriorAtGridEndWarning`][eqx_ensemble.PriorAtGridEndWarning].

        **Arguments:**

        - `validation`: optional held-out `(x, y)`, as `ee.laplace`'s `data`.
        - `grid`: the positive values tried with `validation` (default above).

        **Returns:**

        A new `LaplacePosterior`.

        **Example:**

        ```python
        x = jax.random.normal(jax.random.key(0), (50, 2))
        y = (x[:, 0] > 0).astype(jnp.int32)
        ens = ee.ensemble(lambda k: eqx.nn.MLP(2, 2, 8, 1, key=k), size=3,
                          key=jax.random.key(1))
        fixed = ee.laplace(ens, (x, y), likelihood="classification",
                          prior_precision=1.0)
        fixed.optimize_prior_precision().prior_precision   # as "marglik" gives
        import warnings

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            tuned = fixed.optimize_prior_precision((x[:20], y[:20]))  # by NLL
        tuned.prior_precision    # untrained members: more spread always helps,
        caught[0].category       # to the grid's end: ee.PriorAtGridEndWarning
        ```
        """
        if validation is None:
            if grid is not None:
                raise ValueError("`grid` is searched with `validation` data only")
            prior = _optimize_prior(self)
        else:
            prior = _validation_prior(self, validation, grid)
        return eqx.tree_at(lambda p: p.prior_precision, self, prior)

    def sample(self, key: PRNGKeyArray, samples: int = 1) -> Ensemble:
        """Draw weights of every member's part from its posterior; `ee.predict`
        on the result is the Monte Carlo predictive.

        **Arguments:**

        - `key`: PRNG key.
        - `samples`: draws per member.

        **Returns:**

        An `Ensemble` of `members * samples` models, member `i`'s draws at `i *
        samples, ..., (i + 1) * samples - 1`.

        **Example:**

        ```python
        x = jax.random.normal(jax.random.key(0), (50, 2))
        y = (x[:, 0] > 0).astype(jnp.int32)
        ens = ee.ensemble(lambda k: eqx.nn.MLP(2, 2, 8, 1, key=k), size=3,
                          key=jax.random.key(1))
        posterior = ee.laplace(ens, (x, y), likelihood="classification",
                               prior_precision="marglik")
        draws = posterior.sample(jax.random.key(2), samples=5)   # 15 models
        ee.predict(draws, x).shape                               # (15, 50, 2)
        ```
        """
        check_key(key)
        check_positive_int(samples, "samples")
        return _sample(self, key, samples)

    def predict(
        self,
        x: PyTree[Any],
        *,
        samples: int | None = None,
        key: PRNGKeyArray | None = None,
    ) -> Any:
        """The linearised (GLM) predictive of every member on a batch of inputs
        `x`: the network linearised in its part around the trained weights, so
        the outputs are Gaussian with covariance `S = J Sigma J^T` (Immer et al.
        2021).

        **Arguments:**

        - `x`: inputs with a leading batch axis.
        - `samples`, `key`: Monte Carlo draws of the logits instead of the probit
          approximation (classification only).

        **Returns:**

        Per-member predictions, as every `ee.metrics` function takes them:

        - classification: log-probabilities `(members, batch, classes)`, usable as
          logits, by the probit approximation `log_softmax(f / sqrt(1 + pi/8
          diag(S)))` (MacKay 1992), or the log of the mean softmax of `samples`
          draws of the logits;
        - regression: `(mean, variance)`, each `(members, batch)` (or `(members,
          batch, outputs)`), the variance `diag(S) + sigma_noise**2`.

        **Example:**

        ```python
        x = jax.random.normal(jax.random.key(0), (50, 2))
        y = (x[:, 0] > 0).astype(jnp.int32)
        ens = ee.ensemble(lambda k: eqx.nn.MLP(2, 2, 8, 1, key=k), size=3,
                          key=jax.random.key(1))
        posterior = ee.laplace(ens, (x, y), likelihood="classification",
                               prior_precision="marglik")
        posterior.predict(x[:4]).shape          # (3, 4, 2): probit logits, per member
        posterior.predict(x[:4], samples=100, key=jax.random.key(2))  # Monte Carlo
        ```
        """
        if (samples is None) != (key is None):
            raise ValueError("pass both `samples` and `key` (or neither)")
        if samples is not None:
            if self.likelihood != "classification":
                raise ValueError(
                    "`samples` draws logits: for regression the linearised "
                    "predictive is Gaussian already"
                )
            check_positive_int(samples, "samples")
            check_key(key)
        return _predict(self, x, samples, key)

    def curvature_matrix(self) -> Float[Array, "members parameters parameters"]:
        """Each member's curvature `H` (without the prior), dense over the part's
        flattened weights (the order of `mean`).

        **Returns:**

        Shape `(members, P, P)`.

        **Example:**

        ```python
        x = jax.random.normal(jax.random.key(0), (50, 2))
        y = (x[:, 0] > 0).astype(jnp.int32)
        ens = ee.ensemble(lambda k: eqx.nn.MLP(2, 2, 8, 1, key=k), size=3,
                          key=jax.random.key(1))
        posterior = ee.laplace(ens, (x, y), likelihood="classification",
                               prior_precision="marglik")
        posterior.curvature_matrix().shape      # (3, 18, 18): the last layer's 18
        ```
        """

        def product(values: Array, vectors: Array) -> Array:  # Q diag(values) Q^T
            return jnp.einsum("mij,mj,mkj->mik", vectors, values, vectors)

        if self.curvature == "diagonal":
            assert self.eigenvalues is not None
            return jax.vmap(jnp.diag)(self.eigenvalues)
        if self.curvature == "full":
            assert self.eigenvalues is not None and self.eigenvectors is not None
            return product(self.eigenvalues, self.eigenvectors)
        g_values, g_vectors, a_values, a_vectors = self._kfac_factors()
        dense = jax.vmap(jnp.kron)(
            product(g_values, g_vectors), product(a_values, a_vectors)
        )
        order = self._kfac_order()  # `dense` is over (out, in + bias), row-major
        return dense[:, order][:, :, order]


def _with_part(part: Callable[[Any], Any], model: Any, arrays: Any) -> Any:
    """`model` with the arrays of its part replaced by `arrays`."""
    static = eqx.filter(part(model), eqx.is_inexact_array, inverse=True)
    return eqx.tree_at(
        part, model, eqx.combine(arrays, static), is_leaf=lambda x: x is None
    )


def _model(member: Any, shared: Any) -> Any:
    """One member as a model: its own part completed by the shared one."""
    return member if shared is None else eqx.combine(member, shared)


def _check_prior(value: Any, size: int) -> Array:
    if isinstance(value, str):
        raise ValueError(
            f"`prior_precision` must be a positive number, one per member, or "
            f"'marglik', got {value!r}"
        )
    if isinstance(value, bool):
        raise TypeError(f"`prior_precision` must be a number, got {value!r}")
    array = jnp.asarray(value, jnp.float32)
    if array.ndim == 0:
        array = jnp.full((size,), array)
    if array.shape != (size,):
        raise ValueError(
            f"`prior_precision` must be a scalar or one value per member ({size}), "
            f"got shape {tuple(array.shape)}"
        )
    values = np.asarray(array)
    bad = ~(np.isfinite(values) & (values > 0))
    if bad.any():
        raise ValueError(
            f"`prior_precision` must be positive and finite, got {values.tolist()} "
            f"(member {int(np.argmax(bad))})"
        )
    return array


def laplace(
    ens: Ensemble,
    data: tuple[PyTree[Any], ArrayLike],
    *,
    likelihood: Likelihood,
    part: Callable[[Any], Any] | None = None,
    curvature: Curvature = "kfac",
    prior_precision: Float[ArrayLike, " members"]
    | Float[ArrayLike, ""]
    | float
    | Literal["marglik"]
    | None = None,
    sigma_noise: float | int = 1.0,
    batch_size: int = 256,
    validation: tuple[PyTree[Any], ArrayLike] | None = None,
) -> LaplacePosterior:
    """Fit a Laplace approximation to every member around its trained weights
    (MacKay 1992; Daxberger et al. 2021), for one part of the model, all members
    at once: the mixture of Laplace approximations of Eschenhagen et al. (2021).

    Each member's part gets the posterior `N(theta, (H + prior I)^-1)`, `theta`
    its trained weights and `H` the generalised Gauss-Newton matrix (GGN, here
    also the Fisher) of the summed NLL of `data`: `sum_n J_n^T Lambda_n J_n`,
    `J_n` the Jacobian of the output in the part and `Lambda_n` the likelihood's
    Hessian in the output (`diag(p) - p p^T` softmax, `I / sigma_noise**2`
    Gaussian). Its eigenvalues are clipped at 0: the posterior's precision is
    positive definite.

    **Arguments:**

    - `ens`: the trained ensemble; a member maps ONE input to logits `(classes,)`
      (classification) or its mean, a scalar or `(outputs,)` (regression).
    - `data`: the training data `(x, y)` with a leading example axis (`y`:
      integer labels, or regression targets shaped like the outputs).
    - `likelihood`: `"classification"` (softmax) or `"regression"` (Gaussian
      with standard deviation `sigma_noise`).
    - `part`: `part(model) -> sub-tree` selecting the weights to approximate
      (as `eqx.tree_at`'s `where`); default the last `eqx.nn.Linear`
      (last-layer Laplace). The rest stays at its trained value.
    - `curvature`: `"kfac"` (Kronecker-factored, Martens and Grosse 2015, for a
      part that is one `eqx.nn.Linear` applied once per input: `H ~ G (x) A`,
      `G` the mean output-side GGN, `A` the sum of the layer's input outer
      products; exact when `D^T Lambda D` is the same for every example);
      `"diagonal"` (the GGN's diagonal, any part); `"full"` (the dense GGN, a
      part of at most 4096 weights).
    - `prior_precision`: the isotropic Gaussian prior's precision, a positive
      scalar or one per member; or `"marglik"`: each member's own, tuned by its
      log marginal likelihood
      ([`optimize_prior_precision`][eqx_ensemble.LaplacePosterior.optimize_prior_precision]
      without `validation`), which trusts the trained weights to be the MAP of
      that prior: without the matching weight decay it picks a far too weak
      prior and an underconfident predictive. Pass this or `validation`.
    - `validation`: held-out `(x, y)` (as `data`) to tune each member's prior
      precision on, by its predictive's NLL.
    - `sigma_noise`: the regression noise's standard deviation (ignored for
      classification).
    - `batch_size`: examples per compiled pass over the data (bounds memory).

    **Returns:**

    A [`LaplacePosterior`][eqx_ensemble.LaplacePosterior].

    **Example:**

    ```python
    x = jax.random.normal(jax.random.key(0), (200, 2))
    y = (x[:, 0] * x[:, 1] > 0).astype(jnp.int32)
    ens = ee.ensemble(lambda k: eqx.nn.MLP(2, 2, 16, 2, key=k), size=3,
                      key=jax.random.key(1))
    loss = lambda m, b, k: optax.softmax_cross_entropy_with_integer_labels(
        jax.vmap(m)(b[0]), b[1]).mean()
    ens = ee.fit(ens, loss, optax.adam(1e-2), (x, y), steps=300, batch_size=50,
                 key=jax.random.key(2), callbacks=()).ensemble
    posterior = ee.laplace(ens, (x[:150], y[:150]), likelihood="classification",
                           validation=(x[150:], y[150:]))
    posterior.prior_precision                    # (3,): tuned per member
    logits = posterior.predict(x[:5])            # (3, 5, 2): per member
    draws = posterior.sample(jax.random.key(3), samples=10)   # 30 models
    ```
    """
    if not isinstance(ens, Ensemble):
        if is_ensemble(ens):  # an `ee.Heterogeneous`
            raise TypeError(
                "`ee.laplace` takes one `ee.Ensemble` (one architecture: the "
                "curvature is computed for all members at once); for an "
                "`ee.Heterogeneous`, fit one per group: "
                "`[ee.laplace(group, data, ...) for group in het.groups]`"
            )
        raise TypeError(f"`ens` must be an `ee.Ensemble`, got {type(ens).__name__}")
    likelihood = check_choice(likelihood, "likelihood", _LIKELIHOODS)  # type: ignore[assignment]
    curvature = check_choice(curvature, "curvature", _CURVATURES)  # type: ignore[assignment]
    batch_size = check_positive_int(batch_size, "batch_size")
    if isinstance(sigma_noise, bool) or not isinstance(sigma_noise, int | float):
        raise TypeError(f"`sigma_noise` must be a number, got {sigma_noise!r}")
    if not (math.isfinite(sigma_noise) and sigma_noise > 0):
        raise ValueError(
            f"`sigma_noise` must be positive and finite, got {sigma_noise}"
        )
    size = len(ens)
    if prior_precision is None and validation is None:
        raise TypeError(
            "`ee.laplace` needs `validation=(x, y)`, held-out data to tune each "
            "member's prior precision on (what serves), or `prior_precision=`: a "
            'value, or "marglik" for the log marginal likelihood\'s, which '
            "trusts the weights to be the MAP of that prior (trained with the "
            "matching weight decay; without it, the predictive is underconfident)"
        )
    marglik = isinstance(prior_precision, str) and prior_precision == "marglik"
    prior = (
        None
        if prior_precision is None or marglik
        else _check_prior(prior_precision, size)
    )
    if prior_precision is not None and validation is not None:
        raise ValueError(
            "`validation` tunes the prior precision, and `prior_precision` fixes "
            "it: pass one of them"
        )
    part = last_linear if part is None else part
    if not callable(part):
        raise TypeError(f"`part` must be a function of a model, got {part!r}")
    selected, arrays = _part_arrays(part, ens[0])
    parameters = int(ravel_pytree(arrays)[0].shape[0])
    if ens.shared is not None:
        _check_part_per_member(ens, part, len(jtu.tree_leaves(arrays)))
    if curvature == "kfac":
        _check_kfac_part(selected)
    if curvature == "full" and parameters > FULL_MAX_PARAMETERS:
        raise ValueError(
            f"`curvature='full'` holds a {parameters} x {parameters} matrix per member "
            f"(the part has {parameters} weights; at most {FULL_MAX_PARAMETERS}): use "
            "`curvature='kfac'` or `'diagonal'`, or a smaller part"
        )
    x, y, count = _check_data(data, likelihood)
    _check_targets(ens, x, y, likelihood)
    posterior = _fit(
        ens, x, y, count, likelihood, part, curvature, float(sigma_noise), batch_size
    )
    if prior is None:
        return posterior.optimize_prior_precision(validation)
    return eqx.tree_at(lambda p: p.prior_precision, posterior, prior)


def _check_kfac_part(selected: Any) -> None:
    if not isinstance(selected, eqx.nn.Linear):
        raise ValueError(
            "`curvature='kfac'` needs a part that is one `eqx.nn.Linear`; `part` "
            f"selected {type(selected).__name__}: use `curvature='diagonal'` or "
            "`'full'` for other parts"
        )


def _check_part_per_member(ens: Ensemble, part: Any, leaves: int) -> None:
    """Refuse a part in the ensemble's shared weights (no per-member posterior)."""
    try:
        own = len(jtu.tree_leaves(eqx.filter(part(ens.members), eqx.is_inexact_array)))
    except Exception:  # noqa: BLE001 - the part reaches into the shared part
        own = -1
    if own != leaves:
        raise ValueError(
            "`part` selects weights of the ensemble's shared part (held once for "
            "every member); `ee.laplace` approximates a per-member part: select "
            "weights each member holds (e.g. its head), or build the ensemble "
            "without `shared=` for that part"
        )


def _check_data(
    data: Any, likelihood: str, name: str = "data"
) -> tuple[Any, Array, int]:
    if not (isinstance(data, tuple | list) and len(data) == 2):
        length = f" of {len(data)} items" if isinstance(data, tuple | list) else ""
        raise TypeError(
            f"`{name}` must be `(x, y)`: inputs and targets with a leading example "
            f"axis, got a {type(data).__name__}{length}"
        )
    x, y = data
    y = jnp.asarray(y)
    leaves = jtu.tree_leaves(x)
    if not leaves:
        raise ValueError(f"`{name}`'s inputs `x` hold no array")
    count = int(np.shape(leaves[0])[0]) if np.ndim(leaves[0]) else 0
    if count < 1 or any(np.shape(leaf)[:1] != (count,) for leaf in leaves):
        raise ValueError(
            "every array of `x` needs the same leading example axis, got shapes "
            f"{[tuple(np.shape(leaf)) for leaf in leaves]}"
        )
    if y.shape[:1] != (count,):
        raise ValueError(
            f"`y` must have {count} examples on its leading axis (as `x`), got "
            f"shape {tuple(y.shape)}"
        )
    if likelihood == "classification" and not jnp.issubdtype(y.dtype, jnp.integer):
        raise TypeError(
            f"classification targets `y` must be integer labels, got dtype {y.dtype}"
        )
    # A non-finite value would make every prediction NaN.
    where_from = name
    named = [
        (f"x{keystr(path)}" if path else "x", leaf)
        for path, leaf in jtu.tree_flatten_with_path(x)[0]
    ]
    for name, values in [*named, ("y", y)]:
        found = first_non_finite(values)
        if found is not None:
            where, value = found
            raise ValueError(
                f"`{where_from}`'s `{name}` (shape {tuple(np.shape(values))}) holds "
                f"{value} "
                f"at index {where} (example {where[0]}); the Laplace "
                "approximation needs finite inputs and targets"
            )
    return x, y, count


def _check_targets(ens: Ensemble, x: Any, y: Array, likelihood: str) -> None:
    """The targets fit the model's output (by shapes)."""
    first = jax.tree.map(lambda leaf: jnp.asarray(leaf)[0], x)
    try:
        out = jax.eval_shape(lambda: _model_output(ens[0], first))
    except Exception as error:  # noqa: BLE001 - reported with its cause
        raise ValueError(
            f"a member failed on one input of `x` ({type(error).__name__}: {error}); "
            "a member must map ONE input (no batch axis) to its output"
        ) from error
    outputs = out.shape[0]
    if likelihood == "classification":
        if y.ndim != 1:
            raise ValueError(f"labels `y` must have shape (examples,), got {y.shape}")
        labels = np.asarray(y)
        bad = (labels < 0) | (labels >= outputs)
        if bad.any():
            raise ValueError(
                f"labels `y` must lie in [0, {outputs}) (the model's {outputs} "
                f"logits), got {int(labels[np.argmax(bad)])} at example "
                f"{int(np.argmax(bad))}"
            )
    elif int(np.prod(y.shape[1:], dtype=int)) != outputs:
        raise ValueError(
            f"regression targets `y` of shape {tuple(y.shape)} do not match the "
            f"model's {outputs} output(s) per example"
        )


def _model_output(model: Any, x: Any) -> Array:
    return jnp.reshape(model(x), (-1,))


def _output_hessian(f: Array, likelihood: str, sigma: float) -> Array:
    """`Lambda`: the negative log likelihood's Hessian in the output `f`."""
    if likelihood == "classification":
        p = jax.nn.softmax(f)
        return jnp.diag(p) - jnp.outer(p, p)
    return jnp.eye(f.shape[0], dtype=f.dtype) / sigma**2


def _log_likelihood(f: Array, y: Array, likelihood: str, sigma: float) -> Array:
    if likelihood == "classification":
        return jax.nn.log_softmax(f)[y]
    residual = jnp.reshape(y, f.shape) - f
    return jnp.sum(-0.5 * residual**2 / sigma**2 - 0.5 * jnp.log(2 * jnp.pi * sigma**2))


def _fit(
    ens: Ensemble,
    x: Any,
    y: Array,
    count: int,
    likelihood: str,
    part: Callable[[Any], Any],
    curvature: str,
    sigma: float,
    batch_size: int,
) -> LaplacePosterior:
    chunk = min(batch_size, count)
    x = jax.tree.map(jnp.asarray, x)
    sums = _accumulate(ens, x, y, count, chunk, likelihood, part, curvature, sigma)
    return _finish(ens, sums, count, likelihood, part, curvature, sigma)


@eqx.filter_jit
def _accumulate(ens, x, y, count, chunk, likelihood, part, curvature, sigma):
    """Per member, the curvature's sums over the data and the log likelihood (a
    scan over chunks, vmapped over members)."""
    chunks = -(-count // chunk)
    padded = chunks * chunk

    def pad(a):
        # Pad with copies of the last example (weighted 0 by `mask`), not
        # zeros, where a model may be non-finite (0 * NaN is NaN).
        widths = [(0, padded - count)] + [(0, 0)] * (a.ndim - 1)
        return jnp.pad(a, widths, mode="edge").reshape(chunks, chunk, *a.shape[1:])

    xs = jax.tree.map(pad, x)
    ys = pad(y)
    mask = jnp.pad(jnp.ones(count, jnp.float32), (0, padded - count))
    mask = mask.reshape(chunks, chunk)

    def member_sums(member):
        model = _model(member, ens.shared)
        selected, arrays = _part_arrays(part, model)
        theta, unravel = ravel_pytree(arrays)

        def with_theta(t):
            return _with_part(part, model, unravel(t))

        def one(carry, batch):
            xb, yb, mb = batch
            f = jax.vmap(lambda xi: _model_output(model, xi))(xb)
            lam = jax.vmap(lambda fi: _output_hessian(fi, likelihood, sigma))(f)
            log_lik = jnp.sum(
                mb
                * jax.vmap(lambda fi, yi: _log_likelihood(fi, yi, likelihood, sigma))(
                    f, yb
                )
            )
            if curvature == "kfac":
                d, phi = jax.vmap(lambda xi: _kfac_pieces(model, part, selected, xi))(
                    xb
                )
                g = jnp.einsum("b,boj,bok,bkl->jl", mb, d, lam, d)
                a = jnp.einsum("b,bi,bk->ik", mb, phi, phi)
                sums = (g, a)
            else:
                jac = jax.vmap(
                    jax.jacrev(lambda t, xi: _model_output(with_theta(t), xi)),
                    (None, 0),
                )(theta, xb)
                lam_jac = jnp.einsum("boq,bqp->bop", lam, jac)
                if curvature == "diagonal":
                    sums = (jnp.einsum("b,bop,bop->p", mb, jac, lam_jac),)
                else:
                    sums = (jnp.einsum("b,bop,boq->pq", mb, jac, lam_jac),)
            return (
                jax.tree.map(jnp.add, carry[0], sums),
                carry[1] + log_lik,
            ), None

        zeros = tuple(
            jnp.zeros(shape, theta.dtype)
            for shape in _curvature_shapes(selected, theta.shape[0], curvature)
        )
        (sums, log_lik), _ = jax.lax.scan(
            one, (zeros, jnp.zeros((), theta.dtype)), (xs, ys, mask.astype(theta.dtype))
        )
        return theta, sums, log_lik

    return eqx.filter_vmap(member_sums)(ens.members)


def _curvature_shapes(
    selected: Any, parameters: int, curvature: str
) -> list[tuple[int, ...]]:
    """The shapes of one member's curvature sums."""
    if curvature == "kfac":
        out_size, in_size = selected.weight.shape
        width = in_size + (selected.bias is not None)
        return [(out_size, out_size), (width, width)]
    return [(parameters,) if curvature == "diagonal" else (parameters, parameters)]


def _kfac_pieces(model: Any, part: Any, selected: eqx.nn.Linear, x: Any):
    """For one input: `D = d output / d layer output` `(outputs, out)` and the
    layer's input with a bias column `phi`, fitted to the Jacobian `D_oj phi_i`."""
    out_size = selected.weight.shape[0]

    def output(weight, delta):
        tapped = _Tapped(eqx.tree_at(lambda lin: lin.weight, selected, weight), delta)
        return _model_output(eqx.tree_at(part, model, tapped), x)

    jac_w, d = jax.jacrev(output, argnums=(0, 1))(
        selected.weight, jnp.zeros(out_size, selected.weight.dtype)
    )
    norm = jnp.sum(d**2)
    phi = jnp.einsum("oj,oji->i", d, jac_w) / jnp.where(norm > 0, norm, 1.0)
    if selected.bias is not None:
        phi = jnp.concatenate([phi, jnp.ones((1,), phi.dtype)])
    return d, phi


def _finish(ens, sums, count, likelihood, part, curvature, sigma) -> LaplacePosterior:
    theta, curvature_sums, log_lik = sums
    size = len(ens)
    eig = dict.fromkeys(
        (
            "eigenvalues",
            "eigenvectors",
            "out_eigenvalues",
            "out_eigenvectors",
            "in_eigenvalues",
            "in_eigenvectors",
        )
    )

    def clipped_eigh(matrix: Array) -> tuple[Array, Array]:
        values, vectors = jnp.linalg.eigh(matrix)
        return jnp.maximum(values, 0.0), vectors

    if curvature == "diagonal":
        eig["eigenvalues"] = jnp.maximum(curvature_sums[0], 0.0)
    elif curvature == "full":
        eig["eigenvalues"], eig["eigenvectors"] = clipped_eigh(curvature_sums[0])
    else:
        g, a = curvature_sums
        eig["out_eigenvalues"], eig["out_eigenvectors"] = clipped_eigh(g / count)
        eig["in_eigenvalues"], eig["in_eigenvectors"] = clipped_eigh(a)
    return LaplacePosterior(
        ensemble=ens,
        prior_precision=jnp.ones((size,), jnp.float32),
        log_likelihood=log_lik,
        mean=theta,
        sigma_noise=jnp.asarray(sigma, jnp.float32),
        num_data=jnp.asarray(count, jnp.int32),
        likelihood=likelihood,
        curvature=curvature,
        part=part,
        **eig,
    )


@eqx.filter_jit
def _log_marginal_likelihood(posterior: LaplacePosterior, prior: Array) -> Array:
    parameters = posterior.mean.shape[1]
    squared = jnp.sum(posterior.mean**2, axis=-1)
    return (
        posterior.log_likelihood
        - 0.5 * prior * squared
        + 0.5 * parameters * jnp.log(prior)
        - 0.5 * posterior._log_eigenvalues_sum(prior)
    )


@eqx.filter_jit
def _optimize_prior(posterior: LaplacePosterior) -> Array:
    size = posterior.mean.shape[0]

    def objective(log_prior):
        return -_log_marginal_likelihood(posterior, jnp.exp(log_prior))

    low = jnp.full((size,), math.log(PRIOR_BOUNDS[0]), jnp.float32)
    high = jnp.full((size,), math.log(PRIOR_BOUNDS[1]), jnp.float32)
    return jnp.exp(golden_section(objective, low, high, PRIOR_ITERATIONS))


# The default grid, and its extension past an end a member chose.
DEFAULT_GRID = np.logspace(-4, 4, 41)
EXTENDED_GRID = {0: np.logspace(-8, -4.2, 20), 1: np.logspace(4.2, 8, 20)}


def _validation_prior(posterior: LaplacePosterior, validation: Any, grid: Any) -> Array:
    values = DEFAULT_GRID if grid is None else np.asarray(grid, np.float64)
    if (
        values.ndim != 1
        or values.size < 1
        or not (np.isfinite(values) & (values > 0)).all()
    ):
        raise ValueError(
            f"`grid` must be a 1-D array of positive, finite prior precisions, got "
            f"{values.tolist()}"
        )
    x, y, _ = _check_data(validation, posterior.likelihood, "validation")
    _check_targets(posterior.ensemble, x, y, posterior.likelihood)
    losses = np.asarray(_grid_nll(posterior, x, y, jnp.asarray(values, jnp.float32)))
    best = np.argmin(losses, axis=0)  # (members,): first of ties
    if grid is None:
        for side, at_end in ((0, 0), (1, values.size - 1)):
            if (best == at_end).any():
                more = EXTENDED_GRID[side]
                extra = np.asarray(
                    _grid_nll(posterior, x, y, jnp.asarray(more, jnp.float32))
                )
                joined = (more, values) if side == 0 else (values, more)
                stacked = (extra, losses) if side == 0 else (losses, extra)
                values, losses = np.concatenate(joined), np.concatenate(stacked)
                best = np.argmin(losses, axis=0)
    # The default grid's top, 1e8, is the trained weights' own predictive: no
    # warning there.
    _warn_at_grid_end(values, best, top_is_limit=grid is None)
    return jnp.asarray(values[best], jnp.float32)


class PriorAtGridEndWarning(UserWarning):
    """[`optimize_prior_precision`][eqx_ensemble.LaplacePosterior.optimize_prior_precision]'s
    validation search chose an end of its grid for some members: the best
    prior precision may lie beyond it.

    **Example:**

    ```python
    issubclass(ee.PriorAtGridEndWarning, UserWarning)   # True
    ```
    """


def _warn_at_grid_end(
    values: np.ndarray, best: np.ndarray, *, top_is_limit: bool
) -> None:
    if values.size < 2:
        return
    meaning = {
        0: "the posterior wants more spread than the grid allows",
        values.size - 1: "the predictive is close to the trained weights alone: "
        "the Laplace approximation does not help on this split",
    }
    if top_is_limit:
        del meaning[values.size - 1]
    for index, why in meaning.items():
        members = np.flatnonzero(best == index).tolist()
        if members:
            end = "lowest" if index == 0 else "highest"
            warnings.warn(
                f"the validation NLL is lowest at the grid's {end} prior precision "
                f"({values[index]:g}) for member(s) {members}: {why}; the best value "
                "may lie beyond the grid (pass a wider `grid=`)",
                PriorAtGridEndWarning,
                stacklevel=4,
            )


@eqx.filter_jit
def _grid_nll(posterior: LaplacePosterior, x: Any, y: Array, values: Array) -> Array:
    """`(values, members)`: every member's validation NLL at every prior
    precision (a loop: a vmap would take grid-size times the memory)."""
    size = posterior.mean.shape[0]

    def at(value: Array) -> Array:
        prior = jnp.full((size,), value, jnp.float32)
        trial = eqx.tree_at(lambda p: p.prior_precision, posterior, prior)
        return _member_nll(trial, x, y)

    return jax.lax.map(at, values)


def _member_nll(posterior: LaplacePosterior, x: Any, y: Array) -> Array:
    """Each member's mean NLL of `(x, y)` under its linearised predictive."""
    if posterior.likelihood == "classification":
        log_probs = jnp.asarray(_predict(posterior, x, None, None))
        picked = jnp.take_along_axis(log_probs, y[None, :, None], axis=-1)[..., 0]
        return -jnp.mean(picked, 1)
    mean, variance = _predict(posterior, x, None, None)
    target = jnp.reshape(y, mean.shape[1:])[None]
    nll = 0.5 * (jnp.log(2 * jnp.pi * variance) + (target - mean) ** 2 / variance)
    return jnp.mean(nll.reshape(nll.shape[0], -1), axis=1)


def _sample(posterior: LaplacePosterior, key: Any, samples: int) -> Ensemble:
    size, parameters = posterior.mean.shape
    keys = jax.random.split(key, size)
    deltas = _sample_deltas(posterior, keys, samples)  # (members, samples, P)
    thetas = posterior.mean[:, None, :] + deltas
    unravel = posterior._unravel()
    ens = posterior.ensemble
    repeated = jax.tree.map(
        lambda leaf: jnp.repeat(leaf, samples, axis=0) if eqx.is_array(leaf) else leaf,
        ens.members,
    )
    flat = thetas.reshape(size * samples, parameters)
    members = _with_part(posterior.part, repeated, jax.vmap(unravel)(flat))
    return with_members(ens, members)


@eqx.filter_jit
def _sample_deltas(posterior: LaplacePosterior, keys: Array, samples: int) -> Array:
    prior = posterior.prior_precision

    def one(key, index):
        if posterior.curvature != "kfac":
            assert posterior.eigenvalues is not None
            values = posterior.eigenvalues[index]
            z = jax.random.normal(key, (samples, values.shape[0]))
            z = z / jnp.sqrt(values + prior[index])[None, :]
            if posterior.curvature == "diagonal":
                return z
            assert posterior.eigenvectors is not None
            return z @ posterior.eigenvectors[index].T
        g_values, g_vectors, a_values, a_vectors = posterior._kfac_factors()
        g_values, a_values = g_values[index], a_values[index]
        z = jax.random.normal(key, (samples, g_values.shape[0], a_values.shape[0]))
        scale = jnp.sqrt(jnp.outer(g_values, a_values) + prior[index])
        delta = jnp.einsum(
            "ij,sjk,lk->sil", g_vectors[index], z / scale[None], a_vectors[index]
        )
        return delta.reshape(samples, -1)[:, posterior._kfac_order()]

    return jax.vmap(one)(keys, jnp.arange(keys.shape[0]))


def _predict(posterior: LaplacePosterior, x: Any, samples: int | None, key: Any):
    leaves = jtu.tree_leaves(x)
    if not leaves or np.ndim(leaves[0]) < 1:
        raise ValueError("`x` must hold inputs with a leading batch axis")
    size = posterior.mean.shape[0]
    keys = None if key is None else jax.random.split(key, size)
    return _predict_compiled(posterior, x, samples, keys)


@eqx.filter_jit
def _predict_compiled(posterior: LaplacePosterior, x, samples, keys):
    ens = posterior.ensemble
    unravel = posterior._unravel()
    prior = posterior.prior_precision

    def member(member_tree, index, key):
        model = _model(member_tree, ens.shared)
        selected = posterior.part(model)

        def output_covariance(xi):
            f = _model_output(model, xi)
            if posterior.curvature == "kfac":
                g_values, g_vectors, a_values, a_vectors = posterior._kfac_factors()
                d, phi = _kfac_pieces(model, posterior.part, selected, xi)
                u = d @ g_vectors[index]
                v = a_vectors[index].T @ phi
                scale = 1.0 / (
                    jnp.outer(g_values[index], a_values[index]) + prior[index]
                )
                w = scale @ (v**2)
                return f, (u * w[None, :]) @ u.T

            def at(t):
                return _model_output(_with_part(posterior.part, model, unravel(t)), xi)

            jac = jax.jacrev(at)(posterior.mean[index])
            assert posterior.eigenvalues is not None
            if posterior.curvature == "full":
                assert posterior.eigenvectors is not None
                jac = jac @ posterior.eigenvectors[index]
            variance = 1.0 / (posterior.eigenvalues[index] + prior[index])
            return f, (jac * variance[None, :]) @ jac.T

        f, s = jax.vmap(output_covariance)(x)
        if posterior.likelihood == "regression":
            return f, jnp.diagonal(s, axis1=-2, axis2=-1) + posterior.sigma_noise**2
        if samples is None:
            kappa = 1.0 / jnp.sqrt(
                1.0 + jnp.pi / 8.0 * jnp.diagonal(s, axis1=-2, axis2=-1)
            )
            return jax.nn.log_softmax(f * kappa, axis=-1)
        values, vectors = jnp.linalg.eigh(s)
        root = vectors * jnp.sqrt(jnp.maximum(values, 0.0))[..., None, :]
        z = jax.random.normal(key, (samples, *f.shape))
        logits = f[None] + jnp.einsum("bij,sbj->sbi", root, z)
        log_probs = jax.nn.log_softmax(logits, axis=-1)
        return jax.nn.logsumexp(log_probs, axis=0) - jnp.log(samples)

    size = posterior.mean.shape[0]
    key_arg = keys if keys is not None else jnp.zeros((size,))
    outputs = eqx.filter_vmap(
        lambda m, i, k: member(m, i, None if keys is None else k)
    )(ens.members, jnp.arange(size), key_arg)
    if posterior.likelihood == "regression":
        mean, variance = outputs
        if mean.shape[-1] == 1:  # one output: `(members, batch)`, as the metrics'
            return mean[..., 0], variance[..., 0]
        return mean, variance
    return outputs
