"""A request's digest: the same bytes as `json.dumps` with sorted keys, whichever way it is
made, so digests recorded before the fast way keep matching their retries."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas import v1
from schemas.codec import _floatless, digest

OMIT = ("count", "reservation_id", "group")


def _json_digest(message: msgspec.Struct, omit: tuple[str, ...] = ()) -> str:
    body = msgspec.to_builtins(message)
    for name in omit:
        body.pop(name, None)
    return hashlib.sha256(
        json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


_text = st.text(max_size=12)  # every code point: quotes, backslashes, controls, DEL, emoji


@st.composite
def _requests(draw: st.DrawFn) -> v1.LeaseRequest:
    body: dict[str, Any] = {
        "pool_id": draw(st.from_regex(r"[a-z][a-z0-9_-]{0,10}", fullmatch=True)),
        "shape": {"cpu_millis": draw(st.integers(1, 64_000)),
                  "memory_mib": draw(st.integers(1, 1 << 20))},
        "maximum_runtime_seconds": draw(st.integers(1, 86_400)),
        "idempotency_key": draw(st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,19}", fullmatch=True)),
        "command": draw(st.lists(_text, max_size=3)),
        "env": draw(st.dictionaries(st.from_regex(r"[A-Z_][A-Z0-9_]{0,8}", fullmatch=True),
                                    _text, max_size=3)),
        "checkpointable": draw(st.booleans()),
    }
    if draw(st.booleans()):
        body["count"] = draw(st.integers(1, 50))
    return msgspec.convert(body, v1.LeaseRequest)


def test_a_lease_request_can_hold_no_float() -> None:
    # the fast way is open to it; a kind with a float field is not
    assert _floatless(v1.LeaseRequest)

    class Weighted(msgspec.Struct):
        weight: float

    assert not _floatless(Weighted)


@settings(max_examples=400, deadline=None)
@given(_requests())
def test_the_digest_is_json_s_byte_for_byte(req: v1.LeaseRequest) -> None:
    assert digest(req) == _json_digest(req)
    assert digest(req, omit=OMIT) == _json_digest(req, OMIT)


def test_text_that_json_escapes_takes_json_s_way_and_still_matches() -> None:
    base = {"pool_id": "p", "shape": {"cpu_millis": 100, "memory_mib": 64},
            "maximum_runtime_seconds": 60, "idempotency_key": "k"}
    for text in ("plain", "quote\"", "back\\slash", "tab\t", "del\x7f", "é", "😀", "\x00"):
        req = msgspec.convert({**base, "command": [text], "env": {"K": text}}, v1.LeaseRequest)
        assert digest(req, omit=OMIT) == _json_digest(req, OMIT), repr(text)
