"""A STAND-IN for nvidia-ml-py (`pynvml`), for machines without an NVIDIA GPU.

It is not NVML: it answers the few NVML calls the agent's probe makes, from a fixed table of
two GPUs (one whole, one in MIG mode with three MIG devices), with NVML's return shapes. The
probe runs against the real `pynvml` whenever a GPU is present; this only exercises the code
paths on a machine that has none. `Board` is the same stand-in for an NVLink board of several
GPUs (an HGX-like machine), with NVSwitch links.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass
class _Memory:
    total: int
    free: int
    used: int


@dataclass
class _Device:
    name: str
    uuid: str
    memory: int
    mig: bool = False
    children: tuple[_Device, ...] = ()
    minor: int = 0
    bus_id: str = ""
    links: tuple[str, ...] = ()  # remote PCI bus ids of its active NVLink links
    gi: int = 0  # a MIG device's GPU instance and compute instance ids
    ci: int = 0


@dataclass
class _PciInfo:
    busId: str  # NVML spells it so


GIB = 1 << 30
DEVICES = (
    _Device("NVIDIA L4", "GPU-standin-0000", 24 * GIB, minor=0, bus_id="00000000:17:00.0"),
    _Device("NVIDIA A100-SXM4-80GB", "GPU-standin-0001", 80 * GIB, minor=1,
            bus_id="00000000:65:00.0", mig=True, children=(
        _Device("NVIDIA A100-SXM4-80GB MIG 3g.40gb", "MIG-standin-a", 40 * GIB, gi=2),
        _Device("NVIDIA A100-SXM4-80GB MIG 1g.10gb", "MIG-standin-b", 10 * GIB, gi=9),
        _Device("NVIDIA A100-SXM4-80GB MIG 1g.10gb", "MIG-standin-c", 10 * GIB, gi=10),
    )),
)
initialised = 0


class NVMLError(Exception):
    pass


def nvmlInit() -> None:
    global initialised
    initialised += 1


def nvmlShutdown() -> None:
    global initialised
    initialised -= 1


def nvmlSystemGetDriverVersion() -> str:
    return "standin-1.0"


def nvmlDeviceGetCount() -> int:
    return len(DEVICES)


def nvmlDeviceGetHandleByIndex(i: int) -> _Device:
    return DEVICES[i]


def nvmlDeviceGetName(h: _Device) -> str:
    return h.name


def nvmlDeviceGetUUID(h: _Device) -> str:
    return h.uuid


def nvmlDeviceGetMemoryInfo(h: _Device) -> _Memory:
    return _Memory(total=h.memory, free=h.memory, used=0)


def nvmlDeviceGetMigMode(h: _Device) -> tuple[int, int]:
    if h.name == "NVIDIA L4":
        raise NVMLError("Not Supported")
    return (1, 1) if h.mig else (0, 0)


def nvmlDeviceGetMaxMigDeviceCount(h: _Device) -> int:
    return 7


def nvmlDeviceGetMigDeviceHandleByIndex(h: _Device, j: int) -> _Device:
    if j >= len(h.children):
        raise NVMLError("Not Found")
    return h.children[j]


def nvmlDeviceGetGpuInstanceId(h: _Device) -> int:
    return h.gi


def nvmlDeviceGetComputeInstanceId(h: _Device) -> int:
    return h.ci


def capability_minors() -> dict[str, tuple[int, int]]:
    """Each MIG device's /dev/nvidia-caps/nvidia-cap<N> minors, (GPU instance, compute
    instance), as this stand-in's driver numbers them."""
    out: dict[str, tuple[int, int]] = {}
    for d in DEVICES:
        for c in d.children:
            base = 3 + 2 * len(out)
            out[c.uuid] = (base, base + 1)
    return out


def write_capabilities(root: Path) -> None:
    """A STAND-IN of /proc/driver/nvidia/capabilities under `root`: each MIG device's GPU and
    compute instance `access` files, naming their minors as the driver's do."""
    minors = capability_minors()
    for d in DEVICES:
        for c in d.children:
            gi = root / f"gpu{d.minor}" / "mig" / f"gi{c.gi}"
            (gi / f"ci{c.ci}").mkdir(parents=True, exist_ok=True)
            for where, minor in zip((gi, gi / f"ci{c.ci}"), minors[c.uuid], strict=True):
                (where / "access").write_text(f"DeviceFileMinor: {minor}\n"
                                              "DeviceFileMode: 292\nDeviceFileModify: 1\n")


def nvmlDeviceGetMinorNumber(h: _Device) -> int:
    return h.minor


def nvmlDeviceGetPciInfo(h: _Device) -> _PciInfo:
    return _PciInfo(busId=h.bus_id)


def nvmlDeviceGetNvLinkState(h: _Device, link: int) -> int:
    if not h.links:
        raise NVMLError("Not Supported")
    return 1 if link < len(h.links) else 0


def nvmlDeviceGetNvLinkRemotePciInfo_v2(h: _Device, link: int) -> _PciInfo:
    if link >= len(h.links):
        raise NVMLError("Invalid Argument")
    return _PciInfo(busId=h.links[link])


class Board:
    """The stand-in for a machine of `n` GPUs of one model in NVLink groups of `per_switch`,
    each group on its own NVSwitch (two links per GPU), answering as the module does."""

    NVMLError = NVMLError

    def __init__(self, n: int = 8, *, per_switch: int = 8, model: str = "NVIDIA H100 80GB HBM3",
                 memory_gib: int = 80, fabric: tuple[bytes, int] | None = None) -> None:
        self.fabric = fabric  # (cluster UUID, clique) of a multi-node NVLink domain
        self.devices = tuple(
            _Device(model, f"GPU-board-{i:04d}", memory_gib * GIB, minor=i,
                    bus_id=f"00000000:{0x18 + i:02X}:00.0",
                    links=(f"00000000:F{i // per_switch}:00.0",) * 2)
            for i in range(n))
        self.initialised = 0

    def nvmlInit(self) -> None:
        self.initialised += 1

    def nvmlShutdown(self) -> None:
        self.initialised -= 1

    def nvmlSystemGetDriverVersion(self) -> str:
        return "standin-1.0"

    def nvmlDeviceGetCount(self) -> int:
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> _Device:
        return self.devices[i]

    nvmlDeviceGetName = staticmethod(nvmlDeviceGetName)
    nvmlDeviceGetUUID = staticmethod(nvmlDeviceGetUUID)
    nvmlDeviceGetMemoryInfo = staticmethod(nvmlDeviceGetMemoryInfo)
    nvmlDeviceGetMinorNumber = staticmethod(nvmlDeviceGetMinorNumber)
    nvmlDeviceGetPciInfo = staticmethod(nvmlDeviceGetPciInfo)
    nvmlDeviceGetNvLinkState = staticmethod(nvmlDeviceGetNvLinkState)
    nvmlDeviceGetNvLinkRemotePciInfo_v2 = staticmethod(nvmlDeviceGetNvLinkRemotePciInfo_v2)

    def nvmlDeviceGetMigMode(self, h: _Device) -> tuple[int, int]:
        return (0, 0)

    def nvmlDeviceGetGpuFabricInfo(self, h: _Device) -> _FabricInfo:
        if self.fabric is None:
            raise NVMLError("Not Supported")
        return _FabricInfo(clusterUuid=self.fabric[0], cliqueId=self.fabric[1], state=3)


@dataclass
class _FabricInfo:
    clusterUuid: bytes  # NVML spells it so
    cliqueId: int
    state: int
