"""The eventsourcing library's own recorder contract tests, run against a real nats-server.

Owns wiring each contract TestCase to the JetStream recorders: one server per class, one stream per test.
"""

from __future__ import annotations

import contextlib
import tempfile
import uuid
from pathlib import Path
from typing import Any, ClassVar

from eventsourcing.persistence import (
    AggregateRecorder,
    ApplicationRecorder,
    ProcessRecorder,
    TrackingRecorder,
    Transcoder,
    Transcoding,
)
from eventsourcing.tests import persistence as contract  # a module: pytest skips its bases
from eventsourcing.utils import Environment

from bus.jetstream import (
    JetStreamAggregateRecorder,
    JetStreamApplicationRecorder,
    JetStreamFactory,
    JetStreamProcessRecorder,
    JetStreamTrackingRecorder,
    natsfast,
)
from bus.local.server import NatsServer
from bus.runtime import close_runtime, get_runtime
from bus.transcoder import MsgspecTranscoder


class _ServerMixin:
    """A nats-server per test class; each test gets a stream of its own, deleted afterwards."""

    server: ClassVar[NatsServer]
    _tmp: ClassVar[tempfile.TemporaryDirectory[str]]

    @classmethod
    def setUpClass(cls) -> None:
        super().setUpClass()  # type: ignore[misc]
        cls._tmp = tempfile.TemporaryDirectory()
        cls.server = NatsServer(store_dir=Path(cls._tmp.name), server_name="contract").start()

    @classmethod
    def tearDownClass(cls) -> None:
        close_runtime(cls.server.url)
        cls.server.stop()
        cls._tmp.cleanup()
        super().tearDownClass()  # type: ignore[misc]

    def make_env(self, name: str = "") -> Environment:
        self.stream_name = "T_" + uuid.uuid4().hex[:12].upper()
        return Environment(
            name=name,
            env={
                "PERSISTENCE_MODULE": "bus.jetstream",
                "NATS_URL": self.server.url,
                "NATS_STREAM": self.stream_name,
            },
        )

    def make_factory(self) -> JetStreamFactory:
        self.factory_ = JetStreamFactory(self.make_env())
        return self.factory_

    def drop_stream(self) -> None:
        name = getattr(self, "stream_name", None)
        if not name:
            return
        rt = get_runtime(self.server.url)

        async def go() -> None:
            js = await rt.jetstream()
            for stream in (name, f"{name}_SNAPSHOTS"):
                with contextlib.suppress(Exception):  # the test may never have created it
                    await js.delete_stream(stream)

        rt.run(go())


class _RecorderBase(_ServerMixin):
    def setUp(self) -> None:
        super().setUp()  # type: ignore[misc]
        self.factory_ = self.make_factory()

    def tearDown(self) -> None:
        self.drop_stream()
        super().tearDown()  # type: ignore[misc]


class TestAggregateRecorder(_RecorderBase, contract.AggregateRecorderTestCase):
    def create_recorder(self) -> AggregateRecorder:
        return self.factory_.aggregate_recorder()

    def test_snapshots_are_kept_apart(self) -> None:
        events = self.factory_.aggregate_recorder()
        snaps = self.factory_.aggregate_recorder("snapshots")
        oid = uuid.uuid4()
        from eventsourcing.persistence import StoredEvent

        events.insert_events([StoredEvent(oid, 1, "t", b"e")])
        snaps.insert_events([StoredEvent(oid, 1, "t", b"s")])
        assert [e.state for e in events.select_events(oid)] == [b"e"]
        assert [e.state for e in snaps.select_events(oid)] == [b"s"]


class TestApplicationRecorder(_RecorderBase, contract.ApplicationRecorderTestCase):
    def create_recorder(self) -> ApplicationRecorder:
        return self.factory_.application_recorder()

    def test_insert_subscribe(self) -> None:
        self.optional_test_insert_subscribe()

    def test_notification_ids_are_contiguous_within_a_batch(self) -> None:
        from eventsourcing.persistence import StoredEvent

        r = self.create_recorder()
        a, b = uuid.uuid4(), uuid.uuid4()
        ids = r.insert_events(
            [StoredEvent(a, 1, "t", b"1"), StoredEvent(b, 1, "t", b"2"), StoredEvent(a, 2, "t", b"3")]
        )
        assert ids == [1, 2, 3]
        got = r.select_notifications(None, 10)
        assert [(n.id, n.state) for n in got] == [(1, b"1"), (2, b"2"), (3, b"3")]


class TestProcessRecorder(_RecorderBase, contract.ProcessRecorderTestCase):
    def create_recorder(self) -> ProcessRecorder:
        return self.factory_.process_recorder()


class TestTrackingRecorder(_RecorderBase, contract.TrackingRecorderTestCase):
    def create_recorder(self) -> TrackingRecorder:
        return self.factory_.tracking_recorder()


class TestNonInterleavingNotificationIDs(
    _RecorderBase, contract.NonInterleavingNotificationIDsBaseCase
):
    def create_recorder(self) -> ApplicationRecorder:
        return self.factory_.application_recorder()


class _TrackingSubclass(JetStreamTrackingRecorder):
    pass


class TestInfrastructureFactory(_ServerMixin, contract.InfrastructureFactoryTestCase[JetStreamFactory]):
    def setUp(self) -> None:
        self.env = self.make_env()
        super().setUp()

    def tearDown(self) -> None:
        super().tearDown()
        self.drop_stream()

    def expected_factory_class(self) -> type[JetStreamFactory]:
        return JetStreamFactory

    def expected_aggregate_recorder_class(self) -> type[AggregateRecorder]:
        return JetStreamAggregateRecorder

    def expected_application_recorder_class(self) -> type[ApplicationRecorder]:
        return JetStreamApplicationRecorder

    def expected_tracking_recorder_class(self) -> type[TrackingRecorder]:
        return JetStreamTrackingRecorder

    def tracking_recorder_subclass(self) -> type[TrackingRecorder]:
        return _TrackingSubclass

    def expected_process_recorder_class(self) -> type[ProcessRecorder]:
        return JetStreamProcessRecorder

    def test_default_transcoder_is_msgspec(self) -> None:
        assert isinstance(self.factory.transcoder(), MsgspecTranscoder)


# -- transcoder ----------------------------------------------------------------------------------


class _MyDictAsDict(Transcoding):
    type = contract.Mydict
    name = "mydict"

    def encode(self, obj: Any) -> dict[str, Any]:
        return dict(obj)

    def decode(self, data: Any) -> Any:
        return contract.Mydict(data)


class _MyListAsList(Transcoding):
    type = contract.MyList
    name = "mylist"

    def encode(self, obj: Any) -> list[Any]:
        return list(obj)

    def decode(self, data: Any) -> Any:
        return contract.MyList(data)


class _MyStrAsStr(Transcoding):
    type = contract.MyStr
    name = "mystr"

    def encode(self, obj: Any) -> str:
        return str(obj)

    def decode(self, data: Any) -> Any:
        return contract.MyStr(data)


class _MyIntAsInt(Transcoding):
    type = contract.MyInt
    name = "myint"

    def encode(self, obj: Any) -> int:
        return int(obj)

    def decode(self, data: Any) -> Any:
        return contract.MyInt(data)


class TestMsgspecTranscoder(contract.TranscoderTestCase):
    def construct_transcoder(self) -> Transcoder:
        t = MsgspecTranscoder()
        for transcoding in (
            contract.CustomType1AsDict(),
            contract.CustomType2AsDict(),
            _MyDictAsDict(),
            _MyListAsList(),
            _MyStrAsStr(),
            _MyIntAsInt(),
        ):
            t.register(transcoding)
        return t



# -- bulk record reads ----------------------------------------------------------------------------


def _stream_env(url: str, stream: str, name: str = "main") -> Environment:
    """An application `name`'s environment: its events in `stream` on the server at `url`."""
    return Environment(name=name, env={"PERSISTENCE_MODULE": "bus.jetstream",
                                       "NATS_URL": url, "NATS_STREAM": stream})


def _direct_records(recorder: Any, start: int = 1) -> list[Any]:
    """Every notification of `recorder` from `start`, by direct gets, as log records."""
    out: list[Any] = []
    while True:
        page = recorder.select_notifications(start, 500)
        if not page:
            return out
        out += [(n.id, str(n.originator_id), isinstance(n.originator_id, uuid.UUID),
                 n.originator_version, n.topic, n.state) for n in page]
        start = page[-1].id + 1


def test_read_records_hold_what_direct_gets_return(tmp_path: Path) -> None:
    """A log of one recorder's events (UUID and string ids, small and 70 kB states) with its
    tracking messages and another recorder's events in between: the bulk record pages hold
    exactly the direct gets' notifications, for any start, stop (mid-page too) and page size,
    from the consumer; and the same when the consumer path is refused (direct gets)."""
    import json
    from collections import defaultdict

    from eventsourcing.persistence import StoredEvent, Tracking

    server = NatsServer(store_dir=tmp_path / "nats", server_name="records").start()
    try:
        main = JetStreamFactory(_stream_env(server.url, "T_RECORDS")).process_recorder()
        other = JetStreamFactory(_stream_env(server.url, "T_RECORDS", "other")).application_recorder()
        assert isinstance(main, JetStreamProcessRecorder)
        ids: list[Any] = [uuid.uuid4() for _ in range(30)] + ["acct-1", "Weird Id/2"]
        versions: dict[Any, int] = defaultdict(int)
        for i in range(50):
            batch = []
            for j in range(40):
                oid = ids[(i * 7 + j) % len(ids)]
                versions[oid] += 1
                state = (b'{"big":"' + b"y" * 70_000 + b'"}' if (i, j) in ((20, 7), (21, 39))
                         else json.dumps({"i": i, "j": j, "pad": "x" * (j * 9)}).encode())
                batch.append(StoredEvent(oid, versions[oid], f"tests.topic:E{j % 5}", state))
            main.insert_events(batch, tracking=Tracking("upstream", i + 1))
            if i % 3 == 0:
                other.insert_events([StoredEvent(uuid.uuid4(), 1, "tests.other:E", b"{}")])
        expected = _direct_records(main)
        top = expected[-1][0]
        assert len(expected) == 2000 and top > 2050  # tracking and the other recorder between
        for first, stop, size in ((1, None, 2000), (1, None, 97), (17, top // 2, 333),
                                  (top // 3, top - 5, 1000), (5, 5, 10), (top + 1, None, 50)):
            pages = list(main.read_records(first, stop, page_size=size))
            got = [r for page in pages for r in page]
            assert got == [r for r in expected
                           if r[0] >= first and (stop is None or r[0] <= stop)]
            assert all(0 < len(page) <= size for page in pages)
        # the records came from the bulk reader, its usual frames by its compiled pattern: only
        # the string ids' events (125), the tracking (50) and the other recorder's (17) messages
        # and a new consumer's first frame were taken field by field
        reader = main.__dict__["_log_reader"]
        assert reader.disabled_until == 0.0 and reader.dseq > 0 and reader.fast is not None
        reader.odd_frames = 0
        assert [r for page in main.read_records(1) for r in page] == expected
        if natsfast.FAST:  # the public path hands every frame over one by one
            assert reader.odd_frames <= 125 + 50 + 17 + 1
        # the notifications of read-ahead pages are the direct gets' too
        notes, at = [], 1
        while True:
            page = main.prefetch(at, 250).result()
            if not page:
                break
            notes += page
            at = page[-1].id + 1
        assert notes == main.select_notifications(1, 10_000)
        # a reader that stops early leaves the next read whole
        for _page in main.read_records(1, page_size=100):
            break
        assert [r for page in main.read_records(1) for r in page] == expected
        # the consumer refused: the same records, by direct gets
        reader.disabled_until = float("inf")
        assert [r for page in main.read_records(3, top - 2, page_size=700)
                for r in page] == [r for r in expected if 3 <= r[0] <= top - 2]
    finally:
        close_runtime(server.url)
        server.stop()


def test_the_bulk_reader_keeps_its_consumer_past_a_direct_page_and_other_messages(
        tmp_path: Path) -> None:
    """A follower reads the log page by page from where its last page ended. The bulk reader
    goes on with the consumer it has when that start lies a few messages ahead of the
    consumer (the last page came from direct gets, as it does when the consumer had nothing
    just then) or behind it past only other recorders' messages; the pages still hold
    exactly what direct gets return."""
    from eventsourcing.persistence import StoredEvent

    server = NatsServer(store_dir=tmp_path / "nats", server_name="skip").start()
    try:
        main = JetStreamFactory(_stream_env(server.url, "T_SKIP")).application_recorder()
        other = JetStreamFactory(_stream_env(server.url, "T_SKIP", "other")).application_recorder()

        def write(n: int) -> None:
            for _ in range(n):
                main.insert_events([StoredEvent(uuid.uuid4(), 1, "tests.topic:E", b"{}")])

        def read_from(start: int) -> list[Any]:
            return [(n.id, n.originator_id) for n in main.prefetch(start, 100).result()]

        def direct_from(start: int) -> list[Any]:
            return [(n.id, n.originator_id) for n in main.select_notifications(start, 100)]

        write(5)
        page = read_from(1)
        assert page == direct_from(1) and len(page) == 5
        reader = main.__dict__["_log_reader"]
        consumer = reader.consumer
        assert consumer is not None
        # the next events, read the way an empty consumer page falls back to: direct gets
        write(7)
        at = page[-1][0] + 1
        by_direct = direct_from(at)[:4]
        write(3)
        at = by_direct[-1][0] + 1
        assert read_from(at) == direct_from(at) and len(direct_from(at)) == 6
        assert reader.consumer == consumer
        # another recorder's messages after this recorder's last event: read from that event
        # on, the consumer (already past them) goes on
        at = direct_from(1)[-1][0] + 1
        other.insert_events([StoredEvent(uuid.uuid4(), 1, "tests.other:E", b"{}")])
        other.insert_events([StoredEvent(uuid.uuid4(), 1, "tests.other:E", b"{}")])
        assert read_from(at) == []
        write(2)
        assert read_from(at) == direct_from(at) and len(direct_from(at)) == 2
        assert reader.consumer == consumer
        # far ahead of the consumer: a new one, and the same pages
        write(300)
        at = (main.max_notification_id() or 0) - 9
        assert read_from(at) == direct_from(at) and len(direct_from(at)) == 10
        assert reader.consumer != consumer
    finally:
        close_runtime(server.url)
        server.stop()


def test_a_read_ahead_of_its_consumer_asks_the_server_for_the_messages_it_steps_over(
        tmp_path: Path) -> None:
    """A page that starts a few messages ahead of the consumer (the follower stepped over its
    own batch, or read them by direct gets) steps over those messages: the pull asks for them
    too, so a page bounded by `limit` ends at once with its events, the consumer kept. (Asked
    for `limit` alone, the server ended the pull short of the page and said nothing: the read
    waited for its timeout, dropped the consumer and read by direct gets for a while.)"""
    from eventsourcing.persistence import StoredEvent

    server = NatsServer(store_dir=tmp_path / "nats", server_name="ahead").start()
    try:
        main = JetStreamFactory(_stream_env(server.url, "T_AHEAD")).application_recorder()
        main.timeout = 3.0  # the old way's wait, kept short

        def write(n: int) -> None:
            for _ in range(n):
                main.insert_events([StoredEvent(uuid.uuid4(), 1, "tests.topic:E", b"{}")])

        write(5)
        first = main.prefetch(1, 100).result()
        assert len(first) == 5
        reader = main.__dict__["_log_reader"]
        consumer = reader.consumer
        write(7)
        stored = main.select_notifications(first[-1].id + 1, 100)
        assert len(stored) == 7
        at = stored[4].id  # four messages ahead of the consumer
        page = main.prefetch(at, 2).result()
        assert [(n.id, n.originator_id) for n in page] == [
            (n.id, n.originator_id) for n in stored[4:6]]
        assert reader.consumer == consumer and reader.disabled_until == 0.0
        # and the consumer goes on from there
        page = main.prefetch(page[-1].id + 1, 100).result()
        assert [n.id for n in page] == [stored[6].id]
        assert reader.consumer == consumer and reader.disabled_until == 0.0
    finally:
        close_runtime(server.url)
        server.stop()


def test_last_topics_names_each_aggregates_last_event_in_few_reads(tmp_path: Path) -> None:
    """`last_topics` answers the topic of each aggregate's last event (None for one with
    none), for more aggregates than one multi-subject read holds, repeats and string ids
    included; and it asks the server once per `MULTI_LAST`, not once per aggregate."""
    from eventsourcing.persistence import StoredEvent

    from bus.jetstream import directget as directget_module

    server = NatsServer(store_dir=tmp_path / "nats", server_name="topics").start()
    try:
        env = _stream_env(server.url, "T_TOPICS")
        rec = JetStreamFactory(env).application_recorder()
        n = directget_module.MULTI_LAST + 44
        ids: list[Any] = [uuid.uuid4() for _ in range(n)]
        want: dict[Any, str | None] = {}
        for i, oid in enumerate(ids):
            events = [StoredEvent(oid, v, f"tests.topic:E{i % 3}_{v}", b"{}")
                      for v in range(1, 2 + i % 3)]
            rec.insert_events(events)
            want[oid] = events[-1].topic
        never = [uuid.uuid4(), uuid.uuid4()]
        want.update(dict.fromkeys(never))
        rec.insert_events([StoredEvent("acct-9", 1, "tests.topic:Opened", b"{}")])
        want["acct-9"] = "tests.topic:Opened"
        asked = [*ids, *never, "acct-9", ids[0]]
        before = rec.messages_read
        reads: list[Any] = []
        direct_get = rec._direct_get  # type: ignore[attr-defined]

        async def counted(req: dict[str, Any]) -> Any:
            reads.append(req)
            return await direct_get(req)

        rec._direct_get = counted  # type: ignore[attr-defined]
        got = rec.last_topics(asked)
        assert got == {oid: want[oid] for oid in asked}
        assert len(reads) == 2 and all(len(r["multi_last"]) <= directget_module.MULTI_LAST
                                       for r in reads)
        assert rec.messages_read - before == n + 1  # one message per aggregate that has one
        assert rec.last_topics([]) == {}
    finally:
        close_runtime(server.url)
        server.stop()
