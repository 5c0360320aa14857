"""`ee.tree_weighted_sum` and `ee.average` against hand computations and NumPy."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tree_equal

import eqx_ensemble as ee


def _array_leaves(tree):
    return jax.tree.leaves(eqx.filter(tree, eqx.is_array))


def test_tree_weighted_sum_arrays_and_scalars():
    a = {"w": jnp.array([1.0, 2.0]), "b": 1.0, "n": 2, "act": jax.nn.relu, "name": "x"}
    b = {"w": jnp.array([3.0, -4.0]), "b": 3.0, "n": 5, "act": jax.nn.relu, "name": "x"}
    c = {"w": jnp.array([0.5, 0.0]), "b": -1.0, "n": 1, "act": jax.nn.relu, "name": "x"}
    weights = [0.2, 0.5, 0.3]
    out = ee.tree_weighted_sum([a, b, c], weights)
    # By hand.
    np.testing.assert_allclose(
        out["w"],
        [0.2 * 1 + 0.5 * 3 + 0.3 * 0.5, 0.2 * 2 - 0.5 * 4 + 0.3 * 0],
        rtol=1e-6,
    )
    np.testing.assert_allclose(out["b"], 0.2 * 1 + 0.5 * 3 - 0.3 * 1, rtol=1e-6)
    np.testing.assert_allclose(out["n"], 0.2 * 2 + 0.5 * 5 + 0.3 * 1, rtol=1e-6)
    assert out["act"] is jax.nn.relu and out["name"] == "x"
    # Weights are used as given (a sum, not a mean).
    doubled = ee.tree_weighted_sum([a, b, c], jnp.asarray(weights) * 2)
    np.testing.assert_allclose(doubled["w"], 2 * out["w"], rtol=1e-6)


def test_tree_weighted_sum_modules(getkey):
    models = [eqx.nn.MLP(3, 2, 4, 1, key=getkey()) for _ in range(4)]
    weights = np.array([0.1, 0.2, 0.3, 0.4], dtype=np.float32)
    out = ee.tree_weighted_sum(models, jnp.asarray(weights))
    assert isinstance(out, eqx.nn.MLP) and out.width_size == 4
    for path_leaves in zip(*[_array_leaves(m) for m in [out, *models]]):
        got, *members = path_leaves
        expected = sum(w * np.asarray(leaf) for w, leaf in zip(weights, members))
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_tree_weighted_sum_integer_leaves_become_float():
    out = ee.tree_weighted_sum(
        [jnp.array([1, 2], dtype=jnp.int32), jnp.array([3, 5], dtype=jnp.int32)],
        [0.5, 0.25],
    )
    assert jnp.issubdtype(out.dtype, jnp.floating)
    np.testing.assert_allclose(out, [0.5 * 1 + 0.25 * 3, 0.5 * 2 + 0.25 * 5])


def test_tree_weighted_sum_errors():
    a = {"w": jnp.ones(2)}
    with pytest.raises(ValueError, match="empty list"):
        ee.tree_weighted_sum([], [])
    with pytest.raises(ValueError, match=r"got 2 trees and weights of shape \(3,\)"):
        ee.tree_weighted_sum([a, a], [1.0, 1.0, 1.0])
    with pytest.raises(
        ValueError, match=r"tree 0 and tree 1 differ.*\['w'\].*\(2,\).*\(3,\)"
    ):
        ee.tree_weighted_sum([a, {"w": jnp.ones(3)}], [0.5, 0.5])
    with pytest.raises(ValueError, match=r"`\['f'\]` differs.*relu.*tanh"):
        ee.tree_weighted_sum([{"f": jax.nn.relu}, {"f": jax.nn.tanh}], [0.5, 0.5])


@pytest.fixture
def ens(getkey):
    return ee.ensemble(lambda k: eqx.nn.MLP(3, 2, 4, 2, key=k), size=5, key=getkey())


def _stacked_leaves(ens):
    return [np.asarray(leaf) for leaf in _array_leaves(ens.members)]


def test_average_uniform(ens):
    soup = ee.average(ens)
    assert isinstance(soup, eqx.nn.MLP)
    assert soup.width_size == 4 and soup.activation is ens.members.activation
    for got, stacked in zip(_array_leaves(soup), _stacked_leaves(ens), strict=True):
        np.testing.assert_allclose(got, stacked.mean(axis=0), rtol=1e-5, atol=1e-6)
    # The soup is a working model.
    assert soup(jnp.ones(3)).shape == (2,)


def test_average_weighted(ens):
    weights = np.array([0.0, 1.0, 2.0, 0.5, 0.5], dtype=np.float32)
    soup = ee.average(ens, jnp.asarray(weights))
    for got, stacked in zip(_array_leaves(soup), _stacked_leaves(ens), strict=True):
        np.testing.assert_allclose(
            got, np.average(stacked, axis=0, weights=weights), rtol=1e-5, atol=1e-6
        )
    # A one-hot weight gives that member back.
    picked = ee.average(ens, jnp.eye(5)[3])
    assert bool(tree_equal(picked, ens[3], rtol=1e-6, atol=1e-7))


def test_average_traced_weights(ens):
    weights = jnp.array([1.0, 2.0, 3.0, 4.0, 5.0])
    soup = eqx.filter_jit(ee.average)(ens, weights)
    assert bool(tree_equal(soup, ee.average(ens, weights), rtol=1e-6, atol=1e-7))


def test_average_integer_leaves():
    members = {
        "w": jnp.arange(6.0).reshape(3, 2),
        "steps": jnp.array([7, 7, 7], dtype=jnp.int32),
        "mask": jnp.array([[True, False]] * 3),
    }
    soup = ee.average(ee.Ensemble(members))
    np.testing.assert_allclose(soup["w"], [2.0, 3.0])
    assert soup["steps"].dtype == jnp.int32 and int(soup["steps"]) == 7
    np.testing.assert_array_equal(soup["mask"], [True, False])
    differing = dict(members, steps=jnp.array([7, 8, 7], dtype=jnp.int32))
    with pytest.raises(ValueError, match=r"integer/boolean leaf .*int32, shape \(3,\)"):
        ee.average(ee.Ensemble(differing))


def test_average_weight_errors(ens):
    with pytest.raises(
        ValueError, match=r"ensemble has 5 members, weights have shape \(4,\)"
    ):
        ee.average(ens, jnp.ones(4))
    with pytest.raises(ValueError, match="non-negative with a positive sum"):
        ee.average(ens, jnp.array([1.0, -1.0, 1.0, 1.0, 1.0]))
    with pytest.raises(ValueError, match="non-negative with a positive sum"):
        ee.average(ens, jnp.zeros(5))
    with pytest.raises(TypeError, match="takes an `ee.Ensemble`|Type-check error"):
        ee.average(ee.unstack(ens))


def test_weights_as_lists_and_integers(ens):
    # Regression: a Python list (or integer counts) of weights failed the type check.
    counts = [1, 0, 2, 0, 1]
    expected = ee.average(ens, jnp.asarray(counts, dtype=jnp.float32))
    for weights in (counts, [float(c) for c in counts], jnp.asarray(counts)):
        got = ee.average(ens, weights)
        assert bool(tree_equal(got, expected, rtol=1e-6, atol=1e-7))
    a, b = {"w": jnp.array([1.0, 2.0])}, {"w": jnp.array([3.0, 5.0])}
    for weights in ([2, -1], jnp.array([2, -1]), [2.0, -1.0]):
        np.testing.assert_allclose(
            ee.tree_weighted_sum([a, b], weights)["w"], [2 - 3, 4 - 5]
        )


# -------------------------------------- weights that overflow or are not numbers


@pytest.fixture(scope="module")
def linear_pair():
    return ee.ensemble(
        lambda k: eqx.nn.Linear(2, 1, key=k), size=2, key=jax.random.key(0)
    )


def test_average_with_large_integer_weights_is_exact(linear_pair):
    big = 2**31 - 1
    soup = ee.average(linear_pair, jnp.array([big, big], dtype=jnp.int32))
    np.testing.assert_allclose(
        soup.weight, linear_pair.members.weight.mean(0), rtol=1e-6
    )


def test_average_with_float16_weights_does_not_overflow(linear_pair):
    soup = ee.average(linear_pair, jnp.array([60000.0, 60000.0], dtype=jnp.float16))
    np.testing.assert_allclose(
        soup.weight, linear_pair.members.weight.mean(0), rtol=1e-6
    )


KEY = jax.random.key(0)
ENS = ee.ensemble(lambda k: eqx.nn.MLP(1, 1, 8, 1, key=k), size=3, key=KEY)


def _unchecked(function):
    # The function without the test run's jaxtyping/beartype hook (its error
    # names the parameter too): what a user without the hook calls.
    return getattr(function, "__wrapped__", function)


@pytest.mark.parametrize("weights", ["abc", ["a", "b", "c"], [1.0, None, 2.0]])
def test_weights_that_are_not_numbers_are_named(weights):
    trees = [{"w": jnp.ones(2)}] * 3
    for call in (
        lambda: _unchecked(ee.average)(ENS, weights),
        lambda: _unchecked(ee.tree_weighted_sum)(trees, weights),
    ):
        with pytest.raises(TypeError, match="`weights` must be real numbers"):
            call()
    with pytest.raises(TypeError, match="weights"):  # with the hook, if any
        ee.average(ENS, weights)
