"""elastictrain's layout: imports point down the layers, no module cycles, no two classes share a name.

Layers, lowest first (the folders; docs: README "Layout"): the base modules (errors < config, logs, testing) <
rendezvous < checkpoint, runtime < agent < chaos < cli, recipes. A module may import its own package and any
lower layer. Modules of one layer (checkpoint and runtime; cli and recipes) do not import each other, except
runtime -> checkpoint (the worker saves through the checkpoint manager). The package's `__init__` is the public
surface and may import from any layer; of the package's own modules, only the top layer's recipes import it
(a recipe is an example of the public API, as a user's script is). The worker side (runtime, checkpoint,
recipes) never reaches the agent or the CLI, through any chain: a worker process never loads them.

Every import counts: at module level, inside functions (lazy imports) and under `if TYPE_CHECKING:` (a type
that names a higher layer is still a dependency on it). The source is read with `ast`, nothing is imported.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import pytest

PACKAGE_DIR = Path(__file__).resolve().parents[2] / "elastictrain"

RANK = {"errors": 0, "config": 1, "logs": 1, "testing": 1, "rendezvous": 2, "checkpoint": 3, "runtime": 3,
        "agent": 4, "chaos": 5, "cli": 6, "recipes": 6}
"""Each top-level module or folder of the package and its layer."""
PEER_IMPORTS = {("runtime", "checkpoint")}
"""Imports allowed between two folders of one layer (importer, imported)."""
PUBLIC_SURFACE_USERS = {"recipes"}
"""Folders whose modules import the public surface (`elastictrain`), as a user's script does."""
WORKER_SIDE = {"runtime", "checkpoint", "recipes"}
AGENT_SIDE = {"agent", "cli"}

ALLOWED_CYCLES: dict[frozenset[str], str] = {}
"""Cycles known and not yet fixed, each with why. An entry that no longer matches a cycle fails the test."""
ALLOWED_LAYER_IMPORTS: dict[tuple[str, str], str] = {}
"""(importer, imported) module pairs that break the layers knowingly, each with why; none today."""
SHARED_CLASS_NAMES: dict[str, str] = {}
"""Class names that more than one module of the package defines knowingly, each with why; none today."""


@dataclass(frozen=True)
class Import:
    importer: str
    imported: str
    line: int

    def __str__(self) -> str:
        return f"{self.importer} -> {self.imported} (line {self.line})"


def module_names(package_dir: Path) -> dict[str, Path]:
    """Dotted name of every module under `package_dir` (a package is named by its `__init__`)."""
    names = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = (package_dir.name, *path.relative_to(package_dir).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join(parts)] = path
    return names


def _targets(node: ast.AST, importer: str, is_package: bool, modules: set[str]) -> Iterator[str]:
    """The package's modules one import statement loads, by name."""
    if isinstance(node, ast.Import):
        yield from (a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            anchor = importer.split(".")
            anchor = anchor[: len(anchor) - node.level + (1 if is_package else 0)]
            base = ".".join([*anchor, *([base] if base else [])])
        for alias in node.names:
            # `from pkg import mod` loads the module pkg.mod; `from mod import name` loads mod.
            yield f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base


def import_graph(package_dir: Path) -> list[Import]:
    """Every import of one of the package's modules by another, wherever in the source it stands."""
    names = module_names(package_dir)
    modules = set(names)
    found = set()
    for importer, path in names.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            for target in _targets(node, importer, is_package, modules):
                if target in modules and target != importer:
                    found.add(Import(importer, target, node.lineno))
    return sorted(found, key=lambda i: (i.importer, i.line, i.imported))


def _layer(module: str) -> Optional[str]:
    """The top-level folder or module under the package; None for the package's `__init__` itself."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def layer_violations(imports: list[Import]) -> list[Import]:
    """Imports of a higher layer, or of another folder of the same layer."""
    bad = []
    for i in imports:
        src, dst = _layer(i.importer), _layer(i.imported)
        if src is None or src == dst:
            continue
        if dst is None and i.imported == "elastictrain" and src in PUBLIC_SURFACE_USERS:
            continue
        if dst is None or src not in RANK or dst not in RANK:
            bad.append(i)  # importing the public surface from inside, or a folder with no layer yet
        elif RANK[dst] > RANK[src] or (RANK[dst] == RANK[src] and (src, dst) not in PEER_IMPORTS):
            bad.append(i)
    return bad


def cycles(imports: list[Import]) -> list[frozenset[str]]:
    """Sets of modules that import each other through some chain (strongly connected, more than one)."""
    graph: dict[str, set[str]] = defaultdict(set)
    for i in imports:
        graph[i.importer].add(i.imported)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[frozenset[str]] = []

    def visit(v: str) -> None:  # Tarjan; the graph is a few hundred edges, recursion is fine
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(frozenset(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def reachable(imports: list[Import], start: str) -> dict[str, list[str]]:
    """Every module `start` loads through some chain, with one chain to it."""
    graph: dict[str, set[str]] = defaultdict(set)
    for i in imports:
        graph[i.importer].add(i.imported)
    paths = {start: [start]}
    todo = [start]
    while todo:
        v = todo.pop()
        for w in sorted(graph[v]):
            if w not in paths:
                paths[w] = [*paths[v], w]
                todo.append(w)
    del paths[start]
    return paths


def _explain(cycle: frozenset[str], imports: list[Import]) -> str:
    return ", ".join(str(i) for i in imports if i.importer in cycle and i.imported in cycle)


@pytest.fixture(scope="module")
def imports() -> list[Import]:
    return import_graph(PACKAGE_DIR)


def test_every_folder_of_the_package_has_a_layer() -> None:
    folders = {_layer(m) for m in module_names(PACKAGE_DIR)} - {None}
    assert folders <= set(RANK), f"give {sorted(folders - set(RANK))} a layer in RANK (and in README 'Layout')"


def test_imports_point_down_the_layers(imports: list[Import]) -> None:
    bad = [i for i in layer_violations(imports) if (i.importer, i.imported) not in ALLOWED_LAYER_IMPORTS]
    assert not bad, "imports of a higher or a peer layer; move the shared code down:\n  " + "\n  ".join(map(str, bad))


def test_no_modules_import_each_other_through_any_chain(imports: list[Import]) -> None:
    found = cycles(imports)
    new = [c for c in found if c not in ALLOWED_CYCLES]
    assert not new, "modules that import each other; give one a Protocol of what it uses, or move code:\n  " + (
        "\n  ".join(_explain(c, imports) for c in new))
    gone = [sorted(c) for c in ALLOWED_CYCLES if c not in found]
    assert not gone, f"these cycles are gone: remove them from ALLOWED_CYCLES: {gone}"


def test_allowed_layer_imports_still_exist(imports: list[Import]) -> None:
    present = {(i.importer, i.imported) for i in imports}
    gone = [pair for pair in ALLOWED_LAYER_IMPORTS if pair not in present]
    assert not gone, f"these imports are gone: remove them from ALLOWED_LAYER_IMPORTS: {gone}"


def test_the_worker_side_never_loads_the_agent_side(imports: list[Import]) -> None:
    bad = []
    for module in module_names(PACKAGE_DIR):
        if _layer(module) in WORKER_SIDE:
            bad += [" -> ".join(chain) for target, chain in reachable(imports, module).items()
                    if _layer(target) in AGENT_SIDE]
    assert not bad, "worker modules that load agent-side code:\n  " + "\n  ".join(bad)


def class_definitions(package_dir: Path) -> dict[str, list[str]]:
    """Class name -> where the package defines it ("module:line"), nested classes included."""
    found: dict[str, list[str]] = defaultdict(list)
    for module, path in module_names(package_dir).items():
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ClassDef):
                found[node.name].append(f"{module}:{node.lineno}")
    return found


def test_no_two_classes_share_a_name() -> None:
    shared = {name: where for name, where in class_definitions(PACKAGE_DIR).items() if len(where) > 1}
    new = {name: where for name, where in shared.items() if name not in SHARED_CLASS_NAMES}
    assert not new, "one name, one thing: rename one of each (the name says what it is):\n  " + "\n  ".join(
        f"{name}: {', '.join(where)}" for name, where in sorted(new.items()))
    gone = sorted(set(SHARED_CLASS_NAMES) - set(shared))
    assert not gone, f"these names are no longer shared: remove them from SHARED_CLASS_NAMES: {gone}"


def _tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / "elastictrain" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "elastictrain"


def test_the_checks_see_lazy_type_only_and_relative_imports(tmp_path: Path) -> None:
    package = _tree(tmp_path, {
        "__init__.py": "",
        "agent/__init__.py": "",
        "agent/a.py": "def f():\n    from elastictrain.agent import b\n",
        "agent/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import f\n",
        "agent/c.py": "import elastictrain.cli.x\n",
        "cli/__init__.py": "",
        "cli/x.py": "from elastictrain.agent.c import *\n",
        "runtime/__init__.py": "",
        "runtime/w.py": "from elastictrain.chaos import in_worker\n",
        "chaos/__init__.py": "",
        "chaos/in_worker.py": "from ..agent.a import f\n",
    })  # fmt: skip
    imports = import_graph(package)
    assert [str(i) for i in layer_violations(imports)] == [
        "elastictrain.agent.c -> elastictrain.cli.x (line 1)",
        "elastictrain.runtime.w -> elastictrain.chaos.in_worker (line 1)",
    ]
    assert sorted(map(sorted, cycles(imports))) == [["elastictrain.agent.a", "elastictrain.agent.b"],
                                                    ["elastictrain.agent.c", "elastictrain.cli.x"]]
    assert reachable(imports, "elastictrain.runtime.w")["elastictrain.agent.b"] == [
        "elastictrain.runtime.w", "elastictrain.chaos.in_worker", "elastictrain.agent.a", "elastictrain.agent.b"]


def test_class_names_are_seen_in_every_module_nested_ones_too(tmp_path: Path) -> None:
    package = _tree(tmp_path, {
        "__init__.py": "",
        "chaos/__init__.py": "",
        "chaos/schedule.py": "class Fault:\n    pass\n",
        "chaos/in_worker.py": "def f():\n    class Fault:\n        pass\n",
    })  # fmt: skip
    assert sorted(class_definitions(package)["Fault"]) == ["elastictrain.chaos.in_worker:2",
                                                           "elastictrain.chaos.schedule:1"]
