"""The layer rules of docs/architecture.md, read from every module's imports."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("domain", "schemas", "bus", "workers", "projections", "agents", "client", "cli",
            "local", "bench", "chaos", "gateway", "sim", "computepool")


def _modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")) if (ROOT / package).is_dir() else ():
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


MODULES = _modules()


def _runtime_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node of `tree` but those under `if TYPE_CHECKING:` (types only, never imported)."""
    out: list[ast.AST] = []
    todo = [tree]
    while todo:
        node = todo.pop()
        out.append(node)
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                todo.extend(child.orelse)
            else:
                todo.append(child)
    return out


def _imports(path: Path) -> set[str]:
    """Every module `path` imports when it runs, at any depth (lazy imports count)."""
    out: set[str] = set()
    for node in _runtime_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


IMPORTS = {name: _imports(path) for name, path in MODULES.items()}


def _offenders(where: tuple[str, ...], roots: tuple[str, ...]) -> list[str]:
    def top(module: str) -> str:
        return module.split(".")[0]

    return sorted(f"{name} imports {dep}" for name, deps in IMPORTS.items()
                  if top(name) not in where for dep in deps if top(dep) in roots)


# The "may import" column of docs/architecture.md's table of folders, as data: which of the
# project's own packages each folder's modules may import besides their own folder's (a
# dotted entry allows that module and what is under it, no more of its package).
# test_the_docs_table_and_this_one_agree keeps the two in step.
EVERYTHING = PACKAGES
MAY_IMPORT: dict[str, tuple[str, ...]] = {
    "domain": (),
    "schemas": ("domain",),
    "bus": ("domain", "schemas"),
    "workers": ("domain", "schemas", "bus", "projections", "gateway"),
    "projections": ("domain", "schemas", "bus"),
    "agents": ("domain", "schemas", "bus"),
    "client": ("bus", "schemas"),
    "computepool": ("bus", "client", "schemas", "gateway.wire"),
    "gateway": ("domain", "schemas", "bus", "client", "workers.routes", "projections"),
    "cli": EVERYTHING,
    "local": EVERYTHING,
    "sim": ("domain", "workers.scheduler"),
    "bench": EVERYTHING,
    "chaos": EVERYTHING,
}
# and the libraries the domain may import besides the standard library (the same row's cell)
DOMAIN_LIBRARIES = ("numpy", "eventsourcing.domain", "eventsourcing.utils", "cryptography")


def _targets(path: Path) -> set[str]:
    """The modules `path` imports when it runs, each named once: `from a import b` is `a.b`
    where that is one of the project's modules, else `a`."""
    out: set[str] = set()
    for node in _runtime_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                full = f"{node.module}.{a.name}"
                out.add(full if full in MODULES else node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


TARGETS = {name: _targets(path) for name, path in MODULES.items()}


def _within(module: str, allowed: tuple[str, ...]) -> bool:
    return any(module == a or module.startswith(a + ".") for a in allowed)


@pytest.mark.parametrize("folder", PACKAGES)
def test_a_folder_imports_only_what_the_table_allows(folder: str) -> None:
    allowed = (folder, *MAY_IMPORT[folder])
    found = sorted(f"{name} imports {dep}" for name, deps in TARGETS.items()
                   if name.split(".")[0] == folder for dep in deps
                   if dep.split(".")[0] in PACKAGES and not _within(dep, allowed))
    assert found == []


def test_the_domain_imports_only_the_standard_library_and_its_few_libraries() -> None:
    allowed = ("domain", *DOMAIN_LIBRARIES)
    found = sorted(f"{name} imports {dep}" for name, deps in TARGETS.items()
                   if name.split(".")[0] == "domain" for dep in deps
                   if dep.split(".")[0] not in sys.stdlib_module_names
                   and not _within(dep, allowed))
    assert found == []


def _docs_table() -> dict[str, tuple[set[str], set[str]]]:
    """docs/architecture.md's table of folders: folder → (own packages, other libraries) its
    "may import" cell names (backticked, `workers/routes` as `workers.routes`)."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    rows = text.split("| folder | owns | may import |", 1)[1].split("\n\n", 1)[0]
    out: dict[str, tuple[set[str], set[str]]] = {}
    for line in rows.splitlines()[2:]:
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        names = {re.sub(r"/$|\.py$", "", n).replace("/", ".")
                 for n in re.findall(r"`([^`]+)`", cells[-1])}
        if cells[-1].startswith("everything"):
            names |= set(EVERYTHING)
        for folder in re.findall(r"`([^`]+)/`", cells[0]):
            out[folder] = ({n for n in names if n.split(".")[0] in PACKAGES},
                           {n for n in names if n.split(".")[0] not in PACKAGES})
    return out


def test_the_docs_table_and_this_one_agree() -> None:
    table = _docs_table()
    assert {f: table.get(f, (set(), set()))[0] for f in PACKAGES} == \
        {f: set(MAY_IMPORT[f]) for f in PACKAGES}
    assert table["domain"][1] == set(DOMAIN_LIBRARIES)
    assert all(not libraries for f, (_own, libraries) in table.items() if f != "domain")


def test_only_bus_speaks_nats() -> None:
    # in the product; the tooling (bench/'s load generators, chaos/'s hostile clients) speaks
    # raw NATS on purpose, and ships in none of the product's folders
    assert _offenders(("bus", "bench", "chaos"), ("nats",)) == []


def test_the_product_ships_no_tooling() -> None:
    product = ("domain", "schemas", "bus", "workers", "projections", "agents", "client",
               "gateway", "computepool")
    assert sorted(f"{name} imports {dep}" for name, deps in IMPORTS.items()
                  if name.split(".")[0] in product
                  for dep in deps if dep.split(".")[0] in ("bench", "chaos", "tests")) == []


def test_no_private_name_is_imported_from_another_module() -> None:
    """A `_name` is its module's own: another module that needs it needs a public name."""
    found = []
    for name, path in MODULES.items():
        for node in _runtime_nodes(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                    and node.module.split(".")[0] in PACKAGES:
                found += [f"{name} imports {node.module}.{a.name}" for a in node.names
                          if a.name.startswith("_") and not a.name.startswith("__")]
    assert found == []


def test_only_projections_speak_sql() -> None:
    assert _offenders(("projections",), ("psycopg", "psycopg_pool")) == []


def test_the_domain_does_no_io_and_reads_no_clock() -> None:
    forbidden = ("bus", "workers", "projections", "agents", "client", "cli", "local", "time",
                 "datetime", "nats", "psycopg", "docker", "socket", "subprocess", "os")
    found = sorted(f"{name} imports {dep}" for name, deps in IMPORTS.items()
                   if name.split(".")[0] == "domain"
                   for dep in deps if dep.split(".")[0] in forbidden)
    assert found == []


def test_no_two_modules_import_each_other() -> None:
    graph = {name: {d for d in deps if d in MODULES and d != name}
             for name, deps in IMPORTS.items()}
    # a package's __init__ re-exporting its own submodules is not a cycle between parts
    for name, deps in graph.items():
        graph[name] = {d for d in deps if not d.startswith(name + ".")}
    cycles: list[list[str]] = []
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    assert cycles == []


def test_the_rules_see_the_whole_tree() -> None:
    # a rule over an empty set of modules could not fail
    assert len(MODULES) > 60 and "bus.jetstream.recorder" in MODULES
    assert any(d.startswith("nats") for d in IMPORTS["bus.jetstream.directget"])
