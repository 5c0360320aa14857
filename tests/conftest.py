"""Test configuration: 8 virtual CPU devices, strict promotion, a key fixture."""

import os
import sys

# Must happen before JAX initialises its backends.
os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
# The tests' programs are tiny and compiled once each: XLA's compilation is most
# of the suite's time, their running a few percent. XLA's older CPU emitters and
# LLVM without optimisation compile them in about half the time (test_loop.py:
# 51 -> 24 s of compilation), the library's training steps included (its
# level 1 leaves a level `XLA_FLAGS` set); the few tests that compare two
# programs on dynamics that amplify rounding (a heterogeneous group and the
# same members alone under Adam, a diverging member) pin the library's level 1
# with the `library_codegen` fixture (tests/README.md).
# XLA also splits each program's LLVM module in up to 32 parts compiled on its
# thread pool: on two cores, for programs this small, one part compiles sooner
# (test_loop.py and test_heterogeneous.py: 54 -> 44 s of compilation, round 4
# session 21), and no test's result changed.
# `EE_TEST_XLA_DEFAULTS=1` (set by `make test-all`) runs the suite with XLA's
# defaults, the programs users run.
# A test whose claim is about XLA's own output (a demo's numbers, "these options
# change no bits") runs its code in a process with the defaults:
# `run_with_xla_defaults`.
FAST_COMPILE_FLAGS = (
    "--xla_cpu_use_fusion_emitters=false",
    "--xla_backend_optimization_level=0",
    "--xla_cpu_parallel_codegen_split_count=1",
)


def _known_to_xla(flags: list[str]) -> list[str]:
    """Those of `flags` this jaxlib's XLA knows. XLA ends the process at an
    unknown flag (jaxlib 0.11 dropped `xla_cpu_use_fusion_emitters`), so a
    child process tries them, once per test run (the workers and the tests'
    processes inherit the flags)."""
    import subprocess

    def starts(tried: list[str]) -> bool:
        env = dict(os.environ, JAX_PLATFORMS="cpu")
        env["XLA_FLAGS"] = " ".join([env["XLA_FLAGS"], *tried])
        child = [sys.executable, "-c", "import jax; jax.devices()"]
        return subprocess.run(child, env=env, capture_output=True).returncode == 0

    if not flags or starts(flags):
        return flags
    return [flag for flag in flags if starts([flag])]


if not os.environ.get("EE_TEST_XLA_DEFAULTS") and not os.environ.get(
    "EE_TEST_XLA_FLAGS_TRIED"  # by the process that started this one
):
    _missing = [
        flag
        for flag in FAST_COMPILE_FLAGS
        if flag.split("=")[0] not in os.environ["XLA_FLAGS"]
    ]
    for _flag in _known_to_xla(_missing):
        os.environ["XLA_FLAGS"] += " " + _flag
    os.environ["EE_TEST_XLA_FLAGS_TRIED"] = "1"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Bytecode is written even where the environment says not to
# (`PYTHONDONTWRITEBYTECODE`, set on this project's machines): jaxtyping's
# import hook rewrites every library module for the type checks, and pytest
# every test module for its asserts, in each worker and each process a test
# starts; from their cached bytecode a worker collects the suite in 8 s
# instead of 13.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False
# One on-disk compilation cache for the whole test run, shared by the xdist
# workers and every process the tests start (multi-process runs, killed and
# resumed runs, notebooks inherit the environment): a program that one test
# compiled is read back by the next that compiles the same computation. Kept
# between runs in `.cache/xla-tests` (`make clean` removes it); a damaged entry
# is compiled again (JAX warns, pyproject's filterwarnings lets that through).
# Writing only the programs that took 0.1 s or more to compile (the `fit`
# programs, not ~12,000 small ones) made no difference: 233.2 against 233.9 s
# on seven files, two single-worker runs side by side (round 4, session 24).
os.environ.setdefault(
    "JAX_COMPILATION_CACHE_DIR",
    os.path.join(os.path.dirname(os.path.dirname(__file__)), ".cache", "xla-tests"),
)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import gc  # noqa: E402
import itertools  # noqa: E402
import subprocess  # noqa: E402
from collections.abc import Sequence  # noqa: E402

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")

# Every program XLA compiles for the CPU keeps its machine code in memory maps of
# its own (a few hundred per test here), held until JAX's caches drop the
# executable. A worker that runs ~570 tests reaches the kernel's limit on maps
# per process (`vm.max_map_count`, 65530 by default); the next compilation's
# mmap fails and XLA crashes with a segmentation fault (it did, in CI, at 99%).
# So: when a worker holds more than MAX_MAPS maps after a test, drop JAX's caches.
MAX_MAPS = 20_000
_MAPS = f"/proc/{os.getpid()}/maps"


def _map_count() -> int | None:
    try:
        with open(_MAPS, "rb") as maps:
            return sum(1 for _ in maps)
    except OSError:  # not Linux
        return None


@pytest.fixture(autouse=True)
def _bounded_memory_maps():
    yield
    count = _map_count()
    if count is not None and count > MAX_MAPS:
        jax.clear_caches()
        gc.collect()


@pytest.fixture(autouse=True, scope="module")
def _fresh_caches_per_file():
    """JAX's caches emptied after each test file. A worker that keeps every
    file's programs lowers and compiles ever slower: `tests/test_map.py`'s
    programs lowered in 10 ms each in a fresh worker and in 40 ms after 800
    other tests (MLIR's context for one lowering alone: 3.7 ms in a fresh
    process, 8 ms after 1,500 programs kept). Two single-worker runs of the
    same 34 files side by side (round 4, session 21): the same 643 tests took
    333 s with this and 402 s without (lowering 61 s against 98 s, compiling
    131 s against 161 s), although 14% more programs were compiled again (a
    file's programs are seldom another file's; the disk cache has them). No
    `gc.collect()`: over a worker's heap it cost about a second per file."""
    yield
    jax.clear_caches()


def run_with_xla_defaults(code: str, *args: str, timeout: float = 300) -> str:
    """Run `code` (a Python script) with `args` in a fresh process compiling with
    XLA's default flags (and this suite's device count); its standard output.
    """
    env = dict(os.environ, EE_TEST_XLA_DEFAULTS="1")
    env["XLA_FLAGS"] = " ".join(
        flag for flag in env["XLA_FLAGS"].split() if flag not in FAST_COMPILE_FLAGS
    )
    done = subprocess.run(
        [sys.executable, "-c", code, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout


# How `make test` spreads the tests over its xdist workers (`--dist loadgroup`):
# a test file is one unit of work (its module fixtures built and its programs
# traced on one worker only), except in the files below, where every test is
# a unit of its own: each docs page, notebook and docstring compiles programs
# of its own, and a file of them on one worker would outlast the rest of the
# suite. xdist hands out the units with the most tests first, so the last
# ones are single tests (the longest ~30 s). A scheduler of our own gives the
# units (xdist's `xdist_group` marks did it until pytest 9.2, whose
# `Item.nodeid` no longer reads the `_nodeid` that xdist 3.8 renames: every
# test was then scheduled alone and a file's tests spread over both workers:
# pytest-dev/pytest-xdist#1386).
_SPLIT_FILES = ("test_docs.py", "test_docs_training.py", "test_docs_methods.py",
                "test_docs_scale.py", "test_docstrings.py",
                "test_docstrings_modules.py", "test_notebooks.py",
                "test_notebooks_more.py", "test_multiprocess.py")  # fmt: skip


def unit_of_work(nodeid: str) -> str:
    """The unit of work a test belongs to: its file, or itself in a split file."""
    path = nodeid.split("::")[0]
    return nodeid if os.path.basename(path) in _SPLIT_FILES else path


@pytest.hookimpl(optionalhook=True)  # without xdist (`-p no:xdist`): no such hook
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByUnitOfWork(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return unit_of_work(nodeid)

    return ByUnitOfWork(config, log)


_CACHE_OPTIONS = (
    "jax_compilation_cache_dir",
    "jax_persistent_cache_min_compile_time_secs",
    "jax_persistent_cache_min_entry_size_bytes",
)


@pytest.fixture(autouse=True)
def _no_ambient_mesh():
    """A test leaves no mesh set for the process (`jax.set_mesh` without a
    `with`, in the library or a test): a later test's arrays would meet it
    ("Mesh for all inputs should be equal"). The leaking test fails, named."""
    yield
    leaked = jax.sharding.get_abstract_mesh()
    if not leaked.empty:
        jax.set_mesh(None)  # type: ignore[arg-type]
        pytest.fail(f"the test left an ambient mesh set: {leaked}")


@pytest.fixture(autouse=True)
def _keep_the_compilation_cache():
    """A test or an example that calls `ee.compilation_cache(folder)` moves
    the process's cache there; put the suite's back after it."""
    before = [getattr(jax.config, name) for name in _CACHE_OPTIONS]
    yield
    after = [getattr(jax.config, name) for name in _CACHE_OPTIONS]
    if after != before:
        from jax.experimental.compilation_cache import compilation_cache

        for name, value in zip(_CACHE_OPTIONS, before, strict=True):
            jax.config.update(name, value)
        compilation_cache.reset_cache()


@pytest.fixture
def library_codegen(monkeypatch):
    """The library's own LLVM level 1 for its CPU training steps, not the
    suite's `-O0` (which `XLA_FLAGS` set and the library lets stand): for a
    test that compares two different programs (a heterogeneous group and its
    members alone, chunked and whole members) on dynamics that amplify
    rounding (Adam, a diverging member). At level 1 such programs agree to
    the tolerances those tests assert; at `-O0` some differ by 1e-2
    (tests/README.md). The plans are made anew for the test: they hold the
    options."""
    import weakref

    from eqx_ensemble._execution import cache, compile as compile_module

    level = tuple(sorted(compile_module.FAST_CODEGEN.items()))
    monkeypatch.setattr(compile_module, "cpu_codegen_options", lambda: level)
    monkeypatch.setattr(cache, "_OWNED", weakref.WeakKeyDictionary())
    monkeypatch.setattr(cache, "_BY_ID", {})


class Interrupt(Exception):
    """Raised by `interrupt_at`'s callback: a run stopped as by a crash."""


def interrupt_at(step: int):
    """A `fit` callback raising `Interrupt` once the run has done `step` steps
    (a resume test's interrupted run)."""

    def interrupt(result):
        if result.step >= step:
            raise Interrupt

    return interrupt


def repeat(*values: object) -> object:
    """A parametrised case that repeats a check the default tier already makes
    with another case (a second axis type, sampling or size): run by
    `make test-all` only (marked slow). tests/README.md, "Repeats"."""
    return pytest.param(*values, marks=pytest.mark.slow)


def alternating(cases: Sequence[object], variants: Sequence[object]) -> list[object]:
    """Every case with every variant, as parameters (a case's values, then the
    variant); the default tier runs case `i` with variant `i % len(variants)`
    (so each case runs there, and each variant where there are at least as
    many cases as variants), and the other pairs are `repeat`s. A case is a
    tuple of values or a single value that is not a tuple."""
    params = []
    for i, case in enumerate(cases):
        values = case if isinstance(case, tuple) else (case,)
        for j, variant in enumerate(variants):
            pair = (*values, variant)
            params.append(pair if j == i % len(variants) else repeat(*pair))
    return params


def needs_devices(n: int) -> pytest.MarkDecorator:
    """Skip a test that builds a mesh of `n` devices where fewer exist (one GPU,
    say). On the CPU the 8 virtual devices above are always there, so CI runs
    every such test."""
    have = jax.device_count()
    return pytest.mark.skipif(have < n, reason=f"needs {n} devices, {have} here")


# Tolerances for a vectorised step against the same members run alone. On a CPU
# both run the same kernels to float32 rounding; on a GPU (an H100, session 21)
# they pick different kernels and agree to ~4e-5 even at the highest matmul
# precision.
ON_CPU = jax.default_backend() == "cpu"
MEMBERWISE_TOL = {} if ON_CPU else {"rtol": 1e-4, "atol": 1e-4}


@pytest.fixture
def getkey():
    """`getkey()` returns a fresh PRNG key each call, deterministic per test."""
    counter = itertools.count()
    base = jax.random.key(0)

    def _getkey():
        return jax.random.fold_in(base, next(counter))

    return _getkey


def _on_host(tree):
    """`tree` with its JAX arrays copied to NumPy. Compared there, a check
    compiles nothing: eagerly, `jnp` compiles a program per operation, shape
    and dtype (~20 ms each on these CPUs), and the suite's comparisons made
    about a thousand of them (round 4, session 25).

    A typed PRNG key becomes `("PRNG key", its implementation, its data)` and
    a float NumPy does not know as inexact (bfloat16, the float8s) becomes
    `(its dtype's name, the values as float32)` (exact, and compared with
    tolerances as NumPy's own floats are): neither equals raw key data, a
    key of another implementation or an array of another dtype."""

    def host(leaf):
        if isinstance(leaf, np.generic) and leaf.dtype.kind == "V":  # bf16 scalar
            leaf = np.asarray(leaf)
        if not isinstance(leaf, jax.Array | np.ndarray):
            return leaf
        if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            impl = str(jax.random.key_impl(leaf))
            return ("PRNG key", impl, np.asarray(jax.random.key_data(leaf)))
        leaf = np.asarray(leaf)
        if jax.dtypes.issubdtype(leaf.dtype, np.floating) and not np.issubdtype(
            leaf.dtype, np.inexact
        ):
            return (leaf.dtype.name, leaf.astype(np.float32))
        return leaf

    return jax.tree.map(host, tree)


def tree_equal(*trees, rtol=0.0, atol=0.0) -> bool:
    """`eqx.tree_equal` (structure, shapes, dtypes and values; exact unless
    given tolerances) as a plain bool, compared on the host."""
    return bool(eqx.tree_equal(*map(_on_host, trees), rtol=rtol, atol=atol))


def assert_tree_allclose(a, b, *, rtol=1e-5, atol=1e-6):
    """Equal structures, shapes and dtypes (as JAX holds them: a NumPy float64
    reference is float32 without x64) and `allclose` array leaves (NumPy's
    rule), compared on the host; the first leaf that differs named."""
    flat_a, tree_a = jax.tree_util.tree_flatten_with_path(_on_host(a))
    flat_b, tree_b = jax.tree_util.tree_flatten_with_path(_on_host(b))
    assert tree_a == tree_b, f"structures differ:\n{tree_a}\n{tree_b}"
    for (path, x), (_, y) in zip(flat_a, flat_b, strict=True):
        where = f"leaf {jax.tree_util.keystr(path)}"
        if eqx.is_array(x) or eqx.is_array(y):
            if eqx.is_array(x) and eqx.is_array(y):  # (a number: its value only)
                dtypes = [jax.dtypes.canonicalize_dtype(v.dtype) for v in (x, y)]
                assert x.shape == y.shape and dtypes[0] == dtypes[1], (
                    f"{where}: {dtypes[0]}{list(x.shape)} against "
                    f"{dtypes[1]}{list(y.shape)}"
                )
            x, y = np.asarray(x), np.asarray(y)
            close = (
                np.array_equal(x, y)
                if x.dtype == bool
                else np.allclose(x, y, rtol=rtol, atol=atol)
            )
            wide = np.result_type(x, y, np.float64)
            assert close, (
                f"{where} differs: max abs diff "
                f"{np.max(np.abs(np.subtract(x, y, dtype=wide)), initial=0)}"
            )
        else:
            assert x == y, f"{where}: {x!r} != {y!r}"


# Where a test's time goes: with EE_COMPILE_LOG=FILE, every worker appends one
# line per test (id, wall seconds, XLA compilations and their seconds, tracing
# and lowering seconds) to FILE.<worker>; `tests/compile_report.py FILE` sums it.
_COMPILE_LOG = os.environ.get("EE_COMPILE_LOG")
_SPENT = {"compiles": 0, "compile": 0.0, "trace": 0.0, "lower": 0.0}
_EVENTS = {
    "/jax/core/compile/backend_compile_duration": "compile",
    "/jax/core/compile/jaxpr_trace_duration": "trace",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
}


_BY_PROGRAM: dict[str, list[float]] = {}


def _on_duration(event: str, duration_secs: float, **metadata: str | int) -> None:
    name = _EVENTS.get(event)
    if name is not None:
        _SPENT[name] += duration_secs
        if name == "compile":
            _SPENT["compiles"] += 1
            spent = _BY_PROGRAM.setdefault(str(metadata.get("fun_name", "?")), [0, 0.0])
            spent[0] += 1
            spent[1] += duration_secs


if _COMPILE_LOG:
    import json
    import time

    jax.monitoring.register_event_duration_secs_listener(_on_duration)

    @pytest.fixture(autouse=True)
    def _compile_log(request):
        before = dict(_SPENT)
        start = time.perf_counter()
        yield
        row = {k: _SPENT[k] - before[k] for k in _SPENT}
        row["wall"] = time.perf_counter() - start
        row["test"] = request.node.nodeid
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        with open(f"{_COMPILE_LOG}.{worker}", "a") as log:
            log.write(json.dumps(row) + "\n")

    def pytest_sessionfinish(session):
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        with open(f"{_COMPILE_LOG}-programs.{worker}", "w") as log:
            json.dump(_BY_PROGRAM, log)
