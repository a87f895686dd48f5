"""`pool shares POOL` over an admin's HTTP context (`pool login URL --token ADMIN`): the gateway's
GET /v1/admin/pools/{pool}/shares asks the running scheduler as the NATS admin user does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bus.local.server import NatsServer
from gateway.app import create_app
from gateway.server import ServerThread
from gateway.tokens import TokenStore
from gateway.upstream import Settings
from tests.gateway_stack import Stack, stack_in_own_schema

ROOT = Path(__file__).resolve().parents[2]


def _pool(home: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    """The `pool` command as a new operator runs it: a fresh HOME, no POOL_* variables."""
    environ = {k: v for k, v in os.environ.items()
               if not k.startswith("POOL_") and k != "XDG_CONFIG_HOME"}
    environ.update(HOME=str(home), PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "cli.main", *argv], cwd=home, env=environ,
                          capture_output=True, text=True, timeout=90, check=False)


def _shares(home: Path, *argv: str) -> dict[str, Any]:
    """`pool shares p1 --json`, asked until the pool's leader answers with both tenants."""
    deadline = time.monotonic() + 30
    while True:
        done = _pool(home, "shares", "p1", "--json", *argv)
        reply: dict[str, Any] = json.loads(done.stdout) if done.stdout.strip() else {}
        result = reply.get("result") or {}
        ready = len(result.get("tenants") or []) == 2 and not result.get("stale")
        if ready or time.monotonic() > deadline:
            assert done.returncode == 0 and ready, (done.stdout, done.stderr)
            return reply
        time.sleep(0.2)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, database_url: str) -> Iterator[Stack]:
    with stack_in_own_schema(tmp_path_factory.mktemp("gwsh"), database_url,
                             "views_gwsh") as s:
        yield s


def test_an_admin_context_asks_for_shares_as_nats_does(stack: Stack, tmp_path: Path) -> None:
    home = tmp_path / "operator"
    home.mkdir()
    login = _pool(home, "login", stack.url, "--token", stack.tokens["admin"])
    assert login.returncode == 0, login.stderr
    over_http = _shares(home)
    over_nats = _shares(home, "--nats-url", stack.service_url)
    assert set(over_http) == set(over_nats) == {"ok", "result"}
    http, nats = over_http["result"], over_nats["result"]
    assert set(http) == set(nats) and http["pool_id"] == "p1"
    assert [set(t) for t in http["tenants"]] == [set(t) for t in nats["tenants"]]
    assert sorted(t["tenant"] for t in http["tenants"]) == ["alpha", "beta"]
    table = _pool(home, "shares", "p1")
    assert table.returncode == 0 and "RANK" in table.stdout, table.stderr
    nowhere = _pool(home, "shares", "nowhere")
    assert nowhere.returncode != 0 and "unknown_pool" in nowhere.stderr


def test_a_tenants_token_is_refused_the_shares(stack: Stack) -> None:
    with stack.client("alpha") as http:
        r = http.get("/v1/admin/pools/p1/shares")
    assert r.status_code == 403 and r.json()["code"] == "forbidden"


def test_with_no_scheduler_answering_the_cli_says_so_in_one_line(tmp_path: Path) -> None:
    # a gateway on a bus nothing serves: no scheduler answers `pool.ops.pool.shares`
    server = NatsServer(store_dir=tmp_path / "nats", server_name="pool-gwsh")
    server.start()
    try:
        store = TokenStore(tmp_path / "http-tokens.json")
        http = ServerThread(create_app(Settings(server.url, timeout=2.0), store),
                            port=0).start()
        try:
            home = tmp_path / "operator"
            home.mkdir()
            login = _pool(home, "login", http.url, "--token", store.issue_admin())
            assert login.returncode == 0, login.stderr
            done = _pool(home, "shares", "p1")
            assert done.returncode == 1, done.stderr
            assert "scheduler_unavailable" in done.stderr
            assert len(done.stderr.strip().splitlines()) == 1
            done = _pool(home, "shares", "p1", "--json")
            assert json.loads(done.stdout)["error"]["code"] == "scheduler_unavailable"
        finally:
            http.stop()
    finally:
        server.stop()
