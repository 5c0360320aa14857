"""`ee.svgd`: members as SVGD particles, against a hand-written NumPy SVGD on a
1-D Gaussian mixture (the particles step for step, and the target's moments)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import eqx_ensemble as ee

MEMBERS, STEPS, LR = 40, 500, 0.1
DATA = (jnp.zeros((8, 1)), jnp.zeros(8))  # unused by the loss; `fit` draws batches


class Particle(eqx.Module):
    w: jax.Array

    def __init__(self, key):
        self.w = jax.random.normal(key, (1,))  # N(0, 1): between the modes


def log_p(w):
    # 0.5 N(-2, 1) + 0.5 N(2, 1)
    return jnp.logaddexp(-0.5 * (w + 2) ** 2, -0.5 * (w - 2) ** 2) - 0.5 * jnp.log(
        8 * jnp.pi
    )


def loss(model, batch, key):
    return -log_p(model.w[0])  # num_data = 1: the loss is the negative log density


def grad_log_p(theta):
    """d log p / dw in closed form: the modes' responsibilities are
    `1 - r, r` with `r = sigmoid(4 w)`, so the gradient is `-w - 2 + 4 r`."""
    return -theta - 2 + 4 / (1 + np.exp(-4 * theta))


def numpy_svgd(theta, steps, lr):
    """Liu & Wang (2016), Algorithm 1, with the median heuristic h = med^2 / log n."""
    theta = np.asarray(theta, np.float64).copy()
    n = len(theta)
    for _ in range(steps):
        grad = grad_log_p(theta)
        diff = theta[:, None, :] - theta[None, :, :]  # t_i - t_j
        squared = np.sum(diff**2, axis=-1)
        h = np.median(squared[np.triu_indices(n, 1)]) / np.log(n)
        k = np.exp(-squared / h)
        repulsive = np.sum(-(2 / h) * diff * k[:, :, None], axis=0)  # sum over i
        theta = theta + lr * (k.T @ grad + repulsive) / n
    return theta


def test_members_move_as_hand_written_svgd_particles_and_cover_the_mixture():
    ens = ee.ensemble(Particle, size=MEMBERS, key=jax.random.key(0))
    start = np.asarray(ens.members.w)
    result = ee.fit(ens, ee.svgd(loss, num_data=1), optax.sgd(LR), DATA,
                    steps=STEPS, batch_size=4, key=jax.random.key(1),
                    callbacks=())  # fmt: skip
    got = np.asarray(result.ensemble.members.w)
    before_last = numpy_svgd(start, STEPS - 1, LR)
    expected = numpy_svgd(before_last, 1, LR)
    np.testing.assert_allclose(got, expected, rtol=1e-3, atol=1e-3)
    # The particles spread over both modes: the mixture's mean 0, variance 5.
    assert abs(got.mean()) < 0.4 and abs(got.var() - 5.0) < 1.0, (got.mean(), got.var())
    assert (got < 0).sum() > 10 and (got > 0).sum() > 10
    # Each member's reported loss is its own negative log density.
    np.testing.assert_allclose(
        result.history.losses[-1],
        -np.asarray(jax.vmap(log_p)(jnp.asarray(before_last[:, 0]))),
        rtol=1e-3,
        atol=1e-3,
    )


def test_without_the_repulsion_the_particles_collapse_on_the_modes():
    # Plain gradient ascent from the same start: every particle climbs to a
    # mode and stays there (no spread within a mode), which the repulsion
    # prevents.
    ens = ee.ensemble(Particle, size=MEMBERS, key=jax.random.key(0))
    plain = ee.fit(ens, loss, optax.sgd(LR), DATA, steps=STEPS, batch_size=4,
                   key=jax.random.key(1), callbacks=()).ensemble  # fmt: skip
    particles = ee.fit(ens, ee.svgd(loss, num_data=1), optax.sgd(LR), DATA,
                       steps=STEPS, batch_size=4, key=jax.random.key(1),
                       callbacks=()).ensemble  # fmt: skip
    for ensemble, spread in ((plain, (0.0, 0.05)), (particles, (0.5, 1.5))):
        w = np.asarray(ensemble.members.w)[:, 0]
        right = w[w > 0]
        assert spread[0] <= right.std() <= spread[1], (right.std(), spread)


def scaled_loss(model, batch, key, hyper):
    # A negative scale stands for a member whose loss is not finite.
    return jnp.where(hyper < 0, jnp.nan, hyper * loss(model, batch, key))


def numpy_svgd_scaled(theta, scales, steps, lr):
    """As `numpy_svgd`, particle i's log density scaled by `scales[i]`."""
    theta = np.asarray(theta, np.float64).copy()
    n = len(theta)
    for _ in range(steps):
        grad = grad_log_p(theta) * np.asarray(scales)[:, None]
        diff = theta[:, None, :] - theta[None, :, :]
        squared = np.sum(diff**2, axis=-1)
        h = np.median(squared[np.triu_indices(n, 1)]) / np.log(n)
        k = np.exp(-squared / h)
        repulsive = np.sum(-(2 / h) * diff * k[:, :, None], axis=0)
        theta = theta + lr * (k.T @ grad + repulsive) / n
    return theta


def test_each_member_gets_its_own_hyperparameter():
    ens = ee.ensemble(Particle, size=6, key=jax.random.key(0))
    scales = jnp.linspace(0.5, 2.0, 6)
    result = ee.fit(ens, ee.svgd(scaled_loss, num_data=1), optax.sgd(LR), DATA,
                    steps=20, batch_size=4, key=jax.random.key(1), hyper=scales,
                    callbacks=())  # fmt: skip
    expected = numpy_svgd_scaled(np.asarray(ens.members.w), scales, 20, LR)
    np.testing.assert_allclose(result.ensemble.members.w, expected, rtol=1e-4,
                               atol=1e-4)  # fmt: skip


def test_a_diverging_member_is_frozen_and_the_others_move_without_it():
    ens = ee.ensemble(Particle, size=6, key=jax.random.key(0))
    scales = jnp.array([-1.0, 1.0, 1.0, 1.0, 1.0, 1.0])  # member 0: a NaN loss
    result = ee.fit(ens, ee.svgd(scaled_loss, num_data=1), optax.sgd(LR), DATA,
                    steps=20, batch_size=4, key=jax.random.key(1), hyper=scales,
                    callbacks=())  # fmt: skip
    assert list(result.diverged) == [0]
    got = np.asarray(result.ensemble.members.w)
    np.testing.assert_array_equal(got[0], np.asarray(ens.members.w)[0])  # kept
    expected = numpy_svgd(np.asarray(ens.members.w)[1:], 20, LR)
    np.testing.assert_allclose(got[1:], expected, rtol=1e-4, atol=1e-4)


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="num_data"):
        ee.svgd(loss, num_data=0)
    with pytest.raises(ValueError, match="bandwidth"):
        ee.svgd(loss, num_data=1, bandwidth=-1.0)
    one = ee.ensemble(Particle, size=1, key=jax.random.key(0))
    with pytest.raises(ValueError, match="at least 2"):
        ee.fit(one, ee.svgd(loss, num_data=1), optax.sgd(LR), DATA, steps=2,
               batch_size=4, key=jax.random.key(1), callbacks=())  # fmt: skip
