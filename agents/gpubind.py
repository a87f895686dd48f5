"""Which devices a start order may have: each checked to be this node's own, resolved to what
a runtime binds (UUIDs, /dev minors, MIG capability files). Why: docs/gpus.md."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from agents.probe import GpuProbe
from agents.runtimes.contract import WorkloadError


@dataclass(frozen=True)
class Binding:
    """What the runtime is given for a lease's devices, and nothing more."""

    uuids: tuple[str, ...] = ()
    minors: tuple[int, ...] = ()  # their GPUs' /dev/nvidia<minor> (a MIG's parent's)
    mig: bool = False
    caps: tuple[int, ...] = ()  # the MIG instances' /dev/nvidia-caps/nvidia-cap<N>


def bind(own: dict[str, dict[str, Any]], devices: list[str], gpus: GpuProbe) -> Binding:
    """The UUIDs, minors and capability files of an order's `devices`, each checked against
    `own` (this node's devices by id: an order is as hostile as any message); raises
    WorkloadError device_unknown otherwise."""
    unknown = [d for d in devices if d not in own]
    if unknown:
        raise WorkloadError(f"devices not on this node: {', '.join(unknown)}",
                            code="device_unknown")
    uuids: list[str] = []
    minors: set[int] = set()
    caps: set[int] = set()
    mig = False
    for d in devices:
        dev = own[d]
        uuid = dev["parent"] if dev.get("kind") == "replica" else dev["id"]
        if uuid not in uuids:
            uuids.append(uuid)
        if dev.get("minor") is not None:
            minors.add(int(dev["minor"]))
        if dev.get("kind") == "mig":
            mig = True
            caps.update(gpus.capability_minors(uuid))
    return Binding(tuple(uuids), tuple(sorted(minors)), mig, tuple(sorted(caps)))
