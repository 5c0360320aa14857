"""An opt-in setting of the C allocator for compiled steps called in a loop.

XLA's CPU runtime allocates each call's temporary buffers with `malloc` and
frees them when the call returns. glibc serves blocks this large with fresh
pages (`mmap`, or the top of the heap) and hands them back to the system at
`free` (`munmap`, or trimming the heap), so every call of a compiled step page
faults its scratch memory in again (on one 2-core machine, a quarter of a
`make_step` call's time on 64 MLPs 32-128-128-10 at batch 256). Keeping the freed
memory in the process removes that cost. The setting is process-wide and
changes how every library in the process allocates, so the library never makes
it by itself. This benchmark helper is how the benchmarks opt in
(`--keep-scratch`); a user's program can do the same with glibc's environment
variables (`MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=2147483647`,
see the training guide) or by calling this function, copied into it.
"""

import ctypes
import ctypes.util
import platform
from typing import Any

# glibc's mallopt parameters (<malloc.h>).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

# glibc refuses an mmap threshold above HEAP_MAX_SIZE / 2 (32 MiB on 64-bit).
_MAX_MMAP_THRESHOLD = 32 * 2**20
# mallopt takes a C int: the largest trim threshold it can be told.
_MAX_TRIM_THRESHOLD = 2**31 - 1

_applied: dict[str, int] | None = None


def _libc() -> Any:
    if platform.system() != "Linux":
        return None
    name = ctypes.util.find_library("c") or "libc.so.6"
    try:
        libc = ctypes.CDLL(name)
    except OSError:
        return None
    if not hasattr(libc, "mallopt") or not hasattr(libc, "gnu_get_libc_version"):
        return None  # not glibc (musl has no mallopt thresholds)
    return libc


def keep_scratch_memory() -> dict[str, int] | None:
    """Keep freed scratch memory in the process (glibc only; opt-in, process-wide).

    Tells glibc's allocator to serve blocks up to 32 MiB from its heap instead of
    fresh `mmap`s and never to hand freed heap memory back to the system (up to
    2 GiB), so a compiled step called in a loop reuses its scratch buffers
    instead of page-faulting them in on every call. This is the in-process
    equivalent of starting Python with
    `MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=2147483647`.

    What it buys depends on the machine (`benchmarks/bench_compute.py
    --keep-scratch`, 64 MLPs 32-128-128-10, batch 256): on a 2-core AMD EPYC
    the same setting (as environment variables) made `make_step` called once
    per step 1.34x faster (44.5 -> 33.2 ms) and a hand-written step 1.44x; on a
    2-core Intel Xeon it made no measurable difference (36.5 vs 40.6 ms, within
    the run's spread). `fit`, which runs its steps inside one compiled loop per
    dispatch, hardly changes on either. The price is memory: the process keeps
    its peak heap (what it freed stays reserved). On a GPU the scratch memory
    is the device's and this changes nothing that matters. Measure on your
    machine before relying on it.

    Call it once, early (before the first compiled call is best, any time
    works). Calling it again does nothing.

    **Returns:**

    The settings applied, `{"mmap_threshold": ..., "trim_threshold": ...}` in
    bytes, or `None` where the C library is not glibc (nothing is changed).

    **Example:**

    ```python
    settings = keep_scratch_memory()
    settings is None or settings["trim_threshold"] >= 2**30   # True
    ```
    """
    global _applied
    if _applied is not None:
        return dict(_applied)
    libc = _libc()
    if libc is None:
        return None
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    libc.mallopt.restype = ctypes.c_int
    # Trim first: glibc ties the trim threshold to the mmap threshold until
    # both are set by hand.
    ok_trim = libc.mallopt(_M_TRIM_THRESHOLD, _MAX_TRIM_THRESHOLD)
    ok_mmap = libc.mallopt(_M_MMAP_THRESHOLD, _MAX_MMAP_THRESHOLD)
    if not (ok_trim and ok_mmap):  # pragma: no cover - glibc accepts both
        raise RuntimeError(
            f"glibc's mallopt refused the settings (trim: {ok_trim}, mmap: "
            f"{ok_mmap}); the allocator is unchanged or half-changed"
        )
    _applied = {
        "mmap_threshold": _MAX_MMAP_THRESHOLD,
        "trim_threshold": _MAX_TRIM_THRESHOLD,
    }
    return dict(_applied)
