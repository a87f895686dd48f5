"""A node's capacity ledger: what it can offer, what is allocated to which lease, its state.
States and verbs: docs/architecture.md#the-node-lifecycle.
"""

from __future__ import annotations

import functools
import uuid
from collections.abc import Collection, Sequence
from enum import StrEnum
from typing import Any
from uuid import UUID

from eventsourcing.domain import Aggregate, event

from domain.devices import allocation_problems, choose_devices
from domain.errors import (
    AlreadyAllocated,
    DeviceUnavailable,
    IllegalTransition,
    InvalidAmount,
    NodeNotEmpty,
    NodeNotSchedulable,
    OverAllocation,
    UnknownAllocation,
)
from domain.fold import trigger
from domain.resources import ZERO, LeaseId, NodeCapabilities, NodeId, PoolId, Resources, Shape
from domain.snapshots import StateSnapshot

_NAMESPACE = uuid.uuid5(uuid.NAMESPACE_URL, "urn:computepool:node")


class NodeState(StrEnum):
    READY = "ready"
    CORDONED = "cordoned"
    DRAINING = "draining"
    MAINTENANCE = "maintenance"
    LOST = "lost"


N = NodeState


class Node(Aggregate):
    """Capacity bookkeeping for one node; see the module docstring for the state machine."""

    Snapshot = StateSnapshot
    SNAPSHOT_SCHEMA = 1

    @staticmethod
    @functools.lru_cache(maxsize=1 << 16)  # every heartbeat and placement asks (a uuid5 each)
    def create_id(node_id: str) -> UUID:
        """The aggregate id for an agent's node id: re-registration finds the same ledger."""
        return uuid.uuid5(_NAMESPACE, str(node_id))

    @classmethod
    def register(
        cls, *, node_id: NodeId, pool_id: PoolId, capabilities: NodeCapabilities, now: float
    ) -> Node:
        """First registration. `capabilities.allocatable` is what leases may use (totals minus
        the system reserve), never the raw hardware totals."""
        _require_non_negative(capabilities.allocatable, "allocatable")
        return cls(
            node_id=str(node_id),
            pool_id=str(pool_id),
            capabilities=capabilities.to_dict(),
            registered_at=float(now),
        )

    @event("NodeRegistered")
    def __init__(
        self, node_id: str, pool_id: str, capabilities: dict[str, Any], registered_at: float
    ) -> None:
        self.node_id = NodeId(node_id)
        self.pool_id = PoolId(pool_id)
        self.capabilities = NodeCapabilities.from_dict(capabilities)
        self.registered_at = registered_at
        self.last_heartbeat_at = registered_at
        self.state = NodeState.READY
        self.state_reason: str | None = None
        self.lost_at: float | None = None
        self._allocations: dict[LeaseId, Resources] = {}
        self._allocated = ZERO  # kept in step with _allocations so reads are O(1)
        # device id → the lease holding it, and each lease's devices (empty for count-only)
        self._device_holder: dict[str, LeaseId] = {}
        self._devices_of: dict[LeaseId, tuple[str, ...]] = {}

    def snapshot_state(self) -> dict[str, Any]:
        """The node as plain values (domain.snapshots): its capabilities and devices as
        registered, each live allocation with its devices."""
        return {"node_id": str(self.node_id), "pool_id": str(self.pool_id),
                "capabilities": self.capabilities.to_dict(),
                "registered_at": self.registered_at, "last_heartbeat_at": self.last_heartbeat_at,
                "state": self.state.value, "state_reason": self.state_reason,
                "lost_at": self.lost_at,
                "_allocations": {k: v.to_dict() for k, v in self._allocations.items()},
                "_allocated": self._allocated.to_dict(),
                "_device_holder": dict(self._device_holder),
                "_devices_of": {k: list(v) for k, v in self._devices_of.items()}}

    @staticmethod
    def restore_state(state: dict[str, Any]) -> dict[str, Any]:
        return {"node_id": NodeId(state["node_id"]), "pool_id": PoolId(state["pool_id"]),
                "capabilities": NodeCapabilities.from_dict(state["capabilities"]),
                "registered_at": state["registered_at"],
                "last_heartbeat_at": state["last_heartbeat_at"],
                "state": NodeState(state["state"]), "state_reason": state["state_reason"],
                "lost_at": state["lost_at"],
                "_allocations": {LeaseId(k): Resources.from_dict(v)
                                 for k, v in state["_allocations"].items()},
                "_allocated": Resources.from_dict(state["_allocated"]),
                "_device_holder": {k: LeaseId(v) for k, v in state["_device_holder"].items()},
                "_devices_of": {LeaseId(k): tuple(v) for k, v in state["_devices_of"].items()}}

    # Queries ----------------------------------------------------------------------------------

    @property
    def allocatable(self) -> Resources:
        return self.capabilities.allocatable

    @property
    def allocated(self) -> Resources:
        """The sum of all allocations on this node."""
        return self._allocated

    @property
    def free_capacity(self) -> Resources:
        """Allocatable minus allocated, floored at zero per dimension (a shrunken node that is
        overcommitted offers nothing in that dimension, rather than a negative amount)."""
        free = self.allocatable - self._allocated
        return Resources.from_dict(
            {
                "cpu_millis": max(0, free.cpu_millis),
                "memory_mib": max(0, free.memory_mib),
                "gpu_count": max(0, free.gpu_count),
                "local_disk_gib": max(0, free.local_disk_gib),
                "extended": {k: max(0, v) for k, v in free.extended},
            }
        )

    @property
    def overcommitted_dimensions(self) -> list[str]:
        """Dimensions where allocations exceed allocatable: only after a re-registration
        reported less capacity than was already in use."""
        return self._allocated.exceeded_dimensions(self.allocatable)

    @property
    def allocations(self) -> dict[LeaseId, Resources]:
        return dict(self._allocations)

    @property
    def is_schedulable(self) -> bool:
        return self.state is N.READY

    def allocation_of(self, lease_id: LeaseId) -> Resources:
        try:
            return self._allocations[lease_id]
        except KeyError:
            raise UnknownAllocation(f"no allocation for lease {lease_id}") from None

    def devices_of(self, lease_id: LeaseId) -> tuple[str, ...]:
        """The device ids a lease holds here (() when it holds none or was counted only)."""
        return self._devices_of.get(lease_id, ())

    @property
    def held_devices(self) -> dict[str, LeaseId]:
        """Device id → the lease holding it."""
        return dict(self._device_holder)

    def choose_devices(self, shape: Shape, also_held: Collection[str] = ()
                       ) -> tuple[str, ...] | None:
        """The best-fit devices for a lease of `shape` (domain.devices.choose_devices) among
        those no lease holds nor `also_held` names (placements not yet recorded)."""
        held: Collection[str] = self._device_holder
        if also_held:
            held = set(self._device_holder) | set(also_held)
        return choose_devices(self.capabilities.devices, held, shape)

    def holds_device(self, device_id: str) -> bool:
        return device_id in self._device_holder

    def has_allocation(self, lease_id: LeaseId) -> bool:
        return lease_id in self._allocations

    def can_fit(self, resources: Resources) -> bool:
        return self.is_schedulable and resources.fits_in(self.free_capacity)

    def heartbeat_stale(self, now: float, timeout_seconds: float) -> bool:
        return now - self.last_heartbeat_at >= timeout_seconds

    # Capacity ---------------------------------------------------------------------------------

    def allocate(self, lease_id: LeaseId, resources: Resources, now: float,
                 devices: tuple[str, ...] = ()) -> None:
        """Allocate capacity to a lease, with the concrete `devices` it gets when the node lists
        an inventory. Refused on a node that is not ready, for a lease that already has an
        allocation here, when any dimension would exceed allocatable, and when a device is not
        this node's, is held by another lease, or the devices do not match the GPUs asked."""
        _require_non_negative(resources, "resources")
        if self.state is not N.READY:
            raise NodeNotSchedulable(self.state)
        if lease_id in self._allocations:
            raise AlreadyAllocated(f"lease {lease_id} already holds capacity on {self.node_id}")
        short = (self._allocated + resources).exceeded_dimensions(self.allocatable)
        if short:
            raise OverAllocation(short)
        self._check_devices(lease_id, resources, devices, self._device_holder)
        if devices:
            self._capacity_allocated(lease_id=str(lease_id), resources=resources.to_dict(),
                                     at=float(now), devices=list(devices))
        else:  # recorded as before device inventories, so count-only events stay as they were
            self._capacity_allocated(lease_id=str(lease_id), resources=resources.to_dict(),
                                     at=float(now))

    def allocate_many(self, allocations: Sequence[tuple[LeaseId, Resources]
                                                  | tuple[LeaseId, Resources, tuple[str, ...]]],
                      now: float) -> None:
        """Allocate capacity to several leases as ONE event (`CapacityAllocatedBatch`), checked
        as `allocate` checks each in turn: all or nothing. A scheduler that places many leases
        on one node in a cycle records one event for them, not one per lease. Each item is
        (lease, resources) or (lease, resources, devices)."""
        if not allocations:
            return
        items = [(a[0], a[1], tuple(a[2]) if len(a) == 3 else ()) for a in allocations]
        if len(items) == 1:
            self.allocate(items[0][0], items[0][1], now, items[0][2])
            return
        if self.state is not N.READY:
            raise NodeNotSchedulable(self.state)
        total = self._allocated
        seen: set[LeaseId] = set()
        holders = dict(self._device_holder)
        for lease_id, resources, devices in items:
            _require_non_negative(resources, "resources")
            if lease_id in self._allocations or lease_id in seen:
                raise AlreadyAllocated(
                    f"lease {lease_id} already holds capacity on {self.node_id}")
            seen.add(lease_id)
            total = total + resources
            self._check_devices(lease_id, resources, devices, holders)
            for d in devices:
                holders[d] = lease_id
        short = total.exceeded_dimensions(self.allocatable)
        if short:
            raise OverAllocation(short)
        trigger(self, "_capacity_allocated_batch",
                allocations=[[str(lid), res.to_dict(), *([list(devs)] if devs else [])]
                             for lid, res, devs in items], at=float(now))

    def _check_devices(self, lease_id: LeaseId, resources: Resources, devices: tuple[str, ...],
                       holders: dict[str, LeaseId]) -> None:
        inventory = self.capabilities.devices
        if not inventory and not devices:
            return  # a count-only node: nothing to bind
        problems = allocation_problems(inventory, holders, str(lease_id), devices, resources)
        if problems:
            raise DeviceUnavailable(f"devices for lease {lease_id} on {self.node_id}: "
                                    + "; ".join(problems), reasons=tuple(problems))

    def free(self, lease_id: LeaseId, now: float) -> bool:
        """Return a lease's allocation. Freeing a lease with no allocation here is a no-op
        (returns False, records nothing): release paths retry, and a second free must not fail
        the batch it is in. Works in every state, including lost."""
        if lease_id not in self._allocations:
            return False
        self._capacity_freed(lease_id=str(lease_id), at=float(now))
        return True

    # Lifecycle --------------------------------------------------------------------------------

    def reregister(self, capabilities: NodeCapabilities, now: float) -> None:
        """The agent (re)started and reported its capabilities. Allocations are kept — their
        workloads may still be running — even if the node now offers less; a lost node comes
        back ready, an operator's cordon, drain or maintenance stays."""
        _require_non_negative(capabilities.allocatable, "allocatable")
        self._reregistered(capabilities=capabilities.to_dict(), at=float(now))

    def heartbeat_is_news(self, now: float, timeout_seconds: float) -> bool:
        """Whether the agent's heartbeat at `now` is worth an event: a quarter of the node
        timeout has passed since the last one recorded (liveness needs no more)."""
        return now - self.last_heartbeat_at >= timeout_seconds / 4

    def heartbeat(self, now: float) -> None:
        """The agent is alive. A lost node must re-register instead (its view may be stale)."""
        self._require("heartbeat", {N.READY, N.CORDONED, N.DRAINING, N.MAINTENANCE})
        self._heartbeat_recorded(at=float(now))

    def cordon(self, now: float, reason: str = "") -> None:
        """Stop new allocations; running leases are untouched."""
        self._require("cordon", {N.READY})
        self._cordoned(at=float(now), reason=reason)

    def drain(self, now: float, reason: str = "") -> None:
        """Stop new allocations and ask for the node's leases to be wound down."""
        self._require("drain", {N.READY, N.CORDONED})
        self._drain_started(at=float(now), reason=reason)

    def uncordon(self, now: float) -> None:
        self._require("uncordon", {N.CORDONED, N.DRAINING})
        self._uncordoned(at=float(now))

    def enter_maintenance(self, now: float, reason: str = "") -> None:
        """Take an empty node out of service."""
        self._require("enter_maintenance", {N.READY, N.CORDONED, N.DRAINING})
        if self._allocations:
            raise NodeNotEmpty(
                f"{len(self._allocations)} lease(s) still hold capacity on {self.node_id}",
                reasons=tuple(sorted(self._allocations)),
            )
        self._maintenance_started(at=float(now), reason=reason)

    def end_maintenance(self, now: float) -> None:
        self._require("end_maintenance", {N.MAINTENANCE})
        self._maintenance_ended(at=float(now))

    def mark_lost(self, now: float, reason: str = "heartbeat_lost") -> None:
        """The node stopped answering. Allocations stay until each lease is reconciled."""
        self._require("mark_lost", {N.READY, N.CORDONED, N.DRAINING, N.MAINTENANCE})
        self._lost(at=float(now), reason=reason)

    def _require(self, verb: str, allowed: set[NodeState]) -> None:
        if self.state not in allowed:
            raise IllegalTransition(self.state, verb)

    # Events -----------------------------------------------------------------------------------

    @event("CapacityAllocated")
    def _capacity_allocated(self, lease_id: str, resources: dict[str, Any], at: float,
                            devices: list[str] | None = None) -> None:
        # `devices`: absent in events recorded before device inventories, and for count-only
        amount = Resources.from_dict(resources)
        lid = LeaseId(lease_id)
        self._allocations[lid] = amount
        self._allocated = self._allocated + amount
        if devices:
            self._bind(lid, devices)

    @event("CapacityAllocatedBatch")
    def _capacity_allocated_batch(self, allocations: list[list[Any]], at: float) -> None:
        total = self._allocated
        for item in allocations:  # [lease, resources] or [lease, resources, devices]
            lid = LeaseId(item[0])
            amount = Resources.from_dict(item[1])
            self._allocations[lid] = amount
            total = total + amount
            if len(item) > 2 and item[2]:
                self._bind(lid, item[2])
        self._allocated = total

    @event("CapacityFreed")
    def _capacity_freed(self, lease_id: str, at: float) -> None:
        lid = LeaseId(lease_id)
        amount = self._allocations.pop(lid)
        self._allocated = self._allocated - amount
        for d in self._devices_of.pop(lid, ()):
            if self._device_holder.get(d) == lid:
                del self._device_holder[d]

    def _bind(self, lease_id: LeaseId, devices: list[str]) -> None:
        held = tuple(str(d) for d in devices)
        self._devices_of[lease_id] = held
        for d in held:
            self._device_holder[d] = lease_id

    @event("NodeReregistered")
    def _reregistered(self, capabilities: dict[str, Any], at: float) -> None:
        self.capabilities = NodeCapabilities.from_dict(capabilities)
        self.last_heartbeat_at = at
        if self.state is N.LOST:
            self.state = N.READY
            self.state_reason = None
            self.lost_at = None

    @event("NodeHeartbeatRecorded")
    def _heartbeat_recorded(self, at: float) -> None:
        self.last_heartbeat_at = at

    @event("NodeCordoned")
    def _cordoned(self, at: float, reason: str) -> None:
        self.state, self.state_reason = N.CORDONED, reason

    @event("DrainStarted")
    def _drain_started(self, at: float, reason: str) -> None:
        self.state, self.state_reason = N.DRAINING, reason

    @event("NodeUncordoned")
    def _uncordoned(self, at: float) -> None:
        self.state, self.state_reason = N.READY, None

    @event("MaintenanceStarted")
    def _maintenance_started(self, at: float, reason: str) -> None:
        self.state, self.state_reason = N.MAINTENANCE, reason

    @event("MaintenanceEnded")
    def _maintenance_ended(self, at: float) -> None:
        self.state, self.state_reason = N.READY, None

    @event("NodeLost")
    def _lost(self, at: float, reason: str) -> None:
        self.state, self.state_reason = N.LOST, reason
        self.lost_at = at


def _require_non_negative(resources: Resources, what: str) -> None:
    if not resources.is_non_negative():
        raise InvalidAmount(f"{what} cannot be negative in any dimension", reasons=(what,))
