"""One trace from a client's request through the command handler to the scheduler's placement
(and, by the same functions, the agent's start), plus the control-plane metrics and exporters.
"""

from __future__ import annotations

import http.server
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from bus import observability
from bus.local.server import NatsServer
from client.api import PoolClient
from domain.lease import Lease
from domain.resources import PoolId, TenantId
from schemas import v1
from tests.control_plane import FakeClock, lease_body, node_body, setup_pool, start

SPANS = InMemorySpanExporter()
METRICS = InMemoryMetricReader()


@pytest.fixture()
def spans() -> Iterator[InMemorySpanExporter]:
    # the SDK's providers are global and set once per process: every test adds to the same ones
    observability.setup(span_exporter=SPANS, metric_reader=METRICS)
    SPANS.clear()
    yield SPANS


def _metrics() -> dict[str, list[tuple[dict[str, Any], float]]]:
    out: dict[str, list[tuple[dict[str, Any], float]]] = {}
    data = METRICS.get_metrics_data()
    for rm in data.resource_metrics if data else []:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                out[m.name] = [(dict(p.attributes or {}), p.value) for p in m.data.data_points]
    return out


def test_one_trace_spans_request_command_and_placement(
    fresh_nats: NatsServer, spans: InMemorySpanExporter
) -> None:
    clock = FakeClock()
    cp = start(fresh_nats.url, clock)
    admin = PoolClient(fresh_nats.url)
    alpha = PoolClient(fresh_nats.url, "alpha")
    try:
        setup_pool(admin, tenants={"alpha": 1.0})
        assert admin.admin("node.register", node_body("n1"))["ok"]
        spans.clear()
        reply = alpha.request_lease(lease_body("traced"))
        assert reply["ok"], reply
        lease_id = reply["lease"]["lease_id"]
        observability.watch_scheduler(cp.scheduler)
        report = cp.scheduler.cycle()
        assert report.placed == 1

        by_name = {s.name: s for s in spans.get_finished_spans()}
        request, command, place = by_name["request"], by_name["lease.request"], by_name["place"]
        trace_id = request.context.trace_id
        assert command.context.trace_id == trace_id and place.context.trace_id == trace_id
        assert command.parent is not None and command.parent.span_id == request.context.span_id
        assert place.parent is not None and place.parent.span_id == command.context.span_id
        assert place.attributes is not None and place.attributes["pool.node_id"] == "n1"

        # the lease remembers the command's context: what the dispatcher copies into the
        # agent's start command, and what the agent's `extract` continues
        stored = cp.app.get("alpha", lease_id)
        assert stored.trace_parent is not None
        assert stored.trace_parent.startswith(f"00-{trace_id:032x}-{command.context.span_id:016x}-")
        tracer = observability.tracer()
        with tracer.start_as_current_span(
            "agent.start", context=observability.extract({"traceparent": stored.trace_parent})
        ) as agent_span:
            assert agent_span.get_span_context().trace_id == trace_id

        got = _metrics()
        assert sum(v for _a, v in got["pool.scheduler.placements"]) >= 1
        assert ({"pool": "p1", "state": "reserved"}, 1) in got["pool.leases"]
        assert ({"pool": "p1"}, 0) in got["pool.queue.depth"]
    finally:
        observability.unwatch_scheduler(cp.scheduler)
        alpha.close()
        admin.close()
        cp.stop()


def test_a_refused_command_is_traced_with_its_error_code(
    fresh_nats: NatsServer, spans: InMemorySpanExporter
) -> None:
    cp = start(fresh_nats.url, FakeClock())
    alpha = PoolClient(fresh_nats.url, "alpha")
    try:
        reply = alpha.request_lease(lease_body("k", pool="no-such-pool"))
        assert not reply["ok"]
        command = next(s for s in spans.get_finished_spans() if s.name == "lease.request")
        assert command.attributes is not None
        assert command.attributes["pool.error.code"] == reply["error"]["code"]
    finally:
        alpha.close()
        cp.stop()


def test_trace_context_round_trips_through_headers_and_junk_is_ignored(
    spans: InMemorySpanExporter,
) -> None:
    with observability.tracer().start_as_current_span("outer") as outer:
        headers = observability.inject({"Nats-Msg-Id": "x"})
    assert headers["Nats-Msg-Id"] == "x"
    assert observability.valid_traceparent(headers["traceparent"])
    ctx = observability.extract(headers)
    with observability.tracer().start_as_current_span("inner", context=ctx) as inner:
        assert inner.get_span_context().trace_id == outer.get_span_context().trace_id
    assert observability.traceparent() is None  # no current span here
    for junk in ("", "garbage", "00-" + "0" * 32 + "-" + "1" * 16 + "-01", None):
        assert observability.context_of(junk) is None
        with observability.tracer().start_as_current_span(
            "fresh", context=observability.extract({"traceparent": junk} if junk else {})
        ) as fresh:
            assert fresh.get_span_context().trace_id != outer.get_span_context().trace_id


def test_a_lease_requested_before_tracing_existed_still_loads() -> None:
    lease = Lease.request(tenant_id=TenantId("t"), pool_id=PoolId("p"), idempotency_key="k",
                          shape=v1.ResourceShape(cpu_millis=1, memory_mib=1).to_domain(),
                          maximum_runtime_seconds=60, now=1.0)
    (requested, *_rest) = lease.collect_events()
    requested.__dict__.pop("trace_parent", None)  # as stored by the previous version
    again = requested.mutate(None)
    assert isinstance(again, Lease) and again.trace_parent is None


# -- exporters, each in a process of its own (the SDK's providers are global) -----------------

_SCRIPT = """
from bus import observability as o
print(o.setup("pool-test"), flush=True)
with o.tracer().start_as_current_span("exported-span"):
    pass
o.shutdown()
"""


def _run(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("POOL_", "OTEL_"))}
    return subprocess.run([sys.executable, "-c", _SCRIPT], env={**base, **env},
                          capture_output=True, text=True, timeout=60, check=False)


def test_the_console_exporter_prints_spans_and_none_prints_nothing() -> None:
    console = _run({"POOL_OTEL_EXPORTER": "console"})
    assert console.stdout.strip() == "console" and '"exported-span"' in console.stderr
    quiet = _run({})
    assert quiet.stdout.strip() == "none" and "exported-span" not in quiet.stderr


def test_the_otlp_exporter_posts_spans_over_http() -> None:
    pytest.importorskip("opentelemetry.exporter.otlp.proto.http.trace_exporter",
                        reason="opentelemetry-exporter-otlp-proto-http not installed")
    paths: list[str] = []

    class Collector(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # the stdlib's name
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            paths.append(self.path)
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.end_headers()

        def log_message(self, *_args: Any) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Collector)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        out = _run({"POOL_OTEL_EXPORTER": "otlp",
                    "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{server.server_port}"})
        assert out.stdout.strip() == "otlp", out.stderr
        assert "/v1/traces" in paths, (paths, out.stderr)
    finally:
        server.shutdown()
