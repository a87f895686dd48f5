"""The HTTP API against the real gateway, NATS with users, the control plane and PostgreSQL."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.gateway_stack import Stack, gateway_stack, wait_for

# the concept's example request, verbatim
CONCEPT_BODY = {"pool_id": "p1",
                "shape": {"gpu_count": 0, "gpu_memory_gib_min": 0, "cpu_millis": 500,
                          "memory_mib": 256},
                "maximum_runtime_seconds": 600}


def _is_documented_lease(lease: dict[str, object]) -> None:
    """The reply is the OpenAPI document's Lease, field for field (a new field in the service's
    lease view fails here until the documented Struct has it)."""
    import msgspec

    from gateway.wire import Lease

    msgspec.convert(lease, Lease)
    assert set(lease) <= set(Lease.__struct_fields__), set(lease) - set(Lease.__struct_fields__)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, database_url: str) -> Iterator[Stack]:
    from projections.views import drop_schema

    schema = "views_gw_" + uuid.uuid4().hex[:8]
    home: Path = tmp_path_factory.mktemp("gw")
    try:
        with gateway_stack(home, database_url, schema) as s:
            yield s
    finally:
        drop_schema(database_url, schema)


def test_a_lease_goes_from_request_to_release_over_http(stack: Stack) -> None:
    with stack.client("alpha") as c:
        r = c.post("/v1/compute-leases", json=CONCEPT_BODY,
                   headers={"Idempotency-Key": "life-" + uuid.uuid4().hex})
        assert r.status_code == 201, r.text
        lease = r.json()
        lid = lease["lease_id"]
        assert r.headers["location"] == f"/v1/compute-leases/{lid}"
        assert lease["tenant"] == "alpha" and lease["state"] in ("queued", "reserved")
        _is_documented_lease(lease)
        got = wait_for(lambda: c.get(f"/v1/compute-leases/{lid}").json()["state"] == "reserved")
        assert got, c.get(f"/v1/compute-leases/{lid}").json()
        r = c.post(f"/v1/compute-leases/{lid}/commit",
                   json={"job": {"image": "busybox@sha256:" + "a" * 64, "command": ["true"]}})
        assert r.status_code == 200 and r.json()["state"] == "running", r.text
        assert c.post(f"/v1/compute-leases/{lid}/heartbeat",
                      json={"epoch": r.json()["epoch"]}).status_code == 200
        assert c.post(f"/v1/compute-leases/{lid}/renew",
                      json={"extend_seconds": 60}).status_code == 200
        done = c.post(f"/v1/compute-leases/{lid}/release", json={"exit_code": 0})
        assert done.status_code == 200 and done.json()["state"] == "released", done.text
        _is_documented_lease(done.json())
        again = c.post(f"/v1/compute-leases/{lid}/commit", json={})
        assert again.status_code == 409
        assert again.headers["content-type"] == "application/problem+json"
        assert again.json()["code"] == "illegal_transition"


def test_a_retry_with_the_same_key_returns_the_same_lease_and_another_body_is_409(
    stack: Stack,
) -> None:
    key = "idem-" + uuid.uuid4().hex
    with stack.client("alpha") as c:
        first = c.post("/v1/compute-leases", json=CONCEPT_BODY, headers={"Idempotency-Key": key})
        second = c.post("/v1/compute-leases", json=CONCEPT_BODY,
                        headers={"Idempotency-Key": key})
        assert first.status_code == second.status_code == 201
        assert first.json()["lease_id"] == second.json()["lease_id"]
        other = dict(CONCEPT_BODY, maximum_runtime_seconds=601)
        clash = c.post("/v1/compute-leases", json=other, headers={"Idempotency-Key": key})
        assert clash.status_code == 409, clash.text
        assert clash.json()["code"] == "idempotency_conflict"
        c.post(f"/v1/compute-leases/{first.json()['lease_id']}/cancel", json={})


def test_a_tenant_token_never_reaches_another_tenants_lease(stack: Stack) -> None:
    with stack.client("alpha") as a, stack.client("beta") as b:
        lid = a.post("/v1/compute-leases", json=CONCEPT_BODY).json()["lease_id"]
        for method, path in (("GET", ""), ("POST", "/cancel"), ("POST", "/release"),
                             ("GET", "/why"), ("GET", "/events")):
            r = b.request(method, f"/v1/compute-leases/{lid}{path}", json={} if
                          method == "POST" else None)
            assert r.status_code == 404, (path, r.text)
            assert r.json()["code"] == "lease_not_found"
        assert a.get(f"/v1/compute-leases/{lid}").json()["state"] in ("queued", "reserved")
        listed = wait_for(lambda: any(x["lease_id"] == lid for x in
                                      a.get("/v1/compute-leases").json()["items"]))
        assert listed
        assert all(x["tenant"] == "beta" for x in b.get("/v1/compute-leases").json()["items"])
        assert lid not in {x["lease_id"] for x in b.get("/v1/compute-leases").json()["items"]}
        a.post(f"/v1/compute-leases/{lid}/cancel", json={})


def test_without_a_valid_token_nothing_is_answered_and_tenants_cannot_use_admin(
    stack: Stack,
) -> None:
    with stack.client("alpha") as a:
        assert a.post("/v1/admin/pools", json={"pool_id": "p9"}).json()["code"] == "forbidden"
        assert a.get("/v1/admin/views/leases").status_code == 403
    import httpx

    with httpx.Client(base_url=stack.url) as anon:
        for token in (None, "cpt_wrong", "Basic abc"):
            headers = {"Authorization": f"Bearer {token}"} if token else {}
            r = anon.get("/v1/compute-leases", headers=headers)
            assert r.status_code == 401 and r.json()["code"] == "unauthenticated"
            assert r.headers["www-authenticate"].startswith("Bearer")


def test_whoami_names_the_tokens_tenant_or_the_admin_and_refuses_a_wrong_one(
    stack: Stack,
) -> None:
    import httpx

    with stack.client("alpha") as a, stack.client("admin") as adm:
        assert a.get("/v1/whoami").json() == {"kind": "tenant", "tenant": "alpha"}
        assert adm.get("/v1/whoami").json() == {"kind": "admin"}
    r = httpx.get(stack.url + "/v1/whoami", headers={"Authorization": "Bearer cpt_wrong"})
    assert r.status_code == 401 and r.json()["code"] == "unauthenticated"


@pytest.mark.parametrize(("body", "status", "code"), [
    (b"{not json", 400, "malformed_json"),
    (b"[]", 422, "invalid_field"),
    (b'{"pool_id":"p1","shape":{"cpu_milis":1,"memory_mib":1},"maximum_runtime_seconds":60}',
     422, "unknown_field"),
    (b'{"pool_id":"p1","shape":{"cpu_millis":-1,"memory_mib":1},"maximum_runtime_seconds":60}',
     422, "invalid_field"),
    (b'{"pool_id":"nope","shape":{"cpu_millis":1,"memory_mib":1},"maximum_runtime_seconds":60}',
     404, "unknown_pool"),
    (b"x" * 70000, 413, "payload_too_large"),
])
def test_bad_requests_are_problems_with_the_nats_apis_codes(
    stack: Stack, body: bytes, status: int, code: str
) -> None:
    with stack.client("alpha") as c:
        r = c.post("/v1/compute-leases", content=body,
                   headers={"Content-Type": "application/json"})
        assert r.status_code == status, r.text
        assert r.headers["content-type"] == "application/problem+json"
        p = r.json()
        assert p["code"] == code and p["status"] == status
        assert p["type"].endswith("#problem-" + code) and "Traceback" not in r.text


def test_the_admin_token_configures_and_reads_every_tenant(stack: Stack) -> None:
    with stack.client("admin") as adm:
        r = adm.get("/v1/admin/pools/p1")
        assert r.status_code == 200, r.text
        r = adm.post("/v1/admin/credits/grants", json={"tenant": "beta",
                                                       "amount_microcredits": 5,
                                                       "transfer_id": "gw-" + uuid.uuid4().hex})
        assert r.status_code == 200 and r.json()["tenant"] == "beta", r.text
        nodes = wait_for(lambda: adm.get("/v1/admin/views/capacity").json()["items"])
        assert {n["node_id"] for n in nodes} >= {"n1", "n2"}
        assert adm.get("/v1/compute-leases").status_code == 403
        assert adm.get("/v1/admin/views/nope").status_code == 404


def test_the_openapi_document_is_3_1_and_names_every_route(stack: Stack) -> None:
    import httpx

    from gateway.routes import ROUTES

    doc = httpx.get(stack.url + "/openapi.json").json()
    assert doc["openapi"].startswith("3.1")
    for r in ROUTES:
        assert r.method.lower() in doc["paths"][r.path]
    assert "Problem" in doc["components"]["schemas"]
    assert httpx.get(stack.url + "/docs").status_code == 200


def test_a_leases_flight_recorder_lists_its_events_and_only_to_its_tenant(stack: Stack) -> None:
    with stack.client("alpha") as a, stack.client("beta") as b, stack.client("admin") as adm:
        lid = a.post("/v1/compute-leases", json=CONCEPT_BODY).json()["lease_id"]
        assert a.post(f"/v1/compute-leases/{lid}/cancel", json={"reason": "test"}).is_success
        events = a.get(f"/v1/compute-leases/{lid}/history").json()["events"]
        assert [e["version"] for e in events] == sorted(e["version"] for e in events)
        assert events[0]["type"] == "LeaseRequested"
        assert any("Cancel" in e["type"] for e in events), [e["type"] for e in events]
        assert b.get(f"/v1/compute-leases/{lid}/history").status_code == 404
        assert adm.get(f"/v1/admin/leases/{lid}/history").json()["events"] == events
        row = wait_for(lambda: adm.get(f"/v1/admin/leases/{lid}").json().get("state")
                       == "cancelled")
        assert row


def test_the_dashboard_snapshot_shows_a_tenant_only_its_own(stack: Stack) -> None:
    with stack.client("alpha") as a, stack.client("beta") as b, stack.client("admin") as adm:
        mine = a.post("/v1/compute-leases", json=CONCEPT_BODY).json()["lease_id"]
        theirs = b.post("/v1/compute-leases", json=CONCEPT_BODY).json()["lease_id"]

        def ids(snap: dict[str, object]) -> set[str]:
            rows = list(snap["leases"]) + list(snap["queue"])  # type: ignore[call-overload]
            return {r["lease_id"] for r in rows}

        snap = wait_for(lambda: (s := a.get("/dashboard/state").json()) and mine in ids(s)
                        and s)
        assert snap, "alpha's lease never showed"
        assert theirs not in ids(snap)
        assert {r["tenant"] for r in snap["leases"]} <= {"alpha"}
        assert "node_rows" not in snap["fleet"] and snap["fleet"]["nodes"] >= 2
        assert set(snap["shares"]) <= {"alpha"}
        assert [r["tenant"] for r in snap["balances"]] == ["alpha"]
        everything = wait_for(lambda: (s := adm.get("/dashboard/state").json())
                              and {mine, theirs} <= ids(s) and s)
        assert everything and everything["fleet"]["node_rows"]
        for lid, c in ((mine, a), (theirs, b)):
            c.post(f"/v1/compute-leases/{lid}/cancel", json={})


def test_a_lease_page_s_story_is_read_only_by_its_tenant_or_the_admin(stack: Stack) -> None:
    with stack.client("alpha") as a, stack.client("beta") as b, stack.client("admin") as adm:
        lid = a.post("/v1/compute-leases", json=CONCEPT_BODY).json()["lease_id"]
        assert a.post(f"/v1/compute-leases/{lid}/cancel", json={"reason": "test"}).is_success
        story = wait_for(lambda: (s := a.get(f"/dashboard/leases/{lid}").json())
                         and s["row"].get("state") == "cancelled" and s)
        assert story and story["lease"]["state"] == "cancelled"
        assert story["events"][0]["type"] == "LeaseRequested" and story["why"] == {}
        assert "credits_held" in story["row"] and story["row"]["ended_at"]
        for who, path in ((b, lid), (b, lid.upper()), (a, "../v1/whoami"), (a, "x" * 100)):
            got = who.get(f"/dashboard/leases/{path}")
            assert got.status_code == 404 and "row" not in got.json(), (path, got.text)
        seen = adm.get(f"/dashboard/leases/{lid}").json()
        assert seen["lease"]["lease_id"] == lid and seen["events"] == story["events"]


def test_usage_counts_a_tenants_own_leases_and_what_they_ran(stack: Stack) -> None:
    with stack.client("alpha") as a, stack.client("beta") as b:
        lid = a.post("/v1/compute-leases", json=CONCEPT_BODY).json()["lease_id"]
        a.post(f"/v1/compute-leases/{lid}/cancel", json={})
        got = wait_for(lambda: (u := a.get("/v1/usage").json())
                       and u["pools"].get("p1", {}).get("by_state", {}).get("cancelled") and u)
        assert got and got["tenant"] == "alpha" and not got["truncated"]
        p1 = got["pools"]["p1"]
        assert p1["leases"] == sum(p1["by_state"].values()) == got["leases_read"]
        assert p1["cpu_core_seconds"] >= 0 and p1["run_seconds"] >= 0
        theirs = b.get("/v1/usage").json()
        assert theirs["tenant"] == "beta"
        assert theirs["leases_read"] == len(b.get("/v1/compute-leases",
                                                  params={"limit": 1000}).json()["items"])


def test_the_admin_creates_lists_and_deletes_a_reservation_over_http(stack: Stack) -> None:
    import time

    rid = "gw-" + uuid.uuid4().hex[:8]
    body = {"reservation_id": rid, "tenant": "alpha", "start_at": time.time() + 3600,
            "duration_seconds": 600, "shape": {"cpu_millis": 500}}
    with stack.client("admin") as adm, stack.client("alpha") as a:
        r = adm.post("/v1/admin/pools/p1/reservations", json=body)
        assert r.status_code == 201 and r.json()["status"] == "upcoming", r.text
        listed = adm.get("/v1/admin/pools/p1/reservations").json()["reservations"]
        assert rid in [x["reservation_id"] for x in listed]
        r = adm.post(f"/v1/admin/pools/p1/reservations/{rid}/delete", json={})
        assert r.status_code == 200 and r.json()["status"] == "deleted", r.text
        r = adm.post("/v1/admin/pools/p1/reservations/Nope!/delete", json={})
        assert r.status_code == 404 and r.json()["code"] == "unknown_reservation"
        assert a.post("/v1/admin/pools/p1/reservations", json=body).status_code == 403


def test_a_secret_is_set_listed_used_and_deleted_over_http_never_shown(stack: Stack) -> None:
    import base64

    value = b"http-" + uuid.uuid4().hex.encode()
    with stack.client("alpha") as c, stack.client("beta") as other:
        r = c.post("/v1/secrets", json={"name": "gw-token",
                                        "value": base64.b64encode(value).decode()})
        assert r.status_code == 201, r.text
        assert r.json()["secret"]["version"] == 1 and value.decode() not in r.text
        listed = c.get("/v1/secrets").json()["secrets"]
        assert [s["name"] for s in listed] == ["gw-token"] and value.decode() not in str(listed)
        assert other.get("/v1/secrets").json()["secrets"] == []
        # a job refers to it by name; another tenant's job cannot
        for client, ok in ((c, True), (other, False)):
            r = client.post("/v1/compute-leases", json=CONCEPT_BODY,
                            headers={"Idempotency-Key": "sec-" + uuid.uuid4().hex})
            lid = r.json()["lease_id"]
            assert wait_for(lambda lid=lid, client=client: client.get(
                f"/v1/compute-leases/{lid}").json()["state"] == "reserved")
            r = client.post(f"/v1/compute-leases/{lid}/commit", json={"job": {
                "image": "busybox@sha256:" + "a" * 64, "command": ["true"],
                "secret_env": {"TOKEN": "gw-token"}}})
            if ok:
                assert r.status_code == 200, r.text
            else:
                assert r.status_code == 404 and r.json()["code"] == "secret_unknown", r.text
            client.post(f"/v1/compute-leases/{lid}/cancel", json={})
        gone = c.post("/v1/secrets/gw-token/delete", json={})
        assert gone.status_code == 200 and gone.json()["deleted"] is True
        again = c.post("/v1/secrets/gw-token/delete", json={})
        assert again.status_code == 404 and again.json()["code"] == "secret_unknown"


def test_why_at_answers_over_http_from_the_decision_records(stack: Stack) -> None:
    import time

    wide = dict(CONCEPT_BODY, shape={**CONCEPT_BODY["shape"], "cpu_millis": 512_000})
    with stack.client("alpha") as a, stack.client("beta") as b:
        lid = a.post("/v1/compute-leases", json=wide).json()["lease_id"]
        why = f"/v1/compute-leases/{lid}/why"
        # no node can ever take it: rejected, and that is recorded with its reasons
        later = wait_for(lambda: (r := a.get(why, params={"at": time.time() + 1}).json())
                         .get("waiting") is False and r.get("state") != "not_yet_examined"
                         and r)
        assert later["state"] == "rejected", later
        assert later["record"]["reasons"], later
        assert a.get(why, params={"at": 1}).json()["state"] == "not_requested"
        bad = a.get(why, params={"at": "yesterday"})
        assert bad.status_code == 422 and bad.json()["code"] == "invalid_field"
        other = b.get(why, params={"at": time.time()})
        assert other.status_code == 404 and other.json()["code"] == "lease_not_found"


def test_the_view_routes_answer_as_they_were_at_a_time(stack: Stack) -> None:
    import time

    before = time.time()
    time.sleep(1.05)  # event times are kept per second: a second clear of the request
    with stack.client("alpha") as c, stack.client("admin") as adm:
        r = c.post("/v1/compute-leases", json=CONCEPT_BODY,
                   headers={"Idempotency-Key": "at-" + uuid.uuid4().hex})
        lid = r.json()["lease_id"]
        assert wait_for(lambda: any(i["lease_id"] == lid for i in c.get(
            "/v1/compute-leases", params={"limit": 1000}).json()["items"]))
        now = time.time() + 1
        page = c.get("/v1/compute-leases", params={"at": now, "limit": 1000}).json()
        assert lid in {i["lease_id"] for i in page["items"]} and page["as_of_seq"] > 0
        then = c.get("/v1/compute-leases", params={"at": before, "limit": 1000}).json()
        assert lid not in {i["lease_id"] for i in then["items"]}, then
        assert c.get("/v1/queue", params={"at": before}).json()["at"] == before
        for bad in ("soon", "nan", "-1"):
            r = c.get("/v1/queue", params={"at": bad})
            assert r.status_code == 422 and r.json()["code"] == "invalid_field", r.text
        nodes = adm.get("/v1/admin/views/capacity", params={"at": now}).json()["items"]
        assert {n["node_id"] for n in nodes} >= {"n1", "n2"}
        r = adm.get("/v1/admin/views/capacity", params={"at": "inf"})
        assert r.status_code == 422 and r.json()["code"] == "invalid_field", r.text
