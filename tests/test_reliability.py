"""Reliability: DESIGN.md section 3 end to end, across modules.

The per-module test files check each function against its own reference; this
module checks the promises that span modules:

- Isolation of faults (invariant 6): one member leaving the region where its loss
  is defined diverges mid-run inside `fit` (shared and bootstrap sampling, Adam and
  `clip_by_global_norm` + Adam); the others are bit-identical to the run where it
  does not diverge, `FitResult.diverged` names that member and that step, and the
  member is frozen at its last finite parameters: those of the same run stopped
  just before it diverged. The record survives an interrupt and a resume. A NaN
  member's forward pass (`ee.map`, chunked or not) leaves the other rows intact.
- Clear errors (invariant 5): every documented bad input of every module in one
  table of (callable, exception type, message pattern); the patterns require the
  message to name what is wrong and where (argument, leaf path, shapes, sizes).
  `fit`'s bad inputs are raised before any work is lost: no checkpoint is written,
  the callback is never called, and an existing checkpoint folder is untouched.
- Nothing lost (invariant 4) and round trips (invariant 2), hypothesis-driven:
  random ensembles (MLP / Linear / Conv, 1 to 5 members, float32 / bfloat16) and
  the states of random optax optimizers through `ee.save` / `ee.load`, then through
  `unstack`, `stack`, indexing and `ee.average` (checked against NumPy slices and
  means); and short random `fit` runs (random size, width, sampling, optimizer,
  evaluation, checkpoint and dispatch periods) interrupted at a random step and
  resumed from their checkpoint folder equal the uninterrupted run bit for bit,
  BatchNorm state, dropout keys and best members included. Slow variants run many
  more examples, and a run moved between meshes / device counts on resume.
"""

import functools
import os
import re
import shutil
import tempfile
import types
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import jaxtyping
import numpy as np
import optax
import pytest
from conftest import alternating, tree_equal
from hypothesis import given, settings, strategies as st

import eqx_ensemble as ee

# ----------------------------------------------------------------------------------
# Helpers: exact comparisons, independent of the code under test.
# ----------------------------------------------------------------------------------


def leaf_bytes(x):
    """A leaf's exact content (dtype, shape, bytes; typed keys by their key data)."""
    if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        return ("key", str(jax.random.key_impl(x)), leaf_bytes(jax.random.key_data(x)))
    host = np.asarray(x)
    return (host.dtype.name, host.shape, host.tobytes())


def assert_bitwise_equal(got, want):
    """Same structure (static fields included), array leaves equal bit for bit."""
    flat_got, tree_got = jax.tree_util.tree_flatten_with_path(got)
    flat_want, tree_want = jax.tree_util.tree_flatten_with_path(want)
    assert tree_got == tree_want, f"structures differ:\n{tree_got}\n{tree_want}"
    for (path, g), (_, w) in zip(flat_got, flat_want, strict=True):
        where = jax.tree_util.keystr(path)
        if eqx.is_array(w):
            assert eqx.is_array(g), where
            assert leaf_bytes(g) == leaf_bytes(w), f"leaf {where} differs"
        else:
            assert type(g) is type(w) and g == w, f"leaf {where}: {g!r} != {w!r}"


def member_slice(tree, i):
    """Member `i` of a stacked tree, sliced with NumPy (not with the library)."""
    return jax.tree.map(
        lambda x: jnp.asarray(np.asarray(x)[i]) if eqx.is_array(x) else x, tree
    )


def squared_norm(model):
    leaves = jax.tree.leaves(eqx.filter(model, eqx.is_inexact_array))
    return sum(jnp.sum(leaf**2) for leaf in leaves)


def random_fill(shapes, seed):
    """Replace every `jax.ShapeDtypeStruct` by random values (no compilation)."""
    rng = np.random.default_rng(seed)

    def fill(leaf):
        if not isinstance(leaf, jax.ShapeDtypeStruct):
            return leaf
        if jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            data = rng.integers(0, 2**32, (*leaf.shape, 2), dtype=np.uint32)
            return jax.random.wrap_key_data(data)
        if jnp.issubdtype(leaf.dtype, jnp.integer):
            return jnp.asarray(rng.integers(0, 100, leaf.shape).astype(leaf.dtype))
        return jnp.asarray(rng.normal(size=leaf.shape).astype(leaf.dtype))

    return jax.tree.map(fill, shapes)


def folder_snapshot(directory):
    """`{name: bytes}` of every file in a folder (empty if it does not exist)."""
    directory = Path(directory)
    if not directory.exists():
        return {}
    return {path.name: path.read_bytes() for path in sorted(directory.iterdir())}


# ----------------------------------------------------------------------------------
# Isolation of faults: one member diverges mid-run.
# ----------------------------------------------------------------------------------

SIZE = 4
WILD = 2  # the member that diverges
N, BATCH, STEPS, PER_DISPATCH = 32, 8, 16, 4
X = jax.random.normal(jax.random.key(1), (N, 2))
Y = jnp.sin(X[:, :1]) * X[:, 1:]
FIT_KEY = jax.random.key(2)
# The loss is defined (finite) only inside a ball of parameter space; leaving it is
# the fault. With the tame learning rate every member stays well inside (squared
# norms below 5); member WILD's larger rate walks it out after 5 to 8 steps.
LIMIT = 16.0
TAME_LR = jnp.full((SIZE,), 1e-2)
WILD_LR = TAME_LR.at[WILD].set(0.3)
# Module-level optimizers and losses: compiled functions are keyed on their
# identity, so the tests below share compilations.
ADAM = optax.inject_hyperparams(optax.adam)(learning_rate=1e-2)
CLIP_ADAM = optax.chain(
    optax.clip_by_global_norm(1.0),
    optax.inject_hyperparams(optax.adam)(learning_rate=1e-2),
)
OPTIMIZERS = {"adam": ADAM, "clip_adam": CLIP_ADAM}


def make_mlp(key):
    return eqx.nn.MLP(2, 1, 8, 1, key=key)


def bounded_loss(model, batch, key):
    xb, yb = batch
    mse = jnp.mean((jax.vmap(model)(xb) - yb) ** 2)
    # Exactly `mse` inside the ball (plus 0 * a finite number, gradient included),
    # NaN outside it: a loss that breaks down when a member's parameters run away.
    return mse + 0.0 * jnp.sqrt(LIMIT - squared_norm(model))


@functools.cache
def wild_ensemble():
    return ee.ensemble(make_mlp, size=SIZE, key=jax.random.key(0))


def run(optimizer, sampling, learning_rates, steps=STEPS, **kwargs):
    return ee.fit(
        wild_ensemble(),
        bounded_loss,
        optimizer,
        (X, Y),
        steps=steps,
        batch_size=BATCH,
        key=FIT_KEY,
        sampling=sampling,
        **{"callbacks": (), **kwargs},
        opt_state=ee.init_optimizer(
            optimizer, wild_ensemble(), hyperparams={"learning_rate": learning_rates}
        ),
        execution=ee.Execution(steps_per_dispatch=PER_DISPATCH),
    )


def opt_member(opt_state, i):
    return member_slice(opt_state, i)


@pytest.mark.parametrize(
    "optimizer,sampling", alternating(["adam", "clip_adam"], ["shared", "bootstrap"])
)
def test_one_diverging_member_is_isolated_reported_and_frozen(optimizer, sampling):
    optimizer = OPTIMIZERS[optimizer]
    wild = run(optimizer, sampling, WILD_LR)
    tame = run(optimizer, sampling, TAME_LR)
    assert tame.diverged == {}
    # Exactly that member, at one step in the middle of the run.
    assert set(wild.diverged) == {WILD}
    step = wild.diverged[WILD] - 1  # the steps done before it (counted from 1)
    assert PER_DISPATCH <= step < STEPS - 2, step

    # The others are bit-identical to the run where nothing diverged: parameters,
    # optimizer states and losses (clipping is per member: a cross-member global
    # norm would have been NaN for everyone at `step`).
    for i in range(SIZE):
        if i == WILD:
            continue
        assert_bitwise_equal(wild.ensemble[i], tame.ensemble[i])
        assert_bitwise_equal(
            opt_member(wild.opt_state, i), opt_member(tame.opt_state, i)
        )
        np.testing.assert_array_equal(
            wild.history.losses[:, i], tame.history.losses[:, i]
        )
    assert np.isfinite(np.delete(wild.history.losses, WILD, axis=1)).all()

    # The diverged member is frozen at its last finite values: those of the same
    # run stopped just before the divergence (which did not diverge at all).
    before = run(optimizer, sampling, WILD_LR, steps=step)
    assert before.diverged == {}
    frozen = wild.ensemble[WILD]
    assert_bitwise_equal(frozen, before.ensemble[WILD])
    assert_bitwise_equal(
        opt_member(wild.opt_state, WILD), opt_member(before.opt_state, WILD)
    )
    assert all(
        bool(jnp.isfinite(leaf).all())
        for leaf in jax.tree.leaves(eqx.filter(frozen, eqx.is_inexact_array))
    )
    # ...and it diverged because it had left the ball, not for another reason.
    assert float(squared_norm(frozen)) > LIMIT
    losses = wild.history.losses[:, WILD]
    np.testing.assert_array_equal(losses[:step], before.history.losses[:, WILD])
    assert np.isfinite(losses[:step]).all() and np.isnan(losses[step:]).all()


def test_a_nan_member_does_not_touch_the_others_outputs():
    # Forward passes are independent too: member WILD with NaN weights gives NaN
    # outputs, every other row is bit-identical to the healthy ensemble's, with or
    # without chunking (a chunk holding the NaN member holds healthy ones too).
    ens = wild_ensemble()
    poisoned = jax.tree.map(
        lambda x: x.at[WILD].set(jnp.nan) if eqx.is_inexact_array(x) else x, ens
    )
    xs = X[:5]

    def predict(model, xs):
        return jax.vmap(model)(xs)

    for chunk_size in (None, 3):
        clean = np.asarray(ee.map(predict, ens, xs, chunk_size=chunk_size))
        out = np.asarray(ee.map(predict, poisoned, xs, chunk_size=chunk_size))
        assert np.isnan(out[WILD]).all() and np.isfinite(clean).all()
        np.testing.assert_array_equal(
            np.delete(out, WILD, 0), np.delete(clean, WILD, 0)
        )


class Interrupt(Exception):
    pass


@pytest.mark.parametrize(
    ("optimizer", "sampling", "when"),
    alternating([("adam", "shared"), ("clip_adam", "bootstrap")], ["before", "after"]),
)
def test_divergence_record_survives_interrupt_and_resume(
    tmp_path, optimizer, sampling, when
):
    optimizer = OPTIMIZERS[optimizer]
    every = 4
    straight = run(optimizer, sampling, WILD_LR)
    step = straight.diverged[WILD] - 1  # the steps done before it (counted from 1)
    # Interrupt at the last checkpoint before the divergence, or one after it.
    stop = (
        (step - 1) // every * every if when == "before" else (step // every + 1) * every
    )
    assert 0 < stop < STEPS and (stop <= step) == (when == "before")

    def interrupt(result):
        if result.step >= stop:
            raise Interrupt

    folder = tmp_path / "run"
    with pytest.raises(Interrupt):
        run(
            optimizer,
            sampling,
            WILD_LR,
            checkpoints=ee.Checkpoints(folder, every=every, keep=2),
            callbacks=[interrupt],
        )
    assert [s for s, _ in ee.list_checkpoints(folder)] == [stop - every, stop][
        -min(2, stop // every) :
    ]
    resumed = run(
        optimizer, sampling, WILD_LR, checkpoints=ee.Checkpoints(folder, every=every)
    )
    assert resumed.step == STEPS
    assert resumed.diverged == straight.diverged == {WILD: step + 1}
    assert_bitwise_equal(resumed.ensemble, straight.ensemble)
    assert_bitwise_equal(resumed.opt_state, straight.opt_state)
    np.testing.assert_array_equal(resumed.history.losses, straight.history.losses)
    # A finished run extended by more steps keeps the member frozen and reported.
    extended = run(
        optimizer,
        sampling,
        WILD_LR,
        steps=STEPS + PER_DISPATCH,
        checkpoints=ee.Checkpoints(folder, every=every),
    )
    assert extended.diverged == {WILD: step + 1}
    assert_bitwise_equal(extended.ensemble[WILD], straight.ensemble[WILD])
    assert np.isnan(extended.history.losses[STEPS:, WILD]).all()


# ----------------------------------------------------------------------------------
# Clear errors: every bad input, in one table.
# ----------------------------------------------------------------------------------


def _make4(key):
    return eqx.nn.MLP(2, 1, 4, 1, key=key)


def _make5(key):
    return eqx.nn.MLP(2, 1, 5, 1, key=key)


def _mean_loss(model, batch, key):
    return jnp.mean(jax.vmap(model)(batch))


def _vector_loss(model, batch, key):
    return jax.vmap(model)(batch)


@pytest.fixture(scope="module")
def bad(tmp_path_factory):
    """The objects the error table needs: small ensembles and damaged checkpoints."""
    folder = tmp_path_factory.mktemp("bad")
    key = jax.random.key(0)
    ens = ee.ensemble(_make4, size=3, key=key)
    good = ee.save(folder / "good.ckpt", ens)
    raw = good.read_bytes()
    (folder / "truncated.ckpt").write_bytes(raw[:-10])
    flipped = bytearray(raw)
    flipped[-5] ^= 0x01  # a bit in the last array's data
    (folder / "flipped.ckpt").write_bytes(bytes(flipped))
    (folder / "not_a_checkpoint.ckpt").write_bytes(b"{'weights': [1, 2, 3]}\n" * 4)
    adam = optax.adam(1e-3)
    return types.SimpleNamespace(
        key=key,
        folder=folder,
        ens=ens,
        ens5=ee.ensemble(_make5, size=3, key=key),
        adam=adam,
        opt_state=ee.init_optimizer(adam, ens),
        opt_state2=ee.init_optimizer(adam, ens[:2]),
        injected=optax.inject_hyperparams(optax.adam)(learning_rate=1e-3),
        probs=jnp.full((3, 4, 2), 0.5),
        labels=jnp.array([0, 1, 1, 0]),
    )


def _bf16(tree):
    return jax.tree.map(
        lambda x: x.astype(jnp.bfloat16) if eqx.is_inexact_array(x) else x, tree
    )


def _neg_variances():
    return jnp.ones((3, 4)).at[1, 2].set(-0.5)


# (id, call, exception type, pattern). Each pattern names the argument, leaf path,
# shapes or sizes involved, not just the kind of error.
ERRORS = [
    # ---- construction: ensemble, stack, concatenate, indexing
    (
        "ensemble-size-0",
        lambda o: ee.ensemble(_make4, size=0, key=o.key),
        ValueError,
        r"`size` must be at least 1, got 0",
    ),
    (
        "ensemble-key-batch",
        lambda o: ee.ensemble(_make4, size=3, key=jax.random.split(o.key, 2)),
        ValueError,
        r"`key` must be a single PRNG key of shape \(\), got a key array of shape "
        r"\(2,\)",
    ),
    (
        "ensemble-raw-key-shape",
        lambda o: ee.ensemble(_make4, size=3, key=jnp.zeros(3, jnp.uint32)),
        ValueError,
        r"`key` must be a single PRNG key .* got an array of shape \(3,\) and dtype "
        r"uint32",
    ),
    (
        "stack-empty",
        lambda o: ee.stack([]),
        ValueError,
        r"`ee\.stack` got an empty list",
    ),
    (
        "stack-leaf-shape",
        lambda o: ee.stack([(jnp.ones(3), jnp.ones(2)), (jnp.ones(3), jnp.ones(4))]),
        ValueError,
        r"model 0 and model 1 differ.*leaf `\[1\]` differs: array of shape \(2,\).* "
        r"vs array of shape \(4,\)",
    ),
    (
        "stack-static-field",
        lambda o: ee.stack([o.ens[0], o.ens5[1]]),
        ValueError,
        r"model 0 and model 1 differ.*static field `\.width_size` differs: 4 vs 5",
    ),
    (
        "stack-dtype",
        lambda o: ee.stack([o.ens[0], _bf16(o.ens[1])]),
        ValueError,
        r"leaf `\.layers\[0\]\.weight` differs: .*float32 vs .*bfloat16",
    ),
    (
        "concatenate-empty",
        lambda o: ee.concatenate([]),
        ValueError,
        r"`ee\.concatenate` got an empty list",
    ),
    (
        "concatenate-mismatch",
        lambda o: ee.concatenate([o.ens, o.ens5]),
        ValueError,
        r"ensemble 0 and ensemble 1 differ.*`\.width_size` differs: 4 vs 5",
    ),
    (
        "index-out-of-range",
        lambda o: o.ens[3],
        IndexError,
        r"member index 3 is out of range for an ensemble of 3 members",
    ),
    # ---- calling and map
    (
        "call-key-batch",
        lambda o: o.ens(jnp.ones(2), key=jax.random.split(o.key, 3)),
        ValueError,
        r"`key` must be a single PRNG key of shape \(\), got a key array of shape "
        r"\(3,\)",
    ),
    (
        "map-chunk-size-0",
        lambda o: ee.map(lambda m, x: m(x), o.ens, jnp.ones(2), chunk_size=0),
        ValueError,
        r"`chunk_size` must be between 1 and the ensemble size 3, got 0",
    ),
    (
        "map-chunk-size-too-large",
        lambda o: ee.map(lambda m, x: m(x), o.ens, jnp.ones(2), chunk_size=4),
        ValueError,
        r"`chunk_size` must be between 1 and the ensemble size 3, got 4",
    ),
    (
        "map-per-member-size",
        lambda o: ee.map(lambda m, x: m(x), o.ens, jnp.ones((4, 2)), in_axes=(0,)),
        ValueError,
        r"argument 0 is per-member .* ensemble size 3, but it has shape \(4, 2\)",
    ),
    (
        "map-per-member-leaf",
        lambda o: ee.map(
            lambda m, b: m(b["x"]),
            o.ens,
            {"x": jnp.ones((4, 2)), "y": jnp.ones(2)},
            in_axes=({"x": 0, "y": None},),
        ),
        ValueError,
        r"argument 0 at leaf `\['x'\]` is per-member .* size 3, but it has shape "
        r"\(4, 2\)",
    ),
    (
        "map-in-axes-length",
        lambda o: ee.map(
            lambda m, x, y: m(x), o.ens, jnp.ones(2), jnp.ones(2), in_axes=(None,)
        ),
        ValueError,
        r"`in_axes` has 1 entries but 2 positional argument",
    ),
    (
        "map-key-batch",
        lambda o: ee.map(
            lambda m, x, key: m(x), o.ens, jnp.ones(2), key=jax.random.split(o.key, 3)
        ),
        ValueError,
        r"`key` must be a single PRNG key of shape \(\), got a key array of shape "
        r"\(3,\)",
    ),
    # ---- averaging and combining
    (
        "average-weight-count",
        lambda o: ee.average(o.ens, weights=jnp.ones(2)),
        ValueError,
        r"`weights` must have one entry per member: the ensemble has 3 members, "
        r"weights have shape \(2,\)",
    ),
    (
        "average-negative-weight",
        lambda o: ee.average(o.ens, weights=jnp.array([1.0, -1.0, 1.0])),
        ValueError,
        r"`weights` must be finite and non-negative",
    ),
    pytest.param(
        "average-nan-weight",
        lambda o: ee.average(o.ens, weights=jnp.array([jnp.nan, 1.0, 1.0])),
        ValueError,
        r"`weights` must be finite",
    ),
    (
        "tree-weighted-sum-count",
        lambda o: ee.tree_weighted_sum([o.ens[0], o.ens[1]], jnp.ones(3)),
        ValueError,
        r"`weights` must have one entry per tree: got 2 trees and weights of shape "
        r"\(3,\)",
    ),
    (
        "tree-weighted-sum-structure",
        lambda o: ee.tree_weighted_sum([o.ens[0], o.ens5[0]], jnp.ones(2)),
        ValueError,
        r"tree 0 and tree 1 differ.*`\.width_size` differs: 4 vs 5",
    ),
    (
        "tree-weighted-sum-empty",
        lambda o: ee.tree_weighted_sum([], jnp.ones(0)),
        ValueError,
        r"empty list of trees",
    ),
    (
        "combine-weight-count",
        lambda o: ee.combine.mean_probs(o.probs, weights=jnp.ones(2)),
        ValueError,
        r"predictions have 3 members, weights have shape \(2,\)",
    ),
    (
        "combine-majority-classes",
        lambda o: ee.combine.majority_vote(jnp.zeros((3, 4), jnp.int32), num_classes=0),
        ValueError,
        r"`num_classes` must be at least 1, got 0",
    ),
    (
        "combine-mixture-shapes",
        lambda o: ee.combine.gaussian_mixture(jnp.zeros((3, 4)), jnp.ones((3, 5))),
        ValueError,
        r"`means` and `variances` must have the same shape, got \(3, 4\) and \(3, 5\)",
    ),
    # ---- training: init_optimizer, make_step
    (
        "init-optimizer-not-an-ensemble",
        lambda o: ee.init_optimizer(o.adam, o.ens.members),
        TypeError,
        r"expected an `ee\.Ensemble`, got MLP",
    ),
    (
        "init-optimizer-hyperparam-length",
        lambda o: ee.init_optimizer(
            o.injected, o.ens, hyperparams={"learning_rate": jnp.ones(2)}
        ),
        ValueError,
        r"'learning_rate' must have one value per member: the ensemble has 3 "
        r"members, got shape \(2,\)",
    ),
    (
        "init-optimizer-unknown-hyperparam",
        lambda o: ee.init_optimizer(o.injected, o.ens, hyperparams={"lr": 1e-3}),
        ValueError,
        r"Unknown hyperparameter 'lr'.*'learning_rate'",
    ),
    (
        "init-optimizer-not-injected",
        lambda o: ee.init_optimizer(o.adam, o.ens, hyperparams={"learning_rate": 1e-3}),
        ValueError,
        r"inject_hyperparams",
    ),
    (
        "make-step-optimizer-state-size",
        lambda o: ee.make_step(_mean_loss, o.adam)(
            o.ens, o.opt_state2, jnp.ones((4, 2)), o.key
        ),
        ValueError,
        r"optimizer state does not match .* 3-member ensemble.*leaf `\[0\]\.count` "
        r"differs: .*\[3\] vs .*\[2\]",
    ),
    (
        "make-step-optimizer-state-kind",
        lambda o: ee.make_step(_mean_loss, o.adam)(
            o.ens, ee.init_optimizer(optax.sgd(0.1), o.ens), jnp.ones((4, 2)), o.key
        ),
        ValueError,
        r"optimizer state does not match.*`\[0\]` differs in type: ScaleByAdamState "
        r"vs EmptyState",
    ),
    (
        "make-step-non-scalar-loss",
        lambda o: ee.make_step(_vector_loss, o.adam)(
            o.ens, o.opt_state, jnp.ones((4, 2)), o.key
        ),
        ValueError,
        r"`loss_fn` must return a scalar loss .* a loss of shape \(4, 1\)",
    ),
    (
        "make-step-per-member-batch",
        lambda o: ee.make_step(_mean_loss, o.adam, per_member_batch=True)(
            o.ens, o.opt_state, jnp.ones((4, 4, 2)), o.key
        ),
        ValueError,
        r"ensemble size 3, but it has shape \(4, 4, 2\)",
    ),
    (
        "make-step-model-state-size",
        lambda o: ee.make_step(_fit_stateful, o.adam)(
            ee.Ensemble(_batchnorm_states(3)[0]),
            ee.init_optimizer(o.adam, ee.Ensemble(_batchnorm_states(3)[0])),
            (jnp.ones((4, 2)),),
            o.key,
            _batchnorm_states(2)[1],
        ),
        ValueError,
        r"`state`.* leading axis must be the ensemble size 3",
    ),
    (
        "make-step-key-batch",
        lambda o: ee.make_step(_mean_loss, o.adam)(
            o.ens, o.opt_state, jnp.ones((4, 2)), jax.random.split(o.key, 3)
        ),
        ValueError,
        r"`key` must be a single PRNG key of shape \(\)",
    ),
    (
        "make-step-mesh-indivisible",
        lambda o: ee.make_step(
            _mean_loss, o.adam, execution=ee.Execution(mesh=ee.make_mesh(members=2))
        )(o.ens, o.opt_state, jnp.ones((4, 2)), o.key),
        ValueError,
        r"The ensemble has 3 members, which do not split evenly over the 2 devices of "
        r"the mesh axis 'members'.*e\.g\. 2, 4",
    ),
    # ---- distribution: make_mesh, shard
    (
        "make-mesh-axis-0",
        lambda o: ee.make_mesh(members=0),
        ValueError,
        r"`members` must be at least 1, got 0",
    ),
    (
        "make-mesh-too-many-devices",
        lambda o: ee.make_mesh(members=4, data=4),
        ValueError,
        r"The mesh \{'members': 4, 'data': 4\} needs 16 devices, but 8 are available",
    ),
    (
        "shard-members-indivisible",
        lambda o: ee.shard(o.ens, ee.make_mesh(members=2)),
        ValueError,
        r"leaf `\.members\.layers\[0\]\.weight` has 3 members, which do not split "
        r"evenly over the 2 devices of the mesh axis 'members'",
    ),
    (
        "shard-data-indivisible",
        lambda o: ee.shard(jnp.ones((5, 2)), ee.make_mesh(data=2), axes="data"),
        ValueError,
        r"5 examples along its leading axis, which do not split evenly over the 2 "
        r"devices of the mesh axis 'data'",
    ),
    # ---- checkpoints: save, save_checkpoint, load, load_manifest
    (
        "save-traced",
        lambda o: eqx.filter_jit(lambda e: ee.save(o.folder / "traced.ckpt", e))(o.ens),
        TypeError,
        r"Cannot save leaf `\.members\.layers\[0\]\.weight`: it is traced",
    ),
    (
        "save-metadata-not-json",
        lambda o: ee.save(o.folder / "m.ckpt", o.ens, metadata={"f": object()}),
        TypeError,
        r"`metadata` must be JSON-serialisable",
    ),
    (
        "save-checkpoint-negative-step",
        lambda o: ee.save_checkpoint(o.folder / "steps", -1, o.ens),
        ValueError,
        r"`step` must be a non-negative integer, got -1",
    ),
    (
        "save-checkpoint-keep-0",
        lambda o: ee.save_checkpoint(o.folder / "steps", 1, o.ens, keep=0),
        ValueError,
        r"`keep` must be None or an integer >= 1, got 0",
    ),
    (
        "load-truncated",
        lambda o: ee.load(o.folder / "truncated.ckpt", o.ens),
        ee.CheckpointError,
        r"truncated\.ckpt: the file is truncated: \d+ bytes, the manifest describes "
        r"\d+ bytes",
    ),
    (
        "load-flipped-bit",
        lambda o: ee.load(o.folder / "flipped.ckpt", o.ens),
        ee.CheckpointError,
        r"flipped\.ckpt: the data is corrupt: its sha256 does not match",
    ),
    (
        "load-not-a-checkpoint",
        lambda o: ee.load(o.folder / "not_a_checkpoint.ckpt", o.ens),
        ee.CheckpointError,
        r"not_a_checkpoint\.ckpt: not an eqx_ensemble checkpoint",
    ),
    (
        "load-manifest-not-a-checkpoint",
        lambda o: ee.load_manifest(o.folder / "not_a_checkpoint.ckpt"),
        ee.CheckpointError,
        r"not an eqx_ensemble checkpoint",
    ),
    (
        "load-missing-file",
        lambda o: ee.load(o.folder / "missing.ckpt", o.ens),
        FileNotFoundError,
        r"no checkpoint file at .*missing\.ckpt",
    ),
    (
        "load-like-size",
        lambda o: ee.load(o.folder / "good.ckpt", o.ens[:2]),
        ee.CheckpointError,
        r"an ensemble of 3 members at `<root>` but `like` has 2 members",
    ),
    (
        "load-like-static-field",
        lambda o: ee.load(o.folder / "good.ckpt", o.ens5),
        ee.CheckpointError,
        r"static field `width_size` of node `\.members` \(MLP\) is 4 in the "
        r"checkpoint but 5 in `like`",
    ),
    (
        "load-like-dtype",
        lambda o: ee.load(o.folder / "good.ckpt", _bf16(o.ens)),
        ee.CheckpointError,
        r"leaf `\.members\.layers\[0\]\.weight` differs: the checkpoint holds an "
        r"array of shape \(3, 4, 2\) and dtype float32, `like` holds an array of "
        r"shape \(3, 4, 2\) and dtype bfloat16",
    ),
    (
        "load-like-structure",
        lambda o: ee.load(o.folder / "good.ckpt", {"ens": o.ens}),
        ee.CheckpointError,
        r"node `<root>` is of type Ensemble in the checkpoint but of type dict",
    ),
    # ---- metrics
    (
        "metrics-probabilities-sum",
        lambda o: ee.metrics.nll(jnp.full((3, 4, 2), 0.4), o.labels),
        ValueError,
        r"`probs` must sum to one .* shape \(3, 4, 2\) .* member 0, example 0, which "
        r"sums to 0\.8",
    ),
    (
        "metrics-labels-out-of-range",
        lambda o: ee.metrics.accuracy(o.probs, jnp.array([0, 1, 2, 0])),
        ValueError,
        r"`labels` must lie in \[0, 2\) .* the first out-of-range label is 2 at "
        r"index 2",
    ),
    (
        "metrics-labels-batch",
        lambda o: ee.metrics.brier_score(o.probs, jnp.zeros(5, jnp.int32)),
        ValueError,
        r"`labels` must have shape \(batch,\) = \(4,\) .* predictions of shape "
        r"\(3, 4, 2\) .* has shape \(5,\)",
    ),
    (
        "metrics-no-member-axis",
        lambda o: ee.metrics.predictive_entropy(o.probs[0]),
        ValueError,
        r"must have shape \(members, batch, classes\), got shape \(4, 2\)",
    ),
    (
        "metrics-n-bins-0",
        lambda o: ee.metrics.expected_calibration_error(o.probs, o.labels, n_bins=0),
        ValueError,
        r"`n_bins` must be at least 1, got 0",
    ),
    (
        "metrics-adaptive-n-bins-0",
        lambda o: ee.metrics.adaptive_calibration_error(o.probs, o.labels, n_bins=0),
        ValueError,
        r"`n_bins` must be at least 1, got 0",
    ),
    (
        "metrics-negative-variances",
        lambda o: ee.metrics.gaussian_nll(
            jnp.zeros((3, 4)), _neg_variances(), jnp.zeros(4)
        ),
        ValueError,
        r"`variances` must be non-negative, but 1 of its 12 entries \(shape \(3, 4\)\) "
        r"are negative, the smallest -0\.5; the first is at member 1, example 2",
    ),
    (
        "metrics-targets-batch",
        lambda o: ee.metrics.rmse(jnp.zeros((3, 4)), jnp.zeros(5)),
        ValueError,
        r"`targets` must have shape \(batch,\) = \(4,\) to match `means` of shape "
        r"\(3, 4\)",
    ),
]


def _error_params():
    for case in ERRORS:
        if hasattr(case, "marks"):  # already a pytest.param (an expected failure)
            yield pytest.param(*case.values, id=case.values[0], marks=case.marks)
        else:
            yield pytest.param(*case, id=case[0])


@pytest.fixture
def without_runtime_typecheck(monkeypatch):
    # The suite runs with the jaxtyping import hook, which rejects some bad shapes
    # first with its own error; users without the hook get the library's messages.
    monkeypatch.setattr(jaxtyping.config, "jaxtyping_disable", True)


ERROR_PARAMS = list(_error_params())


@pytest.mark.parametrize(("name", "call", "error", "pattern"), ERROR_PARAMS)
def test_bad_input_error(bad, without_runtime_typecheck, name, call, error, pattern):
    with pytest.raises(error, match=pattern) as raised:
        call(bad)
    # The library's own message, not a JAX/XLA internal one passed through.
    assert "vmap got inconsistent sizes" not in str(raised.value)


@pytest.mark.parametrize(("name", "call", "error", "pattern"), ERROR_PARAMS)
def test_bad_input_error_under_runtime_typecheck(bad, name, call, error, pattern):
    # With the jaxtyping hook on, the same input is rejected, either by the library
    # or by the type checker naming the offending parameter.
    with pytest.raises((error, jaxtyping.TypeCheckError)) as raised:
        call(bad)
    message = str(raised.value)
    if isinstance(raised.value, jaxtyping.TypeCheckError):
        assert re.search(r"typechecking parameter '\w+'", message), message
    else:
        assert re.search(pattern, message, re.DOTALL), message


def test_failed_saves_leave_the_previous_file(bad, tmp_path):
    # A save that is refused never touches the file already at `path`.
    path = ee.save(tmp_path / "model.ckpt", bad.ens)
    before = path.read_bytes()
    with pytest.raises(TypeError):
        ee.save(path, bad.ens5, metadata={"f": object()})
    with pytest.raises(TypeError):
        eqx.filter_jit(lambda e: ee.save(path, e))(bad.ens5)
    assert path.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["model.ckpt"]
    assert_bitwise_equal(ee.load(path, bad.ens), bad.ens)


# ---- fit: errors raised before any step, checkpoint or callback ------------------

FIT_X = jnp.linspace(-1.0, 1.0, 8)[:, None] * jnp.ones((1, 2))
FIT_Y = jnp.sum(FIT_X, axis=1, keepdims=True)
FIT_ADAM = optax.adam(1e-2)


def _fit_mse(model, batch, key):
    xb, yb = batch
    return jnp.mean((jax.vmap(model)(xb) - yb) ** 2)


def _fit_nan(model, batch, key):
    return _fit_mse(model, batch, key) * jnp.nan


def _fit_vector(model, batch, key):
    return jax.vmap(model)(batch[0])[:, 0]


def _vector_eval(model, data, key):
    return jax.vmap(model)(data)


def _one_element_eval(model, data, key):
    return jnp.mean(jax.vmap(model)(data), axis=0)


def _fit_int(model, batch, key):
    return jnp.sum(batch[0] > 0)


class _BatchNormModel(eqx.Module):
    linear: eqx.nn.Linear
    norm: eqx.nn.BatchNorm

    def __init__(self, key):
        self.linear = eqx.nn.Linear(2, 3, key=key)
        self.norm = eqx.nn.BatchNorm(3, axis_name="batch", mode="batch")

    def __call__(self, x, state):
        return self.norm(self.linear(x), state)


@functools.cache
def _batchnorm_states(size):
    make = eqx.nn.make_with_state(_BatchNormModel)
    return eqx.filter_vmap(make)(jax.random.split(jax.random.key(0), size))


def _fit_stateful(model, state, batch, key):
    out, state = jax.vmap(
        model, axis_name="batch", in_axes=(0, None), out_axes=(0, None)
    )(batch[0], state)
    return jnp.mean(out**2), state


class Lazy:
    """An argument built from the `bad` fixture's objects when the test runs."""

    def __init__(self, make):
        self.make = make

    def __repr__(self):
        return "Lazy(...)"


# Overrides of a valid call (`_fit_call`) and the error each must raise.
FIT_ERRORS = [
    ("steps-0", dict(steps=0), ValueError, r"`steps` must be at least 1, got 0"),
    (
        "batch-larger-than-data",
        dict(batch_size=9),
        ValueError,
        r"`batch_size` \(9\) is larger than the data \(8 examples\)",
    ),
    (
        "data-leading-axes",
        dict(data=(FIT_X, FIT_Y[:7])),
        ValueError,
        r"The arrays of `data` disagree on the number of examples \(leading axis\): "
        r"`\[0\]`: 8, `\[1\]`: 7",
    ),
    (
        "data-scalar-leaf",
        dict(data=(FIT_X, jnp.ones(()))),
        ValueError,
        r"`data` leaf `\[1\]` is a scalar",
    ),
    (
        "data-empty",
        dict(data=(FIT_X[:0], FIT_Y[:0])),
        ValueError,
        r"0 examples",
    ),
    (
        "data-empty-bootstrap",
        dict(data=(FIT_X[:0], FIT_Y[:0]), sampling="bootstrap"),
        ValueError,
        r"0 examples",
    ),
    (
        "non-scalar-loss",
        dict(loss_fn=_fit_vector),
        ValueError,
        r"`loss_fn` must return a scalar loss .* a loss of shape \(2,\)",
    ),
    (
        "integer-loss",
        dict(loss_fn=_fit_int),
        TypeError,
        r"`loss_fn` must return a floating loss, got int32",
    ),
    (
        "nan-loss-everywhere",
        dict(loss_fn=_fit_nan),
        ee.EnsembleDivergedError,
        r"All 3 members diverged .* at steps \[\d+, \d+, \d+\]",
    ),
    (
        "hyperparam-length",
        dict(
            optimizer=optax.inject_hyperparams(optax.adam)(learning_rate=1e-2),
            opt_state=Lazy(
                lambda o: ee.init_optimizer(
                    optax.inject_hyperparams(optax.adam)(learning_rate=1e-2),
                    o.ens,
                    hyperparams={"learning_rate": jnp.ones(2)},
                )
            ),
        ),
        ValueError,
        r"'learning_rate' must have one value per member: the ensemble has 3 "
        r"members, got shape \(2,\)",
    ),
    (
        "optimizer-state-of-other-size",
        dict(opt_state=Lazy(lambda o: o.opt_state2)),
        ValueError,
        r"optimizer state does not match .* 3-member ensemble.*`\[0\]\.count`",
    ),
    (
        "optimizer-state-of-other-optimizer",
        dict(opt_state=Lazy(lambda o: ee.init_optimizer(optax.sgd(0.1), o.ens))),
        ValueError,
        r"optimizer state does not match.*ScaleByAdamState vs EmptyState",
    ),
    (
        "mesh-indivisible",
        dict(
            execution=Lazy(
                lambda o: ee.Execution(
                    steps_per_dispatch=2, mesh=ee.make_mesh(members=2)
                )
            )
        ),
        ValueError,
        r"The ensemble has 3 members, which do not split evenly over the 2 devices",
    ),
    (
        "batch-indivisible-by-data-axis",
        dict(
            execution=Lazy(
                lambda o: ee.Execution(steps_per_dispatch=2, mesh=ee.make_mesh(data=2))
            ),
            batch_size=3,
        ),
        ValueError,
        r"`batch_size` \(3\) does not split evenly over the 2 devices of the mesh "
        r"axis 'data'",
    ),
    (
        "key-batch",
        dict(key=Lazy(lambda o: jax.random.split(o.key, 3))),
        ValueError,
        r"`key` must be a single PRNG key of shape \(\), got a key array of shape "
        r"\(3,\)",
    ),
    (
        "unknown-sampling",
        dict(sampling="bagging"),
        ValueError,
        r"`sampling` must be one of .* got 'bagging'",
    ),
    (
        "not-an-ensemble",
        dict(ens=Lazy(lambda o: o.ens.members)),
        TypeError,
        r"`fit` expects an `ee\.Ensemble` \(or an `ee\.Heterogeneous`\), got MLP",
    ),
    (
        "model-state-of-other-size",
        dict(
            ens=Lazy(lambda o: ee.Ensemble(_batchnorm_states(3)[0])),
            state=Lazy(lambda o: _batchnorm_states(2)[1]),
            loss_fn=_fit_stateful,
        ),
        ValueError,
        r"`state`.* leading axis must be the ensemble size 3",
    ),
    (
        "eval-fn-non-scalar",
        dict(evaluate=ee.Evaluate(_vector_eval, FIT_X, every=1)),
        ValueError,
        r"`Evaluate`'s `fn` must return a scalar score .* got shape \(8, 1\)",
    ),
    (
        "eval-fn-one-element",
        dict(evaluate=ee.Evaluate(_one_element_eval, FIT_X, every=1)),
        ValueError,
        r"`Evaluate`'s `fn` must return a scalar score .* got shape \(1,\)",
    ),
]


# Resuming the finished run (saved without evaluation) with an evaluation is
# refused first, by the run contract (a different run: see the guide).
_NO_BEST_IN_CHECKPOINT = (
    ee.CheckpointError,
    r"different `eval_every` \(None there, 1 now\)",
)
RESUMED_ERRORS = {
    "eval-fn-non-scalar": _NO_BEST_IN_CHECKPOINT,
    "eval-fn-one-element": _NO_BEST_IN_CHECKPOINT,
}


def _fit_call(bad, checkpoint_dir, callback, steps=4, **overrides):
    """`ee.fit` on a valid small problem, with some arguments replaced."""
    arguments = dict(
        ens=bad.ens,
        loss_fn=_fit_mse,
        optimizer=FIT_ADAM,
        data=(FIT_X, FIT_Y),
        steps=steps,
        batch_size=2,
        key=bad.key,
        checkpoints=ee.Checkpoints(checkpoint_dir, every=2),
        callbacks=[] if callback is None else [callback],
        execution=ee.Execution(steps_per_dispatch=2),
    )
    for name, value in overrides.items():
        arguments[name] = value.make(bad) if isinstance(value, Lazy) else value
    return ee.fit(
        arguments.pop("ens"),
        arguments.pop("loss_fn"),
        arguments.pop("optimizer"),
        arguments.pop("data"),
        **arguments,
    )


def _fit_params():
    for case in FIT_ERRORS:
        if hasattr(case, "marks"):  # already a pytest.param (an expected failure)
            yield pytest.param(*case.values, id=case.values[0], marks=case.marks)
        else:
            yield pytest.param(*case, id=case[0])


@pytest.fixture(scope="module")
def finished_run(bad, tmp_path_factory):
    """A checkpoint folder of a finished 4-step run (checkpoints at steps 2 and 4)."""
    folder = tmp_path_factory.mktemp("finished") / "run"
    _fit_call(bad, folder, None)
    assert [step for step, _ in ee.list_checkpoints(folder)] == [2, 4]
    return folder


@pytest.mark.parametrize("resume", [False, True], ids=["fresh", "resumed"])
@pytest.mark.parametrize(("name", "overrides", "error", "pattern"), list(_fit_params()))
def test_fit_bad_input_raises_before_any_work(
    bad,
    finished_run,
    without_runtime_typecheck,
    tmp_path,
    resume,
    name,
    overrides,
    error,
    pattern,
):
    folder = tmp_path / "run"
    if resume:
        # Continuing a finished run to 8 steps: its checkpoints must survive intact.
        shutil.copytree(finished_run, folder)
        error, pattern = RESUMED_ERRORS.get(name, (error, pattern))
    before = folder_snapshot(folder)
    calls = []
    with pytest.raises(error, match=pattern) as raised:
        _fit_call(bad, folder, calls.append, **{"steps": 8, **overrides})
    assert "vmap got inconsistent sizes" not in str(raised.value)
    assert calls == [], "the callback ran: a step finished before the error"
    assert folder_snapshot(folder) == before, "the checkpoint folder changed"


def test_resume_into_another_architecture_names_the_leaf(bad, finished_run, tmp_path):
    folder = tmp_path / "run"
    shutil.copytree(finished_run, folder)
    before = folder_snapshot(folder)
    wider = ee.ensemble(_make5, size=3, key=bad.key)
    with pytest.raises(
        ee.CheckpointError,
        match=r"static field `width_size` of node .* is 4 in the "
        r"checkpoint but 5 in `like`",
    ):
        ee.fit(
            wider,
            _fit_mse,
            FIT_ADAM,
            (FIT_X, FIT_Y),
            steps=8,
            batch_size=2,
            key=bad.key,
            checkpoints=ee.Checkpoints(folder),
            callbacks=(),
        )
    assert folder_snapshot(folder) == before


def test_resume_from_a_corrupt_checkpoint_refuses_and_keeps_the_folder(
    bad, finished_run, tmp_path
):
    folder = tmp_path / "run"
    shutil.copytree(finished_run, folder)
    latest = ee.latest_checkpoint(folder)
    damaged = bytearray(latest.read_bytes())
    damaged[-3] ^= 0x10
    latest.write_bytes(bytes(damaged))
    before = folder_snapshot(folder)
    calls = []
    with pytest.raises(
        ee.CheckpointError, match=r"step_0*4\.ckpt: the data is corrupt"
    ):
        _fit_call(bad, folder, calls.append, steps=8)
    assert calls == [] and folder_snapshot(folder) == before


# ----------------------------------------------------------------------------------
# Random ensembles through save / load and across modules (hypothesis).
# ----------------------------------------------------------------------------------

ARCHITECTURES = {
    "mlp": lambda key, a, b: eqx.nn.MLP(3, a, b, a % 3, key=key),
    "linear": lambda key, a, b: eqx.nn.Linear(a, b, use_bias=a % 2 == 0, key=key),
    "conv": lambda key, a, b: eqx.nn.Conv2d(2, a, kernel_size=b % 3 + 1, key=key),
}
SAVE_OPTIMIZERS = {
    "sgd-momentum": lambda: optax.sgd(0.1, momentum=0.9),
    "adam": lambda: optax.adam(1e-3),
    "adamw": lambda: optax.adamw(1e-3, weight_decay=1e-2),
    "clip-adam": lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)),
    "inject-adam": lambda: optax.inject_hyperparams(optax.adam)(learning_rate=1e-3),
    "adafactor": lambda: optax.adafactor(1e-3),
    "lion": lambda: optax.lion(1e-4),
    "rmsprop": lambda: optax.rmsprop(1e-3, momentum=0.5),
}
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def _build(architecture, a, b, size, dtype, optimizer):
    def make(key):
        model = ARCHITECTURES[architecture](key, a, b)
        return jax.tree.map(
            lambda x: x.astype(dtype) if eqx.is_inexact_array(x) else x, model
        )

    ens = ee.ensemble(make, size=size, key=jax.random.key(0))
    opt_state = ee.init_optimizer(SAVE_OPTIMIZERS[optimizer](), ens)
    return {"ens": ens, "opt": opt_state, "key": jax.random.key(1), "step": 7}


def _round_trip_across_modules(
    architecture, a, b, size, dtype, optimizer, like_from_eval_shape, seed
):
    build = functools.partial(
        _build, architecture, a, b, size, DTYPES[dtype], optimizer
    )
    # Random values on random structures, without compiling each new shape.
    shapes = eqx.filter_eval_shape(build)
    tree = random_fill(shapes, seed)
    like = shapes if like_from_eval_shape else random_fill(shapes, seed + 1)
    ens = tree["ens"]
    # Independent per-member references: NumPy slices of the stacked leaves.
    members = [member_slice(ens.members, i) for i in range(size)]
    with tempfile.TemporaryDirectory() as directory:
        path = ee.save(Path(directory) / "tree.ckpt", tree)
        loaded = ee.load(path, like)
        assert_bitwise_equal(loaded, tree)
        assert ee.load_manifest(path)["ensemble_size"] == size

        # Across modules: the loaded ensemble behaves as the saved one.
        restored = loaded["ens"]
        assert len(restored) == size
        for i, model in enumerate(ee.unstack(restored)):
            assert_bitwise_equal(model, members[i])
            assert_bitwise_equal(restored[i], members[i])
        assert_bitwise_equal(ee.stack(ee.unstack(restored)), ens)

        # unstack(stack(ms)) == ms after the list of models itself went through disk.
        listed = ee.save(Path(directory) / "list.ckpt", members)
        members_loaded = ee.load(listed, [member_slice(ens.members, 0)] * size)
        for got, want in zip(
            ee.unstack(ee.stack(members_loaded)), members, strict=True
        ):
            assert_bitwise_equal(got, want)

    # The soup of the loaded ensemble: the float64 NumPy mean of the members.
    soup = ee.average(restored)
    tolerance = 1e-2 if dtype == "bfloat16" else 1e-5
    for got, stacked in zip(
        jax.tree.leaves(eqx.filter(soup, eqx.is_array)),
        jax.tree.leaves(eqx.filter(ens.members, eqx.is_array)),
        strict=True,
    ):
        want = np.asarray(stacked, dtype=np.float64).mean(axis=0)
        assert got.dtype == stacked.dtype and got.shape == want.shape
        np.testing.assert_allclose(
            np.asarray(got, dtype=np.float64), want, rtol=tolerance, atol=tolerance
        )


SAVE_LOAD_EXAMPLES = given(
    architecture=st.sampled_from(sorted(ARCHITECTURES)),
    a=st.integers(1, 5),
    b=st.integers(1, 5),
    size=st.integers(1, 5),
    dtype=st.sampled_from(sorted(DTYPES)),
    optimizer=st.sampled_from(sorted(SAVE_OPTIMIZERS)),
    like_from_eval_shape=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)


@settings(max_examples=8, deadline=None)
@SAVE_LOAD_EXAMPLES
def test_random_ensembles_round_trip_across_modules(**example):
    _round_trip_across_modules(**example)


@pytest.mark.slow
@settings(max_examples=150, deadline=None)
@SAVE_LOAD_EXAMPLES
def test_random_ensembles_round_trip_across_modules_many(**example):
    _round_trip_across_modules(**example)


# ---- fit + checkpoint + resume == uninterrupted ----------------------------------

RESUME_OPTIMIZERS = {
    "adam": optax.adam(1e-2),
    "clip-sgd-momentum": optax.chain(
        optax.clip_by_global_norm(0.5), optax.sgd(5e-2, momentum=0.9)
    ),
    "inject-adam": optax.inject_hyperparams(optax.adam)(learning_rate=1e-2),
}
RESUME_X = jax.random.normal(jax.random.key(20), (12, 2))
RESUME_Y = jnp.cos(RESUME_X[:, :1]) + RESUME_X[:, 1:]


def _noisy_loss(model, batch, key):
    # Uses its key (input dropout), so an exact resume needs the same random stream.
    xb, yb = batch
    keep = jax.random.bernoulli(key, 0.8, xb.shape).astype(xb.dtype)
    return jnp.mean((jax.vmap(model)(xb * keep) - yb) ** 2)


def _distance_score(model, data, key):
    # Not monotone in training time, so the best evaluation is not just the last.
    xe, ye = data
    return jnp.abs(jnp.mean((jax.vmap(model)(xe) - ye) ** 2) - 0.5)


def _resume_fit(ens, optimizer, size, eval_every, **kwargs):
    hyperparams = None
    if optimizer == "inject-adam":
        hyperparams = {"learning_rate": jnp.linspace(1e-3, 3e-2, size)}
    if eval_every is not None:
        kwargs.update(
            evaluate=ee.Evaluate(
                _distance_score, (RESUME_X, RESUME_Y), every=eval_every
            )
        )
    return ee.fit(
        ens,
        _noisy_loss,
        RESUME_OPTIMIZERS[optimizer],
        (RESUME_X, RESUME_Y),
        key=jax.random.key(21),
        **{"callbacks": (), **kwargs},
        opt_state=ee.init_optimizer(
            RESUME_OPTIMIZERS[optimizer], ens, hyperparams=hyperparams
        ),
    )


def assert_same_result(got, want):
    """Two `FitResult`s equal bit for bit: parameters, states, history, best."""
    assert got.step == want.step
    assert got.diverged == want.diverged
    assert_bitwise_equal(got.ensemble, want.ensemble)
    assert_bitwise_equal(got.opt_state, want.opt_state)
    assert_bitwise_equal(got.state, want.state)
    np.testing.assert_array_equal(got.history.losses, want.history.losses)
    np.testing.assert_array_equal(got.history.eval_steps, want.history.eval_steps)
    np.testing.assert_array_equal(got.history.eval_scores, want.history.eval_scores)
    assert_bitwise_equal(got.best_ensemble, want.best_ensemble)
    np.testing.assert_array_equal(got.best_step, want.best_step)


def interrupted_then_resumed(fit, folder, stop, every, steps, **resume_kwargs):
    """Run `fit` with checkpoints until a callback raises at step >= `stop`, check
    that every checkpoint period reached was saved, then resume in a new call
    (with `resume_kwargs` changed: what may differ between sessions)."""
    seen = []

    def interrupt(result):
        seen.append(result.step)
        if result.step >= stop:
            raise Interrupt

    try:
        fit(
            checkpoints=ee.Checkpoints(folder, every=every, keep=None),
            callbacks=[interrupt],
        )
    except Interrupt:
        pass
    reached = seen[-1]
    expected = list(range(every, reached + 1, every))
    if reached == steps and steps % every:  # finished: a last one at the end
        expected.append(steps)
    assert [step for step, _ in ee.list_checkpoints(folder)] == expected
    resume_every = resume_kwargs.pop("checkpoint_every", every)
    return fit(checkpoints=ee.Checkpoints(folder, every=resume_every), **resume_kwargs)


FIT_RESUME_EXAMPLES = given(
    size=st.integers(1, 4),
    width=st.integers(1, 6),
    sampling=st.sampled_from(["shared", "independent", "bootstrap"]),
    optimizer=st.sampled_from(sorted(RESUME_OPTIMIZERS)),
    steps=st.integers(3, 12),
    batch_size=st.integers(1, 12),
    evaluate=st.booleans(),
    plan=st.data(),
)


def _fit_resume_equals_uninterrupted(
    size, width, sampling, optimizer, steps, batch_size, evaluate, plan
):
    every = plan.draw(st.integers(1, steps - 1), label="checkpoint_every")
    stop = plan.draw(st.integers(1, steps - 1), label="interrupt at")
    per_dispatch = plan.draw(st.integers(1, steps), label="steps_per_dispatch")
    eval_every = plan.draw(st.integers(1, 3), label="eval_every") if evaluate else None
    # Dispatch and checkpoint periods may change between sessions (not the run).
    resume_every = plan.draw(st.integers(1, steps), label="resumed checkpoint_every")
    resume_per_dispatch = plan.draw(
        st.sampled_from([per_dispatch, steps]), label="resumed steps_per_dispatch"
    )
    ens = ee.ensemble(
        lambda key: eqx.nn.MLP(2, 1, width, 1, key=key),
        size=size,
        key=jax.random.key(3),
    )
    fit = functools.partial(
        _resume_fit,
        ens,
        optimizer,
        size,
        eval_every,
        steps=steps,
        batch_size=batch_size,
        sampling=sampling,
        execution=ee.Execution(steps_per_dispatch=per_dispatch),
    )
    straight = fit()
    with tempfile.TemporaryDirectory() as directory:
        resumed = interrupted_then_resumed(
            fit,
            Path(directory) / "run",
            stop,
            every,
            steps,
            checkpoint_every=resume_every,
            execution=ee.Execution(steps_per_dispatch=resume_per_dispatch),
        )
    assert_same_result(resumed, straight)


def test_full_and_partial_dispatches_resume_bitwise(tmp_path):
    # Found by the random test below in CI: the uninterrupted run dispatches two
    # full chunks of 2 steps, the interrupted and resumed one 1-step dispatches
    # (checkpoints every step) inside chunks of 2 and 4. Compiling full chunks
    # without the per-step conditional made them a different program, one ulp off.
    ens = ee.ensemble(
        lambda key: eqx.nn.MLP(2, 1, 2, 1, key=key), size=2, key=jax.random.key(3)
    )
    fit = functools.partial(
        _resume_fit, ens, "adam", 2, None, steps=4, batch_size=9,
        sampling="shared", execution=ee.Execution(steps_per_dispatch=2),
    )  # fmt: skip
    straight = fit()
    resumed = interrupted_then_resumed(
        fit,
        tmp_path / "run",
        1,
        1,
        4,
        checkpoint_every=1,
        execution=ee.Execution(steps_per_dispatch=4),
    )
    assert_same_result(resumed, straight)


@pytest.mark.usefixtures("library_codegen")  # level 1, as users compile it
def test_unrolled_dispatches_resume_bitwise(tmp_path):
    ens = ee.ensemble(
        lambda key: eqx.nn.MLP(2, 1, 2, 1, key=key), size=2, key=jax.random.key(3)
    )
    fit = functools.partial(
        _resume_fit, ens, "clip-sgd-momentum", 2, None, steps=6, batch_size=9,
        sampling="shared",
        execution=ee.Execution(steps_per_dispatch=4, unroll=True),
    )  # fmt: skip
    straight = fit()
    resumed = interrupted_then_resumed(
        fit,
        tmp_path / "run",
        1,
        1,
        6,
        checkpoint_every=1,
        execution=ee.Execution(steps_per_dispatch=2),
    )
    assert_same_result(resumed, straight)


@settings(max_examples=2, deadline=None)
@FIT_RESUME_EXAMPLES
def test_random_fit_interrupted_and_resumed_equals_uninterrupted(**example):
    _fit_resume_equals_uninterrupted(**example)


@pytest.mark.slow
@settings(max_examples=30, deadline=None)
@FIT_RESUME_EXAMPLES
def test_random_fit_interrupted_and_resumed_equals_uninterrupted_many(**example):
    _fit_resume_equals_uninterrupted(**example)


class _DropoutBatchNormMLP(eqx.Module):
    hidden: eqx.nn.Linear
    norm: eqx.nn.BatchNorm
    dropout: eqx.nn.Dropout
    out: eqx.nn.Linear

    def __init__(self, key):
        hidden_key, out_key = jax.random.split(key)
        self.hidden = eqx.nn.Linear(2, 8, use_bias=False, key=hidden_key)
        self.norm = eqx.nn.BatchNorm(8, axis_name="batch", mode="ema")
        self.dropout = eqx.nn.Dropout(0.2)
        self.out = eqx.nn.Linear(8, 1, key=out_key)

    def __call__(self, x, state, key, inference=False):
        hidden, state = self.norm(self.hidden(x), state, inference=inference)
        hidden = self.dropout(jax.nn.relu(hidden), key=key, inference=inference)
        return self.out(hidden), state


def _stateful_loss(model, state, batch, key):
    xb, yb = batch
    keys = jax.random.split(key, xb.shape[0])
    pred, state = jax.vmap(
        model, axis_name="batch", in_axes=(0, None, 0), out_axes=(0, None)
    )(xb, state, keys)
    return jnp.mean((pred - yb) ** 2), state


def _stateful_score(model, state, data, key):
    # Lower is better: minus the error, so every member's best is an early
    # evaluation, made before the interrupt, that must survive the resume.
    xe, ye = data
    pred, _ = jax.vmap(
        lambda x: model(x, state, None, inference=True), axis_name="batch"
    )(xe)
    return -jnp.mean((pred - ye) ** 2)


def test_batchnorm_dropout_and_best_members_resume_exactly(tmp_path):
    # Model state (BatchNorm statistics), per-member dropout keys, the best members
    # of an evaluation and its history all continue exactly after an interrupt.
    make = eqx.nn.make_with_state(_DropoutBatchNormMLP)
    models, states = eqx.filter_vmap(make)(jax.random.split(jax.random.key(4), 3))
    fit = functools.partial(
        ee.fit,
        ee.Ensemble(models),
        _stateful_loss,
        RESUME_OPTIMIZERS["adam"],
        (RESUME_X, RESUME_Y),
        steps=12,
        batch_size=4,
        key=jax.random.key(5),
        sampling="independent",
        state=states,
        evaluate=ee.Evaluate(_stateful_score, (RESUME_X, RESUME_Y), every=2),
        callbacks=(),
        execution=ee.Execution(steps_per_dispatch=3),
    )
    straight = fit()
    # The member state really is carried: it changed during training.
    assert not tree_equal(straight.state, states)
    assert (straight.best_step < 6).all(), straight.best_step
    resumed = interrupted_then_resumed(fit, tmp_path / "run", stop=7, every=3, steps=12)
    assert_same_result(resumed, straight)


@pytest.mark.slow
def test_resume_on_another_device_count_and_mesh(tmp_path):
    # A run checkpointed on a 2 x 2 mesh resumes on one device, and a one-device
    # run resumes on a 4-device member mesh; both equal the one-device run (up to
    # the reassociation of sums split over the data axis) and land where asked.
    ens = ee.ensemble(make_mlp, size=SIZE, key=jax.random.key(0))
    fit = functools.partial(
        ee.fit,
        ens,
        bounded_loss,
        ADAM,
        (X, Y),
        steps=12,
        batch_size=BATCH,
        key=FIT_KEY,
        sampling="bootstrap",
        callbacks=(),
        execution=ee.Execution(steps_per_dispatch=PER_DISPATCH),
    )
    single = fit()
    grid = ee.make_mesh(members=2, data=2)
    members_only = ee.make_mesh(members=4)
    cases = [(grid, None), (None, members_only)]
    for index, (first, second) in enumerate(cases):
        folder = tmp_path / f"run{index}"
        with pytest.raises(Interrupt):
            fit(
                checkpoints=ee.Checkpoints(folder, every=4),
                callbacks=[
                    lambda result: _raise_if(result.step >= 8),
                ],
                execution=ee.Execution(mesh=first),
            )
        resumed = fit(
            checkpoints=ee.Checkpoints(folder, every=4),
            execution=ee.Execution(mesh=second),
        )
        assert resumed.step == 12 and resumed.diverged == {}
        for got, want in zip(
            jax.tree.leaves(eqx.filter(resumed.ensemble, eqx.is_array)),
            jax.tree.leaves(eqx.filter(single.ensemble, eqx.is_array)),
            strict=True,
        ):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
            if second is None:
                assert len(got.sharding.device_set) == 1
            else:
                assert got.sharding.mesh.shape == second.shape


def _raise_if(condition):
    if condition:
        raise Interrupt


def test_small_misuses_are_named():
    with pytest.raises(TypeError, match="num_classes"):
        ee.combine.majority_vote(jnp.zeros((2, 3), jnp.int32), num_classes=2.5)
    with pytest.raises(TypeError, match="takes a list .* got str"):
        ee.stack("ab")
    key = jax.random.key(0)
    with pytest.raises(TypeError, match="PRNG key array"):
        ee.tree_weighted_sum([{"k": key}, {"k": key}], jnp.array([0.5, 0.5]))
    with pytest.raises(ValueError, match="`num_examples` must be at least 1"):
        ee.process_rows(ee.make_mesh(members=1), 0)
