"""`pool audit credits` from a checkpoint: reads only the new events, agrees with a full replay,
and a tampered event before the checkpoint is caught."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nats
import pytest
from nats.js.errors import NotFoundError

from bus.local.server import NatsServer
from bus.subjects import EVENTS_STREAM
from client.api import PoolClient
from domain.account import Account
from domain.resources import LeaseId
from projections import audit_checkpoint as ac
from projections.audit import CreditAudit
from projections.errors import CheckpointInvalid
from tests.control_plane import FakeClock, lease_body, node_body, setup_pool, start
from workers.plane import ControlPlane

JOB = {"job": {"image": "busybox@sha256:" + "a" * 64, "command": ["true"]}}
GRANT = 10**9


@pytest.fixture()
def plane(fresh_nats: NatsServer) -> Iterator[tuple[ControlPlane, FakeClock]]:
    clock = FakeClock()
    cp = start(fresh_nats.url, clock)
    with PoolClient(fresh_nats.url) as admin:
        setup_pool(admin, tenants={"alpha": 1.0, "beta": 1.0}, credits=GRANT)
        assert admin.admin("pool.prices", {"pool_id": "p1", "cpu_core_second": 5,
                                           "memory_gib_second": 2})["ok"]
        assert admin.admin("node.register", node_body("n1"))["ok"]
    yield cp, clock
    cp.stop()


def _run(cp: ControlPlane, clock: FakeClock, tenant: str, key: str, *,
         release: bool = True) -> str:
    with PoolClient(cp.nats_url, tenant) as c:
        lid: str = c.request_lease(lease_body(key, cpu_millis=1500))["lease"]["lease_id"]
        assert cp.scheduler.cycle().placed == 1
        assert c.lease(lid, "commit", JOB)["ok"]
        clock.advance(3.2)
        if release:
            assert c.lease(lid, "release", {"exit_code": 0})["ok"]
    return lid


def _findings(report: Any) -> tuple[dict[str, Any], list[tuple[Any, ...]]]:
    tenants = {t: c.figures() for t, c in report.tenants.items()}
    found = sorted((d.kind, d.tenant, d.lease_id, d.expected, d.found)
                   for d in report.discrepancies)
    return tenants, found


def test_an_audit_from_a_checkpoint_reads_only_the_new_events_and_agrees_with_a_full_replay(
        plane: tuple[ControlPlane, FakeClock]) -> None:
    cp, clock = plane
    _run(cp, clock, "alpha", "a0")
    open_lease = _run(cp, clock, "alpha", "a1", release=False)  # held across the checkpoint
    first = ac.ChainedAudit(cp.app)
    assert first.run().ok
    checkpoint = first.checkpoint()
    assert checkpoint.position == cp.app.recorder.max_notification_id()
    assert ac.verify_checkpoint(cp.app, checkpoint) == []
    # after the checkpoint: the open lease settles, prices change, beta runs, and a forged
    # settlement overcharges alpha
    with PoolClient(cp.nats_url, "alpha") as c:
        assert c.lease(open_lease, "release", {"exit_code": 0})["ok"]
    with PoolClient(cp.nats_url) as admin:
        assert admin.admin("pool.prices", {"pool_id": "p1", "cpu_core_second": 9})["ok"]
    _run(cp, clock, "beta", "b0")
    forged = _run(cp, clock, "alpha", "a2", release=False)
    acc = cp.app.repository.get(Account.create_id("alpha"))
    acc.settle("forged", LeaseId(forged), 10**6, clock.now)
    cp.app.save(acc)

    read: list[int] = []
    later = ac.ChainedAudit(cp.app, checkpoint=checkpoint)
    fold = later._fold_records
    later._fold_records = lambda records: (read.extend(r[0] for r in records),  # type: ignore[method-assign]
                                           fold(records))[1]
    incremental = later.run()
    full = CreditAudit(cp.app).run()
    assert read and min(read) == checkpoint.position + 1  # nothing before it was read
    assert _findings(incremental) == _findings(full)
    assert [d.kind for d in full.discrepancies] == ["charge"]  # the forged one, in both
    assert incremental.leases[open_lease].charged == full.leases[open_lease].charged > 0
    assert incremental.leases[open_lease].expected == full.leases[open_lease].expected
    # the running hash carried on from the checkpoint is the one a replay from 1 gives
    replayed = ac.ChainedAudit(cp.app, stop=incremental.position)
    replayed.run()
    assert later.checkpoint().chain == replayed.checkpoint().chain


def _tamper_with_grant(url: str, subject: str, old: int, new: int) -> int:
    """Purge `subject` and publish its events again with one grant changed (they land at the
    end of the log, with new sequences): what someone with write access to the store did."""

    async def go() -> int:
        nc = await nats.connect(url)
        js = nc.jetstream()
        msgs = []
        seq = 0
        while True:
            try:
                m = await js.get_msg(EVENTS_STREAM, seq=seq + 1, subject=subject, next=True)
            except NotFoundError:
                break
            msgs.append(m)
            seq = m.seq
        await js.purge_stream(EVENTS_STREAM, subject=subject)
        changed = 0
        for m in msgs:
            data = m.data
            if f'"amount":{old}'.encode() in data:
                data = data.replace(f'"amount":{old}'.encode(), f'"amount":{new}'.encode())
                changed += 1
            headers = {k: v for k, v in (m.headers or {}).items() if not k.startswith("Nats-")}
            await js.publish(subject, data, headers=headers)
        await nc.close()
        return changed

    return asyncio.run(go())


def test_tampering_with_an_event_before_the_checkpoint_is_caught_by_a_full_replay_and_its_hash(
        plane: tuple[ControlPlane, FakeClock], tmp_path: Path) -> None:
    cp, clock = plane
    _run(cp, clock, "alpha", "a0")
    path = tmp_path / "audit.json"
    report, started = ac.audit_from_checkpoint(cp.app, path)
    assert report.ok and started is None and path.exists()
    checkpoint = ac.load(path)
    assert checkpoint is not None and checkpoint.tenants["alpha"]["granted"] == GRANT
    assert ac.verify_checkpoint(cp.app, checkpoint) == []

    subject = cp.app.recorder.subject_for(Account.create_id("alpha"))
    assert _tamper_with_grant(cp.nats_url, subject, GRANT, GRANT * 2) == 1
    full = CreditAudit(cp.app).run()
    assert full.tenants["alpha"].granted == GRANT * 2 != checkpoint.tenants["alpha"]["granted"]
    problems = ac.verify_checkpoint(cp.app, checkpoint)
    assert any("not the ones the checkpoint hashed" in p for p in problems), problems


def test_a_checkpoint_changed_after_it_was_written_is_refused(
        plane: tuple[ControlPlane, FakeClock], tmp_path: Path) -> None:
    cp, clock = plane
    _run(cp, clock, "alpha", "a0")
    path = tmp_path / "audit.json"
    ac.audit_from_checkpoint(cp.app, path)
    path.write_text(path.read_text().replace(f'"granted": {GRANT}', f'"granted": {GRANT + 1}'))
    with pytest.raises(CheckpointInvalid, match="own digest"):
        ac.load(path)
    path.write_text("{not json")
    with pytest.raises(CheckpointInvalid, match="unreadable"):
        ac.load(path)


def test_pool_audit_credits_checkpoint_flag_continues_and_refuses_a_changed_file(
        plane: tuple[ControlPlane, FakeClock], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    from cli.main import main

    cp, clock = plane
    _run(cp, clock, "alpha", "a0")
    path = tmp_path / "nightly.json"
    args = ["audit", "credits", "--no-views", "--nats-url", cp.nats_url,
            "--checkpoint", str(path)]
    assert main(args) == 0 and path.exists()
    first = ac.load(path)
    _run(cp, clock, "beta", "b0")
    assert main(args) == 0
    second = ac.load(path)
    assert first is not None and second is not None and second.position > first.position
    capsys.readouterr()
    path.write_text(path.read_text().replace('"position": ', '"position": 1'))
    assert main(args) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --checkpoint") and "audit_checkpoint_invalid" in err
    assert len(err.splitlines()) == 1
