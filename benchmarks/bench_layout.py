"""The member layout at inference: `ee.predict` vectorised vs member by member.

On XLA's CPU backend a member-batched convolution becomes a grouped convolution,
which runs several times slower than the members' own convolutions; training
steps therefore run convolving members one after another (`layout=`, see the
training guide), and `ee.predict` / `ee.map` / `ens(x)` choose the same way.
This script times `ee.predict` on the CNN of `bench_families.py` (5 members,
8x8 images; with and without BatchNorm state) and on its MLP (8 members, where
the automatic choice stays vectorised), for `layout="vmap"`, `"sequential"` and
the automatic choice, called eagerly and inside `jax.jit`, at two batch sizes.
It prints ms per call and the speed-up of the automatic choice over `"vmap"`.

With `--training`: `ee.fit` calls of `--steps` steps (default 20, a run too
short for the sequential layout's compile time) on the CNNs of
`bench_families.py` (`--families`, default `cnn,cnn16`), with
`layout="vmap"`, `"sequential"` and the automatic choice (on a CPU, for such a
run: one member at a time in the compiled loop, `member_chunk=1`,
`layout.GROUP_MIN_FLOPS`): the first call (trace, compile and run) and ms per
step once compiled, interleaved.

Run: `python benchmarks/bench_layout.py` (`--quick` for a smoke run;
`--training [--steps 20] [--families cnn,cnn16]`).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common  # noqa: E402


def training(args) -> None:
    repeats = args.repeats or (2 if args.quick else 5)
    steps = args.steps
    _common.print_header(
        f"ee.fit: member layouts, {steps}-step calls; median of {repeats} calls"
    )
    import time

    import equinox as eqx
    import jax
    import optax
    from bench_families import _families

    import eqx_ensemble as ee

    families = _families(jax, jax.numpy, eqx)
    results = {}
    for name in args.families.split(","):
        make, loss_fn, stateful, x_all, y_all = families[name]
        members = args.members or (8 if name[3:].isdigit() else 5)
        built = ee.ensemble(make, size=members, key=jax.random.key(2))
        ens, state = built if stateful else (built, None)
        variants, first = {}, {}
        for layout in ("vmap", "sequential", None):
            label = layout or "auto"

            def call(layout=layout):
                result = ee.fit(
                    ens, loss_fn, optax.adam(1e-3), (x_all, y_all), steps=steps,
                    batch_size=128, key=jax.random.key(3), state=state,
                    callbacks=(), execution=ee.Execution(layout=layout),
                )  # fmt: skip
                jax.block_until_ready(result.ensemble)

            start = time.perf_counter()
            call()
            first[label] = time.perf_counter() - start
            variants[label] = call
        times = _common.interleaved(variants, repeats=repeats, warmup=0)
        ms = {k: _common.median(v) / steps * 1e3 for k, v in times.items()}
        print(f"\n-- {name}: {members} members, {steps} steps per call")
        for k in variants:
            print(f"   {k:<12} first call {first[k]:6.2f} s   {ms[k]:9.2f} ms/step")
        ratios = {f"auto vs {k}": ms[k] / ms["auto"] for k in ("vmap", "sequential")}
        for k, r in ratios.items():
            print(f"   {k}: {r:5.2f}x per step")
        results[name] = {"first_s": first, "ms_per_step": ms, "ratios": ratios}
    _common.emit_summary("layout_training", results, args.json)


def main() -> None:
    p = _common.parser(__doc__.splitlines()[0])
    p.add_argument("--batches", default="128,1024")
    p.add_argument("--training", action="store_true", help="time `fit`'s layouts")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--families", default="cnn,cnn16")
    p.add_argument("--members", type=int, default=None)
    args = p.parse_args()
    if args.training:
        training(args)
        return
    repeats = args.repeats or (3 if args.quick else 15)
    _common.print_header(
        f"ee.predict: member layouts; median of {repeats} calls per variant"
    )
    import equinox as eqx
    import jax
    from bench_families import _families

    import eqx_ensemble as ee

    families = _families(jax, jax.numpy, eqx)
    results = {}
    for name in ("cnn", "cnn_bn", "mlp"):
        make, _, stateful, x_all, _ = families[name]
        members = 8 if name == "mlp" else 5
        built = ee.ensemble(make, size=members, key=jax.random.key(2))
        ens, state = built if stateful else (built, None)
        for batch in map(int, args.batches.split(",")):
            x = x_all[:batch]
            variants = {}
            for layout in ("vmap", "sequential", None):
                label = layout or "auto"

                def eager(layout=layout):
                    out = ee.predict(
                        ens, x, state=state, execution=ee.Execution(layout=layout)
                    )
                    jax.block_until_ready(out)

                jitted_fn = eqx.filter_jit(
                    lambda ens, x, state, layout=layout: ee.predict(
                        ens, x, state=state, execution=ee.Execution(layout=layout)
                    )
                )

                def jitted(jitted_fn=jitted_fn):
                    jax.block_until_ready(jitted_fn(ens, x, state))

                variants[f"eager {label}"] = eager
                variants[f"jit {label}"] = jitted
            times = _common.interleaved(variants, repeats=repeats, warmup=2)
            ms = {k: _common.median(v) * 1e3 for k, v in times.items()}
            print(f"\n-- {name}: {members} members, batch {batch}")
            for k, v in ms.items():
                print(f"   {k:<18} {v:9.3f} ms")
            ratios = {
                mode: ms[f"{mode} vmap"] / ms[f"{mode} auto"]
                for mode in ("eager", "jit")
            }
            for mode, r in ratios.items():
                print(f"   {mode}: auto vs vmap {r:5.2f}x")
            results[f"{name} b{batch}"] = {"ms": ms, "auto_vs_vmap": ratios}
    _common.emit_summary("layout", results, args.json)


if __name__ == "__main__":
    main()
