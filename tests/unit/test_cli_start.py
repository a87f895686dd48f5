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


# what `pool lease run` over NATS does without (client.lean speaks core NATS itself): nats-py
# (its JetStream API) and asyncio, OpenTelemetry with no exporter set, the wire schemas and the
# domain they use, the feed follower and the client they make up; a contexts file's parser
LEAN_RUN_SPARES = ("nats", "asyncio", "opentelemetry", "msgspec", "schemas", "domain",
                   "bus.feed", "bus.leasewatch", "bus.service", "bus.runtime",
                   "bus.observability", "client.api", "tomllib", "secrets")
# the modules the run path loads as it goes, beside `pool lease run`'s own
LEAN_RUN_MODULES = "import cli.run, client.lean, local.embedded, client.contexts, cli.connect"


def _imported_by(argv: list[str], then: str = "") -> list[str]:
    """The modules a fresh Python has loaded after `pool ARGV` returned (and `then` ran)."""
    code = ("import json, sys\nfrom cli.main import main\nmain(sys.argv[1:])\n" + then + "\n"
            "sys.stderr.write('\\nMODULES ' + json.dumps(sorted(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code, *argv], cwd=ROOT, capture_output=True,
                         text=True, timeout=60, check=False)
    assert "MODULES " in out.stderr, out.stderr
    modules: list[str] = json.loads(out.stderr.rsplit("MODULES ", 1)[1])
    return modules


def _heavy(modules: list[str], heavy: tuple[str, ...] = HEAVY) -> list[str]:
    return [m for m in modules if any(m == h or m.startswith(h + ".") for h in heavy)]


@pytest.mark.parametrize("argv", [["--help"], ["lease", "get", "--help"],
                                  ["lease", "run", "--help"], ["lease", "request", "--help"],
                                  ["leases", "--help"], ["balance", "--help"]])
def test_a_tenant_s_help_imports_nothing_of_the_scheduler(argv: list[str]) -> None:
    assert _heavy(_imported_by(argv)) == []


def test_lease_run_over_nats_loads_neither_nats_py_nor_the_schemas() -> None:
    # `lease run` up to its job (none given: a usage error, after the command's set-up), then
    # every module its lean path speaks through: none of what it spares
    modules = _imported_by(["lease", "run", "--tenant", "t", "--pool", "p"],
                           then=LEAN_RUN_MODULES)
    assert "client.lean" in modules
    assert _heavy(modules, LEAN_RUN_SPARES) == []
    assert _heavy(_imported_by(["lease", "run", "--help"]), LEAN_RUN_SPARES) == []


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


def _parser_of(parser: argparse.ArgumentParser, *words: str) -> argparse.ArgumentParser:
    for word in words:
        parser = _commands(parser).choices[word]
    return parser


def test_lease_run_parses_alike_from_its_own_parser_alone() -> None:
    line = ["lease", "run", "--tenant", "t", "--pool", "p", "--cpu-millis", "250", "--env",
            "A=1", "--workdir", ".", "--json"]
    own, whole = build_parser(line), build_parser()
    # `lease run` builds no other verb's parser (they cost as much as the rest of the parse)
    assert list(_commands(_parser_of(own, "lease")).choices) == ["run"]
    assert _parser_of(own, "lease", "run").format_help() == \
        _parser_of(whole, "lease", "run").format_help()
    parsed = [{k: v for k, v in vars(p.parse_args(line)).items() if k != "root_parser"}
              for p in (own, whole)]
    assert parsed[0] == parsed[1]
    # a verb after a flag, or none: every verb, as `pool lease --help` lists them
    assert "get" in _commands(_parser_of(build_parser(["lease", "--help", "run"]),
                                         "lease")).choices


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
