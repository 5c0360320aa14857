"""A script run a second time: the first `fit` call with and without the
on-disk compilation cache (`ee.compilation_cache`).

Each run is a fresh process training the getting-started ensemble (8 MLPs
1-32-32-1, 500 Adam steps). Printed: the first `fit` call's time without the
cache, with an empty cache (it compiles and writes), and with the cache
written by the previous process (it reads); the ratio warm / no cache (target:
at most 0.2).

    python benchmarks/bench_first_call.py [--repeats 3]
"""

import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import _common  # noqa: E402


def _child(cache: str | None) -> None:
    import time

    start = time.perf_counter()
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import optax

    import eqx_ensemble as ee

    if cache:
        ee.compilation_cache(cache)
    imported = time.perf_counter()
    ens = ee.ensemble(
        lambda k: eqx.nn.MLP(1, 1, 32, 2, key=k), size=8, key=jax.random.key(0)
    )
    x = jax.random.uniform(jax.random.key(2), (64, 1), minval=-1, maxval=1)
    y = x**3

    def loss_fn(model, batch, key):
        xb, yb = batch
        return jnp.mean((jax.vmap(model)(xb) - yb) ** 2)

    called = time.perf_counter()
    result = ee.fit(
        ens, loss_fn, optax.adam(1e-2), (x, y), steps=500, batch_size=16,
        key=jax.random.key(4), callbacks=(),
    )  # fmt: skip
    jax.block_until_ready(result.history.losses)
    done = time.perf_counter()
    print(f"RESULT\t{done - called}\t{done - start}\t{imported - start}")


def _run(cache: str | None) -> tuple[float, float]:
    cmd = [sys.executable, __file__, "--child"] + ([cache] if cache else [])
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    line = next(x for x in out.splitlines() if x.startswith("RESULT\t"))
    first_fit, process, _ = (float(v) for v in line.split("\t")[1:])
    return first_fit, process


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        _child(sys.argv[2] if len(sys.argv) > 2 else None)
        return
    p = _common.parser(__doc__.splitlines()[0])
    args = p.parse_args()
    _common.print_header("First fit call of a script run again")
    repeats = args.repeats or (1 if args.quick else 3)
    rows: dict[str, list[tuple[float, float]]] = {"none": [], "cold": [], "warm": []}
    for _ in range(repeats):
        with tempfile.TemporaryDirectory() as cache:
            rows["none"].append(_run(None))
            rows["cold"].append(_run(cache))
            rows["warm"].append(_run(cache))
    medians = {k: _common.median([r[0] for r in v]) for k, v in rows.items()}
    process = {k: _common.median([r[1] for r in v]) for k, v in rows.items()}
    labels = {
        "none": "no cache",
        "cold": "empty cache (compiles, writes)",
        "warm": "cache written by a previous run",
    }
    for key, label in labels.items():
        print(
            f"   {label:34s} first fit {medians[key]:6.2f} s   "
            f"whole process {process[key]:6.2f} s"
        )
    ratio = medians["warm"] / medians["none"]
    print(f"\nwarm / no cache: {ratio:.2f}x (target <= 0.2x)")
    _common.emit_summary(
        "first_call",
        {"first_fit_s": medians, "process_s": process, "warm_over_none": ratio},
        args.json,
    )


if __name__ == "__main__":
    main()
