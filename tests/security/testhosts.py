"""Test hosts of the egress tests' own: a network namespace joined to the host by a veth pair,
holding a documentation address (198.51.100.0/24, public to the filters), a 10/8 and a
169.254/16 one, each serving `hello`, and a service on one of this host's own addresses."""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import pytest

PORT = 18080
SERVER = (
    "import socket\n"
    "s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
    f"s.bind(('0.0.0.0', {PORT})); s.listen(16)\n"
    "while True:\n"
    "    c, _ = s.accept(); c.sendall(b'hello\\n'); c.close()\n"
)


@dataclass
class Hosts:
    public: str  # the test's stand-in for an internet host
    private: str
    link_local: str
    own: str  # an address of this host's, with a service listening on it
    own_port: int


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


@contextmanager
def egress_hosts(own_address: str | None = None) -> Iterator[Hosts]:
    """The hosts, torn down on exit; `own_address` binds the host's own service elsewhere
    (0.0.0.0: on every address of this host's)."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("test hosts need root and iproute2 (a network namespace and a veth pair)")
    tag = uuid.uuid4().hex[:6]
    ns, outer, inner = f"cpeg{tag}", f"cpe{tag}", f"cpn{tag}"
    k = random.randrange(64)
    pairs = [(f"198.51.100.{4 * k + 1}", f"198.51.100.{4 * k + 2}", 30),
             (f"10.201.{k}.1", f"10.201.{k}.2", 24),
             (f"169.254.{100 + k}.1", f"169.254.{100 + k}.2", 24)]
    _ip("netns", "add", ns)
    server = None
    own = socket.socket()
    try:
        _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
        _ip("link", "set", inner, "netns", ns)
        for mine, theirs, bits in pairs:
            _ip("addr", "add", f"{mine}/{bits}", "dev", outer)
            _ip("-n", ns, "addr", "add", f"{theirs}/{bits}", "dev", inner)
        _ip("link", "set", outer, "up")
        _ip("-n", ns, "link", "set", inner, "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        server = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-c", SERVER])
        deadline = time.monotonic() + 10
        while True:  # the test host answers before the test begins
            try:
                socket.create_connection((pairs[0][1], PORT), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        own.bind((own_address or pairs[0][0], 0))
        own.listen(8)
        serve_hello(own)
        yield Hosts(public=pairs[0][1], private=pairs[1][1], link_local=pairs[2][1],
                    own=pairs[0][0], own_port=own.getsockname()[1])
    finally:
        own.close()
        if server is not None:
            server.kill()
            server.wait()
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)
        subprocess.run(["ip", "link", "del", outer], capture_output=True, check=False)


def serve_hello(listening: socket.socket) -> None:
    """Answer `hello` on every connection to `listening`, from a thread, until it closes."""

    def serve() -> None:
        while True:
            try:
                c, _ = listening.accept()
            except OSError:
                return
            c.sendall(b"hello\n")
            c.close()

    threading.Thread(target=serve, daemon=True).start()
