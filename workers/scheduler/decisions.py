"""The scheduler's decision records: a waiting lease's reasons, queued when they change (not
when only its place or estimate moves), and its placement's terms; written per pool in one
batch a cycle, at most `max_per_cycle` records, the rest the next cycle (bus.decisions)."""

from __future__ import annotations

import itertools
import json
import logging
from typing import TYPE_CHECKING, Any, Protocol

from bus.decisions import DecisionReader, DecisionWriter
from bus.errors import BusError
from schemas import v1
from workers.errors import UnknownLease

if TYPE_CHECKING:
    from workers.application import PoolApp
    from workers.scheduler.loop import Scheduler

log = logging.getLogger(__name__)

MAX_RECORDS_PER_CYCLE = 900  # one cycle's writes, all pools together (under a batch's 1,000)
MAX_PENDING = 100_000  # records queued and not yet written; more are dropped (and retried)
# what a wait's fingerprint leaves out: where it stands and when it may start move every cycle
_MOVING = ("queue",)


class Writer(Protocol):
    def append(self, records: list[tuple[str, str, bytes]]) -> None: ...


def fingerprint(reasons: dict[str, Any]) -> str:
    """The reasons that make a change worth recording: codes and per-filter counts, without
    the queue position or start estimate."""
    return json.dumps({k: v for k, v in reasons.items() if k not in _MOVING},
                      sort_keys=True, default=str)


class DecisionRecorder:
    """What was last recorded per waiting lease, and the records due, per pool."""

    def __init__(self, writer: Writer, *, max_per_cycle: int = MAX_RECORDS_PER_CYCLE,
                 max_pending: int = MAX_PENDING) -> None:
        self.writer = writer
        self.max_per_cycle = max_per_cycle
        self.max_pending = max_pending
        self._last: dict[str, str] = {}  # lease → fingerprint of its last queued wait
        # pool → (lease, kind) → (tenant, body), oldest first; a newer wait replaces one due
        self._due: dict[str, dict[tuple[str, str], tuple[str, bytes]]] = {}
        self._pending = 0
        self.written = 0
        self.dropped = 0

    @property
    def pending(self) -> int:
        return self._pending

    def waiting(self, pool: str, tenant: str, lease_id: str, reasons: dict[str, Any],
                now: float) -> None:
        """Queue a record of `reasons` if they differ from the last queued for this lease."""
        key = fingerprint(reasons)
        if self._last.get(lease_id) == key:
            return
        queue = reasons.get("queue")
        if not isinstance(queue, dict):
            queue = {}
        body = {"lease_id": lease_id, "pool": pool, "tenant": tenant, "at": now,
                "state": "waiting",
                "reasons": {k: v for k, v in reasons.items() if k not in _MOVING},
                "position": queue.get("position"),
                "estimated_start_at": queue.get("estimated_start_at")}
        if self._queue(pool, tenant, lease_id, "waiting", body):
            self._last[lease_id] = key

    def left(self, pool: str, tenant: str, lease_id: str, state: str, now: float,
             **fields: Any) -> None:
        """Queue the record of a lease leaving the queue (`reserved` with the terms that
        chose it, `rejected`); its next wait, if it comes back, is recorded anew. A lease
        reserved at its first look never waited: its own events say when (no record, so a
        flood placed at once writes none)."""
        if self._last.pop(lease_id, None) is None and state == "reserved":
            return
        self._queue(pool, tenant, lease_id, state,
                    {"lease_id": lease_id, "pool": pool, "tenant": tenant, "at": now,
                     "state": state, **fields})

    def forget(self, lease_id: str) -> None:
        """An ended lease: nothing more to compare its reasons with."""
        self._last.pop(lease_id, None)

    def _queue(self, pool: str, tenant: str, lease_id: str, kind: str,
               body: dict[str, Any]) -> bool:
        due = self._due.setdefault(pool, {})
        slot = (lease_id, kind)
        if due.pop(slot, None) is not None:
            self._pending -= 1
        elif self._pending >= self.max_pending:
            self.dropped += 1
            return False
        due[slot] = (tenant, json.dumps(body, default=str).encode())
        self._pending += 1
        return True

    def flush(self) -> int:
        """Write what is due, one batch per pool, at most `max_per_cycle` records in all;
        returns how many were written. A refused batch stays due for the next cycle."""
        budget = self.max_per_cycle
        written = 0
        for pool in list(self._due):
            if budget <= 0:
                break
            due = self._due[pool]
            take = list(itertools.islice(due.items(), budget))
            try:
                self.writer.append([(tenant, lid, body) for (lid, _k), (tenant, body) in take])
            except BusError as e:
                log.warning("decision records of pool %s not written (next cycle): %s", pool, e)
                break
            for slot, _record in take:
                del due[slot]
            self._pending -= len(take)
            budget -= len(take)
            written += len(take)
            if not due:
                del self._due[pool]
        self.written += written
        return written


def reason_at(records: list[bytes], at: float, lease: dict[str, Any] | None) -> dict[str, Any]:
    """`why --at`: the last record at or before `at` of one lease (`records` as stored), or
    "not waiting" when the lease (`lease`: its requested_at and ended_at, from its events) was
    not queued then or had left the queue."""
    decoded: list[dict[str, Any]] = []
    for raw in records:
        try:
            r = json.loads(raw)
        except ValueError:
            continue
        if isinstance(r, dict) and isinstance(r.get("at"), (int, float)):
            decoded.append(r)
    decoded.sort(key=lambda r: float(r["at"]))  # stable: stream order among equal times
    last = None
    for r in decoded:
        if float(r["at"]) > at:
            break
        last = r
    out: dict[str, Any] = {"at": at}
    requested = (lease or {}).get("requested_at")
    ended = (lease or {}).get("ended_at")
    reserved = (lease or {}).get("reserved_at")
    if isinstance(requested, (int, float)) and at < requested:
        return {**out, "waiting": False, "state": "not_requested",
                "message": "not waiting at that time: not yet requested"}
    if isinstance(ended, (int, float)) and at >= ended and (
            last is None or last.get("state") != "rejected"):
        return {**out, "waiting": False, "state": "ended",
                "message": "not waiting at that time: the lease had ended"}
    if last is None and isinstance(reserved, (int, float)) and at >= reserved:
        return {**out, "waiting": False, "state": "reserved", "recorded_at": None,
                "message": f"not waiting at that time: reserved at {reserved} (at its first "
                           "look, so no wait was recorded)"}
    if last is None:
        if isinstance(requested, (int, float)):  # queued, but no cycle had looked at it yet
            return {**out, "waiting": True, "state": "not_yet_examined", "reasons": {},
                    "message": "waiting, but no reason was recorded yet"}
        return {**out, "waiting": False, "state": "not_recorded",
                "message": "no reason recorded at or before that time"}
    if last.get("state") != "waiting":
        return {**out, "waiting": False, "state": last.get("state"), "recorded_at": last["at"],
                "record": last,
                "message": f"not waiting at that time: {last.get('state')} at "
                           f"{last['at']}"}
    return {**out, "waiting": True, "state": "waiting", "recorded_at": last["at"],
            "reasons": last.get("reasons") or {}, "position": last.get("position"),
            "estimated_start_at": last.get("estimated_start_at"), "pool": last.get("pool")}


def record_decisions(scheduler: Scheduler) -> DecisionReader:
    """Give `scheduler` a recorder writing on its application's own bus connection (the
    stream made first unless a role's user, which may not); the reader `why_at` needs."""
    runtime = scheduler.app.factory.runtime
    writer = DecisionWriter(runtime.url, runtime=runtime)
    writer.ensure()
    scheduler.decisions = DecisionRecorder(writer)
    return DecisionReader(runtime.url, runtime=runtime)


def why_at(app: PoolApp, reader: DecisionReader | None, tenant: str, lease_id: str,
           at: float) -> v1.Envelope:
    """`why --at`: the reason recorded for the tenant's own lease at `at` (the records are
    read under the asking tenant's subject, and the lease must be that tenant's), or why it
    was not waiting then, from the lease's own events."""
    if reader is None:
        return v1.Envelope.failure("decisions_unavailable",
                                   "this process does not read the decision records")
    try:
        lease = app.get(tenant, lease_id)
    except UnknownLease:
        return v1.Envelope.failure("lease_not_found",
                                   f"no lease {lease_id!r} for tenant {tenant!r}")
    answer = reason_at(reader.records(tenant, lease_id), at,
                       {"requested_at": lease.requested_at, "ended_at": lease.ended_at,
                        "reserved_at": lease.reserved_at})
    return v1.Envelope.success(result={"lease_id": lease_id, **answer})
