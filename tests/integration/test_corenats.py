"""bus.corenats, the standard library's core-NATS connection `pool lease run` speaks through,
and the lease watch on it (bus.leanwatch), against a real nats-server 2.15: replies, refusals,
headers, a server that comes back, a live record that overtakes a page."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from bus.corenats import Connection
from bus.errors import BusTimeout, BusUnavailable, PayloadTooLarge
from bus.leanwatch import LeanLeaseWatch
from bus.leaseitems import Change
from bus.local.server import NatsServer
from bus.service import Client


def _echo(url: str, subject: str, stop: threading.Event) -> threading.Thread:
    """A responder on `subject` that answers each request with its body reversed."""
    ready = threading.Event()

    def serve() -> None:
        conn = Connection(url)
        sid = conn.subscribe(subject)
        conn.flush()
        ready.set()
        while not stop.is_set():
            got = conn.next((sid,), 0.1)
            if got is not None:
                conn.publish(got[1].reply, got[1].data[::-1])
        conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    assert ready.wait(10)
    return thread


def test_a_request_is_answered_and_a_subject_nobody_serves_is_said_so(nats_url: str) -> None:
    stop = threading.Event()
    thread = _echo(nats_url, "corenats.echo", stop)
    try:
        conn = Connection(nats_url, inbox_prefix="_INBOX.t.alpha")
        assert conn.request("corenats.echo", b"abc", timeout=5) == b"cba"
        assert conn.request("corenats.echo", b"", timeout=5) == b""
        with pytest.raises(BusUnavailable, match="no service answers"):
            conn.request("corenats.nobody", b"x", timeout=5)
        with pytest.raises(PayloadTooLarge):
            conn.request("corenats.echo", b"x" * (conn.max_payload + 1), timeout=5)
        conn.close()
    finally:
        stop.set()
        thread.join(5)


def test_a_message_with_headers_from_nats_py_is_read_whole(nats_url: str) -> None:
    conn = Connection(nats_url)
    sid = conn.subscribe("corenats.headers")
    conn.flush()
    with Client(nats_url) as other:
        other._loop.run(other._nc.publish("corenats.headers", b"body\r\nwith a CRLF",
                                          headers={"Nats-Sequence": "7", "X-Y": "z"}))
        got = conn.next((sid,), 5)
    assert got is not None
    assert got[1].data == b"body\r\nwith a CRLF"
    assert (got[1].headers["Nats-Sequence"], got[1].headers["X-Y"]) == ("7", "z")
    conn.close()


def test_a_reply_come_after_its_request_gave_up_never_answers_another(nats_url: str) -> None:
    server, asker = Connection(nats_url), Connection(nats_url)
    sid = server.subscribe("corenats.slow")
    server.flush()
    with pytest.raises(BusTimeout):
        asker.request("corenats.slow", b"1", timeout=0.2)
    for body in (b"first", b"second"):
        if body == b"second":
            token = asker.ask("corenats.slow", b"2")
        got = server.next((sid,), 5)
        assert got is not None
        server.publish(got[1].reply, body)
        server.flush()
    asker.next((), 5, answer=token)
    assert asker.answer(token, "corenats.slow") == b"second"
    assert asker.answer("1", "corenats.slow") is None  # the first request's: dropped
    server.close()
    asker.close()


def test_an_unreachable_server_and_a_wrong_password_are_refused(tmp_path: Path) -> None:
    with pytest.raises(BusUnavailable, match="cannot reach NATS"):
        Connection("nats://127.0.0.1:1")
    server = NatsServer(store_dir=tmp_path / "nats", server_name="corenats-auth",
                        extra_config='authorization { user: "u", password: "right" }')
    with server:
        with pytest.raises(BusUnavailable, match="(?i)authorization"):
            Connection(server.url, user="u", password="wrong")
        conn = Connection(server.url.replace("nats://", "nats://u:right@"))
        conn.flush()
        conn.close()


def test_a_server_that_comes_back_is_connected_to_and_subscribed_again(
        fresh_nats: NatsServer) -> None:
    conn = Connection(fresh_nats.url)
    sid = conn.subscribe("corenats.back")
    conn.flush()
    fresh_nats.stop()
    restart = threading.Timer(0.5, fresh_nats.start)
    restart.start()
    assert conn.next((sid,), 2) is None  # the loss is seen; the connection is made again
    restart.join()
    deadline = time.monotonic() + 15
    while conn.reconnects == 0 and time.monotonic() < deadline:
        conn.next((sid,), 0.2)
    assert conn.reconnects == 1
    conn.flush()  # the subscription is the server's again
    with Client(fresh_nats.url) as other:
        other._loop.run(other._nc.publish("corenats.back", b"again"))
        got = conn.next((sid,), 5)
    assert got is not None and got[1].data == b"again"
    conn.close()


def test_a_live_record_come_while_a_page_is_read_is_not_lost(nats_url: str) -> None:
    # the race a plane makes now and then, played in order: the stored records are asked for,
    # the reservation is stored and comes live, then the page read before it answers without it
    plane = Connection(nats_url)
    asked = plane.subscribe("pool.cmd.alpha.feed.replay")
    plane.flush()
    watch = LeanLeaseWatch(Connection(nats_url), "alpha", "l1").start()
    first = plane.next((asked,), 5)
    assert first is not None
    stored = "pool.feed.alpha.lease.l1"

    def page(seq: int, state: str) -> bytes:
        record = {"seq": seq, "subject": stored, "record": {"state": state, "node_id": "n1"}}
        return json.dumps({"ok": True, "result": {"records": [record], "at_end": True}}).encode()

    with Client(nats_url) as other:
        other._loop.run(other._nc.publish(
            "pool.feedlive.alpha.lease.l1", json.dumps({"state": "reserved"}).encode(),
            headers={"Nats-Stream": "POOL_FEED", "Nats-Sequence": "2", "Nats-Last-Sequence": "1",
                     "Nats-Subject": stored}))  # as the feed's republish stamps it
        assert watch.get(0.5) is None  # held: the page asked for first has not answered
        plane.publish(first[1].reply, page(1, "queued"))
        plane.flush()
        got = [watch.get(5), watch.get(0.5)]
        second = plane.next((asked,), 0.5)  # the gap the page left is read again
        if second is not None:
            plane.publish(second[1].reply, page(2, "reserved"))
            plane.flush()
            got[1] = got[1] or watch.get(5)
    states = [(g.seq, g.record.state) for g in got if isinstance(g, Change)]
    assert states == [(1, "queued"), (2, "reserved")]
    plane.close()
