"""How a PyTree is described in a checkpoint manifest, and compared with `like`.

A leaf is an `"array"` (bytes stored), a `"key"` (typed PRNG key: its key data and
implementation), a Python `"bool"`/`"int"`/`"float"`/`"complex"` (stored exactly)
or `"static"` (taken from `like`). Nodes are described by type name and static
fields, so trees differing only in static hyperparameters are told apart.
"""

import dataclasses
import re
from typing import Any

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

from .._core.ensemble import Ensemble
from .._internal.tree import keystr

ARRAY_KINDS = ("array", "key")
PYTHON_KINDS = {"bool": bool, "int": int, "float": float, "complex": complex}

_ADDRESS = re.compile(r"0x[0-9a-fA-F]+")


def classify(leaf: Any) -> dict[str, Any]:
    """`{"kind": ..., "shape": ..., "dtype": ...}` (shape, dtype: arrays only; the
    dtype's name is one `jnp.dtype` maps back to it: `"bfloat16"`, `"key<fry>"`)."""
    if isinstance(leaf, jax.Array | np.ndarray | np.generic | jax.ShapeDtypeStruct):
        key = jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key)
        return {
            "kind": "key" if key else "array",
            "shape": list(np.shape(leaf)),
            "dtype": str(leaf.dtype) if key else np.dtype(leaf.dtype).name,
        }
    for kind, python_type in PYTHON_KINDS.items():
        if isinstance(leaf, python_type):
            return {"kind": kind}
    return {"kind": "static", "type": type(leaf).__qualname__}


def describe(record: dict[str, Any]) -> str:
    """A leaf description for error messages."""
    kind = record["kind"]
    if kind in ARRAY_KINDS:
        what = "a PRNG key array" if kind == "key" else "an array"
        return f"{what} of shape {tuple(record['shape'])} and dtype {record['dtype']}"
    if kind in PYTHON_KINDS:
        return f"a Python {kind}"
    return f"a non-array leaf of type {record.get('type', '?')}"


def _is_leaf(x: Any) -> bool:
    return jtu.treedef_is_leaf(jtu.tree_structure(x)) and x is not None


def _static_fields(node: Any) -> dict[str, str]:
    if not dataclasses.is_dataclass(node) or isinstance(node, type):
        return {}
    return {
        field.name: _ADDRESS.sub("0x?", repr(getattr(node, field.name, None)))
        for field in dataclasses.fields(node)
        if field.metadata.get("static", False)
    }


def describe_nodes(tree: Any) -> list[list[Any]]:
    """`[path, type name, {static field: repr}]` for every non-leaf node, pre-order."""
    nodes: list[list[Any]] = []
    pending: list[tuple[tuple[Any, ...], Any]] = [((), tree)]
    while pending:
        path, node = pending.pop()
        if _is_leaf(node):
            continue
        nodes.append([keystr(path), type(node).__qualname__, _static_fields(node)])
        children = jtu.tree_flatten_with_path(
            node, is_leaf=lambda child: child is not node
        )[0]
        pending.extend(
            ((*path, child_path[0]), child) for child_path, child in reversed(children)
        )
    return nodes


def node_difference(saved: list[list[Any]], like: list[list[Any]]) -> str | None:
    """The first difference between two `describe_nodes` lists, or `None`."""
    for (path, saved_type, saved_static), (like_path, like_type, like_static) in zip(
        saved, like, strict=False
    ):
        if path != like_path:
            return (
                f"the tree structure differs: the checkpoint has a node at `{path}` "
                f"where `like` has one at `{like_path}`"
            )
        if saved_type != like_type:
            return (
                f"node `{path}` is of type {saved_type} in the checkpoint but of "
                f"type {like_type} in `like`"
            )
        for name in sorted(set(saved_static) | set(like_static)):
            if saved_static.get(name) != like_static.get(name):
                return (
                    f"static field `{name}` of node `{path}` ({like_type}) is "
                    f"{saved_static.get(name, '<absent>')} in the checkpoint but "
                    f"{like_static.get(name, '<absent>')} in `like`"
                )
    if len(saved) != len(like):
        owner = "the checkpoint" if len(saved) > len(like) else "`like`"
        path, node_type, _ = max(saved, like, key=len)[min(len(saved), len(like))]
        return (
            f"the tree structure differs: only {owner} has a node at `{path}` "
            f"({node_type})"
        )
    return None


def path_difference(saved: list[str], like: list[str]) -> str | None:
    """The first difference between two lists of leaf paths, or `None`."""
    for saved_path, like_path in zip(saved, like, strict=False):
        if saved_path == like_path:
            continue
        if saved_path not in like:
            return f"the checkpoint has a leaf `{saved_path}` that `like` lacks"
        if like_path not in saved:
            return f"`like` has a leaf `{like_path}` that the checkpoint lacks"
        return (
            f"the leaves are in a different order: `{saved_path}` in the checkpoint "
            f"where `like` has `{like_path}`"
        )
    if len(saved) > len(like):
        return f"the checkpoint has a leaf `{saved[len(like)]}` that `like` lacks"
    if len(like) > len(saved):
        return f"`like` has a leaf `{like[len(saved)]}` that the checkpoint lacks"
    return None


def ensemble_size(ensemble: Ensemble) -> int | None:
    """`len(ensemble)`, also for a `like` whose leaves are `jax.ShapeDtypeStruct`s."""
    try:
        return len(ensemble)
    except ValueError:
        for leaf in jax.tree.leaves(ensemble.members):
            if isinstance(leaf, jax.ShapeDtypeStruct) and leaf.shape:
                return int(leaf.shape[0])
    return None


def find_ensembles(tree: Any) -> list[dict[str, Any]]:
    """`[{"path": ..., "size": ...}]` for every `ee.Ensemble` in `tree`."""
    flat = jtu.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, Ensemble))
    return [
        {"path": keystr(path), "size": ensemble_size(node)}
        for path, node in flat[0]
        if isinstance(node, Ensemble)
    ]


def ensemble_difference(
    saved: list[dict[str, Any]], like: list[dict[str, Any]]
) -> str | None:
    """A message if an ensemble at the same path has a different size, else `None`."""
    saved_sizes = {entry["path"]: entry["size"] for entry in saved}
    for entry in like:
        saved_size = saved_sizes.get(entry["path"])
        if saved_size is not None and saved_size != entry["size"]:
            return (
                f"the checkpoint holds an ensemble of {_members(saved_size)} at "
                f"`{entry['path']}` but `like` has {_members(entry['size'])} there"
            )
    return None


def _members(count: Any) -> str:
    return f"{count} member" if count == 1 else f"{count} members"
