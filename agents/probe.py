"""What this node really has: CPUs, memory, disk, GPUs (NVML), minus a system reserve.
How GPUs, MIG devices and time-slices are offered: docs/gpus.md.
"""

from __future__ import annotations

import contextlib
import logging
import os
import platform
import re
import shutil
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import ModuleType
from typing import Any

log = logging.getLogger(__name__)

_ARCH = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64"}
_MIG_PROFILE = re.compile(r"(\d+g\.\d+gb)")
NVLINK_MAX_LINKS = 18  # NVML_NVLINK_MAX_LINKS
# where the driver says which /dev/nvidia-caps/nvidia-cap<N> opens each MIG instance
CAPABILITIES = Path("/proc/driver/nvidia/capabilities")
_CAP_MINOR = re.compile(r"^DeviceFileMinor:\s*(\d+)\s*$", re.MULTILINE)


@dataclass(frozen=True)
class Gpu:
    index: int
    uuid: str
    model: str
    memory_mib: int
    mig_enabled: bool = False
    mig_profiles: tuple[tuple[str, str], ...] = ()  # (profile, MIG device uuid)
    minor: int | None = None  # /dev/nvidia<minor>
    pci_bus_id: str | None = None
    nvlink_domain: str | None = None  # GPUs joined by NVLink (directly or through NVSwitch)
    # (MIG device uuid, the minors of its GPU and compute instances' capability files)
    mig_caps: tuple[tuple[str, tuple[int, ...]], ...] = ()


@dataclass(frozen=True)
class GpuProbe:
    gpus: tuple[Gpu, ...] = ()
    driver: str | None = None
    note: str | None = None  # why there are none, said once
    # the multi-node NVLink domain (NVML fabric cluster and clique) every GPU here is in, if any
    fabric_domain: str | None = None

    def capability_minors(self, uuid: str) -> tuple[int, ...]:
        """The /dev/nvidia-caps/nvidia-cap<N> a MIG instance's workload needs (and no other
        instance's); () when the driver did not say."""
        for g in self.gpus:
            for mig, minors in g.mig_caps:
                if mig == uuid:
                    return minors
        return ()

    def whole(self) -> tuple[Gpu, ...]:
        """GPUs offered whole: the ones not partitioned into MIG devices."""
        return tuple(g for g in self.gpus if not g.mig_enabled)

    def partitions(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for g in self.gpus:
            for profile, _ in g.mig_profiles:
                out[profile] = out.get(profile, 0) + 1
        return out

    def devices(self, time_slice_replicas: int = 0) -> list[dict[str, Any]]:
        """Every allocatable device as a GpuDeviceSpec dict: whole GPUs (or, with
        `time_slice_replicas` > 0, that many replicas of each), and MIG instances."""
        out: list[dict[str, Any]] = []
        for g in self.gpus:
            common: dict[str, Any] = {"model": g.model}
            if g.minor is not None:
                common["minor"] = g.minor
            if g.mig_enabled:
                for profile, uuid in g.mig_profiles:
                    out.append({"id": uuid, "kind": "mig", "profile": profile,
                                "parent": g.uuid, **common})
                continue
            extra: dict[str, Any] = {"memory_mib": g.memory_mib}
            if g.nvlink_domain is not None:
                extra["nvlink_domain"] = g.nvlink_domain
            if g.pci_bus_id is not None:
                extra["pci_bus_id"] = g.pci_bus_id
            if time_slice_replicas > 0:
                out += [{"id": f"{g.uuid}/ts{k}", "kind": "replica", "profile": "time-slice",
                         "parent": g.uuid, **common, **extra}
                        for k in range(time_slice_replicas)]
            else:
                out.append({"id": g.uuid, "kind": "gpu", **common, **extra})
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"driver": self.driver, "note": self.note,
                "gpus": [{"index": g.index, "uuid": g.uuid, "model": g.model,
                          "memory_mib": g.memory_mib, "mig_enabled": g.mig_enabled,
                          "minor": g.minor, "pci_bus_id": g.pci_bus_id,
                          "nvlink_domain": g.nvlink_domain,
                          "mig_devices": [{"profile": p, "uuid": u} for p, u in g.mig_profiles]}
                         for g in self.gpus]}


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def probe_gpus(nvml: ModuleType | Any | None = None,
               capabilities: Path = CAPABILITIES) -> GpuProbe:
    """Ask NVML; `nvml` defaults to the real `pynvml` (tests pass a named stand-in, and a
    stand-in of the driver's `capabilities` folder)."""
    if nvml is None:
        try:
            import pynvml  # type: ignore[import-untyped]
        except ImportError:
            return GpuProbe(note="nvidia-ml-py is not installed: no GPUs offered")
        nvml = pynvml
    try:
        nvml.nvmlInit()
    except Exception as e:  # noqa: BLE001 - NVMLError_LibraryNotFound and friends
        return GpuProbe(note=f"no NVIDIA driver library here ({_text(e) or type(e).__name__}): "
                             "no GPUs offered")
    try:
        driver = _text(nvml.nvmlSystemGetDriverVersion())
        gpus: list[Gpu] = []
        handles: list[Any] = []
        for i in range(int(nvml.nvmlDeviceGetCount())):
            h = nvml.nvmlDeviceGetHandleByIndex(i)
            mem = nvml.nvmlDeviceGetMemoryInfo(h)
            mig_enabled = False
            profiles: list[tuple[str, str]] = []
            mig_caps: list[tuple[str, tuple[int, ...]]] = []
            minor = _optional(nvml.nvmlDeviceGetMinorNumber, h)
            try:
                current, _pending = nvml.nvmlDeviceGetMigMode(h)
                mig_enabled = bool(current)
            except Exception:  # noqa: BLE001 - not a MIG-capable GPU
                mig_enabled = False
            if mig_enabled:
                for j in range(int(nvml.nvmlDeviceGetMaxMigDeviceCount(h))):
                    try:
                        mh = nvml.nvmlDeviceGetMigDeviceHandleByIndex(h, j)
                    except Exception:  # noqa: BLE001, S112 - an empty MIG slot
                        continue
                    m = _MIG_PROFILE.search(_text(nvml.nvmlDeviceGetName(mh)))
                    if m:
                        profiles.append((m.group(1), _text(nvml.nvmlDeviceGetUUID(mh))))
                        mig_caps.append((profiles[-1][1],
                                         _mig_capabilities(nvml, mh, minor, capabilities)))
            pci = _optional(nvml.nvmlDeviceGetPciInfo, h)
            bus = None if pci is None else _bus_id(pci)
            gpus.append(Gpu(index=i, uuid=_text(nvml.nvmlDeviceGetUUID(h)),
                            model=_text(nvml.nvmlDeviceGetName(h)),
                            memory_mib=int(mem.total) // (1 << 20), mig_enabled=mig_enabled,
                            mig_profiles=tuple(profiles), minor=None if minor is None else int(minor),
                            pci_bus_id=bus, mig_caps=tuple(mig_caps)))
            handles.append(h)
        fabric = {_fabric_domain(nvml, h) for h in handles}
        return GpuProbe(gpus=_with_nvlink_domains(nvml, gpus, handles), driver=driver,
                        fabric_domain=fabric.pop() if len(fabric) == 1 else None)
    finally:
        with contextlib.suppress(Exception):  # best effort: the probe's answer stands
            nvml.nvmlShutdown()


def _mig_capabilities(nvml: Any, handle: Any, gpu_minor: Any,
                      root: Path) -> tuple[int, ...]:
    """The minors of a MIG device's GPU instance and compute instance capability files, read
    where the driver publishes them; () when any is unknown (the device is then not bound)."""
    gi = _optional(nvml.nvmlDeviceGetGpuInstanceId, handle)
    ci = _optional(nvml.nvmlDeviceGetComputeInstanceId, handle)
    if gpu_minor is None or gi is None or ci is None:
        return ()
    where = root / f"gpu{int(gpu_minor)}" / "mig" / f"gi{int(gi)}"
    minors = []
    for access in (where / "access", where / f"ci{int(ci)}" / "access"):
        try:
            m = _CAP_MINOR.search(access.read_text())
        except OSError:
            return ()
        if m is None:
            return ()
        minors.append(int(m.group(1)))
    return tuple(minors)


def _optional(read: Any, *args: Any) -> Any:
    """An NVML reading a GPU may not support (NVMLError_NotSupported): None then."""
    try:
        return read(*args)
    except Exception:  # noqa: BLE001 - every NVMLError subclass means "not known here"
        return None


def _bus_id(info: Any) -> str:
    # NVML's busId is "00000000:3B:00.0"; normalised so peers' remote ids compare equal
    return _text(getattr(info, "busId", None) or getattr(info, "busIdLegacy", "")).upper()


FABRIC_STATE_COMPLETED = 3  # NVML_GPU_FABRIC_STATE_COMPLETED


def _fabric_domain(nvml: Any, handle: Any) -> str | None:
    """The GPU's multi-node NVLink domain (e.g. an NVL72 rack): its fabric cluster UUID and
    clique, once the fabric manager has registered it; None elsewhere."""
    info = _optional(getattr(nvml, "nvmlDeviceGetGpuFabricInfo", None) or (lambda h: None),
                     handle)
    if info is None or getattr(info, "state", None) != FABRIC_STATE_COMPLETED:
        return None
    cluster = bytes(getattr(info, "clusterUuid", b"") or b"")
    if not cluster.strip(b"\0"):
        return None
    return f"{cluster.hex()[:12]}-{int(getattr(info, 'cliqueId', 0))}"


def _with_nvlink_domains(nvml: Any, gpus: list[Gpu], handles: list[Any]) -> tuple[Gpu, ...]:
    """GPUs joined by active NVLink links — to each other, or to the same NVSwitch — form one
    domain (connected components over PCI bus ids), named after its lowest GPU index."""
    parent: dict[str, str] = {}

    def find(x: str) -> str:
        while parent.setdefault(x, x) != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    linked: set[str] = set()
    for g, h in zip(gpus, handles, strict=True):
        if g.pci_bus_id is None:
            continue
        for link in range(NVLINK_MAX_LINKS):
            if not _optional(nvml.nvmlDeviceGetNvLinkState, h, link):
                continue
            info = _optional(nvml.nvmlDeviceGetNvLinkRemotePciInfo_v2, h, link)
            remote = None if info is None else _bus_id(info)
            if remote:
                linked.add(g.pci_bus_id)
                parent[find(g.pci_bus_id)] = find(remote)
    names: dict[str, str] = {}
    out = []
    for g in gpus:
        domain = None
        if g.pci_bus_id in linked:
            root = find(g.pci_bus_id)
            domain = names.setdefault(root, f"nvlink-{g.index}")
        out.append(replace(g, nvlink_domain=domain))
    return tuple(out)


@dataclass(frozen=True)
class Reserve:
    """Capacity kept back for the system and the agent itself."""

    cpu_millis: int = 500
    memory_mib: int = 1024
    local_disk_gib: int = 5


@dataclass(frozen=True)
class NodeProbe:
    cpu_millis: int
    cpu_arch: str
    memory_mib: int
    local_disk_gib: int
    gpus: GpuProbe = field(default_factory=GpuProbe)

    def capabilities(self, *, reserve: Reserve, runtimes: tuple[str, ...],
                     labels: dict[str, str], trust_level: str = "trusted",
                     network_egress: str = "none", binds_gpus: bool = True,
                     time_slice_replicas: int = 0) -> dict[str, Any]:
        """The node's NodeCapabilitiesSpec as a dict: allocatable = total − reserve. A runtime
        that cannot bind a workload to its devices (`binds_gpus` False) offers no GPU shape;
        `time_slice_replicas` > 0 offers each whole GPU as that many time-slice replicas."""
        gpus = self.gpus if binds_gpus else GpuProbe()
        whole = gpus.whole()
        allocatable: dict[str, Any] = {
            "cpu_millis": max(0, self.cpu_millis - reserve.cpu_millis),
            "memory_mib": max(0, self.memory_mib - reserve.memory_mib),
            "local_disk_gib": max(0, self.local_disk_gib - reserve.local_disk_gib),
            "gpu_count": 0 if time_slice_replicas > 0 else len(whole),
        }
        parts = gpus.partitions()
        if time_slice_replicas > 0 and whole:
            parts["time-slice"] = time_slice_replicas * len(whole)
        if parts:
            allocatable["gpu_partitions"] = parts
        caps: dict[str, Any] = {
            "allocatable": allocatable,
            "cpu_arch": self.cpu_arch,
            "runtimes": list(runtimes) or ["sandboxed"],
            "region": labels.get("region", "default"),
            "zone": labels.get("zone", "default"),
            "failure_domain": labels.get("failure_domain", labels.get("zone", "default")),
            "trust_level": trust_level,
            "network_egress": network_egress,
            "labels": {k: v for k, v in labels.items()
                       if k not in ("region", "zone", "failure_domain")},
        }
        if gpus.fabric_domain and "nvlink_domain" not in labels:
            # read from the hardware; an operator's label wins
            caps["labels"]["nvlink_domain"] = gpus.fabric_domain
        if gpus.gpus:
            caps["gpu_model"] = gpus.gpus[0].model
            caps["gpu_memory_gib"] = min(g.memory_mib for g in gpus.gpus) // 1024
            caps["devices"] = gpus.devices(time_slice_replicas)
        return caps


def _memory_mib() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) // 1024
    except OSError:
        pass
    return 0


def probe_node(disk_path: Path | str = "/", nvml: Any = None,
               capabilities: Path | None = None) -> NodeProbe:
    """Probe this machine for real (`nvml` and `capabilities` only to pass stand-ins)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    disk = shutil.disk_usage(str(disk_path))
    return NodeProbe(
        cpu_millis=int(cpus or 1) * 1000,
        cpu_arch=_ARCH.get(platform.machine().lower(), platform.machine().lower()),
        memory_mib=_memory_mib(),
        local_disk_gib=disk.total // (1 << 30),
        gpus=probe_gpus(nvml, capabilities or CAPABILITIES),
    )
