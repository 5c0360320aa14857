"""Compiling: `filter_jit`, the cached programs, and the XLA options of the training
steps (on a CPU, LLVM level 1 and, for big matmuls, every dot on all cores)."""

import functools
import gc
import os
import re
import types
from collections.abc import Callable, Hashable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import PyTree

from .._internal.tree import is_traced
from .cache import keep, program, programs_of
from .convolution import canonical_convolutions
from .intern import canonical
from .lift import Lifted, lifted
from .placement import Devices

# Turning off YNNPACK's dot/elementwise fusions on the CPU (XLA >= 0.8).
EIGEN_DOTS: dict[str, Any] = {"xla_cpu_experimental_ynn_fusion_type": ""}
# LLVM level 1, not XLA's 2: steps run as fast and compile sooner.
FAST_CODEGEN: dict[str, Any] = {"xla_backend_optimization_level": 1}
# Programs that run once: compile time first (benchmarks/bench_recompile.py).
ONE_SHOT: dict[str, Any] = {
    "xla_backend_optimization_level": 1,
    "xla_cpu_use_fusion_emitters": False,
}
# Below this, the thread pool costs more than it gains (2 cores: 0.6x at 1 MFLOP).
MIN_STEP_FLOPS = 16e6

Options = tuple[tuple[str, Any], ...]


def filter_jit(
    fn: Callable[..., Any], options: Options, *, donate: str | None = None
) -> "Jit":
    """`fn` compiled as by `eqx.filter_jit`, with XLA `options`, owning its programs;
    `donate="all-except-first"` donates every argument's arrays but the first's."""
    return Jit(fn, options, donate)


class Jit:
    """See `filter_jit`. Per call: one flatten, the `jax.jit` call, one unflatten."""

    def __init__(
        self, fn: Callable[..., Any], options: Options, donate: str | None = None
    ):
        if donate not in (None, "all-except-first"):
            raise ValueError(f"unknown donation {donate!r}")
        # No reference back to `self`: the programs go with it.
        on_cpu = jax.default_backend() == "cpu"
        self._jitted = jax.jit(
            functools.partial(_traced, fn, canonical=on_cpu),
            static_argnums=0,
            donate_argnums=(2,) if donate else (),
            compiler_options=dict(options) or None,
        )
        # Inside a user's trace JAX refuses compiler options: called without them.
        self._nested = (
            jax.jit(functools.partial(_traced, fn), static_argnums=0)
            if options
            else self._jitted
        )

    def __call__(self, *args: Any) -> Any:
        return self.call_split(*split_arguments(args))

    def call_split(self, static: Hashable, first: list[Any], rest: list[Any]) -> Any:
        arrays, static_out = self.call_arrays(static, first, rest)
        return static_out.unflatten(arrays)

    def call_arrays(
        self, static: Hashable, first: list[Any], rest: list[Any]
    ) -> tuple[list[Any], "_StaticOutput"]:
        """`call_split` without unflattening: the arrays, and a `_StaticOutput`."""
        # The cyclic GC paused while tracing (a full collection cost 80-120 ms).
        paused = gc.isenabled()
        if paused:
            gc.disable()
        try:
            arrays, static_out = self._jitted(static, first, rest)
        except ValueError as error:
            # Raised while tracing: retried only where the options are the cause.
            if self._nested is self._jitted or not _refuses_options(error, first, rest):
                raise
            arrays, static_out = self._nested(static, first, rest)
        finally:
            if paused:
                gc.enable()
        return arrays, static_out

    def lower(self, *args: Any) -> "Lowered":
        """Ahead-of-time lowering for these arguments (as `jax.jit(...).lower`)."""
        static, first, rest = split_arguments(args)
        lowered = self._jitted.lower(static, first, rest)
        return Lowered(self, static, lowered)


def _any_tracer(*leaf_lists: list[Any]) -> bool:
    return any(is_traced(leaf) for leaves in leaf_lists for leaf in leaves)


def _refuses_options(error: ValueError, *leaf_lists: list[Any]) -> bool:
    """Whether `error` is JAX refusing compiler options inside another trace."""
    return "compiler_options" in str(error) or _any_tracer(*leaf_lists)


def split_arguments(args: tuple[Any, ...]) -> tuple[Hashable, list, list]:
    """A `Jit`'s arguments as (hashable static part, first's arrays, rest's)."""
    first, first_def = jax.tree_util.tree_flatten(args[:1])
    rest, rest_def = jax.tree_util.tree_flatten(args[1:])
    first_arrays, first_static = _split_leaves(first)
    rest_arrays, rest_static = _split_leaves(rest)
    return (first_def, rest_def, first_static, rest_static), first_arrays, rest_arrays


def _split_leaves(leaves: list[Any]) -> tuple[list[Any], tuple[Any, ...]]:
    # One pass (every dispatch); functions interned (`intern.canonical`).
    arrays: list[Any] = []
    static: list[Any] = []
    for leaf in leaves:
        kind = _KINDS.get(type(leaf)) or _kind_of(leaf)
        if kind is _ARRAY:
            arrays.append(leaf)
            static.append(None)
        elif kind is _NUMBER:
            # `2`, `2.0` and `True` hash alike but trace to different dtypes.
            static.append(_Number(leaf))
        else:
            leaf = canonical(leaf)
            found = lifted(leaf) if type(leaf) is types.FunctionType else None
            if found is None:
                static.append(leaf)
            else:  # an optimizer's learning rate...: inputs (`lift.py`)
                static.append(found[0])
                arrays.extend(found[1])
    return arrays, tuple(static)


_NUMBERS = (bool, int, float, complex)
_ARRAY, _NUMBER, _OTHER = "array", "number", "other"
# Leaf kinds by type (never a tracer's).
_KINDS: dict[type, str] = {}


def _kind_of(leaf: Any) -> str:
    kind = (
        _ARRAY if eqx.is_array(leaf) else _NUMBER if type(leaf) in _NUMBERS else _OTHER
    )
    # Not for tracers or proxies (`__class__` not their type); bounded.
    if type(leaf) is leaf.__class__ and not is_traced(leaf) and len(_KINDS) < 1024:
        _KINDS[type(leaf)] = kind
    return kind


def _spec(leaf: Any) -> Hashable:
    # A lifted hyperparameter (`lift.py`) is a Python float.
    return float if type(leaf) is float else (leaf.shape, leaf.dtype)


class _Number:
    """A Python number as a static leaf, equal only to one of its type and repr."""

    __slots__ = ("value", "_key")

    def __init__(self, value: Any):
        self.value = value
        self._key = (type(value), repr(value))

    def __hash__(self) -> int:
        return hash(self._key)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Number) and other._key == self._key


class Lowered:
    """A `Jit` lowered for one set of argument shapes; `.compile()` compiles it."""

    def __init__(self, owner: Jit, static: Hashable, lowered: Any):
        self._owner, self._static, self.lowered = owner, static, lowered

    def as_text(self) -> str:
        return self.lowered.as_text()

    def compile(self) -> "Compiled":
        return Compiled(self._owner, self._static, self.lowered.compile())


class Compiled:
    """A compiled `Jit`; `.compiled` is JAX's compiled object."""

    def __init__(self, owner: Jit, static: Hashable, compiled: Any):
        self._owner, self._static, self.compiled = owner, static, compiled

    def __call__(self, *args: Any) -> Any:
        static, first, rest = split_arguments(args)
        if static != self._static:
            raise TypeError(
                "the arguments' structure or static leaves differ from those this "
                "step was lowered for; lower it again for these arguments"
            )
        arrays, static_out = self.compiled(first, rest)
        return static_out.unflatten(arrays)


def _traced(
    fn: Callable[..., Any],
    static: Hashable,
    first: list[Any],
    rest: list[Any],
    *,
    canonical: bool = False,
) -> tuple[list[Any], "_StaticOutput"]:
    def arrays_out(first: list[Any], rest: list[Any]) -> Any:
        out = fn(*_merge(static, first, rest))
        leaves, treedef = jax.tree_util.tree_flatten(out)
        arrays = [leaf for leaf in leaves if eqx.is_array(leaf)]
        static_out = _StaticOutput(
            treedef, tuple(None if eqx.is_array(leaf) else leaf for leaf in leaves)
        )
        return arrays, static_out

    if canonical:
        return canonical_convolutions(arrays_out)(first, rest)
    return arrays_out(first, rest)


def _merge(static: Any, first: list[Any], rest: list[Any]) -> tuple[Any, ...]:
    first_def, rest_def, first_static, rest_static = static
    return jax.tree_util.tree_unflatten(
        first_def, _fill(first_static, first)
    ) + jax.tree_util.tree_unflatten(rest_def, _fill(rest_static, rest))


def _fill(static_leaves: tuple[Any, ...], arrays: list[Any]) -> list[Any]:
    it = iter(arrays)
    return [
        next(it)
        if leaf is None
        else leaf.value
        if type(leaf) is _Number
        else leaf.filled(it)
        if type(leaf) is Lifted
        else leaf
        for leaf in static_leaves
    ]


@jax.tree_util.register_pytree_node_class
class _StaticOutput:
    """A function's output structure and static leaves, as a leafless pytree node."""

    def __init__(self, treedef: Any, static_leaves: tuple[Any, ...]):
        self.treedef, self.static_leaves = treedef, static_leaves

    def tree_flatten(self) -> tuple[tuple[()], tuple[Any, tuple[Any, ...]]]:
        return (), (self.treedef, self.static_leaves)

    @classmethod
    def tree_unflatten(cls, aux: Any, children: Any) -> "_StaticOutput":
        del children
        return cls(*aux)

    def unflatten(self, arrays: list[Any]) -> Any:
        return jax.tree_util.tree_unflatten(
            self.treedef, _fill(self.static_leaves, arrays)
        )


class CompiledFunctions:
    """The functions `make(*key)`, kept in the process's one table of programs
    (`cache.program`)."""

    def __init__(self, make: Callable[..., Any]):
        self._make = make

    def __call__(self, *key: Hashable) -> Any:
        return program(self._make, *key)

    def __len__(self) -> int:
        return programs_of(self._make)

    def call(self, *args: Any, unhashable: Callable[..., Any] | None = None) -> Any:
        """The function made for `args` (by structure and shapes), called on them."""
        static, first, rest = split_arguments(args)
        shapes = tuple(map(_spec, (*first, *rest)))
        if unhashable is not None:
            try:
                hash(static)
            except TypeError:
                return unhashable(*args)
        return self(static, shapes).call_split(static, first, rest)


def check_compiler_options(
    options: Any, name: str = "compiler_options"
) -> Options | None:
    """A user's XLA options checked (errors name `name`), as a sorted tuple."""
    if options is None:
        return None
    if not isinstance(options, dict):
        raise TypeError(
            f"`{name}` must be a dict of XLA options (e.g. "
            "`{'xla_cpu_experimental_ynn_fusion_type': ''}`) or None, got "
            f"{type(options).__name__}"
        )
    for key, value in options.items():
        if not isinstance(key, str):
            raise TypeError(f"`{name}` keys must be option names (str), got {key!r}")
        if not isinstance(value, str | bool | int | float):
            raise TypeError(
                f"`{name}[{key!r}]` must be a str, bool, int or float, "
                f"got {type(value).__name__}"
            )
    return tuple(sorted(options.items()))


@functools.cache
def _supported(options: Options) -> bool:
    # Option names change between jaxlib versions: one probe (a compile) for all.
    every = tuple(sorted((FAST_CODEGEN | EIGEN_DOTS | ONE_SHOT).items()))
    if options != every and set(options) <= set(every) and _supported(every):
        return True
    try:
        jax.jit(jnp.sin, compiler_options=dict(options)).lower(
            jax.ShapeDtypeStruct((2,), jnp.float32)  # no eager program for it
        ).compile()
    except Exception:  # noqa: BLE001 - any failure means "not available"
        return False
    return True


@functools.cache
def _cores() -> int:
    return os.cpu_count() or 1


def step_matmul_flops(members: PyTree[Any], examples: int, size: int) -> float:
    """Estimated matmul FLOPs of one step: 6 per example per weight per member."""
    weights = 0
    for leaf in jax.tree.leaves(members):
        if eqx.is_inexact_array(leaf) and leaf.ndim >= 3:
            weights += int(np.prod(leaf.shape[1:]))
    return 6.0 * examples * weights * size


def is_tiny_step(members: PyTree[Any], examples: int, size: int, devices: int) -> bool:
    return step_matmul_flops(members, examples, size) / devices < MIN_STEP_FLOPS


def step_compiler_options(
    user: Options | None,
    members: PyTree[Any],
    examples: int,
    size: int,
    placement: Devices,
    batched_dots: bool = False,
) -> Options:
    """The user's options, else on a CPU `FAST_CODEGEN` (+ `EIGEN_DOTS` if big)."""
    if user is not None:
        return user
    if placement.platform != "cpu":
        return ()
    fast = cpu_codegen_options()
    cores = _cores()
    if batched_dots or cores < 2:
        return fast
    if placement.local_devices >= cores:
        # Virtual CPU devices already use every core: Eigen's pool adds contention.
        return fast
    if is_tiny_step(members, examples, size, placement.devices):
        return fast
    options = tuple(sorted((dict(fast) | EIGEN_DOTS).items()))
    return options if _supported(options) else fast


def cpu_codegen_options() -> Options:
    """`FAST_CODEGEN` less what `XLA_FLAGS` set; none where jaxlib lacks it."""
    options = _not_flagged(FAST_CODEGEN)
    return options if _supported(options) else ()


def one_shot_options() -> Options:
    """`ONE_SHOT` (less what `XLA_FLAGS` set, as jaxlib knows it) on a CPU."""
    if jax.default_backend() != "cpu":
        return ()
    return _known(_not_flagged(ONE_SHOT))


def one_shot_jit(
    fn: Callable[..., Any] | None = None,
    *,
    static_argnames: tuple[str, ...] = (),
    static_argnums: tuple[int, ...] = (),
) -> Any:
    """`jax.jit(fn)` with `one_shot_options()`, inlined in a caller's trace."""
    if fn is None:
        return functools.partial(
            one_shot_jit, static_argnames=static_argnames, static_argnums=static_argnums
        )
    # (Only those given: `jax.jit` infers the other from the signature.)
    statics: dict[str, Any] = {}
    if static_argnames:
        statics["static_argnames"] = static_argnames
    if static_argnums:
        statics["static_argnums"] = static_argnums
    nested = jax.jit(fn, **statics)
    jitted: list[Any] = []

    def top_level() -> Any:
        if not jitted:
            jitted.append(
                jax.jit(
                    fn, **statics, compiler_options=dict(one_shot_options()) or None
                )
            )
        return jitted[0]

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        if any(is_traced(leaf) for leaf in jax.tree.leaves((args, kwargs))):
            return nested(*args, **kwargs)
        top_level()
        try:
            return jitted[0](*args, **kwargs)
        except ValueError as error:  # inside a trace that closes over the arguments
            if "compiler_options" not in str(error):
                raise
            return nested(*args, **kwargs)

    call.lower = lambda *args, **kwargs: top_level().lower(*args, **kwargs)  # type: ignore[attr-defined]
    return call


def compiled_call(fn: Callable[..., Any], *args: Any) -> Any:
    return compiled_function(fn)(*args)


def compiled_function(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` as ONE program per (canonical) function, structure and shapes, with
    `one_shot_options()`; op by op where it cannot be compiled or keyed."""
    try:
        key = canonical(fn)
        hash(key)
    except TypeError:  # a closure that cannot be hashed
        return fn

    def call(*args: Any) -> Any:
        if any(is_traced(x) for x in jax.tree.leaves(args)):
            return fn(*args)
        static, first, rest = split_arguments(args)
        try:
            structure = (key, static)
            if structure in _needs_values:
                return fn(*args)
        except TypeError:  # a non-array leaf that cannot be hashed
            return fn(*args)
        shapes = tuple(map(_spec, (*first, *rest)))
        try:
            program = _one_program(key, static, shapes)
            return program.call_split(static, first, rest)
        except jax.errors.JaxRuntimeError:
            # A failed run-time check (`eqx.error_if`): op by op raises it.
            return fn(*args)
        except Exception as error:  # noqa: BLE001 - the op-by-op run reports it
            # Tracing failed on reading values: op by op from now on.
            if isinstance(error, (*NEEDS_VALUES, TypeError, AttributeError)):
                keep(_needs_values, structure, None)
            return fn(*args)

    return call


# What tracing raises where code reads an array's value (`bool(x)`, `float(x)`...).
NEEDS_VALUES = (
    jax.errors.ConcretizationTypeError,
    jax.errors.TracerIntegerConversionError,
    jax.errors.TracerArrayConversionError,
    jax.errors.NonConcreteBooleanIndexError,
)
# The structures `compiled_function` found reading values.
_needs_values: dict[Any, None] = {}


def _make_one_program(fn: Callable[..., Any], *structure: Hashable) -> "Jit":
    del structure  # (what the program is keyed by besides `fn`)
    return filter_jit(fn, one_shot_options())


_one_program = CompiledFunctions(_make_one_program)


def _known(options: Options) -> Options:
    """Those of `options` this jaxlib compiles with."""
    if _supported(options):
        return options
    return tuple(option for option in options if _supported((option,)))


def _not_flagged(options: dict[str, Any]) -> Options:
    """`options`, sorted, less those the process's `XLA_FLAGS` set (that stands)."""
    flags = os.environ.get("XLA_FLAGS", "")
    return tuple(
        sorted(
            (name, value)
            for name, value in options.items()
            if not re.search(rf"--{name}(=|\s|$)", flags)
        )
    )


def with_eigen_dots(options: Options) -> bool:
    return any(name in EIGEN_DOTS for name, _ in options)


def default_steps_per_dispatch(
    members: PyTree[Any], examples: int, size: int, devices: int
) -> int:
    """`fit`'s default `steps_per_dispatch`: 1000 for tiny steps, else 100."""
    return 1000 if is_tiny_step(members, examples, size, devices) else 100
