"""Run every benchmark (each in its own process) and print a summary of the
targets of DESIGN.md section 4.

Run: `python benchmarks/run_all.py` (`make bench`), `--quick` for a smoke run,
`--only compute,dispatch` for a subset, `--json-dir DIR` to keep each script's
results as JSON.
"""

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import _common  # noqa: E402

SCRIPTS = {
    "compute": "bench_compute.py",
    "dispatch": "bench_dispatch.py",
    "compile": "bench_compile.py",
    "chunked": "bench_chunked.py",
    "xla_options": "bench_xla_options.py",
    "families": "bench_families.py",
    "loop": "bench_loop.py",
    "guard": "bench_guard.py",
    "trackers": "bench_trackers.py",
    "overhead": "bench_overhead.py",
    "logging": "bench_logging.py",
    "large_data": "bench_large_data.py",
}
if os.path.exists(os.path.join(HERE, "bench_sharding.py")):
    SCRIPTS["sharding"] = "bench_sharding.py"  # owned by the sharding work


def run(name: str, quick: bool, json_dir: str | None) -> dict | None:
    cmd = [sys.executable, os.path.join(HERE, SCRIPTS[name])]
    if quick:
        cmd.append("--quick")
    if json_dir:
        cmd += ["--json", os.path.join(json_dir, f"{name}.json")]
    start = time.perf_counter()
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    summary = None
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith(_common.SUMMARY_PREFIX):
            summary = json.loads(line[len(_common.SUMMARY_PREFIX) :])
        else:
            print(line, end="", flush=True)
    proc.wait()
    print(
        f"   ({SCRIPTS[name]} took {time.perf_counter() - start:.0f} s, "
        f"exit {proc.returncode})\n"
    )
    return summary


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument(
        "--only", default=None, help="comma-separated subset of " + ",".join(SCRIPTS)
    )
    p.add_argument("--json-dir", default=None)
    args = p.parse_args()
    names = args.only.split(",") if args.only else list(SCRIPTS)
    if args.json_dir:
        os.makedirs(args.json_dir, exist_ok=True)
    summaries = {name: run(name, args.quick, args.json_dir) for name in names}

    print("== summary (DESIGN.md section 4 targets)")
    lines = []
    c = summaries.get("compute")
    if c:
        r = c["ratios"]
        for other, label in [
            ("torch.func vmap + Adam", "torch.func"),
            ("hand filter_vmap (scan-fused)", "hand filter_vmap, scan-fused"),
            ("hand filter_vmap (1 step/call)", "hand filter_vmap, 1 step/call"),
        ]:
            key = f"ee.fit (scan-fused) vs {other}"
            if key in r:
                lines.append(
                    (
                        f"compute: fit vs {label}",
                        f"{r[key]:.2f}x",
                        ">= 1.25x",
                        r[key] >= 1.25,
                    )
                )
        fit_row = c["rows"].get("ee.fit (scan-fused)")
        if fit_row:
            best = max(c["matmul_gflops"].values())
            lines.append(
                (
                    "compute: fit GFLOP/s (of plain matmul)",
                    f"{fit_row['gflops']:.1f} ({fit_row['gflops'] / best:.0%})",
                    "-",
                    None,
                )
            )
    d = summaries.get("dispatch")
    if d:
        for key, value in d["ratios"].items():
            target = (
                50 if "PyTorch loop" in key else 25 if "torch.func" in key else None
            )
            lines.append(
                (
                    f"dispatch: {key}",
                    f"{value:.1f}x",
                    f">= {target}x" if target else "-",
                    None if target is None else value >= target,
                )
            )
    k = summaries.get("compile")
    if k:
        sizes = k["sizes"]
        for key in ("fit chunk (largest)", "make_step XLA", "map"):
            value = k["ratios"].get(key)
            if value is not None:
                lines.append(
                    (
                        f"compile: {key} {sizes[-1]} vs {sizes[0]} members",
                        f"{value:.2f}x",
                        "<= 1.3x",
                        value <= 1.3,
                    )
                )
    h = summaries.get("chunked")
    if h:
        for name, row in h["rows"].items():
            if name == "none":
                continue
            lines.append(
                (
                    f"chunked: chunk_size={name} eval peak / throughput",
                    f"{row['eval_peak_ratio']:.3f} / {row['throughput_ratio']:.2f}x",
                    "<= 0.125 / >= 0.8x",
                    row["eval_peak_ratio"] <= 0.125 and row["throughput_ratio"] >= 0.8,
                )
            )
    for name, value, target, ok in lines:
        verdict = "" if ok is None else ("MET" if ok else "NOT MET")
        print(f"   {name:62s} {value:>16s}  {target:>18s}  {verdict}")
    failed = [name for name, s in summaries.items() if s is None]
    if failed:
        print(f"   scripts that failed: {failed}")
    print(f"   load average now: {[round(x, 2) for x in _common.load_average()]}")


if __name__ == "__main__":
    main()
