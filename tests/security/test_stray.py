"""A message without the recorder's headers on a log subject (a misconfigured deployment that
lets one through) is skipped by every reader and reported; nothing stops."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import nats
import pytest

from bus.jetstream.strays import strays
from bus.local.server import NatsServer
from client.api import PoolClient
from domain.account import Account
from projections.audit import audit_credits
from tests.control_plane import setup_pool
from workers.application import PoolApp
from workers.plane import ControlPlane, app_env

STRAY = b'{"ok": true, "lease": {"lease_id": "l1"}}'


@pytest.fixture()
def plane(fresh_nats: NatsServer) -> Iterator[PoolClient]:
    cp = ControlPlane(fresh_nats.url, roles=["commands"], data_plane=False).start()
    admin = PoolClient(fresh_nats.url)
    setup_pool(admin)
    yield admin
    admin.close()
    cp.stop()


async def _publish_stray(url: str, subject: str) -> int:
    nc = await nats.connect(url)
    ack = await nc.jetstream().publish(subject, STRAY)  # a reply envelope, no headers at all
    await nc.close()
    return int(ack.seq)


def test_a_stray_message_on_an_accounts_subject_stops_no_grant_and_no_reader(
    plane: PoolClient, fresh_nats: NatsServer,
) -> None:
    admin = plane
    app = PoolApp(env=app_env(fresh_nats.url))
    try:
        subject = app.recorder.subject_for(Account.create_id("alpha"))  # type: ignore[attr-defined]
        seq = asyncio.run(_publish_stray(fresh_nats.url, subject))
        before = strays().count
        # the account is loaded through its subject: the stray is passed over, the next write
        # expects the subject's true end
        got = admin.admin("credits.grant", {"tenant": "alpha", "amount_microcredits": 5,
                                            "transfer_id": "after-stray"})
        assert got["ok"], got
        # the log's readers: direct gets, the bulk reader's pages, the read-ahead
        direct = app.recorder.select_notifications(1, 10_000)  # type: ignore[attr-defined]
        pages = [r for page in app.recorder.read_records(1) for r in page]  # type: ignore[attr-defined]
        ahead = app.recorder.prefetch(1, 10_000).result(30)  # type: ignore[attr-defined]
        report = audit_credits(app)  # the credit audit replays the log and names it
    finally:
        app.close()
    assert seq not in [n.id for n in direct]
    assert seq not in [r[0] for r in pages]
    assert seq not in [n.id for n in ahead]
    assert [n.id for n in direct] == [r[0] for r in pages] == [n.id for n in ahead]
    assert strays().count > before
    assert (seq, subject) in strays().seen
    assert report.ok and (seq, subject) in report.strays
    assert any(f"sequence {seq}" in line for line in report.lines())


def test_pool_projections_status_names_the_stray_by_sequence(
    plane: PoolClient, fresh_nats: NatsServer, database_url: str, schema: str,
) -> None:
    import json
    import os
    import subprocess
    import sys

    app = PoolApp(env=app_env(fresh_nats.url))
    try:
        subject = app.recorder.subject_for(Account.create_id("alpha"))  # type: ignore[attr-defined]
    finally:
        app.close()
    seq = asyncio.run(_publish_stray(fresh_nats.url, subject))
    assert plane.admin("credits.grant", {"tenant": "alpha", "amount_microcredits": 5,
                                         "transfer_id": "after-status-stray"})["ok"]
    r = subprocess.run([sys.executable, "-m", "cli.main", "projections", "status", "--json",
                        "--nats-url", fresh_nats.url, "--database-url", database_url,
                        "--schema", schema], capture_output=True, text=True, check=False,
                       timeout=120, env={**os.environ, "POOL_HOME": str(fresh_nats.store_dir)})
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["result"]["strays"] == [{"seq": seq, "subject": subject}]
    plain = subprocess.run([sys.executable, "-m", "cli.main", "projections", "status",
                            "--nats-url", fresh_nats.url, "--database-url", database_url,
                            "--schema", schema], capture_output=True, text=True, check=False,
                           timeout=120)
    assert f"sequence {seq} on {subject!r}" in plain.stdout, plain.stdout
