"""The node agent's collaborators are typed contracts: its runtime (agents.runtimes.contract.
Runtime, whose flags say what a runtime cannot do), its link (agents.link.Link) and the route
handlers' Context (workers.routes.Context, with its desks). Nothing in agents/ or workers/desks.py
asks one of them what it has (`getattr(self.runtime, "wait", None)` and the like): each member
is declared, and called as it is (mypy --strict checks the calls)."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from agents.link import Link
from agents.runtimes.contract import Runtime
from tests.probes import probes
from workers.routes import Context

ROOT = Path(__file__).resolve().parents[2]
CHECKED = sorted((ROOT / "agents").rglob("*.py")) + [ROOT / "workers" / "desks.py"]
# what a collaborator is called where it is used
TARGETS = ("runtime", "rt", "link", "ctx", "context")


def _members(proto: type) -> set[str]:
    return {n for n in vars(proto) if not n.startswith("_")} | set(
        getattr(proto, "__annotations__", {}))


MEMBERS = frozenset(_members(Runtime) | _members(Link) | _members(Context)) - {"name"}


def _of_target(text: str) -> bool:
    last = text.rsplit(".", 1)[-1]
    return last in TARGETS or last.endswith(tuple(f"_{t}" for t in TARGETS))


def _probes(source: str, where: str = "<string>") -> list[str]:
    """Each `getattr`/`hasattr` of a runtime, link or context, or of anything for one of
    their contracts' members, in `source`."""
    return probes(source, where, of_target=_of_target, members=MEMBERS)


def test_the_contracts_name_what_the_agent_used_to_probe_for() -> None:
    for name in ("wait", "read_output", "enter", "stdin", "network_egress", "binds_gpus",
                 "can_wait", "can_read_output", "can_enter"):
        assert name in MEMBERS, name
    assert {"files", "webhooks", "secrets"} <= MEMBERS


def test_the_probe_check_sees_the_probing_it_forbids() -> None:
    probing = """
files = getattr(link, "files", None)
wait = getattr(self.runtime, "wait", None)
ok = any(getattr(self.agent.runtime, n, None) is None for n in need)
desk = getattr(ctx, "webhooks", None)
pipes = hasattr(rt, "stdin")
read = getattr(thing, "read_output", None)
code = getattr(e, "code", "exec_failed")
proc = getattr(self, "proc", None)
bus = getattr(info, "busId", None)
"""
    assert len(_probes(probing)) == 6


def test_nothing_probes_the_agent_s_runtime_link_or_a_route_s_context() -> None:
    found = [probe for path in CHECKED
             for probe in _probes(path.read_text(), str(path.relative_to(ROOT)))]
    assert not found, ("declare the member on agents.runtimes.contract.Runtime, agents.link."
                       "Link or workers.routes.Context and call it:\n" + "\n".join(found))


@pytest.mark.parametrize("runtime", ["agents.runtimes.process:ProcessRuntime",
                                     "agents.runtimes.docker:DockerRuntime",
                                     "agents.simulate:SleepRuntime"])
def test_every_runtime_has_every_member_of_the_contract(runtime: str) -> None:
    """mypy checks the types where each is given to an Agent; here, that each has them all
    and takes the contract's arguments (a flag a runtime leaves out would be an AttributeError
    in the agent, not a quiet `cannot`)."""
    import importlib

    module, cls_name = runtime.split(":")
    cls = getattr(importlib.import_module(module), cls_name)
    for name in _members(Runtime) - {"stdin"}:  # stdin is set per instance (mypy checks it)
        assert hasattr(cls, name), (runtime, name)
        if name == "name" or name.startswith("can_"):
            assert isinstance(getattr(cls, name), bool if name != "name" else str), name
            continue
        want = inspect.signature(getattr(Runtime, name)).parameters
        got = inspect.signature(getattr(cls, name)).parameters
        assert [(p.name, p.kind) for p in got.values()] == [
            (p.name, p.kind) for p in want.values()], (runtime, name)
