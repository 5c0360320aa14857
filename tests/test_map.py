"""`ee.map`: member i of the result equals `fn(unstack(ens)[i], ...)` alone."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_tree_allclose

import eqx_ensemble as ee

SIZE = 5
# None, 1, a chunk that divides nothing (3 -> 1 chunk + remainder 2), the whole size.
CHUNKS = [None, 1, 2, 3, SIZE]


@pytest.fixture(scope="module")
def ens():
    return ee.ensemble(
        lambda k: eqx.nn.MLP(3, 2, 8, 2, key=k), size=SIZE, key=jax.random.key(42)
    )


@pytest.fixture(scope="module")
def models(ens):
    return ee.unstack(ens)


def _batched(model, xs):
    return jax.vmap(model)(xs)


@pytest.mark.parametrize("chunk_size", CHUNKS)
def test_shared_argument(ens, models, chunk_size, getkey):
    xs = jax.random.normal(getkey(), (7, 3))
    out = ee.map(_batched, ens, xs, chunk_size=chunk_size)
    assert out.shape == (SIZE, 7, 2)
    for i, model in enumerate(models):
        assert_tree_allclose(out[i], _batched(model, xs))


@pytest.mark.parametrize("chunk_size", CHUNKS)
@pytest.mark.parametrize("in_axes", [(0,), 0, [0]])
def test_per_member_argument(ens, models, chunk_size, in_axes, getkey):
    xs = jax.random.normal(getkey(), (SIZE, 7, 3))
    out = ee.map(_batched, ens, xs, in_axes=in_axes, chunk_size=chunk_size)
    for i, model in enumerate(models):
        assert_tree_allclose(out[i], _batched(model, xs[i]))


@pytest.mark.parametrize("chunk_size", CHUNKS)
def test_mixed_arguments(ens, models, chunk_size, getkey):
    def loss(model, xs, ys, scale):
        return scale * jnp.mean((_batched(model, xs) - ys) ** 2)

    xs = jax.random.normal(getkey(), (SIZE, 7, 3))  # per member (bagging)
    ys = jax.random.normal(getkey(), (7, 2))  # shared
    out = ee.map(loss, ens, xs, ys, 2.0, in_axes=(0, None, None), chunk_size=chunk_size)
    expected = np.array([float(loss(m, xs[i], ys, 2.0)) for i, m in enumerate(models)])
    np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("chunk_size", CHUNKS)
def test_pytree_prefix_in_axes(ens, models, chunk_size, getkey):
    # One argument mixing per-member and shared leaves, plus a None leaf and a
    # non-array leaf under the per-member part.
    batch = {
        "x": (jax.random.normal(getkey(), (SIZE, 4, 3)), None, "tag"),
        "shift": jax.random.normal(getkey(), (2,)),
    }

    def fn(model, batch):
        xs, _, tag = batch["x"]
        assert tag == "tag"
        return _batched(model, xs) + batch["shift"][None]

    out = ee.map(
        fn, ens, batch, in_axes=({"x": 0, "shift": None},), chunk_size=chunk_size
    )
    for i, model in enumerate(models):
        member_batch = {"x": (batch["x"][0][i], None, "tag"), "shift": batch["shift"]}
        assert_tree_allclose(out[i], fn(model, member_batch))


@pytest.mark.parametrize("chunk_size", CHUNKS)
def test_none_leaf_in_per_member_argument(ens, models, chunk_size, getkey):
    # Regression: a per-member argument containing None crashed the leading-axis
    # check with a bare "zip() argument 2 is longer than argument 1".
    xs = jax.random.normal(getkey(), (SIZE, 3))
    out = ee.map(
        lambda m, a: m(a[0]), ens, (xs, None), in_axes=(0,), chunk_size=chunk_size
    )
    for i, model in enumerate(models):
        assert_tree_allclose(out[i], model(xs[i]))


class _Dropped(eqx.Module):
    linear: eqx.nn.Linear
    dropout: eqx.nn.Dropout

    def __init__(self, key):
        self.linear = eqx.nn.Linear(4, 16, key=key)
        self.dropout = eqx.nn.Dropout(0.5)

    def __call__(self, x, *, key):
        return self.dropout(self.linear(x), key=key)


@pytest.mark.parametrize("chunk_size", CHUNKS)
def test_key_per_member(chunk_size, getkey):
    ens = ee.ensemble(_Dropped, size=SIZE, key=getkey())
    models = ee.unstack(ens)
    xs = jax.random.normal(getkey(), (SIZE, 4))
    key = getkey()
    out = ee.map(
        lambda m, x, *, key: m(x, key=key),
        ens,
        xs,
        in_axes=(0,),
        key=key,
        chunk_size=chunk_size,
    )
    member_keys = jax.random.split(key, SIZE)
    for i, model in enumerate(models):
        assert_tree_allclose(out[i], model(xs[i], key=member_keys[i]))
    # The same through `ens(x, key=...)` with a shared input.
    shared = ens(xs[0], key=key)
    for i, model in enumerate(models):
        assert_tree_allclose(shared[i], model(xs[0], key=member_keys[i]))


@pytest.mark.parametrize("chunk_size", [None, 2, 3])
def test_raw_uint32_key(ens, models, chunk_size):
    key = jax.random.PRNGKey(7)

    def fn(model, *, key):
        return model(jax.random.normal(key, (3,)))

    out = ee.map(fn, ens, key=key, chunk_size=chunk_size)
    for i, model in enumerate(models):
        assert_tree_allclose(out[i], fn(model, key=jax.random.split(key, SIZE)[i]))


@pytest.mark.parametrize("chunk_size", [None, 2, 3])
def test_outputs_with_non_array_leaves(ens, models, chunk_size, getkey):
    x = jax.random.normal(getkey(), (3,))

    def fn(model, x):
        return {"y": model(x), "name": "out", "activation": jax.nn.relu, "none": None}

    out = ee.map(fn, ens, x, chunk_size=chunk_size)
    assert out["name"] == "out" and out["activation"] is jax.nn.relu
    assert out["none"] is None
    for i, model in enumerate(models):
        assert_tree_allclose(out["y"][i], model(x))


@pytest.mark.parametrize("chunk_size", [None, 2])
def test_output_is_a_model(ens, models, chunk_size):
    # fn may return a model (e.g. an updated one): the result is a stacked model.
    def scaled(model):
        return jax.tree.map(
            lambda leaf: 2 * leaf if eqx.is_array(leaf) else leaf, model
        )

    out = ee.map(scaled, ens, chunk_size=chunk_size)
    assert isinstance(out, eqx.nn.MLP)
    assert_tree_allclose(ee.unstack(ee.Ensemble(out)), [scaled(m) for m in models])


@pytest.mark.parametrize("chunk_size", [None, 3])
def test_gradients_per_member(ens, models, chunk_size, getkey):
    xs = jax.random.normal(getkey(), (SIZE, 6, 3))
    ys = jax.random.normal(getkey(), (6, 2))

    @eqx.filter_grad
    def grad(model, xs, ys):
        return jnp.mean((_batched(model, xs) - ys) ** 2)

    out = ee.map(grad, ens, xs, ys, in_axes=(0, None), chunk_size=chunk_size)
    for i, model in enumerate(models):
        assert_tree_allclose(
            ee.Ensemble(out)[i], grad(model, xs[i], ys), rtol=1e-4, atol=1e-5
        )


@pytest.mark.parametrize("chunk_size", [None, 2, 3])
def test_map_under_jit(ens, models, chunk_size, getkey):
    xs = jax.random.normal(getkey(), (SIZE, 7, 3))

    @eqx.filter_jit
    def run(ens, xs):
        return ee.map(_batched, ens, xs, in_axes=(0,), chunk_size=chunk_size)

    out = run(ens, xs)
    for i, model in enumerate(models):
        assert_tree_allclose(out[i], _batched(model, xs[i]))


@pytest.mark.parametrize("numpy_input", [False, True])
def test_numpy_per_member_argument(ens, models, numpy_input):
    xs = np.random.default_rng(0).normal(size=(SIZE, 3)).astype(np.float32)
    args = xs if numpy_input else jnp.asarray(xs)
    for chunk_size in (None, 3):
        out = ee.map(lambda m, x: m(x), ens, args, in_axes=0, chunk_size=chunk_size)
        for i, model in enumerate(models):
            assert_tree_allclose(out[i], model(jnp.asarray(xs[i])))


# --------------------------------------------------------------------------------
# One trace, whatever the ensemble size.
# --------------------------------------------------------------------------------


def test_traced_once_for_256_members(getkey):
    ens = ee.ensemble(lambda k: eqx.nn.Linear(4, 3, key=k), size=256, key=getkey())
    traces = 0

    def fn(model, x):
        nonlocal traces
        traces += 1
        return model(x)

    run = eqx.filter_jit(lambda ens, x: ee.map(fn, ens, x))
    x = jax.random.normal(getkey(), (4,))
    out = run(ens, x)
    assert traces == 1
    run(ens, x + 1)  # cached: no retrace
    assert traces == 1
    assert out.shape == (256, 3)
    for i in (0, 17, 255):
        assert_tree_allclose(out[i], ens[i](x))

    # Chunked: one trace for the scanned chunks and one for the remainder, never one
    # per member or per chunk.
    for chunk_size, expected_traces in ((64, 1), (100, 2)):
        traces = 0
        chunked = ee.map(fn, ens, x, chunk_size=chunk_size)
        assert traces == expected_traces
        assert_tree_allclose(chunked, out)


# --------------------------------------------------------------------------------
# Bad input
# --------------------------------------------------------------------------------


def test_in_axes_length_mismatch(ens):
    with pytest.raises(ValueError, match=r"`in_axes` has 1 entries but 2 positional"):
        ee.map(lambda m, a, b: m(a), ens, jnp.ones(3), jnp.ones(3), in_axes=(None,))
    with pytest.raises(ValueError, match=r"`in_axes` has 2 entries but 0 positional"):
        ee.map(lambda m: m(jnp.ones(3)), ens, in_axes=(0, None))


def test_in_axes_bad_values(ens):
    with pytest.raises(ValueError, match=r"`in_axes\[0\]` must be None .* got 1"):
        ee.map(lambda m, x: m(x), ens, jnp.ones((3, SIZE)), in_axes=(1,))
    with pytest.raises(ValueError, match=r"`in_axes\[0\]` must be None .* got True"):
        ee.map(lambda m, x: m(x), ens, jnp.ones((SIZE, 3)), in_axes=(True,))
    with pytest.raises(ValueError, match=r"`in_axes\[0\]`.* not a PyTree prefix"):
        ee.map(lambda m, x: m(x[0]), ens, (jnp.ones((SIZE, 3)),), in_axes=({"a": 0},))


def test_per_member_argument_wrong_size(ens):
    with pytest.raises(
        ValueError,
        match=r"argument 1 is per-member .* ensemble size 5, but it has shape \(4, 3\)",
    ):
        ee.map(
            lambda m, a, b: m(b), ens, jnp.ones(3), jnp.ones((4, 3)), in_axes=(None, 0)
        )
    with pytest.raises(
        ValueError,
        match=r"argument 0 at leaf `\['x'\]` .* size 5, but it has shape \(\)",
    ):
        ee.map(lambda m, d: m(d["x"]), ens, {"x": jnp.array(1.0)}, in_axes=0)


def test_chunk_size_errors(ens):
    fn = lambda m: m(jnp.ones(3))
    for chunk_size in (0, -1, SIZE + 1):
        with pytest.raises(
            ValueError, match=r"`chunk_size` must be between 1 and .* 5"
        ):
            ee.map(fn, ens, chunk_size=chunk_size)


def test_map_needs_an_ensemble(models):
    with pytest.raises(TypeError, match="expects an `ee.Ensemble`|Type-check error"):
        ee.map(lambda m: m(jnp.ones(3)), models)


def test_map_key_wrong_shape(ens):
    keys = jax.random.split(jax.random.key(0), SIZE)
    with pytest.raises((TypeError, ValueError), match="key|Type-check error"):
        ee.map(lambda m, *, key: m(jnp.ones(3)), ens, key=keys)


def test_check_per_member_args_helper():
    # Used by the training step with `(batch,), (0,)`: keep that calling convention.
    from eqx_ensemble._core.mapping import (
        check_per_member_args as _check_per_member_args,
    )

    batch = {"x": jnp.ones((SIZE, 3)), "y": jnp.ones((SIZE,)), "weight": None}
    masks = _check_per_member_args((batch,), (0,), SIZE)
    assert masks == ({"x": True, "y": True, "weight": None},)
    with pytest.raises(ValueError, match=r"leaf `\['y'\]` .* shape \(4,\)"):
        _check_per_member_args(
            ({"x": jnp.ones((SIZE, 3)), "y": jnp.ones(4)},), (0,), SIZE
        )


def test_gradient_through_chunked_map(ens, getkey):
    xs = jax.random.normal(getkey(), (7, 3))

    def total(ens, chunk_size):
        losses = ee.map(
            lambda m, x: jnp.sum(_batched(m, x) ** 2), ens, xs, chunk_size=chunk_size
        )
        return losses.sum()

    unchunked = eqx.filter_grad(total)(ens, None)
    for chunk_size in (2, 3):
        assert_tree_allclose(eqx.filter_grad(total)(ens, chunk_size), unchunked)


# ------------------------------------ chunks without a copy, one example a member


def _ensemble(size, seed=0):
    return ee.ensemble(
        lambda k: eqx.nn.MLP(3, 2, 4, 1, key=k), size=size, key=jax.random.key(seed)
    )


def test_chunked_map_does_not_copy_the_members():
    ens = _ensemble(13)  # 3 chunks of 4 and a remainder of 1
    x = jnp.ones((5, 3))
    member_shapes = {
        leaf.shape[1:] for leaf in jax.tree.leaves(eqx.filter(ens, eqx.is_array))
    }
    dynamic, static = eqx.partition(ens.members, eqx.is_array)

    def run(members):
        members = eqx.combine(members, static)
        return ee.map(
            lambda m, x: jax.vmap(m)(x), ee.Ensemble(members), x, chunk_size=4
        )

    jaxpr = jax.make_jaxpr(run)(dynamic)
    # Outside the chunk loop, no operation makes a copy of more than a chunk of
    # members (slicing the first 12 members and reshaping them into (chunks,
    # chunk, ...) would be a copy of the ensemble, doubling peak memory).
    for equation in jaxpr.jaxpr.eqns:
        if equation.primitive.name == "scan":
            continue
        for var in equation.outvars:
            shape = var.aval.shape
            if shape and shape[1:] in member_shapes:
                assert shape[0] <= 4, (equation.primitive, shape)


def test_chunked_map_equals_unchunked_to_rounding():
    ens = _ensemble(7)
    x = jax.random.normal(jax.random.key(3), (9, 3))
    fn = lambda m, x: jax.vmap(m)(x)  # noqa: E731
    whole = ee.map(fn, ens, x)
    for chunk in (1, 2, 3, 7):
        np.testing.assert_allclose(
            ee.map(fn, ens, x, chunk_size=chunk), whole, rtol=1e-6, atol=1e-7
        )


def test_forgetting_vmap_in_map_explains_members_take_one_example():
    ens = _ensemble(3)
    with pytest.raises(Exception, match="ONE example"):
        ee.map(lambda m, x: m(x), ens, jnp.ones((8, 3)))
