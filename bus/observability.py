"""OpenTelemetry for every pool process: traces and metrics, W3C trace context in NATS headers.

Environment variables: docs/architecture.md#tracing-and-metrics.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import threading
import weakref
from collections.abc import Iterable, Mapping
from typing import Any

from opentelemetry import metrics, propagate, trace
from opentelemetry.context import Context
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.trace import Span

from bus.headers import HDR_TRACEPARENT

log = logging.getLogger(__name__)

ENV_EXPORTER = "POOL_OTEL_EXPORTER"
ENV_METRIC_INTERVAL = "POOL_OTEL_METRIC_INTERVAL_MS"
EXPORTERS = ("none", "console", "otlp")
INSTRUMENTATION = "computepool"
TRACEPARENT = HDR_TRACEPARENT  # kept: callers import it from here
# version 00: trace id (32 hex, not all zero), span id (16 hex, not all zero), flags
_TRACEPARENT = re.compile(r"^00-(?!0{32})[0-9a-f]{32}-(?!0{16})[0-9a-f]{16}-[0-9a-f]{2}$")

_lock = threading.Lock()
_state: dict[str, Any] = {"exporter": None, "tracer_provider": None, "meter_provider": None}


# -- setup ---------------------------------------------------------------------------------------


def setup(
    service_name: str = "computepool",
    *,
    exporter: str | None = None,
    span_exporter: Any = None,
    metric_reader: Any = None,
) -> str:
    """Install the SDK's tracer and meter providers once per process; returns the exporter used.

    `exporter` overrides POOL_OTEL_EXPORTER. `span_exporter` / `metric_reader` (tests: the SDK's
    InMemorySpanExporter / InMemoryMetricReader) are added to whatever was chosen; calling setup
    again only adds those.
    """
    chosen = (exporter or os.environ.get(ENV_EXPORTER) or "none").strip().lower()
    if chosen not in EXPORTERS:
        log.warning("%s=%r is not one of %s: exporting nothing", ENV_EXPORTER, chosen,
                    "|".join(EXPORTERS))
        chosen = "none"
    with _lock:
        if _state["exporter"] is None:
            if chosen == "otlp" and _otlp_exporters() is None:
                print(f"pool: {ENV_EXPORTER}=otlp but opentelemetry-exporter-otlp-proto-http is "
                      "not installed (pip install 'computepool[otlp]'): exporting nothing",
                      file=sys.stderr)
                chosen = "none"
            _state["exporter"] = chosen
            if chosen != "none" or span_exporter is not None or metric_reader is not None:
                _install(service_name, chosen, span_exporter, metric_reader)
        else:
            _add(span_exporter, metric_reader, service_name)
        return str(_state["exporter"])


def _otlp_exporters() -> tuple[Any, Any] | None:
    try:
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    except ImportError:
        return None
    return OTLPSpanExporter, OTLPMetricExporter


def _install(service_name: str, chosen: str, span_exporter: Any, metric_reader: Any) -> None:
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import (
        ConsoleMetricExporter,
        PeriodicExportingMetricReader,
    )
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import (
        BatchSpanProcessor,
        ConsoleSpanExporter,
        SimpleSpanProcessor,
    )

    resource = Resource.create({SERVICE_NAME: os.environ.get("OTEL_SERVICE_NAME", service_name)})
    tp = TracerProvider(resource=resource)
    readers: list[Any] = []
    interval = int(os.environ.get(ENV_METRIC_INTERVAL, "60000"))
    if chosen == "console":
        tp.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter(out=sys.stderr)))
        readers.append(PeriodicExportingMetricReader(ConsoleMetricExporter(out=sys.stderr),
                                                     export_interval_millis=interval))
    elif chosen == "otlp":
        otlp = _otlp_exporters()
        assert otlp is not None
        span_cls, metric_cls = otlp
        tp.add_span_processor(BatchSpanProcessor(span_cls()))
        readers.append(PeriodicExportingMetricReader(metric_cls(),
                                                     export_interval_millis=interval))
    if span_exporter is not None:
        tp.add_span_processor(SimpleSpanProcessor(span_exporter))
    if metric_reader is not None:
        readers.append(metric_reader)
    trace.set_tracer_provider(tp)
    _state["tracer_provider"] = tp
    if readers:
        mp = MeterProvider(resource=resource, metric_readers=readers)
        metrics.set_meter_provider(mp)
        _state["meter_provider"] = mp


def _add(span_exporter: Any, metric_reader: Any, service_name: str) -> None:
    if span_exporter is not None:
        tp = _state["tracer_provider"]
        if tp is None:
            _install(service_name, "none", span_exporter, None)
        else:
            from opentelemetry.sdk.trace.export import SimpleSpanProcessor

            tp.add_span_processor(SimpleSpanProcessor(span_exporter))
    if metric_reader is not None and _state["meter_provider"] is None:
        # the global meter provider can be set once per process: only the first reader sticks
        from opentelemetry.sdk.metrics import MeterProvider

        mp = MeterProvider(metric_readers=[metric_reader])
        metrics.set_meter_provider(mp)
        _state["meter_provider"] = mp


def shutdown() -> None:
    """Flush and stop the providers (at process exit; spans still queued are exported)."""
    for key in ("tracer_provider", "meter_provider"):
        provider = _state.get(key)
        if provider is not None:
            try:
                provider.shutdown()
            except Exception:  # exporting at exit is best effort
                log.debug("otel %s shutdown failed", key, exc_info=True)


def tracer() -> trace.Tracer:
    return trace.get_tracer(INSTRUMENTATION)


def tracing() -> bool:
    """Whether this process records spans: a tracer provider is installed (by `setup` or by
    whoever embeds us). Without one every span is a no-op that only carries its parent."""
    return not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)


def carries_trace(headers: Mapping[str, str] | None) -> bool:
    """Whether received headers name a parent trace (a `traceparent` header, any case)."""
    return headers is not None and any(k.lower() == TRACEPARENT for k in headers)


def meter() -> metrics.Meter:
    return metrics.get_meter(INSTRUMENTATION)


# -- trace context in headers --------------------------------------------------------------------


def inject(headers: dict[str, str] | None = None, context: Context | None = None) -> dict[str, str]:
    """`headers` (a new dict) with the current (or given) context's `traceparent` added."""
    out = dict(headers or {})
    propagate.inject(out, context=context)
    return out


def extract(headers: Mapping[str, str] | None) -> Context:
    """The parent context named by received headers (an empty context when there is none)."""
    carrier = {k.lower(): v for k, v in (headers or {}).items()}
    if not valid_traceparent(carrier.get(TRACEPARENT)):
        carrier.pop(TRACEPARENT, None)
    return propagate.extract(carrier)


def valid_traceparent(value: object) -> bool:
    return isinstance(value, str) and bool(_TRACEPARENT.match(value))


def traceparent(context: Context | None = None) -> str | None:
    """The `traceparent` of the current (or given) span, or None when there is no trace."""
    if trace.get_current_span(context).get_span_context() == trace.INVALID_SPAN_CONTEXT:
        return None  # what the propagator writes for it: nothing
    value = inject({}, context).get(TRACEPARENT)
    return value if valid_traceparent(value) else None


def context_of(trace_parent: str | None) -> Context | None:
    """A parent context from a stored traceparent (e.g. a lease's), or None."""
    if not valid_traceparent(trace_parent):
        return None
    return extract({TRACEPARENT: str(trace_parent)})


def child_span(name: str, trace_parent: str | None, **kwargs: Any) -> Span:
    """A started span whose parent is `trace_parent` (a root span when it is None); end it."""
    return tracer().start_span(name, context=context_of(trace_parent) or Context(), **kwargs)




# -- control-plane metrics -----------------------------------------------------------------------
#
# Instruments are created against the global (proxy) meter, so they bind to the SDK whenever
# setup() installs it. Gauges read the processes that registered themselves (weakly: a stopped
# scheduler or projector drops out on its own).

_schedulers: weakref.WeakSet[Any] = weakref.WeakSet()
_projectors: weakref.WeakSet[Any] = weakref.WeakSet()
_instruments: dict[str, Any] = {}


def _queue_depth(_options: CallbackOptions) -> Iterable[Observation]:
    for s in list(_schedulers):
        for pool_id, ps in list(s.pools.items()):
            depth = len(ps.queue) if ps.queue is not None else 0
            yield Observation(depth, {"pool": pool_id})


def _leases_by_state(_options: CallbackOptions) -> Iterable[Observation]:
    from domain.lease import Lease

    counts: dict[tuple[str, str], int] = {}
    for s in list(_schedulers):
        for agg in list(s.aggregates.full.values()):  # whole aggregates
            if isinstance(agg, Lease):
                key = (str(agg.pool_id), str(agg.state))
                counts[key] = counts.get(key, 0) + 1
        for record in list(s.aggregates.queued.values()):  # queued leases held compactly
            key = (record.pool_id, "queued")
            counts[key] = counts.get(key, 0) + 1
    for (pool_id, state), n in sorted(counts.items()):
        yield Observation(n, {"pool": pool_id, "state": state})


def _projection_lag(_options: CallbackOptions) -> Iterable[Observation]:
    for p in list(_projectors):
        try:
            head = p.app.recorder.max_notification_id() or 0
        except Exception:  # noqa: BLE001, S112 - the bus may be away; report nothing this time
            continue
        yield Observation(max(0, head - p.position), {"projector": "views"})


def _ensure_instruments() -> dict[str, Any]:
    with _lock:
        if not _instruments:
            m = meter()
            _instruments["placements"] = m.create_counter(
                "pool.scheduler.placements", unit="{lease}",
                description="leases placed (reserved on a node); its rate is placements/s")
            _instruments["cycle"] = m.create_counter(
                "pool.scheduler.cycle.outcomes", unit="{lease}",
                description="per scheduling cycle: rejected, voided, expired, preempted, conflicts")
            m.create_observable_gauge("pool.queue.depth", [_queue_depth], unit="{lease}",
                                      description="leases waiting to be placed, per pool")
            m.create_observable_gauge("pool.leases", [_leases_by_state], unit="{lease}",
                                      description="leases by pool and state")
            m.create_observable_gauge("pool.projection.lag", [_projection_lag], unit="{event}",
                                      description="events in the log not yet in the views")
        return _instruments


def watch_scheduler(scheduler: Any) -> None:
    """Report this scheduler's queues and leases (the active one: a standby would double)."""
    _ensure_instruments()
    _schedulers.add(scheduler)


def unwatch_scheduler(scheduler: Any) -> None:
    _schedulers.discard(scheduler)


def watch_projector(projector: Any) -> None:
    _ensure_instruments()
    _projectors.add(projector)


def record_cycle(report: Any) -> None:
    """Count one scheduler cycle's outcomes (a CycleReport)."""
    inst = _ensure_instruments()
    if report.placed:
        inst["placements"].add(report.placed)
    for outcome in ("rejected", "voided", "expired", "preempted", "conflicts"):
        n = getattr(report, outcome, 0)
        if n:
            inst["cycle"].add(n, {"outcome": outcome})
