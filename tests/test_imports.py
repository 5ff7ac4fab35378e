"""The project's import graph: no cycles, `workloads` never imports `sweeper` nor a
command-line parser, and every import points down the layer drawing of docs/architecture.md
("Layers").

Read with `ast`, not by importing: every `import` statement counts, at module top or inside a
function (a function-level import is still a dependency; it only moves when it is paid).
The drawing is read from the document itself, so the two cannot drift apart.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("sweeper", "workloads")
ARCHITECTURE = ROOT / "docs" / "architecture.md"
# The package roots: `sweeper` names only its own __init__ (each subpackage has a layer of
# its own); `workloads` covers all of its modules.
EXACT_ONLY = {"sweeper"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def imported_modules(path: Path, name: str, modules: dict[str, Path]) -> set[str]:
    """Project modules that `path` imports anywhere in its body."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # `from pkg import mod` depends on pkg.mod; `from mod import name` on mod
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                       for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:      # a name inside a module
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = project_modules()
    return {name: imported_modules(path, name, modules) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_graph_sees_function_level_imports():
    graph = import_graph()
    assert "sweeper.cli" in graph and "workloads.config" in graph
    # the trial command imports the engine's measurement lazily (JAX start-up): still an edge
    assert "workloads.measure" in graph["sweeper.cli.trial"]


def test_a_cycle_is_found():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles_between_project_modules():
    found = cycles(import_graph())
    assert not found, "import cycles: " + "; ".join(" <-> ".join(c) for c in found)


@pytest.mark.parametrize("module", sorted(m for m in project_modules() if m.startswith("workloads")))
def test_workloads_never_imports_sweeper(module):
    graph = import_graph()
    assert not {m for m in graph[module] if m.split(".")[0] == "sweeper"}


# The command-line parsers: `workloads` takes its inputs as values, and its flags are parsed
# in `sweeper` (sweeper/cli/, sweeper/calibrate/worker.py).
CLI_MODULES = {"argparse", "optparse", "getopt", "click", "typer"}


def top_level_imports(source: str) -> set[str]:
    """The top-level package of every absolute import in `source`, anywhere in its body."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.add(node.module.split(".")[0])
    return found


def test_the_cli_import_check_sees_function_level_imports():
    source = "import json\ndef main():\n    from argparse import ArgumentParser\n"
    assert top_level_imports(source) & CLI_MODULES == {"argparse"}


@pytest.mark.parametrize("module", sorted(m for m in project_modules() if m.startswith("workloads")))
def test_workloads_parses_no_command_line(module):
    found = top_level_imports(project_modules()[module].read_text()) & CLI_MODULES
    assert not found, f"{module} imports {sorted(found)}: parse flags in sweeper/cli"


# ----------------------------------------------------------------------------- layers


def layers_from_doc(text: str | None = None) -> list[list[str]]:
    """The layer drawing of docs/architecture.md, top layer first: the first fenced block
    under "## Layers"; each layer is a line `name, name, ...   description` (names then two
    or more spaces), layers separated by lines of `|` (the arrows: a layer imports only its
    own modules and those of the layers below)."""
    text = ARCHITECTURE.read_text() if text is None else text
    section = text.split("\n## Layers", 1)[1]
    block = section.split("```", 2)[1]
    layers = []
    for line in block.splitlines()[1:]:
        if not line.strip() or set(line.strip()) <= {"|", "v"}:
            continue
        names = re.split(r"\s{2,}", line.strip(), maxsplit=1)[0]
        layers.append([n.strip() for n in names.split(",") if n.strip()])
    return layers


def layer_of(module: str, layers: list[list[str]]) -> int | None:
    """Index of the layer naming the longest dotted prefix of `module` (None: no layer)."""
    best, index = -1, None
    for i, names in enumerate(layers):
        for name in names:
            covers = module == name or (module.startswith(name + ".") and name not in EXACT_ONLY)
            if covers and len(name) > best:
                best, index = len(name), i
    return index


def upward_imports(graph: dict[str, set[str]], layers: list[list[str]]) -> list[str]:
    """'a -> b' for every import of a module from a layer above its own."""
    found = []
    for module, targets in sorted(graph.items()):
        own = layer_of(module, layers)
        for target in sorted(targets):
            theirs = layer_of(target, layers)
            if own is not None and theirs is not None and theirs < own:
                found.append(f"{module} -> {target}")
    return found


def test_the_layer_checker_finds_an_upward_import():
    layers = [["top"], ["mid.special"], ["mid"], ["sweeper"]]
    assert layer_of("mid.special.x", layers) == 1 and layer_of("mid.y", layers) == 2
    assert layer_of("sweeper", layers) == 3 and layer_of("sweeper.new", layers) is None
    assert upward_imports({"mid.y": {"top.a"}, "top.a": {"mid.y"}}, layers) == ["mid.y -> top.a"]
    text = "# A\n\n## Layers\n\n```\na.b, c     what\n   |\nd          more\n```\n"
    assert layers_from_doc(text) == [["a.b", "c"], ["d"]]


def test_the_drawing_names_the_main_packages():
    layers = layers_from_doc()
    assert len(layers) >= 5
    named = {name for names in layers for name in names}
    assert {"sweeper.cli", "sweeper.sweep", "sweeper.tracking", "sweeper.analysis",
            "workloads"} <= named


def test_every_project_module_has_a_layer_in_the_drawing():
    """A new package is placed in the drawing (a package listed there before it exists is
    fine: it is checked from the moment it appears)."""
    layers = layers_from_doc()
    missing = sorted(m for m in project_modules() if layer_of(m, layers) is None)
    assert not missing, f"modules with no layer in docs/architecture.md: {missing}"


def test_every_import_points_down_the_layer_drawing():
    found = upward_imports(import_graph(), layers_from_doc())
    assert not found, "imports from a layer above (docs/architecture.md, Layers): " + \
        "; ".join(found)


def test_the_drawing_names_folders_not_modules_inside_them():
    """Each layer is a folder (a package) or a module at a package's top (sweeper.paths): no
    layer names a module inside a subpackage, so a folder never sits in two layers."""
    for names in layers_from_doc():
        for name in names:
            parts = name.split(".")
            path = ROOT.joinpath(*parts)
            assert len(parts) <= 2, f"{name}: a module inside a folder, not a folder"
            assert (path / "__init__.py").is_file() or path.with_suffix(".py").is_file(), name
