"""`ee.recompute_batch_stats`: BatchNorm statistics of the current weights,
against NumPy means and variances of each member's features over the data."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import tree_equal

import eqx_ensemble as ee


@pytest.mark.parametrize("mode", ["ema", "batch"])
def test_statistics_are_the_batch_averages_of_each_members_features(getkey, mode):
    def make(key):
        return eqx.nn.make_with_state(eqx.nn.Sequential)(
            [
                eqx.nn.Linear(3, 4, key=key),
                eqx.nn.BatchNorm(4, axis_name="batch", mode=mode, momentum=0.9),
            ]
        )

    ens, state = ee.ensemble(make, size=3, key=getkey())
    x = jax.random.normal(getkey(), (100, 3)) * 2 + 1
    new_state = ee.recompute_batch_stats(ens, state, x, batch_size=25)
    for i in range(3):
        linear = ens[i].layers[0]
        features = np.asarray(jax.vmap(linear)(x))
        batches = features.reshape(4, 25, 4)
        mean = batches.mean(1).mean(0)
        var = batches.var(1).mean(0)
        # What inference now uses: normalise with exactly these statistics.
        model = eqx.nn.inference_mode(ens[i])
        member_state = jax.tree.map(lambda s: s[i], new_state)
        out, _ = jax.vmap(model, in_axes=(0, None), out_axes=(0, None))(x, member_state)
        bn = ens[i].layers[1]
        expected = (features - mean) / np.sqrt(var + bn.eps) * np.asarray(
            bn.weight
        ) + np.asarray(bn.bias)
        np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-5)


def test_recomputed_for_swa_weights_after_fit(getkey):
    def make(key):
        return eqx.nn.make_with_state(eqx.nn.Sequential)(
            [
                eqx.nn.Linear(2, 8, key=key),
                eqx.nn.BatchNorm(8, axis_name="batch", mode="batch"),
                eqx.nn.Lambda(jax.nn.relu),
                eqx.nn.Linear(8, 1, key=jax.random.fold_in(key, 1)),
            ]
        )

    def loss(model, state, batch, key):
        xs, ys = batch
        out, state = jax.vmap(
            model, axis_name="batch", in_axes=(0, None), out_axes=(0, None)
        )(xs, state)
        return jnp.mean((out[:, 0] - ys) ** 2), state

    ens, state = ee.ensemble(make, size=2, key=getkey())
    x = jax.random.normal(getkey(), (64, 2))
    result = ee.fit(
        ens,
        loss,
        optax.adam(1e-2),
        (x, x.sum(1)),
        steps=30,
        batch_size=16,
        key=getkey(),
        state=state,
        track=[ee.SWA(start=10)],
        callbacks=(),
    )
    fresh = ee.recompute_batch_stats(result.tracked[0], result.state, x, batch_size=16)
    assert jax.tree.structure(fresh) == jax.tree.structure(result.state)
    assert not tree_equal(fresh, result.state)
    with pytest.raises(ValueError, match="no `eqx.nn.BatchNorm`"):
        plain = ee.ensemble(lambda k: eqx.nn.Linear(2, 1, key=k), size=2, key=getkey())
        ee.recompute_batch_stats(plain, None, x, batch_size=8)
