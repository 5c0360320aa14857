"""One process of the multi-process test (run by tests/test_multiprocess.py).

`python _multiprocess_worker.py PROCESS_ID NUM_PROCESSES PORT OUT_DIR AXIS_TYPE LAYOUT
[PHASE]`

PHASE `train` (default): train and save as below. `kill`: train with sharded
checkpoints (`ee.Checkpoints`, the default format on several processes): the
whole run into OUT_DIR/full (asynchronous checkpoints, halfway and at the end),
then the same run into OUT_DIR/half, both processes killed with SIGKILL once
its halfway checkpoint is written (one start of the processes for both runs).
`resume`: fresh
processes resume OUT_DIR/half (written by 2 processes) and OUT_DIR/single
(written by 1) to the end.

LAYOUT `members`: the member axis spans the processes (each process holds half
of the members and every row); `data`: the data axis spans the processes (each
process holds half of the rows and feeds only those); `model`: a `"model"` axis
spans the processes (each member's hidden layer split Megatron-style over the
two processes: each holds half of every member's weights and every row).

Every process runs the same user code: initialise JAX's distributed runtime (gloo
CPU collectives, 2 CPU devices per process), build a mesh over all devices, feed
only its own rows of the data, train a sharded ensemble with `ee.fit`, and save it
with `ee.save`. Process 0 also writes the gathered parameters and history.
"""

import os
import signal
import sys

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = " ".join(
    flag
    for flag in os.environ.get("XLA_FLAGS", "").split()
    if "xla_force_host_platform_device_count" not in flag
)

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 2)
jax.config.update("jax_cpu_collectives_implementation", "gloo")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _multiprocess_problem import (  # noqa: E402
    NUM_EXAMPLES,
    make_problem,
    train,
)


def main() -> None:
    process_id, num_processes, port = map(int, sys.argv[1:4])
    out_dir, axis_type, layout = sys.argv[4:7]
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}",
        num_processes=num_processes,
        process_id=process_id,
        initialization_timeout=60,
    )
    import equinox as eqx
    import numpy as np
    from jax.experimental import multihost_utils

    import eqx_ensemble as ee

    assert jax.process_count() == num_processes
    assert jax.local_device_count() == 2
    devices = np.array(jax.devices()).reshape(num_processes, 2)
    if layout in ("data", "model"):
        devices = devices.T
    axes = {"members": devices.shape[0]}
    axes["model" if layout == "model" else "data"] = devices.shape[1]
    mesh = ee.make_mesh(
        **axes,
        devices=list(devices.ravel()),
        axis_types=getattr(jax.sharding.AxisType, axis_type),
    )
    ens, data = make_problem()
    if layout == "model":
        ens = ee.shard(ens, mesh, model=_megatron)
    else:
        ens = ee.shard(ens, mesh)  # optional (fit places it), exercised here
    # Each process feeds only its rows of the data.
    rows = ee.process_rows(mesh, NUM_EXAMPLES)
    local = jax.tree.map(lambda x: np.asarray(x)[rows], data)
    data = ee.shard(local, mesh, axes="data", process_local=True)
    phase = sys.argv[7] if len(sys.argv) > 7 else "train"
    if phase != "train":
        _checkpoint_phase(phase, out_dir, ens, data, mesh)
        multihost_utils.sync_global_devices("done")
        jax.distributed.shutdown()
        return
    result = train(ens, data, mesh)

    # The results stay sharded like the inputs: members split over "members"
    # (and, with a model axis, the hidden layer over "model").
    expected = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("members"))
    if layout == "model":
        first = result.ensemble.members.layers[0].weight
        moment = result.opt_state[0].mu.layers[0].weight
        placed = [
            tuple(leaf.sharding.spec)[:2] == ("members", "model")
            for leaf in (first, moment)
        ]
    else:
        placed = [
            leaf.sharding.is_equivalent_to(expected, leaf.ndim)
            for leaf in jax.tree.leaves((result.ensemble, result.opt_state))
            if isinstance(leaf, jax.Array)
        ]
    ee.save(os.path.join(out_dir, "ensemble.eqx"), result.ensemble)
    # The single-file format on several processes: process 0 writes, every
    # process waits for it (and would raise its failure).
    ee.save(
        os.path.join(out_dir, "host.eqx"), {"losses": result.history.losses},
        sharded=False,
    )  # fmt: skip
    members = multihost_utils.process_allgather(
        eqx.filter(result.ensemble.members, eqx.is_array), tiled=True
    )
    if process_id == 0:
        # One process may load a single file on its own (no collective).
        alone = ee.load(
            os.path.join(out_dir, "host.eqx"), {"losses": result.history.losses}
        )["losses"]
        leaves = jax.tree.leaves(members)
        np.savez(
            os.path.join(out_dir, "result.npz"),
            losses=result.history.losses,
            alone=np.asarray(alone),
            placed=np.array(placed),
            rows=np.array([rows.start, rows.stop]),
            **{f"leaf{i}": np.asarray(leaf) for i, leaf in enumerate(leaves)},
        )
    multihost_utils.sync_global_devices("done")
    jax.distributed.shutdown()


def _checkpoint_phase(phase, out_dir, ens, data, mesh):
    import equinox as eqx
    import numpy as np
    from _multiprocess_problem import STEPS
    from jax.experimental import multihost_utils

    import eqx_ensemble as ee

    half = STEPS // 2

    def gathered(result):
        members = multihost_utils.process_allgather(
            eqx.filter(result.ensemble.members, eqx.is_array), tiled=True
        )
        leaves = {
            f"leaf{i}": np.asarray(x) for i, x in enumerate(jax.tree.leaves(members))
        }
        return {**leaves, "losses": result.history.losses}

    saved = {}
    if phase == "kill":
        # The whole run, its checkpoints written in the background (on several
        # processes each is committed at the next checkpoint, the last when
        # `fit` ends).
        full = train(
            ens,
            data,
            mesh,
            checkpoints=ee.Checkpoints(
                os.path.join(out_dir, "full"), every=half, keep=None, asynchronous=True
            ),
        )
        arrays = gathered(full)  # an all-gather: every process takes part
        if jax.process_index() == 0:  # saved now: the next run ends by SIGKILL
            np.savez(os.path.join(out_dir, "full.npz"), **arrays)

        # The same run, killed (SIGKILL, both processes) once its halfway
        # checkpoint is written.
        def kill(result):
            if result.step >= half:
                os.kill(os.getpid(), signal.SIGKILL)

        train(
            ens,
            data,
            mesh,
            checkpoints=ee.Checkpoints(os.path.join(out_dir, "half"), every=half),
            callbacks=(kill,),
        )
        raise AssertionError("not killed")
    else:
        # Count the bytes of the chunks this process reads (each read once).
        from eqx_ensemble._checkpoints.sharded import ShardedReader

        read = {"bytes": 0}
        chunk = ShardedReader.chunk

        def counted(self, index, record, position):
            new = (index, position) not in self._chunks
            host = chunk(self, index, record, position)
            read["bytes"] += host.nbytes if new else 0
            return host

        ShardedReader.chunk = counted
        for name in ("half", "single"):
            read["bytes"] = 0
            run = ee.Checkpoints(os.path.join(out_dir, name), every=half)
            result = train(ens, data, mesh, checkpoints=run)
            assert result.resumed_from == half, result.resumed_from
            saved[name] = gathered(result)
            saved[name]["read_bytes"] = np.asarray(
                multihost_utils.process_allgather(np.asarray(read["bytes"]))
            )
        # Any error on one process (here: placing its arrays) ends every
        # process's load of a sharded checkpoint; none waits for the others.
        from eqx_ensemble._checkpoints import io

        path = os.path.join(out_dir, "ensemble.ckpt")
        ee.save(path, result.ensemble, sharded=True)
        place = io.place_array

        def failing(lazy, like_leaf):
            if jax.process_index() == 1:
                raise RuntimeError("placement failed on process 1")
            return place(lazy, like_leaf)

        io.place_array = failing
        try:
            ee.load(path, result.ensemble)
            outcome = 0
        except RuntimeError:
            outcome = 1
        except ee.CheckpointError as error:
            outcome = 2 if "process(es) [1]" in str(error) else 3
        io.place_array = place
        saved["single"]["load_outcome"] = np.asarray(
            multihost_utils.process_allgather(np.asarray(outcome))
        )
    if jax.process_index() == 0:
        for name, arrays in saved.items():
            np.savez(os.path.join(out_dir, f"{name}.npz"), **arrays)


def _megatron(member):
    import equinox as eqx

    P = jax.sharding.PartitionSpec
    specs = eqx.tree_at(
        lambda m: (m.layers[0].weight, m.layers[0].bias, m.layers[1].weight),
        member,
        (P("model", None), P("model"), P(None, "model")),
    )
    return jax.tree.map(lambda s: s if isinstance(s, P) else None, specs)


if __name__ == "__main__":
    main()
