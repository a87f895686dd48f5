"""Generate schemas/json/: one JSON Schema per public Struct plus an AsyncAPI 3.0 document.
Regenerate: `python -m schemas.export [DIR]`; docs/architecture.md#wire-types-and-their-evolution.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any, NamedTuple

import msgspec
from msgspec import Struct

from schemas import feed, secret, session, v1, webhook

DEFAULT_DIRECTORY = Path(__file__).resolve().parent / "json"
# every Struct a reader of the wire may meet: version 1's and the lease feed's
PUBLIC_STRUCTS: tuple[type[Struct], ...] = (v1.PUBLIC_STRUCTS + feed.PUBLIC_STRUCTS
                                              + webhook.PUBLIC_STRUCTS + session.PUBLIC_STRUCTS
                                              + secret.PUBLIC_STRUCTS)
JSON_SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"
ASYNCAPI_FILE = "asyncapi.json"


def render(document: dict[str, Any]) -> bytes:
    """The canonical bytes of a document: what export writes and what the drift test compares."""
    return (json.dumps(document, sort_keys=True, indent=2, ensure_ascii=True) + "\n").encode()


def json_schema(struct: type[Struct]) -> dict[str, Any]:
    """A standalone JSON Schema for one Struct: its definition at the root, parts in $defs."""
    generated = msgspec.json.schema(struct)
    defs: dict[str, Any] = dict(generated.get("$defs", {}))
    root = defs.pop(struct.__name__)
    doc: dict[str, Any] = {
        "$schema": JSON_SCHEMA_DIALECT,
        "$id": f"urn:computepool:schema:{struct.__name__}:v{v1.CURRENT_SCHEMA_VERSION}",
        **root,
    }
    if defs:
        doc["$defs"] = defs
    return doc


# -- AsyncAPI ----------------------------------------------------------------------------------


class Channel(NamedTuple):
    """One AsyncAPI channel and its operation (workers.routes builds these from its table)."""

    id: str
    address: str
    payload: type[Struct]
    operation: str
    action: str  # "receive": the plane answers or consumes it; "send": the plane sends it
    summary: str
    replies: bool  # answered with an Envelope on the requester's inbox
    parameters: dict[str, dict[str, Any]]


def _message(struct: type[Struct]) -> dict[str, Any]:
    doc = (struct.__doc__ or "").strip().splitlines()
    return {
        "name": struct.__name__,
        "title": struct.__name__,
        "summary": doc[0] if doc else struct.__name__,
        "contentType": "application/json",
        "payload": {"$ref": f"#/components/schemas/{struct.__name__}"},
    }


def asyncapi(channel_rows: Iterable[Channel]) -> dict[str, Any]:
    """An AsyncAPI 3.0 document for the control plane: the channels (the route table's,
    `workers.routes.asyncapi_channels()`) with the Structs as their payloads."""
    _, schemas = msgspec.json.schema_components(
        PUBLIC_STRUCTS, ref_template="#/components/schemas/{name}"
    )
    channels: dict[str, Any] = {
        # Replies go to the requester's inbox: NATS request/reply, so the address is dynamic.
        "replyInbox": {
            "address": None,
            "description": "The requester's reply subject (a NATS _INBOX); replies are Envelopes.",
            "messages": {"Envelope": {"$ref": "#/components/messages/Envelope"}},
        }
    }
    operations: dict[str, Any] = {}
    messages: dict[str, Any] = {"Envelope": _message(v1.Envelope)}
    for channel_id, address, payload, op_id, action, summary, replies, params in channel_rows:
        name = payload.__name__
        messages[name] = _message(payload)
        channels[channel_id] = {
            "address": address,
            "messages": {name: {"$ref": f"#/components/messages/{name}"}},
        }
        if params:  # a channel's parameters are its address's expressions: none, no map
            channels[channel_id]["parameters"] = params
        op: dict[str, Any] = {
            "action": action,
            "summary": summary,
            "channel": {"$ref": f"#/channels/{channel_id}"},
            "messages": [{"$ref": f"#/channels/{channel_id}/messages/{name}"}],
        }
        if replies:
            op["reply"] = {
                "channel": {"$ref": "#/channels/replyInbox"},
                "messages": [{"$ref": "#/channels/replyInbox/messages/Envelope"}],
            }
        operations[op_id] = op
    return {
        "asyncapi": "3.0.0",
        "id": "urn:computepool:control-plane",
        "info": {
            "title": "computepool control plane",
            "version": f"{v1.CURRENT_SCHEMA_VERSION}.0.0",
            "description": (
                "Commands, agent messages and telemetry of an event-sourced compute pool on NATS"
                " JetStream. Every payload carries schema_version; commands refuse unknown fields."
            ),
        },
        "defaultContentType": "application/json",
        "channels": channels,
        "operations": operations,
        "components": {"messages": messages, "schemas": schemas},
    }


def documents(channel_rows: Iterable[Channel]) -> dict[str, bytes]:
    """File name -> canonical bytes for everything export writes."""
    out = {f"{s.__name__}.json": render(json_schema(s)) for s in PUBLIC_STRUCTS}
    out[ASYNCAPI_FILE] = render(asyncapi(channel_rows))
    return out


def export(channel_rows: Iterable[Channel], directory: str | Path = DEFAULT_DIRECTORY) -> list[Path]:
    """Write every schema file into `directory` (created if missing); returns the paths, sorted."""
    target = Path(directory)
    target.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, data in sorted(documents(channel_rows).items()):
        path = target / name
        path.write_bytes(data)
        paths.append(path)
    return paths
