"""Post-hoc calibrators fitted on a calibration split: vector, matrix and Dirichlet
scaling (on logits), histogram binning and isotonic regression (on probabilities),
for the ensemble's mean or each member."""

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import optax.tree_utils as otu
from jaxtyping import Array, ArrayLike, Float, Int

from .._internal.tree import is_traced
from .classification import (
    ensemble_log_probs,
    label_log_probs,
    member_log_probs,
    prepare_labels,
    prepare_predictions,
)


def _check_count(value: Any, name: str, *, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"`{name}` must be a Python int, got {value!r}")
    if not low <= value <= high:
        raise ValueError(f"`{name}` must be between {low} and {high}, got {value}")
    return int(value)


# The penalties `l2="cv"` (the default) chooses from, by cross-validation.
L2_GRID = (1e-4, 1e-3, 1e-2, 1e-1, 1.0, 10.0)
CV_FOLDS = 5


def _check_l2(l2: Any) -> float | str:
    if isinstance(l2, str) and l2 == "cv":
        return l2
    if isinstance(l2, bool) or not isinstance(l2, (int, float, np.floating)):
        raise TypeError(f'`l2` must be a Python float or "cv", got {l2!r}')
    if not 0 <= l2 < float("inf"):
        raise ValueError(f"`l2` must be non-negative and finite, got {l2}")
    return float(l2)


def _check_enough_examples(batch: int, parameters: int, what: str) -> None:
    if batch < parameters:
        raise ValueError(
            f"{what} has {parameters} parameters per fit but the calibration split "
            f"holds only {batch} examples; fit it on at least {parameters} examples "
            "(or choose a calibrator with fewer parameters, such as "
            "`ee.metrics.fit_temperature` with one)"
        )


def _check_per_member(per_member: Any) -> bool:
    if not isinstance(per_member, bool):
        raise TypeError(f"`per_member` must be True or False, got {per_member!r}")
    return per_member


def _check_applied(predictions: Array, classes: int, members: int | None, who: str):
    _, _, got_classes = predictions.shape
    if got_classes != classes:
        raise ValueError(
            f"{who} was fitted on {classes} classes but got predictions of shape "
            f"{tuple(predictions.shape)} ({got_classes} classes)"
        )
    if members is not None and predictions.shape[0] != members:
        raise ValueError(
            f"{who} was fitted per member on {members} members but got predictions "
            f"of shape {tuple(predictions.shape)} ({predictions.shape[0]} members)"
        )


def _lead(vector: Array, like: Array) -> Array:
    """`vector` (classes,) with leading axes of size 1 to broadcast over `like`."""
    return jnp.reshape(vector, (1,) * (like.ndim - 1) + vector.shape)


def _norm(tree: Any) -> Array:
    # A tree's L2 norm (optax 0.2.4 lacks `tree_norm`).
    return jnp.sqrt(sum(jnp.sum(leaf**2) for leaf in jax.tree.leaves(tree)))


class _Affine(eqx.Module):
    """Shared by the three parametric calibrators: `weight` and `bias` (with a
    leading member axis when fitted per member)."""

    weight: Array
    bias: Array
    per_member: bool = eqx.field(static=True)

    def _transform(self, weight: Array, bias: Array, logits: Array) -> Array:
        raise NotImplementedError

    def _inputs(self, predictions: Array) -> Array:
        return predictions

    def __call__(
        self, logits: Float[ArrayLike, " members batch classes"]
    ) -> Float[Array, " members batch classes"]:
        predictions = prepare_predictions(logits, from_logits=True, name="logits")
        members = self.weight.shape[0] if self.per_member else None
        _check_applied(predictions, self.bias.shape[-1], members, type(self).__name__)
        inputs = self._inputs(predictions)
        if self.per_member:
            return jax.vmap(self._transform)(self.weight, self.bias, inputs)
        return self._transform(self.weight, self.bias, inputs)


class VectorScaling(_Affine):
    """Vector scaling (Guo et al. 2017): `z' = w * z + b`, a weight and a bias per
    class. Fitted by
    [`fit_vector_scaling`][eqx_ensemble.calibration.fit_vector_scaling]; maps
    logits `(members, batch, classes)` to calibrated logits of the same shape.

    **Example:**

    ```python
    calibrate = ee.calibration.VectorScaling(jnp.array([0.5, 1.0]), jnp.zeros(2),
                                             per_member=False)
    calibrate(jnp.array([[[4.0, 2.0]]]))    # [[[2.0, 2.0]]]
    ```
    """

    def _transform(self, weight: Array, bias: Array, logits: Array) -> Array:
        return _lead(weight, logits) * logits + _lead(bias, logits)


class MatrixScaling(_Affine):
    """Matrix scaling (Guo et al. 2017): `z' = W z + b`, `W` `classes x classes`.
    Fitted by [`fit_matrix_scaling`][eqx_ensemble.calibration.fit_matrix_scaling];
    maps logits to calibrated logits of the same shape.

    **Example:**

    ```python
    swap = jnp.array([[0.0, 1.0], [1.0, 0.0]])
    calibrate = ee.calibration.MatrixScaling(swap, jnp.zeros(2), per_member=False)
    calibrate(jnp.array([[[4.0, 2.0]]]))    # [[[2.0, 4.0]]]
    ```
    """

    def _transform(self, weight: Array, bias: Array, logits: Array) -> Array:
        return logits @ weight.T + _lead(bias, logits)


class DirichletScaling(_Affine):
    """Dirichlet calibration (Kull et al. 2019): `z' = W log p + b` on the log
    probabilities `log p = log_softmax(z)`. Fitted by
    [`fit_dirichlet_scaling`][eqx_ensemble.calibration.fit_dirichlet_scaling];
    maps logits to calibrated logits of the same shape.

    **Example:**

    ```python
    calibrate = ee.calibration.DirichletScaling(jnp.eye(2), jnp.zeros(2),
                                                per_member=False)
    calibrate(jnp.array([[[4.0, 2.0]]]))    # log_softmax: [[[-0.127, -2.127]]]
    ```
    """

    def _inputs(self, predictions: Array) -> Array:
        return jax.nn.log_softmax(predictions, axis=-1)

    def _transform(self, weight: Array, bias: Array, logits: Array) -> Array:
        return logits @ weight.T + _lead(bias, logits)


def _ensemble_nll(logits: Array, labels: Array, weights: Array | None = None) -> Array:
    """The NLL of the members' mean softmax, `logits` `(M, B, C)`, weighted over
    examples by `weights` `(B,)` if given."""
    probs, log_probs = member_log_probs(logits, from_logits=True)
    per_example = label_log_probs(
        ensemble_log_probs(probs, log_probs, from_logits=True), labels
    )
    if weights is None:
        return -jnp.mean(per_example)
    return -jnp.sum(weights * per_example) / jnp.sum(weights)


# The fit stops after this many L-BFGS steps in a row without progress: in
# float32 some gradient norms never reach the tolerance.
STALL_STEPS = 25


def _lbfgs(
    objective, init: Any, iterations: Int[Array, ""] | int, tolerance: float
) -> tuple[Any, Int[Array, ""]]:
    """Minimise `objective` with `optax.lbfgs` to a gradient norm below
    `tolerance`, `STALL_STEPS` steps without progress or `iterations` steps;
    returns the parameters and the steps taken."""
    solver = optax.lbfgs()
    value_and_grad = optax.value_and_grad_from_state(objective)
    dtype = jax.tree.leaves(init)[0].dtype

    def step(carry):
        params, state, best, reference, stalled = carry
        value, grad = value_and_grad(params, state=state)
        updates, state = solver.update(
            grad, state, params, value=value, grad=grad, value_fn=objective
        )
        norm = _norm(grad)
        # Progress: an objective below the lowest so far (not the previous
        # step's: an ulp of jitter would count), or a gradient norm half the
        # one at the last progress (a float32 objective can stay flat while
        # the gradient still shrinks).
        moved = (value < best) | (norm < 0.5 * reference)
        stalled = jnp.where(moved, 0, stalled + 1)
        reference = jnp.where(moved, norm, reference)
        best = jnp.minimum(best, value)
        return optax.apply_updates(params, updates), state, best, reference, stalled

    def going(carry):
        _, state, _, _, stalled = carry
        count = otu.tree_get(state, "count")
        grad = otu.tree_get(state, "grad")
        return (count == 0) | (
            (count < iterations) & (_norm(grad) >= tolerance) & (stalled < STALL_STEPS)
        )

    infinity = jnp.asarray(jnp.inf, dtype)
    start = (init, solver.init(init), infinity, infinity, jnp.int32(0))
    params, state, *_ = jax.lax.while_loop(going, step, start)
    return params, otu.tree_get(state, "count")


def _fit_affine(
    cls: type[_Affine],
    logits: ArrayLike,
    labels: ArrayLike,
    *,
    per_member: bool,
    l2: float | str,
    iterations: int,
    full_matrix: bool,
) -> Any:
    per_member = _check_per_member(per_member)
    l2 = _check_l2(l2)
    iterations = _check_count(iterations, "iterations", low=1, high=100_000)
    predictions = prepare_predictions(logits, from_logits=True, name="logits")
    labels = prepare_labels(labels, predictions)
    members, batch, classes = predictions.shape
    parameters = classes * classes + classes if full_matrix else 2 * classes
    _check_enough_examples(batch, parameters, cls.__name__)
    if l2 == "cv":
        if is_traced(predictions):
            raise ValueError(
                '`l2="cv"` (the default) chooses the penalty from the logits\' '
                "values, which are not known inside `jax.jit`: pass a number "
                "(e.g. `l2=1e-2`) to fit a calibrator in compiled code"
            )
        l2 = _cross_validated_l2(
            cls, predictions, labels, per_member, iterations, full_matrix
        )
    weight, bias = _fit_weighted(
        cls, predictions, labels, per_member, l2, iterations, full_matrix,
        jnp.ones(labels.shape, predictions.dtype),
    )  # fmt: skip
    return cls(weight, bias, per_member)


def _fit_weighted(
    cls, predictions, labels, per_member, l2, iterations, full_matrix, weights
):  # fmt: skip
    """`_fit_affine_compiled` with `l2` (per member when per member) and
    `iterations` as arrays: a search over `l2` compiles once."""
    l2 = jnp.asarray(l2, predictions.dtype)
    l2 = jnp.broadcast_to(l2, predictions.shape[:1]) if per_member else l2
    return _fit_affine_compiled(
        cls, predictions, labels, per_member, l2, jnp.asarray(iterations, jnp.int32),
        full_matrix, weights,
    )  # fmt: skip


def _cross_validated_l2(
    cls: type[_Affine],
    predictions: Array,
    labels: Array,
    per_member: bool,
    iterations: int,
    full_matrix: bool,
) -> Any:
    """The `L2_GRID` penalty with the lowest held-out NLL over `CV_FOLDS` fixed
    folds (as Kull et al. 2019), per member when per member."""
    batch = labels.shape[0]
    fold = np.empty(batch, np.int64)
    for index, part in enumerate(
        np.array_split(np.random.default_rng(0).permutation(batch), CV_FOLDS)
    ):
        fold[part] = index
    scores = np.zeros((len(L2_GRID), *((predictions.shape[0],) if per_member else ())))
    for k in range(CV_FOLDS):
        weights = jnp.asarray(fold != k, predictions.dtype)
        for position, l2 in enumerate(L2_GRID):
            weight, bias = _fit_weighted(
                cls, predictions, labels, per_member, l2, iterations, full_matrix,
                weights,
            )  # fmt: skip
            scores[position] += np.asarray(
                _held_out_nll(
                    cls, weight, bias, predictions, labels, per_member, weights
                )
            )
    chosen = np.asarray(L2_GRID)[np.argmin(scores, axis=0)]
    return chosen if per_member else float(chosen)


@eqx.filter_jit
def _held_out_nll(cls, weight, bias, predictions, labels, per_member, weights):
    """The NLL on the examples `weights` leaves out (per member: each its own)."""
    template = cls(weight, bias, per_member)
    inputs = template._inputs(predictions)
    held = 1.0 - weights
    if per_member:
        out = jax.vmap(template._transform)(weight, bias, inputs)
        return jax.vmap(lambda one: _ensemble_nll(one[None], labels, held))(out)
    return _ensemble_nll(template._transform(weight, bias, inputs), labels, held)


def _fit_affine_params(
    cls, predictions, labels, per_member, l2, iterations, full_matrix,
    weights,
):  # fmt: skip
    classes = predictions.shape[-1]
    dtype = predictions.dtype
    identity = (
        jnp.eye(classes, dtype=dtype) if full_matrix else jnp.ones(classes, dtype)
    )
    init = (identity, jnp.zeros(classes, dtype))
    template = cls(identity, init[1], False)
    inputs = template._inputs(predictions)

    def penalty(params, l2):
        weight, bias = params
        # The distance to `c * identity`, any `c`: a strong penalty gives
        # temperature scaling, not the uncalibrated identity.
        diagonal = weight if not full_matrix else jnp.diagonal(weight)
        deviation = weight - jnp.mean(diagonal) * identity
        return l2 * (jnp.sum(deviation**2) + jnp.sum(bias**2))

    def fit(inputs, l2):  # per member: one member's inputs and `l2`
        def objective(params):
            out = template._transform(*params, inputs)
            out = out[None] if per_member else out
            return _ensemble_nll(out, labels, weights) + penalty(params, l2)

        return _lbfgs(objective, init, iterations, 1e-6)[0]

    if not per_member:
        return fit(inputs, l2)
    if jax.default_backend() != "cpu":
        return jax.vmap(fit)(inputs, l2)
    # On a CPU, one member after another: a vmapped while loop steps every
    # member until the slowest stops. On an accelerator `vmap` saves a launch
    # per step.
    return jax.lax.map(lambda args: fit(*args), (inputs, l2))


_fit_affine_compiled = eqx.filter_jit(_fit_affine_params)


_AFFINE_ARGS = """
    **Arguments:**

    - `logits`: per-member logits on the calibration split, shape `(members,
      batch, classes)`; for a single model pass `logits[None]`.
    - `labels`: integer class labels, shape `(batch,)`.
    - `per_member`: `False` (default): ONE calibrator for the ensemble, applied to
      every member's logits, minimising the NLL of the ensemble's mean prediction
      (as `ee.metrics.fit_temperature`); `True`: one per member, minimising its
      member's NLL (its parameters get a leading member axis).
    - `l2`: the weight of an L2 penalty added to the mean NLL, pulling the
      parameters to temperature scaling's family (the weight any multiple of the
      identity, the bias zero); it keeps the fit finite on a split the logits
      separate perfectly. `0` fits the NLL alone. Default `"cv"`: chosen from
      `1e-4, 1e-3, ..., 10` by 5-fold cross-validation of the held-out NLL (as
      Kull et al. 2019).
    - `iterations`: the most L-BFGS steps (`optax.lbfgs`); the fit stops earlier
      when the gradient norm falls below `1e-6` or after 25 steps in a row
      without progress (neither a lower objective nor a halved gradient norm).

    Raises `ValueError` when the split holds fewer examples than the calibrator
    has parameters.
"""


def fit_vector_scaling(
    logits: Float[ArrayLike, " members batch classes"],
    labels: Int[ArrayLike, " batch"],
    *,
    per_member: bool = False,
    l2: float | int | str = "cv",
    iterations: int = 500,
) -> VectorScaling:
    """Fit vector scaling (Guo et al. 2017, "On calibration of modern neural
    networks"): calibrated logits `w * z + b`, `2 * classes` parameters. It can
    change the predicted class (unlike temperature scaling).

    {args}

    **Returns:**

    A [`VectorScaling`][eqx_ensemble.calibration.VectorScaling]: call it on
    logits `(members, batch, classes)` to get calibrated logits.

    **Example:**

    ```python
    key_logits, key_labels = jax.random.split(jax.random.key(0))
    logits = 4 * jax.random.normal(key_logits, (3, 300, 4))    # overconfident
    labels = jax.random.randint(key_labels, (300,), 0, 4)
    calibrate = ee.calibration.fit_vector_scaling(logits, labels)
    calibrated = calibrate(logits)                             # (3, 300, 4)
    ee.metrics.nll(calibrated, labels, from_logits=True)       # lower than before
    ```
    """
    return _fit_affine(
        VectorScaling, logits, labels, per_member=per_member, l2=l2,
        iterations=iterations, full_matrix=False,
    )  # fmt: skip


def fit_matrix_scaling(
    logits: Float[ArrayLike, " members batch classes"],
    labels: Int[ArrayLike, " batch"],
    *,
    per_member: bool = False,
    l2: float | int | str = "cv",
    iterations: int = 500,
) -> MatrixScaling:
    """Fit matrix scaling (Guo et al. 2017): calibrated logits `W z + b`,
    `classes**2 + classes` parameters; prone to overfit with many classes (the
    default `l2="cv"` pulls it towards temperature scaling on a small split).

    {args}

    **Returns:**

    A [`MatrixScaling`][eqx_ensemble.calibration.MatrixScaling].

    **Example:**

    ```python
    key_logits, key_labels = jax.random.split(jax.random.key(0))
    logits = 4 * jax.random.normal(key_logits, (3, 300, 4))
    labels = jax.random.randint(key_labels, (300,), 0, 4)
    calibrate = ee.calibration.fit_matrix_scaling(logits, labels, per_member=True)
    calibrate.weight.shape                                     # (3, 4, 4)
    calibrate(logits).shape                                    # (3, 300, 4)
    ```
    """
    return _fit_affine(
        MatrixScaling, logits, labels, per_member=per_member, l2=l2,
        iterations=iterations, full_matrix=True,
    )  # fmt: skip


def fit_dirichlet_scaling(
    logits: Float[ArrayLike, " members batch classes"],
    labels: Int[ArrayLike, " batch"],
    *,
    per_member: bool = False,
    l2: float | int | str = "cv",
    iterations: int = 500,
) -> DirichletScaling:
    """Fit Dirichlet calibration (Kull et al. 2019): calibrated logits `W log p +
    b` on the log probabilities, `classes**2 + classes` parameters. The penalty
    pulls the diagonal too (the paper's ODIR leaves it free).

    {args}

    **Returns:**

    A [`DirichletScaling`][eqx_ensemble.calibration.DirichletScaling].

    **Example:**

    ```python
    key_logits, key_labels = jax.random.split(jax.random.key(0))
    logits = 4 * jax.random.normal(key_logits, (3, 300, 4))
    labels = jax.random.randint(key_labels, (300,), 0, 4)
    calibrate = ee.calibration.fit_dirichlet_scaling(logits, labels, l2=1e-3)
    calibrate(logits).shape                                    # (3, 300, 4)
    ```
    """
    return _fit_affine(
        DirichletScaling, logits, labels, per_member=per_member, l2=l2,
        iterations=iterations, full_matrix=True,
    )  # fmt: skip


for _fn in (fit_vector_scaling, fit_matrix_scaling, fit_dirichlet_scaling):
    _fn.__doc__ = (_fn.__doc__ or "").replace("{args}", _AFFINE_ARGS.strip("\n"))


def _floored(probs: Array, floor: float) -> Array:
    """Rows normalised, every class clipped to at least `floor` first."""
    return _normalise(jnp.clip(probs, floor, 1.0 - floor) if floor > 0 else probs)


def _check_floor(floor: Any, batch: int) -> float:
    """`floor=None`: 1 / (2 (batch + 1)); else a number in [0, 0.5)."""
    if floor is None:
        return 1.0 / (2 * (batch + 1))
    if isinstance(floor, bool) or not isinstance(floor, int | float):
        raise TypeError(f"`floor` must be a number or None, got {floor!r}")
    if not 0 <= floor < 0.5:
        raise ValueError(f"`floor` must be in [0, 0.5), got {floor}")
    return float(floor)


def _normalise(probs: Array) -> Array:
    """Rows divided by their sums; a row of zeros becomes uniform."""
    total = jnp.sum(probs, axis=-1, keepdims=True)
    uniform = jnp.full_like(probs, 1.0 / probs.shape[-1])
    return jnp.where(total > 0, probs / jnp.where(total > 0, total, 1.0), uniform)


def _calibration_inputs(
    probs: ArrayLike, labels: ArrayLike, from_logits: bool, per_member: bool
) -> tuple[np.ndarray, np.ndarray, Any]:
    """`(fits, batch, classes)` host probabilities (the mean as one fit, or one
    per member), the labels and the predictions' dtype."""
    per_member = _check_per_member(per_member)
    predictions = prepare_predictions(probs, from_logits=from_logits)
    labels = prepare_labels(labels, predictions)
    member_probs, _ = member_log_probs(predictions, from_logits=from_logits)
    if not per_member:
        member_probs = jnp.mean(member_probs, axis=0, keepdims=True)
    return np.asarray(member_probs, np.float64), np.asarray(labels), predictions.dtype


def _applied_probs(
    calibrator: Any, probs: ArrayLike, from_logits: bool, fits: int, classes: int
) -> Array:
    """Each member's probabilities, or their mean as one, checked against the fit."""
    predictions = prepare_predictions(probs, from_logits=from_logits)
    members = fits if calibrator.per_member else None
    _check_applied(predictions, classes, members, type(calibrator).__name__)
    member_probs, _ = member_log_probs(predictions, from_logits=from_logits)
    if calibrator.per_member:
        return member_probs
    return jnp.mean(member_probs, axis=0)[None]


class HistogramBinning(eqx.Module):
    """Histogram binning (Zadrozny and Elkan 2001), one-vs-rest per class: each
    class's probability becomes that class's frequency among the calibration
    examples in its bin, then rows are normalised. Fitted by
    [`fit_histogram_binning`][eqx_ensemble.calibration.fit_histogram_binning];
    maps probabilities `(members, batch, classes)` (logits with
    `from_logits=True`) to `(1, batch, classes)` (the calibrated mean) or, fitted
    per member, `(members, batch, classes)`.

    **Example:**

    ```python
    values = jnp.array([[[0.2, 0.8], [0.2, 0.8]]])  # (fits, classes, bins)
    calibrate = ee.calibration.HistogramBinning(values, per_member=False)
    calibrate(jnp.array([[[0.9, 0.1]]]))           # bins 0.8, 0.2: [[[0.8, 0.2]]]
    ```
    """

    values: Float[Array, "fits classes bins"]
    per_member: bool = eqx.field(static=True)
    floor: float = eqx.field(static=True, default=0.0)

    def __call__(
        self,
        probs: Float[ArrayLike, " members batch classes"],
        *,
        from_logits: bool = False,
    ) -> Float[Array, " fits batch classes"]:
        fits, classes, bins = self.values.shape
        p = _applied_probs(self, probs, from_logits, fits, classes)
        index = jnp.clip(jnp.floor(p * bins).astype(jnp.int32), 0, bins - 1)
        # values[f, c, index[f, b, c]]
        picked = jnp.take_along_axis(
            self.values[:, None, :, :], index[..., None], axis=-1
        )[..., 0]
        return _floored(picked.astype(p.dtype), self.floor)


def fit_histogram_binning(
    probs: Float[ArrayLike, " members batch classes"],
    labels: Int[ArrayLike, " batch"],
    *,
    n_bins: int = 15,
    per_member: bool = False,
    from_logits: bool = False,
    floor: float | int | None = None,
) -> HistogramBinning:
    """Fit histogram binning (Zadrozny and Elkan 2001; the multiclass
    one-vs-rest form of Guo et al. 2017) on a calibration split.

    Each class's probability is cut into `n_bins` equal-width bins of `[0, 1]`;
    a bin's value is the fraction of its examples with that label (an empty bin
    keeps its midpoint). Rows are normalised.

    **Arguments:**

    - `probs`: per-member probabilities on the calibration split, shape
      `(members, batch, classes)` (logits with `from_logits=True`).
    - `labels`: integer class labels, shape `(batch,)`.
    - `n_bins`: bins per class; the split must hold at least `n_bins` examples.
    - `per_member`: `False` (default): fit the ensemble's mean prediction;
      `True`: one map per member.
    - `from_logits`: whether `probs` holds logits.
    - `floor`: the least probability a class is given before each row is
      normalised (a probability 0 costs an infinite NLL). Default `None`: `1 /
      (2 (batch + 1))` for `batch` calibration examples; `0` keeps the raw map.

    **Returns:**

    A [`HistogramBinning`][eqx_ensemble.calibration.HistogramBinning].

    **Example:**

    ```python
    key_logits, key_labels = jax.random.split(jax.random.key(0))
    logits = 4 * jax.random.normal(key_logits, (3, 500, 4))
    labels = jax.random.randint(key_labels, (500,), 0, 4)
    calibrate = ee.calibration.fit_histogram_binning(logits, labels, from_logits=True)
    calibrated = calibrate(logits, from_logits=True)        # (1, 500, 4): the mean
    ee.metrics.expected_calibration_error(calibrated, labels)   # near 0
    ```
    """
    n_bins = _check_count(n_bins, "n_bins", low=1, high=100_000)
    p, y, dtype = _calibration_inputs(probs, labels, from_logits, per_member)
    fits, batch, classes = p.shape
    _check_enough_examples(batch, n_bins, "HistogramBinning with `n_bins` bins")
    index = np.clip(np.floor(p * n_bins).astype(np.int64), 0, n_bins - 1)
    positive = (y[None, :, None] == np.arange(classes)).astype(np.float64)
    values = np.empty((fits, classes, n_bins))
    midpoints = (np.arange(n_bins) + 0.5) / n_bins
    for f in range(fits):
        for c in range(classes):
            counts = np.bincount(index[f, :, c], minlength=n_bins)
            hits = np.bincount(index[f, :, c], positive[0, :, c], minlength=n_bins)
            values[f, c] = np.where(counts > 0, hits / np.maximum(counts, 1), midpoints)
    return HistogramBinning(
        jnp.asarray(values, dtype), per_member, _check_floor(floor, batch)
    )


def _pool_adjacent_violators(y: np.ndarray, w: np.ndarray) -> np.ndarray:
    """The non-decreasing least-squares fit of `y` (weights `w`)."""
    means: list[float] = []
    weights: list[float] = []
    sizes: list[int] = []
    for value, weight in zip(y.tolist(), w.tolist(), strict=True):
        means.append(value)
        weights.append(weight)
        sizes.append(1)
        while len(means) > 1 and means[-2] > means[-1]:
            total = weights[-2] + weights[-1]
            means[-2] = (means[-2] * weights[-2] + means[-1] * weights[-1]) / total
            weights[-2] = total
            sizes[-2] += sizes[-1]
            del means[-1], weights[-1], sizes[-1]
    return np.repeat(np.asarray(means), sizes)


class IsotonicCalibration(eqx.Module):
    """Isotonic regression (Zadrozny and Elkan 2002), one-vs-rest per class: each
    class's probability goes through a fitted non-decreasing piecewise-linear
    map, then rows are normalised. Fitted by
    [`fit_isotonic_regression`][eqx_ensemble.calibration.fit_isotonic_regression];
    returns `(1, batch, classes)` or, per member, `(members, batch, classes)`.

    **Example:**

    ```python
    x = jnp.array([[[0.0, 1.0], [0.0, 1.0]]])      # (fits, classes, points)
    y = jnp.array([[[0.25, 0.75], [0.25, 0.75]]])
    calibrate = ee.calibration.IsotonicCalibration(x, y, per_member=False)
    calibrate(jnp.array([[[1.0, 0.0]]]))           # [[[0.75, 0.25]]]
    ```
    """

    x: Float[Array, "fits classes points"]
    y: Float[Array, "fits classes points"]
    per_member: bool = eqx.field(static=True)
    floor: float = eqx.field(static=True, default=0.0)

    def __call__(
        self,
        probs: Float[ArrayLike, " members batch classes"],
        *,
        from_logits: bool = False,
    ) -> Float[Array, " fits batch classes"]:
        p = _applied_probs(self, probs, from_logits, *self.x.shape[:2])
        # Inputs outside the fitted range take the end values (`np.interp`).
        per_class = jax.vmap(jnp.interp, in_axes=(-1, 0, 0), out_axes=-1)
        calibrated = jax.vmap(per_class)(
            p, self.x.astype(p.dtype), self.y.astype(p.dtype)
        )
        return _floored(calibrated, self.floor)


def fit_isotonic_regression(
    probs: Float[ArrayLike, " members batch classes"],
    labels: Int[ArrayLike, " batch"],
    *,
    per_member: bool = False,
    from_logits: bool = False,
    floor: float | int | None = None,
) -> IsotonicCalibration:
    """Fit isotonic regression (Zadrozny and Elkan 2002) one-vs-rest per class on
    a calibration split: for class `c`, the non-decreasing function of `p_c`
    closest in squared error to `label == c` (pool adjacent violators),
    linear between the points and constant beyond (as
    `sklearn.isotonic.IsotonicRegression(out_of_bounds="clip")`); rows are then
    normalised. Fitted on the host (NumPy).

    **Arguments:**

    - `probs`: per-member probabilities on the calibration split, shape
      `(members, batch, classes)` (logits with `from_logits=True`).
    - `labels`: integer class labels, shape `(batch,)`; at least 2 examples.
    - `per_member`, `from_logits`, `floor` (default `None`): as
      [`fit_histogram_binning`][eqx_ensemble.calibration.fit_histogram_binning].

    **Returns:**

    An [`IsotonicCalibration`][eqx_ensemble.calibration.IsotonicCalibration].

    **Example:**

    ```python
    key_logits, key_labels = jax.random.split(jax.random.key(0))
    logits = 4 * jax.random.normal(key_logits, (3, 500, 4))
    labels = jax.random.randint(key_labels, (500,), 0, 4)
    calibrate = ee.calibration.fit_isotonic_regression(logits, labels,
                                                       from_logits=True)
    calibrate(logits, from_logits=True).shape                # (1, 500, 4)
    ```
    """
    p, y, dtype = _calibration_inputs(probs, labels, from_logits, per_member)
    fits, batch, classes = p.shape
    _check_enough_examples(batch, 2, "IsotonicCalibration")
    points: list[list[tuple[np.ndarray, np.ndarray]]] = []
    for f in range(fits):
        row = []
        for c in range(classes):
            x_unique, inverse = np.unique(p[f, :, c], return_inverse=True)
            counts = np.bincount(inverse).astype(np.float64)
            means = np.bincount(inverse, (y == c).astype(np.float64)) / counts
            row.append((x_unique, _pool_adjacent_violators(means, counts)))
        points.append(row)
    # At least 2 points, so the interpolation always has an interval.
    length = max(2, max(len(x) for row in points for x, _ in row))

    def padded(values: np.ndarray) -> np.ndarray:
        # Repeat the last point: the interpolation beyond it is unchanged.
        return np.concatenate([values, np.full(length - len(values), values[-1])])

    xs = np.stack([np.stack([padded(x) for x, _ in row]) for row in points])
    ys = np.stack([np.stack([padded(v) for _, v in row]) for row in points])
    return IsotonicCalibration(
        jnp.asarray(xs, dtype),
        jnp.asarray(ys, dtype),
        per_member,
        _check_floor(floor, batch),
    )
