"""SWAG, MultiSWAG, Snapshots and the cyclic schedules: the trackers' states
against NumPy over the same weight trajectories, sample moments against the
closed form, member independence, bit-exact resume, and errors."""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import tree_equal

import eqx_ensemble as ee

X = jnp.linspace(-1, 1, 16)[:, None]
Y = jnp.sin(3 * X)


def loss_fn(model, batch, key):
    x, y = batch
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


@pytest.fixture
def ens(getkey):
    return ee.ensemble(lambda k: eqx.nn.MLP(1, 1, 6, 1, key=k), size=3, key=getkey())


def trajectory(getkey, steps=12, size=3):
    """Random stacked 'weights' at steps 1..steps, as the loop would pass them."""
    shapes = {"w": (size, 4, 2), "b": (size, 5)}
    return [
        {name: jax.random.normal(getkey(), shape) for name, shape in shapes.items()}
        for _ in range(steps)
    ]


def test_swag_state_matches_numpy(getkey):
    tracker = ee.SWAG(start=3, every=2, rank=3)
    weights = trajectory(getkey)
    state = tracker.init(weights[0])
    for step, w in enumerate(weights, start=1):
        state = tracker.update(state, w, jnp.int32(step))
    collected = [np.asarray(weights[s - 1]["w"]) for s in (3, 5, 7, 9, 11)]
    means, deviations = [], []
    for n in range(1, len(collected) + 1):
        means.append(np.mean(collected[:n], axis=0))
        deviations.append(collected[n - 1] - means[-1])
    np.testing.assert_allclose(state["mean"]["w"], means[-1], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(
        state["square"]["w"], np.mean(np.square(collected), axis=0), rtol=1e-5
    )
    # Ring buffer of the last 3 deviations: collections 4, 5 in slots 0, 1; 3 in 2.
    expected = np.stack([deviations[3], deviations[4], deviations[2]], axis=1)
    np.testing.assert_allclose(state["deviations"]["w"], expected, rtol=1e-5, atol=1e-6)
    assert np.asarray(state["count"]).tolist() == [5, 5, 5]


def test_swag_samples_have_the_closed_form_moments(getkey):
    ens = ee.ensemble(lambda k: eqx.nn.Linear(1, 1, key=k), size=2, key=getkey())
    tracker = ee.SWAG(start=1, every=1, rank=3)
    state = tracker.init(ens.members)
    for step in range(1, 7):
        moved = jax.tree.map(
            lambda w: w + 0.3 * jax.random.normal(getkey(), w.shape), ens.members
        )
        state = tracker.update(state, moved, jnp.int32(step))
    posterior = tracker.result(state, ens)
    draws = posterior.sample(getkey(), samples=20000, scale=0.5)
    assert len(draws) == 2 * 20000
    for member in range(2):
        rows = slice(member * 20000, (member + 1) * 20000)
        flat = np.concatenate(
            [
                np.asarray(draws.members.weight[rows]).reshape(20000, -1),
                np.asarray(draws.members.bias[rows]).reshape(20000, -1),
            ],
            axis=1,
        )
        mean = np.concatenate(
            [
                np.ravel(posterior.mean.members.weight[member]),
                np.ravel(posterior.mean.members.bias[member]),
            ]
        )
        variance = np.concatenate(
            [
                np.ravel(posterior.variance.weight[member]),
                np.ravel(posterior.variance.bias[member]),
            ]
        )
        d = np.concatenate(
            [
                np.asarray(posterior.deviations.weight[member]).reshape(3, -1),
                np.asarray(posterior.deviations.bias[member]).reshape(3, -1),
            ],
            axis=1,
        )
        covariance = 0.5 * (np.diag(variance) / 2 + d.T @ d / (2 * (3 - 1)))
        np.testing.assert_allclose(
            flat.mean(0), mean, atol=4 * math.sqrt(covariance.max() / 20000) + 1e-6
        )
        np.testing.assert_allclose(np.cov(flat.T), covariance, rtol=0.1, atol=1e-3)
    means_only = posterior.sample(getkey(), samples=2, scale=0.0)
    np.testing.assert_allclose(
        means_only.members.weight[::2], posterior.mean.members.weight
    )


def test_swag_in_fit_is_per_member_and_resumes_exactly(ens, getkey, tmp_path):
    common = dict(
        batch_size=16,
        key=jax.random.key(5),
        track=[ee.SWAG(start=4, every=2, rank=2)],
        callbacks=(),
        execution=ee.Execution(steps_per_dispatch=4),
    )
    whole = ee.fit(ens, loss_fn, optax.sgd(0.1), (X, Y), steps=12, **common)
    one = ee.fit(ens[1:2], loss_fn, optax.sgd(0.1), (X, Y), steps=12, **common)
    a, b = whole.tracked[0], one.tracked[0]
    for x, y in [
        (a.mean.members, b.mean.members),
        (a.variance, b.variance),
        (a.deviations, b.deviations),
    ]:
        for u, v in zip(
            jax.tree.leaves(eqx.filter(x, eqx.is_array)),
            jax.tree.leaves(eqx.filter(y, eqx.is_array)),
        ):
            np.testing.assert_allclose(u[1:2], v, rtol=1e-4, atol=1e-6)
    run = ee.Checkpoints(tmp_path, every=5)
    ee.fit(ens, loss_fn, optax.sgd(0.1), (X, Y), steps=7, checkpoints=run, **common)
    resumed = ee.fit(
        ens, loss_fn, optax.sgd(0.1), (X, Y), steps=12, checkpoints=run, **common
    )
    assert tree_equal(resumed.tracked[0], whole.tracked[0])


def test_snapshots_hold_the_weights_at_the_chosen_steps(ens):
    schedule = ee.schedules.cosine_cycles(0.2, cycle_steps=4, cycles=3)
    at = ee.schedules.cycle_ends(4, 3)
    assert at == (4, 8, 12)
    result = ee.fit(
        ens,
        loss_fn,
        optax.sgd(schedule),
        (X, Y),
        steps=12,
        batch_size=16,
        key=jax.random.key(1),
        track=[ee.Snapshots(at=at)],
        callbacks=(),
    )
    # By hand: make_step with full batches, weights kept at steps 4, 8, 12.
    step = ee.make_step(loss_fn, optax.sgd(schedule))
    current, state = ens, ee.init_optimizer(optax.sgd(schedule), ens)
    kept = []
    for count in range(1, 13):
        current, state, *_ = step(current, state, (X, Y), jax.random.key(count))
        if count in at:
            kept.append(current)
    snapshots = result.tracked[0]
    assert len(snapshots) == 3 * 3
    for member in range(3):
        for k in range(3):
            got = snapshots[member * 3 + k]
            assert tree_equal(got, kept[k][member], rtol=1e-4, atol=1e-6)


def test_schedules_are_the_papers_formulas():
    cosine = ee.schedules.cosine_cycles(0.1, cycle_steps=10, cycles=2)
    for count in range(20):
        t = count % 10
        assert float(cosine(count)) == pytest.approx(
            0.05 * (math.cos(math.pi * t / 10) + 1), abs=1e-7
        )
    tri = ee.schedules.triangular_cycles(0.05, 0.01, cycle_steps=8, start=4)
    expected = [0.05] * 4 + [0.05, 0.04, 0.03, 0.02, 0.01, 0.02, 0.03, 0.04, 0.05]
    assert [round(float(tri(c)), 6) for c in range(13)] == expected
    assert ee.schedules.fge_snapshots(8, 2, start=4) == (8, 16)


def test_errors(ens):
    with pytest.raises(ValueError, match="starts after the last step"):
        ee.fit(
            ens,
            loss_fn,
            optax.sgd(0.1),
            (X, Y),
            steps=5,
            batch_size=16,
            key=jax.random.key(0),
            track=[ee.SWAG(start=6)],
            callbacks=(),
        )
    with pytest.raises(ValueError, match="needs at least 20 collected"):
        ee.fit(
            ens,
            loss_fn,
            optax.sgd(0.1),
            (X, Y),
            steps=10,
            batch_size=16,
            key=jax.random.key(0),
            track=[ee.SWAG(start=2)],
            callbacks=(),
        )
    with pytest.raises(ValueError, match="rank` must be an int >= 1"):
        ee.SWAG(start=1, rank=0)
    with pytest.raises(ValueError, match=r"asks for steps \[12\]"):
        ee.fit(
            ens,
            loss_fn,
            optax.sgd(0.1),
            (X, Y),
            steps=10,
            batch_size=16,
            key=jax.random.key(0),
            track=[ee.Snapshots(at=(5, 12))],
            callbacks=(),
        )
    with pytest.raises(ValueError, match="must increase"):
        ee.Snapshots(at=(5, 5))
    with pytest.raises(ValueError, match="must be even"):
        ee.schedules.triangular_cycles(0.1, 0.01, cycle_steps=5)
