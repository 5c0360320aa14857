"""Checkpoints: round trips, placement, atomicity under crashes, corruption, mismatch.

References are independent of the code under test: saved trees are compared with
the originals leaf by leaf (bit for bit), file layouts are parsed by hand here,
and crash safety is checked on a real process killed with SIGKILL.
"""

import functools
import hashlib
import json
import math
import os
import random
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import textwrap
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings, strategies as st
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import eqx_ensemble as ee


def make_mlp(key, width=16, depth=2):
    return eqx.nn.MLP(3, 2, width, depth, key=key)


@functools.cache
def make_ensemble(seed, size=8, width=16, depth=2):
    # Cached, and always the same shapes where possible: each new shape costs
    # compilation time, the scarce resource of this test suite.
    build = eqx.filter_jit(
        lambda key: ee.ensemble(lambda k: make_mlp(k, width, depth), size=size, key=key)
    )
    return build(jax.random.key(seed))


def ensemble_shape(size=8, width=16, depth=2):
    """`eqx.filter_eval_shape` of an ensemble: a `like` that costs no compilation."""
    return eqx.filter_eval_shape(
        lambda: ee.ensemble(
            lambda k: make_mlp(k, width, depth), size=size, key=jax.random.key(0)
        )
    )


def random_fill(shapes, seed):
    """Replace every `jax.ShapeDtypeStruct` by a random array (no compilation)."""
    rng = np.random.default_rng(seed)

    def fill(leaf):
        if not isinstance(leaf, jax.ShapeDtypeStruct):
            return leaf
        if jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            data = rng.integers(0, 2**32, (*leaf.shape, 2), dtype=np.uint32)
            return jax.random.wrap_key_data(data)
        if jnp.issubdtype(leaf.dtype, jnp.integer):
            return jnp.asarray(rng.integers(0, 100, leaf.shape).astype(leaf.dtype))
        return jnp.asarray(rng.normal(size=leaf.shape).astype(leaf.dtype))

    return jax.tree.map(fill, shapes)


def leaf_bytes(x):
    """A leaf's exact content: bytes, dtype and shape (NaN payloads included)."""
    if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        return ("key", str(jax.random.key_impl(x)), leaf_bytes(jax.random.key_data(x)))
    host = np.asarray(x)
    return (host.dtype.name, host.shape, host.tobytes())


def assert_bitwise_equal(restored, original):
    """Same structure, array leaves equal bit for bit, other leaves equal."""
    flat_r, tree_r = jax.tree_util.tree_flatten_with_path(restored)
    flat_o, tree_o = jax.tree_util.tree_flatten_with_path(original)
    assert tree_r == tree_o
    for (path, r), (_, o) in zip(flat_r, flat_o, strict=True):
        where = jax.tree_util.keystr(path)
        if eqx.is_array(o):
            assert leaf_bytes(r) == leaf_bytes(o), where
        elif isinstance(o, float) and math.isnan(o):
            assert isinstance(r, float) and math.isnan(r), where
        else:
            assert type(r) is type(o) and r == o, where


# ---------------------------------------------------------------- round trips


def test_ensemble_round_trip(tmp_path):
    ens = make_ensemble(0)
    like = make_ensemble(1)
    written = ee.save(tmp_path / "ens.ckpt", ens)
    assert written == tmp_path / "ens.ckpt"
    restored = ee.load(written, like)
    assert isinstance(restored, ee.Ensemble) and len(restored) == 8
    assert_bitwise_equal(restored, ens)
    # Non-array leaves come from `like`; the restored model computes like `ens`.
    assert restored.members.activation is like.members.activation
    x = jnp.linspace(-1.0, 1.0, 3)
    assert jnp.array_equal(restored(x), ens(x))


def test_optax_state_round_trip_and_training_continues(tmp_path):
    ens = make_ensemble(0)
    params = eqx.filter(ens, eqx.is_array)
    optimizer = optax.inject_hyperparams(optax.adam)(learning_rate=1e-2)
    state = jax.vmap(optimizer.init)(params)
    state.hyperparams["learning_rate"] = jnp.linspace(1e-3, 1e-1, 8)
    grads = jax.tree.map(jnp.ones_like, params)
    # optax's bias correction mixes int32 and float32: not allowed under "strict".
    with jax.numpy_dtype_promotion("standard"):
        _, state = jax.vmap(optimizer.update)(grads, state, params)
    ee.save(tmp_path / "opt.ckpt", (ens, state))

    like_state = jax.vmap(optimizer.init)(eqx.filter(make_ensemble(1), eqx.is_array))
    restored_ens, restored_state = ee.load(
        tmp_path / "opt.ckpt", (make_ensemble(1), like_state)
    )
    assert_bitwise_equal((restored_ens, restored_state), (ens, state))

    def one_step(model, opt_state):
        model_params = eqx.filter(model, eqx.is_array)
        with jax.numpy_dtype_promotion("standard"):
            updates, _ = jax.vmap(optimizer.update)(grads, opt_state, model_params)
        return eqx.apply_updates(model, updates)

    assert_bitwise_equal(one_step(restored_ens, restored_state), one_step(ens, state))


@pytest.mark.parametrize("impl", ["threefry2x32", "rbg", "unsafe_rbg"])
def test_typed_prng_keys_round_trip(tmp_path, impl):
    keys = {
        "one": jax.random.key(1, impl=impl),
        "split": jax.random.split(jax.random.key(2, impl=impl), (4, 3)),
        "legacy_uint32": jax.random.PRNGKey(3),
    }
    ee.save(tmp_path / "keys.ckpt", keys)
    like = {
        "one": jax.random.key(7, impl=impl),
        "split": jax.random.split(jax.random.key(8, impl=impl), (4, 3)),
        "legacy_uint32": jax.random.PRNGKey(9),
    }
    restored = ee.load(tmp_path / "keys.ckpt", like)
    for name in keys:
        assert restored[name].dtype == keys[name].dtype
        assert leaf_bytes(restored[name]) == leaf_bytes(keys[name])
    # The same random stream continues.
    assert jnp.array_equal(
        jax.random.normal(restored["split"][2, 1], (5,)),
        jax.random.normal(keys["split"][2, 1], (5,)),
    )


def test_python_scalars_keep_their_type_and_exact_value(tmp_path):
    tree = {
        "int": 3,
        "big_int": 2**80 + 1,
        "negative": -7,
        "float": 0.1,
        "tiny": 5e-324,
        "nan": float("nan"),
        "inf": float("-inf"),
        "bool": True,
        "complex": 1.5 - 0.1j,
        "array": jnp.arange(3.0),
    }
    ee.save(tmp_path / "scalars.ckpt", tree)
    like = {
        "int": 0,
        "big_int": 0,
        "negative": 0,
        "float": 0.0,
        "tiny": 0.0,
        "nan": 0.0,
        "inf": 0.0,
        "bool": False,
        "complex": 0j,
        "array": jnp.zeros(3),
    }
    restored = ee.load(tmp_path / "scalars.ckpt", like)
    assert_bitwise_equal(restored, tree)
    assert restored["float"].hex() == (0.1).hex()


def test_eval_shape_like(tmp_path, getkey):
    ens = make_ensemble(0)
    tree = {
        "ens": ens,
        "keys": jax.random.split(getkey(), 8),
        "step": jnp.asarray(5),  # weakly typed
        "lr": 0.25,
    }
    ee.save(tmp_path / "shape.ckpt", tree)
    like = eqx.filter_eval_shape(lambda: tree)
    assert isinstance(like["ens"].members.layers[0].weight, jax.ShapeDtypeStruct)
    restored = ee.load(tmp_path / "shape.ckpt", like)
    assert_bitwise_equal(restored, tree)
    assert (
        restored["step"].weak_type
        and not restored["ens"].members.layers[0].weight.weak_type
    )
    # Also straight from the constructor, without building real weights.
    like_ens = eqx.filter_eval_shape(
        ee.ensemble, make_mlp, size=8, key=jax.random.key(0)
    )
    ee.save(tmp_path / "ens.ckpt", ens)
    assert_bitwise_equal(ee.load(tmp_path / "ens.ckpt", like_ens), ens)


@pytest.mark.parametrize(
    "dtype",
    [
        np.float32,
        np.float16,
        jnp.bfloat16,
        np.int8,
        np.uint32,
        np.int32,
        np.bool_,
        np.complex64,
        np.float64,
        np.int64,
    ],
)
def test_dtypes_and_numpy_leaves_round_trip(tmp_path, dtype):
    rng = np.random.default_rng(0)
    values = rng.normal(size=(3, 5)) * 100
    numpy_array = values.astype(dtype)
    tree = {
        "numpy": numpy_array,
        "numpy_scalar": numpy_array[1, 2],
        "empty": np.zeros((0, 4), dtype),
        "zero_d": np.asarray(numpy_array[0, 0]),
    }
    if np.dtype(dtype).itemsize < 8:  # 64-bit jax arrays need jax_enable_x64
        tree["jax"] = jnp.asarray(numpy_array)
    ee.save(tmp_path / "dtypes.ckpt", tree)
    like = jax.tree.map(np.zeros_like, tree)
    like["numpy_scalar"] = np.zeros((), dtype)[()]
    if "jax" in tree:
        like["jax"] = jnp.zeros_like(tree["jax"])
    restored = ee.load(tmp_path / "dtypes.ckpt", like)
    assert_bitwise_equal(restored, tree)
    assert type(restored["numpy"]) is np.ndarray
    assert type(restored["numpy_scalar"]) is type(numpy_array[1, 2])
    assert restored["numpy"].flags.writeable
    if "jax" in tree:
        assert isinstance(restored["jax"], jax.Array)


def test_nan_payload_and_negative_zero_survive(tmp_path):
    bits = np.array([0x7FC00001, 0xFFC12345, 0x80000000, 0x7F800000], np.uint32)
    tree = jnp.asarray(bits.view(np.float32))
    ee.save(tmp_path / "nan.ckpt", tree)
    restored = ee.load(tmp_path / "nan.ckpt", jnp.zeros(4))
    assert np.array_equal(np.asarray(restored).view(np.uint32), bits)


def test_non_array_leaves_come_from_like(tmp_path, getkey):
    ens = make_ensemble(0)
    ee.save(tmp_path / "ens.ckpt", ens)
    like = eqx.tree_at(lambda e: e.members.activation, make_ensemble(1), jax.nn.tanh)
    restored = ee.load(tmp_path / "ens.ckpt", like)
    assert restored.members.activation is jax.nn.tanh
    assert jnp.array_equal(
        restored.members.layers[0].weight, ens.members.layers[0].weight
    )


def test_manifest_contents(tmp_path, getkey):
    ens = make_ensemble(0)
    tree = {"ens": ens, "key": getkey(), "step": 7}
    path = ee.save(tmp_path / "m.ckpt", tree, metadata={"run": "a", "lrs": [0.1, 1]})
    manifest = ee.load_manifest(path)
    assert manifest["format_version"] == 1
    assert manifest["library_version"] == ee.__version__
    assert manifest["jax_version"] == jax.__version__
    assert manifest["ensemble_size"] == len(ens) == 8
    assert manifest["metadata"] == {"run": "a", "lrs": [0.1, 1]}
    assert manifest["step"] is None
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    assert [leaf["path"] for leaf in manifest["leaves"]] == [
        jax.tree_util.keystr(path) for path, _ in flat
    ]
    weight = next(
        leaf for leaf in manifest["leaves"] if leaf["path"].endswith("[0].weight")
    )
    assert weight["shape"] == [8, 16, 3] and weight["dtype"] == "float32"
    key = next(leaf for leaf in manifest["leaves"] if leaf["path"] == "['key']")
    assert key["kind"] == "key" and key["impl"] == "threefry2x32"
    # Parse the container by hand: magic, manifest length, manifest sha256, data.
    raw = path.read_bytes()
    assert raw[:8] == b"\x89EQXENS\n"
    (length,) = struct.unpack("<Q", raw[8:16])
    manifest_bytes = raw[48 : 48 + length]
    assert hashlib.sha256(manifest_bytes).digest() == raw[16:48]
    assert json.loads(manifest_bytes) == manifest
    data = raw[48 + length :]
    assert len(data) == manifest["data"]["bytes"]
    assert hashlib.sha256(data).hexdigest() == manifest["data"]["sha256"]
    offset = weight["offset"]
    stored = np.frombuffer(data[offset : offset + weight["nbytes"]], np.float32)
    assert np.array_equal(
        stored.reshape(8, 16, 3), np.asarray(ens.members.layers[0].weight)
    )


def test_bad_save_inputs(tmp_path):
    with pytest.raises(TypeError, match="JSON-serialisable"):
        ee.save(tmp_path / "a.ckpt", jnp.zeros(2), metadata={"f": object()})
    with pytest.raises(TypeError, match="metadata"):
        ee.save(tmp_path / "a.ckpt", jnp.zeros(2), metadata={1: "x"})
    with pytest.raises(TypeError, match=r"leaf `\['s'\]`.*ShapeDtypeStruct"):
        ee.save(tmp_path / "a.ckpt", {"s": jax.ShapeDtypeStruct((2,), jnp.float32)})
    with pytest.raises(TypeError, match="dtype object"):
        ee.save(tmp_path / "a.ckpt", np.array([object()]))

    @jax.jit
    def save_inside_jit(x):
        ee.save(tmp_path / "a.ckpt", {"x": x})
        return x

    with pytest.raises(TypeError, match=r"leaf `\['x'\]`: it is traced"):
        save_inside_jit(jnp.zeros(2))
    ee.save(tmp_path / "a.ckpt", {"x": jnp.zeros(2)})
    with pytest.raises(TypeError, match=r"`like`'s leaf `\['x'\]` is traced"):
        jax.jit(lambda x: ee.load(tmp_path / "a.ckpt", {"x": x}))(jnp.zeros(2))
    os.remove(tmp_path / "a.ckpt")
    assert os.listdir(tmp_path) == []
    with pytest.raises(FileNotFoundError, match="no checkpoint file"):
        ee.load(tmp_path / "missing.ckpt", jnp.zeros(2))


def test_parent_folders_are_created(tmp_path):
    path = ee.save(tmp_path / "a" / "b" / "x.ckpt", jnp.arange(3))
    assert jnp.array_equal(ee.load(path, jnp.zeros(3, jnp.int32)), jnp.arange(3))


# ---------------------------------------------------------------- placement


@pytest.fixture
def mesh():
    assert len(jax.devices()) == 8
    return Mesh(np.array(jax.devices()), ("members",))


def shard_members(tree, sharding):
    return jax.tree.map(
        lambda x: jax.device_put(x, sharding) if eqx.is_array(x) else x, tree
    )


def array_leaves(tree):
    return jax.tree.leaves(eqx.filter(tree, eqx.is_array))


def test_sharded_checkpoint_loads_on_one_device_and_on_meshes(tmp_path, mesh, getkey):
    members = NamedSharding(mesh, P("members"))
    ens = make_ensemble(0)
    state = {"ens": ens, "keys": jax.random.split(getkey(), 8)}
    sharded = shard_members(state, members)
    assert len(sharded["ens"].members.layers[0].weight.sharding.device_set) == 8
    ee.save(tmp_path / "sharded.ckpt", sharded)

    # Onto one device: a like built without any sharding.
    like = {
        "ens": make_ensemble(1),
        "keys": jax.random.split(getkey(), 8),
    }
    single = ee.load(tmp_path / "sharded.ckpt", like)
    assert_bitwise_equal(single, state)
    for leaf in array_leaves(single):
        assert leaf.sharding.device_set == {jax.devices()[0]}

    # Onto the same mesh, onto a 4-device mesh (2 members per device), and onto
    # explicit struct shardings.
    four = NamedSharding(Mesh(np.array(jax.devices()[:4]), ("members",)), P("members"))
    for sharding in (members, four):
        placed = ee.load(tmp_path / "sharded.ckpt", shard_members(like, sharding))
        assert_bitwise_equal(placed, state)
        for leaf in array_leaves(placed):
            assert leaf.sharding == sharding
            assert leaf.addressable_shards[0].data.shape[0] == 8 // len(
                sharding.device_set
            )
    structs = jax.tree.map(
        lambda x: (
            jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=four)
            if eqx.is_array(x)
            else x
        ),
        like,
    )
    placed = ee.load(tmp_path / "sharded.ckpt", structs)
    assert_bitwise_equal(placed, state)
    assert all(leaf.sharding == four for leaf in array_leaves(placed))


def test_unsharded_checkpoint_loads_onto_a_mesh(tmp_path, mesh, getkey):
    members = NamedSharding(mesh, P("members"))
    ens = make_ensemble(0)
    ee.save(tmp_path / "one.ckpt", ens)
    like = shard_members(make_ensemble(1), members)
    restored = ee.load(tmp_path / "one.ckpt", like)
    assert_bitwise_equal(restored, ens)
    for leaf in array_leaves(restored):
        assert leaf.sharding == members

    replicated = NamedSharding(mesh, P())
    restored = ee.load(tmp_path / "one.ckpt", shard_members(like, replicated))
    assert all(leaf.sharding == replicated for leaf in array_leaves(restored))


def test_explicit_mesh_sharding_is_restored(tmp_path, getkey):
    explicit = jax.make_mesh(
        (8,), ("members",), axis_types=(jax.sharding.AxisType.Explicit,)
    )
    sharding = NamedSharding(explicit, P("members"))
    ens = make_ensemble(0)
    ee.save(tmp_path / "e.ckpt", ens)
    like = shard_members(make_ensemble(1), sharding)
    restored = ee.load(tmp_path / "e.ckpt", like)
    assert_bitwise_equal(restored, ens)
    weight = restored.members.layers[0].weight
    assert weight.sharding == sharding
    assert jax.typeof(weight).sharding.spec == P("members", None, None)


# ---------------------------------------------------------------- corruption


@pytest.fixture
def saved(tmp_path, getkey):
    tree = {"ens": make_ensemble(0), "key": getkey(), "step": 3}
    path = ee.save(tmp_path / "good.ckpt", tree)
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[8:16])
    return path, tree, raw, 48 + length


def rewrite(path, raw):
    path.write_bytes(bytes(raw))


def test_every_single_byte_flip_is_detected(tmp_path):
    small = ee.Ensemble({"w": jnp.arange(6.0).reshape(2, 3), "b": jnp.ones(2)})
    tree = {"ens": small, "key": jax.random.key(0), "n": 3, "x": 0.5}
    path = ee.save(tmp_path / "small.ckpt", tree)
    raw = path.read_bytes()
    # Every position of the file: magic, lengths, hashes, manifest, data, padding.
    for position in range(len(raw)):
        corrupt = bytearray(raw)
        corrupt[position] ^= 1 << (position % 8)
        rewrite(path, corrupt)
        with pytest.raises(ee.CheckpointError):
            ee.load(path, tree)
    rewrite(path, raw)
    assert_bitwise_equal(ee.load(path, tree), tree)


@pytest.mark.parametrize(
    "where, message",
    [
        ("magic", "not an eqx_ensemble checkpoint"),
        ("length", "truncated or its header is corrupt|manifest is corrupt"),
        ("manifest", "manifest is corrupt"),
        ("data_first", "data is corrupt"),
        ("data_last", "data is corrupt"),
    ],
)
def test_flipped_byte_messages(saved, where, message):
    path, tree, raw, data_start = saved
    position = {
        "magic": 2,
        "length": 8,
        "manifest": (48 + data_start) // 2,
        "data_first": data_start,
        "data_last": len(raw) - 1,
    }[where]
    corrupt = bytearray(raw)
    corrupt[position] ^= 0xFF
    rewrite(path, corrupt)
    with pytest.raises(ee.CheckpointError, match=message) as error:
        ee.load(path, tree)
    assert str(path) in str(error.value)


def test_truncation_and_trailing_garbage(saved):
    path, tree, raw, data_start = saved
    cases = {
        0: "empty",
        5: "truncated",
        47: "truncated",
        60: "truncated or its header is corrupt",
        data_start - 1: "truncated or its header is corrupt",
        data_start: "truncated",
        len(raw) - 1: "truncated",
    }
    for length, message in cases.items():
        rewrite(path, raw[:length])
        with pytest.raises(ee.CheckpointError, match=message):
            ee.load(path, tree)
    rewrite(path, raw + b"garbage")
    with pytest.raises(ee.CheckpointError, match="7 unexpected trailing bytes"):
        ee.load(path, tree)
    rewrite(path, raw + raw)
    with pytest.raises(ee.CheckpointError, match="trailing bytes"):
        ee.load(path, tree)
    path.write_bytes(b"\x93NUMPY garbage that is not a checkpoint at all" * 3)
    with pytest.raises(ee.CheckpointError, match="not an eqx_ensemble checkpoint"):
        ee.load(path, tree)


def test_newer_format_version_is_refused(saved):
    path, tree, raw, data_start = saved
    manifest = json.loads(raw[48:data_start])
    manifest["format_version"] = 99
    manifest_bytes = json.dumps(manifest).encode()
    header = b"\x89EQXENS\n" + struct.pack("<Q", len(manifest_bytes))
    header += hashlib.sha256(manifest_bytes).digest()
    rewrite(path, header + manifest_bytes + raw[data_start:])
    with pytest.raises(ee.CheckpointError, match="format version 99, newer"):
        ee.load(path, tree)


def test_mismatched_like_is_refused_with_a_precise_message(saved):
    path, tree, _, _ = saved
    ens = ensemble_shape()

    def like_with(**changes):
        return {**tree, **changes}

    cases = [
        (
            like_with(ens=ensemble_shape(size=3)),
            r"ensemble of 8 members at `\['ens'\]` but `like` has 3 members",
        ),
        (
            like_with(ens=ensemble_shape(width=9)),
            r"static field `width_size` of node `\['ens'\]\.members` \(MLP\) is 16 "
            r"in the checkpoint but 9",
        ),
        (
            like_with(
                ens=eqx.filter_eval_shape(
                    ee.ensemble,
                    lambda k: eqx.nn.Linear(3, 2, key=k),
                    size=8,
                    key=jax.random.key(0),
                )
            ),
            r"node `\['ens'\]\.members` is of type MLP in the checkpoint but of "
            r"type Linear in `like`",
        ),
        (
            like_with(
                ens=jax.tree.map(
                    lambda x: (
                        jax.ShapeDtypeStruct(x.shape, jnp.float16)
                        if isinstance(x, jax.ShapeDtypeStruct)
                        else x
                    ),
                    ens,
                )
            ),
            r"leaf `\['ens'\]\.members\.layers\[0\]\.weight` differs: the checkpoint "
            r"holds an array of shape \(8, 16, 3\) and dtype float32, `like` holds "
            r"an array of shape \(8, 16, 3\) and dtype float16",
        ),
        (
            like_with(
                ens=eqx.tree_at(
                    lambda e: e.members.layers[1].bias,
                    ens,
                    jax.ShapeDtypeStruct((8, 5), jnp.float32),
                )
            ),
            r"leaf `\['ens'\]\.members\.layers\[1\]\.bias` differs: the checkpoint "
            r"holds an array of shape \(8, 16\) and dtype float32, `like` holds an "
            r"array of shape \(8, 5\) and dtype float32",
        ),
        (
            like_with(extra=jnp.zeros(2)),
            r"`like` has a leaf `\['extra'\]` that the checkpoint lacks",
        ),
        (
            {"ens": ens, "step": 3},
            r"the checkpoint has a leaf `\['key'\]` that `like` lacks",
        ),
        (
            like_with(key=jax.random.PRNGKey(0)),
            r"leaf `\['key'\]` differs: the checkpoint holds a PRNG key array of "
            r"shape \(\) and dtype key<fry>, `like` holds an array of shape \(2,\) "
            r"and dtype uint32",
        ),
        (
            like_with(step=3.0),
            r"leaf `\['step'\]` differs: the checkpoint holds a Python int, `like` "
            r"holds a Python float",
        ),
        (
            like_with(step=jnp.asarray(3)),
            r"leaf `\['step'\]` differs: the checkpoint holds a Python int, `like` "
            r"holds an array of shape \(\) and dtype int32",
        ),
        (
            ens,
            r"node `<root>` is of type dict in the checkpoint but of type Ensemble",
        ),
    ]
    for like, message in cases:
        with pytest.raises(ee.CheckpointError, match=message):
            ee.load(path, like)


# ---------------------------------------------------------------- atomicity


def test_failure_between_write_and_rename_keeps_previous(tmp_path, monkeypatch):
    old = {"w": jnp.arange(4.0), "step": 1}
    path = ee.save(tmp_path / "model.ckpt", old)
    before = path.read_bytes()

    def failing_replace(source, target):
        raise OSError("disk on fire")

    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(OSError, match="disk on fire"):
        ee.save(path, {"w": jnp.arange(4.0) + 10, "step": 2})
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["model.ckpt"]
    assert_bitwise_equal(ee.load(path, {"w": jnp.zeros(4), "step": 0}), old)


@pytest.mark.parametrize("failing", ["replace", "fsync", "write"])
def test_failing_checkpoint_save_leaves_previous_latest(tmp_path, monkeypatch, failing):
    directory = tmp_path / "run"
    like = {"w": jnp.zeros(1000), "step": 0}
    ee.save_checkpoint(directory, 10, {"w": jnp.full(1000, 10.0), "step": 10})
    if failing == "write":
        real_fdopen = os.fdopen

        class Broken:
            def __init__(self, stream):
                self.stream = stream

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                self.stream.close()

            def write(self, data):
                self.stream.write(bytes(memoryview(data))[:10])
                raise OSError("no space left on device")

        monkeypatch.setattr(os, "fdopen", lambda *a, **k: Broken(real_fdopen(*a, **k)))
    else:

        def fail(*args):
            raise OSError(f"{failing} failed")

        monkeypatch.setattr(os, failing, fail)
    with pytest.raises(OSError):
        ee.save_checkpoint(directory, 20, {"w": jnp.full(1000, 20.0), "step": 20})
    monkeypatch.undo()
    assert os.listdir(directory) == ["step_0000000010.ckpt"]
    latest = ee.latest_checkpoint(directory)
    assert latest == directory / "step_0000000010.ckpt"
    restored = ee.load(latest, like)
    assert restored["step"] == 10 and bool(jnp.all(restored["w"] == 10.0))


_WRITER = textwrap.dedent(
    """
    import sys
    import numpy as np
    import eqx_ensemble as ee

    mode, target, step = sys.argv[1], sys.argv[2], int(sys.argv[3])
    base = np.arange(3_000_000, dtype=np.float32)
    while True:
        tree = {"w": base + np.float32(step), "b": np.full(7, step), "step": step}
        if mode == "file":
            ee.save(target, tree, metadata={"step": step})
        else:
            ee.save_checkpoint(target, step, tree, metadata={"step": step}, keep=2)
        print(step, flush=True)
        step += 1
    """
)


@pytest.fixture
def processes():
    """Started subprocesses; killed and reaped at teardown, even on failure."""
    started = []
    yield started
    for process in started:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=30)
        for stream in (process.stdout, process.stderr):
            if stream is not None:
                stream.close()


def _check_consistent(path, expected_base):
    like = {"w": np.zeros(3_000_000, np.float32), "b": np.zeros(7, np.int64), "step": 0}
    restored = ee.load(path, like)
    step = restored["step"]
    assert ee.load_manifest(path)["metadata"] == {"step": step}
    assert np.array_equal(restored["b"], np.full(7, step))
    assert np.array_equal(restored["w"], expected_base + np.float32(step))
    return step


def test_killing_the_writer_at_random_points_leaves_a_loadable_checkpoint(
    tmp_path, processes
):
    script = tmp_path / "writer.py"
    script.write_text(_WRITER)
    rng = random.Random(1234)
    base = np.arange(3_000_000, dtype=np.float32)
    target_file = tmp_path / "model.ckpt"
    target_dir = tmp_path / "run"
    next_step = {"file": 0, "dir": 0}
    for round_number in range(5):
        mode = ("file", "dir")[round_number % 2]
        target = target_file if mode == "file" else target_dir
        process = subprocess.Popen(
            [sys.executable, str(script), mode, str(target), str(next_step[mode])],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        processes.append(process)
        first = process.stdout.readline()  # one complete save before the kill
        assert first.strip() == str(next_step[mode]), process.stderr.read()
        time.sleep(rng.uniform(0.0, 0.25))
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=30)
        completed = [first] + process.stdout.readlines()
        last_reported = int(completed[-1])
        if mode == "file":
            step = _check_consistent(target_file, base)
        else:
            checkpoints = ee.list_checkpoints(target_dir)
            assert checkpoints, os.listdir(target_dir)
            # Every listed checkpoint is complete, and the latest is the newest.
            for listed_step, path in checkpoints:
                assert _check_consistent(path, base) == listed_step
            step = checkpoints[-1][0]
            assert ee.latest_checkpoint(target_dir) == checkpoints[-1][1]
        # Durable: what was reported saved is there (the kill may land after the
        # rename but before the report).
        assert step in (last_reported, last_reported + 1)
        next_step[mode] = step + 1


_CRASHER = textwrap.dedent(
    """
    import os, signal, sys
    import numpy as np
    import eqx_ensemble as ee

    point, directory = sys.argv[1], sys.argv[2]

    def state(step):
        return {"w": np.full(100_000, step, np.float32), "step": step}

    ee.save_checkpoint(directory, 1, state(1), keep=1)
    real = getattr(os, point)

    def crash(*args):
        if point == "replace":
            real(*args)  # the new file is in place; die before fsyncing the folder
        os.kill(os.getpid(), signal.SIGKILL)

    setattr(os, point, crash)
    ee.save_checkpoint(directory, 2, state(2), keep=1)
    print("survived", flush=True)
    """
)


@pytest.mark.parametrize(
    "point, latest",
    [("fsync", 1), ("replace", 2), ("unlink", 2)],
    ids=["before-rename", "after-rename", "while-pruning"],
)
def test_crash_at_each_point_of_a_save(tmp_path, processes, point, latest):
    script = tmp_path / "crasher.py"
    script.write_text(_CRASHER)
    directory = tmp_path / "run"
    process = subprocess.Popen(
        [sys.executable, str(script), point, str(directory)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    processes.append(process)
    out, err = process.communicate(timeout=120)
    assert process.returncode == -signal.SIGKILL, err
    assert "survived" not in out
    path = ee.latest_checkpoint(directory)
    assert path == directory / f"step_{latest:010d}.ckpt"
    like = {"w": np.zeros(100_000, np.float32), "step": 0}
    restored = ee.load(path, like)
    assert restored["step"] == latest and np.all(restored["w"] == latest)
    # The next save cleans up what the crash left behind.
    ee.save_checkpoint(directory, 3, {**restored, "step": 3}, keep=1)
    assert os.listdir(directory) == ["step_0000000003.ckpt"]


# ---------------------------------------------------------------- folders


def test_checkpoint_folder_keeps_the_last_n(tmp_path):
    directory = tmp_path / "run"
    assert ee.latest_checkpoint(directory) is None
    assert ee.list_checkpoints(directory) == []
    for step in (5, 10, 100, 1000, 20):
        path = ee.save_checkpoint(directory, step, {"s": jnp.asarray(step)}, keep=3)
        assert ee.load_manifest(path)["step"] == step
    steps = [step for step, _ in ee.list_checkpoints(directory)]
    # Step 20 was just written so it stays; the 3 highest are kept besides it.
    assert steps == [20, 100, 1000]
    assert ee.latest_checkpoint(directory) == directory / "step_0000001000.ckpt"
    # Re-saving a step replaces it; keep=None keeps everything.
    ee.save_checkpoint(directory, 1000, {"s": jnp.asarray(-1)})
    ee.save_checkpoint(directory, 2000, {"s": jnp.asarray(2000)})
    assert [step for step, _ in ee.list_checkpoints(directory)] == [20, 100, 1000, 2000]
    assert (
        int(ee.load(directory / "step_0000001000.ckpt", {"s": jnp.asarray(0)})["s"])
        == -1
    )


def test_stray_temporary_files_are_ignored_then_cleaned(tmp_path):
    directory = tmp_path / "run"
    ee.save_checkpoint(directory, 1, {"w": jnp.ones(3)})
    # Left by a killed writer (no process holds its lock), and by an old,
    # non-locking version an hour ago.
    stray = directory / ".step_0000000002.ckpt.0123456789abcdef-p4242.tmp"
    stray.write_bytes(b"half a checkpoint")
    legacy = directory / ".step_0000000003.ckpt.0123456789abcdef.tmp"
    legacy.write_bytes(b"half a checkpoint")
    two_hours_ago = time.time() - 7200
    os.utime(legacy, (two_hours_ago, two_hours_ago))
    unrelated = directory / "notes.txt"
    unrelated.write_text("keep me")
    assert ee.latest_checkpoint(directory) == directory / "step_0000000001.ckpt"
    ee.save_checkpoint(directory, 2, {"w": jnp.ones(3)}, keep=5)
    assert sorted(os.listdir(directory)) == [
        "notes.txt",
        "step_0000000001.ckpt",
        "step_0000000002.ckpt",
    ]


@pytest.mark.parametrize(
    "step, keep", [(-1, None), (True, None), (1.0, None), (1, 0), (1, -2), (1, 1.5)]
)
def test_save_checkpoint_bad_arguments(tmp_path, step, keep):
    with pytest.raises((ValueError, TypeError)):
        ee.save_checkpoint(tmp_path / "run", step, {"w": jnp.ones(2)}, keep=keep)
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------- hypothesis


@settings(max_examples=10, deadline=None)
@given(
    size=st.integers(1, 6),
    in_size=st.sampled_from(["scalar", 1, 4]),
    out_size=st.integers(1, 3),
    width=st.integers(1, 9),
    depth=st.integers(0, 3),
    use_bias=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
    eval_shape=st.booleans(),
)
def test_random_ensembles_round_trip(
    size, in_size, out_size, width, depth, use_bias, seed, eval_shape
):
    def make(key):
        return eqx.nn.MLP(in_size, out_size, width, depth, use_bias=use_bias, key=key)

    def build(members):
        ens = ee.ensemble(make, size=members, key=jax.random.key(0))
        state = jax.vmap(optax.adam(1e-3).init)(eqx.filter(ens, eqx.is_array))
        return {"ens": ens, "opt": state, "key": jax.random.key(0)}

    # Random values on random structures, without compiling each new shape.
    shapes = eqx.filter_eval_shape(build, size)
    tree = random_fill(shapes, seed)
    like = shapes if eval_shape else random_fill(shapes, seed + 1)
    with tempfile.TemporaryDirectory() as directory:
        path = ee.save(os.path.join(directory, "r.ckpt"), tree)
        restored = ee.load(path, like)
        assert_bitwise_equal(restored, tree)
        assert ee.load_manifest(path)["ensemble_size"] == size
        with pytest.raises(ee.CheckpointError, match=f"ensemble of {size} member"):
            ee.load(path, eqx.filter_eval_shape(build, size + 1))


# ---------------------------------------------------------------- multi-host

_MULTIHOST_WORKER = textwrap.dedent(
    """
    import os, sys
    process_id, port, path = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"localhost:{port}", num_processes=2,
        process_id=process_id, initialization_timeout=120,
    )
    import equinox as eqx, numpy as np
    import eqx_ensemble as ee
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    assert jax.process_count() == 2 and len(jax.devices()) == 8
    sharding = NamedSharding(Mesh(np.array(jax.devices()), ("members",)), P("members"))
    ens = ee.ensemble(lambda k: eqx.nn.MLP(3, 2, 8, 1, key=k), size=8,
                      key=jax.random.key(0))
    keys = jax.random.split(jax.random.key(3), 8)

    def to_global(x):
        host = np.asarray(jax.random.key_data(x) if x.dtype == keys.dtype else x)
        out = jax.make_array_from_callback(host.shape, sharding, lambda i: host[i])
        return jax.random.wrap_key_data(out) if x.dtype == keys.dtype else out

    tree = jax.tree.map(lambda x: to_global(x) if eqx.is_array(x) else x,
                        {"ens": ens, "keys": keys, "step": 5})
    assert not tree["ens"].members.layers[0].weight.is_fully_addressable
    ee.save(path, tree, metadata={"process_count": 2})
    assert os.path.exists(path)
    restored = ee.load(path, tree)  # back onto the 2-process mesh
    for got, want in zip(jax.tree.leaves(eqx.filter(restored, eqx.is_array)),
                         jax.tree.leaves(eqx.filter(tree, eqx.is_array))):
        assert got.sharding == want.sharding
        for got_shard, want_shard in zip(got.addressable_shards,
                                         want.addressable_shards):
            g, w = got_shard.data, want_shard.data
            if g.dtype == keys.dtype:
                g, w = jax.random.key_data(g), jax.random.key_data(w)
            assert np.array_equal(np.asarray(g), np.asarray(w))
    local = ee.load(path, {"ens": ens, "keys": keys, "step": 0})  # one device
    assert eqx.tree_equal(local["ens"], ens) and local["step"] == 5
    print("OK", process_id, flush=True)
    """
)


def _free_port():
    with socket.socket() as probe:
        probe.bind(("localhost", 0))
        return probe.getsockname()[1]


@pytest.mark.slow
def test_multihost_save_gathers_and_every_process_loads(tmp_path, processes):
    script = tmp_path / "worker.py"
    script.write_text(_MULTIHOST_WORKER)
    path = tmp_path / "multihost.ckpt"
    port = str(_free_port())
    for process_id in (0, 1):
        processes.append(
            subprocess.Popen(
                [sys.executable, str(script), str(process_id), port, str(path)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    for process_id, process in enumerate(processes):
        out, err = process.communicate(timeout=300)
        assert process.returncode == 0, err[-3000:]
        assert f"OK {process_id}" in out
    # The single file process 0 wrote loads here, in one process with 8 devices.
    ens = ee.ensemble(
        lambda k: eqx.nn.MLP(3, 2, 8, 1, key=k), size=8, key=jax.random.key(0)
    )
    keys = jax.random.split(jax.random.key(3), 8)
    restored = ee.load(path, {"ens": ens, "keys": keys, "step": 0})
    assert_bitwise_equal(restored, {"ens": ens, "keys": keys, "step": 5})
    assert ee.load_manifest(path)["metadata"] == {"process_count": 2}
