"""Exact resume: an interrupted run continued from its checkpoint equals the
uninterrupted run bit for bit (DESIGN.md invariant 4)."""

import subprocess
import sys
from pathlib import Path

import equinox as eqx
import jax
import numpy as np
import pytest
from _resume_worker import problem, train

import eqx_ensemble as ee

WORKER = Path(__file__).with_name("_resume_worker.py")


def _leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(eqx.filter(tree, eqx.is_array))]


def test_resume_after_exception_in_callback_is_bit_exact(tmp_path):
    reference = train(tmp_path / "reference")

    class Interrupt(Exception):
        pass

    ens, loss_fn, optimizer, data = problem()

    def interrupt(result):
        if result.step >= 120:
            raise Interrupt

    with pytest.raises(Interrupt):
        ee.fit(
            ens,
            loss_fn,
            optimizer,
            data,
            steps=200,
            batch_size=16,
            key=jax.random.key(42),
            sampling="bootstrap",
            checkpoints=ee.Checkpoints(tmp_path / "run", every=40),
            callbacks=[interrupt],
            execution=ee.Execution(steps_per_dispatch=30),
        )
    assert [s for s, _ in ee.list_checkpoints(tmp_path / "run")][-1] == 120
    resumed = train(tmp_path / "run")
    assert resumed.step == 200
    for a, b in zip(
        _leaves(resumed.ensemble), _leaves(reference.ensemble), strict=True
    ):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(
        _leaves(resumed.opt_state), _leaves(reference.opt_state), strict=True
    ):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(resumed.history.losses, reference.history.losses)


@pytest.mark.slow
def test_resume_after_sigkill_is_bit_exact(tmp_path):
    def run(directory, kill_at, out):
        proc = subprocess.Popen(
            [sys.executable, str(WORKER), str(directory), str(kill_at), str(out)],
            cwd=WORKER.parent,
        )
        try:
            return proc.wait(timeout=240)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    assert run(tmp_path / "full", -1, tmp_path / "full.npz") == 0
    # Killed (SIGKILL: no cleanup, no finally blocks) after step 120's checkpoint.
    assert run(tmp_path / "run", 120, tmp_path / "never.npz") != 0
    assert not (tmp_path / "never.npz").exists()
    assert [s for s, _ in ee.list_checkpoints(tmp_path / "run")] == [40, 80, 120]
    assert run(tmp_path / "run", -1, tmp_path / "resumed.npz") == 0
    full, resumed = np.load(tmp_path / "full.npz"), np.load(tmp_path / "resumed.npz")
    assert sorted(full.files) == sorted(resumed.files)
    for name in full.files:
        np.testing.assert_array_equal(full[name], resumed[name])


def test_resume_refuses_a_different_run(tmp_path):
    ens, loss_fn, optimizer, data = problem()
    common = dict(
        steps=40, batch_size=16, checkpoints=ee.Checkpoints(tmp_path), callbacks=()
    )
    ee.fit(ens, loss_fn, optimizer, data, key=jax.random.key(1), **common)
    with pytest.raises(ee.CheckpointError, match="different PRNG key"):
        ee.fit(ens, loss_fn, optimizer, data, key=jax.random.key(2), **common)
    with pytest.raises(ee.CheckpointError, match="different `batch_size`"):
        ee.fit(
            ens,
            loss_fn,
            optimizer,
            data,
            key=jax.random.key(1),
            **{**common, "batch_size": 8},
        )
    other = ee.ensemble(
        lambda k: eqx.nn.MLP(1, 1, 16, 2, key=k), size=5, key=jax.random.key(0)
    )
    with pytest.raises(ee.CheckpointError, match="different `size`"):
        ee.fit(other, loss_fn, optimizer, data, key=jax.random.key(1), **common)


def test_resume_continues_to_more_steps(tmp_path):
    # A finished 80-step run extended to 120 steps equals a 120-step run.
    ens, loss_fn, optimizer, data = problem()
    common = dict(
        batch_size=16,
        key=jax.random.key(3),
        callbacks=(),
        execution=ee.Execution(steps_per_dispatch=40),
    )
    straight = ee.fit(ens, loss_fn, optimizer, data, steps=120, **common)
    run = ee.Checkpoints(tmp_path)
    ee.fit(ens, loss_fn, optimizer, data, steps=80, checkpoints=run, **common)
    extended = ee.fit(
        ens, loss_fn, optimizer, data, steps=120, checkpoints=run, **common
    )
    assert extended.step == 120
    for a, b in zip(
        _leaves(extended.ensemble), _leaves(straight.ensemble), strict=True
    ):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(extended.history.losses, straight.history.losses)


def test_checkpoints_keep_the_last_n(tmp_path):
    ens, loss_fn, optimizer, data = problem()
    ee.fit(
        ens,
        loss_fn,
        optimizer,
        data,
        steps=100,
        batch_size=16,
        key=jax.random.key(0),
        checkpoints=ee.Checkpoints(tmp_path, every=20, keep=2),
        callbacks=(),
        execution=ee.Execution(steps_per_dispatch=10),
    )
    assert [s for s, _ in ee.list_checkpoints(tmp_path)] == [80, 100]


def test_checkpoint_arguments_are_checked(tmp_path):
    with pytest.raises(ValueError, match="`Checkpoints.every` must be at least 1"):
        ee.Checkpoints(tmp_path, every=0)
    with pytest.raises(ValueError, match="`Checkpoints.keep` must be at least 1"):
        ee.Checkpoints(tmp_path, keep=0)
