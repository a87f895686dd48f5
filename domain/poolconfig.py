"""A pool's scheduling and lifecycle settings (`PoolConfig`, `PreemptionSettings`): the values a
`PoolConfigured` event carries, their defaults, bounds and plain-dict form."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from typing import Any

from domain.volumes import Volume, volumes_from_dict

PACKING_POLICIES: tuple[str, ...] = ("best-fit", "spread")


@dataclass(frozen=True)
class PreemptionSettings:
    enabled: bool = False
    min_runtime_seconds: int = 0  # a victim must have run this long in its placement
    grace_seconds: int = 30  # time a victim gets to checkpoint and stop

    def to_dict(self) -> dict[str, Any]:
        return {
            "enabled": self.enabled,
            "min_runtime_seconds": self.min_runtime_seconds,
            "grace_seconds": self.grace_seconds,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PreemptionSettings:
        return cls(
            enabled=bool(d.get("enabled", False)),
            min_runtime_seconds=int(d.get("min_runtime_seconds", 0)),
            grace_seconds=int(d.get("grace_seconds", 30)),
        )


@dataclass(frozen=True)
class PoolConfig:
    """A pool's scheduling and lifecycle settings. Higher priority rank = more important."""

    packing: str = "best-fit"
    commit_timeout_seconds: int = 30
    heartbeat_timeout_seconds: int = 30
    # capped at each lease's maximum runtime: by default a commit grants the whole of it
    default_lease_seconds: int = 30 * 24 * 3600
    maximum_runtime_seconds: int = 86_400  # the longest runtime a request may ask for
    priority_classes: tuple[tuple[str, int], ...] = (("default", 0),)  # sorted (name, rank)
    default_priority_class: str = "default"
    preemption: PreemptionSettings = field(default_factory=PreemptionSettings)
    aging_seconds_per_rank: int = 0  # waiting this long raises effective rank by 1; 0: none
    node_timeout_seconds: int = 30  # a node silent this long is lost: no new placements
    # a lost node's leases are released without the agent's word only after this long
    lost_node_release_seconds: int = 300
    # leases of these priority classes are never preemption victims
    non_preemptible_classes: tuple[str, ...] = ()
    # fair share counts usage decayed with this half-life besides current usage; 0: current only
    fair_share_half_life_seconds: int = 0
    # the user's files: the largest packed work directory a job may bring, how long a job's
    # artifacts are kept, and how many bytes of them one job may store
    max_workdir_bytes: int = 1 << 30
    artifact_ttl_seconds: int = 7 * 86_400
    max_artifact_bytes: int = 1 << 30
    # a renewal is recorded only when it moves the deadline at least this far (the log grows
    # with real changes only; domain.lease.Lease.renew)
    renew_step_seconds: int = 60
    # the most leases one tenant may have waiting in the pool's queue (the scheduler's memory)
    max_queued_leases: int = 10_000
    # how long a lease may wait queued before it ends `queue_timeout` (a request may ask less)
    queue_timeout_seconds: int = 7 * 86_400
    # a tenant's lease requests in the pool: this many a second, after a burst of this many
    # (a token bucket per command-service process)
    requests_per_second: int = 200
    request_burst: int = 1000
    # a tenant that let this many reservations time out uncommitted within the window has its
    # new requests refused until the oldest leaves it (0: no limit; docs/adr/020-…)
    max_voided_reservations: int = 20
    voided_reservation_window_seconds: int = 3600
    # a job's output its node stores and ships to the tenant, per job; the rest is dropped
    max_output_bytes: int = 64 << 20
    # the most attempts a request's retry policy may ask for (domain.retry)
    max_attempts: int = 10
    # host paths offered to jobs by name (domain.volumes), by name
    volumes: tuple[Volume, ...] = ()
    # IPv4 networks its jobs with egress may reach past the denied ranges, normalised
    egress_allow: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        classes = tuple(sorted((str(k), int(v)) for k, v in dict(self.priority_classes).items()))
        object.__setattr__(self, "priority_classes", classes)
        object.__setattr__(self, "non_preemptible_classes",
                           tuple(sorted({str(c) for c in self.non_preemptible_classes})))

    def class_preemptible(self, priority_class: str) -> bool:
        return priority_class not in self.non_preemptible_classes

    def problems(self) -> list[str]:
        """Every inconsistency, as reason strings; empty when the config is valid."""
        found = []
        if self.packing not in PACKING_POLICIES:
            found.append(f"packing must be one of {', '.join(PACKING_POLICIES)}")
        for name in ("commit_timeout_seconds", "heartbeat_timeout_seconds",
                     "default_lease_seconds", "maximum_runtime_seconds",
                     "node_timeout_seconds", "lost_node_release_seconds"):
            if getattr(self, name) <= 0:
                found.append(f"{name} must be positive")
        if self.aging_seconds_per_rank < 0:
            found.append("aging_seconds_per_rank must not be negative")
        if not self.priority_classes:
            found.append("at least one priority class is required")
        if self.default_priority_class not in dict(self.priority_classes):
            found.append(f"default priority class {self.default_priority_class!r} is not defined")
        if self.preemption.min_runtime_seconds < 0 or self.preemption.grace_seconds < 0:
            found.append("preemption times must not be negative")
        for name in self.non_preemptible_classes:
            if name not in dict(self.priority_classes):
                found.append(f"non-preemptible class {name!r} is not defined")
        if self.fair_share_half_life_seconds < 0:
            found.append("fair_share_half_life_seconds must not be negative")
        for name in ("max_workdir_bytes", "max_artifact_bytes", "max_output_bytes"):
            if getattr(self, name) < 0:
                found.append(f"{name} must not be negative")
        if self.artifact_ttl_seconds <= 0:
            found.append("artifact_ttl_seconds must be positive")
        if self.renew_step_seconds < 0:
            found.append("renew_step_seconds must not be negative")
        if self.max_queued_leases <= 0:
            found.append("max_queued_leases must be positive")
        if self.queue_timeout_seconds <= 0:
            found.append("queue_timeout_seconds must be positive")
        for name in ("requests_per_second", "request_burst"):
            if getattr(self, name) <= 0:
                found.append(f"{name} must be positive")
        if self.max_voided_reservations < 0:
            found.append("max_voided_reservations must not be negative")
        if self.voided_reservation_window_seconds <= 0:
            found.append("voided_reservation_window_seconds must be positive")
        if self.max_attempts <= 0:
            found.append("max_attempts must be positive")
        for volume in self.volumes:
            found += volume.problems()
        found += egress_allow_problems(self.egress_allow)
        return found

    def to_dict(self) -> dict[str, Any]:
        return {
            "packing": self.packing,
            "commit_timeout_seconds": self.commit_timeout_seconds,
            "heartbeat_timeout_seconds": self.heartbeat_timeout_seconds,
            "default_lease_seconds": self.default_lease_seconds,
            "maximum_runtime_seconds": self.maximum_runtime_seconds,
            "priority_classes": {k: v for k, v in self.priority_classes},
            "default_priority_class": self.default_priority_class,
            "preemption": self.preemption.to_dict(),
            "aging_seconds_per_rank": self.aging_seconds_per_rank,
            "node_timeout_seconds": self.node_timeout_seconds,
            "lost_node_release_seconds": self.lost_node_release_seconds,
            "non_preemptible_classes": list(self.non_preemptible_classes),
            "fair_share_half_life_seconds": self.fair_share_half_life_seconds,
            "max_workdir_bytes": self.max_workdir_bytes,
            "artifact_ttl_seconds": self.artifact_ttl_seconds,
            "max_artifact_bytes": self.max_artifact_bytes,
            "renew_step_seconds": self.renew_step_seconds,
            "max_queued_leases": self.max_queued_leases,
            "queue_timeout_seconds": self.queue_timeout_seconds,
            "requests_per_second": self.requests_per_second,
            "request_burst": self.request_burst,
            "max_voided_reservations": self.max_voided_reservations,
            "voided_reservation_window_seconds": self.voided_reservation_window_seconds,
            "max_output_bytes": self.max_output_bytes,
            "max_attempts": self.max_attempts,
            # only when offered, so a pool without volumes records the same event as before
            **({"volumes": {v.name: v.to_dict() for v in self.volumes}} if self.volumes else {}),
            **({"egress_allow": list(self.egress_allow)} if self.egress_allow else {}),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PoolConfig:
        default = cls()
        return cls(
            packing=str(d.get("packing", default.packing)),
            commit_timeout_seconds=int(d.get("commit_timeout_seconds", 30)),
            heartbeat_timeout_seconds=int(d.get("heartbeat_timeout_seconds", 30)),
            default_lease_seconds=int(d.get("default_lease_seconds", 300)),
            maximum_runtime_seconds=int(d.get("maximum_runtime_seconds", 86_400)),
            priority_classes=tuple(dict(d.get("priority_classes", {"default": 0})).items()),
            default_priority_class=str(d.get("default_priority_class", "default")),
            preemption=PreemptionSettings.from_dict(dict(d.get("preemption", {}))),
            aging_seconds_per_rank=int(d.get("aging_seconds_per_rank", 0)),
            node_timeout_seconds=int(d.get("node_timeout_seconds", 30)),
            lost_node_release_seconds=int(d.get("lost_node_release_seconds", 300)),
            non_preemptible_classes=tuple(d.get("non_preemptible_classes", ())),
            fair_share_half_life_seconds=int(d.get("fair_share_half_life_seconds", 0)),
            max_workdir_bytes=int(d.get("max_workdir_bytes", default.max_workdir_bytes)),
            artifact_ttl_seconds=int(d.get("artifact_ttl_seconds",
                                           default.artifact_ttl_seconds)),
            max_artifact_bytes=int(d.get("max_artifact_bytes", default.max_artifact_bytes)),
            renew_step_seconds=int(d.get("renew_step_seconds", default.renew_step_seconds)),
            max_queued_leases=int(d.get("max_queued_leases", default.max_queued_leases)),
            queue_timeout_seconds=int(d.get("queue_timeout_seconds",
                                            default.queue_timeout_seconds)),
            requests_per_second=int(d.get("requests_per_second", default.requests_per_second)),
            request_burst=int(d.get("request_burst", default.request_burst)),
            max_voided_reservations=int(d.get("max_voided_reservations",
                                              default.max_voided_reservations)),
            voided_reservation_window_seconds=int(d.get(
                "voided_reservation_window_seconds", default.voided_reservation_window_seconds)),
            max_output_bytes=int(d.get("max_output_bytes", default.max_output_bytes)),
            max_attempts=int(d.get("max_attempts", default.max_attempts)),
            volumes=volumes_from_dict(d.get("volumes")),
            egress_allow=tuple(str(c) for c in d.get("egress_allow") or ()),
        )


def egress_allow_problems(cidrs: tuple[str, ...]) -> list[str]:
    """Why an egress allow-list cannot be a pool's: each entry must be an IPv4 network, as
    the sandboxes' filters are IPv4's (a host address is a /32)."""
    found: list[str] = []
    for text in cidrs:
        try:
            net = ipaddress.ip_network(text, strict=False)
        except ValueError as e:
            found.append(f"egress_allow: {text[:64]!r} is not a network ({e})")
            continue
        if net.version != 4:
            found.append(f"egress_allow: {text[:64]!r} is not IPv4 (only IPv4 can be allowed)")
    return found


def normal_egress_allow(cidrs: list[str] | tuple[str, ...]) -> tuple[str, ...]:
    """An allow-list as a pool keeps it: each valid entry as its network, in order, once."""
    out: list[str] = []
    for text in cidrs:
        try:
            net = str(ipaddress.ip_network(text, strict=False))
        except ValueError:
            net = text  # kept as given, so problems() names it
        if net not in out:
            out.append(net)
    return tuple(out)
