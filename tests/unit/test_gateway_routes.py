"""The HTTP routes and the OpenAPI document stay one-to-one with the NATS route table."""

from __future__ import annotations

import msgspec

from gateway.openapi import document
from gateway.routes import ROUTES
from gateway.wire import LeaseCreate
from schemas import v1
from workers.routes import ROUTES as NATS_ROUTES

# what clients send: tenants' `pool.cmd.…` and the operator's `pool.admin.…` commands and
# `pool.ops.…` questions (agents' own `pool.node.…` reports, the orders sent to agents and the
# telemetry stream are not for HTTP)
CLIENT_PREFIXES = ("pool.cmd.", "pool.admin.", "pool.ops.")
OPERATOR_PREFIXES = ("pool.admin.", "pool.ops.")
# routes whose bytes flow on a NATS subject pair after the answer (docs/exec.md): over HTTP
# they need the gateway's WebSocket bridge, not built yet
NATS_ONLY = {"openSession"}


def test_every_client_facing_nats_route_has_an_http_route() -> None:
    mounted = {r.nats for r in ROUTES if r.nats}
    offered = {r.operation for r in NATS_ROUTES if r.subject.startswith(CLIENT_PREFIXES)}
    assert offered - mounted == NATS_ONLY
    assert mounted <= {r.operation for r in NATS_ROUTES}


def test_every_http_route_fills_every_parameter_of_its_subject() -> None:
    for r in ROUTES:
        if r.route is None:
            continue
        subject = r.subject("t1", {p: "x1" for p in r.path_params})
        assert "{" not in subject and subject.startswith(CLIENT_PREFIXES), subject
        assert r.admin == subject.startswith(OPERATOR_PREFIXES), r.operation_id
        if not r.admin:
            assert subject.startswith("pool.cmd.t1."), subject


def test_the_lease_request_over_http_is_the_nats_one_with_its_key_optional() -> None:
    http = {f.name: f for f in msgspec.structs.fields(LeaseCreate)}
    nats = {f.name: f for f in msgspec.structs.fields(v1.LeaseRequest)}
    assert set(http) == set(nats)
    required = {n for n, f in nats.items() if f.required}
    assert {n for n, f in http.items() if f.required} == required - {"idempotency_key"}


def test_the_openapi_schemas_are_the_nats_structs_schemas() -> None:
    doc = document()
    schemas = doc["components"]["schemas"]
    ref = "#/components/schemas/{name}"
    for r in ROUTES:
        if r.body is None or r.method != "POST" or r.doc_body is not None:
            continue
        _, components = msgspec.json.schema_components([r.body], ref_template=ref)
        for name, schema in components.items():
            assert schemas[name] == schema, name
        body = doc["paths"][r.path]["post"]["requestBody"]["content"]["application/json"]
        assert body["schema"]["$ref"].endswith("/" + r.body.__name__)
    assert doc["openapi"] == "3.1.0"


def test_every_error_code_of_every_layer_has_a_deliberate_http_status() -> None:
    import inspect

    import bus.errors
    import domain.errors
    import workers.errors
    from gateway.problems import STATUS_BY_CODE
    from schemas.codec import SCHEMA_ERROR_CODES

    codes = set(SCHEMA_ERROR_CODES)
    for module in (domain.errors, workers.errors, bus.errors):
        for _, cls in inspect.getmembers(module, inspect.isclass):
            code = getattr(cls, "code", None)
            if isinstance(code, str) and issubclass(cls, Exception):
                codes.add(code)
    assert codes - set(STATUS_BY_CODE) == set()
    assert all(400 <= s < 500 or s in (502, 503) for s in STATUS_BY_CODE.values())
