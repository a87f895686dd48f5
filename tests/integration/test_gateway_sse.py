"""Server-Sent Events through the real gateway: a lease's changes and a tenant's telemetry,
each resumed from Last-Event-ID."""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from bus.telemetry import TelemetryPublisher
from schemas import v1
from tests.gateway_stack import Stack, gateway_stack, sse_events
from tests.placed import place_on

BODY = {"pool_id": "p1", "shape": {"cpu_millis": 100, "memory_mib": 64},
        "maximum_runtime_seconds": 600}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, database_url: str) -> Iterator[Stack]:
    from projections.views import drop_schema

    schema = "views_gwsse_" + uuid.uuid4().hex[:8]
    home: Path = tmp_path_factory.mktemp("gwsse")
    try:
        with gateway_stack(home, database_url, schema) as s:
            yield s
    finally:
        drop_schema(database_url, schema)


def test_a_lease_stream_shows_each_change_and_resumes_after_the_last_seen(stack: Stack) -> None:
    with stack.client("alpha") as c:
        lid = c.post("/v1/compute-leases", json=BODY).json()["lease_id"]
        with c.stream("GET", f"/v1/compute-leases/{lid}/events") as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            first = sse_events(r, 1)[0]
        assert first["event"] == "lease"
        seen = json.loads(first["data"])
        assert (seen["lease_id"], seen["state"], seen["previous_state"]) == \
            (lid, "queued", None)
        assert c.post(f"/v1/compute-leases/{lid}/cancel", json={}).status_code == 200
        # resuming after what was seen: only the later changes, and the stream ends with the
        # terminal one
        with c.stream("GET", f"/v1/compute-leases/{lid}/events",
                      headers={"Last-Event-ID": first["id"]}) as r:
            rest = sse_events(r, 10)
        states = [json.loads(e["data"])["state"] for e in rest]
        assert states[0] != "queued" and states[-1] == "cancelled"
        assert [int(e["id"]) for e in rest] == sorted(int(e["id"]) for e in rest)
        assert int(rest[0]["id"]) > int(first["id"])
        # resuming after the terminal change: nothing more to say
        with c.stream("GET", f"/v1/compute-leases/{lid}/events",
                      headers={"Last-Event-ID": rest[-1]["id"]}) as r:
            assert sse_events(r, 10) == []
        bad = c.get(f"/v1/compute-leases/{lid}/events", headers={"Last-Event-ID": "x1"})
        assert bad.status_code == 422 and bad.json()["code"] == "invalid_field"
    with stack.client("beta") as c:  # another tenant's lease reads as missing
        assert c.get(f"/v1/compute-leases/{lid}/events").status_code == 404


def test_an_ended_lease_s_stream_waits_for_its_end_to_reach_the_feed(
        stack: Stack, monkeypatch: pytest.MonkeyPatch) -> None:
    """The command service says a lease ended before the feed holds its terminal record (the
    feed is written after the command): a stream opened in between still ends with it."""
    from workers.feed import FeedPublisher

    release = threading.Event()
    flush = FeedPublisher.flush

    def held(self: FeedPublisher, position: int) -> None:
        release.wait(30)
        flush(self, position)

    with stack.client("alpha") as c:
        lid = c.post("/v1/compute-leases", json=BODY).json()["lease_id"]
        with c.stream("GET", f"/v1/compute-leases/{lid}/events") as r:
            first = sse_events(r, 1)[0]
        monkeypatch.setattr(FeedPublisher, "flush", held)
        try:
            assert c.post(f"/v1/compute-leases/{lid}/cancel", json={}).status_code == 200
            got: list[list[dict[str, str]]] = []

            def read() -> None:
                with c.stream("GET", f"/v1/compute-leases/{lid}/events",
                              headers={"Last-Event-ID": first["id"]}) as r:
                    got.append(sse_events(r, 10))

            reader = threading.Thread(target=read)
            reader.start()
            time.sleep(0.5)  # the stream is open while the feed lacks the end
        finally:
            release.set()
        reader.join(30)
        states = [json.loads(e["data"])["state"] for e in got[0]]
        assert states and states[-1] == "cancelled"


def test_telemetry_streams_only_the_tenants_own_and_resumes_by_sequence(stack: Stack) -> None:
    lease = "tel-" + uuid.uuid4().hex[:8]
    for tenant in ("alpha", "beta"):
        place_on(stack.service_url, tenant, lease, "n1")
    pub = TelemetryPublisher(stack.service_url)
    try:
        for i in range(3):
            for tenant in ("alpha", "beta"):
                pub.publish(pool="p1", node="n1", tenant=tenant, lease=lease, kind="execution",
                            event=v1.TelemetryEvent(kind="execution", at=time.time(),
                                                    attrs={"i": i, "tenant": tenant}))
        pub.flush()
    finally:
        pub.close()
    with stack.client("alpha") as c:
        with c.stream("GET", "/v1/telemetry", params={"lease": lease}) as r:
            assert r.status_code == 200
            got = sse_events(r, 3)
        samples = [json.loads(e["data"]) for e in got]
        assert [s["event"]["attrs"]["i"] for s in samples] == [0, 1, 2]
        assert {s["event"]["attrs"]["tenant"] for s in samples} == {"alpha"}
        assert all(e["event"] == "execution" for e in got)
        with c.stream("GET", "/v1/telemetry", params={"lease": lease},
                      headers={"Last-Event-ID": got[0]["id"]}) as r:
            resumed = sse_events(r, 2)
        assert [e["id"] for e in resumed] == [got[1]["id"], got[2]["id"]]
        assert c.get("/v1/telemetry", params={"kind": "nope"}).status_code == 422


def test_a_leases_logs_stream_its_output_to_its_tenant_only_and_resume(stack: Stack) -> None:
    with stack.client("alpha") as c:
        lid = c.post("/v1/compute-leases", json=BODY).json()["lease_id"]
    place_on(stack.service_url, "alpha", lid, "n1")
    pub = TelemetryPublisher(stack.service_url)
    try:
        for line in ("one\n", "two\n", "three\n"):
            pub.publish(pool="p1", node="n1", tenant="alpha", lease=lid, kind="output",
                        event=v1.TelemetryEvent(kind="output", at=time.time(),
                                                attrs={"stream": "stdout", "text": line}))
        pub.flush()
    finally:
        pub.close()
    with stack.client("alpha") as c:
        # without follow: what is stored, then the stream ends
        with c.stream("GET", f"/v1/compute-leases/{lid}/logs") as r:
            assert r.status_code == 200
            got = sse_events(r, 10)
        texts = [json.loads(e["data"])["event"]["attrs"]["text"] for e in got]
        assert texts == ["one\n", "two\n", "three\n"]
        assert {e["event"] for e in got} == {"output"}
        with c.stream("GET", f"/v1/compute-leases/{lid}/logs",
                      headers={"Last-Event-ID": got[0]["id"]}) as r:
            assert [e["id"] for e in sse_events(r, 10)] == [got[1]["id"], got[2]["id"]]
        assert c.get(f"/v1/compute-leases/{lid}/logs", params={"follow": "2"}).status_code == 422
    with stack.client("beta") as c:
        # another tenant's lease reads as missing
        assert c.get(f"/v1/compute-leases/{lid}/logs").status_code == 404
