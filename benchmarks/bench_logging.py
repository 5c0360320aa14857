"""What logging every dispatch costs `fit` (issue 31's target: at most 2% of the
step time on the dispatch-bound workload).

The dispatch-bound workload (bench_dispatch.py's: 8 MLPs 1-32-32-1, batch 16,
Adam) runs `--steps` steps with no logger, with `ee.CSVLogger`, with
`ee.TensorBoardLogger` (every step's loss of every member) and with both, at
1000 steps per dispatch (fit's default plan here) and at 100 (ten times the
dispatches, each logged). The variants are timed round-robin; per-step medians
and ratios to the run without a logger, in wall time and in the process's CPU
time (all threads: the loggers' thread included; steadier on a busy machine).
The files are written to a scratch folder on the same disk as the system's
temporary files.

    python benchmarks/bench_logging.py [--quick] [--repeats N] [--steps S] [--wandb]
"""

import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common  # noqa: E402


def main() -> None:
    p = _common.parser(__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=None)
    p.add_argument(
        "--wandb", action="store_true", help="also time ee.WandbLogger (offline)"
    )
    args = p.parse_args()
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import numpy as np

    import eqx_ensemble as ee

    info = _common.print_header(f"logging's cost on {_common.jax_device_name()}")
    steps = args.steps or (2000 if args.quick else 10_000)
    repeats = args.repeats or (3 if args.quick else 5)
    members, batch = 8, 16
    x = np.linspace(-1, 1, 256, dtype=np.float32)[:, None]
    y = np.sin(3 * x)
    ens = ee.ensemble(
        lambda k: eqx.nn.MLP(1, 1, 32, 2, key=k), size=members, key=jax.random.key(0)
    )

    def loss(model, b, key):
        xb, yb = b
        return jnp.mean((jax.vmap(model)(xb) - yb) ** 2)

    scratch = tempfile.mkdtemp(prefix="bench_logging_")
    try:
        _measure(args, ens, loss, x, y, steps, batch, repeats, scratch, info)
    finally:  # the loggers' files (tens of MB a run) go with the run
        shutil.rmtree(scratch, ignore_errors=True)


def _measure(args, ens, loss, x, y, steps, batch, repeats, scratch, info) -> None:
    import jax
    import optax

    import eqx_ensemble as ee

    variants = {
        "none": lambda: [],
        "csv": lambda: [ee.CSVLogger(os.path.join(scratch, "csv"))],
        "tensorboard": lambda: [ee.TensorBoardLogger(os.path.join(scratch, "tb"))],
        "both": lambda: [
            ee.CSVLogger(os.path.join(scratch, "csv")),
            ee.TensorBoardLogger(os.path.join(scratch, "tb")),
        ],
    }
    if args.wandb:
        os.environ.setdefault("WANDB_SILENT", "true")
        variants["wandb"] = lambda: [
            ee.WandbLogger(directory=os.path.join(scratch, "wb"), mode="offline")
        ]
    optimizer = optax.adam(1e-2)  # one object: a new one is a new program
    results: dict[str, dict[str, float]] = {}
    for per_dispatch in (1000, 100):
        execution = ee.Execution(steps_per_dispatch=per_dispatch)

        def run(make, execution=execution):
            result = ee.fit(
                ens, loss, optimizer, (x, y), steps=steps, batch_size=batch,
                key=jax.random.key(1), callbacks=make(), execution=execution,
            )  # fmt: skip
            jax.block_until_ready(result.ensemble)

        times, cpu = _common.interleaved_with_cpu(
            {name: (lambda make=make: run(make)) for name, make in variants.items()},
            repeats=repeats,
        )
        base = _common.median(times["none"])
        base_cpu = _common.median(cpu["none"])
        print(f"-- {steps} steps, {per_dispatch} steps per dispatch")
        row = {}
        for name, ts in times.items():
            ratio = _common.median(ts) / base
            cpu_ratio = _common.median(cpu[name]) / base_cpu
            row[name] = ratio
            row[f"{name}_cpu"] = cpu_ratio
            per_step = _common.median(ts) / steps * 1e6
            print(
                f"   {name:12s} {per_step:8.2f} us/step  wall {ratio:6.3f}x, CPU "
                f"{cpu_ratio:6.3f}x no logger  ({_common.spread(ts)} per run)"
            )
        results[f"per_dispatch_{per_dispatch}"] = row
    _common.emit_summary(
        "logging", {"machine": info, "steps": steps, **results}, args.json
    )


if __name__ == "__main__":
    main()
