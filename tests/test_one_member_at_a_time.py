"""A short convolving run on a CPU steps its members one at a time in a loop
(the plan's `member_chunk=1`: a `jax.lax.map` over the members inside the
dispatch's compiled loop): each member's convolutions are plain ones, not the
vectorised members' grouped convolution, and the program's compile time does
not grow with the members.

Each member must compute what the sequential layout computes (the same
member's plain step, to float32 rounding), with its own keys and its own
batches (`Independent` sampling), evaluation, trackers and model state; a
diverging member must leave the others bit for bit as in a clean run; a
resumed run must equal the uninterrupted one bit for bit; one program serves
every dispatch; and the rule must apply only where members share nothing.
The test models are tiny: `GROUP_MIN_FLOPS` is lowered for them.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import ON_CPU, assert_tree_allclose, repeat
from test_layout import CNN, stateful_loss, xent

import eqx_ensemble as ee
from eqx_ensemble._execution import plan as _plan
from eqx_ensemble._execution.layout import (
    SEQUENTIAL_MAX_MEMBERS,
    SEQUENTIAL_MIN_RUN_FLOPS,
)
from eqx_ensemble._execution.profile import StepProfile
from eqx_ensemble._training import loop as _loop, run as _run
from eqx_ensemble._training.inputs import independent_members
from eqx_ensemble._training.placement import SINGLE_DEVICE

pytestmark = pytest.mark.skipif(not ON_CPU, reason="a CPU plan")

SIZE = 3
# The sequential layout against one member at a time: the same member's step
# in two programs (XLA may fuse it otherwise: float32 rounding).
TOL = {"rtol": 2e-5, "atol": 2e-6}


def loss_fn(model, batch, key):
    x, y = batch
    # The key is used: each member's must be its own (a dropout-like noise).
    noise = 1e-3 * jax.random.normal(key, x.shape)
    return xent(jax.vmap(model)(x + noise), y)


KEY = jax.random.key(1)
X = jax.random.normal(KEY, (48, 1, 4, 4))
Y = jax.random.randint(jax.random.fold_in(KEY, 1), (48,), 0, 3)


@pytest.fixture
def planned(monkeypatch):
    """Plan the test's tiny CNNs one at a time, and record each dispatch's
    chunk."""
    monkeypatch.setattr(_plan, "GROUP_MIN_FLOPS", 0.0)
    chunks = []
    dispatch = _run.dispatch_chunk

    def spy(options, chunk, train_state, *steps):
        chunks.append(chunk)
        return dispatch(options, chunk, train_state, *steps)

    monkeypatch.setattr(_run, "dispatch_chunk", spy)
    return chunks


@pytest.fixture
def traced(monkeypatch):
    """The dispatches' programs traced: one entry per trace of `run_chunk`."""
    traces = []
    run_chunk = _loop.run_chunk

    def counting(chunk, train_state):
        traces.append(chunk.member_chunk)
        return run_chunk(chunk, train_state)

    monkeypatch.setattr(_loop, "run_chunk", counting)
    return traces


def _one_at_a_time(chunks):
    """Every recorded dispatch ran its members one at a time in its compiled
    loop (not unrolled, not in calls per member)."""
    return {(c.layout, c.member_chunk, c.unrolled, c.counted) for c in chunks} == {
        ("vmap", 1, False, True)
    }


def _fit(loss, ens, steps=4, layout=None, **kwargs):
    kwargs.setdefault("callbacks", ())
    return ee.fit(
        ens, loss, optax.adam(1e-2), (X, Y), steps=steps, batch_size=8,
        key=jax.random.key(3),
        execution=ee.Execution(layout=layout) if layout else None, **kwargs,
    )  # fmt: skip


def _assert_equal(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        if eqx.is_array(x):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("sampling", [repeat("shared"), "independent"])
def test_one_at_a_time_equals_the_sequential_layout(planned, traced, sampling):
    ens = ee.ensemble(CNN, size=SIZE, key=jax.random.key(0))
    components = dict(
        sampling=sampling,
        evaluate=ee.Evaluate(loss_fn, (X[:16], Y[:16]), every=2),
        track=[ee.EMA(0.9), ee.SWA(start=2)],
    )
    result = _fit(loss_fn, ens, **components)
    assert _one_at_a_time(planned)
    # One program for every member and step: traced once.
    assert traced == [1]
    planned.clear()
    reference = _fit(loss_fn, ens, layout="sequential", **components)
    assert {c.member_chunk for c in planned} == {None}
    assert_tree_allclose(result.ensemble, reference.ensemble, **TOL)
    assert_tree_allclose(result.opt_state, reference.opt_state, **TOL)
    assert_tree_allclose(result.best_ensemble, reference.best_ensemble, **TOL)
    assert_tree_allclose(result.tracked, reference.tracked, **TOL)
    np.testing.assert_allclose(result.history.losses, reference.history.losses, **TOL)
    np.testing.assert_allclose(
        result.history.eval_scores, reference.history.eval_scores, **TOL
    )
    np.testing.assert_array_equal(result.best_step, reference.best_step)
    # The members differ (their own keys and, independent, batches).
    assert len(set(np.asarray(result.history.losses[-1]).tolist())) == SIZE


def test_model_state_and_hyperparameters_per_member(planned, traced):
    ens, state = ee.ensemble(
        lambda k: eqx.nn.make_with_state(CNN)(k, norm=True),
        size=SIZE,
        key=jax.random.key(0),
    )
    opt = optax.inject_hyperparams(optax.adam)(learning_rate=1e-2)
    rates = {"learning_rate": jnp.array([1e-2, 3e-2, 1e-1])}

    def fit(layout=None):
        return ee.fit(
            ens, stateful_loss, opt, (X, Y), steps=3, batch_size=8,
            key=jax.random.key(3), state=state, callbacks=(),
            sampling="bootstrap",
            opt_state=ee.init_optimizer(opt, ens, hyperparams=rates),
            execution=ee.Execution(layout=layout) if layout else None,
        )  # fmt: skip

    result = fit()
    assert _one_at_a_time(planned)
    assert traced == [1]
    reference = fit("sequential")
    assert_tree_allclose(result.ensemble, reference.ensemble, **TOL)
    assert_tree_allclose(result.state, reference.state, **TOL)
    np.testing.assert_allclose(result.history.losses, reference.history.losses, **TOL)


def test_a_diverging_member_leaves_the_others_bit_for_bit(planned):
    ens = ee.ensemble(CNN, size=SIZE, key=jax.random.key(0))
    clean = _fit(loss_fn, ens)
    weight = ens.members.out.weight
    broken = eqx.tree_at(
        lambda e: e.members.out.weight, ens, weight.at[1, 0, 0].set(jnp.nan)
    )
    result = _fit(loss_fn, broken)
    assert _one_at_a_time(planned)
    assert result.diverged == {1: 1}
    # The failing member keeps its last finite weights: its start.
    _assert_equal(result.ensemble[1].conv1, broken[1].conv1)
    for i in (0, 2):
        _assert_equal(result.ensemble[i], clean.ensemble[i])
        np.testing.assert_array_equal(
            result.history.losses[:, i], clean.history.losses[:, i]
        )


def test_a_resumed_run_equals_the_uninterrupted_one_bit_for_bit(planned, tmp_path):
    ens = ee.ensemble(CNN, size=SIZE, key=jax.random.key(0))
    kwargs = dict(
        steps=6, sampling="independent", track=[ee.EMA(0.9)],
        evaluate=ee.Evaluate(loss_fn, (X[:16], Y[:16]), every=2),
    )  # fmt: skip
    straight = _fit(loss_fn, ens, **kwargs)

    class Stop(Exception):
        pass

    def interrupt(result):
        if result.step >= 3:
            raise Stop

    folder = tmp_path / "run"
    with pytest.raises(Stop):
        _fit(
            loss_fn, ens, callbacks=[interrupt],
            checkpoints=ee.Checkpoints(folder, every=3), **kwargs,
        )  # fmt: skip
    resumed = _fit(loss_fn, ens, checkpoints=ee.Checkpoints(folder, every=3), **kwargs)
    assert resumed.resumed_from == 3
    assert _one_at_a_time(planned)
    for name in ("ensemble", "opt_state", "best_ensemble", "tracked"):
        _assert_equal(getattr(resumed, name), getattr(straight, name))
    for name in ("losses", "eval_scores"):
        np.testing.assert_array_equal(
            getattr(resumed.history, name), getattr(straight.history, name)
        )


def test_the_rule(monkeypatch):
    members = ee.ensemble(CNN, size=SIZE, key=jax.random.key(0)).members

    def plan(steps=20, flops=1e8, groupable=True, size=SIZE, **settings):
        return _plan.plan_step(
            ee.Execution(**settings),
            lambda: StepProfile(convolutions=True, convolution_flops=flops),
            owner=None,
            structure=None,
            members=members,
            examples=8,
            size=size,
            placement=SINGLE_DEVICE,
            steps=steps,
            groupable=groupable,
        )

    short = plan()
    assert (short.layout, short.member_chunk, short.unroll) == ("vmap", 1, False)
    assert short.counted
    # Long enough for the sequential layout's compile time: every member in
    # one program, straight-line, in the same compiled loop.
    long_steps = int(SEQUENTIAL_MIN_RUN_FLOPS / (SIZE * 1e8)) * 2
    long = plan(steps=long_steps)
    assert (long.layout, long.member_chunk, long.unroll) == ("sequential", None, False)
    # More members than the sequential layout takes: one at a time whatever
    # the run's length (a program of one member compiles alike for any count).
    many = SEQUENTIAL_MAX_MEMBERS + 1
    for steps in (20, long_steps):
        assert plan(steps=steps, size=many).member_chunk == 1
    # Small convolutions, members that share something, a step per call, the
    # user's layout or chunks: not one at a time.
    assert plan(flops=1e6).member_chunk is None and plan(flops=1e6).layout == "vmap"
    assert plan(groupable=False).member_chunk is None
    assert plan(steps=None).member_chunk is None
    for settings in ({"layout": "vmap"}, {"layout": "sequential"}):
        assert plan(**settings).member_chunk is None
    assert plan(member_chunk=3).member_chunk == 3
    # A loop (of a traced trip count) where the members' convolutions are
    # plain; straight-line calls per step (unrolled) where they stay the
    # vectorised members' grouped convolutions, or where asked.
    assert not short.unroll and plan(unroll=True).unroll
    assert plan(flops=1e6).unroll and plan(groupable=False).unroll
    assert plan(layout="vmap").unroll and not plan(member_chunk=3).unroll
    assert not plan(groupable=False, steps=long_steps).unroll  # sequential


def test_shared_parts_heterogeneous_and_coupled_losses_are_not_one_at_a_time():
    ens = ee.ensemble(CNN, size=SIZE, key=jax.random.key(0))
    assert independent_members(loss_fn, ens)
    shared = ee.ensemble(
        CNN, size=SIZE, key=jax.random.key(0), shared=lambda m: m.conv1
    )
    assert not independent_members(loss_fn, shared)
    het = ee.Heterogeneous([ens, ens])
    assert not independent_members((loss_fn, loss_fn), het)
    coupled = ee.Coupled(lambda members, batch, key: jnp.zeros(SIZE))
    assert not independent_members(coupled, ens)


class StepLog(ee.Tracker):
    """A tracker keeping a leaf without the member axis (against its protocol:
    it worked before, and still must)."""

    def init(self, members):
        return jnp.zeros((5,), jnp.int32)

    def update(self, state, members, done):
        return state.at[jnp.minimum(done - 1, 4)].set(done)

    def result(self, state, ensemble):
        return state


def test_a_tracker_leaf_without_the_member_axis(planned):
    ens = ee.ensemble(CNN, size=SIZE, key=jax.random.key(0))
    result = _fit(loss_fn, ens, track=[StepLog()])
    assert _one_at_a_time(planned)
    np.testing.assert_array_equal(result.tracked[0], [1, 2, 3, 4, 0])
    reference = _fit(loss_fn, ens, layout="vmap", track=[StepLog()])
    assert_tree_allclose(result.ensemble, reference.ensemble, **TOL)
