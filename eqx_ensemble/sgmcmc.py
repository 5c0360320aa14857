"""Stochastic-gradient MCMC as Optax transformations: every member of an ensemble is
one chain.

[`sgld`][eqx_ensemble.sgmcmc.sgld] (Welling and Teh 2011) and
[`sghmc`][eqx_ensemble.sgmcmc.sghmc] (Chen et al. 2014) are
`optax.GradientTransformationExtraArgs` whose update takes the chain's PRNG key as
the extra argument `key`. `ee.fit` and `ee.make_step` pass each member its own key
(`fold_in(member_key, 0x6F707478)`), so `M` members run `M` independent chains in
one compiled program. Collect samples with [`ee.Snapshots`][eqx_ensemble.Snapshots]:
its ensemble of `chains x samples` models is the posterior predictive's Monte Carlo
sample.

**The loss convention.** Write `fit`'s loss as the batch's mean negative log
likelihood plus the negative log prior divided by `num_data`, so that `U(theta) =
num_data * loss` is the negative log posterior; `learning_rate` is in SGD's units.

Cyclical SG-MCMC (Zhang et al. 2020) is a cyclical learning rate
(`ee.schedules.cosine_cycles`) with a temperature of 0 in each cycle's exploration
stage ([`cyclical_temperature`][eqx_ensemble.sgmcmc.cyclical_temperature]), sampled
at the end of each cycle ([`sample_steps`][eqx_ensemble.sgmcmc.sample_steps]).

```python
steps, cycle = 400, 100
sampler = ee.sgmcmc.sgld(
    ee.schedules.cosine_cycles(1e-2, cycle_steps=cycle, cycles=steps // cycle),
    num_data=1000,
    temperature=ee.sgmcmc.cyclical_temperature(cycle, exploration=0.5),
)
samples = ee.Snapshots(at=ee.sgmcmc.sample_steps(cycle, steps // cycle, per_cycle=5))
```
"""

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import Array, Int, PyTree

from ._trackers.base import check_tracker_int

ScalarOrSchedule = float | Callable[[Any], Any]


def _check_value(
    value: Any,
    name: str,
    *,
    low: float,
    high: float,
    closed: bool,
    schedule: bool = True,
):
    """A constant in range, or (`schedule=True`) a schedule whose value at step 0 is
    in range; a schedule may start at `low` itself (a warm-up from 0)."""
    if callable(value) and not schedule:
        raise TypeError(f"`{name}` must be a number (not a schedule), got {value!r}")
    if callable(value):
        closed = True
        try:
            first = float(np.asarray(value(jnp.asarray(0, jnp.int32))))
        except Exception as error:  # noqa: BLE001 - reported with its cause
            raise TypeError(
                f"`{name}` must be a number or an optax schedule (step count -> "
                f"value); calling it with step 0 failed: {error}"
            ) from error
        shown = f"a schedule whose value at step 0 is {first}"
    elif isinstance(value, bool) or not isinstance(value, (int, float, np.floating)):
        raise TypeError(
            f"`{name}` must be a number or an optax schedule, got {value!r}"
        )
    else:
        first = float(value)
        shown = str(first)
    below = first < low if closed else first <= low
    if not math.isfinite(first) or below or first > high:
        opening = "[" if closed else "("
        closing = ")" if math.isinf(high) else "]"
        raise ValueError(
            f"`{name}` must be in {opening}{low:g}, {high:g}{closing}, got {shown}"
        )


def _schedule(value: ScalarOrSchedule) -> Callable[[Any], Any]:
    return value if callable(value) else (lambda count: value)


def _check_num_data(num_data: Any) -> int:
    if isinstance(num_data, bool) or not isinstance(num_data, (int, np.integer)):
        raise TypeError(f"`num_data` must be a Python int, got {num_data!r}")
    if num_data < 1:
        raise ValueError(
            f"`num_data` must be the number of training examples (>= 1), got {num_data}"
        )
    return int(num_data)


def _noise(key: Any, updates: PyTree[Any], scale: Any) -> PyTree[Any]:
    """Standard normal noise times `scale`, shaped like `updates`: leaf `i` draws
    `jax.random.normal(split(key, n)[i], shape, float32)`."""
    leaves, treedef = jax.tree.flatten(updates)
    keys = jax.random.split(key, len(leaves)) if leaves else []
    draws = _normals(keys, [leaf.shape for leaf in leaves])
    noise = [
        (scale * draw).astype(leaf.dtype)
        for draw, leaf in zip(draws, leaves, strict=True)
    ]
    return jax.tree.unflatten(treedef, noise)


# Leaves up to this size share one threefry call (a larger, maybe sharded one: its own).
GROUPED_DRAW_MAX = 2**16


def _normals(keys: Any, shapes: list[tuple[int, ...]]) -> list[Array]:
    """`[jax.random.normal(keys[i], shapes[i], float32) for i ...]`, the small leaves
    drawn by ONE threefry call on their concatenated counters (same bits; compiled
    values may differ by a few ulps). Without partitionable threefry, one call each."""
    group = [
        i for i, shape in enumerate(shapes) if math.prod(shape) <= GROUPED_DRAW_MAX
    ]
    draws: list[Any] = [None] * len(shapes)
    if len(group) > 1 and _groupable(keys):
        sizes = [math.prod(shapes[i]) for i in group]
        flat = _grouped_normals(jax.random.key_data(keys[np.asarray(group)]), sizes)
        offsets = np.cumsum([0, *sizes])
        for i, start, stop in zip(group, offsets[:-1], offsets[1:], strict=True):
            draws[i] = flat[start:stop].reshape(shapes[i])
    for i, shape in enumerate(shapes):
        if draws[i] is None:
            draws[i] = jax.random.normal(keys[i], shape, jnp.float32)
    return draws


def _groupable(keys: Any) -> bool:
    """Whether `keys` are typed threefry keys with partitionable bits."""
    partitionable = getattr(jax.config, "jax_threefry_partitionable", False)
    if _THREEFRY is None or not partitionable:
        return False
    if not jnp.issubdtype(keys.dtype, jax.dtypes.prng_key):
        return False
    return str(jax.random.key_impl(keys)) == "threefry2x32"


def _grouped_normals(key_data: Array, sizes: list[int]) -> Array:
    """The concatenated float32 standard normal draws of threefry keys `key_data`
    (`(n, 2)`), `sizes[i]` each, bit for bit as `jax.random.normal` (partitionable)."""
    assert _THREEFRY is not None  # (`_groupable`)
    total = sum(sizes)
    k1, k2 = (
        jnp.concatenate([jnp.full((size,), half[i]) for i, size in enumerate(sizes)])
        for half in (key_data[:, 0], key_data[:, 1])
    )
    counts = jnp.concatenate([jax.lax.iota(np.uint32, size) for size in sizes])
    bits1, bits2 = _THREEFRY.bind(k1, k2, jnp.zeros((total,), np.uint32), counts)
    bits = bits1 ^ bits2
    # `jax.random.uniform(key, shape, float32, lo, hi)` from its bits.
    low = np.nextafter(np.float32(-1.0), np.float32(0.0))
    minval, maxval = jnp.asarray(low, jnp.float32), jnp.asarray(1.0, jnp.float32)
    float_bits = jax.lax.shift_right_logical(bits, np.uint32(32 - 23))
    float_bits = jax.lax.bitwise_or(float_bits, np.float32(1.0).view(np.uint32))
    floats = jax.lax.bitcast_convert_type(float_bits, jnp.float32) - np.float32(1.0)
    uniform = jax.lax.max(minval, floats * (maxval - minval) + minval)
    return jax.lax.mul(np.float32(np.sqrt(2)), jax.lax.erf_inv(uniform))


try:  # the hash's primitive: one call site for many counters
    from jax.extend.random import threefry2x32_p as _THREEFRY
except ImportError:  # pragma: no cover - another JAX: every leaf draws its own
    _THREEFRY = None


def _increment(count: Array) -> Array:
    return jnp.asarray(optax.safe_int32_increment(count))


def _non_negative(value: Any, who: str, what: str) -> Any:
    """`value`, checked where computed: a schedule below 0 would make the noise NaN."""
    if isinstance(value, int | float):
        return value  # a constant, checked when the sampler was made
    return eqx.error_if(
        value,
        value < 0,
        f"`ee.sgmcmc.{who}`: the {what} schedule gave a negative value; a "
        "schedule must stay at or above 0 for the whole run",
    )


def _require_key(key: Any, who: str) -> None:
    if key is None:
        raise ValueError(
            f"`ee.sgmcmc.{who}` draws its noise from the chain's PRNG key: call "
            "`update(grads, state, params, key=key)` (`ee.fit` and `ee.make_step` "
            "pass each member its own). A trained shared part (`ee.Ensemble(..., "
            "train_shared=True)`) is one model, not a chain, and gets no key: "
            "sample the members only."
        )


class SGLDState(NamedTuple):
    """The state of [`sgld`][eqx_ensemble.sgmcmc.sgld]: the number of updates done.

    **Example:**

    ```python
    state = ee.sgmcmc.sgld(1e-3, num_data=10).init({"w": jnp.zeros(2)})
    state.count                                # 0
    ```
    """

    count: Int[Array, ""]  # pyright: ignore[reportIncompatibleMethodOverride]


def sgld(
    learning_rate: ScalarOrSchedule,
    *,
    num_data: int,
    temperature: ScalarOrSchedule = 1.0,
) -> optax.GradientTransformationExtraArgs:
    """Stochastic-gradient Langevin dynamics (Welling and Teh 2011): the update
    `-lr * g + sqrt(2 * lr * T / num_data) * xi`, `xi ~ N(0, I)` drawn from the chain's
    key, `g` the gradient of the (mean) loss. Its stationary distribution (as `lr ->
    0`) is `exp(-U / T)`, `U = num_data * loss`: the posterior at `T = 1`, a tempered
    ("cold") posterior at `T < 1`, plain SGD at `T = 0`.

    **Arguments:**

    - `learning_rate`: the step size `lr > 0` (or an optax schedule of the step
      count, e.g. `ee.schedules.cosine_cycles` for cyclical SG-MCMC).
    - `num_data`: the number of training examples the mean loss stands for.
    - `temperature`: `T >= 0`, or a schedule (see `cyclical_temperature`).

    **Returns:**

    An `optax.GradientTransformationExtraArgs`; `update(grads, state, params,
    key=key)` needs the chain's key.

    **Example:**

    ```python
    sampler = ee.sgmcmc.sgld(1e-3, num_data=500)
    params = {"w": jnp.zeros(3)}
    state = sampler.init(params)
    grads = {"w": jnp.ones(3)}
    updates, state = sampler.update(grads, state, params, key=jax.random.key(0))
    ```
    """
    _check_value(learning_rate, "learning_rate", low=0.0, high=math.inf, closed=False)
    _check_value(temperature, "temperature", low=0.0, high=math.inf, closed=True)
    num_data = _check_num_data(num_data)
    lr_at, temperature_at = _schedule(learning_rate), _schedule(temperature)

    def init(params: PyTree[Any]) -> SGLDState:
        del params
        return SGLDState(count=jnp.zeros([], jnp.int32))

    def update(updates, state, params=None, *, key=None, **extra_args):
        del params, extra_args
        _require_key(key, "sgld")
        lr = _non_negative(lr_at(state.count), "sgld", "learning rate")
        temperature = _non_negative(temperature_at(state.count), "sgld", "temperature")
        scale = jnp.sqrt(2.0 * lr * temperature / num_data)
        noise = _noise(key, updates, scale)
        new = jax.tree.map(lambda g, n: (-lr * g).astype(g.dtype) + n, updates, noise)
        return new, SGLDState(count=_increment(state.count))

    return optax.GradientTransformationExtraArgs(init, update)


class SGHMCState(NamedTuple):
    """The state of [`sghmc`][eqx_ensemble.sgmcmc.sghmc]: the number of updates done
    and the momentum (shaped like the parameters).

    **Example:**

    ```python
    state = ee.sgmcmc.sghmc(1e-3, num_data=10).init({"w": jnp.zeros(2)})
    state.momentum["w"]                        # zeros, shape (2,)
    ```
    """

    count: Int[Array, ""]  # pyright: ignore[reportIncompatibleMethodOverride]
    momentum: PyTree[Any]


def sghmc(
    learning_rate: ScalarOrSchedule,
    *,
    num_data: int,
    friction: float | int = 0.1,
    temperature: ScalarOrSchedule = 1.0,
) -> optax.GradientTransformationExtraArgs:
    """Stochastic-gradient Hamiltonian Monte Carlo (Chen et al. 2014, in its "SGD with
    momentum" form, eq. 15): the momentum
    `v <- (1 - a) v - lr * g + sqrt(2 * a * lr * T / num_data) * xi` and the update
    `v`, with friction `a` and `xi ~ N(0, I)` drawn from the chain's key
    (`beta_hat = 0`). Its stationary distribution is
    [`sgld`][eqx_ensemble.sgmcmc.sgld]'s; the momentum moves the chains further per
    gradient evaluation.

    **Arguments:**

    - `learning_rate`: `lr > 0` (or a schedule).
    - `num_data`: the number of training examples the mean loss stands for.
    - `friction`: `a` in `(0, 1]` (`1 - a` is the momentum's decay; at 1 the update
      is exactly `sgld`'s at the same `lr`).
    - `temperature`: `T >= 0`, or a schedule.

    **Returns:**

    An `optax.GradientTransformationExtraArgs` needing `key=` in `update`.

    **Example:**

    ```python
    sampler = ee.sgmcmc.sghmc(1e-3, num_data=500, friction=0.05)
    params = {"w": jnp.zeros(3)}
    state = sampler.init(params)
    updates, state = sampler.update({"w": jnp.ones(3)}, state, params,
                                    key=jax.random.key(0))
    ```
    """
    _check_value(learning_rate, "learning_rate", low=0.0, high=math.inf, closed=False)
    _check_value(temperature, "temperature", low=0.0, high=math.inf, closed=True)
    _check_value(friction, "friction", low=0.0, high=1.0, closed=False, schedule=False)
    num_data = _check_num_data(num_data)
    lr_at, temperature_at = _schedule(learning_rate), _schedule(temperature)
    friction = float(friction)

    def init(params: PyTree[Any]) -> SGHMCState:
        momentum = jax.tree.map(jnp.zeros_like, params)
        return SGHMCState(count=jnp.zeros([], jnp.int32), momentum=momentum)

    def update(updates, state, params=None, *, key=None, **extra_args):
        del params, extra_args
        _require_key(key, "sghmc")
        lr = _non_negative(lr_at(state.count), "sghmc", "learning rate")
        temperature = _non_negative(temperature_at(state.count), "sghmc", "temperature")
        scale = jnp.sqrt(2.0 * friction * lr * temperature / num_data)
        noise = _noise(key, updates, scale)
        momentum = jax.tree.map(
            lambda v, g, n: ((1.0 - friction) * v - lr * g).astype(v.dtype) + n,
            state.momentum,
            updates,
            noise,
        )
        count = _increment(state.count)
        return momentum, SGHMCState(count=count, momentum=momentum)

    return optax.GradientTransformationExtraArgs(init, update)


def cyclical_temperature(
    cycle_steps: int,
    *,
    exploration: float | int = 0.5,
    temperature: float | int = 1.0,
) -> Callable[[Any], Any]:
    """The temperature schedule of cyclical SG-MCMC (Zhang et al. 2020): 0 during the
    first `exploration` fraction of each cycle of `cycle_steps` steps (plain SGD),
    `temperature` for the rest (the sampling stage). Use it with
    `ee.schedules.cosine_cycles` as the learning rate.

    **Arguments:**

    - `cycle_steps`: the steps in one cycle (as the learning-rate schedule's).
    - `exploration`: the fraction of each cycle without noise, in `[0, 1)`.
    - `temperature`: the sampling stage's temperature, `>= 0`.

    **Returns:**

    An optax schedule (step count -> temperature).

    **Example:**

    ```python
    schedule = ee.sgmcmc.cyclical_temperature(10, exploration=0.8)
    [float(schedule(t)) for t in (0, 7, 8, 9, 10)]   # [0, 0, 1, 1, 0]
    ```
    """
    check_tracker_int("cyclical_temperature", "cycle_steps", cycle_steps, 1)
    _check_value(
        exploration, "exploration", low=0.0, high=1.0, closed=True, schedule=False
    )
    _check_value(
        temperature, "temperature", low=0.0, high=math.inf, closed=True, schedule=False
    )
    start = math.ceil(exploration * cycle_steps)  # first sampling step of a cycle
    if start >= cycle_steps:
        raise ValueError(
            f"`exploration={exploration}` leaves no sampling stage in a cycle of "
            f"`cycle_steps={cycle_steps}` steps (the first sampling step would be "
            f"{start}); lower `exploration` or lengthen the cycle"
        )

    def schedule(count):
        sampling = jnp.mod(count, cycle_steps) >= start
        return jnp.where(sampling, jnp.float32(temperature), jnp.float32(0.0))

    return schedule


def sample_steps(
    cycle_steps: int, cycles: int, *, per_cycle: int = 1, spacing: int = 1
) -> tuple[int, ...]:
    """The steps at which to collect samples of cyclical SG-MCMC with
    `ee.Snapshots(at=...)`: the last `per_cycle` points of each cycle, `spacing` steps
    apart, ending at the cycle's end (where the learning rate is smallest).

    **Arguments:**

    - `cycle_steps`, `cycles`: as the schedules'.
    - `per_cycle`: samples per cycle.
    - `spacing`: steps between a cycle's samples (thinning).

    **Returns:**

    Increasing step counts for `ee.Snapshots(at=...)`.

    **Example:**

    ```python
    ee.sgmcmc.sample_steps(100, 3, per_cycle=2, spacing=10)
    # (90, 100, 190, 200, 290, 300)
    ```
    """
    check_tracker_int("sample_steps", "cycle_steps", cycle_steps, 1)
    check_tracker_int("sample_steps", "cycles", cycles, 1)
    check_tracker_int("sample_steps", "per_cycle", per_cycle, 1)
    check_tracker_int("sample_steps", "spacing", spacing, 1)
    if (per_cycle - 1) * spacing >= cycle_steps:
        raise ValueError(
            f"{per_cycle} samples {spacing} steps apart do not fit in a cycle of "
            f"{cycle_steps} steps"
        )
    return tuple(
        (c + 1) * cycle_steps - j * spacing
        for c in range(cycles)
        for j in reversed(range(per_cycle))
    )


__all__ = [
    "sgld",
    "sghmc",
    "cyclical_temperature",
    "sample_steps",
    "SGLDState",
    "SGHMCState",
]
