"""`ee.Callback`, the one protocol of `fit`'s host components: the hooks come
in phase order whatever the order given, a user's callback stops, changes and
checkpoints a run as the library's controllers do, its errors carry the run,
and a run with callbacks computes the same bits as one without."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import eqx_ensemble as ee

SIZE = 3
X = jnp.linspace(-1, 1, 32)[:, None]
DATA = (X, 2 * X)
OPT = optax.sgd(0.1)


def loss(model, batch, key):
    x, y = batch
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


@pytest.fixture(scope="module")
def ens():
    return ee.ensemble(
        lambda k: eqx.nn.Linear(1, 1, key=k), size=SIZE, key=jax.random.key(0)
    )


def run(ens, steps=20, **extra):
    settings = dict(steps=steps, batch_size=8, key=jax.random.key(1), callbacks=())
    return ee.fit(ens, loss, OPT, DATA, **{**settings, **extra})


class Calls(ee.Callback):
    """Writes `(name, hook, done)` into a shared list."""

    name: str
    calls: list
    stops: tuple[int, ...] = ()

    def next_stop(self, done):
        later = [stop for stop in self.stops if stop > done]
        return min(later) if later else None

    def on_check(self, setup):
        self.calls.append((self.name, "check", setup.steps))

    def on_start(self, run):
        self.calls.append((self.name, "start", run.done))
        return self.name

    def on_dispatch(self, handle, run):
        assert handle == self.name
        self.calls.append((self.name, "dispatch", run.done))

    def on_end(self, handle, error):
        self.calls.append((self.name, "end", type(error).__name__))


class Observer(Calls):
    phase = ee.Callback.OBSERVE


class Recorder(Calls):
    phase = ee.Callback.RECORD


def test_hooks_come_in_phase_order_and_stops_end_dispatches(ens):
    calls = []
    callbacks = [
        Calls("react", calls, stops=(7,)),
        Recorder("record", calls),
        Observer("observe", calls, stops=(4, 15)),
    ]
    result = run(ens, callbacks=callbacks)
    plain = run(ens)
    # The callbacks change nothing the members compute.
    assert np.array_equal(result.history.losses, plain.history.losses)
    ends = [done for name, hook, done in calls if hook == "dispatch"]
    # Dispatches end at every callback's stops (the run is one dispatch
    # without them); all three see each one, and end, in phase order.
    assert ends[::3] == [4, 7, 15, 20]
    order = ["observe", "record", "react"]
    assert [name for name, hook, _ in calls if hook == "check"] == order
    assert [name for name, hook, _ in calls if hook == "start"] == order
    assert [name for name, hook, _ in calls if hook == "dispatch"] == order * 4
    assert calls[-3:] == [
        ("observe", "end", "NoneType"),
        ("record", "end", "NoneType"),
        ("react", "end", "NoneType"),
    ]


def test_a_refusal_in_on_check_comes_before_any_work(ens):
    class Refuse(ee.Callback):
        def on_check(self, setup):
            assert setup.size == SIZE and setup.evaluate_every is None
            # In the order they run: the observer first, though given second.
            assert [type(c).__name__ for c in setup.callbacks] == ["Observer", "Refuse"]
            raise ValueError("not this run")

    calls = []
    with pytest.raises(ValueError, match="not this run"):
        run(ens, callbacks=[Refuse(), Observer("observe", calls)])
    assert [hook for _, hook, _ in calls] == ["check"]  # never started


def test_an_error_in_a_hook_carries_the_run_and_ends_every_callback(ens):
    class Fails(ee.Callback):
        def on_dispatch(self, handle, run):
            if run.done >= 10:
                raise RuntimeError("enough")

    calls = []
    with pytest.raises(RuntimeError, match="enough") as error:
        run(ens, callbacks=[Fails(), Observer("observe", calls, stops=(5, 10, 15))])
    result = error.value.result
    plain = run(ens)
    assert result.history.losses.shape == (10, SIZE)
    assert np.array_equal(result.history.losses, plain.history.losses[:10])
    assert calls[-1] == ("observe", "end", "RuntimeError")


def test_an_error_carrying_another_runs_result_gets_this_ones(ens):
    # E.g. an `ee.fit` inside a callback failed: the error that ends this run
    # carries this run, not the inner one.
    class Inner(ee.Callback):
        def on_dispatch(self, handle, run):
            error = RuntimeError("inner run failed")
            error.result = "the inner run"  # type: ignore[attr-defined]
            raise error

    with pytest.raises(RuntimeError, match="inner run failed") as error:
        run(ens, callbacks=[Inner()])
    assert isinstance(error.value.result, ee.FitResult)  # type: ignore[attr-defined]
    assert error.value.result.history.losses.shape == (20, SIZE)  # type: ignore[attr-defined]


class StopBelow(ee.Callback):
    """Stops every member once all losses are below `threshold`."""

    threshold: float
    phase = ee.Callback.CHANGE

    def on_dispatch(self, handle, run):
        if run.losses[-1].max() < self.threshold:
            state = run.train_state
            stopped = jnp.full_like(state.stopped_at, run.done)
            run.update(self, eqx.tree_at(lambda s: s.stopped_at, state, stopped), None)


def test_a_users_callback_stops_the_run(ens):
    every = ee.Execution(steps_per_dispatch=5)
    full = run(ens, steps=60, execution=every)
    threshold = float(full.history.losses[24].max()) * 1.0001
    stopped = run(ens, steps=60, execution=every, callbacks=[StopBelow(threshold)])
    # The first dispatch end whose last losses are all below the threshold.
    last = full.history.losses[4::5].max(axis=1)
    first = 5 * (int(np.flatnonzero(last < threshold)[0]) + 1)
    assert stopped.history.losses.shape == (first, SIZE)
    assert np.array_equal(stopped.history.losses, full.history.losses[:first])
    assert (np.asarray(stopped.train_state.stopped_at) == first).all()


class CountDispatches(ee.Callback):
    """A checkpointed callback: counts dispatches in its own state, and logs
    an event at each."""

    phase = ee.Callback.CHANGE
    checkpointed = True

    def init(self, train_state):
        return jnp.zeros((), jnp.int32)

    def events(self, state):
        return [{"step": 0, "event": "counted"}] * int(state)

    def on_dispatch(self, handle, run):
        run.update(self, run.train_state, run.state_of(self) + 1)


def test_a_checkpointed_callbacks_state_is_saved_and_resumed(ens, tmp_path):
    every = ee.Execution(steps_per_dispatch=5)
    counter = CountDispatches()
    # 10 steps, then resumed to 20: 2 dispatches before, 2 after.
    for steps, counted in ((10, 2), (20, 4)):
        result = run(
            ens,
            steps=steps,
            execution=every,
            callbacks=[counter],
            checkpoints=ee.Checkpoints(tmp_path, every=5),
        )
        assert int(result.train_state.controlled[0]) == counted
    latest = ee.Checkpoints(tmp_path).latest(ens, OPT, callbacks=[counter])
    assert latest is not None and int(latest.train_state.controlled[0]) == 4
    # A callback without state has none to read.
    with pytest.raises(ValueError, match="keeps no state in the run"):
        run(ens, callbacks=[ReadsState()])


class ReadsState(ee.Callback):
    def on_dispatch(self, handle, run):
        run.state_of(self)


def test_loggers_see_a_checkpointed_callbacks_events_and_sync_first(ens, tmp_path):
    class Events(ee.Logger):
        def open(self, run):
            return []

        def write(self, handle, entry):
            handle.extend(event["event"] for event in entry.events)

        def flush(self, handle):
            handle.append("flush")

        def close(self, handle):
            log.append(list(handle))

    log = []
    run(
        ens,
        steps=10,
        execution=ee.Execution(steps_per_dispatch=5),
        callbacks=[Events(), CountDispatches()],
        checkpoints=ee.Checkpoints(tmp_path, every=5),
    )
    # Each dispatch: the counter's new event (controllers run before loggers),
    # then the flush before its checkpoint.
    assert log == [["counted", "flush", "counted", "flush"]]


def test_bad_callbacks_are_named(ens):
    with pytest.raises(TypeError, match=r"`callbacks\[1\]` must be an `ee.Callback`"):
        run(ens, callbacks=[print, 3])
    # (The suite's runtime type checker may answer first, naming the parameter.)
    with pytest.raises(TypeError, match="`callbacks` must be a list|parameter 'call"):
        run(ens, callbacks=print)


def test_misuse_is_refused_before_any_work(ens, tmp_path):
    calls = []
    observer = Observer("observe", calls)
    # The checkpointer goes in `checkpoints=` (which also resumes from it).
    with pytest.raises(TypeError, match=r"`callbacks\[1\]` is a `Checkpoints`"):
        run(ens, callbacks=[observer, ee.Checkpoints(tmp_path)])
    # One checkpointed callback has one place in the run's state.
    counter = CountDispatches()
    with pytest.raises(ValueError, match=r"`callbacks\[1\]`.*is given twice"):
        run(ens, callbacks=[counter, counter])
    # A tracker goes in `track=` (it is callable: as a plain function it was
    # called after each dispatch, far from here).
    with pytest.raises(TypeError, match=r"`callbacks\[0\]` is a `EMA`.*track="):
        run(ens, callbacks=[ee.EMA(0.9), observer])
    assert calls == [] and not list(tmp_path.iterdir())  # nothing ran or written
    run(ens, callbacks=[counter, CountDispatches()])  # two instances: two states


def test_a_stop_that_is_not_ahead_is_named(ens):
    class Stuck(ee.Callback):
        def next_stop(self, done):
            return done

    with pytest.raises(ValueError, match=r"`Stuck.next_stop\(0\)` gave 0"):
        run(ens, callbacks=[Stuck()])


def test_the_log_entry_holds_the_dispatchs_events_for_any_reader(ens):
    class Reads(ee.Callback):
        seen: list

        def on_dispatch(self, handle, run):
            self.seen.append([event["event"] for event in run.log_entry().events])

    # A REACT callback with no logger in the run sees the first dispatch's
    # events too (the record starts at the run's start, not at the first read).
    seen = []
    run(
        ens,
        execution=ee.Execution(steps_per_dispatch=5),
        steps=10,
        callbacks=[Reads(seen), CountDispatches()],
    )
    assert seen == [["counted"], ["counted"]]

    # Before the controllers ran, the record is not complete: refused.
    class EarlyReads(Reads):
        phase = ee.Callback.OBSERVE

    with pytest.raises(RuntimeError, match="from a callback of phase `RECORD`"):
        run(ens, callbacks=[EarlyReads([])])


def test_equal_functions_are_called_each_as_itself(ens):
    # Two distinct callables that compare equal: each is called, not the
    # first one twice (plain functions' wrappers are cached by identity).
    import dataclasses

    @dataclasses.dataclass(frozen=True)
    class Collect:
        name: str
        seen: list = dataclasses.field(compare=False, default_factory=list)

        def __call__(self, result):
            self.seen.append(len(result.history.losses))

    first, second = Collect("losses"), Collect("losses")
    assert first == second
    run(ens, callbacks=[first])
    run(ens, callbacks=[second])
    assert first.seen == [20] and second.seen == [20]


class LateInfo(ee.Callback):
    """Reads the run's description for the first time after a dispatch."""

    seen: list
    every: int = 2

    def next_stop(self, done):
        return done + self.every

    def on_dispatch(self, handle, run):
        if not self.seen:
            info = run.run_info()
            self.seen.append((info.hparams["resumed_from"], info.resumed))


def test_run_info_read_late_still_names_the_runs_start(ens, tmp_path):
    seen = []
    run(ens, steps=4, callbacks=[LateInfo(seen)])
    assert seen == [(0, False)]  # a fresh run, read after its first dispatch
    folder = tmp_path / "run"
    run(ens, steps=4, checkpoints=ee.Checkpoints(folder, every=4))
    seen.clear()
    result = run(
        ens, steps=8, checkpoints=ee.Checkpoints(folder, every=4),
        callbacks=[LateInfo(seen)],
    )  # fmt: skip
    assert result.resumed_from == 4
    assert seen == [(4, True)]  # resumed at step 4, read at step 6
