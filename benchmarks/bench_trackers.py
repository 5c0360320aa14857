"""Per-step cost of the in-loop trackers: `fit` with EMA, SWA, SWAG, Snapshots
against `fit` without a tracker, timed round-robin in one process.

Workload (`--workload compute`, the default): the compute-bound workload of
DESIGN.md section 4, 64 MLPs 32-128-128-10 (about 22k weights each), batch 256,
Adam, shared batches; `--workload wide`: 16 MLPs 64-256-256-10 (about 85k
weights each), batch 128, which has half the arithmetic per weight and so shows
a tracker's cost larger. The trackers update every step (SWA/SWAG collect every
step from the start, the worst case; SWAG with rank 10), so the ratios bound
what they add to a run; SWAG collecting every 10th step is the usual use.

    python benchmarks/bench_trackers.py [--quick] [--repeats N] [--workload W]
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common  # noqa: E402


def main() -> None:
    p = _common.parser(__doc__.splitlines()[0])
    p.add_argument("--workload", choices=("compute", "wide"), default="compute")
    args = p.parse_args()
    import equinox as eqx
    import jax
    import optax

    import eqx_ensemble as ee

    info = _common.print_header("tracker overhead inside fit")
    members, inputs, width, batch = {
        "compute": (64, 32, 128, 256),
        "wide": (16, 64, 256, 128),
    }[args.workload]
    steps = 200
    if args.quick:
        members, width, steps = 4, 64, 100  # SWAG every 10 steps needs 10 collected
    repeats = args.repeats or (3 if args.quick else 7)
    key = jax.random.key(0)
    x = jax.random.normal(key, (4096, inputs))
    y = jax.random.randint(jax.random.key(1), (4096,), 0, 10)

    def loss_fn(model, batch, key):
        xs, ys = batch
        logits = jax.vmap(model)(xs)
        return optax.softmax_cross_entropy_with_integer_labels(logits, ys).mean()

    ens = ee.ensemble(
        lambda k: eqx.nn.MLP(inputs, 10, width, 2, key=k), size=members, key=key
    )
    variants = {
        "no tracker": [],
        "EMA": [ee.EMA(0.99)],
        "SWA (every step)": [ee.SWA(start=1)],
        "SWAG (every step, rank 10)": [ee.SWAG(start=1, rank=10)],
        "SWAG (every 10 steps, rank 10)": [ee.SWAG(start=10, every=10, rank=10)],
        "Snapshots (10 steps)": [
            ee.Snapshots(at=tuple(range(steps // 10, steps + 1, steps // 10)))
        ],
    }

    # One optimizer object for every call: `fit` compiles once per optimizer
    # (a new `optax.adam(...)` per call would time a compilation every call).
    optimizer = optax.adam(1e-3)

    def runner(track):
        def run():
            result = ee.fit(
                ens,
                loss_fn,
                optimizer,
                (x, y),
                steps=steps,
                batch_size=batch,
                key=key,
                track=track,
                callbacks=(),
            )
            jax.block_until_ready(jax.tree.leaves(result.tracked))
            jax.block_until_ready(jax.tree.leaves(result.ensemble))

        return run

    times = _common.interleaved(
        {name: runner(track) for name, track in variants.items()}, repeats=repeats
    )
    base = _common.median(times["no tracker"])
    print(
        f"\n{members} MLPs {inputs}-{width}-{width}-10, batch {batch}, "
        f"{steps} steps per fit"
    )
    results = {}
    for name, ts in times.items():
        per_step = _common.median(ts) / steps
        ratio = _common.median(ts) / base
        results[name] = {"ms_per_step": per_step * 1e3, "ratio": ratio}
        print(f"   {name:30s} {per_step * 1e3:7.3f} ms/step   {ratio:5.2f}x")
    _common.emit_summary(
        "bench_trackers",
        {
            "machine": info,
            "workload": args.workload,
            "members": members,
            "results": results,
        },
        args.json,
    )


if __name__ == "__main__":
    main()
