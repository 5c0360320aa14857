"""The member layout of a step (`layout=`): vectorised or member by member.

`"sequential"` must compute what `"vmap"` computes (to float32 rounding) and what
each member computes alone; the automatic rule must pick it for a convolving
loss on one CPU device (seen in the compiled HLO: no grouped convolution) and
nowhere else; bad values and a mesh are refused by name.
"""

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest
from conftest import assert_tree_allclose

import eqx_ensemble as ee
from eqx_ensemble._layout import SEQUENTIAL_MAX_MEMBERS, choose_layout

SIZE = 3


class CNN(eqx.Module):
    conv1: eqx.nn.Conv2d
    norm: eqx.nn.BatchNorm | None
    conv2: eqx.nn.Conv2d
    out: eqx.nn.Linear

    def __init__(self, key, norm=False):
        k1, k2, k3 = jax.random.split(key, 3)
        # No bias before BatchNorm: its gradient is rounding noise, which Adam
        # would amplify into different updates under different layouts.
        self.conv1 = eqx.nn.Conv2d(1, 2, 3, padding=1, use_bias=not norm, key=k1)
        self.norm = (
            eqx.nn.BatchNorm(2, axis_name="batch", mode="batch") if norm else None
        )
        # Its input differs per member: vectorised, a grouped convolution.
        self.conv2 = eqx.nn.Conv2d(2, 2, 3, padding=1, key=k2)
        self.out = eqx.nn.Linear(2 * 4 * 4, 3, key=k3)

    def __call__(self, x, state=None):
        h = self.conv1(x)
        if self.norm is not None:
            h, state = self.norm(h, state)
        h = self.conv2(jax.nn.relu(h))
        logits = self.out(jax.nn.relu(h).reshape(-1))
        return logits if self.norm is None else (logits, state)


def xent(logits, y):
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], 1))


def loss_fn(model, batch, key):
    x, y = batch
    return xent(jax.vmap(model)(x), y)


def stateful_loss(model, state, batch, key):
    x, y = batch
    logits, state = jax.vmap(
        model, axis_name="batch", in_axes=(0, None), out_axes=(0, None)
    )(x, state)
    return xent(logits, y), state


@pytest.fixture
def data():
    key = jax.random.key(1)
    x = jax.random.normal(key, (32, 1, 4, 4))
    y = jax.random.randint(jax.random.fold_in(key, 1), (32,), 0, 3)
    return x, y


def test_sequential_step_equals_vmap_and_members_alone(data):
    ens = ee.ensemble(CNN, size=SIZE, key=jax.random.key(0))
    opt = optax.adam(1e-2)
    opt_state = ee.init_optimizer(opt, ens)
    batch = (data[0][:8], data[1][:8])
    key = jax.random.key(2)
    vmapped = ee.make_step(loss_fn, opt, layout="vmap")(ens, opt_state, batch, key)
    sequential = ee.make_step(loss_fn, opt, layout="sequential")(
        ens, opt_state, batch, key
    )
    assert_tree_allclose(sequential.ensemble, vmapped.ensemble)
    assert_tree_allclose(sequential.opt_state, vmapped.opt_state)
    assert_tree_allclose(sequential.losses, vmapped.losses)
    # Each member as if alone: a plain step of member i.
    grad_of = eqx.filter_jit(eqx.filter_grad(loss_fn))
    for i, member in enumerate(ee.unstack(ens)):
        grads = grad_of(member, batch, None)
        member_state = opt.init(eqx.filter(member, eqx.is_inexact_array))
        with jax.numpy_dtype_promotion("standard"):  # optax's bias correction
            updates, _ = opt.update(grads, member_state)
        alone = eqx.apply_updates(member, updates)
        assert_tree_allclose(sequential.ensemble[i], alone)


cpu_only = pytest.mark.skipif(
    jax.default_backend() != "cpu", reason="the automatic rule is a CPU rule"
)


@cpu_only
def test_auto_layout_runs_members_one_by_one_for_convolutions(data):
    ens = ee.ensemble(CNN, size=SIZE, key=jax.random.key(0))
    opt = optax.sgd(0.1)
    args = (ens, ee.init_optimizer(opt, ens), (data[0][:8], data[1][:8]))
    auto = ee.make_step(loss_fn, opt).lower(*args, jax.random.key(0)).as_text()
    vmap = (
        ee.make_step(loss_fn, opt, layout="vmap")
        .lower(*args, jax.random.key(0))
        .as_text()
    )
    # Vectorised: the member axis becomes a grouped convolution.
    assert re.search(rf"(feature|batch)_group_count = {SIZE} ", vmap)
    # Auto, on a CPU: each member's own plain convolutions.
    groups = re.findall(r"(?:feature|batch)_group_count = (\d+) ", auto)
    assert groups and set(groups) == {"1"}
    assert auto.count("stablehlo.convolution") >= 3 * SIZE


@cpu_only
def test_rule():
    assert choose_layout("auto", convolutions=True, size=4, mesh=None) == "sequential"
    assert choose_layout("auto", convolutions=False, size=4, mesh=None) == "vmap"
    big = SEQUENTIAL_MAX_MEMBERS + 1
    assert choose_layout("auto", convolutions=True, size=big, mesh=None) == "vmap"
    assert choose_layout("vmap", convolutions=True, size=4, mesh=None) == "vmap"
    assert (
        choose_layout("sequential", convolutions=False, size=64, mesh=None)
        == "sequential"
    )


@pytest.mark.parametrize("sampling", ["shared", "bootstrap"])
def test_fit_sequential_equals_vmap_with_batchnorm(data, sampling):
    ens, state = ee.ensemble(
        lambda k: eqx.nn.make_with_state(CNN)(k, norm=True),
        size=SIZE,
        key=jax.random.key(0),
    )
    results = {
        layout: ee.fit(
            ens,
            stateful_loss,
            optax.adam(1e-2),
            data,
            steps=3,
            batch_size=8,
            key=jax.random.key(3),
            steps_per_dispatch=1,  # one step compiled per layout: a fast test
            sampling=sampling,
            state=state,
            progress=False,
            layout=layout,
        )
        for layout in ("vmap", "sequential")
    }
    assert_tree_allclose(
        results["sequential"].ensemble, results["vmap"].ensemble, rtol=1e-4, atol=1e-5
    )
    assert_tree_allclose(
        results["sequential"].state, results["vmap"].state, rtol=1e-4, atol=1e-5
    )
    assert_tree_allclose(
        results["sequential"].history.losses,
        results["vmap"].history.losses,
        rtol=1e-4,
        atol=1e-5,
    )


def test_bad_layout_is_refused(data):
    opt = optax.sgd(0.1)
    with pytest.raises(ValueError, match=r"`layout` must be one of .*'columns'"):
        ee.make_step(loss_fn, opt, layout="columns")
    ens = ee.ensemble(CNN, size=4, key=jax.random.key(0))
    mesh = ee.make_mesh(members=2)
    with pytest.raises(ValueError, match="layout='sequential'.*mesh"):
        ee.make_step(loss_fn, opt, mesh=mesh, layout="sequential")
    with pytest.raises(ValueError, match="layout='sequential'.*mesh"):
        ee.fit(
            ens,
            loss_fn,
            opt,
            data,
            steps=1,
            batch_size=8,
            key=jax.random.key(0),
            mesh=mesh,
            layout="sequential",
            progress=False,
        )
