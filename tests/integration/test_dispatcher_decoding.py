"""The dispatcher's fast decoder (bus.transcoder.EventDecoder) builds, from a real log, the
events the library's mapper builds, for every event type the dispatcher folds."""

from __future__ import annotations

import importlib
import inspect
from typing import Any

from eventsourcing.domain import Aggregate, DomainEvent

from bus.agentbus import ControlLink
from bus.local.server import NatsServer
from domain.lease import JobSpec, Lease
from domain.node import Node
from domain.policy.images import ImagePolicy
from domain.pool import Pool, TenantPolicy
from domain.poolconfig import PoolConfig
from domain.prices import PriceList
from domain.reservation import CapacityReservation
from domain.resources import (
    LeaseId,
    NodeCapabilities,
    NodeId,
    PoolId,
    Resources,
    Shape,
    TenantId,
)
from workers.application import PoolApp
from workers.bootstrap import app_env
from workers.dispatcher import _TOPICS, Dispatcher

SHAPE = Shape.build(cpu_millis=2000, memory_mib=4096)
CAPS = NodeCapabilities(allocatable=Resources(cpu_millis=8000, memory_mib=32768))
JOB = JobSpec(image="registry.example/train:1", command=("python", "train.py"),
              env=(("SEED", "1"),), checkpoint_interval_seconds=60)


def _folded_event_types() -> set[str]:
    """Every event an aggregate of the modules the dispatcher folds records: its nested event
    classes, but the library's bases and snapshots (stored apart from the log)."""
    found: set[str] = set()
    for module in _TOPICS:
        for cls in vars(importlib.import_module(module)).values():
            if inspect.isclass(cls) and issubclass(cls, Aggregate) and cls.__module__ == module:
                found |= {v.__qualname__ for name, v in vars(cls).items()
                          if inspect.isclass(v) and issubclass(v, DomainEvent)
                          and name not in ("Event", "Created", "Snapshot")}
    return found


def _lease(key: str) -> Lease:
    return Lease.request(tenant_id=TenantId("acme"), pool_id=PoolId("p1"), idempotency_key=key,
                         shape=SHAPE, maximum_runtime_seconds=3600, lease_seconds=600, now=0.0,
                         trace_parent="00-" + "a" * 32 + "-" + "b" * 16 + "-01")


def _placed(key: str) -> Lease:
    lease = _lease(key)
    lease.queue(1)
    lease.reserve(2, node_id=NodeId("n1"), commit_timeout_seconds=30, hold_microcredits=500)
    return lease


def _running(key: str) -> Lease:
    lease = _placed(key)
    lease.commit(10, JOB)
    return lease


def _aggregates() -> list[Aggregate]:
    """Aggregates whose pending events are one or more of every type the dispatcher folds."""
    pool = Pool.create(pool_id=PoolId("p1"), now=0)
    pool.configure(PoolConfig(), 1)
    pool.set_price_list(PriceList(), 2)
    pool.set_image_policy(ImagePolicy(), 3)
    pool.list_member("tenant", "acme", 4)
    policy = TenantPolicy.set(pool_id=PoolId("p1"), tenant_id=TenantId("acme"), now=0, weight=2)
    policy.update(weight=3, quota=None, now=5)
    policy.note_voided_reservation(6, keep=20)

    node = Node.register(node_id=NodeId("n1"), pool_id=PoolId("p1"), capabilities=CAPS, now=0)
    node.allocate(LeaseId("l1"), Resources(cpu_millis=1000, memory_mib=1024), 1)
    node.allocate_many([(LeaseId("l2"), Resources(cpu_millis=1000, memory_mib=1024)),
                        (LeaseId("l3"), Resources(cpu_millis=1000, memory_mib=1024))], 2)
    node.free(LeaseId("l1"), 3)
    node.heartbeat(4)
    node.cordon(5, "look")
    node.uncordon(6)
    node.drain(7, "move")
    node.mark_lost(8)
    node.reregister(CAPS, 9)
    spare = Node.register(node_id=NodeId("n2"), pool_id=PoolId("p1"), capabilities=CAPS, now=0)
    spare.enter_maintenance(1, "firmware")
    spare.end_maintenance(2)

    done = _running("done")
    done.job_started(11, epoch=done.epoch)
    done.heartbeat(12, epoch=done.epoch, checkpoint_at=12)
    done.renew(13)
    done.open_session(13.5, session_id="0123456789abcdef0123456789abcdef", kind="exec",
                      command=("sh",), tty=True, rows=24, cols=80)
    done.job_exited(14, epoch=done.epoch, exit_code=0)
    done.run_job(15, JOB)
    done.job_failed(16, epoch=done.epoch, reason="oom")
    done.release(17)
    rejected = _lease("rejected")
    rejected.reject(1, "quota", ["cpu_millis"])
    voided = _placed("voided")
    voided.void_reservation(40)
    cancelled = _running("cancelled")
    cancelled.cancel(20)
    cancelled.confirm_stopped(21)
    expired = _running("expired")
    expired.expire(700)
    expired.begin_reconciliation(701)
    preempted = _running("preempted")
    preempted.notice_preemption(20, grace_seconds=15, requeue=False)
    preempted.confirm_stopped(25)
    preempted.requeue(26)
    retried = _running("retried")  # an attempt that ended badly, run again (issue 41)
    retried._retried(at=30, attempt=2, reason="failed", exit_code=1, node_id="n1",
                     held_until=None)

    window = CapacityReservation.create(
        reservation_id="r1", pool_id=PoolId("p1"), tenant_id=None, resources=Resources(),
        count=1, node_ids=("n2",), start_at=100.0, duration_seconds=50.0, now=0.0)
    window.begin_drain(60)
    window.delete(70)
    return [pool, policy, node, spare, done, rejected, voided, cancelled, expired, preempted,
            retried, window]


def test_the_fast_decoder_builds_the_mappers_event_for_every_type_the_dispatcher_folds(
    fresh_nats: NatsServer,
) -> None:
    app = PoolApp(env=app_env(fresh_nats.url))
    try:
        for agg in _aggregates():
            app.save(agg)
        dispatcher = Dispatcher(app, ControlLink(fresh_nats.url))
        fallbacks: list[Any] = []

        class Counting:
            """The mapper, counting the events the fast decoder hands it."""

            def to_domain_event(self, n: Any) -> Any:
                fallbacks.append(n)
                return app.mapper.to_domain_event(n)

        dispatcher._decode.mapper = Counting()
        notes = [n for n in app.recorder.select_notifications(start=1, limit=10_000)
                 if n.topic.startswith(_TOPICS)]
        seen: set[str] = set()
        for note in notes:
            fast, plain = dispatcher._decode(note), app.mapper.to_domain_event(note)
            seen.add(type(plain).__qualname__)
            assert type(fast) is type(plain), note.topic
            assert fast.__dict__ == plain.__dict__, note.topic
            assert [type(v) for v in fast.__dict__.values()] == [
                type(v) for v in plain.__dict__.values()], note.topic
        assert seen == _folded_event_types()
        assert not fallbacks  # each took the fast way: nothing here needs the mapper
    finally:
        app.close()
