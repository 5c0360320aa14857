"""Convolutions as patches and a batched matmul (issue 46, item 3): is it faster?

XLA's CPU convolutions run at a fraction of its matmul rate, and a vmapped
convolution over members is a grouped one. The rewrite tried here lowers each
member's convolution to `jax.lax.conv_general_dilated_patches` and one
`dot_general` with the member's kernel (so that vmapping over members gives a
batched matmul). Timed: one `ee.make_step` step (the library's XLA options),
the bench_families CNN (conv 1-16, conv 16-32, 3x3, a linear head; 8 members,
batch 128, Adam) with `eqx.nn.Conv2d` and with the rewrite, in the `"vmap"`
and `"sequential"` layouts, with the library's XLA options or with YNNPACK's
fusions off for both (`--options ynn-off`). Ratios > 1: the rewrite is faster.

    python benchmarks/bench_conv_patches.py [--sides 8,16] [--options ynn-off]
"""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common  # noqa: E402


def _step_time(
    side: int, layout: str, patches: bool, repeats: int, options: str
) -> tuple:
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import optax

    import eqx_ensemble as ee

    class Conv(eqx.nn.Conv2d):
        def __call__(self, x, *, key=None):
            if not patches:
                return super().__call__(x)
            out, _, kh, kw = self.weight.shape
            p = jax.lax.conv_general_dilated_patches(
                x[None], (kh, kw), (1, 1), ((1, 1), (1, 1))
            )[0]
            y = jnp.einsum("ok,khw->ohw", self.weight.reshape(out, -1), p)
            return y if self.bias is None else y + self.bias

    class CNN(eqx.Module):
        conv1: Conv
        conv2: Conv
        out: eqx.nn.Linear

        def __init__(self, key):
            k1, k2, k3 = jax.random.split(key, 3)
            self.conv1 = Conv(1, 16, 3, padding=1, key=k1)
            self.conv2 = Conv(16, 32, 3, padding=1, key=k2)
            self.out = eqx.nn.Linear(32 * side * side, 10, key=k3)

        def __call__(self, x):
            x = jax.nn.relu(self.conv1(x))
            return self.out(jax.nn.relu(self.conv2(x)).reshape(-1))

    ens = ee.ensemble(CNN, size=8, key=jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (128, 1, side, side))
    y = jax.random.randint(jax.random.key(2), (128,), 0, 10)

    def loss(model, batch, key):
        xb, yb = batch
        logits = jax.vmap(model)(xb)
        return optax.softmax_cross_entropy_with_integer_labels(logits, yb).mean()

    opt = optax.adam(1e-3)
    compiler_options = None  # the library's choice
    if options == "ynn-off":  # both variants with YNNPACK's fusions off
        compiler_options = {
            "xla_cpu_experimental_ynn_fusion_type": "",
            "xla_backend_optimization_level": 1,
        }
    execution = ee.Execution(layout=layout, compiler_options=compiler_options)
    step = ee.make_step(loss, opt, execution=execution)
    state = ee.init_optimizer(opt, ens)
    start = time.perf_counter()
    out = jax.block_until_ready(step(ens, state, (x, y), jax.random.key(3)))
    first = time.perf_counter() - start
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = jax.block_until_ready(step(out[0], out[1], (x, y), jax.random.key(3)))
        times.append(time.perf_counter() - start)
    return first, _common.median(times)


def main() -> None:
    p = _common.parser(__doc__.splitlines()[0])
    p.add_argument("--sides", default="8,16", help="image sides, comma-separated")
    p.add_argument(
        "--options",
        default="library",
        choices=("library", "ynn-off"),
        help="XLA options: the library's choice per step, or YNNPACK's fusions "
        "off for both variants",
    )
    args = p.parse_args()
    repeats = args.repeats or (2 if args.quick else 5)
    sides = [8] if args.quick else [int(s) for s in args.sides.split(",")]
    _common.print_header("Convolutions: eqx.nn.Conv2d vs patches + batched matmul")
    print("| image | layout | Conv2d ms/step | patches ms/step | patches / Conv2d |")
    print("| --- | --- | ---: | ---: | ---: |")
    results = {}
    for side in sides:
        for layout in ("vmap", "sequential"):
            direct = _common.run_worker(
                __file__, "_step_time", side=side, layout=layout, patches=False,
                repeats=repeats, options=args.options,
            )  # fmt: skip
            patched = _common.run_worker(
                __file__, "_step_time", side=side, layout=layout, patches=True,
                repeats=repeats, options=args.options,
            )  # fmt: skip
            ratio = direct[1] / patched[1]
            results[f"{side}x{side} {layout}"] = {
                "conv2d_ms": direct[1] * 1e3,
                "patches_ms": patched[1] * 1e3,
                "speedup": ratio,
            }
            print(
                f"| {side}x{side} | {layout} | {direct[1] * 1e3:.1f} | "
                f"{patched[1] * 1e3:.1f} | {ratio:.2f}x |"
            )
    _common.emit_summary("conv_patches", results, args.json)


if __name__ == "__main__":
    main()
