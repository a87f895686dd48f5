"""Snapshots of accounts, nodes and pools against a real nats-server: a load through a snapshot
equals a load of the whole history, reads only the events after the snapshot, and passes over a
snapshot whose schema it cannot read, an old one left in the log, or one of another log; the
latest alone is kept, in a stream of its own, and without that stream loads read histories."""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Callable, Iterator
from itertools import chain
from typing import Any
from uuid import UUID

import pytest
from eventsourcing.application import project_aggregate

from bus.jetstream import JetStreamAggregateRecorder, JetStreamSnapshotRecorder
from bus.jetstream import snapshots as snapshots_module
from bus.local.server import NatsServer
from bus.runtime import get_runtime
from bus.streams import ensure_stream, snapshot_stream_config
from bus.subjects import snapshot_subject
from domain.account import Account
from domain.node import Node
from domain.pool import Pool
from domain.poolconfig import PoolConfig
from domain.prices import PriceList
from domain.resources import Device, LeaseId, NodeCapabilities, NodeId, PoolId, Resources
from domain.snapshots import StateSnapshot
from workers.application.core import Store
from workers.bootstrap import app_env

INTERVAL = 40


@pytest.fixture()
def make_app(fresh_nats: NatsServer, unique: str) -> Iterator[Callable[..., Store]]:
    # a server of its own: these streams take the log's subjects, which a stream that another
    # test left on the shared server (its plane's log) would already hold
    nats_url = fresh_nats.url
    apps: list[Store] = []

    def make(interval: int = INTERVAL) -> Store:
        app = Store(env=app_env(nats_url, NATS_STREAM=f"SNAP_{unique.upper()}",
                                  POOL_SNAPSHOT_INTERVAL=str(interval)))
        apps.append(app)
        return app

    yield make
    for app in apps:
        app.close()
    rt = get_runtime(nats_url)

    async def drop() -> None:  # the streams' subjects are the log's: one such pair at a time
        js = await rt.jetstream()
        for name in (f"SNAP_{unique.upper()}", f"SNAP_{unique.upper()}_SNAPSHOTS"):
            with contextlib.suppress(Exception):
                await js.delete_stream(name)

    rt.run(drop())


def _account(app: Store, movements: int, start: int = 0) -> UUID:
    """An account with `movements` more credit movements (grants, holds, settlements,
    releases), saved a few at a time."""
    aid = Account.create_id("t-long")
    acc = app.find(Account, aid) or Account.open(tenant_id="t-long", now=1.0)  # type: ignore[arg-type]
    for i in range(start, start + movements):
        lid = LeaseId(f"lease-{i // 3}")
        if i % 3 == 0:
            acc.grant(f"g{i}", 1_000 + i, now=float(i))
            acc.hold(f"h{i}", lid, 500, now=float(i))
        elif i % 3 == 1:
            acc.settle(f"s{i}", lid, 200 + i, now=float(i))
        else:
            acc.hold(f"h{i}", lid, 100, now=float(i))
            acc.release_hold(f"r{i}", lid, now=float(i))
        if i % 7 == 6:
            app.save(acc)
    app.save(acc)
    return aid


def _node(app: Store, rounds: int, start: int = 0) -> UUID:
    nid = Node.create_id("n-long")
    node = app.find(Node, nid)
    if node is None:
        devices = tuple(Device(id=f"GPU-{k}", model="H100", memory_mib=81_000, minor=k)
                        for k in range(4))
        caps = NodeCapabilities(allocatable=Resources(cpu_millis=64_000, memory_mib=512_000,
                                                      gpu_count=4),
                                gpu_model="H100", devices=devices, labels=(("rack", "r1"),))
        node = Node.register(node_id=NodeId("n-long"), pool_id=PoolId("p"), capabilities=caps,
                             now=1.0)
        node.allocate(LeaseId("long"), Resources(cpu_millis=500, gpu_count=2), 1.0,
                      devices=("GPU-2", "GPU-3"))  # held across every snapshot
    if node.state.value != "ready":
        node.uncordon(float(start))
    for i in range(start, start + rounds):
        node.allocate(LeaseId(f"lease-{i}"), Resources(cpu_millis=1_000, memory_mib=1_024,
                                                       gpu_count=1), float(i),
                      devices=(f"GPU-{i % 2}",))
        if i > 0:
            node.free(LeaseId(f"lease-{i - 1}"), float(i) + 0.5)
        node.heartbeat(float(i) + 0.7)
        app.save(node)
    if node.state.value == "ready":
        node.cordon(float(start + rounds), reason="kept for the test")
        app.save(node)
    return nid


def _pool(app: Store, rounds: int, start: int = 0) -> UUID:
    pid = Pool.create_id("p-long")
    pool = app.find(Pool, pid) or Pool.create(pool_id=PoolId("p-long"), now=1.0)
    for i in range(start, start + rounds):
        pool.set_price_list(PriceList(cpu_core_second=i, gpu_second=(("H100", 10 * i),)),
                            float(i))
        pool.configure(PoolConfig(), float(i))
        pool.list_member("tenant", f"tenant-{i}", float(i))
        if i % 5 == 0:
            pool.list_member("reservation", f"res-{i}", float(i))
        app.save(pool)
    return pid


BUILDERS: dict[str, Callable[[Store, int, int], UUID]] = {
    "account": _account, "node": _node, "pool": _pool}


def _full(app: Store, aid: UUID) -> Any:
    """The aggregate from its whole history, no snapshot."""
    return project_aggregate(None, app.events.get(aid))


def _state(agg: Any) -> dict[str, Any]:
    state = {k: v for k, v in vars(agg).items() if k != "_pending_events"}
    # order and exact types count too: the transfer window is ordered, ids are NewTypes of str
    return {k: (type(v), list(v.items()) if isinstance(v, dict) else v)
            for k, v in state.items()}


@pytest.mark.parametrize("kind", list(BUILDERS))
def test_a_load_through_a_snapshot_equals_a_load_of_the_whole_history(
        make_app: Callable[..., Store], kind: str) -> None:
    writer = make_app()
    build = BUILDERS[kind]
    aid = build(writer, 120, 0)
    assert writer.snapshotting.wait()
    assert writer.snapshotting.taken >= 1
    build(make_app(interval=0), 17, 120)  # more events after the latest snapshot

    reader = make_app()
    snaps = list(reader.snapshots.get(aid, desc=True, limit=1))  # type: ignore[union-attr]
    assert snaps and isinstance(snaps[0], StateSnapshot)
    full = _full(reader, aid)
    assert snaps[0].originator_version < full.version
    loaded = reader.repository.get(aid)
    assert _state(loaded) == _state(full)
    # and the aggregate goes on deciding alike
    assert type(loaded).Snapshot.take(loaded).state == type(full).Snapshot.take(full).state


def test_a_load_after_a_snapshot_reads_only_the_events_after_it(
        make_app: Callable[..., Store]) -> None:
    writer = make_app(interval=200)
    aid = _account(writer, 700)
    assert writer.snapshotting.wait()
    _account(make_app(interval=0), 30, 700)
    total = writer.repository.get(aid).version

    reader = make_app(interval=0)
    snap = next(iter(reader.snapshots.get(aid, desc=True, limit=1)))  # type: ignore[union-attr]
    tail = total - snap.originator_version
    assert 0 < tail < 200
    reader.recorder.messages_read = 0  # type: ignore[attr-defined]
    acc = reader.find(Account, aid)
    assert acc is not None and acc.version == total
    # the snapshot's own event (checked to be where the snapshot says) and the events after it
    assert reader.recorder.messages_read == tail + 1  # type: ignore[attr-defined]

    without = Store(env=app_env(reader.factory.url,  # type: ignore[attr-defined]
                                  NATS_STREAM=reader.factory.stream,  # type: ignore[attr-defined]
                                  IS_SNAPSHOTTING_ENABLED="n"))
    try:
        assert without.find(Account, aid) is not None
        assert without.recorder.messages_read == total  # type: ignore[attr-defined]
    finally:
        without.close()


def test_a_snapshot_of_an_older_schema_is_upcast_or_passed_over(
        make_app: Callable[..., Store], monkeypatch: pytest.MonkeyPatch) -> None:
    writer = make_app(interval=100)
    aid = _account(writer, 300)
    assert writer.snapshotting.wait()
    total = writer.repository.get(aid).version
    full = _full(writer, aid)

    # the code moves on to schema 2 with no upcast from 1: the snapshot is passed over
    monkeypatch.setattr(Account, "SNAPSHOT_SCHEMA", 2)
    reader = make_app(interval=0)
    acc = reader.find(Account, aid)
    assert acc is not None and _state(acc) == _state(full)
    assert reader.recorder.messages_read == total  # type: ignore[attr-defined]

    # with an upcast it is read, upcast, and only the tail follows it
    upcasts: list[int] = []

    def upcast(fields: dict[str, Any]) -> None:
        upcasts.append(len(fields["recent_transfers"]))

    monkeypatch.setattr(Account, "upcast_snapshot_v1_v2", staticmethod(upcast), raising=False)
    reader = make_app(interval=0)
    acc = reader.find(Account, aid)
    assert acc is not None and _state(acc) == _state(full)
    assert len(upcasts) == 1
    assert reader.recorder.messages_read < total  # type: ignore[attr-defined]

    # a snapshot newer than the code is passed over too
    monkeypatch.setattr(Account, "SNAPSHOT_SCHEMA", 0)
    reader = make_app(interval=0)
    acc = reader.find(Account, aid)
    assert acc is not None and _state(acc) == _state(full)
    assert reader.recorder.messages_read == total  # type: ignore[attr-defined]


def test_a_snapshot_whose_sequence_names_another_message_loads_the_whole_subject(
        make_app: Callable[..., Store], monkeypatch: pytest.MonkeyPatch) -> None:
    from bus.jetstream import JetStreamRecorder

    def moved(self: JetStreamRecorder, e: Any) -> str:  # as if the log were renumbered
        line = real(self, e)
        if not line:
            return line
        name, seq = line.strip().split(": ")
        return f"{name}: {int(seq) + 5}\r\n"

    real = JetStreamRecorder._event_sequence_line
    monkeypatch.setattr(JetStreamRecorder, "_event_sequence_line", moved)
    writer = make_app(interval=100)
    aid = _account(writer, 300)
    assert writer.snapshotting.wait() and writer.snapshotting.taken >= 1
    _account(make_app(interval=0), 20, 300)
    full = _full(writer, aid)

    reader = make_app(interval=0)
    acc = reader.find(Account, aid)
    assert acc is not None and _state(acc) == _state(full)
    assert reader.recorder.messages_read > full.version  # type: ignore[attr-defined]


def test_a_process_that_only_saves_takes_no_snapshot_while_the_latest_is_recent(
        make_app: Callable[..., Store]) -> None:
    writer = make_app(interval=100)
    aid = _account(writer, 200)
    assert writer.snapshotting.wait()
    writer.snapshotting.take(aid)  # at the last version, unless the thread got there first
    snapshots = writer.snapshots.get(aid, desc=True, limit=1)  # type: ignore[union-attr]
    latest = next(iter(snapshots)).originator_version
    assert latest == writer.repository.get(aid).version

    # as the scheduler saves: an aggregate it folded itself, no load through the repository
    saver = make_app(interval=100)
    acc = _full(saver, aid)
    acc.grant("one-more", 5, now=1e6)
    saver.save(acc)
    assert saver.snapshotting.wait()
    assert saver.snapshotting.taken == 0
    assert saver.snapshotting._known[aid] == latest

    for i in range(120):
        acc.grant(f"more-{i}", 5, now=1e6 + i)
    saver.save(acc)
    assert saver.snapshotting.wait()
    assert saver.snapshotting.taken == 1
    snap = next(iter(saver.snapshots.get(aid, desc=True, limit=1)))  # type: ignore[union-attr]
    assert snap.originator_version == acc.version


def test_the_logs_readers_never_see_a_snapshot(make_app: Callable[..., Store]) -> None:
    app = make_app(interval=20)
    aids = [_account(app, 90), _node(app, 60), _pool(app, 30)]
    assert app.snapshotting.wait()
    for aid in aids:
        assert list(app.snapshots.get(aid, desc=True, limit=1))  # type: ignore[union-attr]
    versions = sum(app.repository.get(aid).version for aid in aids)
    recorder: Any = app.recorder
    notes = recorder.select_notifications(1, 100_000)
    assert len(notes) == versions
    assert not [n for n in notes if "Snapshot" in n.topic]
    records = list(chain.from_iterable(recorder.read_records(1, recorder.max_notification_id())))
    assert len(records) == versions


def test_a_snapshot_that_forgets_a_field_is_not_taken() -> None:
    acc = Account.open(tenant_id="t", now=1.0)  # type: ignore[arg-type]
    acc.grant("g", 5, now=2.0)
    acc.__dict__["new_field"] = 1
    with pytest.raises(ValueError, match="new_field"):
        Account.Snapshot.take(acc)


def _rt_run(app: Store, coro_fn: Callable[[Any], Any]) -> Any:
    """`coro_fn(js)` on the app's bus runtime."""
    rt = get_runtime(app.factory.url)  # type: ignore[attr-defined]

    async def go() -> Any:
        return await coro_fn(await rt.jetstream())

    return rt.run(go())


def _ahead(app: Store, aid: UUID) -> Any:
    """A snapshot that, applied, would load as an account with a grant the log never had."""
    acc = copy.deepcopy(_full(app, aid))
    acc.grant("never-saved", 10**9, now=1e9)
    return Account.Snapshot.take(acc)


def test_a_snapshot_is_kept_in_its_own_stream_and_only_the_latest(
        make_app: Callable[..., Store]) -> None:
    app = make_app(interval=50)
    aids = [_account(app, 200), _node(app, 120)]
    assert app.snapshotting.wait() and app.snapshotting.taken >= 4
    factory: Any = app.factory
    info = _rt_run(app, lambda js: js.stream_info(factory.snapshot_stream,
                                                  subjects_filter=">"))
    subjects = {snapshot_subject("pool", str(aid)) for aid in aids}
    # one message per aggregate, on its own subject, however many were taken
    assert info.state.messages == len(aids)
    assert set(info.state.subjects or {}) == subjects
    for aid in aids:
        snap = next(iter(app.snapshots.get(aid, desc=True, limit=1)))  # type: ignore[union-attr]
        assert app.repository.get(aid).version - snap.originator_version < 50
    # and the event log holds only events
    log = _rt_run(app, lambda js: js.stream_info(factory.stream, subjects_filter=">"))
    assert all(s.startswith("pool.evt.pool.") for s in log.state.subjects or {})


def test_an_old_snapshot_left_in_the_event_stream_is_never_read(
        make_app: Callable[..., Store]) -> None:
    app = make_app(interval=0)
    aid = _account(app, 100)
    full = _full(app, aid)
    # as the old recorder saved one: pool.evt.pool_snapshots.<id>, the recorder's headers
    factory: Any = app.factory
    old = JetStreamAggregateRecorder(factory.runtime, stream=factory.stream,
                                     kind="pool_snapshots")
    old.insert_events([app.mapper.to_stored_event(_ahead(app, aid))])

    reader = make_app(interval=0)
    assert not list(reader.snapshots.get(aid, desc=True, limit=1))  # type: ignore[union-attr]
    acc = reader.find(Account, aid)
    assert acc is not None and _state(acc) == _state(full)
    # nor by the folds: not a notification, not a record
    recorder: Any = reader.recorder
    notes = recorder.select_notifications(1, 100_000)
    assert len(notes) == full.version and not [n for n in notes if "Snapshot" in n.topic]
    last = recorder.max_notification_id()
    assert len(list(chain.from_iterable(recorder.read_records(1, last)))) == full.version


def test_a_snapshot_of_another_log_is_passed_over_and_replaced(
        make_app: Callable[..., Store], monkeypatch: pytest.MonkeyPatch) -> None:
    writer = make_app(interval=0)
    aid = _account(writer, 100)
    full = _full(writer, aid)
    # a snapshot stamped with another log's creation, as if the log had been made anew
    snaps: Any = writer.snapshots.recorder  # type: ignore[union-attr]
    real = JetStreamSnapshotRecorder._render

    def stamped_elsewhere(self: Any, stored: Any) -> Any:
        messages, subjects_of, by_subject = real(self, stored)
        return ([(s, d, lines.replace(self._log_created, "2001-01-01T00:00:00+00:00"))
                 for s, d, lines in messages], subjects_of, by_subject)

    monkeypatch.setattr(JetStreamSnapshotRecorder, "_render", stamped_elsewhere)
    snaps.insert_events([writer.mapper.to_stored_event(_ahead(writer, aid))])
    monkeypatch.setattr(JetStreamSnapshotRecorder, "_render", real)

    reader = make_app(interval=0)
    assert not list(reader.snapshots.get(aid, desc=True, limit=1))  # type: ignore[union-attr]
    acc = reader.find(Account, aid)
    assert acc is not None and _state(acc) == _state(full)
    assert reader.recorder.messages_read == full.version  # type: ignore[attr-defined]

    # its version does not refuse this log's own snapshot, which replaces it
    saver = make_app(interval=0)
    assert saver.snapshotting.take(aid) == full.version
    assert saver.snapshotting.taken == 1
    reader = make_app(interval=0)
    snap = next(iter(reader.snapshots.get(aid, desc=True, limit=1)))  # type: ignore[union-attr]
    assert snap.originator_version == full.version
    acc = reader.find(Account, aid)
    assert acc is not None and _state(acc) == _state(full)


def test_without_the_snapshot_stream_loads_read_histories_and_saves_are_skipped(
        make_app: Callable[..., Store], monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    writer = make_app(interval=50)
    aid = _account(writer, 200)
    assert writer.snapshotting.wait() and writer.snapshotting.taken >= 1
    factory: Any = writer.factory
    _rt_run(writer, lambda js: js.delete_stream(factory.snapshot_stream))

    # an old deployment: the operator has not made the stream, and this process may not
    old = Store(env=app_env(factory.url, NATS_STREAM=factory.stream, CREATE_TABLE="no",
                              POOL_SNAPSHOT_INTERVAL="50"))
    try:
        total = _full(writer, aid).version
        with caplog.at_level(logging.INFO, logger=snapshots_module.__name__):
            acc = old.find(Account, aid)
            assert acc is not None and acc.version == total
            assert old.recorder.messages_read == total  # type: ignore[attr-defined]
            for _ in range(3):
                assert not list(old.snapshots.get(aid, desc=True, limit=1))  # type: ignore[union-attr]
            # saves go on; no snapshot is taken, none attempted, and it is said once
            _account(old, 120, 200)
            assert old.snapshotting.wait()
            # and a due aggregate is not asked about again before another interval
            assert old.snapshotting._known[aid] > total
            assert old.snapshotting.take(aid) is not None
            assert old.snapshotting.taken == 0
        said = [r for r in caplog.records if "not usable" in r.getMessage()]
        assert len(said) == 1

        # the stream made later (an upgrade), looked for again once its time is up
        _rt_run(old, lambda js: ensure_stream(js, snapshot_stream_config(
            name=factory.snapshot_stream)))
        monkeypatch.setattr(snapshots_module, "RECHECK_S", 0.0)
        assert old.snapshotting.take(aid) == old.repository.get(aid).version
        assert old.snapshotting.taken == 1
    finally:
        old.close()
