"""Member chunks: the memory and speed of `Execution(member_chunk=k)`.

A training step (`ee.make_step`, Adam) of 16 MLPs 256-512-512-512-10 on a batch
of 1024, with all members at once and with chunks of 8, 4 and 2 members (1/8 of
the ensemble). Memory is XLA's own account of the compiled step's temporaries
(`compiled.memory_analysis().temp_size_in_bytes`: activations and gradients;
the weights, optimizer state and batch are arguments and the same in every
variant); speed is the median wall time of a step, the variants timed
round-robin. The issue's targets: chunks of 1/8 of the members hold at most 1/4
of the unchunked step's temporaries and run at least 0.7x as fast.

Run: `python benchmarks/bench_scale.py` (`--quick` for a smoke run).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common  # noqa: E402


def main() -> None:
    p = _common.parser(__doc__.splitlines()[0])
    p.add_argument("--members", type=int, default=16)
    args = p.parse_args()
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


if __name__ == "__main__":
    main()
