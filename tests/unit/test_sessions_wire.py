"""The session frames, the session bodies' checks and `port-forward`'s port argument."""

from __future__ import annotations

import msgspec
import pytest

from bus import sessions as wire
from bus.errors import InvalidSubject
from bus.subjects import session_subject
from cli.output import UsageError
from cli.session import _ports
from schemas.codec import SchemaError, decode_command

SID = "0123456789abcdef0123456789abcdef"


def test_a_frame_reads_back_as_written() -> None:
    assert wire.parse(wire.frame(wire.STDIN, b"abc")) == (wire.STDIN, None, b"abc")
    assert wire.parse(wire.frame(wire.CONN_DATA, b"xy", 7)) == (wire.CONN_DATA, 7, b"xy")
    assert wire.parse(wire.frame(wire.EXIT, b"4")) == (wire.EXIT, None, b"4")


@pytest.mark.parametrize("data", [b"", b"d", b"d\0\0"])
def test_a_short_or_empty_frame_reads_as_nothing(data: bytes) -> None:
    assert wire.parse(data)[0] == b""


def test_a_session_subject_takes_only_tokens() -> None:
    assert session_subject("alpha", "n1", SID, "in") == f"pool.sess.alpha.n1.{SID}.in"
    for bad in ("a.b", "*", ">", "A"):
        with pytest.raises(InvalidSubject):
            session_subject(bad, "n1", SID, "out")
    with pytest.raises(InvalidSubject):
        session_subject("alpha", "n1", SID, "sideways")


@pytest.mark.parametrize("body", [
    {"session_id": SID, "kind": "exec"},  # no command
    {"session_id": SID, "kind": "exec", "command": ["sh"], "port": 80},
    {"session_id": SID, "kind": "forward"},  # no port
    {"session_id": SID, "kind": "forward", "port": 0},
    {"session_id": SID, "kind": "forward", "port": 80, "command": ["sh"]},
    {"session_id": "short", "command": ["sh"]},
    {"session_id": SID.upper(), "command": ["sh"]},
    {"session_id": SID + ".x", "command": ["sh"]},
    {"session_id": SID, "kind": "attach", "command": ["sh"]},
    {"session_id": SID, "command": ["sh"], "rows": 0},
    {"session_id": SID, "command": ["sh"], "node": "n2"},
])
def test_a_bad_session_body_is_refused_with_a_typed_error(body: dict[str, object]) -> None:
    with pytest.raises(SchemaError):
        decode_command("lease.session", msgspec.json.encode(body))


def test_a_good_session_body_decodes() -> None:
    got = decode_command("lease.session", msgspec.json.encode(
        {"session_id": SID, "command": ["sh", "-c", "true"], "tty": True, "rows": 24,
         "cols": 80}))
    assert got.command == ["sh", "-c", "true"] and got.kind == "exec"  # type: ignore[attr-defined]


def test_port_forward_ports() -> None:
    assert _ports("8000") == (8000, 8000)
    assert _ports("0:8000") == (0, 8000)
    assert _ports("8888:8000") == (8888, 8000)
    for bad in ("", "x", "1:2:3", "70000", "80:0", "-1:80", ":80"):
        with pytest.raises(UsageError):
            _ports(bad)
