"""The vocabulary of capacity: resource vectors, request shapes and node capabilities."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NewType

LeaseId = NewType("LeaseId", str)
NodeId = NewType("NodeId", str)
TenantId = NewType("TenantId", str)
PoolId = NewType("PoolId", str)

# Scalar dimensions every node and request has, in matrix column order.
SCALAR_DIMENSIONS: tuple[str, ...] = ("cpu_millis", "memory_mib", "gpu_count", "local_disk_gib")

# Isolation classes, weakest first: a node that provides a stronger class does not imply the
# weaker ones (each node lists exactly what it can run), but policies compare by this order.
RUNTIME_CLASSES: tuple[str, ...] = ("container", "sandboxed", "microvm", "dedicated-host")
NETWORK_CLASSES: tuple[str, ...] = ("none", "restricted", "open")  # egress, least first
CPU_ARCHS: tuple[str, ...] = ("amd64", "arm64")
TRUST_LEVELS: tuple[str, ...] = ("trusted", "marketplace")

# A GPU partition (a MIG profile such as "1g.10gb", or "time-slice") is a distinct shape: it is
# counted in its own extended dimension, never as a whole GPU.
def partition_dimension(profile: str) -> str:
    return f"gpu/{profile}"


@dataclass(frozen=True)
class Resources:
    """An amount of capacity: the scalar dimensions plus named extended ones (GPU partitions)."""

    cpu_millis: int = 0
    memory_mib: int = 0
    gpu_count: int = 0
    local_disk_gib: int = 0
    extended: tuple[tuple[str, int], ...] = ()  # sorted (name, amount), amounts > 0

    def __post_init__(self) -> None:
        if not self.extended:  # the common case (no GPU partitions): nothing to normalise
            if self.extended != ():
                object.__setattr__(self, "extended", ())
            return
        ext = tuple(sorted((k, int(v)) for k, v in dict(self.extended).items() if v))
        object.__setattr__(self, "extended", ext)

    def get(self, dimension: str) -> int:
        if dimension in SCALAR_DIMENSIONS:
            return int(getattr(self, dimension))
        return dict(self.extended).get(dimension, 0)

    def dimensions(self) -> tuple[str, ...]:
        return SCALAR_DIMENSIONS + tuple(k for k, _ in self.extended)

    def _combine(self, other: Resources, sign: int) -> Resources:
        if not self.extended and not other.extended:
            return Resources(
                cpu_millis=self.cpu_millis + sign * other.cpu_millis,
                memory_mib=self.memory_mib + sign * other.memory_mib,
                gpu_count=self.gpu_count + sign * other.gpu_count,
                local_disk_gib=self.local_disk_gib + sign * other.local_disk_gib,
            )
        ext = dict(self.extended)
        for k, v in other.extended:
            ext[k] = ext.get(k, 0) + sign * v
        return Resources(
            cpu_millis=self.cpu_millis + sign * other.cpu_millis,
            memory_mib=self.memory_mib + sign * other.memory_mib,
            gpu_count=self.gpu_count + sign * other.gpu_count,
            local_disk_gib=self.local_disk_gib + sign * other.local_disk_gib,
            extended=tuple(ext.items()),
        )

    def __add__(self, other: Resources) -> Resources:
        return self._combine(other, 1)

    def __sub__(self, other: Resources) -> Resources:
        return self._combine(other, -1)

    def fits_in(self, other: Resources) -> bool:
        """True when every dimension of self is ≤ the same dimension of `other`."""
        dims = set(self.dimensions()) | set(other.dimensions())
        return all(self.get(d) <= other.get(d) for d in dims)

    def is_non_negative(self) -> bool:
        if not self.extended:
            return (self.cpu_millis >= 0 and self.memory_mib >= 0 and self.gpu_count >= 0
                    and self.local_disk_gib >= 0)
        return all(self.get(d) >= 0 for d in self.dimensions())

    def exceeded_dimensions(self, limit: Resources) -> list[str]:
        if not self.extended and not limit.extended:
            # the scalar dimensions only, in the same (sorted) order as the general case
            return [d for d, mine, lim in (
                ("cpu_millis", self.cpu_millis, limit.cpu_millis),
                ("gpu_count", self.gpu_count, limit.gpu_count),
                ("local_disk_gib", self.local_disk_gib, limit.local_disk_gib),
                ("memory_mib", self.memory_mib, limit.memory_mib),
            ) if mine > lim]
        dims = sorted(set(self.dimensions()) | set(limit.dimensions()))
        return [d for d in dims if self.get(d) > limit.get(d)]

    def to_dict(self) -> dict[str, Any]:
        return {
            "cpu_millis": self.cpu_millis,
            "memory_mib": self.memory_mib,
            "gpu_count": self.gpu_count,
            "local_disk_gib": self.local_disk_gib,
            "extended": {k: v for k, v in self.extended},
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Resources:
        return cls(
            cpu_millis=int(d.get("cpu_millis", 0)),
            memory_mib=int(d.get("memory_mib", 0)),
            gpu_count=int(d.get("gpu_count", 0)),
            local_disk_gib=int(d.get("local_disk_gib", 0)),
            extended=tuple(dict(ext).items()) if (ext := d.get("extended")) else (),
        )


ZERO = Resources()


@dataclass(frozen=True)
class Shape:
    """What a request asks for: an amount of resources plus hard constraints and soft preferences.

    A GPU partition request (`gpu_partition` other than "none") is carried in `resources` as the
    extended dimension `gpu/<profile>` with `gpu_count` 0: see `Shape.build`.
    """

    resources: Resources
    gpu_memory_gib_min: int = 0
    gpu_model: str | None = None
    cpu_arch: str | None = None
    gpu_partition: str = "none"
    network_egress: str = "none"
    bandwidth_mbps_min: int = 0
    runtime: str = "container"
    region: str | None = None
    zone: str | None = None
    # ranked soft preferences, most important first: ("zone", "z1"), ("image_cached", "<ref>")
    preferences: tuple[tuple[str, str], ...] = ()

    @classmethod
    def build(
        cls,
        *,
        cpu_millis: int = 0,
        memory_mib: int = 0,
        gpu_count: int = 0,
        local_disk_gib: int = 0,
        gpu_partition: str = "none",
        **constraints: Any,
    ) -> Shape:
        if gpu_partition != "none":
            res = Resources(
                cpu_millis=cpu_millis,
                memory_mib=memory_mib,
                local_disk_gib=local_disk_gib,
                extended=((partition_dimension(gpu_partition), max(gpu_count, 1)),),
            )
        else:
            res = Resources(cpu_millis, memory_mib, gpu_count, local_disk_gib)
        prefs = constraints.pop("preferences", ())
        return cls(
            resources=res,
            gpu_partition=gpu_partition,
            preferences=tuple(tuple(p) for p in prefs),
            **constraints,
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "resources": self.resources.to_dict(),
            "gpu_memory_gib_min": self.gpu_memory_gib_min,
            "gpu_model": self.gpu_model,
            "cpu_arch": self.cpu_arch,
            "gpu_partition": self.gpu_partition,
            "network_egress": self.network_egress,
            "bandwidth_mbps_min": self.bandwidth_mbps_min,
            "runtime": self.runtime,
            "region": self.region,
            "zone": self.zone,
            "preferences": [list(p) for p in self.preferences],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Shape:
        # Every lease's request is parsed again by each fold of the log (scheduler, views,
        # audit), and most requests share a few shapes: those without extended dimensions or
        # preferences are remembered by their plain field values (equal values build equal
        # shapes, so the cache returns what building would)
        r = d["resources"]
        key = None
        if not r.get("extended") and not d.get("preferences"):
            key = (r.get("cpu_millis", 0), r.get("memory_mib", 0), r.get("gpu_count", 0),
                   r.get("local_disk_gib", 0), d.get("gpu_memory_gib_min", 0), d.get("gpu_model"),
                   d.get("cpu_arch"), d.get("gpu_partition", "none"),
                   d.get("network_egress", "none"), d.get("bandwidth_mbps_min", 0),
                   d.get("runtime", "container"), d.get("region"), d.get("zone"))
            try:
                got = _SHAPES.get(key)
            except TypeError:  # an unhashable value: build it, and let building judge it
                key = got = None
            if got is not None:
                return got
        shape = cls._from_dict(d)
        if key is not None:
            if len(_SHAPES) >= _SHAPES_LIMIT:
                _SHAPES.clear()
            _SHAPES[key] = shape
        return shape

    @classmethod
    def _from_dict(cls, d: dict[str, Any]) -> Shape:
        return cls(
            resources=Resources.from_dict(d["resources"]),
            gpu_memory_gib_min=int(d.get("gpu_memory_gib_min", 0)),
            gpu_model=d.get("gpu_model"),
            cpu_arch=d.get("cpu_arch"),
            gpu_partition=d.get("gpu_partition", "none"),
            network_egress=d.get("network_egress", "none"),
            bandwidth_mbps_min=int(d.get("bandwidth_mbps_min", 0)),
            runtime=d.get("runtime", "container"),
            region=d.get("region"),
            zone=d.get("zone"),
            preferences=tuple((str(k), str(v)) for k, v in d.get("preferences", [])),
        )


_SHAPES: dict[tuple[Any, ...], Shape] = {}  # see Shape.from_dict
_SHAPES_LIMIT = 4096


DEVICE_KINDS: tuple[str, ...] = ("gpu", "mig", "replica")
TIME_SLICE = "time-slice"


@dataclass(frozen=True)
class Device:
    """One allocatable GPU device of a node.

    `id` is unique on the node and what leases hold: a GPU or MIG UUID, or `<gpu uuid>/ts<k>`
    for the k-th time-slice replica of a GPU. `parent` is the GPU a MIG instance or replica is
    carved from; `minor` is the GPU's /dev/nvidia<minor> (the parent's for MIG and replicas).
    """

    id: str
    kind: str = "gpu"
    model: str | None = None
    memory_mib: int = 0
    profile: str | None = None  # a MIG profile ("1g.10gb") or "time-slice"
    parent: str | None = None
    minor: int | None = None
    nvlink_domain: str | None = None  # GPUs that share it talk over NVLink
    pci_bus_id: str | None = None

    @property
    def dimension(self) -> str:
        """The resource dimension one of these counts in: whole GPUs or its partition."""
        if self.kind == "gpu":
            return "gpu_count"
        return partition_dimension(self.profile or TIME_SLICE)

    @property
    def uuid(self) -> str:
        """The NVIDIA UUID a runtime passes on (a replica shares its GPU's)."""
        if self.kind == "replica" and self.parent is not None:
            return self.parent
        return self.id

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "kind": self.kind}
        for name in ("model", "profile", "parent", "minor", "nvlink_domain", "pci_bus_id"):
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        if self.memory_mib:
            out["memory_mib"] = self.memory_mib
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Device:
        minor = d.get("minor")
        return cls(
            id=str(d["id"]), kind=str(d.get("kind", "gpu")), model=d.get("model"),
            memory_mib=int(d.get("memory_mib", 0)), profile=d.get("profile"),
            parent=d.get("parent"), minor=None if minor is None else int(minor),
            nvlink_domain=d.get("nvlink_domain"), pci_bus_id=d.get("pci_bus_id"),
        )


@dataclass(frozen=True)
class NodeCapabilities:
    """What a node offers: allocatable capacity (totals minus system reserve) and its traits."""

    allocatable: Resources
    cpu_arch: str = "amd64"
    gpu_model: str | None = None
    gpu_memory_gib: int = 0  # per GPU (per partition for a partitioned node)
    network_egress: str = "none"  # the most open egress class the node can enforce
    bandwidth_mbps: int = 0
    runtimes: tuple[str, ...] = ("container",)
    region: str = "default"
    zone: str = "default"
    failure_domain: str = "default"
    trust_level: str = "trusted"
    labels: tuple[tuple[str, str], ...] = ()
    image_cache: tuple[str, ...] = field(default=())
    # the concrete GPU devices (domain.devices.Device), empty for a node registered before
    # device inventories or without GPUs; recorded only when present, so older logs read alike
    devices: tuple[Device, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "allocatable": self.allocatable.to_dict(),
            "cpu_arch": self.cpu_arch,
            "gpu_model": self.gpu_model,
            "gpu_memory_gib": self.gpu_memory_gib,
            "network_egress": self.network_egress,
            "bandwidth_mbps": self.bandwidth_mbps,
            "runtimes": list(self.runtimes),
            "region": self.region,
            "zone": self.zone,
            "failure_domain": self.failure_domain,
            "trust_level": self.trust_level,
            "labels": {k: v for k, v in self.labels},
            "image_cache": list(self.image_cache),
            **({"devices": [dev.to_dict() for dev in self.devices]} if self.devices else {}),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> NodeCapabilities:
        return cls(
            allocatable=Resources.from_dict(d["allocatable"]),
            cpu_arch=d.get("cpu_arch", "amd64"),
            gpu_model=d.get("gpu_model"),
            gpu_memory_gib=int(d.get("gpu_memory_gib", 0)),
            network_egress=d.get("network_egress", "none"),
            bandwidth_mbps=int(d.get("bandwidth_mbps", 0)),
            runtimes=tuple(d.get("runtimes", ("container",))),
            region=d.get("region", "default"),
            zone=d.get("zone", "default"),
            failure_domain=d.get("failure_domain", "default"),
            trust_level=d.get("trust_level", "trusted"),
            labels=tuple(sorted(dict(d.get("labels", {})).items())),
            image_cache=tuple(d.get("image_cache", ())),
            devices=tuple(Device.from_dict(x) for x in d.get("devices", ())),
        )
