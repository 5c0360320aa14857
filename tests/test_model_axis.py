"""The `"model"` mesh axis: the inside of a member split over devices (issue 27,
item 1), on 8 virtual CPU devices (see conftest). Every run is compared with the
same run on one device, and the placement of every weight (and of the optimizer
state that follows it) is asserted on the arrays themselves, so a silent gather
or a dropped split fails."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, PartitionSpec as P

import eqx_ensemble as ee

W = 16


def ensemble(size=4, key=0):
    return ee.ensemble(
        lambda k: eqx.nn.MLP(2, 1, W, 2, key=k), size=size, key=jax.random.key(key)
    )


def megatron(member):
    """First layer by rows, second by columns, the head replicated."""
    specs = eqx.tree_at(
        lambda m: (m.layers[0].weight, m.layers[0].bias, m.layers[1].weight),
        member,
        (P("model", None), P("model"), P(None, "model")),
    )
    return jax.tree.map(lambda s: s if isinstance(s, P) else None, specs)


EXPECTED = {  # leaf -> its spec after the member axis
    ".layers[0].weight": ("model", None),
    ".layers[0].bias": ("model",),
    ".layers[1].weight": (None, "model"),
    ".layers[1].bias": (None,),
    ".layers[2].weight": (None, None),
    ".layers[2].bias": (None,),
}

X = jnp.stack([jnp.linspace(-1, 1, 64), jnp.cos(jnp.linspace(0, 3, 64))], axis=1)
Y = jnp.sin(X[:, :1]) + X[:, 1:]


def loss(model, batch, key):
    x, y = batch
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


def entries(array):
    spec = tuple(array.sharding.spec)
    return spec + (None,) * (array.ndim - len(spec))


def assert_megatron(members, leading=("members",)):
    arrays = eqx.filter(members, eqx.is_array)
    for path, leaf in jax.tree_util.tree_flatten_with_path(arrays)[0]:
        name = jax.tree_util.keystr(path)
        assert entries(leaf) == (*leading, *EXPECTED[name]), (name, leaf.sharding)


def assert_close(got, want, atol=2e-6):
    got = jax.tree.leaves(eqx.filter(got, eqx.is_array))
    want = jax.tree.leaves(eqx.filter(want, eqx.is_array))
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=atol)


def mesh_of(axis_types):
    return ee.make_mesh(members=2, data=2, model=2, axis_types=axis_types)


def test_make_mesh_puts_the_model_axis_innermost():
    mesh = ee.make_mesh(members=2, data=2, model=2)
    assert mesh.axis_names == ("members", "data", "model")
    assert dict(mesh.shape) == {"members": 2, "data": 2, "model": 2}
    # Adjacent devices along "model": the fastest links carry a member's traffic.
    ids = np.vectorize(lambda d: d.id)(mesh.devices)
    assert (ids[..., 1] - ids[..., 0] == 1).all()
    assert ee.make_mesh(model=8).axis_names == ("model",)


def test_shard_splits_each_member_and_holds_half_per_device():
    mesh = mesh_of(AxisType.Auto)
    ens = ee.shard(ensemble(), mesh, model=megatron)
    assert_megatron(ens.members)
    weight = ens.members.layers[1].weight  # (4, 16, 16)
    shard_shape = weight.addressable_shards[0].data.shape
    assert shard_shape == (2, 16, 8)  # members / 2, columns / 2
    # The same values, wherever they live.
    assert_close(ens, ensemble(), atol=0)


def test_fit_keeps_the_split_and_equals_one_device():
    opt = optax.adam(1e-2)
    kwargs = dict(steps=12, batch_size=16, key=jax.random.key(1), callbacks=())
    want = ee.fit(ensemble(), loss, opt, (X, Y), **kwargs)
    mesh = mesh_of(AxisType.Auto)
    ens = ee.shard(ensemble(), mesh, model=megatron)
    got = ee.fit(ens, loss, opt, (X, Y), execution=ee.Execution(mesh=mesh), **kwargs)
    assert_close(got.ensemble, want.ensemble)
    np.testing.assert_allclose(got.history.losses, want.history.losses, atol=2e-6)
    assert_megatron(got.ensemble.members)
    adam = got.opt_state[0]  # the optimizer state follows its weights
    assert_megatron(adam.mu)
    assert_megatron(adam.nu)


class Wide(eqx.Module):
    """A member whose only split axis is never contracted: on an Explicit mesh
    a contraction over a split axis needs the model to say where its output
    goes (`out_sharding`), as JAX's explicit sharding requires."""

    layer: eqx.nn.Linear

    def __init__(self, key):
        self.layer = eqx.nn.Linear(2, W, key=key)

    def __call__(self, x):
        return jnp.mean(jnp.tanh(self.layer(x)), keepdims=True)


def rows(member):
    specs = eqx.tree_at(
        lambda m: (m.layer.weight, m.layer.bias), member, (P("model"), P("model"))
    )
    return jax.tree.map(lambda s: s if isinstance(s, P) else None, specs)


def test_fit_on_an_explicit_mesh_keeps_the_split():
    wide = ee.ensemble(Wide, size=4, key=jax.random.key(0))
    opt = optax.adam(1e-2)
    kwargs = dict(steps=8, batch_size=16, key=jax.random.key(1), callbacks=())
    want = ee.fit(wide, loss, opt, (X, Y), **kwargs)
    mesh = mesh_of(AxisType.Explicit)
    placed = ee.shard(wide, mesh, model=rows)
    with jax.set_mesh(mesh):
        got = ee.fit(
            placed, loss, opt, (X, Y), execution=ee.Execution(mesh=mesh), **kwargs
        )
    assert_close(got.ensemble, want.ensemble)
    for leaf in (got.ensemble.members.layer.weight, got.opt_state[0].mu.layer.bias):
        assert entries(leaf)[:2] == ("members", "model")


def test_make_step_and_init_optimizer_keep_the_split():
    mesh = mesh_of(AxisType.Auto)
    opt = optax.adam(1e-2)
    batch = (X[:16], Y[:16])
    want = ee.make_step(loss, opt)(
        ensemble(), ee.init_optimizer(opt, ensemble()), batch, jax.random.key(3)
    )
    ens = ee.shard(ensemble(), mesh, model=megatron)
    with jax.set_mesh(mesh):
        opt_state = ee.shard(ee.init_optimizer(opt, ens), mesh)
        assert_megatron(opt_state[0].mu)
        step = ee.make_step(loss, opt, execution=ee.Execution(mesh=mesh))
        got = step(
            ens, opt_state, ee.shard(batch, mesh, axes="data"), jax.random.key(3)
        )
    assert_close(got.ensemble, want.ensemble)
    assert_megatron(got.ensemble.members)
    assert_megatron(got.opt_state[0].mu)


def test_a_shared_part_splits_over_model_and_is_replicated_over_members():
    mesh = mesh_of(AxisType.Auto)
    base = ensemble()
    shared = ee.ensemble(
        lambda k: eqx.nn.MLP(2, 1, W, 2, key=k),
        size=4,
        key=jax.random.key(0),
        shared=lambda m: m.layers[0],
    )
    placed = ee.shard(shared, mesh, model=megatron)
    weight = placed.shared.layers[0].weight
    assert entries(weight) == ("model", None)  # no member axis: not over "members"
    assert placed.members.layers[0].weight is None
    assert entries(placed.members.layers[1].weight) == ("members", None, "model")
    del base
    opt = optax.adam(1e-2)
    kwargs = dict(steps=6, batch_size=16, key=jax.random.key(1), callbacks=())
    want = ee.fit(shared, loss, opt, (X, Y), **kwargs)
    got = ee.fit(placed, loss, opt, (X, Y), execution=ee.Execution(mesh=mesh), **kwargs)
    assert_close(got.ensemble, want.ensemble)
    assert entries(got.ensemble.shared.layers[0].weight) == ("model", None)


def test_predict_and_save_load_round_trip(tmp_path):
    mesh = mesh_of(AxisType.Auto)
    ens = ee.shard(ensemble(), mesh, model=megatron)
    np.testing.assert_allclose(
        ee.predict(ens, X), ee.predict(ensemble(), X), rtol=0, atol=1e-6
    )
    path = ee.save(tmp_path / "ens.eqx", ens)
    loaded = ee.load(path, ensemble(key=9))
    assert_close(loaded, ensemble(), atol=0)


def only(where, spec):
    """A spec_fn splitting one leaf (`where(member)`) and replicating the rest."""

    def spec_fn(member):
        specs = eqx.tree_at(where, member, spec)
        return jax.tree.map(lambda s: s if isinstance(s, P) else None, specs)

    return spec_fn


def test_bad_model_specs_are_refused_naming_the_leaf():
    mesh = mesh_of(AxisType.Auto)
    head = lambda m: m.layers[2].weight  # noqa: E731 - shape (1, 16)
    with pytest.raises(ValueError, match=r"layers\[2\]\.weight.*\(1, 16\).*axis 0"):
        ee.shard(ensemble(), mesh, model=only(head, P("model")))
    with pytest.raises(ValueError, match="only the mesh axis 'model'"):
        ee.shard(ensemble(), mesh, model=only(head, P(None, "members")))
    with pytest.raises(ValueError, match=r"3 axes.*shape \(1, 16\)"):
        ee.shard(ensemble(), mesh, model=only(head, P(None, "model", None)))
    with pytest.raises(ValueError, match="does not have"):
        ee.shard(ensemble(), ee.make_mesh(members=2), model=megatron)
    with pytest.raises(TypeError, match="pass an `ee.Ensemble`"):
        ee.shard((X, Y), mesh, model=megatron)
    with pytest.raises(ValueError, match="process_local"):
        ee.shard(ensemble(), mesh, model=megatron, process_local=True)
    with pytest.raises(ValueError, match="prefix"):
        ee.shard(ensemble(), mesh, model=lambda m: [P("model")] * 3)
    # Issue 47, item 4: the natural Equinox spelling filters every leaf out
    # (they are ShapeDtypeStructs), so nothing would split: refused.
    filtered = lambda m: jax.tree.map(  # noqa: E731
        lambda _: P("model"), eqx.filter(m, eqx.is_array)
    )
    with pytest.raises(ValueError, match="split no leaf.*ShapeDtypeStruct"):
        ee.shard(ensemble(), mesh, model=filtered)
    with pytest.raises(ValueError, match="split no leaf"):
        ee.shard(ensemble(), mesh, model=lambda m: None)


def test_resume_keeps_the_split_and_is_bit_exact(tmp_path):
    mesh = mesh_of(AxisType.Auto)
    opt = optax.adam(1e-2)
    kwargs = dict(
        steps=8, batch_size=16, key=jax.random.key(1),
        execution=ee.Execution(mesh=mesh, steps_per_dispatch=2),
    )  # fmt: skip
    ens = ee.shard(ensemble(), mesh, model=megatron)
    straight = ee.fit(ens, loss, opt, (X, Y), callbacks=(), **kwargs)

    class Stop(Exception):
        pass

    def interrupt(result):
        if result.step >= 4:
            raise Stop

    run = ee.Checkpoints(tmp_path / "run", every=2)
    with pytest.raises(Stop):
        ee.fit(ens, loss, opt, (X, Y), callbacks=[interrupt], checkpoints=run, **kwargs)
    resumed = ee.fit(ens, loss, opt, (X, Y), callbacks=(), checkpoints=run, **kwargs)
    assert resumed.resumed_from == 4
    assert_close(resumed.ensemble, straight.ensemble, atol=0)
    np.testing.assert_array_equal(resumed.history.losses, straight.history.losses)
    assert_megatron(resumed.ensemble.members)
    assert_megatron(resumed.opt_state[0].mu)


def test_trackers_evaluation_and_pbt_keep_the_split():
    # EMA averages, best members and PBT's copies between members are all
    # computed on model-split weights; each must come back split as it was.
    mesh = mesh_of(AxisType.Auto)
    opt = optax.inject_hyperparams(optax.adam)(learning_rate=0.01)
    rates = {"learning_rate": jnp.logspace(-3, -1, 4)}

    def score(model, data, key):
        return loss(model, data, key)

    def run(ens, callbacks, **extra):
        return ee.fit(
            ens, loss, opt, (X, Y), steps=8, batch_size=16, key=jax.random.key(1),
            opt_state=ee.init_optimizer(opt, ens, hyperparams=rates),
            evaluate=ee.Evaluate(score, (X[:16], Y[:16]), every=4),
            track=[ee.EMA(0.9)], callbacks=callbacks, **extra,
        )  # fmt: skip

    want = run(ensemble(), ())
    placed = ee.shard(ensemble(), mesh, model=megatron)
    got = run(placed, (), execution=ee.Execution(mesh=mesh))
    assert_close(got.ensemble, want.ensemble)
    assert_close(got.tracked[0], want.tracked[0])
    assert_close(got.best_ensemble, want.best_ensemble)
    for tree in (got.ensemble, got.tracked[0], got.best_ensemble):
        assert_megatron(tree.members)
    pbt = ee.PBT(every=4, fraction=0.25, hyperparams=("learning_rate",), seed=1)
    exploited = run(placed, [pbt], execution=ee.Execution(mesh=mesh))
    assert len(pbt.lineage(exploited)[0]) > 0  # members were copied
    assert_megatron(exploited.ensemble.members)
    assert_megatron(
        exploited.opt_state.members.mu
        if hasattr(exploited.opt_state, "members")
        else exploited.opt_state.inner_state[0].mu
    )


MESHES = {
    "one device": lambda: (None, None),
    "members 4 x data 2 (8 devices)": lambda: (ee.make_mesh(members=4, data=2), None),
    "members 2 (4 devices)": lambda: (ee.make_mesh(members=2), None),
    "members 2 x data 2 x model 2": lambda: (
        ee.make_mesh(members=2, data=2, model=2),
        megatron,
    ),
}


@pytest.mark.parametrize(
    "before, after",
    [
        ("members 4 x data 2 (8 devices)", "members 2 (4 devices)"),
        ("members 2 x data 2 x model 2", "one device"),
        ("one device", "members 2 x data 2 x model 2"),
    ],
)
def test_a_run_resumes_on_another_mesh(before, after, tmp_path):
    # A checkpoint holds whole arrays: the resumed run places them on its own
    # mesh (its own "model" split included) and continues the same run.
    opt = optax.adam(1e-2)
    common = dict(batch_size=16, key=jax.random.key(1), callbacks=())
    straight = ee.fit(ensemble(), loss, opt, (X, Y), steps=8, **common)

    def placed(name):
        mesh, spec_fn = MESHES[name]()
        ens = ensemble()
        if mesh is not None:
            ens = ee.shard(ens, mesh, model=spec_fn) if spec_fn else ee.shard(ens, mesh)
        return ens, ee.Execution(mesh=mesh, steps_per_dispatch=2)

    run = ee.Checkpoints(tmp_path / "run", every=2)
    ens, execution = placed(before)
    ee.fit(
        ens, loss, opt, (X, Y), steps=4, checkpoints=run, execution=execution, **common
    )
    ens, execution = placed(after)
    resumed = ee.fit(
        ens, loss, opt, (X, Y), steps=8, checkpoints=run, execution=execution, **common
    )
    assert resumed.resumed_from == 4
    assert_close(resumed.ensemble, straight.ensemble, atol=1e-6)
    weight = resumed.ensemble.members.layers[1].weight
    if MESHES[after]()[1] is not None:
        assert_megatron(resumed.ensemble.members)
    elif MESHES[after]()[0] is not None:
        assert entries(weight) == ("members", None, None)


def test_a_trained_shared_part_and_its_optimizer_state_keep_the_split():
    mesh = mesh_of(AxisType.Auto)
    shared = ee.ensemble(
        lambda k: eqx.nn.MLP(2, 1, W, 2, key=k),
        size=4,
        key=jax.random.key(0),
        shared=lambda m: m.layers[0],
        train_shared=True,
    )
    placed = ee.shard(shared, mesh, model=megatron)
    opt = optax.adam(1e-2)
    assert entries(ee.init_optimizer(opt, placed).shared[0].mu.layers[0].weight) == (
        "model",
        None,
    )
    kwargs = dict(steps=6, batch_size=16, key=jax.random.key(1), callbacks=())
    want = ee.fit(shared, loss, opt, (X, Y), **kwargs)
    got = ee.fit(placed, loss, opt, (X, Y), execution=ee.Execution(mesh=mesh), **kwargs)
    assert_close(got.ensemble, want.ensemble)
    assert entries(got.ensemble.shared.layers[0].weight) == ("model", None)
    assert entries(got.opt_state.shared[0].mu.layers[0].weight) == ("model", None)
    assert entries(got.opt_state.members[0].mu.layers[1].weight) == (
        "members",
        None,
        "model",
    )


def fsdp(member):
    """Every leaf whose first axis is the hidden width split over "model"."""
    return jax.tree.map(
        lambda leaf: P("model") if getattr(leaf, "shape", (0,))[:1] == (W,) else None,
        member,
    )


def test_swag_buffers_members_without_biases_and_other_meshes_keep_the_split():
    mesh = mesh_of(AxisType.Auto)
    opt = optax.adam(1e-2)
    kwargs = dict(steps=8, batch_size=16, key=jax.random.key(1), callbacks=())
    placed = ee.shard(ensemble(), mesh, model=megatron)
    swag = ee.fit(
        placed, loss, opt, (X, Y), track=[ee.SWAG(start=2, every=2, rank=2)],
        execution=ee.Execution(mesh=mesh), **kwargs,
    )  # fmt: skip
    tracked = swag.tracked[0]
    # A deviation buffer has a rank axis before the weight's own axes.
    assert entries(tracked.deviations.layers[1].weight) == (
        "members", None, None, "model",
    )  # fmt: skip
    assert entries(tracked.variance.layers[1].weight) == ("members", None, "model")
    # A member with no biases (None fields).
    plain = ee.ensemble(
        lambda k: eqx.nn.MLP(2, 1, W, 2, use_bias=False, key=k),
        size=4,
        key=jax.random.key(0),
    )
    split = ee.shard(
        plain, mesh, model=only(lambda m: m.layers[1].weight, P(None, "model"))
    )
    assert entries(split.members.layers[1].weight) == ("members", None, "model")
    # A run on another mesh with a "model" axis keeps the members' split.
    other = ee.make_mesh(members=2, model=4)
    moved = ee.fit(
        placed, loss, opt, (X, Y), execution=ee.Execution(mesh=other), **kwargs
    )
    weight = moved.ensemble.members.layers[1].weight
    assert weight.sharding.mesh == other
    assert entries(weight) == ("members", None, "model")
    # P(("model",)) is the same split as P("model").
    tupled = ee.shard(
        ensemble(), mesh, model=only(lambda m: m.layers[0].weight, P(("model",)))
    )
    assert entries(tupled.members.layers[0].weight) == ("members", "model", None)


def test_make_step_returns_every_weight_where_it_was():
    # On an Auto mesh the compiler could move an unconstrained output (e.g. a
    # replicated bias onto "model"); the step pins its outputs to its inputs'.
    mesh = mesh_of(AxisType.Auto)
    opt = optax.adam(1e-2)
    ens = ee.shard(ensemble(), mesh, model=fsdp)
    opt_state = ee.shard(ee.init_optimizer(opt, ens), mesh)
    step = ee.make_step(loss, opt, execution=ee.Execution(mesh=mesh))
    out = step(
        ens, opt_state, ee.shard((X[:16], Y[:16]), mesh, axes="data"), jax.random.key(0)
    )
    before = jax.tree.leaves(eqx.filter((ens, opt_state), eqx.is_array))
    after = jax.tree.leaves(eqx.filter((out.ensemble, out.opt_state), eqx.is_array))
    for a, b in zip(before, after, strict=True):
        assert a.sharding.is_equivalent_to(b.sharding, a.ndim), (a.sharding, b.sharding)


def test_an_optimizer_state_follows_the_right_weight_of_equal_shape():
    # Two weights of one shape, only one split: the moment of the unsplit one
    # must not take the other's split (matched by the longest path suffix).
    class Inner(eqx.Module):
        a: jax.Array

    class Two(eqx.Module):
        a: jax.Array
        inner: Inner

        def __init__(self, key):
            self.a = jax.random.normal(key, (8, 8))
            self.inner = Inner(jax.random.normal(jax.random.fold_in(key, 1), (8, 8)))

        def __call__(self, x):
            return jnp.sum(self.a @ self.inner.a) * x[:1]

    mesh = mesh_of(AxisType.Auto)
    two = ee.shard(
        ee.ensemble(Two, size=2, key=jax.random.key(0)),
        mesh,
        model=only(lambda m: m.a, P("model")),
    )
    state = ee.init_optimizer(optax.adam(1e-2), two)
    assert entries(state[0].mu.a) == ("members", "model", None)
    unsplit = state[0].mu.inner.a.sharding
    assert "model" not in tuple(getattr(unsplit, "spec", ()))
