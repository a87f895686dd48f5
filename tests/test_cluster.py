"""The clustered topology on one machine: three nats-servers, R3 streams, a server SIGKILLed.

Owns the harness's promise: what the recorder acknowledged survives losing a server, any server.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from uuid import UUID

import pytest
from eventsourcing.application import Application
from eventsourcing.domain import Aggregate, event

from bus.admin import describe_streams
from bus.cluster import NatsCluster
from bus.errors import BusError
from bus.runtime import close_runtime, servers
from bus.subjects import EVENTS_STREAM

pytestmark = pytest.mark.slow


class Entry(Aggregate):
    @event("Written")
    def __init__(self, n: int) -> None:
        self.n = n


class Ledger(Application[UUID]):
    pass


@pytest.fixture()
def cluster(tmp_path: Path) -> Iterator[NatsCluster]:
    with NatsCluster(tmp_path / "cluster", nodes=3) as c:
        c.ensure_streams(replicas=3)
        yield c
        close_runtime(c.url)


def test_a_comma_separated_url_names_every_server() -> None:
    assert servers("nats://a:1, nats://b:2,nats://c:3") == ["nats://a:1", "nats://b:2", "nats://c:3"]
    assert servers("nats://a:1") == ["nats://a:1"]


def test_the_cluster_has_a_meta_leader_and_every_stream_at_three_replicas(
    cluster: NatsCluster,
) -> None:
    assert len(cluster.urls) == 3 and cluster.url.count(",") == 2
    assert cluster.healthy()[0]
    streams = {s["name"]: s["replicas"] for s in describe_streams(cluster.url)}
    for name in (EVENTS_STREAM, "POOL_AGENT", "POOL_SCHED", "POOL_TELEMETRY", "KV_pool_leaders",
                 "KV_pool_positions"):
        assert streams.get(name) == 3, (name, streams)


def _append(app: Ledger, n: int, acked: dict[UUID, int], failures: list[str]) -> None:
    entry = Entry(n)
    try:
        app.save(entry)
    except BusError as e:  # refused or unknown outcome: not acknowledged, so not promised
        failures.append(type(e).__name__)
        return
    acked[entry.id] = n


def test_nothing_acknowledged_is_lost_when_the_event_stream_leader_is_sigkilled(
    cluster: NatsCluster,
) -> None:
    app = Ledger(env={"PERSISTENCE_MODULE": "bus.jetstream", "NATS_URL": cluster.url,
                      "NATS_TIMEOUT": "5"})
    acked: dict[UUID, int] = {}
    failures: list[str] = []
    n = 0
    for _ in range(100):
        _append(app, n, acked, failures)
        n += 1

    victim = cluster.stream_leader(EVENTS_STREAM)
    assert victim is not None
    cluster.kill(victim)
    # the two survivors keep a quorum: appends go on once a new stream leader is elected
    deadline = time.monotonic() + 60
    during = 0
    while during < 100 and time.monotonic() < deadline:
        before = len(acked)
        _append(app, n, acked, failures)
        n += 1
        during += len(acked) - before
    assert during == 100, f"only {during} appends acknowledged with one server down: {failures}"

    cluster.restart(victim)
    for _ in range(50):
        _append(app, n, acked, failures)
        n += 1

    # read back through a fresh connection: every acknowledged entry, exactly once
    close_runtime(cluster.url)
    reader = Ledger(env={"PERSISTENCE_MODULE": "bus.jetstream", "NATS_URL": cluster.url})
    notifications = reader.recorder.select_notifications(start=1, limit=10_000)
    stored = [n.originator_id for n in notifications]
    assert len(stored) == len(set(stored)), "an event was stored twice"
    missing = set(acked) - set(stored)
    assert not missing, f"{len(missing)} acknowledged events lost"
    for entry_id, value in list(acked.items())[::25]:
        assert reader.repository.get(entry_id).n == value
    assert len(acked) >= 250
