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
    """fitlm.train.trainer -> train; fitlm.config -> config; fitlm (the package itself) -> __init__.

    One unit is not a folder: the torch-free family specs, `fitlm.models.family_spec` and each family folder's
    `fitlm.models.<family>.spec`, form `model_specs`, below the config that reads them. They may live beside
    their families' model code because fitlm/models/__init__.py and the folders' __init__.py import nothing
    (tests/unit/test_config_without_torch.py checks that validating a config imports no torch)."""
    parts = module.split(".")
    if parts[:2] == ["fitlm", "models"] and (parts[2:] == ["family_spec"] or (len(parts) == 4 and parts[3] == "spec")):
        return "model_specs"
    return parts[1] if len(parts) > 1 else "__init__"


def _imports(tree: ast.AST, names: bool = False):
    """The fitlm modules a tree imports; with `names`, `from module import x` yields `module.x` (x may be a module
    of its own: `from fitlm.plan import finetune` imports fitlm.plan.finetune, not the package's __init__)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue  # annotations only: no import at run time
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "fitlm":
            if node.module == "fitlm":  # from fitlm import hardware / __version__
                yield from (
                    f"fitlm.{a.name}" if (PACKAGE / f"{a.name}.py").exists() or (PACKAGE / a.name).is_dir() else "fitlm"
                    for a in node.names
                )
            elif names:  # module_of resolves an attribute path to its module
                yield from (f"{node.module}.{a.name}" for a in node.names)
            else:
                yield node.module
        elif isinstance(node, ast.Import):
            yield from (a.name for a in node.names if a.name.split(".")[0] == "fitlm")
        yield from _imports(node, names)


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
    units = {
        p.stem if p.is_file() else p.name
        for p in PACKAGE.iterdir()
        if (p.suffix == ".py" or (p.is_dir() and (p / "__init__.py").exists() or p.is_dir() and any(p.glob("*.py"))))
        and p.name != "__pycache__"
    }
    assert units - set(placed) == set(), (
        f"units missing from docs/architecture.md's Layers table: {units - set(placed)}"
    )


def test_imports_go_down_the_layers_only():
    level = {u: i for i, layer in enumerate(documented_layers()) for u in layer}
    upward = [
        f"{f}: {src} (layer {level[src]}) imports {dst} (layer {level.get(dst)})"
        for src, dst, f in import_edges()
        if level.get(dst, 99) >= level[src]
    ]
    assert not upward, "imports that go up or sideways:\n" + "\n".join(upward)


def test_the_checker_sees_imports_inside_functions(tmp_path):
    tree = ast.parse("def f():\n    from fitlm.train.trainer import Trainer\n")
    assert list(_imports(tree)) == ["fitlm.train.trainer"]


def module_of(target: str, modules: set[str]) -> str | None:
    """The fitlm module an import names: `fitlm.data.prep.pack` itself, or the longest module prefix of an
    attribute path (`from fitlm.data import loader` names the package fitlm.data, which is fitlm/data/__init__)."""
    while target and target not in modules:
        target = target.rpartition(".")[0]
    return target or None


def module_graph() -> dict[str, set[str]]:
    """module -> the fitlm modules it imports, function-level imports included, TYPE_CHECKING ones not."""

    def name(path: Path) -> str:
        parts = path.relative_to(ROOT).with_suffix("").parts
        return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)

    paths = {name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for mod, path in paths.items():
        found = {module_of(t, set(paths)) for t in _imports(ast.parse(path.read_text()), names=True)}
        graph[mod] = {m for m in found if m and m != mod}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circle_between_files():
    found = circles(module_graph())
    assert not found, "files that import each other (directly or around a circle):\n" + "\n".join(
        " <-> ".join(c) for c in found
    )


def test_the_circle_finder_finds_one():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def _module_paths(tree: ast.Module):
    """Module paths in strings that are imports: the argument of import_module(...), and the entries of a
    module-level tuple or list of module paths (the registry's BUILTIN_FAMILIES, the CLI's COMMAND_MODULES)."""

    def paths(values):
        names = [v.value for v in values if isinstance(v, ast.Constant) and isinstance(v.value, str)]
        return [n for n in names if re.fullmatch(r"fitlm(\.[a-z_0-9]+)+", n)]

    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args and ast.unparse(node.func).endswith("import_module"):
            yield from paths(node.args[:1])
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, (ast.Tuple, ast.List)):
            yield from paths(node.value.elts)


def module_strings() -> list[tuple[str, str, str]]:
    """(unit of the file, unit named, file) for every module path a file imports by string."""
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        src = unit_of(".".join(path.relative_to(ROOT).with_suffix("").parts))
        out += [(src, unit_of(m), str(path.relative_to(ROOT))) for m in _module_paths(ast.parse(path.read_text()))]
    return out


def test_the_string_checker_sees_import_module_and_module_tables():
    tree = ast.parse(
        'import importlib\nMODS = ("fitlm.train.trainer", "x")\nNAME = "fitlm.json"\n'
        'def f():\n    importlib.import_module("fitlm.serve.app")\n    return ["-m", "fitlm.cli"]\n'
    )
    assert sorted(_module_paths(tree)) == ["fitlm.serve.app", "fitlm.train.trainer"]


def test_module_path_strings_do_not_climb_a_layer():
    """A module path in a string is an import the layer test cannot see as one: it may name its own unit or a
    lower one. The registry, below the models it lists, is the one documented exception (it knows the built-in
    families by module path, as entry points name plugins)."""
    level = {u: i for i, layer in enumerate(documented_layers()) for u in layer}
    upward = [
        f"{f}: {src} (layer {level[src]}) names {dst} (layer {level.get(dst)})"
        for src, dst, f in module_strings()
        if dst != src and level.get(dst, 99) >= level[src] and not (src == "registry" and dst == "models")
    ]
    assert not upward, "module-path strings that go up or sideways:\n" + "\n".join(upward)


def test_the_circle_finder_sees_a_module_imported_from_its_package():
    tree = ast.parse("from fitlm.plan import finetune as ft\nfrom fitlm.config import Config\n")
    modules = {"fitlm.plan", "fitlm.plan.finetune", "fitlm.config"}
    assert {module_of(t, modules) for t in _imports(tree, names=True)} == {"fitlm.plan.finetune", "fitlm.config"}
