"""Members that share parts vs full stacking: memory and step time, same run.

Two workloads, each timed round-robin with the alternative in the same process:

1. Heads on a frozen backbone (M members): `ee.ensemble(..., shared=backbone)`
   vs the same model fully stacked with the backbone frozen by hand
   (`optax.multi_transform` with `set_to_zero` on the backbone: M copies of it,
   M forward passes through it, its optimizer state kept).
2. BatchEnsemble vs a deep ensemble of the same architecture (M members).

Reported per variant: parameter bytes, optimizer-state bytes, XLA's compiled
temporary bytes for one step, and the median step time of a `make_step` loop
(one step per call) and of `fit` (steps fused in one dispatch).

    python benchmarks/bench_shared.py [--quick] [--repeats N] [--json out.json]
"""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import _common  # noqa: E402


def main() -> None:
    args = _common.parser(__doc__.splitlines()[0]).parse_args()
    import equinox as eqx
    import jax
    import optax

    import eqx_ensemble as ee

    info = _common.print_header("shared parts vs full stacking")
    repeats = args.repeats or (3 if args.quick else 15)
    members = 8 if args.quick else 32
    heads_members = 8 if args.quick else 64
    width = 128 if args.quick else 512
    batch = 256
    key = jax.random.key(0)
    x = jax.random.normal(key, (batch, 64))
    y = jax.random.randint(jax.random.key(1), (batch,), 0, 10)

    def loss_fn(model, data, key):
        xs, ys = data
        logits = jax.vmap(model)(xs)
        return optax.softmax_cross_entropy_with_integer_labels(logits, ys).mean()

    def nbytes(tree):
        return sum(
            leaf.size * leaf.dtype.itemsize
            for leaf in jax.tree.leaves(eqx.filter(tree, eqx.is_array))
        )

    def measure(name, ens, opt, results, step_times):
        state = ee.init_optimizer(opt, ens)
        step = ee.make_step(loss_fn, opt)
        compiled = step.lower(ens, state, (x, y), key).compile()
        memory = compiled.compiled.memory_analysis()
        temp = getattr(memory, "temp_size_in_bytes", float("nan"))
        holder = {"ens": ens, "state": state}

        def one_step():
            out = step(holder["ens"], holder["state"], (x, y), key)
            holder["ens"], holder["state"] = out.ensemble, out.opt_state
            jax.block_until_ready(out.losses)

        def fit_steps():
            result = ee.fit(
                ens,
                loss_fn,
                opt,
                (x, y),
                steps=20,
                batch_size=batch,
                key=key,
                callbacks=(),
            )
            jax.block_until_ready(jax.tree.leaves(result.ensemble))

        results[name] = {
            "param_bytes": nbytes(ens),
            "opt_bytes": nbytes(state),
            "temp_bytes": temp,
        }
        step_times[name] = one_step
        step_times[name + " fit/20"] = fit_steps

    def report(title, results, times):
        print(f"\n-- {title}")
        print(f"{'variant':34s} {'params MiB':>10s} {'opt MiB':>9s} {'temp MiB':>9s}")
        for name, r in results.items():
            print(
                f"{name:34s} {r['param_bytes'] / 2**20:10.2f} "
                f"{r['opt_bytes'] / 2**20:9.2f} {r['temp_bytes'] / 2**20:9.2f}"
            )
        for name, ts in times.items():
            print(f"   {name:38s} {_common.spread(ts)}")

    summary = {"machine": info, "members": members, "width": width}

    # 1. Heads on a frozen backbone.
    class Net(eqx.Module):
        backbone: eqx.nn.MLP
        head: eqx.nn.Linear

        def __init__(self, key):
            k1, k2 = jax.random.split(key)
            self.backbone = eqx.nn.MLP(64, width, width, 2, key=k1)
            self.head = eqx.nn.Linear(width, 10, key=k2)

        def __call__(self, x):
            return self.head(jax.nn.relu(self.backbone(x)))

    shared = ee.ensemble(Net, size=heads_members, key=key, shared=lambda m: m.backbone)
    stacked = ee.ensemble(Net, size=heads_members, key=key)

    def labels(params):
        train = jax.tree.map(lambda _: "train", params)
        return eqx.tree_at(
            lambda m: m.backbone,
            train,
            replace_fn=lambda b: jax.tree.map(lambda _: "freeze", b),
        )

    frozen_by_hand = optax.multi_transform(
        {"train": optax.adam(1e-3), "freeze": optax.set_to_zero()}, labels
    )
    results, fns = {}, {}
    measure("shared frozen backbone", shared, optax.adam(1e-3), results, fns)
    measure("stacked, backbone frozen by hand", stacked, frozen_by_hand, results, fns)
    times = _common.interleaved(fns, repeats=repeats)
    report(
        f"{heads_members} heads on one frozen backbone (width {width})", results, times
    )
    a, b = "shared frozen backbone", "stacked, backbone frozen by hand"
    heads = {
        "results": results,
        "step_ms": {k: _common.median(v) * 1e3 for k, v in times.items()},
        "param_ratio": results[b]["param_bytes"] / results[a]["param_bytes"],
        "step_speedup": _common.median(times[b]) / _common.median(times[a]),
        "fit_speedup": _common.median(times[b + " fit/20"])
        / _common.median(times[a + " fit/20"]),
    }
    print(
        f"   ratios: stacked/shared params {heads['param_ratio']:.1f}x, "
        f"step {heads['step_speedup']:.2f}x, fit {heads['fit_speedup']:.2f}x"
    )
    summary["heads"] = heads

    # 2. BatchEnsemble vs deep ensemble, same architecture.
    def make_be(key):
        k1, k2, k3 = jax.random.split(key, 3)
        return eqx.nn.Sequential(
            [
                ee.nn.BatchEnsembleLinear(64, width, key=k1),
                eqx.nn.Lambda(jax.nn.relu),
                ee.nn.BatchEnsembleLinear(width, width, key=k2),
                eqx.nn.Lambda(jax.nn.relu),
                ee.nn.BatchEnsembleLinear(width, 10, key=k3),
            ]
        )

    be = ee.ensemble(
        make_be, size=members, key=key, shared=ee.nn.slow_weights, train_shared=True
    )
    deep = ee.ensemble(
        lambda k: eqx.nn.MLP(64, 10, width, 2, key=k), size=members, key=key
    )
    results, fns = {}, {}
    measure("BatchEnsemble", be, optax.adam(1e-3), results, fns)
    measure("deep ensemble", deep, optax.adam(1e-3), results, fns)
    times = _common.interleaved(fns, repeats=repeats)
    report(f"BatchEnsemble vs deep ensemble ({members} members)", results, times)
    batch_ensemble = {
        "results": results,
        "step_ms": {k: _common.median(v) * 1e3 for k, v in times.items()},
        "param_ratio": results["deep ensemble"]["param_bytes"]
        / results["BatchEnsemble"]["param_bytes"],
        "step_speedup": _common.median(times["deep ensemble"])
        / _common.median(times["BatchEnsemble"]),
        "fit_speedup": _common.median(times["deep ensemble fit/20"])
        / _common.median(times["BatchEnsemble fit/20"]),
    }
    print(
        f"   ratios: deep/BatchEnsemble params {batch_ensemble['param_ratio']:.1f}x, "
        f"step {batch_ensemble['step_speedup']:.2f}x, "
        f"fit {batch_ensemble['fit_speedup']:.2f}x"
    )
    summary["batch_ensemble"] = batch_ensemble
    _common.emit_summary("bench_shared", summary, args.json)


if __name__ == "__main__":
    main()
