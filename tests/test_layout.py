"""The member layout of a step (`layout=`): vectorised or member by member.

`"sequential"` must compute what `"vmap"` computes (to float32 rounding) and what
each member computes alone; the automatic rule must pick it for a convolving
loss on one CPU device (seen in the compiled HLO: no grouped convolution) and
nowhere else; bad values and a mesh are refused by name.
"""

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest
from conftest import (
    MEMBERWISE_TOL,
    ON_CPU,
    assert_tree_allclose,
    needs_devices,
    repeat,
)

import eqx_ensemble as ee
from eqx_ensemble._execution import layout as _layout
from eqx_ensemble._execution.layout import (
    GPU_SEQUENTIAL_MIN_FLOPS,
    GPU_SEQUENTIAL_MIN_RUN_FLOPS,
    SEQUENTIAL_MAX_MEMBERS,
    SEQUENTIAL_MIN_RUN_FLOPS,
    choose_layout,
    choose_map_layout,
    run_length_class,
)
from eqx_ensemble._execution.profile import profile_call

SIZE = 3
SIZE_GROUP = str(SIZE)  # a grouped convolution's `feature_group_count`


class CNN(eqx.Module):
    conv1: eqx.nn.Conv2d
    norm: eqx.nn.BatchNorm | None
    conv2: eqx.nn.Conv2d
    out: eqx.nn.Linear

    def __init__(self, key, norm=False):
        k1, k2, k3 = jax.random.split(key, 3)
        # No bias before BatchNorm: its gradient is rounding noise, which Adam
        # would amplify into different updates under different layouts.
        self.conv1 = eqx.nn.Conv2d(1, 2, 3, padding=1, use_bias=not norm, key=k1)
        self.norm = (
            eqx.nn.BatchNorm(2, axis_name="batch", mode="batch") if norm else None
        )
        # Its input differs per member: vectorised, a grouped convolution.
        self.conv2 = eqx.nn.Conv2d(2, 2, 3, padding=1, key=k2)
        self.out = eqx.nn.Linear(2 * 4 * 4, 3, key=k3)

    def __call__(self, x, state=None):
        h = self.conv1(x)
        if self.norm is not None:
            h, state = self.norm(h, state)
        h = self.conv2(jax.nn.relu(h))
        logits = self.out(jax.nn.relu(h).reshape(-1))
        return logits if self.norm is None else (logits, state)


def xent(logits, y):
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], 1))


def loss_fn(model, batch, key):
    x, y = batch
    return xent(jax.vmap(model)(x), y)


def stateful_loss(model, state, batch, key):
    x, y = batch
    logits, state = jax.vmap(
        model, axis_name="batch", in_axes=(0, None), out_axes=(0, None)
    )(x, state)
    return xent(logits, y), state


@pytest.fixture
def data():
    key = jax.random.key(1)
    x = jax.random.normal(key, (32, 1, 4, 4))
    y = jax.random.randint(jax.random.fold_in(key, 1), (32,), 0, 3)
    return x, y


def test_sequential_step_equals_vmap_and_members_alone(data):
    ens = ee.ensemble(CNN, size=SIZE, key=jax.random.key(0))
    opt = optax.adam(1e-2)
    opt_state = ee.init_optimizer(opt, ens)
    batch = (data[0][:8], data[1][:8])
    key = jax.random.key(2)
    vmapped = ee.make_step(loss_fn, opt, execution=ee.Execution(layout="vmap"))(
        ens, opt_state, batch, key
    )
    sequential = ee.make_step(
        loss_fn, opt, execution=ee.Execution(layout="sequential")
    )(ens, opt_state, batch, key)
    assert_tree_allclose(sequential.ensemble, vmapped.ensemble, **MEMBERWISE_TOL)
    assert_tree_allclose(sequential.opt_state, vmapped.opt_state, **MEMBERWISE_TOL)
    assert_tree_allclose(sequential.losses, vmapped.losses, **MEMBERWISE_TOL)
    # Each member as if alone: a plain step of member i.
    grad_of = eqx.filter_jit(eqx.filter_grad(loss_fn))
    for i, member in enumerate(ee.unstack(ens)):
        grads = grad_of(member, batch, None)
        member_state = opt.init(eqx.filter(member, eqx.is_inexact_array))
        with jax.numpy_dtype_promotion("standard"):  # optax's bias correction
            updates, _ = opt.update(grads, member_state)
        alone = eqx.apply_updates(member, updates)
        assert_tree_allclose(sequential.ensemble[i], alone, **MEMBERWISE_TOL)


cpu_only = pytest.mark.skipif(not ON_CPU, reason="the automatic rule is a CPU rule")


@cpu_only
def test_auto_layout_runs_members_one_by_one_for_convolutions(data):
    ens = ee.ensemble(CNN, size=SIZE, key=jax.random.key(0))
    opt = optax.sgd(0.1)
    args = (ens, ee.init_optimizer(opt, ens), (data[0][:8], data[1][:8]))
    auto = ee.make_step(loss_fn, opt).lower(*args, jax.random.key(0)).as_text()
    vmap = (
        ee.make_step(loss_fn, opt, execution=ee.Execution(layout="vmap"))
        .lower(*args, jax.random.key(0))
        .as_text()
    )
    # Vectorised: the member axis becomes a grouped convolution.
    assert re.search(rf"(feature|batch)_group_count = {SIZE} ", vmap)
    # Auto, on a CPU: each member's own plain convolutions.
    groups = re.findall(r"(?:feature|batch)_group_count = (\d+) ", auto)
    assert groups and set(groups) == {"1"}
    assert auto.count("stablehlo.convolution") >= 3 * SIZE


@cpu_only
def test_rule():
    assert (
        choose_layout("auto", convolutions=True, size=4, sharded=False) == "sequential"
    )
    assert choose_layout("auto", convolutions=False, size=4, sharded=False) == "vmap"
    big = SEQUENTIAL_MAX_MEMBERS + 1
    assert choose_layout("auto", convolutions=True, size=big, sharded=False) == "vmap"
    assert choose_layout("vmap", convolutions=True, size=4, sharded=False) == "vmap"
    assert (
        choose_layout("sequential", convolutions=False, size=64, sharded=False)
        == "sequential"
    )


@cpu_only
def test_rule_for_a_run_weighs_its_convolutions():
    """A run of `fit` goes member by member once its forward convolutions add
    up to `SEQUENTIAL_MIN_RUN_FLOPS` (steps rounded down to a power of two)."""

    def rule(steps, flops, size=5):
        return choose_layout(
            "auto", convolutions=True, size=size, sharded=False, steps=steps,
            convolution_flops=flops,
        )  # fmt: skip

    small, large = 78e6, 311e6  # 8x8 and 16x16 CNNs, batch 128, per member
    assert [run_length_class(s) for s in (1, 2, 3, 511, 512, 1000)] == [
        1, 2, 2, 256, 512, 512,
    ]  # fmt: skip
    # 5 small CNNs: even at about 385 steps; 511 steps count as 256.
    assert rule(511, small) == "vmap" and rule(512, small) == "sequential"
    assert SEQUENTIAL_MIN_RUN_FLOPS <= 512 * 5 * small
    assert 256 * 5 * small < SEQUENTIAL_MIN_RUN_FLOPS
    # 8 larger CNNs: from 64 steps.
    assert rule(63, large, 8) == "vmap" and rule(64, large, 8) == "sequential"
    # No convolutions counted: never, however long the run.
    assert rule(10**9, 0.0) == "vmap"


def test_rule_on_a_gpu():
    """On a GPU a run of `fit` goes member by member only for large
    convolutions (per member and step) over a long run; `make_step` (no
    `steps`), a mesh, many members or a loss without convolutions: never."""

    def rule(
        steps,
        flops,
        size=8,
        sharded=False,
        convolutions=True,
        layout="auto",
        platform="gpu",
    ):
        return choose_layout(
            layout, convolutions=convolutions, size=size, sharded=sharded, steps=steps,
            convolution_flops=flops, platform=platform,
        )  # fmt: skip

    # Per member and step, batch 128 (session 21's sweep on an H100): a 32x32
    # CNN with 1 input channel (1.25 GFLOP; sequential 1.61x faster there) and
    # a 24x24 one (0.70 GFLOP; vectorised faster).
    cnn32, cnn24 = 1.246e9, 0.701e9
    assert cnn24 < GPU_SEQUENTIAL_MIN_FLOPS <= cnn32
    # 8 members: 8,192 steps are enough, 8,191 count as 4,096 and are not.
    assert 4096 * 8 * cnn32 < GPU_SEQUENTIAL_MIN_RUN_FLOPS <= 8192 * 8 * cnn32
    assert rule(8192, cnn32) == "sequential" and rule(8191, cnn32) == "vmap"
    assert rule(10**9, cnn24) == "vmap"  # small convolutions: never
    assert rule(None, cnn32 * 100) == "vmap"  # make_step
    assert rule(10**9, cnn32, size=SEQUENTIAL_MAX_MEMBERS + 1) == "vmap"
    assert rule(10**9, cnn32, convolutions=False) == "vmap"
    assert rule(10**9, cnn32, sharded=True) == "vmap"
    # The user's choice stands; another platform (a TPU) stays vectorised.
    for layout in ("vmap", "sequential"):
        assert rule(10**9, cnn32, layout=layout) == layout
    assert rule(10**9, cnn32, platform="tpu") == "vmap"


@pytest.mark.parametrize("sampling", [repeat("shared"), "bootstrap"])
def test_fit_sequential_equals_vmap_with_batchnorm(data, sampling):
    ens, state = ee.ensemble(
        lambda k: eqx.nn.make_with_state(CNN)(k, norm=True),
        size=SIZE,
        key=jax.random.key(0),
    )
    results = {
        layout: ee.fit(
            ens,
            stateful_loss,
            optax.adam(1e-2),
            data,
            steps=3,
            batch_size=8,
            key=jax.random.key(3),
            sampling=sampling,
            state=state,
            callbacks=(),
            execution=ee.Execution(steps_per_dispatch=1, layout=layout),
        )
        for layout in ("vmap", "sequential")
    }
    assert_tree_allclose(
        results["sequential"].ensemble, results["vmap"].ensemble, rtol=1e-4, atol=1e-5
    )
    assert_tree_allclose(
        results["sequential"].state, results["vmap"].state, rtol=1e-4, atol=1e-5
    )
    assert_tree_allclose(
        results["sequential"].history.losses,
        results["vmap"].history.losses,
        rtol=1e-4,
        atol=1e-5,
    )


@needs_devices(2)
def test_bad_layout_is_refused(data):
    opt = optax.sgd(0.1)
    with pytest.raises(
        ValueError, match=r"`Execution.layout` must be one of .*'columns'"
    ):
        ee.make_step(loss_fn, opt, execution=ee.Execution(layout="columns"))
    ens = ee.ensemble(CNN, size=4, key=jax.random.key(0))
    mesh = ee.make_mesh(members=2)
    with pytest.raises(ValueError, match="layout='sequential'.*mesh"):
        ee.make_step(
            loss_fn, opt, execution=ee.Execution(layout="sequential", mesh=mesh)
        )
    with pytest.raises(ValueError, match="layout='sequential'.*mesh"):
        ee.fit(
            ens,
            loss_fn,
            opt,
            data,
            steps=1,
            batch_size=8,
            key=jax.random.key(0),
            callbacks=(),
            execution=ee.Execution(layout="sequential", mesh=mesh),
        )


# -- `ee.map`, `ee.predict` and in-loop evaluation --------------------------------


def _convolutions(jaxpr_text):
    """The `feature_group_count`s of the convolutions in a jaxpr's text."""
    return re.findall(
        r"conv_general_dilated\[[^\]]*?feature_group_count=(\d+)", jaxpr_text
    )


def test_map_sequential_equals_vmap_and_members_alone(data):
    ens = ee.ensemble(CNN, size=SIZE, key=jax.random.key(0))
    x = data[0][:6]
    scale = jnp.arange(1.0, SIZE + 1.0)  # per member
    key = jax.random.key(5)

    def fn(member, x, extra, *, key):
        noise = jax.random.normal(key, (3,))
        return jax.vmap(member)(x) * extra["scale"] + noise[None], extra["offset"]

    extra = {"scale": scale, "offset": jnp.ones(2)}
    in_axes = ({"scale": 0, "offset": None},)
    outs = {
        layout: ee.map(
            lambda m, extra, *, key: fn(m, x, extra, key=key),
            ens,
            extra,
            in_axes=in_axes,
            key=key,
            execution=ee.Execution(layout=layout),
        )
        for layout in ("vmap", "sequential")
    }
    assert_tree_allclose(outs["sequential"], outs["vmap"], rtol=1e-5, atol=1e-6)
    member_keys = jax.random.split(key, SIZE)
    for i in range(SIZE):
        alone = fn(
            ens[i], x, {"scale": scale[i], "offset": jnp.ones(2)}, key=member_keys[i]
        )
        got = jax.tree.map(lambda leaf, i=i: leaf[i], outs["sequential"])
        assert_tree_allclose(got, alone, rtol=1e-5, atol=1e-6)


@cpu_only
def test_predict_auto_layout_runs_convolving_members_one_by_one(data, monkeypatch):
    ens = ee.ensemble(CNN, size=SIZE, key=jax.random.key(0))
    x = data[0][:6]

    def traced(**kwargs):
        jaxpr, _, _ = eqx.filter_make_jaxpr(
            lambda ens, x: ee.predict(ens, x, **kwargs)
        )(ens, x)
        return _convolutions(str(jaxpr))

    # The tests run 8 virtual devices, where traced arrays may be spread over
    # several: the rule applies to a process with one device.
    assert SIZE_GROUP in traced()
    monkeypatch.setattr(jax, "device_count", lambda *_: 1)
    assert traced() == ["1"] * (2 * SIZE)  # each member's own two convolutions
    assert SIZE_GROUP in traced(
        execution=ee.Execution(layout="vmap")
    )  # the grouped convolution
    # Called with concrete arrays, `predict` is one compiled program too: the
    # rule of a compiled map, whatever the convolutions' size.
    concrete = str(jax.make_jaxpr(lambda: ee.predict(ens, x))())
    assert _convolutions(concrete) == ["1"] * (2 * SIZE)

    # `ee.map` runs eagerly, member by member only from
    # EAGER_SEQUENTIAL_MIN_FLOPS of convolutions per member (each operation
    # then dispatched per member; these tiny members convolve ~10 kFLOP).
    def eager():
        mapped = jax.make_jaxpr(lambda: ee.map(lambda m, xs: jax.vmap(m)(xs), ens, x))
        return _convolutions(str(mapped()))

    assert SIZE_GROUP in eager()
    monkeypatch.setattr(_layout, "EAGER_SEQUENTIAL_MIN_FLOPS", 0.0)
    assert eager() == ["1"] * (2 * SIZE)
    assert_tree_allclose(
        ee.predict(ens, x),
        ee.predict(ens, x, execution=ee.Execution(layout="vmap")),
        rtol=1e-5,
        atol=1e-6,
    )
    for i in range(SIZE):
        assert_tree_allclose(
            ee.predict(ens, x)[i], jax.vmap(ens[i])(x), rtol=1e-5, atol=1e-6
        )


def test_convolution_flops_and_map_rule():
    kernel = jnp.ones((32, 16, 3, 3))
    x = jnp.ones((128, 16, 8, 8))
    profile = profile_call(
        lambda x, w: jax.lax.conv_general_dilated(x, w, (1, 1), "SAME"), (x, kernel)
    )
    # Closed form: 2 x outputs (128 x 32 x 8 x 8) x window (16 x 3 x 3).
    assert profile.convolution_flops == 2 * 128 * 32 * 64 * 16 * 9
    grouped = profile_call(
        lambda x, w: jax.lax.conv_general_dilated(
            x, w, (1, 1), "SAME", feature_group_count=4
        ),
        (x, jnp.ones((32, 4, 3, 3))),
    )
    assert grouped.convolution_flops == 2 * 128 * 32 * 64 * 4 * 9
    big = _layout.EAGER_SEQUENTIAL_MIN_FLOPS
    assert choose_map_layout(0.0, traced=True, size=4) == "vmap"
    assert choose_map_layout(1.0, traced=True, size=4) == "sequential"
    assert choose_map_layout(big / 2, traced=False, size=4) == "vmap"
    assert choose_map_layout(big, traced=False, size=4) == "sequential"
    too_many = SEQUENTIAL_MAX_MEMBERS + 1
    assert choose_map_layout(big, traced=True, size=too_many) == "vmap"


@cpu_only
def test_predict_sequential_with_state_equals_vmap(data):
    ens, state = ee.ensemble(
        lambda k: eqx.nn.make_with_state(CNN)(k, norm=True),
        size=SIZE,
        key=jax.random.key(0),
    )
    x = data[0][:6]
    assert_tree_allclose(
        ee.predict(ens, x, state=state, execution=ee.Execution(layout="sequential")),
        ee.predict(ens, x, state=state, execution=ee.Execution(layout="vmap")),
        rtol=1e-5,
        atol=1e-6,
    )


@cpu_only
def test_map_auto_rule(data, monkeypatch):
    monkeypatch.setattr(_layout, "EAGER_SEQUENTIAL_MIN_FLOPS", 0.0)
    cnn = ee.ensemble(CNN, size=SIZE, key=jax.random.key(0))
    mlp = ee.ensemble(
        lambda k: eqx.nn.MLP(16, 3, 8, 1, key=k), size=SIZE, key=jax.random.key(0)
    )
    x = data[0][:4]

    def forward(m):
        return jax.vmap(m)(x)

    def groups(ens, **kwargs):
        return _convolutions(
            str(jax.make_jaxpr(lambda: ee.map(forward, ens, **kwargs))())
        )

    assert groups(cnn) == ["1"] * (2 * SIZE)
    # Chunks ask for the vectorised layout; so does a big ensemble.
    assert "2" in groups(cnn, chunk_size=2)  # two members vectorised per chunk
    big = ee.ensemble(CNN, size=SEQUENTIAL_MAX_MEMBERS + 1, key=jax.random.key(0))
    assert str(SEQUENTIAL_MAX_MEMBERS + 1) in groups(big)
    # Nothing convolves: vectorised (one batched matmul per layer, no copies).
    flat = x.reshape(4, 16)
    jaxpr = str(jax.make_jaxpr(lambda: ee.map(lambda m: jax.vmap(m)(flat), mlp))())
    assert jaxpr.count("dot_general") == 2


@cpu_only
def test_map_profile_is_traced_once_and_not_kept_alive(data):
    import gc
    import weakref

    ens = ee.ensemble(CNN, size=SIZE, key=jax.random.key(0))
    x = data[0][:4]
    traces = []

    def forward(m):
        traces.append(1)
        return jax.vmap(m)(x)

    ee.map(forward, ens)
    first = len(traces)  # the profile's trace, then the members' calls
    ee.map(forward, ens)
    assert len(traces) == 2 * first - 1  # the profile is read from the cache
    ref = weakref.ref(forward)
    del forward
    gc.collect()
    assert ref() is None  # the cache holds its owner weakly


def test_evaluate_sequential_equals_vmap_without_grouped_convolutions(data):
    ens = ee.ensemble(CNN, size=SIZE, key=jax.random.key(0))
    evaluate = ee.Evaluate(loss_fn, (data[0][:8], data[1][:8]), every=1)
    keys = jax.random.split(jax.random.key(0), SIZE)
    scores = {
        layout: evaluate.scores(ens, None, keys, layout)
        for layout in ("vmap", "sequential")
    }
    assert_tree_allclose(scores["sequential"], scores["vmap"], rtol=1e-5, atol=1e-6)
    jaxpr = str(
        jax.make_jaxpr(lambda: evaluate.scores(ens, None, keys, "sequential"))()
    )
    assert _convolutions(jaxpr) == ["1"] * (2 * SIZE)
    # In `fit`, evaluation follows the step's layout.
    results = {
        layout: ee.fit(
            ens,
            loss_fn,
            optax.sgd(0.1),
            data,
            steps=2,
            batch_size=8,
            key=jax.random.key(3),
            evaluate=evaluate,
            callbacks=(),
            execution=ee.Execution(steps_per_dispatch=1, layout=layout),
        )
        for layout in ("vmap", "sequential")
    }
    assert_tree_allclose(
        results["sequential"].history.eval_scores,
        results["vmap"].history.eval_scores,
        rtol=1e-5,
        atol=1e-6,
    )


def test_map_bad_layout_is_refused(data):
    ens = ee.ensemble(CNN, size=SIZE, key=jax.random.key(0))
    with pytest.raises(ValueError, match=r"`Execution.layout` must be one of .*'rows'"):
        ee.map(lambda m: m(data[0][0]), ens, execution=ee.Execution(layout="rows"))
    with pytest.raises(ValueError, match="one member at a time.*chunk_size"):
        ee.map(
            lambda m: m(data[0][0]),
            ens,
            chunk_size=1,
            execution=ee.Execution(layout="sequential"),
        )


class Counted(eqx.Module):
    """A model whose loss updates its state directly (`state.set` on the state it
    was given, which invalidates that object, as plain Equinox does)."""

    linear: eqx.nn.Linear
    count: eqx.nn.StateIndex

    def __init__(self, key):
        self.linear = eqx.nn.Linear(16, 3, key=key)
        self.count = eqx.nn.StateIndex(jnp.zeros(()))


def counting_loss(model, state, batch, key):
    x, y = batch
    state = state.set(model.count, state.get(model.count) + 1.0)
    logits = jax.vmap(model.linear)(x.reshape(x.shape[0], -1))
    return xent(logits, y), state, {"seen": jnp.float32(1.0), "label": 3}


@pytest.mark.parametrize("layout", ["vmap", "sequential"])
def test_loss_that_sets_its_input_state(data, layout):
    # The sequential layout traces a member's step twice (its shapes, then the
    # step under a conditional): each trace must get its own state object.
    ens, state = ee.ensemble(
        eqx.nn.make_with_state(Counted), size=SIZE, key=jax.random.key(0)
    )
    result = ee.fit(
        ens,
        counting_loss,
        optax.sgd(0.1),
        data,
        steps=4,
        batch_size=8,
        key=jax.random.key(3),
        state=state,
        callbacks=(),
        execution=ee.Execution(steps_per_dispatch=2, layout=layout),
    )
    # Every member counted each of its 4 steps (the Python aux passed through).
    leaves = jax.tree.leaves(result.state)
    assert len(leaves) == 1
    assert jnp.array_equal(leaves[0], jnp.full((SIZE,), 4.0))
