"""The gateway's NATS side: one client per caller, connected as that caller's own NATS user.
Which user each caller gets, and without auth.json: docs/api-http.md#authentication.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bus.errors import BusError, BusUnavailable
from bus.local import auth as bus_auth
from bus.local.auth import AuthConfig, Credentials, url_with_credentials
from bus.replies import admin_inbox
from client.api import PoolClient
from gateway.tokens import Principal


class NotEnrolled(Exception):
    """The token's tenant has no NATS user in this deployment."""

    code = "tenant_not_enrolled"


@dataclass
class Settings:
    """Where NATS is and whose credentials to use."""

    nats_url: str
    auth_path: Path | None = None  # the deployment's auth.json; None: a server without users
    service_url: str = ""  # the admin's URL when there is no auth.json (may carry credentials)
    timeout: float = 10.0
    max_upload_bytes: int = 1 << 30  # a work directory sent over HTTP (gateway/files.py)


class Upstream:
    """Clients by principal, made on first use and kept; all share nothing but the URL."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._clients: dict[Principal, PoolClient] = {}
        self._creds: dict[Principal, Credentials | None] = {}
        self._lock = asyncio.Lock()
        self._auth: AuthConfig | None = None
        self._auth_mtime: float | None = None

    def _load_auth(self) -> AuthConfig | None:
        path = self.settings.auth_path
        if path is None:
            return None
        try:
            mtime = path.stat().st_mtime
        except FileNotFoundError:
            return None
        if mtime != self._auth_mtime:
            self._auth, self._auth_mtime = bus_auth.load(path), mtime
        return self._auth

    def _url_for(self, who: Principal) -> tuple[str, Credentials | None]:
        auth = self._load_auth()
        if self.settings.auth_path is None or auth is None:
            if who.is_admin and self.settings.service_url:
                return self.settings.service_url, None
            return self.settings.nats_url, None
        # an admin token speaks as the admin role (operators' commands, reads of the log), not
        # as the operator who may change streams: the gateway faces the network
        creds = auth.roles["admin"] if who.is_admin else auth.tenants.get(who.tenant)
        if creds is None:
            raise NotEnrolled(f"tenant {who.tenant!r} has no NATS user here "
                              f"(`pool admin tenant creds {who.tenant}`)")
        return url_with_credentials(self.settings.nats_url, creds), creds

    def connection_for(self, who: Principal) -> tuple[str, str]:
        """The URL (with the caller's credentials) and inbox prefix of a connection of its own
        for `who`, for a stream that holds one (the lease feed)."""
        url, _ = self._url_for(who)
        return url, admin_inbox("operator") if who.is_admin else bus_auth.inbox_prefix(who.tenant)

    def service_url(self) -> str:
        """The URL the admin role connects with, or '' when unknown."""
        try:
            return self._url_for(Principal("admin"))[0]
        except NotEnrolled:
            return ""

    async def client(self, who: Principal) -> PoolClient:
        url, creds = self._url_for(who)
        known = self._clients.get(who)
        if known is not None and self._creds.get(who) == creds:
            return known
        async with self._lock:
            known = self._clients.get(who)
            if known is not None and self._creds.get(who) == creds:
                return known
            tenant = "" if who.is_admin else who.tenant
            # connecting blocks (it waits for the server's INFO): off the gateway's loop, and
            # no longer than a request's timeout (a late connection is closed when it comes)
            task = asyncio.ensure_future(asyncio.to_thread(PoolClient, url, tenant,
                                                           timeout=self.settings.timeout))
            try:
                made = await asyncio.wait_for(asyncio.shield(task), self.settings.timeout)
            except TimeoutError:
                task.add_done_callback(_close_when_done)
                raise BusUnavailable(f"NATS did not accept a connection within "
                                     f"{self.settings.timeout:g} s") from None
            old = self._clients.pop(who, None)
            self._clients[who] = made
            self._creds[who] = creds
        if old is not None:  # rotated credentials: the old connection goes
            await asyncio.to_thread(_close_quietly, old)
        return made

    async def call(self, who: Principal, subject: str, body: bytes = b"{}", *,
                   timeout: float | None = None) -> dict[str, Any]:
        """The reply envelope; a transport failure becomes a not-ok envelope with its code."""
        try:
            client = await self.client(who)
            return await client.raw_async(subject, body, timeout=timeout)
        except NotEnrolled as e:
            return {"ok": False, "error": {"code": e.code, "message": str(e), "reasons": {}}}
        except BusError as e:
            return {"ok": False, "error": {"code": e.code, "message": str(e), "reasons": {}}}

    async def close(self) -> None:
        clients, self._clients = list(self._clients.values()), {}
        for c in clients:
            await asyncio.to_thread(_close_quietly, c)


def _close_when_done(task: asyncio.Future[PoolClient]) -> None:
    if not task.cancelled() and task.exception() is None:
        threading.Thread(target=_close_quietly, args=(task.result(),), daemon=True).start()


def _close_quietly(c: PoolClient) -> None:
    with contextlib.suppress(Exception):
        c.close()
