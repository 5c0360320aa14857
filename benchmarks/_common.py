"""Shared helpers for the benchmark scripts: timing, machine facts, reporting.

Nothing here imports JAX or torch at module level, so a script can set
`XLA_FLAGS` before JAX starts.
"""

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

SUMMARY_PREFIX = "SUMMARY-JSON: "


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument(
        "--quick", action="store_true", help="a fast smoke run (small sizes, few reps)"
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="timed repetitions per variant (the median is reported)",
    )
    p.add_argument(
        "--json",
        default=None,
        help="also write the results as JSON to this path",
    )
    p.add_argument(
        "--keep-scratch",
        action="store_true",
        help="call allocator.keep_scratch_memory() first (glibc keeps freed scratch "
        "memory; where a script supports it)",
    )
    return p


def keep_scratch(args: argparse.Namespace) -> None:
    """Apply `allocator.keep_scratch_memory()` when `--keep-scratch` was given."""
    if getattr(args, "keep_scratch", False):
        from allocator import keep_scratch_memory

        print(f"   keep_scratch_memory(): {keep_scratch_memory()}")


def load_average() -> tuple[float, float, float]:
    try:
        return os.getloadavg()
    except OSError:  # pragma: no cover
        return (float("nan"),) * 3


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:  # pragma: no cover
        pass
    return platform.processor() or "unknown"


def total_ram_gib() -> float:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) / 2**20
    except OSError:  # pragma: no cover
        pass
    return float("nan")


def machine_info() -> dict[str, Any]:
    import importlib.metadata as md

    def version(name: str) -> str:
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            return "not installed"

    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "ram_gib": round(total_ram_gib(), 1),
        "python": platform.python_version(),
        "jax": version("jax"),
        "jaxlib": version("jaxlib"),
        "equinox": version("equinox"),
        "optax": version("optax"),
        "torch": version("torch"),
        "loadavg": [round(x, 2) for x in load_average()],
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
    }


def print_header(title: str) -> dict[str, Any]:
    info = machine_info()
    print(f"== {title}")
    print(
        f"   machine: {info['cpu']}, {info['cores']} cores, {info['ram_gib']} GiB; "
        f"jax {info['jax']}, jaxlib {info['jaxlib']}, equinox {info['equinox']}, "
        f"torch {info['torch']}; load average {info['loadavg']}"
    )
    return info


def time_calls(
    fn: Callable[[], Any], *, repeats: int, warmup: int = 1, number: int = 1
) -> list[float]:
    """Wall-clock seconds of `number` calls of `fn`, `repeats` times (after
    `warmup` untimed calls). `fn` must block until its work is done."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(number):
            fn()
        times.append((time.perf_counter() - start) / number)
    return times


def interleaved(
    fns: dict[str, Callable[[], Any]], *, repeats: int, warmup: int = 1
) -> dict[str, list[float]]:
    """Time several variants round-robin (A B C A B C ...) so that a change in the
    machine's load hits all of them alike. Returns seconds per call."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return times


def interleaved_with_cpu(
    fns: dict[str, Callable[[], Any]], *, repeats: int, warmup: int = 1
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Like `interleaved`, also returning the process CPU seconds (all threads) of
    each call: a measure of the work done that a loaded machine disturbs less
    than wall time (threads that spin while waiting count as work, though)."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    wall: dict[str, list[float]] = {name: [] for name in fns}
    cpu: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start, start_cpu = time.perf_counter(), time.process_time()
            fn()
            wall[name].append(time.perf_counter() - start)
            cpu[name].append(time.process_time() - start_cpu)
    return wall, cpu


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs)


def spread(xs: Sequence[float]) -> str:
    """`median (min..max)` in milliseconds."""
    return f"{median(xs) * 1e3:9.3f} ms  ({min(xs) * 1e3:.3f}..{max(xs) * 1e3:.3f})"


def emit_summary(name: str, results: dict[str, Any], path: str | None) -> None:
    """Print one machine-readable line (parsed by run_all.py) and optionally save."""
    payload = {"benchmark": name, **results}
    print(SUMMARY_PREFIX + json.dumps(payload, default=float))
    if path:
        with open(path, "w") as f:
            json.dump(payload, f, indent=2, default=float)


def torch_device(torch: Any) -> str:
    """Where torch runs: "cuda" when JAX runs on a GPU and torch sees one, else
    "cpu", so that both libraries are compared on the same kind of device."""
    import jax

    if jax.default_backend() == "gpu" and torch.cuda.is_available():
        return "cuda"
    return "cpu"


def torch_sync(torch: Any, device: str) -> None:
    """Wait for torch's queued GPU work (timings of asynchronous kernels)."""
    if device == "cuda":
        torch.cuda.synchronize()


def jax_device_name() -> str:
    """The device JAX computes on, in words (e.g. "gpu: NVIDIA H100 80GB HBM3")."""
    import jax

    device = jax.devices()[0]
    return f"{jax.default_backend()}: {getattr(device, 'device_kind', device)}"


WORKER_PREFIX = "WORKER-JSON: "


def run_worker(script: str, function: str, **kwargs: Any) -> Any:
    """Call `function(**kwargs)` of the benchmark module `script` in a fresh
    Python process and return what it returns (JSON-serialisable).

    Used to time torch in a process of its own: after each call torch's OpenMP
    threads keep spinning for a while, which takes a core from whatever is timed
    next in the same process (measured: a 5-member CNN step 13 -> 21 ms). The
    worker exits before the caller times anything else, so neither side runs
    while the other's threads spin, and each runs with its own defaults."""
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    module = os.path.splitext(os.path.basename(script))[0]
    code = (
        "import json, sys\n"
        f"sys.path.insert(0, {here!r})\n"
        f"import {module}\n"
        f"out = {module}.{function}(**json.loads(sys.argv[1]))\n"
        f"print({WORKER_PREFIX!r} + json.dumps(out))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, json.dumps(kwargs)],
        capture_output=True,
        text=True,
        check=False,
    )
    for line in proc.stdout.splitlines():
        if line.startswith(WORKER_PREFIX):
            return json.loads(line[len(WORKER_PREFIX) :])
    raise RuntimeError(
        f"worker {module}.{function} failed (exit {proc.returncode}):\n"
        + (proc.stderr or proc.stdout)[-2000:]
    )
