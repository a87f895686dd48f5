"""What the gateway's handlers share: the token store, the NATS clients, the views' reader,
and the refusal a handler raises to be answered with a problem."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from litestar import Request
from litestar.connection import ASGIConnection

from gateway.throttle import LoginThrottle
from gateway.tokens import Principal, TokenStore
from gateway.upstream import Upstream


@dataclass
class Gateway:
    """What every handler shares: the token store, the NATS clients and the views' reader."""

    tokens: TokenStore
    upstream: Upstream
    database_url: str = ""
    views_schema: str = ""
    in_flight: dict[Principal, int] = field(default_factory=dict)
    streams: dict[Principal, int] = field(default_factory=dict)  # open event streams
    logins: LoginThrottle = field(default_factory=LoginThrottle)  # failed checks by address

    _reader: Any = None
    _history: Any = None
    service_url: str = ""  # the log's reader connects as the admin role
    # opens an application over the log at a URL (the composition root's); None: no reader
    open_log: Callable[[str], Any] | None = None

    def history(self) -> Any:
        """The flight recorder's reader (gateway.history.History), or None without a URL or
        a way to open the log."""
        if self._history is None and self.service_url and self.open_log is not None:
            from gateway.history import History

            self._history = History(self.service_url, self.open_log)
        return self._history

    def views(self, view: str, **kw: Any) -> dict[str, Any]:
        """A page of any view, every tenant: the admin's and the dashboard's fleet (one
        connection, kept; blocking, so callers run it in a thread)."""
        if self._reader is None:
            from projections.queries import ViewReader
            from projections.views import DEFAULT_SCHEMA

            self._reader = ViewReader(self.database_url, self.views_schema or DEFAULT_SCHEMA)
        page: dict[str, Any] = self._reader.query(view, **kw)
        return page

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()
        if self._history is not None:
            self._history.close()


class Refused(Exception):
    """A request the gateway answers itself with a problem."""

    def __init__(self, code: str, detail: str, reasons: dict[str, Any] | None = None) -> None:
        super().__init__(detail)
        self.code, self.detail, self.reasons = code, detail, reasons


def plain_uint(raw: str, most: int) -> int | None:
    """`raw` as a whole number from 0 to `most` when it is ASCII digits only, else None.
    (str.isdigit also takes superscripts and other scripts' digits, which int() refuses or
    reads, and int() refuses a string of more than a few thousand digits.)"""
    if not raw.isascii() or not raw.isdigit() or len(raw) > len(str(most)):
        return None
    value = int(raw)
    return value if value <= most else None


COOKIE = "pool_token"


def principal_of(gw: Gateway, request: Request[Any, Any, Any]) -> Principal:
    """Who the request speaks for: its bearer token, or for a read only, the dashboard's cookie
    (a browser's EventSource cannot send headers; the cookie is SameSite=Strict and never
    authorises a write, so another site cannot act through it)."""
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if (scheme.lower() != "bearer" or not token) and request.method in ("GET", "HEAD"):
        token = request.cookies.get(COOKIE, "")
    who = checked_token(gw, request, token.strip()) if token else None
    if who is None:
        raise Refused("unauthenticated", "a valid bearer token is required "
                      "(`pool admin tenant token TENANT`)")
    return who


def checked_token(gw: Gateway, request: ASGIConnection[Any, Any, Any, Any],
                  token: str) -> Principal | None:
    """Whom `token` names, checked only while its client address has not failed too often
    (then `login_throttled`, before any look-up); a wrong one counts against the address."""
    source = request.client.host if request.client else ""
    wait = gw.logins.retry_after(source)
    if wait:
        raise Refused("login_throttled", f"too many failed token checks from this address; "
                      f"retry in {wait} s", {"retry_after_seconds": wait,
                                             "max_failed_logins": gw.logins.max_failures,
                                             "window_seconds": int(gw.logins.window_seconds)})
    who = gw.tokens.verify(token)
    if who is None:
        gw.logins.failed(source)
    return who


def refusal_headers(e: Refused) -> dict[str, str] | None:
    """The HTTP headers a refusal carries: a challenge when unauthenticated, Retry-After when
    it says when to come back."""
    if e.code == "unauthenticated":
        return {"WWW-Authenticate": 'Bearer realm="computepool"'}
    retry = (e.reasons or {}).get("retry_after_seconds")
    return {"Retry-After": str(retry)} if isinstance(retry, int) else None
