"""The base of the library's host-side components."""

from typing import Any

import equinox as eqx


class Component(eqx.Module):
    """An `eqx.Module` whose methods read as plain bound methods (Equinox wraps
    each read; components' methods never go to a transformation)."""

    def __getattribute__(self, name: str, /) -> Any:
        return object.__getattribute__(self, name)
