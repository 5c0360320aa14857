"""Loggers as `fit` components (issue 31): CSV files equal the history,
TensorBoard event files read back with TensorBoard's own reader, PBT events,
resume, and bad folders refused before any work."""

import json
import os

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import eqx_ensemble as ee

X = np.random.default_rng(0).normal(size=(64, 3)).astype(np.float32)
Y = X.sum(axis=1, keepdims=True)


def _loss(model, batch, key):
    xb, yb = batch
    return jnp.mean((jax.vmap(model)(xb) - yb) ** 2)


def _ens(size=4):
    return ee.ensemble(
        lambda k: eqx.nn.MLP(3, 1, 8, 1, key=k), size=size, key=jax.random.key(0)
    )


def _fit(callbacks, steps=30, checkpoints=None, evaluate=None, ens=None, opt=None):
    return ee.fit(
        _ens() if ens is None else ens,
        _loss,
        optax.adam(1e-2) if opt is None else opt,
        (X, Y),
        steps=steps,
        batch_size=16,
        key=jax.random.key(1),
        callbacks=callbacks,
        checkpoints=checkpoints,
        evaluate=evaluate,
        execution=ee.Execution(steps_per_dispatch=7),
    )


def _csv(path):
    return np.loadtxt(path, delimiter=",", skiprows=1, ndmin=2)


def _evaluate():
    return ee.Evaluate(lambda m, b, k: _loss(m, b, k), (X, Y), every=5)


def test_csv_equals_the_history(tmp_path):
    result = _fit([ee.CSVLogger(tmp_path)], evaluate=_evaluate())
    losses = _csv(tmp_path / "losses.csv")
    np.testing.assert_array_equal(losses[:, 0], np.arange(1, 31))
    np.testing.assert_array_equal(
        losses[:, 1:].astype(np.float32), result.history.losses
    )
    evaluations = _csv(tmp_path / "evaluations.csv")
    np.testing.assert_array_equal(evaluations[:, 0], result.history.eval_steps)
    np.testing.assert_array_equal(
        evaluations[:, 1:].astype(np.float32), result.history.eval_scores
    )
    run = json.loads((tmp_path / "run.json").read_text())
    assert run["members"] == 4 and run["steps"] == 30 and run["batch_size"] == 16


def test_csv_after_a_resume_equals_the_uninterrupted_history(tmp_path):
    full = _fit((), steps=30)
    logs, run = tmp_path / "logs", ee.Checkpoints(tmp_path / "ckpt", every=10)
    with pytest.raises(
        RuntimeError, match="stop"
    ):  # cut off at step 17 (dispatches end at 7, 10, 17)
        _fit([ee.CSVLogger(logs), _stop_after(14)], checkpoints=run)
    assert _csv(logs / "losses.csv")[-1, 0] == 17  # logged past the checkpoint
    _fit([ee.CSVLogger(logs)], checkpoints=run)
    losses = _csv(logs / "losses.csv")
    np.testing.assert_array_equal(losses[:, 0], np.arange(1, 31))
    np.testing.assert_array_equal(losses[:, 1:].astype(np.float32), full.history.losses)


def test_a_kill_while_a_resumed_run_reopens_its_csv_loses_no_row(tmp_path, monkeypatch):
    # Issue 47, item 1: the resumed run's rewrite of the kept rows is killed
    # (every write of the files the logger opens dies); the rows up to the
    # checkpoint must survive, and a resume after it must complete the file.
    from eqx_ensemble._loggers import files

    full = _fit((), steps=30)
    logs, run = tmp_path / "logs", ee.Checkpoints(tmp_path / "ckpt", every=10)
    with pytest.raises(RuntimeError, match="stop"):
        _fit([ee.CSVLogger(logs), _stop_after(14)], checkpoints=run)

    class Killed(BaseException):
        pass

    class Dying:
        def __init__(self, handle):
            self.handle = handle

        def __getattr__(self, name):
            return getattr(self.handle, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.handle.close()

        def write(self, text):
            self.handle.close()
            raise Killed

        writelines = write

    def dying_open(path, mode="r", *args, **kwargs):
        handle = open(path, mode, *args, **kwargs)
        return Dying(handle) if set(mode) & set("wa") else handle

    monkeypatch.setattr(files, "open", dying_open, raising=False)
    with pytest.raises(Killed):
        _fit([ee.CSVLogger(logs)], checkpoints=run)
    monkeypatch.undo()
    np.testing.assert_array_equal(_csv(logs / "losses.csv")[:10, 0], np.arange(1, 11))
    _fit([ee.CSVLogger(logs)], checkpoints=run)
    losses = _csv(logs / "losses.csv")
    np.testing.assert_array_equal(losses[:, 0], np.arange(1, 31))
    np.testing.assert_array_equal(losses[:, 1:].astype(np.float32), full.history.losses)
    assert not list(logs.glob(".*.tmp"))


def _stop_after(step):
    def stop(result):
        if result.step >= step:
            raise RuntimeError("stop")

    return stop


def test_tensorboard_holds_every_members_loss_at_every_step(tmp_path):
    pytest.importorskip("tensorboardX")
    event_accumulator = pytest.importorskip(
        "tensorboard.backend.event_processing.event_accumulator"
    )
    result = _fit([ee.TensorBoardLogger(tmp_path)], evaluate=_evaluate())
    for member in range(4):
        reader = event_accumulator.EventAccumulator(
            str(tmp_path / f"member_{member:03d}"), size_guidance={"scalars": 0}
        )
        reader.Reload()
        loss = reader.Scalars("loss")
        assert [e.step for e in loss] == list(range(1, 31))
        np.testing.assert_array_equal(
            np.array([e.value for e in loss], np.float32),
            result.history.losses[:, member],
        )
        scores = reader.Scalars("eval")
        assert [e.step for e in scores] == result.history.eval_steps.tolist()
        np.testing.assert_array_equal(
            np.array([e.value for e in scores], np.float32),
            result.history.eval_scores[:, member],
        )


def test_tensorboard_after_a_resume_holds_the_uninterrupted_run(tmp_path):
    pytest.importorskip("tensorboardX")
    event_accumulator = pytest.importorskip(
        "tensorboard.backend.event_processing.event_accumulator"
    )
    full = _fit((), steps=30)
    logs, run = tmp_path / "logs", ee.Checkpoints(tmp_path / "ckpt", every=10)
    with pytest.raises(RuntimeError, match="stop"):
        _fit([ee.TensorBoardLogger(logs), _stop_after(14)], checkpoints=run)
    _fit([ee.TensorBoardLogger(logs)], checkpoints=run)
    reader = event_accumulator.EventAccumulator(
        str(logs / "member_001"), size_guidance={"scalars": 0}
    )
    reader.Reload()
    loss = reader.Scalars("loss")
    assert [e.step for e in loss] == list(range(1, 31))  # 11..17 once, not twice
    np.testing.assert_array_equal(
        np.array([e.value for e in loss], np.float32), full.history.losses[:, 1]
    )


def test_tensorboard_every_thins_the_loss(tmp_path):
    pytest.importorskip("tensorboardX")
    event_accumulator = pytest.importorskip(
        "tensorboard.backend.event_processing.event_accumulator"
    )
    result = _fit([ee.TensorBoardLogger(tmp_path, every=4)])
    reader = event_accumulator.EventAccumulator(
        str(tmp_path / "member_002"), size_guidance={"scalars": 0}
    )
    reader.Reload()
    loss = reader.Scalars("loss")
    assert [e.step for e in loss] == list(range(4, 31, 4))
    np.testing.assert_array_equal(
        np.array([e.value for e in loss], np.float32),
        result.history.losses[3::4, 2],
    )


def test_pbt_exploits_and_hyperparameters_are_logged(tmp_path):
    opt = optax.inject_hyperparams(optax.sgd)(learning_rate=0.05)
    ens = _ens(6)
    opt_state = ee.init_optimizer(
        opt, ens, hyperparams={"learning_rate": np.geomspace(1e-3, 1e-1, 6)}
    )
    pbt = ee.PBT(every=10, fraction=0.34)
    result = ee.fit(
        ens,
        _loss,
        opt,
        (X, Y),
        steps=30,
        batch_size=16,
        key=jax.random.key(1),
        opt_state=opt_state,
        evaluate=ee.Evaluate(lambda m, b, k: _loss(m, b, k), (X, Y), every=10),
        callbacks=[pbt, ee.CSVLogger(tmp_path)],
    )
    steps, children, parents = pbt.lineage(result)
    assert len(steps) > 0
    events = [
        json.loads(line)
        for line in (tmp_path / "events.jsonl").read_text().splitlines()
    ]
    exploits = [e for e in events if e["event"] == "exploit"]
    assert [(e["step"], e["member"], e["parent"]) for e in exploits] == list(
        zip(steps.tolist(), children.tolist(), parents.tolist(), strict=True)
    )
    rows = (tmp_path / "hyperparameters.csv").read_text().splitlines()[1:]
    first = rows[0].split(",")
    assert first[:2] == ["0", "learning_rate"]
    np.testing.assert_allclose(
        np.array(first[2:], float), np.geomspace(1e-3, 1e-1, 6), rtol=1e-6
    )
    last = rows[-1].split(",")
    final = result.train_state.opt_state.hyperparams["learning_rate"]
    np.testing.assert_array_equal(np.array(last[2:], np.float32), np.asarray(final))


def test_a_diverged_member_is_an_event(tmp_path):
    ens = _ens(3)
    # Member 1 starts with a NaN weight: it diverges at its first step.
    ens = eqx.tree_at(
        lambda e: e.members.layers[0].weight,
        ens,
        ens.members.layers[0].weight.at[1, 0, 0].set(jnp.nan),
    )
    _fit([ee.CSVLogger(tmp_path)], ens=ens, steps=10)
    events = [
        json.loads(line)
        for line in (tmp_path / "events.jsonl").read_text().splitlines()
    ]
    assert events == [{"step": 1, "event": "diverged", "member": 1}]


def test_a_folder_that_cannot_be_written_fails_before_training(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    calls = []
    with pytest.raises(OSError, match="CSVLogger.directory"):
        _fit([ee.CSVLogger(blocker / "logs"), lambda r: calls.append(r)])
    assert calls == []
    if os.geteuid() != 0:
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(OSError, match="cannot write logs"):
            _fit([ee.CSVLogger(locked / "logs")])


def test_a_logger_that_fails_ends_the_run_with_it():
    class Failing(ee.Logger):
        def open(self, run):
            return None

        def write(self, handle, entry):
            raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full") as error:
        _fit([Failing()])
    result = error.value.result  # pyright: ignore[reportAttributeAccessIssue]
    assert result.step >= 7


def test_a_custom_logger_sees_every_step_in_order():
    class Collect(ee.Logger):
        def open(self, run):
            return {"run": run, "steps": []}

        def write(self, handle, entry):
            handle["steps"].extend(entry.steps.tolist())
            assert entry.losses.shape == (len(entry.steps), 4)

        def close(self, handle):
            seen.append(handle)

    seen = []
    _fit([Collect()], steps=23)
    assert seen[0]["steps"] == list(range(1, 24))
    assert seen[0]["run"].start == 0 and not seen[0]["run"].resumed


def test_crc32c_matches_the_standards_test_vectors():
    from eqx_ensemble._loggers.events import crc32c

    def of(data: bytes) -> int:
        return int(crc32c(np.frombuffer(data, np.uint8)[None, :])[0])

    # RFC 3720, appendix B.4, and the common check value of CRC-32C.
    assert of(b"123456789") == 0xE3069283
    assert of(bytes(32)) == 0x8A9136AA
    assert of(bytes([0xFF] * 32)) == 0x62A8AB43
    assert of(bytes(range(32))) == 0x46DD794E


@pytest.mark.parametrize(
    "steps", [[1, 2, 3], [126, 127, 128, 129], [16383, 16384], [2**31 - 1]]
)
def test_bulk_scalar_records_equal_tensorboardx_events(steps):
    tensorboardx = pytest.importorskip("tensorboardX")
    from tensorboardX.proto.event_pb2 import Event
    from tensorboardX.record_writer import masked_crc32c
    from tensorboardX.summary import scalar

    from eqx_ensemble._loggers.events import scalar_records

    values = np.linspace(-1.5, 2.5, len(steps)).astype(np.float32)
    ours = scalar_records("loss/x", np.array(steps), values, 12.5)
    theirs = b""
    for step, value in zip(steps, values, strict=True):
        data = Event(
            wall_time=12.5, step=step, summary=scalar("loss/x", float(value))
        ).SerializeToString()
        header = len(data).to_bytes(8, "little")
        theirs += header + masked_crc32c(header).to_bytes(4, "little")
        theirs += data + masked_crc32c(data).to_bytes(4, "little")
    assert tensorboardx is not None
    assert ours == theirs


def test_pbt_events_are_not_logged_twice_after_a_resume(tmp_path):
    opt = optax.inject_hyperparams(optax.sgd)(learning_rate=0.05)
    ens = _ens(6)
    rates = {"learning_rate": np.geomspace(1e-3, 1e-1, 6)}

    def run(steps, logs, checkpoints=None):
        pbt = ee.PBT(every=10, fraction=0.34)
        opt_state = ee.init_optimizer(opt, ens, hyperparams=rates)
        return pbt, ee.fit(
            ens, _loss, opt, (X, Y), steps=steps, batch_size=16,
            key=jax.random.key(1), opt_state=opt_state,
            evaluate=ee.Evaluate(lambda m, b, k: _loss(m, b, k), (X, Y), every=10),
            callbacks=[pbt, ee.CSVLogger(logs)], checkpoints=checkpoints,
        )  # fmt: skip

    def exploits(logs):
        lines = (logs / "events.jsonl").read_text().splitlines()
        return [(e["step"], e["member"]) for e in map(json.loads, lines)]

    run(30, tmp_path / "full")
    checkpoints = ee.Checkpoints(tmp_path / "ckpt", every=10)
    run(20, tmp_path / "cut", checkpoints)
    run(30, tmp_path / "cut", checkpoints)
    assert exploits(tmp_path / "cut") == exploits(tmp_path / "full")
    assert len(exploits(tmp_path / "full")) == 6


def test_the_dispatch_in_which_every_member_diverges_is_logged(tmp_path):
    ens = _ens(2)
    ens = eqx.tree_at(
        lambda e: e.members.layers[0].weight,
        ens,
        ens.members.layers[0].weight.at[:, 0, 0].set(jnp.nan),
    )
    with pytest.raises(ee.EnsembleDivergedError) as error:
        _fit([ee.CSVLogger(tmp_path)], ens=ens, steps=10)
    history = error.value.result.history  # pyright: ignore[reportAttributeAccessIssue]
    assert _csv(tmp_path / "losses.csv").shape[0] == history.losses.shape[0] > 0
    events = (tmp_path / "events.jsonl").read_text().splitlines()
    assert [json.loads(e)["member"] for e in events] == [0, 1]


def test_every_row_up_to_a_checkpoint_is_on_disk_when_it_is_written(tmp_path):
    logs = tmp_path / "logs"
    seen = []

    def check(result):  # callbacks run after the dispatch's checkpoint
        if result.step % 10 == 0:
            rows = _csv(logs / "losses.csv")
            seen.append((result.step, rows[-1, 0]))

    _fit(
        [ee.CSVLogger(logs), check],
        steps=30,
        checkpoints=ee.Checkpoints(tmp_path / "ckpt", every=10),
    )
    assert seen == [(10, 10), (20, 20), (30, 30)]


def test_a_torn_last_row_is_dropped_on_resume(tmp_path):
    full = _fit((), steps=30)
    logs, run = tmp_path / "logs", ee.Checkpoints(tmp_path / "ckpt", every=10)
    _fit([ee.CSVLogger(logs)], steps=20, checkpoints=run)
    with open(logs / "losses.csv", "a") as file:  # a kill mid-write
        file.write("21,0.25,0.3")
    _fit([ee.CSVLogger(logs)], steps=30, checkpoints=run)
    losses = _csv(logs / "losses.csv")
    np.testing.assert_array_equal(losses[:, 0], np.arange(1, 31))
    np.testing.assert_array_equal(losses[:, 1:].astype(np.float32), full.history.losses)


def test_the_runs_own_error_wins_over_a_loggers(tmp_path):
    class Failing(ee.Logger):
        def open(self, run):
            return None

        def write(self, handle, entry):
            raise RuntimeError("logger write failed")

    def callback(result):
        raise KeyError("the user's callback")

    with pytest.raises(KeyError, match="the user's callback"):
        _fit([callback, Failing()], steps=3)


def test_a_logger_that_fails_to_open_closes_the_others():
    closed = []

    class Recorder(ee.Logger):
        def open(self, run):
            return "handle"

        def write(self, handle, entry):
            pass

        def close(self, handle):
            closed.append(handle)

    class Broken(ee.Logger):
        def open(self, run):
            raise OSError("cannot open")

        def write(self, handle, entry):
            pass

    with pytest.raises(OSError, match="cannot open"):
        _fit([Recorder(), Broken()], steps=3)
    assert closed == ["handle"]


@pytest.mark.parametrize("length", [110, 119, 120, 121, 300])
def test_long_tags_are_readable_by_tensorboard(tmp_path, length):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import (
        EventAccumulator,
    )

    from eqx_ensemble._loggers.events import EventFile, scalar_records

    tag = "t" * length
    file = EventFile(tmp_path, purge_step=None)
    file.write(scalar_records(tag, np.arange(1, 12), np.arange(11.0), 1.0))
    file.close()
    reader = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0})
    reader.Reload()
    assert [e.value for e in reader.Scalars(tag)] == list(np.arange(11.0))


def test_negative_steps_are_refused():
    from eqx_ensemble._loggers.events import event_record, scalar_records

    with pytest.raises(ValueError, match="non-negative"):
        scalar_records("loss", np.array([-1, 0]), np.zeros(2), 1.0)
    with pytest.raises(ValueError, match="non-negative"):
        event_record(1.0, -1, summary=b"")


def test_tracker_events_are_logged(tmp_path):
    snapshots = ee.Snapshots(at=(10, 20, 30))
    ee.fit(
        _ens(), _loss, optax.adam(1e-2), (X, Y), steps=30, batch_size=16,
        key=jax.random.key(1), track=[snapshots, ee.SWA(start=15)],
        callbacks=[ee.CSVLogger(tmp_path)],
        execution=ee.Execution(steps_per_dispatch=7),
    )  # fmt: skip
    lines = (tmp_path / "events.jsonl").read_text().splitlines()
    events = [(e["step"], e["event"]) for e in map(json.loads, lines)]
    assert events == [
        (10, "snapshot"),
        (15, "averaging_starts"),
        (20, "snapshot"),
        (30, "snapshot"),
    ]
