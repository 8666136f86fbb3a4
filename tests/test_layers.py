"""Imports only point down the layers of docs/ARCHITECTURE.md, and no two modules import
each other.

Every import statement in src/draftgraph is parsed (top level and inside functions); an
import of a module in a higher layer than the importer's, or a pair of modules that import
each other, fails the test with the file and line.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "src" / "draftgraph"
ARCH = ROOT / "docs" / "ARCHITECTURE.md"


def layer_order() -> list[list[str]]:
    """The layers as stated in ARCHITECTURE.md: the line `Layers, top to bottom: a, b | c`."""
    text = ARCH.read_text()
    m = re.search(r"^Layers, top to bottom: (.+)$", text, re.M)
    assert m, "docs/ARCHITECTURE.md must state `Layers, top to bottom: ...`"
    return [[p.strip().strip("`") for p in group.split("|")] for group in m.group(1).split(",")]


def layer_of(module: str, order: list[list[str]]) -> int | None:
    """Layer index of a draftgraph module (`draftgraph.spec.ngram` -> the `spec` layer)."""
    parts = module.split(".")[1:]
    if not parts:
        return None  # the package itself (its __init__ re-exports the public API)
    name = parts[0]
    for i, group in enumerate(order):
        if name in group:
            return i
    raise AssertionError(f"module {module} is in no layer of docs/ARCHITECTURE.md")


def module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def imports_of(path: Path, text: str | None = None) -> list[tuple[str, int]]:
    """(imported draftgraph module, line) for every import in the file (or in `text`, read
    as that file), at any depth: inside functions too."""
    tree = ast.parse(path.read_text() if text is None else text)
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rsplit(".", 1)[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names if a.name.startswith("draftgraph")]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if not mod.startswith("draftgraph"):
                continue
            # `from draftgraph.kernels import gemv` imports the module draftgraph.kernels.gemv
            for a in node.names:
                sub = f"{mod}.{a.name}"
                out.append((sub if (PKG.parent / (sub.replace(".", "/") + ".py")).exists()
                            else mod, node.lineno))
    return out


def all_modules() -> dict[str, list[tuple[str, int]]]:
    return {module_name(p): imports_of(p) for p in sorted(PKG.rglob("*.py"))}


def violations(graph: dict[str, list[tuple[str, int]]], order: list[list[str]]) -> list[str]:
    bad = []
    for mod, imps in graph.items():
        mine = layer_of(mod, order)
        if mine is None:
            continue
        for target, line in imps:
            theirs = layer_of(target, order)
            if theirs is not None and theirs < mine:
                bad.append(f"{mod}:{line} imports {target} (a higher layer)")
    edges = {(m, t) for m, imps in graph.items() for t, _ in imps}
    for m, t in sorted(edges):
        if m < t and (t, m) in edges:
            bad.append(f"{m} and {t} import each other")
    return bad


def test_imports_only_point_down_and_no_module_pair_imports_each_other():
    order = layer_order()
    assert len(order) >= 6
    assert violations(all_modules(), order) == []


def test_layer_check_catches_an_upward_import_and_a_cycle():
    order = layer_order()
    graph = all_modules()
    graph["draftgraph.kernels.ops"] = graph["draftgraph.kernels.ops"] + [
        ("draftgraph.engine.engine", 1)]
    graph["draftgraph.spec.ngram"] = graph["draftgraph.spec.ngram"] + [
        ("draftgraph.spec.verify", 2)]
    graph["draftgraph.spec.verify"] = graph["draftgraph.spec.verify"] + [
        ("draftgraph.spec.ngram", 3)]
    bad = violations(graph, order)
    assert "draftgraph.kernels.ops:1 imports draftgraph.engine.engine (a higher layer)" in bad
    assert "draftgraph.spec.ngram and draftgraph.spec.verify import each other" in bad


def test_imports_inside_functions_and_relative_imports_are_seen():
    f = PKG / "kernels" / "ops.py"
    text = ("import torch\n\ndef f():\n    from draftgraph.engine import engine\n"
            "\n\ndef g():\n    from ..spec import verify\n")
    assert imports_of(f, text) == [("draftgraph.engine.engine", 4),
                                   ("draftgraph.spec.verify", 8)]


@pytest.mark.parametrize("module", ["draftgraph.runtime", "draftgraph.spec"])
def test_every_layer_named_in_the_map_exists(module):
    assert (PKG / module.split(".")[1]).is_dir()
