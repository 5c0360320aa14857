"""XLA compiler options of the compiled training steps (`fit`, `make_step`).

On a multi-core CPU the library compiles big steps with YNNPACK's fusions off so
that batched matmuls run on every core (eqx_ensemble/_xla.py). These tests check
the choice, that the options reach XLA, and that the results do not depend on
them beyond floating-point rounding.
"""

import gc
import os
import weakref

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import assert_tree_allclose, run_with_xla_defaults, tree_equal

import eqx_ensemble as ee
from eqx_ensemble._execution import cache as _cache, compile as _xla
from eqx_ensemble._training.placement import SINGLE_DEVICE, OnMesh

EIGEN = dict(_xla.EIGEN_DOTS)
SGD = optax.sgd(0.05)
X = jax.random.normal(jax.random.key(0), (64, 16))
Y = jax.random.randint(jax.random.key(1), (64,), 0, 4)

needs_cores = pytest.mark.skipif(
    (os.cpu_count() or 1) < 2, reason="the automatic choice needs >= 2 cores"
)


def make_mlp(key):
    return eqx.nn.MLP(16, 4, 64, 2, activation=jax.nn.relu, key=key)


def xent(model, batch, key):
    x, y = batch
    logits = jax.vmap(model)(x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def _members(size, in_size, width, out_size, depth=2):
    return ee.ensemble(
        lambda k: eqx.nn.MLP(in_size, out_size, width, depth, key=k),
        size=size,
        key=jax.random.key(2),
    ).members


def test_flop_estimate_matches_closed_form():
    members = _members(4, 16, 64, 4)
    weights = 16 * 64 + 64 * 64 + 64 * 4  # biases are not matmuls
    assert _xla.step_matmul_flops(members, 32, 4) == 6.0 * 32 * weights * 4


@needs_cores
def test_automatic_choice(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "")  # the library's rule, not this suite's -O0
    small = _members(8, 1, 32, 1)  # the dispatch-bound regime: ~1 MFLOP per step
    big = _members(64, 32, 128, 10)  # the compute-bound regime: ~2 GFLOP per step
    fast = tuple(sorted(_xla.FAST_CODEGEN.items()))
    assert _xla.step_compiler_options(None, small, 16, 8, SINGLE_DEVICE) == fast
    expected = tuple(sorted((EIGEN | _xla.FAST_CODEGEN).items()))
    assert _xla.step_compiler_options(None, big, 256, 64, SINGLE_DEVICE) == expected
    # The user's options always win, `{}` included.
    assert _xla.step_compiler_options((), big, 256, 64, SINGLE_DEVICE) == ()
    user = (("xla_cpu_enable_fast_math", False),)
    assert _xla.step_compiler_options(user, small, 16, 8, SINGLE_DEVICE) == user
    # On a mesh, each device's share of the work counts.
    mesh = ee.make_mesh(members=8)
    threshold_batch = int(_xla.MIN_STEP_FLOPS / _xla.step_matmul_flops(big, 1, 64))
    batch = 2 * threshold_batch  # above the threshold alone, below it per device
    assert _xla.step_compiler_options(None, big, batch, 64, SINGLE_DEVICE) == expected
    assert _xla.step_compiler_options(None, big, batch, 64, OnMesh(mesh)) == fast
    # Attention heads' batched matmuls keep YNNPACK (Eigen runs them slower).
    assert _xla.step_compiler_options(None, big, 256, 64, SINGLE_DEVICE, True) == fast


def test_the_librarys_options_leave_what_xla_flags_set(monkeypatch):
    """A program that runs once (`ee.ensemble`'s build) leaves out of its
    options what the process's `XLA_FLAGS` set (this suite's own LLVM level,
    say), so that it keeps the bits of the operations run one by one under
    those flags; a training step's level too (a user's flag stands)."""
    monkeypatch.setenv("XLA_FLAGS", "")
    assert _xla.one_shot_options() == tuple(sorted(_xla.ONE_SHOT.items()))
    monkeypatch.setenv("XLA_FLAGS", "--xla_backend_optimization_level=3")
    assert _xla.one_shot_options() == (("xla_cpu_use_fusion_emitters", False),)
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_use_fusion_emitters")
    assert _xla.one_shot_options() == (("xla_backend_optimization_level", 1),)
    # An option this jaxlib does not know is left out, not the others with it.
    one_shot = tuple(sorted(_xla.ONE_SHOT.items()))
    with monkeypatch.context() as patched:
        patched.setenv("XLA_FLAGS", "")
        patched.setattr(_xla, "ONE_SHOT", _xla.ONE_SHOT | {"xla_no_such_option": 1})
        assert _xla.one_shot_options() == one_shot
    # So does a training step's level: what `XLA_FLAGS` set stands.
    monkeypatch.setenv("XLA_FLAGS", "--xla_backend_optimization_level=0")
    assert _xla.cpu_codegen_options() == ()
    small = _members(8, 1, 32, 1)
    assert _xla.step_compiler_options(None, small, 16, 8, SINGLE_DEVICE) == ()


def test_options_reach_xla():
    # YNNPACK fusions appear in the default compilation of a batched matmul and
    # disappear with the library's options.
    a = jnp.ones((8, 64, 64))

    def batched(a):
        return jnp.einsum("mij,mjk->mik", a, a)

    default = _xla.filter_jit(batched, ()).lower(a).compile().compiled.as_text()
    if "ynn" not in default:
        pytest.skip("this jaxlib does not use YNNPACK for batched matmuls")
    eigen = _xla.filter_jit(batched, tuple(EIGEN.items())).lower(a).compile()
    assert "ynn" not in eigen.compiled.as_text()


_FAST_CODEGEN_BITS = """
import equinox as eqx, jax, jax.numpy as jnp, numpy as np, optax
import eqx_ensemble as ee
from eqx_ensemble._execution import compile as _xla

a = jnp.linspace(-1.0, 1.0, 64).reshape(8, 8)


def f(a):
    return jnp.tanh(a) @ a + jnp.exp(-a)


fast = tuple(sorted(_xla.FAST_CODEGEN.items()))
compiled = _xla.filter_jit(f, fast).lower(a).compile()
default = _xla.filter_jit(f, ()).lower(a).compile()
ens = ee.ensemble(lambda k: eqx.nn.MLP(1, 1, 8, 2, key=k), size=3,
                  key=jax.random.key(0))
x = jnp.linspace(-1, 1, 32)[:, None]


def mse(model, batch, key):
    return jnp.mean((jax.vmap(model)(batch) - jnp.sin(batch)) ** 2)


runs = [
    ee.fit(ens, mse, optax.adam(1e-2), x, steps=30, batch_size=8,
           key=jax.random.key(1), callbacks=(),
           execution=ee.Execution(compiler_options=options)).ensemble
    for options in ({}, dict(fast))
]
for a_leaf, b_leaf in zip(*map(jax.tree.leaves, runs), strict=True):
    np.testing.assert_array_equal(a_leaf, b_leaf)
np.testing.assert_array_equal(compiled(a), default(a))
print("same bits")

# `ee.ensemble`'s one program, compiled with `ONE_SHOT`, against the same build
# run op by op (uniform, convolutional and normal initialisations).
assert _xla.one_shot_options() == tuple(sorted(_xla.ONE_SHOT.items()))
makers = [
    lambda k: eqx.nn.MLP(6, 3, 16, 2, key=k),
    lambda k: eqx.nn.Conv2d(2, 4, 3, key=k),
    lambda k: eqx.nn.Embedding(20, 4, key=k),
]
for make in makers:
    built = ee.ensemble(make, size=3, key=jax.random.key(3))
    op_by_op = eqx.filter_vmap(make)(jax.random.split(jax.random.key(3), 3))
    for a_leaf, b_leaf in zip(*map(jax.tree.leaves, (built.members, op_by_op))):
        np.testing.assert_array_equal(a_leaf, b_leaf)
print("same bits")

# A search (temperature scaling's golden section) turns the last bit of its
# objective into its result: the same temperature inside a caller's `jax.jit`
# as outside (the metrics' `ONE_SHOT` programs moved it by 2.5e-4).
rng = np.random.default_rng(15)
logits = (rng.standard_normal((3, 600, 5)) * 2).astype(np.float32)
softened = np.exp(logits[0] / 2.0)  # labels drawn at temperature 2
softened /= softened.sum(-1, keepdims=True)
labels = np.array([rng.choice(5, p=row) for row in softened], np.int32)
outside = float(ee.metrics.fit_temperature(logits, labels))
inside = float(jax.jit(ee.metrics.fit_temperature)(logits, labels))
assert 1.2 < outside < 4 and abs(outside - inside) <= 1e-6 * outside, (outside, inside)
print("same temperature")
"""


def test_the_librarys_compiler_options_change_no_bits():
    """In a process compiling with XLA's defaults (a user's, not this suite's
    faster flags): LLVM level 1 (`FAST_CODEGEN`) gives the same bits as XLA's
    default level on a small function and on a tiny `fit` run (the
    dispatch-bound regime it is for); `ee.ensemble`'s one program
    (`ONE_SHOT`: level 1 and the older elemental emitters) gives the bits of
    the same build run op by op, for dense, convolutional and embedding
    layers; and `ee.metrics.fit_temperature` finds the same temperature
    inside a `jax.jit` as outside."""
    out = run_with_xla_defaults(_FAST_CODEGEN_BITS)
    assert out.split() == ["same", "bits", "same", "bits", "same", "temperature"]


def test_a_step_with_options_runs_inside_the_users_jit():
    """JAX refuses compiler options on a nested `jax.jit`: a step with options
    called inside the user's own `jax.jit` runs under the outer program's and
    computes the same as when called on its own."""
    ens = ee.ensemble(make_mlp, size=4, key=jax.random.key(5))
    opt_state = ee.init_optimizer(SGD, ens)
    for options in (
        EIGEN,
        dict(_xla.FAST_CODEGEN),
        {"xla_cpu_enable_fast_math": False},
    ):
        step = ee.make_step(xent, SGD, execution=ee.Execution(compiler_options=options))
        alone = step(ens, opt_state, (X, Y), jax.random.key(6))
        inside = eqx.filter_jit(step)(ens, opt_state, (X, Y), jax.random.key(6))
        assert_tree_allclose(inside.ensemble, alone.ensemble, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(inside.losses, alone.losses, rtol=1e-5)
        jaxpr = eqx.filter_make_jaxpr(step)(ens, opt_state, (X, Y), jax.random.key(6))
        assert jaxpr[0].jaxpr.eqns


def _fit(ens, options, loss=xent, steps_per_dispatch=10, **kwargs):
    kwargs = dict(steps=20, batch_size=32, callbacks=()) | kwargs
    return ee.fit(
        ens,
        loss,
        SGD,
        (X, Y),
        key=jax.random.key(3),
        **kwargs,
        execution=ee.Execution(
            steps_per_dispatch=steps_per_dispatch, compiler_options=options
        ),
    )


def test_one_probe_answers_for_every_subset_of_the_librarys_options(monkeypatch):
    # Whether this jaxlib knows an option is a compile; the library's options are
    # probed together once, and each subset of them needs no probe of its own.
    probes = []
    jit = jax.jit

    def counting(fn, **kwargs):
        probes.append(tuple(sorted(kwargs.get("compiler_options", {}).items())))
        return jit(fn, **kwargs)

    monkeypatch.setattr(_xla.jax, "jit", counting)
    _xla._supported.cache_clear()
    try:
        fast = tuple(sorted(_xla.FAST_CODEGEN.items()))
        both = tuple(sorted((_xla.FAST_CODEGEN | _xla.EIGEN_DOTS).items()))
        one_shot = tuple(sorted(_xla.ONE_SHOT.items()))
        every = _xla.FAST_CODEGEN | _xla.EIGEN_DOTS | _xla.ONE_SHOT
        every = tuple(sorted(every.items()))
        assert _xla._supported(fast) and _xla._supported(both)
        assert _xla._supported(one_shot)
        assert probes == [every]
        assert not _xla._supported((("xla_no_such_option_here", 1),))
        assert probes == [every, (("xla_no_such_option_here", 1),)]
    finally:
        _xla._supported.cache_clear()


def test_fit_results_do_not_depend_on_options():
    ens = ee.ensemble(make_mlp, size=4, key=jax.random.key(4))
    default = _fit(ens, {})
    eigen = _fit(ens, EIGEN)
    assert_tree_allclose(eigen.ensemble, default.ensemble, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(
        eigen.history.losses, default.history.losses, rtol=1e-4, atol=1e-6
    )
    # Members stay independent under the options: the first two members trained
    # as an ensemble of their own match.
    pair = _fit(ens[:2], EIGEN)
    assert_tree_allclose(pair.ensemble, eigen.ensemble[:2], rtol=1e-4, atol=1e-5)


def test_make_step_results_do_not_depend_on_options():
    ens = ee.ensemble(make_mlp, size=4, key=jax.random.key(5))
    opt_state = ee.init_optimizer(SGD, ens)
    outs = []
    for options in ({}, EIGEN, None):
        step = ee.make_step(xent, SGD, execution=ee.Execution(compiler_options=options))
        outs.append(step(ens, opt_state, (X, Y), jax.random.key(6)))
    for out in outs[1:]:
        assert_tree_allclose(out.ensemble, outs[0].ensemble, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(out.losses, outs[0].losses, rtol=1e-5)


def test_fit_with_options_does_not_retrace():
    traces = []

    def counting(model, batch, key):
        traces.append(None)
        return xent(model, batch, key)

    once = None
    for seed in range(2):
        ens = ee.ensemble(make_mlp, size=2, key=jax.random.key(seed))
        _fit(
            ens,
            EIGEN,
            counting,
            steps=4,
            batch_size=8,
            steps_per_dispatch=2,
        )
        if seed == 0:
            once = len(traces)
    assert len(traces) == once


BAD_OPTIONS = [
    ("fast", "must be a dict of XLA options"),
    ({1: True}, "keys must be option names"),
    (
        {"xla_cpu_enable_fast_math": [1]},
        r"\['xla_cpu_enable_fast_math'\]` must be a str",
    ),
]


@pytest.mark.parametrize("options, match", BAD_OPTIONS)
def test_bad_options_messages(options, match):
    with pytest.raises(TypeError, match=match):
        _xla.check_compiler_options(options)


@pytest.mark.parametrize("options, match", BAD_OPTIONS)
def test_bad_options_are_refused(options, match):
    # With runtime type checks on (as in this suite) the annotation may catch the
    # value first; either way the error names the argument.
    ens = ee.ensemble(make_mlp, size=2, key=jax.random.key(7))
    with pytest.raises(TypeError, match="compiler_options"):
        _fit(ens, options, steps=2, batch_size=8)
    with pytest.raises(TypeError, match="compiler_options"):
        ee.make_step(xent, SGD, execution=ee.Execution(compiler_options=options))


def test_unknown_option_is_named_before_any_step(tmp_path):
    ens = ee.ensemble(make_mlp, size=2, key=jax.random.key(9))
    calls = []
    with pytest.raises(Exception, match="xla_cpu_no_such_option"):
        _fit(
            ens,
            {"xla_cpu_no_such_option": True},
            steps=2,
            batch_size=8,
            checkpoints=ee.Checkpoints(tmp_path),
            callbacks=[calls.append],
        )
    assert calls == []
    assert list(tmp_path.iterdir()) == []


def test_default_steps_per_dispatch():
    small = _members(8, 1, 32, 1)
    big = _members(64, 32, 128, 10)
    assert _xla.default_steps_per_dispatch(small, 16, 8, 1) == 1000
    assert _xla.default_steps_per_dispatch(big, 256, 64, 1) == 100


def test_fit_default_steps_per_dispatch_is_used():
    # A tiny model: one dispatch of 1000 steps by default, so the callback (called
    # after every dispatch) runs once for 1000 steps, and the result is the one
    # an explicit `steps_per_dispatch` gives.
    ens = ee.ensemble(
        lambda k: eqx.nn.Linear(16, 4, key=k), size=2, key=jax.random.key(11)
    )
    calls = []
    kwargs = dict(steps=1000, batch_size=8, key=jax.random.key(12), callbacks=())
    linear_loss = lambda m, b, k: jnp.mean(jax.vmap(m)(b[0]) ** 2)  # noqa: E731
    default = ee.fit(
        ens,
        linear_loss,
        SGD,
        (X, Y),
        **{**kwargs, "callbacks": [calls.append]},
    )
    assert len(calls) == 1
    explicit = ee.fit(
        ens,
        linear_loss,
        SGD,
        (X, Y),
        **kwargs,
        execution=ee.Execution(steps_per_dispatch=300),
    )
    assert tree_equal(default.ensemble, explicit.ensemble)


def test_make_step_lowers_ahead_of_time():
    # `step.lower(...)` as on an `eqx.filter_jit` function: the compiled step is
    # the one a call uses.
    ens = ee.ensemble(make_mlp, size=2, key=jax.random.key(13))
    opt_state = ee.init_optimizer(SGD, ens)
    step = ee.make_step(xent, SGD)
    compiled = step.lower(ens, opt_state, (X, Y), jax.random.key(14)).compile()
    ahead = compiled(ens, opt_state, (X, Y), jax.random.key(14))
    called = step(ens, opt_state, (X, Y), jax.random.key(14))
    assert tree_equal(ahead.ensemble, called.ensemble)
    np.testing.assert_array_equal(ahead.losses, called.losses)


# -- bounded compiled programs ----------------------------------------------------


def test_compiled_functions_drop_the_least_recently_used_with_their_programs(
    monkeypatch,
):
    monkeypatch.setattr(_cache, "MAX_PROGRAMS", 2)
    made = []

    def make(scale):
        jitted = eqx.filter_jit(lambda x: x * scale)
        made.append(jitted)
        return jitted

    compiled = _xla.CompiledFunctions(make)
    x = jnp.ones(3)
    for scale in (1.0, 2.0):
        np.testing.assert_allclose(compiled(scale)(x), scale * x)
    compiled(1.0)  # now the most recently used
    dropped = weakref.ref(made[1])
    np.testing.assert_allclose(compiled(3.0)(x), 3.0 * x)  # evicts 2.0
    assert len(compiled) == 2 and len(made) == 3
    assert compiled(1.0) is made[0]  # 1.0's function (and its program) was kept
    del made[1]
    gc.collect()
    assert dropped() is None  # 2.0's function is gone, and its programs with it
    np.testing.assert_allclose(compiled(2.0)(x), 2.0 * x)  # made again
    assert len(made) == 3


@pytest.mark.skipif(
    not os.path.exists("/proc/self/maps"), reason="memory maps are read on Linux"
)
def test_fit_and_make_step_with_new_optimizers_keep_memory_maps_bounded(monkeypatch):
    # Each compiled CPU program holds ~280 memory maps; a loop with a new optimizer
    # per call used to keep every program (and crash past ~230 calls).
    from eqx_ensemble._training import loop as _loop, step as _step

    monkeypatch.setattr(_cache, "MAX_PROGRAMS", 3)
    ens = ee.ensemble(make_mlp, size=2, key=jax.random.key(0))

    def maps():
        with open("/proc/self/maps") as f:
            return sum(1 for _ in f)

    def one_round(i):
        # A new program per round: Adam's `b1` and a clipping threshold are
        # constants of the program (a new learning rate alone is an input).
        adam = optax.adam(1e-3, b1=0.9 - 0.01 * i)
        for per_dispatch in (1, 2):  # two dispatches; one (its start state in it)
            ee.fit(
                ens,
                xent,
                adam,
                (X, Y),
                steps=2,
                batch_size=8,
                key=jax.random.key(i),
                callbacks=(),
                execution=ee.Execution(
                    compiler_options={}, steps_per_dispatch=per_dispatch
                ),
            )
        sgd = optax.chain(optax.clip(1.0 + i), optax.sgd(1e-3))
        step = ee.make_step(xent, sgd, execution=ee.Execution(compiler_options={}))
        step(ens, ee.init_optimizer(sgd, ens), (X[:8], Y[:8]), jax.random.key(i))

    for i in range(3):  # fill the bounded caches
        one_round(i)
    before = maps()
    # (a step whose learning rate is an input runs a program keyed by its
    # plan, `_compiled_generic`; others one keyed by the step, `_compiled_for`;
    # either may hold other tests' entries, and must not grow past both)
    kept = max(3, len(_step._compiled_for))
    kept_generic = max(3, len(_step._compiled_generic))
    # Without the cyclic garbage collector (a long-lived process may not run a
    # full collection for a long time): dropped programs must go by reference
    # counting alone.
    gc.disable()
    try:
        for i in range(3, 6):
            one_round(i)
            assert len(_loop.chunk_runner) <= 3
            assert len(_step._compiled_for) <= kept
            assert len(_step._compiled_generic) <= kept_generic
    finally:
        gc.enable()
    # Bounded, the count does not grow (0 here); unbounded, each round keeps
    # ~260 more maps per cache of programs (~780 for the three), so one cache
    # that stopped dropping its programs adds ~780 over these three rounds.
    grown = maps() - before
    assert grown < 500, f"{grown} more memory maps after three rounds"
