"""What `fit`'s own bookkeeping costs per step, against hand-written scans.

`fit` does more per step than a bare `lax.scan` of the vmapped update: it samples
the minibatch inside the loop, guards every member against non-finite losses,
gradients and updates, records per-member losses, and (in a dispatch with fewer
steps than its compiled length) skips steps with a conditional. This script
times, on the default backend (CPU or GPU), the compute-bound workload (64 MLPs
32-128-128-10, batch 256, Adam; `--workload dispatch`: the dispatch-bound one, 8
MLPs 1-32-32-1, batch 16, 1000 steps):

- a bare hand-written scan over pre-gathered batches,
- the same with a per-step `lax.cond` on the step count (what every dispatch of
  `fit` compiled before round 3; now only a partial dispatch),
- the same with the batch gathered inside the loop from a permutation,
- the same with a divergence guard (finite checks and selects per member),
- `ee.fit` running the same number of steps in one dispatch, and in ten.

Variants are timed round-robin; per-step medians and ratios to the bare scan.

    python benchmarks/bench_loop.py [--quick] [--repeats N] [--steps L]
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common  # noqa: E402


def main() -> None:
    p = _common.parser(__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=None)
    p.add_argument(
        "--workload",
        choices=("compute", "dispatch"),
        default="compute",
        help="compute: 64 MLPs 32-128-128-10, batch 256 (default); dispatch: "
        "bench_dispatch.py's 8 MLPs 1-32-32-1, batch 16, 1000 steps",
    )
    args = p.parse_args()
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import optax

    import eqx_ensemble as ee

    info = _common.print_header(f"fit's bookkeeping on {_common.jax_device_name()}")
    if args.workload == "dispatch":  # bench_dispatch.py's: tiny steps
        members, batch, sizes = 8, 16, [1, 32, 32, 1]
        default_steps, n_data = 1000, 256
    elif args.quick:
        members, batch, sizes = 8, 64, [32, 64, 64, 10]
        default_steps, n_data = 20, 4096
    else:
        members, batch, sizes = 64, 256, [32, 128, 128, 10]
        default_steps, n_data = 200, 4096
    steps = args.steps or default_steps
    repeats = args.repeats or (3 if args.quick else 7)
    key = jax.random.key(0)
    kx, ky, kens = jax.random.split(key, 3)
    x_all = jax.random.normal(kx, (n_data, sizes[0]))
    optimizer = optax.adam(1e-3)

    def make_model(k):
        return eqx.nn.MLP(sizes[0], sizes[-1], sizes[1], len(sizes) - 2, key=k)

    if args.workload == "dispatch":
        y_all = jnp.sin(2 * x_all)

        def loss_fn(model, data, key):
            x, y = data
            return jnp.mean((jax.vmap(model)(x) - y) ** 2)

    else:
        y_all = jax.random.randint(ky, (n_data,), 0, sizes[-1])

        def loss_fn(model, data, key):
            x, y = data
            logits = jax.vmap(model)(x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    def fresh():
        ens = ee.ensemble(make_model, size=members, key=kens)
        params = eqx.filter(ens.members, eqx.is_inexact_array)
        return ens, eqx.filter_vmap(optimizer.init)(params)

    def update(models, opt_state, x, y, guard):
        def one(model, state):
            loss, grads = eqx.filter_value_and_grad(loss_fn)(model, (x, y), None)
            updates, new_state = optimizer.update(grads, state, model)
            new_model = eqx.apply_updates(model, updates)
            if guard:
                leaves = jax.tree.leaves(eqx.filter((grads, updates), eqx.is_array))
                finite = jnp.isfinite(loss) & jnp.all(
                    jnp.stack([jnp.all(jnp.isfinite(v)) for v in leaves])
                )
                new_model, new_state = jax.tree.map(
                    lambda a, b: jnp.where(finite, a, b) if eqx.is_array(a) else a,
                    (new_model, new_state),
                    (model, state),
                )
            return new_model, new_state, loss

        return eqx.filter_vmap(one)(models, opt_state)

    permutation = jax.random.permutation(key, n_data)
    fixed_idx = jax.random.randint(key, (steps, batch), 0, n_data)

    def hand(*, cond=False, gather=False, guard=False):
        @eqx.filter_jit(donate="all-except-first")
        def run(end, models, opt_state):
            params, static = eqx.partition(models, eqx.is_array)

            def active(carry, i):
                p, s, t = carry
                if gather:
                    start = (t * batch) % (n_data - batch)
                    rows = jax.lax.dynamic_slice_in_dim(permutation, start, batch)
                else:
                    rows = fixed_idx[i]
                m, s, loss = update(
                    eqx.combine(p, static), s, x_all[rows], y_all[rows], guard
                )
                return (eqx.filter(m, eqx.is_array), s, t + 1), loss

            def body(carry, i):
                if not cond:
                    return active(carry, i)
                return jax.lax.cond(
                    carry[2] < end,
                    active,
                    lambda c, i: (c, jnp.zeros(members)),
                    carry,
                    i,
                )

            (params, opt_state, _), losses = jax.lax.scan(
                body, (params, opt_state, jnp.array(0)), jnp.arange(steps)
            )
            return eqx.combine(params, static), opt_state, losses

        ens, opt_state = fresh()
        state = {"m": ens.members, "s": opt_state}
        end = jnp.array(steps)

        def go():
            state["m"], state["s"], losses = run(end, state["m"], state["s"])
            jax.block_until_ready(losses)

        return go

    def fit(dispatches):
        ens, _ = fresh()

        def go():
            result = ee.fit(
                ens,
                loss_fn,
                optimizer,
                (x_all, y_all),
                steps=steps,
                batch_size=batch,
                key=key,
                callbacks=(),
                execution=ee.Execution(steps_per_dispatch=steps // dispatches),
            )
            jax.block_until_ready(result.ensemble)

        return go

    variants = {
        "hand scan": hand(),
        "hand scan + per-step cond": hand(cond=True),
        "hand scan + in-loop gather": hand(gather=True),
        "hand scan + divergence guard": hand(guard=True),
        "hand scan + all three": hand(cond=True, gather=True, guard=True),
        "ee.fit, 1 dispatch": fit(1),
        "ee.fit, 10 dispatches": fit(10),
    }
    times = _common.interleaved(variants, repeats=repeats, warmup=2)
    base = _common.median(times["hand scan"])
    print(
        f"\n{members} MLPs {'-'.join(map(str, sizes))}, batch {batch}, Adam, "
        f"{steps} steps per call"
    )
    results = {}
    for name, ts in times.items():
        per_step = _common.median(ts) / steps
        results[name] = {
            "us_per_step": per_step * 1e6,
            "vs_hand": base / _common.median(ts),
        }
        print(
            f"   {name:32s} {per_step * 1e6:9.1f} us/step   "
            f"{_common.median(ts) / base:5.2f}x the bare scan's time"
        )
    _common.emit_summary(
        "loop",
        {"machine": info, "device": _common.jax_device_name(), "results": results},
        args.json,
    )


if __name__ == "__main__":
    main()
