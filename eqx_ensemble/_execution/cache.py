"""What the library keeps between calls, in bounded tables: the compiled programs
(one table: each CPU program holds memory maps, bounded by `vm.max_map_count`)
and, per owner (a loss, held weakly), its plans, profiles and prepared calls."""

import collections
import weakref
from collections.abc import Callable, Hashable
from typing import Any

import equinox as eqx

# Compiled programs kept, least recently used dropped first.
MAX_PROGRAMS = 128
# Entries kept per owner (or per small table); past it the table starts again.
MAX_ENTRIES = 128

_PROGRAMS: collections.OrderedDict[tuple[Any, ...], Any] = collections.OrderedDict()
_OWNED: "weakref.WeakKeyDictionary[Any, dict[Any, Any]]" = weakref.WeakKeyDictionary()
_BY_ID: dict[int, tuple[Any, dict[Any, Any]]] = {}


def program(make: Callable[..., Any], *key: Hashable) -> Any:
    """The program `make(*key)`, made once while it is kept."""
    entry = (make, *key)
    found = _PROGRAMS.get(entry)
    if found is None:
        found = _PROGRAMS[entry] = make(*key)
        while len(_PROGRAMS) > MAX_PROGRAMS:
            _PROGRAMS.popitem(last=False)
    else:
        _PROGRAMS.move_to_end(entry)
    return found


def programs_of(make: Callable[..., Any]) -> int:
    """How many programs `make` made are kept."""
    return sum(entry[0] is make for entry in _PROGRAMS)


def owner_table(owner: Any) -> dict[Any, Any]:
    """What is kept for `owner` (TypeError: it cannot be referred to weakly)."""
    try:
        return _OWNED.setdefault(owner, {})
    except TypeError:
        if type(owner).__hash__ is not None and not isinstance(owner, eqx.Module):
            raise  # hashable but not weakly referable: a tuple, a number
    entry = _BY_ID.get(id(owner))
    if entry is None or entry[0]() is not owner:
        key = id(owner)
        ref = weakref.ref(owner, lambda _, key=key: _BY_ID.pop(key, None))
        entry = _BY_ID[key] = (ref, {})
    return entry[1]


def keep(table: dict[Any, Any], key: Hashable, value: Any) -> Any:
    """`table[key] = value`, the table emptied first when full; `value`."""
    if len(table) >= MAX_ENTRIES:
        table.clear()
    table[key] = value
    return value
