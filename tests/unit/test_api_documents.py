"""Both API documents pass a real validator and a lint for what validators let through and
generated clients trip on: arrays without items, $refs that go nowhere, untyped responses,
unstable or duplicate operationIds, and examples that do not match their schemas."""

from __future__ import annotations

import copy
import json
import re
import warnings
from collections.abc import Iterator
from typing import Any

import jsonschema
import msgspec
import pytest
from openapi_spec_validator import validate

from gateway.files import PATHS as FILE_PATHS
from gateway.openapi import document
from gateway.problems import PROBLEM_JSON, Problem
from gateway.routes import ROUTES
from gateway.wire import Lease, LeaseCreate, Page
from schemas.export import ASYNCAPI_FILE, DEFAULT_DIRECTORY

# Clients are generated from these names (create_compute_lease, …): renaming one breaks them.
OPERATION_IDS = (
    "addWebhook", "adminGetComputeLease", "adminGetComputeLeaseHistory", "adminPoolShares",
    "cancelComputeLease",
    "commitComputeLease", "cordonNode", "createComputeLease", "createPool", "createReservation",
    "deleteReservation", "deleteSecret", "deleteWebhook", "deleteWorkdir", "drainNode", "endMaintenanceNode", "enrollNode",
    "getArtifact", "getBalance", "getComputeLease", "getComputeLeaseHistory", "getUsage",
    "getWorkdir", "grantCredits", "heartbeatComputeLease", "listArtifacts", "listComputeLeases", "listQueue", "listQueuePositions",
    "listReservations", "listSecrets", "listWebhookDeliveries", "listWebhookEndpointDeliveries",
    "listWebhooks", "lostNode", "maintenanceNode", "putWorkdir", "readView", "registerNode",
    "releaseComputeLease", "renewComputeLease", "resealSecrets", "setCohort", "setPool", "setPoolImages",
    "setPoolPrices", "setSecret", "setTenant", "showPool", "streamComputeLeaseEvents",
    "streamComputeLeaseLogs", "streamTelemetry", "testWebhook", "uncordonNode", "whoami",
    "whyComputeLease",
)
# the bodies that show an example, by component name
STRUCTS: dict[str, type[msgspec.Struct]] = {"LeaseCreate": LeaseCreate, "Lease": Lease,
                                            "Page": Page, "Problem": Problem}
METHODS = ("get", "put", "post", "delete", "patch", "head", "options", "trace")


def _nodes(node: Any, pointer: str = "#") -> Iterator[tuple[str, dict[str, Any]]]:
    """Every object in a document, with its JSON pointer."""
    if isinstance(node, dict):
        yield pointer, node
        for key, value in node.items():
            yield from _nodes(value, f"{pointer}/{str(key).replace('~', '~0').replace('/', '~1')}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _nodes(value, f"{pointer}/{i}")


def _resolve(doc: dict[str, Any], ref: str) -> Any:
    node: Any = doc
    for part in ref.removeprefix("#/").split("/"):
        node = node[part.replace("~1", "/").replace("~0", "~")]
    return node


def _unresolved_refs(doc: dict[str, Any]) -> list[str]:
    bad = []
    for pointer, node in _nodes(doc):
        ref = node.get("$ref")
        if not isinstance(ref, str):
            continue
        if not ref.startswith("#/"):
            bad.append(f"{pointer}: {ref} (not local)")
            continue
        try:
            _resolve(doc, ref)
        except (KeyError, IndexError, TypeError):
            bad.append(f"{pointer}: {ref}")
    return bad


def _arrays_without_items(doc: dict[str, Any]) -> list[str]:
    out = []
    for pointer, node in _nodes(doc):
        kind = node.get("type")
        if (kind == "array" or (isinstance(kind, list) and "array" in kind)) and not (
                "items" in node or "prefixItems" in node):
            out.append(pointer)
    return out


def _operations(doc: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    for path, item in doc["paths"].items():
        for method in METHODS:
            if method in item:
                yield f"{method.upper()} {path}", item[method]


def _untyped_responses(doc: dict[str, Any]) -> list[str]:
    """Responses a generator cannot type: none at all, no success, a media type without a
    schema (or one that is neither a $ref nor typed), an error that is not a Problem."""
    out = []
    for name, op in _operations(doc):
        responses = op.get("responses") or {}
        if not any(s.startswith("2") for s in responses):
            out.append(f"{name}: no success response")
        for status, response in responses.items():
            content = response.get("content") or {}
            if not content:
                out.append(f"{name} {status}: no content")
            for media_type, media in content.items():
                schema = media.get("schema") or {}
                if "$ref" not in schema and "type" not in schema:
                    out.append(f"{name} {status} {media_type}: untyped")
            if not status.startswith("2") and content != {
                    PROBLEM_JSON: {**content.get(PROBLEM_JSON, {}),
                                   "schema": {"$ref": "#/components/schemas/Problem"}}}:
                out.append(f"{name} {status}: not a problem+json Problem")
    return out


def _operation_id_faults(doc: dict[str, Any]) -> list[str]:
    ids = [op.get("operationId") for _, op in _operations(doc)]
    out = [f"duplicate {i}" for i in sorted({i for i in ids if ids.count(i) > 1}, key=str)]
    out += [f"not camelCase: {i}" for i in ids
            if not isinstance(i, str) or not re.fullmatch(r"[a-z][A-Za-z0-9]*", i)]
    return out


def _lint(doc: dict[str, Any]) -> list[str]:
    return (_unresolved_refs(doc) + _arrays_without_items(doc) + _untyped_responses(doc)
            + _operation_id_faults(doc))


def test_the_openapi_document_passes_the_openapi_3_1_validator() -> None:
    doc = document()
    assert doc["openapi"] == "3.1.0"
    validate(doc)


def test_the_openapi_document_lints_clean() -> None:
    assert _lint(document()) == []


def test_the_lint_finds_the_faults_generated_clients_trip_on() -> None:
    doc = document()
    # issue 44's fault: a generator dropped Lease, and with it every lease operation's reply
    doc["components"]["schemas"]["Lease"]["properties"]["devices"] = {"type": "array",
                                                                      "default": []}
    doc["paths"]["/v1/balance"]["get"]["operationId"] = "getComputeLease"
    doc["paths"]["/v1/usage"]["get"]["responses"]["200"]["content"]["application/json"] = {}
    doc["paths"]["/v1/queue"]["get"]["responses"]["404"]["content"] = {
        "application/json": {"schema": {"type": "object"}}}
    doc["components"]["schemas"].pop("LeaseGang")
    assert _lint(doc) == [
        "#/components/schemas/Lease/properties/gang/anyOf/0: #/components/schemas/LeaseGang",
        "#/components/schemas/Lease/properties/devices",
        "GET /v1/queue 404: not a problem+json Problem",
        "GET /v1/usage 200 application/json: untyped",
        "duplicate getComputeLease",
    ]


def test_the_operation_ids_are_the_route_tables_and_do_not_change() -> None:
    ids = sorted(op["operationId"] for _, op in _operations(document()))
    # the route table's, and the files' (gateway/files.py: bytes, not a command's body)
    files = [op["operationId"] for ops in FILE_PATHS.values() for op in ops.values()]
    assert ids == sorted([r.operation_id for r in ROUTES] + files)
    assert tuple(ids) == OPERATION_IDS


def test_every_example_matches_its_schema_field_for_field() -> None:
    doc = document()
    seen = set()
    for pointer, media in _nodes(doc["paths"]):
        if "example" not in media or "schema" not in media:
            continue
        schema = media["schema"]
        # validated within the document, so the example's $refs resolve as a client's would
        jsonschema.Draft202012Validator({**schema, "components": doc["components"]}).validate(
            media["example"])
        if "$ref" in schema:
            name = schema["$ref"].rsplit("/", 1)[1]
            declared = _resolve(doc, schema["$ref"]).get("properties", {})
            assert set(media["example"]) <= set(declared), pointer
            # and as the gateway itself decodes (or encodes) that body
            msgspec.convert(media["example"], STRUCTS[name])
            seen.add(name)
    assert seen == set(STRUCTS)


# -- AsyncAPI ----------------------------------------------------------------------------------


def _asyncapi_faults(doc: dict[str, Any]) -> list[str]:
    """What the AsyncAPI 3.0 object model refuses, then what it lets through (refs)."""
    import pydantic

    with warnings.catch_warnings():
        # its own models shadow pydantic's `schema`: a warning at import, nothing of ours
        warnings.simplefilter("ignore", UserWarning)
        from asyncapi3.models import AsyncAPI3
    try:
        AsyncAPI3.model_validate(doc)
    except pydantic.ValidationError as e:
        return [f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors()]
    return _unresolved_refs(doc) + _arrays_without_items(doc)


def _asyncapi_file() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads((DEFAULT_DIRECTORY / ASYNCAPI_FILE).read_bytes())
    return loaded


def test_the_asyncapi_document_passes_the_asyncapi_3_validator() -> None:
    doc = _asyncapi_file()
    assert doc["asyncapi"] == "3.0.0"
    assert _asyncapi_faults(doc) == []
    # the payloads are JSON Schema 2020-12 (the dialect msgspec writes)
    for schema in doc["components"]["schemas"].values():
        jsonschema.Draft202012Validator.check_schema(schema)


@pytest.mark.parametrize("fault", ["action", "channel_parameters", "dangling_ref"])
def test_the_asyncapi_validator_refuses_a_broken_document(fault: str) -> None:
    doc = copy.deepcopy(_asyncapi_file())
    op = doc["operations"]["requestLease"]
    if fault == "action":
        op["action"] = "publish"  # AsyncAPI 2's verb
    elif fault == "channel_parameters":
        doc["channels"]["adminCreditsGrant"]["parameters"] = {}
    else:
        op["channel"] = {"$ref": "#/channels/nowhere"}
    assert _asyncapi_faults(doc) != []
