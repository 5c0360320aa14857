"""Predictive distributions of regression models and ensembles, scored and calibrated
whatever their form: a Gaussian, a Student-t (as trained by
[`ee.losses.student_t_nll`][eqx_ensemble.losses.student_t_nll]) and the mixture of the
members' (the ensemble's predictive).

Each is an `eqx.Module` of arrays with the batch's shape (a mixture's components with a
leading member axis) and the methods `log_prob`, `cdf`, `quantile`, `interval`, `crps`,
`mean`, `variance`. The functions below score a data set and recalibrate quantiles
(`fit_recalibration`). For a conformal interval, pass its `interval` on a calibration
split to [`ee.conformal.cqr`][eqx_ensemble.conformal.cqr].

```python
loc = jax.random.normal(jax.random.key(0), (5, 100))       # (members, batch)
members = ee.predictive.StudentT(loc, jnp.ones((5, 100)), df=4.0)
ens = ee.predictive.Mixture(members)                        # the ensemble's
y = jax.random.normal(jax.random.key(1), (100,))
ee.predictive.nll(ens, y), ee.predictive.crps(ens, y)       # scalars
low, high = ens.interval(0.9)                               # (100,) each
```
"""

import math
import numbers
import warnings
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.scipy.special import betainc, logsumexp, ndtr, ndtri
from jaxtyping import Array, ArrayLike, Float

from ._internal.tree import as_array, is_traced
from ._metrics.checks import check_level
from ._metrics.quantile import central_interval, isotonic_frequencies, map_inverse
from .losses import _log_t_normaliser

__all__ = [
    "Mixture",
    "Normal",
    "Recalibration",
    "StudentT",
    "calibration_error",
    "coverage",
    "crps",
    "fit_recalibration",
    "nll",
]


def _positive(value: Array, name: str, owner: str) -> None:
    if is_traced(value):
        return
    bad = ~(np.asarray(value) > 0)
    if bad.any():
        raise ValueError(
            f"`{owner}`'s `{name}` must be positive, got "
            f"{np.asarray(value).reshape(-1)[np.argmax(bad.reshape(-1))]} at flat "
            f"index {int(np.argmax(bad.reshape(-1)))} ({int(bad.sum())} such)"
        )


def _check_p(p: Array) -> Array:
    if not is_traced(p) and not bool(jnp.all((p >= 0) & (p <= 1))):
        raise ValueError(
            f"quantile levels must lie in [0, 1], got {np.asarray(p).reshape(-1)[:5]}"
        )
    return p


def _float(value: Any) -> Array:
    array = jnp.asarray(value)
    if jnp.issubdtype(array.dtype, jnp.complexfloating):
        raise TypeError(f"a predictive's parameters are real, got {array.dtype}")
    if not jnp.issubdtype(array.dtype, jnp.floating):
        array = array.astype(jnp.result_type(float))
    return array


class _Distribution(eqx.Module):
    def interval(
        self, level: Float[ArrayLike, ""] | float = 0.9
    ) -> tuple[Float[Array, "..."], Float[Array, "..."]]:
        """The central interval at `level`: the quantiles at `(1 ± level) / 2`."""
        return central_interval(self.quantile, level)

    def quantile(self, p: Float[ArrayLike, "..."]) -> Float[Array, "..."]:
        raise NotImplementedError


class Normal(_Distribution):
    """A Gaussian predictive `N(loc, scale^2)`, per example.

    **Example:**

    ```python
    dist = ee.predictive.Normal(jnp.zeros(3), jnp.ones(3))
    dist.cdf(jnp.zeros(3))     # [0.5, 0.5, 0.5]
    dist.crps(jnp.zeros(3))    # (sqrt(2) - 1) / sqrt(pi) each: 0.2337
    ```
    """

    loc: Float[Array, "..."] = eqx.field(converter=_float)
    scale: Float[Array, "..."] = eqx.field(converter=_float)

    def __check_init__(self):
        _positive(self.scale, "scale", "Normal")

    def log_prob(self, y: Float[ArrayLike, "..."]) -> Float[Array, "..."]:
        """The log density at `y`."""
        z = (jnp.asarray(y) - self.loc) / self.scale
        return -0.5 * z**2 - jnp.log(self.scale) - 0.5 * math.log(2 * math.pi)

    def cdf(self, y: Float[ArrayLike, "..."]) -> Float[Array, "..."]:
        """The CDF at `y`."""
        return ndtr((jnp.asarray(y) - self.loc) / self.scale)

    def quantile(self, p: Float[ArrayLike, "..."]) -> Float[Array, "..."]:
        """The `p`-quantile."""
        p = _check_p(jnp.asarray(p, self.loc.dtype))
        return _ends(self.loc + self.scale * ndtri(p), p)

    def crps(self, y: Float[ArrayLike, "..."]) -> Float[Array, "..."]:
        """The CRPS at `y` (Gneiting and Raftery 2007), in closed form."""
        z = (jnp.asarray(y) - self.loc) / self.scale
        return self.scale * (
            z * (2 * ndtr(z) - 1) + 2 * _phi(z) - 1 / math.sqrt(math.pi)
        )

    def mean(self) -> Float[Array, "..."]:
        return jnp.broadcast_to(self.loc, jnp.broadcast_shapes(*self._shapes()))

    def variance(self) -> Float[Array, "..."]:
        return jnp.broadcast_to(self.scale**2, jnp.broadcast_shapes(*self._shapes()))

    def _shapes(self) -> tuple[tuple[int, ...], ...]:
        return (self.loc.shape, self.scale.shape)


def _phi(z: Array) -> Array:
    return jnp.exp(-0.5 * z**2) / math.sqrt(2 * math.pi)


class StudentT(_Distribution):
    """A Student-t predictive with location `loc`, scale `scale` and `df` degrees of
    freedom (`scipy.stats.t(df, loc, scale)`), per example; `df=inf` is the Gaussian.

    **Example:**

    ```python
    dist = ee.predictive.StudentT(jnp.zeros(2), jnp.ones(2), df=3.0)
    dist.quantile(jnp.array([0.5, 0.975]))   # [0, 3.182]
    dist.variance()                          # df / (df - 2) = 3
    ```
    """

    loc: Float[Array, "..."] = eqx.field(converter=_float)
    scale: Float[Array, "..."] = eqx.field(converter=_float)
    df: Float[Array, "..."] = eqx.field(converter=_float)

    def __check_init__(self):
        _positive(self.scale, "scale", "StudentT")
        _positive(self.df, "df", "StudentT")

    def _z(self, y: ArrayLike) -> Array:
        return (jnp.asarray(y) - self.loc) / self.scale

    def log_prob(self, y: Float[ArrayLike, "..."]) -> Float[Array, "..."]:
        """The log density at `y` (accurate for any `df`, to `inf`)."""
        z, df = self._z(y), self.df
        infinite = jnp.isinf(df)
        finite = jnp.where(infinite, 1.0, df)
        tail = jnp.where(
            infinite, 0.5 * z**2, (finite + 1) / 2 * jnp.log1p(z**2 / finite)
        )
        return _log_t_normaliser(df) - jnp.log(self.scale) - tail

    def cdf(self, y: Float[ArrayLike, "..."]) -> Float[Array, "..."]:
        """The CDF at `y` (the regularised incomplete beta function)."""
        return _t_cdf(self._z(y), self.df)

    def quantile(self, p: Float[ArrayLike, "..."]) -> Float[Array, "..."]:
        """The `p`-quantile (by bisection on the CDF, to float precision;
        differentiable by the implicit function theorem)."""
        return self._quantile(_check_p(jnp.asarray(p, self.loc.dtype)))

    @eqx.filter_jit
    def _quantile(self, p: Array) -> Array:
        shape = jnp.broadcast_shapes(
            p.shape, self.loc.shape, self.scale.shape, self.df.shape
        )
        p = jnp.broadcast_to(p, shape)
        z = _bisect(lambda z: _t_cdf(z, self.df), p, -1.0, 1.0)
        q = self.loc + self.scale * jax.lax.stop_gradient(z)
        return _ends(_implicit(self, q, p), p)

    def crps(self, y: Float[ArrayLike, "..."]) -> Float[Array, "..."]:
        """The CRPS at `y`: in closed form (Jordan, Krüger and Lerch 2019) for
        `df >= 2`, by quadrature below; infinite for `df <= 1/2` (it diverges)."""
        z, df = self._z(y), self.df
        infinite = jnp.isinf(df)
        nu = jnp.where(infinite | (df < 2), 3.0, df)
        density = jnp.exp(self.log_prob(y) + jnp.log(self.scale))
        # 2 sqrt(nu) B(1/2, nu - 1/2) / ((nu - 1) B(1/2, nu / 2)^2), the log Betas
        # through the density's normaliser (accurate for large `nu`).
        ratio = -_gamma_ratio(nu - 0.5) + 2 * _gamma_ratio(nu / 2)
        spread = 2 * jnp.sqrt(nu) / (nu - 1) * jnp.exp(ratio - 0.5 * math.log(math.pi))
        finite = (
            z * (2 * _t_cdf(z, nu) - 1) + 2 * density * (nu + z**2) / (nu - 1) - spread
        )
        gaussian = z * (2 * ndtr(z) - 1) + 2 * _phi(z) - 1 / math.sqrt(math.pi)
        score = self.scale * jnp.where(infinite, gaussian, finite)
        # Below df = 2, 1 / (df - 1) loses float32's digits (or is undefined).
        y = jnp.broadcast_to(jnp.asarray(y), score.shape)
        heavy = _crps_by_quadrature(
            self.cdf,
            y,
            jnp.broadcast_to(self.loc, score.shape),
            jnp.broadcast_to(self.scale, score.shape),
        )
        score = jnp.where(df < 2, heavy, score)
        return jnp.where(df <= 0.5, jnp.inf, score)

    def mean(self) -> Float[Array, "..."]:
        """`loc` (NaN where `df <= 1`: no mean)."""
        return jnp.where(self.df > 1, self.loc, jnp.nan)

    def variance(self) -> Float[Array, "..."]:
        """`scale^2 df / (df - 2)` (inf for `1 < df <= 2`, NaN for `df <= 1`)."""
        ratio = jnp.where(jnp.isinf(self.df), 1.0, self.df / (self.df - 2))
        value = jnp.where(self.df > 2, self.scale**2 * ratio, jnp.inf)
        return jnp.where(self.df > 1, value, jnp.nan)


def _gamma_ratio(b: Array) -> Array:
    # log Gamma(b + 1/2) - log Gamma(b), through the t normaliser's series.
    return _log_t_normaliser(2 * b) + 0.5 * jnp.log(2 * b * math.pi)


# Above this `df`, a corrected Gaussian CDF: float32's incomplete beta loses digits
# with `df`; the approximation is within 1e-5 from here on.
_LARGE_DF = 100.0


def _t_cdf(z: Array, df: Array) -> Array:
    large = df > _LARGE_DF
    nu = jnp.where(large, 1.0, df)
    # The tail `I_{nu/(nu+z^2)}(nu/2, 1/2) / 2` for |z| >= 1; near the centre, where
    # `nu / (nu + z^2)` rounds to 1, the mass between 0 and |z|,
    # `I_{z^2/(nu+z^2)}(1/2, nu/2) / 2`. At z = +-inf: 0 and 1.
    centre = z**2 < 1  # (beyond, the tail's argument is at most nu / (nu + 1))
    tail = 0.5 * betainc(nu / 2, 0.5, jnp.where(centre, 0.5, nu / (nu + z**2)))
    inner = 0.5 * betainc(0.5, nu / 2, jnp.where(centre, z**2 / (nu + z**2), 0.5))
    t = jnp.where(centre, 0.5 + jnp.sign(z) * inner, jnp.where(z < 0, tail, 1 - tail))
    # Phi(z (1 - 1/(4 df)) / sqrt(1 + z^2 / (2 df))) (Abramowitz and Stegun 26.7.8).
    big = jnp.where(large, df, _LARGE_DF)
    finite_z = jnp.where(jnp.isinf(z), 0.0, z)
    approx = ndtr(finite_z * (1 - 0.25 / big) / jnp.sqrt(1 + finite_z**2 / (2 * big)))
    value = jnp.where(large, approx, t)
    return jnp.where(jnp.isinf(z), (z > 0).astype(value.dtype), value)


def _implicit(dist: Any, q: Array, p: Array) -> Array:
    """`q` (`F(q) = p`) with the implicit function theorem's derivatives
    `dq = (dp - dF) / f`."""
    correction = (dist.cdf(q) - p) / jnp.exp(dist.log_prob(q))
    return q - (correction - jax.lax.stop_gradient(correction))


def _ends(q: Array, p: Array) -> Array:
    # The quantiles at 0 and 1 are -inf and +inf; outside [0, 1], NaN.
    q = jnp.where(p <= 0, -jnp.inf, jnp.where(p >= 1, jnp.inf, q))
    return jnp.where((p < 0) | (p > 1) | jnp.isnan(p), jnp.nan, q)


def _bisect(
    cdf, p: Array, low: float, high: float, steps: int = 64, *, widen: bool = True
) -> Array:
    """The `x` with `cdf(x) = p` by bisection inside a bracket doubled outwards from
    `[low, high]` (if `widen`)."""
    low_x, high_x = jnp.full_like(p, low), jnp.full_like(p, high)

    def widened(x, sign):
        def cond(carry):
            x, n = carry
            beyond = cdf(x) > p if sign < 0 else cdf(x) < p
            return jnp.any(beyond & jnp.isfinite(x)) & (n < 256)

        def body(carry):
            x, n = carry
            beyond = cdf(x) > p if sign < 0 else cdf(x) < p
            return jnp.where(beyond, 2 * x, x), n + 1

        return jax.lax.while_loop(cond, body, (x, 0))[0]

    if widen:
        low_x, high_x = widened(low_x, -1), widened(high_x, 1)

    def step(carry, _):
        lo, hi = carry
        mid = 0.5 * (lo + hi)
        below = cdf(mid) < p
        return (jnp.where(below, mid, lo), jnp.where(below, hi, mid)), None

    (lo, hi), _ = jax.lax.scan(step, (low_x, high_x), None, length=steps)
    return 0.5 * (lo + hi)


class Mixture(_Distribution):
    """The mixture of `components` (a `Normal` or `StudentT` whose arrays have a
    leading member axis) with `weights` (default: equal): the ensemble's predictive,
    `sum_i w_i p_i(y)`.

    **Example:**

    ```python
    members = ee.predictive.Normal(jnp.array([[-1.0], [1.0]]), jnp.ones((2, 1)))
    ens = ee.predictive.Mixture(members)      # (1,) batch, two members
    ens.mean(), ens.variance()                 # [0.], [2.]
    ens.cdf(jnp.zeros(1))                      # [0.5]
    ```
    """

    components: Normal | StudentT
    weights: Float[Array, " members"] | None = eqx.field(
        default=None, converter=lambda w: None if w is None else _float(w)
    )

    def __check_init__(self):
        if not isinstance(self.components, Normal | StudentT):
            raise TypeError(
                "`Mixture`'s `components` must be an `ee.predictive.Normal` or "
                f"`StudentT` with a leading member axis, got "
                f"{type(self.components).__name__}"
            )
        if self.components.loc.ndim == 0:
            raise ValueError("`Mixture`'s components need a leading member axis")
        if self.weights is not None:
            weights = jnp.asarray(self.weights)
            members = self.components.loc.shape[0]
            if weights.shape != (members,):
                raise ValueError(
                    f"`Mixture`'s `weights` must have shape ({members},) (one per "
                    f"member), got {tuple(weights.shape)}"
                )
            if not is_traced(weights) and not (
                bool(jnp.all(weights >= 0)) and abs(float(jnp.sum(weights)) - 1) < 1e-4
            ):
                raise ValueError(
                    "`Mixture`'s `weights` must be non-negative and sum to 1, got "
                    f"{np.asarray(weights)}"
                )

    def _w(self, like: Array) -> Array:
        members = self.components.loc.shape[0]
        w = jnp.full((members,), 1 / members) if self.weights is None else self.weights
        return w.astype(like.dtype).reshape((members,) + (1,) * (like.ndim - 1))

    def log_prob(self, y: Float[ArrayLike, "..."]) -> Float[Array, "..."]:
        """The log density at `y` (`logsumexp` over members)."""
        log_p = self.components.log_prob(jnp.asarray(y)[None])
        return logsumexp(log_p, axis=0, b=self._w(log_p))

    def cdf(self, y: Float[ArrayLike, "..."]) -> Float[Array, "..."]:
        """The CDF at `y`: the weighted mean of the members'."""
        values = self.components.cdf(jnp.asarray(y)[None])
        return jnp.sum(self._w(values) * values, axis=0)

    def quantile(self, p: Float[ArrayLike, "..."]) -> Float[Array, "..."]:
        """The `p`-quantile, by bisection on the CDF between the members' own
        `p`-quantiles (which bracket it)."""
        return self._quantile(_check_p(jnp.asarray(p, self.components.loc.dtype)))

    @eqx.filter_jit
    def _quantile(self, p: Array) -> Array:
        each = self.components.quantile(p if p.ndim == 0 else p[None])
        low, high = jnp.min(each, axis=0), jnp.max(each, axis=0)
        p = jnp.broadcast_to(p, low.shape)
        width = high - low

        def cdf(t):  # on [0, 1] across the bracket
            return self.cdf(low + t * width)

        # The bracket holds the quantile; 40 halvings reach float32's rounding.
        t = _bisect(cdf, p, 0.0, 1.0, 40, widen=False)
        q = jax.lax.stop_gradient(low + t * width)
        return _ends(_implicit(self, q, p), p)

    def crps(self, y: Float[ArrayLike, "..."]) -> Float[Array, "..."]:
        """The CRPS at `y`: in closed form for Gaussian members (`E|X - y| -
        E|X - X'| / 2`, Grimit et al. 2006); for Student-t members by Gauss-Legendre
        quadrature of `int (F(x) - 1{x >= y})^2 dx`, infinite where a member of
        positive weight has `df <= 1/2`."""
        return self._crps(jnp.asarray(y))

    @eqx.filter_jit
    def _crps(self, y: Array) -> Array:
        if isinstance(self.components, Normal):
            mu, s = self.components.loc, self.components.scale
            mu, s = jnp.broadcast_arrays(mu, s)
            w = self._w(mu)
            to_y = jnp.sum(w * _abs_normal(y[None] - mu, s**2), axis=0)
            pair = _abs_normal(mu[:, None] - mu[None], s[:, None] ** 2 + s[None] ** 2)
            weights = w[:, None] * w[None]
            return to_y - 0.5 * jnp.sum(weights * pair, axis=(0, 1))
        loc, scale = jnp.broadcast_arrays(self.components.loc, self.components.scale)
        df = jnp.broadcast_to(self.components.df, loc.shape)
        heavy = jnp.any((df <= 0.5) & (self._w(loc) > 0), axis=0)
        centre = jnp.sum(self._w(loc) * loc, axis=0)
        spread = jnp.sum(self._w(scale) * scale, axis=0) + jnp.std(loc, axis=0)
        return jnp.where(
            heavy, jnp.inf, _crps_by_quadrature(self.cdf, y, centre, spread)
        )

    def mean(self) -> Float[Array, "..."]:
        means = self.components.mean()
        return jnp.sum(self._w(means) * means, axis=0)

    def variance(self) -> Float[Array, "..."]:
        """The mean of the variances plus the variance of the means."""
        means, variances = self.components.mean(), self.components.variance()
        w = self._w(means)
        mean = jnp.sum(w * means, axis=0, keepdims=True)
        return jnp.sum(w * (variances + (means - mean) ** 2), axis=0)


# Gauss-Legendre nodes per piece of a CRPS integral by quadrature.
_NODES = 128


def _crps_by_quadrature(cdf: Any, y: Array, centre: Array, spread: Array) -> Array:
    """`int_-inf^y F^2 + int_y^inf (1 - F)^2` in three pieces, `_NODES` nodes each:
    the tails beyond `a = min(centre, y)` and `b = max(centre, y)`, mapped onto (0, 1)
    by `x = a -+ spread t / (1 - t)`, and `[a, b]`."""
    nodes, node_weights = np.polynomial.legendre.leggauss(_NODES)
    t = jnp.asarray((nodes + 1) / 2, y.dtype).reshape((-1,) + (1,) * y.ndim)
    w = jnp.asarray(node_weights / 2, y.dtype).reshape(t.shape)
    low, high = jnp.minimum(centre, y), jnp.maximum(centre, y)
    step = spread[None] * t / (1 - t)
    jacobian = spread[None] / (1 - t) ** 2
    left = jnp.sum(w * jacobian * jax.vmap(cdf)(low[None] - step) ** 2, axis=0)
    right = jnp.sum(w * jacobian * (1 - jax.vmap(cdf)(high[None] + step)) ** 2, axis=0)
    inside = jax.vmap(cdf)(low[None] + t * (high - low)[None])
    # On [a, b]: (1 - F)^2 where it lies above y (y <= centre), else F^2.
    middle = jnp.where((y <= centre)[None], (1 - inside) ** 2, inside**2)
    return left + right + (high - low) * jnp.sum(w * middle, axis=0)


def _abs_normal(m: Array, v: Array) -> Array:
    # E|Z| for Z ~ N(m, v).
    s = jnp.sqrt(v)
    return m * (2 * ndtr(m / s) - 1) + 2 * s * _phi(m / s)


Distribution = Normal | StudentT | Mixture


def _targets(dist: Distribution, targets: ArrayLike, who: str) -> Array:
    if not isinstance(dist, Normal | StudentT | Mixture):
        raise TypeError(
            f"`{who}` takes an `ee.predictive` distribution (Normal, StudentT, "
            f"Mixture), got {type(dist).__name__}"
        )
    y = jnp.asarray(targets)
    shape = jax.eval_shape(dist.mean).shape
    if y.shape != shape:
        raise ValueError(
            f"`{who}`: `targets` must have the distribution's batch shape "
            f"{tuple(shape)}, got {tuple(y.shape)}"
        )
    return y


def nll(dist: Distribution, targets: Float[ArrayLike, "..."]) -> Float[Array, ""]:
    """The mean negative log likelihood of `targets` under `dist`.

    **Example:**

    ```python
    dist = ee.predictive.Normal(jnp.zeros(4), jnp.ones(4))
    ee.predictive.nll(dist, jnp.zeros(4))    # log(2 pi) / 2 = 0.919
    ```
    """
    return -jnp.mean(dist.log_prob(_targets(dist, targets, "nll")))


def crps(dist: Distribution, targets: Float[ArrayLike, "..."]) -> Float[Array, ""]:
    """The mean continuous ranked probability score of `targets` under `dist`
    (in the targets' units; lower is better).

    **Example:**

    ```python
    dist = ee.predictive.StudentT(jnp.zeros(4), jnp.ones(4), df=5.0)
    ee.predictive.crps(dist, jnp.zeros(4))
    ```
    """
    return jnp.mean(dist.crps(_targets(dist, targets, "crps")))


def coverage(
    dist: Distribution,
    targets: Float[ArrayLike, "..."],
    level: Float[ArrayLike, ""] | float = 0.9,
) -> Float[Array, ""]:
    """The fraction of `targets` inside `dist`'s central `level` interval.

    **Example:**

    ```python
    y = jax.random.normal(jax.random.key(0), (1000,))
    dist = ee.predictive.Normal(jnp.zeros(1000), jnp.ones(1000))
    ee.predictive.coverage(dist, y, 0.9)     # ~0.9
    ```
    """
    y = _targets(dist, targets, "coverage")
    low, high = dist.interval(level)
    return jnp.mean(((low <= y) & (y <= high)).astype(low.dtype))


def calibration_error(
    dist: Distribution,
    targets: Float[ArrayLike, "..."],
    *,
    levels: int | np.integer = 99,
) -> Float[Array, ""]:
    """The mean, over `levels` evenly spaced `p` in `(0, 1)`, of `|p -
    freq(F(y) <= p)|`: as
    [`ee.metrics.regression_calibration_error`][eqx_ensemble.metrics.regression_calibration_error],
    for any predictive.

    **Example:**

    ```python
    y = 2 * jax.random.normal(jax.random.key(0), (1000,))
    dist = ee.predictive.StudentT(jnp.zeros(1000), jnp.ones(1000), df=3.0)
    ee.predictive.calibration_error(dist, y)     # too narrow: ~0.07
    ```
    """
    if (
        isinstance(levels, bool)
        or not isinstance(levels, numbers.Integral)
        or levels < 1
    ):
        raise ValueError(f"`levels` must be a positive int, got {levels!r}")
    pit = dist.cdf(_targets(dist, targets, "calibration_error")).reshape(-1)
    p = jnp.arange(1, int(levels) + 1, dtype=pit.dtype) / (int(levels) + 1)
    observed = jnp.mean((pit[None, :] <= p[:, None]).astype(pit.dtype), axis=1)
    return jnp.mean(jnp.abs(p - observed))


class Recalibration(eqx.Module):
    """Quantile recalibration of any predictive (Kuleshov, Fenner and Ermon 2018): a
    non-decreasing map `R` of its CDF's values, linear between the calibration points
    and constant beyond them, so that `R(F(y))` is calibrated. Fitted by
    [`fit_recalibration`][eqx_ensemble.predictive.fit_recalibration]; its methods
    take the predictive of new inputs.

    **Example:**

    ```python
    recal = ee.predictive.Recalibration(jnp.array([0.1, 0.5, 0.9]),
                                        jnp.array([0.2, 0.5, 0.8]))
    dist = ee.predictive.Normal(jnp.zeros(2), jnp.ones(2))
    recal.cdf(dist, jnp.zeros(2))             # R(0.5) = 0.5
    recal.interval(dist, 0.6)                 # F^-1(0.1), F^-1(0.9)
    ```
    """

    pit: Float[Array, " points"]
    levels: Float[Array, " points"]

    def cdf(
        self, dist: Distribution, y: Float[ArrayLike, "..."]
    ) -> Float[Array, "..."]:
        """The calibrated CDF at `y`, `R(F(y))`."""
        values = dist.cdf(_targets(dist, y, "Recalibration.cdf"))
        return jnp.interp(
            values, self.pit.astype(values.dtype), self.levels.astype(values.dtype)
        )

    def quantile(
        self, dist: Distribution, level: Float[ArrayLike, ""] | float
    ) -> Float[Array, "..."]:
        """The calibrated `level`-quantile: `F^-1(R^-1(level))`."""
        check_level(level)
        level = as_array(level, self.pit.dtype)
        return dist.quantile(map_inverse(self.pit, self.levels, level))

    def interval(
        self, dist: Distribution, level: Float[ArrayLike, ""] | float = 0.9
    ) -> tuple[Float[Array, "..."], Float[Array, "..."]]:
        """The calibrated central interval at `level`."""
        return central_interval(lambda p: self.quantile(dist, p), level)


def fit_recalibration(
    dist: Distribution, targets: Float[ArrayLike, "..."]
) -> Recalibration:
    """Fit quantile recalibration (Kuleshov et al. 2018, Algorithm 1) on a calibration
    split: `R` maps the PIT values `p_t = F_t(y_t)` to the empirical frequencies
    `#{s : p_s <= p_t} / T`. Runs on the host.

    **Arguments:**

    - `dist`: the predictive on the calibration split.
    - `targets`: its observed values, its batch shape; at least 2.

    **Returns:**

    A [`Recalibration`][eqx_ensemble.predictive.Recalibration].

    **Example:**

    ```python
    y = 3 * jax.random.normal(jax.random.key(0), (600,))     # wider than ...
    dist = ee.predictive.StudentT(jnp.zeros(600), jnp.ones(600), df=5.0)
    recal = ee.predictive.fit_recalibration(dist, y)
    low, high = recal.interval(dist, 0.9)
    float(jnp.mean((low <= y) & (y <= high)))                # ~0.9
    ```
    """
    y = _targets(dist, targets, "fit_recalibration")
    pit = np.asarray(dist.cdf(y), np.float64).ravel()
    if pit.size < 2:
        raise ValueError(f"recalibration needs at least 2 targets, got {pit.size}")
    if not np.isfinite(pit).all():
        raise ValueError(
            "the predictive CDF is not finite at some targets (the first at flat "
            f"index {int(np.argmax(~np.isfinite(pit)))}): NaN or inf in the "
            "predictive or the targets"
        )
    ends = int(np.sum((pit <= 0) | (pit >= 1)))
    if ends:
        warnings.warn(
            f"the predictive CDF is exactly 0 or 1 at {ends} of {pit.size} "
            f"calibration targets (beyond the {np.dtype(y.dtype).name} CDF's "
            "range: a predictive far too narrow for them); recalibration cannot "
            "order them, and its extreme quantiles come out infinite. Widen the "
            "predictive first, or compute in float64 (`jax_enable_x64`)",
            RuntimeWarning,
            stacklevel=2,
        )
    unique, fitted = isotonic_frequencies(pit)
    dtype = (
        jnp.result_type(y.dtype, float)
        if not jnp.issubdtype(y.dtype, jnp.floating)
        else y.dtype
    )
    return Recalibration(as_array(unique, dtype), as_array(fitted, dtype))
