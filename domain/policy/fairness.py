"""Fair ordering of pending requests: priority classes with aging, weighted DRF, then FIFO.
The order and its sources: docs/architecture.md#the-scheduler and docs/quotas.md.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from domain.resources import ZERO, Resources, Shape


@dataclass(frozen=True)
class PendingRequest:
    lease_id: str
    tenant: str
    priority_class: str
    shape: Shape
    enqueued_at: float
    seq: int


def dominant_share(usage: Resources, totals: Resources) -> float:
    """max over dimensions of usage / total; dimensions the pool has none of are ignored."""
    # the four scalar dimensions by attribute (this runs at every placement), then any
    # extended ones the usage has
    best = 0.0
    for amount, total in ((usage.cpu_millis, totals.cpu_millis),
                          (usage.memory_mib, totals.memory_mib),
                          (usage.gpu_count, totals.gpu_count),
                          (usage.local_disk_gib, totals.local_disk_gib)):
        if total > 0:
            best = max(best, int(amount) / total)
    if usage.extended:
        extended_totals = dict(totals.extended)
        for dim, amount in usage.extended:
            total = extended_totals.get(dim, 0)
            if total > 0:
                best = max(best, amount / total)
    return best


def weighted_dominant_share(usage: Resources, totals: Resources, weight: float) -> float:
    """Dominant share divided by the tenant's weight: weight 2 is entitled to twice as much."""
    if weight <= 0:
        return math.inf
    return dominant_share(usage, totals) / weight


def _combined(usage: Resources, delta: Resources, sign: int) -> Resources:
    """usage ± delta: `Resources.__add__`/`__sub__`, without their merge of extended
    dimensions when neither side has any (the case at nearly every placement)."""
    if usage.extended or delta.extended:
        return usage + delta if sign > 0 else usage - delta
    return Resources(usage.cpu_millis + sign * delta.cpu_millis,
                     usage.memory_mib + sign * delta.memory_mib,
                     usage.gpu_count + sign * delta.gpu_count,
                     usage.local_disk_gib + sign * delta.local_disk_gib)


def _rank_of(priority_class: str, priority_ranks: Mapping[str, int]) -> int:
    # An unknown class is treated as the lowest one rather than failing the whole cycle.
    if priority_class in priority_ranks:
        return priority_ranks[priority_class]
    return min(priority_ranks.values(), default=0)


def effective_rank(
    rank: int, top_rank: int, waited_seconds: float, aging_seconds_per_rank: float
) -> int:
    """rank + one per `aging_seconds_per_rank` waited, capped at the top class.

    The cap is the design: aging lifts an old low-class request into the top band, where it
    competes by weighted dominant share. A tenant at or below its fair share (typically a
    light one, whose usage drains while it waits) then wins there against a flood, but aging
    never lets an over-share tenant jump a fair one. `aging_seconds_per_rank <= 0` disables aging.
    """
    if aging_seconds_per_rank <= 0 or rank >= top_rank:
        return rank
    steps = math.floor(max(waited_seconds, 0.0) / aging_seconds_per_rank)
    return min(rank + steps, top_rank)


def order_pending(
    pending: Iterable[PendingRequest],
    usage_by_tenant: Mapping[str, Resources],
    weights: Mapping[str, float],
    totals: Resources,
    priority_ranks: Mapping[str, int],
    aging_seconds_per_rank: float,
    now: float,
) -> list[PendingRequest]:
    """A one-shot ordering under the current usage (placing nothing).

    Key: effective rank (higher first), weighted dominant share of the tenant (lower first),
    then FIFO by (enqueued_at, seq). Use `FairQueue` to re-order as placements change usage.
    """
    top = max(priority_ranks.values(), default=0)
    share_cache: dict[str, float] = {}

    def share(tenant: str) -> float:
        s = share_cache.get(tenant)
        if s is None:
            s = weighted_dominant_share(
                usage_by_tenant.get(tenant, ZERO), totals, weights.get(tenant, 1.0)
            )
            share_cache[tenant] = s
        return s

    def key(p: PendingRequest) -> tuple[int, float, float, int]:
        r = effective_rank(
            _rank_of(p.priority_class, priority_ranks), top, now - p.enqueued_at,
            aging_seconds_per_rank,
        )
        return (-r, share(p.tenant), p.enqueued_at, p.seq)

    return sorted(pending, key=key)


def quota_check(
    usage: Resources, request: Resources, quota: Resources | Mapping[str, int] | None
) -> list[str]:
    """Dimensions in which usage + request would exceed the quota (empty: within quota).

    A `Resources` quota limits every dimension (an absent extended dimension allows 0); a
    mapping limits only the dimensions it names; None means unlimited. The caller reports a
    non-empty result as `reasons.QUOTA_EXCEEDED`.
    """
    if quota is None:
        return []
    after = usage + request
    if isinstance(quota, Resources):
        return after.exceeded_dimensions(quota)
    return sorted(d for d, limit in quota.items() if after.get(d) > limit)


class DecayedUsage:
    """Each tenant's past usage in resource-seconds, decayed with a half-life: usage held
    `age` seconds ago counts 2^(-age / half_life). Usage is constant between the changes the
    caller reports (`set_usage` at the event's time), so the integral is exact, not sampled.

    `half_life_seconds` 0 turns it off: nothing is kept and every share is 0."""

    def __init__(self, half_life_seconds: float = 0.0) -> None:
        self.half_life_seconds = half_life_seconds
        # tenant → (time of the last change, decayed resource-seconds per dimension, usage)
        self._state: dict[str, tuple[float, dict[str, float], Resources]] = {}

    @property
    def _tau(self) -> float:
        """The mean life: a usage held forever integrates to usage × tau."""
        return self.half_life_seconds / math.log(2)

    def tenants(self) -> list[str]:
        return sorted(self._state)

    def _advanced(self, tenant: str, at: float) -> tuple[float, dict[str, float], Resources]:
        state = self._state.get(tenant)
        if state is None:
            return at, {}, ZERO
        since, acc, rate = state
        dt = at - since
        if dt <= 0:  # an event stamped earlier than the last one counts as simultaneous
            return since, acc, rate
        keep = 2.0 ** (-dt / self.half_life_seconds)
        gained = self._tau * (1.0 - keep)
        out = {d: v * keep for d, v in acc.items()}
        for d in rate.dimensions():
            amount = rate.get(d)
            if amount:
                out[d] = out.get(d, 0.0) + amount * gained
        return at, out, rate

    def set_usage(self, tenant: str, at: float, usage: Resources) -> None:
        """From `at` on, `tenant` holds `usage` (what it held before is decayed up to `at`)."""
        if self.half_life_seconds <= 0:
            return
        since, acc, _ = self._advanced(tenant, at)
        self._state[tenant] = (since, acc, usage)

    def usage(self, tenant: str, now: float) -> dict[str, float]:
        """Decayed resource-seconds per dimension at `now`."""
        if self.half_life_seconds <= 0:
            return {}
        return self._advanced(tenant, now)[1]

    def share(self, tenant: str, now: float, totals: Resources) -> float:
        """The dominant share of decayed usage: 1.0 is the whole pool held for ever."""
        if self.half_life_seconds <= 0:
            return 0.0
        best = 0.0
        scale = self._tau
        for d, v in self.usage(tenant, now).items():
            total = totals.get(d)
            if total > 0:
                best = max(best, v / (total * scale))
        return best


_SCALAR_SLOTS = 64  # up to this many (tenant, class) slots, the next one is found in Python
_Entry = tuple[float, int, str]  # (enqueued_at, seq, lease_id): a per-slot heap entry


class FairQueue:
    """Pending requests, popped one at a time in fair order as usage changes.

    One FIFO heap per (tenant, priority class) slot. Only a slot's head can be next (it is the
    oldest, so the most aged), so `pop` compares heads: effective rank, then the tenant's
    weighted dominant share, then FIFO, vectorised over slots with numpy. Aging makes bands a
    function of `now`, so heads are re-banded at every pop rather than kept in fixed heaps.

    After placing a popped request call `placed(request)` (adds its resources to the tenant's
    usage); a request that could not be placed goes back with `requeue` and keeps its place.
    """

    def __init__(
        self,
        totals: Resources,
        weights: Mapping[str, float] | None = None,
        priority_ranks: Mapping[str, int] | None = None,
        aging_seconds_per_rank: float = 0.0,
        usage_by_tenant: Mapping[str, Resources] | None = None,
    ) -> None:
        self._totals = totals
        self._weights: dict[str, float] = dict(weights or {})
        self._ranks: dict[str, int] = dict(priority_ranks or {})
        self._top = max(self._ranks.values(), default=0)
        self._aging = aging_seconds_per_rank
        self._usage: dict[str, Resources] = dict(usage_by_tenant or {})
        # each tenant's decayed past usage as a dominant share (DecayedUsage.share), added to
        # its current share when ordering
        self._history: dict[str, float] = {}
        self._requests: dict[str, PendingRequest] = {}
        self._slot_of_key: dict[tuple[str, str], int] = {}
        self._slot_key: list[tuple[str, str]] = []
        self._heaps: list[list[_Entry]] = []
        self._tenant_slots: dict[str, list[int]] = {}
        cap = 16
        # Per-slot head columns, refreshed whenever a slot's head changes.
        self._head_enq: npt.NDArray[np.float64] = np.full(cap, np.inf)
        self._head_seq: npt.NDArray[np.int64] = np.zeros(cap, dtype=np.int64)
        self._rank: npt.NDArray[np.int64] = np.zeros(cap, dtype=np.int64)
        self._share: npt.NDArray[np.float64] = np.zeros(cap)
        self._active: npt.NDArray[np.bool_] = np.zeros(cap, dtype=np.bool_)

    # ---------------------------------------------------------------- state

    def __len__(self) -> int:
        return len(self._requests)

    def __contains__(self, lease_id: object) -> bool:
        return lease_id in self._requests

    def usage(self, tenant: str) -> Resources:
        return self._usage.get(tenant, ZERO)

    def usages(self) -> Mapping[str, Resources]:
        """Every tenant's current usage (read-only: change it through the methods below)."""
        return self._usage

    def share(self, tenant: str) -> float:
        """(current dominant share + decayed past share) / weight: the DRF ordering key."""
        current = weighted_dominant_share(self.usage(tenant), self._totals, self._weight(tenant))
        past = self._history.get(tenant)
        return current if not past else current + past / self._weight(tenant)

    def set_history(self, tenant: str, decayed_share: float) -> None:
        """The tenant's decayed past usage as a dominant share, counted from now on."""
        if decayed_share or tenant in self._history:
            self._history[tenant] = decayed_share
            self._refresh_share(tenant)

    def _weight(self, tenant: str) -> float:
        return self._weights.get(tenant, 1.0)

    def _refresh_share(self, tenant: str) -> None:
        s = self.share(tenant)
        for slot in self._tenant_slots.get(tenant, ()):
            self._share[slot] = s

    def set_usage(self, tenant: str, usage: Resources) -> None:
        self._usage[tenant] = usage
        self._refresh_share(tenant)

    def placed(self, request: PendingRequest, resources: Resources | None = None) -> None:
        """Charge a placement to the tenant (the request's own resources unless given)."""
        self.add_usage(request.tenant, request.shape.resources if resources is None else resources)

    def add_usage(self, tenant: str, delta: Resources) -> None:
        self.set_usage(tenant, _combined(self.usage(tenant), delta, 1))

    def released(self, tenant: str, resources: Resources) -> None:
        self.set_usage(tenant, _combined(self.usage(tenant), resources, -1))

    def set_weight(self, tenant: str, weight: float) -> None:
        self._weights[tenant] = weight
        self._refresh_share(tenant)

    def set_totals(self, totals: Resources) -> None:
        self._totals = totals
        for tenant in self._tenant_slots:
            self._refresh_share(tenant)

    # ---------------------------------------------------------------- queue

    def _slot(self, tenant: str, priority_class: str) -> int:
        key = (tenant, priority_class)
        slot = self._slot_of_key.get(key)
        if slot is not None:
            return slot
        slot = len(self._slot_key)
        if slot >= self._active.size:
            grow = self._active.size
            self._head_enq = np.concatenate([self._head_enq, np.full(grow, np.inf)])
            self._head_seq = np.concatenate([self._head_seq, np.zeros(grow, dtype=np.int64)])
            self._rank = np.concatenate([self._rank, np.zeros(grow, dtype=np.int64)])
            self._share = np.concatenate([self._share, np.zeros(grow)])
            self._active = np.concatenate([self._active, np.zeros(grow, dtype=np.bool_)])
        self._slot_of_key[key] = slot
        self._slot_key.append(key)
        self._heaps.append([])
        self._tenant_slots.setdefault(tenant, []).append(slot)
        self._rank[slot] = _rank_of(priority_class, self._ranks)
        self._share[slot] = self.share(tenant)
        return slot

    def _refresh_head(self, slot: int) -> None:
        heap = self._heaps[slot]
        # Drop entries of requests removed (cancelled) since they were pushed.
        while heap and heap[0][2] not in self._requests:
            heapq.heappop(heap)
        if heap:
            self._head_enq[slot] = heap[0][0]
            self._head_seq[slot] = heap[0][1]
            self._active[slot] = True
        else:
            self._active[slot] = False

    def push(self, request: PendingRequest) -> None:
        if request.lease_id in self._requests:
            raise ValueError(f"{request.lease_id!r} already queued")
        self._requests[request.lease_id] = request
        slot = self._slot(request.tenant, request.priority_class)
        heapq.heappush(self._heaps[slot], (request.enqueued_at, request.seq, request.lease_id))
        self._refresh_head(slot)

    requeue = push  # a request keeps its enqueued_at/seq, so it goes back to its old place

    def extend(self, requests: Iterable[PendingRequest]) -> None:
        for r in requests:
            self.push(r)

    def requests(self) -> Iterable[PendingRequest]:
        """Every queued request, in no particular order (read-only)."""
        return self._requests.values()

    def requests_of(self, tenant: str) -> list[PendingRequest]:
        """The tenant's queued requests, in no particular order: a walk over its own slots
        only, not the whole queue."""
        out: dict[str, PendingRequest] = {}
        for slot in self._tenant_slots.get(tenant, ()):
            for _, _, lease_id in self._heaps[slot]:
                request = self._requests.get(lease_id)
                if request is not None:  # entries of removed requests linger in the heaps
                    out[lease_id] = request
        return list(out.values())

    def remove(self, lease_id: str) -> PendingRequest | None:
        """Cancel a pending request (lazily dropped from its heap)."""
        request = self._requests.pop(lease_id, None)
        if request is not None:
            self._refresh_head(self._slot_of_key[(request.tenant, request.priority_class)])
        return request

    def _best_slot(self, now: float) -> int | None:
        n = len(self._slot_key)
        if n > _SCALAR_SLOTS:
            return self._best_slot_vectorised(now)
        # a few (tenant, class) slots: plain Python beats numpy's per-call overhead; the same
        # order as the lexsort below (rank desc, share, enqueued, seq; ties to the lower slot)
        active = self._active[:n].tolist()
        ranks = self._rank[:n].tolist()
        shares = self._share[:n].tolist()
        enqs = self._head_enq[:n].tolist()
        seqs = self._head_seq[:n].tolist()
        aging, top = self._aging, self._top
        best: int | None = None
        best_key: tuple[int, float, float, int] | None = None
        for slot in range(n):
            if not active[slot]:
                continue
            rank = ranks[slot]
            if aging > 0 and rank < top:
                waited = max(now - enqs[slot], 0.0)
                rank = min(rank + math.floor(waited / aging), top)
            key = (-rank, shares[slot], enqs[slot], seqs[slot])
            if best_key is None or key < best_key:
                best, best_key = slot, key
        return best

    def _best_slot_vectorised(self, now: float) -> int | None:
        active = np.flatnonzero(self._active[: len(self._slot_key)])
        if active.size == 0:
            return None
        rank = self._rank[active]
        if self._aging > 0:
            waited = np.maximum(now - self._head_enq[active], 0.0)
            aged = rank + np.floor(waited / self._aging).astype(np.int64)
            rank = np.where(rank >= self._top, rank, np.minimum(aged, self._top))
        order = np.lexsort((self._head_seq[active], self._head_enq[active],
                            self._share[active], -rank))
        return int(active[order[0]])

    def peek(self, now: float) -> PendingRequest | None:
        slot = self._best_slot(now)
        if slot is None:
            return None
        return self._requests[self._heaps[slot][0][2]]

    def pop(self, now: float) -> PendingRequest | None:
        """Remove and return the next request in fair order at `now` (None when empty)."""
        slot = self._best_slot(now)
        if slot is None:
            return None
        _, _, lease_id = heapq.heappop(self._heaps[slot])
        request = self._requests.pop(lease_id)
        self._refresh_head(slot)
        return request

    def drain(self, now: float) -> list[PendingRequest]:
        """Everything, in the order `pop` would give it with usage held as it is."""
        out: list[PendingRequest] = []
        while (r := self.pop(now)) is not None:
            out.append(r)
        return out
