"""Asynchronous checkpoints: what `fit` waits for with `Checkpoints(asynchronous=True)`.

One process: `ee.fit` of 8 MLPs 512-1024-1024-10 (Adam, batch 64) for 200 steps
with a checkpoint every 20 steps (10 checkpoints of the ensemble, its Adam
state and the run: 145 MiB each), written synchronously, asynchronously, and not
at all; the same run, round-robin, median of `--repeats` (default 3). The
checkpoint's cost is the run's time minus the run without checkpoints.

Run: `python benchmarks/bench_async_checkpoints.py` (`--quick`: smaller).
"""

import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common  # noqa: E402


def main() -> None:
    args = _common.parser(__doc__.splitlines()[0]).parse_args()
    repeats = args.repeats or (1 if args.quick else 3)
    _common.print_header("asynchronous checkpoints")
    import time

    import equinox as eqx
    import jax
    import optax

    import eqx_ensemble as ee

    width = 256 if args.quick else 1024
    steps, every = (40, 10) if args.quick else (200, 20)
    ens = ee.ensemble(
        lambda k: eqx.nn.MLP(512, 10, width, 2, key=k), size=8, key=jax.random.key(0)
    )
    x = jax.random.normal(jax.random.key(1), (1024, 512))
    y = jax.random.randint(jax.random.key(2), (1024,), 0, 10)

    def loss(model, batch, key):
        xb, yb = batch
        logits = jax.vmap(model)(xb)
        return optax.softmax_cross_entropy_with_integer_labels(logits, yb).mean()

    def run(mode: str, folder: str) -> float:
        checkpoints = None
        if mode != "none":
            checkpoints = ee.Checkpoints(
                os.path.join(folder, f"{mode}-{time.perf_counter_ns()}"),
                every=every,
                keep=2,
                asynchronous=mode == "async",
            )
        start = time.perf_counter()
        result = ee.fit(
            ens, loss, optax.adam(1e-3), (x, y), steps=steps, batch_size=64,
            key=jax.random.key(3), callbacks=(), checkpoints=checkpoints,
        )  # fmt: skip
        jax.block_until_ready(result.ensemble)
        return time.perf_counter() - start

    modes = ("none", "sync", "async")
    times: dict[str, list[float]] = {mode: [] for mode in modes}
    with tempfile.TemporaryDirectory() as folder:
        for mode in modes:  # warm-up: compile
            run(mode, folder)
        for _ in range(repeats):
            for mode in modes:
                times[mode].append(run(mode, folder))
    state = sum(x.nbytes for x in jax.tree.leaves(eqx.filter(ens, eqx.is_array)))
    print(
        f"   {steps} steps, a checkpoint every {every} ({steps // every} in all); "
        f"weights {state / 2**20:.1f} MiB (+ Adam 2x)"
    )
    base = _common.median(times["none"])
    for mode in modes:
        median = _common.median(times[mode])
        cost = (median - base) / (steps // every)
        print(
            f"   {mode:<6} {median:7.3f} s  ({_common.spread(times[mode])})  "
            f"{median / base:5.2f}x  per checkpoint {cost * 1e3:7.1f} ms"
        )
    sync = _common.median(times["sync"]) - base
    asynchronous = _common.median(times["async"]) - base
    print(
        f"   the checkpoints' cost to the run: async {asynchronous:.3f} s vs sync "
        f"{sync:.3f} s ({asynchronous / sync if sync > 0 else float('nan'):.2f}x)"
    )
    _common.emit_summary(
        "async_checkpoints",
        {mode: _common.median(times[mode]) for mode in modes},
        args.json,
    )


if __name__ == "__main__":
    main()
