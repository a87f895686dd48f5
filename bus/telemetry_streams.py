"""Each tenant's telemetry stream, POOL_TEL_<tenant>: making it with its retention, and reading
a tenant's pages across it and what POOL_TELEMETRY kept of the tenant from before the split.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from nats.aio.client import Client
from nats.js.errors import APIError, BadRequestError, NotFoundError

from bus.errors import BusUnavailable, TelemetryRetentionUnreservable
from bus.runtime import BusRuntime, run_sync
from bus.streams import (
    TENANT_TELEMETRY_MAX_AGE_S,
    TENANT_TELEMETRY_MAX_BYTES,
    telemetry_stream_config,
    tenant_telemetry_stream_config,
)
from bus.subjects import (
    NODE_TELEMETRY_SUBJECTS,
    TELEMETRY_PREFIX,
    TELEMETRY_STREAM,
    telemetry_tenant_of,
    tenant_telemetry_stream,
)
from bus.telemetry import TelemetryPage, read_page_async

log = logging.getLogger(__name__)

_NO_ROOM_TO_RESERVE = 10047  # JetStream's err_code for a max_bytes its store cannot reserve


async def _split_shared(js: Any) -> tuple[int, int]:
    """Narrow POOL_TELEMETRY to the node-level subjects when it still takes every `pool.tel.>`
    (a store from before tenants had streams: its samples stay, readable until they age out);
    the sequence a tenant's new stream starts at (one past POOL_TELEMETRY's last) and
    POOL_TELEMETRY's replicas (a cluster's streams are made at R3 by `pool cluster init`)."""
    try:
        info = await js.stream_info(TELEMETRY_STREAM)
    except NotFoundError:
        return 1, 1
    if list(info.config.subjects or []) != [NODE_TELEMETRY_SUBJECTS]:
        info.config.subjects = telemetry_stream_config().subjects
        await js.update_stream(info.config)
        info = await js.stream_info(TELEMETRY_STREAM)
    return int(info.state.last_seq) + 1, int(info.config.num_replicas or 1)


async def ensure_tenant_telemetry(js: Any, tenant: str, *, replicas: int = 1,
                                  max_bytes: int | None = None,
                                  max_age_seconds: float | None = None) -> tuple[int, int, float]:
    """Make POOL_TEL_<tenant> if it is missing, with `max_bytes` and `max_age_seconds` (else the
    defaults) and POOL_TELEMETRY's replicas where more; an existing one gets those that are
    given and keeps its own otherwise (the operator's). Returns (bytes held, max_bytes, max_age
    seconds). Raises TelemetryRetentionUnreservable when the server cannot reserve the bytes;
    lowering them under what the stream holds discards the tenant's oldest samples."""
    name = tenant_telemetry_stream(tenant)
    want_bytes = max_bytes or TENANT_TELEMETRY_MAX_BYTES
    try:
        try:
            info = await js.stream_info(name)
        except NotFoundError:
            first_seq, shared_replicas = await _split_shared(js)
            config = tenant_telemetry_stream_config(
                tenant, replicas=max(replicas, shared_replicas), max_bytes=want_bytes,
                max_age_seconds=max_age_seconds or TENANT_TELEMETRY_MAX_AGE_S,
                first_seq=first_seq)
            try:
                await js.add_stream(config)
            except BadRequestError as e:
                if e.err_code == _NO_ROOM_TO_RESERVE:
                    raise
                # made meanwhile by another process: its settings are the ones below
            info = await js.stream_info(name)
        config = info.config
        changed = False
        if max_bytes is not None and int(config.max_bytes or -1) != max_bytes:
            config.max_bytes, changed = max_bytes, True
        if max_age_seconds is not None and float(config.max_age or 0) != max_age_seconds:
            config.max_age, changed = max_age_seconds, True
        if replicas > (config.num_replicas or 1):
            config.num_replicas, changed = replicas, True
        if changed:
            await js.update_stream(config)
            info = await js.stream_info(name)
    except APIError as e:
        if e.err_code != _NO_ROOM_TO_RESERVE:
            raise
        raise TelemetryRetentionUnreservable(
            f"telemetry of tenant {tenant}: the server cannot reserve its {want_bytes}-byte "
            "retention (every stream's max_bytes is reserved from JetStream's max_file_store): "
            "lower it (`pool admin tenant telemetry-retention`) or raise max_file_store") from e
    return (int(info.state.bytes), int(info.config.max_bytes or -1),
            float(info.config.max_age or 0))


def ensure_tenant_telemetry_sync(url: str, tenants: list[str], *, replicas: int = 1,
                                 max_bytes: int | None = None,
                                 max_age_seconds: float | None = None
                                 ) -> dict[str, tuple[int, int, float]]:
    """`ensure_tenant_telemetry` for each tenant over a connection of its own (as the
    operator): each stream's (bytes held, max_bytes, max_age seconds) by its name."""
    from bus.connection import connect

    async def go() -> dict[str, tuple[int, int, float]]:
        nc = await connect(url, reconnect=False)
        try:
            js = nc.jetstream()
            return {tenant_telemetry_stream(t): await ensure_tenant_telemetry(
                js, t, replicas=replicas, max_bytes=max_bytes, max_age_seconds=max_age_seconds)
                for t in tenants}
        finally:
            await nc.close()

    return run_sync(go(), timeout=30)


class TenantStreams:
    """Where a tenant's samples are: the sequence its stream starts at (fixed when it is made,
    so remembered; a missing stream is asked about again)."""

    def __init__(self) -> None:
        self._first: dict[str, int] = {}

    async def first_seq(self, nc: Client, tenant: str) -> int | None:
        """The first sequence of POOL_TEL_<tenant>, None when it has none."""
        first = self._first.get(tenant)
        if first is not None:
            return first
        try:
            info = await nc.jetstream().stream_info(tenant_telemetry_stream(tenant))
        except NotFoundError:
            return None
        first = max(1, int(info.config.first_seq or 1))
        if len(self._first) > 100_000:
            self._first.clear()
        self._first[tenant] = first
        return first

    async def read_page(self, nc: Client, tenant: str, filter_subject: str, *,
                        after_seq: int = 0, since: float | None = None,
                        limit: int = 500) -> TelemetryPage:
        """A page of `tenant`'s samples under `filter_subject` after `after_seq` (or from
        `since`): first those POOL_TELEMETRY kept from before the tenant's stream, whose
        sequences all lie below the stream's first, then the stream's own."""
        first = await self.first_seq(nc, tenant)
        stream = tenant_telemetry_stream(tenant)
        skipped_to = 0
        if first is None or after_seq + 1 < first:
            try:
                old = await read_page_async(nc, filter_subject, after_seq=after_seq, since=since,
                                            limit=limit, stream=TELEMETRY_STREAM)
            except BusUnavailable:  # no shared stream (a plane that never had one)
                old = TelemetryPage([], True)
            if first is None or old.samples:
                # more may follow in the tenant's stream: the next page asks
                return TelemetryPage(old.samples, old.at_end and first is None)
            skipped_to = first - 1
            after_seq = skipped_to if after_seq else 0
        page = await read_page_async(nc, filter_subject, after_seq=after_seq, since=since,
                                     limit=limit, stream=stream)
        return TelemetryPage(page.samples, page.at_end, skipped_to)


def read_tenant_page(runtime: BusRuntime, streams: TenantStreams, tenant: str,
                     filter_subject: str, **kw: Any) -> TelemetryPage:
    """`TenantStreams.read_page` from a synchronous caller (the command service)."""
    async def go() -> TelemetryPage:
        return await streams.read_page(await runtime.connection(), tenant, filter_subject, **kw)

    return runtime.run(go())


async def streams_holding(nc: Client, filter_subject: str) -> list[str]:
    """The streams that may hold samples under `filter_subject`: a tenant's own stream and
    POOL_TELEMETRY (its samples from before the split); for a filter naming no tenant, every
    telemetry stream on the server."""
    names: list[str] = []
    offset = 0
    while True:
        reply = await nc.request("$JS.API.STREAM.NAMES", json.dumps(
            {"subject": f"{TELEMETRY_PREFIX}.>", "offset": offset}).encode(), timeout=5)
        body = json.loads(reply.data)
        if "error" in body:
            raise BusUnavailable(f"listing the telemetry streams failed: {body['error']}")
        got = list(body.get("streams") or [])
        names += got
        offset += len(got)
        if not got or offset >= int(body.get("total") or 0):
            break
    tenant = telemetry_tenant_of(filter_subject)
    if tenant is not None:
        names = [n for n in names if n in (TELEMETRY_STREAM, tenant_telemetry_stream(tenant))]
    # the samples from before the split first: they are the older
    return sorted(names, key=lambda n: (n != TELEMETRY_STREAM, n))




class MadeOnFirstUse:
    """Makes a tenant's stream, with the default retention, before its first job in this
    process starts: for a plane whose user may make streams (a role's may not: the operator
    made the stream with the tenant's user). A failure is logged, never raised: the job runs,
    and its samples wait for the stream."""

    def __init__(self, runtime: BusRuntime) -> None:
        self._rt = runtime
        self._made: set[str] = set()

    def __call__(self, tenant: str) -> None:
        if tenant in self._made:
            return
        self._made.add(tenant)

        async def go() -> None:
            await ensure_tenant_telemetry(await self._rt.jetstream(), tenant)

        try:
            self._rt.run(go())
        except Exception as e:  # noqa: BLE001 - telemetry must never hold a job back
            log.warning("telemetry stream of tenant %s not made: %s", tenant, e)


__all__ = [
    "MadeOnFirstUse",
    "TenantStreams",
    "ensure_tenant_telemetry",
    "ensure_tenant_telemetry_sync",
    "read_tenant_page",
    "streams_holding",
]
