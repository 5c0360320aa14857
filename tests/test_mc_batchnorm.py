"""`ee.mc_batchnorm` (Teye et al. 2018): each member's predictions are those
of the model normalising with its own random training batch's statistics,
computed here with Equinox's BatchNorm itself; the weights are held once."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqx_ensemble as ee

SAMPLES, BATCH = 6, 32


def make(mode):
    return eqx.nn.make_with_state(eqx.nn.Sequential)(
        [
            eqx.nn.Linear(3, 16, key=jax.random.key(0)),
            eqx.nn.BatchNorm(16, axis_name="batch", mode=mode),
            eqx.nn.Lambda(jax.nn.relu),
            eqx.nn.Linear(16, 8, key=jax.random.key(1)),
            eqx.nn.BatchNorm(8, axis_name="batch", mode=mode),
            eqx.nn.Linear(8, 2, key=jax.random.key(2)),
        ]
    )


X = 2 * jax.random.normal(jax.random.key(3), (200, 3)) + 1


def by_hand(model, state, key, x_test):
    """Member t: Equinox's BatchNorm run in training mode on the t-th batch
    from zeroed statistics, then in inference mode on the test inputs."""
    layers = [layer for layer in model.layers if isinstance(layer, eqx.nn.BatchNorm)]
    state = jax.tree.unflatten(*reversed(jax.tree.flatten(state)))  # a clone
    for bn in layers:  # a reset state: no running statistics, no step yet
        if bn.mode == "ema":
            mean, var = state.get(bn.ema_state_index)
            state = state.set(bn.ema_state_index, (0 * mean, 0 * var))
            state = state.set(bn.ema_first_time_index, jnp.array(True))
        else:
            mean, var = state.get(bn.batch_state_index)
            state = state.set(bn.batch_state_index, (0 * mean, 0 * var))
            state = state.set(bn.batch_counter, 0 * state.get(bn.batch_counter))
    outputs = []
    for sample_key in jax.random.split(key, SAMPLES):
        rows = jax.random.choice(sample_key, len(X), (BATCH,), replace=False)
        batched = jax.vmap(
            model, axis_name="batch", in_axes=(0, None), out_axes=(0, None)
        )
        fresh = jax.tree.unflatten(*reversed(jax.tree.flatten(state)))  # a clone
        _, trained_state = batched(X[rows], fresh)
        inference = eqx.nn.inference_mode(model)
        outputs.append(jax.vmap(lambda x: inference(x, trained_state)[0])(x_test))
    return jnp.stack(outputs)


@pytest.mark.parametrize("mode", ["ema", "batch"])
def test_each_member_normalises_with_its_own_training_batch(mode):
    model, state = make(mode)
    # A trained state (running statistics of other data): they play no part.
    batched = jax.vmap(model, axis_name="batch", in_axes=(0, None), out_axes=(0, None))
    _, state = batched(3 * X[:50] - 2, state)
    key = jax.random.key(4)
    passes, passes_state = ee.mc_batchnorm(
        model, state, X, samples=SAMPLES, batch_size=BATCH, key=key
    )
    x_test = jax.random.normal(jax.random.key(5), (7, 3))
    got = ee.predict(passes, x_test, state=passes_state)
    assert got.shape == (SAMPLES, 7, 2)
    np.testing.assert_allclose(got, by_hand(model, state, key, x_test), atol=2e-5)
    assert float(got.std(0).mean()) > 1e-3  # the batches differ
    # The weights are held once: the members hold only the statistics.
    member_sizes = [leaf.size for leaf in jax.tree.leaves(passes.members)]
    assert sum(member_sizes) == SAMPLES * 2 * (16 + 8)
    # An inference-mode model (as after training) gives the same members.
    again, _ = ee.mc_batchnorm(eqx.nn.inference_mode(model), state, X,
                               samples=SAMPLES, batch_size=BATCH, key=key)  # fmt: skip
    np.testing.assert_array_equal(ee.predict(again, x_test, state=passes_state), got)


def test_the_whole_data_as_one_batch_gives_recomputed_statistics():
    """With every example in each batch, every member holds the statistics of
    the whole data: `ee.recompute_batch_stats`'s with one batch."""
    model, state = make("batch")
    passes, passes_state = ee.mc_batchnorm(
        model, state, X, samples=3, batch_size=len(X), key=jax.random.key(0)
    )
    x_test = jax.random.normal(jax.random.key(5), (7, 3))
    got = ee.predict(passes, x_test, state=passes_state)
    one = ee.ensemble(lambda k: make("batch"), size=1, key=jax.random.key(0))
    recomputed = ee.recompute_batch_stats(*one, X, batch_size=len(X))
    expected = ee.predict(one[0], x_test, state=recomputed)[0]
    for member in got:
        np.testing.assert_allclose(member, expected, atol=2e-5)


def test_bad_input_is_refused():
    model, state = make("batch")
    plain = eqx.nn.Linear(3, 2, key=jax.random.key(0))
    with pytest.raises(ValueError, match="BatchNorm"):
        ee.mc_batchnorm(plain, state, X, samples=2, batch_size=8, key=jax.random.key(0))
    with pytest.raises(ValueError, match="larger than the data"):
        ee.mc_batchnorm(model, state, X, samples=2, batch_size=500,
                        key=jax.random.key(0))  # fmt: skip
    with pytest.raises((TypeError, ValueError), match="samples"):
        ee.mc_batchnorm(model, state, X, samples=0, batch_size=8, key=jax.random.key(0))
    ens, ens_state = ee.ensemble(lambda k: make("batch"), size=2, key=jax.random.key(0))
    with pytest.raises(TypeError, match="ONE model"):
        ee.mc_batchnorm(ens, ens_state, X, samples=2, batch_size=8,
                        key=jax.random.key(0))  # fmt: skip
    # A NaN row would reach every batch that draws it: NaN members, refused.
    bad = np.asarray(X).copy()
    bad[7, 1] = np.nan
    with pytest.raises(ValueError, match="example 7"):
        ee.mc_batchnorm(model, state, bad, samples=2, batch_size=8,
                        key=jax.random.key(0))  # fmt: skip
    with pytest.raises(TypeError, match="eqx.nn.State"):
        ee.mc_batchnorm(model, None, X, samples=2, batch_size=8,
                        key=jax.random.key(0))  # fmt: skip
