"""Chunked evaluation: `ee.map` over 1024 members, peak memory and throughput
against `chunk_size`.

The workload is chosen so that activations dominate memory: 1024 MLPs
16-128-128-1 evaluated on one shared batch of 2048 examples (each hidden layer's
activations are 1024 x 2048 x 128 float32 = 1 GiB unchunked; the parameters are
70 MiB and the output 8 MiB).

Each configuration runs in a FRESH subprocess. Memory is the process's peak
resident set (`VmHWM` from /proc/self/status): the peak is reset with
`/proc/self/clear_refs` after compiling and one warm-up call, so the reported
*evaluation peak* is the memory the evaluation itself added on top of what the
process already held (Python, JAX, parameters, data), and the *process peak* is
the absolute `VmHWM` including that baseline. XLA's own buffer plan
(`compiled.memory_analysis().temp_size_in_bytes`) is shown as a cross-check.
Throughput is member-examples per second (median of the timed calls).

Targets (DESIGN.md section 4): with chunking, peak memory at most 1/8 of the
unchunked run, throughput at least 0.8x.

Run: `python benchmarks/bench_chunked.py` (`--quick` for a smoke run).
"""

import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common  # noqa: E402

WORKER_PREFIX = "CHUNK-RESULT: "


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def worker(members: int, batch: int, width: int, chunk: int, calls: int) -> None:
    import equinox as eqx
    import jax
    import numpy as np

    import eqx_ensemble as ee

    key = jax.random.key(0)
    ens = ee.ensemble(
        lambda k: eqx.nn.MLP(16, 1, width, 2, key=k), size=members, key=key
    )
    x = jax.random.normal(jax.random.key(1), (batch, 16))
    chunk_size = None if chunk <= 0 else chunk

    @eqx.filter_jit
    def predict(ens, x):
        return ee.map(lambda m, xb: jax.vmap(m)(xb), ens, x, chunk_size=chunk_size)

    compiled = predict.lower(ens, x).compile()
    try:
        inner = getattr(compiled, "compiled", compiled)  # equinox wraps jax's
        temp_bytes = int(inner.memory_analysis().temp_size_in_bytes)
    except Exception:  # noqa: BLE001 - not every backend reports it
        temp_bytes = -1
    out = predict(ens, x)
    jax.block_until_ready(out)
    reference = np.asarray(out[:, :4, 0])  # a small checksum across chunkings
    del out
    can_reset = _reset_peak()
    before = _status_kib("VmRSS")
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        out = predict(ens, x)
        jax.block_until_ready(out)
        times.append(time.perf_counter() - start)
        del out
    peak = _status_kib("VmHWM")
    result = {
        "chunk_size": chunk_size,
        "rss_before_mib": before / 1024,
        "process_peak_mib": peak / 1024,
        "eval_peak_mib": (peak - before) / 1024,
        "peak_reset": can_reset,
        "xla_temp_mib": temp_bytes / 2**20,
        "seconds": times,
        "checksum": reference.tolist(),
    }
    print(WORKER_PREFIX + json.dumps(result))


def main() -> None:
    p = _common.parser(__doc__.splitlines()[0])
    p.add_argument("--worker", type=int, default=None, help=argparse_hidden())
    p.add_argument("--members", type=int, default=None)
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--chunks", default=None, help="comma-separated chunk sizes")
    args = p.parse_args()
    members = args.members or (256 if args.quick else 1024)
    batch = args.batch or (512 if args.quick else 2048)
    calls = args.repeats or (2 if args.quick else 5)
    if args.worker is not None:
        worker(members, batch, args.width, args.worker, calls)
        return
    chunks = (
        [int(c) for c in args.chunks.split(",")]
        if args.chunks
        else ([0, 32] if args.quick else [0, 512, 256, 128, 64, 32])
    )
    info = _common.print_header(
        f"chunked evaluation: ee.map over {members} MLPs 16-{args.width}-"
        f"{args.width}-1 on a shared batch of {batch}; chunk sizes "
        f"{['none' if c <= 0 else c for c in chunks]}; {calls} timed calls each, "
        "a fresh subprocess per configuration"
    )
    results = {}
    for chunk in chunks:
        out = subprocess.run(
            [
                sys.executable,
                os.path.abspath(__file__),
                "--worker",
                str(chunk),
                "--members",
                str(members),
                "--batch",
                str(batch),
                "--width",
                str(args.width),
                "--repeats",
                str(calls),
            ],
            capture_output=True,
            text=True,
            check=False,
        )
        lines = [
            line for line in out.stdout.splitlines() if line.startswith(WORKER_PREFIX)
        ]
        if out.returncode != 0 or not lines:
            print(f"   chunk {chunk}: FAILED\n{out.stderr[-2000:]}")
            continue
        results[chunk] = json.loads(lines[-1][len(WORKER_PREFIX) :])

    if 0 not in results:
        print("   the unchunked run failed; no ratios")
        return
    base = results[0]
    base_tp = members * batch / _common.median(base["seconds"])
    print(
        f"   {'chunk_size':>10s} {'eval peak MiB':>14s} {'ratio':>7s} "
        f"{'process peak MiB':>17s} {'ratio':>7s} {'XLA temp MiB':>13s} "
        f"{'M member-ex/s':>14s} {'ratio':>7s}  same result"
    )
    rows = {}
    for chunk, r in results.items():
        tp = members * batch / _common.median(r["seconds"])
        row = {
            "eval_peak_mib": r["eval_peak_mib"],
            "eval_peak_ratio": r["eval_peak_mib"] / base["eval_peak_mib"],
            "process_peak_mib": r["process_peak_mib"],
            "process_peak_ratio": r["process_peak_mib"] / base["process_peak_mib"],
            "xla_temp_mib": r["xla_temp_mib"],
            "throughput": tp,
            "throughput_ratio": tp / base_tp,
            "same_result": bool(
                max(
                    abs(a - b)
                    for ra, rb in zip(r["checksum"], base["checksum"])
                    for a, b in zip(ra, rb)
                )
                <= 1e-5
            ),
        }
        rows["none" if chunk <= 0 else str(chunk)] = row
        print(
            f"   {'none' if chunk <= 0 else chunk:>10} {row['eval_peak_mib']:14.1f} "
            f"{row['eval_peak_ratio']:7.3f} {row['process_peak_mib']:17.1f} "
            f"{row['process_peak_ratio']:7.3f} {row['xla_temp_mib']:13.1f} "
            f"{tp / 1e6:14.1f} {row['throughput_ratio']:7.2f}  {row['same_result']}"
        )
    if not base["peak_reset"]:
        print("   note: /proc/self/clear_refs unavailable; peaks include warm-up")
    met = [
        name
        for name, row in rows.items()
        if name != "none"
        and row["eval_peak_ratio"] <= 1 / 8
        and row["throughput_ratio"] >= 0.8
    ]
    print(
        "   targets (evaluation peak <= 1/8 of unchunked AND throughput >= 0.8x): "
        + (
            f"MET by chunk_size {', '.join(met)}"
            if met
            else "NOT MET by any chunk_size"
        )
    )
    _common.emit_summary(
        "chunked",
        {
            "machine": info,
            "members": members,
            "batch": batch,
            "width": args.width,
            "rows": rows,
            "met_by": met,
            "raw": {str(k): v for k, v in results.items()},
            "loadavg_end": list(_common.load_average()),
        },
        args.json,
    )


def argparse_hidden() -> str:
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    main()
