"""Per-member early stopping against a hand-written patience rule, exact resume,
the early end of a run, and bad input."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import eqx_ensemble as ee

EVERY = 5


def problem():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 3)).astype(np.float32)
    y = (x @ np.array([1.0, -2.0, 0.5]) + 0.3 * rng.normal(size=64)).astype(np.float32)
    x_val = rng.normal(size=(32, 3)).astype(np.float32)
    y_val = (x_val @ np.array([1.0, -2.0, 0.5])).astype(np.float32)
    ens = ee.ensemble(
        lambda k: eqx.nn.MLP(3, 1, 16, 1, key=k), size=4, key=jax.random.key(0)
    )

    def loss(model, batch, key):
        xb, yb = batch
        return jnp.mean((jax.vmap(model)(xb)[:, 0] - yb) ** 2)

    return ens, loss, (x, y), (x_val, y_val)


def run(steps, callbacks=(), checkpoints=None, key=1):
    ens, loss, data, val = problem()
    return ee.fit(
        ens, loss, optax.adam(3e-2), data, steps=steps, batch_size=8,
        key=jax.random.key(key), sampling="independent",
        evaluate=ee.Evaluate(loss, val, every=EVERY),
        callbacks=list(callbacks), checkpoints=checkpoints,
    )  # fmt: skip


def patience_rule(steps, scores, patience, min_delta):
    """The hand-written loop: Keras' rule, one member at a time."""
    stops = {}
    for member in range(scores.shape[1]):
        best, waited = np.inf, 0
        for step, score in zip(steps, scores[:, member], strict=True):
            if score < best - min_delta:
                best, waited = score, 0
            else:
                waited += 1
            if waited >= patience:
                stops[member] = int(step)
                break
    return stops


@pytest.mark.parametrize("patience, min_delta", [(2, 0.0), (3, 0.02)])
def test_members_stop_where_a_hand_written_patience_loop_stops(patience, min_delta):
    steps = 300
    free = run(steps)
    expected = patience_rule(
        free.history.eval_steps, free.history.eval_scores, patience, min_delta
    )
    assert len(set(expected.values())) >= 2, "members should stop at different steps"
    stopping = run(
        steps, [ee.EarlyStopping(EVERY, patience=patience, min_delta=min_delta)]
    )
    assert stopping.stopped == expected
    last = max(expected.values()) if len(expected) == 4 else steps
    assert stopping.step == last
    # Until it stops, each member's trajectory is the free run's (members are
    # independent); a stopped member holds the weights of its best evaluation.
    for member in range(4):
        if member in expected:
            best_step = int(stopping.best_step[member])
            assert best_step <= expected[member]
            reference = run(best_step).ensemble if best_step else problem()[0]
        else:
            reference = free.ensemble
        np.testing.assert_allclose(
            stopping.ensemble[member].layers[0].weight,
            reference[member].layers[0].weight,
            rtol=1e-6,
            atol=1e-7,
        )
    np.testing.assert_array_equal(
        stopping.history.eval_scores[: len(free.history.eval_steps)][:1],
        free.history.eval_scores[:1],
    )


def test_resume_is_bit_exact_and_a_finished_run_stays_finished(tmp_path):
    stop = ee.EarlyStopping(EVERY, patience=2)
    reference = run(300, [stop], ee.Checkpoints(tmp_path / "reference", every=EVERY))
    assert 0 < len(reference.stopped)

    class Interrupt(Exception):
        pass

    first = min(reference.stopped.values())

    def interrupt(result):
        if result.step >= first + EVERY:
            raise Interrupt

    directory = tmp_path / "run"
    with pytest.raises(Interrupt):
        run(300, [stop, interrupt], ee.Checkpoints(directory, every=EVERY))
    resumed = run(300, [stop], ee.Checkpoints(directory, every=EVERY))
    assert resumed.resumed_from is not None
    assert resumed.stopped == reference.stopped and resumed.step == reference.step
    for a, b in zip(
        jax.tree.leaves(resumed.train_state), jax.tree.leaves(reference.train_state)
    ):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(resumed.history.losses, reference.history.losses)
    # Resuming a run that ended early ends at once, with the same result.
    again = run(300, [stop], ee.Checkpoints(tmp_path / "reference", every=EVERY))
    assert again.step == reference.step and again.stopped == reference.stopped


def test_sequential_layout_stops_the_same_members():
    ens, loss, data, val = problem()
    results = [
        ee.fit(
            ens,
            loss,
            optax.adam(3e-2),
            data,
            steps=200,
            batch_size=8,
            key=jax.random.key(1),
            sampling="independent",
            evaluate=ee.Evaluate(loss, val, every=EVERY),
            callbacks=[ee.EarlyStopping(EVERY, patience=2)],
            execution=ee.Execution(layout=layout),
        )  # fmt: skip
        for layout in ("vmap", "sequential")
    ]
    assert results[0].stopped == results[1].stopped
    assert results[0].stopped


def test_stopped_events_reach_loggers(tmp_path):
    run(300, [ee.EarlyStopping(EVERY, patience=2), ee.CSVLogger(tmp_path)])
    events = (tmp_path / "events.jsonl").read_text()
    assert "stopped" in events


# ------------------------------------------------------------------ bad input


@pytest.mark.parametrize("patience", [0, -1])
def test_patience_below_one(patience):
    with pytest.raises(ValueError, match="patience"):
        ee.EarlyStopping(EVERY, patience=patience)


@pytest.mark.parametrize("min_delta", [-0.1, float("nan"), float("inf")])
def test_bad_min_delta(min_delta):
    with pytest.raises(ValueError, match="min_delta"):
        ee.EarlyStopping(EVERY, patience=2, min_delta=min_delta)


def test_needs_evaluation_at_its_period():
    ens, loss, data, val = problem()
    with pytest.raises(ValueError, match="evaluate=ee.Evaluate"):
        ee.fit(
            ens, loss, optax.adam(1e-2), data, steps=10, batch_size=8,
            key=jax.random.key(0), callbacks=[ee.EarlyStopping(EVERY, patience=2)],
        )  # fmt: skip
    with pytest.raises(ValueError, match="every=5"):
        ee.fit(
            ens, loss, optax.adam(1e-2), data, steps=10, batch_size=8,
            key=jax.random.key(0), callbacks=[ee.EarlyStopping(10, patience=2)],
            evaluate=ee.Evaluate(loss, val, every=EVERY),
        )  # fmt: skip


def test_sequential_layout_skips_a_stopped_members_step():
    """Member by member, a stopped member's loss is not computed at all: a host
    callback in the loss counts the calls that ran."""
    ens, loss, data, val = problem()
    calls = []

    def counted(model, batch, key):
        jax.debug.callback(lambda: calls.append(1))
        return loss(model, batch, key)

    result = ee.fit(
        ens, counted, optax.adam(3e-2), data, steps=200, batch_size=8,
        key=jax.random.key(1), sampling="independent",
        evaluate=ee.Evaluate(loss, val, every=EVERY),
        callbacks=[ee.EarlyStopping(EVERY, patience=2)],
        execution=ee.Execution(layout="sequential"),
    )  # fmt: skip
    jax.effects_barrier()
    assert result.stopped
    active = sum(result.stopped.get(member, result.step) for member in range(4))
    assert len(calls) == active < 4 * result.step
    # A stopped member's later losses are NaN (in every layout), the others' not.
    for member, step in result.stopped.items():
        assert np.isnan(result.history.losses[step:, member]).all()
        assert np.isfinite(result.history.losses[:step, member]).all()


def test_sequential_layout_runs_a_convolving_step_without_a_conditional():
    """A step that convolves is not put under a per-member conditional (XLA's
    CPU backend runs a convolution inside one in a slow layout): every member's
    loss runs at every step, and a stopped member still keeps its best weights
    and reports NaN losses, exactly as in the vectorised layout."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 1, 4, 4)).astype(np.float32)
    y = (x.mean(axis=(1, 2, 3)) + 0.3 * rng.normal(size=64)).astype(np.float32)
    val = (x[:32] + 0.1, y[:32])

    class Small(eqx.Module):
        conv: eqx.nn.Conv2d
        out: eqx.nn.Linear

        def __init__(self, key):
            k1, k2 = jax.random.split(key)
            self.conv = eqx.nn.Conv2d(1, 2, 3, padding=1, key=k1)
            self.out = eqx.nn.Linear(32, 1, key=k2)

        def __call__(self, image):
            return self.out(jax.nn.relu(self.conv(image)).reshape(-1))[0]

    def loss(model, batch, key):
        xb, yb = batch
        return jnp.mean((jax.vmap(model)(xb) - yb) ** 2)

    calls = []

    def counted(model, batch, key):
        jax.debug.callback(lambda: calls.append(1))
        return loss(model, batch, key)

    ens = ee.ensemble(Small, size=4, key=jax.random.key(0))

    def fit(loss_fn, layout):
        return ee.fit(
            ens, loss_fn, optax.adam(3e-2), (x, y), steps=60, batch_size=8,
            key=jax.random.key(1), sampling="independent",
            evaluate=ee.Evaluate(loss, val, every=EVERY),
            callbacks=[ee.EarlyStopping(EVERY, patience=2)],
            execution=ee.Execution(layout=layout),
        )  # fmt: skip

    sequential = fit(counted, "sequential")
    jax.effects_barrier()
    vectorised = fit(loss, "vmap")
    assert sequential.stopped and sequential.stopped == vectorised.stopped
    assert len(calls) == 4 * sequential.step
    for member, step in sequential.stopped.items():
        assert np.isnan(sequential.history.losses[step:, member]).all()
    for a, b in zip(
        jax.tree.leaves(eqx.filter(sequential.ensemble, eqx.is_array)),
        jax.tree.leaves(eqx.filter(vectorised.ensemble, eqx.is_array)),
        strict=True,
    ):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_pbt_and_early_stopping_are_refused_together():
    ens, loss, data, val = problem()
    with pytest.raises(ValueError, match=r"ee\.PBT.*ee\.EarlyStopping"):
        ee.fit(
            ens, loss, optax.inject_hyperparams(optax.adam)(learning_rate=3e-2),
            data, steps=20, batch_size=8, key=jax.random.key(1),
            evaluate=ee.Evaluate(loss, val, every=EVERY),
            callbacks=[
                ee.PBT(every=EVERY, fraction=0.25, hyperparams=("learning_rate",)),
                ee.EarlyStopping(EVERY, patience=2),
            ],
        )  # fmt: skip
