"""Snapshots: every role that saves accounts, nodes or pools may write and read their snapshots;
tenants, nodes and the read-only roles may not write them."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from typing import Any

import nats
import pytest

from bus.local.auth import PERMISSIONS, AuthConfig, url_with_credentials
from bus.local.server import NatsServer
from bus.subjects import EVENTS_STREAM, event_subject
from control.application.core import APPLICATION_NAME

SNAPSHOT = event_subject(f"{APPLICATION_NAME}_snapshots", str(uuid.uuid4()))
# the latest snapshot is one direct get by subject
LAST_SNAPSHOT = f"$JS.API.DIRECT.GET.{EVENTS_STREAM}.{SNAPSHOT}"
SAVERS = ("commands", "scheduler", "reconciler")


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
        if role in SAVERS:
            assert _allows(publish, SNAPSHOT), role
            assert _allows(publish, LAST_SNAPSHOT), role
        elif role != "operator":
            assert not _allows(publish, SNAPSHOT), role


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
