"""Workloads for the policy simulator: a seeded synthetic month of cohorts and diurnal tenants,
or the requests and observed runtimes of leases folded from a real log.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from domain.lease import Lease
from domain.resources import NodeCapabilities, Resources, Shape

DAY = 86_400.0
HOUR = 3_600.0


@dataclass(frozen=True)
class SimRequest:
    """One request as the simulator replays it: what was asked, when, and how long it ran."""

    request_id: str
    tenant: str
    arrival: float  # seconds from the start of the workload
    shape: Shape
    runtime_seconds: float  # what it actually ran (never more than its maximum)
    maximum_runtime_seconds: int  # what it declared
    priority_class: str = "default"
    width: str = ""  # a label to report by (e.g. "1-gpu", "8-gpu", "wide-cpu")
    wide: bool = False  # takes most of a node: the requests backfill is for


@dataclass(frozen=True)
class SimNode:
    node_id: str
    capabilities: NodeCapabilities


@dataclass(frozen=True)
class Tenant:
    name: str
    cohort: str
    weight: float


@dataclass(frozen=True)
class Workload:
    """Nodes, tenants and requests (by arrival) of one simulation; `horizon` ends arrivals."""

    nodes: tuple[SimNode, ...]
    tenants: tuple[Tenant, ...]
    requests: tuple[SimRequest, ...]
    horizon: float
    description: str = ""

    def cohort_of(self, tenant: str) -> str:
        for t in self.tenants:
            if t.name == tenant:
                return t.cohort
        return ""


@dataclass(frozen=True)
class RequestKind:
    """A kind of request in the synthetic mix: its shape, share of arrivals and runtimes."""

    width: str
    shape: Shape
    share: float  # fraction of a tenant's arrivals
    median_runtime_seconds: float
    sigma: float = 1.2  # log-normal spread: a heavy tail of long runs


GPU_1 = Shape.build(cpu_millis=8_000, memory_mib=64 * 1024, gpu_count=1)
GPU_8 = Shape.build(cpu_millis=64_000, memory_mib=512 * 1024, gpu_count=8)
WIDE_CPU = Shape.build(cpu_millis=64_000, memory_mib=128 * 1024)

WIDE_KINDS = frozenset({"8-gpu", "wide-cpu"})
DEFAULT_MIX: tuple[RequestKind, ...] = (
    RequestKind("1-gpu", GPU_1, 0.70, 1.0 * HOUR),
    RequestKind("8-gpu", GPU_8, 0.10, 4.0 * HOUR),
    RequestKind("wide-cpu", WIDE_CPU, 0.20, 2.0 * HOUR),
)


def gpu_node(i: int) -> SimNode:
    return SimNode(f"gpu-{i:03d}", NodeCapabilities(
        allocatable=Resources(96_000, 1024 * 1024, 8, 0), gpu_model="h100",
        gpu_memory_gib=80))


def cpu_node(i: int) -> SimNode:
    return SimNode(f"cpu-{i:03d}", NodeCapabilities(allocatable=Resources(64_000, 256 * 1024)))


@dataclass(frozen=True)
class SyntheticSpec:
    """The knobs of a synthetic workload; every draw comes from `seed`."""

    days: float = 30.0
    gpu_nodes: int = 24
    cpu_nodes: int = 16
    cohorts: tuple[tuple[str, float], ...] = (("research", 2.0), ("product", 1.0),
                                              ("batch", 1.0))  # name, weight of each tenant
    tenants_per_cohort: int = 4
    mix: tuple[RequestKind, ...] = DEFAULT_MIX
    offered_load: float = 0.9  # mean GPU demand over GPU capacity
    diurnal_amplitude: float = 0.6  # peak rate = mean × (1 + amplitude)
    maximum_runtime_seconds: int = 3 * 86_400
    seed: int = 1
    tenant_skew: Sequence[float] = field(default=(1.6, 1.2, 0.8, 0.4))  # within a cohort


def _runtime(rng: random.Random, kind: RequestKind, cap: int) -> tuple[float, int]:
    """(actual, declared) runtime: log-normal actual, declared 1.5-4× it rounded up to the
    hour (people overestimate), both within the pool's maximum."""
    actual = min(rng.lognormvariate(math.log(kind.median_runtime_seconds), kind.sigma),
                 float(cap))
    actual = max(actual, 60.0)
    declared = math.ceil(actual * rng.uniform(1.5, 4.0) / HOUR) * int(HOUR)
    declared = min(max(declared, int(HOUR)), cap)
    return min(actual, float(declared)), declared


def _mean_gpu_seconds(mix: Sequence[RequestKind]) -> float:
    total = sum(k.share for k in mix)
    return sum(k.share / total * k.shape.resources.gpu_count * k.median_runtime_seconds
               * math.exp(k.sigma ** 2 / 2) for k in mix)


def synthetic(spec: SyntheticSpec = SyntheticSpec()) -> Workload:
    """Cohorts of tenants with diurnal, time-zone-shifted arrivals (a non-homogeneous Poisson
    process by thinning), each drawing from the mix with heavy-tailed runtimes."""
    rng = random.Random(spec.seed)
    nodes = tuple(gpu_node(i) for i in range(spec.gpu_nodes)) + tuple(
        cpu_node(i) for i in range(spec.cpu_nodes))
    tenants: list[Tenant] = []
    skews: list[float] = []
    phases: list[float] = []
    for c, (cohort, weight) in enumerate(spec.cohorts):
        for j in range(spec.tenants_per_cohort):
            tenants.append(Tenant(f"{cohort}-{j + 1}", cohort, weight))
            skews.append(spec.tenant_skew[j % len(spec.tenant_skew)])
            # cohorts sit in different time zones; tenants within one spread a little
            phases.append((c * 8.0 + j * 0.75) * HOUR)
    gpus = spec.gpu_nodes * 8
    mean_rate = spec.offered_load * gpus / _mean_gpu_seconds(spec.mix)  # requests a second
    total_skew = sum(skews)
    horizon = spec.days * DAY
    shares = [k.share for k in spec.mix]
    requests: list[SimRequest] = []
    for t, tenant in enumerate(tenants):
        rate = mean_rate * skews[t] / total_skew
        peak = rate * (1 + spec.diurnal_amplitude)
        at = 0.0
        n = 0
        while True:
            at += rng.expovariate(peak)
            if at >= horizon:
                break
            level = 1 + spec.diurnal_amplitude * math.sin(2 * math.pi * (at - phases[t]) / DAY)
            if rng.random() * (1 + spec.diurnal_amplitude) > level:
                continue  # thinned: outside this tenant's busy hours
            kind = rng.choices(spec.mix, weights=shares)[0]
            actual, declared = _runtime(rng, kind, spec.maximum_runtime_seconds)
            n += 1
            requests.append(SimRequest(f"{tenant.name}-{n}", tenant.name, at, kind.shape, actual,
                                       declared, width=kind.width,
                                       wide=kind.width in WIDE_KINDS))
    requests.sort(key=lambda r: (r.arrival, r.request_id))
    return Workload(nodes, tuple(tenants), tuple(requests), horizon,
                    description=(f"synthetic seed={spec.seed}: {spec.days:g} days, "
                                 f"{len(tenants)} tenants in {len(spec.cohorts)} cohorts, "
                                 f"{spec.gpu_nodes} GPU + {spec.cpu_nodes} CPU nodes, "
                                 f"offered GPU load {spec.offered_load:g}"))


def width_of(shape: Shape) -> str:
    """A request's width label when the log does not give one."""
    res = shape.resources
    if res.gpu_count:
        return f"{res.gpu_count}-gpu"
    return f"{res.cpu_millis // 1000}-cpu"


def is_wide(shape: Shape, nodes: Sequence[SimNode]) -> bool:
    """Whether a request takes most (three quarters or more) of the largest node's GPUs, or of
    its cores when it asks for no GPU."""
    res = shape.resources
    if res.gpu_count:
        most = max((n.capabilities.allocatable.gpu_count for n in nodes), default=0)
        return most > 0 and res.gpu_count * 4 >= most * 3
    most = max((n.capabilities.allocatable.cpu_millis for n in nodes), default=0)
    return most > 0 and res.cpu_millis * 4 >= most * 3


def from_leases(leases: Iterable[Lease], nodes: Sequence[SimNode],
                weights: dict[str, float] | None = None, *, cohorts: dict[str, str] | None = None
                ) -> Workload:
    """The requests of leases folded from a log, with the runtimes they were observed to run
    (start to end); leases that never ran replay with their maximum runtime, as a bound.
    Arrival times are made relative to the first request."""
    picked = [lease for lease in leases if lease.requested_at is not None]
    if not picked:
        return Workload(tuple(nodes), (), (), 0.0, description="no requests in the log")
    t0 = min(lease.requested_at for lease in picked)
    requests: list[SimRequest] = []
    for lease in picked:
        started, ended = lease.started_at, lease.ended_at
        ran = (ended - started if started is not None and ended is not None
               else float(lease.maximum_runtime_seconds))
        ran = min(max(ran, 1.0), float(lease.maximum_runtime_seconds))
        requests.append(SimRequest(
            str(lease.id), str(lease.tenant_id), lease.requested_at - t0, lease.requested_shape,
            ran, lease.maximum_runtime_seconds, lease.priority_class,
            width_of(lease.requested_shape), is_wide(lease.requested_shape, nodes)))
    requests.sort(key=lambda r: (r.arrival, r.request_id))
    names = sorted({r.tenant for r in requests})
    tenants = tuple(Tenant(n, (cohorts or {}).get(n, ""), (weights or {}).get(n, 1.0))
                    for n in names)
    horizon = requests[-1].arrival if requests else 0.0
    return Workload(tuple(nodes), tenants, tuple(requests), horizon,
                    description=f"{len(requests)} requests replayed from a log")
