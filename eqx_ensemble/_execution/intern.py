"""Programs keyed by what they compute, not by the identity of Python closures.

Two `optax.adam(1e-3)` are distinct closures: identity-keyed caches would compile
the same program twice. `canonical(fn)` returns the first function seen that
provably computes the same as `fn`, else `fn`. What `structural_key` cannot key by
value (a user's module, an oversized array, code that imports) is *doubtful*: its
own key. As in `jax.jit`, a closure cell reassigned later is not looked at again.
"""

import collections
import dis
import enum
import functools
import os
import site
import sys
import sysconfig
import types
import weakref
from collections.abc import Hashable
from typing import Any

import equinox as eqx
import jax
import numpy as np

from .._internal.tree import is_traced

# Arrays with at most this many elements are keyed by value.
MAX_ARRAY = 4096
# Containers and objects' attributes with at most this many items: by contents.
MAX_CONTAINER = 256
# Canonical functions kept (least recently used dropped first).
MAX_CANONICAL = 512


class Doubtful(Exception):
    """Raised while keying an object whose equality cannot be shown by value."""


class _Identity:
    """A key part that is its object's identity (only for what cannot change)."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any):
        self.obj = obj

    def __hash__(self) -> int:
        return id(self.obj)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Identity) and other.obj is self.obj


_PLAIN = (type(None), bool, int, str, bytes, type(Ellipsis))
# Callables implemented in C (`len`, a ufunc): code Python cannot change.
_BUILTIN = (
    types.BuiltinFunctionType,
    types.MethodWrapperType,
    types.WrapperDescriptorType,
    types.MethodDescriptorType,
    types.ClassMethodDescriptorType,
    np.ufunc,
)


def structural_key(obj: Any) -> Hashable:
    """A hashable key equal for objects computing the same thing (else `Doubtful`)."""
    return _key(obj, _Walk())


class _Walk(dict[int, int]):
    """Objects being walked (id -> depth); `mutable`: read in-place-mutable state."""

    mutable = False
    library = 0


def _key(obj: Any, visiting: "_Walk") -> Hashable:
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
    if isinstance(obj, type):
        return _class_key(obj, visiting)
    if isinstance(obj, (enum.Enum, np.dtype, *_BUILTIN)):
        return _Identity(obj)  # code, or a value that cannot change
    if kind is types.ModuleType:
        if _is_library(obj.__name__):
            return _Identity(obj)
        raise Doubtful(f"the module {obj.__name__}")
    if kind in (tuple, list, dict):
        if len(obj) > MAX_CONTAINER:
            raise Doubtful(f"a {kind.__name__} of {len(obj)} items")
        if kind is not tuple:
            _mark_mutable(visiting)
        items = obj.items() if kind is dict else enumerate(obj)
        return (kind, tuple((_key(k, visiting), _key(v, visiting)) for k, v in items))
    if kind in (frozenset, range, slice):
        items = (
            sorted(obj, key=repr)
            if kind is frozenset
            else (obj.start, obj.stop, obj.step)
        )
        return (kind, tuple(_key(item, visiting) for item in items))
    if id(obj) in visiting:  # a cycle: the depth of the object it returns to
        return ("cycle", visiting[id(obj)])
    visiting[id(obj)] = len(visiting)
    try:
        if _is_pytree_node(obj):
            leaves, treedef = jax.tree_util.tree_flatten(obj)
            if len(leaves) > MAX_CONTAINER:
                raise Doubtful(f"a {kind.__name__} of {len(leaves)} leaves")
            key = (treedef, tuple(_key(leaf, visiting) for leaf in leaves))
            try:
                hash(key)
            except TypeError:  # a static field that cannot be hashed
                raise Doubtful(f"a {kind.__name__} with an unhashable field")
            return key
        return _object_key(obj, visiting)
    finally:
        del visiting[id(obj)]


def _object_key(obj: Any, visiting: "_Walk") -> Hashable:
    # By class and `vars`; doubtful where state lives elsewhere (builtin base, slots).
    kind = type(obj)
    if any(
        base is not object and base.__module__ == "builtins" for base in kind.__mro__
    ) or any("__slots__" in vars(base) for base in kind.__mro__):
        raise Doubtful(f"an object of type {kind.__qualname__} (builtin base, slots)")
    attributes = getattr(obj, "__dict__", None)
    if isinstance(attributes, dict) and len(attributes) <= MAX_CONTAINER:
        _mark_mutable(visiting)
        return (_key(kind, visiting), "object", _key(attributes, visiting))
    if attributes is None and callable(obj) and _package(kind.__module__) in _JAX:
        return _Identity(obj)
    raise Doubtful(f"an object of type {kind.__qualname__}")


_JAX = ("jax", "jaxlib")


def _package(module: str | None) -> str:
    return (module or "").partition(".")[0]


def _class_key(cls: type, visiting: "_Walk") -> Hashable:
    """A class by identity; a user's class also by its (and user bases') attributes."""
    own = [
        base
        for base in cls.__mro__
        if not _is_library(base.__module__) or "<locals>" in base.__qualname__
    ]
    if not own:
        return _Identity(cls)
    if id(cls) in visiting:
        return ("cycle", visiting[id(cls)])
    _mark_mutable(visiting)
    visiting[id(cls)] = len(visiting)
    try:
        parts = []
        for base in own:
            for name, value in vars(base).items():
                if name.startswith("__") or name in _CLASS_MACHINERY:
                    continue
                if isinstance(value, staticmethod | classmethod):
                    value = value.__func__
                elif isinstance(value, property):
                    value = (value.fget, value.fset, value.fdel)
                parts.append((base.__qualname__, name, _key(value, visiting)))
        return (_Identity(cls), tuple(parts))
    finally:
        del visiting[id(cls)]


def _mark_mutable(visiting: "_Walk") -> None:
    if not visiting.library:
        visiting.mutable = True


# Attributes Python adds to a class (not the user's state).
_CLASS_MACHINERY = frozenset({"_abc_impl"})


def _is_pytree_node(obj: Any) -> bool:
    try:
        leaves = jax.tree_util.tree_leaves(obj, is_leaf=lambda x: x is not obj)
    except Exception:  # noqa: BLE001 - e.g. a dict whose keys cannot be sorted
        return False
    return not (len(leaves) == 1 and leaves[0] is obj)


def _array_key(array: Any) -> Hashable:
    if is_traced(array):
        return _Identity(array)
    if isinstance(array, jax.Array) and (
        array.size > MAX_ARRAY or not array.is_fully_addressable
    ):
        return _Identity(array)  # cannot change
    if array.size > MAX_ARRAY:
        raise Doubtful(f"a NumPy array of {array.size} elements (written in place?)")
    if isinstance(array, np.ndarray | np.generic) and array.dtype.kind == "O":
        raise Doubtful("a NumPy array of Python objects")
    values = np.asarray(array)
    weak = bool(getattr(array, "weak_type", False))  # (promotes as a Python number)
    return (type(array), values.shape, str(values.dtype), weak, values.tobytes())


@functools.cache
def _library_folders() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    folders = {paths[name] for name in ("stdlib", "platstdlib", "purelib", "platlib")}
    folders.update(site.getsitepackages())
    folders.add(site.getusersitepackages())
    return tuple(os.path.realpath(folder) + os.sep for folder in folders)


@functools.lru_cache(maxsize=4096)
def _is_library(module_name: str | None) -> bool:
    """Whether `module_name` is Python's, an installed package's or this library's."""
    if not module_name or module_name == "__main__":
        return False
    top = module_name.partition(".")[0]
    if top == "eqx_ensemble" or top in sys.builtin_module_names:
        return True
    module = sys.modules.get(module_name)
    path = getattr(module, "__file__", None)
    if path is None:
        return top in sys.stdlib_module_names
    return os.path.realpath(path).startswith(_library_folders())


def _function_key(fn: types.FunctionType, visiting: "_Walk") -> Hashable:
    if id(fn) in visiting:  # recursion (a function naming itself): its name
        return ("recursive", fn.__module__, fn.__qualname__)
    if _is_library(fn.__module__) and "<locals>" not in fn.__qualname__:
        return _Identity(fn)  # (walking its globals would walk the library)
    code = fn.__code__
    if _reads_beyond_its_names(code, fn.__globals__):
        raise Doubtful(f"{fn.__qualname__} imports or reads its namespace by name")
    visiting[id(fn)] = len(visiting)
    library = _is_library(fn.__module__)
    visiting.library += library
    try:
        closure = tuple(_cell_key(cell, visiting) for cell in (fn.__closure__ or ()))
        fn_globals = fn.__globals__
        named = tuple(
            (name, _key(fn_globals[name], visiting))
            for name in _global_names(code)
            if name in fn_globals
        )
        # Data attributes the code may read of modules (`os.environ`): by value.
        read = tuple(
            (name, attribute, _key(getattr(module, attribute), visiting))
            for name, module in ((n, fn_globals.get(n)) for n in _global_names(code))
            if isinstance(module, types.ModuleType)
            for attribute in code.co_names
            if _is_data(getattr(module, attribute, _ABSENT))
        )
        return (
            types.FunctionType,
            _code_key(code),
            closure,
            _key(fn.__defaults__, visiting),
            _key(fn.__kwdefaults__, visiting),
            named,
            read,
            _key(dict(vars(fn)), visiting),  # attributes set on the function
        )
    finally:
        del visiting[id(fn)]
        visiting.library -= library


_ABSENT = object()
# Builtins that read a namespace by a name only known when run.
_DYNAMIC = frozenset({"globals", "locals", "vars", "eval", "exec", "__import__"})


def _is_data(value: Any) -> bool:
    return (
        value is not _ABSENT
        and not isinstance(
            value,
            (types.ModuleType, type, types.FunctionType, *_BUILTIN),
        )
        and not (callable(value) and _package(type(value).__module__) in _JAX)
    )


@functools.lru_cache(maxsize=1024)
def _imports(code: types.CodeType) -> bool:
    """Whether the code (or a function defined in it) imports a module."""
    if any(op.opname == "IMPORT_NAME" for op in dis.get_instructions(code)):
        return True
    return any(_imports(c) for c in code.co_consts if isinstance(c, types.CodeType))


def _reads_beyond_its_names(code: types.CodeType, fn_globals: dict) -> bool:
    names = set(_global_names(code))
    return _imports(code) or any(
        name in names and name not in fn_globals for name in _DYNAMIC
    )


def _cell_key(cell: Any, visiting: "_Walk") -> Hashable:
    try:
        contents = cell.cell_contents
    except ValueError:  # an empty cell
        return ("empty",)
    return _key(contents, visiting)


@functools.lru_cache(maxsize=1024)
def _code_key(code: types.CodeType) -> Hashable:
    # What the code computes, not where it was written (a re-run notebook cell).
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
    # Every global name the code and nested functions may look up.
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names.update(_global_names(const))
    return tuple(sorted(names))


_INTERNABLE = (types.FunctionType, functools.partial, types.MethodType)

# Structural key -> the first function seen with it (least recently used last).
_CANONICAL: "collections.OrderedDict[_Key, Any]" = collections.OrderedDict()
# A function seen before -> its key (held weakly).
_SEEN: "weakref.WeakKeyDictionary[Any, _Key]" = weakref.WeakKeyDictionary()


class _Key:
    """A structural key with its hash computed once (lookups on the hot path)."""

    __slots__ = ("value", "hash", "mutable")

    def __init__(self, value: Hashable):
        self.value, self.hash = value, hash(value)
        self.mutable = False  # (whether it reads state that changes in place)

    def __hash__(self) -> int:
        return self.hash

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Key) and (
            other is self or (other.hash == self.hash and other.value == self.value)
        )


def canonical(obj: Any) -> Any:
    """`obj`, or the first function seen computing the same (`structural_key`)."""
    if type(obj) not in _INTERNABLE:
        return obj
    remembered = _remembered(obj)
    if not remembered:
        # A bound method compares equal whatever its object's state: a partial.
        obj = functools.partial(obj.__func__, obj.__self__)
    key = _SEEN.get(obj) if remembered else None
    if key is None:
        walk = _Walk()
        try:
            key = _Key(_key(obj, walk))
            key.mutable = walk.mutable
        except (Doubtful, TypeError):  # cannot be shown equal to another
            key = _DOUBTFUL
        if remembered:
            _SEEN[obj] = key
    if key is _DOUBTFUL:
        return obj
    found = _CANONICAL.get(key)
    if (
        found is not None
        and found is not obj
        and key.mutable
        and not _still(found, key)
    ):
        found = None  # its state changed in place since it was first seen
    if found is None:
        _CANONICAL[key] = found = obj
        while len(_CANONICAL) > MAX_CANONICAL:
            _CANONICAL.popitem(last=False)
    else:
        _CANONICAL.move_to_end(key)
    return found


def _still(found: Any, key: "_Key") -> bool:
    """Whether the canonical function `found` still computes what `key` says."""
    try:
        return _Key(structural_key(found)) == key
    except (Doubtful, TypeError):
        return False


_DOUBTFUL = _Key(("doubtful",))


def _remembered(obj: Any) -> bool:
    # The key is kept per object (as `jax.jit`), not a mutable bound method's.
    if type(obj) is types.MethodType:
        return isinstance(obj.__self__, eqx.Module)
    return True


def canonical_tree(tree: Any) -> Any:
    """`tree` with every function leaf (or `tree` itself) made `canonical`."""
    if type(tree) in _INTERNABLE:
        return canonical(tree)
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    if not any(type(leaf) in _INTERNABLE for leaf in leaves):
        return tree
    return jax.tree_util.tree_unflatten(treedef, [canonical(x) for x in leaves])
