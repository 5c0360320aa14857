"""The run record: what identifies a `fit` run, saved with each checkpoint and
compared on resume (exact resume needs the same run)."""

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
    """What a resumed run must share with the run that wrote the checkpoint.
    Saved as JSON (`as_json`) in each checkpoint's manifest."""

    size: int
    batch_size: int | None
    sampling: str
    num_examples: int | None
    key: list[int]
    eval_every: int | None
    track: list[str]
    # The hyperparameters the run STARTED with (controllers such as `ee.PBT`
    # change them as it goes); `None` when the run was given no optimizer state
    # (a resume may then continue with the saved one).
    hyperparams: dict[str, Any] | None
    hyper: dict[str, Any] | None
    # The optimizer's structure and fixed hyperparameters (see `optimizer_record`).
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
    """JSON-comparable values of hyperparameter PyTrees (`None` if there are
    none): a list of numbers per leaf, or a digest for a leaf of over 256."""
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
    """The injected hyperparameters of an optimizer state, as `start_record`,
    from its groups' states (`heterogeneous.labelled`: each group's under its
    own prefix)."""
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
    """A digest of what identifies an optimizer without running it: the
    structure of its state (on a canonical one-leaf model), and the values its
    `update` closes over (learning rates, betas, clipping
    thresholds: the numbers and strings in their closures), so that resuming
    with `adam(1e-1)` a run saved with `adam(1e-2)` is refused."""
    # The state's structure on a canonical one-leaf model (not on the ensemble,
    # whose architecture a resume checks leaf by leaf with its own message).
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
    """The plain values a function closes over, recursively through the
    functions and optax transformations it closes over (optax builds
    optimizers as closures over their hyperparameters)."""
    if depth > 12 or id(fn) in seen:
        return []
    seen.add(id(fn))
    values: list[str] = []
    code = getattr(fn, "__code__", None)
    # Values only (no function names, which an optax release may rename): the
    # state's structure already tells one transformation from another.
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
