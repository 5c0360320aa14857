"""The input checks `fit` and `make_step` share, in one order, before any work."""

from collections.abc import Sequence
from typing import Any

import jax

from .._core.ensemble import Ensemble
from .._core.heterogeneous import (
    check_group_losses,
    check_group_run,
    check_group_states,
    is_ensemble,
)
from .._internal.keys import check_key
from .checkpointer import Checkpointer
from .coupled import Coupled
from .evaluate import Evaluate
from .loss import LossFn, check_hyper, check_loss_signature
from .optim import check_opt_state
from .tracker import Tracker


def check_inputs(
    ens: Any,
    loss_fn: LossFn,
    optimizer: Any,
    key: Any,
    *,
    state: Any,
    hyper: Any,
    opt_state: Any,
    runner: Any,
    where: str,
) -> int:
    """The checks of a training call (`where`: "fit" or "make_step"; `runner`:
    its `Execution` or `Step`); returns the number of members."""
    if not is_ensemble(ens):
        raise TypeError(
            f"`{where}` expects an `ee.Ensemble` (or an `ee.Heterogeneous`), got "
            f"{type(ens).__name__}"
        )
    check_key(key)
    size = len(ens)
    losses = loss_fn if isinstance(loss_fn, tuple) else (loss_fn,)
    check_group_run(
        ens, coupled=any(isinstance(fn, Coupled) for fn in losses),
        mesh=getattr(runner, "mesh", None) is not None,
        member_chunk=getattr(runner, "member_chunk", None) is not None, where=where,
    )  # fmt: skip
    check_group_states(ens, state, "`state`")
    if isinstance(loss_fn, Coupled) and state is not None:
        raise TypeError(
            "an `ee.Coupled` loss does not take a model state (`state=`): it is "
            "called as `fn(ensemble, batch, keys)`; drop `state=`, or write the "
            "objective per member"
        )
    check_losses(loss_fn, ens, state is not None, hyper is not None)
    if hyper is not None:
        check_hyper(hyper, size)
    if opt_state is not None or where == "make_step":
        check_opt_state(optimizer, ens, opt_state)
    return size


def check_chunkable(loss_fn: Any, ens: Any) -> None:
    """`Execution.member_chunk` applies to members trained on their own: refuse
    a coupled loss and a trained shared part by name."""
    if isinstance(loss_fn, Coupled):
        raise ValueError(
            "`Execution(member_chunk=...)` does not yet apply to an `ee.Coupled` "
            "loss (it needs every member at once); leave `member_chunk` out"
        )
    if getattr(ens, "train_shared", False):
        raise ValueError(
            "`Execution(member_chunk=...)` does not yet apply to a trained shared "
            "part (its gradient sums over every member); leave `member_chunk` out "
            "or freeze the shared part"
        )


def independent_members(loss_fn: Any, ens: Any) -> bool:
    """Whether the members can run in chunks: one ensemble without a shared
    part, and a loss that does not couple them."""
    return (
        isinstance(ens, Ensemble)
        and not jax.tree.leaves(ens.shared)
        and not isinstance(loss_fn, Coupled)
    )


def check_losses(loss_fn: LossFn, ens: Any, stateful: bool, with_hyper: bool) -> None:
    """`check_loss_signature` for the loss, or for each group's of a tuple of
    losses (one per group of an `ee.Heterogeneous`, which only it takes)."""
    if not isinstance(loss_fn, tuple):
        check_loss_signature(loss_fn, stateful, with_hyper)
        return
    check_group_losses(ens, loss_fn)
    for index, fn in enumerate(loss_fn):
        try:
            check_loss_signature(fn, stateful, with_hyper)
        except TypeError as error:
            raise TypeError(f"`loss_fn[{index}]` (group {index}): {error}") from None


def check_components(
    evaluate: Any, checkpoints: Any, track: Any
) -> tuple[Tracker, ...]:
    """`fit`'s `evaluate`, `checkpoints` and `track` are what they must be."""
    if evaluate is not None and not isinstance(evaluate, Evaluate):
        raise TypeError(
            f"`evaluate` must be an `ee.Evaluate(fn, data, every=...)`, got "
            f"{type(evaluate).__name__}"
        )
    if checkpoints is not None and not isinstance(checkpoints, Checkpointer):
        raise TypeError(
            "`checkpoints` must be an `ee.Checkpoints(directory, every=...)`, got "
            f"{type(checkpoints).__name__}"
        )
    if not isinstance(track, Sequence) or isinstance(track, str):
        raise TypeError(f"`track` must be a list, got {type(track).__name__}")
    for position, item in enumerate(track):
        if not isinstance(item, Tracker):
            raise TypeError(
                f"`track[{position}]` must be an `ee.Tracker`, got "
                f"{type(item).__name__}"
            )
    return tuple(track)


def check_callbacks(callbacks: Any) -> None:
    """Refuse a checkpointer in `callbacks` (it goes in `checkpoints=`) and a
    checkpointed callback given twice (its state has one place in the run)."""
    if not isinstance(callbacks, Sequence) or isinstance(callbacks, str):
        return  # refused, by name, in `as_callbacks`
    seen: set[int] = set()
    for position, item in enumerate(callbacks):
        if isinstance(item, Checkpointer):
            raise TypeError(
                f"`callbacks[{position}]` is a `{type(item).__name__}`: pass it as "
                "`fit(..., checkpoints=...)`, which also resumes the run from it"
            )
        if isinstance(item, Tracker):
            # (A tracker is callable: as a plain function it would fail late.)
            raise TypeError(
                f"`callbacks[{position}]` is a `{type(item).__name__}`, a tracker "
                "updated inside the compiled loop: pass it as "
                f"`fit(..., track=[{type(item).__name__}(...)])`"
            )
        if getattr(item, "checkpointed", False):
            if id(item) in seen:
                raise ValueError(
                    f"`callbacks[{position}]`, a `{type(item).__name__}`, is given "
                    "twice: its state has one place in the run; pass two "
                    "instances for two"
                )
            seen.add(id(item))
