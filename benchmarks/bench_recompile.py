"""What compilation costs a user who runs things again: the share of wall time
spent tracing, lowering and compiling, per workload, in one process.

Each workload is what a notebook user writes, run twice as they would re-run
a cell (a new `optax.adam(...)` object each time, as every example writes it),
then with another `steps=` and with a progress bar. The table prints, per
workload, the wall time of each call and how much of it was compilation
(`jax.monitoring`'s tracing, lowering and XLA compile durations), and the
compile share of the whole workload. Run it on two versions to compare:

    python benchmarks/bench_recompile.py              # this checkout
    git worktree add /tmp/old main~5 && PYTHONPATH=/tmp/old \\
        python benchmarks/bench_recompile.py          # another version

In a fresh process per workload (`--workload NAME` is the child's flag), so
no workload reuses another's programs.
"""

import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import _common  # noqa: E402

WORKLOADS = (
    "mlp",
    "heterogeneous",
    "sgld",
    "calibrator",
    "predict_metrics",
    "first_use",
    "methods",
)


def _workload(name: str, quick: bool) -> list[tuple[str, float, float]]:
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import eqx_ensemble as ee

    spent = [0.0]

    def listen(event: str, duration: float, **_: object) -> None:
        if event.startswith("/jax/core/compile/"):
            spent[0] += duration

    jax.monitoring.register_event_duration_secs_listener(listen)
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = jnp.asarray(digits.data / 16.0, jnp.float32)
    y = jnp.asarray(digits.target, jnp.int32)
    rows: list[tuple[str, float, float]] = []
    steps = 50 if quick else 300

    def timed(label, fn):
        before, start = spent[0], time.perf_counter()
        out = fn()
        jax.block_until_ready(jax.tree.leaves(eqx.filter(out, eqx.is_array)))
        rows.append((label, time.perf_counter() - start, spent[0] - before))
        return out

    def loss_fn(model, batch, key):
        xb, yb = batch
        logits = jax.vmap(model)(xb)
        return optax.softmax_cross_entropy_with_integer_labels(logits, yb).mean()

    def fit(ens, optimizer, n, **kwargs):
        kwargs.setdefault("callbacks", ())
        return ee.fit(
            ens, loss_fn, optimizer, (x, y), steps=n, batch_size=64,
            key=jax.random.key(1), **kwargs,
        )  # fmt: skip

    def build(size):
        # A user's run builds its ensemble too (a re-run cell builds it again).
        return ee.ensemble(
            lambda k: eqx.nn.MLP(64, 10, 64, 2, key=k), size=size, key=jax.random.key(0)
        )

    if name == "mlp":
        ens = timed("build the ensemble", lambda: build(8))
        timed("build it again (re-run cell)", lambda: build(8))
        timed("fit", lambda: fit(ens, optax.adam(1e-3), steps))
        timed("fit again (new adam)", lambda: fit(ens, optax.adam(1e-3), steps))
        timed("fit, other steps=", lambda: fit(ens, optax.adam(1e-3), steps + 37))
        with open(os.devnull, "w") as sink:
            stderr, sys.stderr = sys.stderr, sink
            try:
                timed(
                    "fit, progress bar",
                    lambda: fit(ens, optax.adam(1e-3), steps, callbacks=None),
                )
            finally:
                sys.stderr = stderr
    elif name == "heterogeneous":

        def groups():
            return ee.Heterogeneous(
                [
                    ee.ensemble(
                        lambda k, w=w: eqx.nn.MLP(64, 10, w, 2, key=k),
                        size=3,
                        key=jax.random.key(w),
                    )
                    for w in (32, 64)
                ]
            )

        timed("fit", lambda: fit(groups(), optax.adam(1e-3), steps))
        timed("fit again (new adam)", lambda: fit(groups(), optax.adam(1e-3), steps))
        timed("fit, other steps=", lambda: fit(groups(), optax.adam(1e-3), steps + 37))
    elif name == "sgld":
        ens = timed("build the ensemble", lambda: build(4))

        def sgld():
            return ee.sgmcmc.sgld(1e-4, num_data=x.shape[0])

        timed("fit", lambda: fit(ens, sgld(), steps))
        timed("fit again (new sgld)", lambda: fit(ens, sgld(), steps))
        timed("fit, other steps=", lambda: fit(ens, sgld(), steps + 37))
    elif name == "calibrator":
        logits = 3 * jax.random.normal(jax.random.key(0), (5, 300, 10))
        labels = jax.random.randint(jax.random.key(1), (300,), 0, 10)
        fit_vs = ee.calibration.fit_vector_scaling
        timed("vector scaling", lambda: fit_vs(logits, labels))
        timed("vector scaling again", lambda: fit_vs(logits + 0.1, labels))
        timed("vector scaling, l2=1e-2", lambda: fit_vs(logits, labels, l2=1e-2))
    elif name == "predict_metrics":
        ens = timed("build the ensemble", lambda: build(8))

        def evaluate(count):
            logits = ee.predict(ens, x[:count])
            return (
                ee.metrics.nll(logits, y[:count], from_logits=True),
                ee.metrics.expected_calibration_error(
                    jax.nn.softmax(logits), y[:count]
                ),
                ee.metrics.mutual_information(jax.nn.softmax(logits)),
            )

        timed("predict + metrics", lambda: evaluate(500))
        timed("again", lambda: evaluate(500))
        timed("other batch", lambda: evaluate(400))
    elif name == "first_use":
        # What a notebook's first cells do with a new ensemble: pick members,
        # split and join it, draw a pool of architectures.
        ens = timed("build the ensemble", lambda: build(8))
        timed("a member, a slice, indices", lambda: (ens[0], ens[2:5], ens[[0, 7]]))
        timed("stack(unstack(ens))", lambda: ee.stack(ee.unstack(ens)))
        space = {
            "width": ee.sweep.choice([16, 32, 64]),
            "depth": ee.sweep.choice([1, 2]),
        }

        def pool():
            return ee.sweep.architectures(
                lambda key, width, depth: eqx.nn.MLP(64, 10, width, depth, key=key),
                space,
                size=12,
                key=jax.random.key(4),
            ).ensemble

        timed("a pool of architectures", pool)
    elif name == "methods":
        # The methods notebook's post-training steps: MultiSWAG's draws, and
        # selection and a soup from a pool of snapshots.
        ens = timed("build the ensemble", lambda: build(5))
        sgd = optax.sgd(1e-2, momentum=0.9)
        swag = ee.SWAG(start=steps // 2, every=5, rank=5)
        run = timed("fit with SWAG", lambda: fit(ens, sgd, steps, track=[swag]))
        draw_key = jax.random.key(2)
        timed("MultiSWAG (5 x 4 draws)", lambda: run.tracked[0].sample(draw_key, 4))
        at = tuple(range(steps // 4, steps + 1, steps // 4))
        snap = ee.Snapshots(at=at)
        run = timed("fit with snapshots", lambda: fit(ens, sgd, steps, track=[snap]))
        pool = run.tracked[0]
        val = (x[:500], y[:500])
        logits = ee.predict(pool, val[0])
        timed(
            "greedy selection (5 picks)",
            lambda: ee.greedy_selection(
                logits,
                lambda p: ee.metrics.nll(p, val[1], from_logits=True),
                size=5,
            ),
        )
        timed(
            "greedy soup (pool of 5)",
            lambda: ee.greedy_soup(pool[:5], lambda m: loss_fn(m, val, None)),
        )
    del np
    return rows


def main() -> None:
    p = _common.parser(__doc__.splitlines()[0])
    p.add_argument(
        "--workload", default=None, help="run one workload here (the parent's flag)"
    )
    args = p.parse_args()
    if args.workload:
        for label, wall, compile_s in _workload(args.workload, args.quick):
            print(f"ROW\t{label}\t{wall}\t{compile_s}")
        return
    _common.print_header("Compilation's share of re-run workloads")
    total_wall = total_compile = 0.0
    for name in WORKLOADS:
        cmd = [sys.executable, __file__, "--workload", name]
        if args.quick:
            cmd.append("--quick")
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        rows = [
            line.split("\t")[1:] for line in out.splitlines() if line[:4] == "ROW\t"
        ]
        wall = sum(float(r[1]) for r in rows)
        compiled = sum(float(r[2]) for r in rows)
        total_wall, total_compile = total_wall + wall, total_compile + compiled
        print(
            f"\n{name}: {wall:.2f} s, compiling {compiled:.2f} s "
            f"({compiled / wall:.0%})"
        )
        for label, call_wall, call_compile in rows:
            print(
                f"   {label:28s} {float(call_wall):7.2f} s  "
                f"compile {float(call_compile):6.2f} s"
            )
    print(
        f"\nall workloads: {total_wall:.2f} s, compiling {total_compile:.2f} s "
        f"({total_compile / total_wall:.0%} of wall time)"
    )


if __name__ == "__main__":
    main()
