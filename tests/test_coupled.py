"""`ee.Coupled` losses (gradients of the members' summed loss, taken jointly)
and `ee.distillation_loss`, against hand-written gradients and formulas."""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest
from conftest import assert_tree_allclose

import eqx_ensemble as ee

SIZE = 4
X = jnp.linspace(-1, 1, 24)[:, None]
Y = jnp.sin(3 * X[:, 0])


@pytest.fixture
def ens(getkey):
    return ee.ensemble(lambda k: eqx.nn.Linear(1, 1, key=k), size=SIZE, key=getkey())


def outputs(ens, x):
    return ee.map(lambda m, xs: jax.vmap(m)(xs)[:, 0], ens, x)  # (members, batch)


def test_a_coupled_sum_of_independent_losses_trains_like_plain_members(ens):
    def one(model, batch, key):
        x, y = batch
        return jnp.mean((jax.vmap(model)(x)[:, 0] - y) ** 2)

    def together(e, batch, keys):
        x, y = batch
        return jnp.mean((outputs(e, x) - y[None]) ** 2, axis=1)

    opt = optax.adam(0.05)
    plain, coupled = ee.make_step(one, opt), ee.make_step(ee.Coupled(together), opt)
    a, sa = ens, ee.init_optimizer(opt, ens)
    b, sb = ens, ee.init_optimizer(opt, ens)
    for i in range(3):
        a, sa, la, *_ = plain(a, sa, (X, Y), jax.random.key(i))
        b, sb, lb, *_ = coupled(b, sb, (X, Y), jax.random.key(i))
    assert_tree_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert_tree_allclose(la, lb)


def test_negative_correlation_gets_the_papers_gradient(ens):
    lam = 0.5

    def ncl(e, batch, keys):
        x, y = batch
        f = outputs(e, x)
        mean = jax.lax.stop_gradient(f.mean(0))
        return jnp.mean(
            0.5 * (f - y[None]) ** 2 - 0.5 * lam * (f - mean[None]) ** 2, axis=1
        )

    step = ee.make_step(ee.Coupled(ncl), optax.sgd(1.0))
    new, *_ = step(
        ens, ee.init_optimizer(optax.sgd(1.0), ens), (X, Y), jax.random.key(0)
    )
    # Liu & Yao: d e_i / d f_i = (f_i - y) - lam (f_i - f_mean), per example.
    f = outputs(ens, X)
    delta = (f - Y[None]) - lam * (f - f.mean(0)[None])
    grad_w = jnp.mean(delta[..., None] * X[None], axis=1)  # (members, 1)
    grad_b = jnp.mean(delta, axis=1)
    assert_tree_allclose(
        new.members.weight[:, 0, :], ens.members.weight[:, 0, :] - grad_w
    )
    assert_tree_allclose(new.members.bias[:, 0], ens.members.bias[:, 0] - grad_b)


def test_cross_member_gradients_of_a_scalar_total(ens):
    def ensemble_mse(e, batch, keys):  # a scalar: the ensemble mean's error
        x, y = batch
        return jnp.mean((outputs(e, x).mean(0) - y) ** 2)

    step = ee.make_step(ee.Coupled(ensemble_mse), optax.sgd(0.1))
    new, _, losses, *_ = step(
        ens, ee.init_optimizer(optax.sgd(0.1), ens), (X, Y), jax.random.key(0)
    )
    # By hand: jax.grad of the total over a Python list of plain models.
    models = ee.unstack(ens)

    def total(ms):
        mean = functools.reduce(jnp.add, [jax.vmap(m)(X)[:, 0] for m in ms]) / SIZE
        return jnp.mean((mean - Y) ** 2)

    grads = jax.grad(total)(models)
    for i in range(SIZE):
        expected = jax.tree.map(lambda w, g: w - 0.1 * g, models[i], grads[i])
        assert_tree_allclose(new[i], expected, rtol=1e-5, atol=1e-6)
    assert_tree_allclose(losses, jnp.full(SIZE, total(models)))


def test_coupled_errors(ens):
    bad = ee.make_step(ee.Coupled(lambda e, b, k: jnp.zeros((2, 2))), optax.sgd(0.1))
    with pytest.raises(
        ValueError,
        match=r"one loss per member, shape \(4,\); got "
        r"shape \(2, 2\)",
    ):
        bad(ens, ee.init_optimizer(optax.sgd(0.1), ens), (X, Y), jax.random.key(0))
    with pytest.raises(TypeError):
        ee.Coupled(3)


def test_distillation_loss_is_the_tempered_kl(getkey):
    teacher = ee.ensemble(lambda k: eqx.nn.MLP(2, 3, 8, 1, key=k), size=3, key=getkey())
    student = eqx.nn.MLP(2, 3, 4, 1, key=getkey())
    x = jax.random.normal(getkey(), (10, 2))
    loss = ee.distillation_loss(teacher, temperature=2.0)
    t_probs = jax.nn.softmax(ee.predict(teacher, x) / 2.0, axis=-1).mean(0)
    s_log = jax.nn.log_softmax(jax.vmap(student)(x) / 2.0, axis=-1)
    expected = 4.0 * jnp.mean(jnp.sum(t_probs * (jnp.log(t_probs) - s_log), -1))
    assert_tree_allclose(loss(student, (x, jnp.zeros(10)), None), expected)
    students = ee.ensemble(
        lambda k: eqx.nn.MLP(2, 3, 16, 1, key=k), size=1, key=getkey()
    )
    before = loss(students[0], x, None)
    result = ee.fit(
        students,
        loss,
        optax.adam(1e-2),
        x,
        steps=150,
        batch_size=10,
        key=getkey(),
        callbacks=(),
    )
    assert float(loss(result.ensemble[0], x, None)) < 0.2 * float(before)
    with pytest.raises(ValueError, match="positive and finite"):
        ee.distillation_loss(teacher, temperature=0.0)
    with pytest.raises(TypeError, match="`ee.Ensemble`"):
        ee.distillation_loss(student)
