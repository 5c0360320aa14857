"""What the library costs around the work: per call, per `fit`, and at the first
call (issue 25's targets), as ratios against hand-written code in the same run.

1. `make_step`, one step per call, against a hand-written `eqx.filter_jit`
   step (`eqx.filter_vmap` over members of `eqx.filter_value_and_grad` + the
   optax update) on 8 MLPs 1-32-32-1, batch 16, Adam. Target: at most 1.2x.
2. `fit`'s fixed cost per call: a call of 1 step minus one step's share of a
   call of 201 steps (both once compiled, one dispatch each), with `fit` called
   back to back in a loop (as `make_step` in 1). Target: at most 0.5 ms on a
   CPU. Also printed: the same from single calls timed after the other
   variants (the machine's thread pool idle and its caches cold); and `fit` at
   20 steps per call against a hand-written `lax.scan` of the same 20 steps
   (the GPU target: at least 0.8x).
3. The first call of `fit` (trace, compile and 20 steps) on every family of
   `bench_families.py`, each in a fresh process, against the first 20 calls of
   a hand-written jitted step of the same model in another fresh process.
   Target: at most 2x.

Variants are timed round-robin (medians); the machine is printed first.

    python benchmarks/bench_overhead.py [--quick] [--repeats N] [--families mlp,cnn]
"""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common  # noqa: E402

MEMBERS, BATCH, EXAMPLES = 8, 16, 256


def _tiny(jax, jnp, eqx, optax, ee):
    ens = ee.ensemble(
        lambda k: eqx.nn.MLP(1, 1, 32, 2, key=k), size=MEMBERS, key=jax.random.key(0)
    )
    x = jnp.linspace(-1, 1, EXAMPLES)[:, None]
    y = x**3

    def loss(model, batch, key):
        xb, yb = batch
        return jnp.mean((jax.vmap(model)(xb) - yb) ** 2)

    return ens, (x, y), loss, optax.adam(1e-3)


def per_call(args) -> dict:
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import optax

    import eqx_ensemble as ee

    ens, (x, y), loss, opt = _tiny(jax, jnp, eqx, optax, ee)
    batch = (x[:BATCH], y[:BATCH])
    key = jax.random.key(1)

    def one(member, member_opt, member_key):
        value, grads = eqx.filter_value_and_grad(loss)(member, batch, member_key)
        updates, member_opt = opt.update(
            grads, member_opt, eqx.filter(member, eqx.is_inexact_array)
        )
        return eqx.apply_updates(member, updates), member_opt, value

    @eqx.filter_jit
    def hand(ens, opt_state, key):
        members, opt_state, losses = eqx.filter_vmap(one)(
            ens.members, opt_state, jax.random.split(key, MEMBERS)
        )
        return ee.Ensemble(members), opt_state, losses

    step = ee.make_step(loss, opt)
    opt_state = ee.init_optimizer(opt, ens)
    calls = 50 if args.quick else 300

    def loop_hand():
        out = None
        for _ in range(calls):
            out = hand(ens, opt_state, key)
        jax.block_until_ready(out)

    def loop_step():
        out = None
        for _ in range(calls):
            out = step(ens, opt_state, batch, key)
        jax.block_until_ready(out)

    def fit(steps, **continuing):
        result = ee.fit(
            ens,
            loss,
            opt,
            (x, y),
            steps=steps,
            batch_size=BATCH,
            key=key,
            callbacks=(),
            execution=ee.Execution(steps_per_dispatch=1000),
            **continuing,
        )
        jax.block_until_ready(result.ensemble)

    @eqx.filter_jit
    def scan20(members, opt_state, key):
        dynamic, static = eqx.partition(members, eqx.is_array)

        def body(carry, step):
            dynamic, opt_state = carry
            members = eqx.combine(dynamic, static)
            indices = jax.random.randint(
                jax.random.fold_in(key, step), (BATCH,), 0, EXAMPLES
            )
            xb, yb = x[indices], y[indices]

            def member_step(member, member_opt, member_key):
                value, grads = eqx.filter_value_and_grad(loss)(
                    member, (xb, yb), member_key
                )
                updates, member_opt = opt.update(
                    grads, member_opt, eqx.filter(member, eqx.is_inexact_array)
                )
                return eqx.apply_updates(member, updates), member_opt, value

            keys = jax.random.split(jax.random.fold_in(key, step), MEMBERS)
            members, opt_state, losses = eqx.filter_vmap(member_step)(
                members, opt_state, keys
            )
            return (eqx.filter(members, eqx.is_array), opt_state), losses

        (dynamic, opt_state), losses = jax.lax.scan(
            body, (dynamic, opt_state), jnp.arange(20)
        )
        return eqx.combine(dynamic, static), opt_state, losses

    def hand_scan():
        jax.block_until_ready(scan20(ens.members, opt_state, key))

    fit_calls = 10 if args.quick else 50

    def fits(steps, count, **continuing):
        for _ in range(count):
            fit(steps, **continuing)

    variants = {
        "hand-written filter_jit step x calls": loop_hand,
        "make_step x calls": loop_step,
        "fit 1 step x calls": lambda: fits(1, fit_calls),
        # A loop that carries its optimizer state from call to call.
        "fit 1 step with opt_state x calls": lambda: fits(
            1, fit_calls, opt_state=opt_state
        ),
        "fit 201 steps x calls/10": lambda: fits(201, fit_calls // 10),
        "fit 1 step": lambda: fit(1),
        "fit 201 steps": lambda: fit(201),
        "fit 20 steps": lambda: fit(20),
        "hand-written scan of 20 steps": hand_scan,
    }
    repeats = args.repeats or (3 if args.quick else 9)
    times = _common.interleaved(variants, repeats=repeats, warmup=2)
    med = {name: _common.median(t) for name, t in times.items()}
    hand_us = med["hand-written filter_jit step x calls"] / calls * 1e6
    step_us = med["make_step x calls"] / calls * 1e6
    # Back to back (as `make_step` above): `fit` called in a loop.
    one_call = med["fit 1 step x calls"] / fit_calls
    per_step = (med["fit 201 steps x calls/10"] / (fit_calls // 10) - one_call) / 200
    fixed_ms = (one_call - per_step) * 1e3
    # One call after the other variants ran (the XLA thread pool idle, caches
    # cold): what a single call in a notebook cell pays.
    single_step = (med["fit 201 steps"] - med["fit 1 step"]) / 200
    single_ms = (med["fit 1 step"] - single_step) * 1e3
    print(
        f"   make_step per call: {step_us:.0f} us; hand-written filter_jit step: "
        f"{hand_us:.0f} us; ratio {step_us / hand_us:.2f}x (target <= 1.2x)"
    )
    print(
        f"   fit, {fit_calls} calls back to back: 1-step call {one_call * 1e3:.3f} "
        f"ms, one step {per_step * 1e6:.1f} us -> fixed cost per call "
        f"{fixed_ms:.3f} ms (target <= 0.5 ms on a CPU)"
    )
    continuing = med["fit 1 step with opt_state x calls"] / fit_calls
    continuing_ms = (continuing - per_step) * 1e3
    print(
        f"   fit given its opt_state (a loop carrying it on), back to back: 1-step "
        f"call {continuing * 1e3:.3f} ms -> fixed cost {continuing_ms:.3f} ms"
    )
    print(
        f"   fit, one call after other work: 1-step call "
        f"{med['fit 1 step'] * 1e3:.3f} ms -> fixed cost {single_ms:.3f} ms"
    )
    ratio20 = med["hand-written scan of 20 steps"] / med["fit 20 steps"]
    print(
        f"   fit 20 steps per call {med['fit 20 steps'] * 1e3:.2f} ms; hand-written "
        f"scan {med['hand-written scan of 20 steps'] * 1e3:.2f} ms; fit at "
        f"{ratio20:.2f}x its speed (GPU target >= 0.8x)"
    )
    return {
        "make_step_us": step_us,
        "hand_step_us": hand_us,
        "make_step_ratio": step_us / hand_us,
        "fit_fixed_ms": fixed_ms,
        "fit_fixed_single_call_ms": single_ms,
        "fit_fixed_with_opt_state_ms": continuing_ms,
        "fit_step_us": per_step * 1e6,
        "fit20_vs_scan": ratio20,
    }


def first_fit(family: str, members: int, batch: int, steps: int) -> float:
    """Seconds of the first `fit` call (trace, compile, `steps` steps), in this
    (fresh) process."""
    import bench_families
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import optax

    import eqx_ensemble as ee

    make, loss, stateful, x, y = bench_families._families(jax, jnp, eqx)[family]
    built = ee.ensemble(make, size=members, key=jax.random.key(1))
    ens, state = built if stateful else (built, None)
    jax.block_until_ready((x, y))
    start = time.perf_counter()
    result = ee.fit(
        ens,
        loss,
        optax.adam(1e-3),
        (x, y),
        steps=steps,
        batch_size=batch,
        key=jax.random.key(2),
        state=state,
        callbacks=(),
    )
    jax.block_until_ready(result.ensemble)
    return time.perf_counter() - start


def first_hand(family: str, members: int, batch: int, steps: int) -> float:
    """Seconds of the first `steps` calls of a hand-written jitted step (trace,
    compile, run), in this (fresh) process."""
    import bench_families
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import optax

    import eqx_ensemble as ee

    make, loss, stateful, x, y = bench_families._families(jax, jnp, eqx)[family]
    built = ee.ensemble(make, size=members, key=jax.random.key(1))
    ens, state = built if stateful else (built, None)
    opt = optax.adam(1e-3)
    opt_state = eqx.filter_vmap(opt.init)(eqx.filter(ens.members, eqx.is_array))

    def one(member, member_opt, member_state, key, batch):
        if stateful:

            def wrapped(m):
                return loss(m, member_state, batch, key)

            (value, new_state), grads = eqx.filter_value_and_grad(
                wrapped, has_aux=True
            )(member)
        else:
            value, grads = eqx.filter_value_and_grad(loss)(member, batch, key)
            new_state = member_state
        updates, member_opt = opt.update(
            grads, member_opt, eqx.filter(member, eqx.is_inexact_array)
        )
        return eqx.apply_updates(member, updates), member_opt, new_state, value

    @eqx.filter_jit(donate="all-except-first")
    def step(batch, members, opt_state, state, key):
        keys = jax.random.split(key, members_count)
        per_member = eqx.if_array(0)
        return eqx.filter_vmap(one, in_axes=(per_member,) * 4 + (None,))(
            members, opt_state, state, keys, batch
        )

    members_count = members
    jax.block_until_ready((x, y))
    start = time.perf_counter()
    current = (ens.members, opt_state, state)
    for i in range(steps):
        rows = slice(i * batch, (i + 1) * batch)
        out = step((x[rows], y[rows]), *current, jax.random.key(i))
        current = out[:3]
    jax.block_until_ready(current)
    return time.perf_counter() - start


def main() -> None:
    p = _common.parser(__doc__.splitlines()[0])
    p.add_argument("--families", default="mlp,cnn,cnn_bn,transformer,gru")
    p.add_argument("--members", type=int, default=5)
    p.add_argument("--first-call-repeats", type=int, default=None)
    args = p.parse_args()
    info = _common.print_header("overhead: per call, per fit, first call")
    results: dict = {"machine": info, "per_call": per_call(args)}
    families = [f for f in args.families.split(",") if f]
    repeats = args.first_call_repeats or (1 if args.quick else 3)
    first: dict = {}
    print(
        f"   first call, {args.members} members, batch 32, 20 steps; fresh "
        f"processes, median of {repeats}:"
    )
    for family in families:
        kwargs = dict(family=family, members=args.members, batch=32, steps=20)
        fit_s = _common.median(
            [
                _common.run_worker(__file__, "first_fit", **kwargs)
                for _ in range(repeats)
            ]
        )
        hand_s = _common.median(
            [
                _common.run_worker(__file__, "first_hand", **kwargs)
                for _ in range(repeats)
            ]
        )
        first[family] = {"fit_s": fit_s, "hand_s": hand_s, "ratio": fit_s / hand_s}
        print(
            f"   {family:12s} fit {fit_s:6.2f} s, hand-written 20 calls "
            f"{hand_s:6.2f} s: {fit_s / hand_s:.2f}x (target <= 2x)"
        )
    results["first_call"] = first
    _common.emit_summary("bench_overhead", results, args.json)


if __name__ == "__main__":
    main()
