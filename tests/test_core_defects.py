"""Defects of the core found by the adversarial review (issue 13): stacking and
unstacking many members, chunked `map`, empty indices, errors raised inside a
member. Each test failed on the code before the fix."""

import equinox as eqx
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tree_equal

import eqx_ensemble as ee


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
        for sub in jax.extend.core.jaxprs_in_params(equation.params):
            widest = max(widest, _widest_equation(sub))
    return widest


def test_unstack_and_stack_programs_do_not_grow_with_the_member_count():
    ens = _ensemble(300)
    leaves = len(jax.tree.leaves(eqx.filter(ens, eqx.is_array)))
    dynamic, static = eqx.partition(ens, eqx.is_array)
    unstack_jaxpr = jax.make_jaxpr(
        lambda d: eqx.filter(ee.unstack(eqx.combine(d, static)), eqx.is_array)
    )(dynamic)
    # Before the fix: one operation with an output per member (300 here), whose
    # compilation grew with the member count (512 members: 26 s; 4096: 8 min).
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
    # Before the fix: a stack with an input per model (4096 models: 133 s).
    # Now blocks of 64 models, a few leaves per call: at most 256 inputs.
    assert _widest_equation(stack_jaxpr.jaxpr)[0] <= 256
    assert tree_equal(ee.stack(models), ens)
    assert tree_equal(models[123], ens[123])


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
    # members (before the fix: the first 12 members sliced and reshaped into
    # (chunks, chunk, ...), a copy of the ensemble that doubled peak memory).
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


@pytest.mark.parametrize("index", [[], np.array([], dtype=np.int32)])
def test_empty_index_is_named(index):
    ens = _ensemble(3)
    with pytest.raises((IndexError, ValueError), match="at least one member|empty"):
        ens[index]


def test_calling_an_ensemble_on_a_batch_explains_members_take_one_example():
    ens = _ensemble(3)
    with pytest.raises(Exception, match="ONE example") as info:
        ens(jnp.ones((8, 3)))
    assert "dot_general" in str(info.value) or info.value.__cause__ is not None


def test_forgetting_vmap_in_map_explains_members_take_one_example():
    ens = _ensemble(3)
    with pytest.raises(Exception, match="ONE example"):
        ee.map(lambda m, x: m(x), ens, jnp.ones((8, 3)))


@pytest.mark.parametrize("size", [2**31, 2**40])
def test_impossible_ensemble_size_is_refused_before_xla(size):
    # Before the fix, 2**40 members aborted the process inside XLA.
    with pytest.raises(ValueError, match="members"):
        ee.ensemble(
            lambda k: eqx.nn.Linear(1, 1, key=k), size=size, key=jax.random.key(0)
        )


def test_stack_says_when_it_narrows_64_bit_leaves():
    models = [(np.ones(3, np.float64), np.arange(2, dtype=np.int64)) for _ in range(2)]
    with pytest.warns(UserWarning, match=r"leaf `\[0\]` is float64; .* float32"):
        ens = ee.stack(models)
    assert ens.members[0].dtype == jnp.float32
    # 32-bit leaves: nothing to say.
    ee.stack([(np.ones(3, np.float32),) for _ in range(2)])


# --- The member and example counts take a path-free fast route; their errors
# still name the leaves (the route with paths runs only on bad input).


def test_member_count_errors_name_the_leaves_and_shapes():
    good = {"a": jnp.zeros((3, 2)), "b": jnp.zeros((3,))}
    assert len(ee.Ensemble(good)) == 3
    with pytest.raises(ValueError, match=r"leaf `\['a'\]` has shape \(3, 2\).*"
                       r"leaf `\['b'\]` has shape \(4,\)"):  # fmt: skip
        ee.Ensemble({"a": jnp.zeros((3, 2)), "b": jnp.zeros((4,))})
    with pytest.raises(ValueError, match=r"leaf `\['b'\]` is a scalar"):
        ee.Ensemble({"b": jnp.zeros(()), "c": jnp.zeros((3,))})
    with pytest.raises(ValueError, match=r"`\['c'\]` has shape \(\)"):
        ee.Ensemble({"b": jnp.zeros((3,)), "c": jnp.zeros(())})
    with pytest.raises(ValueError, match="no array leaves"):
        ee.Ensemble({"f": jax.nn.relu})


def test_example_count_errors_name_the_leaves():
    from eqx_ensemble._core.data import num_examples

    assert num_examples((np.zeros((5, 2)), jnp.zeros((5,)))) == 5
    with pytest.raises(ValueError, match=r"`\[0\]`: 5, `\[1\]`: 4"):
        num_examples((np.zeros((5, 2)), jnp.zeros((4,))))
    with pytest.raises(ValueError, match=r"leaf `\[1\]` is a scalar"):
        num_examples((np.zeros((5, 2)), jnp.zeros(())))
    with pytest.raises(ValueError, match="0 examples"):
        num_examples((np.zeros((0, 2)),))
