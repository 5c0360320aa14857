"""Dispatch-bound regime: 8 small MLPs, tiny batches, 1000 Adam steps.

Compares, in one process and run (variants timed round-robin):

- `ee.fit` (a second call, once compiled; its default `steps_per_dispatch`, and
  100 steps per dispatch),
- a PyTorch loop over the members (one module and one Adam each),
- `torch.func` (`stack_module_state` + `functional_call` + `vmap(grad)`) stepping
  once per Python call, with a torch Adam on the stacked parameters,
- an Equinox Python loop over the members (one `eqx.filter_jit` step per member
  per step; compiled once, since every member has the same structure).

Every variant draws its own random minibatch each step. Targets (DESIGN.md
section 4): `fit` >= 50x the PyTorch loop and >= 25x `torch.func`.

Run: `python benchmarks/bench_dispatch.py` (`--quick` for a smoke run).
"""

import copy
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common  # noqa: E402


def main() -> None:
    p = _common.parser(__doc__.splitlines()[0])
    p.add_argument("--members", type=int, default=8)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=None, help="default 1000")
    p.add_argument(
        "--steps-per-dispatch",
        type=int,
        default=None,
        help="fit's steps per dispatch (default: fit's own default, 100)",
    )
    p.add_argument("--no-torch", action="store_true")
    p.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help="torch intra-op threads (default 1: these ops are far too small to "
        "gain from threads, and OpenMP threads spin badly on a loaded machine)",
    )
    args = p.parse_args()
    members, batch = args.members, args.batch
    steps = args.steps or (100 if args.quick else 1000)
    repeats = args.repeats or (2 if args.quick else 5)
    width, n_data, lr = 32, 256, 1e-3
    spd = args.steps_per_dispatch

    info = _common.print_header(
        f"dispatch-bound: {members} MLPs 1-{width}-{width}-1, batch {batch}, "
        f"{steps} Adam steps per timed run, {repeats} runs per variant; torch "
        f"threads: {args.torch_threads}"
    )

    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import eqx_ensemble as ee

    key = jax.random.key(0)
    x_all = jnp.linspace(-2, 2, n_data, dtype=jnp.float32)[:, None]
    y_all = jnp.sin(2 * x_all)
    optimizer = optax.adam(lr)

    def make_model(k):
        return eqx.nn.MLP(1, 1, width, 2, key=k)

    def loss_fn(model, data, key):
        x, y = data
        return jnp.mean((jax.vmap(model)(x) - y) ** 2)

    variants = {}
    errors: dict[str, str] = {}

    # -- the library ----------------------------------------------------------------
    ens0 = ee.ensemble(make_model, size=members, key=key)

    def fit_variant(steps_per_dispatch):
        state = {"ens": ens0}
        extra = (
            {}
            if steps_per_dispatch is None
            else {"execution": ee.Execution(steps_per_dispatch=steps_per_dispatch)}
        )

        def run_fit():
            result = ee.fit(
                state["ens"],
                loss_fn,
                optimizer,
                (x_all, y_all),
                steps=steps,
                batch_size=batch,
                key=jax.random.key(1),
                **extra,
                callbacks=(),
            )
            jax.block_until_ready(result.ensemble)
            state["ens"] = result.ensemble

        return run_fit

    fit_name = (
        "ee.fit (default steps_per_dispatch)"
        if spd is None
        else (f"ee.fit ({spd} steps/dispatch)")
    )
    variants[fit_name] = fit_variant(spd)
    if spd is None:
        # The default is 1000 steps per dispatch for steps this small; 100 (the
        # default for bigger steps) shows what the per-dispatch cost adds.
        variants["ee.fit (100 steps/dispatch)"] = fit_variant(100)

    # -- Equinox Python loop over members ---------------------------------------------
    @eqx.filter_jit
    def member_step(model, opt_state, x, y):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, (x, y), None)
        updates, opt_state = optimizer.update(grads, opt_state, model)
        return eqx.apply_updates(model, updates), opt_state, loss

    eqx_models = ee.unstack(ens0)
    eqx_states = [
        optimizer.init(eqx.filter(m, eqx.is_inexact_array)) for m in eqx_models
    ]
    rng = np.random.default_rng(0)
    x_np, y_np = np.asarray(x_all), np.asarray(y_all)

    def run_eqx_loop():
        for _ in range(steps):
            for i in range(members):
                idx = rng.integers(0, n_data, size=batch)
                eqx_models[i], eqx_states[i], loss = member_step(
                    eqx_models[i], eqx_states[i], x_np[idx], y_np[idx]
                )
        jax.block_until_ready(loss)

    variants["Equinox loop (filter_jit per member)"] = run_eqx_loop

    # -- torch ------------------------------------------------------------------------
    if not args.no_torch:
        try:
            import torch
            import torch.nn.functional as F
            from torch.func import (
                functional_call,
                grad_and_value,
                stack_module_state,
                vmap,
            )

            torch.set_num_threads(args.torch_threads)
            torch.manual_seed(0)
            device = _common.torch_device(torch)
            tx_all = torch.from_numpy(x_np.copy()).to(device)
            ty_all = torch.from_numpy(y_np.copy()).to(device)

            def torch_model():
                return torch.nn.Sequential(
                    torch.nn.Linear(1, width),
                    torch.nn.ReLU(),
                    torch.nn.Linear(width, width),
                    torch.nn.ReLU(),
                    torch.nn.Linear(width, 1),
                )

            loop_modules = [torch_model().to(device) for _ in range(members)]
            loop_opts = [torch.optim.Adam(m.parameters(), lr=lr) for m in loop_modules]

            def run_torch_loop():
                for _ in range(steps):
                    for module, opt in zip(loop_modules, loop_opts):
                        idx = torch.randint(0, n_data, (batch,), device=device)
                        opt.zero_grad(set_to_none=True)
                        F.mse_loss(module(tx_all[idx]), ty_all[idx]).backward()
                        opt.step()
                _common.torch_sync(torch, device)

            variants["PyTorch loop over members"] = run_torch_loop

            modules = [torch_model().to(device) for _ in range(members)]
            params, buffers = stack_module_state(modules)
            base = copy.deepcopy(modules[0]).to("meta")

            def t_loss(p, b, x, y):
                return F.mse_loss(functional_call(base, (p, b), (x,)), y)

            t_grad = vmap(grad_and_value(t_loss), in_dims=(0, 0, None, None))
            t_opt = torch.optim.Adam(list(params.values()), lr=lr)

            def run_torch_func():
                for _ in range(steps):
                    idx = torch.randint(0, n_data, (batch,), device=device)
                    grads, _ = t_grad(params, buffers, tx_all[idx], ty_all[idx])
                    for name, param in params.items():
                        param.grad = grads[name]
                    t_opt.step()
                _common.torch_sync(torch, device)

            variants["torch.func vmap (1 step/call)"] = run_torch_func
        except ImportError as error:
            errors["torch"] = (
                f"torch not installed ({error}); `pip install -e .[bench]`"
            )

    runnable = {}
    for name, fn in variants.items():
        try:
            fn()  # compile / warm up (fit's first call compiles; timed calls are later)
            runnable[name] = fn
        except Exception as error:  # noqa: BLE001 - report and carry on
            if name.startswith("ee."):
                # The library's own variant failing is our bug (a keyword it no
                # longer takes went unnoticed here for months): stop loudly.
                raise
            errors[name] = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
    times = _common.interleaved(runnable, repeats=repeats, warmup=0)

    print(f"   {'variant':40s} {'run time: median (min..max)':>38s} {'us/step':>9s}")
    rows = {}
    for name, ts in times.items():
        med = _common.median(ts)
        rows[name] = {"run_s": med, "us_per_step": med / steps * 1e6}
        spread = f"{med:.4f} s ({min(ts):.4f}..{max(ts):.4f})"
        print(f"   {name:40s} {spread:>38s} {med / steps * 1e6:9.1f}")
    for name, error in errors.items():
        print(f"   {name:40s} FAILED: {error}")

    ratios = {}
    print("   ratios (how many times faster ee.fit is):")
    for other, target in [
        ("PyTorch loop over members", 50),
        ("torch.func vmap (1 step/call)", 25),
        ("Equinox loop (filter_jit per member)", None),
        (f"ee.fit ({steps} steps/dispatch)", None),
    ]:
        if fit_name in rows and other in rows:
            r = rows[other]["run_s"] / rows[fit_name]["run_s"]
            ratios[f"ee.fit vs {other}"] = r
            verdict = (
                ""
                if target is None
                else (f"  target >= {target}x: {'MET' if r >= target else 'NOT MET'}")
            )
            print(f"     vs {other}: {r:.1f}x{verdict}")
    _common.emit_summary(
        "dispatch",
        {
            "machine": info,
            "members": members,
            "batch": batch,
            "steps": steps,
            "steps_per_dispatch": spd,
            "repeats": repeats,
            "rows": rows,
            "ratios": ratios,
            "errors": errors,
            "loadavg_end": list(_common.load_average()),
        },
        args.json,
    )


if __name__ == "__main__":
    main()
