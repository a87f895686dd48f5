"""The eventsourcing persistence module on JetStream (`PERSISTENCE_MODULE=bus.jetstream`)."""

from __future__ import annotations

import logging
from typing import Any

from eventsourcing.persistence import (
    AggregateRecorder,
    ApplicationRecorder,
    InfrastructureFactory,
    ProcessRecorder,
    Transcoder,
)
from eventsourcing.utils import Environment, resolve_topic, strtobool

from bus.jetstream.application import (
    JetStreamApplicationRecorder,
    JetStreamProcessRecorder,
    JetStreamSubscription,
    JetStreamTrackingRecorder,
)
from bus.jetstream.natsfast import internals_changed
from bus.jetstream.recorder import JetStreamAggregateRecorder, JetStreamRecorder
from bus.jetstream.snapshots import JetStreamSnapshotRecorder
from bus.jetstream.wire import DEFAULT_URL, MAX_BATCH, REQUEST_TIMEOUT, LogRecord
from bus.runtime import get_runtime
from bus.streams import (
    ensure_event_stream,
    ensure_stream,
    snapshot_stream_config,
    snapshot_stream_name,
)
from bus.subjects import EVENTS_STREAM
from bus.transcoder import MsgspecTranscoder

log = logging.getLogger(__name__)

__all__ = [
    "MAX_BATCH",
    "Factory",
    "JetStreamAggregateRecorder",
    "JetStreamApplicationRecorder",
    "JetStreamFactory",
    "JetStreamProcessRecorder",
    "JetStreamRecorder",
    "JetStreamSnapshotRecorder",
    "JetStreamSubscription",
    "JetStreamTrackingRecorder",
    "LogRecord",
    "internals_changed",
]


class JetStreamFactory(InfrastructureFactory[JetStreamTrackingRecorder]):
    """Builds JetStream recorders from NATS_URL / NATS_STREAM / NATS_SNAPSHOT_STREAM /
    NATS_REPLICAS in the environment."""

    NATS_URL = "NATS_URL"
    POOL_NATS_URL = "POOL_NATS_URL"
    NATS_STREAM = "NATS_STREAM"
    # the snapshots' stream (default: bus.streams.snapshot_stream_name of NATS_STREAM)
    NATS_SNAPSHOT_STREAM = "NATS_SNAPSHOT_STREAM"
    NATS_REPLICAS = "NATS_REPLICAS"
    NATS_TIMEOUT = "NATS_TIMEOUT"
    # a bus runtime of its own (bus.runtime.get_runtime's name) rather than the process's
    NATS_RUNTIME = "NATS_RUNTIME"
    CREATE_TABLE = "CREATE_TABLE"

    def __init__(self, env: Environment | Any | None) -> None:
        super().__init__(env)
        self.url = self.env.get(self.NATS_URL) or self.env.get(self.POOL_NATS_URL) or DEFAULT_URL
        self.stream = self.env.get(self.NATS_STREAM) or EVENTS_STREAM
        self.snapshot_stream = (self.env.get(self.NATS_SNAPSHOT_STREAM)
                                or snapshot_stream_name(self.stream))
        self.replicas = int(self.env.get(self.NATS_REPLICAS) or 1)
        self.timeout = float(self.env.get(self.NATS_TIMEOUT) or REQUEST_TIMEOUT)
        self.app_name = self.env.name or "default"
        self.runtime = get_runtime(self.url, self.env.get(self.NATS_RUNTIME) or "")
        self._stream_ensured = False
        # the application recorder built last: the one a snapshot recorder's events are in
        self._events: JetStreamRecorder | None = None

    def _ensure_stream(self) -> None:
        if self._stream_ensured or not strtobool(self.env.get(self.CREATE_TABLE) or "yes"):
            return

        async def go() -> None:
            await ensure_event_stream(
                await self.runtime.jetstream(), replicas=self.replicas, name=self.stream
            )

        self.runtime.run(go(), self.timeout + 5)
        self._stream_ensured = True

    def _ensure_snapshot_stream(self) -> None:
        """Create or update the snapshot stream where this factory makes streams. A failure
        is no reason not to start: without the stream, loads read whole histories
        (bus.jetstream.snapshots)."""
        if not strtobool(self.env.get(self.CREATE_TABLE) or "yes"):
            return

        async def go() -> None:
            await ensure_stream(await self.runtime.jetstream(), snapshot_stream_config(
                replicas=self.replicas, name=self.snapshot_stream))

        try:
            self.runtime.run(go(), self.timeout + 5)
        except Exception as e:  # noqa: BLE001 - snapshots are an optimisation
            log.warning("snapshot stream %s not made: %s", self.snapshot_stream, e)

    def _kwargs(self, kind: str) -> dict[str, Any]:
        self._ensure_stream()
        return {
            "stream": self.stream,
            "kind": kind,
            "tracking_owner": self.app_name,
            "timeout": self.timeout,
        }

    def transcoder(self) -> Transcoder:
        if self.env.get(self.TRANSCODER_TOPIC):
            return super().transcoder()
        return MsgspecTranscoder()

    def aggregate_recorder(self, purpose: str = "events") -> AggregateRecorder:
        if purpose == "snapshots":
            # snapshots live in a stream of their own, on pool.snap.<application>.<id>
            kwargs = self._kwargs(self.app_name)
            self._ensure_snapshot_stream()
            snapshots = JetStreamSnapshotRecorder(
                self.runtime, **{**kwargs, "stream": self.snapshot_stream},
                log_stream=self.stream)
            # snapshots say where their event lies in the application's log (seek_from)
            snapshots.events = self._events
            return snapshots
        kind = self.app_name if purpose == "events" else f"{self.app_name}_{purpose}"
        return JetStreamAggregateRecorder(self.runtime, **self._kwargs(kind))

    def application_recorder(self) -> ApplicationRecorder:
        topic = self.env.get(self.APPLICATION_RECORDER_TOPIC)
        cls: type[JetStreamApplicationRecorder] = (
            resolve_topic(topic) if topic else JetStreamApplicationRecorder
        )
        recorder = cls(self.runtime, **self._kwargs(self.app_name))
        self._events = recorder
        return recorder

    def tracking_recorder(
        self, tracking_recorder_class: type[JetStreamTrackingRecorder] | None = None
    ) -> JetStreamTrackingRecorder:
        if tracking_recorder_class is None:
            topic = self.env.get(self.TRACKING_RECORDER_TOPIC)
            tracking_recorder_class = resolve_topic(topic) if topic else JetStreamTrackingRecorder
        assert tracking_recorder_class is not None
        return tracking_recorder_class(self.runtime, **self._kwargs(self.app_name))

    def process_recorder(self) -> ProcessRecorder:
        topic = self.env.get(self.PROCESS_RECORDER_TOPIC)
        cls: type[JetStreamProcessRecorder] = (
            resolve_topic(topic) if topic else JetStreamProcessRecorder
        )
        return cls(self.runtime, **self._kwargs(self.app_name))

    def close(self) -> None:
        # the runtime is shared by every factory in the process; it closes at exit
        pass


Factory = JetStreamFactory
