"""`pool` starts fast: a command imports its own module only, and a tenant's command none of the
scheduler's (numpy, eventsourcing, the domain's policy), each checked in a fresh Python."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from cli.main import COMMANDS, build_parser

ROOT = Path(__file__).resolve().parents[2]
# what parsing a flag never needs, the scheduler's (numpy, eventsourcing, the domain's policy)
# first: a `pool … --help` that loads one of them starts slowly
HEAVY = ("numpy", "eventsourcing", "workers", "domain", "schemas", "nats", "msgspec", "psycopg",
         "projections.postgres", "projections.views", "opentelemetry", "litestar", "docker")


def _imported_by(argv: list[str]) -> list[str]:
    """The modules a fresh Python has loaded after `pool ARGV` returned."""
    code = ("import json, sys\nfrom cli.main import main\nmain(sys.argv[1:])\n"
            "sys.stderr.write('\\nMODULES ' + json.dumps(sorted(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code, *argv], cwd=ROOT, capture_output=True,
                         text=True, timeout=60, check=False)
    assert "MODULES " in out.stderr, out.stderr
    modules: list[str] = json.loads(out.stderr.rsplit("MODULES ", 1)[1])
    return modules


def _heavy(modules: list[str]) -> list[str]:
    return [m for m in modules if any(m == h or m.startswith(h + ".") for h in HEAVY)]


@pytest.mark.parametrize("argv", [["--help"], ["lease", "get", "--help"],
                                  ["lease", "run", "--help"], ["lease", "request", "--help"],
                                  ["leases", "--help"], ["balance", "--help"]])
def test_a_tenant_s_help_imports_nothing_of_the_scheduler(argv: list[str]) -> None:
    assert _heavy(_imported_by(argv)) == []


def test_pool_help_imports_no_command_s_module() -> None:
    modules = _imported_by(["--help"])
    assert [m for m in modules if m.startswith("cli.") and m not in ("cli.main", "cli.output")] \
        == []


def _commands(parser: argparse.ArgumentParser) -> Any:
    """The `COMMAND` action of `pool`'s parser: its choices and their help lines."""
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))


def test_the_command_table_is_what_the_modules_add() -> None:
    listed = [(a.dest, a.help) for a in _commands(build_parser())._choices_actions]
    assert listed == [(name, help_text) for name, _, help_text in COMMANDS]


def test_a_command_parses_alike_from_the_whole_parser_and_its_own() -> None:
    whole = build_parser()
    for name, _, _ in COMMANDS:
        own = build_parser([name])
        assert own.format_help() == whole.format_help()
        assert _commands(own).choices[name].format_help() == \
            _commands(whole).choices[name].format_help(), name


def test_the_lease_flags_offer_the_domain_s_words_and_limits() -> None:
    from cli import lease
    from domain.gang import MAX_GANG_MEMBERS
    from domain.policy.gang import STRATEGIES, TOPOLOGY_KEYS
    from schemas.v1 import MAX_LEASES_PER_REQUEST

    assert (lease.MAX_GANG_MEMBERS, lease.STRATEGIES, lease.TOPOLOGY_KEYS,
            lease.MAX_LEASES_PER_REQUEST) == (MAX_GANG_MEMBERS, STRATEGIES, TOPOLOGY_KEYS,
                                              MAX_LEASES_PER_REQUEST)


def test_the_workflow_flags_offer_the_domain_s_words() -> None:
    from cli import workflow
    from domain.dependency import DEPENDENCY_CONDITIONS
    from domain.retry import RETRY_REASONS

    assert workflow.RETRY_REASONS == RETRY_REASONS
    assert workflow.DEPENDENCY_CONDITIONS == DEPENDENCY_CONDITIONS
