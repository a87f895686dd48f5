"""The AST check the contract tests share: `getattr`/`hasattr` calls that probe a
collaborator (by the name it goes by) or ask for one of its contract's members."""

from __future__ import annotations

import ast
from collections.abc import Callable, Collection


def probes(source: str, where: str, *, of_target: Callable[[str], bool],
           members: Collection[str]) -> list[str]:
    """Each `getattr`/`hasattr` in `source` whose object's text `of_target` accepts, or whose
    name is a constant in `members`, as `where:line: call`."""
    out = []
    for node in ast.walk(ast.parse(source, where)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr") and len(node.args) >= 2):
            continue
        target, name = node.args[0], node.args[1]
        of_member = isinstance(name, ast.Constant) and name.value in members
        if of_target(ast.unparse(target).lower()) or of_member:
            out.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
    return out
