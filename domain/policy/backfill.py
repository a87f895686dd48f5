"""EASY backfill: each band's blocked head holds a reservation that later requests may not delay.
Design and estimates: docs/adr/002-easy-backfill.md.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import numpy as np

from domain.lease import Lease, LeaseState
from domain.policy.fairness import effective_rank
from domain.policy.placement import FilterResult, NodeTable, Packing
from domain.reservation import Withheld
from domain.resources import Resources, Shape

# a reservation or estimate walks the leases of at most this many candidate nodes
WALKED_CANDIDATES = 64
# a lease's resources and when it will have freed them at the latest (None: unknown)
LeaseEnd = tuple[Resources, float | None]
EndLookup = Callable[[str], LeaseEnd | None]


def lease_end_estimate(lease: Lease) -> float | None:
    """The latest time `lease` still holds its capacity, from its own deadlines: a running
    lease ends by its maximum runtime at the latest (renewals never pass it), a reserved one
    must commit by its reservation deadline and then runs at most its maximum runtime, and a
    lease on its way out (preempting, stopping) is gone by its next deadline. None for one
    whose end no deadline bounds (expired or reconciling: its capacity is held until the
    agent confirms the workload gone)."""
    if lease.state is LeaseState.RESERVED:
        if lease.reservation_deadline is None:
            return None
        return lease.reservation_deadline + lease.maximum_runtime_seconds
    if lease.state is LeaseState.RUNNING:
        limit = lease.runtime_limit_at
        return limit if limit is not None else lease.deadline
    return lease.next_due_at()


def placed_end_estimate(now: float, commit_timeout_seconds: float,
                        maximum_runtime_seconds: float) -> float:
    """The end estimate of a request placed at `now` (what `lease_end_estimate` will say of it
    once reserved): the commit window, then its maximum runtime."""
    return now + commit_timeout_seconds + maximum_runtime_seconds


def band_of(priority_class: str, enqueued_at: float, now: float,
            ranks: Mapping[str, int], aging_seconds_per_rank: float) -> int:
    """The effective priority band a queued request competes in at `now`, as FairQueue
    orders it (its class's rank raised by aging, capped at the top class)."""
    top = max(ranks.values(), default=0)
    rank = ranks[priority_class] if priority_class in ranks else min(ranks.values(), default=0)
    return effective_rank(rank, top, now - enqueued_at, aging_seconds_per_rank)


@dataclass(frozen=True)
class Reservation:
    """Capacity promised to a blocked request: on `node_id` from `start_at`."""

    lease_id: str
    node_id: str
    start_at: float
    resources: Resources
    band: int

    def to_dict(self) -> dict[str, object]:
        return {"lease_id": self.lease_id, "node_id": self.node_id,
                "start_at": self.start_at, "band": self.band}


@dataclass(frozen=True)
class _Head:
    lease_id: str
    shape: Shape
    allowed_trust_levels: tuple[str, ...] | None


class Backfill:
    """A pool's reservations, kept from cycle to cycle.

    The first request of a band found not to fit now becomes the band's head and holds a
    reservation until it is placed or leaves the queue; its start and node are worked out
    again at the start of every cycle (`begin`), as leases end early or the pool changes.
    Keeping the head, rather than taking whoever fails first each cycle, is what lets a wide
    request gather a node while fair order keeps putting smaller requests ahead of it.

    Per cycle: `begin`, then `place` (or `admits`) before any placement, `blocked` for a
    request that fits no node now, `placed` once a head is placed. The table must hold every
    capacity-holding lease (this cycle's placements included, as the scheduler allocates them
    at once), and `ends` must know each one's resources and end estimate.
    """

    def __init__(self, table: NodeTable, ends: EndLookup, now: float = 0.0, *,
                 depth: int = 1) -> None:
        if depth < 1:
            raise ValueError("a band holds at least one reservation")
        self.table = table
        self.ends = ends
        self.now = now
        self.depth = depth  # heads (and reservations) per band: 1 is EASY
        self._heads: dict[tuple[int, int], _Head] = {}
        # (band, slot) → that head's reservation
        self.reservations: dict[tuple[int, int], Reservation] = {}
        self._by_node: dict[str, list[Reservation]] = {}
        # (resources, candidate nodes) → earliest (start, node): one walk per shape per cycle
        self._earliest: dict[tuple[Resources, tuple[int, ...]], tuple[float, str] | None] = {}
        # the caller's per-cycle estimates by key (e.g. shape and trust), cleared by `begin`
        self.estimates: dict[object, float | None] = {}
        # node → capacity kept there for advance reservations and maintenance windows
        self._windows: dict[str, list[Withheld]] = {}
        # (shape, trust) → the table's `layout` when no ready node could ever hold it: no
        # reservation for it until a node, state or tag changes (a deep queue of requests
        # that fit nowhere asked `_reserve` to filter every node again for each of them)
        self._nowhere: dict[tuple[Shape, tuple[str, ...] | None], int] = {}

    def withhold(self, withheld: Iterable[Withheld]) -> None:
        """This cycle's advance reservations and maintenance windows (domain.reservation):
        `admits` keeps other requests out of them as it does for heads' reservations."""
        self._windows.clear()
        for w in withheld:
            self._windows.setdefault(w.node_id, []).append(w)

    def withhold_also(self, withheld: Iterable[Withheld]) -> None:
        """More capacity kept this cycle beside the windows `withhold` gave (a gang's hold)."""
        for w in withheld:
            self._windows.setdefault(w.node_id, []).append(w)

    def window_nodes(self) -> set[str]:
        """The nodes a window (`withhold`, `withhold_also`) keeps something on this cycle."""
        return set(self._windows)

    def begin(self, now: float, queued: Callable[[str], bool]) -> None:
        """Start a cycle at `now`: forget heads no longer queued and reserve again for the
        others, in band order (highest first), from the table as it is now."""
        self.now = now
        self.reservations.clear()
        self._by_node.clear()
        self._earliest.clear()
        self.estimates.clear()
        self._nowhere.clear()
        for key in sorted(self._heads, key=lambda k: (-k[0], k[1])):
            head = self._heads[key]
            if not queued(head.lease_id) or not self._reserve(key, head):
                del self._heads[key]

    # ---------------------------------------------------------------- estimates

    def capacity_at(self, node_id: str, at: float) -> Resources:
        """What `node_id` will have free at `at` if every lease on it ends by its estimate
        (and nothing new is placed there meanwhile)."""
        free = self.table.free_resources(node_id)
        for lid in self.table.leases_on(node_id):
            known = self.ends(lid)
            if known is not None and known[1] is not None and known[1] <= at:
                free = free + known[0]
        return free

    def _earliest_on(self, node_id: str, need: Resources) -> float | None:
        if node_id in self._windows:
            return self._earliest_beside_windows(node_id, need)
        free = self.table.free_resources(node_id)
        if need.fits_in(free):
            return self.now
        ending: list[tuple[float, Resources]] = []
        for lid in self.table.leases_on(node_id):
            known = self.ends(lid)
            if known is not None and known[1] is not None:
                ending.append((known[1], known[0]))
        ending.sort(key=lambda e: e[0])
        if not (need.extended or free.extended or any(r.extended for _, r in ending)):
            # the four scalar dimensions as plain ints: this runs per candidate node per
            # reservation per cycle, and Resources arithmetic is the bulk of its cost
            c, m, g, d = free.cpu_millis, free.memory_mib, free.gpu_count, free.local_disk_gib
            nc, nm, ng, nd = need.cpu_millis, need.memory_mib, need.gpu_count, need.local_disk_gib
            for at, res in ending:
                c += res.cpu_millis
                m += res.memory_mib
                g += res.gpu_count
                d += res.local_disk_gib
                if nc <= c and nm <= m and ng <= g and nd <= d:
                    return max(at, self.now)
            return None
        for at, res in ending:
            free = free + res
            if need.fits_in(free):
                return max(at, self.now)
        return None  # a lease with no end estimate holds what the request needs

    def _earliest_beside_windows(self, node_id: str, need: Resources) -> float | None:
        """`_earliest_on` for a node with windows: a head is never reserved capacity a window
        keeps, so it starts once leases have freed enough and the windows holding the rest
        have ended (a head that could run before a window begins is not looked for)."""
        ws = self._windows[node_id]
        times = {self.now, *(w.end_at for w in ws)}
        for lid in self.table.leases_on(node_id):
            known = self.ends(lid)
            if known is not None and known[1] is not None:
                times.add(known[1])
        for at in sorted(t for t in times if t >= self.now):
            free = self.capacity_at(node_id, at)
            for w in ws:
                if w.end_at > at:
                    free = free - w.resources
            if need.fits_in(free):
                return at
        return None

    def earliest(self, resources: Resources, candidates: Iterable[int],
                 *, skip_reserved: bool = False) -> tuple[float, str] | None:
        """The earliest (time, node) at which `resources` fit one of the candidate node
        indices, from the end estimates of the leases there; None if none ever frees enough.
        With `skip_reserved`, nodes already promised to a reservation are not considered.
        Of many candidates only the WALKED_CANDIDATES nearest to fitting now are walked."""
        cands = tuple(int(i) for i in candidates)
        key = (resources, cands)
        if not skip_reserved and key in self._earliest:
            return self._earliest[key]
        if skip_reserved and self._by_node:
            cands = tuple(i for i in cands if self.table.node_id_at(i) not in self._by_node)
        best: tuple[float, str] | None = None
        for i in self._nearest(cands, resources):
            node_id = self.table.node_id_at(i)
            at = self._earliest_on(node_id, resources)
            if at is not None and (best is None or at < best[0]):
                best = (at, node_id)
        if not skip_reserved:
            self._earliest[key] = best
        return best

    def _nearest(self, cands: tuple[int, ...], need: Resources) -> tuple[int, ...]:
        """At most WALKED_CANDIDATES of `cands`: those whose free capacity falls least short
        of `need` (by the largest shortfall over the requested dimensions, as a share of the
        request). Walking every busy node's leases made a cycle on a full pool of thousands
        of nodes cost a walk over all of them per blocked shape; the nearest ones are where
        enough frees first unless their leases run far longer, so the estimate may come out
        later than the true earliest, never earlier."""
        if len(cands) <= WALKED_CANDIDATES:
            return cands
        idx = np.asarray(cands, dtype=np.int64)
        free = self.table.free_matrix()[idx]
        shortfall = np.zeros(idx.size)
        for j, dim in enumerate(self.table.dimensions):
            amount = need.get(dim)
            if amount > 0:
                shortfall = np.maximum(shortfall, (amount - free[:, j]) / amount)
        order = np.argsort(shortfall, kind="stable")[:WALKED_CANDIDATES]
        return tuple(int(i) for i in idx[order])

    # ---------------------------------------------------------------- reservations

    def _reserve(self, key: tuple[int, int], head: _Head) -> Reservation | None:
        fr = self.table.filter(head.shape, allowed_trust_levels=head.allowed_trust_levels)
        candidates = np.concatenate([fr.eligible, fr.busy])
        if not candidates.size:  # no ready node could ever hold it (`_nowhere`)
            self._nowhere[(head.shape, head.allowed_trust_levels)] = self.table.layout
            return None
        found = self.earliest(head.shape.resources, candidates, skip_reserved=True)
        if found is None:
            return None
        at, node_id = found
        r = Reservation(head.lease_id, node_id, at, head.shape.resources, key[0])
        self.reservations[key] = r
        self._by_node.setdefault(node_id, []).append(r)
        return r

    def blocked(self, lease_id: str, shape: Shape, band: int,
                allowed_trust_levels: Iterable[str] | None = None) -> Reservation | None:
        """A request of `band` fits no node now: its own reservation if it is a head already;
        else, while the band has fewer than `depth` heads, it becomes one and gets a
        reservation (None when no node ever frees enough for it); else None (it waits
        behind the heads)."""
        mine = self.reservation_of(lease_id)
        if mine is not None:
            return mine
        taken = {slot for b, slot in self._heads if b == band}
        if len(taken) >= self.depth:
            return None
        key = (band, min(set(range(self.depth)) - taken))
        trust = None if allowed_trust_levels is None else tuple(sorted(allowed_trust_levels))
        if self._nowhere.get((shape, trust)) == self.table.layout:
            return None  # what `_reserve` would find again: no ready node could hold it
        head = _Head(lease_id, shape, trust)
        r = self._reserve(key, head)
        if r is not None:
            self._heads[key] = head
        return r

    def placed(self, lease_id: str) -> None:
        """A head was placed (or left the queue): its reservation is no longer needed."""
        for key, r in list(self.reservations.items()):
            if r.lease_id == lease_id:
                del self.reservations[key]
                self._by_node[r.node_id].remove(r)
                if not self._by_node[r.node_id]:
                    del self._by_node[r.node_id]
        for key, head in list(self._heads.items()):
            if head.lease_id == lease_id:
                del self._heads[key]

    def reservation_of(self, lease_id: str) -> Reservation | None:
        for r in self.reservations.values():
            if r.lease_id == lease_id:
                return r
        return None

    def admits(self, node_id: str, resources: Resources, end_at: float | None,
               lease_id: str | None = None, window: str | None = None, *,
               heads: bool = True, band: int | None = None,
               offered_later: Callable[[str], bool] | None = None) -> bool:
        """Whether placing `resources` on `node_id` now, until `end_at`, leaves every
        reservation there (but the request's own) able to start on time: it ends before the
        reservation begins, or it fits beside the reservation in what the node will have
        free by then. Windows (`withhold`) other than `window`, the one the request may use,
        are counted together from the earliest one it would overlap. `heads` False: windows
        only, not the blocked heads' reservations. `band`: the request's own; a lower band's
        head never holds it back (the queue offers the higher band first, and a head kept
        from an earlier cycle must not turn that order round). `offered_later`: whether a
        lease is still to be offered this cycle (the queue's membership while it is popped);
        such a head never holds the request back either: it comes after the request in the
        current fair order, and a head kept from an earlier cycle, when the tenants' shares
        were otherwise, must not take every node that frees from a tenant further below its
        share."""
        ws = [w for w in self._windows.get(node_id, ())
              if w.reservation_id != window and (end_at is None or end_at > w.start_at)]
        if ws:
            kept = resources
            for w in ws:
                kept = kept + w.resources
            at = min(w.start_at for w in ws)
            if not (self.capacity_at(node_id, at) - kept).is_non_negative():
                return False
        for r in self._by_node.get(node_id, ()) if heads else ():
            if r.lease_id == lease_id or (band is not None and r.band < band) or (
                    offered_later is not None and offered_later(r.lease_id)):
                continue
            if end_at is not None and end_at <= r.start_at:
                continue
            left = self.capacity_at(node_id, r.start_at) - r.resources - resources
            if not left.is_non_negative():
                return False
        return True

    def place(self, shape: Shape, end_at: float | None, *, packing: Packing,
              allowed_trust_levels: Iterable[str] | None, lease_id: str | None = None,
              window: str | None = None, band: int | None = None,
              offered_later: Callable[[str], bool] | None = None
              ) -> tuple[str | None, FilterResult, bool]:
        """(node, filter result, held back): the node the table would choose for `shape`
        among those `admits` allows (the table's own first choice when admitted, else the
        best of the rest), or None; held back is True when it fits now but only where it
        would delay a reservation of `band` or above and not offered later (`admits`)."""
        node_id, fr = self.table.place_fast(shape, packing=packing,
                                            allowed_trust_levels=allowed_trust_levels)
        if node_id is None or self.admits(node_id, shape.resources, end_at, lease_id, window,
                                          band=band, offered_later=offered_later):
            return node_id, fr, False
        fresh = self.table.filter(shape, allowed_trust_levels=allowed_trust_levels)
        ok = [int(i) for i in fresh.eligible
              if self.admits(self.table.node_id_at(int(i)), shape.resources, end_at, lease_id,
                             window, band=band, offered_later=offered_later)]
        if not ok:
            return None, fresh, True
        best = self.table.rank(shape, np.asarray(ok, dtype=np.int64), packing, limit=1)
        return self.table.node_id_at(int(best[0])), fresh, False
