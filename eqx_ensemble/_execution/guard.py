"""The form of the divergence guard's finiteness check (how, never what).

Every step checks that each member's loss, gradients, new weights and new
optimizer state are finite (DESIGN section 3). The answer is the same in either
form below; what differs is what XLA makes of it on a CPU:

- `"per_leaf"`: `all(isfinite(leaf))` for every leaf, one small reduction each.
  Fastest to run on a dispatch-bound step (tiny leaves), and the slowest to
  compile: a kernel per leaf, about twice a bare step's compile time.
- `"by_shape"`: the leaves of one shape and dtype (a weight, its gradient and
  the optimizer's moments of it) summed elementwise as `leaf * 0` (0 where
  finite, NaN where not), one reduction per shape. Compiles in up to a third
  less time, runs as fast or faster on a compute-bound step (fewer passes over
  memory), and 15-35% slower on a dispatch-bound one (XLA recomputes the
  optimizer's elementwise update inside the reductions' loops).

Measured on 2 cores, both forms in one process (docs/benchmarks.md, session
18), `fit` on 8 MLPs 1-32-32-1, batch 16 (a tiny step): 56 us per step per
leaf, 70 us by shape, compile 0.9 vs 0.7-0.9 s; 64 MLPs 32-128-128-10, batch
256 (compute-bound): 24.5 vs 24.2 ms per step, a scan of it compiled in 3.8 vs
3.4 s; the first call of `fit` (20 steps) on the transformer family 3.1-3.3 vs
2.4-2.5 s, the CNN 1.7 vs 1.6 s. So: per leaf where the step is tiny
(`step_flops` under `MIN_STEP_FLOPS`: its time is kernels, not arithmetic, and
that form runs fastest there), by shape elsewhere (as fast or faster to run,
sooner to compile).

On a GPU (one H100, session 21, `benchmarks/bench_guard.py`; a bare scanned
step = 1.00x): compute-bound 1.27x per leaf, 1.18x by shape; dispatch-bound
(a 17 us step) 1.61x per leaf, 1.27x by shape. Each reduction is a kernel
launch there, so the form with fewer reductions wins at every size: by shape.
"""

from typing import Any, Literal

from .compile import MIN_STEP_FLOPS, step_matmul_flops
from .profile import StepProfile

# `"deferred"`: no check and no select in the step (`fit`'s optimistic
# dispatch on a CPU, `_training.loop._settle_members`): the dispatch checks its
# end state once, and `Run._settle` finds the step a member failed at.
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
    every size (on an H100 it was the faster form on both workloads measured:
    1.18x vs 1.27x a bare scanned step on the compute-bound one, 1.27x vs
    1.61x on the dispatch-bound one; a GPU pays per kernel, and this form
    launches fewer reductions); elsewhere (a TPU: not measured) `"per_leaf"`,
    as before."""
    if platform == "gpu" or (platform == "cpu" and flops >= MIN_STEP_FLOPS):
        return "by_shape"
    return "per_leaf"
