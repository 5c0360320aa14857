"""The base of the library's host-side components."""

from typing import Any

import equinox as eqx


class Component(eqx.Module):
    """An `eqx.Module` whose methods read as plain bound methods.

    Equinox turns every method read on a module into a `BoundMethod` module
    (so that `jax.jit(module.method)` sees the module's arrays), which costs
    about 17 us per read on a CPU. The library's components (samplings,
    evaluations, trackers, controllers, progress meters, loggers, checkpoints)
    have their methods called on the host several times per `fit` call and per
    dispatch, and inside traced code, but are never handed to a transformation
    as a bound method: they read them as Python does. Everything else about
    them (fields, pytree structure, immutability) is Equinox's."""

    def __getattribute__(self, name: str, /) -> Any:
        return object.__getattribute__(self, name)
