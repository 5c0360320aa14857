"""The divergence guard's two forms of the finiteness check (`_execution.guard`):
the same answer, element for element, and the rule that picks one."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import ON_CPU

import eqx_ensemble as ee
from eqx_ensemble._execution import plan as plan_module
from eqx_ensemble._execution.compile import MIN_STEP_FLOPS
from eqx_ensemble._execution.guard import choose_finite_check, step_flops
from eqx_ensemble._execution.profile import StepProfile, profile_jaxpr
from eqx_ensemble._training.step import all_finite

FORMS = ("per_leaf", "by_shape")
DTYPES = (jnp.float32, jnp.float16, jnp.bfloat16, jnp.complex64)


def _tree(rng, members):
    # Leaves of repeated and distinct shapes and dtypes (a weight, its gradient
    # and two moments share a shape), an integer leaf and a non-array.
    shapes = [(3, 4), (3, 4), (4,), (3, 4), (), (2, 2, 2)]
    leaves = {}
    for i, shape in enumerate(shapes):
        dtype = DTYPES[i % len(DTYPES)] if i != 1 else jnp.float32
        values = rng.standard_normal((members, *shape)) * 1e3
        leaves[f"leaf{i}"] = jnp.asarray(values, dtype)
    leaves["count"] = jnp.arange(members, dtype=jnp.int32)
    leaves["name"] = "not an array"
    return leaves


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan, "max"])
def test_both_forms_agree_with_numpy_member_by_member(bad):
    rng = np.random.default_rng(0)
    members = 6
    tree = _tree(rng, members)
    names = [k for k, v in tree.items() if eqx.is_inexact_array(v)]
    # Member m gets a bad value in leaf (m % len), at a random position; member
    # members-1 stays finite everywhere.
    for m in range(members - 1):
        name = names[m % len(names)]
        leaf = tree[name]
        index = (m, *(int(rng.integers(0, s)) for s in leaf.shape[1:]))
        if bad == "max":  # the largest finite value: still finite
            value = jnp.finfo(leaf.dtype).max
        else:
            value = bad
        tree[name] = leaf.at[index].set(jnp.asarray(value).astype(leaf.dtype))
    reference = [
        all(
            np.isfinite(np.asarray(tree[name][m], np.complex128)).all()
            for name in names
        )
        for m in range(members)
    ]
    assert reference[-1]
    if bad != "max":
        assert not any(reference[:-1])
    for form in FORMS:

        def member_check(t, form=form):
            first, second = t
            return all_finite(first, second, check=form)

        # Split into two trees, as the guard passes (gradients, weights, state).
        first = {k: tree[k] for k in list(tree)[:3]}
        second = {k: tree[k] for k in list(tree)[3:]}
        flags = eqx.filter_vmap(member_check)((first, second))
        np.testing.assert_array_equal(np.asarray(flags), reference, err_msg=form)


def test_no_floating_point_leaf_is_finite():
    for form in FORMS:
        assert bool(all_finite({"n": jnp.arange(3)}, None, check=form))


def test_the_rule():
    small, big = MIN_STEP_FLOPS / 2, MIN_STEP_FLOPS * 2
    assert choose_finite_check(flops=small, platform="cpu") == "per_leaf"
    assert choose_finite_check(flops=big, platform="cpu") == "by_shape"
    # On a GPU every step is checked by shape (fewer kernels; measured on an
    # H100, docs/benchmarks.md session 21); a TPU is not measured: per leaf.
    for flops in (small, big):
        assert choose_finite_check(flops=flops, platform="gpu") == "by_shape"
        assert choose_finite_check(flops=flops, platform="tpu") == "per_leaf"


def test_matmul_flops_are_read_from_the_jaxpr_scans_included():
    def f(a, b, xs):
        def body(carry, x):
            return carry, carry @ x

        _, ys = jax.lax.scan(body, a, xs)
        return (a @ b).sum() + ys.sum()

    jaxpr = jax.make_jaxpr(f)(jnp.ones((4, 5)), jnp.ones((5, 6)), jnp.ones((7, 5, 3)))
    profile = profile_jaxpr(jaxpr.jaxpr)
    assert profile.dot_flops == 2 * 4 * 6 * 5 + 7 * (2 * 4 * 3 * 5)


def test_a_sequence_models_tokens_count_toward_its_steps_size():
    # 2 members of a linear map applied to each of 64 tokens of 16 examples:
    # the weights' estimate sees 16 examples, the jaxpr's every token.
    ens = ee.ensemble(
        lambda k: eqx.nn.Linear(64, 64, key=k), size=2, key=jax.random.key(0)
    )
    member = jax.tree.map(lambda x: x[0] if eqx.is_array(x) else x, ens.members)

    def forward(model, batch):
        return jax.vmap(jax.vmap(model))(batch)

    batch = jnp.ones((16, 64, 64))
    profile = profile_jaxpr(jax.make_jaxpr(forward)(member, batch).jaxpr)
    forward_flops = 2.0 * 16 * 64 * 64 * 64
    assert profile.dot_flops == forward_flops
    weights_only = step_flops(ens.members, 16, 2, 1, StepProfile())
    assert weights_only == 6.0 * 16 * 64 * 64 * 2
    assert step_flops(ens.members, 16, 2, 1, profile) == 3 * forward_flops * 2
    assert step_flops(ens.members, 16, 2, 4, profile) == 3 * forward_flops * 2 / 4
    with_convolutions = profile._replace(convolution_flops=1e9)
    assert step_flops(ens.members, 16, 2, 1, with_convolutions) == (
        3 * (forward_flops + 1e9) * 2
    )


KEY = jax.random.key(3)


def _new_loss():
    # A new function each time: `fit` caches its plan per loss function.
    def mse(model, batch, key):
        x, y = batch
        return jnp.mean((jax.vmap(model)(x) - y) ** 2)

    return mse


def test_fit_and_make_step_choose_by_the_steps_size(monkeypatch):
    chosen = []

    def spy(**kwargs):
        chosen.append(choose_finite_check(**kwargs))
        return chosen[-1]

    monkeypatch.setattr(plan_module, "choose_finite_check", spy)
    optimizer = optax.adam(1e-3)
    # 2 members, 64 examples: about 13 kFLOP per step, or 205 MFLOP (tiny: under
    # `MIN_STEP_FLOPS`, 16 MFLOP).
    tiny = "per_leaf" if ON_CPU else "by_shape"
    for width, form in ((4, tiny), (512, "by_shape")):
        ens = ee.ensemble(
            lambda k, w=width: eqx.nn.MLP(8, 1, w, 2, key=k),
            size=2,
            key=jax.random.key(0),
        )
        x = jnp.ones((64, 8))
        batch = (x, x[:, :1])
        loss = _new_loss()
        chosen.clear()
        ee.fit(ens, loss, optimizer, batch, steps=2, batch_size=64, key=KEY)
        ee.make_step(loss, optimizer)(
            ens, ee.init_optimizer(optimizer, ens), batch, KEY
        )
        assert chosen == [form, form]


def _leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(eqx.filter(tree, eqx.is_array))]


def test_an_overflowing_update_is_caught_in_either_form(monkeypatch):
    # Per-member learning rates: member 1's update overflows (its loss and
    # gradients stay finite). Each form, forced in place of the rule's choice,
    # freezes member 1 at its last finite weights (those of the run stopped
    # just before) and leaves the others training; the two forms' runs are
    # equal bit for bit.
    ens = ee.ensemble(
        lambda k: eqx.nn.MLP(2, 1, 8, 1, key=k), size=3, key=jax.random.key(0)
    )
    x = jax.random.normal(jax.random.key(1), (32, 2))
    y = jnp.sin(x[:, :1])
    optimizer = optax.inject_hyperparams(optax.sgd)(learning_rate=0.01)
    rates = jnp.array([0.01, 3e38, 0.02])
    forced = []
    monkeypatch.setattr(plan_module, "choose_finite_check", lambda **_: forced[-1])

    def fit(steps):
        return ee.fit(
            ens,
            loss,
            optimizer,
            (x, y),
            steps=steps,
            batch_size=8,
            key=jax.random.key(2),
            opt_state=ee.init_optimizer(
                optimizer, ens, hyperparams={"learning_rate": rates}
            ),
            callbacks=(),
        )

    results = {}
    for form in FORMS:
        forced.append(form)
        loss = _new_loss()
        result = fit(6)
        assert set(result.diverged) == {1}
        before = fit(result.diverged[1] - 1)  # the steps before the failing one
        assert before.diverged == {}
        for got, want in zip(
            _leaves(result.ensemble[1]), _leaves(before.ensemble[1]), strict=True
        ):
            np.testing.assert_array_equal(got, want)
        assert all(np.isfinite(leaf).all() for leaf in _leaves(result.ensemble))
        assert np.isfinite(np.delete(result.history.losses, 1, axis=1)).all()
        results[form] = result
    for got, want in zip(
        _leaves(results["per_leaf"].ensemble),
        _leaves(results["by_shape"].ensemble),
        strict=True,
    ):
        np.testing.assert_array_equal(got, want)


def test_an_optimizer_states_scalars_fail_only_when_nan_in_every_form():
    # Per member (vmapped, as the step checks): the state's scalars may be
    # infinite (a sentinel, an `inf` clipping threshold), not NaN; its arrays
    # (moments) must be finite. Reference: NumPy, member by member.
    inf, nan = float("inf"), float("nan")
    scalar = jnp.array([0.0, inf, -inf, nan, 0.0, 0.0])
    moment = jnp.zeros((6, 3)).at[4, 1].set(inf).at[5, 2].set(nan)
    weights = jnp.ones((6, 2))
    reference = [
        not np.isnan(np.asarray(scalar)[m]) and np.isfinite(np.asarray(moment)[m]).all()
        for m in range(6)
    ]
    assert reference == [True, True, True, False, False, False]
    for form in FORMS:
        flags = eqx.filter_vmap(
            lambda w, s, v, form=form: all_finite(
                w, check=form, state={"best": s, "mu": v}
            )
        )(weights, scalar, moment)
        np.testing.assert_array_equal(np.asarray(flags), reference, err_msg=form)
        # The same values outside the state: every one must be finite.
        flags = eqx.filter_vmap(lambda w, s, form=form: all_finite(w, s, check=form))(
            weights, scalar
        )
        np.testing.assert_array_equal(
            np.asarray(flags), np.isfinite(np.asarray(scalar)), err_msg=form
        )
