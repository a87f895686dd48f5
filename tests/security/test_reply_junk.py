"""A client of the plane's account names any reply subject and the server answers there: a
PubAck or a JetStream API answer aimed at a stream's subject is stored in that stream. A tenant
or a node can no longer do it (its replies stay in its own account, ADR 027 and 028:
tests/security/test_tenant_accounts.py, test_node_accounts.py); only the plane's own users,
the operator's among them, still can. Each reader of such a stream skips the junk (and counts
it where a count exists), as it would were one of them wrong or taken: no loop stops, no state
is replaced."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import nats
import pytest

from bus.admin import ensure_all_streams
from bus.agentbus import POSITIONS_BUCKET, ControlLink
from bus.junk import junk_values
from bus.leader import LeaderElection
from bus.local.auth import AuthConfig, url_with_credentials
from bus.local.server import NatsServer
from bus.objects import artifacts_bucket, ensure_tenant_buckets_sync, work_bucket
from bus.replies import tenant_inbox
from bus.runtime import BusRuntime
from tests.security.conftest import service_url
from workers.plane import ControlPlane

Plane = tuple[NatsServer, AuthConfig, str]


@pytest.fixture()
def plane(secured: tuple[NatsServer, AuthConfig]) -> Iterator[Plane]:
    yield made_plane(secured)


def made_plane(secured: tuple[NatsServer, AuthConfig]) -> Plane:
    """The secured server with every stream and alpha's buckets made; (server, auth, service url)."""
    server, auth = secured
    url = service_url(server, auth)
    ensure_all_streams(url, tenants=["alpha", "beta"])
    ensure_tenant_buckets_sync(url, ["alpha"])
    return server, auth, url


async def _aimer(plane: Plane) -> Any:
    """Who aims: a client of the plane's account (the operator's; a node's answers stay in its
    own account since ADR 028)."""
    return await nats.connect(plane[2])


def aim_live(plane: Plane, target: str, body: bytes, *, tenant: str = "alpha") -> None:
    """As `tenant`, store `body` in its own bucket; as the aimer, have a direct get of it
    answered on `target`: delivered to whoever listens there, the asker's body and headers,
    not stored."""
    server, auth, _ = plane

    async def go() -> None:
        nc = await nats.connect(url_with_credentials(server.url, auth.tenants[tenant]),
                                inbox_prefix=tenant_inbox(tenant).encode())
        stream, chunk = f"OBJ_{work_bucket(tenant)}", f"$O.{work_bucket(tenant)}.C.forged"
        for _ in range(3):  # its sequence past the reader's: a stored message's is too
            await nc.jetstream().publish(chunk, body, stream=stream,
                                         headers={"Nats-Last-Sequence": "0"})
        await nc.close()
        node = await _aimer(plane)
        await node.publish(f"$JS.API.DIRECT.GET.{stream}.{chunk}", b"", reply=target)
        await node.flush()
        await node.close()

    asyncio.run(go())


def aim(plane: Plane, target: str, *, how: str = "puback", tenant: str = "alpha") -> None:
    """As the aimer, have the server answer on `target`: a PubAck of a store in `tenant`'s
    artifacts bucket, or that bucket stream's info; waits until the answer is stored there."""
    _, _, url = plane

    async def go() -> None:
        nc = await _aimer(plane)
        bucket = artifacts_bucket(tenant)
        svc = await nats.connect(url)
        try:
            stream = await _stream_of(svc, target)
            before = (await svc.jetstream().stream_info(stream)).state.last_seq
            if how == "puback":
                await nc.publish(f"$O.{bucket}.C.junk", b"x", reply=target)
            else:
                await nc.publish(f"$JS.API.STREAM.INFO.OBJ_{bucket}", b"", reply=target)
            await nc.flush()
            for _ in range(200):
                try:
                    got = await svc.jetstream().get_msg(stream, subject=target)
                    if got.seq > before and not got.headers:
                        return
                except nats.js.errors.NotFoundError:
                    pass
                await asyncio.sleep(0.02)
            pytest.fail(f"no junk stored on {target}")
        finally:
            await nc.close()
            await svc.close()

    asyncio.run(go())


async def _stream_of(nc: nats.NATS, subject: str) -> str:
    return str(await nc.jetstream().find_stream_name_by_subject(subject))


# -- the KV buckets ------------------------------------------------------------------------------

def test_junk_on_the_leader_key_moves_no_leadership(plane: Plane) -> None:
    _, _, url = plane
    rt = BusRuntime(url)
    try:
        holder = LeaderElection(rt, name="pool-a", holder_id="sched-1", ttl_seconds=3.0)
        assert holder.try_acquire()
        epoch = holder.epoch
        before = junk_values().count
        aim(plane, "$KV.pool_leaders.pool-a")
        assert holder.try_acquire(), "a junk value made the holder step down"
        assert holder.is_leader and holder.epoch == epoch
        assert holder.current_leader()["holder"] == "sched-1"  # type: ignore[index]
        assert junk_values().count > before
        # the stream-info answer too
        aim(plane, "$KV.pool_leaders.pool-a", how="info")
        assert holder.try_acquire() and holder.epoch == epoch
    finally:
        rt.close()


def test_junk_on_the_dispatchers_position_starts_it_from_the_beginning(plane: Plane) -> None:
    _, _, url = plane
    link = ControlLink(url)
    try:
        link.save_position("dispatcher", 41)
        assert link.load_position("dispatcher") == 41
        before = junk_values().count
        aim(plane, f"$KV.{POSITIONS_BUCKET}.dispatcher")
        # as if the key were absent (what a lost position already means), never a crash
        assert link.load_position("dispatcher") == 0
        assert junk_values().count > before
    finally:
        link.close()


def test_junk_on_the_feed_position_leaves_the_feed_writer_its_own(plane: Plane) -> None:
    from bus.feed import POSITION_KEY, FeedPosition, FeedWriter

    _, _, url = plane
    rt = BusRuntime(url)
    writer = FeedWriter(url, runtime=rt)
    try:
        writer.save_position(7)
        assert writer.position().log_seq == 7
        aim(plane, f"$KV.{POSITIONS_BUCKET}.{POSITION_KEY}")
        before = junk_values().count
        at = writer.position()  # the writer's loop reads this at every start
        assert at == FeedPosition(0, 0)  # the stream's own: empty
        assert junk_values().count > before
    finally:
        rt.close()


def test_junk_on_a_webhook_delivery_key_stops_no_tenants_listing(plane: Plane) -> None:
    from bus.webhooks import WebhookBus

    _, _, url = plane
    hooks = WebhookBus(url)
    try:
        state = {"tenant": "beta", "endpoint_id": "hook-1", "seq": 5, "state": "delivered"}
        hooks.put("beta.hook-1.5", state)
        aim(plane, "$KV.pool_webhooks.beta.hook-1.9")
        before = junk_values().count
        # the tenant's `webhook deliveries` and the deliverer's start-up read both lists
        assert hooks.states("beta.>") == [state]
        assert hooks.states(">") == [state]
        assert junk_values().count > before
    finally:
        hooks.close()


def _wait(pred: object, timeout: float = 10.0) -> None:
    t0 = time.monotonic()
    while not pred():  # type: ignore[operator]
        if time.monotonic() - t0 > timeout:
            pytest.fail("condition not met")
        time.sleep(0.05)


# -- the lease feed -----------------------------------------------------------------------------

def _beta_reads(plane: Plane, *, live_writes: list[tuple[str, str]] | None = None,
                junk_at: str | None = None,
                forged: tuple[str, bytes] | None = None) -> list[Any]:
    """Beta's feed as `pool lease watch` and `pool lease run` read it: the replay through the
    command service, then (when `live_writes`) live records until the last one written."""
    from bus.feed import follow
    from tests.security.test_feed import write_out

    server, auth, _ = plane
    b = auth.tenants["beta"]

    async def go() -> list[Any]:
        got: list[Any] = []
        ready = asyncio.Event()
        async def read() -> None:
            async for item in follow(server.url, "beta", user=b.user, password=b.password,
                                     inbox_prefix=tenant_inbox("beta"),
                                     until_caught_up=live_writes is None,
                                     on_ready=ready.set):
                got.append(item)
                if live_writes and item.record is not None \
                        and item.record.lease_id == live_writes[-1][1]:
                    return
        task = asyncio.ensure_future(read())
        if live_writes:
            await asyncio.wait_for(ready.wait(), 10)
            if junk_at:
                await asyncio.to_thread(aim, plane, junk_at)
            if forged:
                await asyncio.to_thread(aim_live, plane, *forged)
            await asyncio.to_thread(write_out, server, auth, live_writes)
        await asyncio.wait_for(task, 20)
        return got

    return asyncio.run(go())


def test_junk_on_a_tenants_feed_reaches_no_reader_of_it(plane: Plane) -> None:
    from bus.subjects import feed_subject
    from tests.security.test_feed import write_out

    server, auth, url = plane
    write_out(server, auth, [("beta", "b1")])
    aim(plane, feed_subject("beta", "b1"))
    aim(plane, feed_subject("beta", "b1"), how="info")
    write_out(server, auth, [("beta", "b2")])
    cp = ControlPlane(url, roles=["commands"], data_plane=False,
                      responder_url=url_with_credentials(server.url, auth.responder)).start()
    try:
        before = junk_values().count
        stored = _beta_reads(plane)
        live = _beta_reads(plane, live_writes=[("beta", "b3")],
                           junk_at=feed_subject("beta", "b3"))
    finally:
        cp.stop()
    assert [i.record.lease_id for i in stored] == ["b1", "b2"]
    assert [i.record.lease_id for i in live if i.record] == ["b1", "b2", "b3"]
    assert all(i.record is not None for i in stored + live)
    assert junk_values().count > before


def test_junk_at_the_feeds_end_leaves_the_writer_its_last_record(plane: Plane) -> None:
    from bus.feed import FeedWriter
    from bus.subjects import feed_subject
    from tests.security.test_feed import write_out

    server, auth, url = plane
    write_out(server, auth, [("beta", "b1")])  # made from log sequence 7
    aim(plane, feed_subject("beta", "b1"))
    aim(plane, feed_subject("beta", "b9"), how="info")
    rt = BusRuntime(url)
    try:
        at = FeedWriter(url, runtime=rt).position()  # what a restarted writer resumes from
    finally:
        rt.close()
    assert at.feed_seq == 3
    assert at.log_seq == 7, "junk at the end would have the writer write every record again"


def test_a_direct_gets_answer_on_a_tenants_live_feed_is_no_record_of_it(plane: Plane) -> None:
    from bus.subjects import FEED_LIVE_PREFIX
    from tests.security.test_feed import _record, write_out

    server, auth, url = plane
    write_out(server, auth, [("beta", "b1")])
    # a well-formed record of beta's, in alpha's own bucket, answered on beta's live feed
    forged = (f"{FEED_LIVE_PREFIX}.beta.lease.b1", _record("beta", "b-forged"))
    cp = ControlPlane(url, roles=["commands"], data_plane=False,
                      responder_url=url_with_credentials(server.url, auth.responder)).start()
    try:
        before = junk_values().count
        live = _beta_reads(plane, live_writes=[("beta", "b2")], forged=forged)
    finally:
        cp.stop()
    assert [i.record.lease_id for i in live] == ["b1", "b2"]
    assert junk_values().count > before


# -- the caches of the log: snapshots and the scheduler's checkpoints ---------------------------

def test_junk_on_a_snapshot_subject_costs_a_cold_load_its_history(plane: Plane) -> None:
    from bus.runtime import close_runtime
    from bus.subjects import snapshot_subject
    from domain.account import Account
    from workers.application.core import APPLICATION_NAME, Store
    from workers.bootstrap import app_env

    server, auth, _ = plane
    urls = {r: url_with_credentials(server.url, auth.roles[r]) for r in ("commands", "projector")}
    apps: list[Store] = []
    try:
        saver = Store(env=app_env(urls["commands"], POOL_SNAPSHOT_INTERVAL="5"))
        apps.append(saver)
        acc = Account.open(tenant_id="beta", now=1.0)  # type: ignore[arg-type]
        for i in range(12):
            acc.grant(f"g{i}", 5, now=float(i))
        saver.save(acc)
        assert saver.snapshotting.wait() and saver.snapshotting.taken == 1
        # the account's only kept snapshot replaced by alpha's PubAck, then by a stream info
        aim(plane, snapshot_subject(APPLICATION_NAME, str(acc.id)))
        aim(plane, snapshot_subject(APPLICATION_NAME, str(acc.id)), how="info")
        reader = Store(env=app_env(urls["projector"]))
        apps.append(reader)
        assert list(reader.snapshots.get(acc.id, desc=True, limit=1)) == []  # type: ignore[union-attr]
        loaded = reader.repository.get(acc.id)
        assert loaded.version == acc.version and loaded.balance == acc.balance
    finally:
        for app in apps:
            app.close()
        for url in urls.values():
            close_runtime(url)


def test_junk_on_the_checkpoint_head_costs_the_scheduler_a_full_replay(plane: Plane) -> None:
    from types import SimpleNamespace

    from bus.checkpoints import CheckpointStore, CheckpointTorn
    from workers.scheduler.checkpoint import Checkpointer

    _, _, url = plane
    rt = BusRuntime(url)
    try:
        store = CheckpointStore(url, runtime=rt)
        store.put(b'{"position": 1}', b"fold")
        assert store.get() == (b'{"position": 1}', b"fold")
        aim(plane, "pool.ckpt.scheduler.head")  # the only head kept: replaced
        with pytest.raises(CheckpointTorn):
            store.get()
        fold = SimpleNamespace(position=0, app=None)
        # what a scheduler's start does: no checkpoint used, the log replayed, nothing raised
        assert Checkpointer(store, b"k" * 32).restore(fold) is False  # type: ignore[arg-type]
        assert fold.position == 0
    finally:
        rt.close()


# -- the timers ---------------------------------------------------------------------------------

def test_junk_among_the_fired_timers_stops_no_reconciler(
        plane: Plane, caplog: pytest.LogCaptureFixture) -> None:
    import uuid

    from workers.application import PoolApp
    from workers.bootstrap import app_env
    from workers.dispatcher import Reconciler

    _, _, url = plane
    app = PoolApp(env=app_env(url))
    link = ControlLink(url)
    try:
        before = junk_values().count
        aim(plane, "pool.due.x")  # no kind and id: the reconciler's subjects have both
        aim(plane, f"pool.due.lease.{uuid.uuid4()}", how="info")  # a lease no one has
        aim(plane, "pool.due.node.no-such-node")
        aim(plane, f"pool.due.reservation.{uuid.uuid4()}")
        aim(plane, "pool.due.lease.not-a-uuid")
        reconciler = Reconciler(app, link)
        steps = [reconciler.step(timeout=1.0) for _ in range(3)]
        assert sum(steps) == 4 and reconciler.applied == []
        assert not [r for r in caplog.records if "failed" in r.getMessage()]  # all acked
        assert link.fetch_due(timeout=0.5) == []  # each taken off the queue, none left
        assert junk_values().count > before
    finally:
        link.close()
        app.close()


def test_junk_over_a_tenants_secret_keeps_its_versions_readable(plane: Plane) -> None:
    from bus.secrets import SecretRecord, SecretStore

    _, _, url = plane
    rt = BusRuntime(url)
    try:
        store = SecretStore(url, runtime=rt)
        v1 = SecretRecord(name="db", version=1, key_id="k1", sealed="c2VhbGVk", size_bytes=6,
                          updated_at=1.0)
        store.put("beta", v1, last_revision=None)
        aim(plane, "$KV.pool_secrets.beta.db")  # the key's newest entry: alpha's PubAck
        before = junk_values().count
        # what a node's secret fetch, the tenant's `secret list` and a key rotation read
        found = store.latest("beta", "db")
        assert found is not None and found[0] == v1
        assert store.version("beta", "db", 1) == v1
        assert store.listing("beta") == [v1]
        assert [(t, r) for t, r, _ in store.every()] == [("beta", v1)]
        assert junk_values().count > before
        # the tenant's next version is written over the junk
        v2 = SecretRecord(name="db", version=2, key_id="k1", sealed="c2VhbGVkMg==",
                          size_bytes=7, updated_at=2.0)
        store.put("beta", v2, last_revision=found[1])
        assert store.latest("beta", "db")[0] == v2  # type: ignore[index]
    finally:
        rt.close()


# -- a node's work queue ------------------------------------------------------------------------

def test_junk_in_a_nodes_work_queue_is_dropped_and_the_next_order_taken(
        plane: Plane, tmp_path: Any) -> None:
    from agents.agent import Agent
    from agents.probe import NodeProbe
    from agents.simulate import SleepRuntime
    from bus.agentbus import AgentLink

    server, auth, url = plane
    control = ControlLink(url)
    link = AgentLink(url_with_credentials(server.url, auth.nodes["gpu-7"]), "gpu-7").connect()
    try:
        control.ensure_agent_consumer("gpu-7")
        aim(plane, "pool.agent.gpu-7.start")
        aim(plane, "pool.agent.gpu-7.stop", how="info")
        agent = Agent(link, SleepRuntime(), node_id="gpu-7", pool_id="p1", state_dir=tmp_path,
                      probe=NodeProbe(cpu_millis=4500, cpu_arch="amd64", memory_mib=9216,
                                      local_disk_gib=50))
        junk = link.fetch(timeout=2.0)
        assert [c.verb for c in junk] == ["start", "stop"]
        for cmd in junk:
            agent.handle(cmd)  # what the agent's loop does with each: dropped, acked
        control.send("gpu-7", "session", b"{}", msg_id="after-junk")
        assert [c.verb for c in link.fetch(timeout=2.0)] == ["session"]
    finally:
        link.close()
        control.close()


# -- the scheduler's decision records -----------------------------------------------------------

def test_junk_among_a_leases_decisions_leaves_why_at_the_recorded_reason(plane: Plane) -> None:
    import json

    from bus.decisions import DecisionReader, DecisionWriter
    from bus.subjects import decision_subject
    from workers.scheduler.decisions import reason_at

    _, _, url = plane
    rt = BusRuntime(url)
    try:
        DecisionWriter(url, runtime=rt).append([("beta", "b1", json.dumps(
            {"at": 10.0, "state": "waiting", "reasons": {"no_node_fits": 3}}).encode())])
        aim(plane, decision_subject("beta", "b1"))
        aim(plane, decision_subject("beta", "b1"), how="info")
        records = DecisionReader(url, runtime=rt).records("beta", "b1")
    finally:
        rt.close()
    assert len(records) == 3  # stored, all three: `why --at` reads them all
    answer = reason_at(records, 20.0, None)
    assert answer["recorded_at"] == 10.0 and answer["reasons"] == {"no_node_fits": 3}
