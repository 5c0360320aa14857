"""Temperature scaling (Guo et al. 2017): one temperature fitted on held-out data."""

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Float, Int

from .._internal.search import golden_section
from .._internal.tree import is_traced
from .classification import (
    ensemble_log_probs,
    label_log_probs,
    member_log_probs,
    prepare_labels,
    prepare_predictions,
)


def _check_bounds(bounds: tuple[float | int, float | int]) -> None:
    lower, upper = bounds
    if not 0 < lower < upper:
        raise ValueError(
            f"`bounds` must be (lower, upper) with 0 < lower < upper, got {bounds}"
        )


def fit_temperature(
    logits: Float[ArrayLike, " members batch classes"],
    labels: Int[ArrayLike, " batch"],
    *,
    bounds: tuple[float | int, float | int] = (0.01, 100.0),
    iterations: int = 60,
) -> Float[Array, ""]:
    """Fit one temperature `T` for the ensemble on held-out data (temperature
    scaling, Guo et al. 2017): the `T` minimising the ensemble's NLL
    `-log((1/M) sum_i softmax(logits_i / T)[label])`.

    A golden-section search over `log T` in `bounds` (one model's NLL is
    unimodal in `log T`); `iterations` steps shrink the bracket by
    `0.618**iterations` (60: about `1e-12`, below float32 resolution). It runs
    under `jax.jit`. A best temperature outside `bounds` gives the nearest bound.
    For a single model pass `logits[None]`; for one temperature per member,
    `jax.vmap` over members (see the example).

    **Arguments:**

    - `logits`: per-member logits on held-out data, shape `(members, batch, classes)`.
    - `labels`: integer class labels, shape `(batch,)`.
    - `bounds`: the temperatures searched, `(lower, upper)`, `0 < lower < upper`.
    - `iterations`: the number of golden-section steps.

    **Returns:**

    The temperature, a positive scalar. Apply it with `ee.metrics.apply_temperature`.

    **Example:**

    ```python
    key_logits, key_labels = jax.random.split(jax.random.key(0))
    logits = 5 * jax.random.normal(key_logits, (3, 200, 4))   # overconfident
    labels = jax.random.randint(key_labels, (200,), 0, 4)
    temperature = ee.metrics.fit_temperature(logits, labels)  # > 1: soften
    scaled = ee.metrics.apply_temperature(logits, temperature)
    per_member = jax.vmap(lambda x: ee.metrics.fit_temperature(x[None], labels))(logits)
    ```
    """
    _check_bounds(bounds)
    if isinstance(iterations, bool) or not isinstance(iterations, int):
        raise TypeError(f"`iterations` must be a Python int, got {iterations!r}")
    if not 1 <= iterations <= 10_000:
        raise ValueError(
            f"`iterations` must be between 1 and 10000, got {iterations} (60 already "
            "narrows the search to about 1e-12 of its range)"
        )
    predictions = prepare_predictions(logits, from_logits=True, name="logits")
    labels = prepare_labels(labels, predictions)
    bounds = (float(bounds[0]), float(bounds[1]))
    temperature, nlls = _fit_temperature(predictions, labels, bounds, iterations)
    _warn_at_bound(temperature, nlls, bounds)
    return temperature


class TemperatureAtBoundWarning(UserWarning):
    """[`fit_temperature`][eqx_ensemble.metrics.fit_temperature]'s search ended
    at an end of its `bounds`: the NLL kept falling towards it.

    **Example:**

    ```python
    import warnings

    logits = jnp.array([[[3.0, 0.0], [0.0, 3.0]]])     # both right
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ee.metrics.fit_temperature(logits, jnp.array([0, 1]))
    caught[0].category is ee.metrics.TemperatureAtBoundWarning   # True
    ```
    """


def _warn_at_bound(
    temperature: Array, nlls: Array, bounds: tuple[float, float]
) -> None:
    # A split without errors drives T to its lower bound: probabilities of 0 and
    # 1 on new data (breast cancer: test NLL 0.220 -> 2.604). Traced: unread.
    if is_traced(temperature):
        return
    fitted, at_low, at_high = (float(x) for x in np.asarray(nlls))
    value = float(temperature)
    low, high = np.log(bounds)
    near = 1e-3 * (high - low)
    # (An NLL at a bound within float32 rounding of the fitted one counts as
    # no worse: every prediction right saturates the NLL at 0 before the
    # lower bound, where rounding can leave the fitted NLL at -1e-12.)
    flat = 1e-6 * (1.0 + abs(fitted))
    reached_low = np.log(value) - low <= near or at_low <= fitted + flat
    reached_high = high - np.log(value) <= near or at_high <= fitted + flat
    if not (reached_low or reached_high):
        return
    at, side = (bounds[0], "lower") if reached_low else (bounds[1], "upper")
    cause = (
        "every held-out prediction is already right, so sharpening always helps "
        "there (a split too small or too easy to calibrate on)"
        if side == "lower"
        else "the held-out predictions are no better than uniform"
    )
    warnings.warn(
        f"the fitted temperature {value:.4g} is at the {side} bound {at:g} of the "
        f"search: the NLL kept falling towards it, likely because {cause}. It "
        "will not generalise; use a larger calibration split, wider `bounds`, "
        "or no temperature scaling",
        TemperatureAtBoundWarning,
        stacklevel=3,
    )


# Plain `jax.jit` (not `one_shot_jit`, whose `exp`/`log` rounding moved the
# result by 2.5e-4): the same temperature inside a caller's jit and outside.
@functools.partial(jax.jit, static_argnames=("bounds", "iterations"))
def _fit_temperature(
    predictions: Array,
    labels: Array,
    bounds: tuple[float, float],
    iterations: int,
) -> tuple[Array, Array]:
    dtype = predictions.dtype

    def objective(log_temperature):
        scaled = predictions / jnp.exp(log_temperature)
        probs, log_probs = member_log_probs(scaled, from_logits=True)
        log_mean = ensemble_log_probs(probs, log_probs, from_logits=True)
        return -jnp.mean(label_log_probs(log_mean, labels))

    low = jnp.asarray(np.log(bounds[0]), dtype)
    high = jnp.asarray(np.log(bounds[1]), dtype)
    log_temperature = golden_section(objective, low, high, iterations)
    nlls = jnp.stack([objective(x) for x in (log_temperature, low, high)])
    return jnp.exp(log_temperature), nlls


def apply_temperature(
    logits: Float[ArrayLike, " *batch classes"],
    temperature: Float[ArrayLike, ""] | float,
) -> Float[Array, " *batch classes"]:
    """Divide logits by a temperature (from `ee.metrics.fit_temperature`).

    `T > 1` softens the predictions, `T < 1` sharpens them; accuracy is unchanged.

    **Arguments:**

    - `logits`: logits of any shape with classes last, e.g. `(members, batch, classes)`.
    - `temperature`: a positive scalar.

    **Returns:**

    `logits / temperature`, the same shape as `logits`.

    **Example:**

    ```python
    logits = jnp.array([[[4.0, 0.0]]])
    softened = ee.metrics.apply_temperature(logits, 2.0)   # [[[2.0, 0.0]]]
    jax.nn.softmax(softened, axis=-1)                      # [[[0.88, 0.12]]]
    ```
    """
    logits = jnp.asarray(logits)
    temperature = jnp.asarray(temperature, logits.dtype)
    if temperature.ndim != 0:
        raise ValueError(
            f"`temperature` must be a scalar, got shape {tuple(temperature.shape)}"
        )
    if not is_traced(temperature) and not 0 < float(temperature) < float("inf"):
        raise ValueError(
            f"`temperature` must be positive and finite, got {float(temperature)}"
        )
    return logits / temperature
