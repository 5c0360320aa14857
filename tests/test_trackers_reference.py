"""Every tracker against a reference computed by hand (NumPy) from the weights the
same run reached after each step (recorded with a callback, one step per
dispatch), with independent, bootstrap and streamed data."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import eqx_ensemble as ee

SIZE, STEPS = 3, 12
X = jax.random.normal(jax.random.key(0), (48, 2))
Y = jnp.sin(X[:, 0]) + X[:, 1]


def loss_fn(model, batch, key):
    x, y = batch
    return jnp.mean((jax.vmap(model)(x)[:, 0] - y) ** 2)


def stream(start):
    rng = np.random.default_rng(start)
    for _ in range(STEPS - start):
        rows = rng.integers(0, 48, (SIZE, 8))
        yield np.asarray(X)[rows], np.asarray(Y)[rows]


@pytest.mark.parametrize("data", ["independent", "bootstrap", "stream"])
def test_trackers_equal_numpy_over_the_runs_own_weights(getkey, data):
    ens = ee.ensemble(lambda k: eqx.nn.MLP(2, 1, 8, 1, key=k), size=SIZE, key=getkey())
    trajectory = [np.asarray(ens.members.layers[0].weight)]
    track = [
        ee.EMA(0.8),
        ee.SWA(start=4, every=3),
        ee.SWAG(start=4, every=2, rank=3),
        ee.Snapshots(at=(5, 9, 12)),
    ]

    def record(result):
        trajectory.append(np.asarray(result.ensemble.members.layers[0].weight))

    if data == "stream":
        inputs, extra = stream, dict(sampling=ee.Independent())
    else:
        sampling = ee.Independent() if data == "independent" else ee.Bootstrap()
        inputs, extra = (X, Y), dict(sampling=sampling, batch_size=8)
    result = ee.fit(
        ens,
        loss_fn,
        optax.sgd(0.1),
        inputs,
        steps=STEPS,
        key=getkey(),
        track=track,
        **extra,
        callbacks=[record],
        execution=ee.Execution(steps_per_dispatch=1),
    )
    assert len(trajectory) == STEPS + 1
    w = np.stack(trajectory)  # (steps + 1, members, ...): w[t] after t steps
    ema = w[0]
    for t in range(1, STEPS + 1):
        ema = 0.8 * ema + 0.2 * w[t]
    ema_result, swa, swag, snapshots = result.tracked
    np.testing.assert_allclose(
        ema_result.members.layers[0].weight, ema, rtol=1e-5, atol=1e-6
    )
    np.testing.assert_allclose(
        swa.members.layers[0].weight, w[[4, 7, 10]].mean(0), rtol=1e-5, atol=1e-6
    )
    collected = w[[4, 6, 8, 10, 12]]
    np.testing.assert_allclose(
        swag.mean.members.layers[0].weight, collected.mean(0), rtol=1e-5, atol=1e-6
    )
    np.testing.assert_allclose(
        swag.variance.layers[0].weight,
        np.maximum((collected**2).mean(0) - collected.mean(0) ** 2, 0),
        atol=1e-5,
    )
    got = np.asarray(snapshots.members.layers[0].weight).reshape(SIZE, 3, 8, 2)
    np.testing.assert_allclose(got, np.moveaxis(w[[5, 9, 12]], 0, 1), rtol=1e-6)
