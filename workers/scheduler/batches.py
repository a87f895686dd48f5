"""The scheduler's atomic batches: saved, acknowledged, voided and settled."""

from __future__ import annotations

import logging

from eventsourcing.domain import Aggregate
from eventsourcing.persistence import IntegrityError

from bus import observability
from workers import metrics
from workers.pending import QueuedLease
from workers.scheduler.preemption import Preempting
from workers.scheduler.state import CycleReport, InFlight, Placed, account_uuid, node_uuid

log = logging.getLogger(__name__)
from domain.account import Account
from domain.devices import wanted
from domain.lease import Lease, LeaseState
from domain.node import Node
from domain.pool import Pool
from domain.resources import LeaseId, Shape


class Batching(Preempting):
    """A cycle's placements gathered into atomic batches, saved, voided or settled."""

    def _save(self, aggs: list[Aggregate], report: CycleReport) -> bool:
        unique = list({a.id: a for a in aggs}.values())
        if not unique:
            return True
        try:
            settled = self._settle(report)  # a batch still in flight from the last cycle
        except Exception:
            self._void(unique, [], report, quiet=True)  # planned on an unknown outcome
            raise
        if not settled:  # planned on top of a refused batch: void, as `_commit_batch` does
            self._void(unique, [], report)
            return False
        self._hint_ends(unique)
        try:
            recordings = self.app.save(*unique)
            report.batches += 1
            self._saved([r.notification.id for r in recordings or ()])
            self._settled(unique)
            return True
        except IntegrityError:
            # someone else wrote one of these first: forget our in-memory view of them and
            # re-read the log; the requests are still queued and the next cycle retries
            report.conflicts += 1
            for a in unique:
                self.aggregates.pop(a.id, None)
            self._reload(unique)
            return False

    def _hint_ends(self, aggs: list[Aggregate]) -> None:
        """Tell the recorder where the subjects of the compact leases this save promoted end
        (their record kept it): past its bound of remembered subjects, a backlog's oldest
        requests were forgotten, and each batch was held up by a look-up of ~900 subjects."""
        ends = self._ends
        if not ends:
            return
        hints = {a.id: ends[a.id] for a in aggs if a.id in ends}
        ends.clear()  # what a save leaves out was voided or planned again: read anew
        remember = getattr(self.app.recorder, "remember_ends", None)
        if hints and remember is not None:
            remember(hints)

    def _reload(self, aggs: list[Aggregate]) -> None:
        for a in aggs:
            fresh = self.app.repository.get(a.id)
            self.aggregates[fresh.id] = fresh
        for a in aggs:
            self._index(self.aggregates[a.id])

    def _close_batch(self, batch: list[Aggregate], allocs: dict[str, list[Placed]],
                     now: float, report: CycleReport) -> None:
        """Record each node's placements of this batch as one event on the node, and each
        tenant's credit holds as one event on its account, then send the batch
        (`_commit_batch`); `allocs` and the holds are emptied."""
        for node_id, placed in allocs.items():
            node = self.aggregates[node_uuid(node_id)]
            assert isinstance(node, Node)
            node.allocate_many(placed, now)
            batch.append(node)
        allocs.clear()
        for tenant, holds in self._holds.items():
            acc = self.aggregates[account_uuid(tenant)]
            assert isinstance(acc, Account)
            acc.hold_many(holds, now)
            batch.append(acc)
        self._holds.clear()
        self._held.clear()
        self._commit_batch(batch, report)

    def _commit_batch(self, batch: list[Aggregate], report: CycleReport) -> None:
        """Send `batch` as one atomic save and return while it is in flight, so the next batch
        is planned during the round trip. The batch before it is settled first: a save that
        shares a subject with one not yet acknowledged would carry a stale expectation, and a
        batch planned on top of a refused one is void — it is dropped unsent and everything
        both touched is re-read from the log, so its requests are planned again, never lost."""
        placing, self._placing = self._placing, []
        unique = list({a.id: a for a in batch}.values())
        try:
            settled = self._settle(report)
        except Exception:
            self._void(unique, placing, report, quiet=True)  # planned on an unknown outcome
            raise
        if not settled:
            self._void(unique, placing, report)
            return
        if not unique:
            return
        self._hint_ends(unique)
        try:
            pending = self.app.save_nowait(*unique)
        except IntegrityError:  # refused before sending (e.g. a version the recorder knows)
            report.conflicts += 1
            self._void(unique, placing, report)
            return
        self._inflight = InFlight(pending, unique, placing)

    def _settle(self, report: CycleReport) -> bool:
        """Wait for the batch in flight, if any; False if it was refused (then its aggregates
        have been re-read from the log and its placements no longer count)."""
        flight, self._inflight = self._inflight, None
        if flight is None:
            return True
        try:
            flight.pending.wait()
        except IntegrityError:
            # someone else wrote one of these first: forget our in-memory view of them and
            # re-read the log; the requests are still queued and the next cycle retries
            report.conflicts += 1
            self._void(flight.aggregates, flight.placing, report)
            return False
        except Exception:
            # not known whether it landed (a timeout, the bus gone): the log says; re-read
            # what it touched, as far as the bus allows, and let the cycle fail
            self._void(flight.aggregates, flight.placing, report, quiet=True)
            raise
        report.batches += 1
        self._saved(flight.pending.ids)
        self._end_spans(flight.placing, saved=True)
        self._settled(flight.aggregates)
        return True

    def _settled(self, aggs: list[Aggregate]) -> None:
        """Leases our acknowledged save ended (rejected, voided) leave memory."""
        for a in aggs:
            if isinstance(a, Lease) and a.is_terminal:
                self._forget(a)

    def _saved(self, ids: list[int]) -> None:
        """Remember where an acknowledged batch of ours sits in the log (an atomic batch is
        contiguous; anything else is simply read back as before)."""
        if (ids and ids[-1] - ids[0] + 1 == len(ids) and ids[0] > self.position
                and (not self._own or self._own[-1][1] < ids[0])):
            self._own.append((ids[0], ids[-1]))

    def _void(self, aggs: list[Aggregate], placing: list[tuple[Lease, int]],
              report: CycleReport, *, quiet: bool = False) -> None:
        """The placements in `aggs` did not land: uncount them and re-index from the log.
        Their unsaved events are dropped first, so no later save can carry them; should the
        log not answer, the in-memory objects stay until it does (as after a failed save)."""
        self._end_spans(placing, saved=False)
        lost = sum(isinstance(a, Lease) and a.state is LeaseState.RESERVED for a in aggs)
        report.placed = max(0, report.placed - lost)
        for a in aggs:
            a.collect_events()
        try:
            self._reload(aggs)
        except Exception:
            if not quiet:
                raise
            log.exception("could not re-read %d aggregates after a failed save", len(aggs))

    def _end_spans(self, placing: list[tuple[Lease, int]], *, saved: bool) -> None:
        if saved:
            metrics.placed_many(
                (str(lease.pool_id), (lease.reserved_at or lease.requested_at) - lease.requested_at)
                for lease, _ns in placing)
        for lease, started_ns in placing:
            if getattr(lease, "trace_parent", None) is None:  # untraced (older snapshots: none)
                continue
            # one `place` span per placement, in the trace of the request that asked for it
            span = observability.child_span("place", lease.trace_parent, start_time=started_ns,
                                            attributes={"pool.lease_id": str(lease.id),
                                                        "pool.node_id": str(lease.node_id),
                                                        "pool.pool_id": str(lease.pool_id),
                                                        "pool.saved": saved})
            span.end()

    def _devices_for(self, node_id: str, shape: Shape, allocs: dict[str, list[Placed]]
                     ) -> tuple[str, ...] | None:
        """The node's GPU devices for this placement (domain.devices), past those of this
        batch's placements on it not yet recorded; () when it binds none."""
        if wanted(shape)[1] <= 0:  # () whatever the node lists: no look-up a placement
            return ()
        node = self.aggregates.get(node_uuid(node_id))
        if not isinstance(node, Node) or not node.capabilities.devices:
            return ()
        pending = [d for item in allocs.get(node_id, ()) for d in item[2]]
        return node.choose_devices(shape, pending)

    def _hold_and_available(self, pool: Pool, tenant: str,
                            lease: Lease | QueuedLease) -> tuple[int, int]:
        """The credit hold the lease needs in this pool, and what its tenant has available."""
        hold = pool.hold_for(lease.requested_shape, lease.maximum_runtime_seconds)
        acc = self.aggregates.get(account_uuid(tenant))
        if not isinstance(acc, Account):
            return hold, 0
        return hold, acc.available - self._held.get(tenant, 0)  # less this batch's holds

    def _return_capacity(self, lease: Lease, now: float, *, charge: bool) -> list[Aggregate]:
        out: list[Aggregate] = []
        if lease.node_id is not None:
            node = self.aggregates.get(Node.create_id(lease.node_id))
            if isinstance(node, Node) and node.free(LeaseId(str(lease.id)), now):
                out.append(node)
        acc = self.aggregates.get(Account.create_id(lease.tenant_id))
        lid = LeaseId(str(lease.id))
        if isinstance(acc, Account) and acc.has_hold(lid):
            acc.release_hold(f"void-{lease.id}-{lease.epoch}", lid, now)
            out.append(acc)
        ps = self.pools.get(lease.pool_id)
        if ps is not None:
            ps.table.free(str(lease.id))
            self._track(ps, lease)
        return out
