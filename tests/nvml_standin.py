"""A STAND-IN for nvidia-ml-py (`pynvml`), for machines without an NVIDIA GPU.

It is not NVML: it answers the few NVML calls the agent's probe makes, from a fixed table of
two GPUs (one whole, one in MIG mode with three MIG devices), with NVML's return shapes. The
probe runs against the real `pynvml` whenever a GPU is present; this only exercises the code
paths on a machine that has none.
"""

from __future__ import annotations

from dataclasses import dataclass


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


GIB = 1 << 30
DEVICES = (
    _Device("NVIDIA L4", "GPU-standin-0000", 24 * GIB),
    _Device("NVIDIA A100-SXM4-80GB", "GPU-standin-0001", 80 * GIB, mig=True, children=(
        _Device("NVIDIA A100-SXM4-80GB MIG 3g.40gb", "MIG-standin-a", 40 * GIB),
        _Device("NVIDIA A100-SXM4-80GB MIG 1g.10gb", "MIG-standin-b", 10 * GIB),
        _Device("NVIDIA A100-SXM4-80GB MIG 1g.10gb", "MIG-standin-c", 10 * GIB),
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
