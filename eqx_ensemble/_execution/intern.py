"""Programs keyed by what they compute, not by the identity of Python closures.

Every optax constructor returns new closures: two `optax.adam(1e-3)` are two
`(init, update)` pairs of distinct functions, and a cache keyed on them (JAX's
own `jit` cache, the library's compiled functions, its plans) compiles the same
program twice. `canonical(fn)` returns the first function seen that computes
the same thing as `fn`: same bytecode and constants (wherever it was written),
same closure contents, same defaults and the same values of the globals the
code names. The library interns the functions
it compiles for (losses, optimizers, schedules, components' functions) at its
entry points, so every identity-keyed cache below them sees equal functions as
one.

What counts as "the same" (`structural_key`): numbers, strings and other plain
values by value; tuples, lists and dicts by their contents (up to
`MAX_CONTAINER` items); NumPy and JAX arrays by shape, dtype and contents (up
to `MAX_ARRAY` elements); functions, `functools.partial`s and bound methods by
their code and what they close over, recursively (a function that is its
module's own global, such as a library's, by identity: it is the same object
while the module is loaded); pytrees (`eqx.Module`s,
optax's named tuples) by their structure and leaves. Anything else (modules,
classes, jitted functions, large arrays, objects of other types) by identity:
where equality cannot be proven, the cache falls back to identity, as JAX does.
As in `jax.jit`, a closure cell or a global that changes after a function was
first seen is not noticed for that same function object.
"""

import collections
import enum
import functools
import sys
import types
import weakref
from collections.abc import Hashable
from typing import Any

import jax
import numpy as np

from .._internal.tree import is_traced

# Arrays with at most this many elements are keyed by value; larger by identity.
MAX_ARRAY = 4096
# Tuples, lists and dicts with at most this many items are keyed by contents.
MAX_CONTAINER = 256
# Canonical functions kept (the least recently used dropped first): each is one
# entry in the caches below it, which are bounded too.
MAX_CANONICAL = 512


class _Identity:
    """A key part that is its object's identity (and keeps the object alive, so
    the identity cannot be reused while the key exists)."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any):
        self.obj = obj

    def __hash__(self) -> int:
        return id(self.obj)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Identity) and other.obj is self.obj


_PLAIN = (type(None), bool, int, str, bytes, type(Ellipsis))


def structural_key(obj: Any) -> Hashable:
    """A hashable key equal for two objects that compute the same thing (see
    the module's docstring); identity where that cannot be shown."""
    return _key(obj, set())


def _key(obj: Any, visiting: set[int]) -> Hashable:
    kind = type(obj)
    if kind in _PLAIN:
        return (kind, obj)
    if kind is float:
        return (kind, obj.hex())  # NaN equal to itself, -0.0 apart from 0.0
    if kind is complex:
        return (kind, obj.real.hex(), obj.imag.hex())
    if isinstance(obj, types.FunctionType):
        return _function_key(obj, visiting)
    if kind is functools.partial:
        return (
            kind,
            _key(obj.func, visiting),
            _key(obj.args, visiting),
            _key(obj.keywords, visiting),
        )
    if kind is types.MethodType:
        return (kind, _key(obj.__func__, visiting), _key(obj.__self__, visiting))
    if isinstance(obj, np.ndarray | np.generic | jax.Array):
        return _array_key(obj)
    if isinstance(obj, enum.Enum | np.dtype):
        return (kind, obj)
    if kind in (tuple, list, dict):
        if len(obj) > MAX_CONTAINER:
            return _Identity(obj)
        items = obj.items() if kind is dict else enumerate(obj)
        return (kind, tuple((_key(k, visiting), _key(v, visiting)) for k, v in items))
    if id(obj) not in visiting and _is_pytree_node(obj):
        visiting.add(id(obj))
        try:
            leaves, treedef = jax.tree_util.tree_flatten(obj)
            if len(leaves) <= MAX_CONTAINER:
                key = (treedef, tuple(_key(leaf, visiting) for leaf in leaves))
                hash(key)  # a static field that cannot be hashed: identity
                return key
        except Exception:  # noqa: BLE001 - anything unusual: identity
            pass
        finally:
            visiting.discard(id(obj))
    return _Identity(obj)


def _is_pytree_node(obj: Any) -> bool:
    # A registered pytree node (a NamedTuple, an `eqx.Module`, a dataclass
    # registered with JAX), not a leaf.
    try:
        leaves = jax.tree_util.tree_leaves(obj, is_leaf=lambda x: x is not obj)
    except Exception:  # noqa: BLE001 - e.g. a dict whose keys cannot be sorted
        return False
    return not (len(leaves) == 1 and leaves[0] is obj)


def _array_key(array: Any) -> Hashable:
    if is_traced(array) or array.size > MAX_ARRAY:
        return _Identity(array)
    if isinstance(array, jax.Array) and not array.is_fully_addressable:
        return _Identity(array)
    values = np.asarray(array)
    return (type(array), values.shape, str(values.dtype), values.tobytes())


def _is_module_global(fn: types.FunctionType) -> bool:
    # A function that is its module's own global (a library's function, a
    # test module's helper): the same object for as long as the module is
    # loaded, so its identity says what it computes, and the walk stops there
    # (walking every global it names would walk a library's whole call graph).
    # A script's or notebook's `__main__` functions are keyed by their code: a
    # re-run cell defines them again.
    if fn.__module__ in (None, "__main__") or "<locals>" in fn.__qualname__:
        return False
    found: Any = sys.modules.get(fn.__module__)
    for part in fn.__qualname__.split("."):
        found = getattr(found, part, None)
    return found is fn


def _function_key(fn: types.FunctionType, visiting: set[int]) -> Hashable:
    if id(fn) in visiting:  # recursion (a function naming itself): its name
        return ("recursive", fn.__module__, fn.__qualname__)
    if _is_module_global(fn):
        return _Identity(fn)
    visiting.add(id(fn))
    try:
        closure = tuple(_cell_key(cell, visiting) for cell in (fn.__closure__ or ()))
        fn_globals = fn.__globals__
        named = tuple(
            (name, _key(fn_globals[name], visiting))
            for name in _global_names(fn.__code__)
            if name in fn_globals
        )
        return (
            types.FunctionType,
            _code_key(fn.__code__),
            closure,
            _key(fn.__defaults__, visiting),
            _key(fn.__kwdefaults__, visiting),
            named,
        )
    finally:
        visiting.discard(id(fn))


def _cell_key(cell: Any, visiting: set[int]) -> Hashable:
    try:
        contents = cell.cell_contents
    except ValueError:  # an empty cell
        return ("empty",)
    return _key(contents, visiting)


@functools.lru_cache(maxsize=1024)
def _code_key(code: types.CodeType) -> Hashable:
    # What the code computes: its bytecode, names and constants, not where it
    # was written (its file, line numbers and name), so that one loss written
    # twice (a re-run notebook cell, two tests) is one program.
    consts = tuple(
        _code_key(c) if isinstance(c, types.CodeType) else (type(c), repr(c))
        for c in code.co_consts
    )
    return (
        code.co_code,
        consts,
        code.co_names,
        code.co_varnames,
        code.co_freevars,
        code.co_cellvars,
        code.co_argcount,
        code.co_posonlyargcount,
        code.co_kwonlyargcount,
        code.co_flags,
        code.co_exceptiontable,
    )


@functools.lru_cache(maxsize=1024)
def _global_names(code: types.CodeType) -> tuple[str, ...]:
    # Every name the code (and the functions defined inside it) may look up
    # among its globals: `co_names` also holds attribute names, which are
    # simply absent from the globals.
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names.update(_global_names(const))
    return tuple(sorted(names))


_INTERNABLE = (types.FunctionType, functools.partial, types.MethodType)

# Structural key -> the first function seen with it (least recently used last).
_CANONICAL: "collections.OrderedDict[_Key, Any]" = collections.OrderedDict()
# A function seen before -> its key (held weakly: the entry goes with the
# function).
_SEEN: "weakref.WeakKeyDictionary[Any, _Key]" = weakref.WeakKeyDictionary()


class _Key:
    """A structural key with its hash computed once: a lookup on the hot path
    (every `fit` call, every dispatch's static leaves) hashes no nested tuple,
    and finds the stored key by identity."""

    __slots__ = ("value", "hash")

    def __init__(self, value: Hashable):
        self.value, self.hash = value, hash(value)

    def __hash__(self) -> int:
        return self.hash

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Key) and (
            other is self or (other.hash == self.hash and other.value == self.value)
        )


def canonical(obj: Any) -> Any:
    """`obj` if it is not a function, else the first function seen that
    computes the same thing (`structural_key`): pass the result wherever a
    cache keys on identity."""
    if type(obj) not in _INTERNABLE:
        return obj
    try:
        key = _SEEN.get(obj)
    except TypeError:  # not weakly referable
        key = None
    if key is None:
        try:
            key = _Key(structural_key(obj))
        except TypeError:  # a part that cannot be hashed
            return obj
        try:
            _SEEN[obj] = key
        except TypeError:
            pass
    found = _CANONICAL.get(key)
    if found is None:
        _CANONICAL[key] = found = obj
        while len(_CANONICAL) > MAX_CANONICAL:
            _CANONICAL.popitem(last=False)
    else:
        _CANONICAL.move_to_end(key)
    return found


def canonical_tree(tree: Any) -> Any:
    """`tree` with every function leaf `canonical` (an optax
    `GradientTransformation`, a loss that is an `eqx.Module` holding a
    function...); a function itself is interned too."""
    if type(tree) in _INTERNABLE:
        return canonical(tree)
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    if not any(type(leaf) in _INTERNABLE for leaf in leaves):
        return tree
    return jax.tree_util.tree_unflatten(treedef, [canonical(x) for x in leaves])
