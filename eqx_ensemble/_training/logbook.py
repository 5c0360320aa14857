"""What a run tells its loggers (`RunView.run_info`, `RunView.log_entry`):
built on the host from the run's state after each dispatch, once each."""

from typing import Any

import numpy as np

from .loggers import LogEntry, RunInfo
from .optim import member_hparams


class LogBook:
    """The run's description and each dispatch's record, with what the loggers
    were given so far (a resumed run's earlier events and evaluations)."""

    def __init__(self, run: Any):
        self._info: RunInfo | None = None
        self._entry: tuple[int, LogEntry] | None = None
        self._hparams: bool | None = None  # whether the members have any
        size, stateful = len(run.diverged_at), run.stateful
        if run.resumed_from is None:
            self._logged = (np.full(size, -1, np.int32), 0, [0] * len(stateful))
        else:
            controlled = run.train_state.controlled
            self._logged = (
                run.diverged_at.copy(),
                len(run.recorder.eval_steps),
                [len(c.events(s)) for c, s in zip(stateful, controlled, strict=True)],
            )

    def info(self, run: Any) -> RunInfo:
        if self._info is None:
            start_hparams = member_hparams(run.train_state)
            self._hparams = bool(start_hparams)  # none at the start: none later
            self._info = RunInfo(
                steps=run.steps,
                size=run.chunk.size,
                start=run.done,
                resumed=run.resumed_from is not None,
                hparams={
                    "members": run.chunk.size,
                    "steps": run.steps,
                    "batch_size": run.source.batch_size,
                    "sampling": type(run.sampling).__name__,
                    "data": run.source.kind,
                    "resumed_from": run.resumed_from or 0,
                },  # fmt: skip
                member_hparams=start_hparams,
            )
        return self._info

    def entry(self, run: Any) -> LogEntry:
        """The last dispatch's record (once per dispatch)."""
        if self._entry is not None and self._entry[0] == run.done:
            return self._entry[1]
        state, diverged_at = run.train_state, run.diverged_at
        if self._hparams is None:
            self._hparams = bool(member_hparams(state))
        losses, end = run.losses, run.done
        events: list[dict[str, Any]] = []
        diverged, evaluations, counts = self._logged
        for member in np.flatnonzero((diverged < 0) & (diverged_at >= 0)):
            step = int(diverged_at[member]) + 1  # counted like `steps`
            events.append({"step": step, "event": "diverged", "member": int(member)})
        for position, item in enumerate(run.stateful):
            made = item.events(state.controlled[position])
            events += made[counts[position] :]
            counts[position] = len(made)
        for tracker in run.track:
            events += tracker.events(end - len(losses), end)
        events.sort(key=lambda event: event["step"])  # stable: by step, then kind
        recorder = run.recorder
        recorded = recorder.eval_steps[evaluations:]
        scores = recorder.eval_scores[evaluations:]
        self._logged = (diverged_at.copy(), len(recorder.eval_steps), counts)
        entry = LogEntry(
            steps=np.arange(end - len(losses) + 1, end + 1),
            losses=np.asarray(losses, np.float32),
            eval_steps=np.asarray(recorded, np.int64),
            eval_scores=np.asarray(scores, np.float32).reshape(
                len(recorded), len(diverged_at)
            ),
            diverged_at=run.diverged_steps(),
            member_hparams=member_hparams(state) if self._hparams else {},
            events=tuple(events),
        )
        self._entry = (end, entry)
        return entry
