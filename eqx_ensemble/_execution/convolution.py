"""Convolutions in the one form XLA's CPU backend runs fast in any program.

XLA's CPU compiler hands a convolution to its fast kernels (YNNPACK or Eigen)
only in one layout: batch, spatial dimensions, features for the input and the
output, spatial dimensions, input and output features for the kernel
(`NHWC`/`HWIO` in 2-D). It transposes other convolutions into that form
itself, but only in a program's top level: a convolution inside a loop (a
`jax.lax.scan`, a `fori_loop`, a `lax.map` over members) keeps the layout it
was written in and runs on XLA's generic loop emitter, 6-25x slower (jax-ml/jax
issue 12868). Equinox's convolutions are written channels first, and the
backward pass's convolutions of any layout are others again (the kernel's
gradient convolves over the batch).

While the library's own programs are lowered (`canonical_convolutions`), every
real convolution of plain groups (no feature or batch groups: the members'
own, not the vectorised members' grouped one) with no output sharding of
its own is lowered on a CPU as that form: its operands transposed in, the
result transposed out. The sums are the same (XLA's own
transposes outside loops are these); the convolution then runs on the fast
kernels inside the compiled loops of `fit` and in a `lax.map` over members. A
user's own programs are lowered as JAX lowers them.
"""

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

import jax.numpy as jnp
from jax import lax
from jax.interpreters import mlir

_ACTIVE = contextvars.ContextVar("eqx_ensemble_canonical_convolutions", default=False)
_PRIMITIVE = lax.conv_general_dilated_p


def _jax_lowering() -> Any:
    """JAX's own CPU lowering of the primitive (its CPU rule expands complex
    convolutions into real ones; else the rule of every platform), which the
    rule below defers to (never itself, should this module run again)."""
    entry = mlir._platform_specific_lowerings["cpu"].get(_PRIMITIVE)
    if entry is not None and getattr(entry.rule, "__module__", None) != __name__:
        return entry.rule
    return mlir._lowerings[_PRIMITIVE].rule


try:
    _JAX_LOWERING = _jax_lowering()
except (AttributeError, KeyError):  # JAX's registry moved: its lowering stands
    _JAX_LOWERING = None
# Whether the library's programs get the fast form (`plan.py` unrolls a
# convolving `fit` on a CPU without it, as before).
AVAILABLE = _JAX_LOWERING is not None


@contextlib.contextmanager
def canonical_convolutions() -> Iterator[None]:
    """Convolutions lowered for a CPU in XLA's fast form (see the module) while
    in this context: around the library's own programs' trace and lowering."""
    token = _ACTIVE.set(True)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def canonical_numbers(spatial: int) -> lax.ConvDimensionNumbers:
    """The dimension numbers of XLA's fast form for `spatial` spatial
    dimensions: input and output `(batch, *spatial, feature)`, kernel
    `(*spatial, in, out)`."""
    last = spatial + 1
    return lax.ConvDimensionNumbers(
        lhs_spec=(0, last, *range(1, last)),
        rhs_spec=(last, spatial, *range(spatial)),
        out_spec=(0, last, *range(1, last)),
    )


def _lower(
    ctx: Any,
    lhs: Any,
    rhs: Any,
    *,
    dimension_numbers: lax.ConvDimensionNumbers,
    feature_group_count: int,
    batch_group_count: int,
    **params: Any,
) -> Any:
    numbers = dimension_numbers
    spatial = len(numbers.lhs_spec) - 2
    canonical = canonical_numbers(spatial)
    if (
        not _ACTIVE.get()
        or feature_group_count != 1
        or batch_group_count != 1
        or tuple(numbers) == tuple(canonical)
        # JAX's CPU rule splits a complex convolution into real ones; an
        # output sharding is written in the dimension order given.
        or jnp.issubdtype(ctx.avals_in[0].dtype, jnp.complexfloating)
        or params.get("out_sharding") is not None
    ):
        assert _JAX_LOWERING is not None
        return _JAX_LOWERING(
            ctx,
            lhs,
            rhs,
            dimension_numbers=numbers,
            feature_group_count=feature_group_count,
            batch_group_count=batch_group_count,
            **params,
        )
    lhs_spec, rhs_spec, out_spec = numbers
    # Where each dimension of the written output comes from in the canonical one.
    out_order = [0] * (spatial + 2)
    out_order[out_spec[0]], out_order[out_spec[1]] = 0, spatial + 1
    for position, dimension in enumerate(out_spec[2:]):
        out_order[dimension] = position + 1

    def canonical_form(lhs: Any, rhs: Any) -> Any:
        lhs = lax.transpose(lhs, (lhs_spec[0], *lhs_spec[2:], lhs_spec[1]))
        rhs = lax.transpose(rhs, (*rhs_spec[2:], rhs_spec[1], rhs_spec[0]))
        out = _PRIMITIVE.bind(
            lhs,
            rhs,
            dimension_numbers=canonical,
            feature_group_count=1,
            batch_group_count=1,
            **params,
        )
        return lax.transpose(out, tuple(out_order))

    return mlir.lower_fun(canonical_form, multiple_results=False)(ctx, lhs, rhs)


if AVAILABLE:
    mlir.register_lowering(_PRIMITIVE, _lower, platform="cpu")
