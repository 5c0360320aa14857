"""`benchmarks/allocator.keep_scratch_memory` (a benchmark helper, not the
library's: the setting is process-wide): glibc keeps a step's freed scratch blocks.

Checked in a fresh process (the setting is process-wide): without it a 16 MiB
block is `mmap`ped and handed back at `free`; with it the block comes from the
heap and stays there after `free` (glibc's own `mallinfo2` counters).
"""

import os
import platform
import subprocess
import sys
import textwrap

import pytest

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks")

PROBE = textwrap.dedent(
    """
    import ctypes, sys
    sys.path.insert(0, {benchmarks!r})
    import allocator

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in (
            "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks "
            "fordblks keepcost").split()]

    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = MallInfo2
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    if sys.argv[1] == "keep":
        print("settings", allocator.keep_scratch_memory())
    mapped = libc.mallinfo2().hblks
    block = libc.malloc(16 * 2**20)
    print("mapped", libc.mallinfo2().hblks - mapped)
    heap = libc.mallinfo2().arena
    libc.free(block)
    print("kept", libc.mallinfo2().arena >= heap)
    """
).format(benchmarks=BENCHMARKS)


def _probe(mode):
    # glibc's own environment variables would make the "before" the same as after.
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run(
        [sys.executable, "-c", PROBE, mode],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    return dict(line.split(" ", 1) for line in out.strip().splitlines())


glibc = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
    reason="glibc's allocator only",
)


@glibc
def test_blocks_stay_on_the_heap():
    default = _probe("default")
    assert default["mapped"] == "1"  # glibc's default: a fresh mapping
    kept = _probe("keep")
    assert kept["settings"] == str(
        {"mmap_threshold": 32 * 2**20, "trim_threshold": 2**31 - 1}
    )
    assert kept["mapped"] == "0"
    assert kept["kept"] == "True"


def test_second_call_returns_the_same():
    # In a fresh process too: the setting outlives the call.
    code = (
        f"import sys; sys.path.insert(0, {BENCHMARKS!r}); import allocator; "
        "first = allocator.keep_scratch_memory(); "
        "print(allocator.keep_scratch_memory() == first)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "True"
