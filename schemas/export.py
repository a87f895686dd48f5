"""Generate schemas/json/: one JSON Schema per public Struct plus an AsyncAPI 3.0 document.

Output is deterministic (sorted keys, indent 2, trailing newline) so the committed files can be
compared byte for byte with the Structs; `python -m schemas.export [DIR]` regenerates them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import msgspec
from msgspec import Struct

from schemas import v1

DEFAULT_DIRECTORY = Path(__file__).resolve().parent / "json"
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

_PARAMETERS: dict[str, dict[str, Any]] = {
    "tenant": {"description": "Tenant id (a subject token)."},
    "lease_id": {"description": "Lease id (a subject token)."},
    "view": {"description": "Name of a projection view."},
    "node": {"description": "Node id (a subject token)."},
    "pool": {"description": "Pool id (a subject token)."},
    "lease": {"description": "Lease id (a subject token)."},
    "verb": {
        "description": "Node maintenance verb.",
        "enum": ["cordon", "drain", "maintenance", "uncordon", "end-maintenance", "lost"],
    },
    "kind": {
        "description": "Telemetry kind.",
        "enum": list(v1.TelemetryKind.__args__),  # type: ignore[attr-defined]
    },
}

_LEASE_VERBS: tuple[tuple[str, type[Struct], str], ...] = (
    ("commit", v1.CommitLease, "Commit a reserved lease and attach its job."),
    ("heartbeat", v1.HeartbeatLease, "Heartbeat a lease (fenced by epoch)."),
    ("renew", v1.RenewLease, "Extend a lease's deadline."),
    ("release", v1.ReleaseLease, "Release a lease's capacity."),
    ("cancel", v1.CancelLease, "Cancel a pending or running lease."),
    ("get", v1.GetLease, "Read a lease."),
    ("why", v1.WhyLease, "Explain why a lease is pending."),
)

_AGENT_VERBS: tuple[tuple[str, type[Struct], str, str], ...] = (
    ("register", v1.NodeRegistration, "receive", "A node agent registers its capabilities."),
    ("heartbeat", v1.NodeHeartbeat, "receive", "A node agent reports it is alive."),
    ("drain", v1.NodeDrain, "receive", "A node agent asks to take no new leases."),
    ("assign", v1.LeaseAssignment, "send", "The pool tells an agent to start a lease's job."),
    ("revoke", v1.LeaseRevocation, "send", "The pool tells an agent to stop a lease."),
)


def _channels() -> list[tuple[str, str, type[Struct], str, str, str, bool]]:
    """(channel id, address, payload, operation id, action, summary, replies with Envelope)."""
    rows: list[tuple[str, str, type[Struct], str, str, str, bool]] = [
        (
            "leaseRequest",
            "pool.cmd.{tenant}.lease.request",
            v1.LeaseRequest,
            "requestLease",
            "receive",
            "Request a lease on capacity of a resource shape.",
            True,
        )
    ]
    for verb, payload, summary in _LEASE_VERBS:
        rows.append(
            (
                f"lease{verb.capitalize()}",
                f"pool.cmd.{{tenant}}.lease.{{lease_id}}.{verb}",
                payload,
                f"{verb}Lease",
                "receive",
                summary,
                True,
            )
        )
    rows.append(
        (
            "query",
            "pool.cmd.{tenant}.query.{view}",
            v1.Query,
            "queryView",
            "receive",
            "Read a projection view.",
            True,
        )
    )
    rows.append(
        (
            "telemetryReplay",
            "pool.cmd.{tenant}.telemetry.replay",
            v1.TelemetryReplay,
            "replayTelemetry",
            "receive",
            "A page of the tenant's own telemetry from the stream (replay without consumers).",
            True,
        )
    )
    for verb, payload, action, summary in _AGENT_VERBS:
        rows.append(
            (
                f"agent{verb.capitalize()}",
                f"pool.agent.{{node}}.{verb}",
                payload,
                f"agent{verb.capitalize()}",
                action,
                summary,
                action == "receive",
            )
        )
    rows.append(
        (
            "nodeLeaseStopped",
            "pool.node.{node}.lease.{lease_id}.stopped",
            v1.LeaseStopped,
            "confirmLeaseStopped",
            "receive",
            "A node agent confirms a lease's workload is gone, so its capacity can be freed.",
            True,
        )
    )
    for path, payload, summary in (
        ("pool.set", v1.PoolConfig, "Create or reconfigure a pool."),
        ("pool.show", v1.PoolShow, "Every setting in force for a pool."),
        ("pool.prices", v1.PriceListConfig, "Publish a new price list version."),
        ("pool.images", v1.ImagePolicyConfig, "Replace a pool's image policy (a new version)."),
        ("tenant.set", v1.TenantConfig, "Set a tenant's weight and quota in a pool."),
        ("node.register", v1.NodeRegistration, "Register or re-register a node."),
        ("credits.grant", v1.CreditGrant, "Grant micro-credits, idempotent by transfer id."),
    ):
        name = "".join(part.capitalize() for part in path.split("."))
        rows.append(
            (f"admin{name}", f"pool.admin.{path}", payload, f"admin{name}", "receive", summary,
             True)
        )
    rows.append(
        (
            "adminNodeState",
            "pool.admin.node.{node}.{verb}",
            v1.NodeStateChange,
            "adminNodeState",
            "receive",
            "Cordon, drain, put in maintenance or return a node.",
            True,
        )
    )
    rows.append(
        (
            "telemetry",
            "pool.tel.{pool}.{node}.{tenant}.{lease}.{kind}",
            v1.TelemetryEvent,
            "receiveTelemetry",
            "receive",
            ("Queue, startup, execution, utilization and failure events from node agents"
            " (the tenant token lets NATS permissions give each tenant only its own leases)."),
            False,
        )
    )
    return rows


def _message(struct: type[Struct]) -> dict[str, Any]:
    doc = (struct.__doc__ or "").strip().splitlines()
    return {
        "name": struct.__name__,
        "title": struct.__name__,
        "summary": doc[0] if doc else struct.__name__,
        "contentType": "application/json",
        "payload": {"$ref": f"#/components/schemas/{struct.__name__}"},
    }


def asyncapi() -> dict[str, Any]:
    """An AsyncAPI 3.0 document for the control plane, generated from the Structs."""
    _, schemas = msgspec.json.schema_components(
        v1.PUBLIC_STRUCTS, ref_template="#/components/schemas/{name}"
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
    for channel_id, address, payload, op_id, action, summary, replies in _channels():
        name = payload.__name__
        messages[name] = _message(payload)
        params = [p.strip("{}") for p in address.split(".") if p.startswith("{")]
        channels[channel_id] = {
            "address": address,
            "parameters": {p: _PARAMETERS[p] for p in params},
            "messages": {name: {"$ref": f"#/components/messages/{name}"}},
        }
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


def documents() -> dict[str, bytes]:
    """File name -> canonical bytes for everything export writes."""
    out = {f"{s.__name__}.json": render(json_schema(s)) for s in v1.PUBLIC_STRUCTS}
    out[ASYNCAPI_FILE] = render(asyncapi())
    return out


def export(directory: str | Path = DEFAULT_DIRECTORY) -> list[Path]:
    """Write every schema file into `directory` (created if missing); returns the paths, sorted."""
    target = Path(directory)
    target.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, data in sorted(documents().items()):
        path = target / name
        path.write_bytes(data)
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    paths = export(args[0] if args else DEFAULT_DIRECTORY)
    for p in paths:
        print(p)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
