"""XLA compiler options for the compiled training steps (`fit`, `make_step`).

On a CPU, XLA sends a dot whose operands have the canonical layout to YNNPACK,
which runs a *batched* dot (one matmul per member) on one core; other dots go to
Eigen, which splits them over the intra-op thread pool. An ensemble's step is made
of batched dots, so for any step big enough to amortise the thread pool (about
16 MFLOP of matmuls; measured in docs/benchmarks.md) the library compiles it with
YNNPACK's fusions turned off: every dot then runs on all cores. Tiny steps (the
dispatch-bound regime) keep XLA's defaults, where YNNPACK's single-threaded calls
are faster. Every CPU step is also compiled at LLVM optimisation level 1
(`FAST_CODEGEN`): as fast to run, sooner to compile; unless the process's
`XLA_FLAGS` set the level (that choice stands, as for every other program).
Other platforms always keep XLA's defaults.
"""

import collections
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
from .convolution import canonical_convolutions
from .intern import canonical
from .lift import Lifted, lifted
from .placement import Devices

# Turning off YNNPACK's dot/elementwise fusions on the CPU (XLA >= 0.8).
EIGEN_DOTS: dict[str, Any] = {"xla_cpu_experimental_ynn_fusion_type": ""}
# LLVM's optimisation level for the code XLA's CPU backend generates: 1 instead
# of XLA's default 2. Matmuls and convolutions are library calls either way, and
# XLA's own emitters vectorise its loops, so the steps run as fast or faster
# and compile sooner (measured on the families in round 3, session 17; the
# changelog's "Benchmarks history").
FAST_CODEGEN: dict[str, Any] = {"xla_backend_optimization_level": 1}
# Programs that run once (building an ensemble, a run's start state) are
# compiled for compile time, not run time: LLVM at level 1 and XLA's older CPU
# elemental emitters. Building 8 MLPs 64-64-64-10 compiles in 0.5 s, against
# 1.8 s with XLA's defaults in one program and 2.0 s as the 16 programs of
# running it op by op, with the same bits as op by op (tests/test_xla.py);
# `benchmarks/bench_recompile.py`'s build rows.
ONE_SHOT: dict[str, Any] = {
    "xla_backend_optimization_level": 1,
    "xla_cpu_use_fusion_emitters": False,
}
# Below this many matmul FLOPs per step, the thread pool costs more than it gains
# (2-core measurements: 0.6x at 1 MFLOP, 0.86x at 4, 1.0-1.1x at 20, 1.25x at 2000).
MIN_STEP_FLOPS = 16e6

Options = tuple[tuple[str, Any], ...]


def filter_jit(
    fn: Callable[..., Any], options: Options, *, donate: str | None = None
) -> "Jit":
    """`fn` compiled as `eqx.filter_jit(fn)` compiles it (array leaves traced,
    every other leaf static), with XLA `options`, and owned by the caller: a
    `Jit` holds its own `jax.jit` function, so dropping it drops its programs
    (Equinox keeps its jitted functions in a cache of its own).
    `donate="all-except-first"` donates the arrays of every argument but the
    first."""
    return Jit(fn, options, donate)


class Jit:
    """See `filter_jit`. Per call: one flatten of the arguments, the `jax.jit`
    call on their arrays (the static leaves and structure are its static
    argument), one unflatten of the outputs."""

    def __init__(
        self, fn: Callable[..., Any], options: Options, donate: str | None = None
    ):
        if donate not in (None, "all-except-first"):
            raise ValueError(f"unknown donation {donate!r}")
        # `jax.jit` of a function that does not refer back to this object: no
        # reference cycle, so the programs go as soon as the last reference
        # to this object does (not at the next full garbage collection).
        # On a CPU the library's own programs carry their convolutions in the
        # form XLA runs fast inside loops (`convolution.py`).
        on_cpu = jax.default_backend() == "cpu"
        self._jitted = jax.jit(
            functools.partial(_traced, fn, canonical=on_cpu),
            static_argnums=0,
            donate_argnums=(2,) if donate else (),
            compiler_options=dict(options) or None,
        )
        # Called inside a trace of the user's own (`jax.jit`, `eqx.filter_jit`,
        # `jax.make_jaxpr`...), the function is inlined into that program,
        # which JAX refuses for a `jax.jit` carrying compiler options: there it
        # is called without them (the outer program's options apply), as
        # written.
        self._nested = (
            jax.jit(functools.partial(_traced, fn), static_argnums=0)
            if options
            else self._jitted
        )

    def __call__(self, *args: Any) -> Any:
        return self.call_split(*split_arguments(args))

    def call_split(self, static: Hashable, first: list[Any], rest: list[Any]) -> Any:
        """The call on arguments already split by `split_arguments` (a caller
        that keys something on `static` splits once)."""
        arrays, static_out = self.call_arrays(static, first, rest)
        return static_out.unflatten(arrays)

    def call_arrays(
        self, static: Hashable, first: list[Any], rest: list[Any]
    ) -> tuple[list[Any], "_StaticOutput"]:
        """`call_split` without the outputs' unflatten: their arrays in
        flattening order, and what `unflatten`s them (a caller that calls again
        on some of the outputs passes those arrays on as they are)."""
        # Python's cyclic garbage collector paused for the call: tracing and
        # lowering a new program make hundreds of thousands of short-lived
        # objects, and a full collection of the process's (JAX's, Equinox's,
        # Optax's) landing in a first call's trace was 80-120 ms of it (15% of
        # a first call that finds its program in the disk cache). Restored
        # after, whatever happens; left alone where the caller paused it.
        paused = gc.isenabled()
        if paused:
            gc.disable()
        try:
            arrays, static_out = self._jitted(static, first, rest)
        except ValueError as error:
            # Raised while tracing, before anything ran: only retried where
            # the options are the cause (called inside another trace, whether
            # or not the arguments are its tracers).
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
    """Whether `error` is JAX refusing compiler options inside another trace
    (its arguments that trace's tracers, or constants it closes over)."""
    return "compiler_options" in str(error) or _any_tracer(*leaf_lists)


def split_arguments(args: tuple[Any, ...]) -> tuple[Hashable, list, list]:
    """A `Jit`'s arguments as (their structure and non-array leaves: hashable,
    what a program is compiled for; the first argument's arrays; the other
    arguments' arrays)."""
    first, first_def = jax.tree_util.tree_flatten(args[:1])
    rest, rest_def = jax.tree_util.tree_flatten(args[1:])
    first_arrays, first_static = _split_leaves(first)
    rest_arrays, rest_static = _split_leaves(rest)
    return (first_def, rest_def, first_static, rest_static), first_arrays, rest_arrays


def _split_leaves(leaves: list[Any]) -> tuple[list[Any], tuple[Any, ...]]:
    # One pass (this is on every dispatch's path): the arrays, and the leaves
    # with `None` in each array's place; functions interned, so that a program
    # is keyed by what they compute (`intern.canonical`).
    # Each leaf's kind is looked up by its type (`_kind_of`): an `isinstance`
    # against `jax.Array` was about a microsecond per leaf, on two flattenings
    # per `fit` call.
    arrays: list[Any] = []
    static: list[Any] = []
    for leaf in leaves:
        kind = _KINDS.get(type(leaf)) or _kind_of(leaf)
        if kind is _ARRAY:
            arrays.append(leaf)
            static.append(None)
        elif kind is _NUMBER:
            # `2`, `2.0` and `True` are equal and hash alike: as keys, a
            # program traced for one would run for the other (its dtype).
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
# Leaf kinds by type, for the types whose kind is their type's: not tracers
# (whether one is an array is JAX's check of the instance).
_KINDS: dict[type, str] = {}


def _kind_of(leaf: Any) -> str:
    kind = (
        _ARRAY if eqx.is_array(leaf) else _NUMBER if type(leaf) in _NUMBERS else _OTHER
    )
    # Not a tracer, nor an object whose `__class__` is not its type (a proxy:
    # `isinstance` reads `__class__`); bounded (types made in a loop).
    if type(leaf) is leaf.__class__ and not is_traced(leaf) and len(_KINDS) < 1024:
        _KINDS[type(leaf)] = kind
    return kind


def _spec(leaf: Any) -> Hashable:
    # An array's shape and dtype; a lifted hyperparameter (`lift.py`) is a
    # Python float, traced as a weakly typed scalar.
    return float if type(leaf) is float else (leaf.shape, leaf.dtype)


class _Number:
    """A Python number as a static leaf: equal only to a number of the same
    type and value (`-0.0` and `0.0` apart, NaN equal to NaN)."""

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
    """A compiled `Jit`: called with arguments of the shapes it was lowered for;
    `.compiled` is JAX's compiled object (`.as_text()`, cost analysis)."""

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
        # The outputs' structure and static leaves travel as a leafless node:
        # JAX keeps them with each trace (as Equinox's `filter_jit` does).
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
    """A compiled function's output structure and static leaves, as a pytree
    node with no leaves (its contents are the node's auxiliary data)."""

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


# Every program XLA compiles for a CPU keeps its machine code in memory maps of
# its own (about 280 for a small `fit` loop, measured on Linux), and a jitted
# function keeps every program it compiled for as long as it lives. A loop that
# calls `fit` or `make_step` with a new optimizer each time would keep one more
# program per call and, after a few hundred, pass Linux's limit on maps per
# process (`vm.max_map_count`, 65530 by default): the next compilation then
# crashes the interpreter. So the library's compiled functions are made per key
# (what the program depends on: the loss, the optimizer, the shapes...) and at
# most `MAX_PROGRAMS` of them are kept, the least recently used dropped: a
# dropped function, once nothing else holds it, takes its programs with it. The
# count is the library's own (no compiled function's private cache is read).
MAX_PROGRAMS = 32


class CompiledFunctions:
    """At most `MAX_PROGRAMS` compiled functions made by `make(*key)`, the least
    recently used dropped first: a `functools.cache` that does not keep every
    program. A key should name everything its function compiles for, so that
    each function holds about one program."""

    def __init__(self, make: Callable[..., Any]):
        self._make = make
        self._made: collections.OrderedDict[Hashable, Any] = collections.OrderedDict()

    def __call__(self, *key: Hashable) -> Any:
        jitted = self._made.get(key)
        if jitted is None:
            jitted = self._made[key] = self._make(*key)
            while len(self._made) > MAX_PROGRAMS:
                self._made.popitem(last=False)
        else:
            self._made.move_to_end(key)
        return jitted

    def __len__(self) -> int:
        return len(self._made)

    def call(self, *args: Any, unhashable: Callable[..., Any] | None = None) -> Any:
        """The function made for `args` (keyed by their structure, non-array
        leaves and array shapes), called on them: a `filter_jit` whose programs
        are bounded. Where a non-array leaf cannot be hashed, `unhashable(*args)`
        (`None`: the TypeError)."""
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
    """Validate a user's XLA options (`None`: let the library choose), naming
    the argument `name` in the errors; returns them as a sorted tuple."""
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
    # The option names are XLA's and may change between jaxlib versions: use them
    # only where this jaxlib compiles with them. One probe for all of the
    # library's options answers for each subset of them (a probe is a compile,
    # 20-30 ms of a first call).
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
    """Estimated matmul FLOPs of one training step of the whole ensemble: forward,
    input and weight gradients (3 x 2 FLOPs) per example for every weight of every
    member (leaves with at least two axes besides the member axis: dense weights
    and kernels; biases and norms are not matmuls)."""
    weights = 0
    for leaf in jax.tree.leaves(members):
        if eqx.is_inexact_array(leaf) and leaf.ndim >= 3:
            weights += int(np.prod(leaf.shape[1:]))
    return 6.0 * examples * weights * size


def is_tiny_step(members: PyTree[Any], examples: int, size: int, devices: int) -> bool:
    """Whether a step has under `MIN_STEP_FLOPS` of matmuls per device."""
    return step_matmul_flops(members, examples, size) / devices < MIN_STEP_FLOPS


def step_compiler_options(
    user: Options | None,
    members: PyTree[Any],
    examples: int,
    size: int,
    placement: Devices,
    batched_dots: bool = False,
) -> Options:
    """The options a training step is compiled with: the user's if given; on a
    CPU, `FAST_CODEGEN`, with `EIGEN_DOTS` for a big enough step on a
    multi-core CPU whose matmuls have no batch dimension of their own
    (`batched_dots`: attention heads, which Eigen runs slower than XLA's default
    path); elsewhere XLA's defaults. An option this jaxlib does not know is
    left out."""
    if user is not None:
        return user
    if placement.platform != "cpu":
        return ()
    fast = cpu_codegen_options()
    cores = _cores()
    if batched_dots or cores < 2:
        return fast
    if placement.local_devices >= cores:
        # Virtual CPU devices already put one core on each device's share of the
        # members; Eigen's thread pool on top of that only adds contention.
        return fast
    if is_tiny_step(members, examples, size, placement.devices):
        return fast
    options = tuple(sorted((dict(fast) | EIGEN_DOTS).items()))
    return options if _supported(options) else fast


def cpu_codegen_options() -> Options:
    """`FAST_CODEGEN` as options (but for what `XLA_FLAGS` set), or none where
    this jaxlib lacks it."""
    options = _not_flagged(FAST_CODEGEN)
    return options if _supported(options) else ()


def one_shot_options() -> Options:
    """`ONE_SHOT` as options on a CPU (but for what `XLA_FLAGS` set), none
    where this jaxlib lacks them; XLA's defaults elsewhere."""
    if jax.default_backend() != "cpu":
        return ()
    return _known(_not_flagged(ONE_SHOT))


def one_shot_jit(
    fn: Callable[..., Any] | None = None,
    *,
    static_argnames: tuple[str, ...] = (),
    static_argnums: tuple[int, ...] = (),
) -> Any:
    """`jax.jit(fn)` compiled with `one_shot_options()`, for functions called
    once per shape on small inputs (metrics, their input checks): their
    programs compile in about half the time (a probability check of 8 x 400
    x 10: 0.19 -> 0.08 s) and run as fast on large ones (16 x 100,000 x 10).
    Inside a trace of the caller's own, the function is inlined into
    that program (JAX refuses options there). Usable as `@one_shot_jit` or
    `@one_shot_jit(static_argnames=...)`."""
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

    # Ahead-of-time lowering of the top-level program (as `jax.jit(...).lower`).
    call.lower = lambda *args, **kwargs: top_level().lower(*args, **kwargs)  # type: ignore[attr-defined]
    return call


def compiled_call(fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)` as ONE program (`compiled_function(fn)(*args)`)."""
    return compiled_function(fn)(*args)


def compiled_function(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` compiled as ONE program per argument structure, with
    `one_shot_options()`, and kept per function (keyed by what `fn` computes,
    `canonical`; the key found once, here): run op by op, library code that
    runs once per shape (a build, a posterior's draw, an optimizer's init,
    conformal scores) compiles a program per operation and shape. Array
    leaves are traced, other leaves are static. `fn` runs as it is inside the
    caller's own trace, for a closure or a non-array argument that cannot be
    keyed (hashed), and for an `fn` that reads an array's value (Python
    control flow on it, `float`, NumPy): its trace raised, and is not tried
    again for that function and argument structure. Any error of the
    compiled call is reported by running `fn` op by op (a run-time check as
    its own exception, a bad argument as its own error). Programs are kept
    per function, argument structure and shapes, at most `MAX_PROGRAMS`.
    Not for a user's function that may have side effects: it runs once per
    program, on tracers."""
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
            # A program per function, structure and shapes, in the bounded
            # cache (`MAX_PROGRAMS`): each holds one program.
            program = _one_program(key, static, shapes)
            return program.call_split(static, first, rest)
        except jax.errors.JaxRuntimeError:
            # A run-time check that failed in the program (`eqx.error_if`):
            # run again op by op, which raises it as the function's own error.
            return fn(*args)
        except Exception as error:  # noqa: BLE001 - the op-by-op run reports it
            # Tracing failed: the function reads values (`NEEDS_VALUES`) or
            # uses an array as only a concrete one can be (`f"{x:.3f}"`,
            # `x.block_until_ready()`): op by op from now on for this
            # function and structure. Any other error (bad arguments) is
            # raised by the op-by-op run as it is.
            if isinstance(error, (*NEEDS_VALUES, TypeError, AttributeError)):
                _needs_values[structure] = None
                while len(_needs_values) > MAX_PROGRAMS:
                    del _needs_values[next(iter(_needs_values))]
            return fn(*args)

    return call


# What tracing raises where code reads an array's value (`bool(x)`, `int(x)`,
# `float(x)`, `np.asarray(x)`, a boolean mask), which running op by op allows.
NEEDS_VALUES = (
    jax.errors.ConcretizationTypeError,
    jax.errors.TracerIntegerConversionError,
    jax.errors.TracerArrayConversionError,
    jax.errors.NonConcreteBooleanIndexError,
)
# The functions and argument structures `compiled_function` found reading
# values (the oldest forgotten).
_needs_values: dict[Any, None] = {}


def _make_one_program(fn: Callable[..., Any], *structure: Hashable) -> "Jit":
    del structure  # (what the program is keyed by besides `fn`)
    return filter_jit(fn, one_shot_options())


# One compiled function per function, argument structure and shapes
# (bounded: `CompiledFunctions`).
_one_program = CompiledFunctions(_make_one_program)


def _known(options: Options) -> Options:
    """Those of `options` this jaxlib compiles with (jaxlib 0.11 has no
    `xla_cpu_use_fusion_emitters`: the others still apply)."""
    if _supported(options):
        return options
    return tuple(option for option in options if _supported((option,)))


def _not_flagged(options: dict[str, Any]) -> Options:
    """`options`, sorted, without those the process's `XLA_FLAGS` set: a
    choice made there for every program stands, as it does for operations
    run one by one (whose bits a one-shot program then keeps)."""
    flags = os.environ.get("XLA_FLAGS", "")
    return tuple(
        sorted(
            (name, value)
            for name, value in options.items()
            if not re.search(rf"--{name}(=|\s|$)", flags)
        )
    )


def with_eigen_dots(options: Options) -> bool:
    """Whether `options` turn YNNPACK's fusions off (`EIGEN_DOTS`)."""
    return any(name in EIGEN_DOTS for name, _ in options)


def default_steps_per_dispatch(
    members: PyTree[Any], examples: int, size: int, devices: int
) -> int:
    """`fit`'s default `steps_per_dispatch`: 1000 for tiny steps, else 100.

    Each dispatch costs about a millisecond outside the steps themselves (the
    call, the chunk's epoch permutations, reading the losses back); for steps of a
    few tens of microseconds that is a fifth of the time at 100 steps per
    dispatch. 1000 tiny steps still take well under a second, so the progress bar
    and callbacks stay responsive."""
    return 1000 if is_tiny_step(members, examples, size, devices) else 100
