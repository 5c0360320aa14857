"""The plan of a training step: every automatic choice of `fit` and `make_step`
(layout, unrolling, steps per dispatch, XLA options, the guard's form), made
once per loss, execution and input structure."""

import dataclasses
from collections.abc import Callable, Hashable
from typing import Any

import jax
from jaxtyping import PyTree

from .._internal.tree import trainable
from .cache import keep, owner_table
from .compile import (
    Options,
    default_steps_per_dispatch,
    step_compiler_options,
    with_eigen_dots,
)
from .guard import FiniteCheck, choose_finite_check, step_flops
from .layout import (
    GROUP_MIN_FLOPS,
    SEQUENTIAL_MAX_MEMBERS,
    Layout,
    choose_layout,
    run_length_class,
)
from .placement import Devices
from .profile import StepProfile

# Platforms whose dispatches loop over a traced trip count (a GPU's waits on it).
COUNTED = frozenset({"cpu"})
# A CPU's convolving (or unrolled) dispatch returns to the host after about this
# much estimated work, so progress, callbacks and a diverged run's end stay timely.
UNROLLED_DISPATCH_SECONDS = 1.0
CPU_FLOPS_PER_SECOND = 5e10  # a 2-core CPU's convolving steps (`bench_families`)
# glibc's `DEFAULT_MMAP_THRESHOLD_MAX` (64-bit): XLA's CPU runtime takes a call's
# temporaries as one block, which above this size is mapped and faulted afresh.
SCRATCH_BYTES = 32 * 2**20


@dataclasses.dataclass(frozen=True)
class Plan:
    """How a training step runs: the user's `Execution` (or a `Step`'s
    settings), with the library's choices where they are left open. For `fit`:
    whether a dispatch is unrolled, its steps, and whether it loops over a
    traced trip count; `member_chunk`: vectorised members computed at a time."""

    layout: Layout
    compiler_options: Options
    check: FiniteCheck = "per_leaf"
    unroll: bool = False
    length: int = 1
    counted: bool = False
    member_chunk: int | None = None


def plan_step(
    settings: Any,
    profile: Callable[[], StepProfile],
    *,
    owner: Any,
    structure: Hashable,
    members: PyTree[Any],
    examples: int,
    size: int,
    placement: Devices,
    steps: int | None = None,
    pads_on_host: bool = False,
    groupable: bool = False,
) -> Plan:
    """The plan of a step of `size` members on `examples` examples each, cached
    per `owner` (the loss, held weakly), `structure` (`None`: planned every
    time), settings, placement, backend and run length class. `settings`: an
    `Execution` or a `Step`; `profile()` is called only where a choice reads it;
    `steps`: `fit`'s run length (`None`: a step per call); `pads_on_host`: a
    stream's short group is padded on the host; `groupable`: the members share
    nothing, so they may run in chunks."""
    length_class = None if steps is None else run_length_class(steps)
    try:
        if structure is None:
            raise TypeError
        table = owner_table(owner[0] if isinstance(owner, tuple) and owner else owner)
        key = (
            owner if isinstance(owner, tuple) else None,  # a loss per group
            _settings_key(settings),
            structure,
            examples,
            placement,
            jax.default_backend(),
            length_class,
            pads_on_host,
            groupable,
        )
        found = table.get(key)
    except TypeError:  # not weakly referable, or an unhashable leaf
        table, key, found = None, None, None
    if found is None:
        found = _plan(
            settings,
            profile,
            members,
            examples,
            size,
            placement,
            steps,
            pads_on_host,
            groupable,
        )
        if table is not None:
            keep(table, key, found)
    if steps is None or found.counted or (found.unroll and not pads_on_host):
        return found  # one program for any length
    return dataclasses.replace(found, length=min(found.length, steps))


def _settings_key(settings: Any) -> Hashable:
    names = (
        "layout",
        "member_chunk",
        "compiler_options",
        "unroll",
        "steps_per_dispatch",
    )
    return tuple(getattr(settings, name, None) for name in names)


def _plan(
    settings: Any,
    profile_of: Callable[[], StepProfile],
    members: PyTree[Any],
    examples: int,
    size: int,
    placement: Devices,
    steps: int | None,
    pads_on_host: bool,
    groupable: bool = False,
) -> Plan:
    platform = jax.default_backend()
    member_chunk = settings.member_chunk
    automatic = settings.layout not in ("vmap", "sequential")
    profile, batched_dots = _profile(
        settings, profile_of, members, examples, size, placement, steps
    )
    layout = choose_layout(
        "auto" if automatic else settings.layout,
        convolutions=profile.convolutions,
        size=size,
        sharded=placement.sharded,
        steps=steps,
        convolution_flops=profile.convolution_flops,
        platform=platform,
    )
    if member_chunk is not None:  # chunks of vectorised members
        layout = "vmap"
    # The library's own member chunks may apply (one CPU device, members apart).
    own_chunks = (
        member_chunk is None
        and layout == "vmap"
        and groupable
        and not placement.sharded
        and platform == "cpu"
    )
    if own_chunks and automatic and steps is not None:
        if profile.convolution_flops >= GROUP_MIN_FLOPS:
            # One member at a time: plain convolutions, compile time flat in size.
            member_chunk = 1
    unroll = getattr(settings, "unroll", None)
    if unroll is None:
        # Grouped convolutions are slow in a CPU loop (`convolution.py`).
        unroll = (
            profile.convolutions
            and platform == "cpu"
            and layout == "vmap"
            and member_chunk is None
        )
    flops = step_flops(members, examples, size, placement.devices, profile)
    length = _length(
        settings, members, examples, size, placement, steps, unroll, pads_on_host,
        profile.convolutions and platform == "cpu", flops,
    )  # fmt: skip
    options = step_compiler_options(
        settings.compiler_options, members, examples, size, placement, batched_dots
    )
    check = choose_finite_check(flops=flops, platform=placement.platform)
    # A traced trip count: one program for `length` steps, whatever the run.
    counted = steps is not None and placement.platform in COUNTED and not unroll
    counted = counted and not pads_on_host
    if own_chunks and steps is None and not profile.convolutions:
        # A step per call takes its temporaries at every call: kept under
        # `SCRATCH_BYTES`. Not for convolutions: slow inside the chunks' loop.
        member_chunk = scratch_chunk(size, member_temporaries(profile, members, size))
    return Plan(layout, options, check, unroll, length, counted, member_chunk)


def _profile(
    settings: Any, profile_of: Callable[[], StepProfile], members: PyTree[Any],
    examples: int, size: int, placement: Devices, steps: int | None,
) -> tuple[StepProfile, bool]:  # fmt: skip
    """The step's profile where a choice reads it, and whether it has batched
    matmuls (which Eigen's dots, an option, run slower)."""
    platform = jax.default_backend()
    automatic_layout = (
        settings.layout not in ("vmap", "sequential")
        and settings.member_chunk is None
        and size <= SEQUENTIAL_MAX_MEMBERS
    )
    reads_profile = not placement.sharded and (
        platform == "cpu"
        or (platform == "gpu" and automatic_layout and steps is not None)
    )
    profile = profile_of() if reads_profile else StepProfile()
    batched_dots = profile.batched_dots
    if (
        settings.compiler_options is None
        and not reads_profile
        and with_eigen_dots(
            step_compiler_options(None, members, examples, size, placement)
        )
    ):
        batched_dots = profile_of().batched_dots
    return profile, batched_dots


def _length(
    settings: Any, members: PyTree[Any], examples: int, size: int,
    placement: Devices, steps: int | None, unroll: bool, pads_on_host: bool,
    cpu_convolutions: bool, flops: float,
) -> int:  # fmt: skip
    """Steps per dispatch: the user's, else `default_steps_per_dispatch` for
    `fit` (one for a step per call or an unrolled stream), cut to about
    `UNROLLED_DISPATCH_SECONDS` of work where steps unroll or convolve on a CPU."""
    length = getattr(settings, "steps_per_dispatch", None)
    if length is not None:
        return length
    length = (
        default_steps_per_dispatch(members, examples, size, placement.devices)
        if steps is not None and not (unroll and pads_on_host)
        else 1
    )
    if unroll or cpu_convolutions:
        budget = UNROLLED_DISPATCH_SECONDS * CPU_FLOPS_PER_SECOND
        length = max(1, min(length, int(budget / max(flops, 1.0))))
    return length


def scratch_chunk(size: int, member_bytes: float) -> int | None:
    """The most members, a divisor of `size` and at least two, whose
    temporaries (`member_bytes` each) fit in `SCRATCH_BYTES` where all `size`
    members' do not (`None`: no chunks, or none fits)."""
    if size * member_bytes <= SCRATCH_BYTES:
        return None
    # At least two members per chunk: one at a time lost more than it saved.
    fitting = [
        k for k in range(2, size) if size % k == 0 and k * member_bytes <= SCRATCH_BYTES
    ]
    return max(fitting, default=None)


def member_temporaries(profile: StepProfile, members: PyTree[Any], size: int) -> float:
    """One member's temporaries, overestimated before compiling: its loss's
    values as written (kept for the backward pass) and three times its
    parameters (gradient, update, new moments)."""
    parameters = sum(
        leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(trainable(members))
    )
    return profile.intermediate_bytes + 3.0 * parameters / size
