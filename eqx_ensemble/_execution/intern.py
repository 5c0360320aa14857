"""Programs keyed by what they compute, not by the identity of Python closures.

Every optax constructor returns new closures: two `optax.adam(1e-3)` are two
`(init, update)` pairs of distinct functions, and a cache keyed on them (JAX's
own `jit` cache, the library's compiled functions, its plans) compiles the same
program twice. `canonical(fn)` returns the first function seen that provably
computes the same thing as `fn`, else `fn` itself.

The rule: a program is reused for a new function object only where a fresh
`jax.jit` of that object could not trace differently. So everything a function
can reach while it is traced is keyed by value (`structural_key`):

- numbers, strings and other plain values by value; tuples, lists and dicts by
  their contents (up to `MAX_CONTAINER` items); NumPy and JAX arrays by shape,
  dtype and contents (up to `MAX_ARRAY` elements; a larger JAX array, which
  cannot change, by identity);
- functions, `functools.partial`s and bound methods by their code, closure
  cells, defaults and the current values of the globals their code names,
  recursively (a user's module-level helper too, with the globals it reads);
- pytrees (`eqx.Module`s, optax's named tuples) by their structure and leaves;
  other objects by their type and their attributes (`vars(obj)`), recursively;
- the code of installed libraries and of Python itself (their modules,
  functions and classes: `jnp`, `optax.adam`, `eqx.nn.MLP`) by identity, and
  every class by identity (as JAX's tree definitions are keyed).

Anything that cannot be keyed so (a user's module object, whose attributes any
code may reassign; a NumPy array above `MAX_ARRAY` elements, which may be
written in place; a container above `MAX_CONTAINER` items; an object with no
attributes to read) makes the function *doubtful*: it is its own key, so a new
function object traces and compiles again, as with `jax.jit`. As in `jax.jit`,
the same function object passed again is not traced again (a global changed
since is not seen for it).
"""

import collections
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
# Tuples, lists, dicts and objects' attributes with at most this many items
# are keyed by contents.
MAX_CONTAINER = 256
# Canonical functions kept (the least recently used dropped first): each is one
# entry in the caches below it, which are bounded too.
MAX_CANONICAL = 512


class Doubtful(Exception):
    """Raised while keying an object whose equality cannot be shown by value."""


class _Identity:
    """A key part that is its object's identity (and keeps the object alive, so
    the identity cannot be reused while the key exists): only for objects that
    cannot change what a trace of them sees."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any):
        self.obj = obj

    def __hash__(self) -> int:
        return id(self.obj)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Identity) and other.obj is self.obj


_PLAIN = (type(None), bool, int, str, bytes, type(Ellipsis))
# Callables implemented in C (`len`, `jnp.float32`'s methods, a ufunc): code
# that cannot be changed from Python.
_BUILTIN = (
    types.BuiltinFunctionType,
    types.MethodWrapperType,
    types.WrapperDescriptorType,
    types.MethodDescriptorType,
    types.ClassMethodDescriptorType,
    np.ufunc,
)


def structural_key(obj: Any) -> Hashable:
    """A hashable key equal for two objects that compute the same thing (see
    the module's docstring). Raises `Doubtful` where that cannot be shown."""
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
    if isinstance(obj, (enum.Enum, np.dtype, type, *_BUILTIN)):
        return _Identity(obj)  # code, or a value that cannot change
    if kind is types.ModuleType:
        if _is_library(obj.__name__):
            return _Identity(obj)
        raise Doubtful(f"the module {obj.__name__}")
    if kind in (tuple, list, dict):
        if len(obj) > MAX_CONTAINER:
            raise Doubtful(f"a {kind.__name__} of {len(obj)} items")
        items = obj.items() if kind is dict else enumerate(obj)
        return (kind, tuple((_key(k, visiting), _key(v, visiting)) for k, v in items))
    if id(obj) in visiting:  # a cycle through an object: its place in the walk
        return ("cycle", kind)
    visiting.add(id(obj))
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
        visiting.discard(id(obj))


def _object_key(obj: Any, visiting: set[int]) -> Hashable:
    # An instance of a plain class: by its class and its attributes. One from
    # a library with no attributes to read (a lock, a device, a jitted
    # function) by identity where its class is a library's.
    kind = type(obj)
    attributes = getattr(obj, "__dict__", None)
    if isinstance(attributes, dict) and len(attributes) <= MAX_CONTAINER:
        return (_Identity(kind), "object", _key(attributes, visiting))
    if attributes is None and _is_library(kind.__module__):
        return _Identity(obj)
    raise Doubtful(f"an object of type {kind.__qualname__}")


def _is_pytree_node(obj: Any) -> bool:
    # A registered pytree node (a NamedTuple, an `eqx.Module`, a dataclass
    # registered with JAX), not a leaf.
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
    values = np.asarray(array)
    return (type(array), values.shape, str(values.dtype), values.tobytes())


@functools.cache
def _library_folders() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    folders = {paths[name] for name in ("stdlib", "platstdlib", "purelib", "platlib")}
    folders.update(site.getsitepackages())
    folders.add(site.getusersitepackages())
    return tuple(os.path.realpath(folder) + os.sep for folder in folders)


@functools.lru_cache(maxsize=4096)
def _is_library(module_name: str | None) -> bool:
    """Whether `module_name` is Python's, an installed package's or this
    library's: code whose functions and classes are keyed by identity."""
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


def _function_key(fn: types.FunctionType, visiting: set[int]) -> Hashable:
    if id(fn) in visiting:  # recursion (a function naming itself): its name
        return ("recursive", fn.__module__, fn.__qualname__)
    if _is_library(fn.__module__) and "<locals>" not in fn.__qualname__:
        # A library's own function: the same code while the module is loaded
        # (walking every global it names would walk the library's call graph).
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
    provably computes the same thing (`structural_key`), else `obj` itself
    (a doubtful function: its own program, as with `jax.jit`): pass the
    result wherever a cache keys on identity."""
    if type(obj) not in _INTERNABLE:
        return obj
    remembered = _remembered(obj)
    if not remembered:
        # A bound method equals every other of the same object and function
        # (`==`, `hash`), whatever the object's state since: as a key of an
        # identity-keyed cache it would find the program of an earlier state.
        # The same call as a partial, which compares by identity.
        obj = functools.partial(obj.__func__, obj.__self__)
    key = _SEEN.get(obj) if remembered else None
    if key is None:
        try:
            key = _Key(structural_key(obj))
        except (Doubtful, TypeError):  # cannot be shown equal to another
            key = _DOUBTFUL
        if remembered:
            _SEEN[obj] = key
    if key is _DOUBTFUL:
        return obj
    found = _CANONICAL.get(key)
    if found is None:
        _CANONICAL[key] = found = obj
        while len(_CANONICAL) > MAX_CANONICAL:
            _CANONICAL.popitem(last=False)
    else:
        _CANONICAL.move_to_end(key)
    return found


# The key of a function found doubtful.
_DOUBTFUL = _Key(("doubtful",))


def _remembered(obj: Any) -> bool:
    # A function's or partial's key is kept for the object (as `jax.jit` keeps
    # its trace for the same function object). Not a bound method's: Python
    # makes one per attribute read, equal to every other of the same object
    # and function, so a kept key would outlive a change of the object; but
    # for an `eqx.Module`'s, which is frozen.
    if type(obj) is types.MethodType:
        return isinstance(obj.__self__, eqx.Module)
    return True


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
