"""The gateway's own refusals, with nothing behind it: problems with stable codes, never a 5xx
traceback, whatever NATS is doing."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from litestar.testing import TestClient

from bus.local.server import free_port
from gateway import app as gateway_app
from gateway.app import create_app
from gateway.tokens import TokenStore
from gateway.upstream import Settings


@pytest.fixture()
def client(tmp_path: Path) -> Iterator[tuple[TestClient, str]]:  # type: ignore[type-arg]
    store = TokenStore(tmp_path / "t.json")
    token = store.issue_tenant("alpha")
    # nothing listens there: every call to NATS fails
    app = create_app(Settings(f"nats://127.0.0.1:{free_port()}", timeout=1.0), store)
    with TestClient(app) as c:
        c.headers["Authorization"] = f"Bearer {token}"
        yield c, token


def test_with_nats_down_a_request_is_a_503_problem_not_a_traceback(
    client: tuple[TestClient, str],  # type: ignore[type-arg]
) -> None:
    c, _ = client
    r = c.post("/v1/compute-leases", json={"pool_id": "p1", "shape": {
        "cpu_millis": 1, "memory_mib": 1}, "maximum_runtime_seconds": 60})
    assert r.status_code == 503, r.text
    assert r.headers["content-type"] == "application/problem+json"
    assert r.json()["code"] in ("bus_unavailable", "bus_timeout")
    assert "Traceback" not in r.text


def test_a_bad_body_is_refused_before_nats_is_asked(
    client: tuple[TestClient, str],  # type: ignore[type-arg]
) -> None:
    c, _ = client
    r = c.post("/v1/compute-leases", content=b'{"pool_id": "P 1"}',
               headers={"Content-Type": "application/json"})
    assert r.status_code == 422 and r.json()["code"] in ("invalid_field", "missing_field")


def test_a_token_over_its_in_flight_limit_gets_429_with_retry_after(
    client: tuple[TestClient, str],  # type: ignore[type-arg]
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    c, _ = client
    monkeypatch.setattr(gateway_app, "MAX_IN_FLIGHT", 0)
    r = c.get("/v1/balance")
    assert r.status_code == 429 and r.headers["retry-after"] == "1"
    assert r.json()["code"] == "too_many_requests"


@pytest.mark.parametrize(("method", "path", "status", "code"), [
    ("GET", "/v1/nowhere", 404, "not_found"),
    ("DELETE", "/v1/compute-leases", 405, "method_not_allowed"),
    ("GET", "/v1/compute-leases/UPPER.case/why", 404, "lease_not_found"),
    ("GET", "/v1/compute-leases?limit=0", 422, "invalid_field"),
])
def test_what_matches_no_operation_is_a_problem_too(
    client: tuple[TestClient, str],  # type: ignore[type-arg]
    method: str, path: str, status: int, code: str,
) -> None:
    c, _ = client
    r = c.request(method, path)
    assert r.status_code == status, r.text
    assert r.json()["code"] == code


@pytest.mark.parametrize("since", ["abc", "1e12", "-1"])
def test_a_bad_since_on_a_stream_is_refused_naming_it_before_nats_is_asked(
    client: tuple[TestClient, str],  # type: ignore[type-arg]
    since: str,
) -> None:
    c, _ = client
    r = c.get("/v1/telemetry", params={"since": since})
    assert 400 <= r.status_code < 500, r.text
    assert r.json()["code"] == "invalid_field" and r.json()["reasons"]["path"] == "since"
