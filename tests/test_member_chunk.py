"""`Execution(member_chunk=k)`: k members at a time inside the compiled step,
equal to the unchunked run (to rounding) for fit, make_step, map and predict,
with BatchNorm state and per-member keys; bad input named."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import MEMBERWISE_TOL, ON_CPU, needs_devices, repeat

import eqx_ensemble as ee
from eqx_ensemble._training.placement import SINGLE_DEVICE

SIZE = 8


class Net(eqx.Module):
    """Dropout (per-member keys) and BatchNorm (per-member state)."""

    first: eqx.nn.Linear
    norm: eqx.nn.BatchNorm
    dropout: eqx.nn.Dropout
    last: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.first = eqx.nn.Linear(3, 16, key=k1)
        self.norm = eqx.nn.BatchNorm(16, axis_name="batch", mode="batch")
        self.dropout = eqx.nn.Dropout(0.2)
        self.last = eqx.nn.Linear(16, 1, key=k2)

    def __call__(self, x, state, *, key=None):
        h = jax.nn.relu(self.first(x))
        h, state = self.norm(h, state)
        h = self.dropout(h, key=key, inference=key is None)
        return self.last(h), state


def loss(model, state, batch, key):
    xs, ys = batch
    keys = jax.random.split(key, xs.shape[0])
    out, state = jax.vmap(
        lambda xi, ki: model(xi, state, key=ki), axis_name="batch", out_axes=(0, None)
    )(xs, keys)
    return jnp.mean((out[:, 0] - ys) ** 2), state


@pytest.fixture(scope="module")
def problem():
    ens, state = ee.ensemble(
        lambda k: eqx.nn.make_with_state(Net)(k), size=SIZE, key=jax.random.key(0)
    )
    x = jax.random.normal(jax.random.key(1), (64, 3))
    y = jnp.sin(x[:, 0])
    return ens, state, (x, y)


def _close(a, b, atol=1e-6):
    # Off the CPU a chunk's kernels round differently (up to 8e-5 relative on
    # an H100 at the highest matmul precision, session 21).
    rtol = 1e-5 if ON_CPU else MEMBERWISE_TOL["rtol"]
    atol = atol if ON_CPU else max(atol, MEMBERWISE_TOL["atol"])
    a, b = eqx.filter(a, eqx.is_array), eqx.filter(b, eqx.is_array)
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        # A chunk is another program: float32 rounding of 30 steps, measured
        # at up to 2.6e-6 of a leaf's largest entry on an AVX2-only CPU (a
        # weight near 0.02 in a leaf of scale 0.5), so small entries are
        # compared at their leaf's scale too. A wrong batch, key or member
        # differs by 1e-2 and more.
        scale = float(np.max(np.abs(np.asarray(v)), initial=0.0))
        np.testing.assert_allclose(u, v, rtol=rtol, atol=max(atol, 1e-5 * scale))


@pytest.mark.parametrize("chunk", [1, 2, repeat(4)])
def test_fit_equals_the_unchunked_run(problem, chunk):
    ens, state, data = problem

    def run(execution):
        # SGD: Adam's normalised steps turn rounding in near-zero gradients
        # into steps of the learning rate's size.
        return ee.fit(
            ens, loss, optax.sgd(0.05), data, steps=30, batch_size=16,
            key=jax.random.key(2), state=state, sampling="independent",
            callbacks=(), execution=execution,
            evaluate=ee.Evaluate(loss, data, every=10),
        )  # fmt: skip

    plain, chunked = run(None), run(ee.Execution(member_chunk=chunk))
    _close(chunked.ensemble, plain.ensemble)
    _close(chunked.state, plain.state)
    _close(chunked.opt_state, plain.opt_state)
    rtol = 1e-5 if ON_CPU else MEMBERWISE_TOL["rtol"]
    np.testing.assert_allclose(chunked.history.losses, plain.history.losses, rtol=rtol)
    np.testing.assert_allclose(
        chunked.history.eval_scores, plain.history.eval_scores, rtol=rtol
    )


def test_make_step_equals_the_unchunked_step(problem):
    ens, state, data = problem
    opt = optax.sgd(0.1)
    opt_state = ee.init_optimizer(opt, ens)
    plain = ee.make_step(loss, opt)(ens, opt_state, data, jax.random.key(3), state)
    chunked = ee.make_step(loss, opt, execution=ee.Execution(member_chunk=2))(
        ens, opt_state, data, jax.random.key(3), state
    )
    _close(chunked, plain)


def test_map_and_predict_equal_the_unchunked_ones(problem):
    ens, state, data = problem
    x = data[0]
    plain = ee.predict(ens, x, state=state)
    chunked = ee.predict(ens, x, state=state, execution=ee.Execution(member_chunk=4))
    _close(chunked, plain)
    fn = lambda m, xs: jax.vmap(lambda xi: m.first(xi))(xs)  # noqa: E731
    _close(
        ee.map(fn, ens, x, execution=ee.Execution(member_chunk=2)), ee.map(fn, ens, x)
    )
    with pytest.raises(ValueError, match="disagree"):
        ee.map(fn, ens, x, chunk_size=4, execution=ee.Execution(member_chunk=2))
    # Mapping takes a chunk that does not divide the 8 members (3 + 3 + 2).
    _close(
        ee.map(fn, ens, x, execution=ee.Execution(member_chunk=3)), ee.map(fn, ens, x)
    )
    with pytest.raises(ValueError, match=r"`Execution\.member_chunk=9` is more"):
        ee.predict(ens, x, state=state, execution=ee.Execution(member_chunk=9))


def test_chunked_step_holds_fewer_intermediates():
    """XLA's memory analysis of the compiled step: the temporaries of one chunk
    of members, not of all of them (sizes, not timings)."""
    ens = ee.ensemble(
        lambda k: eqx.nn.MLP(64, 64, 256, 3, key=k), size=16, key=jax.random.key(0)
    )
    mse = lambda m, b, k: jnp.mean((jax.vmap(m)(b) - b) ** 2)  # noqa: E731
    x = jnp.ones((512, 64))
    opt = optax.sgd(0.1)
    opt_state = ee.init_optimizer(opt, ens)

    def temp_bytes(execution):
        step = ee.make_step(mse, opt, execution=execution)
        dynamic, static = eqx.partition((ens, opt_state), eqx.is_array)

        def run(dynamic, batch, key):
            out = step(*eqx.combine(dynamic, static), batch, key)
            return eqx.filter(out, eqx.is_array)

        lowered = jax.jit(run).lower(dynamic, x, jax.random.key(0))
        return lowered.compile().memory_analysis().temp_size_in_bytes

    # `compiler_options={}`: an outer `jit` takes no options of the inner one's.
    # `member_chunk=16`: all members at once (left out, `make_step` would chunk
    # a step this large itself: the test below).
    whole = temp_bytes(ee.Execution(member_chunk=16, compiler_options={}))
    chunked = temp_bytes(ee.Execution(member_chunk=2, compiler_options={}))
    # On a CPU one chunk's temporaries (2 of 16 members) and the stacked
    # results; XLA:GPU keeps more around the chunks' loop (39 vs 67 MB measured
    # on an H100, session 21), so there only the direction is checked.
    assert chunked < (whole / 3 if ON_CPU else whole), (chunked, whole)


# --------------------------------------------- chunks chosen by `make_step`


def _temp_bytes(step, *args):
    """XLA's temporaries of `step`'s compiled program for `args`."""
    compiled = step.lower(*args)._lowered.compile().compiled
    return compiled.memory_analysis().temp_size_in_bytes


@pytest.mark.skipif(not ON_CPU, reason="a CPU's allocator (glibc's mmap ceiling)")
def test_make_step_chunks_a_step_whose_temporaries_pass_the_allocators_ceiling():
    # 64 MLPs 32-128-128-10 on a batch of 256 (the compute-bound benchmark):
    # all at once, XLA's temporaries are ~32 MiB, which glibc maps afresh at
    # every call (`make_step` 40 ms per step on a 2-core CPU, 25 in chunks).
    from eqx_ensemble._execution.plan import SCRATCH_BYTES

    ens = ee.ensemble(
        lambda k: eqx.nn.MLP(32, 10, 128, 2, key=k), size=64, key=jax.random.key(0)
    )
    x = jax.random.normal(jax.random.key(1), (256, 32))
    y = jax.random.randint(jax.random.key(2), (256,), 0, 10)

    def xent(model, batch, key):
        logits = jax.vmap(model)(batch[0])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch[1]).mean()

    opt = optax.adam(1e-3)
    opt_state = ee.init_optimizer(opt, ens)
    args = (ens, opt_state, (x, y), jax.random.key(3))
    auto = ee.make_step(xent, opt)
    whole = ee.make_step(xent, opt, execution=ee.Execution(member_chunk=64))
    chunk = auto._plan(ens, (x, y)).member_chunk
    assert chunk is not None and chunk < 64 and 64 % chunk == 0
    # XLA's own account of the two programs: the chunks' temporaries (with the
    # stacked results) under the ceiling by a quarter, and under the whole's.
    chunked_bytes, whole_bytes = _temp_bytes(auto, *args), _temp_bytes(whole, *args)
    assert chunked_bytes <= 0.75 * SCRATCH_BYTES, chunked_bytes
    assert chunked_bytes < 0.75 * whole_bytes, (chunked_bytes, whole_bytes)
    _close(auto(*args), whole(*args))
    # Eight members (an eighth of the values), members sharing a part, a
    # coupled loss and `fit`'s compiled loop, which takes its temporaries once
    # per dispatch, are not chunked.
    assert auto._plan(ee.stack([ens[i] for i in range(8)]), (x, y)).member_chunk is None
    shared = ee.ensemble(
        lambda k: eqx.nn.MLP(32, 10, 128, 2, key=k),
        size=64,
        key=jax.random.key(0),
        shared=lambda m: m.layers[0],
    )
    assert auto._plan(shared, (x, y)).member_chunk is None
    coupled = ee.Coupled(lambda members, batch, key: jnp.zeros(64))
    assert ee.make_step(coupled, opt)._plan(ens, (x, y)).member_chunk is None
    # Nor inside a trace of the user's own (its program takes the temporaries
    # once per call of its own).
    seen = []

    @eqx.filter_jit
    def inside(ens):
        seen.append(auto._plan(ens, (x, y)).member_chunk)
        return 0

    inside(ens)
    assert seen == [None]
    # Nor a step that convolves (XLA's CPU convolutions in the chunks' loop
    # ran 14x slower), here 24 small CNNs whose values pass the ceiling.
    cnns = ee.ensemble(
        lambda k: eqx.nn.Conv2d(1, 16, 3, padding=1, key=k),
        size=24,
        key=jax.random.key(0),
    )
    images = jnp.ones((128, 1, 16, 16))
    convolve = lambda m, b, k: jnp.mean(jax.vmap(m)(b) ** 2)  # noqa: E731
    step = ee.make_step(convolve, opt, execution=ee.Execution(layout="vmap"))
    from eqx_ensemble._execution.plan import SCRATCH_BYTES, member_temporaries

    assert 24 * member_temporaries(_profile(step, cnns, images), cnns.members, 24) > (
        SCRATCH_BYTES
    )
    assert step._plan(cnns, images).member_chunk is None
    from eqx_ensemble._execution.plan import plan_step

    fit_plan = plan_step(
        ee.Execution(),
        lambda: _profile(auto, ens, (x, y)),
        owner=None,
        structure=None,
        members=ens.members,
        examples=256,
        size=64,
        placement=SINGLE_DEVICE,
        steps=1000,
        groupable=True,
    )
    assert fit_plan.member_chunk is None


def _profile(step, ens, batch):
    from eqx_ensemble._training.step import _profile_of

    return _profile_of(step, (ens, batch, None, None))


def test_scratch_chunk_is_the_largest_divisor_that_fits():
    from eqx_ensemble._execution.plan import SCRATCH_BYTES, scratch_chunk

    mib = float(2**20)
    assert scratch_chunk(8, 1 * mib) is None  # 8 MiB in all
    assert scratch_chunk(64, 1 * mib) == 32  # 64 MiB in all; 32 fit
    assert scratch_chunk(64, 1.5 * mib) == 16  # 32 x 1.5 = 48 MiB does not
    assert scratch_chunk(7, 5 * mib) is None  # 35 MiB; 7 is prime: no chunk of 2+
    assert scratch_chunk(10, 12 * mib) == 2  # 120 MiB; 2 x 12 fit, 5 x 12 not
    assert scratch_chunk(5, 12 * mib) is None  # only 1 x 12 fits: not a chunk
    assert scratch_chunk(2, 50 * mib) is None  # one member alone is over
    assert scratch_chunk(4, SCRATCH_BYTES / 4) is None  # exactly the ceiling


@pytest.mark.skipif(not ON_CPU, reason="the estimate is read on a CPU only")
def test_the_temporaries_estimate_bounds_xlas_own():
    # `scratch_chunk`'s estimate of a member's temporaries (its loss's values
    # as written and three times its parameters) against XLA's memory analysis
    # of the compiled step: an overestimate but within 8x, for a matmul stack,
    # a wide one on a tiny batch (parameters, not values), convolutions and a
    # recurrent scan (whose backward pass keeps every iteration's values: the
    # scan's body counted per iteration).
    from eqx_ensemble._execution.plan import member_temporaries

    class CNN(eqx.Module):
        conv: eqx.nn.Conv2d
        out: eqx.nn.Linear

        def __init__(self, key):
            k1, k2 = jax.random.split(key)
            self.conv = eqx.nn.Conv2d(1, 16, 3, padding=1, key=k1)
            self.out = eqx.nn.Linear(16 * 8 * 8, 10, key=k2)

        def __call__(self, x):
            return self.out(jax.nn.relu(self.conv(x)).reshape(-1))

    class GRU(eqx.Module):
        cell: eqx.nn.GRUCell
        out: eqx.nn.Linear

        def __init__(self, key):
            k1, k2 = jax.random.split(key)
            self.cell = eqx.nn.GRUCell(8, 32, key=k1)
            self.out = eqx.nn.Linear(32, 10, key=k2)

        def __call__(self, xs):
            def step(h, x):
                return self.cell(x, h), None

            h, _ = jax.lax.scan(step, jnp.zeros(32), xs)
            return self.out(h)

    key = jax.random.key(0)
    cases = {
        "mlp": (lambda k: eqx.nn.MLP(64, 10, 256, 2, key=k), (128, 64)),
        "wide": (lambda k: eqx.nn.MLP(1024, 10, 1024, 2, key=k), (4, 1024)),
        "cnn": (CNN, (128, 1, 8, 8)),
        "gru": (GRU, (128, 16, 8)),
    }
    for name, (make, shape) in cases.items():
        ens = ee.ensemble(make, size=2, key=key)
        x = jax.random.normal(key, shape)

        def mse(model, batch, key):
            return jnp.mean(jax.vmap(model)(batch) ** 2)

        step = ee.make_step(mse, optax.adam(1e-3))
        args = (ens, ee.init_optimizer(optax.adam(1e-3), ens), x, key)
        each = member_temporaries(_profile(step, ens, x), ens.members, 2)
        ratio = _temp_bytes(step, *args) / (2 * each)
        assert 1 / 8 <= ratio <= 1, (name, ratio)


# ------------------------------------------------------------ chunks on a mesh


@pytest.mark.usefixtures("library_codegen")
@needs_devices(8)
def test_fit_on_a_mesh_chunks_within_each_device(problem):
    # 8 members over the 4 devices of "members" (2 each), batch over 2 "data"
    # devices; chunks of 1: each device computes one of its members at a time.
    ens, state, data = problem
    mesh = ee.make_mesh(members=4, data=2)

    def run(execution, ens=ens):
        return ee.fit(
            ens, loss, optax.sgd(0.05), data, steps=20, batch_size=16,
            key=jax.random.key(2), state=state, sampling="independent",
            callbacks=(), execution=execution,
            evaluate=ee.Evaluate(loss, data, every=10),
        )  # fmt: skip

    plain = run(None)
    chunked = run(ee.Execution(mesh=mesh, member_chunk=1), ee.shard(ens, mesh))
    # A mesh run equals the one-device run to rounding, which 20 steps grow to
    # about 2e-6 here (the sharding guide measures it).
    _close(chunked.ensemble, plain.ensemble, atol=1e-5)
    _close(chunked.state, plain.state, atol=1e-5)
    np.testing.assert_allclose(chunked.history.losses, plain.history.losses, rtol=1e-5)
    np.testing.assert_allclose(
        chunked.history.eval_scores, plain.history.eval_scores, rtol=1e-5
    )
    weight = chunked.ensemble.members.first.weight
    assert tuple(weight.sharding.spec)[0] == "members"
    # make_step too.
    opt = optax.sgd(0.1)
    opt_state = ee.init_optimizer(opt, ens)
    want = ee.make_step(loss, opt)(ens, opt_state, data, jax.random.key(3), state)
    step = ee.make_step(loss, opt, execution=ee.Execution(mesh=mesh, member_chunk=1))
    placed = ee.shard(ens, mesh)
    got = step(placed, ee.init_optimizer(opt, placed), data, jax.random.key(3), state)
    _close(got, want)


@needs_devices(8)
def test_chunks_on_an_explicit_mesh_equal_the_unchunked_run():
    # Explicit axes: every reshape of a split axis says where its output goes.
    mesh = ee.make_mesh(members=4, data=2, axis_types=jax.sharding.AxisType.Explicit)
    ens = ee.ensemble(
        lambda k: eqx.nn.MLP(2, 1, 16, 2, key=k), size=8, key=jax.random.key(0)
    )
    x = jnp.stack([jnp.linspace(-1, 1, 64), jnp.cos(jnp.linspace(0, 3, 64))], axis=1)
    data = (x, jnp.sin(x[:, :1]))
    mse = lambda m, b, k: jnp.mean((jax.vmap(m)(b[0]) - b[1]) ** 2)  # noqa: E731

    def run(execution, ens=ens):
        return ee.fit(
            ens, mse, optax.adam(1e-2), data, steps=6, batch_size=16,
            key=jax.random.key(1), callbacks=(), execution=execution,
            evaluate=ee.Evaluate(mse, data, every=2),
        )  # fmt: skip

    plain = run(None)
    chunked = run(ee.Execution(mesh=mesh, member_chunk=1), ee.shard(ens, mesh))
    _close(chunked.ensemble, plain.ensemble)
    np.testing.assert_allclose(
        chunked.history.eval_scores, plain.history.eval_scores, rtol=1e-5
    )
    assert tuple(chunked.ensemble.members.layers[0].weight.sharding.spec)[0] == (
        "members"
    )


@needs_devices(4)
def test_chunks_on_a_mesh_hold_fewer_intermediates_per_device():
    """Per device (XLA's memory analysis of the SPMD step): the temporaries of
    one of its members at a time, not of its 4."""
    mesh = ee.make_mesh(members=4, devices=jax.devices()[:4])
    ens = ee.shard(
        ee.ensemble(
            lambda k: eqx.nn.MLP(64, 64, 256, 3, key=k), size=16, key=jax.random.key(0)
        ),
        mesh,
    )
    mse = lambda m, b, k: jnp.mean((jax.vmap(m)(b) - b) ** 2)  # noqa: E731
    x = jnp.ones((2048, 64))  # activations dominate (measured: 52.0 -> 19.1 MiB)
    opt = optax.sgd(0.1)
    opt_state = ee.init_optimizer(opt, ens)

    def temp_bytes(chunk):
        execution = ee.Execution(mesh=mesh, member_chunk=chunk, compiler_options={})
        step = ee.make_step(mse, opt, execution=execution)
        compiled = step.lower(ens, opt_state, x, jax.random.key(0)).compile()
        return compiled.compiled.memory_analysis().temp_size_in_bytes

    whole, chunked = temp_bytes(None), temp_bytes(1)
    assert chunked < whole / 2, (chunked, whole)


# ------------------------------------------------------------------ bad input


def test_chunk_must_divide_the_members(problem):
    ens, state, data = problem
    with pytest.raises(ValueError, match=r"member_chunk=3` must divide .* \(8\)"):
        ee.fit(
            ens, loss, optax.sgd(0.1), data, steps=2, batch_size=8,
            key=jax.random.key(0), state=state, callbacks=(),
            execution=ee.Execution(member_chunk=3),
        )  # fmt: skip
    step = ee.make_step(loss, optax.sgd(0.1), execution=ee.Execution(member_chunk=3))
    with pytest.raises(ValueError, match="must divide"):
        step(
            ens, ee.init_optimizer(optax.sgd(0.1), ens), data, jax.random.key(0), state
        )


@needs_devices(8)
def test_chunk_must_divide_each_devices_members(problem):
    ens, state, data = problem
    mesh = ee.make_mesh(members=4, data=2)
    with pytest.raises(
        ValueError, match=r"per device \(8 members over the 4 .* 2 each"
    ):
        ee.fit(
            ee.shard(ens, mesh), loss, optax.sgd(0.1), data, steps=2, batch_size=8,
            key=jax.random.key(0), state=state, callbacks=(),
            execution=ee.Execution(mesh=mesh, member_chunk=4),
        )  # fmt: skip


def test_chunk_refused_where_it_cannot_apply():
    with pytest.raises(ValueError, match="one member at a time"):
        ee.Execution(member_chunk=2, layout="sequential")
    with pytest.raises(ValueError, match="member_chunk"):
        ee.Execution(member_chunk=0)
    ens = ee.ensemble(
        lambda k: eqx.nn.Linear(2, 1, key=k), size=4, key=jax.random.key(0)
    )
    x = jnp.ones((8, 2))
    coupled = ee.Coupled(lambda e, b, k: jnp.zeros(4))
    with pytest.raises(ValueError, match="Coupled"):
        ee.fit(
            ens, coupled, optax.sgd(0.1), x, steps=2, batch_size=4,
            key=jax.random.key(0), callbacks=(),
            execution=ee.Execution(member_chunk=2),
        )  # fmt: skip
