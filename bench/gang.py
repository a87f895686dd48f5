"""`pool bench gang`: 1-GPU leases and multi-node gangs on a simulated GPU fleet, on a virtual
clock, through the gang placement policy and device choice, with and without the hold guard.
"""

from __future__ import annotations

import heapq
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from domain.devices import Device, choose_devices
from domain.policy.gang import Candidate, GangHolds, GangSpec, place_gang
from domain.resources import Shape

GPUS_PER_NODE = 8
RACK_SIZE = 16
GANG_SIZES = (2, 4, 16)  # nodes of 8 GPUs each
STARVED_FACTOR = 10.0  # a gang waited past 10× its size class's median wait


@dataclass(frozen=True)
class GangBenchSpec:
    nodes: int = 1000
    hours: float = 8.0
    warmup_hours: float = 1.0
    offered_load: float = 0.95  # GPU demand over GPU capacity
    single_share: float = 0.5  # of the GPU demand, from 1-GPU leases; the rest from gangs
    single_minutes: float = 20.0  # mean duration of a 1-GPU lease
    gang_minutes: float = 90.0  # mean duration of a gang
    # the guard's bound on one hold: longer than a busy node takes to drain (the longest of
    # its eight 1-GPU leases: about 2.7 × their mean), or holding gains nothing
    hold_seconds: float = 7200.0
    seed: int = 7


FULL = GangBenchSpec()
QUICK = GangBenchSpec(nodes=160, hours=3.0, warmup_hours=0.5)


@dataclass
class _Request:
    rid: int
    arrived: float
    members: int  # 0: a 1-GPU lease
    minutes: float
    waited: float | None = None


@dataclass
class _Fleet:
    """Each node's devices, which are held, and its rack."""

    devices: list[tuple[Device, ...]]
    held: list[set[str]]
    rack: list[str]
    free: list[int] = field(default_factory=list)
    # nodes by free GPU count, so best fit needs no walk over every node
    by_free: list[set[int]] = field(default_factory=list)

    def take(self, node: int, gpus: int) -> None:
        self.by_free[self.free[node]].discard(node)
        self.free[node] -= gpus
        self.by_free[self.free[node]].add(node)

    @classmethod
    def build(cls, nodes: int) -> _Fleet:
        devs = [tuple(Device(id=f"GPU-{n}-{k}", model="H100", memory_mib=80 * 1024, minor=k,
                             nvlink_domain=f"nv-{n}") for k in range(GPUS_PER_NODE))
                for n in range(nodes)]
        by_free: list[set[int]] = [set() for _ in range(GPUS_PER_NODE + 1)]
        by_free[GPUS_PER_NODE] = set(range(nodes))
        return cls(devs, [set() for _ in range(nodes)],
                   [f"rack-{n // RACK_SIZE}" for n in range(nodes)], [GPUS_PER_NODE] * nodes,
                   by_free)


def _run(spec: GangBenchSpec, *, guard: bool, packing: str = "best-fit") -> dict[str, Any]:
    rng = random.Random(spec.seed)
    fleet = _Fleet.build(spec.nodes)
    total_gpus = spec.nodes * GPUS_PER_NODE
    horizon = spec.hours * 3600.0
    warm = spec.warmup_hours * 3600.0
    one_gpu = Shape.build(cpu_millis=1000, memory_mib=1024, gpu_count=1)
    whole = Shape.build(cpu_millis=1000, memory_mib=1024, gpu_count=GPUS_PER_NODE)
    # arrival rates from the offered GPU demand: rate = share × GPUs / (GPUs each × seconds)
    single_rate = (spec.offered_load * spec.single_share * total_gpus
                   / (spec.single_minutes * 60.0))
    per_size = spec.offered_load * (1 - spec.single_share) / len(GANG_SIZES) * total_gpus
    gang_rates = {m: per_size / (m * GPUS_PER_NODE * spec.gang_minutes * 60.0)
                  for m in GANG_SIZES}
    events: list[tuple[float, int, str, Any]] = []
    seq = 0

    def push(at: float, kind: str, what: Any) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(events, (at, seq, kind, what))

    rid = 0
    for members, rate in [(0, single_rate), *gang_rates.items()]:
        t = rng.expovariate(rate)
        while t < horizon:
            rid += 1
            mean = spec.single_minutes if members == 0 else spec.gang_minutes
            push(t, "arrive", _Request(rid, t, members, rng.expovariate(1.0 / mean)))
            t += rng.expovariate(rate)
    queue: list[_Request] = []
    holds = GangHolds(max_hold_seconds=spec.hold_seconds)
    waits: dict[int, list[float]] = {m: [] for m in GANG_SIZES}
    placed = 0
    decide_s = 0.0
    busy = 0
    busy_integral = 0.0
    last = warm
    whole_free_changed = True
    labels = [{"rack": fleet.rack[n]} for n in range(spec.nodes)]

    def account(now: float) -> None:
        nonlocal busy_integral, last
        if now > warm:
            busy_integral += busy * (now - max(last, warm))
            last = now

    def start(req: _Request, now: float, grants: list[tuple[int, tuple[str, ...]]]) -> None:
        nonlocal busy, placed, whole_free_changed
        for node, devs in grants:
            fleet.held[node].update(devs)
            if fleet.free[node] == GPUS_PER_NODE:
                whole_free_changed = True
            fleet.take(node, len(devs))
            busy += len(devs)
        placed += 1
        req.waited = now - req.arrived
        if req.members and req.arrived >= warm:
            waits[req.members].append(req.waited)
        push(now + req.minutes * 60.0, "end", grants)

    def schedule(now: float) -> None:
        nonlocal decide_s, whole_free_changed
        if not queue:
            return
        t0 = time.perf_counter()
        candidates: list[Candidate] | None = None
        head_gang = next((r for r in queue if r.members), None)
        blocked_all = holds.blocked(now) if guard else set()
        blocked_idx = {int(x) for x in blocked_all}
        keep: list[_Request] = []
        singles_full = False  # one 1-GPU lease found no room: the rest of this pass neither
        failed_from = 1 << 30  # the smallest gang that failed in this pass
        for req in queue:
            if req.members == 0:
                grant = None if singles_full else _place_single(fleet, one_gpu, blocked_idx,
                                                                packing)
                if grant is None:
                    singles_full = True
                    keep.append(req)
                else:
                    start(req, now, [grant])
                continue
            if (not whole_free_changed and req is not head_gang) or (
                    req is not head_gang and req.members >= failed_from):
                # nothing freed since, or a gang no larger already failed in this pass (every
                # gang here is packed into one rack): it would fail the same way
                keep.append(req)
                continue
            if candidates is None or whole_free_changed:
                candidates = [Candidate(str(n), labels[n],
                                        fits_now=fleet.free[n] == GPUS_PER_NODE)
                              for n in range(spec.nodes)]
                whole_free_changed = False
            gspec = GangSpec.build(req.members, same="rack")
            blocked = holds.blocked(now, except_for=str(req.rid)) if guard else set()
            d = place_gang(gspec, candidates, blocked)
            if d.placed:
                holds.release(str(req.rid))
                grants = []
                for x in d.nodes:
                    devs = choose_devices(fleet.devices[int(x)], fleet.held[int(x)], whole)
                    assert devs, "a node offered as free had a device held"
                    grants.append((int(x), devs))
                start(req, now, grants)
                singles_full = False
                failed_from = 1 << 30
                candidates = None
                blocked_idx = {int(x) for x in holds.blocked(now)} if guard else set()
                continue
            keep.append(req)
            failed_from = min(failed_from, req.members)
            if guard and req is head_gang and d.best_domain is not None:
                # hold as many nodes of the best rack as the gang needs, the emptiest first
                # (the ones held already stay held): their running leases drain and no new
                # small one lands on them
                mine = holds.held_for(str(req.rid))
                rack = sorted((n for n in range(spec.nodes) if fleet.rack[n] == d.best_domain
                               and str(n) not in mine), key=lambda n: -fleet.free[n])
                want = [str(n) for n in rack[:max(0, req.members - len(mine))]]
                if holds.hold(str(req.rid), want, now):
                    blocked_idx |= {int(x) for x in want}
        queue[:] = keep
        decide_s += time.perf_counter() - t0

    while events:
        now, _, kind, what = heapq.heappop(events)
        if now > horizon:
            break
        account(now)
        if kind == "arrive":
            queue.append(what)
        else:
            for node, devs in what:
                fleet.held[node].difference_update(devs)
                fleet.take(node, -len(devs))
                if fleet.free[node] == GPUS_PER_NODE:
                    whole_free_changed = True
                busy -= len(devs)
        schedule(now)
    account(horizon)
    for req in queue:  # still waiting at the end: their wait so far counts
        if req.members and req.arrived >= warm:
            waits[req.members].append(horizon - req.arrived)
    out: dict[str, Any] = {
        "packing": packing, "guard": guard, "placements": placed,
        "placements_per_s": round(placed / decide_s) if decide_s else None,
        "gpu_utilisation": round(busy_integral / (total_gpus * (horizon - warm)), 3),
        "still_waiting": len(queue), "holds_expired": holds.expired,
    }
    starved = 0
    for m, w in waits.items():
        if not w:
            continue
        ws = sorted(w)
        med = statistics.median(ws)
        out[f"gang{m}x8_wait_p50_s"] = round(med, 1)
        out[f"gang{m}x8_wait_p99_s"] = round(ws[min(len(ws) - 1, int(0.99 * len(ws)))], 1)
        out[f"gang{m}x8_count"] = len(ws)
        starved += sum(1 for x in ws if x > STARVED_FACTOR * max(med, 60.0))
    out["starved"] = starved
    return out


def _place_single(fleet: _Fleet, shape: Shape, blocked: set[int],
                  packing: str = "best-fit") -> tuple[int, tuple[str, ...]] | None:
    """best-fit: the node with the fewest free GPUs that has one; spread: the most. Never a
    node held for a gang."""
    counts = range(1, GPUS_PER_NODE + 1)
    order = counts if packing == "best-fit" else reversed(counts)
    best = next((n for f in order for n in fleet.by_free[f] if n not in blocked), -1)
    if best < 0:
        return None
    chosen = choose_devices(fleet.devices[best], fleet.held[best], shape)
    if not chosen:
        return None
    return best, chosen


def run_gang_bench(*, quick: bool = False, seed: int = 7,
                   progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """The same seeded workload with 1-GPU leases placed best-fit and spread, each without
    and with the hold guard; figures and a table."""
    base = QUICK if quick else FULL
    spec = GangBenchSpec(nodes=base.nodes, hours=base.hours, warmup_hours=base.warmup_hours,
                         offered_load=base.offered_load, seed=seed)
    results = []
    for packing in ("best-fit", "spread"):
        for guard in (False, True):
            if progress:
                progress(f"gang bench: {spec.nodes} nodes × {GPUS_PER_NODE} GPUs, racks of "
                         f"{RACK_SIZE}, {spec.hours:g} h simulated, 1-GPU leases {packing}, "
                         f"guard {'on' if guard else 'off'}")
            results.append(_run(spec, guard=guard, packing=packing))
    cols = ["packing", "guard", "placements_per_s", "gpu_utilisation", "starved", "still_waiting",
            *(f"gang{m}x8_wait_{q}_s" for m in GANG_SIZES for q in ("p50", "p99"))]
    lines = ["  ".join(f"{c:>18}" for c in cols)]
    for r in results:
        lines.append("  ".join(f"{r.get(c, '-')!s:>18}" for c in cols))
    return {"nodes": spec.nodes, "hours": spec.hours, "seed": seed,
            "results": results, "table": "\n".join(lines),
            "note": "placements/s is the placement policy alone (inner figure), on a virtual "
                    "clock; waits are simulated seconds"}
