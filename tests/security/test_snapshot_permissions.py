"""Snapshots: every role that saves accounts, nodes or pools may write and read their snapshots;
the projector and the admin CLI only read them; tenants and nodes may do neither."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from typing import Any

import nats
import pytest

from bus.admin import ensure_all_streams
from bus.local.auth import PERMISSIONS, AuthConfig, inbox_prefix, role_inbox, url_with_credentials
from bus.local.server import NatsServer
from bus.replies import NODE_INBOXES
from bus.runtime import close_runtime
from bus.streams import snapshot_stream_config
from bus.subjects import SNAPSHOTS_STREAM, snapshot_subject
from domain.account import Account
from workers.application.core import APPLICATION_NAME, Store
from workers.bootstrap import app_env

SNAPSHOT = snapshot_subject(APPLICATION_NAME, str(uuid.uuid4()))
# the latest snapshot is one direct get by subject (the leader's own get on a replicated stream)
LAST_SNAPSHOT = f"$JS.API.DIRECT.GET.{SNAPSHOTS_STREAM}.{SNAPSHOT}"
LEADER_GET = f"$JS.API.STREAM.MSG.GET.{SNAPSHOTS_STREAM}"
SAVERS = ("commands", "scheduler", "reconciler")
READERS = (*SAVERS, "projector", "admin")


def _allows(patterns: tuple[str, ...] | None, subject: str) -> bool:
    if patterns is None:
        return True
    tokens = subject.split(".")
    for pattern in patterns:
        want = pattern.split(".")
        for i, w in enumerate(want):
            if w == ">":
                if len(tokens) > i:
                    return True
                break
            if i >= len(tokens) or (w != "*" and w != tokens[i]):
                break
        else:
            if len(want) == len(tokens):
                return True
    return False


def test_the_table_lets_exactly_the_saving_roles_write_snapshots() -> None:
    for role, rule in PERMISSIONS.items():
        publish = tuple(p.replace("{name}", "alpha") for p in rule.publish or ()) \
            if rule.publish is not None else None
        subscribe = tuple(p.replace("{name}", "alpha") for p in rule.subscribe or ()) \
            if rule.subscribe is not None else None
        if role == "operator":
            continue
        assert _allows(publish, SNAPSHOT) == (role in SAVERS), role
        for read in (LAST_SNAPSHOT, LEADER_GET):
            assert _allows(publish, read) == (role in READERS), (role, read)
        if role not in READERS:
            assert not _allows(subscribe, SNAPSHOT), role


async def _publish_as(url: str, user: str, password: str, subject: str,
                      watch_url: str) -> dict[str, Any]:
    errors: list[str] = []

    async def on_error(e: Exception) -> None:
        errors.append(str(e))

    watcher = await nats.connect(watch_url)
    landed: list[str] = []

    async def seen(msg: Any) -> None:
        landed.append(msg.subject)

    await watcher.subscribe(subject, cb=seen)
    await watcher.flush()
    nc = await nats.connect(url, user=user, password=password, error_cb=on_error,
                            max_reconnect_attempts=0)
    await nc.publish(subject, b"{}")
    await nc.flush()
    await asyncio.sleep(0.3)
    for conn in (nc, watcher):
        await conn.close()
    return {"landed": len(landed),
            "refused": sum("permissions violation" in e.lower() for e in errors)}


@pytest.mark.parametrize("who", [*SAVERS, "projector", "admin", "tenant", "node"])
def test_the_server_lets_only_the_saving_roles_write_a_snapshot(tmp_path: Path,
                                                                 who: str) -> None:
    auth = AuthConfig()
    tenant = auth.add_tenant("alpha")
    node = auth.add_node("n1")
    server = NatsServer(store_dir=tmp_path / "nats", server_name="pool-snap",
                        extra_config=auth.render()).start()
    try:
        creds = {"tenant": tenant, "node": node}.get(who) or auth.roles[who]
        out = asyncio.run(_publish_as(server.url, creds.user, creds.password, SNAPSHOT,
                                      url_with_credentials(server.url, auth.service)))
    finally:
        server.stop()
    assert out == ({"landed": 1, "refused": 0} if who in SAVERS
                   else {"landed": 0, "refused": 1})


async def _read_as(url: str, user: str, password: str, inbox: str,
                   service_url: str) -> dict[str, Any]:
    """A snapshot stored by the service user, then read as `user`: by a direct get, the
    leader's get and a subscription to every snapshot subject."""
    svc = await nats.connect(service_url)
    js = svc.jetstream()
    await js.add_stream(snapshot_stream_config())
    await js.publish(SNAPSHOT, b"snap")
    errors: list[str] = []

    async def on_error(e: Exception) -> None:
        errors.append(str(e))

    nc = await nats.connect(url, user=user, password=password, error_cb=on_error,
                            max_reconnect_attempts=0, inbox_prefix=inbox)
    got: list[bytes] = []
    for subject, body in ((LAST_SNAPSHOT, b""), (LEADER_GET, b'{"seq": 1}')):
        try:
            reply = await nc.request(subject, body, timeout=1)
            got.append(reply.data)
        except Exception:  # noqa: BLE001, S112 - refused: no reply comes back
            continue
    heard: list[bytes] = []

    async def seen(msg: Any) -> None:
        heard.append(msg.data)

    await nc.subscribe(f"{SNAPSHOT.split('.')[0]}.snap.>", cb=seen)
    await nc.flush()
    await svc.publish(SNAPSHOT, b"again")
    await svc.flush()
    await asyncio.sleep(0.3)
    for conn in (nc, svc):
        await conn.close()
    return {"read": sum(b"snap" in g for g in got), "heard": len(heard),
            "refused": sum("permissions violation" in e.lower() for e in errors)}


@pytest.mark.parametrize("who", [*READERS, "tenant", "node"])
def test_the_server_lets_only_the_roles_read_a_snapshot(tmp_path: Path, who: str) -> None:
    auth = AuthConfig()
    tenant = auth.add_tenant("alpha")
    node = auth.add_node("n1")
    server = NatsServer(store_dir=tmp_path / "nats", server_name="pool-snap",
                        extra_config=auth.render()).start()
    try:
        creds = {"tenant": tenant, "node": node}.get(who) or auth.roles[who]
        inbox = {"tenant": inbox_prefix("alpha"),
                 "node": f"{NODE_INBOXES}.n1"}.get(who) or role_inbox(who)
        out = asyncio.run(_read_as(server.url, creds.user, creds.password, inbox,
                                   url_with_credentials(server.url, auth.service)))
    finally:
        server.stop()
    if who in READERS:
        assert out["read"] == 2
    else:  # both gets and the subscription refused, nothing read or heard
        assert out == {"read": 0, "heard": 0, "refused": 3}


def test_a_saving_role_takes_a_snapshot_and_a_reading_role_loads_through_it(
        secured: tuple[NatsServer, AuthConfig]) -> None:
    server, auth = secured
    ensure_all_streams(url_with_credentials(server.url, auth.service))  # as `pool up` does
    urls = {r: url_with_credentials(server.url, auth.roles[r]) for r in ("commands", "projector")}
    apps: list[Store] = []
    try:
        saver = Store(env=app_env(urls["commands"], POOL_SNAPSHOT_INTERVAL="5"))
        apps.append(saver)
        acc = Account.open(tenant_id="t", now=1.0)  # type: ignore[arg-type]
        for i in range(12):
            acc.grant(f"g{i}", 5, now=float(i))
        saver.save(acc)
        assert saver.snapshotting.wait() and saver.snapshotting.taken == 1
        reader = Store(env=app_env(urls["projector"]))
        apps.append(reader)
        snaps = list(reader.snapshots.get(acc.id, desc=True, limit=1))  # type: ignore[union-attr]
        assert [s.originator_version for s in snaps] == [acc.version]
        loaded = reader.repository.get(acc.id)
        assert loaded.version == acc.version and loaded.balance == acc.balance
    finally:
        for app in apps:
            app.close()
        for url in urls.values():
            close_runtime(url)
