"""Checkpoint reliability (issue 13): special files, permissions, temporaries of
interrupted writes, key leaves, forged manifests, step numbers, fallback to an
intact checkpoint, path arguments, writable folders and failed writes.

Each test names the defect it pins; they fail on the code before the fixes."""

import errno
import hashlib
import json
import os
import shutil
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import threading
import time
import tracemalloc
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tree_equal

import eqx_ensemble as ee
from eqx_ensemble._checkpoints import file as _checkpoint_file
from eqx_ensemble._checkpoints.directory import (
    _step_number,
    check_writable_directory,
    newest_intact_checkpoint,
)
from eqx_ensemble._checkpoints.file import _HEADER, MAGIC, TEMP_SUFFIX

ROOT = os.geteuid() == 0 if hasattr(os, "geteuid") else False


def _tree(scale=1.0):
    return {
        "w": jnp.arange(6.0).reshape(2, 3) * scale,
        "key": jax.random.key(0),
        "lr": 0.5,
        "n": 3,
        "flag": True,
        "z": 1 + 2j,
    }


def _within(seconds, fn):
    """`fn()` in a thread; the test fails if it blocks (a hang) for `seconds`."""
    outcome = {}

    def run():
        try:
            outcome["value"] = fn()
        except BaseException as error:  # noqa: BLE001 - reported to the test
            outcome["error"] = error

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), "the call blocked"
    return outcome


def _temporaries(directory):
    return sorted(name for name in os.listdir(directory) if name.endswith(".tmp"))


# ------------------------------------------------- 1. special files never block


def _make_fifo(path):
    os.mkfifo(path)


def _make_directory(path):
    path.mkdir()


def _make_symlink_to_fifo(path):
    os.mkfifo(path.with_name("pipe"))
    path.symlink_to(path.with_name("pipe"))


def _make_device(path):
    path.symlink_to("/dev/zero")  # a character device that never ends


@pytest.mark.parametrize(
    "make",
    [_make_fifo, _make_directory, _make_symlink_to_fifo, _make_device],
    ids=["fifo", "directory", "symlink-to-fifo", "device"],
)
def test_special_file_named_like_the_newest_checkpoint(tmp_path, make):
    ee.save_checkpoint(tmp_path, 1, _tree())
    special = tmp_path / "step_0000000002.ckpt"
    make(special)
    # Skipped by the listing, so a resume picks the real newest file...
    assert ee.list_checkpoints(tmp_path) == [(1, tmp_path / "step_0000000001.ckpt")]
    assert ee.latest_checkpoint(tmp_path) == tmp_path / "step_0000000001.ckpt"
    # ...and refused, without blocking, by everything that reads a file.
    for read in (
        lambda: ee.load(special, _tree()),
        lambda: ee.load_manifest(special),
        lambda: ee.verify_checkpoint(special),
    ):
        outcome = _within(10.0, read)
        assert isinstance(outcome.get("error"), ee.CheckpointError), outcome
        assert str(special) in str(outcome["error"])
        assert "not a regular file" in str(outcome["error"])


def test_socket_named_like_a_checkpoint_is_refused():
    # (a short folder: socket paths are limited to ~100 bytes)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "s.ckpt"
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            server.bind(str(path))
            outcome = _within(10.0, lambda: ee.load(path, _tree()))
        finally:
            server.close()
    assert isinstance(outcome.get("error"), ee.CheckpointError)
    assert "socket" in str(outcome["error"])


def test_a_file_swapped_for_a_fifo_after_the_check_does_not_block(
    tmp_path, monkeypatch
):
    # The check and the open are two steps: the open must not block either.
    path = tmp_path / "a.ckpt"
    ee.save(path, _tree())
    real_stat = os.stat

    def stat_then_swap(target, *args, **kwargs):
        result = real_stat(target, *args, **kwargs)
        if Path(target) == path and stat.S_ISREG(result.st_mode):
            os.unlink(path)
            os.mkfifo(path)
        return result

    monkeypatch.setattr(_checkpoint_file.os, "stat", stat_then_swap)
    outcome = _within(10.0, lambda: ee.load(path, _tree()))
    monkeypatch.undo()
    assert isinstance(outcome.get("error"), ee.CheckpointError), outcome


# ------------------------------------------------------ 2. permissions are kept


@pytest.mark.parametrize("mode", [0o600, 0o640, 0o444])
def test_overwriting_keeps_the_mode_of_the_existing_file(tmp_path, mode):
    path = tmp_path / "private.ckpt"
    ee.save(path, _tree())
    os.chmod(path, mode)
    ee.save(path, _tree(2.0))
    assert stat.S_IMODE(os.stat(path).st_mode) == mode
    assert float(ee.load(path, _tree())["w"][1, 2]) == 10.0  # the new content
    directory = tmp_path / "run"
    ee.save_checkpoint(directory, 5, _tree())
    os.chmod(directory / "step_0000000005.ckpt", mode)
    ee.save_checkpoint(directory, 5, _tree(2.0))
    assert stat.S_IMODE(os.stat(directory / "step_0000000005.ckpt").st_mode) == mode


def test_special_mode_bits_are_not_copied(tmp_path):
    path = tmp_path / "a.ckpt"
    ee.save(path, _tree())
    os.chmod(path, 0o4755)  # setuid: never worth copying onto a data file
    ee.save(path, _tree())
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o755


@pytest.mark.parametrize("umask, expected", [(0o077, 0o600), (0o022, 0o644)])
def test_a_new_file_follows_the_umask(tmp_path, umask, expected):
    previous = os.umask(umask)
    try:
        ee.save(tmp_path / "new.ckpt", _tree())
    finally:
        os.umask(previous)
    assert stat.S_IMODE(os.stat(tmp_path / "new.ckpt").st_mode) == expected


# ------------------------------- 3. temporaries of interrupted writes are removed


def _dead_writers_temporary(directory, target_name, token="0123456789abcdef"):
    """What a writer killed mid-save leaves: its temporary, with no lock held."""
    path = directory / f".{target_name}.{token}-p{2**22 + 7}.tmp"
    path.write_bytes(b"half a checkpoint" * 1000)
    return path


def test_the_next_save_removes_a_killed_writers_temporaries(tmp_path):
    for index in range(30):
        _dead_writers_temporary(tmp_path, "model.ckpt", f"{index:016x}")
    other_target = _dead_writers_temporary(tmp_path, "model.ckpt.1")
    assert len(_temporaries(tmp_path)) == 31
    ee.save(tmp_path / "model.ckpt", _tree())
    # All 30 of this target's are gone at once; another target's are its own.
    assert _temporaries(tmp_path) == [other_target.name]


def test_a_real_killed_save_is_cleaned_by_the_next_one(tmp_path):
    script = tmp_path / "killed.py"
    script.write_text(
        "import os, signal, sys\n"
        "import numpy as np\n"
        "import eqx_ensemble as ee\n"
        "os.fsync = lambda fd: os.kill(os.getpid(), signal.SIGKILL)\n"
        "ee.save(sys.argv[1], {'w': np.ones(250_000, np.float32)})\n"
    )
    target = tmp_path / "run" / "model.ckpt"
    result = subprocess.run(
        [sys.executable, str(script), str(target)], capture_output=True, timeout=120
    )
    assert result.returncode == -9, result.stderr
    assert len(_temporaries(target.parent)) == 1  # 1 MB left by the killed save
    ee.save(target, _tree())
    assert os.listdir(target.parent) == ["model.ckpt"]


_HOLDER = """
import fcntl, os, sys
descriptor = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
fcntl.flock(descriptor, fcntl.LOCK_EX)
os.write(descriptor, b"still writing")
print("locked", flush=True)
sys.stdin.readline()
"""


def test_a_live_writers_temporary_is_never_removed(tmp_path):
    # Another process in the middle of a save (it holds the lock, as `ee.save`
    # does) keeps its temporary, whatever its age; once it is gone, the next save
    # removes the file.
    live = tmp_path / f".model.ckpt.{'a' * 16}-p12345.tmp"
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(live)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "locked\n"
        long_ago = time.time() - 10 * 86400
        os.utime(live, (long_ago, long_ago))
        ee.save(tmp_path / "model.ckpt", _tree())
        ee.save_checkpoint(tmp_path, 1, _tree())
        assert live.read_bytes() == b"still writing"
    finally:
        holder.communicate("done\n", timeout=30)
    ee.save(tmp_path / "model.ckpt", _tree())
    assert not live.exists()


def test_a_concurrent_save_in_this_process_is_not_disturbed(tmp_path, monkeypatch):
    # Thread A is between writing its temporary and renaming it; thread B saves
    # the same target and cleans up meanwhile. A must still complete.
    target = tmp_path / "model.ckpt"
    paused, resume = threading.Event(), threading.Event()
    real_fsync = os.fsync

    def slow_fsync(descriptor):
        if threading.current_thread().name == "writer-a":
            paused.set()
            resume.wait(30)
        real_fsync(descriptor)

    outcome = {}

    def save_a():
        try:
            outcome["a"] = ee.save(target, _tree(1.0))
        except BaseException as error:  # noqa: BLE001 - reported below
            outcome["a"] = error

    monkeypatch.setattr(_checkpoint_file.os, "fsync", slow_fsync)
    thread = threading.Thread(target=save_a, name="writer-a")
    thread.start()
    assert paused.wait(30)
    assert len(_temporaries(tmp_path)) == 1
    ee.save(target, _tree(2.0))  # B: its cleanup must spare A's file
    resume.set()
    thread.join(30)
    assert outcome["a"] == target, outcome
    assert float(ee.load(target, _tree())["w"][1, 2]) == 5.0  # A renamed last
    assert _temporaries(tmp_path) == []


def test_a_writer_whose_fresh_file_was_taken_starts_over(tmp_path, monkeypatch):
    # The race the lock protocol closes: a cleaner removes a temporary between
    # its creation and its writer's lock. The writer must notice and retry.
    real_lock = _checkpoint_file._lock
    calls = []

    def lock_after_removal(descriptor, *, blocking):
        if blocking and not calls:
            calls.append(descriptor)
            (temporary,) = [
                tmp_path / n for n in os.listdir(tmp_path) if n.endswith(".tmp")
            ]
            os.unlink(temporary)  # what a cleaner that won the race does
        return real_lock(descriptor, blocking=blocking)

    monkeypatch.setattr(_checkpoint_file, "_lock", lock_after_removal)
    ee.save(tmp_path / "a.ckpt", _tree())
    assert calls  # the race happened
    assert os.listdir(tmp_path) == ["a.ckpt"]
    assert tree_equal(ee.load(tmp_path / "a.ckpt", _tree())["w"], _tree()["w"])


def test_what_is_not_an_abandoned_temporary_is_left_alone(tmp_path):
    target = tmp_path / "model.ckpt"
    old = time.time() - 7200
    # An older, non-locking version's temporary: removed after an hour only.
    legacy_fresh = tmp_path / ".model.ckpt.0123456789abcdef.tmp"
    legacy_old = tmp_path / ".model.ckpt.fedcba9876543210.tmp"
    # Look-alikes that are not ours: a folder, a symlink, other names.
    folder = tmp_path / ".model.ckpt.1111111111111111-p1.tmp"
    link = tmp_path / ".model.ckpt.2222222222222222-p1.tmp"
    elsewhere = tmp_path / "elsewhere.bin"
    notes = tmp_path / ".model.ckpt.notes.tmp"
    for path in (legacy_fresh, legacy_old, elsewhere, notes):
        path.write_bytes(b"x")
    folder.mkdir()
    link.symlink_to(elsewhere)
    for path in (legacy_old, notes):
        os.utime(path, (old, old))
    ee.save(target, _tree())
    assert not legacy_old.exists()
    for path in (legacy_fresh, folder, link, elsewhere, notes):
        assert path.exists() or path.is_symlink(), path


# ------------------------------------------------------------- 4. PRNG key leaves


def test_key_leaf_implementation_and_shape_are_checked(tmp_path):
    path = tmp_path / "keys.ckpt"
    ee.save(path, {"keys": jax.random.split(jax.random.key(0, impl="rbg"), 4)})
    with pytest.raises(ee.CheckpointError, match=r"`\['keys'\]` differs.*rbg"):
        ee.load(path, {"keys": jax.random.split(jax.random.key(0), 4)})
    with pytest.raises(ee.CheckpointError, match=r"shape \(4,\).*shape \(3,\)"):
        ee.load(path, {"keys": jax.random.split(jax.random.key(0, impl="rbg"), 3)})
    struct_like = {
        "keys": jax.eval_shape(
            lambda: jax.random.split(jax.random.key(0, impl="rbg"), 4)
        )
    }
    restored = ee.load(path, struct_like)
    expected = jax.random.key_data(jax.random.split(jax.random.key(0, impl="rbg"), 4))
    assert np.array_equal(jax.random.key_data(restored["keys"]), expected)
    assert jax.random.key_impl(restored["keys"]) == jax.random.key_impl(
        jax.random.key(0, impl="rbg")
    )


def test_raw_and_typed_keys_are_told_apart_with_a_fix(tmp_path):
    ee.save(tmp_path / "raw.ckpt", {"key": jax.random.PRNGKey(0)})
    with pytest.raises(ee.CheckpointError, match="wrap_key_data"):
        ee.load(tmp_path / "raw.ckpt", {"key": jax.random.key(0)})
    ee.save(tmp_path / "typed.ckpt", {"key": jax.random.key(0)})
    with pytest.raises(ee.CheckpointError, match="key_data"):
        ee.load(tmp_path / "typed.ckpt", {"key": jax.random.PRNGKey(0)})


# ----------------------------------------------- 5. forged or corrupt manifests


def _rewrite_manifest(path, change):
    """A forged file: the manifest changed, its hash in the header made to match."""
    raw = path.read_bytes()
    _, length, _ = _HEADER.unpack(raw[: _HEADER.size])
    manifest = json.loads(raw[_HEADER.size : _HEADER.size + length])
    data = raw[_HEADER.size + length :]
    changed = change(manifest)
    body = changed if isinstance(changed, bytes) else json.dumps(changed).encode()
    header = _HEADER.pack(MAGIC, len(body), hashlib.sha256(body).digest())
    path.write_bytes(header + body + data)


def _set(leaf, field, value):
    def change(manifest):
        next(r for r in manifest["leaves"] if r["path"] == f"['{leaf}']")[field] = value
        return manifest

    return change


_FORGERIES = {
    "huge shape": (_set("w", "shape", [2**40] * 4), "inconsistent"),
    "shape wrapping int64": (_set("w", "shape", [2**62, 4]), "inconsistent"),
    "negative offset": (_set("w", "offset", -64), "inconsistent"),
    "size not the shape's": (_set("w", "nbytes", 8), "inconsistent"),
    "float shape": (_set("w", "shape", [2.0, 3]), "malformed shape"),
    "big-endian dtype": (_set("w", "dtype", ">f4"), "unsupported dtype"),
    "object dtype": (_set("w", "dtype", "object"), "unsupported dtype"),
    "unknown kind": (_set("w", "kind", "tensor"), "unknown kind"),
    "unhashable kind": (_set("w", "kind", ["array"]), "malformed kind"),
    "unknown PRNG": (_set("key", "impl", "no_such_prng"), "unknown PRNG"),
    "key data shape": (_set("key", "data_shape", [1, 2]), "key data"),
    "bool as text": (_set("flag", "value", "false"), "malformed bool"),
    "float not hex": (_set("lr", "value", 123), "malformed float"),
    "int as inf": (_set("n", "value", 1e400), "malformed int"),
    "complex as text": (_set("z", "value", "x"), "malformed complex"),
    "leaves not a list": (lambda m: {**m, "leaves": {"a": 1}}, "no list of leaves"),
    "leaf not a dict": (lambda m: {**m, "leaves": [3]}, "leaf entry is malformed"),
    "deep JSON": (lambda m: b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    "manifest a list": (lambda m: [m], "malformed"),
}


@pytest.mark.parametrize("name", list(_FORGERIES))
def test_forged_manifests_are_checkpoint_errors(tmp_path, name):
    change, reason = _FORGERIES[name]
    path = tmp_path / "forged.ckpt"
    ee.save(path, _tree())
    _rewrite_manifest(path, change)
    like = _tree()
    if name == "huge shape":  # a `like` that agrees: only the layout check is left
        like["w"] = jax.ShapeDtypeStruct((2**40,) * 4, jnp.float32)
    tracemalloc.start()
    try:
        for read in (lambda: ee.load(path, like), lambda: ee.verify_checkpoint(path)):
            with pytest.raises(ee.CheckpointError) as caught:
                read()
            assert str(path) in str(caught.value)
            assert reason in str(caught.value)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 * 2**20  # bounded before allocating


# -------------------------------------------- 6. the step in the name and inside


def test_a_checkpoint_renamed_to_another_step_is_noticed(tmp_path):
    ee.save_checkpoint(tmp_path, 10, _tree())
    shutil.copy(tmp_path / "step_0000000010.ckpt", tmp_path / "step_0000000020.ckpt")
    assert ee.verify_checkpoint(tmp_path / "step_0000000010.ckpt")["step"] == 10
    with pytest.raises(ee.CheckpointError, match="records step 10 but its name says"):
        ee.verify_checkpoint(tmp_path / "step_0000000020.ckpt")
    path, skipped = newest_intact_checkpoint(tmp_path, ee.verify_checkpoint)
    assert path == tmp_path / "step_0000000010.ckpt"
    assert [p.name for p, _ in skipped] == ["step_0000000020.ckpt"]
    # A file saved with `ee.save` under any name records no step: nothing to check.
    ee.save(tmp_path / "step_0000000030.ckpt", _tree())
    assert ee.verify_checkpoint(tmp_path / "step_0000000030.ckpt")["step"] is None


# ------------------------------------ 7. the newest intact checkpoint, verified


def test_verify_checkpoint_checks_the_data_without_a_like(tmp_path):
    path = tmp_path / "a.ckpt"
    ee.save(path, _tree(), metadata={"epoch": 2})
    manifest = ee.verify_checkpoint(path)
    assert manifest["metadata"] == {"epoch": 2}
    assert manifest == ee.load_manifest(path)
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0x01  # one bit of the array data; the manifest is intact
    path.write_bytes(bytes(raw))
    ee.load_manifest(path)  # the manifest alone still reads
    with pytest.raises(ee.CheckpointError, match="the data is corrupt"):
        ee.verify_checkpoint(path)
    path.write_bytes(bytes(raw[:-7]))
    with pytest.raises(ee.CheckpointError, match="truncated"):
        ee.verify_checkpoint(path)
    with pytest.raises(FileNotFoundError, match="no checkpoint file"):
        ee.verify_checkpoint(tmp_path / "missing.ckpt")


def test_newest_intact_checkpoint_walks_back_past_damaged_files(tmp_path):
    for step in (1, 2, 3, 4):
        ee.save_checkpoint(tmp_path, step, _tree(float(step)))
    newest = tmp_path / "step_0000000004.ckpt"
    raw = bytearray(newest.read_bytes())
    raw[-1] ^= 0xFF
    newest.write_bytes(bytes(raw))
    (tmp_path / "step_0000000003.ckpt").write_bytes(b"")
    path, skipped = newest_intact_checkpoint(tmp_path, ee.verify_checkpoint)
    assert path == tmp_path / "step_0000000002.ckpt"
    assert [(p.name, "corrupt" in why or "empty" in why) for p, why in skipped] == [
        ("step_0000000004.ckpt", True),
        ("step_0000000003.ckpt", True),
    ]
    assert float(ee.load(path, _tree())["w"][0, 1]) == 2.0
    # With a `like` check instead: the same walk, any return value ignored.
    path, _ = newest_intact_checkpoint(tmp_path, lambda p: ee.load(p, _tree()))
    assert path == tmp_path / "step_0000000002.ckpt"
    for name in ("step_0000000001.ckpt", "step_0000000002.ckpt"):
        (tmp_path / name).write_bytes(b"junk")
    path, skipped = newest_intact_checkpoint(tmp_path, ee.verify_checkpoint)
    assert path is None and len(skipped) == 4
    assert newest_intact_checkpoint(tmp_path / "missing", ee.verify_checkpoint) == (
        None,
        [],
    )


def test_newest_intact_checkpoint_lets_other_errors_through(tmp_path):
    ee.save_checkpoint(tmp_path, 1, _tree())

    def broken(path):
        raise RuntimeError("a bug in the caller's check")

    with pytest.raises(RuntimeError, match="a bug"):
        newest_intact_checkpoint(tmp_path, broken)


# ----------------------------------------------------- 8. path arguments only


# Ours, or (in this test suite) the runtime type checker's, both naming it.
_NOT_A_PATH = "`{0}` must be a path|typechecking parameter '{0}'"

_PUBLIC = {
    "save": lambda p: ee.save(p, _tree()),
    "load": lambda p: ee.load(p, _tree()),
    "load_manifest": ee.load_manifest,
    "verify_checkpoint": ee.verify_checkpoint,
    "save_checkpoint": lambda p: ee.save_checkpoint(p, 1, _tree()),
    "latest_checkpoint": ee.latest_checkpoint,
    "list_checkpoints": ee.list_checkpoints,
}


@pytest.mark.parametrize("function", list(_PUBLIC))
@pytest.mark.parametrize("bad", [3, 3.5, b"run", None, ["run"]])
def test_non_paths_are_refused_naming_the_argument(tmp_path, function, bad):
    argument = (
        "directory" if function.endswith(("_checkpoint", "_checkpoints")) else "path"
    )
    if function == "verify_checkpoint":
        argument = "path"
    with pytest.raises(TypeError, match=_NOT_A_PATH.format(argument)):
        _PUBLIC[function](bad)


def test_a_file_descriptor_is_not_listed(tmp_path):
    # `os.listdir(3)` lists whatever folder descriptor 3 is open on.
    ee.save_checkpoint(tmp_path, 1, _tree())
    descriptor = os.open(tmp_path, os.O_RDONLY)
    try:
        with pytest.raises(TypeError, match=_NOT_A_PATH.format("directory")):
            ee.latest_checkpoint(descriptor)
    finally:
        os.close(descriptor)


@pytest.mark.parametrize("function", list(_PUBLIC))
def test_an_empty_path_is_refused(function):
    with pytest.raises(ValueError, match="empty path"):
        _PUBLIC[function]("")


# ------------------------------- 9. writable folders, and failed writes leave nothing


def test_check_writable_directory(tmp_path):
    made = check_writable_directory(tmp_path / "a" / "b")
    assert made == tmp_path / "a" / "b" and made.is_dir()
    assert os.listdir(made) == []  # the probe is gone
    blocker = tmp_path / "file"
    blocker.write_text("x")
    for bad, reason in (
        (blocker, "not a folder"),
        (blocker / "sub", "Not a directory"),
    ):
        with pytest.raises(ee.CheckpointError, match=reason) as caught:
            check_writable_directory(bad)
        assert str(bad) in str(caught.value)
    with pytest.raises(TypeError, match=_NOT_A_PATH.format("directory")):
        check_writable_directory(3)


def test_check_writable_directory_by_writers_at_once(tmp_path):
    # The processes of a multi-process run check the same folder at the same
    # time: one's probe must not be taken for, or removed as, another's.
    folder = tmp_path / "run"
    errors: list[BaseException] = []
    start = threading.Barrier(4)

    def writer():
        start.wait()
        try:
            for _ in range(50):
                check_writable_directory(folder)
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=writer) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert os.listdir(folder) == []  # every probe is gone


def test_check_writable_directory_reports_an_unwritable_folder(tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr("eqx_ensemble._checkpoints.directory.write_file", refuse)
    with pytest.raises(ee.CheckpointError, match="Permission denied") as caught:
        check_writable_directory(tmp_path / "run")
    assert str(tmp_path / "run") in str(caught.value)


@pytest.mark.skipif(ROOT, reason="root writes anywhere")
def test_check_writable_directory_in_a_read_only_folder(tmp_path):
    read_only = tmp_path / "ro"
    read_only.mkdir(mode=0o500)
    with pytest.raises(ee.CheckpointError, match="Permission denied"):
        check_writable_directory(read_only)


class _FullDisk:
    """A stream that takes `room` bytes, then fails as a full disk does."""

    def __init__(self, stream, room):
        self.stream, self.room = stream, room

    def write(self, chunk):
        size = memoryview(chunk).nbytes
        if size > self.room:
            self.stream.write(memoryview(chunk).cast("B")[: self.room])
            self.room = 0
            raise OSError(errno.ENOSPC, "No space left on device")
        self.room -= size
        return self.stream.write(chunk)

    def __getattr__(self, name):
        return getattr(self.stream, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stream.close()


def _fail_mid_write(monkeypatch):
    real_fdopen = os.fdopen

    def fdopen(*args, **kwargs):
        return _FullDisk(real_fdopen(*args, **kwargs), room=1000)

    monkeypatch.setattr(_checkpoint_file.os, "fdopen", fdopen)


def _fail_at_fsync(monkeypatch):
    def fsync(descriptor):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(_checkpoint_file.os, "fsync", fsync)


@pytest.mark.parametrize("fail", [_fail_mid_write, _fail_at_fsync])
def test_a_failed_write_names_the_path_and_leaves_nothing(tmp_path, monkeypatch, fail):
    path = tmp_path / "model.ckpt"
    ee.save(path, _tree())
    before = path.read_bytes()
    directory = tmp_path / "run"
    ee.save_checkpoint(directory, 1, _tree())
    fail(monkeypatch)
    big = {**_tree(), "w": jnp.ones((100, 100))}
    with pytest.raises(OSError) as caught:
        ee.save(path, big)
    assert caught.value.errno == errno.ENOSPC
    assert str(path) in str(caught.value) and "No space left" in str(caught.value)
    with pytest.raises(OSError, match="step_0000000002.ckpt"):
        ee.save_checkpoint(directory, 2, big, keep=1)
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == ["model.ckpt", "run"]  # no temporary
    assert path.read_bytes() == before  # the previous file is intact
    assert os.listdir(directory) == ["step_0000000001.ckpt"]  # nothing pruned
    assert ee.latest_checkpoint(directory) == directory / "step_0000000001.ckpt"


def test_unwritable_targets_are_named(tmp_path):
    (tmp_path / "folder.ckpt").mkdir()
    with pytest.raises(IsADirectoryError, match="folder.ckpt"):
        ee.save(tmp_path / "folder.ckpt", _tree())
    (tmp_path / "file").write_text("x")
    with pytest.raises(FileExistsError, match="cannot create the folder") as caught:
        ee.save_checkpoint(tmp_path / "file", 1, _tree())
    assert "step_0000000001.ckpt" in str(caught.value)
    assert sorted(os.listdir(tmp_path)) == ["file", "folder.ckpt"]


# ----------------------------------------------------------- other bad arguments


_NOT_A_STEP = "`step` must be a non-negative integer|typechecking parameter 'step'"


def test_step_and_keep_accept_integer_scalars_only(tmp_path):
    ee.save_checkpoint(tmp_path, jnp.asarray(3, jnp.int32), _tree())
    ee.save_checkpoint(tmp_path, np.int64(4), _tree(), keep=np.int64(5))
    assert [s for s, _ in ee.list_checkpoints(tmp_path)] == [3, 4]
    for bad in (1.0, jnp.asarray(3.0), jnp.arange(2), np.bool_(True), True, "5"):
        with pytest.raises(TypeError, match=_NOT_A_STEP):
            ee.save_checkpoint(tmp_path, bad, _tree())
        with pytest.raises(TypeError, match="`step` must be a non-negative integer"):
            _step_number(bad)  # the check a caller without a type checker meets
    with pytest.raises(ValueError, match="got -2"):
        ee.save_checkpoint(tmp_path, -2, _tree())
    for bad_keep in (0, True):  # (True passes an `int` annotation)
        with pytest.raises(ValueError, match="`keep` must be None or an integer"):
            ee.save_checkpoint(tmp_path, 5, _tree(), keep=bad_keep)
    assert [s for s, _ in ee.list_checkpoints(tmp_path)] == [3, 4]


def test_metadata_nested_too_deeply_is_a_type_error(tmp_path):
    nested: list = []
    for _ in range(100_000):
        nested = [nested]
    with pytest.raises(TypeError, match="nested too deeply"):
        ee.save(tmp_path / "a.ckpt", _tree(), metadata={"a": nested})
    assert os.listdir(tmp_path) == []


def test_non_ascii_digits_are_not_step_numbers(tmp_path):
    ee.save_checkpoint(tmp_path, 1, _tree())
    shutil.copy(tmp_path / "step_0000000001.ckpt", tmp_path / "step_\u0663.ckpt")
    assert [s for s, _ in ee.list_checkpoints(tmp_path)] == [1]


# ------------------- 9. a two-leaf tree: special files, modes, paths, manifests


def _weights_and_key():
    return {"w": jnp.arange(6.0).reshape(2, 3), "key": jax.random.key(0)}


def test_fifo_named_like_a_checkpoint_neither_hangs_nor_is_listed(tmp_path):
    ee.save_checkpoint(tmp_path, 1, _weights_and_key())
    os.mkfifo(tmp_path / "step_0000000002.ckpt")
    assert [s for s, _ in ee.list_checkpoints(tmp_path)] == [1]
    assert ee.latest_checkpoint(tmp_path) == tmp_path / "step_0000000001.ckpt"
    outcome = _within(
        10.0, lambda: ee.load(tmp_path / "step_0000000002.ckpt", _weights_and_key())
    )
    assert isinstance(outcome.get("error"), ee.CheckpointError)
    assert "named pipe" in str(outcome["error"])


def test_directory_in_place_of_a_file_is_refused(tmp_path):
    (tmp_path / "dir.ckpt").mkdir()
    with pytest.raises(ee.CheckpointError, match="not a regular file .a directory"):
        ee.load(tmp_path / "dir.ckpt", _weights_and_key())


def test_overwrite_keeps_the_files_permissions(tmp_path):
    path = tmp_path / "private.ckpt"
    ee.save(path, _weights_and_key())
    os.chmod(path, 0o600)
    ee.save(path, _weights_and_key())
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
    ee.save(path, _weights_and_key())
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
        ee.save(bad, _weights_and_key())
    with pytest.raises(TypeError, match=match):
        ee.load(bad, _weights_and_key())


def test_the_library_refuses_non_paths_itself(tmp_path):
    from eqx_ensemble._checkpoints.file import as_path

    with pytest.raises(TypeError, match="`directory` must be a path .* got int 3"):
        as_path(3, "directory")


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
def test_forged_manifests_of_a_two_leaf_tree_are_checkpoint_errors(tmp_path, change):
    path = tmp_path / "forged.ckpt"
    ee.save(path, _weights_and_key())
    _rewrite_manifest(path, change)
    with pytest.raises(ee.CheckpointError):
        ee.load(path, _weights_and_key())


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
        ee.save_checkpoint(tmp_path / "run", step, _weights_and_key())
    newest = ee.latest_checkpoint(tmp_path / "run")
    assert newest is not None
    newest.write_bytes(newest.read_bytes()[:-5])

    def verify(path):
        ee.load(path, _weights_and_key())

    path, skipped = newest_intact_checkpoint(tmp_path / "run", verify)
    assert path is not None and path.name == "step_0000000002.ckpt"
    assert [p.name for p, _ in skipped] == ["step_0000000003.ckpt"]
    assert "truncated" in skipped[0][1]


def test_unchanged_behaviour_round_trip(tmp_path):
    # A plain save/load round trip is bit for bit.
    tree = _weights_and_key()
    ee.save(tmp_path / "a.ckpt", tree)
    restored = ee.load(tmp_path / "a.ckpt", tree)
    assert tree_equal(restored["w"], tree["w"])
    assert np.array_equal(
        jax.random.key_data(restored["key"]), jax.random.key_data(tree["key"])
    )


def test_struct_header_is_what_the_tests_assume():
    assert _HEADER.size == struct.calcsize("<8sQ32s")
