"""`first_difference`'s one-flatten fast path (`_internal.tree._same`) agrees
with the node-by-node walk that names a difference, on pairs that differ in
each way the walk knows and on equal pairs."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqx_ensemble._internal import tree

KEY = jax.random.key(0)
MLP = eqx.nn.MLP(2, 1, 4, 1, key=KEY)

PAIRS = {
    "equal": (MLP, eqx.nn.MLP(2, 1, 4, 1, key=jax.random.key(1)), None),
    "a shape": (MLP, eqx.nn.MLP(2, 1, 5, 1, key=KEY), "differs"),
    "a dtype": ({"a": jnp.ones(2)}, {"a": jnp.ones(2, jnp.int32)}, "differs"),
    "a static field": (
        MLP,
        eqx.nn.MLP(2, 1, 4, 1, activation=jax.nn.tanh, key=KEY),
        "activation",
    ),
    "an int against a float": ({"a": 1}, {"a": 1.0}, "type"),
    "a number": ({"a": 1.0}, {"a": 2.0}, "differs"),
    "an array against a number": ({"a": jnp.ones(())}, {"a": 1.0}, "differs"),
    "children": ({"a": 1, "b": 2}, {"a": 1, "c": 2}, "children"),
    "numpy and jax arrays": ((np.ones(3, np.float32),), (jnp.ones(3),), None),
}


@pytest.mark.parametrize("name", list(PAIRS))
def test_the_fast_path_agrees_with_the_walk(name):
    a, b, found = PAIRS[name]
    walked = tree._first_difference(a, b, (), False, False)
    assert tree._same(a, b, False, False) == (walked is None)
    got = tree.first_difference(a, b)
    if found is None:
        assert got is None
    else:
        assert got is not None and found in got, got


def test_the_leading_axis_and_numbers_as_data():
    a, b = {"w": jnp.ones((3, 2)), "lr": 0.1}, {"w": jnp.ones((4, 2)), "lr": 0.2}
    assert tree.first_difference(a, b) is not None
    assert tree.first_difference(a, b, ignore_leading_axis=True) is not None  # lr
    assert (
        tree.first_difference(a, b, ignore_leading_axis=True, numbers_are_data=True)
        is None
    )
    assert tree._same(a, b, True, True)
