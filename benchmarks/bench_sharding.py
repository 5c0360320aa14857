"""Sharding: `fit` step throughput on 1 device vs the member axis split over N devices.

For each device count N (default 2, 4, 8) the script starts a fresh Python process
with `XLA_FLAGS=--xla_force_host_platform_device_count=N` (virtual CPU devices: the
count must be set before JAX starts, hence the subprocesses). In that process it
times, round-robin so a change in the machine's load hits them alike:

- `one device`: `ee.fit` without a mesh (everything on device 0),
- `members=N`: `ee.fit(..., mesh=ee.make_mesh(members=N))`,
- `members=N/2 x data=2`: a 2-D mesh (member axis and batch axis split),

each a second call (compiled), all steps fused into one dispatch, and prints steps
per second and the ratio to `one device` in the same process.

Virtual CPU devices share the machine's cores: on a CPU the split mostly measures
the overhead of partitioning (and whatever parallelism XLA's per-device thread
pools add); real gains need real devices (GPUs, TPUs, hosts).

Run: `python benchmarks/bench_sharding.py` (`--quick` for a smoke run).
"""

import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common  # noqa: E402

WORKER_PREFIX = "WORKER-JSON: "


def worker(devices: int, members: int, batch: int, steps: int, repeats: int) -> None:
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import optax

    import eqx_ensemble as ee

    assert jax.device_count() == devices, jax.devices()
    sizes = [32, 128, 128, 10]
    key_x, key_y, key_ens = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(key_x, (4096, sizes[0]), dtype=jnp.float32)
    y = jax.random.randint(key_y, (4096,), 0, sizes[-1])
    ens = ee.ensemble(
        lambda k: eqx.nn.MLP(
            sizes[0], sizes[-1], sizes[1], len(sizes) - 2, activation=jax.nn.relu, key=k
        ),
        size=members,
        key=key_ens,
    )

    def loss_fn(model, data, key):
        inputs, labels = data
        logits = jax.vmap(model)(inputs)
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    optimizer = optax.adam(1e-3)  # one object: a new one would recompile `fit`
    meshes = {"one device": None, f"members={devices}": ee.make_mesh(members=devices)}
    if devices >= 4:
        meshes[f"members={devices // 2} x data=2"] = ee.make_mesh(
            members=devices // 2, data=2
        )

    def run(mesh):
        def call():
            data = (x, y) if mesh is None else ee.shard((x, y), mesh, axes="data")
            result = ee.fit(
                ens,
                loss_fn,
                optimizer,
                data,
                steps=steps,
                batch_size=batch,
                key=jax.random.key(1),
                callbacks=(),
                execution=ee.Execution(steps_per_dispatch=steps, mesh=mesh),
            )
            jax.block_until_ready(result.ensemble)

        return call

    times = _common.interleaved(
        {name: run(mesh) for name, mesh in meshes.items()}, repeats=repeats
    )
    print(
        WORKER_PREFIX
        + json.dumps({name: _common.median(ts) for name, ts in times.items()})
    )


def main() -> None:
    p = _common.parser(__doc__.splitlines()[0])
    p.add_argument("--devices", default="2,4,8", help="device counts, e.g. 2,4,8")
    p.add_argument("--members", type=int, default=64)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--steps", type=int, default=None, help="steps per call")
    p.add_argument("--worker", type=int, default=None, help=argparse_hidden())
    args = p.parse_args()
    steps = args.steps or (5 if args.quick else 50)
    repeats = args.repeats or (2 if args.quick else 5)
    members = 16 if args.quick and args.members == 64 else args.members
    if args.worker is not None:
        worker(args.worker, members, args.batch, steps, repeats)
        return

    info = _common.print_header(
        f"sharding: {members} MLPs 32-128-128-10, batch {args.batch}, Adam; "
        f"{steps} steps per call, median of {repeats}"
    )
    results = {}
    for devices in [int(n) for n in args.devices.split(",")]:
        flags = " ".join(
            flag
            for flag in os.environ.get("XLA_FLAGS", "").split()
            if "xla_force_host_platform_device_count" not in flag
        )
        env = {
            **os.environ,
            "JAX_PLATFORMS": "cpu",
            "XLA_FLAGS": f"{flags} --xla_force_host_platform_device_count={devices}",
        }
        command = [
            sys.executable,
            os.path.abspath(__file__),
            f"--worker={devices}",
            f"--members={members}",
            f"--batch={args.batch}",
            f"--steps={steps}",
            f"--repeats={repeats}",
        ]
        done = subprocess.run(command, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            print(done.stdout, done.stderr, sep="\n")
            raise SystemExit(f"the {devices}-device worker failed")
        line = next(
            text for text in done.stdout.splitlines() if text.startswith(WORKER_PREFIX)
        )
        seconds = json.loads(line[len(WORKER_PREFIX) :])
        base = seconds["one device"]
        print(f"-- {devices} virtual CPU devices")
        for name, value in seconds.items():
            print(
                f"   {name:26s} {steps / value:9.1f} steps/s  "
                f"{value * 1e3:9.1f} ms per call   x{base / value:5.2f} vs one device"
            )
        results[str(devices)] = {
            name: {"seconds": value, "ratio_vs_one_device": base / value}
            for name, value in seconds.items()
        }
    _common.emit_summary(
        "sharding",
        {"machine": info, "members": members, "steps": steps, "results": results},
        args.json,
    )


def argparse_hidden() -> str:
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    main()
