"""The operator's commands over an admin's HTTP context: client.http.ADMIN_PATHS is the gateway's
admin routes, and HttpClient.admin sends each as the gateway expects it."""

from __future__ import annotations

import json
from typing import Any

import httpx

from client.http import ADMIN_PATHS, HttpClient
from gateway.routes import ROUTES
from workers.routes import NODE_VERBS

ADMIN = "pool.admin."


def test_the_clients_table_is_the_gateways_admin_routes() -> None:
    gateway: dict[str, set[tuple[str, str]]] = {}
    for r in ROUTES:
        nats = r.route
        if r.admin and nats is not None and nats.subject.startswith(ADMIN):
            gateway.setdefault(nats.subject.removeprefix(ADMIN), set()).add((r.method, r.path))
    ours = {path: {(method, template.replace("{verb}", v)) for v in NODE_VERBS}
            if "{verb}" in template else {(method, template)}
            for path, (method, template) in ADMIN_PATHS.items()}
    assert ours == gateway


def _sent(path: str, body: dict[str, Any] | None = None,
          answer: httpx.Response | None = None) -> tuple[list[httpx.Request], dict[str, Any]]:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return answer or httpx.Response(200, json={"pool_id": "p1"})

    c = HttpClient("http://gw.test", "admin-token")
    c._http = httpx.Client(base_url="http://gw.test", headers=c._http.headers,
                           transport=httpx.MockTransport(handler))
    with c:
        return seen, c.admin(path, body)


def test_a_command_goes_to_its_route_with_its_body() -> None:
    seen, reply = _sent("pool.set", {"pool_id": "p1", "packing": "spread"})
    assert reply == {"ok": True, "result": {"pool_id": "p1"}}
    [r] = seen
    assert (r.method, r.url.path) == ("POST", "/v1/admin/pools/p1")
    assert json.loads(r.content) == {"pool_id": "p1", "packing": "spread"}
    assert r.headers["authorization"] == "Bearer admin-token"


def test_a_nodes_verb_and_a_reservation_go_in_the_url() -> None:
    seen, _ = _sent("node.n-1.drain", {"reason": "disk"})
    assert (seen[0].method, seen[0].url.path) == ("POST", "/v1/admin/nodes/n-1/drain")
    assert json.loads(seen[0].content) == {"reason": "disk"}
    seen, _ = _sent("reservation.delete", {"pool_id": "p1", "reservation_id": "r1"})
    assert seen[0].url.path == "/v1/admin/pools/p1/reservations/r1/delete"


def test_a_read_sends_no_body_and_refuses_what_its_url_cannot_hold() -> None:
    seen, reply = _sent("pool.show", {"pool_id": "p1"})
    assert (seen[0].method, seen[0].url.path, seen[0].content) == (
        "GET", "/v1/admin/pools/p1", b"")
    assert reply["ok"]
    seen, _ = _sent("reservation.list", {"pool_id": "p1", "all": False})
    assert seen[0].url.path == "/v1/admin/pools/p1/reservations"
    seen, reply = _sent("reservation.list", {"pool_id": "p1", "all": True})
    assert not seen and reply["error"]["code"] == "not_over_http"
    assert "all" in reply["error"]["message"]


def test_a_path_the_gateway_does_not_serve_is_not_over_http_in_one_line() -> None:
    seen, reply = _sent("pool.teleport", {"pool_id": "p1"})
    assert not seen and not reply["ok"]
    error = reply["error"]
    assert error["code"] == "not_over_http"
    assert "pool.teleport" in error["message"] and "\n" not in error["message"]
    assert "--nats-url" in error["message"]


def test_a_refusal_reads_as_the_nats_envelopes() -> None:
    problem = httpx.Response(404, json={"code": "unknown_pool", "detail": "no pool 'p9'"})
    _, reply = _sent("pool.show", {"pool_id": "p9"}, problem)
    assert reply == {"ok": False, "error": {"code": "unknown_pool", "message": "no pool 'p9'",
                                            "reasons": {}}}
