"""Compile once: equal optimizers and losses, another `steps=`, a progress bar
reuse the compiled program (counted through `jax.monitoring`); functions that
compute different things never share one (checked against separate runs)."""

import functools
import logging
import os
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import assert_tree_allclose, tree_equal

import eqx_ensemble as ee
from eqx_ensemble._execution.intern import (
    MAX_ARRAY,
    Doubtful,
    canonical,
    structural_key,
)
from eqx_ensemble._internal.tree import as_array

_COMPILES = [0]


def _count(event: str, duration_secs: float, **_: str | int) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        _COMPILES[0] += 1


jax.monitoring.register_event_duration_secs_listener(_count)


def compilations(run) -> int:
    before = _COMPILES[0]
    run()
    return _COMPILES[0] - before


class _Names(logging.Handler):
    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        match = re.match(r"Compiling (\S+)", record.getMessage())
        if match:
            self.names.append(match[1])


def compiled_programs(run) -> list[str]:
    """The names of the programs XLA compiled during `run()` (JAX's log)."""
    handler = _Names()
    logger = logging.getLogger("jax")
    logger.addHandler(handler)
    try:
        with jax.log_compiles(True):
            run()
    finally:
        logger.removeHandler(handler)
    return handler.names


X = jnp.linspace(-1, 1, 48)[:, None]
DATA = (X, X**3)
ENS = ee.ensemble(
    lambda k: eqx.nn.MLP(1, 1, 8, 1, key=k), size=3, key=jax.random.key(0)
)


def make_loss(scale=1.0):
    # A new function object each call, computing the same thing for one scale.
    def loss_fn(model, batch, key):
        xb, yb = batch
        return scale * jnp.mean((jax.vmap(model)(xb) - yb) ** 2)

    return loss_fn


def fit(optimizer, steps=40, loss_fn=None, **kwargs):
    kwargs.setdefault("callbacks", ())
    return ee.fit(
        ENS,
        loss_fn or make_loss(),
        optimizer,
        DATA,
        steps=steps,
        batch_size=12,
        key=jax.random.key(1),
        **kwargs,
    )


def test_equal_optimizer_loss_steps_and_progress_bar_compile_nothing(capsys):
    first = fit(optax.adam(1e-3))
    assert compilations(lambda: fit(optax.adam(1e-3))) == 0  # new, equal objects
    chain = lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3))  # noqa: E731
    fit(chain())
    assert compilations(lambda: fit(chain())) == 0
    # Another length: the same program (on the CPU a dispatch's trip count is
    # an input), and its history is the longer run's first rows.
    shorter = []
    assert compilations(lambda: shorter.append(fit(optax.adam(1e-3), 25))) == 0
    np.testing.assert_array_equal(
        np.asarray(shorter[0].history.losses), np.asarray(first.history.losses)[:25]
    )
    assert compilations(lambda: fit(optax.adam(1e-3), callbacks=None)) == 0
    capsys.readouterr()


def test_runs_of_one_and_of_many_dispatches_share_one_program(tmp_path):
    # A run of one dispatch, a run of many (a `steps=` past the dispatch
    # length), a checkpointed run and a run with a controller: one program for
    # the dispatch and one for the start state, compiled by the first.
    fit(optax.adam(1e-3), 5)
    assert compilations(lambda: fit(optax.adam(1e-3), 2500)) == 0
    every = ee.Checkpoints(tmp_path / "run", every=10)
    assert compilations(lambda: fit(optax.adam(1e-3), 30, checkpoints=every)) == 0

    class Stops(ee.Callback):  # a user's callback that ends dispatches at 7, 19
        def next_stop(self, done):
            return next((stop for stop in (7, 19) if stop > done), None)

    assert compilations(lambda: fit(optax.adam(1e-3), 30, callbacks=[Stops()])) == 0
    stop = ee.EarlyStopping(5, patience=3)
    evaluate = ee.Evaluate(make_loss(), DATA, every=5)
    fit(optax.adam(1e-3), 10, evaluate=evaluate)  # evaluation: another program
    # The controller's own state is made by a few eager operations (compiled
    # once per shape); the training programs are not compiled again.
    names = compiled_programs(
        lambda: fit(optax.adam(1e-3), 20, evaluate=evaluate, callbacks=(stop,))
    )
    assert "jit(_traced)" not in names, names
    assert len(names) <= 6, names


def test_different_computations_do_not_share_a_program():
    # Another learning rate, another closure constant: each run equals the
    # same run made first in a fresh cache key (its own program).
    slow = fit(optax.adam(1e-3))
    fast = fit(optax.adam(1e-2))
    assert not np.allclose(slow.history.losses, fast.history.losses)
    scaled = fit(optax.sgd(1e-2), loss_fn=make_loss(2.0))
    plain = fit(optax.sgd(1e-2), loss_fn=make_loss(1.0))
    # Same weights at the first step: the scaled loss reports twice the loss,
    # and then trains faster (twice the gradient).
    np.testing.assert_allclose(
        scaled.history.losses[0], 2 * plain.history.losses[0], rtol=1e-6
    )
    assert not np.allclose(scaled.history.losses[1:], 2 * plain.history.losses[1:])


def test_make_step_with_an_equal_optimizer_compiles_nothing():
    batch = (X, X**3)
    step = ee.make_step(make_loss(), optax.adam(1e-3))
    step(ENS, ee.init_optimizer(optax.adam(1e-3), ENS), batch, jax.random.key(0))
    again = ee.make_step(make_loss(), optax.adam(1e-3))
    opt_state = ee.init_optimizer(optax.adam(1e-3), ENS)
    assert compilations(lambda: again(ENS, opt_state, batch, jax.random.key(0))) == 0


SCALE = 2.0


def uses_global(x):
    return SCALE * x


def test_structural_keys():
    def make(c):
        return lambda x: c * x

    assert canonical(make(1.0)) is canonical(make(1.0))
    assert canonical(make(1.0)) is not canonical(make(2.0))
    assert canonical(make(np.float32(1))) is not canonical(make(np.float64(1)))
    small = jnp.arange(3.0)
    assert structural_key(make(small)) == structural_key(make(jnp.arange(3.0)))
    assert structural_key(make(small)) != structural_key(make(jnp.arange(1.0, 4.0)))
    big = jnp.zeros(10_000)  # by identity
    assert structural_key(make(big)) == structural_key(make(big))
    assert structural_key(make(big)) != structural_key(make(jnp.zeros(10_000)))
    # Partials, bound methods, defaults, and the globals a function names.
    assert structural_key(functools.partial(make, 1.0)) == structural_key(
        functools.partial(make, 1.0)
    )
    assert structural_key(functools.partial(make, 1.0)) != structural_key(
        functools.partial(make, 3.0)
    )
    # A script's (or notebook's) function is keyed by its code and the globals
    # it names; a module's own global function by identity.
    script = {"__name__": "__main__", "SCALE": 2.0}
    exec("def uses_global(x):\n    return SCALE * x\n", script)
    key = structural_key(script["uses_global"])
    script["SCALE"] = 3.0
    assert structural_key(script["uses_global"]) != key
    assert canonical(uses_global) is uses_global
    assert structural_key(optax.adam(1e-3)) == structural_key(optax.adam(1e-3))
    assert structural_key(optax.adam(1e-3)) != structural_key(optax.adam(2e-3))
    assert structural_key(optax.adam(1e-3)) != structural_key(optax.adamw(1e-3))


def _first_loss(loss_fn) -> float:
    """The first step's mean loss of a short `fit` (the same weights whatever
    the loss, so a loss scaled by `s` reports `s` times the plain one)."""
    result = fit(optax.sgd(1e-2), steps=2, loss_fn=loss_fn)
    return float(np.mean(np.asarray(result.history.losses)[0]))


class _Trainer:
    def __init__(self, scale):
        self.scale = scale

    def loss(self, model, batch, key):
        return self.scale * make_loss()(model, batch, key)


def _scaled(model, batch, key, cfg):
    return cfg.scale * make_loss()(model, batch, key)


def _scaled_item(model, batch, key, cfg):
    return cfg["scale"] * make_loss()(model, batch, key)


def _cell(source: str, namespace: dict) -> dict:
    """A notebook cell run (again): its functions are new objects of `__main__`."""
    namespace.setdefault("__name__", "__main__")
    namespace.update(jnp=jnp, jax=jax, make_loss=make_loss)
    exec(source, namespace)
    return namespace


_CELL = (
    "def loss_fn(model, batch, key):\n    return {} * make_loss()(model, batch, key)\n"
)


def _kinds_of_state():
    """For each kind of state a loss can reach: `(make, change)`, where `make()`
    gives a new loss object reading the state and `change()` sets its scale to
    3 (from 1)."""
    import sys
    import types

    trainer = _Trainer(1.0)
    cfg = types.SimpleNamespace(scale=1.0)
    cell = _cell(_CELL.format("CFG.scale"), {"CFG": types.SimpleNamespace(scale=1.0)})
    user_module = types.ModuleType("user_config_for_the_cache_rule")
    user_module.scale = 1.0
    sys.modules[user_module.__name__] = user_module
    module_cell = _cell(_CELL.format("config.scale"), {"config": user_module})
    helper_module = types.ModuleType("user_helpers_for_the_cache_rule")
    sys.modules[helper_module.__name__] = helper_module
    helpers = _cell(
        "SCALE = 1.0\ndef helper():\n    return SCALE\n", vars(helper_module)
    )
    helper_cell = _cell(_CELL.format("helper()"), {"helper": helpers["helper"]})
    small = np.ones(3, np.float32)  # read by value

    class ClassConfig:
        scale = 1.0

    class ClassConfig2:
        scale = 1.0

    class Settings(ClassConfig2):
        pass

    instance_of_class = Settings()

    class DictConfig(dict):
        pass

    dict_config = DictConfig(scale=1.0)

    class Slotted:
        __slots__ = ("scale",)

    class SlottedChild(Slotted):
        pass

    slotted = SlottedChild()
    slotted.scale = 1.0
    os.environ["EE_TEST_SCALE"] = "1.0"

    def marked():
        return None

    marked.scale = 1.0
    big = np.ones(MAX_ARRAY + 1, np.float32)  # may be written in place
    nested = {"inner": [types.SimpleNamespace(scale=1.0)]}

    def closing_over(array):
        return lambda model, batch, key: array[0] * make_loss()(model, batch, key)

    def set_scale(obj, name="scale"):
        return lambda: setattr(obj, name, 3.0)

    def write(array):
        return lambda: array.__setitem__(0, 3.0)

    return {
        "bound method of an object": (lambda: trainer.loss, set_scale(trainer)),
        "partial over a namespace": (
            lambda: functools.partial(_scaled, cfg=cfg),
            set_scale(cfg),
        ),
        "notebook cell reading a global namespace": (
            lambda: _cell(_CELL.format("CFG.scale"), cell)["loss_fn"],
            set_scale(cell["CFG"]),
        ),
        "attribute of a user module": (
            lambda: _cell(_CELL.format("config.scale"), module_cell)["loss_fn"],
            set_scale(user_module),
        ),
        "global of a user module's helper": (
            lambda: _cell(_CELL.format("helper()"), helper_cell)["loss_fn"],
            lambda: helpers.__setitem__("SCALE", 3.0),
        ),
        "small NumPy array closed over": (lambda: closing_over(small), write(small)),
        "large NumPy array closed over": (lambda: closing_over(big), write(big)),
        "object inside a closed-over container": (
            lambda: functools.partial(_scaled, cfg=nested["inner"][0]),
            set_scale(nested["inner"][0]),
        ),
        "class attribute": (
            lambda: functools.partial(_scaled, cfg=ClassConfig),
            set_scale(ClassConfig),
        ),
        "instance reading its class's attribute": (
            lambda: functools.partial(_scaled, cfg=instance_of_class),
            set_scale(ClassConfig2),
        ),
        "dict subclass": (
            lambda: functools.partial(_scaled_item, cfg=dict_config),
            lambda: dict_config.__setitem__("scale", 3.0),
        ),
        "subclass of a slotted class": (
            lambda: functools.partial(_scaled, cfg=slotted),
            set_scale(slotted),
        ),
        "environment variable": (
            lambda: _cell(
                _CELL.format("float(os.environ['EE_TEST_SCALE'])"), {"os": os}
            )["loss_fn"],  # fmt: skip
            lambda: os.environ.__setitem__("EE_TEST_SCALE", "3.0"),
        ),
        "module imported inside the loss": (
            lambda: _cell(
                "def loss_fn(model, batch, key):\n"
                "    import user_config_for_the_cache_rule as config\n"
                "    return config.scale * make_loss()(model, batch, key)\n",
                {},
            )["loss_fn"],
            set_scale(user_module),
        ),
        "attribute of a helper function": (
            lambda: _cell(_CELL.format("helper.scale"), {"helper": marked})["loss_fn"],
            set_scale(marked),
        ),
    }


@pytest.mark.parametrize("kind", list(_kinds_of_state()))
def test_a_program_is_never_reused_for_changed_state(kind):
    # The rule: a program is reused for a new function object only where a
    # fresh `jax.jit` of it could not trace differently. Each kind of state a
    # loss reaches is changed between two `fit`s of new, otherwise equal,
    # function objects: the second run sees the new scale (3x the loss).
    make, change = _kinds_of_state()[kind]
    before = _first_loss(make())
    change()
    after = _first_loss(make())
    np.testing.assert_allclose(after, 3.0 * before, rtol=1e-5)


def test_a_canonical_function_whose_state_changed_is_not_reused():
    # A is seen with its dict at 1, the dict is then set to 3; C, a new
    # closure over its own dict at 1, must not be given A (which a new batch
    # shape would trace again, reading 3).
    def factory(cfg):
        def loss(model, batch, key):
            return cfg["s"] * make_loss()(model, batch, key)

        return loss

    state = {"s": 1.0}
    first = factory(state)
    assert canonical(first) is first
    state["s"] = 3.0
    fresh = factory({"s": 1.0})
    assert canonical(fresh) is fresh

    def at_16(loss_fn):  # another batch shape: traced again
        run = ee.fit(ENS, loss_fn, optax.sgd(1e-2), DATA, steps=2, batch_size=16,
                     key=jax.random.key(1), callbacks=())  # fmt: skip
        return run.history.losses[0]

    np.testing.assert_allclose(at_16(fresh), at_16(make_loss()))


def test_keys_see_weak_types_cycles_and_object_arrays():
    weak, strong = jnp.asarray(2.0), jnp.array(2.0, jnp.float32)
    assert structural_key((weak,)) != structural_key((strong,))

    class Node:
        pass

    a, b, c = Node(), Node(), Node()
    a.s, b.s, c.s = 1.0, 1.0, 2.0
    a.next, b.next = b, a  # a -> b -> a
    c.next = c
    d, e = Node(), Node()
    d.s, e.s = 1.0, 1.0
    d.next, e.next = e, e  # d -> e -> e
    assert structural_key(a) != structural_key(d)
    with pytest.raises(Doubtful, match="objects"):
        structural_key(np.array([Node()], dtype=object))


def test_an_optax_schedule_that_rewrites_its_closure_still_compiles_once():
    # optax's cosine decay turns its `decay_steps` cell into a float on its
    # first call: a key taken again would differ from the one stored.
    def make():
        return optax.adamw(optax.warmup_cosine_decay_schedule(0.0, 1e-3, 10, 100))

    fit(make(), steps=5)
    assert compilations(lambda: fit(make(), steps=5)) == 0


def test_equal_state_still_shares_a_program():
    # Unchanged state read by value is still one program for new objects.
    import types

    cfg = types.SimpleNamespace(scale=2.0)
    _first_loss(functools.partial(_scaled, cfg=cfg))
    again = types.SimpleNamespace(scale=2.0)
    assert compilations(lambda: _first_loss(functools.partial(_scaled, cfg=again))) == 0
    assert canonical(_Trainer(2.0).loss) is not canonical(_Trainer(3.0).loss)


def test_a_rebuilt_ensemble_sees_a_changed_config():
    import types

    cfg = types.SimpleNamespace(scale=1.0)

    class Particle(eqx.Module):
        weight: jax.Array

        def __init__(self, key, scale):
            self.weight = scale * jax.random.normal(key, (3,))

    key = jax.random.key(3)
    first = ee.ensemble(lambda k: Particle(k, scale=cfg.scale), size=2, key=key)
    cfg.scale = 5.0
    second = ee.ensemble(lambda k: Particle(k, scale=cfg.scale), size=2, key=key)
    np.testing.assert_allclose(second.members.weight, 5.0 * first.members.weight)


def test_doubtful_state_is_its_own_key():
    import types

    module = types.ModuleType("a_user_module")
    with pytest.raises(Doubtful, match="a_user_module"):
        structural_key(module)
    with pytest.raises(Doubtful, match="NumPy array"):
        structural_key(np.zeros(MAX_ARRAY + 1))
    reads = lambda x: module  # noqa: E731
    assert canonical(reads) is reads
    assert canonical(jnp.sum) is jnp.sum  # a library's code by identity
    big = jnp.zeros(MAX_ARRAY + 1)  # a JAX array cannot change: by identity
    assert structural_key((big,)) == structural_key((big,))


def test_one_function_written_twice_is_one_function():
    def first(model, batch):
        return jnp.mean((model(batch) - 1.5) ** 2)

    def second(model, batch):
        return jnp.mean((model(batch) - 1.5) ** 2)

    def other(model, batch):
        return jnp.mean((model(batch) - 2.5) ** 2)

    assert canonical(first) is canonical(second)
    assert canonical(other) is not canonical(first)


def test_recursive_and_unusual_functions_are_keyed():
    def recursive(n):
        return 1 if n == 0 else n * recursive(n - 1)

    assert structural_key(recursive) == structural_key(recursive)
    assert canonical(print) is print  # a builtin: by identity, returned as is
    nan = lambda x: x * float("nan")  # noqa: E731
    assert structural_key(nan) == structural_key(nan)


def test_compilation_cache_writes_programs(tmp_path):
    # (conftest puts the suite's own cache back after the test)
    folder = ee.compilation_cache(tmp_path / "cache")
    jax.jit(lambda x: jnp.sin(x) * 3.25 + 1)(jnp.ones(7)).block_until_ready()
    assert any(folder.iterdir()), "no program was written to the cache folder"
    with pytest.raises(ValueError, match="min_compile_seconds"):
        ee.compilation_cache(tmp_path, min_compile_seconds=-1.0)
    with pytest.raises(TypeError, match="directory"):
        ee.compilation_cache(3)  # type: ignore[arg-type]


def test_a_loss_holding_arrays_is_planned_once(monkeypatch):
    # A loss module with an array field cannot be hashed: its step's plan (and
    # the loss's profile, a trace) is kept by the loss's identity, not made
    # again on every call.
    from eqx_ensemble._execution import plan as plan_module

    planned = []
    real = plan_module._plan
    monkeypatch.setattr(
        plan_module, "_plan", lambda *args: planned.append(1) or real(*args)
    )

    class Scaled(eqx.Module):
        scale: jax.Array

        def __call__(self, model, batch, key):
            return self.scale * jnp.mean(jax.vmap(model)(batch) ** 2)

    ens = ee.ensemble(lambda k: eqx.nn.Linear(2, 1, key=k), size=2,
                      key=jax.random.key(0))  # fmt: skip
    optimizer = optax.sgd(0.1)
    step = ee.make_step(Scaled(jnp.array(2.0)), optimizer)
    opt_state = ee.init_optimizer(optimizer, ens)
    for seed in range(3):
        ens, opt_state, *_ = step(
            ens, opt_state, jnp.ones((4, 2)), jax.random.key(seed)
        )
    assert len(planned) == 1


def test_a_loss_holding_arrays_compiles_once_for_any_values():
    # The deep-ensembles recipe on many splits: an adversarial step per input
    # feature (`ee.adversarial(epsilon=array)`) from each split's ranges. The
    # arrays are inputs of one program, not constants of one per split.
    per_split = [jnp.array([0.01]), jnp.array([0.02])]
    fit(optax.adam(1e-3), loss_fn=ee.adversarial(make_loss(), epsilon=per_split[0]))
    assert (
        compilations(
            lambda: fit(
                optax.adam(1e-3),
                loss_fn=ee.adversarial(make_loss(), epsilon=per_split[1]),
            )
        )
        == 0
    )


def test_building_an_ensemble_is_one_program_and_a_rebuild_none():
    """`ee.ensemble` compiles one program (not one per operation and shape), and
    a `make` written again (a re-run notebook cell: a new lambda, the same code
    and values) reuses it; another width is another program. The members equal
    `make` run alone on each member's key."""
    key = jax.random.key(11)

    def build(width):
        return ee.ensemble(lambda k: eqx.nn.MLP(5, 3, width, 2, key=k), size=4, key=key)

    jax.random.split(key, 4)  # the members' keys' own program, compiled first
    names = compiled_programs(lambda: build(13))
    assert len(names) == 1, names
    assert compilations(lambda: build(13)) == 0
    assert compilations(lambda: build(14)) == 1
    ens = build(13)
    alone = [eqx.nn.MLP(5, 3, 13, 2, key=k) for k in jax.random.split(key, 4)]
    for i, member in enumerate(alone):
        assert tree_equal(ens[i], member), i


def test_rebuilding_an_ensemble_with_a_shared_part_compiles_nothing():
    """A shared part's build is one program too, and a rebuild reuses it (also
    under jaxtyping's import hook, which the suite runs the library under: a
    function defined inside the build was a new wrapper per call)."""

    def build():
        return ee.ensemble(
            lambda k: eqx.nn.Sequential(
                [eqx.nn.Linear(3, 8, key=k), eqx.nn.Linear(8, 2, key=k)]
            ),
            size=4,
            key=jax.random.key(13),
            shared=lambda m: m.layers[0],
        )

    names = compiled_programs(build)
    assert names.count("jit(_traced)") == 1, names
    assert compilations(build) == 0


def test_indexing_and_stacking_compile_one_program_for_every_leaf():
    """`ens[i]`, `ens[a:b]`, `ens[indices]` and `ee.stack` take every leaf in
    one compiled call (op by op: a program per leaf shape, 10-15 for an MLP);
    another member index or slice of the same length compiles nothing, and
    the results are the leaves' own rows."""
    ens = ee.ensemble(
        lambda k: eqx.nn.MLP(2, 3, 7, 2, key=k), size=6, key=jax.random.key(17)
    )
    leaves = jax.tree.leaves(eqx.filter(ens, eqx.is_array))
    assert len({leaf.shape for leaf in leaves}) == 5  # op by op: 5 programs each
    taken = []
    assert compilations(lambda: taken.append(ens[4])) == 1
    assert compilations(lambda: taken.append(ens[-1])) == 0
    assert compilations(lambda: taken.append(ens[1:3])) == 1
    assert compilations(lambda: taken.append(ens[3:5])) == 0
    assert compilations(lambda: taken.append(ens[jnp.array([5, 0, 2])])) <= 2
    assert compilations(lambda: taken.append(ens[[1, 4, 4]])) == 0
    models = [taken[0], taken[1], taken[0]]
    assert compilations(lambda: taken.append(ee.stack(models))) == 1
    rows = (4, 5, [1, 2], [3, 4], [5, 0, 2], [1, 4, 4], [4, 5, 4])
    for got, row in zip(taken, rows, strict=True):
        got_leaves = jax.tree.leaves(eqx.filter(got, eqx.is_array))
        for got_leaf, leaf in zip(got_leaves, leaves, strict=True):
            np.testing.assert_array_equal(got_leaf, np.asarray(leaf)[np.array(row)])


def test_many_leaves_of_few_shapes_reuse_a_program_per_shape():
    """A deep stack of equal layers (26 leaves, 4 shapes) is indexed and
    stacked leaf by leaf: a program per shape, which a deeper stack reuses
    (one call for all leaves would compile a program per depth)."""

    def deep(depth):
        return ee.ensemble(
            lambda k: eqx.nn.MLP(4, 4, 8, depth, key=k), size=3, key=jax.random.key(5)
        )

    first, deeper = deep(12), deep(13)
    first[0], ee.stack([first[0], first[1]])  # compiles the programs per shape
    assert compilations(lambda: (deeper[1], ee.stack([deeper[0], deeper[2]]))) == 0
    arrays = lambda tree: jax.tree.leaves(eqx.filter(tree, eqx.is_array))  # noqa: E731
    for got, want in zip(arrays(deeper[1]), arrays(deeper.members), strict=True):
        np.testing.assert_array_equal(got, np.asarray(want)[1])


def test_a_pool_of_architectures_is_one_program_per_architecture():
    """`ee.sweep.architectures` builds each drawn architecture's group as one
    program (op by op: one per operation and shape, 115 for 6 MLPs); the same
    call again compiles nothing."""
    space = {"width": ee.sweep.choice([8, 16]), "depth": ee.sweep.choice([1, 2])}

    def pool():
        return ee.sweep.architectures(
            lambda key, width, depth: eqx.nn.MLP(3, 1, width, depth, key=key),
            space,
            size=8,
            key=jax.random.key(21),
        )

    built = []
    names = compiled_programs(lambda: built.append(pool()))
    groups = len(built[0].ensemble.groups)
    assert groups > 1
    # The groups' programs and the settings' draws (a few operations, op by
    # op): not one program per operation of the members' initialisation for
    # each architecture (op by op: 115 for 6 MLPs).
    assert names.count("jit(_traced)") == groups, names
    initialisation = {"jit(dot_general)", "jit(_uniform)", "jit(_normal)"}
    assert not initialisation & set(names), names
    assert compilations(pool) == 0


def test_a_make_that_reads_an_array_value_is_built_op_by_op():
    # Python control flow on an array that does not depend on the key: allowed
    # op by op (the array is concrete there), refused by a trace; `ee.ensemble`
    # falls back to the op-by-op build and gives what `make` gives alone.
    def make(key):
        scale = jnp.array([2.0, 3.0])
        width = 4 if float(scale.sum()) > 4 else 9
        return eqx.nn.Linear(3, width, key=key)

    key = jax.random.key(12)
    ens = ee.ensemble(make, size=3, key=key)
    assert ens.members.weight.shape == (3, 4, 3)
    for i, member_key in enumerate(jax.random.split(key, 3)):
        assert tree_equal(ens[i], make(member_key)), i


def test_predict_and_a_metric_compile_one_program_per_shape():
    # `ee.predict` is one compiled program per batch shape (op by op, a new
    # shape compiled every operation and every call dispatched each), equal
    # to the members run one by one; a metric compiles its input checks and
    # its computation, one program each, and runs inside a caller's `jit`.
    ens = ee.ensemble(
        lambda k: eqx.nn.MLP(4, 3, 16, 2, key=k), size=4, key=jax.random.key(2)
    )
    x = jax.random.normal(jax.random.key(3), (64, 4))
    labels = jax.random.randint(jax.random.key(4), (64,), 0, 3)
    few, fewer = x[:50], x[:40]
    ee.predict(ens, few)
    assert compilations(lambda: ee.predict(ens, few)) == 0
    out = []
    assert compilations(lambda: out.append(ee.predict(ens, fewer))) == 1
    members = [jax.vmap(ens[i])(fewer) for i in range(len(ens))]
    np.testing.assert_allclose(out[0], jnp.stack(members), rtol=1e-6, atol=1e-6)

    logits, some = out[0], labels[:40]
    nll = []
    # The logits' finiteness, the labels' range, the NLL (op by op: seven).
    assert (
        compilations(lambda: nll.append(ee.metrics.nll(logits, some, from_logits=True)))
        == 3
    )
    assert compilations(lambda: ee.metrics.nll(logits, some, from_logits=True)) == 0
    inside = jax.jit(lambda lg, y: ee.metrics.nll(lg, y, from_logits=True))
    np.testing.assert_allclose(inside(logits, some), nll[0], rtol=1e-6)
    # Inside a `jit` that closes over concrete arrays (no argument traced):
    # part of the caller's program too (JAX refuses options there).
    scores = jax.nn.logsumexp(logits, axis=-1).mean(0)
    auroc = ee.metrics.ood_auroc(scores[:20], scores[20:])
    closed = jax.jit(lambda: ee.metrics.ood_auroc(scores[:20], scores[20:]))
    np.testing.assert_allclose(closed(), auroc, rtol=1e-6)
    np.testing.assert_allclose(
        jax.jit(lambda: ee.predict(ens, fewer))(), out[0], rtol=1e-6, atol=1e-6
    )
    probs = jax.nn.softmax(logits)
    expected = -jnp.log(jnp.mean(probs, axis=0)[jnp.arange(40), some]).mean()
    np.testing.assert_allclose(nll[0], expected, rtol=1e-5)


def test_host_data_reaches_the_device_without_a_program(tmp_path):
    # `jnp.asarray` of NumPy data is a compiled program per shape and dtype
    # since JAX 0.10 (`jit(stage)`); the library copies host data with
    # `jax.device_put`, which compiles nothing. Shapes no other test uses.
    ens = ee.ensemble(
        lambda k: eqx.nn.MLP(5, 7, 13, 2, key=k), size=3, key=jax.random.key(5)
    )
    state = optax.adam(1e-3).init(eqx.filter(ens, eqx.is_inexact_array))
    path = ee.save(tmp_path / "run.eqx", (ens, state))
    loaded = []
    assert compilations(lambda: loaded.append(ee.load(path, (ens, state)))) == 0
    assert tree_equal(loaded[0], (ens, state))
    # A metric's first call on NumPy data compiles what it does on JAX arrays
    # of another new shape: its checks and its computation, nothing per input.
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, 37, 4)).astype(np.float32)
    labels = rng.integers(0, 4, size=37)
    on_device = (jnp.asarray(logits[:, :31]), jnp.asarray(labels[:31]))
    assert compilations(lambda: ee.metrics.nll(*on_device, from_logits=True)) == 3
    value = []
    assert (
        compilations(
            lambda: value.append(ee.metrics.nll(logits, labels, from_logits=True))
        )
        == 3
    )
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    expected = -np.log(probs.mean(0)[np.arange(37), labels]).mean()
    np.testing.assert_allclose(value[0], expected, rtol=1e-5)


def _aligned(n: int) -> np.ndarray:
    """Ones in a 64-byte aligned buffer: what `jax.device_put` on a CPU holds
    without a copy (an aligned array's memory is aliased)."""
    buffer = np.empty(n + 16, np.float32)
    start = (-buffer.ctypes.data % 64) // 4
    out = buffer[start : start + n]
    out[:] = 1.0
    return out


def test_host_data_is_copied_and_a_transfer_guard_still_sees_it():
    # `as_array` copies a NumPy array before `jax.device_put`: on a CPU that
    # aliases an aligned array's memory, and the work queued on it runs after
    # the call returns, so a caller writing into its buffer changed results
    # (a review found `gaussian_mixture` and `ee.metrics.nll` wrong in 14/30
    # and 6/20 tries). Deterministic here: the array itself is read back.
    host = _aligned(4096)
    held = as_array(host)
    host[:] = 5.0
    np.testing.assert_array_equal(np.asarray(held), np.ones(4096, np.float32))
    logits = _aligned(4096).reshape(2, 1024, 2)
    labels = np.zeros(1024, np.int32)
    value = ee.metrics.nll(logits, labels, from_logits=True)
    logits[..., 1] = 1000.0
    np.testing.assert_allclose(float(value), np.log(2.0), rtol=1e-6)
    # A masked array is refused, as `jnp.asarray` refuses it (a copy to a
    # plain array would have used its masked values).
    with pytest.raises(ValueError, match="masked arrays are not supported"):
        as_array(np.ma.masked_array([0.0, 1e6], mask=[0, 1]))
    # A host-to-device guard sees the library's transfers as the implicit
    # ones they are (as `jnp.asarray`'s were), not as explicit `device_put`s.
    with jax.transfer_guard_host_to_device("disallow"):
        with pytest.raises(Exception, match="host-to-device transfer"):
            ee.metrics.nll(np.zeros((2, 3, 2), np.float32), labels[:3])


def test_combining_and_in_bag_counts_are_one_program_each():
    # Op by op, a first call of `log_mean_probs_from_logits` compiled twenty
    # programs per shape, `gaussian_mixture` five, `Bootstrap.in_bag` eleven.
    rng = np.random.default_rng(1)
    logits = jnp.asarray(rng.normal(size=(5, 29, 3)).astype(np.float32) * 3)
    out = []
    combined = lambda: out.append(ee.combine.log_mean_probs_from_logits(logits))
    assert compilations(combined) == 1
    host = np.asarray(logits, np.float64)
    probs = np.exp(host - host.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    probs_mean = probs.mean(0)
    np.testing.assert_allclose(out[0], np.log(probs_mean), rtol=1e-5, atol=1e-6)

    means, variances = logits[..., 0], jnp.abs(logits[..., 1])
    mixed = lambda: out.append(ee.combine.gaussian_mixture(means, variances))
    assert compilations(mixed) == 1
    m, v = np.asarray(means, np.float64), np.asarray(variances, np.float64)
    np.testing.assert_allclose(out[1][0], m.mean(0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out[1][1], v.mean(0) + m.var(0), rtol=1e-5, atol=1e-6)

    key, bootstrap = jax.random.key(7), ee.Bootstrap()
    bootstrap.in_bag(key, size=4, num_examples=40)  # the run's keys: compiled
    counted = lambda: out.append(bootstrap.in_bag(key, size=4, num_examples=41))
    assert compilations(counted) == 1
    from eqx_ensemble._internal.keys import run_keys

    resamples = np.asarray(bootstrap.prepare(run_keys(key).bootstrap, 4, 41))
    by_hand = np.stack([np.bincount(row, minlength=41) for row in resamples])
    np.testing.assert_array_equal(out[2], by_hand)
    # The counts are static in the program: checked as ints there.
    for bad, message in [(True, "got bool"), (0, "at least 1")]:
        with pytest.raises((TypeError, ValueError), match=message):
            bootstrap.in_bag(key, size=bad, num_examples=41)
    # `mean_probs_from_logits` is one program too: exp of the log-mean.
    probs = lambda: out.append(ee.combine.mean_probs_from_logits(logits))
    assert compilations(probs) == 1
    np.testing.assert_allclose(out[3], probs_mean, rtol=1e-5, atol=1e-6)
    # Each term of the mixture is weighted in its own array's dtype: bf16
    # means do not round f32 variances' weights (7 members: 1/7 in bf16 is
    # 0.1426..., and 7 of them sum to 0.998).
    with jax.numpy_dtype_promotion("standard"):
        _, var = ee.combine.gaussian_mixture(
            jnp.zeros((7, 3), jnp.bfloat16), jnp.full((7, 3), 1000.0)
        )
    assert var.dtype == jnp.float32
    np.testing.assert_allclose(var, 1000.0, rtol=1e-6)


def test_a_metric_in_a_callers_jit_checks_the_arrays_it_closes_over():
    # Labels, probabilities and variances closed over by the caller's trace
    # are concrete: their checks read them there (before: a
    # ConcretizationTypeError from the check's own compiled reduction), and
    # the metric is the one computed outside.
    logits = jax.random.normal(jax.random.key(3), (3, 12, 4))
    labels = jnp.arange(12) % 4
    inside = jax.jit(lambda lg: ee.metrics.nll(lg, labels, from_logits=True))
    np.testing.assert_allclose(
        inside(logits), ee.metrics.nll(logits, labels, from_logits=True), rtol=1e-6
    )
    wrong = jnp.arange(12) % 4 + 1
    with pytest.raises(ValueError, match="the first out-of-range label is 4"):
        jax.jit(lambda lg: ee.metrics.nll(lg, wrong, from_logits=True))(logits)
    probs = jax.nn.softmax(logits).at[0, 1, 0].set(jnp.nan)
    with pytest.raises(
        ValueError, match=r"NaN or infinite values, first at index \(0, 1, 0\)"
    ):
        jax.jit(lambda: ee.metrics.nll(probs, labels))()
    variances = jnp.ones((3, 12)).at[1, 2].set(-1.0)
    with pytest.raises(ValueError, match="member 1, example 2"):
        jax.jit(lambda m: ee.metrics.gaussian_nll(m, variances, jnp.zeros(12)))(
            jnp.zeros((3, 12))
        )


def _swag_posterior():
    ens = ee.ensemble(
        lambda k: eqx.nn.MLP(3, 2, 8, 2, key=k), size=3, key=jax.random.key(30)
    )
    x = jax.random.normal(jax.random.key(31), (24, 3))
    return ee.fit(
        ens,
        lambda m, b, k: jnp.mean((jax.vmap(m)(b) - 1.0) ** 2),
        optax.sgd(0.05),
        x,
        steps=12,
        batch_size=8,
        key=jax.random.key(32),
        callbacks=(),
        track=[ee.SWAG(start=3, rank=3)],
    ).tracked[0]


def test_a_swag_draw_is_one_program_and_the_formula_run_op_by_op():
    """`SWAGPosterior.sample` is one program per structure, draw count and
    scale (op by op: 73 for 5 MLPs x 4 draws); another key compiles nothing;
    the draws are the formula run op by op, to the last bit but for fused
    multiply-adds."""
    from eqx_ensemble._trackers.swag import _draw

    posterior = _swag_posterior()
    draws = []
    names = compiled_programs(
        lambda: draws.append(posterior.sample(jax.random.key(1), 4))
    )
    assert names.count("jit(_traced)") == 1 and len(names) <= 2, names
    assert compilations(lambda: posterior.sample(jax.random.key(2), 4)) == 0
    assert compilations(lambda: posterior.sample(jax.random.key(2), 4, scale=2.0)) == 1
    with jax.disable_jit():
        eager = _draw(posterior, jax.random.key(1), samples=4, root_scale=0.5**0.5)
    leaves = lambda tree: jax.tree.leaves(eqx.filter(tree, eqx.is_array))  # noqa: E731
    for got, want in zip(leaves(draws[0]), leaves(eager), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


def test_greedy_selection_gathers_each_selection_in_one_program():
    """A selection's rows are one gather program per selection size (op by
    op: five per size), and `score` runs as written: on concrete arrays, so
    its own input checks and side effects work as outside the library."""
    rng = np.random.default_rng(0)
    labels = jnp.asarray(rng.integers(0, 3, 50))
    logits = jnp.asarray(rng.normal(size=(6, 50, 3)), jnp.float32)
    seen = []

    def score(p):
        value = ee.metrics.nll(p, labels, from_logits=True)
        seen.append(float(value))  # a concrete value, as in a user's loop
        return value

    picks = []
    names = compiled_programs(
        lambda: picks.append(ee.greedy_selection(logits, score, size=4))
    )
    assert names.count("jit(_take_leaves)") == 4, names  # sizes 1, 2, 3 and 4
    assert "jit(gather)" not in names, names
    assert len(seen) == 6 + 3 * 6
    # The metric's own check sees the predictions: probabilities out of range.
    doubled = 2 * jax.nn.softmax(logits)
    with pytest.raises(ValueError, match=r"probabilities in \[0, 1\]"):
        ee.greedy_selection(doubled, lambda p: ee.metrics.nll(p, labels), size=2)
    # By hand: the NLL of each selection's mean probabilities.
    probs = np.asarray(jax.nn.softmax(logits), np.float64)

    def nll(rows):
        mean = probs[rows].mean(0)
        return -np.mean(np.log(mean[np.arange(50), np.asarray(labels)]))

    chosen = [int(np.argmin([nll([i]) for i in range(6)]))]
    while len(chosen) < 4:
        chosen.append(int(np.argmin([nll(chosen + [i]) for i in range(6)])))
    assert picks[0].tolist() == chosen


def test_prediction_sets_compile_one_program_for_their_scores():
    """APS/RAPS calibration scores the true labels in one program per shape
    and the sets are one more (op by op: ~20 each); another calibration
    split of the same shape compiles nothing; the threshold is the rank's
    score of a NumPy computation of the paper's rule."""
    logits = 2 * jax.random.normal(jax.random.key(0), (4, 120, 6))
    labels = jax.random.randint(jax.random.key(1), (120,), 0, 6)
    key = jax.random.key(2)

    def calibrate(rows):
        return ee.conformal.raps(
            logits[:, rows], labels[rows], alpha=0.2, penalty=0.05, k_reg=1,
            from_logits=True, key=key,
        )  # fmt: skip

    first, second = np.arange(0, 60), np.arange(60, 120)
    calibrate(first)
    calibrated = []
    assert compilations(lambda: calibrated.append(calibrate(second))) <= 1  # slice
    sets = []
    test = logits[:, :30]
    names = compiled_programs(
        lambda: sets.append(calibrated[0].sets(test, from_logits=True, key=key))
    )
    # The logits' finiteness check at the new shape, and the sets.
    assert sorted(names) == ["jit(_any_nan_or_inf)", "jit(_traced)"], names
    assert (
        compilations(lambda: calibrated[0].sets(test, from_logits=True, key=key)) == 0
    )
    # The paper's rule by NumPy (float64): mass above, u times its own, penalty.
    probs = np.asarray(jax.nn.softmax(logits[:, second], axis=-1), np.float64).mean(0)
    u = np.asarray(jax.random.uniform(key, (60,)), np.float64)
    scores = []
    for i, label in enumerate(np.asarray(labels[second])):
        order = list(np.argsort(-probs[i], kind="stable"))
        rank = order.index(label)
        above = probs[i][order[:rank]].sum()
        scores.append(above + u[i] * probs[i][label] + 0.05 * max(0, rank + 1 - 1))
    expected = np.sort(scores)[int(np.ceil(61 * 0.8)) - 1]
    assert calibrated[0].quantile == pytest.approx(expected, rel=1e-5)


def test_init_optimizer_is_one_program_per_optimizer_and_structure():
    """`ee.init_optimizer` compiles the members' optimizer init as one program
    (op by op with per-member hyperparameters: 37 programs for 16 MLPs) and
    checks the hyperparameters on shapes only; an equal optimizer and other
    values compile nothing; the state is `filter_vmap(init)` run op by op."""
    ens = ee.ensemble(
        lambda k: eqx.nn.MLP(8, 1, 16, 2, key=k), size=6, key=jax.random.key(50)
    )

    def make():
        return optax.inject_hyperparams(optax.adam)(learning_rate=1e-3)

    rates = np.geomspace(1e-4, 1e-2, 6)
    states = []
    names = compiled_programs(
        lambda: states.append(
            ee.init_optimizer(make(), ens, hyperparams={"learning_rate": rates})
        )
    )
    assert names.count("jit(_traced)") == 1 and len(names) <= 3, names
    other = {"learning_rate": rates[::-1].copy()}
    assert compilations(lambda: ee.init_optimizer(make(), ens, hyperparams=other)) == 0
    with jax.disable_jit():
        eager = eqx.filter_vmap(make().init)(
            eqx.filter(ens.members, eqx.is_inexact_array)
        )
    got = jax.tree.leaves(states[0])
    want = jax.tree.leaves(eager)
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        if g.shape == (6,) and g.dtype == jnp.float32 and not np.array_equal(g, w):
            np.testing.assert_allclose(g, rates, rtol=1e-6)  # the rates set
        else:
            np.testing.assert_array_equal(g, w)


def test_a_pbt_round_is_one_program():
    """A round of `ee.PBT` (copies of the best members' runs, the explored
    hyperparameters perturbed) is one program for the run's structure (op by
    op: a gather and more per leaf shape, ~30 programs at the first round);
    the runs are those `tests/test_pbt.py` checks against hand-made copies."""
    x = jax.random.normal(jax.random.key(1), (128, 3))
    data = (x, jnp.sin(x[:, 0]))
    ens = ee.ensemble(
        lambda k: eqx.nn.MLP(3, 1, 8, 2, key=k), size=4, key=jax.random.key(2)
    )

    def loss(model, batch, key):
        return jnp.mean((jax.vmap(model)(batch[0])[:, 0] - batch[1]) ** 2)

    def run():
        opt = optax.inject_hyperparams(optax.adam)(learning_rate=1e-3)
        rates = {"learning_rate": np.geomspace(1e-4, 1e-1, 4)}
        state = ee.init_optimizer(opt, ens, hyperparams=rates)
        pbt = ee.PBT(every=10, fraction=0.5, hyperparams=("learning_rate",))
        evaluate = ee.Evaluate(loss, data, every=5)
        result = ee.fit(
            ens, loss, opt, data, steps=30, batch_size=32, key=jax.random.key(3),
            evaluate=evaluate, opt_state=state, callbacks=[pbt],
        )  # fmt: skip
        return pbt.lineage(result)

    names = compiled_programs(run)
    # Op by op, every round's gathers of the runs' leaves were programs.
    assert "jit(gather)" not in names and "jit(_take)" not in names, names
    lineage = []
    assert compilations(lambda: lineage.append(run())) == 0
    assert len(lineage[0][0]) == 3 * 2  # rounds at steps 10, 20, 30; two copies each


def test_init_programs_are_shared_bounded_and_not_poisoned():
    """Two optimizers that differ only in their updates (learning rates)
    share the init program; a function that reads a value for one argument
    structure (run op by op) stays compiled for another; a number and the
    equal number of another type (`2`, `2.0`) are different static
    arguments."""
    from eqx_ensemble._execution.compile import compiled_call

    ens = ee.ensemble(
        lambda k: eqx.nn.MLP(3, 1, 5, 1, key=k), size=3, key=jax.random.key(51)
    )
    ee.init_optimizer(optax.adam(1e-3), ens)
    assert compilations(lambda: ee.init_optimizer(optax.adam(7e-3), ens)) == 0

    # A function that reads a value for one argument structure runs op by op
    # for that structure only.
    def maybe_reading(x, read):
        return x * float(x.sum()) if read else x * 2.0

    x, y = jnp.arange(3.0), jnp.arange(1.0, 4.0)
    np.testing.assert_array_equal(compiled_call(maybe_reading, x, True), x * 3.0)
    assert compilations(lambda: compiled_call(maybe_reading, y, True)) == 0
    assert compilations(lambda: compiled_call(maybe_reading, x, False)) == 1

    def typed(x, number):  # what the program computes depends on the type
        return x + (1.0 if isinstance(number, float) else 0.0)

    np.testing.assert_array_equal(compiled_call(typed, x, 2), x)
    np.testing.assert_array_equal(compiled_call(typed, x, 2.0), x + 1.0)
    np.testing.assert_array_equal(compiled_call(typed, x, True), x)


def test_a_per_member_calibrator_search_and_fit_share_one_program():
    # The penalty search's 30 fits (one `l2` for every member) and the final
    # fit (each member's chosen `l2`) are one program: the penalty is passed
    # as one value per member in both (a first fit compiled two, ~4 s each).
    logits = 3 * jax.random.normal(jax.random.key(0), (2, 90, 3))
    labels = jax.random.randint(jax.random.key(1), (90,), 0, 3)
    names = compiled_programs(
        lambda: ee.calibration.fit_vector_scaling(
            logits, labels, per_member=True, iterations=30
        )
    )
    assert names.count("jit(_fit_affine_params)") == 1, names


def test_the_host_comparisons_see_what_eqx_tree_equal_and_strict_jnp_saw():
    # The suite compares on the host (compiling nothing); these are the
    # differences a host copy could lose, each still a difference.
    key = jax.random.key(0)
    assert tree_equal(key, jax.random.key(0))
    assert not tree_equal(key, jax.random.key_data(key))  # raw data, not a key
    rbg, unsafe = (jax.random.key(0, impl=i) for i in ("rbg", "unsafe_rbg"))
    assert not tree_equal(rbg, unsafe)  # the same data, another implementation
    half = jnp.ones(3, jnp.bfloat16)
    assert not tree_equal(half, jnp.ones(3))  # another dtype
    assert not tree_equal(half, half * 1.0078125)  # one bf16 ulp, exactly
    assert tree_equal(half, half * 1.0078125, rtol=1e-2)  # bf16 takes tolerances
    assert not tree_equal(jnp.array([jnp.nan]), jnp.array([jnp.nan]))
    assert_tree_allclose(jnp.ones(3), np.ones(3))  # a float64 reference, as held
    assert_tree_allclose(key, jax.random.key(0))
    assert_tree_allclose(jnp.full(3, 1.0000001), 1.0)  # a number: tolerances
    bf16_scalar = np.asarray(jnp.ones((), jnp.bfloat16))[()]
    assert_tree_allclose(jnp.ones((), jnp.bfloat16), bf16_scalar)
    differ = [
        (jnp.ones(3), half),
        (jnp.ones(3), jnp.ones(3, jnp.int32)),
        (jnp.ones(3, bool), jnp.ones(3, jnp.int32)),
        (key, jax.random.key_data(key)),
        (jnp.ones(3), jnp.ones((1, 3))),
        (jnp.ones(2, jnp.complex64), jnp.zeros(2, jnp.complex64)),
    ]
    for a, b in differ:
        with pytest.raises(AssertionError):
            assert_tree_allclose(a, b)


# Float hyperparameters Optax applies as one multiplication are inputs of the
# program (`_execution/lift.py`): a sweep over them compiles once.
LIFTED = {
    "learning rate": lambda v: optax.adam(v),
    "momentum": lambda v: optax.sgd(0.05, momentum=v),
    "weight decay and learning rate": lambda v: optax.adamw(v / 100, weight_decay=v),
}


@pytest.mark.parametrize("name", LIFTED)
def test_a_new_learning_rate_momentum_or_weight_decay_compiles_nothing(name):
    make = LIFTED[name]
    first = fit(make(0.5))
    assert compilations(lambda: fit(make(0.25))) == 0
    second = fit(make(0.25))
    assert not tree_equal(first.ensemble, second.ensemble)  # the value is used
    opt = make(0.5)
    ee.make_step(make_loss(), opt)(ENS, ee.init_optimizer(opt, ENS), DATA, KEY)
    opt = make(0.125)
    step = ee.make_step(make_loss(), opt)
    opt_state = ee.init_optimizer(opt, ENS)
    assert compilations(lambda: step(ENS, opt_state, DATA, KEY)) == 0


KEY = jax.random.key(3)


def test_other_optimizer_constants_still_compile():
    # Adam's b1 enters as `1 - b1`, computed in double precision: a constant.
    fit(optax.adam(1e-2, b1=0.8))
    assert compilations(lambda: fit(optax.adam(1e-2, b1=0.7))) > 0


_LIFTED_RUN = """
import sys
sys.path.insert(0, {tests!r})
import numpy as np
import optax
from test_compile_once import bits, fit
from eqx_ensemble._execution import lift

def run():
    return [bits(fit(optax.adamw(2e-3, weight_decay=0.3))),
            bits(fit(optax.sgd(0.05, momentum=0.7), steps=7))]

fresh = run()
lift._CODES.clear()  # every value a constant of its program, as before
lift._LIFTS.clear()
constant = run()
np.savez({out!r}, *fresh, *constant)
"""


def bits(result) -> np.ndarray:
    """A run's losses and trained weights, one flat array."""
    leaves = jax.tree.leaves(eqx.filter(result.ensemble, eqx.is_array))
    parts = [result.history.losses, *leaves]
    return np.concatenate([np.ravel(np.asarray(x)) for x in parts])


def test_lifted_values_give_the_bits_of_constants_and_of_a_fresh_process(tmp_path):
    import subprocess
    import sys

    fit(optax.adamw(1e-3, weight_decay=0.1))  # programs traced for other values
    fit(optax.sgd(0.1, momentum=0.9), steps=7)
    here = [
        bits(fit(optax.adamw(2e-3, weight_decay=0.3))),
        bits(fit(optax.sgd(0.05, momentum=0.7), steps=7)),
    ]
    out = tmp_path / "out.npz"
    script = _LIFTED_RUN.format(tests=os.path.dirname(__file__), out=str(out))
    subprocess.run([sys.executable, "-c", script], check=True)
    saved = np.load(out)
    fresh_adamw, fresh_sgd, constant_adamw, constant_sgd = (
        saved[f"arr_{i}"] for i in range(4)
    )
    np.testing.assert_array_equal(here[0], fresh_adamw)
    np.testing.assert_array_equal(here[1], fresh_sgd)
    np.testing.assert_array_equal(constant_adamw, fresh_adamw)
    np.testing.assert_array_equal(constant_sgd, fresh_sgd)
