"""`ee.fit`: every member equals the same model trained alone.

The reference is a hand-written single-model loop (`eqx.filter_value_and_grad`,
`optimizer.update`, `eqx.apply_updates`, a Python loop over steps) that reproduces
the key and batch scheme documented in `fit`'s docstring with `jax.random` directly.
"""

import functools
import re
import tomllib
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import assert_tree_allclose, repeat, tree_equal

import eqx_ensemble as ee

SIZE = 3
N = 40
BATCH = 8
STEPS = 50
X = jax.random.normal(jax.random.key(10), (N, 2))
Y = jnp.sin(2 * X[:, :1]) + X[:, 1:] ** 2
DATA = (X, Y)
X_EVAL = jax.random.normal(jax.random.key(11), (32, 2))
EVAL_DATA = (X_EVAL, jnp.sin(2 * X_EVAL[:, :1]) + X_EVAL[:, 1:] ** 2)
FIT_KEY = jax.random.key(5)

# Module-level optimizers and losses: compiled functions are keyed on their
# identity, so reusing them keeps the suite from recompiling.
ADAM = optax.adam(1e-2)
CLIP_ADAM = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(5e-2))
CLIP_SGD = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(1e-2))
INJECT_ADAM = optax.inject_hyperparams(optax.adam)(learning_rate=1e-2)


def make_mlp(key):
    return eqx.nn.MLP(2, 1, 8, 1, key=key)


def mse_loss(model, batch, key):
    xb, yb = batch
    return jnp.mean((jax.vmap(model)(xb) - yb) ** 2)


def eval_mse(model, eval_data):
    xe, ye = eval_data
    return jnp.mean((jax.vmap(model)(xe) - ye) ** 2)


def eval_distance(model, eval_data):
    # Not monotone in training time (members cross 2.5 at different steps), so the
    # best evaluation is not simply the last one.
    return jnp.abs(eval_mse(model, eval_data) - 2.5)


class DropoutMLP(eqx.Module):
    hidden: eqx.nn.Linear
    dropout: eqx.nn.Dropout
    out: eqx.nn.Linear

    def __init__(self, key):
        hidden_key, out_key = jax.random.split(key)
        self.hidden = eqx.nn.Linear(2, 16, key=hidden_key)
        self.dropout = eqx.nn.Dropout(0.5)
        self.out = eqx.nn.Linear(16, 1, key=out_key)

    def __call__(self, x, key):
        return self.out(self.dropout(jax.nn.relu(self.hidden(x)), key=key))


def dropout_loss(model, batch, key):
    xb, yb = batch
    example_keys = jax.random.split(key, xb.shape[0])
    return jnp.mean((jax.vmap(model)(xb, example_keys) - yb) ** 2)


class BatchNormMLP(eqx.Module):
    hidden: eqx.nn.Linear
    norm: eqx.nn.BatchNorm
    out: eqx.nn.Linear

    def __init__(self, key):
        hidden_key, out_key = jax.random.split(key)
        # No bias before the norm: its gradient is zero up to rounding, and Adam
        # would turn that rounding noise into full-size steps.
        self.hidden = eqx.nn.Linear(2, 8, use_bias=False, key=hidden_key)
        self.norm = eqx.nn.BatchNorm(8, axis_name="batch", mode="batch")
        self.out = eqx.nn.Linear(8, 1, key=out_key)

    def __call__(self, x, state):
        hidden, state = self.norm(self.hidden(x), state)
        return self.out(jax.nn.relu(hidden)), state


def batchnorm_loss(model, state, batch, key):
    xb, yb = batch
    pred, new_state = jax.vmap(
        model, axis_name="batch", in_axes=(0, None), out_axes=(0, None)
    )(xb, state)
    return jnp.mean((pred - yb) ** 2), new_state


# --------------------------------------------------------------------------------
# The reference: one model, a Python loop, the documented randomness scheme.
# --------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames="size")
def _step_member_keys(train_key, step, *, size):
    return jax.random.split(jax.random.fold_in(train_key, step), size)


@functools.partial(jax.jit, static_argnames="n")
def _epoch_permutation(data_key, epoch, *, n):
    return jax.random.permutation(jax.random.fold_in(data_key, epoch), n)


@functools.partial(jax.jit, static_argnames=("size", "n", "batch_size"))
def _bootstrap_positions(data_key, step, *, size, n, batch_size):
    return jax.random.randint(
        jax.random.fold_in(data_key, step), (size, batch_size), 0, n
    )


class Scheme:
    """`fit`'s documented keys and batch indices for member `member` of `size`."""

    def __init__(self, key, sampling, *, member, size, n=N, batch_size=BATCH):
        data_key, bootstrap_key, self.train_key = jax.random.split(key, 3)
        self.sampling, self.member, self.size = sampling, member, size
        self.n, self.batch_size = n, batch_size
        self.data_key = data_key
        if sampling == "independent":
            self.data_key = jax.random.split(data_key, size)[member]
        if sampling == "bootstrap":
            resample_key = jax.random.split(bootstrap_key, size)[member]
            self.resample = np.asarray(jax.random.randint(resample_key, (n,), 0, n))

    def key(self, step):
        return _step_member_keys(self.train_key, step, size=self.size)[self.member]

    def indices(self, step):
        if self.sampling == "bootstrap":
            positions = _bootstrap_positions(
                self.data_key,
                step,
                size=self.size,
                n=self.n,
                batch_size=self.batch_size,
            )
            return self.resample[np.asarray(positions)[self.member]]
        per_epoch = self.n // self.batch_size
        permutation = np.asarray(
            _epoch_permutation(self.data_key, step // per_epoch, n=self.n)
        )
        start = (step % per_epoch) * self.batch_size
        return permutation[start : start + self.batch_size]


def params(model):
    return eqx.filter(model, eqx.is_inexact_array)


@eqx.filter_jit
def solo_step(model, opt_state, batch, key, loss_fn, optimizer):
    loss, grads = eqx.filter_value_and_grad(loss_fn)(model, batch, key)
    # Optax's Adam computes `b1 ** count` with an int32 count; the test suite runs
    # with strict dtype promotion, so trace optax with standard promotion.
    with jax.numpy_dtype_promotion("standard"):
        updates, opt_state = optimizer.update(grads, opt_state, params(model))
    norm = jnp.sqrt(sum(jnp.sum(g**2) for g in jax.tree.leaves(grads)))
    return eqx.apply_updates(model, updates), opt_state, loss, norm


@eqx.filter_jit
def solo_stateful_step(model, state, opt_state, batch, key, loss_fn, optimizer):
    (loss, state), grads = eqx.filter_value_and_grad(loss_fn, has_aux=True)(
        model, state, batch, key
    )
    with jax.numpy_dtype_promotion("standard"):
        updates, opt_state = optimizer.update(grads, opt_state, params(model))
    return eqx.apply_updates(model, updates), state, opt_state, loss


def solo_fit(
    model,
    loss_fn,
    optimizer,
    *,
    member,
    size=SIZE,
    sampling="shared",
    steps=STEPS,
    key=FIT_KEY,
    state=None,
    data=DATA,
):
    """Train ONE model; returns `(model, state, losses, grad_norms)`."""
    scheme = Scheme(key, sampling, member=member, size=size)
    opt_state = optimizer.init(params(model))
    losses, grad_norms = [], []
    for step in range(steps):
        indices = scheme.indices(step)
        batch = jax.tree.map(lambda a: a[indices], data)
        if state is None:
            model, opt_state, loss, grad_norm = solo_step(
                model, opt_state, batch, scheme.key(step), loss_fn, optimizer
            )
            grad_norms.append(float(grad_norm))
        else:
            model, state, opt_state, loss = solo_stateful_step(
                model, state, opt_state, batch, scheme.key(step), loss_fn, optimizer
            )
        losses.append(float(loss))
    return model, state, np.array(losses), np.array(grad_norms)


def member_state(state, i):
    return jax.tree.map(lambda leaf: leaf[i], state)


def fit(ens, loss_fn, optimizer, **kwargs):
    kwargs = {
        "steps": STEPS,
        "batch_size": BATCH,
        "key": FIT_KEY,
        "callbacks": (),
        **kwargs,
    }
    return ee.fit(ens, loss_fn, optimizer, kwargs.pop("data", DATA), **kwargs)


def assert_members_match_solo(result, ens, loss_fn, optimizer, **solo_kwargs):
    for i in range(len(ens)):
        solo, _, solo_losses, _ = solo_fit(
            ens[i], loss_fn, optimizer, member=i, size=len(ens), **solo_kwargs
        )
        assert_tree_allclose(result.ensemble[i], solo, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(
            result.history.losses[:, i], solo_losses, rtol=1e-4, atol=1e-6
        )


# --------------------------------------------------------------------------------
# The central equivalence: ensemble training == each member trained alone.
# --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mlp_ens():
    return ee.ensemble(make_mlp, size=SIZE, key=jax.random.key(0))


@pytest.mark.parametrize("sampling", ["shared", "bootstrap", "independent"])
def test_fit_equals_solo_training(mlp_ens, sampling):
    result = fit(mlp_ens, mse_loss, ADAM, sampling=sampling)
    assert result.step == STEPS
    assert result.history.losses.shape == (STEPS, SIZE)
    assert result.diverged == {}
    assert_members_match_solo(result, mlp_ens, mse_loss, ADAM, sampling=sampling)


def test_sampling_modes_differ(mlp_ens):
    # Guards the equivalence test against a scheme that ignores `sampling`.
    shared = fit(
        mlp_ens, mse_loss, ADAM, steps=5, execution=ee.Execution(steps_per_dispatch=5)
    )
    boot = fit(
        mlp_ens,
        mse_loss,
        ADAM,
        steps=5,
        sampling="bootstrap",
        execution=ee.Execution(steps_per_dispatch=5),
    )
    assert not np.allclose(shared.history.losses, boot.history.losses)


def test_fit_with_dropout_equals_solo_training():
    ens = ee.ensemble(DropoutMLP, size=SIZE, key=jax.random.key(1))
    result = fit(ens, dropout_loss, ADAM)
    assert_members_match_solo(result, ens, dropout_loss, ADAM)


def test_fit_with_batchnorm_equals_solo_training():
    ens, state = ee.ensemble(
        eqx.nn.make_with_state(BatchNormMLP), size=SIZE, key=jax.random.key(2)
    )
    result = fit(ens, batchnorm_loss, ADAM, state=state)
    for i in range(SIZE):
        solo, solo_state, solo_losses, _ = solo_fit(
            ens[i], batchnorm_loss, ADAM, member=i, state=member_state(state, i)
        )
        assert_tree_allclose(result.ensemble[i], solo, rtol=1e-5, atol=1e-5)
        assert_tree_allclose(
            member_state(result.state, i), solo_state, rtol=1e-5, atol=1e-5
        )
        np.testing.assert_allclose(
            result.history.losses[:, i], solo_losses, rtol=1e-4, atol=1e-6
        )
    # Every member keeps its own running statistics.
    running_means = [
        leaf for leaf in jax.tree.leaves(result.state) if leaf.shape == (SIZE, 8)
    ]
    assert running_means and not np.allclose(running_means[0][0], running_means[0][1])


def test_fit_with_clipping_equals_solo_training(mlp_ens):
    scaled = (X, 20 * Y)
    result = fit(mlp_ens, mse_loss, CLIP_ADAM, data=scaled)
    for i in range(SIZE):
        solo, _, _, grad_norms = solo_fit(
            mlp_ens[i], mse_loss, CLIP_ADAM, member=i, data=scaled
        )
        # Clipping must actually be active for this test to mean anything.
        assert (grad_norms > 1.0).mean() > 0.5
        assert_tree_allclose(result.ensemble[i], solo, rtol=1e-5, atol=1e-5)


def test_clipping_is_per_member(mlp_ens):
    # Member 0 gets huge output weights, hence huge gradients. Clipping over the
    # whole ensemble would shrink the other members' steps; per member it must not.
    loud = eqx.tree_at(
        lambda e: e.members.layers[-1].weight,
        mlp_ens,
        mlp_ens.members.layers[-1].weight.at[0].multiply(1e3),
    )
    result = fit(loud, mse_loss, CLIP_SGD)
    for i in range(SIZE):
        solo, _, _, grad_norms = solo_fit(loud[i], mse_loss, CLIP_SGD, member=i)
        if i == 0:
            assert grad_norms.min() > 100.0
        assert_tree_allclose(result.ensemble[i], solo, rtol=1e-5, atol=1e-5)
    # ...and the quiet members are exactly the ones of a run without the loud one.
    quiet = fit(mlp_ens, mse_loss, CLIP_SGD)
    assert tree_equal(result.ensemble[1:], quiet.ensemble[1:])


# --------------------------------------------------------------------------------
# Per-member hyperparameters.
# --------------------------------------------------------------------------------


def test_per_member_learning_rates():
    learning_rates = [0.0, 1e-2, 0.0, 1e-3]
    ens = ee.ensemble(make_mlp, size=4, key=jax.random.key(3))
    result = fit(
        ens,
        mse_loss,
        INJECT_ADAM,
        opt_state=ee.init_optimizer(
            INJECT_ADAM, ens, hyperparams={"learning_rate": jnp.array(learning_rates)}
        ),
    )
    np.testing.assert_array_equal(
        result.opt_state.hyperparams["learning_rate"],
        np.array(learning_rates, dtype=np.float32),
    )
    for i, learning_rate in enumerate(learning_rates):
        if learning_rate == 0.0:
            # Bit for bit: a zero learning rate leaves the weights untouched.
            assert tree_equal(result.ensemble[i], ens[i])
            continue
        assert not tree_equal(result.ensemble[i], ens[i])
        solo, _, _, _ = solo_fit(
            ens[i], mse_loss, optax.adam(learning_rate), member=i, size=4
        )
        assert_tree_allclose(result.ensemble[i], solo, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------------
# Divergence isolation.
# --------------------------------------------------------------------------------


def test_diverging_member_is_reported_and_isolated(mlp_ens):
    # Member 1 alone gets a learning rate that blows up its outputs to inf.
    wild = jnp.array([1e-2, 1e20, 1e-2])
    result = fit(
        mlp_ens,
        mse_loss,
        INJECT_ADAM,
        opt_state=ee.init_optimizer(
            INJECT_ADAM, mlp_ens, hyperparams={"learning_rate": wild}
        ),
    )
    tame = fit(
        mlp_ens,
        mse_loss,
        INJECT_ADAM,
        opt_state=ee.init_optimizer(
            INJECT_ADAM, mlp_ens, hyperparams={"learning_rate": jnp.full(3, 1e-2)}
        ),
    )
    # The step at which member 1's loss first becomes non-finite, trained alone.
    _, _, solo_losses, _ = solo_fit(
        mlp_ens[1], mse_loss, optax.adam(1e20), member=1, steps=5
    )
    first_bad = int(np.argmax(~np.isfinite(solo_losses)))
    assert not np.isfinite(solo_losses[first_bad])
    assert result.diverged == {1: first_bad + 1}  # steps count from 1
    assert not np.all(np.isfinite(result.history.losses[:, 1]))
    assert np.all(np.isfinite(result.history.losses[:, [0, 2]]))
    # The healthy members are bit-identical to a run without the diverging one:
    # each member's computation is its own slice of the vmapped program, and the
    # NaN/inf of member 1 is only ever combined with others through `jnp.where`.
    for i in (0, 2):
        assert tree_equal(result.ensemble[i], tame.ensemble[i])
        assert tree_equal(
            jax.tree.map(lambda x: x[i], result.opt_state),
            jax.tree.map(lambda x: x[i], tame.opt_state),
        )


def test_all_members_diverging_raises(mlp_ens):
    with pytest.raises(ee.EnsembleDivergedError, match="All 3 members diverged"):
        fit(
            mlp_ens,
            mse_loss,
            INJECT_ADAM,
            opt_state=ee.init_optimizer(
                INJECT_ADAM, mlp_ens, hyperparams={"learning_rate": jnp.full(3, 1e20)}
            ),
        )


# --------------------------------------------------------------------------------
# Fused dispatch, evaluation, callbacks, compilation cache.
# --------------------------------------------------------------------------------


def test_steps_per_dispatch_does_not_change_the_result(mlp_ens):
    # 1 step per dispatch, 7 (the last dispatch only partly active) and all 50.
    results = [
        fit(mlp_ens, mse_loss, ADAM, execution=ee.Execution(steps_per_dispatch=k))
        for k in (1, 7, STEPS)
    ]
    for other in results[1:]:
        # Bit for bit: the scanned body is the same compiled computation whatever
        # the scan length, so nothing is reassociated.
        assert tree_equal(other.ensemble, results[0].ensemble)
        assert tree_equal(other.opt_state, results[0].opt_state)
        np.testing.assert_array_equal(other.history.losses, results[0].history.losses)


@pytest.mark.parametrize("sampling", [repeat("shared"), "independent", "bootstrap"])
def test_a_run_split_into_more_dispatches_draws_the_same_batches_and_keys(
    mlp_ens, sampling
):
    # Unrolled with evaluation every 3 steps, a run of 6 steps per dispatch
    # runs as one dispatch (evaluating after its third step), one of 3 steps
    # per dispatch as two: the second dispatch must draw its batches and
    # member keys from the run's keys (bootstrap: its draws are made on the
    # host).
    def run(per_dispatch):
        return fit(
            mlp_ens,
            mse_loss,
            ADAM,
            steps=6,
            sampling=sampling,
            evaluate=ee.Evaluate(
                lambda m, d, k: eval_distance(m, d), EVAL_DATA, every=3
            ),
            execution=ee.Execution(steps_per_dispatch=per_dispatch, unroll=True),
        )

    one, two = run(6), run(3)
    # Bit for bit: every unrolled step is a call of the same one-step program.
    # Batches or member keys from other keys would differ at the first step of
    # the second dispatch.
    assert tree_equal(one.ensemble, two.ensemble)
    assert tree_equal(one.opt_state, two.opt_state)
    for name in ("losses", "eval_scores", "eval_steps"):
        np.testing.assert_array_equal(
            getattr(one.history, name), getattr(two.history, name)
        )
    assert one.history.eval_steps.tolist() == [3, 6]


def test_evaluation_and_best_members(mlp_ens):
    every, steps, per_dispatch = 7, 30, 5
    result = fit(
        mlp_ens,
        mse_loss,
        ADAM,
        steps=steps,
        evaluate=ee.Evaluate(
            lambda m, d, k: eval_distance(m, d), EVAL_DATA, every=every
        ),
        execution=ee.Execution(steps_per_dispatch=per_dispatch),
    )
    eval_steps = list(range(every, steps + 1, every))
    np.testing.assert_array_equal(result.history.eval_steps, eval_steps)
    assert result.history.eval_scores.shape == (len(eval_steps), SIZE)
    # Recompute every score on the members trained (without evaluation) to that step.
    at_step = {
        t: fit(
            mlp_ens,
            mse_loss,
            ADAM,
            steps=t,
            execution=ee.Execution(steps_per_dispatch=per_dispatch),
        )
        for t in eval_steps
    }
    for row, t in enumerate(eval_steps):
        for i in range(SIZE):
            expected = eval_distance(at_step[t].ensemble[i], EVAL_DATA)
            np.testing.assert_allclose(
                result.history.eval_scores[row, i], expected, rtol=1e-5, atol=1e-6
            )
    # Evaluating does not perturb training.
    final = fit(
        mlp_ens,
        mse_loss,
        ADAM,
        steps=steps,
        execution=ee.Execution(steps_per_dispatch=per_dispatch),
    )
    assert_tree_allclose(result.ensemble, final.ensemble, rtol=0, atol=0)
    assert result.best_ensemble is not None and result.best_step is not None
    for i in range(SIZE):
        best_row = int(np.argmin(result.history.eval_scores[:, i]))
        best_step = eval_steps[best_row]
        assert result.best_step[i] == best_step
        assert tree_equal(result.best_ensemble[i], at_step[best_step].ensemble[i])
    assert len(set(result.best_step.tolist())) > 1


def batchnorm_eval(model, state, eval_data):
    xe, ye = eval_data
    model = eqx.nn.inference_mode(model)
    pred, _ = jax.vmap(model, axis_name="batch", in_axes=(0, None), out_axes=(0, None))(
        xe, state
    )
    return jnp.mean((pred - ye) ** 2)


def test_evaluation_of_stateful_members():
    ens, state = ee.ensemble(
        eqx.nn.make_with_state(BatchNormMLP), size=SIZE, key=jax.random.key(2)
    )
    common = dict(state=state, steps=10, execution=ee.Execution(steps_per_dispatch=5))
    result = fit(
        ens,
        batchnorm_loss,
        ADAM,
        evaluate=ee.Evaluate(
            lambda m, s, d, k: batchnorm_eval(m, s, d), EVAL_DATA, every=5
        ),
        **common,
    )
    halfway = fit(ens, batchnorm_loss, ADAM, **{**common, "steps": 5})
    for row, trained in enumerate([halfway, result]):
        for i in range(SIZE):
            expected = batchnorm_eval(
                trained.ensemble[i], member_state(trained.state, i), EVAL_DATA
            )
            np.testing.assert_allclose(
                result.history.eval_scores[row, i], expected, rtol=1e-5
            )


def test_progress_bar_shows_member_losses(mlp_ens, capsys):
    fit(
        mlp_ens,
        mse_loss,
        ADAM,
        steps=10,
        callbacks=[ee.ProgressBar()],
        execution=ee.Execution(steps_per_dispatch=5),
    )
    err = capsys.readouterr().err
    assert "10/10" in err and re.search(r"loss mean=\S+ min=\S+ max=\S+", err)


def test_numpy_data_and_aux_outputs(mlp_ens):
    def loss_with_aux(model, batch, key):
        return mse_loss(model, batch, key), {"norm": jnp.sum(batch[0] ** 2)}

    reference = fit(
        mlp_ens, mse_loss, ADAM, steps=10, execution=ee.Execution(steps_per_dispatch=5)
    )
    as_numpy = fit(
        mlp_ens,
        loss_with_aux,
        ADAM,
        data=(np.asarray(X), np.asarray(Y)),
        steps=10,
        execution=ee.Execution(steps_per_dispatch=5),
    )
    assert tree_equal(as_numpy.ensemble, reference.ensemble)


def test_callback_sees_each_dispatch_and_results_stay_valid(mlp_ens):
    seen = []
    result = fit(
        mlp_ens,
        mse_loss,
        ADAM,
        steps=20,
        callbacks=[seen.append],
        execution=ee.Execution(steps_per_dispatch=5),
    )
    assert [r.step for r in seen] == [5, 10, 15, 20]
    # The loop donates its buffers to the next dispatch: what a callback was given
    # must remain readable afterwards.
    for r in seen:
        jax.block_until_ready(jax.tree.leaves(eqx.filter(r.ensemble, eqx.is_array)))
        assert r.history.losses.shape == (r.step, SIZE)
    assert tree_equal(seen[-1].ensemble, result.ensemble)
    direct = fit(
        mlp_ens, mse_loss, ADAM, steps=10, execution=ee.Execution(steps_per_dispatch=5)
    )
    assert tree_equal(seen[1].ensemble, direct.ensemble)


def test_inputs_are_not_consumed(mlp_ens):
    opt_state = ee.init_optimizer(ADAM, mlp_ens)
    fit(
        mlp_ens,
        mse_loss,
        ADAM,
        steps=5,
        opt_state=opt_state,
        execution=ee.Execution(steps_per_dispatch=5),
    )
    # The caller's ensemble and optimizer state are still usable.
    fit(
        mlp_ens,
        mse_loss,
        ADAM,
        steps=5,
        opt_state=opt_state,
        execution=ee.Execution(steps_per_dispatch=5),
    )
    assert np.all(np.isfinite(np.asarray(mlp_ens.members.layers[0].weight)))


def test_hyperparam_arrays_are_not_consumed(mlp_ens):
    # The per-member values end up in the optimizer state, which the loop
    # donates: the caller's array must stay valid.
    learning_rates = jnp.array([1e-3, 1e-2, 3e-2])
    fit(
        mlp_ens,
        mse_loss,
        INJECT_ADAM,
        steps=5,
        opt_state=ee.init_optimizer(
            INJECT_ADAM, mlp_ens, hyperparams={"learning_rate": learning_rates}
        ),
        execution=ee.Execution(steps_per_dispatch=5),
    )
    np.testing.assert_allclose(np.asarray(learning_rates), [1e-3, 1e-2, 3e-2])


def test_fit_does_not_retrace():
    traces = []

    def counting_loss(model, batch, key):
        traces.append(None)
        return mse_loss(model, batch, key)

    optimizer = optax.sgd(1e-2)
    for seed in range(2):
        ens = ee.ensemble(make_mlp, size=SIZE, key=jax.random.key(seed))
        fit(
            ens,
            counting_loss,
            optimizer,
            steps=12,
            key=jax.random.key(seed),
            execution=ee.Execution(steps_per_dispatch=5),
        )
        if seed == 0:
            traced_once = len(traces)
            assert traced_once >= 1
    assert len(traces) == traced_once


# --------------------------------------------------------------------------------
# Bad input: a clear error before any work.
# --------------------------------------------------------------------------------


def test_mismatched_data_lengths(mlp_ens):
    data = {"x": X, "y": Y[:30]}
    with pytest.raises(ValueError, match=r"`\['x'\]`: 40, `\['y'\]`: 30"):
        fit(mlp_ens, mse_loss, ADAM, data=data)


def test_batch_larger_than_data(mlp_ens):
    with pytest.raises(ValueError, match=r"`batch_size` \(41\).*40 examples"):
        fit(mlp_ens, mse_loss, ADAM, batch_size=41)
    # Bootstrap samples with replacement: any batch size is fine.
    fit(mlp_ens, mse_loss, ADAM, batch_size=41, steps=1, sampling="bootstrap")


@pytest.mark.parametrize("steps", [0, -3])
def test_steps_below_one(mlp_ens, steps):
    with pytest.raises(ValueError, match=f"`steps` must be at least 1, got {steps}"):
        fit(mlp_ens, mse_loss, ADAM, steps=steps)


def test_non_scalar_loss(mlp_ens):
    def per_example_loss(model, batch, key):
        xb, yb = batch
        return (jax.vmap(model)(xb) - yb) ** 2

    with pytest.raises(ValueError, match=r"loss of shape \(8, 1\)"):
        fit(mlp_ens, per_example_loss, ADAM)


def test_hyperparams_of_wrong_length(mlp_ens):
    with pytest.raises(ValueError, match=r"ensemble has 3 members, got shape \(4,\)"):
        fit(
            mlp_ens,
            mse_loss,
            INJECT_ADAM,
            opt_state=ee.init_optimizer(
                INJECT_ADAM, mlp_ens, hyperparams={"learning_rate": jnp.ones(4)}
            ),
        )


def test_unknown_hyperparameter(mlp_ens):
    with pytest.raises(ValueError, match=r"Unknown hyperparameter 'lr'.*learning_rate"):
        fit(
            mlp_ens,
            mse_loss,
            INJECT_ADAM,
            opt_state=ee.init_optimizer(
                INJECT_ADAM, mlp_ens, hyperparams={"lr": jnp.ones(3)}
            ),
        )


def test_scheduled_hyperparameter(mlp_ens):
    scheduled = optax.inject_hyperparams(optax.adam)(
        learning_rate=optax.constant_schedule(1e-2)
    )
    with pytest.raises(ValueError, match=r"'learning_rate' is a schedule"):
        fit(
            mlp_ens,
            mse_loss,
            scheduled,
            opt_state=ee.init_optimizer(
                scheduled, mlp_ens, hyperparams={"learning_rate": jnp.zeros(3)}
            ),
        )


def test_hyperparams_without_inject_hyperparams(mlp_ens):
    with pytest.raises(ValueError, match="optax.inject_hyperparams"):
        fit(
            mlp_ens,
            mse_loss,
            ADAM,
            opt_state=ee.init_optimizer(
                ADAM, mlp_ens, hyperparams={"learning_rate": jnp.ones(3)}
            ),
        )


def test_optimizer_state_for_another_ensemble_size(mlp_ens):
    bigger = ee.ensemble(make_mlp, size=SIZE + 1, key=jax.random.key(0))
    opt_state = ee.init_optimizer(ADAM, bigger)
    with pytest.raises(ValueError, match="does not match.*3-member ensemble"):
        fit(mlp_ens, mse_loss, ADAM, opt_state=opt_state)


def test_optimizer_state_for_another_optimizer(mlp_ens):
    opt_state = ee.init_optimizer(optax.sgd(1e-2, momentum=0.9), mlp_ens)
    with pytest.raises(ValueError, match="optimizer state does not match"):
        fit(mlp_ens, mse_loss, ADAM, opt_state=opt_state)


def test_a_given_optimizer_state_is_checked_without_tracing_init_again(
    mlp_ens, monkeypatch
):
    # The check of `opt_state` traces `optimizer.init` once per optimizer (as
    # interned: an equal new one is the same) and structure of the members:
    # tracing it was ~8 ms of every short `fit` call. Another optimizer or
    # another ensemble is checked anew, and a mismatch still raises.
    from eqx_ensemble._training import optim

    traced = []
    original = optim._init_state

    def counting(*args):
        traced.append(1)
        return original(*args)

    monkeypatch.setattr(optim, "_init_state", counting)
    monkeypatch.setattr(optim, "_EXPECTED", {})
    opt_state = ee.init_optimizer(optax.adam(1e-3), mlp_ens)
    traced.clear()
    for _ in range(3):
        fit(mlp_ens, mse_loss, optax.adam(1e-3), opt_state=opt_state)
    assert len(traced) == 1
    with pytest.raises(ValueError, match="optimizer state does not match"):
        fit(mlp_ens, mse_loss, optax.sgd(1e-3), opt_state=opt_state)
    bigger = ee.ensemble(make_mlp, size=SIZE + 1, key=jax.random.key(0))
    with pytest.raises(ValueError, match=f"{SIZE + 1}-member ensemble"):
        fit(bigger, mse_loss, optax.adam(1e-3), opt_state=opt_state)
    assert len(traced) == 3
    # An optimizer's own state dtypes follow `jax_enable_x64` (L-BFGS' memory):
    # checked anew when it changes, not refused as another structure.
    lbfgs = optax.lbfgs()
    optim.check_opt_state(lbfgs, mlp_ens, ee.init_optimizer(lbfgs, mlp_ens))
    with jax.enable_x64(True):
        optim.check_opt_state(lbfgs, mlp_ens, ee.init_optimizer(lbfgs, mlp_ens))


def test_unknown_sampling(mlp_ens):
    with pytest.raises(ValueError, match=r"`sampling` must be one of.*'bagging'"):
        fit(mlp_ens, mse_loss, ADAM, sampling="bagging")


def test_evaluate_without_every():
    with pytest.raises(TypeError, match="every"):
        ee.Evaluate(eval_mse, EVAL_DATA)  # type: ignore[call-arg]
    with pytest.raises(ValueError, match="`Evaluate.every` must be at least 1"):
        ee.Evaluate(eval_mse, EVAL_DATA, every=0)


def test_non_scalar_eval_score(mlp_ens):
    def per_example_eval(model, eval_data, key):
        xe, ye = eval_data
        return (jax.vmap(model)(xe) - ye) ** 2

    with pytest.raises(ValueError, match=r"scalar score.*shape \(32, 1\)"):
        fit(
            mlp_ens,
            mse_loss,
            ADAM,
            evaluate=ee.Evaluate(per_example_eval, EVAL_DATA, every=5),
        )


def test_not_an_ensemble(mlp_ens):
    # beartype (the suite's runtime type checks) or `fit` itself rejects it.
    with pytest.raises(TypeError, match="Ensemble"):
        fit(mlp_ens[0], mse_loss, ADAM)


# The example count takes a path-free fast route; its errors still name the
# leaves (the route with paths runs only on bad input).


def test_example_count_errors_name_the_leaves():
    from eqx_ensemble._core.data import num_examples

    assert num_examples((np.zeros((5, 2)), jnp.zeros((5,)))) == 5
    with pytest.raises(ValueError, match=r"`\[0\]`: 5, `\[1\]`: 4"):
        num_examples((np.zeros((5, 2)), jnp.zeros((4,))))
    with pytest.raises(ValueError, match=r"leaf `\[1\]` is a scalar"):
        num_examples((np.zeros((5, 2)), jnp.zeros(())))
    with pytest.raises(ValueError, match="0 examples"):
        num_examples((np.zeros((0, 2)),))


# --------------- step numbers, the divergence advice and the version errors name


ROOT = Path(__file__).resolve().parent.parent
KEY = jax.random.key(0)
LINE_X = jnp.linspace(-1, 1, 32)[:, None]
LINE_Y = jnp.sin(3 * LINE_X)
ENS = ee.ensemble(lambda k: eqx.nn.MLP(1, 1, 8, 1, key=k), size=3, key=KEY)


def test_a_schedule_that_turns_negative_is_named_when_the_members_diverge():
    schedule = optax.linear_schedule(0.05, -5.0, transition_steps=40)
    steep = lambda model, batch, key: jnp.sum(  # noqa: E731
        jax.vmap(model)(batch[0]) ** 2
    )
    with pytest.raises(ee.EnsembleDivergedError) as caught:
        ee.fit(
            ENS, steep, optax.sgd(schedule), (LINE_X, LINE_Y), steps=400, batch_size=8,
            key=KEY, callbacks=(),
        )  # fmt: skip
    message = str(caught.value)
    # The first negative value of the schedule, computed independently (optax
    # reads it at the count of steps done; the message counts steps from 1):
    first = next(count for count in range(400) if float(schedule(count)) < 0)
    assert f"`learning_rate` schedule is negative from step {first + 1}" in message
    assert "lower the learning rate" not in message


def test_a_constant_learning_rate_keeps_the_usual_advice():
    def explode(model, batch, key):
        return jnp.mean(jax.vmap(model)(batch[0])) * jnp.inf

    with pytest.raises(ee.EnsembleDivergedError, match="lower the learning rate"):
        ee.fit(
            ENS, explode, optax.sgd(0.1), (LINE_X, LINE_Y), steps=3, batch_size=8,
            key=KEY, callbacks=(),
        )  # fmt: skip


def test_the_version_the_errors_name_is_the_package_version():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert meta["version"] == ee.__version__
    with pytest.raises(TypeError) as caught:
        ee.fit(
            ENS, mse_loss, optax.sgd(0.1), (LINE_X, LINE_Y), steps=1, key=KEY,
            unroll=True,
        )  # fmt: skip
    named = re.search(r"version (\d+\.\d+)", str(caught.value))
    assert named is not None
    assert ee.__version__.startswith(named[1] + ".")


def test_every_step_number_counts_from_one(tmp_path):
    # Member 1's learning rate blows SGD up after a few steps. Its divergence
    # step is the same number in the result, the log's event, the progress
    # meter and (when every member diverges) the error; it is the first row of
    # the log whose loss column is NaN from then on, and the log's step column,
    # the evaluations and the checkpoints count the same way (step t: the
    # t-th update, after which t steps are done).
    sgd = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
    rates = jnp.array([0.1, 6.0, 0.1])
    seen = []

    class Meter(ee.ProgressMeter):
        def start(self, total, done, resumed):
            return None

        def update(self, handle, done, losses, diverged_at):
            seen.append(diverged_at.copy())

        def close(self, handle):
            pass

    result = ee.fit(
        ENS, mse_loss, sgd, (LINE_X, LINE_Y), steps=20, batch_size=8, key=KEY,
        opt_state=ee.init_optimizer(sgd, ENS, hyperparams={"learning_rate": rates}),
        evaluate=ee.Evaluate(mse_loss, (LINE_X, LINE_Y), every=5),
        checkpoints=ee.Checkpoints(tmp_path / "ckpt", every=10),
        callbacks=[ee.CSVLogger(tmp_path / "logs"), Meter()],
        execution=ee.Execution(steps_per_dispatch=5),
    )  # fmt: skip
    assert set(result.diverged) == {1}
    t = result.diverged[1]
    assert 1 <= t <= 20
    table = np.loadtxt(tmp_path / "logs" / "losses.csv", delimiter=",", skiprows=1)
    np.testing.assert_array_equal(table[:, 0], np.arange(1, 21))
    column = table[:, 2]  # member 1
    assert np.isfinite(column[: t - 1]).all() and np.isnan(column[t:]).all()
    np.testing.assert_allclose(column, result.history.losses[:, 1], rtol=1e-6)
    events = (tmp_path / "logs" / "events.jsonl").read_text()
    assert f'{{"step": {t}, "event": "diverged", "member": 1}}' in events
    assert int(seen[-1][1]) == t and (np.delete(seen[-1], 1) == -1).all()
    # Member 1 keeps its weights after step t - 1: a run of t - 1 steps.
    before = ee.fit(
        ENS, mse_loss, sgd, (LINE_X, LINE_Y), steps=t - 1, batch_size=8, key=KEY,
        opt_state=ee.init_optimizer(sgd, ENS, hyperparams={"learning_rate": rates}),
        callbacks=(),
    ) if t > 1 else None  # fmt: skip
    if before is not None:
        assert before.diverged == {}
        assert tree_equal(result.ensemble[1], before.ensemble[1])
    np.testing.assert_array_equal(result.history.eval_steps, [5, 10, 15, 20])
    assert [step for step, _ in ee.list_checkpoints(tmp_path / "ckpt")] == [10, 20]

    # Every member diverging: the error names the same numbers.
    with pytest.raises(ee.EnsembleDivergedError) as caught:
        ee.fit(
            ENS, mse_loss, sgd, (LINE_X, LINE_Y), steps=20, batch_size=8, key=KEY,
            opt_state=ee.init_optimizer(sgd, ENS, hyperparams={"learning_rate": 6.0}),
            callbacks=(),
        )  # fmt: skip
    steps = caught.value.result.diverged  # pyright: ignore[reportAttributeAccessIssue]
    listed = [steps[member] for member in range(3)]
    assert f"at steps {listed}" in str(caught.value)
    assert min(listed) >= 1
