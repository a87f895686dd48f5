"""A node's GPU devices (whole GPUs, MIG instances, time-slice replicas) and the best-fit choice
of which concrete devices a lease gets: the value objects and pure functions, no I/O.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping

from domain.resources import (
    DEVICE_KINDS,
    TIME_SLICE,
    Device,
    Resources,
    Shape,
    partition_dimension,
)

# the value object lives beside NodeCapabilities, which holds a node's devices
__all__ = [
    "DEVICE_KINDS",
    "TIME_SLICE",
    "Device",
    "allocation_problems",
    "choose_devices",
    "device_counts",
    "eligible",
    "inventory_problems",
    "wanted",
]


def device_counts(devices: Iterable[Device]) -> dict[str, int]:
    """How many devices count in each resource dimension."""
    out: dict[str, int] = {}
    for d in devices:
        out[d.dimension] = out.get(d.dimension, 0) + 1
    return out


def physical_gpus(devices: Iterable[Device]) -> int:
    """How many physical GPUs a device list stands for: MIG instances and time-slice replicas
    count as the GPU they are carved from, once."""
    return len({d.id if d.kind == "gpu" else (d.parent or d.id) for d in devices})


def inventory_problems(devices: Iterable[Device], allocatable: Resources) -> list[str]:
    """Why a device list cannot stand for `allocatable` (empty when it can): ids repeat, a kind
    is unknown, or the devices per dimension differ from the GPUs and partitions offered."""
    problems: list[str] = []
    seen: set[str] = set()
    listed = list(devices)
    for d in listed:
        if d.id in seen:
            problems.append(f"device {d.id} is listed twice")
        seen.add(d.id)
        if d.kind not in DEVICE_KINDS:
            problems.append(f"device {d.id} has unknown kind {d.kind!r}")
        elif d.kind == "mig" and d.profile is None:
            problems.append(f"MIG device {d.id} has no profile")
    counts = device_counts(listed)
    for dim in sorted(set(counts) | {"gpu_count"} | {k for k, _ in allocatable.extended}):
        gpu_dim = dim.startswith("gpu/") or dim == "gpu_count"
        if gpu_dim and counts.get(dim, 0) != allocatable.get(dim):
            problems.append(f"{dim}: {allocatable.get(dim)} offered but "
                            f"{counts.get(dim, 0)} devices listed")
    return problems


def wanted(shape: Shape) -> tuple[str, int]:
    """(dimension, how many devices) a shape needs; ("gpu_count", 0) for none."""
    res = shape.resources
    if shape.gpu_partition != "none":
        dim = partition_dimension(shape.gpu_partition)
        return dim, res.get(dim)
    return "gpu_count", res.gpu_count


def eligible(device: Device, shape: Shape, dimension: str) -> bool:
    """Per-device filters: the right kind, the model asked for, at least the memory asked for
    (`gpu_memory_gib_min` is per device)."""
    if device.dimension != dimension:
        return False
    if shape.gpu_model is not None and device.model is not None and device.model != shape.gpu_model:
        return False
    return device.memory_mib >= shape.gpu_memory_gib_min * 1024


def _group_key(d: Device) -> str:
    # whole GPUs group by NVLink domain; partitions by the GPU they are carved from; a device
    # with neither is a group of its own
    if d.kind == "gpu":
        return f"nvlink:{d.nvlink_domain}" if d.nvlink_domain else f"solo:{d.id}"
    return f"parent:{d.parent}" if d.parent else f"solo:{d.id}"


def _order(d: Device) -> tuple[int, str]:
    return (d.minor if d.minor is not None else 1 << 30, d.id)


def choose_devices(devices: Collection[Device], held: Collection[str],
                   shape: Shape) -> tuple[str, ...] | None:
    """The devices a lease of `shape` should get on a node with `devices`, of which `held` are
    taken; None when too few eligible devices are free. () when the shape asks for no GPU or
    the node lists no devices (a node registered before device inventories: counted only).

    Best fit: a group (NVLink domain for GPUs, parent GPU for partitions) that can hold the
    whole request is preferred, and of those the one with the fewest free devices, so larger
    free groups stay whole for larger requests; failing that, the largest groups are taken
    first so the request is split over as few groups as possible.
    """
    dimension, n = wanted(shape)
    if n <= 0 or not devices:
        return ()
    taken = held if isinstance(held, (set, frozenset, dict)) else set(held)
    groups: dict[str, list[Device]] = {}
    for d in devices:
        if d.id not in taken and eligible(d, shape, dimension):
            groups.setdefault(_group_key(d), []).append(d)
    if sum(len(g) for g in groups.values()) < n:
        return None
    for g in groups.values():
        g.sort(key=_order)
    fitting = [k for k, g in groups.items() if len(g) >= n]
    if fitting:
        best = min(fitting, key=lambda k: (len(groups[k]), _order(groups[k][0])))
        return tuple(d.id for d in groups[best][:n])
    chosen: list[str] = []
    for k in sorted(groups, key=lambda k: (-len(groups[k]), _order(groups[k][0]))):
        for d in groups[k]:
            chosen.append(d.id)
            if len(chosen) == n:
                return tuple(chosen)
    return None  # unreachable: the total was checked above


def allocation_problems(devices: Collection[Device], held: Mapping[str, str],
                        lease_id: str, chosen: Collection[str], resources: Resources) -> list[str]:
    """Why `chosen` cannot be given to `lease_id` (empty when it can): a device not on the
    node, held by another lease, named twice, or the count per dimension not what
    `resources` asks for. Nodes without an inventory take no devices."""
    if not devices:
        return [f"device {d} is not on this node" for d in chosen]
    by_id = {d.id: d for d in devices}
    problems: list[str] = []
    counts: dict[str, int] = {}
    seen: set[str] = set()
    for dev in chosen:
        if dev in seen:
            problems.append(f"device {dev} named twice")
        seen.add(dev)
        found = by_id.get(dev)
        if found is None:
            problems.append(f"device {dev} is not on this node")
            continue
        owner = held.get(dev)
        if owner is not None and owner != lease_id:
            problems.append(f"device {dev} is held by lease {owner}")
        counts[found.dimension] = counts.get(found.dimension, 0) + 1
    # a node with an inventory binds every GPU it gives: the count per dimension must match
    for dim in sorted(set(counts) | {d.dimension for d in devices}):
        if counts.get(dim, 0) != resources.get(dim):
            problems.append(f"{dim}: {resources.get(dim)} asked but "
                            f"{counts.get(dim, 0)} devices chosen")
    return problems
