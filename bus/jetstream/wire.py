"""How stored events travel as NATS messages: headers, subjects and log records."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from uuid import UUID

from eventsourcing.persistence import (
    Notification,
    StoredEvent,
)

from bus.headers import (
    HDR_DESCRIPTION,
    HDR_ID_KIND,
    HDR_ORIGINATOR_ID,
    HDR_STATUS,
    HDR_TOPIC,
    HDR_VERSION,
)
from bus.subjects import (
    is_token,
)

# the server's atomic-batch limit (ADR-50 default max batch size); larger saves are refused, never split
MAX_BATCH = 1000


# JetStream's "wrong last sequence" answers: 10071 for a plain publish, 10164 inside a batch
WRONG_LAST_SEQUENCE = frozenset({10071, 10164})

DEFAULT_URL = "nats://127.0.0.1:4222"
REQUEST_TIMEOUT = 10.0
DIRECT_BATCH = 1000


@dataclass
class SubjectState:
    """What this process last saw at the end of one subject."""

    last_version: int | None
    last_seq: int


def originator_token(originator_id: UUID | str) -> str:
    """The subject token for an id; ids that are not already tokens are hashed so they stay distinct."""
    s = str(originator_id)
    if is_token(s):
        return s
    return "h-" + hashlib.sha256(s.encode("utf8")).hexdigest()[:40]


def is_stored_event(headers: dict[str, str]) -> bool:
    """Whether a log message carries the recorder's event headers; one that does not (a stray:
    something else published on a log subject) is skipped by every reader and reported."""
    version = headers.get(HDR_VERSION)
    return (HDR_TOPIC in headers and HDR_ORIGINATOR_ID in headers
            and version is not None and version.isdigit())


def stored_event_from(headers: dict[str, str], data: bytes) -> StoredEvent:
    oid: UUID | str = headers[HDR_ORIGINATOR_ID]
    if headers.get(HDR_ID_KIND) == "uuid":
        oid = UUID(oid)  # type: ignore[arg-type]
    return StoredEvent(
        originator_id=oid,
        originator_version=int(headers[HDR_VERSION]),
        topic=headers[HDR_TOPIC],
        state=bytes(data or b""),
    )


_VALUE_NEWLINES = str.maketrans({"\r": " ", "\n": " "})


def header_value(v: str) -> str:
    """`v` as nats-py would send it as a header value: trimmed, CR/LF turned into spaces."""
    if "\r" in v or "\n" in v or v != v.strip():
        return v.strip().translate(_VALUE_NEWLINES)
    return v


def header_dict(lines: str) -> dict[str, str]:
    """Header lines as `_publish` renders them ("Key: value\\r\\n"…) back as a dict, for the
    one message that goes through nats-py's request. Keys never hold ": "; values may."""
    out: dict[str, str] = {}
    for line in lines.split("\r\n"):
        if line:
            k, _, v = line.partition(": ")
            out[k] = v
    return out


def parse_headers(raw: bytes | None) -> dict[str, str]:
    """A NATS header block as nats-py parses it (inline status as "Status"/"Description"),
    for the few well-formed headers a JetStream direct get carries: a split, not a scan."""
    if not raw:
        return {}
    lines = raw.decode("utf-8", "replace").split("\r\n")
    out: dict[str, str] = {}
    first = lines[0]
    if len(first) > 9 and first[8] == " ":  # "NATS/1.0 404 Message Not Found"
        status, _, desc = first[9:].strip().partition(" ")
        if status.isdigit():
            out[HDR_STATUS] = status
        if desc:
            out[HDR_DESCRIPTION] = desc
    for line in lines[1:]:
        if line:
            k, sep, v = line.partition(":")
            if sep:
                out[k.strip()] = v.strip()
    return out


_KEY_ID = "\r\n" + HDR_ORIGINATOR_ID + ":"
_KEY_KIND = "\r\n" + HDR_ID_KIND + ":"
_KEY_VERSION = "\r\n" + HDR_VERSION + ":"
_KEY_TOPIC = "\r\n" + HDR_TOPIC + ":"
UUIDS: dict[str, UUID] = {}  # ids seen in log reads: one parse per aggregate, not per event


def uuid_of(text: str) -> UUID:
    """UUID(text), one object per id while few ids are seen (every entry of the table is one
    more object for the cyclic collector to walk, so it is emptied once it grows)."""
    got = UUIDS.get(text)
    if got is None:
        if len(UUIDS) >= 20_000:
            UUIDS.clear()
        got = UUIDS[text] = UUID(text)
    return got


def _header(text: str, key: str) -> str | None:
    """The value of `key` ("\r\nName:") in a header block's text, as parse_headers gives it."""
    i = text.find(key)
    if i < 0:
        return None
    i += len(key)
    return text[i:text.find("\r\n", i)].strip()


# A log record of a bulk read: (stream sequence, originator id as text, whether that id is a
# UUID, originator version, topic, stored state). A UUID id comes as its canonical text (what
# str(UUID) gives), so a reader can key by it without building UUID objects.
LogRecord = tuple[int, str, bool, int, str, bytes]

RECORD_PAGE = 2000  # records per page of read_records
RECORD_IDS_LIMIT = 10_000  # subject token → id text, per reader; cleared when it grows past this
UUID_TEXT = re.compile(rb"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


UNWRITTEN = SubjectState(None, 0)  # a subject with no message, as a save expects it


def record_of(n: Notification) -> LogRecord:
    oid = n.originator_id
    is_uuid = isinstance(oid, UUID)
    return (n.id, str(oid), is_uuid, n.originator_version, n.topic, n.state)


def event_fields(raw: bytes) -> tuple[str, bool, int, str]:
    """(originator id text, uuid?, version, topic) of a stored event's header block, as
    the direct gets read it (a UUID id as its canonical text)."""
    text = raw.decode("utf-8", "replace")
    oid_text, version, topic = _header(text, _KEY_ID), _header(text, _KEY_VERSION), _header(
        text, _KEY_TOPIC)
    if oid_text is None or version is None or topic is None:
        raise KeyError(f"not a stored event's headers: {text[:200]!r}")
    is_uuid = _header(text, _KEY_KIND) == "uuid"
    if is_uuid:
        oid_text = str(UUID(oid_text))
    return oid_text, is_uuid, int(version), topic


