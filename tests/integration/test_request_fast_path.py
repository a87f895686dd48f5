"""A new lease request is answered on the bus's loop, without a worker thread; anything that
needs a read (a retry, a refusal, a cold cache) is answered by the thread path as before."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from bus.local.server import NatsServer
from client.api import PoolClient
from projections.decisions import count_events
from tests.control_plane import (
    FakeClock,
    lease_body,
    setup_pool,
    start,
    threaded_subjects,
)
from workers.plane import ControlPlane

Plane = tuple[ControlPlane, PoolClient, list[str]]


@pytest.fixture()
def plane(fresh_nats: NatsServer) -> Iterator[Plane]:
    cp = start(fresh_nats.url, FakeClock())
    threaded = threaded_subjects(cp)
    admin = PoolClient(fresh_nats.url)
    setup_pool(admin, tenants={"alpha": 1.0})
    admin.close()
    alpha = PoolClient(fresh_nats.url, "alpha")
    yield cp, alpha, threaded
    alpha.close()
    cp.stop()


def _requests(threaded: list[str]) -> int:
    return sum(1 for s in threaded if s.endswith(".lease.request"))


def _events(cp: ControlPlane) -> int:
    return cp.app.recorder.max_notification_id() or 0


def test_a_new_request_is_answered_on_the_loop_once_its_policies_are_cached(
        plane: Plane) -> None:
    cp, alpha, threaded = plane
    first = alpha.request_lease(lease_body("cold"))
    assert first["ok"], first
    assert _requests(threaded) == 1  # nothing cached yet: read on a thread
    for i in range(5):
        r = alpha.request_lease(lease_body(f"warm-{i}"))
        assert r["ok"], r
        assert r["lease"]["state"] == "queued" and r["lease"]["tenant"] == "alpha"
    assert _requests(threaded) == 1
    counts = count_events(cp.app, {"LeaseRequested"})
    assert sum(counts.values()) == 6 and set(counts.values()) == {1}


def test_a_retry_on_the_loop_is_answered_with_what_it_made_and_appends_nothing(
        plane: Plane) -> None:
    cp, alpha, threaded = plane
    assert alpha.request_lease(lease_body("warm"))["ok"]
    made = alpha.request_lease({**lease_body("twice"), "count": 3})
    assert made["ok"], made
    before, on_threads = _events(cp), _requests(threaded)
    again = alpha.request_lease({**lease_body("twice"), "count": 3})
    assert again["ok"], again
    assert again["result"]["lease_ids"] == made["result"]["lease_ids"]
    assert _events(cp) == before
    assert _requests(threaded) == on_threads + 1  # the refused save went to a thread


@pytest.mark.parametrize(("body", "code"), [
    ({**lease_body("other"), "maximum_runtime_seconds": 601}, "idempotency_conflict"),
    (lease_body("k2", priority="no-such-class"), None),
])
def test_a_refusal_on_the_loop_gets_the_thread_paths_typed_error(
        plane: Plane, body: dict[str, Any], code: str | None) -> None:
    cp, alpha, _threaded = plane
    assert alpha.request_lease(lease_body("other"))["ok"]
    before = _events(cp)
    fast = alpha.request_lease(body)
    assert not fast["ok"] and fast["error"]["code"]
    if code is not None:
        assert fast["error"]["code"] == code
    # the same request answered by the thread path alone says the same
    on_loop = cp.commands.fast  # type: ignore[union-attr]
    cp.commands.fast = None  # type: ignore[union-attr]
    try:
        slow = alpha.request_lease(body)
    finally:
        cp.commands.fast = on_loop  # type: ignore[union-attr]
    assert slow["error"] == fast["error"]
    assert _events(cp) == before


def test_a_malformed_request_is_refused_on_the_loop_with_its_schema_error(
        plane: Plane) -> None:
    _cp, alpha, threaded = plane
    r = alpha.call("pool.cmd.alpha.lease.request", {"pool_id": "p1"})
    assert not r["ok"] and r["error"]["code"] in ("missing_field", "invalid_field")
    assert _requests(threaded) == 0


def test_a_policy_past_its_time_is_read_again_on_a_thread_while_the_loop_answers(
        plane: Plane, monkeypatch: pytest.MonkeyPatch) -> None:
    """Past the cache's time to live an unchanged pool and tenant policy still answer new
    requests on the loop; one thread per policy reads it again meanwhile."""
    import time

    from workers.application import core

    cp, alpha, threaded = plane
    assert alpha.request_lease(lease_body("cold"))["ok"]
    cached = dict(cp.app.store._policies)
    assert len(cached) == 2  # the pool and alpha's policy
    monkeypatch.setattr(core, "POLICY_CACHE_SECONDS", 600.0)
    for key, (value, _until) in cached.items():
        cp.app.store._policies[key] = (value, time.monotonic() - 1)  # past its time
    on_threads = _requests(threaded)
    for i in range(5):
        assert alpha.request_lease(lease_body(f"late-{i}"))["ok"]
    assert _requests(threaded) == on_threads  # none left the loop
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not all(
            cp.app.store._policies[k][1] > time.monotonic() + 300 for k in cached):
        time.sleep(0.05)
    assert all(cp.app.store._policies[k][1] > time.monotonic() + 300 for k in cached)  # read again
    assert not cp.app.store._refreshing


def test_with_tracing_off_a_request_skips_the_no_op_span_and_keeps_its_parent(
        plane: Plane, monkeypatch: pytest.MonkeyPatch) -> None:
    """No tracer provider: a request naming no parent trace is answered on the loop without
    the span machinery and records no trace; one naming a parent goes through the span, whose
    no-op carries the parent into the lease as before."""
    from opentelemetry import trace

    from bus import observability
    from domain import Lease
    from workers import commands

    cp, alpha, threaded = plane
    assert alpha.request_lease(lease_body("warm"))["ok"]  # policies cached
    monkeypatch.setattr(observability, "tracing", lambda: False)
    monkeypatch.setattr(observability, "tracer", lambda: trace.NoOpTracer())
    spans: list[str] = []
    real_use_span = commands.use_span

    def counting(span: Any, *args: Any, **kwargs: Any) -> Any:
        spans.append("span")
        return real_use_span(span, *args, **kwargs)

    monkeypatch.setattr(commands, "use_span", counting)
    on_threads = _requests(threaded)

    r = alpha.request_lease(lease_body("plain"))
    assert r["ok"] and r["lease"]["state"] == "queued", r
    assert spans == [] and _requests(threaded) == on_threads
    assert cp.app.repository.get(Lease.create_id("alpha", "plain")).trace_parent is None

    bad = alpha.call("pool.cmd.alpha.lease.request", {"pool_id": "p1"})
    assert not bad["ok"] and bad["error"]["code"] in ("missing_field", "invalid_field")
    assert spans == [] and _requests(threaded) == on_threads

    parent = trace.SpanContext(trace_id=0x1234, span_id=0x5678, is_remote=False,
                               trace_flags=trace.TraceFlags(1))
    with trace.use_span(trace.NonRecordingSpan(parent)):
        r = alpha.request_lease(lease_body("traced"))
    assert r["ok"], r
    assert spans == ["span"] and _requests(threaded) == on_threads
    stored = cp.app.repository.get(Lease.create_id("alpha", "traced")).trace_parent
    assert stored == f"00-{0x1234:032x}-{0x5678:016x}-01"


def test_a_no_op_span_without_a_parent_carries_no_trace() -> None:
    """What the skipped span would have given a request naming no parent: no traceparent."""
    from opentelemetry import trace

    from bus import observability

    span = trace.NoOpTracer().start_span("x", context=observability.extract({}))
    with trace.use_span(span):
        assert observability.traceparent() is None
    parent = "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"
    span = trace.NoOpTracer().start_span(
        "x", context=observability.extract({"TraceParent": parent}))
    assert observability.carries_trace({"TraceParent": parent})
    with trace.use_span(span):
        assert observability.traceparent() == parent


def test_a_request_handed_to_a_thread_reads_nothing_on_the_loop(
        plane: Plane, monkeypatch: pytest.MonkeyPatch) -> None:
    """Giving back the token of a request the loop hands to a thread read the pool again when
    its cache entry was past its time: on the loop, where a quorum loss once held every answer
    due there for 45 s (fault scenario 2)."""
    import threading
    import time

    cp, alpha, _threaded = plane
    assert alpha.request_lease(lease_body("warm"))["ok"]
    made = alpha.request_lease(lease_body("again"))
    assert made["ok"], made
    reads_on_loop: list[str] = []
    real = cp.app.store.pool

    def spy(pool_id: str) -> Any:
        if threading.current_thread().name.startswith("bus-runtime"):
            reads_on_loop.append(pool_id)
        return real(pool_id)

    monkeypatch.setattr(cp.app.store, "pool", spy)
    for key, (value, _until) in list(cp.app.store._policies.items()):
        cp.app.store._policies[key] = (value, time.monotonic() - 1)  # past its time
    again = alpha.request_lease(lease_body("again"))  # a retry: the loop hands it to a thread
    assert again["ok"] and again["lease"]["lease_id"] == made["lease"]["lease_id"], again
    assert reads_on_loop == []
