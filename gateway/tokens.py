"""Bearer tokens for the HTTP API: one per tenant and one for the admin, stored hashed.
The token file and why an unsalted digest suffices: docs/api-http.md#authentication.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from bus.local.auth import write_private
from bus.subjects import is_token

TOKENS_FILE = "http-tokens.json"
PREFIX = "cpt_"


class TokenExists(Exception):
    """The holder already has a token; only a rotation replaces it (the old one is not kept)."""

    code = "token_exists"


class BadTenant(Exception):
    """A tenant name that is not a subject token."""

    code = "invalid_field"


@dataclass(frozen=True)
class Principal:
    """Who a request speaks for: one tenant, or the admin."""

    kind: Literal["tenant", "admin"]
    tenant: str = ""

    @property
    def is_admin(self) -> bool:
        return self.kind == "admin"


def digest(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()


class TokenStore:
    """The digests in one file; re-read when the file changes, so a rotation takes effect on
    the next request of a running gateway."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._mtime: float | None = None
        self._by_digest: dict[str, Principal] = {}

    # -- issuing (the CLI) -----------------------------------------------------------------

    def issue_tenant(self, tenant: str, *, rotate: bool = False) -> str:
        if not is_token(tenant):
            raise BadTenant(f"tenant {tenant!r} is not a valid name (a-z 0-9 - _)")
        return self._issue(("tenants", tenant), rotate)

    def issue_admin(self, *, rotate: bool = False) -> str:
        return self._issue(("admin", ""), rotate)

    def has_admin(self) -> bool:
        return bool(self._read().get("admin"))

    def _issue(self, slot: tuple[str, str], rotate: bool) -> str:
        token = PREFIX + secrets.token_urlsafe(32)
        with self._locked():
            data = self._read()
            kind, name = slot
            if kind == "admin":
                if data.get("admin") and not rotate:
                    raise TokenExists("the admin already has a token; --rotate replaces it")
                data["admin"] = digest(token)
            else:
                tenants = data.setdefault("tenants", {})
                assert isinstance(tenants, dict)
                if tenants.get(name) and not rotate:
                    raise TokenExists(f"tenant {name!r} already has a token; --rotate "
                                      "replaces it")
                tenants[name] = digest(token)
            write_private(self.path, json.dumps(data, indent=2, sort_keys=True) + "\n")
        return token

    # -- checking (the gateway) ------------------------------------------------------------

    def verify(self, token: str) -> Principal | None:
        if not token.startswith(PREFIX) or len(token) > 256:
            return None
        self._refresh()
        return self._by_digest.get(digest(token))

    def _refresh(self) -> None:
        try:
            mtime = self.path.stat().st_mtime
        except FileNotFoundError:
            self._by_digest, self._mtime = {}, None
            return
        if mtime == self._mtime:
            return
        data = self._read()
        table: dict[str, Principal] = {}
        admin = data.get("admin")
        if isinstance(admin, str) and admin:
            table[admin] = Principal("admin")
        tenants = data.get("tenants")
        for name, d in (tenants.items() if isinstance(tenants, dict) else ()):
            if isinstance(d, str) and is_token(str(name)):
                table[d] = Principal("tenant", str(name))
        self._by_digest, self._mtime = table, mtime

    def _read(self) -> dict[str, object]:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        return data if isinstance(data, dict) else {}

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path.with_name("." + self.path.name + ".lock"),
                     os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
