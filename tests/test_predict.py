"""`ee.predict` equals the hand-written `vmap` with the right `in_axes`."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_tree_allclose

import eqx_ensemble as ee


class DropoutMLP(eqx.Module):
    linear: eqx.nn.Linear
    dropout: eqx.nn.Dropout

    def __init__(self, key):
        self.linear = eqx.nn.Linear(3, 2, key=key)
        self.dropout = eqx.nn.Dropout(0.5)

    def __call__(self, x, *, key=None):
        return self.dropout(self.linear(x), key=key)


class BatchNormNet(eqx.Module):
    linear: eqx.nn.Linear
    norm: eqx.nn.BatchNorm

    def __init__(self, key):
        self.linear = eqx.nn.Linear(3, 4, key=key)
        self.norm = eqx.nn.BatchNorm(4, axis_name="batch", mode="batch")

    def __call__(self, x, state):
        return self.norm(self.linear(x), state)


X = jax.random.normal(jax.random.key(1), (10, 3))


@pytest.mark.parametrize("chunk_size", [None, 1, 2, 4])
def test_predict_equals_vmap_of_members(chunk_size):
    ens = ee.ensemble(
        lambda k: eqx.nn.MLP(3, 2, 8, 1, key=k), size=4, key=jax.random.key(0)
    )
    got = ee.predict(ens, X, chunk_size=chunk_size)
    expected = jnp.stack([jax.vmap(model)(X) for model in ee.unstack(ens)])
    assert got.shape == (4, 10, 2)
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)


def test_predict_is_in_inference_mode():
    ens = ee.ensemble(DropoutMLP, size=3, key=jax.random.key(0))
    got = ee.predict(ens, X, key=jax.random.key(5))
    expected = jnp.stack([jax.vmap(model.linear)(X) for model in ee.unstack(ens)])
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("chunk_size", [None, 2])
def test_predict_with_per_member_state(chunk_size):
    ens, state = ee.ensemble(
        eqx.nn.make_with_state(BatchNormNet), size=3, key=jax.random.key(0)
    )

    # Give every member its own running statistics: one training step each.
    def batch_stats(model, member_state, x):
        _, new_state = jax.vmap(
            model, axis_name="batch", in_axes=(0, None), out_axes=(0, None)
        )(x, member_state)
        return new_state

    state = ee.map(
        batch_stats,
        ens,
        state,
        X[None] * jnp.arange(1.0, 4.0)[:, None, None],
        in_axes=(0, 0),
    )
    got = ee.predict(ens, X, state=state, chunk_size=chunk_size)
    inference = eqx.nn.inference_mode(ens)
    expected = []
    for i in range(3):
        member_state = jax.tree.map(lambda s: s[i], state)
        out, _ = jax.vmap(
            inference[i], axis_name="batch", in_axes=(0, None), out_axes=(0, None)
        )(X, member_state)
        expected.append(out)
    assert_tree_allclose(got, jnp.stack(expected), rtol=1e-5, atol=1e-6)


def test_predict_pytree_inputs():
    class TwoInputs(eqx.Module):
        linear: eqx.nn.Linear

        def __init__(self, key):
            self.linear = eqx.nn.Linear(5, 1, key=key)

        def __call__(self, inputs):
            a, b = inputs
            return self.linear(jnp.concatenate([a, b]))

    ens = ee.ensemble(TwoInputs, size=2, key=jax.random.key(0))
    a, b = X, X[:, :2]
    got = ee.predict(ens, (a, b))
    expected = jnp.stack([jax.vmap(m)((a, b)) for m in ee.unstack(ens)])
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)


def test_predict_bad_inputs():
    ens = ee.ensemble(
        lambda k: eqx.nn.Linear(3, 1, key=k), size=2, key=jax.random.key(0)
    )
    with pytest.raises((TypeError, ValueError), match="`x`|Ensemble|predict"):
        ee.predict(ens, jnp.ones(()))
    with pytest.raises(TypeError, match="Ensemble"):
        ee.predict(ens[0], X)  # type: ignore[arg-type]
    _, state = ee.ensemble(
        eqx.nn.make_with_state(BatchNormNet), size=3, key=jax.random.key(0)
    )
    with pytest.raises(ValueError, match="`state`.*ensemble size 2"):
        ee.predict(ens, X, state=state)


class _Checked(eqx.Module):
    """A member that checks its input at run time, with a field whose value
    cannot be hashed (a plain dataclass: equality, no hash)."""

    linear: eqx.nn.Linear
    settings: object = eqx.field(static=True)

    def __call__(self, x):
        x = eqx.error_if(x, jnp.any(x < 0), "negative input")
        return self.linear(x)


def test_predict_keeps_the_members_errors_and_any_static_field():
    import dataclasses

    @dataclasses.dataclass
    class Settings:  # eq=True: unhashable
        scale: float = 1.0

    hashable = ee.ensemble(
        lambda k: _Checked(eqx.nn.Linear(3, 2, key=k), None),
        size=2,
        key=jax.random.key(0),
    )
    x = jnp.ones((4, 3))
    # A member's run-time check fails as the member raised it, with the note
    # that names the example (the compiled program is run op by op again).
    with pytest.raises(eqx.EquinoxRuntimeError, match="negative input") as error:
        ee.predict(hashable, -x)
    assert any("ONE example" in note for note in error.value.__notes__)
    # An unhashable static field: predicted op by op, as before.
    unhashable = ee.ensemble(
        lambda k: _Checked(eqx.nn.Linear(3, 2, key=k), Settings()),
        size=2,
        key=jax.random.key(0),
    )
    expected = jnp.stack([jax.vmap(hashable[i])(x) for i in range(2)])
    np.testing.assert_allclose(ee.predict(unhashable, x), expected, rtol=1e-6)
    np.testing.assert_allclose(ee.predict(hashable, x), expected, rtol=1e-6)


SIZE = 3


def make_mlp(key):
    return eqx.nn.MLP(2, 1, 8, 1, key=key)


@pytest.fixture
def ens():
    return ee.ensemble(make_mlp, size=SIZE, key=jax.random.key(0))


@pytest.mark.parametrize("x", [np.ones((5, 3), np.float32), np.ones(2, np.float32)])
def test_predict_on_the_wrong_examples_names_x(ens, x):
    # 3 features for a model of 2; one example of 2 features instead of a batch.
    with pytest.raises((TypeError, ValueError)) as error:
        ee.predict(ens, x)
    notes = " ".join(getattr(error.value, "__notes__", []))
    assert "`ee.predict` on ONE example of `x`" in notes
    assert f"shape {x.shape}" in notes
    assert "jax.vmap(model)" not in notes  # predict already maps over examples
