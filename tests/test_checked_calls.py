"""`fit`'s per-call work: a call like one checked before skips the checks that
read only its inputs' structure (`run._checked`, kept with the loss's plans),
every call that differs is checked again, a known fresh call starts without
the start program (`train_state.FreshStart`), and the compiled calls sort
array leaves from the rest as `eqx.is_array` does (`compile._split_leaves`)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import eqx_ensemble as ee
from eqx_ensemble._execution import cache as cache_module
from eqx_ensemble._execution.compile import _split_leaves
from eqx_ensemble._execution.intern import canonical_tree
from eqx_ensemble._training import run as run_module

X = jnp.linspace(-1, 1, 32)[:, None]
DATA = (X, X**2)


def _ens():
    return ee.ensemble(
        lambda k: eqx.nn.MLP(1, 1, 8, 1, key=k), size=3, key=jax.random.key(0)
    )


def _loss(model, batch, key):
    xb, yb = batch
    return jnp.mean((jax.vmap(model)(xb) - yb) ** 2)


def _fit(ens, loss=_loss, data=DATA, **kwargs):
    arguments = dict(steps=4, batch_size=8, key=jax.random.key(1), callbacks=())
    arguments.update(kwargs)
    return ee.fit(ens, loss, optax.adam(1e-2), data, **arguments)


def _counting(monkeypatch, name="check_inputs"):
    """The calls of `run.<name>` (its checks, or its start program's)."""
    calls = []
    original = getattr(run_module, name)

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(run_module, name, counted)
    return calls


def _same(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_a_call_like_one_checked_before_skips_its_checks_with_the_same_bits(
    monkeypatch,
):
    calls = _counting(monkeypatch)

    def loss(model, batch, key):  # a loss of its own: no entry from other tests
        return _loss(model, batch, key)

    ens = _ens()
    first = _fit(ens, loss)
    again = _fit(_ens(), loss)  # equal inputs, new arrays: no checks
    assert len(calls) == 1
    cache_module.owner_table(loss).clear()  # forgotten with the plans
    checked = _fit(_ens(), loss)
    assert len(calls) == 2
    for result in (again, checked):
        _same(result.ensemble, first.ensemble)
        _same(result.opt_state, first.opt_state)
        np.testing.assert_array_equal(result.history.losses, first.history.losses)
    # NumPy data of the same shapes is another call (its own checks).
    _fit(ens, loss, data=tuple(np.asarray(leaf) for leaf in DATA))
    assert len(calls) == 3
    # Components, evaluation and `hyper` are checked on every call.
    _fit(ens, loss, callbacks=[lambda result: None])
    _fit(ens, loss, callbacks=[lambda result: None])
    _fit(ens, _hyper_loss, hyper={"scale": jnp.ones(3)}, steps=2)
    _fit(ens, _hyper_loss, hyper={"scale": jnp.ones(3)}, steps=2)
    assert len(calls) == 7


def _hyper_loss(model, batch, key, *, hyper):
    return _loss(model, batch, key) * hyper["scale"]


@pytest.mark.parametrize(
    "change, error, match",
    [
        (dict(steps=0), ValueError, "steps"),
        (dict(batch_size=8.0), TypeError, "batch_size"),
        (dict(batch_size=64), ValueError, "larger than the data"),
        # (a raw key of 4 words: past the annotation, which takes one)
        (dict(key=jnp.zeros(4, jnp.uint32)), ValueError, "single PRNG key"),
        (dict(data=(X, X[:16])), ValueError, "leading"),
        (dict(sampling="independent", batch_size=64), ValueError, "larger"),
        (dict(opt_state="other"), ValueError, "optimizer state"),
    ],
)
def test_every_call_that_differs_is_checked_again(change, error, match):
    def loss(model, batch, key):
        return _loss(model, batch, key)

    ens = _ens()
    _fit(ens, loss)
    _fit(ens, loss)  # now known
    if change.get("opt_state") == "other":  # made for another ensemble
        other = ee.ensemble(
            lambda k: eqx.nn.MLP(1, 1, 4, 1, key=k), size=3, key=jax.random.key(0)
        )
        change = dict(opt_state=ee.init_optimizer(optax.adam(1e-2), other))
    with pytest.raises(error, match=match):
        _fit(ens, loss, **change)


def test_a_number_equal_to_a_checked_one_but_of_another_type_is_checked():
    def loss(model, batch, key):
        return _loss(model, batch, key)

    ens = _ens()
    _fit(ens, loss, steps=1)
    _fit(ens, loss, steps=1)
    with pytest.raises(TypeError, match="steps"):  # `True == 1`, but not a count
        _fit(ens, loss, steps=True)


class _Shaped:  # a leaf with a shape and no dtype, as a data frame
    shape = (32, 1)


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(track=""), "track"),  # (past the annotation: a sequence)
        (dict(data=_Shaped()), "data"),
    ],
)
def test_what_a_known_call_would_skip_is_refused_as_on_a_first_call(change, match):
    def loss(model, batch, key):
        return _loss(model, batch, key)

    ens = _ens()
    with pytest.raises(TypeError, match=match):  # first
        _fit(ens, loss, **change)
    _fit(ens, loss)
    _fit(ens, loss)
    with pytest.raises(TypeError, match=match):  # after known calls
        _fit(ens, loss, **change)


def test_hyperparameters_values_are_checked_on_every_call():
    ens = _ens()
    _fit(ens, _hyper_loss, hyper={"scale": jnp.ones(3)})
    with pytest.raises(ValueError, match="non-finite"):
        _fit(ens, _hyper_loss, hyper={"scale": jnp.array([1.0, jnp.nan, 1.0])})


def test_leaves_are_sorted_as_equinox_sorts_them_traced_or_not():
    def kinds(x):
        arrays, static = _split_leaves([x])
        assert (len(arrays) == 1) == eqx.is_array(x), type(x)
        return x

    for leaf in (jnp.ones(2), np.ones(2), np.float32(1), jax.random.key(0), 1, 2.0):
        kinds(leaf)
    kinds(None)
    kinds("text")
    jax.jit(lambda x: kinds(x) * 2)(jnp.ones(2))
    jax.vmap(lambda x: kinds(x) * 2)(jnp.ones(2))
    jax.grad(lambda x: kinds(x).sum())(jnp.ones(2))
    jax.jvp(kinds, (jnp.ones(2),), (jnp.ones(2),))
    jax.jit(lambda key: kinds(key))(jax.random.key(0))
    # Numbers keep their type in the static part: `1` and `True` are apart.
    assert _split_leaves([1])[1] != _split_leaves([True])[1]
    assert _split_leaves([1.0])[1] != _split_leaves([1])[1]


# A known call of a fresh run whose dispatches donate nothing starts from its
# own arrays and a kept optimizer state, without the start program
# (`train_state.FreshStart`): kept on a call's second sight, used from its
# third.


@pytest.fixture
def counted(monkeypatch):
    """The start programs `fit` runs (counted), and a loss of the test's own."""

    @_own
    def loss(model, batch, key):
        return _loss(model, batch, key)

    return _counting(monkeypatch, "start_state"), loss


def _own(loss):
    # Equal losses are one (`intern`): this test's starts with no known call.
    _table(loss).clear()
    return loss


def _table(loss):
    return cache_module.owner_table(canonical_tree(loss))


def _kept(loss):
    (entry,) = [
        found
        for key, found in _table(loss).items()
        if isinstance(key, tuple) and key[0] == "fit call"
    ]
    return entry.fresh


def _shifted(tree, by):
    return jax.tree.map(lambda x: x + by if eqx.is_inexact_array(x) else x, tree)


def test_a_call_seen_twice_starts_without_its_program_with_the_same_bits(counted):
    starts, loss = counted

    ens = _ens()
    first = _fit(ens, loss)
    assert _kept(loss) is None  # seen once: nothing kept (a sweep keeps none)
    _fit(ens, loss)
    assert len(starts) == 2 and _kept(loss).kept  # seen twice: kept
    # Other weights and another optimizer state, equal in structure: from
    # the kept start, the bits of a run from its own start program.
    other = _shifted(ens, 0.25)
    opt_state = _shifted(ee.init_optimizer(optax.adam(1e-2), ens), 0.5)
    fresh = [_fit(other, loss), _fit(ens, loss)]
    assert len(starts) == 2
    _fit(ens, loss, opt_state=opt_state)  # (another call: seen once, twice)
    _fit(ens, loss, opt_state=opt_state)
    given = _fit(other, loss, opt_state=opt_state)
    assert len(starts) == 4
    _table(loss).clear()  # each made by its start program
    made = [_fit(other, loss), _fit(ens, loss), _fit(other, loss, opt_state=opt_state)]
    assert len(starts) == 7
    for got, want in zip([*fresh, given], made, strict=True):
        _same(got.ensemble, want.ensemble)
        _same(got.opt_state, want.opt_state)
        np.testing.assert_array_equal(got.history.losses, want.history.losses)
    _same(fresh[1].ensemble, first.ensemble)
    # The caller's arrays are read, never donated nor changed.
    _same(ens, _ens())
    _same(other, _shifted(_ens(), 0.25))
    _same(opt_state, _shifted(ee.init_optimizer(optax.adam(1e-2), ens), 0.5))


def test_a_member_diverging_in_a_fresh_start_run_is_settled_as_from_its_program(
    counted,
):
    # The optimistic guard runs the dispatch again from its start state: here
    # the caller's arrays and the kept ones, which must come out unchanged.
    starts, loss = counted

    sgd = optax.inject_hyperparams(optax.sgd)(learning_rate=0.01)
    ens = _ens()

    def fit(rates):
        opt_state = ee.init_optimizer(sgd, ens, hyperparams={"learning_rate": rates})
        result = ee.fit(
            ens, loss, sgd, DATA, steps=30, batch_size=8, key=jax.random.key(1),
            opt_state=opt_state, callbacks=(),
        )  # fmt: skip
        return result, opt_state

    wild, tame = jnp.array([0.01, 1e4, 0.02]), jnp.array([0.01, 0.01, 0.02])
    for _ in range(2):
        fit(tame)
    diverged, opt_state = fit(wild)  # a fresh start
    healthy, _ = fit(tame)  # and after it, fresh counters
    assert len(starts) == 2
    assert set(diverged.diverged) == {1} and healthy.diverged == {}
    _same(ens, _ens())
    _same(opt_state, ee.init_optimizer(sgd, ens, hyperparams={"learning_rate": wild}))
    _table(loss).clear()
    made, _ = fit(wild)
    assert len(starts) == 3
    assert made.diverged == diverged.diverged
    _same(diverged.ensemble, made.ensemble)
    _same(diverged.opt_state, made.opt_state)
    np.testing.assert_array_equal(diverged.history.losses, made.history.losses)


def test_kept_start_arrays_deleted_since_are_made_and_kept_again(counted):
    starts, loss = counted

    first, _ = _fit(_ens(), loss), _fit(_ens(), loss)
    kept = _kept(loss).kept
    assert kept  # the fresh Adam state and the counters
    kept[0].delete()  # (by the caller: the live arrays cleared, say)
    again = _fit(_ens(), loss)
    assert len(starts) == 3
    assert not any(leaf.is_deleted() for leaf in _kept(loss).kept)
    third = _fit(_ens(), loss)
    assert len(starts) == 3
    for result in (again, third):
        _same(result.ensemble, first.ensemble)
        _same(result.opt_state, first.opt_state)


def _copying(inner):
    # An optimizer whose state holds a copy of the weights (as Lookahead's).
    copy = optax.GradientTransformation(
        lambda params: {"start": params},
        lambda updates, state, params=None: (updates, state),
    )
    return optax.chain(inner, copy)


def test_only_an_optimizer_state_that_reads_no_weight_is_kept(counted):
    from eqx_ensemble._training.train_state import reads_weights

    ens = _ens()
    assert not reads_weights(optax.adam(1e-2), ens)
    assert not reads_weights(optax.inject_hyperparams(optax.sgd)(0.1, 0.9), ens)
    assert reads_weights(_copying(optax.sgd(0.1)), ens)
    starts, loss = counted

    def fit(ens):
        return ee.fit(
            ens, loss, _copying(optax.sgd(0.1)), DATA, steps=2, batch_size=8,
            key=jax.random.key(1), callbacks=(),
        )  # fmt: skip

    for _ in range(2):
        fit(_ens())
    assert _kept(loss) is False  # never
    other = _shifted(_ens(), 1.0)
    result = fit(other)
    assert len(starts) == 3
    kept = result.opt_state[1]["start"]  # this call's weights
    _same(eqx.filter(kept, eqx.is_array), eqx.filter(other, eqx.is_array))


def test_committed_arrays_and_another_default_device_start_by_their_program(counted):
    starts, loss = counted

    first, _ = _fit(_ens(), loss), _fit(_ens(), loss)
    device = jax.devices()[1]
    params, static = eqx.partition(_ens(), eqx.is_array)
    committed = eqx.combine(jax.device_put(params, device), static)
    moved = [_fit(committed, loss) for _ in range(3)]
    assert len(starts) == 5  # another call, never from kept arrays
    with jax.default_device(device):
        elsewhere = [_fit(_ens(), loss) for _ in range(3)]
    assert len(starts) == 7  # another call: kept on its own device
    for result in [*moved, *elsewhere]:
        assert all(
            leaf.devices() == {device}
            for leaf in jax.tree.leaves((result.ensemble, result.opt_state))
            if eqx.is_array(leaf)
        )
        _same(result.ensemble, first.ensemble)


def test_a_guard_at_every_step_keeps_its_start_program(counted):
    starts, loss = counted

    step = ee.Execution(guard="step")
    ens = _ens()
    results = [_fit(ens, loss, execution=step) for _ in range(3)]
    assert len(starts) == 3  # its dispatches donate their state
    assert _kept(loss) is False
    _same(results[2].ensemble, results[0].ensemble)
    _same(ens, _ens())


def test_a_key_objects_run_keys_are_derived_once_while_it_lives(monkeypatch):
    from eqx_ensemble._internal.keys import run_keys
    from eqx_ensemble._training import train_state as train_state_module

    made = []
    program = train_state_module._keys()

    def counting():
        def keys(key):
            made.append(1)
            return program(key)

        return keys

    monkeypatch.setattr(train_state_module, "_keys", counting)
    derive = train_state_module.derived_keys

    def derived(key):
        return derive(key)

    def same_keys(a, b):
        _same(*(jax.tree.map(jax.random.key_data, keys) for keys in (a, b)))

    key = jax.random.key(7)
    first = derived(key)
    assert derive(key) is first and len(made) == 1  # the same object: kept
    same_keys(first, run_keys(key))
    equal = jax.random.key(7)  # another object, of equal value: derived again
    same_keys(derived(equal), first)
    assert len(made) == 2
    first.train.delete()  # (deleted since: derived again)
    same_keys(derived(key), run_keys(key))
    assert len(made) == 3
    # `jax_threefry_partitionable` changes what `split` gives: the same key
    # object derives again under the other setting (a review found the keys
    # of the first setting returned).
    flag = jax.config.jax_threefry_partitionable
    try:
        jax.config.update("jax_threefry_partitionable", not flag)
        other = derived(key)
        assert len(made) == 4
        same_keys(other, run_keys(key))
        assert not np.array_equal(
            jax.random.key_data(other.data), jax.random.key_data(first.data)
        )
    finally:
        jax.config.update("jax_threefry_partitionable", flag)
    assert derive(key) is not other and len(made) == 4  # its own entry again
    # In `fit`: one key object in a loop, the bits of keys derived anew.
    results = [_fit(_ens(), key=key) for _ in range(3)]
    _same(results[2].ensemble, _fit(_ens(), key=jax.random.key(7)).ensemble)
    assert results[0].key is key
