"""Sharded checkpoints (issue 27, item 2): a folder per checkpoint, each shard one
chunk of a tensorstore zarr array with its sha256 in the manifest. One process
with 8 virtual CPU devices here; tests/test_multiprocess.py writes and reads them
from 2 processes."""

import json
import shutil
import sys
import threading

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, PartitionSpec as P

import eqx_ensemble as ee
from eqx_ensemble._checkpoints.file import write_file
from eqx_ensemble._checkpoints.io import open_manifest
from eqx_ensemble._checkpoints.sharded import LazyLeaf, ShardedReader

W = 16
X = jnp.stack([jnp.linspace(-1, 1, 64), jnp.cos(jnp.linspace(0, 3, 64))], axis=1)
Y = jnp.sin(X[:, :1]) + X[:, 1:]


def ensemble(size=4, key=0):
    return ee.ensemble(
        lambda k: eqx.nn.MLP(2, 1, W, 2, key=k), size=size, key=jax.random.key(key)
    )


def megatron(member):
    specs = eqx.tree_at(
        lambda m: (m.layers[0].weight, m.layers[0].bias, m.layers[1].weight),
        member,
        (P("model", None), P("model"), P(None, "model")),
    )
    return jax.tree.map(lambda s: s if isinstance(s, P) else None, specs)


def loss(model, batch, key):
    x, y = batch
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


def bits(tree):
    """Every array leaf as NumPy (typed keys as their key data), for bitwise checks."""

    def host(leaf):
        if isinstance(leaf, jax.Array) and jnp.issubdtype(
            leaf.dtype, jax.dtypes.prng_key
        ):
            leaf = jax.random.key_data(leaf)
        return np.asarray(leaf)

    return [host(x) for x in jax.tree.leaves(eqx.filter(tree, eqx.is_array))]


def assert_bitwise(got, want):
    got, want = bits(got), bits(want)
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(
            a.reshape(-1).view(np.uint8), b.reshape(-1).view(np.uint8)
        )


def mixed_tree():
    return {
        "ens": ensemble(),
        "keys": jax.random.split(jax.random.key(1), 4),
        "raw_key": jax.random.PRNGKey(3),
        "numpy": np.arange(5.0),
        "float": 1.5,
        "bf16": jnp.linspace(0, 1, 15, dtype=jnp.bfloat16).reshape(3, 5),
        "int4": jnp.arange(-4, 4, dtype=jnp.int4),
        # Dtypes tensorstore does not store: kept as bytes (a trailing axis).
        "uint4": jnp.arange(4, dtype=jnp.uint4).reshape(2, 2),
        "float8": jnp.linspace(-1, 1, 6).astype(jnp.float8_e4m3),
        "empty": jnp.zeros((0, 3)),
        "scalar": jnp.int32(7),
        "bool": jnp.array([True, False]),
    }


def chunk_files(path):
    return sorted(
        p for p in (path / "arrays").rglob("*") if p.is_file() and "c" in p.parts
    )


def test_round_trip_of_every_kind_of_leaf(tmp_path):
    tree = mixed_tree()
    path = ee.save(tmp_path / "tree.ckpt", tree, sharded=True, metadata={"a": 1})
    assert path.is_dir() and (path / "manifest.ckpt").is_file()
    restored = ee.load(path, tree)
    assert_bitwise(restored, tree)
    assert restored["float"] == 1.5 and type(restored["numpy"]) is np.ndarray
    manifest = ee.verify_checkpoint(path)
    assert manifest["metadata"] == {"a": 1}
    stored = [leaf for leaf in manifest["leaves"] if "store" in leaf]
    # Every jax.Array is stored in chunks (the empty one has none), NumPy inline.
    assert len(stored) == sum(isinstance(x, jax.Array) for x in jax.tree.leaves(tree))
    assert all(
        len(leaf["store"]["chunks"]) == 1 for leaf in stored if leaf["shape"] != [0, 3]
    )
    # Through `eval_shape` structs too (no real `like` needed).
    like = {**tree, "ens": eqx.filter_eval_shape(ensemble)}
    assert_bitwise(ee.load(path, like)["ens"], tree["ens"])


def test_each_shard_is_one_chunk_written_once_and_loads_on_any_mesh(tmp_path):
    mesh = ee.make_mesh(members=2, data=2, model=2, axis_types=AxisType.Auto)
    ens = ee.shard(ensemble(), mesh, model=megatron)
    path = ee.save(tmp_path / "ens.ckpt", ens, sharded=True)
    manifest = ee.load_manifest(path)
    total = 0
    stored = [record for record in manifest["leaves"] if "store" in record]
    for record, leaf in zip(
        stored, jax.tree.leaves(eqx.filter(ens, eqx.is_array)), strict=True
    ):
        store = record["store"]
        shard = leaf.addressable_shards[0].data.shape
        assert tuple(store["chunk"]) == shard  # the chunk is the shard
        # One chunk per distinct shard: replicas ("data") are written once.
        distinct = {str(s.index) for s in leaf.addressable_shards}
        assert len(store["chunks"]) == len(distinct)
        total += len(store["chunks"]) * int(np.prod(shard)) * leaf.dtype.itemsize
    stored_bytes = sum(p.stat().st_size for p in chunk_files(path))
    assert stored_bytes == total == sum(x.nbytes for x in bits(ens))
    # The same mesh: every leaf back on its shards.
    like = ee.shard(ensemble(key=9), mesh, model=megatron)
    back = ee.load(path, like)
    assert_bitwise(back, ens)
    arrays = [eqx.filter(tree, eqx.is_array) for tree in (back, ens)]
    for got, want in zip(*map(jax.tree.leaves, arrays), strict=True):
        assert got.sharding == want.sharding
    # One device, and 4 devices (members 2 x model 2).
    assert_bitwise(ee.load(path, ensemble(key=9)), ens)
    small = ee.make_mesh(members=2, model=2, devices=jax.devices()[:4])
    back = ee.load(path, ee.shard(ensemble(key=9), small, model=megatron))
    assert_bitwise(back, ens)
    assert back.members.layers[1].weight.sharding.mesh.devices.size == 4


def test_a_region_reads_only_the_chunks_it_overlaps(tmp_path):
    mesh = ee.make_mesh(members=4, devices=jax.devices()[:4])
    ens = ee.shard(ensemble(), mesh)
    path = ee.save(tmp_path / "ens.ckpt", ens, sharded=True)
    weight_index = 0  # layers[0].weight, (4, 16, 2) in chunks of (1, 16, 2)
    (path / "arrays" / "0" / "c" / "3" / "0" / "0").unlink()  # member 3's chunk
    with open_manifest(path) as file:
        record = file.manifest["leaves"][weight_index]
        lazy = LazyLeaf(ShardedReader(path, file), weight_index, record)
        part = lazy[(slice(0, 3),)]  # members 0-2: never touches member 3's chunk
        np.testing.assert_array_equal(
            part, np.asarray(ens.members.layers[0].weight[:3])
        )
        with pytest.raises(ee.CheckpointError, match=r"c/3/0/0 .* is missing"):
            lazy.full()


@pytest.mark.parametrize("damage", ["flip", "truncate", "swap", "remove", "grow"])
def test_a_damaged_chunk_is_refused_naming_its_file(tmp_path, damage):
    mesh = ee.make_mesh(members=4, devices=jax.devices()[:4])
    ens = ee.shard(ensemble(), mesh)
    path = ee.save(tmp_path / "ens.ckpt", ens, sharded=True)
    chunk = path / "arrays" / "2" / "c" / "1" / "0" / "0"  # layers[1].weight, member 1
    other = path / "arrays" / "2" / "c" / "2" / "0" / "0"
    data = bytearray(chunk.read_bytes())
    if damage == "flip":
        data[17] ^= 0x40
        chunk.write_bytes(bytes(data))
    elif damage == "truncate":
        chunk.write_bytes(bytes(data[:-4]))
    elif damage == "grow":
        chunk.write_bytes(bytes(data) + b"\0")
    elif damage == "swap":
        chunk.write_bytes(other.read_bytes())
        other.write_bytes(bytes(data))
    else:
        chunk.unlink()
    pattern = r"c/1/0/0 \(leaf `\.members\.layers\[1\]\.weight`\)"
    with pytest.raises(ee.CheckpointError, match=pattern):
        ee.load(path, ensemble(key=9))
    with pytest.raises(ee.CheckpointError, match=pattern):
        ee.verify_checkpoint(path)


def _rewrite_manifest(path, change):
    with open_manifest(path) as file:
        manifest = dict(file.manifest)
        data = bytes(file.read_data())
    manifest.pop("data")
    change(manifest)
    write_file(path / "manifest.ckpt", manifest, [data] if data else [])


def test_a_forged_manifest_or_array_is_refused(tmp_path):
    mesh = ee.make_mesh(members=4, devices=jax.devices()[:4])
    path = ee.save(tmp_path / "ens.ckpt", ee.shard(ensemble(), mesh), sharded=True)
    backup = tmp_path / "backup"
    shutil.copytree(path, backup)

    def drop_a_chunk(manifest):
        manifest["leaves"][0]["store"]["chunks"].pop()

    def duplicate_a_chunk(manifest):
        chunks = manifest["leaves"][0]["store"]["chunks"]
        chunks[1] = dict(chunks[0])

    def outside_the_grid(manifest):
        manifest["leaves"][0]["store"]["chunks"][0]["at"] = [9, 0, 0]

    for change, message in (
        (drop_a_chunk, r"shards do not cover the array \(3 chunks recorded, 4 needed"),
        (duplicate_a_chunk, "a chunk is recorded twice"),
        (outside_the_grid, "malformed chunk entry"),
    ):
        _rewrite_manifest(path, change)
        with pytest.raises(ee.CheckpointError, match=message):
            ee.load(path, ensemble(key=9))
        with pytest.raises(ee.CheckpointError, match=message):
            ee.verify_checkpoint(path)
        shutil.rmtree(path)
        shutil.copytree(backup, path)
    # An array's metadata altered: its shape no longer the manifest's.
    meta = path / "arrays" / "0" / "zarr.json"
    spec = json.loads(meta.read_text())
    spec["shape"] = [8, 16, 2]
    meta.write_text(json.dumps(spec))
    with pytest.raises(ee.CheckpointError, match=r"arrays/0/zarr.json\) holds"):
        ee.load(path, ensemble(key=9))
    # A folder that is no checkpoint; a single file that claims stored chunks.
    (tmp_path / "empty.ckpt").mkdir()
    with pytest.raises(
        ee.CheckpointError, match=r"a directory without a manifest.ckpt"
    ):
        ee.load(tmp_path / "empty.ckpt", ensemble())
    single = ee.save(tmp_path / "single.ckpt", ensemble())
    with open_manifest(path) as file:
        forged = dict(file.manifest)
    forged.pop("data")
    write_file(single, forged, [])
    with pytest.raises(ee.CheckpointError, match="names stored shards, which a single"):
        ee.load(single, ensemble())


def test_fit_resumes_a_sharded_run_bit_for_bit_keeping_the_split(tmp_path):
    mesh = ee.make_mesh(members=2, data=2, model=2, axis_types=AxisType.Auto)
    opt = optax.adam(1e-2)
    kwargs = dict(
        batch_size=16,
        key=jax.random.key(1),
        callbacks=(),
        execution=ee.Execution(mesh=mesh),
    )
    straight = ee.fit(
        ee.shard(ensemble(), mesh, model=megatron), loss, opt, (X, Y), steps=8, **kwargs
    )
    run = ee.Checkpoints(tmp_path / "run", every=2, keep=2, sharded=True)
    ens = ee.shard(ensemble(), mesh, model=megatron)
    ee.fit(ens, loss, opt, (X, Y), steps=4, checkpoints=run, **kwargs)
    listed = ee.list_checkpoints(tmp_path / "run")
    assert [step for step, _ in listed] == [2, 4]  # keep=2 removed step 2's folder
    assert all(p.is_dir() for _, p in listed)
    resumed = ee.fit(ens, loss, opt, (X, Y), steps=8, checkpoints=run, **kwargs)
    assert resumed.resumed_from == 4
    assert_bitwise(resumed.ensemble, straight.ensemble)
    np.testing.assert_array_equal(resumed.history.losses, straight.history.losses)
    weight = resumed.ensemble.members.layers[1].weight
    assert tuple(weight.sharding.spec)[:3] == ("members", None, "model")
    # A damaged newest checkpoint: refused by default, skipped with "previous".
    newest = ee.latest_checkpoint(tmp_path / "run")
    assert newest is not None and newest.name == "step_0000000008.ckpt"
    victim = next(p for p in chunk_files(newest) if p.stat().st_size > 64)
    data = bytearray(victim.read_bytes())
    data[5] ^= 1
    victim.write_bytes(bytes(data))
    with pytest.raises(ee.CheckpointError, match="is corrupt or was swapped"):
        ee.fit(ens, loss, opt, (X, Y), steps=8, checkpoints=run, **kwargs)
    fallback = ee.Checkpoints(
        tmp_path / "run", every=2, sharded=True, on_corrupt="previous"
    )
    with pytest.warns(UserWarning, match="step_0000000008.ckpt"):
        again = ee.fit(ens, loss, opt, (X, Y), steps=8, checkpoints=fallback, **kwargs)
    assert again.resumed_from == 6
    assert_bitwise(again.ensemble, straight.ensemble)


def test_an_interrupted_write_is_never_listed_and_is_cleaned_up(tmp_path, monkeypatch):
    from eqx_ensemble._checkpoints import sharded

    state = {"w": jnp.arange(4.0)}
    ee.save_checkpoint(tmp_path, 1, state, sharded=True)

    def fail(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(sharded, "write_file", fail)
    with pytest.raises(OSError, match="the checkpoint was not written"):
        ee.save_checkpoint(tmp_path, 2, state, sharded=True)
    monkeypatch.undo()
    assert [step for step, _ in ee.list_checkpoints(tmp_path)] == [1]
    assert not list(tmp_path.glob(".*.tmp"))  # the failed write removed its folder
    # A folder left by a killed writer is not a checkpoint, and the next save
    # removes it.
    (tmp_path / ".step_0000000003.ckpt.sharded.tmp" / "arrays").mkdir(parents=True)
    assert [step for step, _ in ee.list_checkpoints(tmp_path)] == [1]
    ee.save_checkpoint(tmp_path, 4, state, sharded=True)
    assert not list(tmp_path.glob(".*.tmp"))
    # A checkpoint of the same step is replaced, in either format.
    ee.save_checkpoint(tmp_path, 4, {"w": jnp.ones(4)}, sharded=False)
    assert (tmp_path / "step_0000000004.ckpt").is_file()
    ee.save_checkpoint(tmp_path, 4, {"w": jnp.zeros(4)}, sharded=True)
    path = ee.latest_checkpoint(tmp_path)
    assert path is not None and path.is_dir()
    np.testing.assert_array_equal(ee.load(path, state)["w"], np.zeros(4))


def test_bad_arguments_and_a_missing_tensorstore_are_named(tmp_path, monkeypatch):
    with pytest.raises(TypeError, match="sharded"):
        ee.save(tmp_path / "a.ckpt", {"w": jnp.ones(2)}, sharded="yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="sharded"):
        ee.Checkpoints(tmp_path, sharded=1)  # type: ignore[arg-type]
    monkeypatch.setitem(sys.modules, "tensorstore", None)
    with pytest.raises(ImportError, match=r"eqx_ensemble\[distributed\]"):
        ee.save(tmp_path / "b.ckpt", {"w": jnp.ones(2)}, sharded=True)
    assert not (tmp_path / "b.ckpt").exists()


# -- asynchronous checkpoints ---------------------------------------------------


def _fit(ens, folder=None, steps=6, callbacks=(), per_dispatch=2, **checkpoints):
    return ee.fit(
        ens,
        loss,
        optax.adam(1e-2),
        (X, Y),
        steps=steps,
        batch_size=16,
        key=jax.random.key(1),
        callbacks=callbacks,
        checkpoints=None
        if folder is None
        else ee.Checkpoints(folder, every=2, keep=None, **checkpoints),
        execution=ee.Execution(steps_per_dispatch=per_dispatch),
    )


@pytest.mark.parametrize("sharded", [False, True])
def test_asynchronous_checkpoints_equal_synchronous_ones_and_resume(tmp_path, sharded):
    sync = _fit(ensemble(), tmp_path / "sync", sharded=sharded)
    run = _fit(ensemble(), tmp_path / "async", sharded=sharded, asynchronous=True)
    assert_bitwise(run.ensemble, sync.ensemble)
    steps = [
        [s for s, _ in ee.list_checkpoints(tmp_path / f)] for f in ("sync", "async")
    ]
    assert (
        steps == [[2, 4, 6]] * 2
    )  # every one committed (the last before fit returned)
    opt = optax.adam(1e-2)
    for (_, a), (_, b) in zip(
        ee.list_checkpoints(tmp_path / "sync"),
        ee.list_checkpoints(tmp_path / "async"),
        strict=True,
    ):
        assert a.is_dir() == b.is_dir() == sharded
        ee.verify_checkpoint(b)
    shutil.rmtree(tmp_path / "async" / "step_0000000006.ckpt", ignore_errors=True)
    (tmp_path / "async" / "step_0000000006.ckpt").unlink(missing_ok=True)
    resumed = _fit(ensemble(), tmp_path / "async", sharded=sharded, asynchronous=True)
    assert resumed.resumed_from == 4
    assert_bitwise(resumed.ensemble, sync.ensemble)
    latest = ee.Checkpoints(tmp_path / "async").latest(ensemble(), opt)
    assert latest is not None and latest.step == 6


@pytest.mark.parametrize("sharded", [False, True])
def test_training_goes_on_while_a_checkpoint_is_written(tmp_path, monkeypatch, sharded):
    from eqx_ensemble._checkpoints import io, sharded as sharded_module

    module = sharded_module if sharded else io
    release = threading.Event()
    log = []
    real = module.write_file

    def slow(path, manifest, chunks):
        if manifest.get("step") == 2:  # the checkpoint of step 2 waits...
            release.wait(timeout=20)
            log.append("step 2 written")
        return real(path, manifest, chunks)

    def callback(result):
        log.append(f"dispatch to {result.step}")
        if result.step == 3:  # ...until training has gone on to step 3
            release.set()

    monkeypatch.setattr(module, "write_file", slow)
    _fit(
        ensemble(),
        tmp_path / "run",
        steps=5,
        per_dispatch=1,
        callbacks=(callback,),
        sharded=sharded,
        asynchronous=True,
    )
    # (a synchronous save would block at step 2 until the 20 s timeout)
    expected = ["dispatch to 1", "dispatch to 2", "dispatch to 3", "step 2 written"]
    assert log[:4] == expected, log


def test_a_failed_background_write_is_raised_with_the_run(tmp_path, monkeypatch):
    from eqx_ensemble._checkpoints import io

    real = io.write_file

    def failing(path, manifest, chunks):
        if manifest.get("step") == 2:
            raise OSError(28, "No space left on device")
        return real(path, manifest, chunks)

    monkeypatch.setattr(io, "write_file", failing)
    with pytest.raises(ee.CheckpointError, match="in the background failed") as caught:
        _fit(ensemble(), tmp_path / "run", asynchronous=True)
    result = caught.value.result  # type: ignore[attr-defined]
    assert result.step == 4  # raised at the next checkpoint, the run attached
    assert ee.list_checkpoints(tmp_path / "run") == []
    with pytest.raises(TypeError, match="asynchronous"):
        ee.Checkpoints(tmp_path, asynchronous=None)  # type: ignore[arg-type]


def test_a_folder_that_is_no_checkpoint_is_never_replaced(tmp_path):
    folder = tmp_path / "results"
    (folder / "sub").mkdir(parents=True)
    (folder / "sub" / "important.txt").write_text("keep me")
    for sharded in (True, False):
        with pytest.raises(OSError, match="not a checkpoint is in the way"):
            ee.save(folder, {"w": jnp.ones(2)}, sharded=sharded)
        assert (folder / "sub" / "important.txt").read_text() == "keep me"
    # A sharded checkpoint and a single file replace each other.
    path = tmp_path / "a.ckpt"
    ee.save(path, {"w": jnp.ones(2)}, sharded=True)
    ee.save(path, {"w": jnp.zeros(2)}, sharded=False)
    assert path.is_file()
    ee.save(path, {"w": jnp.full(2, 2.0)}, sharded=True)
    np.testing.assert_array_equal(ee.load(path, {"w": jnp.ones(2)})["w"], [2.0, 2.0])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.ckpt", "results"]


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_tensorstore_failure_is_a_checkpoint_error_with_the_run(
    tmp_path, monkeypatch, asynchronous
):
    from eqx_ensemble._checkpoints import writer

    real = writer.on_every_process

    def in_the_way(work, path):
        real(work, path)
        if work is not None and work.__name__ == "create":
            # A file where the first array's chunk folder goes: tensorstore's
            # write fails (it reports a ValueError).
            arrays = sorted((writer.partial_folder(path) / "arrays").iterdir())
            (arrays[0] / "c").write_text("x")

    monkeypatch.setattr(writer, "on_every_process", in_the_way)
    with pytest.raises(OSError, match="tensorstore could not write"):
        ee.save(tmp_path / "a.ckpt", {"w": jnp.ones(3)}, sharded=True)
    assert not list(tmp_path.iterdir())  # nothing left behind
    folder = tmp_path / "run"
    with pytest.raises(
        ee.CheckpointError, match="tensorstore could not write"
    ) as caught:
        _fit(ensemble(), folder, sharded=True, asynchronous=asynchronous)
    assert caught.value.result.step in (2, 4)  # type: ignore[attr-defined]
    assert ee.list_checkpoints(folder) == []


def test_a_checkpoint_set_aside_by_a_killed_writer_comes_back(tmp_path):
    from eqx_ensemble._checkpoints.writer import set_aside

    state = {"w": jnp.arange(3.0)}
    ee.save_checkpoint(tmp_path, 5, state, sharded=True)
    # A writer replacing step 5 died between its two renames: step 5 is aside.
    set_aside(tmp_path / "step_0000000005.ckpt")
    assert ee.list_checkpoints(tmp_path) == []
    ee.save_checkpoint(tmp_path, 6, state, sharded=True)  # the next save restores it
    assert [step for step, _ in ee.list_checkpoints(tmp_path)] == [5, 6]
    assert not list(tmp_path.glob(".*"))
    # Pruned folders leave the listing before they are removed.
    ee.save_checkpoint(tmp_path, 7, state, sharded=True, keep=1)
    assert [step for step, _ in ee.list_checkpoints(tmp_path)] == [7]
    assert not list(tmp_path.glob(".*"))


def test_a_sharded_checkpoint_through_a_symlink(tmp_path):
    path = ee.save(tmp_path / "real.ckpt", {"w": jnp.ones(2)}, sharded=True)
    link = tmp_path / "link.ckpt"
    link.symlink_to(path)
    np.testing.assert_array_equal(ee.load(link, {"w": jnp.zeros(2)})["w"], [1, 1])
    assert ee.verify_checkpoint(link)["step"] is None
