"""`init_optimizer`: one optax state per member, per-member hyperparameters."""

import functools
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.extend.core as jex_core
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import optax
from jaxtyping import ArrayLike, Float, PyTree

from .._core.ensemble import Ensemble, SharedOptState
from .._core.heterogeneous import (
    Heterogeneous,
    group_parts,
    groups_of,
    is_ensemble,
    joined,
    labelled,
    per_group_slices,
)
from .._execution.compile import compiled_call
from .._execution.intern import canonical_tree
from .._execution.profile import first_member, signature
from .._internal.checks import real_array
from .._internal.keys import optimizer_key
from .._internal.tree import first_difference, is_traced, keystr, trainable
from .loss import check_optimizer
from .placement import members_mesh, model_mesh, placement_of


def optimizer_update(
    optimizer: optax.GradientTransformation,
    updates: PyTree[Any],
    state: PyTree[Any],
    params: PyTree[Any],
    key: Any = None,
    value: Any = None,
) -> tuple[PyTree[Any], PyTree[Any]]:
    """`optimizer.update`, passing `key` and `value` where it takes them."""
    takes = _takes(optimizer)
    extra = {"key": key, "value": value}
    extra = {
        name: arg for name, arg in extra.items() if arg is not None and takes(name)
    }
    # Optax relies on standard dtype promotion, even under "strict" promotion.
    with jax.numpy_dtype_promotion("standard"):
        return optimizer.update(updates, state, params, **extra)


def _takes(optimizer: Any) -> Callable[[str], bool]:
    """Whether `optimizer.update` takes a keyword (by signature, else by type)."""
    try:
        parameters = inspect.signature(optimizer.update).parameters.values()
    except (TypeError, ValueError):
        extra_args = isinstance(optimizer, optax.GradientTransformationExtraArgs)
        return lambda name: extra_args
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return lambda name: True
    keyword = (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return {p.name for p in parameters if p.kind in keyword}.__contains__


def _init_state(optimizer: Any, members: PyTree[Any], shared: PyTree[Any]) -> Any:
    # One program per `init` and structure (two learning rates share it).
    return compiled_call(_init, optimizer.init, members, shared)


def _init(init: Any, members: PyTree[Any], shared: PyTree[Any]) -> Any:
    members_state = eqx.filter_vmap(init)(members)
    if shared is None:
        return members_state
    return SharedOptState(members_state, init(shared))


def _trained_shared(ens: Ensemble) -> PyTree[Any]:
    return trainable(ens.shared) if ens.train_shared else None


def members_opt_state(opt_state: Any) -> Any:
    return opt_state.members if isinstance(opt_state, SharedOptState) else opt_state


def hides_non_finite(opt_state: PyTree[Any]) -> bool:
    """Whether the state shows a transformation that hides non-finite gradients."""
    kinds = (optax.ZeroNansState, optax.ApplyIfFiniteState, optax.MultiStepsState)
    nodes = jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, kinds))
    return any(
        isinstance(x, kinds)
        and not (
            isinstance(x, optax.MultiStepsState) and not jax.tree.leaves(x.skip_state)
        )
        for x in nodes
    )


def is_hyperparam_node(x: Any) -> bool:
    return (
        isinstance(x, tuple)
        and hasattr(x, "hyperparams")
        and isinstance(getattr(x, "hyperparams"), dict)
    )


def hyperparam_nodes(opt_state: PyTree[Any]) -> list[tuple[str, Any]]:
    """Every `inject_hyperparams` state inside `opt_state`, with its path."""
    return [
        (keystr(path), node)
        for path, node in jtu.tree_flatten_with_path(
            opt_state, is_leaf=is_hyperparam_node
        )[0]
        if is_hyperparam_node(node)
    ]


def member_hparams(train_state: Any) -> dict[str, np.ndarray]:
    """Each member's injected hyperparameters and `hyper` leaves, on the host."""
    size = int(np.shape(train_state.diverged_at)[0])
    values: dict[str, np.ndarray] = {}
    groups = [
        (len(group), _injected(state, len(group)))
        for group, state in group_parts(train_state.ensemble, train_state.opt_state)
    ]
    if len(groups) == 1:
        values.update(groups[0][1])
    else:
        for name in dict.fromkeys(name for _, group in groups for name in group):
            values[name] = np.concatenate(
                [
                    np.asarray(group[name], np.float64)
                    if name in group
                    else np.full(members, np.nan)
                    for members, group in groups
                ]
            )
    for path, leaf in jtu.tree_flatten_with_path(train_state.hyper)[0]:
        if np.shape(leaf) == (size,):
            values[f"hyper{keystr(path)}"] = np.asarray(leaf)
    return values


def _injected(opt_state: Any, size: int) -> dict[str, np.ndarray]:
    values: dict[str, np.ndarray] = {}
    nodes = hyperparam_nodes(members_opt_state(opt_state))
    for path, node in nodes:
        for name, value in node.hyperparams.items():
            if np.shape(value) == (size,):
                values[f"{path}{name}" if len(nodes) > 1 else name] = np.asarray(value)
    return values


def _looks_grouped(
    opt_state: Any, owners: list[tuple[str, Any]], name: str, size: int
) -> bool:
    # A heterogeneous ensemble's state: per-group states of the groups' sizes.
    shapes = [np.shape(node.hyperparams[name]) for _, node in owners]
    return (
        isinstance(opt_state, tuple)
        and all(path.startswith("[") for path, _ in owners)
        and all(len(shape) == 1 for shape in shapes)
        and any(shape != (size,) for shape in shapes)
    )


def map_hyperparam_nodes(fn: Any, opt_state: PyTree[Any]) -> PyTree[Any]:
    return jtu.tree_map(
        lambda node: fn(node) if is_hyperparam_node(node) else node,
        opt_state,
        is_leaf=is_hyperparam_node,
    )


def check_hyperparams_mapping(hyperparams: Any) -> None:
    if not isinstance(hyperparams, Mapping) or not all(
        isinstance(name, str) for name in hyperparams
    ):
        raise TypeError(
            "`hyperparams` must be a dict from hyperparameter names to one value "
            'per member (or one for all), e.g. `{"learning_rate": '
            f"jnp.array([1e-3, 1e-2])}}`; got {type(hyperparams).__name__} "
            f"{hyperparams!r:.80}"
        )


def set_hyperparams(
    opt_state: PyTree[Any],
    hyperparams: Mapping[str, Float[ArrayLike, " members"] | Sequence[float] | float],
    size: int,
) -> PyTree[Any]:
    """Set per-member hyperparameters inside a stacked `inject_hyperparams` state.

    **Arguments:**

    - `opt_state`: a stacked optimizer state from
      [`init_optimizer`][eqx_ensemble.init_optimizer].
    - `hyperparams`: name -> one value per member (or one value for all).
    - `size`: the ensemble size.

    **Returns:**

    The state with the hyperparameters replaced.

    **Example:**

    ```python
    ens = ee.ensemble(lambda k: eqx.nn.Linear(2, 1, key=k), size=3,
                      key=jax.random.key(0))
    opt = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
    state = ee.init_optimizer(opt, ens)
    state = ee.set_hyperparams(state, {"learning_rate": jnp.array([0.1, 0.01, 0.0])},
                               size=3)
    state.hyperparams["learning_rate"]      # [0.1, 0.01, 0.0]
    ```
    """
    check_hyperparams_mapping(hyperparams)
    if isinstance(opt_state, SharedOptState):
        # The shared part has ONE state: it keeps the optimizer's own values.
        members = set_hyperparams(opt_state.members, hyperparams, size)
        return SharedOptState(members, opt_state.shared)
    nodes = hyperparam_nodes(opt_state)
    if not nodes:
        raise ValueError(
            "Per-member hyperparameters need an optimizer built with "
            "`optax.inject_hyperparams`, e.g. "
            "`optax.inject_hyperparams(optax.adam)(learning_rate=1e-3)`; this "
            "optimizer state has no injected hyperparameters."
        )
    for name, value in hyperparams.items():
        owners = [(path, node) for path, node in nodes if name in node.hyperparams]
        if not owners:
            available = sorted({n for _, node in nodes for n in node.hyperparams})
            raise ValueError(
                f"Unknown hyperparameter {name!r}; the injected hyperparameters are "
                f"{available}"
            )
        if len(owners) > 1:
            if _looks_grouped(opt_state, owners, name, size):
                raise ValueError(
                    f"Hyperparameter {name!r} is held once per group: this looks "
                    "like the optimizer state of an `ee.Heterogeneous` (a tuple "
                    "with one state per group). Pass `hyperparams=` to "
                    "`ee.init_optimizer(optimizer, het, hyperparams=...)` (one value "
                    "per member over all groups), or set each group's state with "
                    "its own members' values: `tuple(ee.set_hyperparams(s, {...}, "
                    "size=len(g)) for s, g in zip(opt_state, het.groups))`"
                )
            raise ValueError(
                f"Hyperparameter {name!r} is injected in several places "
                f"({[path for path, _ in owners]}); set them on the optimizer itself"
            )
        path, node = owners[0]
        array = _hyperparam_value(name, value, node.hyperparams[name], size)
        new_hyperparams = {**node.hyperparams, name: array}
        opt_state = jtu.tree_map(
            lambda x, node=node, new=new_hyperparams: (
                x._replace(hyperparams=new) if x is node else x
            ),
            opt_state,
            is_leaf=lambda x: x is node,
        )
        nodes = hyperparam_nodes(opt_state)
    return opt_state


def _hyperparam_value(name: str, value: Any, current: Any, size: int) -> Any:
    """`value` for the hyperparameter `name`, checked and cast like `current`."""
    given_shape = np.shape(value)  # pyright: ignore[reportArgumentType]
    if current.ndim == 0 and len(given_shape) > 0:
        raise ValueError(
            f"Hyperparameter {name!r} is held once in this optimizer state (it "
            "is not stacked over members: e.g. the state of a shared part, "
            "`SharedOptState.shared`), so it takes ONE value, got shape "
            f"{given_shape}. A shared part is trained with one "
            "setting for all members; per-member values apply to the members' "
            "own state (`SharedOptState.members`, or the whole `SharedOptState`)."
        )
    state_size = current.shape[0] if current.ndim else None
    if state_size is not None and state_size != size:
        raise ValueError(
            f"`size` is {size} but the optimizer state holds {state_size} "
            f"members (hyperparameter {name!r} has shape {tuple(current.shape)}); "
            "pass the ensemble size the state was made for"
        )
    array = real_array(value, f"hyperparams[{name!r}]")
    if jnp.issubdtype(array.dtype, jnp.complexfloating) or array.dtype == bool:
        raise TypeError(
            f"Hyperparameter {name!r} must be real numbers, got dtype {array.dtype}"
        )
    if array.ndim == 0 and current.ndim:
        array = jnp.broadcast_to(array, (size,))
    if array.shape != ((size,) if current.ndim else ()):
        raise ValueError(
            f"Hyperparameter {name!r} must have one value per member: the "
            f"ensemble has {size} members, got shape {tuple(array.shape)}"
        )
    if not is_traced(array):
        finite = np.isfinite(np.asarray(array, dtype=np.float64))
        if not finite.all():
            bad = np.flatnonzero(~finite).tolist()
            raise ValueError(
                f"Hyperparameter {name!r} is not finite for members {bad}: "
                f"{np.asarray(array).tolist()}"
            )
    # The state's dtype, weak type included (optax would change it at an update).
    if (
        not isinstance(value, jax.Array)
        or not jax.numpy.issubdtype(array.dtype, current.dtype)
        or jax.typeof(array).weak_type != jax.typeof(current).weak_type
    ):
        array = jax.lax.convert_element_type(array, current.dtype)
    return array


def init_state(
    optimizer: optax.GradientTransformation, ens: Ensemble | Heterogeneous
) -> PyTree[Any]:
    """The fresh stacked optimizer state of `ens` (traceable; one per group)."""
    states = [
        _init_state(optimizer, trainable(group.members), _trained_shared(group))
        for (group,) in group_parts(ens)
    ]
    return joined(ens, states)


def init_optimizer(
    optimizer: optax.GradientTransformation,
    ens: Ensemble | Heterogeneous,
    *,
    hyperparams: Mapping[str, Float[ArrayLike, " members"] | Sequence[float] | float]
    | None = None,
) -> PyTree[Any]:
    """Initialise one optax state per member, stacked like the ensemble.

    `filter_vmap(optimizer.init)` over the members' floating-point leaves, so
    every transformation keeps its per-member meaning; compiled once per `init`
    and structure.

    **Arguments:**

    - `optimizer`: any `optax.GradientTransformation`.
    - `ens`: the ensemble.
    - `hyperparams`: optional per-member hyperparameters, name -> array of shape
      `(len(ens),)`, for an optimizer built with `optax.inject_hyperparams`; e.g. a
      learning-rate sweep trained as one ensemble.

    **Returns:**

    The stacked optimizer state (leading member axis on every array leaf). With
    `train_shared=True`, a [`SharedOptState`][eqx_ensemble.SharedOptState] that
    adds ONE state for the shared part (with the optimizer's own
    hyperparameters). For an [`ee.Heterogeneous`][eqx_ensemble.Heterogeneous],
    a tuple with one state per group (`hyperparams` still per member).

    **Example:**

    ```python
    ens = ee.ensemble(lambda k: eqx.nn.MLP(2, 1, 16, 1, key=k), size=4,
                      key=jax.random.key(0))
    opt = optax.inject_hyperparams(optax.adam)(learning_rate=1e-3)
    state = ee.init_optimizer(opt, ens,
                              hyperparams={"learning_rate": jnp.logspace(-4, -1, 4)})
    ```
    """
    if hyperparams is not None:
        check_hyperparams_mapping(hyperparams)
    if not is_ensemble(ens):
        raise TypeError(f"expected an `ee.Ensemble`, got {type(ens).__name__}")
    check_optimizer(optimizer)
    cut = functools.partial(_group_hyperparams, size=len(ens))
    held = per_group_slices(ens, hyperparams or None, cut)
    return joined(
        ens,
        [_init_group(optimizer, group, hp) for group, hp in zip(groups_of(ens), held)],
    )


def _init_group(
    optimizer: optax.GradientTransformation, ens: Ensemble, hyperparams: Any
) -> PyTree[Any]:
    size = len(ens)
    opt_state = _init_state(optimizer, trainable(ens.members), _trained_shared(ens))
    if hyperparams:
        opt_state = set_hyperparams(opt_state, hyperparams, size)
        check_hyperparams_kept(optimizer, ens.members, opt_state, hyperparams)
    opt_state = placement_of(model_mesh(ens)).follow_model(opt_state, ens)
    # Split over "members" as `fit` places it (each process holds its part).
    opt_state = placement_of(members_mesh(ens)).shard(opt_state)
    return opt_state


def _group_hyperparams(
    hyperparams: Mapping[str, Any] | None, start: int, stop: int, *, size: int
) -> dict[str, Any] | None:
    # Per-member values over all groups, cut to one group's members.
    if hyperparams is None:
        return None
    out = {}
    for name, value in hyperparams.items():
        shape = np.shape(value)
        if shape not in ((), (size,)):
            raise ValueError(
                f"hyperparameter {name!r} has shape {shape}; give one value per "
                f"member of the heterogeneous ensemble ({size},) or one value for all"
            )
        out[name] = value if shape == () else jnp.asarray(value)[start:stop]
    return out


def check_hyperparams_kept(
    optimizer: optax.GradientTransformation,
    members: PyTree[Any],
    opt_state: PyTree[Any],
    names: Mapping[str, Any],
) -> None:
    """Raise if `optimizer.update` overwrites an injected hyperparameter in `names`."""
    opt_state = members_opt_state(opt_state)
    member_params = first_member(trainable(members))
    member_state = first_member(opt_state)
    dynamic, static = eqx.partition(
        member_state, lambda x: isinstance(x, jax.ShapeDtypeStruct)
    )

    def update(dynamic_state, params):
        _, new_state = optimizer_update(
            optimizer,
            jax.tree.map(jnp.zeros_like, params),
            eqx.combine(dynamic_state, static),
            params,
            optimizer_key(jax.random.key(0)),
            jnp.zeros(()),
        )
        return eqx.filter(new_state, eqx.is_array)

    jaxpr, out_shapes = jax.make_jaxpr(update, return_shape=True)(
        dynamic, member_params
    )
    inputs = jtu.tree_flatten_with_path(dynamic)[0]
    outputs = {
        keystr(path): index
        for index, (path, _) in enumerate(jtu.tree_flatten_with_path(out_shapes)[0])
    }
    kept = _kept_inputs(jaxpr.jaxpr)
    for index, (path, _) in enumerate(inputs):
        output = outputs.get(keystr(path))
        if (
            len(path) >= 2
            and isinstance(path[-2], jtu.GetAttrKey)
            and path[-2].name == "hyperparams"
            and isinstance(path[-1], jtu.DictKey)
            and path[-1].key in names
            and (output is None or index not in kept[output])
        ):
            raise ValueError(
                f"Hyperparameter {path[-1].key!r} is a schedule in this optimizer, "
                "or its update does not pass it on as it is: "
                "`optax.inject_hyperparams` recomputes a schedule from the step "
                "count at every update (and a wrapper may compute the value "
                "anew), so per-member values would be overwritten at the next "
                "update. Give `inject_hyperparams` a number for it (e.g. "
                "`learning_rate=1e-3`) to set it per member."
            )


# Primitives whose outputs are their inputs' values.
_IDENTITIES = frozenset({"copy", "optimization_barrier"})


# Primitives that call their `jaxpr` (or `call_jaxpr`) once on their inputs.
_CALLS = frozenset(
    {"jit", "pjit", "closed_call", "core_call", "custom_jvp_call",
     "custom_vjp_call", "remat2", "checkpoint"}
)  # fmt: skip


def _kept_carries(body: Any, consts: int) -> list[bool]:
    """For each output of a loop's `body`, whether it is its carry unchanged."""
    marks = [frozenset({index}) for index in range(len(body.invars))]
    return [consts + j in kept for j, kept in enumerate(_kept_inputs(body, marks))]


def _kept_inputs(
    jaxpr: Any, given: Sequence[frozenset[int]] | None = None
) -> list[frozenset[int]]:
    """For each output of `jaxpr`, the inputs it provably equals."""
    origin: dict[Any, frozenset[int]] = {
        var: frozenset({index}) if given is None else given[index]
        for index, var in enumerate(jaxpr.invars)
    }

    def of(atom: Any) -> frozenset[int]:
        if isinstance(atom, jex_core.Literal):
            return frozenset()
        return origin.get(atom, frozenset())

    for eqn in jaxpr.eqns:
        ins = [of(atom) for atom in eqn.invars]
        name, params = eqn.primitive.name, eqn.params
        outs: list[frozenset[int]] = [frozenset()] * len(eqn.outvars)
        if name in _IDENTITIES or (
            name == "convert_element_type"
            and params.get("new_dtype") == getattr(eqn.invars[0].aval, "dtype", None)
        ):
            outs = ins[: len(outs)]
        elif name == "select_n":
            outs = [frozenset.intersection(*ins[1:])]
        elif name == "cond":
            per_branch = [
                _kept_inputs(branch.jaxpr, ins[1:]) for branch in params["branches"]
            ]
            outs = [frozenset.intersection(*column) for column in zip(*per_branch)]
        elif name == "while":  # cond's consts, body's consts, carries
            first = params["cond_nconsts"] + params["body_nconsts"]
            kept = _kept_carries(params["body_jaxpr"].jaxpr, params["body_nconsts"])
            outs = [
                ins[first + j] if keeps else frozenset() for j, keeps in enumerate(kept)
            ]
        elif name == "scan":  # consts, carries, scanned; out: carries, stacked
            consts = params["num_consts"]
            kept = _kept_carries(params["jaxpr"].jaxpr, consts)[: params["num_carry"]]
            outs[: len(kept)] = [
                ins[consts + j] if keeps else frozenset()
                for j, keeps in enumerate(kept)
            ]
        elif name in _CALLS:
            inner = params.get("jaxpr", params.get("call_jaxpr"))
            inner = getattr(inner, "jaxpr", inner)
            if isinstance(inner, jex_core.Jaxpr) and len(inner.invars) == len(ins):
                outs = _kept_inputs(inner, ins)
        for var, found in zip(eqn.outvars, outs, strict=True):
            origin[var] = found  # (a dropped output too: never read)
    return [of(atom) for atom in jaxpr.outvars]


def check_opt_state(
    optimizer: optax.GradientTransformation,
    ens: Ensemble | Heterogeneous,
    opt_state: Any,
) -> None:
    """Raise a clear error if `opt_state` was not made for this ensemble."""
    parts = group_parts(ens, opt_state, what="The optimizer state")
    for (label, _), (group, group_state) in zip(
        labelled(ens, parts), parts, strict=True
    ):
        try:
            _check_group_state(optimizer, group, group_state)
        except (ValueError, TypeError) as error:
            if not label:
                raise
            raise type(error)(f"group {label[1:-1]}: {error}") from None


def _check_group_state(
    optimizer: optax.GradientTransformation, ens: Ensemble, opt_state: Any
) -> None:
    size = len(ens)
    given_arrays = eqx.filter(opt_state, _is_array_or_struct)
    difference = first_difference(
        _expected_state(optimizer, trainable(ens.members), _trained_shared(ens)),
        jax.tree.map(_as_struct, given_arrays),
    )
    if difference is not None:
        raise ValueError(
            "The optimizer state does not match the ensemble and optimizer (make it "
            f"with `ee.init_optimizer(optimizer, ens)` for this {size}-member "
            f"ensemble). First difference (expected first): {difference}"
        )


# Expected states per optimizer and structures (tracing `init` costs ~8 ms).
_EXPECTED: dict[Any, Any] = {}


def _expected_state(
    optimizer: Any, members: PyTree[Any], shared: PyTree[Any]
) -> PyTree[Any]:
    """`_init_state`'s output as `_Spec`s (array leaves) and `None`s."""
    try:
        key = (
            canonical_tree(optimizer),
            signature(members),
            signature(shared),
            jax.dtypes.canonicalize_dtype(np.float64),  # x64 on or off
        )
        found = _EXPECTED.get(key)
    except TypeError:  # a part that cannot be hashed: traced every time
        key, found = None, None
    if found is None:
        expected = eqx.filter_eval_shape(_init_state, optimizer, members, shared)
        # Keep the `ShapeDtypeStruct`s (not `eqx.is_array_like`).
        found = jax.tree.map(_as_struct, eqx.filter(expected, _is_array_or_struct))
        if key is not None:
            if len(_EXPECTED) >= 64:
                _EXPECTED.clear()
            _EXPECTED[key] = found
    return found


def _is_array_or_struct(x: Any) -> bool:
    return eqx.is_array_like(x) or isinstance(x, jax.ShapeDtypeStruct)


class _Spec:
    """Shape and dtype of an array leaf, compared without weak types or shardings."""

    def __init__(self, shape: tuple[int, ...], dtype: Any):
        self.shape, self.dtype = tuple(shape), jnp.dtype(dtype)

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, _Spec)
            and self.shape == other.shape
            and self.dtype == other.dtype
        )

    def __hash__(self) -> int:
        return hash((self.shape, self.dtype))

    def __repr__(self) -> str:
        return f"{self.dtype}{list(self.shape)}"


def _as_struct(x: Any) -> Any:
    if isinstance(x, bool | int | float | complex):
        return x
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return _Spec(x.shape, x.dtype)
    return _Spec(np.shape(x), jnp.result_type(x))


# Where optax closes over a learning-rate schedule (`sgd` negates `step_size_fn`).
_SCHEDULE_NAMES = ("learning_rate",)


def _schedules(optimizer: Any) -> list[tuple[str, Callable[[Any], Any]]]:
    """The learning-rate schedules an optax optimizer closes over (by name)."""
    found: list[tuple[str, Callable[[Any], Any]]] = []
    seen: set[int] = set()

    def named(name: Any, value: Any, depth: int) -> None:
        if name in _SCHEDULE_NAMES and callable(value):
            if all(value is not known for _, known in found):
                found.append((name, value))
        visit(value, depth + 1)

    def visit(value: Any, depth: int) -> None:
        if depth > 12 or id(value) in seen:
            return
        seen.add(id(value))
        if isinstance(value, optax.GradientTransformation):
            visit(value.init, depth + 1)
            visit(value.update, depth + 1)
        elif isinstance(value, tuple | list):
            for item in value:
                visit(item, depth + 1)
        elif isinstance(value, dict):
            for name, item in value.items():
                named(name, item, depth)
        elif isinstance(value, functools.partial):
            visit(value.func, depth + 1)
            visit(value.args, depth + 1)
            visit(value.keywords, depth + 1)
        else:
            code = getattr(value, "__code__", None)
            cells = getattr(value, "__closure__", None) or ()
            if code is None:
                return
            for name, cell in zip(code.co_freevars, cells, strict=True):
                try:
                    content = cell.cell_contents
                except ValueError:  # an empty cell
                    continue
                named(name, content, depth)

    visit(optimizer, 0)
    return found


def schedule_problem(optimizer: Any, steps: Sequence[int]) -> str | None:
    """A sentence naming a negative or non-finite step-size schedule, or `None`."""
    last = max((int(s) for s in steps), default=-1)
    if last < 0:
        return None
    counts = jnp.arange(last + 1, dtype=jnp.int32)
    for name, schedule in _schedules(optimizer):
        try:
            values = np.asarray(jax.vmap(schedule)(counts), dtype=np.float64)
        except Exception:  # noqa: BLE001 - not a schedule of the step count
            continue
        if values.shape != counts.shape:
            continue
        bad = ~np.isfinite(values) | (values < 0)
        if bad.any():
            first = int(np.argmax(bad))
            what = "negative" if values[first] < 0 else "not finite"
            return (
                f"the optimizer's `{name}` schedule is {what} from step {first + 1} "
                f"({values[first]:.6g}): a negative step size climbs the loss. "
                "Fix the schedule"
            )
    return None
