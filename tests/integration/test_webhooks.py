"""Tenants' webhooks: a receiver on 127.0.0.1 gets every `ended` record of its tenant's feed
exactly once per feed sequence, signed as Standard Webhooks says, retried after it answers 500,
in feed order, and not again after the plane restarts; endpoints the plane must not reach, or
one too many, are refused, and no secret is stored in clear."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from bus.admin import ensure_all_streams
from bus.connection import connect
from bus.local.server import NatsServer
from bus.subjects import EVENTS_STREAM
from client.api import PoolClient
from tests.control_plane import lease_body, node_body, setup_pool
from workers.plane import ControlPlane
from workers.webhooks.addresses import networks
from workers.webhooks.settings import WebhookSettings
from workers.webhooks.signing import plane_key

ROOT = Path(__file__).resolve().parents[2]
JOB = {"image": "busybox@sha256:" + "a" * 64, "command": ["true"]}
ENDED = {"released", "cancelled", "voided", "preempted", "rejected"}
SETTINGS = WebhookSettings(key=plane_key("test key"), allow=networks("127.0.0.1/32"),
                           max_endpoints=2, backoff_seconds=0.2, backoff_max_seconds=0.5)


def verify(secret: str, headers: dict[str, str], body: bytes) -> bool:
    """The Standard Webhooks reference check: HMAC-SHA256 under the base64 key after
    `whsec_`, over "id.timestamp.body", compared with each `v1,` signature given."""
    key = base64.b64decode(secret.split("_", 1)[1])
    signed = f"{headers['webhook-id']}.{headers['webhook-timestamp']}.".encode() + body
    expected = base64.b64encode(hmac.new(key, signed, hashlib.sha256).digest()).decode()
    given = [s.split(",", 1)[1] for s in headers["webhook-signature"].split()
             if s.startswith("v1,")]
    return any(hmac.compare_digest(expected, g) for g in given)


class Receiver:
    """An HTTP endpoint on 127.0.0.1 that answers 500 to the first `fail` feed deliveries."""

    def __init__(self, fail: int = 2) -> None:
        self.fail = fail
        self.got: list[tuple[dict[str, str], bytes, int]] = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # http.server's name
                body = self.rfile.read(int(self.headers["content-length"]))
                headers = {k.lower(): v for k, v in self.headers.items()}
                with receiver.lock:
                    status = 200
                    if headers["webhook-id"].isdigit() and receiver.fail > 0:
                        receiver.fail -= 1
                        status = 500
                    receiver.got.append((headers, body, status))
                self.send_response(status)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hooks"

    def answered_ok(self) -> list[str]:
        with self.lock:
            return [h["webhook-id"] for h, _b, status in self.got if status == 200]


@pytest.fixture()
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.server.shutdown()


def _plane(url: str) -> ControlPlane:
    return ControlPlane(url, webhooks=SETTINGS, leader_ttl_seconds=1.0).start()


def _wait(predicate: Any, timeout: float = 15.0) -> Any:
    deadline = time.monotonic() + timeout
    while not (got := predicate()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return got


def _end_lease(alpha: PoolClient, key: str) -> str:
    lid = str(alpha.request_lease(lease_body(key))["lease"]["lease_id"])
    assert _wait(lambda: alpha.lease(lid, "get")["lease"]["state"] == "reserved")
    assert alpha.lease(lid, "commit", {"job": JOB})["ok"]
    assert alpha.lease(lid, "release", {"exit_code": 0})["ok"]
    return lid


def _ended_seqs(alpha: PoolClient) -> list[int]:
    page = alpha.call("pool.cmd.alpha.feed.replay", {"after_seq": 0})["result"]["records"]
    return [int(r["seq"]) for r in page if r["record"]["state"] in ENDED]


def test_a_receiver_gets_each_ended_record_once_signed_and_retried(
        fresh_nats: NatsServer, receiver: Receiver) -> None:
    url = fresh_nats.url
    ensure_all_streams(url)
    cp = _plane(url)
    try:
        with PoolClient(url) as admin, PoolClient(url, "alpha") as alpha:
            setup_pool(admin)
            assert admin.admin("node.register", node_body("n1"))["ok"]
            added = alpha.call("pool.cmd.alpha.webhook.add",
                               {"url": receiver.url, "events": ["ended"]})
            assert added["ok"], added
            secret = added["result"]["secret"]
            endpoint = added["result"]["endpoint"]["endpoint_id"]
            assert secret.startswith("whsec_")
            listed = alpha.call("pool.cmd.alpha.webhook.list", {})["result"]["endpoints"]
            assert [e["endpoint_id"] for e in listed] == [endpoint]
            assert "secret" not in json.dumps(listed)

            for i in range(3):
                _end_lease(alpha, f"wh-{i}")
            ended = _wait(lambda: (got := _ended_seqs(alpha)) and len(got) == 3 and got)
            assert ended and len(ended) == 3
            assert _wait(lambda: len(receiver.answered_ok()) >= 3)

            # the tenant's test message goes out at once, signed the same way
            tested = alpha.call("pool.cmd.alpha.webhook.test", {"endpoint_id": endpoint})
            assert tested["ok"] and tested["result"]["status"] == 200, tested

            deliveries = alpha.call("pool.cmd.alpha.webhook.deliveries", {})["result"]
            rows = sorted(deliveries["deliveries"], key=lambda r: r["seq"])
            assert [(r["seq"], r["state"]) for r in rows] == [(s, "delivered") for s in ended]
            assert rows[0]["attempts"] == 3 and rows[0]["last_status"] == 200
        cp.stop()

        # a restarted plane resumes its consumer: the next record only, nothing again
        cp = _plane(url)
        with PoolClient(url, "alpha") as alpha:
            _end_lease(alpha, "wh-after-restart")
            ended = _wait(lambda: (got := _ended_seqs(alpha)) and len(got) == 4 and got)
            assert ended and len(ended) == 4
            assert _wait(lambda: len(receiver.answered_ok()) >= 5)
            time.sleep(0.5)  # room for a stray duplicate to arrive
    finally:
        cp.stop()

    feed_ids = [i for i in receiver.answered_ok() if i.isdigit()]
    assert feed_ids == [str(s) for s in ended]  # once each, in feed order
    attempts = [h["webhook-id"] for h, _b, _s in receiver.got if h["webhook-id"].isdigit()]
    assert attempts[:3] == [str(ended[0])] * 3  # 500, 500, then 200: the same webhook-id
    for headers, body, _status in receiver.got:
        assert verify(secret, headers, body), headers
        assert abs(int(headers["webhook-timestamp"]) - time.time()) < 120
        message = json.loads(body)
        if headers["webhook-id"].isdigit():
            assert message["type"] == "lease.released"
            assert message["feed_seq"] == int(headers["webhook-id"])
            assert message["data"]["state"] in ENDED and message["data"]["tenant"] == "alpha"
        else:
            assert message["type"] == "webhook.test"


def test_endpoints_the_plane_must_not_reach_or_too_many_are_refused(
        fresh_nats: NatsServer, receiver: Receiver) -> None:
    url = fresh_nats.url
    ensure_all_streams(url)
    with ControlPlane(url, webhooks=SETTINGS), PoolClient(url, "beta") as beta:
        for target in ("http://10.1.2.3/hook", "http://169.254.169.254/latest/meta-data",
                       "http://192.168.0.10:8080/", "http://[::1]:9/", "ftp://example.com/"):
            r = beta.call("pool.cmd.beta.webhook.add", {"url": target, "events": ["ended"]})
            assert not r["ok"] and r["error"]["code"] in (
                "webhook_address_refused", "invalid_webhook"), (target, r)
        r = beta.call("pool.cmd.beta.webhook.add", {"url": receiver.url, "events": ["bogus"]})
        assert r["error"]["code"] == "invalid_webhook"
        secrets = []
        for _ in range(2):
            r = beta.call("pool.cmd.beta.webhook.add", {"url": receiver.url,
                                                        "events": ["running", "ended"]})
            assert r["ok"], r
            secrets.append(r["result"]["secret"])
        r = beta.call("pool.cmd.beta.webhook.add", {"url": receiver.url, "events": ["ended"]})
        assert r["error"]["code"] == "webhook_limit"
        first = beta.call("pool.cmd.beta.webhook.list", {})["result"]["endpoints"][0]
        # the CLI lists them as the tenant (`pool webhook list`), secrets never shown again
        done = subprocess.run([sys.executable, "-m", "cli.main", "webhook", "list", "--json",
                               "--nats-url", url, "--tenant", "beta"], capture_output=True,
                              text=True, timeout=60, check=False, cwd=ROOT)
        assert done.returncode == 0, done.stderr
        listed = json.loads(done.stdout)["result"]["endpoints"]
        assert len(listed) == 2 and not any(s in done.stdout for s in secrets)
        assert beta.call("pool.cmd.beta.webhook.delete",
                         {"endpoint_id": first["endpoint_id"]})["ok"]
        r = beta.call("pool.cmd.beta.webhook.delete", {"endpoint_id": first["endpoint_id"]})
        assert r["error"]["code"] == "unknown_webhook"

    # the registrations are events in the log, and no secret is in it in clear
    async def log_bytes() -> bytes:
        nc = await connect(url)
        try:
            js = nc.jetstream()
            last = (await js.stream_info(EVENTS_STREAM)).state.last_seq
            out = b""
            for seq in range(1, last + 1):
                msg = await js.get_msg(EVENTS_STREAM, seq)
                out += (msg.data or b"") + b"\n"
            return out
        finally:
            await nc.close()

    stored = asyncio.run(log_bytes())
    assert stored.count(b'"sealed_secret":"v1:') == 2  # the two added, sealed
    for secret in secrets:
        assert secret.encode() not in stored
        assert secret.removeprefix("whsec_").encode() not in stored


def test_the_http_api_offers_webhooks_and_refuses_a_loopback_endpoint(
        tmp_path: Path, database_url: str) -> None:
    import uuid

    from projections.views import drop_schema
    from tests.gateway_stack import gateway_stack

    schema = "views_wh_" + uuid.uuid4().hex[:8]
    try:
        # this plane allows no address but public ones
        with gateway_stack(tmp_path, database_url, schema) as stack, \
                stack.client("alpha") as c:
            r = c.post("/v1/webhooks", json={"url": "http://127.0.0.1:9/x", "events": ["ended"]})
            assert r.status_code == 422 and r.json()["code"] == "webhook_address_refused", r.text
            r = c.post("/v1/webhooks", json={"url": "http://example.invalid/x",
                                             "events": ["nonsense"]})
            assert r.status_code == 422 and r.json()["code"] == "invalid_webhook", r.text
            assert c.get("/v1/webhooks").json() == {"endpoints": []}
            assert c.get("/v1/webhooks/deliveries").json() == {"deliveries": []}
            r = c.post("/v1/webhooks/wh-0000/test", json={})
            assert r.status_code == 404 and r.json()["code"] == "unknown_webhook", r.text
    finally:
        drop_schema(database_url, schema)
