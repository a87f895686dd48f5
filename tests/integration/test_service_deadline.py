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
        assert late["error"]["reasons"] == {"answer_within_seconds": 0.5, "started": True}
        assert json.loads(client.request(subject, b"quick", timeout=5))["result"] == {
            "echo": "quick"}
    finally:
        release.set()
        client.close()
        service.stop()


def test_requests_waiting_for_a_busy_worker_are_answered_by_the_same_deadline(
        nats_url: str, unique: str) -> None:
    """The clock runs from arrival: a request queued behind a stuck worker is not given a
    fresh deadline once it reaches one (in a quorum loss such waits added up past 45 s)."""
    release = threading.Event()
    ran: list[str] = []

    def handler(subject: str, body: bytes, headers: dict[str, str]) -> bytes:
        ran.append(subject)
        release.wait(10)
        return b'{"ok": true, "result": {}}'

    tenant = f"t{unique}"
    subject = f"pool.cmd.{tenant}.deadline-queue"
    service = Service(nats_url, [subject], handler, queue=f"q-{unique}", threads=1,
                      answer_within_seconds=0.5).start()
    clients = [Client(nats_url, inbox_prefix=tenant_inbox(tenant)) for _ in range(4)]
    answers: list[tuple[float, dict]] = []

    def ask(client: Client) -> None:
        t0 = time.monotonic()
        reply = json.loads(client.request(subject, b"x", timeout=5))
        answers.append((time.monotonic() - t0, reply))

    try:
        threads = [threading.Thread(target=ask, args=(c,)) for c in clients]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert len(answers) == 4
        # one worker, four requests: one (or more) times out working, the rest waiting
        assert all(r["error"]["code"] == "bus_timeout" for _, r in answers)
        assert max(s for s, _ in answers) < 1.5, sorted(s for s, _ in answers)
        assert {r["error"]["reasons"]["started"] for _, r in answers} == {True, False}
        release.set()
        time.sleep(0.5)  # a command answered as not started never runs, even once freed
        assert len(ran) == sum(r["error"]["reasons"]["started"] for _, r in answers)
    finally:
        release.set()
        for c in clients:
            c.close()
        service.stop()


def test_a_command_handed_to_a_stuck_worker_pool_is_answered_not_started_and_never_runs(
        nats_url: str, unique: str) -> None:
    """The first command's worker is stuck past its deadline, which frees its slot; a second,
    arriving later, takes the slot but no thread is free before its own deadline: it is not
    started, so its client may simply retry, and it must then never run."""
    release = threading.Event()
    ran: list[bytes] = []

    def handler(subject: str, body: bytes, headers: dict[str, str]) -> bytes:
        ran.append(body)
        release.wait(10)
        return b'{"ok": true, "result": {}}'

    tenant = f"t{unique}"
    subject = f"pool.cmd.{tenant}.deadline-turn"
    service = Service(nats_url, [subject], handler, queue=f"q-{unique}", threads=1,
                      answer_within_seconds=0.5).start()
    clients = [Client(nats_url, inbox_prefix=tenant_inbox(tenant)) for _ in range(2)]
    answers: dict[bytes, dict] = {}

    def ask(client: Client, body: bytes) -> None:
        answers[body] = json.loads(client.request(subject, body, timeout=5))

    try:
        first = threading.Thread(target=ask, args=(clients[0], b"first"))
        first.start()
        time.sleep(0.3)  # the second arrives while the first still runs
        second = threading.Thread(target=ask, args=(clients[1], b"second"))
        second.start()
        first.join(10)
        second.join(10)
        assert answers[b"first"]["error"]["reasons"]["started"] is True
        assert answers[b"second"]["error"]["reasons"]["started"] is False, answers
        release.set()
        time.sleep(0.5)
        assert ran == [b"first"]
    finally:
        release.set()
        for c in clients:
            c.close()
        service.stop()


def test_a_flood_beyond_what_the_service_holds_is_refused_at_once(
        nats_url: str, unique: str) -> None:
    release = threading.Event()

    def handler(subject: str, body: bytes, headers: dict[str, str]) -> bytes:
        release.wait(10)
        return b'{"ok": true, "result": {}}'

    tenant = f"t{unique}"
    subject = f"pool.cmd.{tenant}.deadline-flood"
    service = Service(nats_url, [subject], handler, queue=f"q-{unique}", threads=1,
                      answer_within_seconds=5, max_waiting=1).start()
    first, second = (Client(nats_url, inbox_prefix=tenant_inbox(tenant)) for _ in range(2))
    try:
        held = threading.Thread(target=lambda: first.request(subject, b"x", timeout=10))
        held.start()
        time.sleep(0.3)  # the first holds the one place
        t0 = time.monotonic()
        refused = json.loads(second.request(subject, b"y", timeout=5))
        assert time.monotonic() - t0 < 1
        assert refused["error"]["code"] == "bus_unavailable"
        assert refused["error"]["reasons"] == {"max_waiting": 1}
    finally:
        release.set()
        held.join(10)
        first.close()
        second.close()
        service.stop()
