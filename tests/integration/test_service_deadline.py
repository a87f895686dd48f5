"""A command the service cannot finish in time is still answered, with a typed `bus_timeout`,
and the service goes on answering the others (a quorum loss once left requests unanswered)."""

from __future__ import annotations

import json
import threading
import time

from bus.replies import tenant_inbox
from bus.service import Client, Service


def test_a_request_past_the_deadline_is_answered_bus_timeout_and_the_next_is_served(
        nats_url: str, unique: str) -> None:
    release = threading.Event()

    def handler(subject: str, body: bytes, headers: dict[str, str]) -> bytes:
        if body == b"slow":
            release.wait(10)  # a handler stuck behind bus calls that do not answer
        return json.dumps({"ok": True, "result": {"echo": body.decode()}}).encode()

    tenant = f"t{unique}"  # answered only under the requester's own inbox, as every command
    subject = f"pool.cmd.{tenant}.deadline-test"
    service = Service(nats_url, [subject], handler, queue=f"q-{unique}", threads=2,
                      answer_within_seconds=0.5).start()
    client = Client(nats_url, inbox_prefix=tenant_inbox(tenant))
    try:
        t0 = time.monotonic()
        late = json.loads(client.request(subject, b"slow", timeout=5))
        assert time.monotonic() - t0 < 3
        assert late["ok"] is False and late["error"]["code"] == "bus_timeout"
        assert late["error"]["reasons"] == {"answer_within_seconds": 0.5}
        assert json.loads(client.request(subject, b"quick", timeout=5))["result"] == {
            "echo": "quick"}
    finally:
        release.set()
        client.close()
        service.stop()
