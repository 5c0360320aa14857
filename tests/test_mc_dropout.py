"""`ee.mc_dropout`: stochastic passes of one model as an ensemble, against the
model called by hand with each pass's key, a closed form for the passes' mean,
and the metrics taking them as members."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tree_equal

import eqx_ensemble as ee


class Net(eqx.Module):
    first: eqx.nn.Linear
    drop: eqx.nn.Dropout
    norm: eqx.nn.LayerNorm
    head: eqx.nn.Linear

    def __init__(self, key, p=0.3):
        k1, k2 = jax.random.split(key)
        self.first = eqx.nn.Linear(3, 16, key=k1)
        self.drop = eqx.nn.Dropout(p)
        self.norm = eqx.nn.LayerNorm(16)
        self.head = eqx.nn.Linear(16, 4, key=k2)

    def __call__(self, x, *, key=None):
        h = self.norm(jax.nn.relu(self.first(x)))
        return self.head(self.drop(h, key=key))


X = jax.random.normal(jax.random.key(0), (10, 3))


def test_each_pass_is_the_model_with_dropout_on_and_its_key():
    model = eqx.nn.inference_mode(Net(jax.random.key(1)))  # as after training
    passes = ee.mc_dropout(model, samples=6, key=jax.random.key(2))
    assert isinstance(passes, ee.Ensemble) and len(passes) == 6
    got = ee.predict(passes, X)
    on = eqx.nn.inference_mode(model, value=False)
    keys = jax.random.split(jax.random.key(2), 6)
    for i in range(6):
        # One mask for every example: a pass is one sampled network.
        expected = jax.vmap(lambda x, k=keys[i]: on(x, key=k))(X)
        np.testing.assert_allclose(got[i], expected, rtol=1e-6, atol=1e-6)
    assert not np.allclose(got[0], got[1])  # different masks
    # `ens(x)` and a pass alone agree with `predict`.
    np.testing.assert_allclose(passes(X[0]), got[:, 0], rtol=1e-6, atol=1e-6)
    assert isinstance(passes[2], ee.DropoutPass)
    np.testing.assert_allclose(passes[2](X[0]), got[2, 0], rtol=1e-6, atol=1e-6)


def test_the_weights_are_held_once():
    model = Net(jax.random.key(1))
    passes = ee.mc_dropout(model, samples=50, key=jax.random.key(2))
    stacked = [leaf for leaf in jax.tree.leaves(passes.members) if eqx.is_array(leaf)]
    assert len(stacked) == 1 and stacked[0].shape == (50,)  # the keys only
    shared = eqx.filter(passes.shared, eqx.is_inexact_array)
    assert tree_equal(shared.model.first, model.first)
    assert tree_equal(shared.model.head, model.head)


def test_the_passes_mean_is_the_deterministic_model_where_it_is_linear():
    # Inverted dropout keeps each unit's expectation: before a linear head, the
    # passes' mean output tends to the model without dropout (closed form),
    # within the Monte Carlo error of 4,000 passes.
    model = Net(jax.random.key(3), p=0.5)
    passes = ee.mc_dropout(model, samples=4000, key=jax.random.key(4))
    outputs = ee.predict(passes, X)
    deterministic = jax.vmap(eqx.nn.inference_mode(model))(X)
    error = np.asarray(outputs).std(0) / np.sqrt(4000)
    assert np.all(np.abs(outputs.mean(0) - deterministic) < 5 * error + 1e-6)


def test_metrics_calibrators_and_per_example_masks_take_the_passes():
    model = Net(jax.random.key(1))
    passes = ee.mc_dropout(model, samples=8, key=jax.random.key(2))
    labels = jnp.arange(10) % 4
    logits = ee.predict(passes, X)
    assert ee.metrics.nll(logits, labels, from_logits=True).shape == ()
    assert ee.metrics.mutual_information(logits, from_logits=True).shape == (10,)
    assert ee.metrics.fit_temperature(logits, labels) > 0
    # With `key=`, each example draws masks of its own: other outputs.
    per_example = ee.predict(passes, X, key=jax.random.key(5))
    assert per_example.shape == logits.shape
    assert not np.allclose(per_example, logits)


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="no|none"):
        ee.mc_dropout(eqx.nn.Linear(2, 2, key=jax.random.key(0)), 4,
                      key=jax.random.key(1))  # fmt: skip
    with pytest.raises(ValueError, match="samples"):
        ee.mc_dropout(Net(jax.random.key(0)), 0, key=jax.random.key(1))
    ens = ee.ensemble(Net, size=2, key=jax.random.key(0))
    with pytest.raises(TypeError, match="ONE model"):
        ee.mc_dropout(ens, 4, key=jax.random.key(1))
    with pytest.raises(TypeError, match="ONE model, got an `Heterogeneous`"):
        ee.mc_dropout(ee.Heterogeneous([ens, ens]), 4, key=jax.random.key(1))
