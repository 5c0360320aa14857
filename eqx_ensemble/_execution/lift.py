"""Optax's learning rate, momentum and weight decay as inputs of a program, so
that a new value does not compile again: `optax.scale`'s step size (every
`learning_rate`), `optax.trace`'s decay and a nonzero `add_decayed_weights`.
Others (Adam's `b1`, `eps`) stay constants. `lifted(fn)`: `None`, or a `Lifted`
static leaf (equal for functions differing only in those values) and the values.
"""

import enum
import functools
import types
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import jax
import optax

from .intern import canonical


class _Hole(enum.Enum):
    """Where a lifted value was (keyed by identity: `intern.py` keys enums so)."""

    HOLE = 0


_HOLE = _Hole.HOLE


def _codes() -> dict[types.CodeType, tuple[str, Callable[[float], bool]]]:
    # The update functions' code -> the closure variable lifted, and for which values.
    def nonzero(value: float) -> bool:
        return value != 0.0

    def any_value(value: float) -> bool:
        del value
        return True

    def code(fn: Any) -> types.CodeType:
        return fn.__code__

    decayed = optax.add_decayed_weights(0.5)  # (its `init` reads it too)
    return {
        code(optax.scale(1.0).update): ("step_size", any_value),
        code(optax.trace(0.5).update): ("decay", any_value),
        code(decayed.update): ("weight_decay", nonzero),
        code(decayed.init): ("weight_decay", nonzero),
    }


_CODES = _codes()
# Containers and depth walked from a function into the closures it reaches.
_MAX_DEPTH = 32


def _substitute(obj: Any, fill: Callable[[Any, bool], Any], depth: int = 0) -> Any:
    """`obj` with each lifted closure value `v` replaced by `fill(v, liftable)`."""
    if depth > _MAX_DEPTH:
        return obj
    if isinstance(obj, types.FunctionType):
        return _function(obj, fill, depth)
    if isinstance(obj, functools.partial):
        func = _substitute(obj.func, fill, depth + 1)
        args = _substitute(obj.args, fill, depth + 1)
        keywords = {k: _substitute(v, fill, depth + 1) for k, v in obj.keywords.items()}
        same = all(keywords[k] is v for k, v in obj.keywords.items())
        if func is obj.func and args is obj.args and same:
            return obj
        return functools.partial(func, *args, **keywords)
    if type(obj) in (tuple, list) or (isinstance(obj, tuple) and hasattr(obj, "_make")):
        items = [_substitute(item, fill, depth + 1) for item in obj]
        if all(new is old for new, old in zip(items, obj)):
            return obj
        named: Any = obj
        return type(obj)(items) if type(obj) in (tuple, list) else named._make(items)
    return obj


def _function(
    fn: types.FunctionType, fill: Callable[[Any, bool], Any], depth: int
) -> Any:
    if not (fn.__module__ or "").startswith("optax") or not fn.__closure__:
        return fn  # (a user's function: its values are keyed, `intern.py`)
    name, liftable = _CODES.get(fn.__code__, (None, None))
    cells = []
    for variable, cell in zip(fn.__code__.co_freevars, fn.__closure__):
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            cells.append(cell)
            continue
        if variable == name:
            assert liftable is not None
            new = fill(value, type(value) is float and liftable(value))
        else:
            new = _substitute(value, fill, depth + 1)
        cells.append(cell if new is value else types.CellType(new))
    if all(new is old for new, old in zip(cells, fn.__closure__)):
        return fn
    copy = types.FunctionType(
        fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, tuple(cells)
    )
    copy.__kwdefaults__ = fn.__kwdefaults__
    copy.__qualname__, copy.__doc__ = fn.__qualname__, fn.__doc__
    copy.__dict__.update(fn.__dict__)
    return copy


class Lifted:
    """A static leaf: a canonical template function and how many values fill it."""

    __slots__ = ("template", "count", "__weakref__")

    def __init__(self, template: Any, count: int):
        self.template, self.count = template, count

    def __hash__(self) -> int:
        return hash((id(self.template), self.count))

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, Lifted)
            and other.template is self.template
            and other.count == self.count
        )

    def filled(self, values: Iterator[Any]) -> Any:
        """The function, its holes filled with the next `count` values."""

        def fill(value: Any, liftable: bool) -> Any:
            del liftable
            return next(values) if value is _HOLE else value

        return _substitute(self.template, fill)


# A canonical function -> its `Lifted` leaf and values, or `None` (held weakly).
_LIFTS: "weakref.WeakKeyDictionary[Any, tuple[Lifted, tuple[float, ...]] | None]" = (
    weakref.WeakKeyDictionary()
)


def lifted(fn: Any) -> "tuple[Lifted, tuple[float, ...]] | None":
    """`fn`'s static leaf and lifted values, or `None`."""
    try:
        return _LIFTS[fn]
    except KeyError:
        pass
    except TypeError:  # not weakly referenceable
        return None
    values: list[float] = []

    def hole(value: Any, liftable: bool) -> Any:
        if not liftable:
            return value
        values.append(value)
        return _HOLE

    template = _substitute(fn, hole)
    found = None
    if values:
        template = canonical(template)
        found = (Lifted(template, len(values)), tuple(values))
    _LIFTS[fn] = found
    return found


def lifts(tree: Any) -> bool:
    return any(
        type(leaf) is types.FunctionType and lifted(leaf) is not None
        for leaf in jax.tree_util.tree_leaves(tree)
    )
