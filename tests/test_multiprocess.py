"""Multi-process training: 2 local processes, 2 CPU devices each, gloo collectives.

Each process runs tests/_multiprocess_worker.py: the same user code as on one
device, with `jax.distributed.initialize`, a mesh over the 4 global devices, each
process feeding only its own rows of the data. Their trained ensemble, history and
`ee.save` file must equal the single-process run's.
"""

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import equinox as eqx
import jax
import numpy as np
import optax
import pytest
from _multiprocess_problem import NUM_EXAMPLES, STEPS, make_problem, train
from conftest import assert_tree_allclose

import eqx_ensemble as ee
from eqx_ensemble._checkpoints.sharded import written_bytes

TESTS = Path(__file__).resolve().parent
WORKER = TESTS / "_multiprocess_worker.py"
NUM_PROCESSES = 2
TIMEOUT_S = 240  # generous: the machine may be shared; a healthy run takes ~10 s


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run_workers(
    out_dir: Path, axis_type: str, layout: str, phase: str = "train"
) -> None:
    # The "kill" phase ends by SIGKILL (exit code -9) on purpose.
    expected = [-signal.SIGKILL if phase == "kill" else 0] * NUM_PROCESSES
    for attempt in range(3):
        codes = _start_and_wait(out_dir, axis_type, layout, _free_port(), phase)
        if codes == expected:
            return
        # The free port can be taken between choosing and binding it: retry.
        if "already in use" not in _logs(out_dir) or attempt == 2:
            break
    pytest.fail(f"exit codes {codes}:\n{_logs(out_dir)}")


def _start_and_wait(
    out_dir: Path, axis_type: str, layout: str, port: int, phase: str
) -> list[int | None]:
    env = {**os.environ, "PYTHONPATH": str(TESTS.parent)}
    processes = []
    logs = []
    try:
        for process_id in range(NUM_PROCESSES):
            log = open(out_dir / f"worker{process_id}.log", "wb")  # noqa: SIM115
            logs.append(log)
            processes.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        str(WORKER),
                        str(process_id),
                        str(NUM_PROCESSES),
                        str(port),
                        str(out_dir),
                        axis_type,
                        layout,
                        phase,
                    ],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                    cwd=out_dir,
                )
            )
        for process in processes:
            # One shared deadline: a hung worker cannot stall the suite.
            process.wait(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"workers timed out after {TIMEOUT_S} s:\n{_logs(out_dir)}")
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
            process.wait()
        for log in logs:
            log.close()
    return [process.returncode for process in processes]


def _logs(out_dir: Path) -> str:
    return "\n".join(
        f"--- {path.name} ---\n{path.read_text(errors='replace')[-4000:]}"
        for path in sorted(out_dir.glob("worker*.log"))
    )


def _check_against_single_process(out_dir: Path, layout: str) -> None:
    ens, data = make_problem()
    reference = train(ens, data, None)
    result = np.load(out_dir / "result.npz")
    expected = jax.tree.leaves(eqx.filter(reference.ensemble.members, eqx.is_array))
    for index, leaf in enumerate(expected):
        np.testing.assert_allclose(
            result[f"leaf{index}"], np.asarray(leaf), rtol=1e-5, atol=1e-6
        )
    np.testing.assert_allclose(
        result["losses"], reference.history.losses, rtol=1e-5, atol=1e-6
    )
    assert result["placed"].size > 0 and result["placed"].all()
    # Process 0 fed only its own rows when the data axis spans the processes.
    rows = NUM_EXAMPLES // NUM_PROCESSES if layout == "data" else NUM_EXAMPLES
    assert result["rows"].tolist() == [0, rows]
    # The checkpoint written by the processes (a sharded folder: the default on
    # several processes) equals the single-process one.
    assert (out_dir / "ensemble.eqx" / "manifest.ckpt").is_file()
    assert (out_dir / "host.eqx").is_file()  # one file, written by process 0
    host = ee.load(out_dir / "host.eqx", {"losses": result["losses"]})
    np.testing.assert_array_equal(host["losses"], result["losses"])
    np.testing.assert_array_equal(result["alone"], result["losses"])
    loaded = ee.load(out_dir / "ensemble.eqx", reference.ensemble)
    assert_tree_allclose(loaded, reference.ensemble)
    single = out_dir / "single.eqx"
    ee.save(single, reference.ensemble)
    manifest, single_manifest = (
        ee.load_manifest(out_dir / "ensemble.eqx"),
        ee.load_manifest(single),
    )
    for key in ("treedef", "nodes", "ensembles", "ensemble_size"):
        assert _without_hashes(manifest[key]) == _without_hashes(single_manifest[key])
    fields = ("path", "kind", "shape", "dtype")
    assert [{f: leaf.get(f) for f in fields} for leaf in manifest["leaves"]] == [
        {f: leaf.get(f) for f in fields} for leaf in single_manifest["leaves"]
    ]


def _without_hashes(value):
    if isinstance(value, dict):
        return {
            key: _without_hashes(item)
            for key, item in value.items()
            if "sha" not in key and "hash" not in key
        }
    if isinstance(value, list):
        return [_without_hashes(item) for item in value]
    return value


def test_two_processes_data_axis_across_processes_explicit(tmp_path):
    _run_workers(tmp_path, "Explicit", "data")
    _check_against_single_process(tmp_path, "data")


@pytest.mark.slow
def test_two_processes_member_axis_across_processes_auto(tmp_path):
    _run_workers(tmp_path, "Auto", "members")
    _check_against_single_process(tmp_path, "members")


def test_two_processes_model_axis_across_processes_auto(tmp_path):
    # Each member's hidden layer is split over the two processes (tensor
    # parallel across hosts, gloo collectives); the run equals one process's.
    _run_workers(tmp_path, "Auto", "model")
    _check_against_single_process(tmp_path, "model")


def test_sharded_checkpoints_of_two_processes_resume_on_one_and_on_two(tmp_path):
    # Members split over the 2 processes; each process writes only its shards.
    # The whole run (asynchronous checkpoints), then, in the same processes,
    # the same run killed (SIGKILL) once its halfway checkpoint is in place.
    _run_workers(tmp_path, "Auto", "members", "kill")
    half = STEPS // 2
    ens, data = make_problem()
    reference = train(ens, data, None)
    full = np.load(tmp_path / "full.npz")
    np.testing.assert_allclose(full["losses"], reference.history.losses, rtol=1e-5)
    checkpoint = tmp_path / "half" / f"step_{half:010d}.ckpt"
    assert checkpoint.is_dir() and ee.verify_checkpoint(checkpoint)["step"] == half
    assert [step for step, _ in ee.list_checkpoints(tmp_path / "half")] == [half]
    # No gather: each process wrote about half of the bytes (at most 1/2 + 5%).
    written = written_bytes(ee.load_manifest(checkpoint))
    assert sorted(written) == [0, 1]
    total = sum(written.values())
    assert max(written.values()) <= (1 / NUM_PROCESSES + 0.05) * total, written
    # The stopped run's shards equal the whole run's at the same step, bit for bit
    # (the sha256 of every chunk), and one process reads them.
    halfway = tmp_path / "full" / checkpoint.name

    def digests(folder):
        return [
            [chunk["sha256"] for chunk in leaf["store"]["chunks"]]
            for leaf in ee.load_manifest(folder)["leaves"]
            if "store" in leaf
        ]

    assert digests(checkpoint) == digests(halfway)
    stopped = ee.Checkpoints(tmp_path / "half").latest(ens, optax.adam(1e-2))
    assert stopped is not None and stopped.step == half
    at_half = train(ens, data, None, steps=half)
    for a, b in zip(
        jax.tree.leaves(eqx.filter(stopped.ensemble, eqx.is_array)),
        jax.tree.leaves(eqx.filter(at_half.ensemble, eqx.is_array)),
        strict=True,
    ):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    # Resumed on one process: the rest of the run, to the rounding of the
    # different reductions.
    shutil.copytree(tmp_path / "half", tmp_path / "on_one")
    resumed = train(ens, data, None, checkpoints=ee.Checkpoints(tmp_path / "on_one"))
    assert resumed.resumed_from == half
    np.testing.assert_allclose(resumed.history.losses, full["losses"], rtol=1e-5)
    # A corrupted shard is refused, naming its file.
    damaged = tmp_path / "on_one" / checkpoint.name
    victim = sorted(p for p in (damaged / "arrays").rglob("*") if p.is_file())[-1]
    content = bytearray(victim.read_bytes())
    content[0] ^= 0x01
    victim.write_bytes(bytes(content))
    with pytest.raises(ee.CheckpointError, match=re.escape(str(victim))):
        ee.verify_checkpoint(damaged)
    # One process writes, two resume; and two resume two processes' checkpoint:
    # bit for bit the uninterrupted two-process run.
    train(
        ens,
        data,
        None,
        steps=half,
        checkpoints=ee.Checkpoints(tmp_path / "single", every=half, sharded=True),
    )
    _run_workers(tmp_path, "Auto", "members", "resume")
    resumed_on_two = dict(np.load(tmp_path / "half.npz"))
    # Each process read only the chunks its devices hold: about half.
    read = resumed_on_two.pop("read_bytes")
    assert read.shape == (NUM_PROCESSES,) and read.min() > 0, read
    assert read.max() <= (1 / NUM_PROCESSES + 0.05) * total, (read, total)
    _assert_equal_npz(resumed_on_two, full)
    single = np.load(tmp_path / "single.npz")
    np.testing.assert_allclose(single["losses"], reference.history.losses, rtol=1e-5)
    # A load that fails on process 1 alone (an error in placing its arrays):
    # process 1 raises its own error, process 0 refuses the checkpoint naming
    # process 1 (before, process 0 waited for ever).
    assert single["load_outcome"].tolist() == [2, 1]


def _assert_equal_npz(got, want) -> None:
    assert sorted(got) == sorted(want.files)
    for name in want.files:
        np.testing.assert_array_equal(got[name], want[name])
