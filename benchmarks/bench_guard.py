"""What the divergence guard's finiteness check costs, in each of its forms.

A hand-written `lax.scan` of the vmapped Adam step (the batch sliced inside the
loop), with no check, or with the library's check
(`eqx_ensemble._training.step.all_finite`) of the loss, gradients, new weights
and new optimizer state in each form (`"per_leaf"`, `"by_shape"`: see
`eqx_ensemble._execution.guard`) followed by a select per leaf, as `fit` does.
Printed: the compile time of each program (its first call), then per-step
medians of interleaved calls and ratios to the unchecked scan. Workloads:
`dispatch` (8 MLPs 1-32-32-1, batch 16, 1000 steps: a tiny step, the plan's
per-leaf case) and `compute` (64 MLPs 32-128-128-10, batch 256, 100 steps).

    python benchmarks/bench_guard.py [--quick] [--repeats N] [--fit]
        [--workload compute]
"""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common  # noqa: E402


def main() -> None:
    p = _common.parser(__doc__.splitlines()[0])
    p.add_argument("--workload", choices=("dispatch", "compute"), default="dispatch")
    p.add_argument("--fit", action="store_true", help="also time `ee.fit` itself")
    args = p.parse_args()
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import optax

    from eqx_ensemble._training.step import all_finite

    _common.print_header(f"the guard's forms on {_common.jax_device_name()}")
    if args.workload == "dispatch":
        members, batch, sizes, steps = 8, 16, [1, 32, 32, 1], 1000
    else:
        members, batch, sizes, steps = 64, 256, [32, 128, 128, 10], 100
    if args.quick:
        steps = max(steps // 10, 10)
    repeats = args.repeats or (3 if args.quick else 11)
    n = 4096
    key = jax.random.key(0)
    x_all = jax.random.normal(key, (n, sizes[0]))
    y_all = jax.random.normal(jax.random.fold_in(key, 1), (n, sizes[-1]))
    optimizer = optax.adam(1e-3)

    def loss_fn(model, x, y):
        return jnp.mean((jax.vmap(model)(x) - y) ** 2)

    def make(form):
        def one(model, state, x, y):
            loss, grads = eqx.filter_value_and_grad(loss_fn)(model, x, y)
            updates, new_state = optimizer.update(grads, state, model)
            new_model = eqx.apply_updates(model, updates)
            if form is not None:
                params = eqx.filter(new_model, eqx.is_inexact_array)
                ok = jnp.isfinite(loss) & all_finite(
                    grads, params, check=form, state=new_state
                )
                new_model, new_state = jax.tree.map(
                    lambda a, b: jnp.where(ok, a, b) if eqx.is_array(a) else a,
                    (new_model, new_state),
                    (model, state),
                )
            return new_model, new_state, loss

        @eqx.filter_jit(donate="all-except-first")
        def run(static, params, state):
            def body(carry, i):
                params, state = carry
                start = (i * batch) % (n - batch)
                xb = jax.lax.dynamic_slice_in_dim(x_all, start, batch)
                yb = jax.lax.dynamic_slice_in_dim(y_all, start, batch)
                model, state, losses = eqx.filter_vmap(
                    one, in_axes=(eqx.if_array(0), eqx.if_array(0), None, None)
                )(eqx.combine(params, static), state, xb, yb)
                return (eqx.filter(model, eqx.is_array), state), losses

            (params, state), losses = jax.lax.scan(
                body, (params, state), jnp.arange(steps)
            )
            return params, state, losses

        return run

    ens = eqx.filter_vmap(
        lambda k: eqx.nn.MLP(sizes[0], sizes[-1], sizes[1], len(sizes) - 2, key=k)
    )(jax.random.split(key, members))
    params, static = eqx.partition(ens, eqx.is_array)
    variants, compile_s = {}, {}
    for name, form in (
        ("no check", None),
        ("per leaf", "per_leaf"),
        ("by shape", "by_shape"),
    ):
        run = make(form)
        state = {
            "p": jax.tree.map(jnp.copy, params),
            "s": eqx.filter_vmap(optimizer.init)(params),
        }
        start = time.perf_counter()
        state["p"], state["s"], losses = run(static, state["p"], state["s"])
        jax.block_until_ready(losses)
        compile_s[name] = time.perf_counter() - start

        def go(run=run, state=state):
            state["p"], state["s"], losses = run(static, state["p"], state["s"])
            jax.block_until_ready(losses)

        variants[name] = go
    if args.fit:
        import eqx_ensemble as ee

        stacked = ee.ensemble(
            lambda k: eqx.nn.MLP(sizes[0], sizes[-1], sizes[1], len(sizes) - 2, key=k),
            size=members,
            key=key,
        )
        _fit_variants(variants, compile_s, stacked, x_all, y_all, batch, steps, loss_fn)
    times = _common.interleaved(variants, repeats=repeats, warmup=1)
    base = _common.median(times["no check"])
    print(
        f"\n{members} MLPs {'-'.join(map(str, sizes))}, batch {batch}, Adam, "
        f"{steps} steps per call"
    )
    results = {}
    for name, ts in times.items():
        per_step = _common.median(ts) / steps
        results[name] = {
            "us_per_step": per_step * 1e6,
            "vs_none": _common.median(ts) / base,
            "first_call_s": compile_s[name],
        }
        print(
            f"   {name:10s} first call {compile_s[name]:5.2f} s   "
            f"{per_step * 1e6:10.1f} us/step   {_common.median(ts) / base:5.2f}x "
            "the unchecked scan's time"
        )
    _common.emit_summary("guard", results, args.json)


def _fit_variants(variants, compile_s, ens, x_all, y_all, batch, steps, loss_fn):
    """`ee.fit` of the same workload (Adam, its own batch sampling): the
    optimistic guard (the default: a dispatch checks its end state once), the
    guarded step at every step (as forced for an optimizer that hides
    non-finite gradients), and a bare dispatch (the optimistic one without its
    end-of-dispatch check and restore of frozen members)."""
    import jax
    import optax

    import eqx_ensemble as ee
    from eqx_ensemble._execution import plan as plan_module
    from eqx_ensemble._training import loop as loop_module, run as run_module

    optimizer = optax.adam(1e-3)
    hides = run_module._hides_non_finite

    def fit_loss(model, b, key):
        del key
        return loss_fn(model, *b)

    def bare_loss(model, b, key):  # other code: a program of its own
        del key
        return loss_fn(model, *b) + 0.0

    def counted_loss(model, b, key):  # a program of its own: counted off a CPU
        del key
        return loss_fn(model, *b) + 1.0

    def counted_bare_loss(model, b, key):
        del key
        return loss_fn(model, *b) + 2.0

    variants_of_fit = [
        ("fit optimistic", fit_loss, False, False, False),
        ("fit guarded", fit_loss, True, False, False),
        ("fit bare", bare_loss, False, True, False),
    ]
    if jax.default_backend() != "cpu":
        # Off a CPU `fit`'s default is the guarded step in a scan of fixed
        # length ("fit optimistic" and "fit bare" above are that too): these
        # loop over a traced trip count, as on a CPU, with the optimistic
        # guard, and with it and no end-of-dispatch check.
        variants_of_fit += [
            ("fit counted optimistic", counted_loss, False, False, True),
            ("fit counted bare", counted_bare_loss, False, True, True),
        ]
    counted = plan_module.COUNTED
    for name, loss, guarded, bare, count in variants_of_fit:
        state = {"ens": ens, "opt": ee.init_optimizer(optimizer, ens)}

        def go(loss=loss, guarded=guarded, state=state, count=count):
            run_module._hides_non_finite = (lambda *_: True) if guarded else hides
            if count:
                plan_module.COUNTED = counted | {jax.default_backend()}
            result = ee.fit(
                state["ens"], loss, optimizer, (x_all, y_all), steps=steps,
                batch_size=batch, key=jax.random.key(0), callbacks=(),
                opt_state=state["opt"],
            )  # fmt: skip
            jax.block_until_ready(result.ensemble)
            state["ens"], state["opt"] = result.ensemble, result.opt_state
            run_module._hides_non_finite = hides
            plan_module.COUNTED = counted

        settle = loop_module._settle_members
        if bare:  # traced at the first call only
            loop_module._settle_members = lambda start, end, mesh: end
        start = time.perf_counter()
        go()
        compile_s[name] = time.perf_counter() - start
        loop_module._settle_members = settle
        variants[name] = go


if __name__ == "__main__":
    main()
