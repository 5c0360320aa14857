"""Compute-bound regime: 64 MLPs 32-128-128-10, batch 256, Adam.

Compares, in one process and run (variants timed round-robin so a change in the
machine's load hits them alike):

- `ee.fit` (a second call, once compiled; all steps fused into one dispatch),
  with the library's automatic XLA options and, for comparison, with XLA's
  defaults (`ee.Execution(compiler_options={})`),
- `ee.fit` with the member axis split over `--cpu-devices` virtual CPU devices
  (`ee.Execution(mesh=ee.make_mesh(members=N))`; default N = the number of
  cores), the way to put every core on the member axis,
- `ee.make_step` (one step per call),
- a hand-written `eqx.filter_vmap` step, jitted with donation, one step per call,
- the same hand-written step fused with `jax.lax.scan` (as `fit` fuses steps),
  with XLA's defaults and with the library's XLA options (to show what the
  options alone account for),
- `torch.func` (`stack_module_state` + `functional_call` + `vmap(grad)`) with a
  torch Adam on the stacked parameters,
- a PyTorch loop over the 64 modules with one (foreach) Adam over all of them
  (both torch variants timed round-robin in a process of their own, after the
  JAX variants, by default: `--torch same` times them in this process, where
  torch's spinning OpenMP threads slow the JAX variant timed next),

and reports step time, achieved GFLOP/s (matmul FLOPs of forward + backward) and
the fraction of the machine's plain float32 matmul throughput (a single large
matmul in JAX and in torch, measured in the same run).

Run: `python benchmarks/bench_compute.py` (`--quick` for a smoke run).
"""

import copy
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common  # noqa: E402


def matmul_flops_per_step(members: int, batch: int, sizes: list[int]) -> float:
    """Matmul FLOPs of one training step: forward, weight gradients, and input
    gradients of every layer but the first."""
    pairs = list(zip(sizes[:-1], sizes[1:]))
    forward = sum(2 * batch * i * o for i, o in pairs)
    weight_grads = forward
    input_grads = sum(2 * batch * i * o for i, o in pairs[1:])
    return float(members * (forward + weight_grads + input_grads))


def _torch_variants(
    members, batch, sizes, steps, loop_steps, threads, device, lr, n, quick
):
    """The torch variants (torch.func and a loop over members) as timed
    callables, and torch's plain matmul GFLOP/s; imports torch and NumPy only."""
    import numpy as np
    import torch
    import torch.nn.functional as F
    from torch.func import functional_call, grad_and_value, stack_module_state, vmap

    if threads is not None:
        torch.set_num_threads(threads)
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    tx = torch.from_numpy(rng.standard_normal((batch, sizes[0]), dtype=np.float32))
    ty = torch.from_numpy(rng.integers(0, sizes[-1], size=batch)).long()
    tx, ty = tx.to(device), ty.to(device)
    ta = torch.randn(n, n, device=device)

    def torch_mm():
        torch.mm(ta, ta)
        _common.torch_sync(torch, device)

    t_times = _common.time_calls(torch_mm, repeats=5 if quick else 20, warmup=2)
    matmul_gflops = 2 * n**3 / _common.median(t_times) / 1e9

    def torch_model():
        layers = []
        for i, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:])):
            layers.append(torch.nn.Linear(fan_in, fan_out))
            if i < len(sizes) - 2:
                layers.append(torch.nn.ReLU())
        return torch.nn.Sequential(*layers)

    # torch.func: stacked parameters, vmap over members.
    modules = [torch_model().to(device) for _ in range(members)]
    params, buffers = stack_module_state(modules)
    base = copy.deepcopy(modules[0]).to("meta")

    def t_loss(p, b, x, y):
        return F.cross_entropy(functional_call(base, (p, b), (x,)), y)

    t_grad = vmap(grad_and_value(t_loss), in_dims=(0, 0, None, None))
    t_opt = torch.optim.Adam(list(params.values()), lr=lr)

    def run_torch_func():
        for _ in range(steps):
            grads, _losses = t_grad(params, buffers, tx, ty)
            for name, param in params.items():
                param.grad = grads[name]
            t_opt.step()
        _common.torch_sync(torch, device)

    # A plain PyTorch loop over the members.
    loop_modules = [torch_model().to(device) for _ in range(members)]
    loop_opt = torch.optim.Adam(
        [q for m in loop_modules for q in m.parameters()], lr=lr
    )

    def run_torch_loop():
        for _ in range(loop_steps):
            loop_opt.zero_grad(set_to_none=True)
            for module in loop_modules:
                F.cross_entropy(module(tx), ty).backward()
            loop_opt.step()
        _common.torch_sync(torch, device)

    variants = {
        "torch.func vmap + Adam": run_torch_func,
        "PyTorch loop over members": run_torch_loop,
    }
    return variants, matmul_gflops


def torch_worker(repeats, **spec):
    """Wall and CPU seconds per timed block of each torch variant, round-robin,
    and torch's matmul GFLOP/s (run by `_common.run_worker` in its own process)."""
    variants, matmul_gflops = _torch_variants(**spec)
    wall, cpu = _common.interleaved_with_cpu(variants, repeats=repeats, warmup=1)
    return {"wall": wall, "cpu": cpu, "matmul_gflops": matmul_gflops}


def main() -> None:
    p = _common.parser(__doc__.splitlines()[0])
    p.add_argument("--members", type=int, default=64)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        help="steps per timed block (default 20; the slow PyTorch loop runs a "
        "quarter of that)",
    )
    p.add_argument(
        "--torch",
        choices=("process", "same", "none"),
        default="process",
        help="how the torch variants are timed: in a process of their own after "
        "the JAX variants (default: torch's OpenMP threads spin after each call "
        "and would take a core from the JAX variant timed next), round-robin in "
        "this process ('same'), or not at all",
    )
    p.add_argument("--no-torch", action="store_true", help="same as --torch none")
    p.add_argument(
        "--cpu-devices",
        type=int,
        default=None,
        help="virtual CPU devices for the `ee.fit` mesh variant (default: the "
        "number of cores; 1 skips it)",
    )
    p.add_argument(
        "--torch-threads",
        type=int,
        default=None,
        help="torch intra-op threads (default: torch's default, one per core)",
    )
    args = p.parse_args()
    if args.no_torch:
        args.torch = "none"
    members, batch = args.members, args.batch
    steps = args.steps or (4 if args.quick else 20)
    repeats = args.repeats or (2 if args.quick else 5)
    sizes = [32, 128, 128, 10]
    loop_steps = max(1, steps // 4)
    n_data = 4096
    lr = 1e-3

    info = _common.print_header(
        f"compute-bound: {members} MLPs {'-'.join(map(str, sizes))}, batch {batch}, "
        f"Adam; {steps} steps per timed block, {repeats} blocks per variant; "
        f"torch threads: {args.torch_threads or 'default'}, torch: {args.torch}"
    )

    cpu_devices = args.cpu_devices or os.cpu_count() or 1
    import jax

    # Must happen before JAX starts its backends. The other variants run on
    # device 0 alone, as they would without this setting.
    jax.config.update("jax_num_cpu_devices", cpu_devices)
    import equinox as eqx
    import jax.numpy as jnp
    import numpy as np
    import optax

    import eqx_ensemble as ee

    _common.keep_scratch(args)

    flops = matmul_flops_per_step(members, batch, sizes)
    key = jax.random.key(0)
    kx, ky, kens = jax.random.split(key, 3)
    x_all = jax.random.normal(kx, (n_data, sizes[0]), dtype=jnp.float32)
    y_all = jax.random.randint(ky, (n_data,), 0, sizes[-1])
    x_batch, y_batch = x_all[:batch], y_all[:batch]
    optimizer = optax.adam(lr)

    def make_model(k):
        return eqx.nn.MLP(
            sizes[0], sizes[-1], sizes[1], len(sizes) - 2, activation=jax.nn.relu, key=k
        )

    def loss_fn(model, data, key):
        x, y = data
        logits = jax.vmap(model)(x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    def fresh_ensemble():
        return ee.ensemble(make_model, size=members, key=kens)

    variants = {}
    errors: dict[str, str] = {}

    # -- plain matmul: the machine's reference throughput ------------------------
    n = 1024 if args.quick else 2048
    a = jax.random.normal(key, (n, n), dtype=jnp.float32)
    mm = jax.jit(lambda a, b: a @ b)
    mm_times = _common.time_calls(
        lambda: mm(a, a).block_until_ready(), repeats=5 if args.quick else 20, warmup=2
    )
    matmul_gflops = {"jax": 2 * n**3 / _common.median(mm_times) / 1e9}

    # -- the library: fit ---------------------------------------------------------
    def fit_variant(ens, data, **execution):
        # `execution`: fields of `ee.Execution` besides the steps per dispatch.
        state = {"ens": ens}

        def run_fit():
            result = ee.fit(
                state["ens"],
                loss_fn,
                optimizer,
                data,
                steps=steps,
                batch_size=batch,
                key=jax.random.key(1),
                callbacks=(),
                execution=ee.Execution(steps_per_dispatch=steps, **execution),
            )
            jax.block_until_ready(result.ensemble)
            state["ens"] = result.ensemble

        return run_fit

    variants["ee.fit (scan-fused)"] = fit_variant(fresh_ensemble(), (x_all, y_all))
    variants["ee.fit (XLA default options)"] = fit_variant(
        fresh_ensemble(), (x_all, y_all), compiler_options={}
    )
    if cpu_devices > 1 and members % cpu_devices == 0:
        mesh = ee.make_mesh(members=cpu_devices)
        variants[f"ee.fit (mesh, {cpu_devices} CPU devices)"] = fit_variant(
            ee.shard(fresh_ensemble(), mesh),
            ee.shard((x_all, y_all), mesh, axes=()),
            mesh=mesh,
        )

    # -- the library: make_step ---------------------------------------------------
    step = ee.make_step(loss_fn, optimizer)
    step_state = {"ens": fresh_ensemble()}
    step_state["opt"] = ee.init_optimizer(optimizer, step_state["ens"])
    step_key = jax.random.key(2)

    def run_make_step():
        ens, opt_state = step_state["ens"], step_state["opt"]
        for _ in range(steps):
            ens, opt_state, losses, _, _ = step(
                ens, opt_state, (x_batch, y_batch), step_key
            )
        jax.block_until_ready(losses)
        step_state["ens"], step_state["opt"] = ens, opt_state

    variants["ee.make_step (1 step/call)"] = run_make_step

    # -- hand-written eqx.filter_vmap step ----------------------------------------
    def hand_update(models, opt_state, x, y):
        def one(model, state):
            loss, grads = eqx.filter_value_and_grad(loss_fn)(model, (x, y), None)
            updates, state = optimizer.update(grads, state, model)
            return eqx.apply_updates(model, updates), state, loss

        return eqx.filter_vmap(one)(models, opt_state)

    @eqx.filter_jit(donate="all-except-first")
    def hand_step(data, models, opt_state):
        return hand_update(models, opt_state, *data)

    def hand_scan(data, models, opt_state):
        xs, ys = data
        params, static = eqx.partition(models, eqx.is_array)

        def body(carry, batch_):
            p, s = carry
            m, s, loss = hand_update(eqx.combine(p, static), s, *batch_)
            return (eqx.filter(m, eqx.is_array), s), loss

        (params, opt_state), losses = jax.lax.scan(body, (params, opt_state), (xs, ys))
        return eqx.combine(params, static), opt_state, losses

    hand_scan_default = eqx.filter_jit(hand_scan, donate="all-except-first")
    hand_scan_options = eqx.filter_jit(
        hand_scan,
        donate="all-except-first",
        compiler_options={"xla_cpu_experimental_ynn_fusion_type": ""},
    )

    def hand_init():
        models = fresh_ensemble().members
        return {
            "m": models,
            "s": eqx.filter_vmap(optimizer.init)(
                eqx.filter(models, eqx.is_inexact_array)
            ),
        }

    hand_state = hand_init()

    def run_hand_step():
        models, opt_state = hand_state["m"], hand_state["s"]
        for _ in range(steps):
            models, opt_state, losses = hand_step((x_batch, y_batch), models, opt_state)
        jax.block_until_ready(losses)
        hand_state["m"], hand_state["s"] = models, opt_state

    variants["hand filter_vmap (1 step/call)"] = run_hand_step

    rng = np.random.default_rng(0)
    idx = rng.integers(0, n_data, size=(steps, batch))
    xs, ys = x_all[idx], y_all[idx]

    def hand_scan_variant(compiled):
        scan_state = hand_init()

        def run_hand_scan():
            models, opt_state, losses = compiled(
                (xs, ys), scan_state["m"], scan_state["s"]
            )
            jax.block_until_ready(losses)
            scan_state["m"], scan_state["s"] = models, opt_state

        return run_hand_scan

    variants["hand filter_vmap (scan-fused)"] = hand_scan_variant(hand_scan_default)
    variants["hand scan-fused + library's XLA options"] = hand_scan_variant(
        hand_scan_options
    )

    # -- torch ----------------------------------------------------------------------
    torch_spec = {
        "members": members,
        "batch": batch,
        "sizes": sizes,
        "steps": steps,
        "loop_steps": loop_steps,
        "threads": args.torch_threads,
        "device": "cuda" if jax.default_backend() == "gpu" else "cpu",
        "lr": lr,
        "n": n,
        "quick": args.quick,
    }
    if args.torch == "same":
        try:
            built, matmul_gflops["torch"] = _torch_variants(**torch_spec)
            variants.update(built)
        except ImportError as error:
            errors["torch"] = f"torch not installed ({error}): pip install -e .[bench]"

    # -- run ------------------------------------------------------------------------
    runnable = {}
    for name, fn in variants.items():
        try:
            fn()  # compile / warm up; also checks that it runs at all
            runnable[name] = fn
        except Exception as error:  # noqa: BLE001 - report and carry on
            if name.startswith("ee."):
                # The library's own variant failing is our bug (a keyword it no
                # longer takes went unnoticed here for months): stop loudly.
                raise
            errors[name] = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
    block_times, block_cpu = _common.interleaved_with_cpu(
        runnable, repeats=repeats, warmup=1
    )
    if args.torch == "process":
        try:
            worker = _common.run_worker(
                __file__, "torch_worker", repeats=repeats, **torch_spec
            )
            block_times.update(worker["wall"])
            block_cpu.update(worker["cpu"])
            matmul_gflops["torch"] = worker["matmul_gflops"]
        except RuntimeError as error:  # e.g. torch not installed
            errors["torch"] = str(error).splitlines()[-1]

    def steps_of(name: str) -> int:
        return loop_steps if name == "PyTorch loop over members" else steps

    per_step = {
        name: [t / steps_of(name) for t in ts] for name, ts in block_times.items()
    }
    cpu_per_step = {
        name: _common.median(ts) / steps_of(name) for name, ts in block_cpu.items()
    }

    best_matmul = max(matmul_gflops.values())
    print(
        "   plain float32 matmul "
        + ", ".join(f"{k}: {v:.1f} GFLOP/s" for k, v in matmul_gflops.items())
        + f" ({n}x{n})"
    )
    print(f"   model matmul FLOPs per step: {flops / 1e9:.3f} GFLOP")
    print(
        f"   {'variant':40s} {'step time median (min..max)':>36s} {'GFLOP/s':>8s} "
        f"{'of matmul':>9s} {'CPU ms/step':>11s}"
    )
    rows = {}
    for name, ts in per_step.items():
        med = _common.median(ts)
        gflops = flops / med / 1e9
        cpu_ms = cpu_per_step[name] * 1e3
        rows[name] = {"step_ms": med * 1e3, "gflops": gflops, "cpu_ms": cpu_ms}
        print(
            f"   {name:40s} {_common.spread(ts):>36s} {gflops:8.1f} "
            f"{gflops / best_matmul:9.0%} {cpu_ms:11.1f}"
        )
    for name, error in errors.items():
        print(f"   {name:40s} FAILED: {error}")

    def ratio(a: str, b: str) -> float | None:
        if a in rows and b in rows:
            return rows[b]["step_ms"] / rows[a]["step_ms"]
        return None

    mesh_name = f"ee.fit (mesh, {cpu_devices} CPU devices)"
    comparisons = [
        ("ee.fit (scan-fused)", "torch.func vmap + Adam", 1.25),
        ("ee.fit (scan-fused)", "hand filter_vmap (scan-fused)", 1.25),
        ("ee.fit (scan-fused)", "hand filter_vmap (1 step/call)", 1.25),
        (mesh_name, "torch.func vmap + Adam", 1.25),
        (mesh_name, "hand filter_vmap (scan-fused)", 1.25),
        (mesh_name, "ee.fit (scan-fused)", None),
        ("ee.fit (scan-fused)", "ee.fit (XLA default options)", None),
        ("ee.fit (scan-fused)", "hand scan-fused + library's XLA options", None),
        ("ee.fit (scan-fused)", "PyTorch loop over members", None),
        ("ee.make_step (1 step/call)", "hand filter_vmap (1 step/call)", None),
        ("ee.make_step (1 step/call)", "torch.func vmap + Adam", None),
    ]
    ratios = {}
    print("   ratios (speed-up of the first over the second; > 1 = library faster):")
    for a_name, b_name, target in comparisons:
        r = ratio(a_name, b_name)
        if r is None:
            continue
        ratios[f"{a_name} vs {b_name}"] = r
        verdict = (
            ""
            if target is None
            else (f"  target >= {target}: {'MET' if r >= target else 'NOT MET'}")
        )
        print(f"     {a_name} vs {b_name}: {r:.2f}x{verdict}")
    _common.emit_summary(
        "compute",
        {
            "machine": info,
            "members": members,
            "batch": batch,
            "cpu_devices": cpu_devices,
            "steps_per_block": steps,
            "repeats": repeats,
            "matmul_gflops": matmul_gflops,
            "flops_per_step": flops,
            "rows": rows,
            "ratios": ratios,
            "errors": errors,
            "loadavg_end": list(_common.load_average()),
        },
        args.json,
    )


if __name__ == "__main__":
    main()
