"""The scheduler's decision records (stream POOL_DECISIONS, `pool.dec.<tenant>.<lease>`): its
writer, one atomic batch a cycle and pool, and the reader `why --at` asks for one lease's."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import nats.js.errors

from bus.errors import BusUnavailable, PublishRejected
from bus.runtime import BusRuntime
from bus.streams import decisions_stream_config, ensure_stream
from bus.subjects import DECISIONS_STREAM, decision_subject
from bus.telemetry import read_page_async

BATCH_MAX = 999  # records per atomic batch (the server takes at most 1,000)
READ_PAGE = 500
READ_MAX = 20_000  # records of one lease read at most (a lease's reasons change far less)


class DecisionWriter:
    """The scheduler's side: a synchronous facade on a bus runtime."""

    def __init__(self, url: str, *, runtime: BusRuntime | None = None,
                 replicas: int = 1) -> None:
        from bus.runtime import get_runtime

        self.rt = runtime or get_runtime(url)
        self.replicas = replicas
        self.batches = 0
        self.records = 0

    def ensure(self) -> None:
        """Create the stream unless this process speaks as a role (the operator made it)."""
        from bus.local.auth import speaks_as_role

        if speaks_as_role(self.rt.url):
            return

        async def go() -> None:
            await ensure_stream(await self.rt.jetstream(), decisions_stream_config(self.replicas))

        self.rt.run(go())

    def append(self, records: Sequence[tuple[str, str, bytes]]) -> None:
        """Store `records` (tenant, lease id, body; at most BATCH_MAX) as one atomic batch:
        one write for a cycle's changed reasons of a pool, however many leases they name."""
        if not records:
            return
        if len(records) > BATCH_MAX:
            raise ValueError(f"at most {BATCH_MAX} records a batch, not {len(records)}")
        self.rt.run(self._batch(records))
        self.batches += 1
        self.records += len(records)

    async def _batch(self, records: Sequence[tuple[str, str, bytes]]) -> None:
        from bus.jetstream.natsfast import publish_atomic

        nc = await self.rt.connection()
        answer = await publish_atomic(
            nc, [(decision_subject(tenant, lease), body, {}) for tenant, lease, body in records])
        error = answer.get("error")
        if error:
            raise PublishRejected(f"the decisions stream refused a batch: "
                                  f"{error.get('description')}")


class DecisionReader:
    """The `why` service's side: one tenant's lease's records, in the order recorded."""

    def __init__(self, url: str, *, runtime: BusRuntime | None = None) -> None:
        from bus.runtime import get_runtime

        self.rt = runtime or get_runtime(url)

    def records(self, tenant: str, lease_id: str) -> list[bytes]:
        """Every stored record of `tenant`'s lease `lease_id` (the subject names the tenant:
        no other tenant's record can be read this way); empty before any."""

        async def go() -> list[bytes]:
            nc = await self.rt.connection()
            subject = decision_subject(tenant, lease_id)
            out: list[bytes] = []
            after = 0
            while len(out) < READ_MAX:
                try:
                    page = await read_page_async(nc, subject, after_seq=after, limit=READ_PAGE,
                                                 stream=DECISIONS_STREAM)
                except BusUnavailable:
                    with contextlib.suppress(nats.js.errors.NotFoundError):
                        await nc.jetstream().stream_info(DECISIONS_STREAM)
                        raise
                    return out  # no stream yet: nothing was recorded
                out += [body for _seq, _subject, body in page.samples]
                if page.at_end or not page.samples:
                    return out
                after = page.samples[-1][0]
            return out

        return self.rt.run(go())
