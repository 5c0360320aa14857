"""Members that differ: one `fit` of an `ee.Heterogeneous` against the alternatives.

Three groups of MLPs 8-w-w-1 (widths 32, 64 and 128 by default, 4 members
each), Adam, batch 64, independent batches per member. Timed, each warm (its
programs compiled by an untimed first call) and round-robin:

- `heterogeneous`: ONE `ee.fit` call of the three groups as an
  `ee.Heterogeneous` (one compiled program per dispatch, one vectorised step
  per group);
- `separate`: three `ee.fit` calls, one per width (what a user writes today);
- `padded`: ONE `ee.fit` of all 12 members at the widest width (the other
  workaround: pad every member to the largest architecture; it computes more).

The issue's target: the heterogeneous run at least 1.5x faster than three
separate calls. Ratios > 1: the heterogeneous run is faster.

Run: `python benchmarks/bench_heterogeneous.py` (`--quick` for a smoke run).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common  # noqa: E402


def main() -> None:
    p = _common.parser(__doc__.splitlines()[0])
    p.add_argument("--widths", type=int, nargs="+", default=[32, 64, 128])
    p.add_argument("--members", type=int, default=4, help="members per width")
    p.add_argument("--steps", type=int, default=200, help="steps per fit call")
    p.add_argument("--examples", type=int, default=2048)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument(
        "--sampling", choices=["shared", "independent"], default="independent"
    )
    args = p.parse_args()
    repeats = args.repeats or (3 if args.quick else 9)
    steps = 20 if args.quick else args.steps
    info = _common.print_header("heterogeneous ensembles: one fit vs the workarounds")

    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import optax

    import eqx_ensemble as ee

    x = jax.random.normal(jax.random.key(1), (args.examples, 8))
    y = jnp.sin(x[:, :1]) + 0.1 * x[:, 1:2]

    def loss(model, batch, key):
        xb, yb = batch
        return jnp.mean((jax.vmap(model)(xb) - yb) ** 2)

    def group(width, size, seed):
        return ee.ensemble(
            lambda k: eqx.nn.MLP(8, 1, width, 2, key=k),
            size=size,
            key=jax.random.key(seed),
        )

    groups = [group(w, args.members, w) for w in args.widths]
    het = ee.Heterogeneous(groups)
    padded = group(max(args.widths), len(het), 0)
    optimizer = optax.adam(1e-3)
    common = dict(
        steps=steps,
        batch_size=args.batch,
        sampling=ee.Independent() if args.sampling == "independent" else "shared",
        key=jax.random.key(2),
        callbacks=[],
    )

    def fit(ens):
        return ee.fit(ens, loss, optimizer, (x, y), **common)

    def run_het():
        jax.block_until_ready(fit(het).ensemble)

    def run_separate():
        for g in groups:
            jax.block_until_ready(fit(g).ensemble)

    def run_padded():
        jax.block_until_ready(fit(padded).ensemble)

    calls = {"heterogeneous": run_het, "separate": run_separate, "padded": run_padded}
    for call in calls.values():  # compile
        call()
    times = _common.interleaved(calls, repeats=repeats)
    base = _common.median(times["heterogeneous"])
    widths = "/".join(str(w) for w in args.widths)
    print(
        f"   MLP 8-w-w-1, widths {widths} x {args.members} members, batch "
        f"{args.batch} of {args.examples} examples ({args.sampling}), Adam, "
        f"{steps} steps per fit call"
    )
    results = {}
    for name in calls:
        seconds = _common.median(times[name])
        print(
            f"   {name:14} {seconds * 1e3 / steps:8.3f} ms/step "
            f"{_common.spread(times[name])}  heterogeneous is "
            f"{seconds / base:5.2f}x faster"
        )
        results[name] = {"seconds_per_step": seconds / steps, "ratio": seconds / base}
    _common.emit_summary("bench_heterogeneous", {"machine": info, **results}, args.json)


if __name__ == "__main__":
    main()
