"""Public contracts: examples and benchmarks use only public names; every public name is documented."""

from __future__ import annotations

import ast
import inspect
import pathlib
import typing

import pytest

import functional_shard as fs

ROOT = pathlib.Path(__file__).resolve().parents[1]


def private_uses(path: pathlib.Path) -> list[str]:
    """`fs._x` / `functional_shard._x` attribute reads and `from functional_shard._x import ...`."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            base = node.value
            while isinstance(base, ast.Attribute):
                base = base.value
            if isinstance(base, ast.Name) and base.id in ("fs", "functional_shard"):
                found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("functional_shard"):
            parts = node.module.split(".")
            if any(p.startswith("_") for p in parts) or any(a.name.startswith("_") for a in node.names):
                found.append(f"{path.name}:{node.lineno}: from {node.module} import ...")
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("functional_shard.") and any(p.startswith("_") for p in alias.name.split(".")):
                    found.append(f"{path.name}:{node.lineno}: import {alias.name}")
    return found


@pytest.mark.parametrize("folder", ["examples", "benchmarks"])
def test_examples_and_benchmarks_use_only_public_names(folder):
    found = [use for path in sorted((ROOT / folder).rglob("*.py")) for use in private_uses(path)]
    assert not found, "private names used:\n" + "\n".join(found)


def test_the_checker_finds_private_uses(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("import functional_shard as fs\nfs._tree.flatten(x)\nfrom functional_shard._mesh import Mesh\n")
    assert len(private_uses(sample)) == 2


def public_names():
    modules = [fs] + [getattr(fs, name) for name in fs.__all__ if inspect.ismodule(getattr(fs, name))]
    for module in modules:
        for name in module.__all__:
            obj = getattr(module, name)
            if inspect.ismodule(obj):
                continue
            yield f"{module.__name__}.{name}", obj


def test_every_public_name_has_a_docstring():
    missing = []
    for qualified, obj in public_names():
        if not (inspect.isclass(obj) or callable(obj)) or typing.get_origin(obj) is not None:
            continue  # constants and type aliases (documented by a comment where they are defined)
        doc = inspect.getdoc(obj)
        # A NamedTuple's or typing alias's inherited docstring does not count.
        if not doc or (inspect.isclass(obj) and obj.__doc__ is None):
            missing.append(qualified)
    assert not missing, f"undocumented public names: {missing}"
