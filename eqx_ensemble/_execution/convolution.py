"""Convolutions in the one form XLA's CPU backend runs fast in any program.

XLA's CPU kernels take a convolution only as `NHWC`/`HWIO` and transpose others
only at a program's top level: inside a loop they run far slower (jax-ml/jax
issue 12868). `canonical_convolutions(fn)` rewrites `fn`'s plain convolutions.
"""

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.core
import jax.extend.core as jex
import jax.numpy as jnp
from jax import lax

_PRIMITIVE = lax.conv_general_dilated_p


def canonical_convolutions(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` (of PyTrees of arrays) with its convolutions in XLA's fast form."""

    @functools.wraps(fn)
    def rewritten(*args: Any) -> Any:
        closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
        outputs = _Rewriter().evaluate(closed, jax.tree.leaves(args))
        return jax.tree.unflatten(jax.tree.structure(out_shape), outputs)

    return rewritten


def canonical_numbers(spatial: int) -> lax.ConvDimensionNumbers:
    """XLA's fast form: `(batch, *spatial, feature)`, kernel `(*spatial, in, out)`."""
    last = spatial + 1
    return lax.ConvDimensionNumbers(
        lhs_spec=(0, last, *range(1, last)),
        rhs_spec=(last, spatial, *range(spatial)),
        out_spec=(0, last, *range(1, last)),
    )


def _rewritable(eqn: Any) -> bool:
    if eqn.primitive is not _PRIMITIVE:
        return False
    params = eqn.params
    numbers = params["dimension_numbers"]
    spatial = len(numbers.lhs_spec) - 2
    return (
        params["feature_group_count"] == 1
        and params["batch_group_count"] == 1
        and tuple(numbers) != tuple(canonical_numbers(spatial))
        and not jnp.issubdtype(eqn.invars[0].aval.dtype, jnp.complexfloating)
        and params.get("out_sharding") is None
    )


def _canonical_convolution(lhs: Any, rhs: Any, **params: Any) -> Any:
    numbers = params.pop("dimension_numbers")
    lhs_spec, rhs_spec, out_spec = numbers
    spatial = len(lhs_spec) - 2
    # Where each dimension of the written output comes from in the canonical one.
    out_order = [0] * (spatial + 2)
    out_order[out_spec[0]], out_order[out_spec[1]] = 0, spatial + 1
    for position, dimension in enumerate(out_spec[2:]):
        out_order[dimension] = position + 1
    lhs = lax.transpose(lhs, (lhs_spec[0], *lhs_spec[2:], lhs_spec[1]))
    rhs = lax.transpose(rhs, (*rhs_spec[2:], rhs_spec[1], rhs_spec[0]))
    out = _PRIMITIVE.bind(
        lhs, rhs, dimension_numbers=canonical_numbers(spatial), **params
    )
    return lax.transpose(out, tuple(out_order))


class _Rewriter:
    """One program's rewrite: each inner program rewritten once (by identity)."""

    def __init__(self) -> None:
        self._closed: dict[int, tuple[Any, Any]] = {}
        self._convolves: dict[int, bool] = {}

    def convolves(self, jaxpr: Any) -> bool:
        """Whether `jaxpr` (or a program it holds) has a convolution to rewrite."""
        found = self._convolves.get(id(jaxpr))
        if found is None:
            found = any(
                _rewritable(eqn)
                or any(
                    self.convolves(inner.jaxpr) for inner in _closed_jaxprs(eqn.params)
                )
                for eqn in jaxpr.eqns
            )
            self._convolves[id(jaxpr)] = found
        return found

    def evaluate(self, closed: Any, args: list[Any]) -> list[Any]:
        if not self.convolves(closed.jaxpr):
            return jex.jaxpr_as_fun(closed)(*args)
        return self._eval(closed.jaxpr, closed.consts, args)

    def _eval(self, jaxpr: Any, consts: Any, args: Any) -> list[Any]:
        env: dict[Any, Any] = {}

        def read(var: Any) -> Any:
            return var.val if isinstance(var, jex.Literal) else env[var]

        for var, value in zip(jaxpr.constvars, consts, strict=True):
            env[var] = value
        for var, value in zip(jaxpr.invars, args, strict=True):
            env[var] = value
        for eqn in jaxpr.eqns:
            inputs = [read(var) for var in eqn.invars]
            if _rewritable(eqn):
                outputs = [_canonical_convolution(*inputs, **eqn.params)]
            else:
                params = {
                    name: self._param(value) for name, value in eqn.params.items()
                }
                outputs = _bind(eqn, inputs, params)
            for var, value in zip(eqn.outvars, outputs, strict=True):
                env[var] = value  # (a dropped output too: never read)
        return [read(var) for var in jaxpr.outvars]

    def _param(self, value: Any) -> Any:
        if isinstance(value, jex.ClosedJaxpr):
            return self._rewrite(value)
        if isinstance(value, jex.Jaxpr) and not value.constvars:
            # An open program (`jax.checkpoint`'s): kept if the rewrite adds consts.
            closed = jex.ClosedJaxpr(value, [])
            found = self._rewrite(closed)
            return value if found is closed or found.consts else found.jaxpr
        if isinstance(value, tuple) and any(
            isinstance(item, jex.ClosedJaxpr) for item in value
        ):
            return tuple(self._param(item) for item in value)
        return value

    def _rewrite(self, closed: Any) -> Any:
        """`closed` with its convolutions rewritten (where a retrace keeps it)."""
        kept = self._closed.get(id(closed))
        if kept is not None:
            return kept[1]
        found = closed
        avals = [var.aval for var in closed.jaxpr.invars]
        plain = all(type(aval) is jax.core.ShapedArray for aval in avals)
        if plain and self.convolves(closed.jaxpr) and not any(map(_explicit, avals)):
            structs = [
                jax.ShapeDtypeStruct(
                    aval.shape,
                    aval.dtype,
                    weak_type=aval.weak_type,
                    sharding=getattr(aval, "sharding", None)
                    if _on_mesh(aval)
                    else None,
                )
                for aval in avals
            ]
            found = jax.make_jaxpr(
                lambda *xs: self._eval(closed.jaxpr, closed.consts, xs)
            )(*structs)
        # (Kept with its program: an id is only unique while its object lives.)
        self._closed[id(closed)] = (closed, found)
        return found


def _bind(eqn: Any, inputs: list[Any], params: dict[str, Any]) -> list[Any]:
    """`eqn`'s primitive bound to `inputs` with `params`, in its context."""
    bind_params = eqn.primitive.get_bind_params(params)
    subfuns: Any = ()
    if isinstance(bind_params, tuple):  # JAX 0.8: (subfunctions, parameters)
        subfuns, bind_params = bind_params
    context = getattr(getattr(eqn, "ctx", None), "manager", None)
    with context if context is not None else contextlib.nullcontext():
        outputs = eqn.primitive.bind(*subfuns, *inputs, **bind_params)
    return outputs if eqn.primitive.multiple_results else [outputs]


def _closed_jaxprs(params: dict[str, Any]) -> list[Any]:
    found = []
    for value in params.values():
        items = value if isinstance(value, tuple) else (value,)
        for item in items:
            if isinstance(item, jex.ClosedJaxpr):
                found.append(item)
            elif isinstance(item, jex.Jaxpr):
                found.append(jex.ClosedJaxpr(item, []))
    return found


def _on_mesh(aval: Any) -> bool:
    mesh = getattr(getattr(aval, "sharding", None), "mesh", None)
    return not getattr(mesh, "empty", True)  # (no mesh: no `empty`)


def _explicit(aval: Any) -> bool:
    """Whether `aval`'s sharding names an explicit mesh axis."""
    if not _on_mesh(aval):
        return False
    axis_types = getattr(aval.sharding.mesh, "axis_types", ())
    return any("Explicit" in str(kind) for kind in axis_types)
