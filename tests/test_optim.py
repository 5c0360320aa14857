"""`ee.init_optimizer` / `ee.set_hyperparams`: one optax state per member."""

import functools
import inspect

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import assert_tree_allclose, tree_equal

import eqx_ensemble as ee

SIZE = 3


def params(model):
    return eqx.filter(model, eqx.is_inexact_array)


def stacked(trees):
    return jax.tree.map(lambda *leaves: jnp.stack(leaves), *trees)


def member(tree, i):
    return jax.tree.map(lambda leaf: leaf[i] if eqx.is_array(leaf) else leaf, tree)


@pytest.fixture(scope="module")
def ens():
    return ee.ensemble(
        lambda k: eqx.nn.MLP(2, 1, 4, 1, key=k), size=SIZE, key=jax.random.key(0)
    )


@pytest.mark.parametrize(
    "optimizer",
    [
        optax.adam(1e-3),
        optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3)),
        optax.inject_hyperparams(optax.sgd)(learning_rate=0.1, momentum=0.9),
    ],
    ids=["adam", "clip+adamw", "inject(sgd)"],
)
def test_state_is_the_stack_of_member_states(ens, optimizer):
    state = ee.init_optimizer(optimizer, ens)
    expected = stacked([optimizer.init(params(ens[i])) for i in range(SIZE)])
    assert_tree_allclose(state, expected, rtol=0, atol=0)
    for leaf in jax.tree.leaves(state):
        assert leaf.shape[0] == SIZE


def test_per_member_hyperparams(ens):
    optimizer = optax.inject_hyperparams(optax.adam)(learning_rate=1e-3, b1=0.9)
    learning_rates = jnp.array([0.0, 1e-2, 1e-3])
    state = ee.init_optimizer(
        optimizer, ens, hyperparams={"learning_rate": learning_rates}
    )
    np.testing.assert_array_equal(state.hyperparams["learning_rate"], learning_rates)
    # The others keep their (per-member copies of the) shared value.
    np.testing.assert_allclose(state.hyperparams["b1"], np.full(SIZE, 0.9))
    # Member i's state equals a solo state whose optimizer has member i's value.
    for i in range(SIZE):
        solo_optimizer = optax.inject_hyperparams(optax.adam)(
            learning_rate=learning_rates[i], b1=0.9
        )
        assert_tree_allclose(
            member(state, i), solo_optimizer.init(params(ens[i])), rtol=0, atol=0
        )


def test_scalar_and_numpy_hyperparams_are_broadcast_and_cast(ens):
    optimizer = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
    state = ee.init_optimizer(optimizer, ens, hyperparams={"learning_rate": 0.5})
    np.testing.assert_array_equal(state.hyperparams["learning_rate"], [0.5] * SIZE)
    state = ee.set_hyperparams(
        state, {"learning_rate": np.array([0.1, 0.2, 0.3])}, SIZE
    )
    rates = state.hyperparams["learning_rate"]
    assert rates.dtype == jnp.float32
    np.testing.assert_allclose(rates, [0.1, 0.2, 0.3])


def test_weakly_typed_hyperparams_take_the_state_type(ens):
    # `jnp.full(3, 0.1)` is weakly typed; the state must keep optax's own type, or
    # it would change type at the first update.
    optimizer = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
    fresh = ee.init_optimizer(optimizer, ens)
    state = ee.set_hyperparams(fresh, {"learning_rate": jnp.full(SIZE, 0.5)}, SIZE)
    rates, original = (
        state.hyperparams["learning_rate"],
        fresh.hyperparams["learning_rate"],
    )
    assert jax.typeof(rates) == jax.typeof(original)


def test_hyperparams_inside_a_chain(ens):
    optimizer = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.inject_hyperparams(optax.adamw)(learning_rate=1e-3, weight_decay=1e-4),
    )
    decays = jnp.array([0.0, 0.1, 0.2])
    state = ee.init_optimizer(optimizer, ens, hyperparams={"weight_decay": decays})
    np.testing.assert_array_equal(state[1].hyperparams["weight_decay"], decays)


def _mse(model, batch, key):
    xb, yb = batch
    return jnp.mean((jax.vmap(model)(xb) - yb) ** 2)


def _assert_members_train_like_solo_runs(ens, optimizer, opt_state, solos, steps):
    """`steps` of `make_step` from `opt_state` against member i trained alone
    with the plain optax optimizer `solos[i]` on the same batch."""
    x = jax.random.normal(jax.random.key(1), (16, 2))
    batch = (x, x[:, :1] * x[:, 1:])
    step = ee.make_step(_mse, optimizer)
    trained = ens
    for t in range(steps):
        trained, opt_state, *_ = step(trained, opt_state, batch, jax.random.key(t))
    for i, solo_optimizer in enumerate(solos):
        model, solo_state = ens[i], solo_optimizer.init(params(ens[i]))
        # optax's extra argument `value` (the loss), to those that take it.
        takes = inspect.signature(solo_optimizer.update).parameters.values()
        extra = any(p.name == "value" or p.kind is p.VAR_KEYWORD for p in takes)
        for _ in range(steps):
            value, grads = eqx.filter_value_and_grad(_mse)(model, batch, None)
            with jax.numpy_dtype_promotion("standard"):  # optax's own promotions
                updates, solo_state = solo_optimizer.update(
                    grads,
                    solo_state,
                    params(model),
                    **({"value": value} if extra else {}),
                )
            model = eqx.apply_updates(model, updates)
        # Adam's normalised steps turn float32 rounding of small gradients into
        # ~1e-6 differences after a few large (lr 0.1) steps.
        assert_tree_allclose(trained[i], model, rtol=1e-5, atol=1e-5)
    return trained


def test_per_member_weight_decay_trains_like_solo_runs(ens):
    # A hyperparameter sweep as one ensemble: member i == adamw with decay i.
    decays = [0.0, 0.5, 2.0]
    optimizer = optax.inject_hyperparams(optax.adamw)(
        learning_rate=0.1, weight_decay=0.0
    )
    opt_state = ee.init_optimizer(
        optimizer, ens, hyperparams={"weight_decay": jnp.array(decays)}
    )
    solos = [optax.adamw(0.1, weight_decay=decay) for decay in decays]
    trained = _assert_members_train_like_solo_runs(ens, optimizer, opt_state, solos, 3)
    assert not tree_equal(trained[1], trained[2])


def test_per_member_rates_inside_multisteps_train_like_solo_runs(ens):
    # `optax.MultiSteps` keeps the inner state through a `cond` and a select
    # (the hyperparameters are not the update's inputs as they are): the
    # check that they are kept must see through both, not refuse them as a
    # schedule. Member i == MultiSteps(sgd(rate i)) run alone.
    rates = [0.3, 0.1, 0.0]

    def accumulated(inner):
        return optax.MultiSteps(inner, every_k_schedule=2).gradient_transformation()

    optimizer = accumulated(optax.inject_hyperparams(optax.sgd)(learning_rate=0.2))
    opt_state = ee.init_optimizer(
        optimizer, ens, hyperparams={"learning_rate": jnp.array(rates)}
    )
    np.testing.assert_allclose(
        opt_state.inner_opt_state.hyperparams["learning_rate"], rates
    )
    solos = [accumulated(optax.sgd(rate)) for rate in rates]
    trained = _assert_members_train_like_solo_runs(ens, optimizer, opt_state, solos, 4)
    assert tree_equal(trained[2], ens[2])  # rate 0: unchanged
    assert not tree_equal(trained[0], ens[0])


# --------------------------------------------------------------------------------
# optax's extra argument `value`: each member's own loss.
# --------------------------------------------------------------------------------


def _plateau(factor):
    # Halve (or scale by `factor`) the step after one step without progress.
    return optax.chain(
        optax.sgd(0.5),
        optax.contrib.reduce_on_plateau(patience=1, factor=factor, min_scale=1e-3),
    )


@pytest.mark.parametrize(
    "make_optimizer",
    [
        lambda: _plateau(0.5),
        lambda: optax.polyak_sgd(max_learning_rate=0.5),
        # Not typed `GradientTransformationExtraArgs`, but passes them on.
        lambda: optax.MultiSteps(
            _plateau(0.5), every_k_schedule=2
        ).gradient_transformation(),
        # Takes `grad_fn` only (no `**extra_args`): given neither key nor value.
        lambda: optax.contrib.sam(optax.sgd(0.3), optax.sgd(0.1), sync_period=2),
    ],
    ids=["reduce_on_plateau", "polyak_sgd", "multisteps", "sam"],
)
def test_optimizers_with_extra_arguments_train_each_member_like_a_solo_run(
    ens, make_optimizer
):
    # `optax.contrib.reduce_on_plateau` and `optax.polyak_sgd` take the loss as
    # `update(..., value=loss)`: each member is given its own, so member i
    # trains as it would alone (its own plateau, its own Polyak step).
    optimizer = make_optimizer()
    opt_state = ee.init_optimizer(optimizer, ens)
    trained = _assert_members_train_like_solo_runs(
        ens, optimizer, opt_state, [make_optimizer()] * SIZE, 8
    )
    assert not tree_equal(trained[0], ens[0])


def _records_value(threshold=jnp.inf):
    """A transformation that passes the updates on and keeps in its state the
    `value` it was given, an infinity from its start that it never changes (a
    sentinel, as reduce_on_plateau's best value), and a flag that becomes NaN
    from its second update on where the value exceeds `threshold`."""

    def init(params):
        del params
        zero = jnp.zeros(())
        count = jnp.zeros((), jnp.int32)
        return {"value": zero, "sentinel": jnp.array(jnp.inf), "flag": zero, "n": count}

    def update(updates, state, params=None, *, value, **extra):
        del params, extra
        n = state["n"] + 1
        flag = jnp.where((n >= 2) & (value > threshold), jnp.nan, 0.0)
        sentinel = state["sentinel"]
        return updates, {"value": value, "sentinel": sentinel, "flag": flag, "n": n}

    return optax.GradientTransformationExtraArgs(init, update)


def _scaled_mse(model, batch, key, hyper):
    return hyper * _mse(model, batch, key)


def test_the_value_given_is_the_members_loss_and_the_shared_parts_sum():
    # Independent reference: the losses the step reports. A trained shared
    # part's gradient is the sum of the members' gradients: its value is the
    # sum of their losses.
    ens = ee.ensemble(
        lambda k: eqx.nn.MLP(2, 1, 4, 1, key=k),
        size=SIZE,
        key=jax.random.key(0),
        shared=lambda m: m.layers[0],
        train_shared=True,
    )
    optimizer = optax.chain(optax.sgd(0.1), _records_value())
    x = jax.random.normal(jax.random.key(1), (16, 2))
    batch = (x, x[:, :1] * x[:, 1:])
    step = ee.make_step(_mse, optimizer)
    out = step(ens, ee.init_optimizer(optimizer, ens), batch, jax.random.key(2))
    members, shared = out.opt_state.members[1], out.opt_state.shared[1]
    np.testing.assert_array_equal(members["value"], out.losses)
    np.testing.assert_allclose(shared["value"], jnp.sum(out.losses), rtol=1e-6)
    # `fit`: the value of its last step is that step's loss.
    result = ee.fit(
        ens, _mse, optimizer, batch, steps=3, batch_size=16, key=jax.random.key(3),
        callbacks=(),
    )  # fmt: skip
    np.testing.assert_array_equal(
        result.opt_state.members[1]["value"], result.history.losses[-1]
    )


def test_the_value_of_a_coupled_loss_is_its_total(ens):
    # Every member's gradient is of the coupled objective: each is given it.
    def together(ensemble, batch, keys):  # the members' losses: summed
        x, y = batch
        out = ee.map(lambda m, xs: jax.vmap(m)(xs), ensemble, x)
        return jnp.mean((out - y[None]) ** 2, axis=(1, 2))

    optimizer = optax.chain(optax.sgd(0.1), _records_value())
    x = jax.random.normal(jax.random.key(1), (16, 2))
    step = ee.make_step(ee.Coupled(together), optimizer)
    out = step(ens, ee.init_optimizer(optimizer, ens), (x, x[:, :1]), jax.random.key(2))
    total = jnp.sum(out.losses)  # the step's own report of each member's
    np.testing.assert_allclose(out.opt_state[1]["value"], [total] * SIZE, rtol=1e-6)


def test_infinite_optimizer_scalars_are_no_divergence_and_nan_ones_are(ens):
    # The guard checks the optimizer state; its scalars may be infinite by
    # design: reduce_on_plateau's best value until its first average (here
    # longer than the run), a clipping threshold of inf (no clipping) on some
    # steps. A NaN scalar still freezes the member, at the same step in the
    # guarded step (`make_step`, `guard="step"`) and the optimistic dispatch
    # (`fit`'s default: checked once per dispatch), whatever its length.
    x = jax.random.normal(jax.random.key(1), (16, 2))
    batch = (x, x[:, :1] * x[:, 1:])
    plateau = optax.chain(
        optax.sgd(0.1), optax.contrib.reduce_on_plateau(accumulation_size=10)
    )
    fit = functools.partial(
        ee.fit, steps=4, batch_size=16, key=jax.random.key(3), callbacks=()
    )
    result = fit(ens, _mse, plateau, batch)
    assert result.diverged == {}
    assert np.isinf(result.opt_state[1].best_value).all()

    def clipped(rate):  # no clipping on even steps: max_norm inf
        norm = lambda count: jnp.where(count % 2 == 0, jnp.inf, 0.1)  # noqa: E731
        return optax.chain(
            optax.inject_hyperparams(optax.clip_by_global_norm)(max_norm=norm),
            optax.sgd(rate),
        )

    optimizer = clipped(0.5)
    _assert_members_train_like_solo_runs(
        ens, optimizer, ee.init_optimizer(optimizer, ens), [clipped(0.5)] * SIZE, 4
    )
    for execution in (None, ee.Execution(steps_per_dispatch=1)):
        assert fit(ens, _mse, optimizer, batch, execution=execution).diverged == {}

    # Member 1's loss is above the threshold: its flag turns NaN at step 2.
    optimizer = optax.chain(optax.sgd(0.0), _records_value(threshold=1e20))
    hyper = jnp.array([1.0, 1e30, 1.0])
    step = ee.make_step(_scaled_mse, optimizer)
    trained, opt_state = ens, ee.init_optimizer(optimizer, ens)
    for t in range(2):
        out = step(trained, opt_state, batch, jax.random.key(t), hyper=hyper)
        trained, opt_state = out.ensemble, out.opt_state
    kept = opt_state[1]
    np.testing.assert_array_equal(kept["n"], [2, 1, 2])  # member 1: its step 1
    np.testing.assert_array_equal(kept["sentinel"], [jnp.inf] * SIZE)
    np.testing.assert_array_equal(kept["flag"], [0.0] * SIZE)
    np.testing.assert_array_equal(kept["value"][::2], out.losses[::2])
    for execution in (
        None, ee.Execution(steps_per_dispatch=1), ee.Execution(guard="step")
    ):  # fmt: skip
        result = fit(
            ens, _scaled_mse, optimizer, batch, hyper=hyper, execution=execution
        )
        assert result.diverged == {1: 2}
        np.testing.assert_array_equal(result.opt_state[1]["n"], [4, 1, 4])


def test_set_hyperparams_does_not_modify_its_input(ens):
    optimizer = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
    state = ee.init_optimizer(optimizer, ens)
    ee.set_hyperparams(state, {"learning_rate": jnp.zeros(SIZE)}, SIZE)
    np.testing.assert_allclose(state.hyperparams["learning_rate"], [0.1] * SIZE)


# --------------------------------------------------------------------------------
# Bad input.
# --------------------------------------------------------------------------------


def test_hyperparams_of_wrong_length(ens):
    optimizer = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
    with pytest.raises(ValueError, match=r"ensemble has 3 members, got shape \(2,\)"):
        ee.init_optimizer(optimizer, ens, hyperparams={"learning_rate": jnp.ones(2)})
    # A 2-D array: the runtime type check (TypeError) or the library rejects it.
    with pytest.raises((TypeError, ValueError), match=r"3, ?1"):
        ee.init_optimizer(
            optimizer, ens, hyperparams={"learning_rate": jnp.ones((3, 1))}
        )


def test_unknown_hyperparameter(ens):
    optimizer = optax.inject_hyperparams(optax.adam)(learning_rate=0.1)
    with pytest.raises(ValueError, match=r"Unknown hyperparameter 'lr'.*'b1'"):
        ee.init_optimizer(optimizer, ens, hyperparams={"lr": jnp.ones(SIZE)})


def test_hyperparams_without_inject_hyperparams(ens):
    with pytest.raises(ValueError, match=r"optax.inject_hyperparams"):
        ee.init_optimizer(
            optax.adam(0.1), ens, hyperparams={"learning_rate": jnp.ones(SIZE)}
        )


def test_hyperparameter_injected_twice(ens):
    optimizer = optax.chain(
        optax.inject_hyperparams(optax.sgd)(learning_rate=0.1),
        optax.inject_hyperparams(optax.sgd)(learning_rate=0.2),
    )
    with pytest.raises(ValueError, match="injected in several places"):
        ee.init_optimizer(optimizer, ens, hyperparams={"learning_rate": jnp.ones(SIZE)})


def test_scheduled_hyperparameter_cannot_be_set_per_member(ens):
    # `inject_hyperparams` recomputes a schedule at every update: per-member values
    # would be overwritten silently after one step.
    optimizer = optax.inject_hyperparams(optax.adam)(
        learning_rate=optax.linear_schedule(1e-2, 1e-3, 100), b1=0.9
    )
    with pytest.raises(ValueError, match=r"'learning_rate' is a schedule"):
        ee.init_optimizer(optimizer, ens, hyperparams={"learning_rate": jnp.ones(SIZE)})
    # Also behind the `cond` and selects of `optax.MultiSteps`.
    accumulated = optax.MultiSteps(
        optimizer, every_k_schedule=2
    ).gradient_transformation()
    with pytest.raises(ValueError, match=r"'learning_rate' is a schedule"):
        ee.init_optimizer(
            accumulated, ens, hyperparams={"learning_rate": jnp.ones(SIZE)}
        )
    ee.init_optimizer(accumulated, ens, hyperparams={"b1": jnp.ones(SIZE) / 2})
    # A number-valued hyperparameter next to the schedule is fine.
    state = ee.init_optimizer(optimizer, ens, hyperparams={"b1": jnp.ones(SIZE) / 2})
    np.testing.assert_array_equal(state.hyperparams["b1"], [0.5] * SIZE)


def _rewriting(transform):
    # `inject_hyperparams(sgd)` whose update passes its learning rate through
    # `transform` (a wrapper's own code around an injected optimizer).
    inner = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)

    def update(updates, state, params=None):
        updates, state = inner.update(updates, state, params)
        rate = transform(state.hyperparams["learning_rate"])
        return updates, state._replace(
            hyperparams={**state.hyperparams, "learning_rate": rate}
        )

    return optax.GradientTransformation(inner.init, update)


def _swapped(rate, length):
    carries = jax.lax.scan(
        lambda pair, _: ((pair[1], pair[0]), None), (rate * 0.5, rate), length=length
    )[0]
    return carries[0]


@pytest.mark.parametrize(
    "transform, kept",
    [
        (lambda rate: jax.lax.scan(lambda c, _: (c, None), rate, length=3)[0], True),
        (lambda rate: jax.lax.while_loop(lambda c: False, lambda c: c, rate), True),
        (lambda rate: jnp.where(rate > 0, rate, rate), True),
        (lambda rate: _swapped(rate, 2), False),  # carries swapped: rate / 2
        (lambda rate: jax.lax.fori_loop(0, 0, lambda i, c: rate, rate * 0.5), False),
        (lambda rate: rate * 0.5, False),
    ],
)
def test_hyperparameter_kept_only_where_the_update_provably_passes_it_on(
    ens, transform, kept
):
    # Ground truth first: the value after three real updates.
    optimizer = _rewriting(transform)
    params_ = {"w": jnp.ones(3)}
    state = optimizer.init(params_)
    state = state._replace(hyperparams={"learning_rate": jnp.asarray(0.123)})
    for _ in range(3):
        _, state = optimizer.update({"w": jnp.ones(3)}, state, params_)
    assert bool(state.hyperparams["learning_rate"] == jnp.float32(0.123)) == kept
    rates = {"learning_rate": jnp.array([0.1, 0.2, 0.3])}
    if kept:
        set_ = ee.init_optimizer(optimizer, ens, hyperparams=rates)
        np.testing.assert_allclose(set_.hyperparams["learning_rate"], [0.1, 0.2, 0.3])
    else:
        with pytest.raises(ValueError, match="does not pass it on as it is"):
            ee.init_optimizer(optimizer, ens, hyperparams=rates)


def test_not_an_ensemble(ens):
    with pytest.raises(TypeError, match="Ensemble"):
        ee.init_optimizer(optax.adam(0.1), ens[0])


# ------------------------------------- hyperparameters and optimizers misgiven


@pytest.fixture(scope="module")
def linear_pair():
    return ee.ensemble(
        lambda k: eqx.nn.Linear(2, 1, key=k), size=2, key=jax.random.key(0)
    )


def test_set_hyperparams_with_another_size_is_refused(linear_pair):
    opt = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
    state = ee.init_optimizer(opt, linear_pair)
    with pytest.raises(ValueError, match="`size` is 3 but the optimizer state holds 2"):
        ee.set_hyperparams(state, {"learning_rate": 0.1}, size=3)


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_non_finite_hyperparameters_are_refused(linear_pair, value):
    opt = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
    state = ee.init_optimizer(opt, linear_pair)
    with pytest.raises(ValueError, match="not finite for members \\[1\\]"):
        ee.set_hyperparams(state, {"learning_rate": jnp.array([0.1, value])}, size=2)


def test_complex_hyperparameters_are_refused(linear_pair):
    opt = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
    state = ee.init_optimizer(opt, linear_pair)
    with pytest.raises(TypeError, match="real numbers|hyperparams"):
        ee.set_hyperparams(state, {"learning_rate": jnp.array([0.1, 1j])}, size=2)


def test_an_optimizer_name_gets_an_actionable_error(linear_pair):
    # (the suite's runtime type checker may answer first; both name the problem)
    with pytest.raises(TypeError, match="optax|optimizer"):
        ee.init_optimizer("adam", linear_pair)  # type: ignore[arg-type]


KEY = jax.random.key(0)
ENS = ee.ensemble(lambda k: eqx.nn.MLP(1, 1, 8, 1, key=k), size=3, key=KEY)


def _unchecked(function):
    # The function without the test run's jaxtyping/beartype hook (its error
    # names the parameter too): what a user without the hook calls.
    return getattr(function, "__wrapped__", function)


def test_hyperparams_that_are_not_a_dict_of_numbers_are_named():
    opt = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
    init = _unchecked(ee.init_optimizer)
    with pytest.raises(TypeError, match="`hyperparams` must be a dict"):
        init(opt, ENS, hyperparams=[0.1, 0.2, 0.3])
    state = ee.init_optimizer(opt, ENS)
    with pytest.raises(TypeError, match=r"`hyperparams\['learning_rate'\]` must be"):
        _unchecked(ee.set_hyperparams)(state, {"learning_rate": "abc"}, size=3)
    with pytest.raises(TypeError, match="`hyperparams` must be a dict"):
        _unchecked(ee.set_hyperparams)(state, [("learning_rate", 0.1)], size=3)
