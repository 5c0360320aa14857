"""Every model family: `fit` vs a `make_step` loop vs a hand-written step vs torch.

Per training step, in one process, variants timed round-robin, on seven families:
an MLP, a CNN (8x8 images, digits-sized), the same CNN on 16x16 and 32x32 images
(`cnn16`, `cnn32`: 8 members), the 8x8 CNN with BatchNorm (model state), a small
transformer (one attention block over 16 tokens) and a GRU (16 time steps). For
each:

- `ee.fit` with shared and with bootstrap sampling (a second call, once
  compiled; `steps` steps per call, the library's default dispatch),
- `ee.make_step`, one step per call (a user's own loop),
- a hand-written step: `eqx.filter_jit` of `eqx.filter_vmap` over members of
  `eqx.filter_value_and_grad` + optax, with donation, one step per call,
- `torch.func` (`stack_module_state` + `functional_call` + `vmap(grad)`, Adam on
  the stacked parameters) for the MLP and the CNNs, when torch is installed. By
  default torch is timed in a process of its own, after the JAX variants of the
  family (`--torch process`): torch's OpenMP threads spin after each call and
  would take a core from the JAX variant timed next, and telling them to sleep
  (`--torch passive`) slows torch itself. `--torch same` times it round-robin
  with the JAX variants in this process (the pre-round-3 measurement).

It prints ms per step, the ratios the round-2 targets name (fit / make_step,
make_step / torch.func, fit / torch.func) and the achieved GFLOP/s (XLA's cost
analysis of one step) against a plain float32 matmul measured in the same run.

Run: `python benchmarks/bench_families.py` (`--quick`: a smoke run of a few
seconds per family; `--families mlp,cnn` to choose; `--steps 20` for 20-step
`fit` calls: a convolving run's automatic layout reads its length).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common  # noqa: E402


def _families(jax, jnp, eqx, n=1024):
    """name -> (make(key) -> model or (model, state), loss, stateful, x, y), on
    `n` examples."""
    key = jax.random.key(0)
    labels = jax.random.randint(key, (n,), 0, 10)

    class CNN(eqx.Module):
        conv1: eqx.nn.Conv2d
        conv2: eqx.nn.Conv2d
        out: eqx.nn.Linear

        def __init__(self, key, side=8):
            k1, k2, k3 = jax.random.split(key, 3)
            self.conv1 = eqx.nn.Conv2d(1, 16, 3, padding=1, key=k1)
            self.conv2 = eqx.nn.Conv2d(16, 32, 3, padding=1, key=k2)
            self.out = eqx.nn.Linear(32 * side * side, 10, key=k3)

        def __call__(self, x):
            x = jax.nn.relu(self.conv1(x))
            return self.out(jax.nn.relu(self.conv2(x)).reshape(-1))

    class BNCNN(eqx.Module):
        conv1: eqx.nn.Conv2d
        norm: eqx.nn.BatchNorm
        conv2: eqx.nn.Conv2d
        out: eqx.nn.Linear

        def __init__(self, key):
            k1, k2, k3 = jax.random.split(key, 3)
            self.conv1 = eqx.nn.Conv2d(1, 16, 3, padding=1, use_bias=False, key=k1)
            self.norm = eqx.nn.BatchNorm(16, axis_name="batch", mode="batch")
            self.conv2 = eqx.nn.Conv2d(16, 32, 3, padding=1, key=k2)
            self.out = eqx.nn.Linear(32 * 8 * 8, 10, key=k3)

        def __call__(self, x, state):
            x, state = self.norm(self.conv1(x), state)
            x = jax.nn.relu(self.conv2(jax.nn.relu(x)))
            return self.out(x.reshape(-1)), state

    class Transformer(eqx.Module):
        embed: eqx.nn.Linear
        attention: eqx.nn.MultiheadAttention
        norm1: eqx.nn.LayerNorm
        mlp: eqx.nn.MLP
        norm2: eqx.nn.LayerNorm
        out: eqx.nn.Linear

        def __init__(self, key):
            k1, k2, k3, k4 = jax.random.split(key, 4)
            self.embed = eqx.nn.Linear(8, 32, key=k1)
            self.attention = eqx.nn.MultiheadAttention(2, 32, key=k2)
            self.norm1 = eqx.nn.LayerNorm(32)
            self.mlp = eqx.nn.MLP(32, 32, 64, 1, key=k3)
            self.norm2 = eqx.nn.LayerNorm(32)
            self.out = eqx.nn.Linear(32, 10, key=k4)

        def __call__(self, x):  # x: (tokens, 8)
            h = jax.vmap(self.embed)(x)
            h = jax.vmap(self.norm1)(h + self.attention(h, h, h))
            h = jax.vmap(self.norm2)(h + jax.vmap(self.mlp)(h))
            return self.out(h.mean(0))

    class GRU(eqx.Module):
        cell: eqx.nn.GRUCell
        out: eqx.nn.Linear

        def __init__(self, key):
            k1, k2 = jax.random.split(key)
            self.cell = eqx.nn.GRUCell(8, 32, key=k1)
            self.out = eqx.nn.Linear(32, 10, key=k2)

        def __call__(self, x):  # x: (time, 8)
            def step(h, xt):
                return self.cell(xt, h), None

            h, _ = jax.lax.scan(step, jnp.zeros(32), x)
            return self.out(h)

    def xent(logits, y):
        return -jnp.mean(
            jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], axis=1)
        )

    def plain_loss(model, batch, key):
        x, y = batch
        return xent(jax.vmap(model)(x), y)

    def stateful_loss(model, state, batch, key):
        x, y = batch
        logits, state = jax.vmap(
            model, axis_name="batch", in_axes=(0, None), out_axes=(0, None)
        )(x, state)
        return xent(logits, y), state

    images = jax.random.normal(key, (n, 1, 8, 8))
    sequences = jax.random.normal(key, (n, 16, 8))
    return {
        "mlp": (
            lambda k: eqx.nn.MLP(64, 10, 256, 2, key=k),
            plain_loss,
            False,
            images.reshape(n, 64),
            labels,
        ),
        "cnn": (CNN, plain_loss, False, images, labels),
        # The same CNN on larger images (issue 28: where XLA's CPU convolutions
        # fall behind PyTorch's).
        **{
            f"cnn{side}": (
                lambda k, side=side: CNN(k, side),
                plain_loss,
                False,
                jax.random.normal(key, (n, 1, side, side)),
                labels,
            )
            for side in CNN_SIDES
        },
        "cnn_bn": (eqx.nn.make_with_state(BNCNN), stateful_loss, True, images, labels),
        "transformer": (Transformer, plain_loss, False, sequences, labels),
        "gru": (GRU, plain_loss, False, sequences, labels),
    }


CNN_SIDES = (16, 32)  # the "cnn16" and "cnn32" families: 8 members by default
TORCH_FAMILIES = ("mlp", "cnn") + tuple(f"cnn{side}" for side in CNN_SIDES)


def _side(family: str) -> int:
    """The image side of a CNN family ("cnn": 8, "cnn16": 16...)."""
    return int(family[3:] or 8)


def _torch_func_step(name, members, x, y, lr, device):
    """A torch.func step for the MLP or the CNN (None for other families) on
    `device` ("cpu" or "cuda")."""
    import numpy as np
    import torch
    from torch import nn
    from torch.func import functional_call, grad, stack_module_state, vmap

    if name == "mlp":

        def make():
            return nn.Sequential(
                nn.Linear(64, 256),
                nn.ReLU(),
                nn.Linear(256, 256),
                nn.ReLU(),
                nn.Linear(256, 10),
            )
    elif name.startswith("cnn") and name in TORCH_FAMILIES:
        side = _side(name)

        def make():
            return nn.Sequential(
                nn.Conv2d(1, 16, 3, padding=1),
                nn.ReLU(),
                nn.Conv2d(16, 32, 3, padding=1),
                nn.ReLU(),
                nn.Flatten(),
                nn.Linear(32 * side * side, 10),
            )
    else:
        return None
    models = [make().to(device) for _ in range(members)]
    params, buffers = stack_module_state(models)
    base = make().to("meta")
    xt = torch.from_numpy(np.array(x)).to(device)
    yt = torch.from_numpy(np.array(y)).long().to(device)

    def loss(p, b, xb, yb):
        logits = functional_call(base, (p, b), (xb,))
        return nn.functional.cross_entropy(logits, yb)

    grads_of = vmap(grad(loss), in_dims=(0, 0, None, None))
    optimizer = torch.optim.Adam(list(params.values()), lr=lr)

    def step():
        grads = grads_of(params, buffers, xt, yt)
        for name_, value in params.items():
            value.grad = grads[name_]
        optimizer.step()

    def steps(count):
        for _ in range(count):
            step()
        _common.torch_sync(torch, device)

    return steps


def torch_worker(family, members, batch, steps, repeats, device, passive):
    """Seconds per block of `steps` torch.func steps, `repeats` blocks after one
    warm-up block (run by `_common.run_worker` in a process of its own; imports
    torch and NumPy only)."""
    if passive:  # before torch loads its OpenMP runtime
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    import numpy as np

    rng = np.random.default_rng(0)
    side = 8 if family == "mlp" else _side(family)
    shape = (batch, 64) if family == "mlp" else (batch, 1, side, side)
    x = rng.standard_normal(shape, dtype=np.float32)
    y = rng.integers(0, 10, size=batch)
    run = _torch_func_step(family, members, x, y, 1e-3, device)
    return _common.interleaved({"torch.func": lambda: run(steps)}, repeats=repeats)[
        "torch.func"
    ]


def main() -> None:
    p = _common.parser(__doc__.splitlines()[0])
    p.add_argument(
        "--torch",
        choices=("process", "same", "passive", "none"),
        default="process",
        help="how torch.func is timed: in a process of its own after each family's "
        "JAX variants (default); round-robin in this process ('same': its spinning "
        "OpenMP threads then slow the JAX variant timed next); in its own process "
        "with OMP_WAIT_POLICY=PASSIVE ('passive': threads sleep, torch slower); "
        "or not at all",
    )
    p.add_argument("--families", default="mlp,cnn,cnn16,cnn32,cnn_bn,transformer,gru")
    p.add_argument("--members", type=int, default=None)
    p.add_argument(
        "--examples",
        type=int,
        default=1024,
        help="examples `fit` samples from (an epoch's permutation is drawn per "
        "epoch; more examples, a longer sort)",
    )
    p.add_argument("--batch", type=int, default=128)
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        help="steps per timed block: per `fit` call, and `make_step` calls (default "
        "50; 10 with --quick). The automatic layout of a convolving `fit` reads "
        "the run's length",
    )
    p.add_argument("--no-torch", action="store_true", help="same as --torch none")
    p.add_argument(
        "--no-hand",
        action="store_true",
        help="leave out the hand-written vmapped step (on a CPU its grouped "
        "convolutions make it the slowest variant by far on the CNN rows)",
    )
    args = p.parse_args()
    if args.no_torch:
        args.torch = "none"
    steps = args.steps or (10 if args.quick else 50)
    repeats = args.repeats or (2 if args.quick else 3)
    _common.print_header(
        f"model families: batch {args.batch} of {args.examples} examples, Adam; "
        f"{steps} steps per timed block, "
        f"{repeats} blocks per variant; torch: {args.torch}"
    )
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import eqx_ensemble as ee

    _common.keep_scratch(args)

    optimizer = optax.adam(1e-3)
    n = 2048 if args.quick else 4096
    a = jax.random.normal(jax.random.key(1), (n, n))
    mm = jax.jit(lambda a: a @ a)
    matmul_gflops = (
        2
        * n**3
        / _common.median(
            _common.time_calls(lambda: mm(a).block_until_ready(), repeats=5, warmup=2)
        )
        / 1e9
    )
    print(
        f"   plain float32 matmul {n}x{n} on {_common.jax_device_name()}: "
        f"{matmul_gflops:.1f} GFLOP/s"
    )
    results = {"matmul_gflops": matmul_gflops, "device": _common.jax_device_name()}
    families = _families(jax, jnp, eqx, args.examples)
    for name in args.families.split(","):
        make, loss_fn, stateful, x_all, y_all = families[name]
        members = args.members or (8 if name == "mlp" or name[3:].isdigit() else 5)
        built = ee.ensemble(make, size=members, key=jax.random.key(2))
        ens, state = built if stateful else (built, None)
        data = (x_all, y_all)
        batch = (x_all[: args.batch], y_all[: args.batch])
        opt_state = ee.init_optimizer(optimizer, ens)
        variants = {}

        for sampling in ("shared", "bootstrap"):

            def run_fit(sampling=sampling):
                result = ee.fit(
                    ens,
                    loss_fn,
                    optimizer,
                    data,
                    steps=steps,
                    batch_size=args.batch,
                    key=jax.random.key(3),
                    sampling=sampling,
                    state=state,
                    callbacks=(),
                )
                jax.block_until_ready(result.ensemble)

            variants[f"fit {sampling}"] = (run_fit, steps)

        step = ee.make_step(loss_fn, optimizer)
        loop_state = {"ens": ens, "opt": opt_state, "state": state}

        def run_make_step():
            for i in range(steps):
                out = step(
                    loop_state["ens"],
                    loop_state["opt"],
                    batch,
                    jax.random.key(i),
                    loop_state["state"],
                )
                loop_state["ens"], loop_state["opt"] = out.ensemble, out.opt_state
                loop_state["state"] = out.state
            jax.block_until_ready(loop_state["ens"])

        variants["make_step loop"] = (run_make_step, steps)

        @eqx.filter_jit(donate="all-except-first")
        def hand_step(batch, members, opt, member_state):
            def one(member, opt, member_state):
                if stateful:
                    (loss, new_state), grads = eqx.filter_value_and_grad(
                        loss_fn, has_aux=True
                    )(member, member_state, batch, None)
                else:
                    loss, grads = eqx.filter_value_and_grad(loss_fn)(
                        member, batch, None
                    )
                    new_state = member_state
                with jax.numpy_dtype_promotion("standard"):
                    updates, opt = optimizer.update(
                        grads, opt, eqx.filter(member, eqx.is_inexact_array)
                    )
                return eqx.apply_updates(member, updates), opt, new_state, loss

            return eqx.filter_vmap(one)(members, opt, member_state)

        def copied(tree):
            return jax.tree.map(lambda v: jnp.copy(v) if eqx.is_array(v) else v, tree)

        hand = {
            "members": copied(ens.members),
            "opt": copied(opt_state),
            "state": copied(state),
        }

        def run_hand():
            for _ in range(steps):
                hand["members"], hand["opt"], hand["state"], _ = hand_step(
                    batch, hand["members"], hand["opt"], hand["state"]
                )
            jax.block_until_ready(hand["members"])

        if not args.no_hand:
            variants["hand-written step"] = (run_hand, steps)
        if args.torch == "same" and name in TORCH_FAMILIES:
            try:
                import torch

                torch_step = _torch_func_step(
                    name,
                    members,
                    np.asarray(batch[0]),
                    np.asarray(batch[1]),
                    1e-3,
                    _common.torch_device(torch),
                )
            except ImportError:
                torch_step = None
            if torch_step is not None:

                def run_torch(torch_step=torch_step):
                    torch_step(steps)

                variants["torch.func"] = (run_torch, steps)

        times = _common.interleaved(
            {k: fn for k, (fn, _) in variants.items()}, repeats=repeats
        )
        if args.torch in ("process", "passive") and name in TORCH_FAMILIES:
            try:
                times["torch.func"] = _common.run_worker(
                    __file__,
                    "torch_worker",
                    family=name,
                    members=members,
                    batch=args.batch,
                    steps=steps,
                    repeats=repeats,
                    device="cuda" if jax.default_backend() == "gpu" else "cpu",
                    passive=args.torch == "passive",
                )
                variants["torch.func"] = (None, steps)
            except RuntimeError as error:  # e.g. torch not installed
                print(f"   torch.func skipped: {str(error).splitlines()[-1]}")
        per_step = {k: _common.median(v) / variants[k][1] for k, v in times.items()}
        lowered = step.lower(ens, opt_state, batch, jax.random.key(0), state)
        flops = float(lowered.compile().compiled.cost_analysis().get("flops", 0.0))
        print(f"\n-- {name}: {members} members, {flops / 1e6:.1f} MFLOP per step")
        for k, seconds in per_step.items():
            print(
                f"   {k:<18} {seconds * 1e3:8.2f} ms/step  "
                f"{flops / seconds / 1e9:7.2f} GFLOP/s "
                f"({flops / seconds / 1e9 / matmul_gflops:6.1%} of the matmul)"
            )
        ratios = {
            "fit/make_step (speed-up)": per_step["make_step loop"]
            / per_step["fit shared"],
            "fit bootstrap/make_step": per_step["make_step loop"]
            / per_step["fit bootstrap"],
        }
        if "torch.func" in per_step:
            ratios["fit/torch.func"] = per_step["torch.func"] / per_step["fit shared"]
            ratios["make_step/torch.func"] = (
                per_step["torch.func"] / per_step["make_step loop"]
            )
        for k, v in ratios.items():
            print(f"   {k:<26} {v:5.2f}x")
        results[name] = {
            "ms_per_step": {k: v * 1e3 for k, v in per_step.items()},
            "ratios": ratios,
            "mflop_per_step": flops / 1e6,
        }
    _common.emit_summary("families", results, args.json)


if __name__ == "__main__":
    main()
