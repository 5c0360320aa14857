"""`ee.test_time_augmentation`: the augmentations as members of one
ensemble, against a hand-written loop over the passes' keys."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqx_ensemble as ee


def _shift(key, x):
    return jnp.roll(x, jax.random.randint(key, (), -2, 3))


def _model(key=0):
    return eqx.nn.MLP(8, 3, 16, 1, key=jax.random.key(key))


def test_passes_are_the_hand_written_loop_over_keys():
    model = _model()
    x = jax.random.normal(jax.random.key(2), (5, 8))
    passes = ee.test_time_augmentation(model, _shift, passes=6, key=jax.random.key(1))
    got = ee.predict(passes, x)
    keys = jax.random.split(jax.random.key(1), 6)
    want = np.stack([[model(_shift(k, xi)) for xi in x] for k in keys])
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)
    # The model is held once (the shared part); members hold their keys only.
    member_arrays = [
        leaf for leaf in jax.tree.leaves(passes.members) if eqx.is_array(leaf)
    ]
    assert len(member_arrays) == 1 and member_arrays[0].shape[0] == 6
    # One augmentation per pass: a pass shifts every example alike.
    one = passes[0]
    assert jnp.allclose(one(x[0]), model(_shift(keys[0], x[0])))


def test_an_ensemble_of_members_times_passes_composes_with_the_metrics():
    members = [_model(i) for i in range(2)]
    x = jax.random.normal(jax.random.key(3), (4, 8))
    # Each member's passes share its weights: one group each.
    tta = ee.Heterogeneous(
        [ee.test_time_augmentation(m, _shift, passes=3, key=jax.random.key(i))
         for i, m in enumerate(members)]
    )  # fmt: skip
    logits = ee.predict(tta, x)
    assert logits.shape == (6, 4, 3)
    for i, model in enumerate(members):
        for j, k in enumerate(jax.random.split(jax.random.key(i), 3)):
            want = jax.vmap(lambda xi, k=k, model=model: model(_shift(k, xi)))(x)
            np.testing.assert_allclose(logits[3 * i + j], want, rtol=1e-5, atol=1e-6)
    mi = ee.metrics.mutual_information(logits, from_logits=True)
    assert mi.shape == (4,) and bool((mi >= -1e-6).all())


def test_bad_inputs_are_refused_by_name():
    model = _model()
    with pytest.raises(ValueError, match="passes"):
        ee.test_time_augmentation(model, _shift, passes=0, key=jax.random.key(0))
    ens = ee.ensemble(lambda k: _model(), size=2, key=jax.random.key(0))
    with pytest.raises(TypeError, match="ONE model"):
        ee.test_time_augmentation(ens, _shift, passes=2, key=jax.random.key(0))
    with pytest.raises(TypeError, match="augment"):
        ee.test_time_augmentation(model, "flip", passes=2, key=jax.random.key(0))
