"""The run record: what identifies a `fit` run, checked on resume."""

import dataclasses
import hashlib
from typing import Any

import equinox as eqx
import jax
import numpy as np
import optax
from jaxtyping import PRNGKeyArray, PyTree

from .._internal.tree import keystr
from .optim import hyperparam_nodes, members_opt_state


@dataclasses.dataclass(frozen=True)
class RunRecord:
    """What a resumed run must share with the checkpoint's run (JSON)."""

    size: int
    batch_size: int | None
    sampling: str
    num_examples: int | None
    key: list[int]
    eval_every: int | None
    track: list[str]
    # The hyperparameters the run STARTED with; `None`: no optimizer state given.
    hyperparams: dict[str, Any] | None
    hyper: dict[str, Any] | None
    optimizer: str | None = None

    def as_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def mismatch(self, saved: dict[str, Any]) -> tuple[str, Any, Any] | None:
        """The first field whose saved value differs: `(field, saved, now)`."""
        for field, value in self.as_json().items():
            if field == "hyperparams" and value is None:
                continue  # not given: the saved optimizer state continues
            if field == "optimizer" and (value is None or field not in saved):
                continue  # a checkpoint from before the optimizer was recorded
            if saved.get(field) != value:
                return field, saved.get(field), value
        return None


def key_record(key: PRNGKeyArray) -> list[int]:
    """The key's raw data as JSON-comparable integers."""
    if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.key_data(key)
    return np.asarray(key).ravel().tolist()


def start_record(trees: list[tuple[str, Any]]) -> dict[str, Any] | None:
    """Hyperparameter PyTrees as JSON: numbers per leaf (a digest over 256)."""
    record: dict[str, Any] = {}
    for prefix, tree in trees:
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
            if not eqx.is_array(leaf):
                continue
            host = np.asarray(leaf)
            name = prefix + keystr(path)
            if host.size <= 256:
                record[name] = host.ravel().tolist()
            else:
                record[name] = hashlib.sha256(
                    host.tobytes() + str(host.dtype).encode()
                ).hexdigest()
    return record or None


def hyperparams_record(states: list[tuple[str, Any]]) -> dict[str, Any] | None:
    """The injected hyperparameters of the groups' optimizer states, as
    `start_record` (each group's under its own prefix)."""
    return start_record(
        [
            (prefix, dict(node.hyperparams))
            for prefix, state in states
            for _, node in hyperparam_nodes(members_opt_state(state))
        ]
    )


def optimizer_record(
    optimizer: optax.GradientTransformation, opt_state: PyTree[Any]
) -> str:
    """A digest of an optimizer's state structure and the values its `update`
    closes over (`adam(1e-1)` cannot resume a run of `adam(1e-2)`)."""
    del opt_state
    try:
        canonical = jax.eval_shape(
            optimizer.init, {"w": jax.ShapeDtypeStruct((1,), np.float32)}
        )
        parts = [str(jax.tree.structure(canonical))]
    except Exception:  # noqa: BLE001 - an optimizer tied to one model's structure
        parts = []
    parts += _closure_values(optimizer.update, depth=0, seen=set())
    return hashlib.sha256("|".join(parts).encode()).hexdigest()


def _closure_values(fn: Any, depth: int, seen: set[int]) -> list[str]:
    """The plain values a function (e.g. an optax `update`) closes over, deeply."""
    if depth > 12 or id(fn) in seen:
        return []
    seen.add(id(fn))
    values: list[str] = []
    code = getattr(fn, "__code__", None)
    # Values only: function names may change between optax releases.
    cells = getattr(fn, "__closure__", None) or ()
    names = code.co_freevars if code is not None else ()
    for name, cell in zip(names, cells, strict=False):
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        values += _value_record(name, value, depth, seen)
    return values


def _value_record(name: str, value: Any, depth: int, seen: set[int]) -> list[str]:
    if isinstance(value, bool | int | float | str | type(None)):
        return [f"{name}={value!r}"]
    if isinstance(value, np.ndarray | jax.Array) and np.size(value) <= 64:
        return [f"{name}={np.asarray(value).tolist()!r}"]
    if isinstance(value, optax.GradientTransformation):
        return _closure_values(value.update, depth + 1, seen)
    if isinstance(value, tuple | list):
        out: list[str] = []
        for position, item in enumerate(value):
            out += _value_record(f"{name}[{position}]", item, depth, seen)
        return out
    if isinstance(value, dict):
        out = []
        for key in sorted(value, key=str):
            out += _value_record(f"{name}[{key!r}]", value[key], depth, seen)
        return out
    if callable(value) and hasattr(value, "__code__"):
        return _closure_values(value, depth + 1, seen)
    return []
