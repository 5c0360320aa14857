"""The package's structure: no import cycle between its modules (counting
imports inside functions), no reach into another family's private names, the
public namespace flat and importable without side effects."""

import ast
import pathlib
import re
import subprocess
import sys
import types

from conftest import tree_equal

import eqx_ensemble as ee

PACKAGE = pathlib.Path(ee.__file__).parent


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> list[str]:
    """The package modules an import statement loads (`from . import x` loads
    `pkg.x` when it is a module)."""
    if node.level == 0:
        base = node.module or ""
    else:
        anchor = module.split(".")
        if not is_package:
            anchor = anchor[:-1]
        anchor = anchor[: len(anchor) - (node.level - 1)]
        base = ".".join(anchor + ([node.module] if node.module else []))
    if not base.startswith("eqx_ensemble"):
        return []
    targets = [base]
    for alias in node.names:
        targets.append(f"{base}.{alias.name}")
    return targets


def import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports, at any depth of its code."""
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        tree = ast.parse(path.read_text())
        is_package = path.name == "__init__.py"
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                targets = _resolve(name, is_package, node)
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                continue
            graph[name] |= {t for t in targets if t in files and t != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle (as a path that returns to its start), or `None`.
    Imports of a package's `__init__` (the public namespace) are not followed:
    every module's import of its own package is implied by Python."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt == "eqx_ensemble":
                continue
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_cycle_finder_finds_a_cycle():
    # The check itself can fail: a made-up graph with a cycle through three.
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def _family(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 else "<top>"


def test_no_private_reach_across_families():
    """A module may import another family's module, but only names without a
    leading underscore from it (a family's private helpers stay its own)."""
    offences = []
    for path in PACKAGE.rglob("*.py"):
        name = _module_name(path)
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom):
                continue
            targets = _resolve(name, is_package, node)
            if not targets or _family(targets[0]) == _family(name):
                continue
            for alias in node.names:
                if alias.name.startswith("_") and not alias.name.startswith("__"):
                    offences.append(f"{name} imports {targets[0]}.{alias.name}")
    assert not offences, offences


def test_subpackages_have_no_code_in_init():
    # Importing one module of a family must not import the whole family.
    for init in PACKAGE.glob("_*/__init__.py"):
        code = [
            node
            for node in ast.parse(init.read_text()).body
            if not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant))
        ]
        assert not code, f"{init} holds code"


def test_no_library_private_attributes():
    """Nothing reads another library's private attributes (`obj._name` on an
    object of Equinox, JAX or Optax): the package's own privates only."""
    own = {
        node.name
        for path in PACKAGE.rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.FunctionDef | ast.ClassDef)
    }
    offences = []
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and node.value in {"_cached"}:
                offences.append(f"{path.name}: reads {node.value!r}")
            if (
                isinstance(node, ast.Attribute)
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
                and node.attr in {"_cached", "_cache_size", "_fun", "_signature"}
                and node.attr not in own
            ):
                offences.append(f"{path.name}: .{node.attr}")
    assert not offences, offences


def private_jax_uses(source: str) -> list[str]:
    """Every use of JAX's private API in `source`: an import of or from a
    `jax._src` (or any underscore) module, an underscore name imported from a
    JAX module, and an underscore attribute (or `getattr` of one) read from a
    name bound to a JAX module or object, at any depth of attribute access."""
    found = []
    tree = ast.parse(source)
    jax_names: set[str] = set()

    def private(parts: list[str]) -> str | None:
        return next(
            (p for p in parts if p.startswith("_") and not p.startswith("__")), None
        )

    def is_jax(module: str | None) -> bool:
        return bool(module) and module.split(".")[0] in ("jax", "jaxlib")

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if is_jax(alias.name):
                    jax_names.add((alias.asname or alias.name).split(".")[0])
                    if private(alias.name.split(".")):
                        found.append(f"line {node.lineno}: import {alias.name}")
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            if is_jax(node.module):
                assert node.module is not None
                for alias in node.names:
                    jax_names.add(alias.asname or alias.name)
                    name = f"{node.module}.{alias.name}"
                    if private(name.split(".")):
                        found.append(f"line {node.lineno}: from {node.module} "
                                     f"import {alias.name}")  # fmt: skip
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            parts, base = [node.attr], node.value
            while isinstance(base, ast.Attribute):
                parts.append(base.attr)
                base = base.value
            if (
                isinstance(base, ast.Name)
                and base.id in jax_names
                and private(parts[:1])
            ):
                found.append(f"line {node.lineno}: {ast.unparse(node)}")
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr", "setattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and private([node.args[1].value])
            and any(
                isinstance(n, ast.Name) and n.id in jax_names
                for n in ast.walk(node.args[0])
            )
        ):
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def test_only_public_jax():
    """No `jax._src`, no underscore name of a JAX module or object, anywhere
    in the package: a JAX release may move or change them at any time."""
    offences = [
        f"{path.relative_to(PACKAGE)} {use}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for use in private_jax_uses(path.read_text())
    ]
    assert not offences, offences


def test_the_private_jax_check_catches_each_form():
    # The forms the package used before (`sgmcmc.py`'s import of the threefry
    # primitive, `convolution.py`'s lowering registry) and their variants.
    planted = {
        "from jax._src.random.threefry2x32 import threefry2x32_p": 1,
        "import jax._src.core as core": 1,
        "from jax.interpreters import mlir\n"
        "mlir._platform_specific_lowerings['cpu'].get(p)\n"
        "rule = mlir._lowerings[p].rule": 2,
        "import jax\njax.interpreters.mlir._lowerings": 1,
        "import jax.numpy as jnp\njnp._something(1)": 1,
        "from jax import lax\ngetattr(lax, '_private')": 1,
        "from jax import _src": 1,
        "from jax.sharding import Mesh\nMesh._cache": 1,
        # Public uses, and a private name of an object of our own:
        "import jax\njax.extend.random.threefry2x32_p\nself._jitted(x)": 0,
        "from jax import lax\nlax.conv_general_dilated_p.bind(x)\nx.__class__": 0,
    }
    for source, count in planted.items():
        assert len(private_jax_uses(source)) == count, (
            source,
            private_jax_uses(source),
        )


FAMILIES = ("_core", "_training", "_metrics", "_checkpoints")


def test_each_family_imports_alone():
    # Every module of these families imports on its own in a fresh interpreter
    # (no module relies on another having been imported first). One
    # interpreter loads the third-party libraries once (most of an import's
    # time), then forks a child per module, which imports it with nothing of
    # this package loaded: the package itself stands in its `sys.modules`
    # entry without its `__init__` run (which imports every module: importing
    # a module through it checked only that the package imports, once per
    # module, 10 s for `_training`), so only what the module imports is
    # loaded. (One interpreter for the four families, not one each: ~3 s of
    # start-up apiece.)
    modules = [
        _module_name(p)
        for family in FAMILIES
        for p in sorted((PACKAGE / family).glob("*.py"))
    ]
    result = subprocess.run(
        [sys.executable, "-c", _IMPORT_EACH_ALONE, *modules],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.split() == [f"imported:{m}" for m in modules]


def test_the_import_check_catches_a_module_that_fails_alone():
    result = subprocess.run(
        [sys.executable, "-c", _IMPORT_EACH_ALONE, "eqx_ensemble._no_such_module"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 1
    assert "eqx_ensemble._no_such_module" in result.stderr


_IMPORT_EACH_ALONE = """
import importlib.util, os, sys, traceback
import equinox, jax, jaxtyping, numpy, optax
assert not [m for m in sys.modules if m.startswith("eqx_ensemble")]
package = importlib.util.find_spec("eqx_ensemble")
failed = []
for module in sys.argv[1:]:
    sys.stdout.flush()
    pid = os.fork()
    if pid == 0:
        try:
            # The package without its `__init__` (which imports everything).
            bare = importlib.util.module_from_spec(package)
            sys.modules["eqx_ensemble"] = bare
            __import__(module)
            assert not hasattr(bare, "fit"), "the package's __init__ ran"
        except BaseException:
            traceback.print_exc()
            sys.stderr.flush()
            os._exit(1)
        print(f"imported:{module}")
        sys.stdout.flush()
        os._exit(0)
    if os.waitpid(pid, 0)[1] != 0:
        failed.append(module)
if failed:
    print("failed alone:", *failed, file=sys.stderr)
sys.exit(1 if failed else 0)
"""


ARCHITECTURE = PACKAGE.parent / "docs" / "architecture.md"
_ON_TOP = {"eqx_ensemble", "__main__", "_demo"}  # the package's top: imports anything


def documented_layers() -> dict[str, int]:
    """Family (`_core`, `sgmcmc`, ...) -> its layer's rank in the table of
    docs/architecture.md (0: the first row, which imports nothing above it)."""
    layers: dict[str, int] = {}
    rows = [
        line for line in ARCHITECTURE.read_text().splitlines()
        if line.startswith("| ") and "`" in line.split("|")[2]
    ]  # fmt: skip
    for rank, row in enumerate(rows):
        for entry in re.findall(r"`([^`]+)`", row.split("|")[2]):
            layers[entry.rstrip("/").removesuffix(".py")] = rank
    return layers


def layer_violations(graph: dict[str, set[str]], layers: dict[str, int]) -> list[str]:
    """Every import of a module from a layer below its own (and every module of
    no documented layer). An import of the package itself (`from .. import
    __version__`) is not counted: Python imports it with any of its modules."""
    offences = []
    for module, imported in sorted(graph.items()):
        family = module.split(".")[1] if "." in module else module
        if family in _ON_TOP:
            continue
        if family not in layers:
            offences.append(f"{module} is in no layer of docs/architecture.md")
            continue
        for target in sorted(imported - {"eqx_ensemble"}):
            other = target.split(".")[1] if "." in target else target
            if other in _ON_TOP or layers.get(other, -1) > layers[family]:
                offences.append(f"{module} imports {target}, a layer below it")
    return offences


def test_every_layer_imports_only_itself_and_the_layers_above():
    layers = documented_layers()
    assert set(layers.values()) == set(range(8)), layers  # the table was read
    offences = layer_violations(import_graph(), layers)
    assert not offences, offences


def test_the_layer_check_catches_a_planted_violation():
    # The check itself can fail: the real graph with one import added from the
    # core up to the training loop, and one module of no documented layer.
    graph = {module: set(targets) for module, targets in import_graph().items()}
    graph["eqx_ensemble._core.ensemble"].add("eqx_ensemble._training.run")
    graph["eqx_ensemble._nowhere"] = set()
    assert layer_violations(graph, documented_layers()) == [
        "eqx_ensemble._core.ensemble imports eqx_ensemble._training.run, a layer "
        "below it",
        "eqx_ensemble._nowhere is in no layer of docs/architecture.md",
    ]


def test_with_fields_is_dataclasses_replace_without_init():
    """The per-dispatch `dataclasses.replace`: the same module, a misspelt
    field refused."""
    import dataclasses

    import equinox as eqx
    import jax.numpy as jnp
    import pytest

    from eqx_ensemble._internal.tree import with_fields

    class Pair(eqx.Module):
        a: jnp.ndarray
        b: tuple

    pair = Pair(jnp.ones(2), (1,))
    fast, slow = with_fields(pair, b=()), dataclasses.replace(pair, b=())
    assert bool(tree_equal(fast, slow)) and pair.b == (1,)
    with pytest.raises(TypeError, match=r"no field\(s\) \['c'\]"):
        with_fields(pair, c=1)


def components_named(module: types.ModuleType) -> list[str]:
    """The host components (`ee.Callback` subclasses other than the protocol
    itself) a module's namespace holds: what it imported or defined."""
    from eqx_ensemble._training.callback import Callback

    return sorted(
        name
        for name, value in vars(module).items()
        if isinstance(value, type)
        and issubclass(value, Callback)
        and value is not Callback
    )


def test_the_run_names_no_component():
    # `run.py` calls the callbacks' hooks: it imports no progress meter,
    # controller, logger or checkpointer, and sorts nothing by their type.
    from eqx_ensemble._training import run

    assert components_named(run) == []
    # The check can fail: a module that imported a concrete component.
    from eqx_ensemble._training import fit

    assert components_named(fit) == ["Checkpointer", "ProgressBar"]


def test_the_declared_floor_is_the_tested_one():
    """Every core dependency's lower bound in pyproject.toml is the version
    `make test-floor` (CI) installs from tests/floor.txt, and the reverse: the
    declared range is a promise tested at its floor."""
    import tomllib

    root = PACKAGE.parent
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    declared = {}
    for requirement in project["dependencies"]:
        match = re.fullmatch(r"([A-Za-z0-9_.-]+)>=([0-9.]+)", requirement)
        assert match, f"{requirement!r}: give each core dependency a floor (>=)"
        declared[match[1].lower()] = match[2]
    pinned = {}
    for line in (root / "tests" / "floor.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, version = line.split("==")
            pinned[name.lower()] = version

    def same(a: str, b: str) -> bool:
        pad = lambda v: [int(x) for x in v.split(".")] + [0] * (3 - v.count(".") - 1)  # noqa: E731
        return pad(a) == pad(b)

    assert set(declared) == set(pinned), (declared, pinned)
    for name, version in declared.items():
        assert same(version, pinned[name]), (name, version, pinned[name])


MACHINERY = ("_training", "_execution", "_core", "_checkpoints", "_internal")


def shape_offences(source: str, where: str) -> list[str]:
    """What breaks the machinery's shape in one module's `source` (DESIGN
    section 9): a `Run` class over 300 lines, a function whose body (without
    its docstring) is over 80 lines, a test of a heterogeneous ensemble outside
    `_core/` (`is_heterogeneous(...)`, `isinstance(..., Heterogeneous)`), and
    each `mesh is None` / `mesh is not None` (counted by the caller)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef) and node.name == "Run":
            if node.end_lineno - node.lineno + 1 > 300:  # type: ignore[operator]
                found.append(f"class Run is over 300 lines ({where})")
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if ast.get_docstring(node) is not None:
                body = body[1:]
            if body and body[-1].end_lineno - body[0].lineno + 1 > 80:  # type: ignore[operator]
                found.append(f"{where}:{node.name} has a body over 80 lines")
        elif isinstance(node, ast.Call) and not where.startswith("_core"):
            name = ast.unparse(node.func)
            args = [ast.unparse(arg) for arg in node.args]
            if name.endswith("is_heterogeneous") or (
                name == "isinstance" and "Heterogeneous" in "".join(args[1:])
            ):
                found.append(f"{where}: {ast.unparse(node)}")
        elif isinstance(node, ast.Compare) and len(node.ops) == 1:
            subject = ast.unparse(node.left)
            none = isinstance(node.comparators[0], ast.Constant) and (
                node.comparators[0].value is None
            )
            if (
                none
                and isinstance(node.ops[0], ast.Is | ast.IsNot)
                and (subject == "mesh" or subject.endswith(".mesh"))
            ):
                found.append(f"{where}: mesh-is-None {ast.unparse(node)}")
    return found


def test_the_machinery_keeps_its_shape():
    """The run machinery stays small in the ways DESIGN section 9 names:
    placement is an object (`_training.placement`: `SingleDevice` or `OnMesh`)
    rather than `mesh is None` at each use (at most 3 in the machinery), an
    ensemble is a tuple of groups outside `_core/`, `Run` at most 300 lines
    and no function body over 80 lines."""
    offences, mesh_tests = [], []
    for path in sorted(PACKAGE.rglob("*.py")):
        where = str(path.relative_to(PACKAGE))
        machinery = where.split("/")[0] in MACHINERY
        for offence in shape_offences(path.read_text(), where):
            if "mesh-is-None" in offence:
                if machinery:
                    mesh_tests.append(offence)
            elif machinery or "heterogeneous" in offence.lower():
                offences.append(offence)
    assert not offences, offences
    assert len(mesh_tests) <= 3, mesh_tests


def test_the_shape_check_catches_each_form():
    long_body = "\n".join(f"    x{i} = {i}" for i in range(81))
    planted = {
        f"def f():\n    '''doc'''\n{long_body}\n": 1,
        "class Run:\n" + "\n".join(f"    a{i} = {i}" for i in range(300)) + "\n": 1,
        "if is_heterogeneous(ens):\n    pass\n": 1,
        "isinstance(ens, Heterogeneous)\n": 1,
        "isinstance(ens, (Ensemble, Heterogeneous))\n": 1,
        "mesh is None\nself.mesh is not None\nchunk.mesh is None\n": 3,
        # Not offences: a short body, an Ensemble check, another None test.
        "def f():\n    return 1\nisinstance(ens, Ensemble)\nkey is None\n": 0,
    }
    for source, count in planted.items():
        assert len(shape_offences(source, "_training/x.py")) == count, source
    # A heterogeneity test inside `_core/` is its own business.
    assert not shape_offences("isinstance(ens, Heterogeneous)\n", "_core/x.py")
