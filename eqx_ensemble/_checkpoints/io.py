"""`save` / `load`: verified, atomic checkpoints of any PyTree (ensembles included).

Not `eqx.tree_serialise_leaves`: its bare `np.save` stream cannot name a differing
leaf, detect a flipped byte, or restore typed keys and shardings (checkpoints guide).
"""

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import equinox as eqx
import jax
import jax.tree_util as jtu
from jaxtyping import PyTree

from .._internal.tree import is_traced, keystr
from .file import (
    FORMAT_NAME,
    FORMAT_VERSION,
    CheckpointError,
    CheckpointFile,
    as_path,
    remove_stale_temporaries,
    write_file,
)
from .leaves import (
    decode_value,
    encode_leaves,
    host_view,
    key_impl_shapes,
    place_array,
    place_key,
    record_error,
)
from .sharded import LazyLeaf, ShardedReader, sharded_write
from .structure import (
    ARRAY_KINDS,
    classify,
    describe,
    describe_nodes,
    ensemble_difference,
    find_ensembles,
    node_difference,
    path_difference,
)
from .writer import (
    MANIFEST,
    PendingSave,
    Phase,
    check_replaceable,
    failed_processes,
    make_parent,
    put_in_place,
    write,
)

# The names `eqx_ensemble` re-exports; the rest serves the other checkpoint modules.
__all__ = ["load", "load_manifest", "save"]

Tree = TypeVar("Tree")


def save(
    path: str | os.PathLike[str],
    tree: PyTree,
    *,
    metadata: dict[str, Any] | None = None,
    sharded: bool | None = None,
) -> Path:
    """Save a PyTree (an ensemble, an optimizer state, a PRNG key...) to one file.

    The write is atomic: the file is written to a temporary file in the same folder,
    flushed and fsynced, then renamed over `path`; a crash at any point leaves the
    previous file at `path` intact. Missing parent folders are created.

    Stored: every array leaf (`jax.Array`, `np.ndarray`, NumPy scalar; bfloat16 and
    other ML dtypes included), typed PRNG key arrays (their key data and
    implementation name), and Python `bool`/`int`/`float`/`complex` leaves (exactly).
    Other leaves (functions, strings...) and static fields are not stored: `load`
    takes them from `like`, as `eqx.tree_deserialise_leaves` does.

    **File format** (version 1, laid out in the checkpoints guide): a header,
    a verified JSON manifest (the tree's structure, each leaf's path, kind,
    shape and dtype, your `metadata`), then the arrays' raw bytes.

    **Sharded** (`sharded=True`; the default when `jax.process_count() > 1`):
    `path` becomes a folder in which each process writes only the shards its
    devices own (with tensorstore: `pip install 'eqx_ensemble[distributed]'`),
    committed by a verified manifest; `load` reads them onto any mesh. Every
    process must call `save` with its part of the same global tree, on a shared
    file system. `sharded=False` on several processes gathers the arrays and
    process 0 writes the single file.

    **Arguments:**

    - `path`: the file to write (conventionally `*.ckpt`).
    - `tree`: any PyTree; its arrays must be concrete (not traced).
    - `metadata`: an optional JSON-serialisable dict (string keys) stored in the
      manifest; read it back with [`ee.load_manifest`][eqx_ensemble.load_manifest].
    - `sharded`: write the sharded folder format (`True`), the single file
      (`False`), or choose (`None`: sharded when `jax.process_count() > 1`).

    **Returns:**

    The path written, as a `pathlib.Path`.

    **Example:**

    ```python
    ens = ee.ensemble(lambda k: eqx.nn.MLP(2, 1, 8, 2, key=k), size=4,
                      key=jax.random.key(0))
    ee.save("ensemble.ckpt", ens, metadata={"epoch": 3})
    like = ee.ensemble(lambda k: eqx.nn.MLP(2, 1, 8, 2, key=k), size=4,
                       key=jax.random.key(1))
    restored = ee.load("ensemble.ckpt", like)
    assert eqx.tree_equal(restored, ens)
    ee.load_manifest("ensemble.ckpt")["metadata"]   # {'epoch': 3}
    ```
    """
    written = save_tree(as_path(path, "path"), tree, metadata=metadata, sharded=sharded)
    assert isinstance(written, Path)
    return written


def save_tree(
    path: Path,
    tree: Any,
    *,
    metadata: dict[str, Any] | None,
    step: int | None = None,
    after_write: Callable[[], None] | None = None,
    sharded: bool | None = None,
    asynchronous: bool = False,
) -> "Path | PendingSave":
    """`save`, also recording a training `step` and running `after_write` on the
    writing process once the file is in place (used to prune old checkpoints).
    `asynchronous`: copy the arrays to the host now, write them on a thread, and
    return a `PendingSave` (see `Checkpoints(asynchronous=True)`)."""
    from .. import __version__

    metadata = _checked_metadata(metadata)
    if sharded is not None and not isinstance(sharded, bool):
        raise TypeError(f"`sharded` must be True, False or None, got {sharded!r}")
    if sharded is None:
        sharded = jax.process_count() > 1
    leaves, treedef = jtu.tree_flatten_with_path(tree)
    ensembles = find_ensembles(tree)
    manifest = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "library_version": __version__,
        "jax_version": jax.__version__,
        "equinox_version": eqx.__version__,
        "step": step,
        "ensemble_size": ensembles[0]["size"] if ensembles else None,
        "ensembles": ensembles,
        "treedef": str(treedef),
        "nodes": describe_nodes(tree),
        "leaves": [],
        "metadata": metadata,
    }
    if sharded:
        prepare, finish = sharded_write(path, leaves, manifest, copy=asynchronous)
    else:  # process 0 writes every leaf (arrays not fully addressable gathered)
        manifest["leaves"], chunks, _ = encode_leaves(leaves, copy=asynchronous)

        def write_single() -> None:
            make_parent(path)
            remove_stale_temporaries(path)
            check_replaceable(path)
            put_in_place(path, lambda: write_file(path, manifest, chunks), folder=False)

        prepare, finish = [], [Phase(write_single)]
    if after_write is not None:  # in the commit's phase, once it is in place
        last = finish.pop()

        def commit_then_prune() -> None:
            last.work()
            after_write()

        finish.append(Phase(commit_then_prune, last.everyone))
    return write(path, prepare, finish, asynchronous)


def _checked_metadata(metadata: dict[str, Any] | None) -> dict[str, Any]:
    if metadata is None:
        return {}
    if not isinstance(metadata, dict) or not all(
        isinstance(name, str) for name in metadata
    ):
        raise TypeError("`metadata` must be a dict with string keys")
    try:
        return json.loads(json.dumps(metadata))
    except RecursionError:
        raise TypeError("`metadata` is nested too deeply to store as JSON") from None
    except (TypeError, ValueError) as error:
        raise TypeError(
            f"`metadata` must be JSON-serialisable (dicts, lists, strings, numbers, "
            f"booleans, None): {error}"
        ) from None


def load(path: str | os.PathLike[str], like: Tree) -> Tree:
    """Load a checkpoint written by [`ee.save`][eqx_ensemble.save] into `like`'s shape.

    The file is verified (header, sha256s, length) and the stored tree compared
    with `like` (ensemble sizes, node types and static fields, leaf paths, each
    leaf's kind, shape and dtype) before anything is returned. Non-array leaves
    and static fields come from `like`; Python numbers take `like`'s type.

    Placement follows `like`: each array goes on the sharding of `like`'s leaf,
    so a checkpoint of any mesh loads onto any other. `like` may come from
    `eqx.filter_eval_shape` (arrays then go on the struct's sharding, if any, else
    the default device). NumPy leaves in `like` load as NumPy arrays.

    **Arguments:**

    - `path`: a file written by `ee.save` (or `ee.save_checkpoint`).
    - `like`: a PyTree with the same structure as the saved one: a model of the same
      architecture, or `eqx.filter_eval_shape` of its constructor.

    **Returns:**

    A PyTree with `like`'s structure and the checkpoint's values.

    **Raises:**

    [`ee.CheckpointError`][eqx_ensemble.CheckpointError] (a `ValueError`) when the
    file is not a checkpoint, is truncated or corrupt, or differs from `like`; the
    message says what differs (leaf path, both shapes/dtypes, both ensemble sizes).
    `FileNotFoundError` when there is no file at `path`.

    **Example:**

    ```python
    make = lambda k: eqx.nn.MLP(3, 2, 16, 2, key=k)
    ens = ee.ensemble(make, size=8, key=jax.random.key(0))
    ee.save("ens.ckpt", ens)
    # No need to initialise real weights to get a `like`:
    like = eqx.filter_eval_shape(ee.ensemble, make, size=8, key=jax.random.key(0))
    restored = ee.load("ens.ckpt", like)
    assert eqx.tree_equal(restored, ens)
    ```
    """
    path = as_path(path, "path")
    like_leaves, like_treedef = jtu.tree_flatten_with_path(like)
    for leaf_path, leaf in like_leaves:
        if is_traced(leaf):
            raise TypeError(
                f"`like`'s leaf `{keystr(leaf_path)}` is traced (inside `jit`, "
                "`vmap`...): call `ee.load` outside transformed code."
            )
    failure: BaseException | None = None
    leaves = []
    try:
        with open_manifest(path) as file:
            records = _verified_records(file, like, like_leaves)
            data = file.read_data()
            reader = ShardedReader(path, file)
            for index, (record, (_, like_leaf)) in enumerate(
                zip(records, like_leaves, strict=True)
            ):
                if record["kind"] not in ARRAY_KINDS:
                    leaves.append(decode_value(record, like_leaf))
                    continue
                if "store" in record:  # (only a folder's records have one)
                    source: Any = LazyLeaf(reader, index, record)
                else:
                    source = host_view(data, record)
                if record["kind"] == "key":
                    leaves.append(place_key(source, record["impl"], like_leaf))
                else:
                    leaves.append(place_array(source, like_leaf))
                reader.forget()
    except Exception as error:  # noqa: BLE001 - raised below, after the agreement
        failure = error
    if jax.process_count() > 1 and path.is_dir():
        # Each process read only its own chunks: all succeed or all refuse (one
        # raising alone would leave the others waiting). A single file is read
        # whole by each process, so one may load it on its own.
        failed = failed_processes(failure)
        if failed and failure is None:
            raise CheckpointError(
                f"Checkpoint {path}: process(es) {failed} failed to load their "
                "shards (their own error says why); refused on every process"
            )
    if failure is not None:
        raise failure
    return jtu.tree_unflatten(like_treedef, leaves)


def open_manifest(path: Path) -> CheckpointFile:
    """The verified manifest file of a checkpoint: the file itself, or a sharded
    checkpoint's `manifest.ckpt`."""
    if not path.is_dir():
        return CheckpointFile(path)
    manifest = path / MANIFEST
    if not manifest.is_file():
        raise CheckpointError(
            f"Checkpoint {path}: not a regular file (a directory without a "
            f"{MANIFEST}); a checkpoint is a file written by `ee.save`, or a folder "
            "written by `ee.save(..., sharded=True)` and committed by its manifest"
        )
    file = CheckpointFile(manifest)
    file.sharded = True
    return file


def _verified_records(
    file: CheckpointFile, like: Any, like_leaves: list[tuple[Any, Any]]
) -> list[dict[str, Any]]:
    """The manifest's leaf records, once they are known to match `like`."""
    records = checked_records(file)
    try:
        message = (
            ensemble_difference(file.manifest["ensembles"], find_ensembles(like))
            or node_difference(file.manifest["nodes"], describe_nodes(like))
            or path_difference(
                [record["path"] for record in records],
                [keystr(path) for path, _ in like_leaves],
            )
            or _first_mismatch(records, like_leaves)
        )
    except (
        KeyError,
        TypeError,
        ValueError,
        IndexError,
        AttributeError,
        OverflowError,
        RecursionError,
    ) as error:
        raise file.error(f"the manifest is malformed ({error!r})") from None
    if message is not None:
        raise file.error(message)
    return records


def _first_mismatch(
    records: list[dict[str, Any]], like_leaves: list[tuple[Any, Any]]
) -> str | None:
    for record, (path, like_leaf) in zip(records, like_leaves, strict=True):
        expected = classify(like_leaf)
        found = {key: record.get(key) for key in expected}
        if record["kind"] == "static" and expected["kind"] == "static":
            continue
        differs = f"leaf `{keystr(path)}` differs: the checkpoint holds"
        if found != expected:
            message = f"{differs} {describe(record)}, `like` holds {describe(expected)}"
            if {record["kind"], expected["kind"]} == {"key", "array"}:
                message += (
                    " (typed keys, `jax.random.key`, and raw uint32 keys, "
                    "`jax.random.PRNGKey`, are stored differently: build `like` with "
                    "the same kind, or convert with `jax.random.key_data` / "
                    "`jax.random.wrap_key_data`)"
                )
            return message
        # A key's data shape follows from its implementation (checked with the record).
        found_key = key_impl_shapes(record["impl"]) if record["kind"] == "key" else None
        if found_key is not None and found_key[0] != like_leaf.dtype:
            return (
                f"{differs} keys of implementation {record['impl']!r}, `like` holds "
                f"{like_leaf.dtype}"
            )
    return None


def checked_records(file: CheckpointFile) -> list[dict[str, Any]]:
    """The manifest's leaf records, each checked on its own (no `like` needed)."""
    records = file.manifest.get("leaves")
    if not isinstance(records, list):
        raise file.error("the manifest is malformed (no list of leaves)")
    for record in records:
        problem = record_error(record, file.data_bytes, file.sharded)
        if problem is not None:
            raise file.error(problem)
    return records


def load_manifest(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read and verify a checkpoint's manifest without loading its arrays.

    Checks the header, the manifest's sha256 and the file's length (not the data).

    **Arguments:**

    - `path`: a file written by [`ee.save`][eqx_ensemble.save].

    **Returns:**

    The manifest as a dict: `"metadata"` (what was passed to `save`), `"step"`
    (set by [`ee.save_checkpoint`][eqx_ensemble.save_checkpoint], else `None`),
    `"ensemble_size"`, `"leaves"` (path, kind, shape, dtype of each leaf),
    `"format_version"`, `"library_version"`, `"jax_version"`, `"data"` (length and
    sha256)...

    **Example:**

    ```python
    ee.save("keys.ckpt", {"key": jax.random.key(0), "lr": 0.1}, metadata={"a": 1})
    manifest = ee.load_manifest("keys.ckpt")
    manifest["metadata"], [leaf["path"] for leaf in manifest["leaves"]]
    # ({'a': 1}, ["['key']", "['lr']"])
    ```
    """
    with open_manifest(as_path(path, "path")) as file:
        return file.manifest
