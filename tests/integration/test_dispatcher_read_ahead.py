"""The dispatcher's catch-up over many pages, read ahead through the recorder's pull consumer:
the orders a plain page-by-page read sends, each once, also when a send fails mid-page."""

from __future__ import annotations

from typing import Any

import pytest

from bus.admin import ensure_all_streams
from bus.agentbus import Armed
from bus.errors import BusUnavailable
from bus.local.server import NatsServer
from bus.recorders import PlainLogRecorder
from domain.lease import JobSpec, Lease
from domain.resources import NodeId, PoolId, Shape, TenantId
from workers.application import PoolApp
from workers.bootstrap import app_env
from workers.dispatcher import PAGE, Dispatcher

LEASES = 1100  # three events each: the log is several pages
PER_SAVE = 249  # under the 1000-message atomic batch
JOB = JobSpec(image="registry.example/train:1", command=("true",))


class _Link:
    """The part of ControlLink the dispatcher uses, kept in memory; `fail_at`: the send of
    that number raises once, as a bus down for a moment would."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.sent: list[str] = []
        self.positions: dict[str, int] = {}
        self.fail_at = fail_at

    def load_position(self, name: str) -> int:
        return self.positions.get(name, 0)

    def save_position(self, name: str, position: int) -> None:
        self.positions[name] = position

    def ensure_agent_consumer(self, node_id: str) -> None:
        pass

    def schedule_many_started(self, timers: list[tuple[str, str, float]],
                              body: bytes = b"") -> Armed:
        return Armed(None)

    def send(self, node_id: str, verb: str, body: bytes, *, msg_id: str,
             headers: dict[str, str] | None = None) -> None:
        if self.fail_at is not None and len(self.sent) + 1 == self.fail_at:
            self.fail_at = None
            raise BusUnavailable("the bus is down for a moment")
        self.sent.append(msg_id)


def _running_leases(app: PoolApp) -> None:
    shape = Shape.build(cpu_millis=1000, memory_mib=1024)
    for first in range(0, LEASES, PER_SAVE):
        batch = []
        for i in range(first, min(LEASES, first + PER_SAVE)):
            lease = Lease.request(tenant_id=TenantId("acme"), pool_id=PoolId("p1"),
                                  idempotency_key=f"r{i}", shape=shape,
                                  maximum_runtime_seconds=3600, now=0.0, queued=True)
            lease.reserve(1, node_id=NodeId(f"n{i % 7}"), commit_timeout_seconds=60,
                          hold_microcredits=0)
            lease.commit(2, JOB)
            batch.append(lease)
        app.save(*batch)


def _catch_up(d: Dispatcher) -> int:
    n = 0
    while True:
        try:
            got = d.step()
        except BusUnavailable:
            continue  # as the run loop does: the next step sends what is left
        n += got
        if not got:
            return n


@pytest.fixture()
def app(fresh_nats: NatsServer) -> Any:
    ensure_all_streams(fresh_nats.url)
    app = PoolApp(env=app_env(fresh_nats.url))
    _running_leases(app)
    yield app
    app.close()


def test_a_catch_up_read_ahead_sends_what_a_plain_one_does_each_order_once(
    fresh_nats: NatsServer, app: PoolApp,
) -> None:
    top = app.recorder.max_notification_id() or 0
    assert top >= 3 * PAGE
    plain_app = PoolApp(env=app_env(fresh_nats.url))
    readers = [PoolApp(env=app_env(fresh_nats.url)) for _ in range(2)]
    try:
        # the plain path: one exact page at a time, asked for when the one before is done
        plain_app.recorder = PlainLogRecorder(plain_app.recorder)  # type: ignore[assignment]
        plain_link = _Link()
        plain = Dispatcher(plain_app, plain_link)  # type: ignore[arg-type]
        assert _catch_up(plain) == top
        assert len(plain_link.sent) == len(set(plain_link.sent)) == LEASES  # a start each

        link = _Link()
        ahead = Dispatcher(readers[0], link)  # type: ignore[arg-type]
        assert ahead.step() == top  # one step: every page, to the end
        assert link.sent == plain_link.sent
        assert ahead.position == plain.position == top
        assert link.positions == {"dispatcher": top}
        # the pages after the first came from the pull consumer
        reader = readers[0].recorder.__dict__["_log_reader"]
        assert reader.dseq > 0 and reader.disabled_until == 0.0

        # a send that fails mid-log: the read ahead is dropped, the next step goes on from
        # the orders kept in the outbox, and none is sent twice or left out
        # (on the second page, the first one read ahead)
        failing_link = _Link(fail_at=LEASES // 2)
        failing = Dispatcher(readers[1], failing_link)  # type: ignore[arg-type]
        _catch_up(failing)
        assert failing.position == top and failing_link.fail_at is None  # it did fail
        assert failing_link.sent == plain_link.sent
        assert failing_link.positions == {"dispatcher": top}
    finally:
        for a in (plain_app, *readers):
            a.close()
