"""One webhook POST to an address already checked (workers.webhooks.addresses): the socket goes
to that address, never to a second lookup of the host (a rebinding DNS answer cannot steer it)."""

from __future__ import annotations

import http.client
import socket
import ssl
from urllib.parse import urlsplit


class _PinnedHTTPS(http.client.HTTPSConnection):
    def __init__(self, host: str, port: int, address: str, timeout: float) -> None:
        super().__init__(host, port, timeout=timeout, context=ssl.create_default_context())
        self._address = address

    def connect(self) -> None:
        sock = socket.create_connection((self._address, self.port), self.timeout)
        self.sock = self._context.wrap_socket(sock, server_hostname=self.host)  # type: ignore[attr-defined]


class _PinnedHTTP(http.client.HTTPConnection):
    def __init__(self, host: str, port: int, address: str, timeout: float) -> None:
        super().__init__(host, port, timeout=timeout)
        self._address = address

    def connect(self) -> None:
        self.sock = socket.create_connection((self._address, self.port), self.timeout)


def post(url: str, address: str, body: bytes, headers: dict[str, str], *,
         timeout: float) -> int:
    """POST `body` to `url` through `address`; the response's status (its body is read and
    dropped, at most 64 KiB). OSError (and http.client's errors) when no answer came."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    https = parts.scheme == "https"
    port = parts.port or (443 if https else 80)
    conn: http.client.HTTPConnection = (_PinnedHTTPS if https else _PinnedHTTP)(
        host, port, address, timeout)
    path = parts.path or "/"
    if parts.query:
        path += "?" + parts.query
    try:
        conn.request("POST", path, body=body, headers={
            **headers, "user-agent": "computepool-webhooks/1", "content-length": str(len(body))})
        response = conn.getresponse()
        response.read(65536)
        return int(response.status)
    finally:
        conn.close()
