"""The open loop: streamed data, trackers, controllers, checkpoints as components,
and the reliability fixes of the loop (issue 12 and 13).

References are independent of `fit`: a `make_step` loop over the same batches and
the documented keys, EMAs computed by hand from the per-step weights, and runs
without interruption for resume.
"""

import dataclasses
import io
import os

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import (
    ON_CPU,
    alternating,
    assert_tree_allclose,
    needs_devices,
    repeat,
    tree_equal,
)
from test_fit import BatchNormMLP, batchnorm_loss

import eqx_ensemble as ee

SIZE = 3
N = 48
BATCH = 8
X = np.asarray(jax.random.normal(jax.random.key(10), (N, 2)), dtype=np.float32)
Y = np.sin(2 * X[:, :1]) + X[:, 1:] ** 2
KEY = jax.random.key(5)
ADAM = optax.adam(1e-2)
SGD = optax.sgd(0.05)


def make_mlp(key):
    return eqx.nn.MLP(2, 1, 8, 1, key=key)


def mse_loss(model, batch, key):
    xb, yb = batch
    return jnp.mean((jax.vmap(model)(xb) - yb) ** 2)


@pytest.fixture(scope="module")
def ens():
    return ee.ensemble(make_mlp, size=SIZE, key=jax.random.key(0))


@pytest.fixture(scope="module")
def bn():
    return ee.ensemble(
        lambda k: eqx.nn.make_with_state(BatchNormMLP)(k),
        size=SIZE,
        key=jax.random.key(1),
    )


def shared_batches(count, seed=0, per_member=False):
    rng = np.random.default_rng(seed)
    shape = (SIZE, BATCH) if per_member else (BATCH,)
    return [
        (X[idx], Y[idx]) for idx in (rng.integers(0, N, shape) for _ in range(count))
    ]


def step_keys(key, steps):
    train_key = jax.random.split(key, 3)[2]
    return [jax.random.fold_in(train_key, s) for s in range(steps)]


def reference_loop(ens, loss_fn, optimizer, batches, *, per_member=False, state=None):
    """A `make_step` loop over `batches` with `fit`'s documented keys."""
    step = ee.make_step(loss_fn, optimizer, per_member_batch=per_member)
    opt_state = ee.init_optimizer(optimizer, ens)
    trajectory, losses = [], []
    for batch, key in zip(batches, step_keys(KEY, len(batches)), strict=True):
        ens, opt_state, step_losses, _, state = step(ens, opt_state, batch, key, state)
        trajectory.append(ens)
        losses.append(np.asarray(step_losses))
    return ens, state, opt_state, np.stack(losses), trajectory


# -------------------------------------------------------------------------------
# Streams
# -------------------------------------------------------------------------------


@pytest.mark.parametrize("per_member", [False, True])
def test_stream_equals_make_step_loop(ens, per_member):
    batches = shared_batches(23, per_member=per_member)
    sampling = ee.Independent() if per_member else ee.Shared()
    result = ee.fit(
        ens,
        mse_loss,
        ADAM,
        iter(batches),
        steps=23,
        key=KEY,
        sampling=sampling,
        callbacks=(),
        execution=ee.Execution(steps_per_dispatch=5),
    )
    expected, _, _, losses, _ = reference_loop(
        ens, mse_loss, ADAM, batches, per_member=per_member
    )
    assert_tree_allclose(result.ensemble, expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(result.history.losses, losses, rtol=1e-5, atol=1e-7)
    assert result.num_examples is None


def test_stream_with_batchnorm_state_and_evaluation(bn):
    ens, state = bn
    batches = shared_batches(12, seed=1)
    eval_data = (X[:16], Y[:16])
    result = ee.fit(
        ens,
        batchnorm_loss,
        ADAM,
        (b for b in batches),
        steps=12,
        key=KEY,
        state=state,
        evaluate=ee.Evaluate(batchnorm_loss, eval_data, every=4, inference=False),
        callbacks=(),
        execution=ee.Execution(steps_per_dispatch=5),
    )
    expected, expected_state, _, losses, trajectory = reference_loop(
        ens, batchnorm_loss, ADAM, batches, state=state
    )
    assert_tree_allclose(result.ensemble, expected, rtol=1e-5, atol=1e-6)
    assert_tree_allclose(result.state, expected_state, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(result.history.losses, losses, rtol=1e-5, atol=1e-7)
    # Scores recomputed by hand from the reference trajectory (the model state
    # used is the one after the evaluated step).
    _, _, _, _, states = _trajectory_states(ens, batches, state)
    assert result.history.eval_steps.tolist() == [4, 8, 12]
    for row, done in enumerate([4, 8, 12]):
        members = trajectory[done - 1]
        for i in range(SIZE):
            score, _ = batchnorm_loss(
                members[i],
                jax.tree.map(lambda s: s[i], states[done - 1]),
                eval_data,
                None,
            )
            np.testing.assert_allclose(
                result.history.eval_scores[row, i], score, rtol=1e-5, atol=1e-6
            )


def _trajectory_states(ens, batches, state):
    step = ee.make_step(batchnorm_loss, ADAM)
    opt_state = ee.init_optimizer(ADAM, ens)
    states = []
    for batch, key in zip(batches, step_keys(KEY, len(batches)), strict=True):
        ens, opt_state, _, _, state = step(ens, opt_state, batch, key, state)
        states.append(state)
    return ens, state, opt_state, None, states


def test_stream_from_memmap_larger_than_a_dispatch(ens, tmp_path):
    rows = 8 * BATCH * 5
    path = tmp_path / "x.dat"
    table = np.lib.format.open_memmap(
        path, mode="w+", dtype=np.float32, shape=(rows, 3)
    )
    table[:, :2] = np.resize(X, (rows, 2))
    table[:, 2:] = np.resize(Y, (rows, 1))
    table.flush()
    del table

    def batches(step):  # a factory: the batches from `step` on
        table = np.load(path, mmap_mode="r")
        for start in range(step * BATCH, rows, BATCH):
            chunk = np.asarray(table[start : start + BATCH])
            yield chunk[:, :2], chunk[:, 2:]

    steps = rows // BATCH
    result = ee.fit(
        ens,
        mse_loss,
        ADAM,
        batches,
        steps=steps,
        key=KEY,
        callbacks=(),
        execution=ee.Execution(steps_per_dispatch=7),
    )
    expected, _, _, losses, _ = reference_loop(ens, mse_loss, ADAM, list(batches(0)))
    assert_tree_allclose(result.ensemble, expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(result.history.losses, losses, rtol=1e-5, atol=1e-7)


def test_stream_resume_with_factory_equals_uninterrupted(ens, tmp_path):
    batches = shared_batches(20, seed=3)

    def factory(step):
        return iter(batches[step:])

    common = dict(key=KEY, callbacks=(), execution=ee.Execution(steps_per_dispatch=3))
    reference = ee.fit(ens, mse_loss, ADAM, factory, steps=20, **common)
    run = ee.Checkpoints(tmp_path, every=4)
    ee.fit(ens, mse_loss, ADAM, factory, steps=8, checkpoints=run, **common)
    resumed = ee.fit(ens, mse_loss, ADAM, factory, steps=20, checkpoints=run, **common)
    assert tree_equal(resumed.ensemble, reference.ensemble)
    np.testing.assert_array_equal(resumed.history.losses, reference.history.losses)
    with pytest.raises(ValueError, match="Resuming at step 20 from a stream"):
        ee.fit(ens, mse_loss, ADAM, iter(batches), steps=24, checkpoints=run, **common)


def test_stream_errors(ens):
    good = shared_batches(4)
    bad_shape = good[:2] + [(X[:5], Y[:5])] + good[2:]
    with pytest.raises(ValueError, match=r"leaf `\[0\]` at step 2 has float32\[5, 2\]"):
        ee.fit(ens, mse_loss, ADAM, iter(bad_shape), steps=4, key=KEY, callbacks=())
    with pytest.raises(ValueError, match="ended after step 4") as info:
        ee.fit(ens, mse_loss, ADAM, iter(good), steps=10, key=KEY, callbacks=())
    assert info.value.result.step == 4  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="a stream cannot be resampled"):
        ee.fit(
            ens,
            mse_loss,
            ADAM,
            iter(good),
            steps=4,
            key=KEY,
            sampling="bootstrap",
            callbacks=(),
        )
    with pytest.raises(ValueError, match="leading member axis of size 3"):
        ee.fit(
            ens,
            mse_loss,
            ADAM,
            iter(good),
            steps=4,
            key=KEY,
            sampling=ee.Independent(),
            callbacks=(),
        )
    with pytest.raises(
        ValueError, match="`batch_size=4` but the stream's batches hold 8"
    ):
        ee.fit(
            ens,
            mse_loss,
            ADAM,
            iter(good),
            steps=4,
            key=KEY,
            batch_size=4,
            callbacks=(),
        )


@pytest.mark.parametrize("data", [5, object(), "x.npy"])
def test_data_that_is_neither_arrays_nor_a_stream(ens, data):
    with pytest.raises(TypeError, match="`data` "):
        ee.fit(ens, mse_loss, ADAM, data, steps=2, batch_size=4, key=KEY)


# -------------------------------------------------------------------------------
# Loss signatures and errors inside the loss
# -------------------------------------------------------------------------------


def test_stateful_loss_without_state_is_named(ens):
    with pytest.raises(TypeError, match="pass the stacked model state with `state=`"):
        ee.fit(ens, batchnorm_loss, ADAM, (X, Y), steps=2, batch_size=4, key=KEY)


def test_plain_loss_with_state_is_named(bn):
    ens, state = bn
    with pytest.raises(
        TypeError, match=r"called as `loss_fn\(model, state, batch, key"
    ):
        ee.fit(ens, mse_loss, ADAM, (X, Y), steps=2, batch_size=4, key=KEY, state=state)


def test_loss_without_vmap_gets_a_note(ens):
    def loss_without_vmap(model, batch, key):
        xb, yb = batch
        return jnp.mean((model(xb) - yb) ** 2)

    with pytest.raises(Exception, match="A model takes ONE example"):
        ee.fit(
            ens,
            loss_without_vmap,
            ADAM,
            (X, Y),
            steps=2,
            batch_size=4,
            key=KEY,
            callbacks=(),
        )


def test_state_set_inside_the_loss(bn):
    # `state.set` consumes the old state, as in plain Equinox.
    ens, state = bn

    def loss_with_set(model, state, batch, key):
        loss, new_state = batchnorm_loss(model, state, batch, key)
        index = model.norm.batch_counter
        new_state = new_state.set(index, new_state.get(index))
        return loss, new_state

    result = ee.fit(
        ens,
        loss_with_set,
        ADAM,
        (X, Y),
        steps=3,
        batch_size=8,
        key=KEY,
        state=state,
        callbacks=(),
    )
    reference = ee.fit(
        ens,
        batchnorm_loss,
        ADAM,
        (X, Y),
        steps=3,
        batch_size=8,
        key=KEY,
        state=state,
        callbacks=(),
    )
    assert_tree_allclose(result.ensemble, reference.ensemble)
    step = ee.make_step(loss_with_set, ADAM)
    out = step(ens, ee.init_optimizer(ADAM, ens), (X, Y), KEY, state)
    assert np.isfinite(np.asarray(out.losses)).all()


# -------------------------------------------------------------------------------
# Divergence: the update is guarded too
# -------------------------------------------------------------------------------


def test_huge_learning_rate_member_keeps_last_finite_parameters(ens):
    # The loss and gradient stay finite; only the update overflows.
    lr = 3e38
    batches = shared_batches(5, seed=7)
    optimizer = optax.inject_hyperparams(optax.sgd)(learning_rate=0.01)
    result = ee.fit(
        ens,
        mse_loss,
        optimizer,
        iter(batches),
        steps=5,
        key=KEY,
        opt_state=ee.init_optimizer(
            optimizer, ens, hyperparams={"learning_rate": jnp.array([0.01, lr, 0.01])}
        ),
        callbacks=(),
    )
    # Reference: member 1 alone, plain SGD, stopped at its first non-finite step.
    model, diverged_at = ens[1], None
    for step, batch in enumerate(batches, start=1):  # steps count from 1
        loss, grads = eqx.filter_value_and_grad(mse_loss)(model, batch, None)
        new = eqx.apply_updates(model, jax.tree.map(lambda g: -lr * g, grads))
        new_leaves = jax.tree.leaves(eqx.filter(new, eqx.is_inexact_array))
        if not (np.isfinite(loss) and all(np.isfinite(x).all() for x in new_leaves)):
            diverged_at = step
            break
        model = new
    assert diverged_at is not None
    assert result.diverged == {1: diverged_at}
    assert_tree_allclose(result.ensemble[1], model, rtol=1e-6, atol=0)
    leaves = jax.tree.leaves(eqx.filter(result.ensemble, eqx.is_inexact_array))
    assert all(bool(jnp.isfinite(leaf).all()) for leaf in leaves)


def test_batch_size_beyond_xla_limits_is_refused_before_xla(ens):
    with pytest.raises(ValueError, match="indices XLA can address|GiB"):
        ee.fit(
            ens,
            mse_loss,
            ADAM,
            (X, Y),
            steps=2,
            batch_size=2**31,
            key=KEY,
            sampling="bootstrap",
        )
    with pytest.raises(ValueError, match="indices XLA can address"):
        ee.fit(
            ens,
            mse_loss,
            ADAM,
            (X, Y),
            steps=2,
            batch_size=2**30,
            key=KEY,
            sampling="bootstrap",
        )


# -------------------------------------------------------------------------------
# Trackers
# -------------------------------------------------------------------------------


@pytest.mark.parametrize("sampling", ["shared", "bootstrap"])
def test_ema_equals_hand_computed_average(ens, sampling):
    decay = 0.8
    weights = []

    def keep(result):
        weights.append(eqx.filter(result.ensemble, eqx.is_inexact_array))

    result = ee.fit(
        ens,
        mse_loss,
        ADAM,
        (X, Y),
        steps=9,
        batch_size=BATCH,
        key=KEY,
        sampling=sampling,
        track=[ee.EMA(decay)],
        callbacks=[keep],
        execution=ee.Execution(steps_per_dispatch=1),
    )
    average = eqx.filter(ens, eqx.is_inexact_array)
    for w in weights:
        average = jax.tree.map(lambda a, b: decay * a + (1 - decay) * b, average, w)
    assert isinstance(result.tracked[0], ee.Ensemble)
    assert_tree_allclose(
        eqx.filter(result.tracked[0], eqx.is_inexact_array),
        average,
        rtol=1e-6,
        atol=1e-7,
    )


def test_ema_on_a_stream_equals_make_step_trajectory(ens):
    batches = shared_batches(7, seed=4)
    result = ee.fit(
        ens,
        mse_loss,
        ADAM,
        iter(batches),
        steps=7,
        key=KEY,
        track=[ee.EMA(0.5)],
        callbacks=(),
    )
    _, _, _, _, trajectory = reference_loop(ens, mse_loss, ADAM, batches)
    average = eqx.filter(ens, eqx.is_inexact_array)
    for members in trajectory:
        average = jax.tree.map(
            lambda a, b: 0.5 * a + 0.5 * b,
            average,
            eqx.filter(members, eqx.is_inexact_array),
        )
    assert_tree_allclose(eqx.filter(result.tracked[0], eqx.is_inexact_array), average)


def test_resume_with_tracker_and_evaluation_is_bit_exact(ens, tmp_path):
    common = dict(
        batch_size=BATCH,
        key=KEY,
        sampling="bootstrap",
        track=[ee.EMA(0.9)],
        evaluate=ee.Evaluate(mse_loss, (X, Y), every=2),
        callbacks=(),
        execution=ee.Execution(steps_per_dispatch=3),
    )
    reference = ee.fit(ens, mse_loss, ADAM, (X, Y), steps=14, **common)
    run = ee.Checkpoints(tmp_path, every=5)
    ee.fit(ens, mse_loss, ADAM, (X, Y), steps=10, checkpoints=run, **common)
    resumed = ee.fit(ens, mse_loss, ADAM, (X, Y), steps=14, checkpoints=run, **common)
    assert tree_equal(resumed.train_state, reference.train_state)
    assert tree_equal(resumed.tracked[0], reference.tracked[0])
    np.testing.assert_array_equal(
        resumed.history.eval_scores, reference.history.eval_scores
    )
    latest = run.latest(ens, ADAM, evaluate=common["evaluate"], track=common["track"])
    assert latest is not None and latest.step == 14
    assert tree_equal(latest.ensemble, reference.ensemble)
    assert isinstance(latest.sampling, ee.Bootstrap)


@pytest.mark.parametrize(
    "decay, error",
    [
        (1.0, ValueError),
        (-0.1, ValueError),
        (float("nan"), ValueError),
        ("0.9", TypeError),
    ],
)
def test_ema_bad_decay(decay, error):
    # (under the test suite's runtime type checking, a wrong type is caught by
    # beartype, which names the parameter, before the library's own check)
    with pytest.raises(error, match="EMA.decay|parameter 'decay'"):
        ee.EMA(decay)


# -------------------------------------------------------------------------------
# Controllers
# -------------------------------------------------------------------------------


class CopyBest(ee.Controller):
    """Copies member 0 into member 1 (weights and optimizer state)."""

    every: int
    calls: list = dataclasses.field(default_factory=list)

    def __call__(self, train_state, state, history):
        self.calls.append((int(train_state.step), history.losses.shape[0]))

        def copy(tree):
            return jax.tree.map(
                lambda x: x.at[1].set(x[0]) if eqx.is_array(x) and x.ndim else x, tree
            )

        train_state = dataclasses.replace(
            train_state,
            ensemble=copy(train_state.ensemble),
            opt_state=copy(train_state.opt_state),
        )
        return train_state, state


def test_controller_runs_between_dispatches_and_changes_the_run(ens):
    controller = CopyBest(every=4)
    result = ee.fit(
        ens,
        mse_loss,
        ADAM,
        (X, Y),
        steps=10,
        batch_size=BATCH,
        key=KEY,
        callbacks=[controller],
        execution=ee.Execution(steps_per_dispatch=100),
    )
    assert controller.calls == [(4, 4), (8, 8)]
    # After the copy at step 8, members 0 and 1 train on the same shared batches
    # with different keys (unused by the loss): they stay equal.
    assert_tree_allclose(result.ensemble[0], result.ensemble[1])


def test_controller_that_changes_shapes_is_refused(ens):
    class Shrink(ee.Controller):
        every: int = 2

        def __call__(self, train_state, state, history):
            halves = jax.tree.map(
                lambda x: x[:, :1] if eqx.is_array(x) and x.ndim > 1 else x,
                train_state.ensemble,
            )
            return dataclasses.replace(train_state, ensemble=halves), state

    with pytest.raises(
        TypeError, match=r"callback `Shrink` \(in `callbacks`\) changed the structure"
    ) as raised:
        ee.fit(
            ens,
            mse_loss,
            ADAM,
            (X, Y),
            steps=4,
            batch_size=BATCH,
            key=KEY,
            callbacks=[Shrink()],
        )
    # Raised after training started: the run up to the controller's step is kept.
    assert raised.value.result.step == 2


def test_bad_components_are_named(ens):
    common = dict(steps=2, batch_size=4, key=KEY)
    with pytest.raises(TypeError, match=r"`track\[0\]` must be an|parameter 'track'"):
        ee.fit(ens, mse_loss, ADAM, (X, Y), track=["ema"], **common)
    with pytest.raises(
        TypeError, match="`evaluate` must be an `ee.Evaluate|parameter 'evaluate'"
    ):
        ee.fit(ens, mse_loss, ADAM, (X, Y), evaluate=mse_loss, **common)
    with pytest.raises(
        TypeError,
        match="`checkpoints` must be an `ee.Checkpoints|parameter 'checkpoints'",
    ):
        ee.fit(ens, mse_loss, ADAM, (X, Y), checkpoints="run", **common)
    with pytest.raises(
        TypeError, match="`optimizer` must be an `optax.Gradient|parameter 'optimizer'"
    ):
        ee.fit(ens, mse_loss, "adam", (X, Y), **common)
    # The library's own checks (the suite's runtime type checker answers first
    # inside `fit`, naming the parameter).
    from eqx_ensemble._training.inputs import check_components
    from eqx_ensemble._training.sampling import as_sampling

    with pytest.raises(TypeError, match=r"instance, e.g. `ee.Bootstrap\(\)`"):
        as_sampling(ee.Bootstrap)
    with pytest.raises(ValueError, match="'bagging'"):
        as_sampling("bagging")
    with pytest.raises(TypeError, match=r"`track\[0\]` must be an `ee.Tracker`"):
        check_components(None, None, ["ema"])
    with pytest.raises(TypeError, match="`evaluate` must be an `ee.Evaluate"):
        check_components(mse_loss, None, ())
    with pytest.raises(TypeError, match="`checkpoints` must be an `ee.Checkpoints"):
        check_components(None, "run", ())
    with pytest.raises(TypeError, match="Checkpoints.directory|parameter .directory."):
        ee.Checkpoints(3)
    with pytest.raises(ValueError, match="on_corrupt"):
        ee.Checkpoints("run", on_corrupt="ignore")


# -------------------------------------------------------------------------------
# Checkpoints: nothing lost, resume contract
# -------------------------------------------------------------------------------


def test_unwritable_checkpoint_folder_fails_before_training(ens, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    calls = []
    with pytest.raises(Exception, match="file"):
        ee.fit(
            ens,
            mse_loss,
            ADAM,
            (X, Y),
            steps=4,
            batch_size=4,
            key=KEY,
            checkpoints=ee.Checkpoints(blocker / "run"),
            callbacks=[calls.append],
        )
    assert calls == []


def test_failed_checkpoint_write_keeps_the_result(ens, tmp_path, monkeypatch):
    from eqx_ensemble._checkpoints import component as _fit_checkpoints

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(_fit_checkpoints, "_save_checkpoint", full_disk)
    with pytest.raises(ee.CheckpointError, match="error.result") as info:
        ee.fit(
            ens,
            mse_loss,
            ADAM,
            (X, Y),
            steps=6,
            batch_size=4,
            key=KEY,
            checkpoints=ee.Checkpoints(tmp_path, every=3),
            callbacks=(),
        )
    result = info.value.result  # type: ignore[attr-defined]
    assert result.step == 3 and result.history.losses.shape == (3, SIZE)


def test_resume_contract(ens, tmp_path):
    run = ee.Checkpoints(tmp_path, every=4)
    optimizer = optax.inject_hyperparams(optax.adam)(learning_rate=1e-2)
    lrs = {"learning_rate": jnp.array([1e-2, 2e-2, 3e-2])}
    common = dict(batch_size=4, key=KEY, checkpoints=run, callbacks=())
    ee.fit(
        ens,
        mse_loss,
        optimizer,
        (X, Y),
        steps=8,
        **common,
        opt_state=ee.init_optimizer(optimizer, ens, hyperparams=lrs),
    )
    with pytest.raises(ee.CheckpointError, match="step 8, past the `steps=5`"):
        ee.fit(ens, mse_loss, optimizer, (X, Y), steps=5, **common)
    with pytest.raises(ee.CheckpointError, match="different optimizer hyperparameters"):
        ee.fit(
            ens,
            mse_loss,
            optimizer,
            (X, Y),
            steps=12,
            **common,
            opt_state=ee.init_optimizer(
                optimizer,
                ens,
                hyperparams={"learning_rate": jnp.array([1.0, 1.0, 1.0])},
            ),
        )
    with pytest.raises(ee.CheckpointError, match="`eval_every`"):
        ee.fit(
            ens,
            mse_loss,
            optimizer,
            (X, Y),
            steps=12,
            evaluate=ee.Evaluate(mse_loss, (X, Y), every=2),
            **common,
            opt_state=ee.init_optimizer(optimizer, ens, hyperparams=lrs),
        )
    resumed = ee.fit(
        ens,
        mse_loss,
        optimizer,
        (X, Y),
        steps=12,
        **common,
        opt_state=ee.init_optimizer(optimizer, ens, hyperparams=lrs),
    )
    assert resumed.step == 12


def test_corrupt_newest_checkpoint_falls_back_when_asked(ens, tmp_path):
    common = dict(batch_size=4, key=KEY, callbacks=())
    reference = ee.fit(ens, mse_loss, ADAM, (X, Y), steps=12, **common)
    ee.fit(
        ens,
        mse_loss,
        ADAM,
        (X, Y),
        steps=8,
        checkpoints=ee.Checkpoints(tmp_path, every=4),
        **common,
    )
    newest = ee.latest_checkpoint(tmp_path)
    assert newest is not None
    data = newest.read_bytes()
    newest.write_bytes(data[: len(data) // 2])
    with pytest.raises(ee.CheckpointError):
        ee.fit(
            ens,
            mse_loss,
            ADAM,
            (X, Y),
            steps=12,
            checkpoints=ee.Checkpoints(tmp_path, every=4),
            **common,
        )
    with pytest.warns(UserWarning, match="Resuming from step_0000000004.ckpt"):
        resumed = ee.fit(
            ens,
            mse_loss,
            ADAM,
            (X, Y),
            steps=12,
            checkpoints=ee.Checkpoints(tmp_path, every=4, on_corrupt="previous"),
            **common,
        )
    assert tree_equal(resumed.ensemble, reference.ensemble)


def test_checkpoint_renamed_to_another_step_is_noticed(ens, tmp_path):
    common = dict(batch_size=4, key=KEY, callbacks=())
    ee.fit(
        ens,
        mse_loss,
        ADAM,
        (X, Y),
        steps=4,
        checkpoints=ee.Checkpoints(tmp_path),
        **common,
    )
    newest = ee.latest_checkpoint(tmp_path)
    assert newest is not None
    os.rename(newest, newest.with_name(newest.name.replace("4", "6")))
    with pytest.raises(ee.CheckpointError, match="manifest says step 4"):
        ee.fit(
            ens,
            mse_loss,
            ADAM,
            (X, Y),
            steps=8,
            checkpoints=ee.Checkpoints(tmp_path),
            **common,
        )


# -------------------------------------------------------------------------------
# make_step is a Module
# -------------------------------------------------------------------------------


def test_make_step_is_a_module_with_lower(ens):
    step = ee.make_step(mse_loss, ADAM)
    assert isinstance(step, ee.Step) and isinstance(step, eqx.Module)
    opt_state = ee.init_optimizer(ADAM, ens)
    args = (ens, opt_state, (X[:8], Y[:8]), KEY)
    compiled = step.lower(*args).compile()
    out = step(*args)
    again = compiled(*args)
    assert_tree_allclose(out.ensemble, again.ensemble)
    assert ee.make_step(mse_loss, ADAM) == step


@needs_devices(4)
@pytest.mark.parametrize(
    "per_member,axis_type", alternating([False, True], ["Auto", "Explicit"])
)
def test_stream_on_a_mesh_equals_one_device(axis_type, per_member):
    from jax.sharding import AxisType

    four = ee.ensemble(make_mlp, size=4, key=jax.random.key(2))
    rng = np.random.default_rng(9)
    shape = (4, BATCH) if per_member else (BATCH,)
    batches = [(X[i], Y[i]) for i in (rng.integers(0, N, shape) for _ in range(6))]
    sampling = ee.Independent() if per_member else ee.Shared()
    common = dict(
        steps=6,
        key=KEY,
        sampling=sampling,
        execution=ee.Execution(steps_per_dispatch=4),
    )
    reference = ee.fit(four, mse_loss, ADAM, iter(batches), **common, callbacks=())
    mesh = ee.make_mesh(members=2, data=2, axis_types=getattr(AxisType, axis_type))
    sharded = ee.fit(
        four,
        mse_loss,
        ADAM,
        iter(batches),
        **{**common, "execution": ee.Execution(steps_per_dispatch=4, mesh=mesh)},
        callbacks=(),
    )
    assert_tree_allclose(sharded.ensemble, reference.ensemble, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(
        sharded.history.losses, reference.history.losses, rtol=1e-5, atol=1e-7
    )
    weight = sharded.ensemble.members.layers[0].weight
    assert weight.sharding.spec[0] == "members"


# -------------------------------------------------------------------------------
# Per-member hyperparameters of the loss: `hyper=`
# -------------------------------------------------------------------------------

TRACES = []


def decayed_loss(model, batch, key, *, hyper):
    TRACES.append(1)
    weights = jax.tree.leaves(eqx.filter(model, eqx.is_inexact_array))
    penalty = sum(jnp.sum(w**2) for w in weights)
    return mse_loss(model, batch, key) + hyper["decay"] * penalty


@pytest.mark.parametrize("sampling", ["shared", repeat("bootstrap")])
def test_hyper_members_equal_solo_training(ens, sampling):
    import functools

    from test_fit import DATA, solo_fit

    decays = jnp.array([0.0, 0.01, 0.1])
    result = ee.fit(
        ens,
        decayed_loss,
        ADAM,
        DATA,
        steps=20,
        batch_size=BATCH,
        key=KEY,
        sampling=sampling,
        hyper={"decay": decays},
        callbacks=(),
    )
    for i in range(SIZE):
        loss_i = functools.partial(decayed_loss, hyper={"decay": decays[i]})
        solo, _, losses, _ = solo_fit(
            ens[i],
            loss_i,
            ADAM,
            member=i,
            size=SIZE,
            sampling=sampling,
            steps=20,
            key=KEY,
            data=DATA,
        )
        assert_tree_allclose(result.ensemble[i], solo, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(result.history.losses[:, i], losses, rtol=1e-5)
    assert tree_equal(result.train_state.hyper, {"decay": decays})


def test_new_hyper_values_do_not_recompile(ens):
    common = dict(steps=3, batch_size=BATCH, key=KEY, callbacks=())
    ee.fit(ens, decayed_loss, ADAM, (X, Y), hyper={"decay": jnp.zeros(3)}, **common)
    before = len(TRACES)
    ee.fit(ens, decayed_loss, ADAM, (X, Y), hyper={"decay": jnp.ones(3)}, **common)
    assert len(TRACES) == before
    step = ee.make_step(decayed_loss, ADAM)
    opt_state = ee.init_optimizer(ADAM, ens)
    step(ens, opt_state, (X[:8], Y[:8]), KEY, hyper={"decay": jnp.zeros(3)})
    before = len(TRACES)
    step(ens, opt_state, (X[:8], Y[:8]), KEY, hyper={"decay": jnp.ones(3)})
    assert len(TRACES) == before


def test_bad_hyper_is_named(ens):
    common = dict(steps=2, batch_size=BATCH, key=KEY, callbacks=())
    with pytest.raises(
        ValueError, match=r"`hyper` leaf `\['decay'\]` has shape \(2,\)"
    ):
        ee.fit(ens, decayed_loss, ADAM, (X, Y), hyper={"decay": jnp.zeros(2)}, **common)
    with pytest.raises(TypeError, match="Add a `hyper` parameter"):
        ee.fit(ens, mse_loss, ADAM, (X, Y), hyper={"decay": jnp.zeros(3)}, **common)
    with pytest.raises(ValueError, match="non-finite"):
        ee.fit(
            ens,
            decayed_loss,
            ADAM,
            (X, Y),
            hyper={"decay": jnp.array([0.0, jnp.nan, 0.0])},
            **common,
        )
    with pytest.raises(TypeError, match="is a float"):
        ee.fit(ens, decayed_loss, ADAM, (X, Y), hyper={"decay": 0.1}, **common)


# -------------------------------------------------------------------------------
# Unrolled dispatches (convolutions on a CPU)
# -------------------------------------------------------------------------------


class TinyCNN(eqx.Module):
    conv: eqx.nn.Conv2d
    out: eqx.nn.Linear

    def __init__(self, key):
        conv_key, out_key = jax.random.split(key)
        self.conv = eqx.nn.Conv2d(1, 2, 3, padding=1, key=conv_key)
        self.out = eqx.nn.Linear(2 * 4 * 4, 1, key=out_key)

    def __call__(self, x):
        return self.out(jax.nn.relu(self.conv(x)).reshape(-1))


IMAGES = np.asarray(jax.random.normal(jax.random.key(20), (N, 1, 4, 4)), np.float32)


def cnn_loss(model, batch, key):
    xb, yb = batch
    return jnp.mean((jax.vmap(model)(xb) - yb) ** 2)


@pytest.mark.parametrize("sampling", [repeat("shared"), "bootstrap"])
def test_unrolled_dispatches_equal_the_fused_loop(sampling):
    cnn = ee.ensemble(TinyCNN, size=2, key=jax.random.key(3))
    common = dict(
        steps=13,
        batch_size=BATCH,
        key=KEY,
        sampling=sampling,
        evaluate=ee.Evaluate(cnn_loss, (IMAGES[:8], Y[:8]), every=4),
        track=[ee.EMA(0.9)],
        callbacks=(),
        execution=ee.Execution(steps_per_dispatch=5),
    )
    looped = ee.fit(
        cnn,
        cnn_loss,
        ADAM,
        (IMAGES, Y),
        **{**common, "execution": ee.Execution(steps_per_dispatch=5, unroll=False)},
    )
    unrolled = ee.fit(
        cnn,
        cnn_loss,
        ADAM,
        (IMAGES, Y),
        **{**common, "execution": ee.Execution(steps_per_dispatch=5, unroll=True)},
    )
    assert_tree_allclose(unrolled.ensemble, looped.ensemble, rtol=1e-5, atol=1e-6)
    assert_tree_allclose(unrolled.tracked[0], looped.tracked[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(
        unrolled.history.losses, looped.history.losses, rtol=1e-5, atol=1e-6
    )
    assert unrolled.history.eval_steps.tolist() == [4, 8, 12]
    np.testing.assert_allclose(
        unrolled.history.eval_scores, looped.history.eval_scores, rtol=1e-5, atol=1e-6
    )
    np.testing.assert_array_equal(unrolled.best_step, looped.best_step)


def test_convolutions_on_cpu_are_unrolled_only_where_vectorised(monkeypatch):
    # The library lowers a CPU's plain convolutions in the form XLA runs fast
    # inside a loop (`_execution/convolution.py`), not the vectorised
    # members' grouped ones: a tiny CNN stays vectorised and unrolled, larger
    # ones (one member at a time) run in the compiled loop.
    from eqx_ensemble._execution import plan as plan_module
    from eqx_ensemble._training.run import prepare

    cnn = ee.ensemble(TinyCNN, size=2, key=jax.random.key(3))
    common = dict(
        steps=4,
        key=KEY,
        batch_size=BATCH,
        sampling="shared",
        opt_state=None,
        state=None,
        hyper=None,
        evaluate=None,
        checkpoints=None,
        track=(),
        callbacks=(),
        execution=ee.Execution(),
    )
    cpu = jax.default_backend() == "cpu"
    run = prepare(cnn, cnn_loss, ADAM, (IMAGES, Y), **common)
    assert run.chunk.unrolled == cpu and run.chunk.member_chunk is None
    monkeypatch.setattr(plan_module, "GROUP_MIN_FLOPS", 0.0)

    def other_loss(model, batch, key):  # (plans are kept per loss)
        return cnn_loss(model, batch, key)

    run = prepare(cnn, other_loss, ADAM, (IMAGES, Y), **common)
    assert not run.chunk.unrolled and run.chunk.counted == cpu
    assert run.chunk.member_chunk == (1 if cpu else None)
    mlp = ee.ensemble(make_mlp, size=2, key=jax.random.key(3))
    assert not prepare(mlp, mse_loss, ADAM, (X, Y), **common).chunk.unrolled


def test_unrolled_run_is_one_program_of_one_step_for_any_length(monkeypatch):
    # An unrolled dispatch is a loop on the host of calls of one compiled step:
    # a run of another `steps=` or with a callback's stops compiles nothing
    # new, the calls gather indices drawn once per dispatch (no permutation of
    # the data in the step), and a run is bit for bit the same whatever its
    # dispatches.
    from test_compile_once import compilations

    from eqx_ensemble._training import loop as loop_module

    traces, draws = [], []
    unrolled, drawers = loop_module._unrolled, loop_module._drawers

    def tracing(chunk, *args):
        traces.append(type(chunk.batches).__name__)
        return unrolled(chunk, *args)

    class Drawers:
        def call(self, *args):
            draws.append(args[2])  # the rows drawn: the plan's dispatch length
            return drawers.call(*args)

    monkeypatch.setattr(loop_module, "_unrolled", tracing)
    monkeypatch.setattr(loop_module, "_drawers", Drawers())
    cnn = ee.ensemble(TinyCNN, size=2, key=jax.random.key(3))

    class Stops(ee.Callback):  # a user's callback that ends dispatches at 2, 7
        def next_stop(self, done):
            return next((stop for stop in (2, 7) if stop > done), None)

    def run(steps, callbacks=(), **execution):
        return ee.fit(
            cnn, cnn_loss, ADAM, (IMAGES, Y), steps=steps, batch_size=BATCH,
            key=KEY, callbacks=callbacks,
            execution=ee.Execution(unroll=True, **execution),
        )  # fmt: skip

    whole = run(9)
    assert traces == ["IndexedBatches"] and len(draws) == 1
    short = []
    assert compilations(lambda: short.append(run(5))) == 0
    stopped = []
    assert compilations(lambda: stopped.append(run(9, callbacks=[Stops()]))) == 0
    assert traces == ["IndexedBatches"] and draws == draws[:1] * 5  # 1 + 1 + 3
    in_pairs = run(9, steps_per_dispatch=2)  # fewer rows drawn: one more trace
    assert len(draws) == 5 + 5
    for other in (stopped[0], in_pairs):
        assert tree_equal(other.ensemble, whole.ensemble)
        assert tree_equal(other.opt_state, whole.opt_state)
        np.testing.assert_array_equal(other.history.losses, whole.history.losses)
    np.testing.assert_array_equal(short[0].history.losses, whole.history.losses[:5])


def test_unrolled_stream_equals_make_step_loop():
    cnn = ee.ensemble(TinyCNN, size=2, key=jax.random.key(3))
    rng = np.random.default_rng(0)
    batches = [(IMAGES[i], Y[i]) for i in (rng.integers(0, N, BATCH) for _ in range(7))]
    result = ee.fit(
        cnn,
        cnn_loss,
        ADAM,
        iter(batches),
        steps=7,
        key=KEY,
        callbacks=(),
        execution=ee.Execution(steps_per_dispatch=3, unroll=True),
    )
    expected, _, _, losses, _ = reference_loop(cnn, cnn_loss, ADAM, batches)
    assert_tree_allclose(result.ensemble, expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(result.history.losses, losses, rtol=1e-5, atol=1e-6)


def test_step_profile_reads_convolutions_and_batched_matmuls():
    from eqx_ensemble._training.loss import profile_step

    cnn = ee.ensemble(TinyCNN, size=2, key=jax.random.key(3))
    batch = (IMAGES[:4], Y[:4])
    assert profile_step(cnn_loss, cnn[0], batch).convolutions
    assert not profile_step(cnn_loss, cnn[0], batch).batched_dots

    attention = eqx.nn.MultiheadAttention(2, 4, key=jax.random.key(0))

    def attention_loss(model, batch, key):
        x = batch  # (tokens, 4)
        return jnp.mean(model(x, x, x) ** 2)

    profile = profile_step(attention_loss, attention, jnp.ones((5, 4)))
    assert profile.batched_dots and not profile.convolutions
    mlp = ee.ensemble(make_mlp, size=2, key=jax.random.key(3))
    # No convolution, no batched matmul; the matmuls' FLOPs in closed form (a
    # 2-8-1 MLP on N examples).
    dot_flops = 2.0 * N * (2 * 8 + 8 * 1)
    profile = profile_step(mse_loss, mlp[0], (X, Y))
    assert profile[:4] == (False, False, 0.0, dot_flops)
    # The values as written, in closed form on a loss of two operations and a
    # sum, and a scan's body counted once per iteration (as its FLOPs).
    from eqx_ensemble._execution.profile import profile_jaxpr

    def tanh_dot(x, w):
        return jnp.sum(jnp.tanh(x @ w))

    x, w = jnp.ones((N, 8)), jnp.ones((8, 16))
    written = profile_jaxpr(jax.make_jaxpr(tanh_dot)(x, w).jaxpr).intermediate_bytes
    assert written == 4 * (2 * N * 16 + 1)  # float32: x @ w, tanh, the sum

    def scanned(x, w):
        start = jnp.zeros((), jnp.float32)
        return jax.lax.scan(lambda c, _: (c + tanh_dot(x, w), None), start, None, 5)[0]

    looped = profile_jaxpr(jax.make_jaxpr(scanned)(x, w).jaxpr).intermediate_bytes
    # A scatter's combiner is a jaxpr in its parameters, not a body it calls:
    # its output (N x 16 floats) is counted beside the zeros it adds into.
    rows = jnp.arange(N) % 4

    def scattered(v):
        return jnp.zeros((N, 16)).at[rows].add(v)

    summed = profile_jaxpr(jax.make_jaxpr(scattered)(x @ w).jaxpr).intermediate_bytes
    assert summed >= 2 * 4 * N * 16
    assert looped == 5 * (written + 4) + 4  # each trip adds to the carry; the result


@pytest.mark.skipif(not ON_CPU, reason="compiler options are chosen on a CPU only")
def test_batched_matmuls_keep_xla_defaults():
    from eqx_ensemble._execution.compile import (
        EIGEN_DOTS,
        cpu_codegen_options,
        step_compiler_options,
    )
    from eqx_ensemble._training.placement import SINGLE_DEVICE

    big = ee.ensemble(
        lambda k: eqx.nn.MLP(256, 256, 256, 2, key=k), size=8, key=jax.random.key(0)
    )
    options = step_compiler_options(None, big.members, 256, 8, SINGLE_DEVICE)
    fast = cpu_codegen_options()
    if dict(options) != dict(fast):  # a multi-core CPU with the option available
        assert dict(options) == EIGEN_DOTS | dict(fast)
    assert step_compiler_options(None, big.members, 256, 8, SINGLE_DEVICE, True) == fast


def test_latest_reads_back_a_run_with_hyper(ens, tmp_path):
    hyper = {"decay": jnp.array([0.0, 0.01, 0.1])}
    run = ee.Checkpoints(tmp_path)
    result = ee.fit(
        ens,
        decayed_loss,
        ADAM,
        (X, Y),
        steps=3,
        batch_size=BATCH,
        key=KEY,
        hyper=hyper,
        checkpoints=run,
        callbacks=(),
    )
    latest = run.latest(ens, ADAM, hyper=hyper)
    assert latest is not None and latest.step == 3
    assert tree_equal(latest.ensemble, result.ensemble)
    assert tree_equal(latest.train_state.hyper, hyper)


@pytest.mark.parametrize("sampling", ["shared", "bootstrap"])
def test_swa_equals_the_mean_of_the_weights_at_the_chosen_steps(ens, sampling):
    weights = {}

    def keep(result):
        weights[result.step] = eqx.filter(result.ensemble, eqx.is_inexact_array)

    result = ee.fit(
        ens,
        mse_loss,
        ADAM,
        (X, Y),
        steps=12,
        batch_size=BATCH,
        key=KEY,
        sampling=sampling,
        track=[ee.SWA(start=5, every=3)],
        callbacks=[keep],
        execution=ee.Execution(steps_per_dispatch=1),
    )
    chosen = [weights[s] for s in (5, 8, 11)]
    mean = jax.tree.map(lambda *ws: sum(ws) / len(ws), *chosen)
    assert_tree_allclose(
        eqx.filter(result.tracked[0], eqx.is_inexact_array),
        mean,
        rtol=1e-5,
        atol=1e-6,
    )


def test_swa_that_starts_after_the_last_step_is_refused(ens):
    with pytest.raises(ValueError, match=r"SWA\(start=20\)` starts after the last"):
        ee.fit(
            ens,
            mse_loss,
            ADAM,
            (X, Y),
            steps=10,
            batch_size=BATCH,
            key=KEY,
            track=[ee.SWA(start=20)],
            callbacks=(),
        )


# -------------------------------------------------------------------------------
# The host path of a fit call (issue 25: nothing on it but the work)
# -------------------------------------------------------------------------------


def test_a_fit_call_builds_no_bound_method_modules(ens, tmp_path, monkeypatch):
    # Equinox builds a `BoundMethod` module for every method read on a module
    # (about 17 us each on a CPU); fit reads its components' methods (sampling,
    # evaluation, trackers, controllers, progress, loggers, checkpoints) as plain
    # methods, several times per call and per dispatch.
    from equinox._module._prebuilt import BoundMethod

    built = []
    original = BoundMethod.__post_init__

    def record(self):
        built.append(self.__func__.__qualname__)
        original(self)

    monkeypatch.setattr(BoundMethod, "__post_init__", record)

    def run(folder):
        return ee.fit(
            ens,
            mse_loss,
            ADAM,
            (X, Y),
            steps=6,
            batch_size=BATCH,
            key=KEY,
            sampling=ee.Bootstrap(),
            evaluate=ee.Evaluate(mse_loss, (X[:16], Y[:16]), every=2),
            track=[ee.EMA(0.9)],
            checkpoints=ee.Checkpoints(tmp_path / folder, every=3),
            callbacks=[
                ee.ProgressBar(),
                ee.CSVLogger(tmp_path / folder / "logs"),
                ee.EarlyStopping(2, patience=100),
            ],
            execution=ee.Execution(steps_per_dispatch=2),
        )

    run("first")  # traces and compiles (tracing may read methods: once)
    built.clear()
    result = run("second")
    assert result.step == 6
    assert built == [], built
    # The components are modules still: pytrees with Equinox's fields.
    component = ee.Evaluate(mse_loss, (X[:16], Y[:16]), every=2)
    assert isinstance(component, eqx.Module)
    assert len(jax.tree.leaves(eqx.filter(component, eqx.is_array))) == 2
    assert isinstance(ee.Shared().check, type(component.check))


def test_a_loss_checked_once_is_still_checked_for_other_calls(ens, bn):
    # A loss's signature is read once per way of calling it (stateful, hyper):
    # a loss accepted without a state is still refused with one.
    ee.fit(
        ens, mse_loss, ADAM, (X, Y), steps=1, batch_size=BATCH, key=KEY, callbacks=()
    )
    _, state = bn
    for extra, message in (
        ({"state": state}, "A model state was given"),
        ({"hyper": {"decay": jnp.zeros(SIZE)}}, "`hyper=` was given"),
    ):
        for _ in range(2):
            with pytest.raises(TypeError, match=message):
                ee.fit(
                    ens,
                    mse_loss,
                    ADAM,
                    (X, Y),
                    steps=1,
                    batch_size=BATCH,
                    key=KEY,
                    callbacks=(),
                    **extra,
                )


def test_a_run_of_one_dispatch_equals_a_checkpointed_run_and_donates_nothing(
    ens, tmp_path
):
    # The start state is its own call before the first dispatch in every run
    # (one dispatch program for runs with and without checkpoints, counted in
    # test_compile_once.py): the same bits either way, and the caller's arrays
    # are not donated.
    opt_state = ee.init_optimizer(
        optax.inject_hyperparams(optax.adam)(learning_rate=1e-2),
        ens,
        hyperparams={"learning_rate": jnp.array([1e-2, 2e-2, 5e-3])},
    )

    def run(**kwargs):
        return ee.fit(
            ens,
            mse_loss,
            optax.inject_hyperparams(optax.adam)(learning_rate=1e-2),
            (X, Y),
            steps=6,
            batch_size=BATCH,
            key=KEY,
            sampling=ee.Bootstrap(),
            opt_state=opt_state,
            evaluate=ee.Evaluate(mse_loss, (X[:16], Y[:16]), every=2),
            track=[ee.EMA(0.9)],
            callbacks=(),
            **kwargs,
        )

    merged = run()
    separate = run(checkpoints=ee.Checkpoints(tmp_path / "run", every=6))
    for name in ("ensemble", "opt_state", "best_ensemble", "tracked"):
        for a, b in zip(
            jax.tree.leaves(getattr(merged, name)),
            jax.tree.leaves(getattr(separate, name)),
            strict=True,
        ):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(merged.history.losses, separate.history.losses)
    np.testing.assert_array_equal(
        merged.history.eval_scores, separate.history.eval_scores
    )
    # Nothing given was donated: the ensemble and optimizer state still read.
    assert np.isfinite(np.asarray(ens.members.layers[0].weight)).all()
    assert np.isfinite(np.asarray(jax.tree.leaves(opt_state)[0])).all()


@pytest.mark.parametrize(
    "mesh_kind",
    [
        None,
        pytest.param("Auto", marks=needs_devices(4)),
        pytest.param("Explicit", marks=needs_devices(4)),
    ],
)
@pytest.mark.parametrize("evaluated", [False, True])
def test_readout_round_trip_is_exact(evaluated, mesh_kind):
    """The one array the host reads after a dispatch gives back the losses
    (NaN, a NaN with a payload and inf included: bit for bit), scores and the
    members' step counts exactly, and is replicated on a mesh whatever the
    parts' placement (members split)."""
    from eqx_ensemble._training.loop import readout, unpack_readout
    from eqx_ensemble._training.placement import placement_of

    steps, size = 3, 4
    losses = jax.random.normal(jax.random.key(0), (steps, size))
    payload = jnp.asarray(np.int32(0x7FC00123).view(np.float32))
    losses = losses.at[0, 1].set(jnp.nan).at[2, 3].set(-jnp.inf)
    losses = losses.at[1, 0].set(payload)
    assert np.asarray(losses)[1, 0].view(np.int32) == 0x7FC00123
    scores = jax.random.normal(jax.random.key(1), (steps, size)) if evaluated else None
    diverged = jnp.array([-1, 0, 2**24 + 1, 2**31 - 1], jnp.int32)
    stopped = jnp.array([7, -1, -1, 123_456_789], jnp.int32)
    mesh = None
    if mesh_kind is not None:
        axis_type = getattr(jax.sharding.AxisType, mesh_kind)
        mesh = jax.make_mesh((4,), ("members",), axis_types=(axis_type,))
        split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("members"))
        diverged, stopped = jax.device_put((diverged, stopped), split)
        rows = jax.sharding.NamedSharding(
            mesh, jax.sharding.PartitionSpec(None, "members")
        )
        losses, scores = jax.device_put((losses, scores), rows)
    placement = placement_of(mesh)
    with placement.context():
        out = jax.jit(readout, static_argnums=4)(
            losses, scores, diverged, stopped, placement
        )
    assert out.dtype == jnp.int32 and out.ndim == 1
    assert out.sharding.is_fully_replicated
    got = unpack_readout(np.asarray(out), size, evaluated)
    assert got.losses.dtype == np.float32
    np.testing.assert_array_equal(
        got.losses.view(np.int32), np.asarray(losses).view(np.int32)
    )
    if evaluated:
        np.testing.assert_array_equal(got.scores, np.asarray(scores))
    else:
        assert got.scores is None
    for have, want in ((got.diverged_at, diverged), (got.stopped_at, stopped)):
        assert have.dtype == np.int32
        np.testing.assert_array_equal(have, np.asarray(want))
    # A length that is not whole steps of this many members is refused.
    with pytest.raises(ValueError, match="readout of"):
        unpack_readout(np.asarray(out)[1:], size, evaluated)
    if not evaluated:  # (read as evaluated, 20 values are 1.5 steps)
        with pytest.raises(ValueError, match="readout of"):
            unpack_readout(np.asarray(out), size, True)


# ----------------------------------------- resuming, streams failing, checks early


def _failing_stream(good, fail_at, how):
    def stream():
        for position, batch in enumerate(good):
            if position == fail_at:
                if how == "raise":
                    raise OSError("the loader's disk went away")
                yield batch[0][:5], batch[1][:5]  # another shape
            yield batch

    return stream()


@pytest.mark.parametrize(
    "other",
    [
        optax.adam(1e-1),  # another learning rate
        optax.sgd(1e-2),  # another transformation
        optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2)),
    ],
    ids=["learning-rate", "transformation", "chain"],
)
def test_resume_with_another_optimizer_is_refused(ens, tmp_path, other):
    common = dict(steps=4, batch_size=BATCH, key=KEY, callbacks=())
    run = ee.Checkpoints(tmp_path, every=2)
    ee.fit(ens, mse_loss, optax.adam(1e-2), (X, Y), checkpoints=run, **common)
    with pytest.raises(ee.CheckpointError, match="different optimizer"):
        ee.fit(ens, mse_loss, other, (X, Y), checkpoints=run, **{**common, "steps": 6})
    # The same optimizer, built anew, resumes.
    resumed = ee.fit(
        ens,
        mse_loss,
        optax.adam(1e-2),
        (X, Y),
        checkpoints=run,
        **{**common, "steps": 6},
    )
    assert resumed.step == 6 and resumed.resumed_from == 4


# A stream that fails mid-run keeps the dispatch that ran.


@pytest.mark.parametrize("how", ["raise", "shape"])
def test_stream_failure_keeps_the_finished_dispatch(ens, tmp_path, how):
    good = shared_batches(12)
    run = ee.Checkpoints(tmp_path, every=4)
    error = OSError if how == "raise" else ValueError
    with pytest.raises(error) as raised:
        ee.fit(
            ens,
            mse_loss,
            optax.adam(1e-2),
            _failing_stream(good, 6, how),
            steps=12,
            key=KEY,
            checkpoints=run,
            callbacks=(),
            execution=ee.Execution(steps_per_dispatch=4),
        )
    # Steps 0-3 ran; the read of the next group failed while they ran: they are
    # recorded and checkpointed, and the error carries them.
    result = raised.value.result  # type: ignore[attr-defined]
    assert result.step == 4 and result.history.losses.shape == (4, SIZE)
    assert [step for step, _ in ee.list_checkpoints(tmp_path)] == [4]


# Checks that can be made before any work are made there.


def test_evaluation_period_is_bounded_and_named(ens):
    with pytest.raises(ValueError, match=r"`Evaluate.every` must be at most"):
        ee.Evaluate(mse_loss, (X, Y), every=2**40)
    with pytest.raises(ValueError, match=r"`Checkpoints.every` must be at most"):
        ee.Checkpoints("unused", every=2**40)
    with pytest.raises(ValueError, match=r"`steps` must be at most"):
        ee.fit(ens, mse_loss, optax.sgd(0.1), (X, Y), steps=2**40, batch_size=BATCH,
               key=KEY, callbacks=())  # fmt: skip


def test_pbt_with_a_sparser_evaluation_is_refused_before_work(ens):
    opt = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
    calls = []
    with pytest.raises(ValueError, match=r"`ee.Evaluate\(every=3\)` evaluates less"):
        ee.fit(
            ens,
            mse_loss,
            opt,
            (X, Y),
            steps=8,
            batch_size=BATCH,
            key=KEY,
            evaluate=ee.Evaluate(mse_loss, (X, Y), every=3),
            callbacks=[ee.PBT(every=2), calls.append],
        )
    assert calls == []


# fit says when it resumes.


def test_resumed_run_says_so(ens, tmp_path, monkeypatch):
    common = dict(batch_size=BATCH, key=KEY, checkpoints=ee.Checkpoints(tmp_path))
    first = ee.fit(ens, mse_loss, optax.sgd(0.1), (X, Y), steps=3, callbacks=(),
                   **common)  # fmt: skip
    assert first.resumed_from is None
    descriptions = []

    class Recording(ee.ProgressMeter):
        def start(self, total, done, resumed):
            descriptions.append((total, done, resumed))
            return None

        def update(self, handle, done, losses, diverged_at):
            pass

    more = ee.fit(ens, mse_loss, optax.sgd(0.1), (X, Y), steps=5,
                  callbacks=[Recording()], **common)  # fmt: skip
    assert more.resumed_from == 3 and descriptions == [(5, 3, True)]
    # The default bar's description says so too.
    stream = io.StringIO()
    from tqdm import tqdm

    monkeypatch.setattr(
        "tqdm.auto.tqdm", lambda *a, **k: tqdm(*a, **{**k, "file": stream})
    )
    ee.fit(ens, mse_loss, optax.sgd(0.1), (X, Y), steps=6,
           callbacks=[ee.ProgressBar()], **common)  # fmt: skip
    assert "fit (resumed at step 5)" in stream.getvalue()


# ------------- exact resume on the CPU's default path for convolutions; its plan


# 32 images (IMAGES above: 48), the targets their means.
SMALL_IMAGES = np.asarray(
    jax.random.normal(jax.random.key(1), (32, 1, 4, 4)), np.float32
)
SMALL_TARGETS = SMALL_IMAGES.mean(axis=(1, 2, 3))[:, None]


class Interrupt(Exception):
    pass


def test_default_unrolled_run_resumes_bit_for_bit(tmp_path):
    cnns = ee.ensemble(TinyCNN, size=2, key=jax.random.key(3))
    common = dict(steps=7, batch_size=8, key=KEY)
    whole = ee.fit(cnns, mse_loss, optax.adam(1e-2), (SMALL_IMAGES, SMALL_TARGETS),
                   callbacks=(), **common)  # fmt: skip

    def stop_at_three(result):
        if result.step >= 3:
            raise Interrupt

    run = ee.Checkpoints(tmp_path, every=1)
    with pytest.raises(Interrupt):
        ee.fit(cnns, mse_loss, optax.adam(1e-2), (SMALL_IMAGES, SMALL_TARGETS),
               checkpoints=run, callbacks=[stop_at_three], **common)  # fmt: skip
    resumed = ee.fit(cnns, mse_loss, optax.adam(1e-2), (SMALL_IMAGES, SMALL_TARGETS),
                     checkpoints=run, callbacks=(), **common)  # fmt: skip
    assert resumed.resumed_from == 3
    assert bool(tree_equal(resumed.ensemble, whole.ensemble))
    np.testing.assert_array_equal(resumed.history.losses, whole.history.losses)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="a CPU plan")
def test_plan_weighs_compile_time_against_the_run_length():
    from eqx_ensemble._training.placement import SINGLE_DEVICE
    from eqx_ensemble._training.run import plan_fit
    from eqx_ensemble._training.sampling import Shared
    from eqx_ensemble._training.source import ArraySource

    cnns = ee.ensemble(TinyCNN, size=2, key=jax.random.key(3))
    source = ArraySource((SMALL_IMAGES, SMALL_TARGETS), Shared(), 8, 2)

    def plan(steps):
        return plan_fit(
            ee.Execution(), mse_loss, cnns, len(cnns), source, None, None,
            SINGLE_DEVICE, steps,
        )  # fmt: skip

    short, long = plan(20), plan(2**30)  # a tiny CNN: only a very long run
    # Convolutions vectorised (a tiny CNN: grouped convolutions): unrolled, a
    # dispatch a loop on the host of calls of one compiled step; member by
    # member (plain convolutions, lowered in the form XLA runs fast in
    # loops, `_execution/convolution.py`): a compiled loop over a traced
    # trip count. As long whatever the run's length (one program, exact
    # resume).
    assert short.unroll and not long.unroll and long.counted
    assert short.length == long.length > 20
    # The member-by-member layout compiles a copy per member: runs whose
    # convolutions repay that only (`test_layout.py` checks the boundary).
    assert short.layout == "vmap" and long.layout == "sequential"


# ------------------ the keywords `execution=` and `callbacks=` replaced; errors


@pytest.mark.parametrize(
    "call, keyword, replacement",
    [
        ("fit", "steps_per_dispatch", "execution=ee.Execution(steps_per_dispatch"),
        ("fit", "mesh", "execution=ee.Execution(mesh"),
        ("fit", "progress", "callbacks=()"),
        ("fit", "controllers", "callbacks=[controller"),
        ("fit", "hyperparams", "opt_state=ee.init_optimizer"),
        ("make_step", "compiler_options", "execution=ee.Execution(compiler_options"),
        ("map", "layout", "execution=ee.Execution(layout"),
        ("predict", "layout", "execution=ee.Execution(layout"),
    ],
)
def test_moved_keywords_name_their_replacement(ens, call, keyword, replacement):
    calls = {
        "fit": lambda **kw: ee.fit(ens, mse_loss, optax.sgd(0.1), (X, Y), steps=2,
                                   batch_size=BATCH, key=KEY, **kw),
        "make_step": lambda **kw: ee.make_step(mse_loss, optax.sgd(0.1), **kw),
        "map": lambda **kw: ee.map(lambda m, x: m(x), ens, X[0], **kw),
        "predict": lambda **kw: ee.predict(ens, X, **kw),
    }  # fmt: skip
    with pytest.raises(TypeError, match=rf"no longer takes `{keyword}=`") as raised:
        calls[call](**{keyword: None})
    assert replacement in str(raised.value)
    # The replacement works (the default execution, no bar).
    if call == "fit":
        assert calls[call](callbacks=(), execution=ee.Execution()).step == 2


def test_execution_refuses_fields_a_function_does_not_use():
    with pytest.raises(ValueError, match="`ee.map` does not use `Execution.unroll`"):
        ee.map(lambda m, x: m(x), ee.ensemble(make_mlp, size=2, key=KEY), X[0],
               execution=ee.Execution(unroll=True))  # fmt: skip
    with pytest.raises(ValueError, match=r"`Execution.steps_per_dispatch` must be"):
        ee.Execution(steps_per_dispatch=0)


# Errors that say what to do.


def _fit_short(ens, loss, **kwargs):
    return ee.fit(
        ens, loss, optax.sgd(0.1), (X, Y), steps=2, batch_size=BATCH, key=KEY,
        callbacks=(), **kwargs,
    )  # fmt: skip


def test_an_evaluate_function_of_model_and_data_is_named(ens):
    with pytest.raises(TypeError, match=r"fn\(model, data, key\).*takes a `key`"):
        _fit_short(ens, mse_loss, evaluate=ee.Evaluate(lambda m, d: 0.0, (X, Y), 1))


def test_coupled_losses_with_aux_integers_or_state_are_named(ens):
    def with_aux(e, b, k):
        return jnp.zeros(SIZE), {"extra": 1.0}

    with pytest.raises(TypeError, match="got a tuple; a coupled loss has no `aux`"):
        _fit_short(ens, ee.Coupled(with_aux))
    with pytest.raises(TypeError, match="floating-point losses"):
        _fit_short(ens, ee.Coupled(lambda e, b, k: jnp.zeros(SIZE, jnp.int32)))
    with pytest.raises(TypeError, match=r"does not take a model state.*drop `state=`"):
        _fit_short(
            ens,
            ee.Coupled(lambda e, b, k: jnp.zeros(SIZE)),
            state=jnp.zeros((SIZE, 1)),
        )
