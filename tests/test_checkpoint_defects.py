"""Checkpoint defects found by the adversarial review (issue 13): each test failed
on the code before the fix."""

import json
import os
import stat
import struct
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tree_equal

import eqx_ensemble as ee
from eqx_ensemble._checkpoints.file import _HEADER, MAGIC, TEMP_SUFFIX


def _tree():
    return {"w": jnp.arange(6.0).reshape(2, 3), "key": jax.random.key(0)}


def _call_with_timeout(fn, seconds=10.0):
    """`fn()` in a thread; fails the test if it blocks (a hang)."""
    outcome = {}

    def run():
        try:
            outcome["value"] = fn()
        except BaseException as error:  # noqa: BLE001 - reported below
            outcome["error"] = error

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), "the call blocked"
    return outcome


def test_fifo_named_like_a_checkpoint_neither_hangs_nor_is_listed(tmp_path):
    ee.save_checkpoint(tmp_path, 1, _tree())
    os.mkfifo(tmp_path / "step_0000000002.ckpt")
    assert [s for s, _ in ee.list_checkpoints(tmp_path)] == [1]
    assert ee.latest_checkpoint(tmp_path) == tmp_path / "step_0000000001.ckpt"
    outcome = _call_with_timeout(
        lambda: ee.load(tmp_path / "step_0000000002.ckpt", _tree())
    )
    assert isinstance(outcome.get("error"), ee.CheckpointError)
    assert "named pipe" in str(outcome["error"])


def test_directory_in_place_of_a_file_is_refused(tmp_path):
    (tmp_path / "dir.ckpt").mkdir()
    with pytest.raises(ee.CheckpointError, match="not a regular file .a directory"):
        ee.load(tmp_path / "dir.ckpt", _tree())


def test_overwrite_keeps_the_files_permissions(tmp_path):
    path = tmp_path / "private.ckpt"
    ee.save(path, _tree())
    os.chmod(path, 0o600)
    ee.save(path, _tree())
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600


def test_save_removes_stale_temporaries_of_its_own_interrupted_writes(tmp_path):
    path = tmp_path / "model.ckpt"
    stale = tmp_path / f".model.ckpt.0123456789abcdef{TEMP_SUFFIX}"
    fresh = tmp_path / f".model.ckpt.fedcba9876543210{TEMP_SUFFIX}"
    unrelated = tmp_path / f".other.ckpt.0123456789abcdef{TEMP_SUFFIX}"
    for file in (stale, fresh, unrelated):
        file.write_bytes(b"x" * 100)
    old = os.stat(stale).st_mtime - 7200
    os.utime(stale, (old, old))
    os.utime(unrelated, (old, old))
    ee.save(path, _tree())
    assert not stale.exists()  # an interrupted write of this target, long dead
    assert fresh.exists()  # may belong to a writer still running
    assert unrelated.exists()  # another target's


@pytest.mark.parametrize("bad", [3, 3.5, b"run", None])
def test_non_path_arguments_are_refused(tmp_path, bad):
    # An int would be taken as an open file descriptor by `os.listdir`.
    match = "must be a path|parameter"
    with pytest.raises(TypeError, match=match):
        ee.latest_checkpoint(bad)
    with pytest.raises(TypeError, match=match):
        ee.list_checkpoints(bad)
    with pytest.raises(TypeError, match=match):
        ee.save(bad, _tree())
    with pytest.raises(TypeError, match=match):
        ee.load(bad, _tree())


def test_the_library_refuses_non_paths_itself(tmp_path):
    from eqx_ensemble._checkpoints.file import as_path

    with pytest.raises(TypeError, match="`directory` must be a path .* got int 3"):
        as_path(3, "directory")


def _rewrite_manifest(path, change):
    """Rewrite a checkpoint's manifest (a forged or damaged file), keeping its
    header consistent so that only the manifest's content is wrong."""
    import hashlib

    raw = path.read_bytes()
    _, length, _ = _HEADER.unpack(raw[: _HEADER.size])
    manifest = json.loads(raw[_HEADER.size : _HEADER.size + length])
    data = raw[_HEADER.size + length :]
    manifest = change(manifest)
    body = json.dumps(manifest).encode() if isinstance(manifest, dict) else manifest
    header = _HEADER.pack(MAGIC, len(body), hashlib.sha256(body).digest())
    path.write_bytes(header + body + data)


def _leaf(manifest, name):
    return next(r for r in manifest["leaves"] if r["path"] == name)


def _huge_shape(manifest):
    _leaf(manifest, "['w']")["shape"] = [2**40, 2**40, 2**40, 2**40]
    return manifest


def _wrapping_shape(manifest):
    # 2**62 * 2**2 * 4 bytes wraps to 0 in int64: must not pass as 24 bytes.
    _leaf(manifest, "['w']")["shape"] = [2**62, 4]
    return manifest


def _unknown_key_impl(manifest):
    _leaf(manifest, "['key']")["impl"] = "no_such_prng"
    return manifest


def _other_key_shape(manifest):
    _leaf(manifest, "['key']")["data_shape"] = [1, 2]
    return manifest


def _deep_json(manifest):
    depth = 100_000
    return ("[" * depth + "]" * depth).encode()


@pytest.mark.parametrize(
    "change",
    [_huge_shape, _wrapping_shape, _unknown_key_impl, _other_key_shape, _deep_json],
)
def test_forged_manifests_are_checkpoint_errors(tmp_path, change):
    path = tmp_path / "forged.ckpt"
    ee.save(path, _tree())
    _rewrite_manifest(path, change)
    with pytest.raises(ee.CheckpointError):
        ee.load(path, _tree())


def test_key_leaf_is_checked_against_like(tmp_path):
    path = tmp_path / "keys.ckpt"
    ee.save(path, {"key": jax.random.key(0, impl="rbg")})
    with pytest.raises(ee.CheckpointError, match="`\\['key'\\]` differs"):
        ee.load(path, {"key": jax.random.key(0)})
    restored = ee.load(path, {"key": jax.random.key(1, impl="rbg")})
    assert jnp.array_equal(
        jax.random.key_data(restored["key"]),
        jax.random.key_data(jax.random.key(0, impl="rbg")),
    )


def test_writable_check_and_fallback_helpers(tmp_path):
    from eqx_ensemble._checkpoints.directory import (
        check_writable_directory,
        newest_intact_checkpoint,
    )

    assert check_writable_directory(tmp_path / "new" / "run").is_dir()
    assert list((tmp_path / "new" / "run").iterdir()) == []  # the probe is gone
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ee.CheckpointError, match="Cannot write checkpoints to"):
        check_writable_directory(blocker / "run")
    for step in (1, 2, 3):
        ee.save_checkpoint(tmp_path / "run", step, _tree())
    newest = ee.latest_checkpoint(tmp_path / "run")
    assert newest is not None
    newest.write_bytes(newest.read_bytes()[:-5])

    def verify(path):
        ee.load(path, _tree())

    path, skipped = newest_intact_checkpoint(tmp_path / "run", verify)
    assert path is not None and path.name == "step_0000000002.ckpt"
    assert [p.name for p, _ in skipped] == ["step_0000000003.ckpt"]
    assert "truncated" in skipped[0][1]


def test_unchanged_behaviour_round_trip(tmp_path):
    # The fixes leave a plain save/load bit for bit.
    tree = _tree()
    ee.save(tmp_path / "a.ckpt", tree)
    restored = ee.load(tmp_path / "a.ckpt", tree)
    assert tree_equal(restored["w"], tree["w"])
    assert np.array_equal(
        jax.random.key_data(restored["key"]), jax.random.key_data(tree["key"])
    )


def test_struct_header_is_what_the_tests_assume():
    assert _HEADER.size == struct.calcsize("<8sQ32s")
