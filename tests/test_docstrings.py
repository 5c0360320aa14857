"""Every public name's docstring example runs (the docs cannot drift from the code).

Examples are the ```python fenced blocks of a docstring; each runs in a fresh
namespace holding `jax`, `jnp`, `np`, `eqx`, `optax` and `ee`.
"""

import inspect
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import eqx_ensemble as ee

_FENCE = re.compile(r"```python\n(.*?)```", re.DOTALL)


def _public_objects():
    seen = set()
    modules = [ee] + [
        value
        for name, value in vars(ee).items()
        if inspect.ismodule(value)
        and not name.startswith("_")
        and value.__name__.startswith("eqx_ensemble.")
    ]
    for module in modules:
        names = getattr(module, "__all__", None) or [
            name for name in vars(module) if not name.startswith("_")
        ]
        for name in names:
            obj = getattr(module, name)
            if inspect.ismodule(obj) and obj is not module:
                yield f"{obj.__name__}", obj
                continue
            defined_in = getattr(obj, "__module__", "") or ""
            if not defined_in.startswith("eqx_ensemble"):
                continue
            if id(obj) in seen:
                continue
            seen.add(id(obj))
            yield f"{module.__name__}.{name}", obj
            if inspect.isclass(obj):
                for attr, member in vars(obj).items():
                    if attr.startswith("_") and attr not in ("__call__", "__getitem__"):
                        continue
                    if callable(member) or isinstance(
                        member, property | classmethod | staticmethod
                    ):
                        yield f"{module.__name__}.{name}.{attr}", member


def _examples(submodules: bool):
    """The examples of the top-level names (`submodules=False`) or of the
    submodules' names (`ee.calibration.*`, `ee.nn.*`, ...: run by
    test_docstrings_modules.py, so that neither file takes a minute)."""
    for qualname, obj in _public_objects():
        parts = qualname.split(".")
        in_submodule = len(parts) > 1 and inspect.ismodule(getattr(ee, parts[1], None))
        if in_submodule != submodules:
            continue
        doc = inspect.getdoc(obj) or ""
        for number, block in enumerate(_FENCE.findall(doc)):
            yield pytest.param(block, id=f"{qualname}[{number}]")


@pytest.mark.parametrize("source", list(_examples(submodules=False)))
def test_docstring_example_runs(source, tmp_path, monkeypatch):
    run_example(source, tmp_path, monkeypatch)


def run_example(source: str, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    namespace = {
        "jax": jax,
        "jnp": jnp,
        "np": np,
        "eqx": eqx,
        "optax": optax,
        "ee": ee,
    }
    exec(compile(source, "<docstring>", "exec"), namespace)


def test_every_public_function_has_an_example():
    missing = []
    for qualname, obj in _public_objects():
        if inspect.ismodule(obj) or isinstance(obj, property):
            continue
        if inspect.isfunction(obj) or inspect.isclass(obj):
            if qualname.count(".") > 1 and not inspect.isclass(obj):
                # Methods are covered by their class's example.
                continue
            if not _FENCE.search(inspect.getdoc(obj) or ""):
                missing.append(qualname)
    assert not missing, f"public names without a docstring example: {missing}"
