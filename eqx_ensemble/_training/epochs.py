"""`ee.epochs`: an epoch-based data loader as a stream `fit` resumes from."""

import base64
import inspect
import json
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import jax
import numpy as np
from jaxtyping import PyTree

from .._internal.checks import check_int, check_positive_int
from .stream import host_array

# How a loader's own iterator state is kept in a checkpoint's (JSON) manifest.
_STATE_JSON = "json"
_STATE_BYTES = "base64"


class Epochs:
    """An epoch-based loader as a resumable, endless stream of batches: what
    [`ee.epochs`][eqx_ensemble.epochs] returns. Called with a step, it gives an
    iterator of the batches from that step on.

    **Example:**

    ```python
    data = ee.epochs(lambda epoch: [epoch * 10 + i for i in range(3)])
    stream = data(4)                     # from step 4: epoch 1, batch 1
    assert [next(stream) for _ in range(3)] == [11, 12, 20]
    ```
    """

    def __init__(
        self,
        loader_for_epoch: Callable[..., Iterable[Any]],
        batches_per_epoch: int | None,
        members: int | None,
    ):
        if not callable(loader_for_epoch):
            raise TypeError(
                "`ee.epochs(loader_for_epoch)`: `loader_for_epoch` must be a "
                "function `epoch -> loader` (the loader of one epoch), got "
                f"{type(loader_for_epoch).__name__}"
            )
        self.loader_for_epoch = loader_for_epoch
        self.batches_per_epoch = (
            None
            if batches_per_epoch is None
            else check_positive_int(batches_per_epoch, "batches_per_epoch")
        )
        self.members = (
            None if members is None else check_positive_int(members, "members")
        )
        try:
            parameters = inspect.signature(loader_for_epoch).parameters
        except (TypeError, ValueError):  # a builtin without a signature
            parameters = {}
        self.takes_start = "start" in parameters
        if self.members is not None and "member" not in parameters:
            raise TypeError(
                f"`ee.epochs(..., members={self.members})` calls "
                "`loader_for_epoch(epoch, member=m)` for each member; give the "
                "function a `member` argument, e.g. `lambda epoch, member: ...`"
            )

    def __repr__(self) -> str:
        name = getattr(self.loader_for_epoch, "__name__", type(self).__name__)
        return (
            f"ee.epochs({name}, batches_per_epoch={self.batches_per_epoch}, "
            f"members={self.members})"
        )

    def __call__(self, step: int) -> "EpochIterator":
        """The batches from `step` on."""
        step = check_int(step, "step", low=0)
        return EpochIterator(self, step, None)

    def restore(self, step: int, state: dict[str, Any]) -> "EpochIterator":
        """The batches from `step` on, positioned from an `EpochIterator` state."""
        step = check_int(step, "step", low=0)
        return EpochIterator(self, step, state)

    def open(self, epoch: int, start: int) -> tuple[list[Any], list[Any]]:
        """One epoch's loaders (one per member) and iterators, from `start`."""
        loaders = []
        for member in range(self.members or 1):
            kwargs: dict[str, int] = {}
            if self.members is not None:
                kwargs["member"] = member
            if self.takes_start:
                kwargs["start"] = start
            loader = self.loader_for_epoch(epoch, **kwargs)
            if not isinstance(loader, Iterable):
                raise TypeError(
                    f"`loader_for_epoch({epoch})` returned {type(loader).__name__}; "
                    "it must return the epoch's iterable of batches (a data loader, "
                    "a generator, a list of batches)"
                )
            loaders.append(loader)
        return loaders, [iter(loader) for loader in loaders]


def epochs(
    loader_for_epoch: Callable[..., Iterable[PyTree[Any]]],
    *,
    batches_per_epoch: int | None = None,
    members: int | None = None,
) -> Epochs:
    """An epoch-based data loader as the resumable stream that
    [`fit`][eqx_ensemble.fit] takes as `data`.

    `loader_for_epoch(epoch)` returns one epoch's batches. The stream is endless
    and step-indexed (step `s` is batch `s % n` of epoch `s // n`), so a resumed
    run equals the uninterrupted one bit for bit. It resumes from the loader
    iterator's saved state (`get_state()`/`set_state()`, as grain's), else by
    `loader_for_epoch(epoch, start=k)` where it takes `start`, else by reading
    and dropping the epoch's first `k` batches.

    A loader must give the same batches for the same epoch each call (seed its
    shuffling with `epoch`): a resumed run whose first batch differs from the
    checkpoint's record is refused. Batches may hold NumPy, JAX or PyTorch arrays.

    **Arguments:**

    - `loader_for_epoch`: `epoch -> iterable of batches`; optionally with a
      `start` argument (above) and, with `members`, a `member` argument.
    - `batches_per_epoch`: the batches of every epoch (`None`: the loader's
      `len`, else counted by reading); checked as each epoch is read.
    - `members`: for per-member data (`sampling=ee.Independent()`): the number
      of members; `loader_for_epoch(epoch, member=m)` gives member `m`'s batches.

    **Example:**

    ```python
    import numpy as np

    x = np.linspace(0, 1, 64, dtype=np.float32)[:, None]

    def loader_for_epoch(epoch):                 # a shuffled epoch of 4 batches
        order = np.random.default_rng(epoch).permutation(64)
        return (x[order[i : i + 16]] for i in range(0, 64, 16))

    data = ee.epochs(loader_for_epoch, batches_per_epoch=4)
    ens = ee.ensemble(lambda k: eqx.nn.Linear(1, 1, key=k), size=2,
                      key=jax.random.key(0))
    loss = lambda m, b, k: jnp.mean((jax.vmap(m)(b) - 2 * b) ** 2)
    result = ee.fit(ens, loss, optax.sgd(0.1), data, steps=10,
                    key=jax.random.key(1), callbacks=())   # 2.5 epochs
    ```
    """
    return Epochs(loader_for_epoch, batches_per_epoch, members)


class EpochIterator(Iterator[PyTree[Any]]):
    """The batches of an `Epochs` stream from one step on."""

    def __init__(self, source: Epochs, step: int, state: dict[str, Any] | None):
        self.source = source
        self.length = source.batches_per_epoch
        self.loaders: list[Any] = []
        self.iterators: list[Any] = []
        if state is not None:
            epoch, position = _saved_position(state, step, self.length)
        elif self.length is None:
            epoch, position = self._count_to(step)
        else:
            epoch, position = divmod(step, self.length)
        if not self.iterators or self.epoch != epoch:
            self._open(epoch, position, state)

    def _open(self, epoch: int, position: int, state: dict[str, Any] | None) -> None:
        """Open `epoch` and place it at batch `position`."""
        start = position if self.source.takes_start else 0
        self.loaders, self.iterators = self.source.open(epoch, start)
        self.epoch = epoch
        self.position = start
        self._check_length()
        saved = None if state is None else state.get("loaders")
        if position > start and saved is not None and self._restore(saved):
            self.position = position
        while self.position < position:
            self._next_of_epoch(skipping=True)

    def _check_length(self) -> None:
        lengths = set()
        for loader in self.loaders:
            try:
                lengths.add(len(loader))
            except TypeError:  # no `len`: counted as the epoch is read
                return
        if len(lengths) > 1:
            raise ValueError(
                f"The members' loaders of epoch {self.epoch} have different lengths "
                f"{sorted(lengths)}; every member's epoch needs the same number of "
                "batches"
            )
        length = lengths.pop() + self.position  # a loader given `start` counts
        if length == 0:  # from there
            raise ValueError(_empty_message(self.epoch))
        if self.length is None:
            self.length = length
        elif length != self.length:
            given = self.source.batches_per_epoch
            raise ValueError(
                f"`batches_per_epoch={given}` but the loader of epoch {self.epoch} "
                f"has {length} batches (its `len`); leave `batches_per_epoch` out "
                "to use the loader's length"
                if given is not None
                else f"The loader of epoch {self.epoch} has {length} batches (its "
                f"`len`) but an earlier epoch had {self.length}: every epoch must "
                "have the same number of batches (drop a short last batch)"
            )

    def _count_to(self, step: int) -> tuple[int, int]:
        """Count the first epoch's batches by reading it, then go to `step`."""
        self._open(0, 0, None)
        while self.length is None:
            if self.position == step:
                return 0, step
            if self._next_of_epoch(skipping=True, end_ok=True) is _END:
                self.length = self.position
        epoch, position = divmod(step, self.length)
        if epoch != self.epoch or position < self.position:
            self._open(epoch, position, None)
        while self.position < position:
            self._next_of_epoch(skipping=True)
        return self.epoch, self.position

    def get_state(self) -> dict[str, Any]:
        """The epoch, the batch within it, and the loaders' own states (JSON)."""
        state: dict[str, Any] = {"epoch": self.epoch, "position": self.position}
        if self.length is not None and self.position == self.length:
            return {"epoch": self.epoch + 1, "position": 0}
        saved = [_loader_state(iterator) for iterator in self.iterators]
        if self.position > 0 and all(s is not None for s in saved):
            state["loaders"] = saved
        return state

    def _restore(self, saved: list[Any]) -> bool:
        if len(saved) != len(self.iterators):
            return False
        setters = [getattr(it, "set_state", None) for it in self.iterators]
        if not all(callable(setter) for setter in setters):
            return False
        for setter, value in zip(setters, saved, strict=True):
            setter(_decode_state(value))  # pyright: ignore[reportOptionalCall]
        return True

    def __next__(self) -> PyTree[Any]:
        return self._next_batch(skipping=False)

    def _next_batch(self, skipping: bool) -> PyTree[Any]:
        if self.length is not None and self.position == self.length:
            self._end_of_epoch()
            self._open(self.epoch + 1, 0, None)
        batch = self._next_of_epoch(skipping, end_ok=self.length is None)
        if batch is _END:  # an epoch of unknown length ended
            self.length = self.position
            self._open(self.epoch + 1, 0, None)
            batch = self._next_of_epoch(skipping)
        return batch

    def _next_of_epoch(self, skipping: bool, end_ok: bool = False) -> Any:
        batches = [next(iterator, _END) for iterator in self.iterators]
        ended = [batch is _END for batch in batches]
        if any(ended):
            if self.position == 0:
                raise ValueError(_empty_message(self.epoch))
            if end_ok and all(ended):
                return _END
            which = (
                f"member {ended.index(True)}'s loader"
                if self.source.members is not None and not all(ended)
                else "the loader"
            )
            expected = (
                "the other members' loaders go on"
                if end_ok
                else f"`batches_per_epoch` is {self.length}"
                if self.source.batches_per_epoch is not None
                else f"earlier epochs had {self.length}"
            )
            raise ValueError(
                f"In epoch {self.epoch}, {which} ended after {self.position} "
                f"batches, but {expected}: every epoch (of every member) must have "
                "the same number of batches (drop a short last batch, e.g. "
                "`drop_last=True`)"
            )
        self.position += 1
        if skipping:
            return None
        batches = [jax.tree.map(host_array, batch) for batch in batches]
        if self.source.members is None:
            return batches[0]
        return jax.tree.map(lambda *leaves: np.stack(leaves), *batches)

    def _end_of_epoch(self) -> None:
        """Raise if an epoch of known length has one more batch."""
        if self.loaders and all(_has_len(loader) for loader in self.loaders):
            return  # its `len` was checked when it was opened
        for iterator in self.iterators:
            extra = next(iterator, _END)
            if extra is not _END:
                given = self.source.batches_per_epoch
                raise ValueError(
                    f"The loader of epoch {self.epoch} has more than "
                    f"`batches_per_epoch={given}` batches; give the number of "
                    "batches of a whole epoch (or leave it out)"
                    if given is not None
                    else f"The loader of epoch {self.epoch} has more batches than "
                    f"earlier epochs ({self.length}): every epoch must have the "
                    "same number of batches"
                )


_END = object()


def _has_len(loader: Any) -> bool:
    try:
        len(loader)
    except TypeError:
        return False
    return True


def _empty_message(epoch: int) -> str:
    return (
        f"The loader of epoch {epoch} yielded no batch; `loader_for_epoch` must "
        "give at least one batch per epoch (is the dataset smaller than a batch, "
        "with `drop_last=True`?)"
    )


def _saved_position(
    state: dict[str, Any], step: int, length: int | None
) -> tuple[int, int]:
    epoch, position = state.get("epoch"), state.get("position")
    if not isinstance(epoch, int) or not isinstance(position, int):
        raise ValueError(f"Not a saved stream position: {state!r}")
    if length is not None and epoch * length + position != step:
        raise ValueError(
            f"The checkpoint's stream position (epoch {epoch}, batch {position}) is "
            f"not step {step} with `batches_per_epoch={length}`: the run was saved "
            "with another number of batches per epoch"
        )
    return epoch, position


def _loader_state(iterator: Any) -> Any:
    """A loader iterator's own state as JSON (`None` if it has none usable)."""
    get = getattr(iterator, "get_state", None)
    if not callable(get) or not callable(getattr(iterator, "set_state", None)):
        return None
    value = get()
    if isinstance(value, bytes):
        return {_STATE_BYTES: base64.b64encode(value).decode()}
    try:  # a copy: a loader may hand out its live state
        return {_STATE_JSON: json.loads(json.dumps(value))}
    except (TypeError, ValueError):
        return None


def _decode_state(saved: Any) -> Any:
    if isinstance(saved, dict) and _STATE_BYTES in saved:
        return base64.b64decode(saved[_STATE_BYTES])
    if isinstance(saved, dict) and _STATE_JSON in saved:
        return saved[_STATE_JSON]
    raise ValueError(f"Not a saved loader state: {saved!r}")
