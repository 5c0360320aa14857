"""`ee.Heterogeneous`: members of different architectures held and trained as
one ensemble. The reference throughout is the homogeneous library itself run
on the same members: member `i` of a heterogeneous ensemble of `N` members
must train exactly as member `i` of an `N`-member `ee.Ensemble` does (same key,
batches, `hyper=` row), so a group is compared with an ordinary ensemble of its
architecture that holds the group's members at the group's positions."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import repeat, tree_equal

import eqx_ensemble as ee

X = jax.random.normal(jax.random.key(1), (48, 2))
Y = jnp.sin(X[:, :1]) + 0.5 * X[:, 1:]
WIDTHS = (4, 8)
SIZES = (2, 3)  # members of the width-4 group, then of the width-8 group


def mlp(width, depth=1):
    return lambda key: eqx.nn.MLP(2, 1, width, depth, key=key)


def loss(model, batch, key):
    x, y = batch
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


def arrays(tree):
    return jax.tree.leaves(eqx.filter(tree, eqx.is_array))


def assert_close(got, want, atol=1e-6):
    got, want = arrays(got), arrays(want)
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=atol)


def members_at(ens, start, stop):
    """Members `start:stop` of an ensemble, as an `ee.Ensemble`."""
    return ens[start:stop]


def rows(tree, start, stop):
    """Rows `start:stop` of every array leaf (a stacked tree's members)."""
    return jax.tree.map(lambda x: x[start:stop] if eqx.is_array(x) else x, tree)


def padded(width, group, position, total, key):
    """A `total`-member ensemble of `width` whose members `position:position +
    len(group)` are `group`'s (the others fresh): the homogeneous run that the
    group must reproduce."""
    others = ee.ensemble(mlp(width), size=total, key=key)
    stop = position + len(group)
    parts = [others[:position]] if position else []
    parts.append(group)
    if stop < total:
        parts.append(others[stop:])
    return ee.concatenate(parts)


@pytest.fixture
def het():
    groups = [
        ee.ensemble(mlp(width), size=size, key=jax.random.key(width))
        for width, size in zip(WIDTHS, SIZES, strict=True)
    ]
    return ee.Heterogeneous(groups)


# --- the object -------------------------------------------------------------


def test_numbering_indexing_and_bounds(het):
    assert len(het) == het.size == 5
    assert het.sizes == (2, 3)
    assert het.bounds == ((0, 2), (2, 5))
    assert het.locate(0) == (0, 0)
    assert het.locate(3) == (1, 1)
    assert het.locate(-1) == (1, 2)
    member = het[3]
    assert isinstance(member, eqx.nn.MLP) and member.width_size == 8
    assert_close(member, het.groups[1][1], atol=0)
    assert het[1].width_size == 4


@pytest.mark.parametrize(
    "groups, error, match",
    [
        ([], ValueError, "at least one group"),
        ("abc", TypeError, "list or tuple|parameter .groups."),
        (
            [eqx.nn.Linear(1, 1, key=jax.random.key(0))],
            TypeError,
            "group 0 must be|parameter .groups.",
        ),
    ],
)
def test_bad_groups_are_refused_by_name(groups, error, match):
    with pytest.raises(error, match=match):
        ee.Heterogeneous(groups)


def test_an_ensemble_or_a_nested_heterogeneous_is_refused(het):
    # (Under the test suite's jaxtyping hook beartype refuses these first.)
    with pytest.raises(TypeError, match="list or tuple|parameter .groups."):
        ee.Heterogeneous(het.groups[0])
    with pytest.raises(TypeError, match="group 1 is itself|Heterogeneous.__init__"):
        ee.Heterogeneous([het.groups[0], het])


def test_bad_member_indices(het):
    with pytest.raises(IndexError, match="out of range.*5 members"):
        het[5]
    with pytest.raises(TypeError, match="int member index|parameter .index."):
        het[1:3]


# --- predict, map, call -----------------------------------------------------


def test_predict_concatenates_the_groups_in_member_order(het):
    got = ee.predict(het, X)
    assert got.shape == (5, 48, 1)
    want = jnp.concatenate([ee.predict(group, X) for group in het.groups])
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    # Member by member, as plain models.
    for i in range(len(het)):
        np.testing.assert_allclose(got[i], jax.vmap(het[i])(X), atol=1e-6)


def test_outputs_of_different_shapes_come_back_per_group():
    groups = [
        ee.ensemble(
            lambda k: eqx.nn.MLP(2, 1, 4, 1, key=k), size=2, key=jax.random.key(0)
        ),
        ee.ensemble(
            lambda k: eqx.nn.MLP(2, 3, 4, 1, key=k), size=1, key=jax.random.key(1)
        ),
    ]
    out = ee.predict(ee.Heterogeneous(groups), X)
    assert isinstance(out, tuple)
    assert [o.shape for o in out] == [(2, 48, 1), (1, 48, 3)]


def test_keys_of_a_stochastic_model_are_the_global_members_keys():
    # Dropout members: member i gets split(key, N)[i] whichever group holds it,
    # so slices of one ensemble predict as the ensemble does.
    def model(key):
        return eqx.nn.Sequential(
            [eqx.nn.Linear(2, 16, key=key), eqx.nn.Dropout(0.5, inference=False)]
        )

    full = ee.ensemble(model, size=4, key=jax.random.key(0))
    het = ee.Heterogeneous([full[:1], full[1:]])
    key = jax.random.key(5)
    want = ee.map(lambda m, x, key: m(x, key=key), full, X[0], key=key)
    got = ee.map(lambda m, x, key: m(x, key=key), het, X[0], key=key)
    np.testing.assert_allclose(got, want, atol=1e-6)
    assert not np.allclose(got[0], got[1])  # the keys do differ per member
    np.testing.assert_allclose(het(X[0], key=key), full(X[0], key=key), atol=1e-6)


def test_map_cuts_per_member_arguments_at_the_bounds(het):
    per_member = jax.random.normal(jax.random.key(2), (5, 7, 2))
    got = ee.map(lambda m, x: jax.vmap(m)(x), het, per_member, in_axes=(0,))
    for i in range(5):
        np.testing.assert_allclose(got[i], jax.vmap(het[i])(per_member[i]), atol=1e-6)
    with pytest.raises(ValueError, match="5"):
        ee.map(lambda m, x: jax.vmap(m)(x), het, per_member[:4], in_axes=(0,))


def batchnorm_mlp(width):
    def make(key):
        return eqx.nn.make_with_state(eqx.nn.Sequential)(
            [
                eqx.nn.Linear(2, width, key=key),
                eqx.nn.BatchNorm(width, axis_name="batch", mode="batch", momentum=0.5),
                eqx.nn.Lambda(jax.nn.relu),
                eqx.nn.Linear(width, 1, key=jax.random.fold_in(key, 1)),
            ]
        )

    return make


def test_predict_with_a_state_per_group():
    built = [
        ee.ensemble(batchnorm_mlp(w), size=s, key=jax.random.key(s))
        for w, s in zip(WIDTHS, SIZES, strict=True)
    ]
    groups = [ens for ens, _ in built]
    states = tuple(state for _, state in built)
    het = ee.Heterogeneous(groups)
    got = ee.predict(het, X, state=states)
    want = jnp.concatenate(
        [ee.predict(g, X, state=s) for g, s in zip(groups, states, strict=True)]
    )
    assert got.shape == (5, 48, 1)
    np.testing.assert_allclose(got, want, atol=1e-6)
    with pytest.raises(ValueError, match="one entry per group"):
        ee.predict(het, X, state=states[0])


# --- fit ----------------------------------------------------------------------


@pytest.mark.parametrize("sampling", [repeat("shared"), "independent", "bootstrap"])
def test_slices_of_one_ensemble_train_as_that_ensemble(sampling):
    full = ee.ensemble(mlp(8), size=5, key=jax.random.key(0))
    het = ee.Heterogeneous([full[:2], full[2:3], full[3:]])
    opt = optax.adam(1e-2)
    kwargs = dict(steps=12, batch_size=8, key=jax.random.key(3), callbacks=[])
    kwargs["sampling"] = {
        "independent": ee.Independent(),
        "bootstrap": ee.Bootstrap(),
    }.get(sampling, sampling)
    want = ee.fit(full, loss, opt, (X, Y), **kwargs)
    got = ee.fit(het, loss, opt, (X, Y), **kwargs)
    assert isinstance(got.ensemble, ee.Heterogeneous)
    assert got.history.losses.shape == (12, 5)
    np.testing.assert_allclose(got.history.losses, want.history.losses, atol=1e-6)
    assert_close(
        [g.members for g in got.ensemble.groups],
        [rows(want.ensemble.members, a, b) for a, b in het.bounds],
    )
    assert isinstance(got.opt_state, tuple) and len(got.opt_state) == 3


def test_groups_of_different_widths_train_as_their_own_architecture(het):
    # Group g must equal the homogeneous fit of its width with its members at
    # the same global positions (same member keys, batches and hyper rows).
    hyper = jnp.linspace(0.5, 1.5, 5)

    def scaled(model, batch, key, *, hyper):
        return hyper * loss(model, batch, key)

    opt = optax.adam(1e-2)
    kwargs = dict(
        steps=10, batch_size=8, key=jax.random.key(4), callbacks=[],
        sampling=ee.Independent(), hyper=hyper,
    )  # fmt: skip
    got = ee.fit(het, scaled, opt, (X, Y), **kwargs)
    for index, (width, group, (start, stop)) in enumerate(
        zip(WIDTHS, het.groups, het.bounds, strict=True)
    ):
        ref = padded(width, group, start, len(het), jax.random.key(99))
        want = ee.fit(ref, scaled, opt, (X, Y), **kwargs)
        assert_close(got.ensemble.groups[index], members_at(want.ensemble, start, stop))
        np.testing.assert_allclose(
            got.history.losses[:, start:stop],
            want.history.losses[:, start:stop],
            atol=1e-6,
        )


def test_divergence_is_isolated_to_its_member(het):
    # Member 3 (group 1) returns NaN from step 0: it is reported and keeps its
    # weights; every other member trains as in the run without it.
    def poisoned(model, batch, key, *, hyper):
        value = loss(model, batch, key)
        return jnp.where(hyper > 0, jnp.nan, value)

    opt = optax.sgd(1e-2)
    kwargs = dict(steps=6, batch_size=8, key=jax.random.key(5), callbacks=[])
    clean = ee.fit(het, poisoned, opt, (X, Y), hyper=jnp.zeros(5), **kwargs)
    flag = jnp.zeros(5).at[3].set(1.0)
    bad = ee.fit(het, poisoned, opt, (X, Y), hyper=flag, **kwargs)
    assert bad.diverged == {3: 1}  # its first step (steps count from 1)
    assert clean.diverged == {}
    assert_close(bad.ensemble[3], het[3], atol=0)
    for i in (0, 1, 2, 4):
        assert_close(bad.ensemble[i], clean.ensemble[i], atol=0)


def test_evaluation_best_members_and_trackers_per_member(het):
    full_groups = []
    opt = optax.sgd(5e-2)
    evaluate = ee.Evaluate(loss, (X[:16], Y[:16]), every=2)
    kwargs = dict(
        steps=8, batch_size=8, key=jax.random.key(6), callbacks=[],
        evaluate=evaluate, track=[ee.EMA(decay=0.9)],
    )  # fmt: skip
    got = ee.fit(het, loss, opt, (X, Y), **kwargs)
    assert got.history.eval_scores.shape == (4, 5)
    assert isinstance(got.best_ensemble, ee.Heterogeneous)
    assert isinstance(got.tracked[0], ee.Heterogeneous)
    for width, group, (start, stop) in zip(WIDTHS, het.groups, het.bounds, strict=True):
        ref = padded(width, group, start, len(het), jax.random.key(98))
        want = ee.fit(ref, loss, opt, (X, Y), **kwargs)
        full_groups.append(want)
        np.testing.assert_allclose(
            got.history.eval_scores[:, start:stop],
            want.history.eval_scores[:, start:stop],
            atol=1e-6,
        )
        index = het.locate(start)[0]
        assert_close(
            got.best_ensemble.groups[index], members_at(want.best_ensemble, start, stop)
        )
        assert_close(
            got.tracked[0].groups[index], members_at(want.tracked[0], start, stop)
        )
        np.testing.assert_array_equal(
            got.best_step[start:stop], want.best_step[start:stop]
        )


def stateful_loss(m, state, batch, key):
    x, y = batch
    pred, state = jax.vmap(m, axis_name="batch", in_axes=(0, None), out_axes=(0, None))(
        x, state
    )
    return jnp.mean((pred - y) ** 2), state


@pytest.mark.usefixtures("library_codegen")
def test_a_model_state_per_group():
    built = [
        ee.ensemble(batchnorm_mlp(w), size=s, key=jax.random.key(w))
        for w, s in zip(WIDTHS, SIZES, strict=True)
    ]
    groups = [ens for ens, _ in built]
    states = [state for _, state in built]
    het = ee.Heterogeneous(groups)
    opt = optax.adam(1e-2)
    kwargs = dict(steps=5, batch_size=8, key=jax.random.key(7), callbacks=[])
    got = ee.fit(het, stateful_loss, opt, (X, Y), state=tuple(states), **kwargs)
    assert isinstance(got.state, tuple) and len(got.state) == 2
    for index, (width, group, state, (start, stop)) in enumerate(
        zip(WIDTHS, groups, states, het.bounds, strict=True)
    ):
        ref, ref_state = ee.ensemble(
            batchnorm_mlp(width), size=len(het), key=jax.random.key(97)
        )
        parts = [ref[:start]] if start else []
        parts += [group] + ([ref[stop:]] if stop < len(het) else [])
        ref = ee.concatenate(parts)
        ref_state = jax.tree.map(
            lambda r, s: jnp.concatenate([r[:start], s, r[stop:]]), ref_state, state
        )
        want = ee.fit(ref, stateful_loss, opt, (X, Y), state=ref_state, **kwargs)
        assert_close(got.ensemble.groups[index], members_at(want.ensemble, start, stop))
        assert_close(got.state[index], rows(want.state, start, stop))
    with pytest.raises(ValueError, match="one entry per group"):
        ee.fit(het, stateful_loss, opt, (X, Y), state=states[0], **kwargs)
    with pytest.raises(ValueError, match=r"`state`\[1\].*leading axis.*3"):
        ee.fit(het, stateful_loss, opt, (X, Y), state=(states[0], states[0]), **kwargs)


def test_resume_is_bit_exact(het, tmp_path):
    opt = optax.adam(1e-2)
    kwargs = dict(
        steps=8, batch_size=8, key=jax.random.key(8), sampling=ee.Independent(),
        evaluate=ee.Evaluate(loss, (X[:8], Y[:8]), every=2),
        execution=ee.Execution(steps_per_dispatch=2),
    )  # fmt: skip
    straight = ee.fit(het, loss, opt, (X, Y), callbacks=[], **kwargs)

    class Stop(Exception):
        pass

    def interrupt(result):
        if result.step >= 4:
            raise Stop

    folder = tmp_path / "run"
    with pytest.raises(Stop):
        ee.fit(
            het, loss, opt, (X, Y), callbacks=[interrupt],
            checkpoints=ee.Checkpoints(folder, every=2), **kwargs,
        )  # fmt: skip
    assert [step for step, _ in ee.list_checkpoints(folder)][-1] == 4
    resumed = ee.fit(
        het, loss, opt, (X, Y), callbacks=[],
        checkpoints=ee.Checkpoints(folder, every=2), **kwargs,
    )  # fmt: skip
    assert resumed.resumed_from == 4
    for a, b in zip(
        jax.tree.leaves((resumed.ensemble, resumed.opt_state, resumed.best_ensemble)),
        jax.tree.leaves(
            (straight.ensemble, straight.opt_state, straight.best_ensemble)
        ),
        strict=True,
    ):
        if eqx.is_array(a):
            np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(resumed.history.losses, straight.history.losses)


def test_save_and_load_round_trip(het, tmp_path):
    path = ee.save(tmp_path / "het.eqx", het)
    like = ee.Heterogeneous(
        [
            ee.ensemble(mlp(w), size=s, key=jax.random.key(0))
            for w, s in zip(WIDTHS, SIZES)
        ]
    )
    loaded = ee.load(path, like)
    assert_close(loaded, het, atol=0)
    wrong = ee.Heterogeneous([like.groups[0], like.groups[0]])
    with pytest.raises(Exception, match="groups"):
        ee.load(path, wrong)


def test_make_step_equals_the_homogeneous_step():
    full = ee.ensemble(mlp(8), size=4, key=jax.random.key(0))
    het = ee.Heterogeneous([full[:3], full[3:]])
    opt = optax.inject_hyperparams(optax.adam)(learning_rate=1e-2)
    rates = {"learning_rate": jnp.array([1e-3, 1e-2, 3e-2, 1e-1])}
    step = ee.make_step(loss, opt)
    want = step(
        full, ee.init_optimizer(opt, full, hyperparams=rates), (X, Y), jax.random.key(1)
    )
    het_state = ee.init_optimizer(opt, het, hyperparams=rates)
    assert isinstance(het_state, tuple) and len(het_state) == 2
    np.testing.assert_allclose(het_state[1].hyperparams["learning_rate"], [1e-1])
    got = step(het, het_state, (X, Y), jax.random.key(1))
    np.testing.assert_allclose(got.losses, want.losses, atol=1e-6)
    assert_close(
        [g.members for g in got.ensemble.groups],
        [rows(want.ensemble.members, 0, 3), rows(want.ensemble.members, 3, 4)],
    )
    with pytest.raises(ValueError, match="group 1"):
        step(het, (het_state[0], het_state[0]), (X, Y), jax.random.key(1))
    with pytest.raises(ValueError, match="one entry per group"):
        step(het, het_state[0], (X, Y), jax.random.key(1))
    with pytest.raises(ValueError, match=r"'learning_rate' has shape \(3,\)"):
        ee.init_optimizer(opt, het, hyperparams={"learning_rate": jnp.ones(3)})


# --- what is refused ----------------------------------------------------------


def test_aux_that_differs_between_groups_names_the_leaf(het):
    def with_aux(model, batch, key):
        out = jax.vmap(model)(batch[0])
        return jnp.mean((out - batch[1]) ** 2), {"hidden": model.layers[0].weight}

    with pytest.raises(ValueError, match=r"aux.*group 0 and group 1.*hidden"):
        ee.fit(het, with_aux, optax.sgd(0.1), (X, Y), steps=2, batch_size=8,
               key=jax.random.key(0), callbacks=[])  # fmt: skip


@pytest.mark.parametrize(
    "setting, match",
    [
        (dict(execution=ee.Execution(member_chunk=1)), "member_chunk"),
        (dict(callbacks=[ee.PBT(every=2)]), "PBT"),
    ],
)
def test_what_a_heterogeneous_fit_does_not_take_is_refused_first(het, setting, match):
    kwargs = dict(steps=4, batch_size=8, key=jax.random.key(0), callbacks=[])
    kwargs.update(setting)
    with pytest.raises(ValueError, match=match):
        ee.fit(het, loss, optax.sgd(0.1), (X, Y), **kwargs)


def test_a_coupled_loss_and_a_mesh_are_refused(het):
    coupled = ee.Coupled(lambda ens, batch, keys: jnp.sum(ens.members.layers[0].weight))
    with pytest.raises(ValueError, match="Coupled"):
        ee.fit(het, coupled, optax.sgd(0.1), (X, Y), steps=2, batch_size=8,
               key=jax.random.key(0), callbacks=[])  # fmt: skip
    mesh = ee.make_mesh(members=1, data=1)
    with pytest.raises(ValueError, match="mesh"):
        ee.fit(het, loss, optax.sgd(0.1), (X, Y), steps=2, batch_size=8,
               key=jax.random.key(0), callbacks=[],
               execution=ee.Execution(mesh=mesh))  # fmt: skip


# --- selection and hyper-deep ensembles ----------------------------------------


def test_indexing_with_member_indices_selects_a_heterogeneous_ensemble(het):
    picked = het[[3, 0, 3, 4]]
    assert isinstance(picked, ee.Heterogeneous)
    # Grouped: group 0's picks ([0]), then group 1's in the order given.
    assert picked.sizes == (1, 3)
    for got, want in zip(range(4), (0, 3, 3, 4), strict=True):
        assert_close(picked[got], het[want], atol=0)
    assert het[np.array([4, 2])].sizes == (2,)
    with pytest.raises(IndexError, match="out of range"):
        het[[0, 7]]
    with pytest.raises(IndexError, match="no members"):
        het[np.zeros((0,), np.int32)]
    with pytest.raises(TypeError, match="not a slice|parameter .index."):
        het[0:2]


def arch_model(key, width, depth):
    return eqx.nn.MLP(2, 1, width, depth, key=key)


SPACE = {"width": ee.sweep.choice([4, 8]), "depth": ee.sweep.choice([1, 2])}


def test_architectures_build_each_drawn_member_with_its_own_key():
    key = jax.random.key(11)
    pool = ee.sweep.architectures(arch_model, SPACE, size=7, key=key)
    # Independently: the documented draw and keys, grouped by first appearance.
    draw_key, init_key = jax.random.split(key)
    drawn = ee.sweep.sample(draw_key, SPACE, size=7)
    keys = jax.random.split(init_key, 7)
    rows = [(int(drawn["width"][j]), int(drawn["depth"][j])) for j in range(7)]
    firsts = list(dict.fromkeys(rows))
    order = [j for row in firsts for j in range(7) if rows[j] == row]
    assert pool.ensemble.sizes == tuple(rows.count(row) for row in firsts)
    assert pool.state is None
    for i, j in enumerate(order):
        width, depth = rows[j]
        assert int(pool.settings["width"][i]) == width
        assert int(pool.settings["depth"][i]) == depth
        assert_close(pool.ensemble[i], arch_model(keys[j], width, depth), atol=0)


def test_a_hyper_deep_ensemble_trains_the_pool_and_selects_from_it():
    pool = ee.sweep.architectures(arch_model, SPACE, size=6, key=jax.random.key(12))
    fitted = ee.fit(
        pool.ensemble, loss, optax.adam(1e-2), (X[:32], Y[:32]), steps=20,
        batch_size=8, key=jax.random.key(13), callbacks=[],
    ).ensemble  # fmt: skip
    preds = ee.predict(fitted, X[32:])
    assert preds.shape == (6, 16, 1)
    picks = ee.greedy_selection(
        preds, lambda p: jnp.mean((p.mean(0) - Y[32:]) ** 2), size=3,
        replacement=False,
    )  # fmt: skip
    chosen = fitted[np.asarray(picks)]
    assert len(chosen) == 3
    got = ee.predict(chosen, X[32:])
    want = jnp.stack(
        [
            preds[int(i)]
            for i in sorted(picks.tolist(), key=lambda i: fitted.locate(i)[0])
        ]
    )
    np.testing.assert_allclose(got, want, atol=1e-6)


def test_architectures_refuse_bad_spaces_naming_the_call():
    with pytest.raises(TypeError, match="non-empty dict"):
        ee.sweep.architectures(arch_model, {}, size=2, key=jax.random.key(0))
    with pytest.raises(TypeError, match=r"make\(key, \*\*\{'width'"):
        ee.sweep.architectures(
            arch_model, {"width": ee.sweep.choice([4])}, size=2, key=jax.random.key(0)
        )


# --- review fixes: hyperparameters, states, indices, layouts, losses per group --


def _injected_lr_run(het, lrs, **kwargs):
    opt = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
    opt_state = ee.init_optimizer(opt, het, hyperparams={"learning_rate": lrs})
    return opt, opt_state


def test_loggers_see_every_members_injected_hyperparameters(het):
    lrs = jnp.array([0.01, 0.02, 0.03, 0.04, 0.05])
    opt, opt_state = _injected_lr_run(het, lrs)
    seen = []

    class Collect(ee.Logger):
        def open(self, run):
            seen.append(run.member_hparams)
            return None

        def write(self, handle, entry):
            seen.append(entry.member_hparams)

        def close(self, handle):
            pass

    ee.fit(
        het, loss, opt, (X, Y), steps=4, batch_size=8, key=jax.random.key(0),
        opt_state=opt_state, callbacks=[Collect()],
    )  # fmt: skip
    assert len(seen) >= 2
    for hparams in seen:
        np.testing.assert_allclose(hparams["learning_rate"], lrs, rtol=1e-6)


def test_resume_with_another_groups_hyperparameters_is_refused(het, tmp_path):
    folder = tmp_path / "run"
    kwargs = dict(steps=4, batch_size=8, key=jax.random.key(0), callbacks=[])
    lrs = jnp.array([0.01, 0.02, 0.03, 0.04, 0.05])
    opt, opt_state = _injected_lr_run(het, lrs)
    ee.fit(
        het, loss, opt, (X, Y), opt_state=opt_state,
        checkpoints=ee.Checkpoints(folder, every=2), **kwargs,
    )  # fmt: skip
    # Only group 0's values change: a record that kept one group's values per
    # name (the last group's) would miss it.
    changed = lrs.at[0].set(0.5)
    _, other = _injected_lr_run(het, changed)
    with pytest.raises(Exception, match="hyperparam"):
        ee.fit(
            het, loss, opt, (X, Y), opt_state=other,
            checkpoints=ee.Checkpoints(folder, every=2),
            **{**kwargs, "steps": 6},
        )  # fmt: skip


def test_set_hyperparams_on_a_group_tuple_says_how(het):
    opt = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
    opt_state = ee.init_optimizer(opt, het)
    with pytest.raises(ValueError, match="once per group.*init_optimizer"):
        ee.set_hyperparams(opt_state, {"learning_rate": jnp.ones(5)}, size=5)
    # Per group, as the message says, it works.
    per_group = tuple(
        ee.set_hyperparams(s, {"learning_rate": jnp.full(len(g), 0.2)}, size=len(g))
        for s, g in zip(opt_state, het.groups, strict=True)
    )
    assert [s.hyperparams["learning_rate"].shape for s in per_group] == [(2,), (3,)]


def test_a_state_for_some_groups_only_is_refused_naming_them():
    built = [
        ee.ensemble(batchnorm_mlp(w), size=s, key=jax.random.key(s))
        for w, s in zip(WIDTHS, SIZES, strict=True)
    ]
    het = ee.Heterogeneous([ens for ens, _ in built])
    with pytest.raises(ValueError, match=r"None for groups \[1\]"):
        ee.fit(
            het, loss, optax.sgd(0.1), (X, Y), steps=2, batch_size=8,
            key=jax.random.key(0), state=(built[0][1], None), callbacks=[],
        )  # fmt: skip


def test_make_step_names_a_wrongly_held_state_per_group():
    # `make_step` plans (profiles one member per group) before its input
    # checks: a state not held one per group is named there too.
    built = [
        ee.ensemble(batchnorm_mlp(w), size=s, key=jax.random.key(s))
        for w, s in zip(WIDTHS, SIZES, strict=True)
    ]
    het = ee.Heterogeneous([ens for ens, _ in built])
    opt = optax.adam(1e-2)
    step = ee.make_step(stateful_loss, opt)
    for bad, got in ((built[0][1], "got State"), ((built[0][1],) * 3, "of 3")):
        with pytest.raises(ValueError, match=f"one entry per group.*{got}"):
            step(het, ee.init_optimizer(opt, het), (X, Y), jax.random.key(1), bad)


def test_chunk_size_is_checked_against_all_members(het):
    with pytest.raises(ValueError, match="between 1 and the ensemble size 5"):
        ee.map(lambda m, x: jax.vmap(m)(x), het, X, chunk_size=6)
    got = ee.map(lambda m, x: jax.vmap(m)(x), het, X, chunk_size=3)
    np.testing.assert_allclose(got, ee.predict(het, X), atol=1e-6)


def test_zero_d_indices_masks_and_the_selection_order(het):
    assert_close(het[np.int64(3)], het[3], atol=0)
    assert_close(het[np.asarray(3)], het[3], atol=0)
    mask = np.array([True, False, False, True, True])
    assert het[mask].sizes == (1, 2)
    with pytest.raises(IndexError, match=r"shape \(5,\)"):
        het[mask[:4]]
    picks = [4, 0, 3, 0]
    chosen = het[picks]
    order = het.order(picks)
    assert sorted(order.tolist()) == sorted(picks)
    # Member i of the selection is global member order[i] of `het`.
    for i, global_index in enumerate(order):
        assert_close(chosen[i], het[int(global_index)], atol=0)


def cnn(width):
    def make(key):
        return eqx.nn.Sequential(
            [
                eqx.nn.Conv2d(1, width, 3, padding=1, key=key),
                eqx.nn.Lambda(lambda x: jnp.mean(x, axis=(1, 2))),
                eqx.nn.Linear(width, 1, key=jax.random.fold_in(key, 1)),
            ]
        )

    return make


def test_make_step_chooses_the_layout_and_options_fit_would():
    # A convolving group makes the automatic layout member by member on one
    # CPU device, for a heterogeneous ensemble as for its group alone.
    groups = [ee.ensemble(cnn(w), size=2, key=jax.random.key(w)) for w in (2, 4)]
    het = ee.Heterogeneous(groups)
    images = jnp.ones((4, 1, 6, 6))
    batch = (images, jnp.ones((4, 1)))
    step = ee.make_step(loss, optax.sgd(0.1))
    for_group = step._plan(groups[0], batch)
    assert step._plan(het, batch).layout == for_group.layout == "sequential"
    assert step._plan(het, batch).compiler_options == for_group.compiler_options


def test_a_loss_per_group_trains_each_group_as_its_loss_alone(het):
    def scaled_loss(scale):
        def fn(model, batch, key):
            return scale * loss(model, batch, key)

        return fn

    losses = (scaled_loss(1.0), scaled_loss(3.0))
    opt = optax.sgd(0.05)
    kwargs = dict(
        steps=6, batch_size=8, key=jax.random.key(4), callbacks=[],
        sampling=ee.Independent(),
    )  # fmt: skip
    got = ee.fit(het, losses, opt, (X, Y), **kwargs)
    for index, (width, group, (start, stop)) in enumerate(
        zip(WIDTHS, het.groups, het.bounds, strict=True)
    ):
        ref = padded(width, group, start, len(het), jax.random.key(99))
        want = ee.fit(ref, losses[index], opt, (X, Y), **kwargs)
        assert_close(got.ensemble.groups[index], members_at(want.ensemble, start, stop))
        np.testing.assert_allclose(
            got.history.losses[:, start:stop],
            want.history.losses[:, start:stop],
            atol=1e-6,
        )
    # The same through make_step.
    step = ee.make_step(losses, opt)
    out = step(het, ee.init_optimizer(opt, het), (X[:8], Y[:8]), jax.random.key(0))
    assert out.losses.shape == (5,)
    np.testing.assert_allclose(
        out.losses[2:] / 3.0,
        ee.make_step(loss, opt)(
            het, ee.init_optimizer(opt, het), (X[:8], Y[:8]), jax.random.key(0)
        ).losses[2:],
        rtol=1e-6,
    )


def test_bad_losses_per_group_are_refused_naming_them(het):
    kwargs = dict(steps=2, batch_size=8, key=jax.random.key(0), callbacks=[])
    with pytest.raises(ValueError, match="tuple of 3 losses.*2 groups"):
        ee.fit(het, (loss, loss, loss), optax.sgd(0.1), (X, Y), **kwargs)
    with pytest.raises(TypeError, match=r"loss_fn\[1\]. \(group 1\)"):
        ee.fit(het, (loss, lambda m, b: 0.0), optax.sgd(0.1), (X, Y), **kwargs)
    ens = het.groups[0]
    with pytest.raises(TypeError, match="only an `ee.Heterogeneous`"):
        ee.fit(ens, (loss,), optax.sgd(0.1), (X, Y), **kwargs)
    # make_step names them too (before its plan traces a group's loss).
    opt_state = ee.init_optimizer(optax.sgd(0.1), het)
    for losses in ((loss,), (loss, loss, loss)):
        with pytest.raises(ValueError, match=f"tuple of {len(losses)} losses"):
            ee.make_step(losses, optax.sgd(0.1))(het, opt_state, (X, Y), kwargs["key"])


def test_the_steps_profile_counts_a_member_on_average():
    """The layout and guard rules multiply a member's FLOPs by the member count:
    a heterogeneous step's profile is the size-weighted mean of its groups'
    (each group's read as an ordinary ensemble's), not their sum, which would
    count the run's FLOPs once per group."""
    from eqx_ensemble._training.step import ensemble_profile

    def cnn(key):
        conv_key, out_key = jax.random.split(key)
        return eqx.nn.Sequential(
            [
                eqx.nn.Lambda(lambda x: x.reshape(1, 4, 4)),
                eqx.nn.Conv2d(1, 3, 3, padding=1, key=conv_key),
                eqx.nn.Lambda(jnp.ravel),
                eqx.nn.Linear(48, 1, key=out_key),
            ]
        )

    def xy(batch):
        return jnp.ones((batch, 16)), jnp.ones((batch, 1))

    groups = [
        ee.ensemble(cnn, size=3, key=jax.random.key(0)),
        ee.ensemble(
            lambda k: eqx.nn.MLP(16, 1, 8, 1, key=k), size=1, key=jax.random.key(1)
        ),
    ]
    batch = xy(5)
    alone = [ensemble_profile(loss, group, batch, None, None) for group in groups]
    assert alone[0].convolution_flops > 0 and alone[1].convolution_flops == 0
    got = ensemble_profile(loss, ee.Heterogeneous(groups), batch, None, None)
    assert got.convolutions
    assert got.convolution_flops == pytest.approx(3 * alone[0].convolution_flops / 4)
    want_dots = (3 * alone[0].dot_flops + alone[1].dot_flops) / 4
    assert got.dot_flops == pytest.approx(want_dots)


def test_unstack_distillation_and_laplace_take_a_heterogeneous(het):
    # Issue 47, item 5. unstack: member i is `het[i]`, in member order.
    models = ee.unstack(het)
    assert len(models) == len(het)
    for i, model in enumerate(models):
        assert tree_equal(model, het[i])
    # Distillation: the teacher's mean prediction over all groups' members,
    # written by hand from the members one by one.
    classes = lambda w: lambda k: eqx.nn.MLP(2, 3, w, 1, key=k)  # noqa: E731
    teacher = ee.Heterogeneous(
        [ee.ensemble(classes(w), size=2, key=jax.random.key(w)) for w in WIDTHS]
    )
    student = eqx.nn.MLP(2, 3, 4, 1, key=jax.random.key(9))
    t = 2.0
    got = ee.distillation_loss(teacher, temperature=t)(student, (X, Y), None)
    probs = jnp.stack(
        [jax.nn.softmax(jax.vmap(teacher[i])(X) / t, axis=-1) for i in range(4)]
    ).mean(0)
    student_log_probs = jax.nn.log_softmax(jax.vmap(student)(X) / t, axis=-1)
    kl = jnp.sum(probs * (jnp.log(probs) - student_log_probs), axis=-1)
    np.testing.assert_allclose(float(got), float(t**2 * kl.mean()), rtol=1e-5)
    # Laplace: one per group, said so (also without the tests' type-checking
    # hook, whose own error names the parameter).
    laplace = getattr(ee.laplace, "__wrapped__", ee.laplace)
    with pytest.raises(TypeError, match=r"one per group.*het\.groups"):
        laplace(het, (X, Y), likelihood="regression")
