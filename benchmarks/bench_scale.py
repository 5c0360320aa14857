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

Part 2, the model axis (`--mesh`, on 8 virtual CPU devices): a training step
of 4 MLPs 256-1024-1024-10 (Adam, batch 256) on a members 2 x data 4 mesh
against a members 2 x data 2 x model 2 mesh whose members are split
Megatron-style (first layer by rows, second by columns, the head replicated).
Per device: the bytes of the weights and the optimizer state (their
addressable shards), of the model-split leaves alone, and XLA's account of the
compiled step (arguments + temporaries). The issue's target: the model-split
leaves at most 1/2 per device of the members x data run. (Virtual devices share
one CPU: their times say nothing about a real mesh and are not printed.)

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
        execution = ee.Execution(layout="vmap", member_chunk=chunk, compiler_options={})
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

    width, batch = (128, 64) if args.quick else (1024, 256)
    ens = ee.ensemble(
        lambda k: eqx.nn.MLP(256, 10, width, 2, key=k), size=4, key=jax.random.key(0)
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
    rows = {}
    for name, mesh, spec_fn in (
        ("members 2 x data 4", ee.make_mesh(members=2, data=4), None),
        ("members 2 x data 2 x model 2", ee.make_mesh(2, 2, 2), megatron),
    ):
        placed = (
            ee.shard(ens, mesh)
            if spec_fn is None
            else ee.shard(ens, mesh, model=spec_fn)
        )
        opt_state = ee.shard(ee.init_optimizer(optimizer, placed), mesh)
        data = ee.shard((x, y), mesh, axes="data")
        step = ee.make_step(loss, optimizer, execution=ee.Execution(mesh=mesh))
        compiled = step.lower(placed, opt_state, data, jax.random.key(3)).compile()
        stats = compiled.compiled.memory_analysis()
        device = mesh.devices.flat[0]

        def on_device(tree, only=None):
            total = 0
            for path, leaf in jax.tree_util.tree_flatten_with_path(
                eqx.filter(tree, eqx.is_array)
            )[0]:
                if only is not None and not only(jax.tree_util.keystr(path)):
                    continue
                for shard in leaf.addressable_shards:
                    if shard.device == device:
                        total += shard.data.nbytes
            return total

        split = lambda path: any(  # noqa: E731 - the leaves Megatron splits
            key in path for key in ("layers[0]", "layers[1].weight")
        )
        rows[name] = {
            "weights_and_opt_state": on_device((placed, opt_state)),
            "split_leaves": on_device((placed, opt_state), split),
            "compiled_step": stats.argument_size_in_bytes + stats.temp_size_in_bytes,
        }
    base = rows["members 2 x data 4"]
    print(f"   4 members, MLP 256-{width}-{width}-10, batch {batch}, Adam; per device:")
    for name, row in rows.items():
        print(
            f"   {name:30} weights+Adam {row['weights_and_opt_state'] / 2**20:7.2f} MiB"
            f" ({row['weights_and_opt_state'] / base['weights_and_opt_state']:4.2f}x)"
            f"  split leaves {row['split_leaves'] / 2**20:7.2f} MiB"
            f" ({row['split_leaves'] / base['split_leaves']:4.2f}x)"
            f"  compiled step {row['compiled_step'] / 2**20:7.2f} MiB"
            f" ({row['compiled_step'] / base['compiled_step']:4.2f}x)"
        )
    _common.emit_summary("bench_scale_model", {"machine": info, **rows}, args.json)


if __name__ == "__main__":
    main()
