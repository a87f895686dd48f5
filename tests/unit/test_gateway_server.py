"""Where the gateway listens: `--http` values, and a port already taken said plainly."""

from __future__ import annotations

import socket

import pytest
from litestar import Litestar

from gateway.server import ServerThread, parse_listen


@pytest.mark.parametrize(("text", "want"), [
    ("127.0.0.1:8080", ("127.0.0.1", 8080)), (":9000", ("127.0.0.1", 9000)),
    ("9001", ("127.0.0.1", 9001)), ("[::1]:8080", ("::1", 8080)), ("off", None),
])
def test_listen_values_read_as_host_and_port(text: str,
                                             want: tuple[str, int] | None) -> None:
    assert parse_listen(text) == want


@pytest.mark.parametrize("text", ["nonsense", "host:port", "1:99999", "127.0.0.1:"])
def test_a_bad_listen_value_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="HOST:PORT"):
        parse_listen(text)


def test_a_port_in_use_is_named_as_the_likely_cause() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(RuntimeError, match="port in use"):
            ServerThread(Litestar([]), port=port).start()
