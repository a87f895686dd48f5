"""The one place that opens a NATS connection, with the same defaults for every process."""

from __future__ import annotations

import logging
import os
from typing import Any
from urllib.parse import unquote, urlsplit

import nats
from nats.aio.client import Client
from nats.errors import Error as NatsError

from bus.errors import BusUnavailable

log = logging.getLogger(__name__)

# credentials for a URL that carries none: how compose.yaml gives each service its role's user
USER_ENV = "POOL_NATS_USER"
PASSWORD_ENV = "POOL_NATS_PASSWORD"


def servers(url: str) -> list[str]:
    """`url` as nats-py's server list: a comma-separated URL names the servers of one cluster."""
    return [u.strip() for u in url.split(",") if u.strip()]


# how many times the first connection tries each server before it says none answers
FIRST_CONNECT_PASSES = 3


async def quiet(exc: Exception) -> None:
    """nats-py prints a traceback for every failed reconnect by default; they are routine."""
    log.debug("nats connection error: %r", exc)


async def connect(url: str, *, reconnect: bool = True, connect_timeout: float = 5,
                  **options: Any) -> Client:
    """A connection to `url`: reconnecting forever unless `reconnect=False`, connection errors
    logged quietly, `options` passed on to nats-py; BusUnavailable when no server answers."""
    settings: dict[str, Any] = {"connect_timeout": max(1, int(connect_timeout)),
                                "error_cb": quiet}
    forever = reconnect and "max_reconnect_attempts" not in options
    if reconnect:
        # the first connection tries each server a few times and then says so: with -1 here
        # nats-py retries the first connect forever, and a wrong URL was a bus_timeout 15 s
        # later (and a process that could not stop); once connected, reconnects never stop
        settings.update(max_reconnect_attempts=FIRST_CONNECT_PASSES, reconnect_time_wait=0.5)
    else:
        settings.update(max_reconnect_attempts=0, allow_reconnect=False)
    settings.update(options)
    url_user = unquote(urlsplit(servers(url)[0]).username or "")
    if not url_user and "user" not in settings and os.environ.get(USER_ENV):
        # a deployment's process speaks as the user its environment names (compose.yaml)
        settings.update(user=os.environ[USER_ENV], password=os.environ.get(PASSWORD_ENV, ""))
    if "inbox_prefix" not in settings:
        # a role's user may read only its own inbox: its replies must come back there
        from bus.local.auth import inbox_of

        prefix = inbox_of(str(settings.get("user") or url_user))
        if prefix:
            settings["inbox_prefix"] = prefix.encode()
    try:
        nc: Client = await nats.connect(servers(url), **settings)
    except (NatsError, OSError) as e:
        raise BusUnavailable(f"cannot reach NATS at {url}: {e}") from e
    if forever:
        nc.options["max_reconnect_attempts"] = -1  # connected: from now on, never give up
    return nc
