"""The one way bytes from the wire become typed commands: `decode_command(kind, data)`.
Rules for every decode: docs/architecture.md#wire-types-and-their-evolution.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Literal, TypeVar

import msgspec
from msgspec import Struct

from schemas import feed, secret, session, v1, webhook

MAX_PAYLOAD_BYTES: Final = 64 * 1024
_MAX_MESSAGE_CHARS: Final = 300  # field names are attacker-chosen: keep messages short

SchemaErrorCode = Literal[
    "malformed_json",
    "invalid_field",
    "unknown_field",
    "missing_field",
    "payload_too_large",
    "invalid_utf8",
    "unsupported_schema_version",
    "unknown_kind",
]
SCHEMA_ERROR_CODES: Final[tuple[str, ...]] = SchemaErrorCode.__args__  # type: ignore[attr-defined]


class SchemaError(ValueError):
    """A payload that is not a valid message of the expected kind and version."""

    def __init__(self, code: SchemaErrorCode, message: str, path: str | None = None) -> None:
        # One line, bounded: the message is echoed back to clients and into logs.
        # Non-printables (newlines, U+2028, NUL) in attacker-chosen names are escaped.
        message = "".join(c if c.isprintable() else ascii(c)[1:-1] for c in message)
        if len(message) > _MAX_MESSAGE_CHARS:
            message = message[: _MAX_MESSAGE_CHARS - 3] + "..."
        super().__init__(message)
        self.code: SchemaErrorCode = code
        self.message = message
        # JSONPath of the offending field ("$.shape.cpu_millis"), if known; bounded like message.
        if path is not None and len(path) > _MAX_MESSAGE_CHARS:
            path = path[: _MAX_MESSAGE_CHARS - 3] + "..."
        self.path = path

    def to_error_body(self) -> v1.ErrorBody:
        reasons: dict[str, int | str] = {"path": self.path} if self.path else {}
        return v1.ErrorBody(code=self.code, message=self.message, reasons=reasons)

    def to_envelope(self) -> v1.Envelope:
        return v1.Envelope(ok=False, error=self.to_error_body())

    def __repr__(self) -> str:
        return f"SchemaError({self.code!r}, {self.message!r})"


Upcaster = Callable[[dict[str, Any]], dict[str, Any]]


@dataclass(frozen=True)
class CommandSpec:
    """How one kind decodes: its current Struct, version, and upcasters from older versions."""

    type: type[Struct]
    version: int = v1.CURRENT_SCHEMA_VERSION
    # upcasters[n] turns a version-n body (a dict) into a version-(n+1) body.
    upcasters: Mapping[int, Upcaster] = field(default_factory=dict)

    @functools.cached_property
    def decoder(self) -> msgspec.json.Decoder[Any]:
        """Built on first use: building every kind's at import cost a CLI call ~30 ms."""
        return msgspec.json.Decoder(self.type)


# Kinds are named after what follows the tenant/node in the subject.
COMMANDS: Final[Mapping[str, CommandSpec]] = {
    "lease.request": CommandSpec(v1.LeaseRequest),
    "lease.commit": CommandSpec(v1.CommitLease),
    "lease.heartbeat": CommandSpec(v1.HeartbeatLease),
    "lease.renew": CommandSpec(v1.RenewLease),
    "lease.release": CommandSpec(v1.ReleaseLease),
    "lease.cancel": CommandSpec(v1.CancelLease),
    "lease.get": CommandSpec(v1.GetLease),
    "lease.why": CommandSpec(v1.WhyLease),
    "lease.queue": CommandSpec(v1.QueuePositions),
    "lease.session": CommandSpec(session.SessionOpen),
    "query": CommandSpec(v1.Query),
    "telemetry.replay": CommandSpec(v1.TelemetryReplay),
    "feed.replay": CommandSpec(feed.FeedReplay),
    "webhook.add": CommandSpec(webhook.WebhookAdd),
    "webhook.list": CommandSpec(webhook.WebhookList),
    "webhook.delete": CommandSpec(webhook.WebhookDelete),
    "webhook.test": CommandSpec(webhook.WebhookTest),
    "webhook.deliveries": CommandSpec(webhook.WebhookDeliveries),
    "secret.set": CommandSpec(secret.SecretSet),
    "secret.list": CommandSpec(secret.SecretList),
    "secret.delete": CommandSpec(secret.SecretDelete),
    "node.secrets": CommandSpec(secret.SecretFetch),
    "admin.secrets.reseal": CommandSpec(secret.SecretReseal),
    "admin.pool": CommandSpec(v1.PoolConfig),
    "admin.pool.set": CommandSpec(v1.PoolPatch),
    "admin.tenant": CommandSpec(v1.TenantConfig),
    "admin.cohort": CommandSpec(v1.CohortConfig),
    "admin.reservation.create": CommandSpec(v1.ReservationCreate),
    "admin.reservation.delete": CommandSpec(v1.ReservationDelete),
    "admin.reservation.list": CommandSpec(v1.ReservationList),
    "admin.pool.show": CommandSpec(v1.PoolShow),
    "admin.pool.prices": CommandSpec(v1.PriceListConfig),
    "admin.pool.images": CommandSpec(v1.ImagePolicyConfig),
    "admin.credits.grant": CommandSpec(v1.CreditGrant),
    "admin.node.state": CommandSpec(v1.NodeStateChange),
    "admin.node.enroll": CommandSpec(v1.NodeEnrollment),
    "agent.register": CommandSpec(v1.NodeRegistration),
    "agent.heartbeat": CommandSpec(v1.NodeHeartbeat),
    "agent.drain": CommandSpec(v1.NodeDrain),
    "agent.assign": CommandSpec(v1.LeaseAssignment),
    "agent.revoke": CommandSpec(v1.LeaseRevocation),
    "agent.session": CommandSpec(session.SessionOrder),
    "node.stopped": CommandSpec(v1.LeaseStopped),
    "node.started": CommandSpec(v1.JobStarted),
    "node.exited": CommandSpec(v1.JobExited),
    "node.failed": CommandSpec(v1.JobFailed),
    "telemetry": CommandSpec(v1.TelemetryEvent),
    "feed": CommandSpec(feed.FeedRecord),
    "reply": CommandSpec(v1.Envelope),
}
COMMAND_KINDS: Final[tuple[str, ...]] = tuple(COMMANDS)


# msgspec ends messages with " - at `$.a.b`", or " - at `key` in `$.env`" for a dict key.
_AT = re.compile(r" - at (?:`key` in )?`(?P<path>[^`]*)`$")
_NAMED = re.compile(r"(unknown|missing required) field `(?P<name>.*)`", re.DOTALL)


def decode_command(kind: str, data: bytes | bytearray | memoryview | str) -> Struct:
    """Decode `data` as the current version of command `kind`, upcasting older versions."""
    spec = COMMANDS.get(kind) if isinstance(kind, str) else None
    if spec is None:
        raise SchemaError("unknown_kind", f"unknown command kind {kind!r}")
    return decode_with(spec, data)


T = TypeVar("T", bound=Struct)


def decode(type_: type[T], data: bytes | bytearray | memoryview | str) -> T:
    """Decode `data` as `type_` (current version, no upcasting), with decode_command's errors."""
    out: T = decode_with(CommandSpec(type_), data)  # type: ignore[assignment]
    return out


def decode_with(spec: CommandSpec, data: bytes | bytearray | memoryview | str) -> Struct:
    """Decode per `spec`; the engine under decode_command, public so tests can supply specs."""
    raw = _checked_bytes(data)
    version = _probe_version(raw)
    try:
        if version is not None and version > spec.version:
            raise SchemaError(
                "unsupported_schema_version",
                f"schema_version {version} is newer than the supported {spec.version}"
                " - at `$.schema_version`",
                "$.schema_version",
            )
        if version is not None and 1 <= version < spec.version:
            return _upcast_and_convert(spec, raw, version)
        return spec.decoder.decode(raw)  # type: ignore[no-any-return]
    except msgspec.ValidationError as e:
        raise _from_validation(str(e)) from None
    except msgspec.DecodeError as e:
        raise SchemaError("malformed_json", str(e)) from None
    except RecursionError:
        raise SchemaError("malformed_json", "JSON nested too deeply") from None


def encode(message: Struct) -> bytes:
    """The JSON bytes of a wire message (the inverse of decode_command)."""
    return msgspec.json.encode(message)


# -- internals ---------------------------------------------------------------------------------


def digest(message: Struct, *, omit: Iterable[str] = ()) -> str:
    """A fingerprint of a decoded command, the same for every spelling of the same command (key
    order, defaults written or left out): two requests under one idempotency key are one
    request exactly when their digests are equal. `omit` leaves fields out (a field added
    later, at its default, so digests recorded before it keep matching).

    The canonical text is `json.dumps` with sorted keys and no spaces, byte for byte, as
    recorded digests were made. msgspec writes the same bytes for a command that cannot hold
    a float and whose text is printable ASCII without escapes, in a fraction of the time, so
    such a command takes that way; any other takes json's."""
    body = msgspec.to_builtins(message)
    for name in omit:
        body.pop(name, None)
    if _floatless(type(message)):
        try:
            fast = _SORTED_JSON.encode(body)
        except (msgspec.EncodeError, OverflowError):
            fast = b""
        if fast and fast.isascii() and b"\\" not in fast and b"\x7f" not in fast:
            return hashlib.sha256(fast).hexdigest()
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


_SORTED_JSON = msgspec.json.Encoder(order="sorted")


@functools.cache
def _floatless(kind: type) -> bool:
    """Whether a value of `kind` can never hold a float, nor a dict key other than text (json
    and msgspec write floats differently and sort other keys differently)."""
    return _no_float(msgspec.inspect.type_info(kind), set())


def _no_float(t: Any, seen: set[type]) -> bool:
    mi = msgspec.inspect
    if isinstance(t, (mi.IntType, mi.StrType, mi.BoolType, mi.NoneType)):
        return True
    if isinstance(t, mi.Metadata):  # a kind with extra JSON schema or a custom name
        return _no_float(t.type, seen)
    if isinstance(t, mi.LiteralType):
        return all(isinstance(v, (str, int)) for v in t.values)
    if isinstance(t, mi.StructType):
        if t.cls in seen:
            return True
        seen.add(t.cls)
        return all(_no_float(f.type, seen) for f in t.fields)
    if isinstance(t, mi.UnionType):
        return all(_no_float(u, seen) for u in t.types)
    if isinstance(t, (mi.ListType, mi.SetType, mi.FrozenSetType, mi.VarTupleType)):
        return _no_float(t.item_type, seen)
    if isinstance(t, mi.TupleType):
        return all(_no_float(u, seen) for u in t.item_types)
    if isinstance(t, mi.DictType):
        return isinstance(t.key_type, mi.StrType) and _no_float(t.value_type, seen)
    return False  # a float, Any, or a kind not looked at: json's way


def _checked_bytes(data: object) -> bytes:
    if isinstance(data, str):
        try:
            data = data.encode("utf-8")
        except UnicodeEncodeError:  # lone surrogates
            raise SchemaError("invalid_utf8", "payload is not valid UTF-8") from None
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise SchemaError("malformed_json", f"payload must be bytes, not {type(data).__name__}")
    raw = bytes(data)
    if len(raw) > MAX_PAYLOAD_BYTES:
        raise SchemaError(
            "payload_too_large", f"payload is {len(raw)} bytes; the limit is {MAX_PAYLOAD_BYTES}"
        )
    try:
        # Checked up front: msgspec only rejects bad UTF-8 inside strings it reads.
        raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise SchemaError("invalid_utf8", f"payload is not valid UTF-8 (byte {e.start})") from None
    # An empty body is an empty object: `nc.request(subject, b"")` for get/why is natural.
    return raw if raw.strip() else b"{}"


def _probe_version(raw: bytes) -> int | None:
    """The body's schema_version when it is an int; None leaves the error to the full decode.

    A full untyped parse first, so that broken JSON is always "malformed_json" (a typed decode
    reports a type mismatch as soon as it sees the first byte of "[").
    """
    try:
        obj = msgspec.json.decode(raw)
    except msgspec.DecodeError as e:
        raise SchemaError("malformed_json", str(e)) from None
    except RecursionError:
        raise SchemaError("malformed_json", "JSON nested too deeply") from None
    if not isinstance(obj, dict):
        got = _JSON_TYPE_NAMES.get(type(obj), type(obj).__name__)
        raise SchemaError("invalid_field", f"Expected `object`, got `{got}` - at `$`", "$")
    v = obj.get("schema_version", 1)
    return v if isinstance(v, int) and not isinstance(v, bool) else None


_JSON_TYPE_NAMES: Final[dict[type, str]] = {
    list: "array",
    str: "str",
    int: "int",
    float: "float",
    bool: "bool",
    type(None): "null",
}


def _upcast_and_convert(spec: CommandSpec, raw: bytes, version: int) -> Struct:
    state: dict[str, Any] = msgspec.json.decode(raw)
    while version < spec.version:
        upcast = spec.upcasters.get(version)
        if upcast is None:
            raise SchemaError(
                "unsupported_schema_version",
                f"no upgrade from schema_version {version} - at `$.schema_version`",
                "$.schema_version",
            )
        state = upcast(dict(state))
        version += 1
        state["schema_version"] = version
    return msgspec.convert(state, spec.type)


def _from_validation(text: str) -> SchemaError:
    m = _AT.search(text)
    base = m.group("path") if m else "$"
    detail = text[: m.start()] if m else text
    named = _NAMED.search(detail)
    if detail.startswith("Object contains unknown field") and named:
        path = f"{base}.{named.group('name')}"
        code: SchemaErrorCode = "unknown_field"
    elif detail.startswith("Object missing required field") and named:
        path = f"{base}.{named.group('name')}"
        code = "missing_field"
    else:
        path = base
        # A nested part (the shape) from a newer writer: same answer as a newer top level.
        newer = path.endswith(".schema_version") and "<=" in detail
        code = "unsupported_schema_version" if newer else "invalid_field"
    # Every message ends with the full path of the offending field, even at the top level.
    return SchemaError(code, f"{detail} - at `{path}`", path)
