"""The connection guard: caps the connections and subscriptions of each tenant's and each node
agent's NATS user, enforced through the server's system account (connect advisories, CONNZ,
KICK). ADR 023, 028.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from bus.caps import Caps
from bus.runtime import close_runtime, get_runtime

log = logging.getLogger(__name__)

# how often every capped user's connections are counted again from the servers themselves: a
# missed advisory (the guard restarting, a reconnect) and subscriptions, which have none
SWEEP_SECONDS = 5.0
# how long replies to a request sent to every server (PING) are gathered
GATHER_SECONDS = 0.5
PAGE = 1024  # CONNZ's own default page

CONNECT = "$SYS.ACCOUNT.*.CONNECT"
DISCONNECT = "$SYS.ACCOUNT.*.DISCONNECT"
PING_CONNZ = "$SYS.REQ.SERVER.PING.CONNZ"


@dataclass
class Conn:
    """One client connection of a capped user, as the servers report it."""

    server: str
    cid: int
    start: str  # RFC 3339 from the server: sorts in time order
    subscriptions: int = 0

    @property
    def key(self) -> tuple[str, int]:
        return (self.server, self.cid)

    @property
    def when(self) -> str:
        """`start` comparable as text: the server trims the nanoseconds' trailing zeros."""
        base, _, frac = self.start.removesuffix("Z").partition(".")
        return f"{base}.{frac.ljust(9, '0')}"


class ConnectionGuard:
    """Keeps each capped user within its caps: on a connect advisory, connections past
    `max_connections` are kicked, newest first; every `sweep_seconds`, the servers' own count
    replaces the guard's and a user past `max_subscriptions` loses its connection holding
    the most. `caps_of(user)` is a user's caps, None for a user without any."""

    def __init__(self, url: str, caps_of: Callable[[str], Caps | None], *,
                 sweep_seconds: float = SWEEP_SECONDS) -> None:
        self.url = url
        self.caps_of = caps_of
        self.sweep_seconds = sweep_seconds
        self.conns: dict[str, dict[tuple[str, int], Conn]] = {}
        self.kicked: Counter[str] = Counter()  # kicks per `user:limit`
        self._sweeper: Any = None
        # connections announced, and those gone, while a sweep asks the servers: what it
        # finds is corrected by them
        self._fresh: dict[tuple[str, int], tuple[str, Conn]] | None = None
        self._gone: set[tuple[str, int]] = set()

    # -- the process's side ---------------------------------------------------------------

    def start(self) -> ConnectionGuard:
        """Listen, count what the servers hold now (closing what is past the caps), then
        count again every `sweep_seconds`; BusUnavailable when the servers refuse its user."""
        rt = get_runtime(self.url, "guard")
        try:
            rt.run(self._subscribe())
            rt.run(self.sweep(), timeout=30)
        except BaseException:
            self.stop()
            raise
        self._sweeper = rt.submit(self._sweep_forever())
        return self

    def stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        close_runtime(self.url)

    # -- on the runtime's loop -----------------------------------------------------------

    async def _nc(self) -> Any:
        return await get_runtime(self.url, "guard").connection()

    async def _subscribe(self) -> None:
        nc = await self._nc()
        await nc.subscribe(CONNECT, cb=self._on_connect)
        await nc.subscribe(DISCONNECT, cb=self._on_disconnect)
        await nc.flush()

    async def _on_connect(self, msg: Any) -> None:
        event = json.loads(msg.data)
        client, server = event.get("client") or {}, event.get("server") or {}
        user = str(client.get("user") or "")
        if not user or self.caps_of(user) is None or client.get("kind", "Client") != "Client":
            return
        conn = Conn(str(server.get("id") or ""), int(client.get("id") or 0),
                    str(client.get("start") or ""))
        self.conns.setdefault(user, {})[conn.key] = conn
        if self._fresh is not None:
            self._fresh[conn.key] = (user, conn)
        await self._enforce_connections(user)

    async def _on_disconnect(self, msg: Any) -> None:
        event = json.loads(msg.data)
        client, server = event.get("client") or {}, event.get("server") or {}
        key = (str(server.get("id") or ""), int(client.get("id") or 0))
        if self._fresh is not None:
            self._fresh.pop(key, None)
            self._gone.add(key)
        self.conns.get(str(client.get("user") or ""), {}).pop(key, None)

    async def _enforce_connections(self, user: str) -> None:
        caps = self.caps_of(user)
        held = sorted(self.conns.get(user, {}).values(), key=lambda c: (c.when, c.server, c.cid))
        if caps is None or len(held) <= caps.max_connections:
            return
        for conn in held[caps.max_connections:]:
            await self._kick(user, conn, "max_connections",
                             f"{len(held)} connections, over its cap of {caps.max_connections}")

    async def _enforce_subscriptions(self, user: str) -> None:
        caps = self.caps_of(user)
        held = list(self.conns.get(user, {}).values())
        total = sum(c.subscriptions for c in held)
        if caps is None:
            return
        # the connection holding the most goes first (the newest of equals)
        for conn in sorted(held, key=lambda c: (c.subscriptions, c.when), reverse=True):
            if total <= caps.max_subscriptions:
                break
            await self._kick(user, conn, "max_subscriptions",
                             f"{total} subscriptions, over its cap of {caps.max_subscriptions}")
            total -= conn.subscriptions

    async def _kick(self, user: str, conn: Conn, limit: str, why: str) -> None:
        """Close one connection through its own server (the client sees it closed; the
        server's disconnect advisory says `Kicked`)."""
        log.warning("connection guard: kicked connection %d of NATS user %s on server %s: %s "
                    "(%s)", conn.cid, user, conn.server, why, limit)
        self.conns.get(user, {}).pop(conn.key, None)
        self.kicked[f"{user}:{limit}"] += 1
        nc = await self._nc()
        with contextlib.suppress(Exception):  # gone already: nothing to close
            await nc.request(f"$SYS.REQ.SERVER.{conn.server}.KICK",
                             json.dumps({"cid": conn.cid}).encode(), timeout=2)

    async def sweep(self) -> None:
        """Count every capped user's connections and subscriptions on every server again,
        then hold each user to its caps."""
        found: dict[str, dict[tuple[str, int], Conn]] = {}
        self._fresh, self._gone = {}, set()
        try:
            listed = await self._connz()
        finally:
            fresh, gone, self._fresh = self._fresh, self._gone, None
        for user, conn in fresh.values():
            found.setdefault(user, {})[conn.key] = conn
        for conn_info, server in listed:
            user = str(conn_info.get("authorized_user") or "")
            if not user or self.caps_of(user) is None:
                continue
            conn = Conn(server, int(conn_info["cid"]), str(conn_info.get("start") or ""),
                        int(conn_info.get("subscriptions") or 0))
            if conn.key not in gone:
                found.setdefault(user, {})[conn.key] = conn
        self.conns = found
        for user in list(found):
            await self._enforce_connections(user)
            await self._enforce_subscriptions(user)

    async def _connz(self) -> list[tuple[dict[str, Any], str]]:
        """Every client connection on every server, with the id of the server holding it."""
        nc = await self._nc()
        out: list[tuple[dict[str, Any], str]] = []
        for reply in await self._gather(nc, PING_CONNZ, {"limit": PAGE, "auth": True}):
            server = str(reply["server"]["id"])
            data = reply.get("data") or {}
            out += [(c, server) for c in data.get("connections") or []]
            offset, total = PAGE, int(data.get("total") or 0)
            while offset < total:  # the rest of that server's connections, a page at a time
                r = await nc.request(f"$SYS.REQ.SERVER.{server}.CONNZ", json.dumps(
                    {"offset": offset, "limit": PAGE, "auth": True}).encode(), timeout=5)
                page = json.loads(r.data).get("data") or {}
                out += [(c, server) for c in page.get("connections") or []]
                offset += PAGE
        return out

    async def _gather(self, nc: Any, subject: str, body: dict[str, Any]) -> list[dict[str, Any]]:
        """The replies of every server to one request, gathered for GATHER_SECONDS."""
        replies: list[dict[str, Any]] = []
        inbox = nc.new_inbox()

        async def got(msg: Any) -> None:
            with contextlib.suppress(ValueError):
                replies.append(json.loads(msg.data))

        sub = await nc.subscribe(inbox, cb=got)
        try:
            await nc.publish(subject, json.dumps(body).encode(), reply=inbox)
            await nc.flush()
            await asyncio.sleep(GATHER_SECONDS)
        finally:
            await sub.unsubscribe()
        return [r for r in replies if "data" in r and "server" in r]

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(self.sweep_seconds)
            try:
                await self.sweep()
            except Exception as e:  # noqa: BLE001 - a sweep that failed is tried again next time
                log.warning("connection guard: sweep failed: %r", e)


def user_caps(tenant: Caps, node: Caps | None = None) -> Callable[[str], Caps | None]:
    """`tenant` for every tenant's user (named `tenant-<tenant>`), `node` for every node
    agent's (`node-<node>`; None: nodes uncapped), none for anyone else: the operator and the
    plane's roles are trusted."""
    from bus.local.auth import NODE_USER_PREFIX, TENANT_USER_PREFIX

    def caps_of(user: str) -> Caps | None:
        if user.startswith(TENANT_USER_PREFIX):
            return tenant
        return node if user.startswith(NODE_USER_PREFIX) else None

    return caps_of


def tenant_caps(caps: Caps) -> Callable[[str], Caps | None]:
    """`caps` for every tenant's user, none for anyone else (`user_caps` without nodes')."""
    return user_caps(caps)
