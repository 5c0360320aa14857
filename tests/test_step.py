"""`ee.make_step`: one compiled step for all members == each member stepped alone."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import assert_tree_allclose, tree_equal

import eqx_ensemble as ee

SIZE = 3
BATCH = 8
STEPS = 3
ADAM = optax.adam(1e-2)
CLIP_ADAM = optax.chain(optax.clip_by_global_norm(0.1), optax.adam(1e-2))


class DropoutMLP(eqx.Module):
    hidden: eqx.nn.Linear
    dropout: eqx.nn.Dropout
    out: eqx.nn.Linear

    def __init__(self, key):
        hidden_key, out_key = jax.random.split(key)
        self.hidden = eqx.nn.Linear(2, 16, key=hidden_key)
        self.dropout = eqx.nn.Dropout(0.5)
        self.out = eqx.nn.Linear(16, 1, key=out_key)

    def __call__(self, x, key):
        return self.out(self.dropout(jax.nn.relu(self.hidden(x)), key=key))


def dropout_loss(model, batch, key):
    xb, yb = batch
    preds = jax.vmap(model)(xb, jax.random.split(key, xb.shape[0]))
    return jnp.mean((preds - yb) ** 2)


def loss_with_aux(model, batch, key):
    xb, yb = batch
    preds = jax.vmap(model)(xb, jax.random.split(key, xb.shape[0]))
    return jnp.mean((preds - yb) ** 2), {"preds": preds, "top": jnp.max(preds)}


class BatchNormMLP(eqx.Module):
    hidden: eqx.nn.Linear
    norm: eqx.nn.BatchNorm
    out: eqx.nn.Linear

    def __init__(self, key):
        hidden_key, out_key = jax.random.split(key)
        self.hidden = eqx.nn.Linear(2, 8, use_bias=False, key=hidden_key)
        self.norm = eqx.nn.BatchNorm(8, axis_name="batch", mode="batch")
        self.out = eqx.nn.Linear(8, 1, key=out_key)

    def __call__(self, x, state):
        hidden, state = self.norm(self.hidden(x), state)
        return self.out(jax.nn.relu(hidden)), state


def batchnorm_loss(model, state, batch, key):
    xb, yb = batch
    preds, state = jax.vmap(
        model, axis_name="batch", in_axes=(0, None), out_axes=(0, None)
    )(xb, state)
    return jnp.mean((preds - yb) ** 2), state, {"preds": preds}


def make_batch(key, leading=()):
    x = jax.random.normal(key, leading + (BATCH, 2))
    return x, jnp.sin(2 * x[..., :1]) + x[..., 1:] ** 2


def params(model):
    return eqx.filter(model, eqx.is_inexact_array)


def member(tree, i):
    return jax.tree.map(lambda leaf: leaf[i] if eqx.is_array(leaf) else leaf, tree)


@eqx.filter_jit
def solo_step(model, opt_state, batch, key, loss_fn, optimizer, state=None):
    """The hand-written single-model step."""
    if state is None:
        (loss, aux), grads = eqx.filter_value_and_grad(
            lambda m: _with_aux(loss_fn(m, batch, key)), has_aux=True
        )(model)
    else:
        (loss, (state, aux)), grads = eqx.filter_value_and_grad(
            lambda m: _stateful(loss_fn(m, state, batch, key)), has_aux=True
        )(model)
    # Adam's `b1 ** count` mixes dtypes; the suite runs with strict promotion.
    with jax.numpy_dtype_promotion("standard"):
        updates, opt_state = optimizer.update(grads, opt_state, params(model))
    return eqx.apply_updates(model, updates), opt_state, loss, aux, state


def _with_aux(out):
    return out if isinstance(out, tuple) else (out, None)


def _stateful(out):
    return out[0], (out[1], out[2] if len(out) == 3 else None)


def check_against_solo(
    ens, loss_fn, optimizer, *, per_member_batch, state=None, steps=STEPS
):
    step = ee.make_step(loss_fn, optimizer, per_member_batch=per_member_batch)
    opt_state = ee.init_optimizer(optimizer, ens)
    solos = [
        (ens[i], optimizer.init(params(ens[i])), member(state, i)) for i in range(SIZE)
    ]
    for t in range(steps):
        batch_key, step_key = jax.random.split(jax.random.key(100 + t))
        batch = make_batch(batch_key, (SIZE,) if per_member_batch else ())
        ens, opt_state, losses, aux, state = step(
            ens, opt_state, batch, step_key, state
        )
        assert losses.shape == (SIZE,)
        member_keys = jax.random.split(step_key, SIZE)
        for i, (model, solo_opt_state, solo_state) in enumerate(solos):
            solo_batch = member(batch, i) if per_member_batch else batch
            model, solo_opt_state, loss, solo_aux, solo_state = solo_step(
                model,
                solo_opt_state,
                solo_batch,
                member_keys[i],
                loss_fn,
                optimizer,
                solo_state,
            )
            solos[i] = (model, solo_opt_state, solo_state)
            np.testing.assert_allclose(losses[i], loss, rtol=1e-5, atol=1e-6)
            assert_tree_allclose(member(aux, i), solo_aux, rtol=1e-5, atol=1e-6)
            assert_tree_allclose(ens[i], model, rtol=1e-5, atol=1e-6)
            assert_tree_allclose(
                member(opt_state, i), solo_opt_state, rtol=1e-5, atol=1e-6
            )
            assert_tree_allclose(member(state, i), solo_state, rtol=1e-5, atol=1e-6)
    return ens


@pytest.fixture(scope="module")
def dropout_ens():
    return ee.ensemble(DropoutMLP, size=SIZE, key=jax.random.key(0))


@pytest.mark.parametrize("per_member_batch", [False, True])
def test_step_equals_solo_steps(dropout_ens, per_member_batch):
    trained = check_against_solo(
        dropout_ens, dropout_loss, ADAM, per_member_batch=per_member_batch
    )
    assert not tree_equal(trained, dropout_ens)


def test_step_aux_outputs(dropout_ens):
    check_against_solo(dropout_ens, loss_with_aux, ADAM, per_member_batch=False)
    step = ee.make_step(loss_with_aux, ADAM)
    out = step(
        dropout_ens,
        ee.init_optimizer(ADAM, dropout_ens),
        make_batch(jax.random.key(1)),
        jax.random.key(2),
    )
    assert isinstance(out, ee.StepOutput)
    assert out.aux["preds"].shape == (SIZE, BATCH, 1)
    assert out.aux["top"].shape == (SIZE,)
    assert out.state is None


def test_step_clipping_is_per_member(dropout_ens):
    # Member 0's output weights are huge, so its gradient norm dwarfs the others'.
    loud = eqx.tree_at(
        lambda e: e.members.out.weight,
        dropout_ens,
        dropout_ens.members.out.weight.at[0].multiply(1e3),
    )
    check_against_solo(loud, dropout_loss, CLIP_ADAM, per_member_batch=False)


@pytest.mark.parametrize("per_member_batch", [False, True])
def test_step_with_batchnorm_state(per_member_batch):
    ens, state = ee.ensemble(
        eqx.nn.make_with_state(BatchNormMLP), size=SIZE, key=jax.random.key(3)
    )
    check_against_solo(
        ens, batchnorm_loss, ADAM, per_member_batch=per_member_batch, state=state
    )


def test_non_finite_member_keeps_its_parameters(dropout_ens):
    step = ee.make_step(dropout_loss, ADAM, per_member_batch=True)
    opt_state = ee.init_optimizer(ADAM, dropout_ens)
    x, y = make_batch(jax.random.key(4), (SIZE,))
    y = y.at[1, 0, 0].set(jnp.nan)
    key = jax.random.key(5)
    ens, new_opt_state, losses, _, _ = step(dropout_ens, opt_state, (x, y), key)
    assert not np.isfinite(losses[1])
    assert tree_equal(ens[1], dropout_ens[1])
    assert tree_equal(member(new_opt_state, 1), member(opt_state, 1))
    member_keys = jax.random.split(key, SIZE)
    for i in (0, 2):
        solo, _, _, _, _ = solo_step(
            dropout_ens[i],
            ADAM.init(params(dropout_ens[i])),
            (x[i], y[i]),
            member_keys[i],
            dropout_loss,
            ADAM,
        )
        assert_tree_allclose(ens[i], solo, rtol=1e-5, atol=1e-6)


def test_step_is_traced_once(dropout_ens):
    traces = []

    def counting_loss(model, batch, key):
        traces.append(None)
        return dropout_loss(model, batch, key)

    step = ee.make_step(counting_loss, ADAM)
    ens, opt_state = dropout_ens, ee.init_optimizer(ADAM, dropout_ens)
    for t in range(3):
        ens, opt_state, *_ = step(
            ens, opt_state, make_batch(jax.random.key(t)), jax.random.key(t)
        )
        if t == 0:
            traced_once = len(traces)
    assert len(traces) == traced_once


# --------------------------------------------------------------------------------
# Bad input.
# --------------------------------------------------------------------------------


def test_non_scalar_loss(dropout_ens):
    def per_example(model, batch, key):
        xb, yb = batch
        return (jax.vmap(model)(xb, jax.random.split(key, xb.shape[0])) - yb) ** 2

    step = ee.make_step(per_example, ADAM)
    with pytest.raises(ValueError, match=r"loss of shape \(8, 1\)"):
        step(
            dropout_ens,
            ee.init_optimizer(ADAM, dropout_ens),
            make_batch(jax.random.key(0)),
            jax.random.key(1),
        )


def test_loss_returning_a_long_tuple(dropout_ens):
    step = ee.make_step(lambda m, b, k: (dropout_loss(m, b, k), 1.0, 2.0), ADAM)
    with pytest.raises(TypeError, match="tuple of length 3"):
        step(
            dropout_ens,
            ee.init_optimizer(ADAM, dropout_ens),
            make_batch(jax.random.key(0)),
            jax.random.key(1),
        )


def test_per_member_batch_of_wrong_size(dropout_ens):
    step = ee.make_step(dropout_loss, ADAM, per_member_batch=True)
    with pytest.raises(ValueError, match=r"\b3\b.*\b4\b|\b4\b.*\b3\b"):
        step(
            dropout_ens,
            ee.init_optimizer(ADAM, dropout_ens),
            make_batch(jax.random.key(0), (SIZE + 1,)),
            jax.random.key(1),
        )


def test_optimizer_state_of_another_ensemble(dropout_ens):
    step = ee.make_step(dropout_loss, ADAM)
    with pytest.raises(ValueError, match="does not match.*3-member ensemble"):
        step(
            dropout_ens,
            ee.init_optimizer(ADAM, dropout_ens[:2]),
            make_batch(jax.random.key(0)),
            jax.random.key(1),
        )


def test_optimizer_state_of_another_optimizer(dropout_ens):
    step = ee.make_step(dropout_loss, ADAM)
    with pytest.raises(ValueError, match="optimizer state does not match"):
        step(
            dropout_ens,
            ee.init_optimizer(optax.sgd(0.1), dropout_ens),
            make_batch(jax.random.key(0)),
            jax.random.key(1),
        )


def test_stateful_loss_returning_a_bare_loss():
    ens, state = ee.ensemble(
        eqx.nn.make_with_state(BatchNormMLP), size=SIZE, key=jax.random.key(3)
    )
    step = ee.make_step(lambda m, s, b, k: batchnorm_loss(m, s, b, k)[0], ADAM)
    with pytest.raises(TypeError, match=r"\(loss, new_state\)"):
        step(
            ens,
            ee.init_optimizer(ADAM, ens),
            make_batch(jax.random.key(0)),
            jax.random.key(1),
            state,
        )


def test_several_keys_instead_of_one(dropout_ens):
    step = ee.make_step(dropout_loss, ADAM)
    # The runtime type check (jaxtyping, a TypeError) or `check_key` rejects it.
    with pytest.raises((TypeError, ValueError), match="key"):
        step(
            dropout_ens,
            ee.init_optimizer(ADAM, dropout_ens),
            make_batch(jax.random.key(0)),
            jax.random.split(jax.random.key(1), SIZE),
        )


N = 48
X = np.asarray(jax.random.normal(jax.random.key(10), (N, 2)), dtype=np.float32)
Y = np.sin(2 * X[:, :1]) + X[:, 1:] ** 2
KEY = jax.random.key(5)


def make_mlp(key):
    return eqx.nn.MLP(2, 1, 8, 1, key=key)


def mse_loss(model, batch, key):
    x, y = batch
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


@pytest.fixture
def ens():
    return ee.ensemble(make_mlp, size=SIZE, key=jax.random.key(0))


def test_make_step_on_a_batch_of_no_examples_is_refused(ens):
    step = ee.make_step(mse_loss, optax.sgd(0.1))
    opt_state = ee.init_optimizer(optax.sgd(0.1), ens)
    with pytest.raises(
        ValueError, match=r"no examples: leaf `\[0\]` has shape \(0, 2\)"
    ):
        step(ens, opt_state, (X[:0], Y[:0]), KEY)
