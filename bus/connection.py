"""The one place that opens a NATS connection, with the same defaults for every process."""

from __future__ import annotations

import logging
from typing import Any

import nats
from nats.aio.client import Client
from nats.errors import Error as NatsError

from bus.errors import BusUnavailable

log = logging.getLogger(__name__)


def servers(url: str) -> list[str]:
    """`url` as nats-py's server list: a comma-separated URL names the servers of one cluster."""
    return [u.strip() for u in url.split(",") if u.strip()]


async def quiet(exc: Exception) -> None:
    """nats-py prints a traceback for every failed reconnect by default; they are routine."""
    log.debug("nats connection error: %r", exc)


async def connect(url: str, *, reconnect: bool = True, connect_timeout: float = 5,
                  **options: Any) -> Client:
    """A connection to `url`: reconnecting forever unless `reconnect=False`, connection errors
    logged quietly, `options` passed on to nats-py; BusUnavailable when no server answers."""
    settings: dict[str, Any] = {"connect_timeout": max(1, int(connect_timeout)),
                                "error_cb": quiet}
    if reconnect:
        settings.update(max_reconnect_attempts=-1, reconnect_time_wait=0.5)
    else:
        settings.update(max_reconnect_attempts=0, allow_reconnect=False)
    settings.update(options)
    try:
        nc: Client = await nats.connect(servers(url), **settings)
    except (NatsError, OSError) as e:
        raise BusUnavailable(f"cannot reach NATS at {url}: {e}") from e
    return nc
