"""One composition root: only workers/bootstrap.py builds the plane's parts (docs/architecture.md)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from workers.bootstrap import DATA_PLANE, PLANE, SERVED, Role, served

ROOT = Path(__file__).resolve().parents[2]
# the product's folders (bench/, chaos/, sim/ and the tests may build their own pieces)
PRODUCT = ("domain", "schemas", "bus", "workers", "projections", "agents", "client",
           "computepool", "gateway", "cli", "local")
ROOT_MODULE = ROOT / "workers" / "bootstrap.py"
# the application (PoolApp) composes its store and the command services over it
FACADE = ROOT / "workers" / "application" / "app.py"
# what only the composition root makes: the applications over the log, the scheduler, the
# dispatcher and reconciler, the projector, and the HTTP gateway's application
BUILT_THERE = frozenset({"PoolApp", "Store", "Scheduler", "Dispatcher", "Reconciler",
                         "Projector", "create_app"})


def _called(node: ast.Call) -> str:
    func = node.func
    return func.id if isinstance(func, ast.Name) else (
        func.attr if isinstance(func, ast.Attribute) else "")


def constructions(path: Path) -> list[str]:
    """`path`'s calls of one of BUILT_THERE, as 'file:line Name'."""
    tree = ast.parse(path.read_text(), str(path))
    return [f"{path.relative_to(ROOT)}:{node.lineno} {_called(node)}"
            for node in ast.walk(tree)
            if isinstance(node, ast.Call) and _called(node) in BUILT_THERE]


def test_only_the_composition_root_constructs_the_planes_parts() -> None:
    found = [hit for folder in PRODUCT for path in sorted((ROOT / folder).rglob("*.py"))
             if path not in (ROOT_MODULE, FACADE) for hit in constructions(path)]
    assert found == []
    # the rule would pass over an empty tree: the root itself makes every one of them but
    # the store, which the application it builds makes, and nothing else there
    assert {hit.rsplit(" ", 1)[1] for hit in constructions(ROOT_MODULE)} == \
        BUILT_THERE - {"Store"}
    assert {hit.rsplit(" ", 1)[1] for hit in constructions(FACADE)} == {"Store"}


def test_in_workers_only_the_composition_root_imports_the_gateway() -> None:
    found = []
    for path in sorted((ROOT / "workers").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (isinstance(node, ast.ImportFrom) and node.module
                    and node.module.split(".")[0] == "gateway" and path != ROOT_MODULE):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.module}")
    assert found == []


@pytest.mark.parametrize(("names", "roles"), [
    (["commands"], {Role.COMMANDS}),
    (["scheduler"], {Role.SCHEDULER, Role.DISPATCHER}),
    (["reconciler"], {Role.RECONCILER, Role.WEBHOOKS}),
    (["projector"], {Role.PROJECTOR}),
    (list(SERVED), set(PLANE)),
])
def test_a_served_role_name_stands_for_its_roles(names: list[str], roles: set[Role]) -> None:
    assert served(names) == roles
    assert served(names, data_plane=False) == roles - DATA_PLANE


def test_each_role_connects_as_the_user_its_served_name_is() -> None:
    assert {r: r.user for name, roles in SERVED.items() for r in roles} == {
        r: name for name, roles in SERVED.items() for r in roles}
    assert {Role.GATEWAY.user, Role.LOG.user, Role.REPLAY.user} == {""}
