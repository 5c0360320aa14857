"""The form of the divergence guard's finiteness check (`step.all_finite`), the
same answer either way: `"per_leaf"` (fastest on a tiny CPU step) or
`"by_shape"` (sooner to compile, faster on larger steps and GPUs)."""

from typing import Any, Literal

from .compile import MIN_STEP_FLOPS, step_matmul_flops
from .profile import StepProfile

# `"deferred"`: no check in the step (`fit`'s optimistic dispatch).
FiniteCheck = Literal["per_leaf", "by_shape", "deferred"]


def step_flops(
    members: Any, examples: int, size: int, devices: int, profile: StepProfile
) -> float:
    """A step's FLOPs per device: the larger of `step_matmul_flops` and three
    times the profiled forward FLOPs."""
    by_weights = step_matmul_flops(members, examples, size)
    forward = profile.dot_flops + profile.convolution_flops
    return max(by_weights, 3.0 * forward * size) / max(devices, 1)


def choose_finite_check(*, flops: float, platform: str) -> FiniteCheck:
    """`"by_shape"` on a GPU and for a CPU step of at least `MIN_STEP_FLOPS`;
    else `"per_leaf"` (a TPU: not measured)."""
    if platform == "gpu" or (platform == "cpu" and flops >= MIN_STEP_FLOPS):
        return "by_shape"
    return "per_leaf"
