"""The library's programs lower a CPU's convolutions in XLA's fast form
(`_execution/convolution.py`): input and output `(batch, *spatial,
feature)`, kernel `(*spatial, in, out)`, with transposes around it.

What must hold: the values and gradients equal JAX's own lowering's (to
float32 rounding: the same sums, maybe added in another order) for every kind
of convolution the primitive takes (1-3 spatial dimensions, strides,
padding, both dilations, any dimension order; feature groups and complex
numbers left to JAX), inside loops too; the library's programs carry the
fast form; a user's own programs are lowered as JAX lowers them, before and
after the library's.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ON_CPU

from eqx_ensemble._execution.compile import filter_jit
from eqx_ensemble._execution.convolution import canonical_numbers

pytestmark = pytest.mark.skipif(not ON_CPU, reason="a CPU lowering")

# (input shape, kernel shape, dimension numbers, keyword arguments)
CASES = {
    "2d channels first": (
        (4, 3, 9, 8), (5, 3, 3, 3), ("NCHW", "OIHW", "NCHW"), {"padding": "SAME"},
    ),
    "2d strided, dilated": (
        (2, 3, 11, 10), (4, 3, 3, 2), ("NCHW", "OIHW", "NCHW"),
        {"window_strides": (2, 1), "padding": ((1, 2), (0, 1)),
         "lhs_dilation": (1, 2), "rhs_dilation": (2, 1)},
    ),
    "2d odd order": (
        (9, 8, 3, 4), (3, 3, 5, 3), ("HWCN", "HWOI", "CNHW"), {"padding": "VALID"},
    ),
    "2d canonical already": (
        (4, 9, 8, 3), (3, 3, 3, 5), ("NHWC", "HWIO", "NHWC"), {"padding": "SAME"},
    ),
    "1d": ((3, 2, 17), (4, 2, 5), ("NCH", "OIH", "NCH"), {"padding": "SAME"}),
    "3d": (
        (2, 2, 5, 6, 4), (3, 2, 2, 3, 2), ("NCDHW", "OIDHW", "NCDHW"),
        {"padding": "SAME", "window_strides": (1, 2, 1)},
    ),
    "feature groups": (
        (2, 4, 6, 6), (6, 2, 3, 3), ("NCHW", "OIHW", "NCHW"),
        {"padding": "SAME", "feature_group_count": 2},
    ),
}  # fmt: skip


def _conv(numbers, kwargs):
    def conv(x, w):
        return jax.lax.conv_general_dilated(
            x,
            w,
            window_strides=kwargs.get("window_strides", (1,) * (x.ndim - 2)),
            padding=kwargs["padding"],
            lhs_dilation=kwargs.get("lhs_dilation"),
            rhs_dilation=kwargs.get("rhs_dilation"),
            dimension_numbers=numbers,
            feature_group_count=kwargs.get("feature_group_count", 1),
        )

    return conv


def _value_and_grads(conv):
    """A loss of the convolution, its gradients, and the same three times in a
    `lax.scan` (where XLA itself leaves a convolution's layout alone)."""

    def loss(x, w):
        return jnp.sum(jnp.sin(conv(x, w)))

    def program(x, w):
        value, grads = jax.value_and_grad(loss, argnums=(0, 1))(x, w)

        def body(carry, scale):
            return carry, jax.value_and_grad(loss, argnums=(0, 1))(x, scale * w)

        _, looped = jax.lax.scan(body, None, jnp.array([0.5, 1.0, 2.0]))
        return value, grads, looped

    return program


def _inputs(x_shape, w_shape):
    key = jax.random.key(0)
    return (
        jax.random.normal(key, x_shape, jnp.float32),
        jax.random.normal(jax.random.fold_in(key, 1), w_shape, jnp.float32) / 3,
    )


@pytest.mark.parametrize("case", list(CASES))
def test_values_and_gradients_equal_jaxs_lowering(case):
    x_shape, w_shape, numbers, kwargs = CASES[case]
    program = _value_and_grads(_conv(numbers, kwargs))
    x, w = _inputs(x_shape, w_shape)
    ours = filter_jit(program, ())(x, w)
    theirs = jax.jit(program)(x, w)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs), strict=True):
        scale = float(np.max(np.abs(np.asarray(b)))) or 1.0
        np.testing.assert_allclose(
            np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-5 * scale
        )


def _convolution_numbers(text):
    """The dimension numbers of every convolution in StableHLO text."""
    return re.findall(r"dim_numbers = (\[[^\]]*\]x\[[^\]]*\]->\[[^\]]*\])", text)


def test_the_librarys_programs_carry_the_fast_form_and_users_keep_jaxs():
    x_shape, w_shape, numbers, kwargs = CASES["2d channels first"]
    program = _value_and_grads(_conv(numbers, kwargs))
    x, w = _inputs(x_shape, w_shape)
    users = jax.jit(program).lower(x, w).as_text()
    ours = filter_jit(program, ()).lower(x, w).as_text()
    fast = "[b, 0, 1, f]x[0, 1, i, o]->[b, 0, 1, f]"
    found = _convolution_numbers(ours)
    # The forward convolution and the two of its gradient, out of the loop
    # and in it: all in the fast form.
    assert len(found) >= 6 and set(found) == {fast}
    # JAX's lowering, as before the library: the forms written (and the
    # gradient's own), none of them rewritten.
    assert fast not in _convolution_numbers(users)
    assert "[b, f, 0, 1]x[o, i, 0, 1]->[b, f, 0, 1]" in _convolution_numbers(users)
    # A user's program lowered after the library's is still JAX's.
    again = jax.jit(lambda x, w: program(x, w)).lower(x, w).as_text()
    assert _convolution_numbers(again) == _convolution_numbers(users)


def test_grouped_convolutions_are_left_to_jax():
    x_shape, w_shape, numbers, kwargs = CASES["feature groups"]
    conv = _conv(numbers, kwargs)
    x, w = _inputs(x_shape, w_shape)
    ours = _convolution_numbers(filter_jit(conv, ()).lower(x, w).as_text())
    assert ours == ["[b, f, 0, 1]x[o, i, 0, 1]->[b, f, 0, 1]"]


def test_canonical_numbers():
    assert canonical_numbers(2) == jax.lax.conv_dimension_numbers(
        (1, 1, 1, 1), (1, 1, 1, 1), ("NHWC", "HWIO", "NHWC")
    )
    assert canonical_numbers(1) == jax.lax.conv_dimension_numbers(
        (1, 1, 1), (1, 1, 1), ("NHC", "HIO", "NHC")
    )


def test_complex_convolutions_keep_jaxs_cpu_rule():
    # JAX's CPU rule splits a complex convolution into real ones (three
    # products); the library's rule defers to it, in its programs and in a
    # user's alike.
    x = jax.random.normal(jax.random.key(0), (2, 3, 6, 6), jnp.complex64)
    w = jax.random.normal(jax.random.key(1), (4, 3, 3, 3), jnp.complex64)
    conv = _conv(("NCHW", "OIHW", "NCHW"), {"padding": "SAME"})
    users = _convolution_numbers(jax.jit(conv).lower(x, w).as_text())
    ours = _convolution_numbers(filter_jit(conv, ()).lower(x, w).as_text())
    assert len(users) == len(ours) == 3
    np.testing.assert_allclose(
        np.asarray(filter_jit(conv, ())(x, w)), np.asarray(jax.jit(conv)(x, w)),
        rtol=1e-5, atol=1e-4,
    )  # fmt: skip


FAST = "[b, 0, 1, f]x[0, 1, i, o]->[b, 0, 1, f]"


def test_checkpointed_and_mesh_placed_loops_are_rewritten_too():
    # A `jax.checkpoint`-ed body holds an open jaxpr; an Auto mesh puts a mesh
    # into the loop carry's type: both are rewritten (neither was before).
    conv = _conv(("NCHW", "OIHW", "NCHW"), {"padding": "SAME"})
    x, w = _inputs((4, 3, 8, 8), (3, 3, 3, 3))

    def checkpointed(x, w):
        def body(c, _):
            return jax.checkpoint(lambda c: jnp.tanh(conv(c, w)))(c), None

        def loss(x, w):
            return jnp.sum(jax.lax.scan(body, x, None, length=3)[0])

        return jax.grad(loss, argnums=(0, 1))(x, w)

    ours = filter_jit(checkpointed, ())
    found = _convolution_numbers(ours.lower(x, w).as_text())
    assert found and set(found) == {FAST}, found
    expected = jax.jit(checkpointed)(x, w)
    for a, b in zip(
        jax.tree.leaves(ours(x, w)), jax.tree.leaves(expected), strict=True
    ):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-5)
    mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    placed = jax.device_put(
        jnp.tile(x, (2, 1, 1, 1)),
        jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d")),
    )

    def looped(x, w):
        return jax.lax.fori_loop(0, 2, lambda i, c: jnp.tanh(conv(c, w)), x)

    found = _convolution_numbers(filter_jit(looped, ()).lower(placed, w).as_text())
    assert found and set(found) == {FAST}, found
    np.testing.assert_allclose(
        np.asarray(filter_jit(looped, ())(placed, w)),
        np.asarray(jax.jit(looped)(placed, w)),
        rtol=2e-5,
        atol=2e-5,
    )


@pytest.mark.skipif(not hasattr(jax, "new_ref"), reason="a JAX without mutable refs")
def test_a_loop_over_a_mutable_ref_is_left_as_written():
    # A trace from shape and dtype would drop an input's `Ref` type ("get must
    # be called on Ref types"): such a program is evaluated as it is.
    conv = _conv(("NCHW", "OIHW", "NCHW"), {"padding": "SAME"})
    x, w = _inputs((1, 2, 4, 4), (2, 2, 3, 3))

    def accumulating(x, w):
        total = jax.new_ref(jnp.zeros(()))

        def body(i, c):
            y = conv(c, w)
            total[...] += jnp.sum(y)
            return y

        return jax.lax.fori_loop(0, 2, body, x), total[...]

    ours, theirs = filter_jit(accumulating, ())(x, w), jax.jit(accumulating)(x, w)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5)
