"""The form of the divergence guard's finiteness check (how, never what).

A guarded step checks that each member's loss, gradients, new weights and new
optimizer state are finite (DESIGN section 3; the state's scalars only for
NaN, as an optimizer's scalar may be infinite by design:
`_training.step.all_finite`). In a dispatch of array data `fit` checks once
at the dispatch's end instead (`loop._settle_members`). The answer is the
same in either form below; what differs is what XLA makes of it:

- `"per_leaf"`: `all(isfinite(leaf))` for every leaf, one small reduction each.
  Fastest to run on a dispatch-bound CPU step (tiny leaves), the slowest to
  compile (a kernel per leaf).
- `"by_shape"`: the leaves of one shape and dtype (a weight, its gradient and
  the optimizer's moments of it) summed elementwise as `leaf * 0` (0 where
  finite, NaN where not), one reduction per shape. Sooner to compile, as fast
  or faster on a compute-bound step (fewer passes over memory), and on a GPU,
  where each reduction is a kernel launch, faster at every size.

So: per leaf where a CPU step is tiny (`step_flops` under `MIN_STEP_FLOPS`:
its time is kernels, not arithmetic), by shape elsewhere. The measurements are
in docs/benchmarks.md ("The divergence guard").
"""

from typing import Any, Literal

from .compile import MIN_STEP_FLOPS, step_matmul_flops
from .profile import StepProfile

# `"deferred"`: no check and no select in the step (`fit`'s optimistic
# dispatch, `_training.loop._settle_members`): the dispatch checks its
# end state once, and `_training.guard.Deferred` finds the step a member failed at.
FiniteCheck = Literal["per_leaf", "by_shape", "deferred"]


def step_flops(
    members: Any, examples: int, size: int, devices: int, profile: StepProfile
) -> float:
    """A training step's matmul and convolution FLOPs per device, as the rule
    below reads it: the larger of two estimates, every weight once per example
    (`step_matmul_flops`) and three times the members' forward matmuls and
    convolutions read from a member's jaxpr (`profile.dot_flops`,
    `profile.convolution_flops`: they count every token of a sequence and
    every position of an image, which the first does not; 0 where no profile
    was read)."""
    by_weights = step_matmul_flops(members, examples, size)
    forward = profile.dot_flops + profile.convolution_flops
    return max(by_weights, 3.0 * forward * size) / max(devices, 1)


def choose_finite_check(*, flops: float, platform: str) -> FiniteCheck:
    """The check's form for a step of `flops` (see `step_flops`) on
    `platform`: on a CPU, `"per_leaf"` for a tiny step (under
    `MIN_STEP_FLOPS`) and `"by_shape"` for any other; on a GPU `"by_shape"` at
    every size (a GPU pays per kernel, and this form launches fewer
    reductions: the faster form on both workloads measured on an H100);
    elsewhere (a TPU: not measured) `"per_leaf"`."""
    if platform == "gpu" or (platform == "cpu" and flops >= MIN_STEP_FLOPS):
        return "by_shape"
    return "per_leaf"
