"""Packages are layered: a module imports only from units in lower layers (or its own unit), counting the
imports inside functions too, so no two packages depend on each other. The table is docs/architecture.md's."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "fitlm"


def documented_layers() -> list[list[str]]:
    """docs/architecture.md's "Layers" table, bottom layer first: `| N | unit, unit, ... |` rows."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("## Layers", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| (\d+) \| ([^|]+) \|", section, flags=re.M)
    assert rows, "docs/architecture.md: no rows in the Layers table"
    return [[u.strip().strip("`") for u in units.split(",")] for _, units in sorted(rows, key=lambda r: int(r[0]))]


def unit_of(module: str) -> str:
    """fitlm.train.trainer -> train; fitlm.config -> config; fitlm (the package itself) -> __init__."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _imports(tree: ast.AST):
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue  # annotations only: no import at run time
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "fitlm":
            if node.module == "fitlm":  # from fitlm import hardware / __version__
                yield from (f"fitlm.{a.name}" if (PACKAGE / f"{a.name}.py").exists() or (PACKAGE / a.name).is_dir()
                            else "fitlm" for a in node.names)
            else:
                yield node.module
        elif isinstance(node, ast.Import):
            yield from (a.name for a in node.names if a.name.split(".")[0] == "fitlm")
        yield from _imports(node)


def import_edges() -> list[tuple[str, str, str]]:
    """(importing unit, imported unit, file) for every fitlm import between different units."""
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        src = unit_of(".".join(path.relative_to(ROOT).with_suffix("").parts))
        for target in _imports(ast.parse(path.read_text())):
            dst = unit_of(target)
            if dst != src:
                out.append((src, dst, str(path.relative_to(ROOT))))
    return out


def test_every_unit_has_a_layer():
    layers = documented_layers()
    placed = [u for layer in layers for u in layer]
    assert len(placed) == len(set(placed)), "a unit is listed in two layers"
    units = {p.stem if p.is_file() else p.name for p in PACKAGE.iterdir()
             if (p.suffix == ".py" or (p.is_dir() and (p / "__init__.py").exists() or p.is_dir() and any(p.glob("*.py"))))
             and p.name != "__pycache__"}
    assert units - set(placed) == set(), f"units missing from docs/architecture.md's Layers table: {units - set(placed)}"


def test_imports_go_down_the_layers_only():
    level = {u: i for i, layer in enumerate(documented_layers()) for u in layer}
    upward = [f"{f}: {src} (layer {level[src]}) imports {dst} (layer {level.get(dst)})"
              for src, dst, f in import_edges() if level.get(dst, 99) >= level[src]]
    assert not upward, "imports that go up or sideways:\n" + "\n".join(upward)


def test_the_checker_sees_imports_inside_functions(tmp_path):
    tree = ast.parse("def f():\n    from fitlm.train.trainer import Trainer\n")
    assert list(_imports(tree)) == ["fitlm.train.trainer"]
