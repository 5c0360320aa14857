"""Convolutions inside a compiled loop on a CPU: JAX's lowering against the
library's (`_execution/convolution.py`).

XLA's CPU backend hands a convolution to its fast kernels only in the layout
(batch, spatial, features) x (spatial, in, out), and moves other convolutions
into it only at a program's top level (jax-ml/jax issue 12868). This script
times, on a CNN of `bench_families.py` (two 3x3 convolutions, batch 128,
Adam, `--members` members; `--family cnn`, `cnn16` or `cnn32`: 8x8, 16x16
or 32x32 images), the members' step (value, gradient, update):

- one member after another in a `jax.lax.scan` (a loop), lowered by JAX
  (`jax.jit`) and by the library (`compile.filter_jit`, what `fit` and
  `make_step` compile with);
- the same members as straight-line code (no loop: XLA moves the
  convolutions itself), lowered by JAX;
- the scan of members inside a 20-step loop (what a `fit` dispatch is), both
  lowerings.

It prints ms per step and the library's lowering against JAX's in the same
run, and checks that both compute the same (to float32 rounding).

Run: `python benchmarks/bench_conv_loop.py [--family cnn] [--members 5]
[--repeats 5]` (`--quick`: 2 repeats).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common  # noqa: E402


def main(args) -> dict:
    import time

    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from bench_families import _families, _side

    from eqx_ensemble._execution.compile import filter_jit

    side, members = _side(args.family), args.members
    _common.print_header(
        f"convolutions in a loop: {members} CNNs on {side}x{side} images "
        f"(`bench_families.py`'s {args.family}), batch 128, Adam"
    )
    make, _, _, images, labels = _families(jax, jnp, eqx)[args.family]
    stacked = eqx.filter_vmap(make)(jax.random.split(jax.random.key(0), members))
    params, static = eqx.partition(stacked, eqx.is_array)
    optimizer = optax.adam(1e-3)
    opt_state = jax.vmap(optimizer.init)(params)
    x, y = images[:128], labels[:128]

    def loss(p):
        logits = jax.vmap(eqx.combine(p, static))(x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    def one(p, o):
        value, grads = jax.value_and_grad(loss)(p)
        updates, o = optimizer.update(grads, o, p)
        return optax.apply_updates(p, updates), o, value

    def scanned(p, o):
        return jax.lax.scan(lambda c, po: (c, one(*po)), None, (p, o))[1]

    def straight(p, o):
        outs = [one(*jax.tree.map(lambda a: a[i], (p, o))) for i in range(members)]
        return jax.tree.map(lambda *a: jnp.stack(a), *outs)

    def dispatch(p, o):
        def body(carry, _):
            p, o, losses = scanned(*carry)
            return (p, o), losses

        return jax.lax.scan(body, (p, o), None, length=20)

    programs = {
        "members in a scan, JAX's lowering": (jax.jit(scanned), 1),
        "members in a scan, the library's": (filter_jit(scanned, ()), 1),
        "straight-line members, JAX's lowering": (jax.jit(straight), 1),
        "20-step dispatch, JAX's lowering": (jax.jit(dispatch), 20),
        "20-step dispatch, the library's": (filter_jit(dispatch, ()), 20),
    }
    outputs, first = {}, {}
    for name, (program, _) in programs.items():
        start = time.perf_counter()
        outputs[name] = jax.block_until_ready(program(params, opt_state))
        first[name] = time.perf_counter() - start
    # The same computation: the losses (the weights after an Adam step are
    # no test of it: Adam's first update is the gradient's sign times the
    # rate, so a gradient near zero may round to another update; the tests
    # compare the gradients, `tests/test_convolution.py`).
    for pair, rtol in [
        (
            ("members in a scan, JAX's lowering", "members in a scan, the library's"),
            1e-5,
        ),
        (("20-step dispatch, JAX's lowering", "20-step dispatch, the library's"), 1e-3),
    ]:
        np.testing.assert_allclose(
            *(np.asarray(outputs[name][-1]) for name in pair), rtol=rtol
        )
    calls = {
        name: (lambda p=program: jax.block_until_ready(p(params, opt_state)))
        for name, (program, _) in programs.items()
    }
    times = _common.interleaved(
        calls, repeats=args.repeats or (2 if args.quick else 5), warmup=0
    )
    ms = {
        name: _common.median(times[name]) / programs[name][1] * 1e3 for name in programs
    }
    for name in programs:
        print(f"   {name:<40} first call {first[name]:5.2f} s  {ms[name]:9.2f} ms/step")
    ratios = {
        "scan: library / JAX (speed-up)": ms["members in a scan, JAX's lowering"]
        / ms["members in a scan, the library's"],
        "dispatch: library / JAX (speed-up)": ms["20-step dispatch, JAX's lowering"]
        / ms["20-step dispatch, the library's"],
        "library's scan / straight-line (speed-up)": ms[
            "straight-line members, JAX's lowering"
        ]
        / ms["members in a scan, the library's"],
    }
    for name, ratio in ratios.items():
        print(f"   {name}: {ratio:.2f}x")
    return {"ms_per_step": ms, "first_s": first, "ratios": ratios}


if __name__ == "__main__":
    p = _common.parser(__doc__)
    p.add_argument("--family", default="cnn", choices=("cnn", "cnn16", "cnn32"))
    p.add_argument("--members", type=int, default=5)
    args = p.parse_args()
    _common.emit_summary("conv_loop", main(args), args.json)
