"""What a dataset of MNIST's size costs `fit` per call: epoch orders, NumPy copies.

Without replacement (`ee.Shared`, `ee.Independent`), step `s` takes a slice of
`jax.random.permutation(fold_in(data_key, s // E), n)`, drawn inside the
compiled dispatch. JAX shuffles by sorting random keys with the indices as
values, which XLA's CPU runs ~5x slower than a sort of the keys alone; on a
CPU the library sorts the keys alone and places each index where the stable
sort would (`_core.data.permutation`: the same bits). Printed, in one run:

1. the permutation alone, n = 20,000 and 60,000: the library's against
   `jax.random.permutation` (ratio > 1: the library faster; the bits are
   checked equal);
2. `fit` on 60,000 examples (8 MLPs 10-32-32-1, batch 128, Adam) at 20 and 200
   steps per call, against the loop a user would write: `ee.make_step` on
   batches gathered from a NumPy permutation drawn on the host at the start
   of each epoch (ratio > 1: `fit` faster per step). Each timed block is one
   run from step 0, as each `fit` call is: both draw an epoch's order in it.

3. `fit` given 60,000 examples of 784 features (188 MB) as NumPy arrays
   against the same data as JAX arrays, 20 steps per call (8 MLPs 784-32-1):
   NumPy arrays are copied to the device at every call.

Variants are timed round-robin (medians).

    python benchmarks/bench_large_data.py [--quick] [--repeats N]
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common  # noqa: E402

N, MEMBERS, BATCH = 60_000, 8, 128


def permutations(args, repeats: int) -> dict:
    import jax
    import numpy as np

    from eqx_ensemble._core.data import permutation

    out = {}
    for n in (20_000, N):
        ours = jax.jit(lambda k, e, n=n: permutation(jax.random.fold_in(k, e), n))
        theirs = jax.jit(
            lambda k, e, n=n: jax.random.permutation(jax.random.fold_in(k, e), n)
        )
        key = jax.random.key(0)
        np.testing.assert_array_equal(ours(key, 3), theirs(key, 3))
        epoch = iter(range(10**9))
        times = _common.interleaved(
            {
                "ee": lambda f=ours: f(key, next(epoch)).block_until_ready(),
                "jax": lambda f=theirs: f(key, next(epoch)).block_until_ready(),
            },
            repeats=repeats,
        )
        ee_ms, jax_ms = (_common.median(times[k]) * 1e3 for k in ("ee", "jax"))
        print(
            f"   permutation of {n:6d}: ee {ee_ms:7.2f} ms, jax.random.permutation "
            f"{jax_ms:7.2f} ms: {jax_ms / ee_ms:.2f}x"
        )
        out[f"permutation {n}"] = {"ee_ms": ee_ms, "jax_ms": jax_ms}
    return out


def fit_rows(args, repeats: int) -> dict:
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import eqx_ensemble as ee

    ens = ee.ensemble(
        lambda k: eqx.nn.MLP(10, 1, 32, 2, key=k), size=MEMBERS, key=jax.random.key(0)
    )
    x = jax.random.normal(jax.random.key(2), (N, 10))
    y = x.sum(axis=1)
    optimizer = optax.adam(1e-3)

    def loss(model, batch, key):
        xb, yb = batch
        return jnp.mean((jax.vmap(model)(xb)[:, 0] - yb) ** 2)

    step = ee.make_step(loss, optimizer)
    gather = jax.jit(lambda x, y, rows: (x[rows], y[rows]))
    per_epoch = N // BATCH
    step_key = jax.random.key(3)  # the loss draws nothing from it
    out = {}
    for steps in (20, 200):
        loop = {"ens": ens, "opt": ee.init_optimizer(optimizer, ens), "run": 0}

        def run_fit(steps=steps):
            result = ee.fit(
                ens, loss, optimizer, (x, y), steps=steps, batch_size=BATCH,
                key=jax.random.key(1), callbacks=(),
            )  # fmt: skip
            jax.block_until_ready(result.ensemble)

        def run_loop(steps=steps, loop=loop):
            # A run of `steps` steps from step 0, as each `fit` call is: its
            # first epoch's order drawn at its start.
            loop["run"] += 1
            for s in range(steps):
                epoch, position = divmod(s, per_epoch)
                if position == 0:
                    rng = np.random.default_rng((loop["run"], epoch))
                    order = rng.permutation(N)
                rows = order[position * BATCH : (position + 1) * BATCH]
                out_ = step(loop["ens"], loop["opt"], gather(x, y, rows), step_key)
                loop["ens"], loop["opt"] = out_.ensemble, out_.opt_state
            jax.block_until_ready(loop["ens"])

        times = _common.interleaved(
            {"fit": run_fit, "make_step loop": run_loop}, repeats=repeats
        )
        fit_ms, loop_ms = (
            _common.median(times[k]) * 1e3 / steps for k in ("fit", "make_step loop")
        )
        print(
            f"   fit, {steps:3d} steps per call: {fit_ms:.3f} ms per step; make_step "
            f"loop {loop_ms:.3f} ms: fit {loop_ms / fit_ms:.2f}x"
        )
        out[f"fit {steps}"] = {"fit_ms_per_step": fit_ms, "loop_ms_per_step": loop_ms}
    return out


def host_data_rows(args, repeats: int) -> dict:
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import eqx_ensemble as ee

    features = 784
    ens = ee.ensemble(
        lambda k: eqx.nn.MLP(features, 1, 32, 1, key=k),
        size=MEMBERS,
        key=jax.random.key(0),
    )
    x_host = np.random.default_rng(0).normal(size=(N, features)).astype(np.float32)
    y_host = x_host[:, 0].copy()
    on_host, on_device = (x_host, y_host), (jnp.asarray(x_host), jnp.asarray(y_host))
    optimizer = optax.adam(1e-3)

    def loss(model, batch, key):
        xb, yb = batch
        return jnp.mean((jax.vmap(model)(xb)[:, 0] - yb) ** 2)

    def run(data):
        result = ee.fit(
            ens, loss, optimizer, data, steps=20, batch_size=BATCH,
            key=jax.random.key(1), callbacks=(),
        )  # fmt: skip
        jax.block_until_ready(result.ensemble)

    times = _common.interleaved(
        {"numpy": lambda: run(on_host), "jax": lambda: run(on_device)},
        repeats=repeats,
    )
    numpy_ms, jax_ms = (_common.median(times[k]) * 1e3 for k in ("numpy", "jax"))
    print(
        f"   fit, 20 steps, {N} x {features} data: NumPy arrays {numpy_ms:.1f} ms per "
        f"call, JAX arrays {jax_ms:.1f} ms: {numpy_ms / jax_ms:.2f}x"
    )
    return {"host data": {"numpy_ms": numpy_ms, "jax_ms": jax_ms}}


def main() -> None:
    p = _common.parser(__doc__.splitlines()[0])
    args = p.parse_args()
    import jax

    _common.print_header(f"a dataset of MNIST's size on {_common.jax_device_name()}")
    repeats = args.repeats or (3 if args.quick else 11)
    results = permutations(args, repeats)
    results.update(fit_rows(args, repeats))
    results.update(host_data_rows(args, repeats))
    results["backend"] = jax.default_backend()
    _common.emit_summary("large_data", results, args.json)


if __name__ == "__main__":
    main()
