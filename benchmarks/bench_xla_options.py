"""XLA's default CPU compilation vs the library's options, across step sizes.

For each ensemble shape (members, MLP sizes, batch) the script compiles the same
hand-written, scan-fused `eqx.filter_vmap` Adam step twice, with XLA's defaults
and with `{"xla_cpu_experimental_ynn_fusion_type": ""}` (YNNPACK's fusions off,
so every dot runs on Eigen's thread pool), times them round-robin in one process
and prints the speed-up next to the step's estimated matmul FLOPs (the estimate
`fit` and `make_step` use to choose; `eqx_ensemble/_xla.py`). This is the
evidence for the 16 MFLOP threshold on the benchmarks page.

`--onednn` adds a third variant: the dots as oneDNN fusions
(`xla_cpu_use_onednn` with `xla_cpu_experimental_onednn_fusion_type=DOT`,
YNNPACK's off), the path PyTorch's CPU matmuls take; `--shapes 11,12` runs
only those rows of `SHAPES` (0-based).

Run: `python benchmarks/bench_xla_options.py` (`--quick` for a smoke run).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common  # noqa: E402

# (members, [in, hidden, hidden, out], batch)
SHAPES = [
    (8, [1, 32, 32, 1], 16),
    (8, [1, 32, 32, 1], 32),
    (8, [1, 64, 64, 1], 16),
    (16, [32, 64, 64, 10], 32),
    (8, [32, 64, 64, 10], 64),
    (64, [32, 64, 64, 10], 32),
    (32, [32, 128, 128, 10], 64),
    (16, [32, 128, 128, 10], 128),
    (4, [32, 256, 256, 10], 256),
    (128, [32, 64, 64, 10], 128),
    (8, [32, 256, 256, 10], 256),
    (64, [32, 128, 128, 10], 256),
    (16, [784, 512, 512, 10], 128),
]


def main() -> None:
    p = _common.parser(__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20, help="steps per timed call")
    p.add_argument("--onednn", action="store_true", help="add oneDNN's dot fusions")
    p.add_argument("--shapes", default="", help="rows of SHAPES, e.g. 11,12")
    args = p.parse_args()
    repeats = args.repeats or (2 if args.quick else 7)
    shapes = SHAPES[:3] if args.quick else SHAPES
    if args.shapes:
        shapes = [SHAPES[int(i)] for i in args.shapes.split(",")]
    info = _common.print_header(
        f"XLA options vs step size: {len(shapes)} shapes, {args.steps} scan-fused "
        f"Adam steps per call, {repeats} calls per variant"
    )

    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    from eqx_ensemble._execution import compile as _xla

    optimizer = optax.adam(1e-3)
    options = {"default": None, "eigen": dict(_xla.EIGEN_DOTS)}
    if args.onednn:
        options["onednn"] = {
            **_xla.EIGEN_DOTS,
            "xla_cpu_use_onednn": True,
            "xla_cpu_experimental_onednn_fusion_type": "LIBRARY_FUSION_TYPE_DOT",
        }
    rows = []
    print(
        f"   {'members':>7s} {'MLP':>16s} {'batch':>5s} {'est. MFLOP':>10s} "
        f"{'default ms':>10s} {'eigen ms':>9s} {'speed-up':>8s}"
        + (f" {'onednn ms':>9s} {'vs eigen':>8s}" if args.onednn else "")
    )
    for members, sizes, batch in shapes:
        keys = jax.random.split(jax.random.key(0), members)
        models = eqx.filter_vmap(
            lambda k, sizes=sizes: eqx.nn.MLP(
                sizes[0], sizes[-1], sizes[1], 2, activation=jax.nn.relu, key=k
            )
        )(keys)
        params, static = eqx.partition(models, eqx.is_array)
        flops = _xla.step_matmul_flops(params, batch, members)

        def one(p, s, x, y, static=static):
            def loss(p):
                logits = jax.vmap(eqx.combine(p, static))(x)
                return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

            value, grads = jax.value_and_grad(loss)(p)
            updates, s = optimizer.update(grads, s, p)
            return optax.apply_updates(p, updates), s, value

        def scan(xs, ys, p, s, one=one):
            def body(carry, batch_):
                p, s, value = jax.vmap(one, in_axes=(0, 0, None, None))(*carry, *batch_)
                return (p, s), value

            (p, s), values = jax.lax.scan(body, (p, s), (xs, ys))
            return p, s, values

        rng = np.random.default_rng(0)
        xs = jnp.asarray(
            rng.normal(size=(args.steps, batch, sizes[0])), dtype=jnp.float32
        )
        ys = jnp.asarray(rng.integers(0, sizes[-1], size=(args.steps, batch)))
        opt_state = jax.vmap(optimizer.init)(params)
        variants = {}
        for name, compiler_options in options.items():
            compiled = jax.jit(
                scan, donate_argnums=(2, 3), compiler_options=compiler_options
            )
            state = {
                "p": jax.tree.map(jnp.copy, params),
                "s": jax.tree.map(jnp.copy, opt_state),
            }

            def run(compiled=compiled, state=state):
                p, s, values = compiled(xs, ys, state["p"], state["s"])
                values.block_until_ready()
                state["p"], state["s"] = p, s

            run()  # compile
            variants[name] = run
        times = _common.interleaved(variants, repeats=repeats, warmup=1)
        default = _common.median(times["default"]) / args.steps * 1e3
        eigen = _common.median(times["eigen"]) / args.steps * 1e3
        row = {
            "members": members,
            "sizes": sizes,
            "batch": batch,
            "mflop": flops / 1e6,
            "default_ms": default,
            "eigen_ms": eigen,
            "speedup": default / eigen,
        }
        extra = ""
        if args.onednn:
            onednn = _common.median(times["onednn"]) / args.steps * 1e3
            row["onednn_ms"] = onednn
            extra = f" {onednn:9.3f} {eigen / onednn:7.2f}x"
        rows.append(row)
        print(
            f"   {members:7d} {'-'.join(map(str, sizes)):>16s} {batch:5d} "
            f"{flops / 1e6:10.1f} {default:10.3f} {eigen:9.3f} "
            f"{default / eigen:7.2f}x" + extra
        )
    print(
        f"   the library uses the Eigen options from {_xla.MIN_STEP_FLOPS / 1e6:.0f} "
        "MFLOP per step (per device on a mesh) on a CPU with >= 2 cores"
    )
    _common.emit_summary("xla_options", {"machine": info, "rows": rows}, args.json)


if __name__ == "__main__":
    main()
