"""The OpenAPI 3.1 document of the HTTP API, built from the route table and the same msgspec
Structs the NATS API decodes with, so the two cannot drift apart."""

from __future__ import annotations

from typing import Any

import msgspec
from msgspec import Struct

from gateway import examples
from gateway.problems import PROBLEM_JSON, STATUS_BY_CODE, TITLES, Problem
from gateway.routes import ROUTES, HttpRoute
from gateway.wire import Lease, Page, Whoami
from schemas.codec import MAX_PAYLOAD_BYTES

REF = "#/components/schemas/{name}"
VERSION = "1.0.0"


def _structs() -> list[type[Struct]]:
    seen: dict[str, type[Struct]] = {}
    for r in ROUTES:
        body = r.doc_body or r.body
        if body is not None and r.method == "POST":
            seen[body.__name__] = body
    for t in (Lease, Page, Problem, Whoami):
        seen[t.__name__] = t
    return list(seen.values())


# what no code of STATUS_BY_CODE names: a failure of the gateway itself (app._http_error)
_UNCODED = {500: ("Internal Server Error", "internal_error")}


def _json(name: str) -> dict[str, Any]:
    """A media type whose schema is the component `name`, with its example when there is one."""
    media: dict[str, Any] = {"schema": {"$ref": REF.format(name=name)}}
    if name in examples.BY_SCHEMA:
        media["example"] = examples.BY_SCHEMA[name]
    return media


def _problem_responses(route: HttpRoute) -> dict[str, Any]:
    # a body names pools, tenants and nodes too: any operation may meet 404 and 409; and any
    # may meet a failure behind the gateway (502) or of the gateway itself (500)
    statuses = {400, 401, 403, 404, 409, 422, 429, 500, 502, 503}
    if route.body is not None:
        statuses.add(413)
    out: dict[str, Any] = {}
    for s in sorted(statuses):
        codes = sorted(c for c, st in STATUS_BY_CODE.items() if st == s)
        title = TITLES.get(s) or _UNCODED[s][0]
        example = examples.problem(s, codes[0] if codes else _UNCODED[s][1], title,
                                   route.path)
        out[str(s)] = {
            "description": f"{title}: " + ", ".join(codes or [_UNCODED[s][1]]),
            "content": {PROBLEM_JSON: {"schema": {"$ref": REF.format(name="Problem")},
                                       "example": example}},
        }
    return out


def _ok_response(route: HttpRoute) -> dict[str, Any]:
    if route.reply == "stream":
        return {"description": "A stream of Server-Sent Events (`id`, `event`, `data` JSON)",
                "content": {"text/event-stream": {"schema": {"type": "string"}}}}
    media: dict[str, Any]
    if route.reply == "lease":
        media = _json("Lease")
    elif route.reply == "page":
        media = _json("Page")
    elif route.reply == "principal":
        media = _json("Whoami")
    else:
        # the command's result: an object whose fields are the command's own (docs/api.md)
        media = {"schema": {"type": "object", "additionalProperties": True}}
    return {"description": "OK" if route.status == 200 else "Created",
            "content": {"application/json": media}}


def _parameters(route: HttpRoute) -> list[dict[str, Any]]:
    params: list[dict[str, Any]] = [
        {"name": p, "in": "path", "required": True,
         "schema": {"type": "string", "pattern": "^[a-z0-9_-]{1,128}$"}}
        for p in route.path_params
    ]
    if route.operation_id == "createComputeLease":
        params.append({"name": "Idempotency-Key", "in": "header", "required": False,
                       "description": "The request's idempotency key (overrides none in the "
                       "body; another body with the same key is 409).",
                       "schema": {"type": "string",
                                  "pattern": "^[A-Za-z0-9][A-Za-z0-9_.:/-]{0,127}$"}})
    if route.reply == "page":
        params += [{"name": "limit", "in": "query", "required": False,
                    "schema": {"type": "integer", "minimum": 1, "maximum": 1000}},
                   {"name": "cursor", "in": "query", "required": False,
                    "schema": {"type": "string", "maxLength": 256}}]
    for f in route.query:
        params.append({"name": f, "in": "query", "required": False,
                       "schema": {"type": "string", "maxLength": 256}})
    for f in route.numbers:
        params.append({"name": f, "in": "query", "required": False,
                       "schema": {"type": "number", "minimum": 0}})
    if route.reply == "stream":
        params.append({"name": "Last-Event-ID", "in": "header", "required": False,
                       "schema": {"type": "string", "pattern": "^[0-9]{1,19}$"}})
        if route.operation_id == "streamComputeLeaseLogs":
            params += [{"name": "follow", "in": "query", "required": False,
                        "schema": {"enum": ["0", "1"]}},
                       {"name": "since", "in": "query", "required": False,
                        "schema": {"type": "number", "minimum": 0}}]
        if route.operation_id == "streamTelemetry":
            params += [{"name": n, "in": "query", "required": False, "schema": s} for n, s in (
                ("lease", {"type": "string", "pattern": "^[a-z0-9_-]{1,128}$"}),
                ("kind", {"enum": ["queue", "startup", "execution", "utilization", "failure",
                                  "output"]}),
                ("since", {"type": "number", "minimum": 0}),
            )]
    return params


def document() -> dict[str, Any]:
    """The whole OpenAPI 3.1 document."""
    _, components = msgspec.json.schema_components(_structs(), ref_template=REF)
    paths: dict[str, dict[str, Any]] = {}
    for r in ROUTES:
        op: dict[str, Any] = {
            "operationId": r.operation_id,
            "summary": r.summary,
            "tags": [r.tag],
            "parameters": _parameters(r),
            "responses": {str(r.status): _ok_response(r), **_problem_responses(r)},
        }
        nats = r.route
        if nats is not None:
            op["x-nats-subject"] = nats.subject
        body = r.doc_body or r.body
        if body is not None and r.method == "POST":
            op["requestBody"] = {
                "required": r.operation_id == "createComputeLease" or r.admin,
                "content": {"application/json": _json(body.__name__)},
            }
        paths.setdefault(r.path, {})[r.method.lower()] = op
    from gateway.files import PATHS

    paths.update(PATHS)
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "computepool HTTP API",
            "version": VERSION,
            "description": "The command subjects over HTTP: a tenant token acts as that "
            "tenant's NATS user. Errors are RFC 9457 problem+json with the NATS API's codes. "
            f"Bodies are at most {MAX_PAYLOAD_BYTES} bytes.",
        },
        "jsonSchemaDialect": "https://json-schema.org/draft/2020-12/schema",
        "servers": [{"url": "/"}],
        "security": [{"bearer": []}],
        "paths": paths,
        "components": {
            "schemas": components,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer",
                                           "description": "`pool admin tenant token T`"}},
        },
    }
