"""Version 1's capacity parts: what a lease asks for (ResourceShape), amounts, reported usage,
and what a node offers (its GPU devices and capabilities).
"""

# msgspec gives each instance its own copy of a mutable default; ruff sees that only when
# msgspec.Struct is a base in the same file, not through the imported bases.
# ruff: noqa: RUF012

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from domain.devices import Device, inventory_problems
from domain.resources import NodeCapabilities, Resources, Shape, partition_dimension
from schemas.hostaccess import TrustLevel
from schemas.v1_vocabulary import (
    MAX_DEVICES,
    MAX_GPU_COUNT,
    MAX_PREFERENCES,
    BandwidthMbps,
    CpuArch,
    CpuMillis,
    DeviceId,
    GpuCount,
    GpuMemoryGib,
    GpuModel,
    GpuPartition,
    ImageRef,
    LabelKey,
    LabelValue,
    LocalDiskGib,
    MemoryMib,
    NameToken,
    NetworkEgress,
    PartBase,
    PartitionProfile,
    PreferenceKind,
    RuntimeClass,
    SchemaVersion,
)

# -- resource shape ----------------------------------------------------------------------------


class NetworkSpec(PartBase, frozen=True, kw_only=True):
    """Network a workload needs: the egress class it may use and a bandwidth floor."""

    egress: NetworkEgress = "none"
    bandwidth_mbps_min: BandwidthMbps = 0


class Preference(PartBase, frozen=True, kw_only=True):
    """A soft preference: it affects ranking among eligible nodes, never eligibility."""

    kind: PreferenceKind
    # node_label values are "key=value"; the others are a zone, region, image ref or model.
    value: Annotated[str, Meta(min_length=1, max_length=512)]


class ResourceShape(PartBase, frozen=True, kw_only=True):
    """What a lease asks for: amounts, exact pins (hard constraints) and ranked preferences."""

    schema_version: SchemaVersion = 1
    # Required, so nobody gets a hidden default amount of CPU or memory.
    cpu_millis: CpuMillis
    memory_mib: MemoryMib
    gpu_count: Annotated[
        int,
        Meta(
            ge=0,
            le=MAX_GPU_COUNT,
            description="Whole GPUs, or the number of partitions when gpu_partition is set.",
        ),
    ] = 0
    gpu_memory_gib_min: GpuMemoryGib = 0
    gpu_model: GpuModel | None = None
    cpu_arch: CpuArch | None = None
    gpu_partition: GpuPartition = "none"
    local_disk_gib: LocalDiskGib = 0
    network: NetworkSpec = msgspec.field(default_factory=NetworkSpec)
    runtime: RuntimeClass = "container"
    region: NameToken | None = None
    zone: NameToken | None = None
    preferences: Annotated[list[Preference], Meta(max_length=MAX_PREFERENCES)] = []

    def __post_init__(self) -> None:
        # Cross-field rules msgspec cannot express; the ValueError becomes a ValidationError.
        if self.gpu_partition != "none" and self.gpu_count < 1:
            raise ValueError("gpu_partition requires gpu_count >= 1 (the number of partitions)")
        if self.gpu_count == 0 and (self.gpu_memory_gib_min or self.gpu_model is not None):
            raise ValueError("gpu_memory_gib_min and gpu_model require gpu_count >= 1")

    def to_domain(self) -> Shape:
        return Shape.build(
            cpu_millis=self.cpu_millis,
            memory_mib=self.memory_mib,
            gpu_count=self.gpu_count,
            local_disk_gib=self.local_disk_gib,
            gpu_partition=self.gpu_partition,
            gpu_memory_gib_min=self.gpu_memory_gib_min,
            gpu_model=self.gpu_model,
            cpu_arch=self.cpu_arch,
            network_egress=self.network.egress,
            bandwidth_mbps_min=self.network.bandwidth_mbps_min,
            runtime=self.runtime,
            region=self.region,
            zone=self.zone,
            preferences=[(p.kind, p.value) for p in self.preferences],
        )


class ResourceAmounts(PartBase, frozen=True, kw_only=True):
    """An amount of capacity: scalar dimensions plus GPU partitions counted per profile."""

    cpu_millis: CpuMillis = 0
    memory_mib: MemoryMib = 0
    gpu_count: GpuCount = 0
    local_disk_gib: LocalDiskGib = 0
    gpu_partitions: Annotated[
        dict[PartitionProfile, Annotated[int, Meta(ge=0, le=1024)]], Meta(max_length=32)
    ] = {}

    def to_domain(self) -> Resources:
        return Resources(
            cpu_millis=self.cpu_millis,
            memory_mib=self.memory_mib,
            gpu_count=self.gpu_count,
            local_disk_gib=self.local_disk_gib,
            extended=tuple((partition_dimension(p), n) for p, n in self.gpu_partitions.items()),
        )


# -- usage reported ----------------------------------------------------------------------------


class Utilization(PartBase, frozen=True, kw_only=True):
    """Point-in-time usage a heartbeat or telemetry sample reports; every field optional."""

    cpu_millis_used: CpuMillis | None = None
    memory_mib_used: MemoryMib | None = None
    gpu_util_percent: Annotated[float, Meta(ge=0, le=100)] | None = None
    gpu_memory_mib_used: MemoryMib | None = None



# -- what a node offers ------------------------------------------------------------------------


class GpuDeviceSpec(PartBase, frozen=True, kw_only=True):
    """One GPU device a node offers: a whole GPU, a MIG instance or a time-slice replica."""

    id: DeviceId
    kind: Literal["gpu", "mig", "replica"] = "gpu"
    model: GpuModel | None = None
    memory_mib: MemoryMib = 0
    profile: PartitionProfile | None = None  # MIG profile, or "time-slice" for a replica
    parent: DeviceId | None = None  # the GPU a MIG instance or replica is carved from
    minor: Annotated[int, Meta(ge=0, le=4095)] | None = None  # /dev/nvidia<minor>
    nvlink_domain: LabelValue | None = None
    pci_bus_id: Annotated[str, Meta(pattern=r"^[0-9A-Fa-f:.]{1,32}(?!\n)$")] | None = None

    def __post_init__(self) -> None:
        if self.kind != "gpu" and (self.profile is None or self.parent is None):
            raise ValueError(f"a {self.kind} device needs its profile and parent GPU")
        if self.kind == "replica" and self.profile != "time-slice":
            raise ValueError("a replica's profile is time-slice")
        if self.kind == "mig" and self.profile == "time-slice":
            raise ValueError("a MIG device's profile is a MIG profile")

    def to_domain(self) -> Device:
        return Device(id=self.id, kind=self.kind, model=self.model, memory_mib=self.memory_mib,
                      profile=self.profile, parent=self.parent, minor=self.minor,
                      nvlink_domain=self.nvlink_domain, pci_bus_id=self.pci_bus_id)


class NodeCapabilitiesSpec(PartBase, frozen=True, kw_only=True):
    """What a node offers: allocatable capacity (after system reserve) and its traits."""

    allocatable: ResourceAmounts
    cpu_arch: CpuArch = "amd64"
    gpu_model: GpuModel | None = None
    gpu_memory_gib: GpuMemoryGib = 0
    network_egress: NetworkEgress = "none"
    bandwidth_mbps: BandwidthMbps = 0
    runtimes: Annotated[list[RuntimeClass], Meta(min_length=1, max_length=4)] = msgspec.field(
        default_factory=lambda: ["container"]
    )
    region: NameToken = "default"
    zone: NameToken = "default"
    failure_domain: NameToken = "default"
    trust_level: TrustLevel = "trusted"
    labels: Annotated[dict[LabelKey, LabelValue], Meta(max_length=64)] = {}
    image_cache: Annotated[list[ImageRef], Meta(max_length=1024)] = []
    # the concrete devices behind gpu_count and gpu_partitions: when listed, one per GPU and
    # partition offered, and every GPU lease on the node is bound to its own
    devices: Annotated[list[GpuDeviceSpec], Meta(max_length=MAX_DEVICES)] = []

    def __post_init__(self) -> None:
        if self.devices:
            problems = inventory_problems([d.to_domain() for d in self.devices],
                                          self.allocatable.to_domain())
            if problems:
                raise ValueError("devices disagree with allocatable: " + "; ".join(problems))

    def to_domain(self) -> NodeCapabilities:
        return NodeCapabilities(
            allocatable=self.allocatable.to_domain(),
            cpu_arch=self.cpu_arch,
            gpu_model=self.gpu_model,
            gpu_memory_gib=self.gpu_memory_gib,
            network_egress=self.network_egress,
            bandwidth_mbps=self.bandwidth_mbps,
            runtimes=tuple(dict.fromkeys(self.runtimes)),
            region=self.region,
            zone=self.zone,
            failure_domain=self.failure_domain,
            trust_level=self.trust_level,
            labels=tuple(sorted(self.labels.items())),
            image_cache=tuple(self.image_cache),
            devices=tuple(d.to_domain() for d in self.devices),
        )


