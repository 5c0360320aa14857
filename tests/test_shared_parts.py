"""Members that share parts (`ee.ensemble(..., shared=...)`): member i is the model
rebuilt from the shared part and its own stacked leaves; a frozen shared part gets
no gradient and no optimizer state; a trained one gets ONE state and the sum of the
members' gradients. Every reference here is computed member by member by hand."""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import assert_tree_allclose, tree_equal

import eqx_ensemble as ee

SIZE = 4


def make(key):
    return eqx.nn.MLP(3, 2, 8, 2, key=key)


def backbone(model):
    return model.layers[0]


def loss_fn(model, batch, key):
    del key
    x, y = batch
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


@pytest.fixture
def data(getkey):
    x = jax.random.normal(getkey(), (32, 3))
    y = jnp.stack([jnp.sin(x.sum(1)), jnp.cos(x[:, 0])], axis=1)
    return x, y


def plain_members(ens):
    """Member i rebuilt BY HAND: the shared leaves and member i's stacked leaves."""
    out = []
    for i in range(len(ens)):
        stacked = jax.tree.map(
            lambda leaf: leaf[i] if eqx.is_array(leaf) else leaf, ens.members
        )
        out.append(eqx.combine(stacked, ens.shared))
    return out


def test_shared_part_is_held_once_and_members_are_plain_models(getkey):
    ens = ee.ensemble(make, size=SIZE, key=getkey(), shared=backbone)
    assert ens.shared.layers[0].weight.shape == (8, 3)
    assert ens.members.layers[0].weight is None
    assert ens.members.layers[1].weight.shape == (SIZE, 8, 8)
    for i, model in enumerate(plain_members(ens)):
        assert isinstance(ens[i], eqx.nn.MLP)
        assert tree_equal(ens[i], model)
    # The shared part is member 0's: the model `make` builds with member 0's key.
    key = jax.random.key(7)
    ens = ee.ensemble(make, size=SIZE, key=key, shared=backbone)
    alone = make(jax.random.split(key, SIZE)[0])
    assert tree_equal(ens.shared.layers[0], alone.layers[0])
    # The stacked parts are those of a plain ensemble made with the same key.
    plain = ee.ensemble(make, size=SIZE, key=key)
    assert_tree_allclose(ens.members.layers[1:], plain.members.layers[1:])


def test_forward_map_predict_and_average_equal_rebuilt_members(getkey, data):
    x, _ = data
    ens = ee.ensemble(make, size=SIZE, key=getkey(), shared=backbone)
    expected = jnp.stack([jax.vmap(m)(x) for m in plain_members(ens)])
    assert_tree_allclose(ee.map(lambda m, xs: jax.vmap(m)(xs), ens, x), expected)
    assert_tree_allclose(ee.predict(ens, x), expected)
    assert_tree_allclose(
        ee.map(lambda m, xs: jax.vmap(m)(xs), ens, x, chunk_size=3), expected
    )
    assert_tree_allclose(ens(x[0]), expected[:, 0])
    soup = ee.average(ens)
    assert tree_equal(soup.layers[0], ens.shared.layers[0])
    mean = jax.tree.map(
        lambda *ws: (
            (functools.reduce(jnp.add, ws) / SIZE) if eqx.is_array(ws[0]) else ws[0]
        ),
        *plain_members(ens),
    )
    assert_tree_allclose(soup, mean)


def test_slicing_unstack_stack_concatenate_round_trip(getkey):
    ens = ee.ensemble(make, size=SIZE, key=getkey(), shared=backbone)
    sub = ens[1:3]
    assert len(sub) == 2 and sub.shared is ens.shared
    assert tree_equal(sub[0], ens[1])
    picked = ens[jnp.array([3, 0])]
    assert tree_equal(picked[0], ens[3]) and tree_equal(picked[1], ens[0])
    models = ee.unstack(ens)
    assert all(tree_equal(m, e) for m, e in zip(models, plain_members(ens)))
    again = ee.stack(models, shared=backbone)
    assert tree_equal(again, ens)
    joined = ee.concatenate([ens, ens[:2]])
    assert len(joined) == SIZE + 2 and tree_equal(joined[SIZE + 1], ens[1])


def test_save_load_round_trip(tmp_path, getkey):
    ens = ee.ensemble(make, size=SIZE, key=getkey(), shared=backbone, train_shared=True)
    ee.save(tmp_path / "ens.eqx", ens)
    back = ee.load(tmp_path / "ens.eqx", like=ens)
    assert tree_equal(back, ens)
    assert back.train_shared


def test_frozen_shared_part_has_no_gradient_no_state_and_members_train_alone(
    getkey, data
):
    ens = ee.ensemble(make, size=SIZE, key=getkey(), shared=backbone)
    opt = optax.adam(1e-2)
    opt_state = ee.init_optimizer(opt, ens)
    # Exactly the state of the stacked part: nothing for the backbone.
    expected_state = eqx.filter_vmap(opt.init)(
        eqx.filter(ens.members, eqx.is_inexact_array)
    )
    assert tree_equal(opt_state, expected_state)
    assert opt_state[0].mu.layers[0].weight is None
    step = ee.make_step(loss_fn, opt)
    ens1, state1 = ens, opt_state
    for i in range(3):
        ens1, state1, *_ = step(ens1, state1, data, jax.random.key(i))
    assert tree_equal(ens1.shared, ens.shared)
    # Member i alone, by hand: optax on its stacked part, the backbone closed over.
    with jax.numpy_dtype_promotion("standard"):
        hand = [train_alone(ens, opt, data, i) for i in range(SIZE)]
    for i in range(SIZE):
        assert_tree_allclose(ens1[i], hand[i], rtol=1e-4)


def train_alone(ens, opt, data, i):
    part = jax.tree.map(
        lambda leaf: leaf[i] if eqx.is_array(leaf) else leaf, ens.members
    )
    state = opt.init(eqx.filter(part, eqx.is_inexact_array))
    for _ in range(3):
        grads = eqx.filter_grad(
            lambda p: loss_fn(eqx.combine(p, ens.shared), data, None)
        )(part)
        updates, state = opt.update(grads, state, part)
        part = eqx.apply_updates(part, updates)
    return eqx.combine(part, ens.shared)


def test_trained_shared_part_gets_one_state_and_the_sum_of_gradients(getkey, data):
    ens = ee.ensemble(make, size=SIZE, key=getkey(), shared=backbone, train_shared=True)
    opt = optax.adam(1e-2)
    opt_state = ee.init_optimizer(opt, ens)
    assert isinstance(opt_state, ee.SharedOptState)
    assert opt_state.shared[0].mu.layers[0].weight.shape == (8, 3)
    step = ee.make_step(loss_fn, opt)
    got, got_state = ens, opt_state
    for i in range(3):
        got, got_state, losses, *_ = step(got, got_state, data, jax.random.key(i))
    # By hand: each member's gradient on its own model; the shared part's is the
    # sum over members of d loss_i / d shared; one optax state for it.
    parts = [
        jax.tree.map(
            lambda leaf, i=i: leaf[i] if eqx.is_array(leaf) else leaf, ens.members
        )
        for i in range(SIZE)
    ]
    shared = ens.shared
    states = [opt.init(eqx.filter(p, eqx.is_inexact_array)) for p in parts]
    shared_state = opt.init(eqx.filter(shared, eqx.is_inexact_array))
    promotion = jax.numpy_dtype_promotion("standard")
    promotion.__enter__()
    for _ in range(3):
        grads = [
            eqx.filter_grad(lambda pair: loss_fn(eqx.combine(*pair), data, None))(
                (p, shared)
            )
            for p in parts
        ]
        shared_grad = jax.tree.map(
            lambda *g: functools.reduce(jnp.add, g), *[g[1] for g in grads]
        )
        new_parts = []
        for i, (p, (g, _)) in enumerate(zip(parts, grads)):
            updates, states[i] = opt.update(g, states[i], p)
            new_parts.append(eqx.apply_updates(p, updates))
        updates, shared_state = opt.update(shared_grad, shared_state, shared)
        shared = eqx.apply_updates(shared, updates)
        parts = new_parts
    promotion.__exit__(None, None, None)
    assert_tree_allclose(got.shared, shared, rtol=1e-4, atol=1e-5)
    for i in range(SIZE):
        assert_tree_allclose(
            got[i], eqx.combine(parts[i], shared), rtol=1e-4, atol=1e-5
        )


@pytest.mark.parametrize("train_shared", [False, True])
@pytest.mark.parametrize("sampling", ["shared", "bootstrap"])
def test_fit_equals_make_step_loop(getkey, data, train_shared, sampling):
    """`fit` drives the same update as `make_step` (its own loop, its own data
    sampling): with full batches and `Shared` data the two agree exactly."""
    ens = ee.ensemble(
        make, size=SIZE, key=getkey(), shared=backbone, train_shared=train_shared
    )
    opt = optax.sgd(0.05)
    result = ee.fit(
        ens,
        loss_fn,
        opt,
        data,
        steps=6,
        batch_size=32,
        key=jax.random.key(3),
        sampling=sampling,
        callbacks=(),
    )
    assert result.ensemble.train_shared == train_shared
    if not train_shared:
        assert tree_equal(result.ensemble.shared, ens.shared)
    if sampling == "shared":
        step = ee.make_step(loss_fn, opt)
        got, state = ens, ee.init_optimizer(opt, ens)
        for i in range(6):
            got, state, *_ = step(got, state, data, jax.random.key(i))
        assert_tree_allclose(result.ensemble, got, rtol=1e-4, atol=1e-5)
    else:
        assert np.isfinite(result.history.losses).all()


def test_stateful_members_with_a_shared_part(getkey):
    def make_bn(key):
        k1, k2 = jax.random.split(key)
        return eqx.nn.make_with_state(Net)(k1, k2)

    class Net(eqx.Module):
        body: eqx.nn.Linear
        norm: eqx.nn.BatchNorm
        head: eqx.nn.Linear

        def __init__(self, k1, k2):
            self.body = eqx.nn.Linear(3, 6, key=k1)
            self.norm = eqx.nn.BatchNorm(6, axis_name="batch", mode="batch")
            self.head = eqx.nn.Linear(6, 1, key=k2)

        def __call__(self, x, state):
            h, state = self.norm(jax.nn.relu(self.body(x)), state)
            return self.head(h), state

    ens, state = ee.ensemble(make_bn, size=3, key=getkey(), shared=lambda m: m.body)

    def loss(model, state, batch, key):
        out, state = jax.vmap(
            model, in_axes=(0, None), out_axes=(0, None), axis_name="batch"
        )(batch, state)
        return jnp.mean(out**2), state

    x = jax.random.normal(getkey(), (16, 3))
    result = ee.fit(
        ens,
        loss,
        optax.sgd(0.1),
        x,
        steps=4,
        batch_size=16,
        key=getkey(),
        state=state,
        callbacks=(),
    )
    assert tree_equal(result.ensemble.shared, ens.shared)
    # Member 1 by hand, with its own state slice.
    member_state = jax.tree.map(lambda s: s[1], state)
    opt = optax.sgd(0.1)
    part = jax.tree.map(
        lambda leaf: leaf[1] if eqx.is_array(leaf) else leaf, ens.members
    )
    opt_state = opt.init(eqx.filter(part, eqx.is_inexact_array))
    for _ in range(4):
        (_, member_state), grads = eqx.filter_value_and_grad(
            lambda p, s: loss(eqx.combine(p, ens.shared), s, x, None), has_aux=True
        )(part, member_state)
        updates, opt_state = opt.update(grads, opt_state, part)
        part = eqx.apply_updates(part, updates)
    assert_tree_allclose(result.ensemble[1], eqx.combine(part, ens.shared), rtol=1e-4)


def test_a_diverging_member_does_not_poison_the_trained_shared_part(getkey, data):
    ens = ee.ensemble(make, size=SIZE, key=getkey(), shared=backbone, train_shared=True)
    opt = optax.inject_hyperparams(optax.sgd)(learning_rate=0.01)
    rates = jnp.array([0.05, 0.05, 3e38, 0.05])
    result = ee.fit(
        ens,
        loss_fn,
        opt,
        data,
        steps=8,
        batch_size=32,
        key=getkey(),
        opt_state=ee.init_optimizer(opt, ens, hyperparams={"learning_rate": rates}),
        callbacks=(),
    )
    assert set(result.diverged) == {2}
    leaves = jax.tree.leaves(eqx.filter(result.ensemble, eqx.is_array))
    assert all(np.isfinite(np.asarray(leaf)).all() for leaf in leaves)
    # The diverged member keeps its last finite weights; the shared part and the
    # other members went on training (their losses fell).
    assert not tree_equal(result.ensemble.shared, ens.shared)
    losses = result.history.losses
    for member in (0, 1, 3):
        assert losses[-1, member] < losses[0, member]


def test_trackers_and_evaluation_keep_the_shared_part(getkey, data):
    ens = ee.ensemble(make, size=SIZE, key=getkey(), shared=backbone, train_shared=True)
    result = ee.fit(
        ens,
        loss_fn,
        optax.adam(1e-2),
        data,
        steps=6,
        batch_size=16,
        key=getkey(),
        track=[ee.EMA(0.5)],
        evaluate=ee.Evaluate(loss_fn, data, every=2),
        callbacks=(),
    )
    ema = result.tracked[0]
    assert tree_equal(ema.shared, result.ensemble.shared)
    assert result.best_ensemble is not None
    assert np.isfinite(result.history.eval_scores).all()


@pytest.mark.parametrize("explicit", [False, True])
def test_sharded_training_replicates_the_shared_part(getkey, data, explicit):
    ens = ee.ensemble(make, size=8, key=getkey(), shared=backbone, train_shared=True)
    axis_type = (
        jax.sharding.AxisType.Explicit if explicit else jax.sharding.AxisType.Auto
    )
    mesh = ee.make_mesh(members=4, data=2, axis_types=axis_type)
    placed = ee.shard(ens, mesh)
    assert placed.members.layers[1].weight.sharding.spec[0] == "members"
    assert placed.shared.layers[0].weight.sharding.is_fully_replicated
    opt = optax.sgd(0.05)
    step = ee.make_step(loss_fn, opt)
    plain, state = ens, ee.init_optimizer(opt, ens)
    plain, *_ = step(plain, state, data, jax.random.key(0))
    sharded_step = ee.make_step(loss_fn, opt, execution=ee.Execution(mesh=mesh))
    got, got_state, *_ = sharded_step(
        placed, ee.shard(ee.init_optimizer(opt, ens), mesh), data, jax.random.key(0)
    )
    assert got.shared.layers[0].weight.sharding.is_fully_replicated
    assert_tree_allclose(got, plain, rtol=1e-4, atol=1e-5)


def test_bad_selections_are_refused(getkey):
    with pytest.raises(ValueError, match="picks no array leaf"):
        ee.ensemble(make, size=2, key=getkey(), shared=lambda m: m.activation)
    with pytest.raises(ValueError, match="picks every array leaf"):
        ee.ensemble(make, size=2, key=getkey(), shared=lambda m: m.layers)
    with pytest.raises(ValueError, match="needs a shared part"):
        ee.ensemble(make, size=2, key=getkey(), train_shared=True)
    with pytest.raises(ValueError, match="calling it failed"):
        ee.ensemble(make, size=2, key=getkey(), shared=lambda m: m.backbone)
    models = [make(k) for k in jax.random.split(getkey(), 3)]
    with pytest.raises(
        ValueError,
        match=r"model 0 and model 1 differ at leaf "
        r"`\.layers\[0\]\.weight`",
    ):
        ee.stack(models, shared=backbone)
    a = ee.ensemble(make, size=2, key=getkey(), shared=backbone)
    b = ee.ensemble(make, size=2, key=getkey(), shared=backbone)
    with pytest.raises(ValueError, match="ensemble 0 and ensemble 1 differ"):
        ee.concatenate([a, b])


def test_filter_specification_selects_the_same_leaves(getkey):
    key = getkey()
    by_function = ee.ensemble(make, size=3, key=key, shared=backbone)
    model = make(key)
    spec = jax.tree.map(lambda _: False, model)
    spec = eqx.tree_at(
        backbone, spec, replace_fn=lambda n: jax.tree.map(lambda _: True, n)
    )
    by_spec = ee.ensemble(make, size=3, key=key, shared=spec)
    assert tree_equal(by_function, by_spec)


# --- Efficient-ensemble layers (ee.nn) ------------------------------------------


def make_batch_ensemble(key):
    k1, k2 = jax.random.split(key)
    return eqx.nn.Sequential(
        [
            ee.nn.BatchEnsembleLinear(3, 16, key=k1),
            eqx.nn.Lambda(jax.nn.relu),
            ee.nn.BatchEnsembleLinear(16, 2, key=k2),
        ]
    )


def test_batch_ensemble_linear_is_the_closed_form(getkey):
    layer = ee.nn.BatchEnsembleLinear(3, 4, key=getkey())
    x = jax.random.normal(getkey(), (3,))
    expected = layer.s * (layer.weight @ (layer.r * x)) + layer.bias
    assert_tree_allclose(layer(x), expected)
    assert set(np.unique(np.asarray(layer.r))) <= {-1.0, 1.0}
    conv = ee.nn.BatchEnsembleConv(1, 2, 3, 3, padding=1, key=getkey())
    xs = jax.random.normal(getkey(), (2, 7))
    plain = eqx.nn.Conv(1, 2, 3, 3, padding=1, use_bias=False, key=getkey())
    plain = eqx.tree_at(lambda c: c.weight, plain, conv.conv.weight)
    expected = conv.s[:, None] * plain(conv.r[:, None] * xs) + conv.bias[:, None]
    assert_tree_allclose(conv(xs), expected)


def test_lora_linear_is_the_closed_form(getkey):
    base = eqx.nn.Linear(5, 3, key=getkey())
    layer = ee.nn.LoRALinear(base, rank=2, alpha=4.0, key=getkey())
    layer = eqx.tree_at(lambda m: m.b, layer, jax.random.normal(getkey(), (3, 2)))
    x = jax.random.normal(getkey(), (5,))
    expected = base.weight @ x + base.bias + (4.0 / 2) * (layer.b @ (layer.a @ x))
    assert_tree_allclose(layer(x), expected)
    # Member i of an adapter ensemble is base + its own adapter.
    ens = ee.ensemble(
        lambda k: ee.nn.lora(base, rank=2, key=k),
        size=3,
        key=getkey(),
        shared=ee.nn.lora_base,
    )
    ens = eqx.tree_at(
        lambda e: e.members.b, ens, jax.random.normal(getkey(), (3, 3, 2))
    )
    out = ee.predict(ens, x[None])[:, 0]
    for i in range(3):
        a, b = ens.members.a[i], ens.members.b[i]
        assert_tree_allclose(out[i], base.weight @ x + base.bias + b @ (a @ x))


def test_batch_ensemble_holds_the_slow_weight_once_and_never_copies_it(getkey):
    ens = ee.ensemble(
        make_batch_ensemble,
        size=8,
        key=getkey(),
        shared=ee.nn.slow_weights,
        train_shared=True,
    )
    assert ens.shared.layers[0].weight.shape == (16, 3)
    assert ens.members.layers[0].weight is None
    assert ens.members.layers[0].r.shape == (8, 3)
    x = jax.random.normal(getkey(), (5, 3))
    expected = jnp.stack([jax.vmap(m)(x) for m in ee.unstack(ens)])
    assert_tree_allclose(ee.predict(ens, x), expected)
    # No array of shape (members, *slow weight) appears in the computation, in the
    # forward pass or in a training step: the slow weight meets all members at once.
    opt = optax.adam(1e-3)
    step = ee.make_step(loss_fn, opt)
    y = jnp.zeros((5, 2))
    for fn, args in [
        (lambda e, xs: ee.predict(e, xs), (ens, x)),
        (step, (ens, ee.init_optimizer(opt, ens), (x, y), getkey())),
    ]:
        jaxpr = eqx.filter_make_jaxpr(fn)(*args)[0]
        shapes = {
            tuple(var.aval.shape)
            for eqn in _all_eqns(jaxpr.jaxpr)
            for var in eqn.outvars
            if hasattr(var.aval, "shape")
        }
        assert (8, 16, 3) not in shapes and (8, 2, 16) not in shapes


def _all_eqns(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        for param in eqn.params.values():
            inner = getattr(param, "jaxpr", param)
            if hasattr(inner, "eqns"):
                yield from _all_eqns(inner)


def test_batch_ensemble_trains_like_members_built_by_hand(getkey, data):
    ens = ee.ensemble(
        make_batch_ensemble,
        size=SIZE,
        key=getkey(),
        shared=ee.nn.slow_weights,
        train_shared=True,
    )
    opt = optax.sgd(0.05)
    step = ee.make_step(loss_fn, opt)
    got, state, *_ = step(ens, ee.init_optimizer(opt, ens), data, getkey())
    # By hand: the slow weights move by the SUM of the members' gradients.
    members = ee.unstack(ens)
    grads = [eqx.filter_grad(loss_fn)(m, data, None) for m in members]
    with jax.numpy_dtype_promotion("standard"):
        slow = ens.shared.layers[0].weight - 0.05 * functools.reduce(
            jnp.add, [g.layers[0].weight for g in grads]
        )
        r1 = members[1].layers[0].r - 0.05 * grads[1].layers[0].r
    assert_tree_allclose(got.shared.layers[0].weight, slow, rtol=1e-4, atol=1e-6)
    assert_tree_allclose(got[1].layers[0].r, r1, rtol=1e-4, atol=1e-6)


def test_lora_adapter_ensemble_over_a_frozen_base(getkey, data):
    base = eqx.nn.MLP(3, 2, 16, 2, key=getkey())
    ens = ee.ensemble(
        lambda k: ee.nn.lora(base, rank=2, key=k),
        size=SIZE,
        key=getkey(),
        shared=ee.nn.lora_base,
    )
    assert ens.shared.layers[1].base.weight.shape == (16, 16)
    assert tree_equal(ens.shared.layers[1].base, base.layers[1])
    assert ens.members.layers[1].a.shape == (SIZE, 2, 16)
    assert ens.members.layers[1].base.weight is None
    x, _ = data
    # Fresh adapters (b = 0) leave the base's output unchanged.
    assert_tree_allclose(
        ee.predict(ens, x), jnp.broadcast_to(jax.vmap(base)(x), (SIZE, 32, 2))
    )
    result = ee.fit(
        ens,
        loss_fn,
        optax.adam(1e-2),
        data,
        steps=5,
        batch_size=32,
        key=getkey(),
        callbacks=(),
    )
    assert tree_equal(result.ensemble.shared, ens.shared)  # the base is frozen
    moved = result.ensemble.members.layers[1].b
    assert bool(jnp.all(jnp.abs(moved).sum(axis=(1, 2)) > 0))  # every adapter trained
    only_adapters = ee.nn.lora(
        base, rank=2, key=getkey(), where=lambda layer: layer.out_features == 2
    )
    assert isinstance(only_adapters.layers[2], ee.nn.LoRALinear)
    assert isinstance(only_adapters.layers[0], eqx.nn.Linear)


def test_layer_helpers_refuse_models_without_their_layers(getkey):
    with pytest.raises(ValueError, match="no BatchEnsemble layer"):
        ee.ensemble(make, size=2, key=getkey(), shared=ee.nn.slow_weights)
    with pytest.raises(ValueError, match="no LoRA adapter"):
        ee.ensemble(make, size=2, key=getkey(), shared=ee.nn.lora_base)
    with pytest.raises(ValueError, match="no `eqx.nn.Linear`"):
        ee.nn.lora(eqx.nn.Lambda(jnp.tanh), rank=1, key=getkey())
    with pytest.raises(ValueError, match="positive int"):
        ee.nn.LoRALinear(eqx.nn.Linear(2, 2, key=getkey()), rank=0, key=getkey())


def test_per_member_hyperparameters_on_the_shared_state_are_refused(getkey):
    ens = ee.ensemble(make, size=SIZE, key=getkey(), shared=backbone, train_shared=True)
    opt = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
    state = ee.init_optimizer(
        opt, ens, hyperparams={"learning_rate": jnp.array([0.1, 0.2, 0.3, 0.4])}
    )
    # The members' states take the per-member values; the shared state keeps one.
    assert state.members.hyperparams["learning_rate"].shape == (SIZE,)
    assert float(state.shared.hyperparams["learning_rate"]) == pytest.approx(0.1)
    with pytest.raises(ValueError, match="held once in this optimizer state"):
        ee.set_hyperparams(state.shared, {"learning_rate": jnp.ones(SIZE)}, size=SIZE)
    one = ee.set_hyperparams(state.shared, {"learning_rate": 0.5}, size=SIZE)
    assert float(one.hyperparams["learning_rate"]) == pytest.approx(0.5)


def test_inference_mode_reaches_members_with_a_shared_part(getkey):
    base = eqx.nn.MultiheadAttention(2, 8, dropout_p=0.5, key=getkey())
    ens = ee.ensemble(
        lambda k: ee.nn.lora(base, rank=1, key=k),
        size=3,
        key=getkey(),
        shared=ee.nn.lora_base,
    )
    assert not ens[0].dropout.inference
    assert eqx.nn.inference_mode(ens)[0].dropout.inference

    def make_dropout(key):
        k1, k2 = jax.random.split(key)
        return eqx.nn.Sequential(
            [
                eqx.nn.Linear(4, 8, key=k1),
                eqx.nn.Dropout(0.5),
                eqx.nn.Linear(8, 2, key=k2),
            ]
        )

    ens = ee.ensemble(make_dropout, size=3, key=getkey(), shared=lambda m: m.layers[0])
    x = jax.random.normal(getkey(), (5, 4))
    # ee.predict switches dropout off: outputs do not depend on the key and equal
    # the members run by hand in inference mode.
    a = ee.predict(ens, x, key=getkey())
    b = ee.predict(ens, x, key=getkey())
    assert_tree_allclose(a, b)
    by_hand = jnp.stack([jax.vmap(eqx.nn.inference_mode(ens[i]))(x) for i in range(3)])
    assert_tree_allclose(a, by_hand)


def test_a_shared_leaf_given_a_member_axis_is_refused_by_name(getkey, data):
    ens = ee.ensemble(make, size=SIZE, key=getkey(), shared=backbone)
    weight = ens.shared.layers[0].weight
    stacked = jnp.broadcast_to(weight, (SIZE, *weight.shape))
    broken = eqx.tree_at(lambda e: e.shared.layers[0].weight, ens, stacked)
    message = r"shared leaf `\.layers\[0\]\.weight` has shape \(4, 8, 3\).*member axis"
    with pytest.raises(ValueError, match=message):
        ee.predict(broken, data[0])
    opt = optax.sgd(0.1)
    step = ee.make_step(loss_fn, opt)
    with pytest.raises(ValueError, match=message):
        step(broken, ee.init_optimizer(opt, broken), data, getkey())
    with pytest.raises(ValueError, match=message):
        broken[0]


def test_fit_on_a_mesh_and_from_a_stream_with_a_shared_part(getkey, data):
    ens = ee.ensemble(make, size=8, key=getkey(), shared=backbone, train_shared=True)
    opt = optax.sgd(0.05)
    step = ee.make_step(loss_fn, opt)
    expected, state = ens, ee.init_optimizer(opt, ens)
    for i in range(4):
        expected, state, *_ = step(expected, state, data, jax.random.key(i))
    # A stream of the full batch: the same updates as the hand-written loop.
    streamed = ee.fit(
        ens,
        loss_fn,
        opt,
        lambda start: iter([data] * (4 - start)),
        steps=4,
        key=getkey(),
        callbacks=(),
    )
    assert_tree_allclose(streamed.ensemble, expected, rtol=1e-4, atol=1e-5)
    mesh = ee.make_mesh(members=4, data=2)
    sharded = ee.fit(
        ens,
        loss_fn,
        opt,
        data,
        steps=4,
        batch_size=32,
        key=getkey(),
        callbacks=(),
        execution=ee.Execution(mesh=mesh),
    )
    assert sharded.ensemble.shared.layers[0].weight.sharding.is_fully_replicated
    assert_tree_allclose(sharded.ensemble, expected, rtol=1e-4, atol=1e-5)


def _failing_loss(kind):
    """`loss_fn`, and for the member whose `hyper` is 1: a NaN loss, a forward
    pass that overflows, or a finite loss whose gradient is NaN (the
    unselected branch of a `where`: `0 * nan`), at every step."""

    def loss(model, batch, key, hyper):
        x, y = batch
        out = jax.vmap(model)(x)
        if kind == "overflow":
            out = (
                out * jnp.where(hyper > 0, 1e38, 1.0) * jnp.where(hyper > 0, 1e38, 1.0)
            )
        base = jnp.mean((out - y) ** 2)
        if kind == "nan_loss":
            return jnp.where(hyper > 0, jnp.nan, base)
        if kind == "nan_gradient":
            s = jnp.sum(out)
            bad = jnp.sqrt(hyper * (-1.0 - s**2) + (1 - hyper))
            return base + jnp.where(True, 0.0, bad)
        return base

    return loss


@pytest.mark.parametrize("kind", ["nan_loss", "overflow", "nan_gradient"])
def test_a_diverged_member_drops_out_of_the_shared_gradient(getkey, data, kind):
    # Issue 47, item 13: against a loop BY HAND over the healthy members (the
    # shared part gets the sum of their gradients, from the step the failing
    # member diverges at, that step included).
    ens = ee.ensemble(make, size=SIZE, key=getkey(), shared=backbone, train_shared=True)
    flags = jnp.array([0.0, 0.0, 1.0, 0.0])
    loss = _failing_loss(kind)
    opt = optax.sgd(0.05)
    steps = 6
    result = ee.fit(
        ens, loss, opt, data, steps=steps, batch_size=32, key=getkey(),
        hyper=flags, callbacks=(),
    )  # fmt: skip
    assert set(result.diverged) == {2}
    healthy = [0, 1, 3]
    own = [  # member i's own leaves (None where the shared part goes)
        jax.tree.map(lambda leaf: leaf[i] if eqx.is_array(leaf) else leaf, ens.members)
        for i in healthy
    ]
    parts = [eqx.filter(member, eqx.is_inexact_array) for member in own]
    statics = [eqx.filter(member, eqx.is_inexact_array, inverse=True) for member in own]
    shared, shared_static = eqx.partition(ens.shared, eqx.is_inexact_array)

    def total(parts, shared):
        backbone = eqx.combine(shared, shared_static)
        return sum(
            loss_fn(eqx.combine(eqx.combine(p, s), backbone), data, None)
            for p, s in zip(parts, statics, strict=True)
        )

    for _ in range(steps):
        grads, shared_grads = jax.grad(total, argnums=(0, 1))(parts, shared)
        parts = jax.tree.map(lambda p, g: p - 0.05 * g, parts, grads)
        shared = jax.tree.map(lambda p, g: p - 0.05 * g, shared, shared_grads)
    got_shared = eqx.filter(result.ensemble.shared, eqx.is_inexact_array)
    assert_tree_allclose(got_shared, shared, rtol=1e-5, atol=1e-6)
    for position, i in enumerate(healthy):
        got = jax.tree.map(
            lambda leaf: leaf[i] if eqx.is_array(leaf) else leaf,
            eqx.filter(result.ensemble.members, eqx.is_inexact_array),
        )
        assert_tree_allclose(got, parts[position], rtol=1e-5, atol=1e-6)
    # The diverged member keeps the weights it had before its first step.
    for got, start in zip(
        jax.tree.leaves(eqx.filter(result.ensemble.members, eqx.is_array)),
        jax.tree.leaves(eqx.filter(ens.members, eqx.is_array)),
        strict=True,
    ):
        np.testing.assert_array_equal(np.asarray(got[2]), np.asarray(start[2]))


N = 48
X = np.asarray(jax.random.normal(jax.random.key(10), (N, 2)), dtype=np.float32)
Y = np.sin(2 * X[:, :1]) + X[:, 1:] ** 2
KEY = jax.random.key(5)


def test_a_member_whose_forward_overflows_drops_out_of_the_shared_gradient():
    def make(key):
        return eqx.nn.MLP(2, 1, 8, 1, key=key)

    def backbone(model):
        return model.layers[0]

    def loss(model, batch, key):
        x, y = batch
        return jnp.mean((jax.vmap(model)(x) - y) ** 2)

    ens = ee.ensemble(make, size=4, key=jax.random.key(3), shared=backbone,
                      train_shared=True)  # fmt: skip
    # Member 2's head weights are finite but so large (3e38) that its output
    # overflows to inf at every step with the weights it keeps (its gradient is
    # NaN: inf * 0): it diverges at step 0.
    ens = eqx.tree_at(
        lambda e: e.members.layers[1].weight,
        ens,
        ens.members.layers[1].weight.at[2].set(3e38),
    )
    rate, steps = 0.05, 6
    data = (jnp.asarray(X), jnp.asarray(Y))
    result = ee.fit(
        ens, loss, optax.sgd(rate), data, steps=steps, batch_size=N, key=KEY,
        callbacks=(),
    )  # fmt: skip
    assert result.diverged == {2: 1}  # its first step (steps count from 1)
    # By hand: the healthy members train from step 0, and so does the shared
    # part, with the sum of the HEALTHY members' gradients (member 2 drops out
    # at the step it diverges at, that step included: step 0 here).
    healthy = [0, 1, 3]
    shared = ens.shared
    members = [
        jax.tree.map(lambda a, i=i: a[i] if eqx.is_array(a) else a, ens.members)
        for i in healthy
    ]

    def total(parts):
        shared, members = parts
        return sum(loss(eqx.combine(m, shared), data, None) for m in members)

    for step in range(steps):
        shared_grad, member_grads = eqx.filter_grad(total)((shared, members))
        members = [
            eqx.apply_updates(m, jax.tree.map(lambda g: -rate * g, grad))
            for m, grad in zip(members, member_grads, strict=True)
        ]
        shared = eqx.apply_updates(
            shared, jax.tree.map(lambda g: -rate * g, shared_grad)
        )
    assert not tree_equal(shared, ens.shared)
    np.testing.assert_allclose(
        result.ensemble.shared.layers[0].weight,
        shared.layers[0].weight,
        rtol=2e-5,
        atol=1e-6,
    )
    for position, member in enumerate(healthy):
        mine = jax.tree.map(
            lambda a, m=member: a[m] if eqx.is_array(a) else a, result.ensemble.members
        )
        np.testing.assert_allclose(
            mine.layers[1].weight, members[position].layers[1].weight,
            rtol=2e-5, atol=1e-6,
        )  # fmt: skip
    # The diverged member's later losses are not computed: NaN, not its stand-in's.
    assert np.isnan(result.history.losses[1:, 2]).all()
