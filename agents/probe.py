"""What this node really has: CPUs, memory, disk, GPUs (NVML), minus a system reserve.

GPUs come from nvidia-ml-py (`pynvml`): count, model, memory, UUID, MIG mode and MIG devices —
each MIG profile is published as its own partition shape (`gpu_partitions["1g.10gb"] = n`),
and the GPUs carved into MIG devices are not offered whole. With no NVIDIA library on the
machine the node reports zero GPUs and says why once; nothing fails.
"""

from __future__ import annotations

import contextlib
import logging
import os
import platform
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

log = logging.getLogger(__name__)

_ARCH = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64"}
_MIG_PROFILE = re.compile(r"(\d+g\.\d+gb)")


@dataclass(frozen=True)
class Gpu:
    index: int
    uuid: str
    model: str
    memory_mib: int
    mig_enabled: bool = False
    mig_profiles: tuple[tuple[str, str], ...] = ()  # (profile, MIG device uuid)


@dataclass(frozen=True)
class GpuProbe:
    gpus: tuple[Gpu, ...] = ()
    driver: str | None = None
    note: str | None = None  # why there are none, said once

    def whole(self) -> tuple[Gpu, ...]:
        """GPUs offered whole: the ones not partitioned into MIG devices."""
        return tuple(g for g in self.gpus if not g.mig_enabled)

    def partitions(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for g in self.gpus:
            for profile, _ in g.mig_profiles:
                out[profile] = out.get(profile, 0) + 1
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"driver": self.driver, "note": self.note,
                "gpus": [{"index": g.index, "uuid": g.uuid, "model": g.model,
                          "memory_mib": g.memory_mib, "mig_enabled": g.mig_enabled,
                          "mig_devices": [{"profile": p, "uuid": u} for p, u in g.mig_profiles]}
                         for g in self.gpus]}


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def probe_gpus(nvml: ModuleType | Any | None = None) -> GpuProbe:
    """Ask NVML; `nvml` defaults to the real `pynvml` (tests pass a named stand-in)."""
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
        gpus = []
        for i in range(int(nvml.nvmlDeviceGetCount())):
            h = nvml.nvmlDeviceGetHandleByIndex(i)
            mem = nvml.nvmlDeviceGetMemoryInfo(h)
            mig_enabled = False
            profiles: list[tuple[str, str]] = []
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
            gpus.append(Gpu(index=i, uuid=_text(nvml.nvmlDeviceGetUUID(h)),
                            model=_text(nvml.nvmlDeviceGetName(h)),
                            memory_mib=int(mem.total) // (1 << 20), mig_enabled=mig_enabled,
                            mig_profiles=tuple(profiles)))
        return GpuProbe(gpus=tuple(gpus), driver=driver)
    finally:
        with contextlib.suppress(Exception):  # best effort: the probe's answer stands
            nvml.nvmlShutdown()


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
                     network_egress: str = "none") -> dict[str, Any]:
        """The node's NodeCapabilitiesSpec as a dict: allocatable = total − reserve."""
        whole = self.gpus.whole()
        allocatable: dict[str, Any] = {
            "cpu_millis": max(0, self.cpu_millis - reserve.cpu_millis),
            "memory_mib": max(0, self.memory_mib - reserve.memory_mib),
            "local_disk_gib": max(0, self.local_disk_gib - reserve.local_disk_gib),
            "gpu_count": len(whole),
        }
        parts = self.gpus.partitions()
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
        if self.gpus.gpus:
            caps["gpu_model"] = self.gpus.gpus[0].model
            caps["gpu_memory_gib"] = min(g.memory_mib for g in self.gpus.gpus) // 1024
        return caps


def _memory_mib() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) // 1024
    except OSError:
        pass
    return 0


def probe_node(disk_path: Path | str = "/", nvml: Any = None) -> NodeProbe:
    """Probe this machine for real (`nvml` only to pass a stand-in in tests)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    disk = shutil.disk_usage(str(disk_path))
    return NodeProbe(
        cpu_millis=int(cpus or 1) * 1000,
        cpu_arch=_ARCH.get(platform.machine().lower(), platform.machine().lower()),
        memory_mib=_memory_mib(),
        local_disk_gib=disk.total // (1 << 30),
        gpus=probe_gpus(nvml),
    )
