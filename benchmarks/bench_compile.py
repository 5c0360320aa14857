"""Compile time against ensemble size (8 to 1024 members).

Each size runs in a FRESH subprocess (no in-memory JAX caches; the persistent
compilation cache is switched off), on the compute workload's MLP (32-128-128-10).
Measured per size:

- `ee.make_step`: `step.lower(...)` (trace + lower) and `.compile()` (XLA), timed
  directly;
- `ee.fit`: the first call's tracing, lowering and XLA compile time of every
  function it compiles (from `jax.monitoring` duration events), with the
  largest (the fused `lax.scan` chunk) reported separately, and the first call's
  wall time minus a second call's (what the user waits for);
- `ee.map` (jitted, unchunked and with `chunk_size=size // 8`): lower + compile.

Target (DESIGN.md section 4): compile time at 1024 members within 1.3x of 8.

Run: `python benchmarks/bench_compile.py` (`--quick` for a smoke run).
"""

import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common  # noqa: E402

WORKER_PREFIX = "COMPILE-RESULT: "


def worker(size: int, fit_steps: int) -> None:
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import optax

    jax.config.update("jax_enable_compilation_cache", False)
    import eqx_ensemble as ee

    events: list[tuple[str, float, str]] = []

    def listener(event: str, duration: float, **kwargs) -> None:
        if event.startswith("/jax/core/compile/"):
            events.append(
                (event.rsplit("/", 1)[-1], duration, kwargs.get("fun_name", ""))
            )

    jax.monitoring.register_event_duration_secs_listener(listener)

    sizes = [32, 128, 128, 10]
    key = jax.random.key(0)
    ens = ee.ensemble(
        lambda k: eqx.nn.MLP(32, 10, 128, 2, activation=jax.nn.relu, key=k),
        size=size,
        key=key,
    )
    x = jax.random.normal(key, (1024, sizes[0]))
    y = jax.random.randint(key, (1024,), 0, sizes[-1])
    optimizer = optax.adam(1e-3)

    def loss_fn(model, data, key):
        xb, yb = data
        logits = jax.vmap(model)(xb)
        return optax.softmax_cross_entropy_with_integer_labels(logits, yb).mean()

    opt_state = ee.init_optimizer(optimizer, ens)
    jax.block_until_ready((ens, opt_state))
    result: dict = {"size": size}

    # make_step: lower + compile, timed directly.
    step = ee.make_step(loss_fn, optimizer)
    batch = (x[:256], y[:256])
    t0 = time.perf_counter()
    lowered = step.lower(ens, opt_state, batch, key)
    t1 = time.perf_counter()
    lowered.compile()
    t2 = time.perf_counter()
    result["make_step"] = {"lower_s": t1 - t0, "compile_s": t2 - t1, "total_s": t2 - t0}

    # fit: the first call compiles; events name what was compiled.
    events.clear()
    kwargs = dict(
        steps=fit_steps,
        batch_size=256,
        key=jax.random.key(1),
        callbacks=(),
        execution=ee.Execution(steps_per_dispatch=fit_steps),
    )
    t0 = time.perf_counter()
    jax.block_until_ready(ee.fit(ens, loss_fn, optimizer, (x, y), **kwargs).ensemble)
    first = time.perf_counter() - t0
    fit_events = list(events)
    t0 = time.perf_counter()
    jax.block_until_ready(ee.fit(ens, loss_fn, optimizer, (x, y), **kwargs).ensemble)
    second = time.perf_counter() - t0
    by_kind: dict[str, float] = {}
    per_fun: dict[str, float] = {}
    for kind, duration, fun in fit_events:
        by_kind[kind] = by_kind.get(kind, 0.0) + duration
        per_fun[fun] = per_fun.get(fun, 0.0) + duration
    largest = max(per_fun.items(), key=lambda kv: kv[1]) if per_fun else ("", 0.0)
    result["fit"] = {
        "first_call_s": first,
        "second_call_s": second,
        "first_minus_second_s": first - second,
        "trace_s": by_kind.get("jaxpr_trace_duration", 0.0),
        "lower_s": by_kind.get("jaxpr_to_mlir_module_duration", 0.0),
        "compile_s": by_kind.get("backend_compile_duration", 0.0),
        "compiled_functions": len(
            [e for e in fit_events if e[0] == "backend_compile_duration"]
        ),
        "largest_function": largest[0],
        "largest_function_s": largest[1],
    }

    # ee.map, jitted, without and with chunking.
    def predict(ens, xb, chunk_size):
        return ee.map(lambda m, xx: jax.vmap(m)(xx), ens, xb, chunk_size=chunk_size)

    for name, chunk in [("map", None), ("map_chunked", max(1, size // 8))]:
        fn = eqx.filter_jit(lambda e, xb, c=chunk: predict(e, xb, c))
        t0 = time.perf_counter()
        lowered = fn.lower(ens, x)
        t1 = time.perf_counter()
        lowered.compile()
        t2 = time.perf_counter()
        result[name] = {"lower_s": t1 - t0, "compile_s": t2 - t1, "total_s": t2 - t0}
    del jnp
    print(WORKER_PREFIX + json.dumps(result))


def main() -> None:
    p = _common.parser(__doc__.splitlines()[0])
    p.add_argument("--worker", type=int, default=None, help=argparse_hidden())
    p.add_argument("--sizes", default=None, help="comma-separated ensemble sizes")
    p.add_argument("--fit-steps", type=int, default=5)
    args = p.parse_args()
    if args.worker is not None:
        worker(args.worker, args.fit_steps)
        return
    sizes = (
        [int(s) for s in args.sizes.split(",")]
        if args.sizes
        else ([8, 64] if args.quick else [8, 32, 128, 512, 1024])
    )
    repeats = args.repeats or (1 if args.quick else 3)
    info = _common.print_header(
        f"compile time vs ensemble size {sizes}; a fresh subprocess per size and "
        f"repeat ({repeats} repeats, median reported)"
    )
    env = dict(os.environ)
    env["JAX_ENABLE_COMPILATION_CACHE"] = "false"
    runs: dict[int, list[dict]] = {s: [] for s in sizes}
    for _ in range(repeats):
        for size in sizes:  # interleave sizes across repeats (load drift hits all)
            out = subprocess.run(
                [
                    sys.executable,
                    os.path.abspath(__file__),
                    "--worker",
                    str(size),
                    "--fit-steps",
                    str(args.fit_steps),
                ],
                capture_output=True,
                text=True,
                env=env,
                check=False,
            )
            lines = [
                line
                for line in out.stdout.splitlines()
                if line.startswith(WORKER_PREFIX)
            ]
            if out.returncode != 0 or not lines:
                print(f"   size {size}: FAILED\n{out.stderr[-2000:]}")
                continue
            runs[size].append(json.loads(lines[-1][len(WORKER_PREFIX) :]))

    def med(size: int, *path: str) -> float:
        values = []
        for run in runs[size]:
            v = run
            for k in path:
                v = v[k]
            values.append(v)
        return _common.median(values) if values else float("nan")

    columns = [
        ("make_step lower", ("make_step", "lower_s")),
        ("make_step XLA", ("make_step", "compile_s")),
        ("fit trace+lower", None),
        ("fit XLA (all)", ("fit", "compile_s")),
        ("fit chunk (largest)", ("fit", "largest_function_s")),
        ("fit 1st-2nd call", ("fit", "first_minus_second_s")),
        ("map", ("map", "total_s")),
        ("map chunked", ("map_chunked", "total_s")),
    ]
    header = "   " + f"{'members':>8s}" + "".join(f"{c:>20s}" for c, _ in columns)
    print("   seconds (median over repeats):")
    print(header)
    table: dict[int, dict[str, float]] = {}
    for size in sizes:
        row = {}
        for name, path in columns:
            if path is None:
                row[name] = med(size, "fit", "trace_s") + med(size, "fit", "lower_s")
            else:
                row[name] = med(size, *path)
        table[size] = row
        print("   " + f"{size:8d}" + "".join(f"{row[c]:20.3f}" for c, _ in columns))
    ratios = {}
    small, large = sizes[0], sizes[-1]
    print(f"   ratio {large} members / {small} members (target <= 1.3):")
    for name, _ in columns:
        r = (
            table[large][name] / table[small][name]
            if table[small][name]
            else float("nan")
        )
        ratios[name] = r
        verdict = "MET" if r <= 1.3 else "NOT MET"
        print(f"     {name:22s} {r:6.2f}x  {verdict}")
    _common.emit_summary(
        "compile",
        {
            "machine": info,
            "sizes": sizes,
            "repeats": repeats,
            "table": table,
            "ratios": ratios,
            "runs": runs,
            "loadavg_end": list(_common.load_average()),
        },
        args.json,
    )


def argparse_hidden() -> str:
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    main()
