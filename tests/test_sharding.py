"""Meshes, placement, and training on them (8 virtual CPU devices, see conftest).

Every sharded run is compared with the same run on one device (no mesh): sharding
must never change results, only where they live. Shardings are asserted on the
output arrays' `.sharding`, so a silent gather to one device fails.
"""

import functools
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import alternating, assert_tree_allclose, repeat
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

import eqx_ensemble as ee
from eqx_ensemble._core.data import SORT_ALONE_FROM, permutation
from eqx_ensemble._training.placement import OnMesh

MESHES = {
    "members": dict(members=8),
    "data": dict(data=8),
    "2d": dict(members=2, data=4),
}
AXIS_TYPES = [AxisType.Auto, AxisType.Explicit]


def _mlp_ensemble(size=8, key=0):
    return ee.ensemble(
        lambda k: eqx.nn.MLP(2, 1, 8, 1, key=k), size=size, key=jax.random.key(key)
    )


def _data(n=64):
    x = jnp.stack(
        [jnp.linspace(-1.0, 1.0, n), jnp.cos(jnp.linspace(0.0, 3.0, n))], axis=1
    )
    y = jnp.sin(2.0 * x[:, :1]) + x[:, 1:]
    return x, y


def _loss(model, batch, key):
    x, y = batch
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


def _normalised(spec: PartitionSpec, ndim: int) -> tuple:
    entries = tuple(spec) + (None,) * (ndim - len(spec))
    return entries


def assert_placed(tree, mesh: Mesh, axes: tuple[str, ...]):
    """Every array leaf lives on `mesh`, split over `axes` (those the mesh has)."""
    expected = tuple(name if name in mesh.axis_names else None for name in axes)
    leaves = [leaf for leaf in jax.tree.leaves(tree) if isinstance(leaf, jax.Array)]
    assert leaves
    for leaf in leaves:
        sharding = leaf.sharding
        assert isinstance(sharding, NamedSharding), sharding
        assert sharding.mesh == mesh
        assert _normalised(sharding.spec, leaf.ndim) == _normalised(
            PartitionSpec(*expected), leaf.ndim
        ), (sharding.spec, expected)
        assert sharding.is_equivalent_to(
            NamedSharding(mesh, PartitionSpec(*expected)), leaf.ndim
        )


# --------------------------------------------------------------------------- mesh


def test_make_mesh_axes_and_types():
    mesh = ee.make_mesh(members=2, data=4)
    assert mesh.axis_names == ("members", "data")
    assert dict(mesh.shape) == {"members": 2, "data": 4}
    assert mesh.axis_types == (AxisType.Auto, AxisType.Auto)
    assert mesh.devices.size == 8
    only_members = ee.make_mesh(members=4)
    assert only_members.axis_names == ("members",)
    assert list(only_members.devices) == jax.devices()[:4]
    only_data = ee.make_mesh(data=2, axis_types=AxisType.Explicit)
    assert only_data.axis_names == ("data",)
    assert only_data.axis_types == (AxisType.Explicit,)
    everything = ee.make_mesh()
    assert dict(everything.shape) == {"members": 8}
    chosen = ee.make_mesh(members=2, devices=jax.devices()[6:])
    assert set(chosen.devices.ravel()) == set(jax.devices()[6:])


def test_make_mesh_errors():
    with pytest.raises(ValueError, match="needs 12 devices, but 8 are available"):
        ee.make_mesh(members=3, data=4)
    with pytest.raises(ValueError, match="needs 2 devices, but 3 are available"):
        ee.make_mesh(members=2, devices=jax.devices()[:3])
    with pytest.raises(ValueError, match="at least 1"):
        ee.make_mesh(members=0)
    # (beartype or our own check, depending on the jaxtyping hook)
    with pytest.raises(TypeError, match="data"):
        ee.make_mesh(data=2.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="Auto or AxisType.Explicit"):
        ee.make_mesh(members=2, axis_types=AxisType.Manual)


def test_foreign_meshes_are_checked():
    other = jax.make_mesh((8,), ("batch",), axis_types=(AxisType.Auto,))
    with pytest.raises(ValueError, match="axes named"):
        ee.shard(_mlp_ensemble(), other)
    mixed = jax.make_mesh(
        (2, 4), ("members", "data"), axis_types=(AxisType.Auto, AxisType.Explicit)
    )
    with pytest.raises(ValueError, match="all be AxisType.Auto or all"):
        ee.shard(_mlp_ensemble(), mixed)
    with pytest.raises(TypeError, match="mesh"):
        ee.shard(_mlp_ensemble(), "members")  # type: ignore[arg-type]
    # A mesh built by `jax.make_mesh` with our names works (Explicit by
    # default since JAX 0.9; Auto before) in either kind.
    for kind in (AxisType.Explicit, AxisType.Auto):
        theirs = jax.make_mesh((4, 2), ("members", "data"), axis_types=(kind, kind))
        assert_placed(ee.shard(_mlp_ensemble(), theirs), theirs, ("members",))


# ------------------------------------------------------------------------- shard


@pytest.mark.parametrize("axis_type", AXIS_TYPES, ids=lambda t: t.name)
def test_shard_ensemble_states_and_data(axis_type, getkey):
    mesh = ee.make_mesh(members=4, data=2, axis_types=axis_type)
    ens = _mlp_ensemble()
    opt_state = ee.init_optimizer(optax.adam(1e-3), ens)
    placed = ee.shard(ens, mesh)
    assert_placed(placed, mesh, ("members",))
    # Values unchanged; non-array leaves (the activation function) untouched.
    assert_tree_allclose(placed, ens, rtol=0, atol=0)
    assert placed.members.activation is ens.members.activation
    assert_placed(ee.shard(opt_state, mesh), mesh, ("members",))
    x, y = _data()
    data = ee.shard((x, y), mesh, axes="data")
    assert_placed(data, mesh, ("data",))
    np.testing.assert_array_equal(np.asarray(data[0]), np.asarray(x))
    per_member = ee.shard(jnp.zeros((8, 6, 3)), mesh, axes=("members", "data"))
    assert_placed(per_member, mesh, ("members", "data"))
    assert_placed(ee.shard((x, "label"), mesh, axes=())[0], mesh, ())
    # Typed PRNG keys keep their type.
    keys = ee.shard(jax.random.split(getkey(), 8), mesh)
    assert jnp.issubdtype(keys.dtype, jax.dtypes.prng_key)
    assert_placed(keys, mesh, ("members",))
    # Placing again is free: the very same arrays come back.
    again = ee.shard(placed, mesh)
    assert all(a is b for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(placed)))


def test_shard_on_meshes_lacking_an_axis():
    ens = _mlp_ensemble()
    data_only = ee.make_mesh(data=8)
    assert_placed(ee.shard(ens, data_only), data_only, ())  # replicated
    members_only = ee.make_mesh(members=8)
    x, _ = _data(12)  # 12 examples: no data axis, so no divisibility needed
    assert_placed(ee.shard(x, members_only, axes="data"), members_only, ())


def test_shard_model_state():
    model, state = eqx.filter_vmap(lambda k: eqx.nn.make_with_state(_BatchNormNet)(k))(
        jax.random.split(jax.random.key(0), 4)
    )
    mesh = ee.make_mesh(members=4)
    assert_placed(ee.shard(state, mesh), mesh, ("members",))
    assert_placed(ee.shard(ee.Ensemble(model), mesh), mesh, ("members",))


def test_member_count_not_divisible_is_a_clear_error():
    mesh = ee.make_mesh(members=4, data=2)
    ens = _mlp_ensemble(size=6)
    message = (
        r"6 members, which do not split evenly over the 4 devices of the mesh axis "
        r"'members'.*multiple of 4 \(e\.g\. 4, 8\).*divides 6 \(1, 2, 3, 6\)"
    )
    with pytest.raises(ValueError, match=message):
        ee.shard(ens, mesh)

    def loss_never_called(model, batch, key):
        raise AssertionError("the error must come before any work")

    with pytest.raises(ValueError, match=message):
        ee.fit(
            ens,
            loss_never_called,
            optax.sgd(0.1),
            _data(),
            steps=2,
            batch_size=8,
            key=jax.random.key(0),
            callbacks=(),
            execution=ee.Execution(mesh=mesh),
        )
    step = ee.make_step(
        loss_never_called, optax.sgd(0.1), execution=ee.Execution(mesh=mesh)
    )
    with pytest.raises(ValueError, match=message):
        step(ens, ee.init_optimizer(optax.sgd(0.1), ens), _data(), jax.random.key(0))


def test_data_not_divisible_is_a_clear_error():
    mesh = ee.make_mesh(members=2, data=4)
    x, _ = _data(10)
    with pytest.raises(
        ValueError, match=r"10 examples.*4 devices of the mesh axis 'data'"
    ):
        ee.shard(x, mesh, axes="data")
    with pytest.raises(ValueError, match=r"`batch_size` \(6\).*multiple of 4"):
        ee.fit(
            _mlp_ensemble(),
            _loss,
            optax.sgd(0.1),
            _data(),
            steps=2,
            batch_size=6,
            key=jax.random.key(0),
            callbacks=(),
            execution=ee.Execution(mesh=mesh),
        )
    step = ee.make_step(_loss, optax.sgd(0.1), execution=ee.Execution(mesh=mesh))
    ens = _mlp_ensemble()
    with pytest.raises(ValueError, match=r"`batch` leaf `\[0\]` has 10 examples"):
        step(ens, ee.init_optimizer(optax.sgd(0.1), ens), _data(10), jax.random.key(0))


def test_shard_errors():
    mesh = ee.make_mesh(members=8)
    with pytest.raises(ValueError, match=r"leaf `\['a'\]` has shape \(\).*1 leading"):
        ee.shard({"a": jnp.zeros(())}, mesh)
    with pytest.raises(ValueError, match="`axes` must name"):
        ee.shard(jnp.zeros(8), mesh, axes="batch")
    with pytest.raises(ValueError, match="outside `jit`"):
        jax.jit(lambda x: ee.shard(x, mesh))(jnp.zeros(8))


def test_process_rows_single_process():
    mesh = ee.make_mesh(members=2, data=4)
    assert ee.process_rows(mesh, 64) == slice(0, 64)
    with pytest.raises(ValueError, match="10 examples"):
        ee.process_rows(mesh, 10)


@pytest.mark.parametrize("axis_type", AXIS_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("per_member", [False, True])
def test_gather_batch_is_split_over_the_mesh(axis_type, per_member):
    mesh = ee.make_mesh(members=2, data=4, axis_types=axis_type)
    x = jnp.arange(64.0).reshape(32, 2)
    placed = ee.shard(x, mesh, axes="data")
    shape = (2, 8) if per_member else (8,)
    indices = jax.random.randint(jax.random.key(0), shape, 0, 32)
    batch = jax.jit(lambda d, i: OnMesh(mesh).gather_batch(d, i))(placed, indices)
    np.testing.assert_array_equal(np.asarray(batch), np.asarray(x)[indices])
    axes = ("members", "data") if per_member else ("data",)
    assert_placed(batch, mesh, axes)


# --------------------------------------------------------------------------- fit


@functools.cache
def _reference(sampling: str, with_eval: bool):
    return _fit(None, sampling, with_eval, presharded=False)


def _eval_fn(model, data, key):
    return _loss(model, data, key)


def _fit(mesh, sampling, with_eval, presharded, steps=7):
    ens = _mlp_ensemble()
    # Independent epochs of `SORT_ALONE_FROM` examples: on a CPU the members'
    # permutations sort their keys alone (`_core.data.permutation`), on the
    # mesh too.
    data = _data(SORT_ALONE_FROM if sampling == "independent" else 64)
    if presharded:
        ens = ee.shard(ens, mesh)
        data = ee.shard(data, mesh, axes="data")
    extra = {}
    if with_eval:
        extra = dict(evaluate=ee.Evaluate(_eval_fn, _data(16), every=2))
    return ee.fit(
        ens,
        _loss,
        optax.adam(1e-2),
        data,
        steps=steps,
        batch_size=16,
        key=jax.random.key(3),
        sampling=sampling,
        **extra,
        callbacks=(),
        execution=ee.Execution(steps_per_dispatch=3, mesh=mesh),
    )


def _assert_same_run(result, reference):
    assert_tree_allclose(result.ensemble, reference.ensemble)
    assert_tree_allclose(result.opt_state, reference.opt_state)
    np.testing.assert_allclose(
        result.history.losses, reference.history.losses, rtol=1e-5, atol=1e-6
    )
    np.testing.assert_allclose(
        result.history.eval_scores, reference.history.eval_scores, rtol=1e-5
    )
    assert result.step == reference.step
    if reference.best_ensemble is not None:
        assert_tree_allclose(result.best_ensemble, reference.best_ensemble)
        np.testing.assert_array_equal(result.best_step, reference.best_step)


CASES = [
    # (mesh, sampling, eval, data and ensemble placed beforehand)
    ("members", "independent", False, False),
    ("data", "shared", True, True),
    ("2d", "bootstrap", True, False),
]


def _axis_id(value):
    return value.name if isinstance(value, AxisType) else None


@pytest.mark.parametrize(
    "kind,sampling,with_eval,presharded,axis_type",
    # Bootstrap draws (the 2-D mesh's case) gather by indices of their own,
    # and an Explicit mesh types its gathers: that case runs on both types.
    alternating(CASES[:2], AXIS_TYPES) + [(*CASES[2], t) for t in AXIS_TYPES],
    ids=_axis_id,
)
def test_fit_on_a_mesh_equals_one_device(
    kind, sampling, with_eval, presharded, axis_type
):
    mesh = ee.make_mesh(**MESHES[kind], axis_types=axis_type)
    result = _fit(mesh, sampling, with_eval, presharded)
    _assert_same_run(result, _reference(sampling, with_eval))
    # The results live where the inputs were put: no gather to one device.
    assert_placed(result.ensemble, mesh, ("members",))
    assert_placed(result.opt_state, mesh, ("members",))
    if with_eval:
        assert_placed(result.best_ensemble, mesh, ("members",))


@pytest.mark.parametrize("axis_type", AXIS_TYPES, ids=lambda t: t.name)
def test_permutations_of_keys_split_over_a_mesh_are_jaxs(axis_type):
    if axis_type == AxisType.Explicit and jax.__version_info__ < (0, 10):
        pytest.skip(
            "JAX < 0.10: jax.random.permutation itself fails under vmap on a mesh "
            "of Explicit axes (docs/guides/sharding.md)"
        )
    # Per-member epoch orders (`ee.Independent`) are a `vmap` over keys; on a
    # CPU they sort their keys alone, which must batch over a mesh axis too.
    mesh = ee.make_mesh(members=8, axis_types=axis_type)
    keys = jax.random.split(jax.random.key(5), 8)
    placed = jax.device_put(keys, NamedSharding(mesh, PartitionSpec("members")))
    n = SORT_ALONE_FROM
    with jax.set_mesh(mesh):
        orders = jax.jit(jax.vmap(lambda k: permutation(k, n)))(placed)
    for key, order in zip(keys, np.asarray(orders), strict=True):
        np.testing.assert_array_equal(order, jax.random.permutation(key, n))


def test_fit_keeps_the_callers_arrays_and_feeds_split_batches():
    mesh = ee.make_mesh(members=2, data=4, axis_types=AxisType.Explicit)
    ens = ee.shard(_mlp_ensemble(), mesh)
    before = jax.tree.map(np.asarray, eqx.filter(ens, eqx.is_array))
    specs = []

    def loss(model, batch, key):
        # Under an Explicit mesh the sharding is part of the type: record it.
        specs.append(tuple(jax.typeof(batch[0]).sharding.spec))
        return _loss(model, batch, key)

    for sampling in ("shared", "independent"):
        ee.fit(
            ens,
            loss,
            optax.adam(1e-2),
            _data(),
            steps=2,
            batch_size=8,
            key=jax.random.key(0),
            sampling=sampling,
            callbacks=(),
            execution=ee.Execution(mesh=mesh),
        )
    # Each member's batch (the member axis vmapped away) is split over "data".
    assert specs == [("data", None), ("data", None)]
    # The loop donates its own copies, never the caller's arrays.
    assert_tree_allclose(eqx.filter(ens, eqx.is_array), before, rtol=0, atol=0)


class _BatchNormNet(eqx.Module):
    linear: eqx.nn.Linear
    norm: eqx.nn.BatchNorm
    head: eqx.nn.Linear

    def __init__(self, key):
        first, second = jax.random.split(key)
        self.linear = eqx.nn.Linear(2, 8, key=first)
        self.norm = eqx.nn.BatchNorm(8, axis_name="batch", mode="batch")
        self.head = eqx.nn.Linear(8, 1, key=second)

    def __call__(self, x, state):
        hidden, state = self.norm(jax.nn.tanh(self.linear(x)), state)
        return self.head(hidden), state


def _stateful_loss(model, state, batch, key):
    x, y = batch
    predictions, state = jax.vmap(
        model, axis_name="batch", in_axes=(0, None), out_axes=(0, None)
    )(x, state)
    return jnp.mean((predictions - y) ** 2), state


@pytest.mark.parametrize(
    "axis_type", [repeat(AxisType.Auto), AxisType.Explicit], ids=_axis_id
)
def test_fit_with_model_state_on_a_mesh(axis_type):
    model, state = eqx.filter_vmap(lambda k: eqx.nn.make_with_state(_BatchNormNet)(k))(
        jax.random.split(jax.random.key(0), 4)
    )
    ens = ee.Ensemble(model)
    kwargs = dict(
        steps=4,
        batch_size=16,
        key=jax.random.key(1),
        state=state,
        sampling="independent",
        callbacks=(),
    )
    reference = ee.fit(ens, _stateful_loss, optax.sgd(1e-2), _data(), **kwargs)
    mesh = ee.make_mesh(members=2, data=4, axis_types=axis_type)
    result = ee.fit(
        ens,
        _stateful_loss,
        optax.sgd(1e-2),
        _data(),
        **kwargs,
        execution=ee.Execution(mesh=mesh),
    )
    assert_tree_allclose(result.ensemble, reference.ensemble)
    assert_tree_allclose(result.state, reference.state)
    assert_placed(result.state, mesh, ("members",))


def test_fit_resumes_on_a_mesh(tmp_path):
    mesh = ee.make_mesh(members=4, data=2)
    uninterrupted = _fit(mesh, "shared", False, presharded=False, steps=6)
    kwargs = dict(
        batch_size=16,
        key=jax.random.key(3),
        sampling="shared",
        checkpoints=ee.Checkpoints(tmp_path),
        callbacks=(),
        execution=ee.Execution(steps_per_dispatch=3, mesh=mesh),
    )
    ens = _mlp_ensemble()
    ee.fit(ens, _loss, optax.adam(1e-2), _data(), steps=3, **kwargs)
    resumed = ee.fit(ens, _loss, optax.adam(1e-2), _data(), steps=6, **kwargs)
    assert_tree_allclose(resumed.ensemble, uninterrupted.ensemble)
    np.testing.assert_allclose(
        resumed.history.losses, uninterrupted.history.losses, rtol=1e-6
    )
    assert_placed(resumed.ensemble, mesh, ("members",))


# --------------------------------------------------------------------- make_step


@pytest.mark.parametrize(
    "per_member_batch,axis_type", alternating([False, True], AXIS_TYPES), ids=_axis_id
)
def test_make_step_on_a_mesh(axis_type, per_member_batch):
    ens = _mlp_ensemble()
    optimizer = optax.adam(1e-2)
    opt_state = ee.init_optimizer(optimizer, ens)
    x, y = _data(32)
    batch = (x, y)
    batch_axes: tuple[str, ...] = ("data",)
    if per_member_batch:
        batch = (jnp.stack([x] * 8), jnp.stack([y * i for i in range(8)]))
        batch_axes = ("members", "data")
    key = jax.random.key(5)
    reference = ee.make_step(_loss, optimizer, per_member_batch=per_member_batch)(
        ens, opt_state, batch, key
    )
    mesh = ee.make_mesh(members=4, data=2, axis_types=axis_type)
    step = ee.make_step(
        _loss,
        optimizer,
        per_member_batch=per_member_batch,
        execution=ee.Execution(mesh=mesh),
    )
    # Inputs placed beforehand (the fast path) or not (placed inside the step).
    for inputs in (
        (ee.shard(ens, mesh), ee.shard(opt_state, mesh)),
        (ens, opt_state),
    ):
        placed_batch = ee.shard(batch, mesh, axes=batch_axes)
        out = step(*inputs, placed_batch, key)
        assert_tree_allclose(out.ensemble, reference.ensemble)
        assert_tree_allclose(out.opt_state, reference.opt_state)
        np.testing.assert_allclose(out.losses, reference.losses, rtol=1e-5)
        assert_placed(out.ensemble, mesh, ("members",))
        assert_placed(out.opt_state, mesh, ("members",))
        assert_placed(out.losses, mesh, ())
    # A second step on the outputs stays placed (no drift, no recompilation).
    again = step(out.ensemble, out.opt_state, placed_batch, key)
    assert_placed(again.ensemble, mesh, ("members",))


def test_error_messages_name_the_numbers():
    mesh = ee.make_mesh(members=8)
    with pytest.raises(ValueError) as info:
        ee.shard({"w": jnp.zeros((12, 3))}, mesh)
    text = str(info.value)
    assert re.search(r"12 members", text) and "8 devices" in text
    assert "(e.g. 8, 16)" in text and "(1, 2, 3, 4, 6, 12)" in text


def test_a_member_of_a_member_sharded_ensemble_moves_one_row_not_the_ensemble():
    """`ens[i]` on an ensemble split over the members axis is one compiled
    call that gathers member `i`'s rows (an all-reduce of one row), not an
    all-gather of every leaf onto every device (what a dynamic slice of the
    split axis compiles to: 8x the memory here); values and placement as
    before, and a slice too."""
    from eqx_ensemble._core.ensemble import _take_leaves

    values = {
        f"w{i}": jnp.arange(8 * 16 * 4, dtype=jnp.float32).reshape(8, 16, 4) + i
        for i in range(3)
    }
    ens = ee.shard(ee.Ensemble(values), ee.make_mesh(members=8))
    leaves = jax.tree.leaves(ens.members)
    text = _take_leaves.lower(leaves, np.asarray([3], np.int32), True)
    assert "all-gather" not in text.compile().as_text()
    for index, rows in ((3, 3), (-1, 7), (slice(2, 5), slice(2, 5))):
        taken = ens[index]
        got = taken if isinstance(index, int) else taken.members
        for name, value in values.items():
            np.testing.assert_array_equal(got[name], np.asarray(value)[rows])
            assert got[name].sharding.is_fully_replicated


def test_leaves_on_different_devices_are_indexed_stacked_and_joined():
    """An ensemble whose leaves live on different devices (a part kept on one
    device, the rest on another) is indexed, stacked and joined leaf by leaf
    (one compiled call for all leaves cannot take them)."""
    first, second = jax.devices()[:2]
    ens = ee.Ensemble(
        {
            "a": jax.device_put(jnp.arange(12.0).reshape(4, 3), first),
            "b": jax.device_put(jnp.arange(8.0).reshape(4, 2), second),
        }
    )
    assert ens[1]["b"].tolist() == [2.0, 3.0]
    assert ens[1:3].members["a"].shape == (2, 3)
    assert ee.stack([ens[0], ens[3]]).members["b"].tolist() == [[0, 1], [6, 7]]
    joined = ee.concatenate([ens, ens[:1]])
    assert joined.members["a"][4].tolist() == [0.0, 1.0, 2.0]


def test_make_mesh_with_a_repeated_device_is_refused():
    device = jax.devices()[0]
    with pytest.raises(ValueError, match="more than once"):
        ee.make_mesh(members=2, devices=[device, device])
