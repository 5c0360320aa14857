"""`fit`'s per-call work: a call like one checked before skips the checks that
read only its inputs' structure (`run._checked`, kept with the loss's plans),
every call that differs is checked again, and the compiled calls sort array leaves from the rest as
`eqx.is_array` does (`compile._split_leaves`)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import eqx_ensemble as ee
from eqx_ensemble._execution import plan as plan_module
from eqx_ensemble._execution.compile import _split_leaves
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


def _counting(monkeypatch):
    calls = []
    original = run_module.check_inputs

    def check_inputs(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(run_module, "check_inputs", check_inputs)
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
    plan_module.owner_table(loss).clear()  # forgotten with the plans
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
