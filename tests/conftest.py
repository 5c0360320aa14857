"""Test configuration: 8 virtual CPU devices, strict promotion, a key fixture."""

import os

# Must happen before JAX initialises its backends.
os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import gc  # noqa: E402
import itertools  # noqa: E402

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
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


def tree_allclose(a, b, *, rtol=1e-5, atol=1e-6) -> bool:
    """`eqx.tree_equal` with float32 tolerances, as a plain bool."""
    return bool(eqx.tree_equal(a, b, rtol=rtol, atol=atol))


def assert_tree_allclose(a, b, *, rtol=1e-5, atol=1e-6):
    flat_a, tree_a = jax.tree_util.tree_flatten_with_path(a)
    flat_b, tree_b = jax.tree_util.tree_flatten_with_path(b)
    assert tree_a == tree_b, f"structures differ:\n{tree_a}\n{tree_b}"
    for (path, x), (_, y) in zip(flat_a, flat_b, strict=True):
        if eqx.is_array(x):
            assert jnp.allclose(x, y, rtol=rtol, atol=atol), (
                f"leaf {jax.tree_util.keystr(path)} differs: max abs diff "
                f"{float(jnp.max(jnp.abs(x - y)))}"
            )
        else:
            assert x == y, f"leaf {jax.tree_util.keystr(path)}: {x!r} != {y!r}"
