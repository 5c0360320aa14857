"""`ee.adversarial`: each member's loss plus its loss at its OWN fast-gradient-sign
examples (Lakshminarayanan et al. 2017), against a hand-written FGSM per member."""

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest
from conftest import assert_tree_allclose, tree_equal

import eqx_ensemble as ee


def loss_fn(model, batch, key):
    x, y = batch
    return jnp.mean((jax.vmap(model)(x)[:, 0] - y) ** 2)


@pytest.fixture
def setup(getkey):
    ens = ee.ensemble(lambda k: eqx.nn.MLP(2, 1, 8, 1, key=k), size=3, key=getkey())
    x = jax.random.normal(getkey(), (32, 2))
    return ens, (x, jnp.sin(x.sum(1)))


def fgsm_by_hand(model, batch, epsilon):
    x, y = batch
    gx = jax.grad(lambda xs: loss_fn(model, (xs, y), None))(x)
    adv = x + epsilon * jnp.sign(gx)
    return (loss_fn(model, batch, None) + loss_fn(model, (adv, y), None)) / 2


def test_adversarial_loss_is_fgsm_per_member(setup):
    ens, batch = setup
    wrapped = ee.adversarial(loss_fn, epsilon=0.1)
    for i in range(len(ens)):
        assert_tree_allclose(
            wrapped(ens[i], batch, None), fgsm_by_hand(ens[i], batch, 0.1)
        )
    # epsilon = 0 is exactly the plain loss.
    assert_tree_allclose(
        ee.adversarial(loss_fn, epsilon=0.0)(ens[0], batch, None),
        loss_fn(ens[0], batch, None),
    )


def test_a_step_per_feature_is_fgsm_with_that_step(setup):
    # The paper's epsilon: 1% of each input dimension's range.
    ens, batch = setup
    x, _ = batch
    epsilon = 0.01 * (x.max(0) - x.min(0))
    wrapped = ee.adversarial(loss_fn, epsilon=epsilon)
    for i in range(len(ens)):
        assert_tree_allclose(
            wrapped(ens[i], batch, None), fgsm_by_hand(ens[i], batch, epsilon[None])
        )
    # Trained with it: another array of steps is another input of the same
    # program (test_compile_once.py counts it), not a constant.
    opt = optax.adam(1e-2)
    common = dict(steps=5, batch_size=8, key=jax.random.key(0), callbacks=())
    before = ee.fit(ens, wrapped, opt, batch, **common).ensemble
    again = ee.adversarial(loss_fn, epsilon=2 * epsilon)
    after = ee.fit(ens, again, opt, batch, **common).ensemble
    assert not tree_equal(before, after)
    with pytest.raises(ValueError, match="finite and non-negative"):
        ee.adversarial(loss_fn, epsilon=jnp.array([0.1, -0.1]))
    with pytest.raises(TypeError, match="epsilon"):  # integer steps
        ee.adversarial(loss_fn, epsilon=jnp.array([1, 2]))
    with pytest.raises(ValueError, match=r"shape \(3,\) does not broadcast"):
        ee.adversarial(loss_fn, epsilon=jnp.ones(3))(ens[0], batch, None)


def test_training_with_adversarial_examples_equals_a_hand_loop(setup):
    ens, batch = setup
    opt = optax.sgd(0.05)
    step = ee.make_step(ee.adversarial(loss_fn, epsilon=0.1), opt)
    got, state = ens, ee.init_optimizer(opt, ens)
    for i in range(3):
        got, state, *_ = step(got, state, batch, jax.random.key(i))
    for i in range(len(ens)):
        model = ens[i]
        for _ in range(3):
            grads = eqx.filter_grad(lambda m: fgsm_by_hand(m, batch, 0.1))(model)
            model = eqx.apply_updates(model, jax.tree.map(lambda g: -0.05 * g, grads))
        assert_tree_allclose(got[i], model, rtol=1e-4, atol=1e-6)


def test_inputs_selector_and_stateful_losses(getkey):
    class Net(eqx.Module):
        linear: eqx.nn.Linear
        norm: eqx.nn.BatchNorm

        def __init__(self, key):
            self.linear = eqx.nn.Linear(2, 1, key=key)
            self.norm = eqx.nn.BatchNorm(1, axis_name="batch", mode="batch")

        def __call__(self, x, state):
            return self.norm(self.linear(x), state)

    def stateful_loss(model, state, batch, key):
        out, state = jax.vmap(
            model, in_axes=(0, None), out_axes=(0, None), axis_name="batch"
        )(batch["x"], state)
        return jnp.mean((out[:, 0] - batch["y"]) ** 2), state

    ens, state = ee.ensemble(eqx.nn.make_with_state(Net), size=2, key=getkey())
    batch = {"x": jax.random.normal(getkey(), (16, 2)), "y": jnp.zeros(16)}
    wrapped = ee.adversarial(stateful_loss, epsilon=0.1, inputs=lambda b: b["x"])
    result = ee.fit(
        ens,
        wrapped,
        optax.sgd(0.1),
        batch,
        steps=3,
        batch_size=16,
        key=getkey(),
        state=state,
        callbacks=(),
    )
    assert jnp.isfinite(result.history.losses).all()


def test_bad_epsilon_and_inputs_are_refused(setup):
    with pytest.raises(ValueError, match="finite and non-negative"):
        ee.adversarial(loss_fn, epsilon=-0.1)
    with pytest.raises(ValueError, match="finite and non-negative"):
        ee.adversarial(loss_fn, epsilon=float("nan"))
    ens, (x, y) = setup
    wrapped = ee.adversarial(lambda m, b, k: jnp.sum(b[0]) * 0.0, epsilon=0.1)
    with pytest.raises(TypeError, match="floating-point inputs"):
        wrapped(ens[0], (jnp.zeros(3, jnp.int32), y), None)
