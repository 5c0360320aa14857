"""`ee.WandbLogger`: what it hands W&B (checked against a stand-in `wandb`
module that records every call), and a real offline run where wandb installs."""

import sys
import types

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


def _ens(size=3):
    return ee.ensemble(
        lambda k: eqx.nn.MLP(3, 1, 8, 1, key=k), size=size, key=jax.random.key(0)
    )


class _Run:
    def __init__(self, calls, kwargs):
        self.calls, self.kwargs, self.rows, self.finished = calls, kwargs, [], False
        calls.append(self)

    def log(self, row, step):
        assert not self.rows or step > self.rows[-1][0], "W&B steps must increase"
        self.rows.append((step, dict(row)))

    def finish(self):
        self.finished = True


@pytest.fixture
def fake_wandb(monkeypatch):
    calls: list = []
    module = types.ModuleType("wandb")
    module.init = lambda **kwargs: _Run(calls, kwargs)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "wandb", module)
    return calls


def _fit(callbacks, steps=20, **kwargs):
    return ee.fit(
        _ens(), _loss, optax.adam(1e-2), (X, Y), steps=steps, batch_size=16,
        key=jax.random.key(1), callbacks=callbacks,
        execution=ee.Execution(steps_per_dispatch=7), **kwargs,
    )  # fmt: skip


def test_every_members_loss_and_evaluation_reach_wandb(fake_wandb, tmp_path):
    evaluate = ee.Evaluate(lambda m, b, k: _loss(m, b, k), (X, Y), every=5)
    result = _fit(
        [ee.WandbLogger(project="p", directory=tmp_path, group="g")],
        evaluate=evaluate,
    )
    (run,) = fake_wandb
    assert run.finished
    assert run.kwargs["project"] == "p" and run.kwargs["mode"] == "offline"
    assert run.kwargs["config"]["members"] == 3
    losses = {s: r for s, r in run.rows if "loss/member_0" in r}
    assert sorted(losses) == list(range(1, 21))
    got = np.array([[losses[s][f"loss/member_{i}"] for i in range(3)] for s in losses])
    np.testing.assert_array_equal(got.astype(np.float32), result.history.losses)
    evals = {s: r for s, r in run.rows if "eval/member_0" in r}
    assert sorted(evals) == result.history.eval_steps.tolist()
    np.testing.assert_array_equal(
        np.array([[evals[s][f"eval/member_{i}"] for i in range(3)] for s in evals],
                 np.float32),
        result.history.eval_scores,
    )  # fmt: skip


def test_hyperparameters_and_exploits_reach_wandb(fake_wandb):
    opt = optax.inject_hyperparams(optax.sgd)(learning_rate=0.05)
    ens = _ens(6)
    pbt = ee.PBT(every=10, fraction=0.34)
    result = ee.fit(
        ens, _loss, opt, (X, Y), steps=30, batch_size=16, key=jax.random.key(1),
        opt_state=ee.init_optimizer(
            opt, ens, hyperparams={"learning_rate": np.geomspace(1e-3, 1e-1, 6)}
        ),
        evaluate=ee.Evaluate(lambda m, b, k: _loss(m, b, k), (X, Y), every=10),
        callbacks=[pbt, ee.WandbLogger(mode="disabled")],
    )  # fmt: skip
    (run,) = fake_wandb
    first_step, first = run.rows[0]
    assert first_step == 0
    np.testing.assert_allclose(
        [first[f"hparams/learning_rate/member_{i}"] for i in range(6)],
        np.geomspace(1e-3, 1e-1, 6),
        rtol=1e-6,
    )
    steps, children, parents = pbt.lineage(result)
    logged = [
        (step, int(key.split("_")[-1]), int(value))
        for step, row in run.rows
        for key, value in row.items()
        if key.startswith("exploit/")
    ]
    assert sorted(logged) == sorted(
        zip(steps.tolist(), children.tolist(), parents.tolist(), strict=True)
    )


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="WandbLogger.mode"):
        ee.WandbLogger(mode="cloud")
    with pytest.raises(ValueError, match="WandbLogger.every"):
        ee.WandbLogger(every=0)


def test_a_real_offline_run_writes_its_files(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    _fit([ee.WandbLogger(project="eqx_ensemble_test", directory=tmp_path)], steps=5)
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    (log,) = runs[0].glob("*.wandb")
    assert log.stat().st_size > 0


def test_a_relative_folder_is_the_working_directorys_when_the_run_opens(
    tmp_path, monkeypatch
):
    # W&B's service process starts with the process's first run and keeps the
    # working directory it started in: a relative folder (or none) given to a
    # later run, after a `chdir`, left that run's console log in the first
    # folder and its data file nowhere.
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    monkeypatch.chdir(first)
    _fit([ee.WandbLogger(project="eqx_ensemble_test", directory="logs")], steps=2)
    monkeypatch.chdir(second)
    _fit([ee.WandbLogger(project="eqx_ensemble_test", directory="logs")], steps=2)
    _fit([ee.WandbLogger(project="eqx_ensemble_test")], steps=2)
    for folder in (first / "logs", second / "logs", second):
        (run,) = (folder / "wandb").glob("offline-run-*")
        (log,) = run.glob("*.wandb")
        assert log.stat().st_size > 0, folder
    # Nothing of the later runs in the first folder.
    assert [p.name for p in first.iterdir()] == ["logs"]
    assert len(list((first / "logs" / "wandb").glob("offline-run-*"))) == 1
