"""The GPU table: the round-2 benchmarks on the machine's GPU, in one command.

Runs `bench_compute.py`, `bench_dispatch.py`, `bench_families.py` and
`bench_trackers.py`, each in its own process (JAX on the default backend, torch
on CUDA when JAX runs on a GPU: `_common.torch_device`), and prints one Markdown
table of the step times and of the ratios DESIGN.md section 4 names, ready for
docs/benchmarks.md. On a machine without a GPU it says so and stops (the CPU
tables come from the scripts themselves).

What differs from a CPU run: the library's CPU-only choices are not made on a
GPU (the YNNPACK/Eigen compiler options of `_xla.py`, the unrolled dispatches
for convolutions of `_profile.py`, the sequential member layout of
`_layout.py`); the virtual-CPU-device mesh row of `bench_compute.py` is
skipped (`--cpu-devices 1`); torch runs on the same GPU.

    python benchmarks/bench_gpu.py [--quick] [--repeats N] [--json-dir DIR]
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import _common  # noqa: E402

SCRIPTS = {
    "families": ("bench_families.py", []),
    "compute": ("bench_compute.py", ["--cpu-devices", "1"]),
    "dispatch": ("bench_dispatch.py", ["--torch-threads", "1"]),
    "trackers": ("bench_trackers.py", []),
}


def _run(name: str, extra: list[str], json_dir: str) -> dict | None:
    script, fixed = SCRIPTS[name]
    path = os.path.join(json_dir, f"{name}.json")
    cmd = [sys.executable, os.path.join(HERE, script), *fixed, *extra, "--json", path]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    print(proc.stdout, end="", flush=True)
    if proc.returncode != 0:
        print(proc.stderr[-3000:], end="")
    print(f"   ({script}: {time.perf_counter() - start:.0f} s, exit {proc.returncode})")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def _block(label: str, ms_per_step: dict[str, float], ratios: dict) -> list[str]:
    """One workload's rows: each variant's time, then each ratio."""
    lines = [f"| {label} | {name} | {ms:.4g} | |" for name, ms in ms_per_step.items()]
    lines += [f"| {label} | | | {name}: {r:.2f}x |" for name, r in ratios.items()]
    return lines


def _table(results: dict[str, dict | None]) -> str:
    lines = ["| workload | variant | ms/step | ratio |", "| --- | --- | ---: | --- |"]
    if compute := results.get("compute"):
        times = {k: row["step_ms"] for k, row in compute["rows"].items()}
        lines += _block("compute-bound", times, compute["ratios"])
    if dispatch := results.get("dispatch"):
        times = {k: row["us_per_step"] / 1e3 for k, row in dispatch["rows"].items()}
        lines += _block("dispatch-bound", times, dispatch["ratios"])
    for family, row in (results.get("families") or {}).items():
        if isinstance(row, dict) and "ms_per_step" in row:
            lines += _block(family, row["ms_per_step"], row["ratios"])
    if trackers := results.get("trackers"):
        times = {k: row["ms_per_step"] for k, row in trackers["results"].items()}
        ratios = {
            f"{k} vs no tracker": row["ratio"] for k, row in trackers["results"].items()
        }
        lines += _block("trackers", times, ratios)
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--only", default=",".join(SCRIPTS))
    p.add_argument("--json-dir", default=None)
    p.add_argument(
        "--allow-cpu", action="store_true", help="run even without a GPU (testing)"
    )
    args = p.parse_args()
    import jax

    if jax.default_backend() != "gpu" and not args.allow_cpu:
        print(f"no GPU: JAX's default backend is {jax.default_backend()!r}; stopping")
        return
    _common.print_header(f"GPU table on {_common.jax_device_name()}")
    extra = (["--quick"] if args.quick else []) + (
        ["--repeats", str(args.repeats)] if args.repeats else []
    )
    json_dir = args.json_dir or tempfile.mkdtemp(prefix="bench_gpu_")
    os.makedirs(json_dir, exist_ok=True)
    results = {name: _run(name, extra, json_dir) for name in args.only.split(",")}
    print("\n" + _table(results))


if __name__ == "__main__":
    main()
