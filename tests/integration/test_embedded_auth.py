"""`pool up` is secure by default: a user per tenant and node, a service user for the plane.

Everything goes through the real CLI and the embedded nats-server, as an operator would use it.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import nats
import pytest


def _env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("POOL_")}
    env.update(POOL_HOME=str(home), POOL_NATS_PORT="0")
    return env


def _up(home: Path) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "cli.main", "up", "--no-postgres", "--json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(home),
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line, proc.stderr.read() if proc.stderr else "no output"
    return proc, json.loads(line)


def _down(proc: subprocess.Popen[str]) -> None:
    proc.send_signal(signal.SIGINT)
    assert proc.wait(30) == 0


def _pool(home: Path, *args: str) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-m", "cli.main", *args, "--json"],
                         capture_output=True, text=True, env=_env(home), timeout=60,
                         check=False)
    reply: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1]) if out.stdout else {}
    reply["_rc"] = out.returncode
    reply["_stderr"] = out.stderr
    return reply


def _request(home: Path, tenant: str, key: str) -> dict[str, Any]:
    return _pool(home, "lease", "request", "--tenant", tenant, "--pool", "p1", "--cpu-millis",
                 "100", "--memory-mib", "64", "--max-runtime", "60", "--key", key)


async def _quiet(_e: Exception) -> None:
    pass


async def _refused_without_user(url: str) -> str:
    try:
        nc = await nats.connect(url, connect_timeout=2, allow_reconnect=False,
                                max_reconnect_attempts=0, error_cb=_quiet)
    except Exception as e:  # noqa: BLE001 - the refusal is what we look for
        return str(e)
    await nc.close()
    return ""


async def _alpha_crosses_into_beta(url: str, alpha: dict[str, Any], beta_lease: str,
                                   beta_creds: dict[str, Any]) -> dict[str, Any]:
    errors: list[str] = []

    async def on_error(e: Exception) -> None:
        errors.append(str(e))

    nc = await nats.connect(url, user=alpha["user"], password=alpha["password"],
                            inbox_prefix=alpha["inbox_prefix"].encode(), error_cb=on_error,
                            allow_reconnect=False)
    out: dict[str, Any] = {}
    # its own subject answers
    own = await nc.request("pool.cmd.alpha.lease.request", b"{}", timeout=5)
    out["own"] = json.loads(own.data)
    # beta's subject: the server drops the publish, so nothing answers
    try:
        await nc.request(f"pool.cmd.beta.lease.{beta_lease}.get", b"{}", timeout=1.5)
        out["cross"] = "answered"
    except Exception as e:  # noqa: BLE001 - timeout (or no responders) is the point
        out["cross"] = type(e).__name__
    # beta's replies: the subscription is refused, so beta's answer never reaches alpha
    snooped: list[bytes] = []

    async def snoop(msg: Any) -> None:
        snooped.append(msg.data)

    await nc.subscribe(f"{beta_creds['inbox_prefix']}.>", cb=snoop)
    await nc.flush()
    beta = await nats.connect(url, user=beta_creds["user"], password=beta_creds["password"],
                              inbox_prefix=beta_creds["inbox_prefix"].encode(),
                              allow_reconnect=False)
    got = await beta.request(f"pool.cmd.beta.lease.{beta_lease}.get", b"{}", timeout=5)
    out["beta_ok"] = json.loads(got.data)["ok"]
    await asyncio.sleep(0.3)
    await beta.close()
    await nc.close()
    out["snooped"] = snooped
    out["errors"] = errors
    return out


@pytest.mark.timeout(240)
def test_pool_up_pins_each_tenant_to_its_own_subjects(tmp_path: Path) -> None:
    home = tmp_path / "home"
    proc, info = _up(home)
    try:
        assert info["auth"] is True
        url = str(info["nats_url"])
        for name in ("auth.json", "endpoints.json"):
            assert stat.S_IMODE((home / name).stat().st_mode) == 0o600, name
        endpoints = json.loads((home / "endpoints.json").read_text())
        assert endpoints["service_url"].startswith("nats://pool-service:")

        # the operator sets up a pool and two tenants through the CLI (as the service user)
        assert _pool(home, "admin", "pool", "create", "p1")["ok"]
        for t in ("alpha", "beta"):
            r = _pool(home, "admin", "tenant", "set", t, "--pool", "p1")
            assert r["ok"], r
        auth = json.loads((home / "auth.json").read_text())
        assert set(auth["tenants"]) == {"alpha", "beta"}
        creds = {t: _pool(home, "admin", "tenant", "creds", t)["result"] for t in ("alpha", "beta")}
        assert creds["alpha"]["user"] == "tenant-alpha"
        assert creds["alpha"]["inbox_prefix"] == "_INBOX.t.alpha"

        # alpha requests a lease through the CLI, which connects as alpha's user
        lease = _request(home, "alpha", "k-alpha")
        assert lease["ok"] and lease["lease"]["tenant"] == "alpha", lease
        beta_lease = _request(home, "beta", "k-beta")["lease"]["lease_id"]
        # a tenant without a user in this pool is told how to get one
        missing = _request(home, "gamma", "k-gamma")
        assert missing["_rc"] == 2 and "tenant creds gamma" in missing["_stderr"]

        # no user, no connection
        assert "authorization violation" in asyncio.run(_refused_without_user(url)).lower()

        # alpha's user cannot act as beta nor read beta's replies
        out = asyncio.run(_alpha_crosses_into_beta(url, creds["alpha"], beta_lease, creds["beta"]))
        assert "ok" in out["own"]  # its own subject reached the service
        assert out["cross"] in ("TimeoutError", "NoRespondersError"), out
        assert out["beta_ok"] is True
        assert out["snooped"] == []
        assert sum("permissions violation" in e.lower() for e in out["errors"]) >= 2, out

        # a node agent's user is limited to that node's subjects
        node = _pool(home, "admin", "node", "creds", "n1")["result"]
        assert node["user"] == "node-n1"
        assert not asyncio.run(_refused_without_user(url.replace(
            "nats://", f"nats://{node['user']}:{node['password']}@")))
    finally:
        _down(proc)

    # the data and the users survive a restart
    service_password = auth["service"]["password"]
    proc, info = _up(home)
    try:
        assert json.loads((home / "auth.json").read_text())["service"]["password"] == service_password
        got = _pool(home, "lease", "get", lease["lease"]["lease_id"], "--tenant", "alpha")
        assert got["ok"] and got["lease"]["tenant"] == "alpha", got
        again = _request(home, "alpha", "k-alpha")  # same idempotency key: the same lease
        assert again["ok"] and again["lease"]["lease_id"] == lease["lease"]["lease_id"], again
        other = _pool(home, "lease", "get", beta_lease, "--tenant", "alpha")
        assert not other["ok"]  # alpha's subject names alpha: beta's lease is not found there
    finally:
        _down(proc)


def test_a_user_added_while_pool_up_runs_is_loaded_by_one_reload_only(tmp_path: Path) -> None:
    """nats-server drops every connection still in its handshake at a reload ("Authorization
    Violation"), so `pool up` must not reload again what the creds command already loaded."""
    from bus.admin import can_connect
    from bus.local import auth as bus_auth
    from local import embedded

    home = tmp_path / "home"
    old = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("POOL_")}
    os.environ["POOL_NATS_PORT"] = "0"
    emb = embedded.start(home, with_postgres=False)
    try:
        emb.write_endpoints()
        creds = embedded.add_tenant("alpha", home)
        assert can_connect(emb.nats_url, user=creds.user, password=creds.password)
        assert emb.reload_if_changed() is False  # the same users: no second reload

        # auth.json edited by other means (no include rendered): the next look applies it
        auth = bus_auth.load(home / embedded.AUTH_FILE)
        assert auth is not None
        beta = auth.add_tenant("beta")
        bus_auth.save(auth, home / embedded.AUTH_FILE)
        assert emb.reload_if_changed() is True
        deadline = 50
        while not can_connect(emb.nats_url, user=beta.user, password=beta.password) and deadline:
            deadline -= 1
        assert deadline, "beta's user was never loaded"
        assert emb.reload_if_changed() is False  # nothing changed since
    finally:
        emb.stop()
        os.environ.pop("POOL_NATS_PORT", None)
        os.environ.update(old)


async def _user_connections(url: str, creds: dict[str, Any], n: int) -> list[bool]:
    conns: list[Any] = []
    for _ in range(n):
        try:
            conns.append(await nats.connect(url, user=creds["user"], password=creds["password"],
                                            allow_reconnect=False, max_reconnect_attempts=0,
                                            error_cb=_quiet))
        except nats.errors.Error as e:  # the server's own refusal: the account is at its cap
            assert "maximum account active connections exceeded" in str(e)
            conns.append(None)
        await asyncio.sleep(0.2)  # the guard hears each before the next
    for _ in range(100):
        if conns[-1] is None or conns[-1].is_closed:
            break
        await asyncio.sleep(0.05)
    closed = [c is None or c.is_closed for c in conns]
    for c in conns:
        if c is not None:
            await c.close()
    return closed


def test_pool_up_holds_a_tenant_and_a_node_to_their_connection_caps(tmp_path: Path) -> None:
    """The caps are `pool up`'s settings, shown at its start: the tenant's (and the node's)
    account refuses the connection past it (or, should one get through, the guard closes it)
    while its others stay."""
    home = tmp_path / "pool"
    proc = subprocess.Popen([sys.executable, "-m", "cli.main", "up", "--no-postgres",
                             "--no-workers", "--json"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env=_env(home) | {"POOL_TENANT_MAX_CONNECTIONS": "3",
                                              "POOL_NODE_MAX_CONNECTIONS": "2"})
    try:
        assert proc.stdout is not None
        info = json.loads(proc.stdout.readline())
        assert info["tenant_caps"] == {"max_connections": 3, "max_subscriptions": 4096}
        assert info["node_caps"] == {"max_connections": 2, "max_subscriptions": 2048}
        alpha = _pool(home, "admin", "tenant", "creds", "alpha")["result"]
        closed = asyncio.run(_user_connections(info["nats_url"], alpha, 4))
        assert closed == [False, False, False, True]
        # added after the start, by a CLI without the setting: the caps `pool up` keeps
        n1 = _pool(home, "admin", "node", "creds", "n1")["result"]
        assert asyncio.run(_user_connections(info["nats_url"], n1, 3)) == [False, False, True]
    finally:
        _down(proc)


@pytest.mark.parametrize("name", ["POOL_NODE_MAX_CONNECTIONS", "POOL_NODE_MAX_SUBSCRIPTIONS"])
def test_pool_up_refuses_a_bad_node_cap_before_it_starts(tmp_path: Path, name: str) -> None:
    out = subprocess.run([sys.executable, "-m", "cli.main", "up", "--no-postgres",
                          "--no-workers", "--json", "--exit-when-ready"], capture_output=True,
                         text=True, env=_env(tmp_path / "pool") | {name: "0"}, timeout=60,
                         check=False)
    assert out.returncode != 0
    error = json.loads(out.stdout.strip().splitlines()[-1])["error"]
    assert error["code"] == "invalid_limit" and name in error["message"], out.stdout
    assert not (tmp_path / "pool" / "endpoints.json").exists()
