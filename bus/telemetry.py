"""The telemetry stream and its publisher: samples on `pool.tel.<pool>.<node>.<tenant>.<lease>.<kind>`.

Telemetry is lossy by design: limits retention, core publishes (the stream captures them), and a
publisher that logs a bus hiccup instead of raising it into the agent.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading

import msgspec
from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig

from bus.runtime import BusRuntime
from bus.streams import ensure_stream
from bus.subjects import TELEMETRY_PREFIX, TELEMETRY_STREAM, telemetry_subject
from schemas import v1

TELEMETRY_KINDS: tuple[str, ...] = ("queue", "startup", "execution", "utilization", "failure")

MAX_AGE_S = 7 * 24 * 3600.0
MAX_BYTES = 1024 * 1024 * 1024
# samples waiting for the loop thread; beyond this the publisher drops (telemetry is lossy)
MAX_IN_FLIGHT = 10_000

log = logging.getLogger(__name__)


def telemetry_stream_config(replicas: int = 1) -> StreamConfig:
    """POOL_TELEMETRY: limits retention (7 days, 1 GiB), oldest samples discarded first."""
    return StreamConfig(
        name=TELEMETRY_STREAM,
        subjects=[f"{TELEMETRY_PREFIX}.>"],
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE,
        num_replicas=replicas,
        max_age=MAX_AGE_S,
        max_bytes=MAX_BYTES,
        max_msgs=-1,
        discard=DiscardPolicy.OLD,
        allow_direct=True,
    )


async def ensure_telemetry_stream(js: JetStreamContext, replicas: int = 1) -> None:
    await ensure_stream(js, telemetry_stream_config(replicas))


class TelemetryPublisher:
    """A synchronous facade for agents: `publish` never blocks on the server and never raises
    on a bus hiccup (it logs); it owns its own event-loop thread and connection."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._rt = BusRuntime(url)
        self._lock = threading.Lock()
        self._in_flight = 0
        self._dropped = 0

    def publish(
        self,
        *,
        pool: str,
        node: str,
        tenant: str,
        lease: str,
        kind: str,
        event: v1.TelemetryEvent,
        headers: dict[str, str] | None = None,
    ) -> None:
        if kind not in TELEMETRY_KINDS:
            raise ValueError(f"unknown telemetry kind {kind!r}; one of {TELEMETRY_KINDS}")
        subject = telemetry_subject(pool, node, tenant, lease, kind)
        data = msgspec.json.encode(event)
        with self._lock:
            if self._in_flight >= MAX_IN_FLIGHT:
                self._dropped += 1
                if self._dropped == 1 or self._dropped % 1000 == 0:
                    log.warning("telemetry backlog full: %d samples dropped", self._dropped)
                return
            self._in_flight += 1
        try:
            fut = self._rt.submit(self._publish(subject, data, dict(headers) if headers else None))
        except RuntimeError as e:  # the loop is closed
            with self._lock:
                self._in_flight -= 1
            log.warning("telemetry not published on %s: %s", subject, e)
            return
        fut.add_done_callback(lambda f: self._done(subject, f))

    async def _publish(self, subject: str, data: bytes, headers: dict[str, str] | None) -> None:
        nc = await self._rt.connection()
        await nc.publish(subject, data, headers=headers)

    def _done(self, subject: str, fut: concurrent.futures.Future[None]) -> None:
        with self._lock:
            self._in_flight -= 1
        if fut.cancelled():
            return
        exc = fut.exception()
        if exc is not None:
            log.warning("telemetry not published on %s: %r", subject, exc)

    def flush(self, timeout: float = 5.0) -> None:
        """Wait until queued samples reached the server's socket (best effort; for tests, exit)."""

        async def go() -> None:
            nc = await self._rt.connection()
            await nc.flush(timeout=max(1, int(timeout)))

        try:
            self._rt.run(go(), timeout=timeout + 1)
        except Exception as e:  # noqa: BLE001 - lossy by design
            log.warning("telemetry flush failed: %r", e)

    def close(self) -> None:
        self._rt.close()


__all__ = [
    "TELEMETRY_KINDS",
    "TelemetryPublisher",
    "ensure_telemetry_stream",
    "telemetry_stream_config",
]
