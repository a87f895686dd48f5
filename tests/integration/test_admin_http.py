"""The operator's commands over an admin's HTTP context (`pool login URL --token ADMIN`): `pool
admin …` through the gateway's /v1/admin routes, with the replies NATS gives, and no NATS
password; a tenant's context never carries them."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from client.http import HttpClient
from tests.gateway_stack import Stack, stack_in_own_schema
from tests.integration.test_shares_http import _pool


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, database_url: str) -> Iterator[Stack]:
    with stack_in_own_schema(tmp_path_factory.mktemp("gwadm"), database_url,
                             "views_gwadm") as s:
        yield s


def _login(home: Path, stack: Stack, who: str) -> Path:
    home.mkdir()
    done = _pool(home, "login", stack.url, "--token", stack.tokens[who])
    assert done.returncode == 0, done.stderr
    return home


def _json(home: Path, *argv: str) -> dict[str, Any]:
    done = _pool(home, *argv, "--json")
    assert done.returncode == 0, (argv, done.stdout, done.stderr)
    reply: dict[str, Any] = json.loads(done.stdout)
    return reply


def _both(home: Path, stack: Stack, *argv: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The command's reply over the admin context, and over the plane's NATS."""
    return _json(home, *argv), _json(home, *argv, "--nats-url", stack.service_url)


def test_an_admin_context_runs_the_operators_commands_as_nats_does(stack: Stack,
                                                                   tmp_path: Path) -> None:
    home = _login(tmp_path / "operator", stack, "admin")
    http = _json(home, "admin", "pool", "create", "p-http", "--packing", "spread")
    nats = _json(home, "admin", "pool", "create", "p-nats", "--packing", "spread",
                 "--nats-url", stack.service_url)
    # over NATS the envelope also spells out its empty fields (lease, error: null)
    assert http["ok"] is nats["ok"] is True and set(http) == {"ok", "result"}
    assert set(http["result"]) == set(nats["result"])
    for pool in ("p-http", "p-nats"):
        set_ = _json(home, "admin", "pool", "set", pool, "--commit-timeout", "45")
        assert set_["ok"], set_
    http, nats = _both(home, stack, "admin", "pool", "show", "p-http")
    assert http["result"] == nats["result"]
    assert http["result"]["config"]["commit_timeout_seconds"] == 45
    assert http["result"]["config"]["packing"] == "spread"
    http, nats = _both(home, stack, "admin", "tenant", "set", "gamma", "--pool", "p-http",
                       "--weight", "2")
    assert http["ok"] and nats["ok"] and set(http["result"]) == set(nats["result"])
    shown = _json(home, "admin", "pool", "show", "p-http")["result"]
    assert "gamma" in json.dumps(shown)
    # a node's verb goes in the URL; a refusal reads as it does over NATS
    assert _json(home, "node", "cordon", "n2", "--reason", "disk")["ok"]
    assert _json(home, "node", "uncordon", "n2")["ok"]
    done = _pool(home, "admin", "pool", "show", "nowhere")
    assert done.returncode == 1 and "unknown_pool" in done.stderr, done.stderr


def test_a_tenants_context_does_not_carry_an_operators_command(stack: Stack,
                                                               tmp_path: Path) -> None:
    home = _login(tmp_path / "alpha", stack, "alpha")
    # no `pool up` here, and a tenant's token cannot administer: the command wants NATS
    done = _pool(home, "admin", "pool", "show", "p1")
    assert done.returncode == 2 and "no NATS server" in done.stderr, done.stderr
    assert _json(home, "admin", "pool", "show", "p1", "--nats-url", stack.service_url)["ok"]
    with stack.client("alpha") as http:  # and the gateway refuses its token anyway
        assert http.get("/v1/admin/pools/p1").status_code == 403


def test_what_the_gateway_does_not_serve_is_not_over_http_in_one_line(stack: Stack,
                                                                      tmp_path: Path) -> None:
    home = _login(tmp_path / "operator", stack, "admin")
    done = _pool(home, "admin", "reservation", "list", "--pool", "p1", "--all")
    assert done.returncode == 1 and "not_over_http" in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    listed = _json(home, "admin", "reservation", "list", "--pool", "p1")
    assert listed["ok"], listed
    with HttpClient(stack.url, stack.tokens["admin"]) as c:
        reply = c.admin("pool.teleport", {"pool_id": "p1"})
    assert reply["error"]["code"] == "not_over_http" and "pool.teleport" in \
        reply["error"]["message"]
