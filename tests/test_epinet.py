"""`ee.nn.Epinet` and `ee.nn.epinet_loss` (Osband et al. 2023) against the
paper's formulas written in NumPy: `f(x, z) = mu(x) + g([phi, z])^T z + alpha
h(phi)^T z`, the loss averaged over sampled indices; the fixed prior through
`fit`; the index variance away from the data; members of one ensemble trained
alone; bitwise resume; errors."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import Interrupt, interrupt_at

import eqx_ensemble as ee

X = jax.random.uniform(jax.random.key(1), (128, 1), minval=-1, maxval=1)
Y = jnp.sin(3 * X) + 0.05 * jax.random.normal(jax.random.key(5), X.shape)


def _make(key, *, out=1, index_dim=8, include_input=True):
    k1, k2, k3 = jax.random.split(key, 3)
    torso = eqx.nn.MLP(1, 16, 16, 2, final_activation=jax.nn.relu, key=k1)
    return ee.nn.Epinet(
        torso,
        eqx.nn.Linear(16, out, key=k2),
        16 + include_input,
        out,
        index_dim=index_dim,
        width=16,
        prior_scale=1.5,
        include_input=include_input,
        key=k3,
    )


def _mse(model, batch, key):
    x, y = batch
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


def _arrays(tree):
    return jax.tree.leaves(eqx.filter(tree, eqx.is_array))


def _np_linear(layer, v):
    return v @ np.asarray(layer.weight, np.float64).T + np.asarray(layer.bias)


def _np_mlp(mlp, v, *, final_relu=False):
    for number, layer in enumerate(mlp.layers):
        v = _np_linear(layer, v)
        if number < len(mlp.layers) - 1 or final_relu:
            v = np.maximum(v, 0.0)
    return v


def _np_epinet(model, x, z, alpha=1.5):
    """The paper's ENN in NumPy, from the model's parameters: a batch `x`
    `(n, 1)` at one index `z`, `(n, out)`."""
    x, z = np.asarray(x, np.float64), np.asarray(z, np.float64)
    features = _np_mlp(model.torso, x, final_relu=True)
    mu = _np_linear(model.head, features)
    phi = np.concatenate([features, x], 1) if model.include_input else features
    n, out, index_dim = len(x), mu.shape[1], len(z)
    z_rows = np.broadcast_to(z, (n, index_dim))
    g = _np_mlp(model.learnable, np.concatenate([phi, z_rows], 1))
    h = _np_mlp(model.prior, phi)
    g, h = g.reshape(n, out, index_dim), h.reshape(n, out, index_dim)
    return mu + g @ z + alpha * (h @ z)


@pytest.mark.parametrize("include_input", [False, True])
def test_output_is_the_papers_formula(include_input):
    model = _make(jax.random.key(0), out=2, index_dim=3, include_input=include_input)
    x = jnp.array([[0.3], [-0.8], [2.0]])
    for seed in range(3):
        z = jax.random.normal(jax.random.key(seed), (3,))
        got = jax.vmap(lambda xi, z=z: model(xi, z))(x)
        np.testing.assert_allclose(got, _np_epinet(model, x, z), rtol=1e-5, atol=1e-6)
    # z = 0 (and no z) is the base alone; the prior is a fixed random network.
    mu = _np_epinet(model, x, np.zeros(3))
    np.testing.assert_allclose(jax.vmap(model)(x), mu, rtol=1e-5, atol=1e-6)
    at_zero = jax.vmap(lambda xi: model(xi, jnp.zeros(3)))(x)
    np.testing.assert_allclose(at_zero, mu, rtol=1e-5, atol=1e-6)
    assert float(jnp.abs(model.prior.layers[0].weight).min()) > 0


def test_features_reach_the_epinet_through_stop_gradient():
    x, z = jnp.array([0.3]), jnp.ones(8)
    model = _make(jax.random.key(0))
    grads = eqx.filter_grad(lambda m: jnp.sum(m(x, z) - m(x)))(model)
    zero = lambda tree: all(not np.any(leaf) for leaf in jax.tree.leaves(tree))
    assert zero(grads.torso) and zero(grads.head) and not zero(grads.learnable)
    # The prior is held as bits (unsigned ints): not a parameter at all.
    assert all(leaf.dtype == jnp.uint32 for leaf in _arrays(model.prior_bits))
    assert jax.tree.leaves(grads.prior_bits) == []


def test_loss_is_the_average_over_the_same_indices():
    model = _make(jax.random.key(0), out=1, index_dim=4)
    x, y, key = X[:10], Y[:10], jax.random.key(9)

    def noisy_mse(model, batch, key):  # uses its key: the per-index keys count
        return _mse(model, batch, key) + jax.random.uniform(key)

    got = ee.nn.epinet_loss(noisy_mse, num_indices=5, l2=0.01)(model, (x, y), key)
    # The documented scheme, written with jax.random; the rest in NumPy.
    index_key, loss_key = jax.random.split(key)
    zs = jax.random.normal(index_key, (5, 4))
    noise = [float(jax.random.uniform(k)) for k in jax.random.split(loss_key, 5)]
    y = np.asarray(y, np.float64)
    losses = [
        np.mean((_np_epinet(model, x, z) - y) ** 2) + n for z, n in zip(zs, noise)
    ]
    squares = sum(
        np.sum(np.asarray(leaf, np.float64) ** 2)
        for part in (model.torso, model.head, model.learnable)
        for leaf in jax.tree.leaves(eqx.filter(part, eqx.is_array))
    )
    assert float(got) == pytest.approx(np.mean(losses) + 0.01 * squares, rel=1e-5)


@pytest.fixture(scope="module")
def toy():
    """Three epinets (three seeds: init and indices) trained in ONE fit on
    [-1, 1], with a decoupled weight decay that moves any float leaf."""
    ens = ee.ensemble(_make, size=3, key=jax.random.key(0))
    result = ee.fit(
        ens,
        ee.nn.epinet_loss(_mse, num_indices=8),
        optax.adamw(1e-2, weight_decay=0.1),
        (X, Y),
        steps=200,
        batch_size=32,
        key=jax.random.key(2),
        callbacks=(),
    )
    return ens, result.ensemble


def test_the_prior_is_untouched_by_fit_while_the_rest_trains(toy):
    before, after = toy
    for i in range(3):
        for old, new in zip(
            _arrays(before[i].prior), _arrays(after[i].prior), strict=True
        ):
            np.testing.assert_array_equal(old, new)
        for part in ("learnable", "torso", "head"):
            old, new = getattr(before[i], part), getattr(after[i], part)
            pairs = zip(_arrays(old), _arrays(new), strict=True)
            assert all(not np.allclose(a, b) for a, b in pairs), part


def test_the_index_variance_grows_away_from_the_data(toy):
    before, after = toy
    near = jnp.linspace(-0.9, 0.9, 19)[:, None]
    far = jnp.array([[-4.0], [-3.0], [3.0], [4.0]])

    def ratio(model):
        indices = model.samples(200, key=jax.random.key(7))
        variance = lambda x: float(jnp.mean(jnp.var(ee.predict(indices, x), axis=0)))
        return variance(far) / variance(near)

    # Measured on 18 seeds (6 fit keys x 3 members): 18-123 trained, 0.9-1.8
    # untrained; so > 5 and > 4x the untrained ratio, on every member here.
    for i in range(3):
        assert ratio(after[i]) > 5.0
        assert ratio(after[i]) > 4 * ratio(before[i])


def test_samples_are_members_at_the_documented_indices(toy):
    _, fitted = toy
    keys = jax.random.split(jax.random.key(3), 3)
    # An ensemble's indices: each member's as a group, members x indices.
    groups = [m.samples(4, key=k) for m, k in zip(ee.unstack(fitted), keys)]
    got = ee.predict(ee.Heterogeneous(groups), X[:6])
    assert got.shape == (12, 6, 1)
    for i, key in enumerate(keys):
        for j, z in enumerate(jax.random.normal(key, (4, 8))):
            want = _np_epinet(ee.unstack(fitted)[i], X[:6], z)
            np.testing.assert_allclose(got[4 * i + j], want, rtol=1e-5, atol=1e-5)


# One program for the two tests below: the same loss, optimizer and shapes.
LOSS, ADAM, DATA = (
    ee.nn.epinet_loss(_mse, num_indices=4),
    optax.adam(1e-2),
    (X[:32], Y[:32]),
)


def _fit(ens, steps, **kwargs):
    return ee.fit(
        ens,
        LOSS,
        ADAM,
        DATA,
        steps=steps,
        batch_size=32,
        key=jax.random.key(6),
        execution=ee.Execution(steps_per_dispatch=10),
        **kwargs,
    )


def test_members_of_one_fit_equal_each_trained_alone():
    ens = ee.ensemble(_make, size=3, key=jax.random.key(5))
    loss, optimizer, key, steps = LOSS, ADAM, jax.random.key(6), 20
    fitted = _fit(ens, steps, callbacks=()).ensemble

    # `fit`'s documented keys; one full batch per step, in the epoch's order.
    data_key, _, train_key = jax.random.split(key, 3)

    @eqx.filter_jit
    def step(model, opt_state, batch, key):
        grads = eqx.filter_grad(loss)(model, batch, key)
        with jax.numpy_dtype_promotion("standard"):
            updates, opt_state = optimizer.update(
                grads, opt_state, eqx.filter(model, eqx.is_inexact_array)
            )
        return eqx.apply_updates(model, updates), opt_state

    x, z = jnp.array([0.5]), jnp.linspace(-1, 1, 8)
    stacked_out = fitted(x, z)  # every member at once: (3, 1)
    for i, member in enumerate(ee.unstack(ens)):
        opt_state = optimizer.init(eqx.filter(member, eqx.is_inexact_array))
        for s in range(steps):
            order = jax.random.permutation(jax.random.fold_in(data_key, s), 32)
            member_key = jax.random.split(jax.random.fold_in(train_key, s), 3)[i]
            member, opt_state = step(
                member, opt_state, jax.tree.map(lambda a: a[order], DATA), member_key
            )
        alone = ee.unstack(fitted)[i]
        for a, b in zip(_arrays(alone), _arrays(member), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(stacked_out[i], alone(x, z), rtol=1e-6)


def test_resume_is_bit_exact(tmp_path):
    ens = ee.ensemble(_make, size=3, key=jax.random.key(5))

    def run(directory, callbacks=()):
        checkpoints = ee.Checkpoints(directory, every=10)
        return _fit(ens, 30, checkpoints=checkpoints, callbacks=callbacks)

    reference = run(tmp_path / "reference")
    with pytest.raises(Interrupt):
        run(tmp_path / "run", [interrupt_at(20)])
    assert [step for step, _ in ee.list_checkpoints(tmp_path / "run")][-1] == 20
    resumed = run(tmp_path / "run")
    for part in ("ensemble", "opt_state"):
        resumed_part, reference_part = getattr(resumed, part), getattr(reference, part)
        pairs = zip(_arrays(resumed_part), _arrays(reference_part), strict=True)
        for a, b in pairs:
            np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(resumed.history.losses, reference.history.losses)


def test_a_frozen_base_is_a_shared_part_that_fit_leaves_alone():
    base = _make(jax.random.key(7))  # e.g. a pretrained base, held once
    make = lambda key: eqx.tree_at(lambda m: (m.torso, m.head), _make(key),
                                   (base.torso, base.head))  # fmt: skip
    ens = ee.ensemble(make, size=3, key=jax.random.key(8),
                      shared=lambda m: (m.torso, m.head))  # fmt: skip
    fitted = _fit(ens, 10, callbacks=()).ensemble
    for i in range(3):
        assert eqx.tree_equal(fitted[i].torso, base.torso, ens[i].torso)
        assert eqx.tree_equal(fitted[i].head, base.head)
        assert not np.allclose(
            fitted[i].learnable.layers[0].weight, ens[i].learnable.layers[0].weight
        )


def test_bad_inputs_are_refused_by_name():
    key = jax.random.key(0)
    torso = eqx.nn.MLP(1, 16, 16, 1, final_activation=jax.nn.relu, key=key)
    head = eqx.nn.Linear(16, 1, key=key)
    for bad in (0, -2):
        with pytest.raises(ValueError, match="index_dim"):
            ee.nn.Epinet(torso, head, 16, 1, index_dim=bad, key=key)
    wrong_width = ee.nn.Epinet(torso, head, 12, 1, index_dim=4, key=key)
    with pytest.raises(ValueError, match=r"feature_size=12.*\(16,\)"):
        wrong_width(jnp.ones(1), jnp.ones(4))
    no_input = ee.nn.Epinet(
        torso, head, 16, 1, index_dim=4, include_input=True, key=key
    )
    with pytest.raises(ValueError, match=r"feature_size=16.*\(17,\)"):
        no_input(jnp.ones(1))
    with pytest.raises(ValueError, match="out_size=2"):
        ee.nn.Epinet(torso, head, 16, 2, index_dim=4, key=key)(jnp.ones(1))
    model = ee.nn.Epinet(torso, head, 16, 1, index_dim=4, key=key)
    with pytest.raises(ValueError, match=r"`z` must have shape \(4,\).*\(5,\)"):
        model(jnp.ones(1), jnp.ones(5))
    with pytest.raises(ValueError, match="num"):
        model.samples(0, key=key)
    with pytest.raises(ValueError, match="num_indices"):
        ee.nn.epinet_loss(_mse, num_indices=0)
    with pytest.raises(TypeError, match="Epinet"):
        ee.nn.epinet_loss(_mse, num_indices=2)(torso, (X, Y), key)
