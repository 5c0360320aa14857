"""`fit`'s optimistic divergence guard (`guard.Deferred`,
`loop._settle_members`).

On a CPU a dispatch runs the step with no per-step finiteness check or select;
frozen members compute along and get their weights back at its end, and every
member's state is checked once, at its end. Where a member was not finite, the
dispatch runs again from its start, in parts of the same program, to freeze it
at the step it failed at. References: the run where nothing diverges (the other
members bit for bit), the same run stopped just before the failing step (the
frozen member bit for bit), SWA's mean by hand, and the guarded step forced for
the whole run (the step each member diverged at)."""

import weakref

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import eqx_ensemble as ee
from eqx_ensemble._execution import cache as cache_module, plan as plan_module
from eqx_ensemble._training import (
    guard as guard_module,
    loop as loop_module,
    run as run_module,
)

SIZE = 4
X = jax.random.normal(jax.random.key(1), (48, 2))
Y = jnp.sin(X[:, :1])
# Members 1 and 3's learning rates make SGD blow up geometrically on this
# problem: their weights overflow at two different steps in the middle of the
# first dispatch (40 steps): member 1 at step 11, member 3 at step 15.
WILD = jnp.array([0.01, 0.63, 0.02, 0.65])
TAME = jnp.array([0.01, 0.01, 0.02, 0.01])
OPTIMIZER = optax.inject_hyperparams(optax.sgd)(learning_rate=0.01)
STEPS, PER_DISPATCH = 60, 40
SWA = ee.SWA(start=5, every=3)
KEY0 = jax.random.key(0)


def loss(model, batch, key):
    del key
    x, y = batch
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


def _fit(ens, rates, steps=STEPS, layout="vmap", **kwargs):
    return ee.fit(
        ens,
        loss,
        OPTIMIZER,
        (X, Y),
        steps=steps,
        batch_size=8,
        key=jax.random.key(2),
        opt_state=ee.init_optimizer(
            OPTIMIZER, ens, hyperparams={"learning_rate": rates}
        ),
        execution=ee.Execution(layout=layout, steps_per_dispatch=PER_DISPATCH),
        callbacks=(),
        **kwargs,
    )


@pytest.fixture
def checks(monkeypatch):
    """The finiteness check of every dispatch `fit` runs, in order."""
    seen = []
    original = loop_module.dispatch_chunk

    def spy(options, chunk, train_state, *steps):
        seen.append(chunk.check)
        return original(options, chunk, train_state, *steps)

    monkeypatch.setattr(run_module, "dispatch_chunk", spy)
    return seen


def _leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(eqx.filter(tree, eqx.is_array))]


def _assert_same(a, b):
    for x, y in zip(_leaves(a), _leaves(b), strict=True):
        np.testing.assert_array_equal(x, y)


def _member(tree, i):
    return jax.tree.map(lambda x: x[i] if eqx.is_array(x) else x, tree)


def _ensemble():
    return ee.ensemble(
        lambda k: eqx.nn.MLP(2, 1, 8, 1, key=k), size=SIZE, key=jax.random.key(0)
    )


@pytest.mark.usefixtures("library_codegen")
@pytest.mark.parametrize("layout", ["vmap", "sequential"])
def test_members_diverging_mid_dispatch_are_frozen_at_their_step(
    monkeypatch, checks, layout
):
    ens = _ensemble()
    wild = _fit(ens, WILD, layout=layout, track=[SWA])
    assert set(checks) == {"deferred"}  # one program, every dispatch
    assert set(wild.diverged) == {1, 3}
    assert 1 < wild.diverged[1] < wild.diverged[3] <= PER_DISPATCH
    tame = _fit(ens, TAME, layout=layout, track=[SWA])
    assert tame.diverged == {}
    mean = wild.tracked[0]
    for i in (0, 2):  # the others: bit for bit the run where nothing diverged
        _assert_same(wild.ensemble[i], tame.ensemble[i])
        _assert_same(_member(wild.opt_state, i), _member(tame.opt_state, i))
        _assert_same(mean[i], tame.tracked[0][i])
        np.testing.assert_array_equal(
            wild.history.losses[:, i], tame.history.losses[:, i]
        )
    for i in (1, 3):
        step = wild.diverged[i] - 1  # the steps done before it (counted from 1)
        # Frozen at its last finite weights: the same run stopped just before.
        before = _fit(ens, WILD, steps=step, layout=layout, track=[SWA])
        assert i not in before.diverged
        _assert_same(wild.ensemble[i], before.ensemble[i])
        _assert_same(_member(wild.opt_state, i), _member(before.opt_state, i))
        losses = wild.history.losses[:, i]
        np.testing.assert_array_equal(losses[:step], before.history.losses[:, i])
        assert np.isnan(losses[step + 1 :]).all()
        # SWA keeps averaging what the member holds: its frozen weights.
        averaged = [done for done in range(5, STEPS + 1, 3)]
        early = sum(done <= step for done in averaged)
        late = len(averaged) - early
        for got, partial, frozen in zip(
            _leaves(mean[i]),
            _leaves(before.tracked[0][i]),
            _leaves(before.ensemble[i]),
            strict=True,
        ):
            want = (partial * early + frozen * late) / len(averaged)
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert all(np.isfinite(leaf).all() for leaf in _leaves(wild.ensemble))

    # The guarded step, checked at every step, freezes them at the same steps.
    checks.clear()
    monkeypatch.setattr(guard_module, "_hides_non_finite", lambda *_: True)
    guarded = _fit(ens, WILD, layout=layout, track=[SWA])
    assert "deferred" not in checks
    assert guarded.diverged == wild.diverged
    for got, want in zip(
        _leaves(wild.ensemble), _leaves(guarded.ensemble), strict=True
    ):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def _as_off_a_cpu(monkeypatch):
    """Dispatches as off a CPU (a GPU: `plan.COUNTED`): the run's plans made
    anew, no traced trip count, full dispatches without the per-step
    conditional."""
    monkeypatch.setattr(cache_module, "_OWNED", weakref.WeakKeyDictionary())
    monkeypatch.setattr(plan_module, "COUNTED", frozenset())
    monkeypatch.setattr(run_module, "_skips_conditional", lambda chunk: True)


def test_a_dispatch_of_fixed_length_is_optimistic_too(monkeypatch, checks):
    # Off a CPU a dispatch is a scan of fixed length, a full one compiled
    # without the per-step conditional; its longer parts during the search
    # run the variant with it, its single steps a program of one step (not a
    # whole scan of conditional steps each).
    _as_off_a_cpu(monkeypatch)
    fulls = []
    spy = run_module.dispatch_chunk

    def recording(options, chunk, train_state, *steps):
        assert not chunk.counted
        fulls.append((chunk.full, chunk.length, int(chunk.end - train_state.step)))
        return spy(options, chunk, train_state, *steps)

    monkeypatch.setattr(run_module, "dispatch_chunk", recording)
    ens = _ensemble()
    wild = _fit(ens, WILD)
    assert set(checks) == {"deferred"}
    assert fulls[0] == (True, PER_DISPATCH, PER_DISPATCH)  # the first try
    for full, length, steps in fulls:  # a part: one step, or the conditional
        assert (full, length) == (True, 1) if steps == 1 else length == PER_DISPATCH
        assert full == (steps == length)
    assert (True, 1, 1) in fulls and (False, PER_DISPATCH, 10) in fulls
    assert set(wild.diverged) == {1, 3}
    tame = _fit(ens, TAME)
    assert tame.diverged == {}
    for i in (0, 2):  # the other members: the clean run to rounding
        for got, want in zip(
            _leaves(wild.ensemble[i]), _leaves(tame.ensemble[i]), strict=True
        ):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    for i in (1, 3):  # frozen at the last finite weights of the step before
        before = _fit(ens, WILD, steps=wild.diverged[i] - 1)
        for got, want in zip(
            _leaves(wild.ensemble[i]), _leaves(before.ensemble[i]), strict=True
        ):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # The same steps as the guarded step at every step.
    monkeypatch.setattr(guard_module, "_hides_non_finite", lambda *_: True)
    assert _fit(ens, WILD).diverged == wild.diverged


@pytest.mark.parametrize("counted", [True, False], ids=["cpu", "fixed_length"])
def test_a_member_failing_only_in_the_rerun_of_the_failing_step(monkeypatch, counted):
    # The failing step is run again with its failing members frozen. On a
    # CPU that is the same program on the same inputs: nothing else can fail
    # (an internal error if it did). Off a CPU it is another program, whose
    # kernels may round otherwise (a GPU's atomic scatter-adds): a member at
    # the edge that fails only there is frozen at that step too. Made so here
    # by marking member 0's loss NaN in that rerun.
    if not counted:
        _as_off_a_cpu(monkeypatch)
    plain = _fit(_ensemble(), WILD)  # member 1 fails first, at `step`
    step = plain.diverged[1]
    part, injected = guard_module.Deferred.part, []

    def edged(self, run, chunk, state, start, end):
        readout, after = part(self, run, chunk, state, start, end)
        marks = np.asarray(state.diverged_at)
        if end - start == 1 and (marks == start).any() and not injected:
            injected.append(start)  # the rerun, its failing members frozen
            losses = readout.losses.copy()
            losses[0, 0] = np.nan
            readout = readout._replace(losses=losses)
        return readout, after

    monkeypatch.setattr(guard_module.Deferred, "part", edged)
    if counted:
        with pytest.raises(RuntimeError, match=f"internal error: step {step} fai"):
            _fit(_ensemble(), WILD)
        return
    wild = _fit(_ensemble(), WILD)
    assert injected == [step - 1]  # the rerun of member 1's failing step
    assert wild.diverged == {0: step, 1: step, 3: plain.diverged[3]}
    losses = wild.history.losses
    assert np.isnan(losses[step - 1 :, 0]).all()  # frozen from that step
    np.testing.assert_array_equal(  # and the run before it, as it was
        losses[: step - 1, 0], plain.history.losses[: step - 1, 0]
    )
    # Its weights: those before the step, as the run stopped just before it.
    before = _fit(_ensemble(), WILD, steps=step - 1)
    for got, want in zip(
        _leaves(wild.ensemble[0]), _leaves(before.ensemble[0]), strict=True
    ):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_a_trained_shared_part_keeps_the_guarded_step(checks):
    # A frozen member must drop out of the shared gradient at every step: the
    # step checks, as before (test_shared_parts.py tests what it does).
    ens = ee.ensemble(
        lambda k: eqx.nn.MLP(2, 1, 8, 1, key=k),
        size=SIZE,
        key=jax.random.key(0),
        shared=lambda m: m.layers[0],
        train_shared=True,
    )
    _fit(ens, TAME, steps=5)
    assert checks and "deferred" not in checks


def test_a_member_whose_optimizer_state_alone_overflows_is_found_step_by_step(
    checks,
):
    # Adam's second moment overflows (g ** 2 > 3e38) while its update, weights
    # and loss stay finite: only the end-of-dispatch check sees it, with no
    # non-finite loss to start the search from. The guarded step freezes the
    # member at step 0, before any update; so does the optimistic dispatch.
    ens = _ensemble()
    adam = optax.adam(1e-3)

    def scaled(model, batch, key, hyper):
        del key
        x, y = batch
        return hyper * jnp.mean((jax.vmap(model)(x) - y) ** 2)

    result = ee.fit(
        ens,
        scaled,
        adam,
        (X, Y),
        steps=10,
        batch_size=8,
        key=jax.random.key(2),
        hyper=jnp.array([1.0, 1.0, 1e30, 1.0]),
        callbacks=(),
    )
    assert set(checks) == {"deferred"}
    assert result.diverged == {2: 1}  # its first step (steps count from 1)
    _assert_same(result.ensemble[2], ens[2])
    assert np.isfinite(np.delete(result.history.losses, 2, axis=1)).all()


@pytest.mark.parametrize(
    "make_optimizer",
    [
        lambda: optax.chain(optax.zero_nans(), optax.sgd(0.01)),
        lambda: optax.apply_if_finite(optax.sgd(0.01), 3),
        lambda: optax.MultiSteps(
            optax.sgd(0.01), 1, should_skip_update_fn=optax.skip_not_finite
        ).gradient_transformation(),
        # (`skip_not_finite` given positionally is `use_grad_mean`: no skip.)
        lambda: optax.MultiSteps(
            optax.sgd(0.01), 1, optax.skip_not_finite
        ).gradient_transformation(),
    ],
    ids=["zero_nans", "apply_if_finite", "multisteps_skip", "multisteps_no_skip"],
)
def test_an_optimizer_that_hides_non_finite_gradients_keeps_the_guarded_step(
    checks, make_optimizer, request
):
    # Such an optimizer keeps the weights finite where a gradient was not: the
    # end-of-dispatch check could not see it, so every step is checked, and a
    # member whose gradient alone is NaN is frozen at its start weights.
    # `MultiSteps` with a skip function skips the step (its weights and
    # accumulator stay finite); without one it accumulates the NaN gradient
    # in its state: the end-of-dispatch check sees it and replays.
    optimizer = make_optimizer()
    ens = ee.ensemble(
        lambda k: eqx.nn.MLP(2, 1, 8, 1, key=k), size=SIZE, key=jax.random.key(0)
    )
    # Member 1 is marked by a last bias below -10 (set here).
    ens = eqx.tree_at(
        lambda e: e.members.layers[-1].bias,
        ens,
        ens.members.layers[-1].bias.at[1].set(-20.0),
    )

    def nan_gradient_when_marked(model, batch, key):
        # A finite loss whose gradient is NaN (sqrt at 0) for the marked member.
        del key
        x, y = batch
        marked = model.layers[-1].bias[0] < -10.0
        w = model.layers[0].bias[0]
        at_zero = jnp.where(marked, jnp.abs(w - w), 1.0)
        extra = jnp.where(marked, jnp.sqrt(at_zero), 0.0)
        return jnp.mean((jax.vmap(model)(x) - y) ** 2) + extra

    result = ee.fit(
        ens,
        nan_gradient_when_marked,
        optimizer,
        (X, Y),
        steps=5,
        batch_size=8,
        key=jax.random.key(2),
        callbacks=(),
    )
    hidden = request.node.callspec.id != "multisteps_no_skip"
    assert checks and ("deferred" not in checks) == hidden
    assert set(result.diverged) == {1}
    _assert_same(result.ensemble[1], ens[1])


def test_the_search_runs_each_step_at_most_a_few_times(checks):
    # Two failures in one 40-step dispatch: the first try, then per failure
    # one part up to just before its first NaN loss, at most two single
    # steps, the failing step again, and the rest of the dispatch; then the
    # run's second dispatch. Not a full re-run per step.
    _fit(_ensemble(), WILD)
    assert len(checks) <= 1 + 2 * 5 + 1, len(checks)


class RunningMax(eqx.Module):
    """A linear model whose state keeps the largest output seen, starting at
    -inf, beside a -inf it never updates: a model state that is not finite by
    design."""

    linear: eqx.nn.Linear
    index: eqx.nn.StateIndex

    def __init__(self, key):
        self.linear = eqx.nn.Linear(2, 1, key=key)
        self.index = eqx.nn.StateIndex(jnp.full((2,), -jnp.inf, jnp.float32))


def test_a_model_state_that_holds_an_infinity_is_not_a_divergence(checks):
    # The guarded step checks the loss, gradients, weights and optimizer
    # state, never the model state; neither does the end-of-dispatch check.
    ens, state = ee.ensemble(
        lambda k: eqx.nn.make_with_state(RunningMax)(k), size=SIZE, key=KEY0
    )

    def stateful_loss(model, state, batch, key):
        del key
        x, y = batch
        out = jax.vmap(model.linear)(x)
        seen = state.get(model.index).at[0].max(jnp.max(out))
        return jnp.mean((out - y) ** 2), state.set(model.index, seen)

    results = {}
    for guard in ("auto", "step"):
        results[guard] = ee.fit(
            ens, stateful_loss, OPTIMIZER, (X, Y), steps=10, batch_size=8,
            key=jax.random.key(2), state=state, callbacks=(),
            opt_state=ee.init_optimizer(
                OPTIMIZER, ens, hyperparams={"learning_rate": TAME}
            ),
            execution=ee.Execution(guard=guard),
        )  # fmt: skip
    assert results["auto"].diverged == results["step"].diverged == {}
    assert "deferred" in checks
    assert np.isneginf(np.asarray(results["auto"].state.get(ens[0].index))[:, 1]).all()


def test_guard_step_checks_every_step_and_freezes_at_the_same_step(checks):
    # For a loss that checks its own inputs (`eqx.error_if`): with the check at
    # every step a failed member never computes with non-finite weights.
    def checked(model, batch, key):
        x, y = batch
        weights = model.layers[0].weight
        model = eqx.tree_at(
            lambda m: m.layers[0].weight,
            model,
            eqx.error_if(weights, ~jnp.isfinite(weights), "non-finite weights"),
        )
        return loss(model, (x, y), key)

    result = ee.fit(
        _ensemble(), checked, OPTIMIZER, (X, Y), steps=STEPS, batch_size=8,
        key=jax.random.key(2),
        opt_state=ee.init_optimizer(
            OPTIMIZER, _ensemble(), hyperparams={"learning_rate": WILD}
        ),
        execution=ee.Execution(steps_per_dispatch=PER_DISPATCH, guard="step"),
        callbacks=(),
    )  # fmt: skip
    assert checks and "deferred" not in checks
    assert result.diverged == _fit(_ensemble(), WILD).diverged
    with pytest.raises(ValueError, match="Execution.guard"):
        ee.Execution(guard="never")
    with pytest.raises(ValueError, match="does not use `Execution.guard`"):
        ee.make_step(loss, OPTIMIZER, execution=ee.Execution(guard="step"))
