"""The dispatcher keeping up with a steady log: the next page read while the last one's
records are stored, the timers of a step's pages armed together, the position saved when
orders went out (else at most every POSITION_EVERY_S), everything armed when a step ends,
and a step that keeps finding events ended past STEP_MAX_S, its next read left to the next."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from bus.admin import ensure_all_streams
from bus.agentbus import Armed, ControlLink
from bus.connection import connect
from bus.local.server import NatsServer
from bus.recorders import PlainLogRecorder
from bus.subjects import SCHEDULE_STREAM
from domain.lease import JobSpec, Lease
from domain.resources import NodeId, PoolId, Shape, TenantId
from workers import dispatcher as dispatcher_module
from workers.application import PoolApp
from workers.bootstrap import app_env
from workers.dispatcher import PAGE, Dispatcher

JOB = JobSpec(image="registry.example/train:1", command=("true",))


class _Link(ControlLink):
    """A real link that notes, in one journal shared with the reader, each round of timers,
    each order and each position saved."""

    def __init__(self, url: str, journal: list[str]) -> None:
        super().__init__(url)
        self.journal = journal
        self.saved: list[int] = []

    def schedule_many_started(self, timers: list[tuple[str, str, float]],
                              body: bytes = b"") -> Armed:
        self.journal.append(f"timers {len(timers)}")
        return super().schedule_many_started(timers, body)

    def send(self, node_id: str, verb: str, body: bytes, *, msg_id: str,
             headers: dict[str, str] | None = None) -> None:
        self.journal.append("order")
        super().send(node_id, verb, body, msg_id=msg_id, headers=headers)

    def save_position(self, name: str, position: int) -> None:
        self.journal.append("position")
        self.saved.append(position)
        super().save_position(name, position)


class _Reader(PlainLogRecorder):
    """The app's recorder, noting in the journal each page asked for and each read ahead
    (its own read-ahead's)."""

    reads_ahead = True

    def __init__(self, recorder: Any, journal: list[str]) -> None:
        super().__init__(recorder, timeout=recorder.timeout)
        self.journal = journal

    def select_notifications(self, *args: Any, **kwargs: Any) -> Any:
        self.journal.append("read")
        return self.recorder.select_notifications(*args, **kwargs)

    def prefetch(self, start: int, limit: int, stop: int | None = None) -> Any:
        self.journal.append("read ahead")
        return self.recorder.prefetch(start, limit, stop)


def _leases(app: PoolApp, n: int, *, commit: bool, prefix: str = "r") -> None:
    """`n` leases reserved (a commit deadline each) and, with `commit`, committed (a start
    order each)."""
    shape = Shape.build(cpu_millis=1000, memory_mib=1024)
    for start in range(0, n, 249):
        batch = []
        for i in range(start, min(n, start + 249)):
            lease = Lease.request(tenant_id=TenantId("acme"), pool_id=PoolId("p1"),
                                  idempotency_key=f"{prefix}{i}", shape=shape,
                                  maximum_runtime_seconds=3600, now=0.0, queued=True)
            lease.reserve(1, node_id=NodeId(f"n{i % 7}"), commit_timeout_seconds=4102444800,
                          hold_microcredits=0)
            if commit:
                lease.commit(2, JOB)
            batch.append(lease)
        app.save(*batch)


def _timers_stored(url: str) -> int:
    async def go() -> int:
        nc = await connect(url)
        try:
            info = await nc.jetstream().stream_info(SCHEDULE_STREAM,
                                                    subjects_filter="pool.sched.lease.>")
            return len(info.state.subjects or {})
        finally:
            await nc.close()

    return asyncio.run(go())


@pytest.fixture()
def follower(fresh_nats: NatsServer) -> Any:
    url = fresh_nats.url
    ensure_all_streams(url)
    writer = PoolApp(env=app_env(url))
    reader_app = PoolApp(env=app_env(url))
    journal: list[str] = []
    reader_app.recorder = _Reader(reader_app.recorder, journal)  # type: ignore[assignment]
    link = _Link(url, journal)
    d = Dispatcher(reader_app, link)  # type: ignore[arg-type]
    yield writer, d, link, journal
    link.close()
    reader_app.recorder = reader_app.recorder.recorder  # type: ignore[attr-defined]
    reader_app.close()
    writer.close()


def test_the_next_page_is_asked_for_before_the_last_one_is_sent(follower: Any) -> None:
    writer, d, link, journal = follower
    _leases(writer, 3, commit=True)  # one short page: three leases, three orders
    assert d.step() > 0
    # read, then the next page asked for at once, before the first page's orders go out
    first_order = journal.index("order")
    assert journal[:2] == ["read", "read ahead"] and journal.index("read ahead") < first_order
    assert link.saved[-1] == d.position  # orders went out: the position follows


def test_without_orders_the_step_arms_its_pages_timers_together_and_saves_once(
        follower: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    writer, d, link, journal = follower
    monkeypatch.setattr(dispatcher_module, "POSITION_EVERY_S", 3600.0)
    monkeypatch.setattr(dispatcher_module, "TIMERS_EVERY_S", 3600.0)
    monkeypatch.setattr(dispatcher_module, "TIMERS_BATCH", 10_000)
    _leases(writer, 1200, commit=False)  # reserved only: timers, no orders
    assert d.step() > 2 * PAGE  # several pages in one step
    assert "order" not in journal
    rounds = [e for e in journal if e.startswith("timers")]
    assert rounds == ["timers 1200"]  # every page's, in one round at the step's end
    assert journal[-1] == "position" and link.saved == [d.position]  # saved once, at the end
    assert _timers_stored(link.rt.url) == 1200


def test_a_step_arms_its_timers_in_rounds_when_many_wait(
        follower: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    writer, d, _link, journal = follower
    monkeypatch.setattr(dispatcher_module, "TIMERS_EVERY_S", 3600.0)
    monkeypatch.setattr(dispatcher_module, "TIMERS_BATCH", 700)
    _leases(writer, 1200, commit=False)
    d.step()
    rounds = [int(e.split()[1]) for e in journal if e.startswith("timers")]
    assert len(rounds) > 1 and sum(rounds) == 1200
    assert all(r >= 700 for r in rounds[:-1])  # a round waits until enough are due


def test_a_step_past_its_time_ends_and_the_next_takes_its_read(
        follower: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    writer, d, link, journal = follower
    monkeypatch.setattr(dispatcher_module, "STEP_MAX_S", 0.0)
    _leases(writer, 10, commit=True)  # 30 events, one short page
    first = d.step()
    assert first == 30 and d._ahead is not None  # ended with the next read asked for
    assert [e for e in journal if e.startswith("timers")] == ["timers 10"]  # all armed
    assert link.saved == [d.position]
    _leases(writer, 5, commit=True, prefix="s")
    mark = len(journal)
    total = first + d.step()
    # the step after the first began with the read the first had asked for, not its own
    assert "read" not in journal[mark:]
    steps = 1
    while total < 45 and steps < 10:
        total += d.step()
        steps += 1
    assert total == 45 and d.position == writer.recorder.max_notification_id()
    orders = [e for e in journal if e == "order"]
    assert len(orders) == 15  # a start each, none twice
