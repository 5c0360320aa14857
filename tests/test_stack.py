"""`ee.stack` / `ee.unstack` / `ee.concatenate`: round trips and clear errors."""

import equinox as eqx
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_tree_allclose, tree_equal
from hypothesis import given, settings

import eqx_ensemble as ee
from eqx_ensemble._execution.profile import inner_jaxprs

ACTIVATIONS = [jax.nn.relu, jax.nn.tanh, jax.nn.gelu, jax.nn.sigmoid, jnp.sin]
ROUND_TRIP = settings(max_examples=15, deadline=None)


def _equal(a, b) -> bool:
    return bool(tree_equal(a, b))


# --------------------------------------------------------------------------------
# Random model structures for the round-trip properties.
# --------------------------------------------------------------------------------


@st.composite
def mlp_builders(draw):
    sizes = st.one_of(st.integers(1, 4), st.just("scalar"))
    config = dict(
        in_size=draw(sizes),
        out_size=draw(sizes),
        width_size=draw(st.integers(1, 6)),
        depth=draw(st.integers(0, 3)),
        activation=draw(st.sampled_from(ACTIVATIONS)),
        final_activation=draw(st.sampled_from(ACTIVATIONS)),
        use_bias=draw(st.booleans()),
        use_final_bias=draw(st.booleans()),
    )
    return lambda key: eqx.nn.MLP(**config, key=key)


@st.composite
def conv_builders(draw):
    dims = draw(st.sampled_from([1, 2]))
    conv = eqx.nn.Conv1d if dims == 1 else eqx.nn.Conv2d
    config = dict(
        in_channels=draw(st.integers(1, 3)),
        out_channels=draw(st.integers(1, 3)),
        kernel_size=draw(st.integers(1, 3)),
        stride=draw(st.integers(1, 2)),
        padding=draw(st.integers(0, 1)),
        use_bias=draw(st.booleans()),
    )
    return lambda key: conv(**config, key=key)


@st.composite
def linear_builders(draw):
    sizes = st.one_of(st.integers(1, 5), st.just("scalar"))
    config = dict(
        in_features=draw(sizes),
        out_features=draw(sizes),
        use_bias=draw(st.booleans()),
    )
    return lambda key: eqx.nn.Linear(**config, key=key)


builders = st.one_of(mlp_builders(), conv_builders(), linear_builders())


@ROUND_TRIP
@given(build=builders, size=st.integers(1, 6), seed=st.integers(0, 2**16))
def test_round_trip_modules(build, size, seed):
    keys = jax.random.split(jax.random.key(seed), size)
    models = [build(key) for key in keys]
    ens = ee.stack(models)
    assert len(ens) == size
    unstacked = ee.unstack(ens)
    assert isinstance(unstacked, list) and len(unstacked) == size
    # tree_equal compares treedefs too: module types and static fields intact.
    assert _equal(unstacked, models)
    for model, back in zip(models, unstacked):
        assert type(back) is type(model)
    # Stacking keeps each member's weights, in order.
    for i, model in enumerate(models):
        assert _equal(ens[i], model)


@ROUND_TRIP
@given(build=builders, size=st.integers(1, 6), seed=st.integers(0, 2**16))
def test_round_trip_ensemble(build, size, seed):
    ens = ee.ensemble(build, size=size, key=jax.random.key(seed))
    restacked = ee.stack(ee.unstack(ens))
    assert isinstance(restacked, ee.Ensemble)
    assert _equal(restacked, ens)


@st.composite
def plain_pytrees(draw):
    """A builder `seed -> PyTree` of plain containers: a list of (w, b) tuples, or a
    nested dict with arrays of several dtypes and a few non-array leaves."""
    if draw(st.booleans()):
        widths = draw(st.lists(st.integers(1, 4), min_size=2, max_size=4))

        def build(seed):
            rng = np.random.default_rng(seed)
            return [
                (
                    jnp.asarray(rng.normal(size=(a, b)), dtype=jnp.float32),
                    jnp.asarray(rng.normal(size=(b,)), dtype=jnp.float32),
                )
                for a, b in zip(widths[:-1], widths[1:])
            ]

        return build
    shape = tuple(draw(st.lists(st.integers(1, 3), max_size=3)))

    def build(seed):
        rng = np.random.default_rng(seed)
        return {
            "encoder": {
                "w": jnp.asarray(rng.normal(size=shape), dtype=jnp.float32),
                "steps": jnp.asarray(rng.integers(0, 9, size=shape), dtype=jnp.int32),
            },
            "scale": jnp.asarray(rng.normal(), dtype=jnp.float32),
            "name": "head",
            "temperature": 0.5,
            "layers": [jnp.asarray(rng.normal(size=(2,)), dtype=jnp.float32), None],
        }

    return build


@ROUND_TRIP
@given(build=plain_pytrees(), size=st.integers(1, 6), seed=st.integers(0, 2**16))
def test_round_trip_plain_pytrees(build, size, seed):
    models = [build(seed + i) for i in range(size)]
    ens = ee.stack(models)
    assert len(ens) == size
    assert _equal(ee.unstack(ens), models)
    assert _equal(ee.stack(ee.unstack(ens)), ens)


def test_unstack_members_that_are_lists():
    # Regression: unstack used `is_leaf=isinstance(x, list)` and broke when the
    # model itself is a list (a list of (w, b) layers).
    models = [
        [(jnp.full((3, 2), float(i)), jnp.full(2, -float(i))), (jnp.ones((2, 1)),)]
        for i in range(3)
    ]
    unstacked = ee.unstack(ee.stack(models))
    assert _equal(unstacked, models)


def test_stack_layout():
    models = [(jnp.full((3, 2), float(i)), jnp.full((2,), 10.0 * i)) for i in range(4)]
    ens = ee.stack(models)
    weight, bias = ens.members
    assert weight.shape == (4, 3, 2) and bias.shape == (4, 2)
    np.testing.assert_array_equal(weight[:, 0, 0], [0.0, 1.0, 2.0, 3.0])
    np.testing.assert_array_equal(bias[:, 0], [0.0, 10.0, 20.0, 30.0])


def test_non_array_leaves_kept_once(getkey):
    models = [
        eqx.nn.MLP(2, 3, 4, 1, activation=jax.nn.tanh, key=getkey()) for _ in "ab"
    ]
    ens = ee.stack(models)
    assert ens.members.activation is jax.nn.tanh
    assert ens.members.width_size == 4
    assert ens.members.layers[0].weight.shape == (2, 4, 2)


# --------------------------------------------------------------------------------
# The classic failure: jax.vmap over a list of models.
# --------------------------------------------------------------------------------


def _loss(params, x, y):
    prediction = x
    for weight, bias in params[:-1]:
        prediction = jnp.tanh(prediction @ weight + bias[None])
    weight, bias = params[-1]
    prediction = prediction @ weight + bias[None]
    return jnp.mean((prediction - y) ** 2)


def test_vmap_over_list_fails_and_stack_fixes_it(getkey):
    widths = [3, 5, 2]
    num_models = 4
    params = [
        [
            (
                jax.random.normal(getkey(), (a, b)),
                jax.random.normal(getkey(), (b,)),
            )
            for a, b in zip(widths[:-1], widths[1:])
        ]
        for _ in range(num_models)
    ]
    x = jax.random.normal(getkey(), (16, 3))
    y = jax.random.normal(getkey(), (16, 2))

    with pytest.raises(
        ValueError, match="vmap got inconsistent sizes for array axes to be mapped"
    ):
        jax.vmap(_loss, in_axes=(0, None, None))(params, x, y)

    ens = ee.stack(params)
    losses = ee.map(_loss, ens, x, y)
    expected = np.array([float(_loss(p, x, y)) for p in params])
    assert losses.shape == (num_models,)
    np.testing.assert_allclose(np.asarray(losses), expected, rtol=1e-5, atol=1e-6)
    # The losses are really different per model (the test can tell them apart).
    assert np.ptp(expected) > 1e-3


def test_vmap_over_list_of_mlps_fails_and_stack_fixes_it(getkey):
    models = [eqx.nn.MLP(2, 1, 8, 2, key=getkey()) for _ in range(5)]
    x = jax.random.normal(getkey(), (10, 2))
    y = jax.random.normal(getkey(), (10, 1))

    def loss(model, x, y):
        return jnp.mean((jax.vmap(model)(x) - y) ** 2)

    # jax.vmap refuses the activation function leaves; eqx.filter_vmap gets past
    # those and then hits the inconsistent sizes.
    with pytest.raises(TypeError, match="is not a valid JAX type"):
        jax.vmap(loss, in_axes=(0, None, None))(models, x, y)
    with pytest.raises(
        ValueError, match="vmap got inconsistent sizes for array axes to be mapped"
    ):
        eqx.filter_vmap(loss, in_axes=(eqx.if_array(0), None, None))(models, x, y)

    losses = ee.map(loss, ee.stack(models), x, y)
    expected = np.array([float(loss(m, x, y)) for m in models])
    np.testing.assert_allclose(np.asarray(losses), expected, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------------
# concatenate
# --------------------------------------------------------------------------------


def test_concatenate(getkey):
    make = lambda k: eqx.nn.MLP(3, 2, 4, 1, key=k)
    parts = [ee.ensemble(make, size=n, key=getkey()) for n in (2, 1, 3)]
    joined = ee.concatenate(parts)
    assert len(joined) == 6
    expected = [m for part in parts for m in ee.unstack(part)]
    assert _equal(ee.unstack(joined), expected)
    assert _equal(ee.concatenate([parts[0]]), parts[0])


def test_concatenate_errors(getkey):
    a = ee.ensemble(lambda k: eqx.nn.Linear(3, 2, key=k), size=2, key=getkey())
    b = ee.ensemble(lambda k: eqx.nn.Linear(3, 4, key=k), size=2, key=getkey())
    with pytest.raises(ValueError, match="empty list"):
        ee.concatenate([])
    with pytest.raises(ValueError, match=r"ensemble 0 and ensemble 1 differ"):
        ee.concatenate([a, b])
    # beartype checks one random item of a Sequence: it may or may not see it first.
    with pytest.raises(TypeError, match="item 1 is a Linear|Type-check error"):
        ee.concatenate([a, a[0]])
    with pytest.raises(TypeError, match="takes a list of ensembles|Type-check error"):
        ee.concatenate(a)


# --------------------------------------------------------------------------------
# Bad input: each message names what is wrong and where.
# --------------------------------------------------------------------------------


def test_stack_error_names_leaf_path_and_shapes():
    good = {"encoder": {"w": jnp.ones((3, 2)), "b": jnp.ones(2)}}
    bad = {"encoder": {"w": jnp.ones((3, 5)), "b": jnp.ones(2)}}
    with pytest.raises(ValueError) as info:
        ee.stack([good, good, bad])
    message = str(info.value)
    assert "model 0 and model 2 differ" in message
    assert "['encoder']['w']" in message
    assert "(3, 2)" in message and "(3, 5)" in message


def test_stack_error_names_dtype():
    with pytest.raises(ValueError, match=r"\[1\].*float32.*int32"):
        ee.stack([(jnp.ones(2), jnp.ones(2)), (jnp.ones(2), jnp.ones(2, jnp.int32))])


def test_stack_error_static_field(getkey):
    a = eqx.nn.MLP(2, 1, 4, 1, key=getkey())
    b = eqx.nn.MLP(2, 1, 5, 1, key=getkey())
    with pytest.raises(
        ValueError, match=r"static field `\.width_size` differs: 4 vs 5"
    ):
        ee.stack([a, b])
    c = eqx.nn.Conv2d(2, 3, 3, stride=1, key=getkey())
    d = eqx.nn.Conv2d(2, 3, 3, stride=2, key=getkey())
    with pytest.raises(ValueError, match=r"`\.stride` differs: \(1, 1\) vs \(2, 2\)"):
        ee.stack([c, d])


def test_stack_error_activation(getkey):
    a = eqx.nn.MLP(2, 1, 4, 1, activation=jax.nn.relu, key=getkey())
    b = eqx.nn.MLP(2, 1, 4, 1, activation=jax.nn.tanh, key=getkey())
    with pytest.raises(ValueError, match=r"`\.activation` differs.*relu.*tanh"):
        ee.stack([a, b])
    # Two distinct lambdas are different functions: the message says so.
    c = eqx.nn.MLP(2, 1, 4, 1, activation=lambda x: x, key=getkey())
    d = eqx.nn.MLP(2, 1, 4, 1, activation=lambda x: x, key=getkey())
    with pytest.raises(ValueError, match=r"`\.activation`.*same function object"):
        ee.stack([c, d])


def test_stack_error_non_array_values_and_containers():
    with pytest.raises(
        ValueError, match=r"leaf `\.p` differs: float 0\.1 vs float 0\.2"
    ):
        ee.stack([eqx.nn.Dropout(0.1), eqx.nn.Dropout(0.2)])
    with pytest.raises(
        ValueError, match=r"node `<root>` has children .*'a'.* vs .*'b'"
    ):
        ee.stack([{"a": jnp.ones(1)}, {"b": jnp.ones(1)}])
    with pytest.raises(ValueError, match="differs in type: list vs tuple"):
        ee.stack([[jnp.ones(1)], (jnp.ones(1),)])


def test_stack_error_empty_and_wrong_type(getkey):
    with pytest.raises(ValueError, match="empty list"):
        ee.stack([])
    ens = ee.ensemble(lambda k: eqx.nn.Linear(2, 2, key=k), size=2, key=getkey())
    # beartype (the jaxtyping hook) may reject the call before the library does.
    with pytest.raises(TypeError, match="of models, got Ensemble|Type-check error"):
        ee.stack(ens)
    with pytest.raises(
        TypeError, match="takes an `ee.Ensemble`, got list|Type-check error"
    ):
        ee.unstack([ens[0]])


def test_stack_same_models_round_trip_with_assert_helper(getkey):
    models = [eqx.nn.Conv1d(2, 3, 3, key=getkey()) for _ in range(3)]
    assert_tree_allclose(ee.unstack(ee.stack(models)), models, rtol=0, atol=0)


# ------------------------------------------ many members, 64-bit and wide leaves


def _ensemble(size, seed=0):
    return ee.ensemble(
        lambda k: eqx.nn.MLP(3, 2, 4, 1, key=k), size=size, key=jax.random.key(seed)
    )


def _widest_equation(jaxpr):
    """The most inputs and outputs of any one operation of a jaxpr (nested calls
    included): the size of the programs XLA is asked to compile."""
    widest = (0, 0)
    for equation in jaxpr.eqns:
        widest = max(widest, (len(equation.invars), len(equation.outvars)))
        for sub in inner_jaxprs(equation.params):
            widest = max(widest, _widest_equation(sub))
    return widest


def test_unstack_and_stack_programs_do_not_grow_with_the_member_count():
    ens = _ensemble(300)
    leaves = len(jax.tree.leaves(eqx.filter(ens, eqx.is_array)))
    dynamic, static = eqx.partition(ens, eqx.is_array)
    unstack_jaxpr = jax.make_jaxpr(
        lambda d: eqx.filter(ee.unstack(eqx.combine(d, static)), eqx.is_array)
    )(dynamic)
    # No operation with an output per member (300 here): the compilation of
    # such a program grows with the member count (512 members: 26 s; 4096: 8 min).
    assert _widest_equation(unstack_jaxpr.jaxpr)[1] <= leaves
    models = ee.unstack(ens)
    model_dynamic = [eqx.filter(m, eqx.is_array) for m in models]
    stack_jaxpr = jax.make_jaxpr(
        lambda ms: eqx.filter(
            ee.stack(
                [
                    eqx.combine(m, eqx.filter(models[0], eqx.is_array, inverse=True))
                    for m in ms
                ]
            ),
            eqx.is_array,
        )
    )(model_dynamic)
    # Not a stack with an input per model (4096 models: 133 s to compile):
    # blocks of 64 models, a few leaves per call, at most 256 inputs.
    assert _widest_equation(stack_jaxpr.jaxpr)[0] <= 256
    assert tree_equal(ee.stack(models), ens)
    assert tree_equal(models[123], ens[123])


def test_stack_says_when_it_narrows_64_bit_leaves():
    models = [(np.ones(3, np.float64), np.arange(2, dtype=np.int64)) for _ in range(2)]
    with pytest.warns(UserWarning, match=r"leaf `\[0\]` is float64; .* float32"):
        ens = ee.stack(models)
    assert ens.members[0].dtype == jnp.float32
    # 32-bit leaves: nothing to say.
    ee.stack([(np.ones(3, np.float32),) for _ in range(2)])


def test_stack_refuses_integers_that_would_wrap():
    assert not jax.config.jax_enable_x64
    fine = [{"w": np.ones(2, np.float32), "n": np.array([7], np.int64)}] * 2
    with pytest.warns(UserWarning, match="stores it as int32"):
        assert int(ee.stack(fine).members["n"][1, 0]) == 7
    big = [
        {"w": np.ones(2, np.float32), "n": np.array([7], np.int64)},
        {"w": np.ones(2, np.float32), "n": np.array([3_000_000_000], np.int64)},
    ]
    with pytest.raises(ValueError, match=r"leaf `\['n'\]` of model 1.*3000000000"):
        ee.stack(big)
