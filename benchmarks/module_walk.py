"""Follow one dispatch through the library's modules (issue 45's target: every
module entered once, no return to a module already left, no climb back up).

The dispatch is `loop.run_chunk` as `fit` traces it (its Python runs once,
when the dispatch is traced; the compiled program runs no Python). Every call
of a library function under it is recorded in call order (pre-order), with
JAX's, Equinox's and jaxtyping's own frames (and attribute reads through a
`__getattribute__`) transparent; consecutive calls in
one module are one *stay*. Printed:

- the stays (the walk, module by module);
- *returns*: stays in a module that already had one earlier in the walk;
- *climbs*: calls from a module into a module of a higher layer of
  `docs/architecture.md`'s table (the layers an import may not reach: core
  calling back into training, for example), made through a function passed
  down.

Configurations: a plain MLP ensemble, and the same with a tracker, per-member
sampling, evaluation and a heterogeneous ensemble (`--all`).

    python benchmarks/module_walk.py [--all]
"""

import os
import re
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def layers() -> dict[str, int]:
    """Family (`_core`, `sgmcmc`, ...) -> its row in docs/architecture.md's
    layer table (0: the first row, `_internal`)."""
    table: dict[str, int] = {}
    rows = [
        line
        for line in (ROOT / "docs" / "architecture.md").read_text().splitlines()
        if line.startswith("| ") and "`" in line.split("|")[2]
    ]
    for rank, row in enumerate(rows):
        for entry in re.findall(r"`([^`]+)`", row.split("|")[2]):
            table[entry.rstrip("/").removesuffix(".py")] = rank
    return table


def family(module: str) -> str:
    return module.split(".")[1] if module.count(".") else module


def walk(run) -> list[tuple[str, str]]:
    """The library calls made under `run_chunk` while `run()` traces it:
    `(caller module, callee module)` pairs in call order."""
    calls: list[tuple[str, str]] = []
    stack: list[str | None] = []  # per frame: its library module, or None
    inside = [0]  # depth of run_chunk frames on the stack

    def profile(frame, event, arg):
        del arg
        if event == "call":
            module = frame.f_globals.get("__name__", "")
            ours = module.startswith("eqx_ensemble.") or module == "eqx_ensemble"
            # An attribute read through a base class's `__getattribute__`
            # (`_internal.component.Component`) is a read, not a call.
            hook = frame.f_code.co_name in ("__getattribute__", "__getattr__")
            name = module if ours and not hook else None
            if ours and frame.f_code.co_name == "run_chunk":
                inside[0] += 1
            if inside[0] and name is not None:
                caller = next((m for m in reversed(stack) if m is not None), None)
                if caller is not None:
                    calls.append((caller, name))
            stack.append(name)
        elif event == "return" and stack:
            name = stack.pop()
            if name is not None and frame.f_code.co_name == "run_chunk":
                inside[0] -= 1

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return calls


def summary(calls: list[tuple[str, str]], table: dict[str, int]) -> dict:
    stays: list[str] = []
    for _, callee in calls:
        if not stays or stays[-1] != callee:
            stays.append(callee)
    seen: set[str] = set()
    returns = 0
    for index, module in enumerate(stays):
        if module in seen:
            returns += 1
        if index + 1 < len(stays):
            seen.add(module)
    climbs = sorted(
        {
            (caller, callee)
            for caller, callee in calls
            if table.get(family(callee), -1) > table.get(family(caller), -1)
        }
    )
    climb_count = sum(
        table.get(family(callee), -1) > table.get(family(caller), -1)
        for caller, callee in calls
    )
    short = [m.removeprefix("eqx_ensemble.") for m in stays]
    return {
        "stays": len(stays),
        "modules": len(set(stays)),
        "returns": returns,
        "climbs": climb_count,
        "walk": short,
        "climbing calls": [
            f"{a.removeprefix('eqx_ensemble.')} -> {b.removeprefix('eqx_ensemble.')}"
            for a, b in climbs
        ],
    }


def configurations(all_: bool):
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import optax

    import eqx_ensemble as ee

    x = jnp.linspace(-1, 1, 64)[:, None]
    data = (x, x**3)

    def loss(model, batch, key):
        xb, yb = batch
        return jnp.mean((jax.vmap(model)(xb) - yb) ** 2)

    def mlp(width):
        return lambda k: eqx.nn.MLP(1, 1, width, 2, key=k)

    ens = ee.ensemble(mlp(16), size=4, key=jax.random.key(0))
    common = dict(steps=20, key=jax.random.key(1), batch_size=16, callbacks=[])
    yield "plain", lambda: ee.fit(ens, loss, optax.adam(1e-3), data, **common)
    if not all_:
        return
    yield (
        "tracker, bootstrap, evaluation",
        lambda: ee.fit(
            ens, loss, optax.adam(1e-3), data, **common,
            track=[ee.EMA(0.9)], sampling=ee.Bootstrap(),
            evaluate=ee.Evaluate(loss, data, every=10),
        ),
    )  # fmt: skip
    het = ee.Heterogeneous(
        (
            ee.ensemble(mlp(8), size=2, key=jax.random.key(2)),
            ee.ensemble(mlp(16), size=2, key=jax.random.key(3)),
        )
    )
    yield "heterogeneous", lambda: ee.fit(het, loss, optax.adam(1e-3), data, **common)


def main() -> None:
    p = _common.parser(__doc__.splitlines()[0])
    p.add_argument("--all", action="store_true", help="every configuration")
    args = p.parse_args()
    _common.print_header("One dispatch's walk through the library's modules")
    table = layers()
    results = {}
    for name, run in configurations(args.all):
        result = summary(walk(run), table)
        results[name] = result
        print(
            f"\n{name}: {result['stays']} stays in {result['modules']} modules, "
            f"{result['returns']} returns, {result['climbs']} climbing calls"
        )
        print("  walk: " + " > ".join(result["walk"]))
        for line in result["climbing calls"]:
            print(f"  climbs: {line}")
    _common.emit_summary("module_walk", results, args.json)


if __name__ == "__main__":
    main()
