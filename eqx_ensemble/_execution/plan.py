"""The plan of a training step: every automatic choice that `fit` and
`make_step` make about how a step runs (member layout, unrolling, steps per
dispatch, XLA options, the divergence guard's form), in one place and once per
loss, execution and input structure."""

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

# The platforms whose dispatches loop over a traced trip count. Not a GPU: its
# loop waits for each trip's predicate on the host (8 MLPs 1-32-32-1 on an
# H100: 52 us per step against 32.5 in a scan of fixed length;
# `bench_guard.py --fit`, docs/benchmarks.md).
COUNTED = frozenset({"cpu"})
# A dispatch of a CPU's convolving steps (or an unrolled one) returns to the
# host after about this many seconds of estimated work (progress, callbacks,
# a diverged run's end, the replay of an optimistic dispatch), at the rate
# below: a 5-CNN step on 8x8 images 40 steps, on 16x16 6.
UNROLLED_DISPATCH_SECONDS = 1.0
CPU_FLOPS_PER_SECOND = 5e10  # a 2-core CPU's convolving steps (`bench_families`)
# glibc's largest threshold for taking a block from the system (`mmap`) rather
# than from the heap it keeps (`DEFAULT_MMAP_THRESHOLD_MAX`, 64-bit). XLA's CPU
# runtime takes a program's temporaries as one block per call: above this
# size every call maps it afresh and faults its pages in again (64 MLPs
# 32-128-128-10, batch 256: 32.3 MiB of temporaries, `make_step` 33-39 ms
# per step, 24-29 ms in chunks; docs/benchmarks.md, compute-bound).
SCRATCH_BYTES = 32 * 2**20


@dataclasses.dataclass(frozen=True)
class Plan:
    """How a training step runs, resolved from the user's `Execution` (or a
    `make_step`'s settings) with the library's choices where they are left
    open: the member layout, the XLA options, the form of the divergence
    guard's finiteness check (`_execution.guard`), and for `fit` whether a
    dispatch is unrolled, how many steps it holds and whether it loops over a
    traced trip count (`loop.Chunk.counted`); `member_chunk`: the vectorised
    members computed at a time (`Execution.member_chunk`, or the plan's: one
    at a time for a short convolving run, `scratch_chunk`'s for a large
    `make_step`)."""

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
    """The plan of a step of `size` members (`members`: their stacked leaves)
    on `examples` examples per member. `settings`: an `Execution` or a `Step`
    (`layout`, `member_chunk`, `compiler_options`; `fit`'s `unroll` and
    `steps_per_dispatch`). `profile()` is called only where a choice reads it
    (one CPU device; one GPU where `fit`'s layout is automatic; options with
    Eigen's dots, which batched matmuls refuse). Looked up per `owner` (the
    loss, held weakly), `structure` (the inputs' shapes; `None`: planned every
    time), settings, placement, backend and run length class. `steps`: `fit`'s run
    length (`None`: a step per call); `pads_on_host`: a stream's short group
    is padded on the host (no traced trip count); `groupable`: the members
    share nothing (no shared part, no coupled loss, one group of members), so
    that they may run in chunks (`Plan.member_chunk`)."""
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
    # One device's CPU, no chunks given, the members vectorised and sharing
    # nothing: the library's chunks below may apply.
    own_chunks = (
        member_chunk is None
        and layout == "vmap"
        and groupable
        and not placement.sharded
        and platform == "cpu"
    )
    if own_chunks and automatic and steps is not None:
        if profile.convolution_flops >= GROUP_MIN_FLOPS:
            # A run too short for the sequential layout's compile time, or
            # with too many members for it: one member at a time in a loop
            # (plain convolutions, not the vectorised members' grouped one),
            # whose compile time does not grow with the members
            # (`layout.GROUP_MIN_FLOPS`).
            member_chunk = 1
    unroll = getattr(settings, "unroll", None)
    if unroll is None:
        # The library's programs lower a CPU's convolutions in the form XLA
        # runs fast inside a loop too (`convolution.py`), but not the
        # vectorised members' grouped ones: those stay straight-line code,
        # a call per step, where XLA moves them itself.
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
    # On a CPU a scanned dispatch of array data loops over a traced trip
    # count: one program for `length` steps, whatever the run's length.
    counted = steps is not None and placement.platform in COUNTED and not unroll
    counted = counted and not pads_on_host
    if own_chunks and steps is None and not profile.convolutions:
        # A step per call (`make_step`): its temporaries are taken at every
        # call, so kept under the allocator's ceiling (`SCRATCH_BYTES`). A
        # compiled loop (`fit`) takes them once per dispatch. Not a step that
        # convolves: XLA's CPU convolutions inside the chunks' loop ran 14x
        # slower (24 CNNs on 8x8 images: 2.5 s per step in chunks of 3 to 12
        # against 0.18 s vectorised whole).
        member_chunk = scratch_chunk(size, member_temporaries(profile, members, size))
    return Plan(layout, options, check, unroll, length, counted, member_chunk)


def _profile(
    settings: Any, profile_of: Callable[[], StepProfile], members: PyTree[Any],
    examples: int, size: int, placement: Devices, steps: int | None,
) -> tuple[StepProfile, bool]:  # fmt: skip
    """The step's profile where a choice reads it (one CPU device; one GPU
    where `fit`'s layout is automatic), and whether it has batched matmuls
    (read for the options alone where they would take Eigen's dots, which
    run batched matmuls slower: on a mesh every other choice is the rules'
    without a profile)."""
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
    a run of `fit` (one for a step per call, and for an unrolled stream's),
    cut to about `UNROLLED_DISPATCH_SECONDS` of work where the steps are
    unrolled or convolve on a CPU. An unrolled dispatch of array data is a
    loop on the host of calls of one compiled step, given `length` rows of
    drawn indices (one program for any run length: a resumed run is bit for
    bit the whole); a stream's would be given its group padded to `length`
    batches: one step per dispatch, as the stream is read."""
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
    temporaries fit in `SCRATCH_BYTES` where all `size` members' do not
    (`None`: no chunks, or none that fits). A member's temporaries are
    estimated before compiling (`member_bytes`) as its loss's values as
    written (`StepProfile`'s `intermediate_bytes`: the forward pass, whose
    values the backward pass keeps) and three times its parameters (the
    gradient, the optimizer's update and new moments): an overestimate,
    which XLA's fusions bring to 0.19-0.75 of it (`tests/test_member_chunk.py`
    compares it with XLA's memory analysis)."""
    if size * member_bytes <= SCRATCH_BYTES:
        return None
    # At least two members per chunk: one at a time lost more than the
    # allocator cost (5 transformers: 29.0 ms per step one by one, 22.8 all at
    # once with 29.5 MiB of temporaries; 10 of them: 54.6 ms at once with 58.3
    # MiB, 40.1 in chunks of 5, 33.0 in chunks of 2; session 17).
    fitting = [
        k for k in range(2, size) if size % k == 0 and k * member_bytes <= SCRATCH_BYTES
    ]
    return max(fitting, default=None)


def member_temporaries(profile: StepProfile, members: PyTree[Any], size: int) -> float:
    """`scratch_chunk`'s estimate of one member's temporaries in a compiled
    step: its loss's values as written and three times its parameters."""
    parameters = sum(
        leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(trainable(members))
    )
    return profile.intermediate_bytes + 3.0 * parameters / size
