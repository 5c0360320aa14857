"""Scale: member chunks (`Execution(member_chunk=k)`) and the `"model"` mesh axis.

Part 1, member chunks:
A training step (`ee.make_step`, Adam) of 16 MLPs 256-512-512-512-10 on a batch
of 1024, with all members at once and with chunks of 8, 4 and 2 members (1/8 of
the ensemble). Memory is XLA's own account of the compiled step's temporaries
(`compiled.memory_analysis().temp_size_in_bytes`: activations and gradients;
the weights, optimizer state and batch are arguments and the same in every
variant); speed is the median wall time of a step, the variants timed
round-robin. The issue's targets: chunks of 1/8 of the members hold at most 1/4
of the unchunked step's temporaries and run at least 0.7x as fast.

Part 2, memory per device on a mesh (`--mesh`, 8 virtual CPU devices): a
training step (`ee.make_step`, Adam, batch 256) of 8 MLPs 256-1024-1024-10 on
one device and on meshes of members, data and model axes
(members split Megatron-style over "model": first layer by rows, second by
columns, the head replicated). Per device: the bytes of the weights and the
optimizer state it holds (their addressable shards), and XLA's account of the
compiled step's temporaries (activations, gradients, the update). The issue's
target: the model-split leaves at most 1/2 per device of the members x data
run. (Virtual devices share one CPU: their times say nothing about a real mesh
and are not printed.)

Run: `python benchmarks/bench_scale.py` (`--quick` for a smoke run),
`python benchmarks/bench_scale.py --mesh` for part 2.
"""

import os
import sys

if "--mesh" in sys.argv:  # before JAX starts: 8 virtual CPU devices
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    )
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common  # noqa: E402


def main() -> None:
    p = _common.parser(__doc__.splitlines()[0])
    p.add_argument("--members", type=int, default=16)
    p.add_argument("--mesh", action="store_true", help="part 2: the model axis")
    args = p.parse_args()
    if args.mesh:
        model_axis(args)
        return
    repeats = args.repeats or (3 if args.quick else 15)
    info = _common.print_header("member chunks: temporaries and step time")

    import equinox as eqx
    import jax
    import optax

    import eqx_ensemble as ee

    members = args.members
    width, batch = (64, 128) if args.quick else (512, 1024)
    ens = ee.ensemble(
        lambda k: eqx.nn.MLP(256, 10, width, 3, key=k),
        size=members,
        key=jax.random.key(0),
    )
    x = jax.random.normal(jax.random.key(1), (batch, 256))
    y = jax.random.randint(jax.random.key(2), (batch,), 0, 10)

    def loss(model, data, key):
        logits = jax.vmap(model)(data[0])
        return optax.softmax_cross_entropy_with_integer_labels(logits, data[1]).mean()

    optimizer = optax.adam(1e-3)
    opt_state = ee.init_optimizer(optimizer, ens)
    chunks = [None] + [k for k in (members // 2, members // 4, members // 8) if k]
    steps, temporaries = {}, {}
    for chunk in chunks:
        # `compiler_options={}` on both: the measurement wraps the step in an
        # outer `jit`, which takes no options of its own.
        # `member_chunk=members`: all at once (left out, `make_step` on a CPU
        # would choose chunks for a step this large itself).
        execution = ee.Execution(
            layout="vmap", member_chunk=chunk or members, compiler_options={}
        )
        step = ee.make_step(loss, optimizer, execution=execution)
        dynamic, static = eqx.partition((ens, opt_state), eqx.is_array)

        def run(dynamic, data, key, step=step, static=static):
            out = step(*eqx.combine(dynamic, static), data, key)
            return eqx.filter(out, eqx.is_array)

        compiled = jax.jit(run).lower(dynamic, (x, y), jax.random.key(3)).compile()
        name = "all members" if chunk is None else f"chunks of {chunk}"
        temporaries[name] = compiled.memory_analysis().temp_size_in_bytes

        def call(compiled=compiled, dynamic=dynamic):
            jax.block_until_ready(compiled(dynamic, (x, y), jax.random.key(3)))

        steps[name] = call
    times = _common.interleaved(steps, repeats=repeats)
    base = _common.median(times["all members"])
    whole = temporaries["all members"]
    print(f"   {members} members, MLP 256-{width}x3-10, batch {batch}, Adam")
    results = {}
    for name in steps:
        seconds = _common.median(times[name])
        memory = temporaries[name] / whole
        speed = base / seconds
        print(
            f"   {name:12}  temporaries {temporaries[name] / 2**20:8.1f} MiB "
            f"({memory:5.2f}x)  step {seconds * 1e3:8.2f} ms ({speed:4.2f}x speed)"
        )
        results[name] = {"temp_bytes": temporaries[name], "seconds": seconds}
    _common.emit_summary("bench_scale", {"machine": info, **results}, args.json)


def model_axis(args) -> None:
    info = _common.print_header("the model axis: bytes per device")

    import equinox as eqx
    import jax
    import optax
    from jax.sharding import PartitionSpec as P

    import eqx_ensemble as ee

    members = 8
    width, batch = (128, 64) if args.quick else (1024, 256)
    ens = ee.ensemble(
        lambda k: eqx.nn.MLP(256, 10, width, 2, key=k),
        size=members,
        key=jax.random.key(0),
    )
    x = jax.random.normal(jax.random.key(1), (batch, 256))
    y = jax.random.randint(jax.random.key(2), (batch,), 0, 10)

    def loss(model, data, key):
        logits = jax.vmap(model)(data[0])
        return optax.softmax_cross_entropy_with_integer_labels(logits, data[1]).mean()

    def megatron(member):
        specs = eqx.tree_at(
            lambda m: (m.layers[0].weight, m.layers[0].bias, m.layers[1].weight),
            member,
            (P("model", None), P("model"), P(None, "model")),
        )
        return jax.tree.map(lambda s: s if isinstance(s, P) else None, specs)

    optimizer = optax.adam(1e-3)
    configurations = [
        ("1 device", None, None, None),
        ("members 8", dict(members=8), None, None),
        ("members 4 x data 2", dict(members=4, data=2), None, None),
        ("members 4 x model 2", dict(members=4, model=2), megatron, None),
        (
            "members 2 x data 2 x model 2",
            dict(members=2, data=2, model=2),
            megatron,
            None,
        ),
        ("members 2 x model 4", dict(members=2, model=4), megatron, None),
    ]
    rows = {}
    for name, axes, spec_fn, chunk in configurations:
        mesh = None if axes is None else ee.make_mesh(**axes)
        if mesh is None:
            placed, data = ens, (x, y)
        else:
            placed = (
                ee.shard(ens, mesh)
                if spec_fn is None
                else ee.shard(ens, mesh, model=spec_fn)
            )
            data = ee.shard((x, y), mesh, axes="data")
        opt_state = ee.init_optimizer(optimizer, placed)
        if mesh is not None:
            opt_state = ee.shard(opt_state, mesh)
        execution = ee.Execution(mesh=mesh, member_chunk=chunk, layout="vmap")
        step = ee.make_step(loss, optimizer, execution=execution)
        compiled = step.lower(placed, opt_state, data, jax.random.key(3)).compile()
        stats = compiled.compiled.memory_analysis()
        device = jax.devices()[0] if mesh is None else mesh.devices.flat[0]
        held = 0
        for leaf in jax.tree.leaves(eqx.filter((placed, opt_state), eqx.is_array)):
            for shard in leaf.addressable_shards:
                if shard.device == device:
                    held += shard.data.nbytes
        rows[name] = {
            "weights_and_opt_state": held,
            "temporaries": stats.temp_size_in_bytes,
        }
    base = rows["1 device"]
    print(
        f"   {members} members, MLP 256-{width}-{width}-10, batch {batch}, Adam; "
        "per device (device 0):"
    )
    print(f"   {'':32} {'weights+Adam':>20} {'step temporaries':>22}")
    for name, row in rows.items():
        held, temp = row["weights_and_opt_state"], row["temporaries"]
        held_ratio = held / base["weights_and_opt_state"]
        temp_ratio = temp / base["temporaries"]
        print(
            f"   {name:32} {held / 2**20:9.2f} MiB ({held_ratio:4.2f}x)"
            f" {temp / 2**20:10.2f} MiB ({temp_ratio:4.2f}x)"
        )
    _common.emit_summary("bench_scale_model", {"machine": info, **rows}, args.json)


if __name__ == "__main__":
    main()
