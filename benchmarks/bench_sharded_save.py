"""Sharded checkpoints across processes: what each process writes and reads.

Two local processes (`jax.distributed` on 127.0.0.1, gloo collectives, 2 CPU
devices each) hold an ensemble of 8 MLPs 512-1024-1024-10 and its Adam state
(members split over the processes: each process holds half of every array), and
save it with `ee.save`:

- `sharded=True` (the default on several processes): each process writes only
  the shards it owns (tensorstore zarr chunks) and a part of the manifest;
- `sharded=False`: the single file: every array is gathered to every process
  (`process_allgather`) and process 0 writes it all.

Per process: the bytes it wrote (sharded: from the manifest's record of who
wrote each chunk; single file: its size on process 0), the bytes of arrays it
copied to its host (sharded: its own shards; single file: every array, gathered),
and the median wall time of the save (`--repeats`, default 3); then the time to
load the checkpoint back onto the same 2-process mesh (each process reading only
what its devices hold, or the whole file). The issue's target: a 2-process save
writes at most 1/2 + 5% of the bytes per process.

Run: `python benchmarks/bench_sharded_save.py` (`--quick`: a smaller ensemble).
"""

import json
import os
import socket
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common  # noqa: E402

PREFIX = "RESULT-JSON: "


def worker(process_id: int, port: int, folder: str, quick: bool, repeats: int) -> None:
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax

    jax.config.update("jax_num_cpu_devices", 2)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}",
        num_processes=2,
        process_id=process_id,
        initialization_timeout=60,
    )
    import equinox as eqx
    import optax
    from jax.experimental import multihost_utils

    import eqx_ensemble as ee

    width = 256 if quick else 1024
    mesh = ee.make_mesh(members=2, data=2, devices=jax.devices())
    ens = ee.ensemble(
        lambda k: eqx.nn.MLP(512, 10, width, 2, key=k), size=8, key=jax.random.key(0)
    )
    ens = ee.shard(ens, mesh)
    opt_state = ee.init_optimizer(optax.adam(1e-3), ens)
    tree = {"ensemble": ens, "opt_state": opt_state}
    arrays = [x for x in jax.tree.leaves(tree) if isinstance(x, jax.Array)]
    total = sum(x.nbytes for x in arrays)
    own = sum(
        shard.data.nbytes
        for x in arrays
        for shard in x.addressable_shards
        if shard.replica_id == 0
    )
    results = {"total_bytes": total}
    for name, sharded in (("sharded", True), ("single", False)):
        path = os.path.join(folder, f"{name}.ckpt")
        times = []
        for _ in range(repeats + 1):  # the first call is a warm-up
            multihost_utils.sync_global_devices("start")
            start = time.perf_counter()
            ee.save(path, tree, sharded=sharded)
            times.append(time.perf_counter() - start)
        loads = []
        for _ in range(repeats):
            multihost_utils.sync_global_devices("load")
            start = time.perf_counter()
            back = ee.load(path, tree)
            jax.block_until_ready(back)
            loads.append(time.perf_counter() - start)
        if sharded:
            from eqx_ensemble._checkpoints.sharded import written_bytes

            written = written_bytes(ee.load_manifest(path))
            mine = written.get(process_id, 0)
            host = own
        else:
            mine = os.path.getsize(path) if process_id == 0 else 0
            host = total
        results[name] = {
            "written": mine,
            "host": host,
            "save_s": _common.median(times[1:]),
            "load_s": _common.median(loads),
        }
    print(PREFIX + json.dumps(results), flush=True)
    multihost_utils.sync_global_devices("done")
    jax.distributed.shutdown()


def main() -> None:
    p = _common.parser(__doc__.splitlines()[0])
    p.add_argument("--worker", nargs=3, help=argparse_suppress())
    args = p.parse_args()
    repeats = args.repeats or (1 if args.quick else 3)
    if args.worker:
        process_id, port, folder = args.worker
        worker(int(process_id), int(port), folder, args.quick, repeats)
        return
    _common.print_header("sharded checkpoints: 2 processes x 2 CPU devices")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as folder:
        flags = ["--quick"] if args.quick else []
        procs = [
            subprocess.Popen(
                [sys.executable, __file__, "--worker", str(i), str(port), folder,
                 "--repeats", str(repeats), *flags],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for i in range(2)
        ]  # fmt: skip
        outputs = [proc.communicate(timeout=1200)[0] for proc in procs]
    results = []
    for index, output in enumerate(outputs):
        lines = [line for line in output.splitlines() if line.startswith(PREFIX)]
        if not lines:
            raise RuntimeError(f"worker {index} failed:\n{output[-3000:]}")
        results.append(json.loads(lines[0][len(PREFIX) :]))
    total = results[0]["total_bytes"]
    print(f"   ensemble + Adam state: {total / 2**20:.1f} MiB; repeats {repeats}")
    print("   format    process  written MiB (share)  to host MiB  save s   load s")
    for name in ("sharded", "single"):
        for index, result in enumerate(results):
            row = result[name]
            print(
                f"   {name:<8}  {index:>7}  {row['written'] / 2**20:>11.1f} "
                f"({row['written'] / total:>5.1%})  {row['host'] / 2**20:>11.1f}  "
                f"{row['save_s']:>6.3f}  {row['load_s']:>6.3f}"
            )
    worst = max(r["sharded"]["written"] for r in results) / total
    ratio = max(r["sharded"]["save_s"] for r in results) / max(
        r["single"]["save_s"] for r in results
    )
    load_ratio = max(r["sharded"]["load_s"] for r in results) / max(
        r["single"]["load_s"] for r in results
    )
    target = "met" if worst <= 0.5 + 0.05 else "MISSED"
    print(
        f"   sharded: the most any process wrote {worst:.1%} of the bytes (target "
        f"<= 55%: {target}); save time sharded/single {ratio:.2f}x, load "
        f"{load_ratio:.2f}x"
    )
    _common.emit_summary(
        "sharded_save",
        {"results": results, "worst_share": worst, "save_ratio": ratio},
        args.json,
    )


def argparse_suppress() -> str:
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    main()
