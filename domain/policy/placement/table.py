"""A pool's nodes as numpy columns: membership, state and allocations per lease."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import numpy.typing as npt

from domain.errors import CapacityError
from domain.policy import reasons as R
from domain.resources import (
    NETWORK_CLASSES,
    RUNTIME_CLASSES,
    SCALAR_DIMENSIONS,
    NodeCapabilities,
    Resources,
)

if TYPE_CHECKING:
    from domain.policy.placement.fast import Memo


IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]
NodeState = Literal["ready", "cordoned", "draining", "maintenance", "lost"]
NODE_STATES: tuple[str, ...] = ("ready", "cordoned", "draining", "maintenance", "lost")
READY = 0
Packing = Literal["best-fit", "spread"]
PREFERENCE_KINDS: tuple[str, ...] = ("zone", "region", "image_cached", "gpu_model", "node_label")
SCALAR_REASON: dict[str, str] = {
    "cpu_millis": R.INSUFFICIENT_CPU,
    "memory_mib": R.INSUFFICIENT_MEMORY,
    "gpu_count": R.INSUFFICIENT_GPU,
    "local_disk_gib": R.INSUFFICIENT_DISK,
}


# Bit budget of the int64 rank key: preference bonus | packing terms | position (tie-break).
PREF_BITS = 12
POS_BITS = 17
POS_LIMIT = 1 << POS_BITS
Q20 = float((1 << 20) - 1)
Q16 = float((1 << 16) - 1)
Q14 = float((1 << 14) - 1)
Q18 = np.int64((1 << 18) - 1)
# Per-node 1-D columns, moved together on growth and on remove_node.
ROW_COLUMNS: tuple[str, ...] = (
    "_inv_ndims", "_arch", "_gpu_model", "_zone", "_region", "_fd", "_trust", "_gpu_mem",
    "_egress", "_bandwidth", "_runtimes", "_state",
)
NO_CODE = -1  # a node without the trait (gpu_model None)
UNKNOWN = -2  # a requested value no node has ever had: matches nothing


def reason_for_dimension(dim: str) -> str:
    if dim in SCALAR_REASON:
        return SCALAR_REASON[dim]
    return R.INSUFFICIENT_GPU if dim.startswith("gpu/") else R.INSUFFICIENT_EXTENDED


@dataclass(frozen=True)
class FilterResult:
    """The outcome of filtering every node for one shape.

    eligible: node indices (ascending) that can take the request now.
    failures: reason code → number of nodes failing that filter (non-zero only, filter order);
        a node may fail several filters.
    never_satisfiable: no node present, whatever its state or load, passes the static filters
        and has the allocatable capacity; False for an empty table (no evidence either way).
    fit_when_empty: nodes that pass the static filters and could hold the request if empty
        (in any state).
    busy: ready nodes that pass the static filters and fit when empty but not now: the
        candidates for preemption.
    """

    nodes_total: int
    eligible: IntArray
    failures: dict[str, int]
    never_satisfiable: bool
    fit_when_empty: int
    busy: IntArray

    @property
    def satisfiable_now(self) -> bool:
        return bool(self.eligible.size)

    def wait_reasons(self, tenant: Iterable[str] = ()) -> R.WaitReasons:
        return R.WaitReasons(
            nodes_total=self.nodes_total,
            filters=dict(self.failures),
            tenant=tuple(tenant),
            never_satisfiable=self.never_satisfiable,
        )


class Codes:
    """A growing str → small int encoding for one categorical column."""

    def __init__(self) -> None:
        self.by_name: dict[str, int] = {}
        self.names: list[str] = []

    def encode(self, name: str | None) -> int:
        if name is None:
            return NO_CODE
        code = self.by_name.get(name)
        if code is None:
            code = len(self.names)
            self.by_name[name] = code
            self.names.append(name)
        return code

    def lookup(self, name: str) -> int:
        return self.by_name.get(name, UNKNOWN)


@dataclass
class TableLease:
    node: int
    vector: IntArray
    tenant: str | None


NO_KEY = int(np.iinfo(np.int64).max)
SCALAR_ROWS = 8  # re-scored one by one in Python up to this many touched rows


def node_egress_rank(name: str) -> int:
    # A node advertising a class we do not know is trusted with the least egress only.
    return NETWORK_CLASSES.index(name) if name in NETWORK_CLASSES else 0


def requested_egress_rank(name: str) -> int:
    # An unknown requested class is treated as stricter than any node can promise.
    return NETWORK_CLASSES.index(name) if name in NETWORK_CLASSES else len(NETWORK_CLASSES)


class Table:
    """Every node of a pool as rows of numpy arrays; allocations tracked per lease.

    Row indices are dense and change when a node is removed (the last row moves into the gap),
    so indices are only meaningful until the next `remove_node`; ids are stable.
    """

    # place_fast answers a shape that fits nowhere from its memory (fast.NodeTable._missed):
    # the table's half of the one fast-path switch (`remember_misses`, workers.fastpaths)
    misses_remembered: bool = True

    def __init__(self, initial_capacity: int = 64) -> None:
        cap = max(1, initial_capacity)
        self._n = 0
        self._dims: list[str] = list(SCALAR_DIMENSIONS)
        self._dim_index: dict[str, int] = {d: i for i, d in enumerate(self._dims)}
        # Fortran order: the filters read one dimension (a column) for all nodes at a time.
        self._alloc = np.zeros((cap, len(self._dims)), dtype=np.int64, order="F")
        self._used = np.zeros((cap, len(self._dims)), dtype=np.int64, order="F")
        # 1/allocatable (0 where none) and 1/(dimensions the node has), for normalised shares.
        self._inv = np.zeros((cap, len(self._dims)), dtype=np.float64, order="F")
        self._inv_ndims = np.zeros(cap, dtype=np.float64)
        self._arch = np.zeros(cap, dtype=np.int32)
        self._gpu_model = np.zeros(cap, dtype=np.int32)
        self._zone = np.zeros(cap, dtype=np.int32)
        self._region = np.zeros(cap, dtype=np.int32)
        self._fd = np.zeros(cap, dtype=np.int32)
        self._trust = np.zeros(cap, dtype=np.int32)
        self._gpu_mem = np.zeros(cap, dtype=np.int64)
        self._egress = np.zeros(cap, dtype=np.int8)
        self._bandwidth = np.zeros(cap, dtype=np.int64)
        self._runtimes = np.zeros(cap, dtype=np.int64)
        self._state = np.zeros(cap, dtype=np.int8)
        self._codes = {k: Codes() for k in ("arch", "gpu_model", "zone", "region", "fd", "trust")}
        self._runtime_bits: dict[str, int] = {r: 1 << i for i, r in enumerate(RUNTIME_CLASSES)}
        # Sparse per-node sets (image cache, labels) as one boolean column per distinct tag,
        # so a preference is a single column lookup rather than a Python loop over nodes.
        self._tags: dict[str, BoolArray] = {}
        self._node_tags: list[tuple[str, ...]] = []
        self._ids: list[str] = []
        self._index: dict[str, int] = {}
        self._leases: dict[str, TableLease] = {}
        self._node_leases: list[set[str]] = []
        # place_fast's memory: per shape, each node's key; rows touched since are re-scored
        self._memo: dict[Any, Memo] = {}
        self._lease_vectors: dict[tuple[Resources, int], tuple[IntArray, list[int]]] = {}
        self._dirty: list[int] = []
        # bumped by every change but an allocation's (nodes, states, dimensions, tags): which
        # nodes a shape could ever use while ready (`filter`'s eligible and busy together)
        # changes only with it
        self.layout = 0
        self._fd_counts = np.zeros(0, dtype=np.int64)
        self._fd_tenant_counts: dict[str, IntArray] = {}

    def __len__(self) -> int:
        return self._n

    def __contains__(self, node_id: object) -> bool:
        return node_id in self._index

    @property
    def node_ids(self) -> tuple[str, ...]:
        return tuple(self._ids)

    @property
    def dimensions(self) -> tuple[str, ...]:
        return tuple(self._dims)

    @property
    def failure_domains(self) -> tuple[str, ...]:
        """Failure domain names by code (the index into `failure_domain_counts`)."""
        return tuple(self._codes["fd"].names)

    def index_of(self, node_id: str) -> int:
        return self._index[node_id]

    def node_id_at(self, index: int) -> str:
        return self._ids[index]

    def state_of(self, node_id: str) -> str:
        return NODE_STATES[int(self._state[self._index[node_id]])]

    def _grow_rows(self, need: int) -> None:
        cap = self._alloc.shape[0]
        if need <= cap:
            return
        new = max(need, cap * 2)

        def grow(a: npt.NDArray[np.generic]) -> npt.NDArray[np.generic]:
            out = np.zeros((new,) + a.shape[1:], dtype=a.dtype, order="F")
            out[:cap] = a
            return out

        self._alloc = grow(self._alloc)  # type: ignore[assignment]
        self._used = grow(self._used)  # type: ignore[assignment]
        self._inv = grow(self._inv)  # type: ignore[assignment]
        for name in ROW_COLUMNS:
            setattr(self, name, grow(getattr(self, name)))
        for tag, col in self._tags.items():
            self._tags[tag] = grow(col)  # type: ignore[assignment]

    def _dim(self, name: str) -> int:
        """Column of a dimension, adding an all-zero column the first time it is seen."""
        j = self._dim_index.get(name)
        if j is not None:
            return j
        self._invalidate()
        j = len(self._dims)
        self._dims.append(name)
        self._dim_index[name] = j
        pad = np.zeros((self._alloc.shape[0], 1), dtype=np.int64)
        self._alloc = np.asfortranarray(np.hstack([self._alloc, pad]))
        self._used = np.asfortranarray(np.hstack([self._used, pad]))
        self._inv = np.asfortranarray(np.hstack([self._inv, pad.astype(np.float64)]))
        for lease in self._leases.values():
            lease.vector = np.append(lease.vector, 0)
        return j

    def _vector(self, res: Resources) -> IntArray:
        for k, _ in res.extended:
            self._dim(k)
        v = np.zeros(len(self._dims), dtype=np.int64)
        v[0], v[1], v[2], v[3] = res.cpu_millis, res.memory_mib, res.gpu_count, res.local_disk_gib
        for k, amount in res.extended:
            v[self._dim_index[k]] = amount
        return v

    def _lease_vector(self, res: Resources) -> tuple[IntArray, list[int]]:
        """`_vector(res)` (read-only, shared by the leases of one shape) and its amounts;
        remembered per shape until a dimension is added."""
        key = (res, len(self._dims))
        got = self._lease_vectors.get(key)
        if got is None:
            v = self._vector(res)
            if (v < 0).any():
                raise ValueError("negative allocation")
            v.flags.writeable = False
            if len(self._lease_vectors) > 4096:
                self._lease_vectors.clear()
            got = self._lease_vectors[(res, len(self._dims))] = (v, v.tolist())
        return got

    def _resources(self, v: IntArray) -> Resources:
        ext = tuple((d, int(v[j])) for j, d in enumerate(self._dims) if j >= 4 and v[j])
        return Resources(int(v[0]), int(v[1]), int(v[2]), int(v[3]), ext)

    def _fd_array(self, tenant: str | None) -> IntArray:
        size = len(self._codes["fd"].names)
        arr = self._fd_counts if tenant is None else self._fd_tenant_counts.get(tenant)
        if arr is None:
            arr = np.zeros(size, dtype=np.int64)
        if arr.size < size:
            arr = np.concatenate([arr, np.zeros(size - arr.size, dtype=np.int64)])
        if tenant is None:
            self._fd_counts = arr
        else:
            self._fd_tenant_counts[tenant] = arr
        return arr

    def _count_fd(self, lease: TableLease, sign: int) -> None:
        fd = int(self._fd[lease.node])
        self._fd_array(None)[fd] += sign
        if lease.tenant is not None:
            self._fd_array(lease.tenant)[fd] += sign

    def add_or_update_node(
        self, node_id: str, caps: NodeCapabilities, state: str = "ready"
    ) -> int:
        """Insert or replace a node's capabilities; its leases and allocations are kept.

        A node whose allocatable shrank below what is allocated simply fits nothing until
        leases end (its free capacity is negative), which is what a resize should mean.
        """
        self._invalidate()
        if state not in NODE_STATES:
            raise ValueError(f"unknown node state {state!r}")
        vec = self._vector(caps.allocatable)
        i = self._index.get(node_id)
        if i is None:
            i = self._n
            self._grow_rows(i + 1)
            self._n += 1
            self._ids.append(node_id)
            self._index[node_id] = i
            self._node_tags.append(())
            self._node_leases.append(set())
            self._used[i, :] = 0
        moving = [self._leases[lid] for lid in self._node_leases[i]]
        for lease in moving:  # failure domain may change: re-count this node's leases
            self._count_fd(lease, -1)
        self._alloc[i, :] = vec
        has = vec > 0
        self._inv[i, :] = np.where(has, 1.0 / np.where(has, vec, 1), 0.0)
        self._inv_ndims[i] = 1.0 / max(int(has.sum()), 1)
        self._arch[i] = self._codes["arch"].encode(caps.cpu_arch)
        self._gpu_model[i] = self._codes["gpu_model"].encode(caps.gpu_model)
        self._zone[i] = self._codes["zone"].encode(caps.zone)
        self._region[i] = self._codes["region"].encode(caps.region)
        self._fd[i] = self._codes["fd"].encode(caps.failure_domain)
        self._trust[i] = self._codes["trust"].encode(caps.trust_level)
        self._gpu_mem[i] = caps.gpu_memory_gib
        self._egress[i] = node_egress_rank(caps.network_egress)
        self._bandwidth[i] = caps.bandwidth_mbps
        bits = 0
        for r in caps.runtimes:
            if r not in self._runtime_bits:
                if len(self._runtime_bits) >= 62:
                    raise ValueError("too many runtime classes")
                self._runtime_bits[r] = 1 << len(self._runtime_bits)
            bits |= self._runtime_bits[r]
        self._runtimes[i] = bits
        self._state[i] = NODE_STATES.index(state)
        self._fd_array(None)
        for lease in moving:
            self._count_fd(lease, +1)
        tags = tuple(f"image:{ref}" for ref in caps.image_cache) + tuple(
            f"label:{k}={v}" for k, v in caps.labels
        )
        self._set_tags(i, tags)
        return i

    def _set_tags(self, i: int, tags: tuple[str, ...]) -> None:
        for tag in self._node_tags[i]:
            col = self._tags.get(tag)
            if col is not None:
                col[i] = False
                if tag not in tags and not col[: self._n].any():
                    del self._tags[tag]  # keep the tag dictionary bounded by what exists
        for tag in tags:
            col = self._tags.get(tag)
            if col is None:
                col = np.zeros(self._alloc.shape[0], dtype=np.bool_)
                self._tags[tag] = col
            col[i] = True
        self._node_tags[i] = tags

    def set_image_cache(self, node_id: str, images: Iterable[str]) -> None:
        """Replace a node's cached image set (reported far more often than capabilities)."""
        self._invalidate()
        i = self._index[node_id]
        keep = tuple(t for t in self._node_tags[i] if not t.startswith("image:"))
        self._set_tags(i, keep + tuple(f"image:{ref}" for ref in images))

    def set_state(self, node_id: str, state: str) -> None:
        if state not in NODE_STATES:
            raise ValueError(f"unknown node state {state!r}")
        i = self._index[node_id]
        if self._state[i] != NODE_STATES.index(state):
            self._invalidate()
            self._state[i] = NODE_STATES.index(state)

    def remove_node(self, node_id: str) -> list[str]:
        """Drop a node; returns the lease ids that were allocated on it (now forgotten)."""
        self._invalidate()
        i = self._index.pop(node_id)
        dropped = sorted(self._node_leases[i])
        for lid in dropped:
            self._count_fd(self._leases.pop(lid), -1)
        self._set_tags(i, ())
        last = self._n - 1
        if i != last:
            # Move the last row into the gap so live rows stay dense.
            for name in ("_alloc", "_used", "_inv"):
                a = getattr(self, name)
                a[i, :] = a[last, :]
            for name in ROW_COLUMNS:
                a = getattr(self, name)
                a[i] = a[last]
            for col in self._tags.values():
                col[i] = col[last]
                col[last] = False
            moved = self._ids[last]
            self._ids[i] = moved
            self._index[moved] = i
            self._node_tags[i] = self._node_tags[last]
            self._node_leases[i] = self._node_leases[last]
            for lid in self._node_leases[i]:
                self._leases[lid].node = i
        self._ids.pop()
        self._node_tags.pop()
        self._node_leases.pop()
        self._alloc[last, :] = 0
        self._used[last, :] = 0
        self._inv[last, :] = 0.0
        self._n -= 1
        return dropped

    def allocate(
        self, node_id: str, lease_id: str, resources: Resources, *, tenant: str | None = None
    ) -> None:
        """Record a lease's allocation on a node; refuses anything past allocatable.

        The `tenant` (optional) feeds the per-tenant failure-domain counts used by spread.
        """
        if lease_id in self._leases:
            raise ValueError(f"lease {lease_id!r} already allocated")
        i = self._index[node_id]
        v, amounts = self._lease_vector(resources)
        # one row: Python over its few dimensions, not numpy calls on 1×d slices
        alloc, used = self._alloc[i].tolist(), self._used[i].tolist()
        over = [j for j, x in enumerate(amounts) if x > alloc[j] - used[j]]
        if over:
            dims = [self._dims[j] for j in over]
            raise CapacityError(f"{lease_id} does not fit on {node_id}: {', '.join(dims)}")
        self._used[i, :] += v
        self._touched(i)
        lease = TableLease(i, v, tenant)
        self._leases[lease_id] = lease
        self._node_leases[i].add(lease_id)
        self._count_fd(lease, +1)

    def free(self, lease_id: str) -> bool:
        """Release a lease's allocation; False (and no change) for an unknown lease."""
        lease = self._leases.pop(lease_id, None)
        if lease is None:
            return False
        self._used[lease.node, : lease.vector.size] -= lease.vector
        self._touched(lease.node)
        self._node_leases[lease.node].discard(lease_id)
        self._count_fd(lease, -1)
        return True

    def node_of(self, lease_id: str) -> str | None:
        lease = self._leases.get(lease_id)
        return None if lease is None else self._ids[lease.node]

    def leases_on(self, node_id: str) -> tuple[str, ...]:
        return tuple(sorted(self._node_leases[self._index[node_id]]))

    def allocatable_matrix(self) -> IntArray:
        """nodes × `dimensions` copy of allocatable capacity."""
        return np.ascontiguousarray(self._alloc[: self._n])

    def allocated_matrix(self) -> IntArray:
        return np.ascontiguousarray(self._used[: self._n])

    def free_matrix(self) -> IntArray:
        """nodes × `dimensions`: allocatable − allocated (negative after a shrinking update)."""
        return np.ascontiguousarray(self._alloc[: self._n] - self._used[: self._n])

    def free_resources(self, node_id: str) -> Resources:
        i = self._index[node_id]
        return self._resources(np.maximum(self._alloc[i] - self._used[i], 0))

    def allocated_resources(self, node_id: str) -> Resources:
        i = self._index[node_id]
        return self._resources(self._used[i])

    def totals(self, *, ready_only: bool = False) -> Resources:
        """Sum of allocatable over nodes (the DRF denominator)."""
        a = self._alloc[: self._n]
        if ready_only:
            a = a[self._state[: self._n] == READY]
        return self._resources(a.sum(axis=0))

    def failure_domain_counts(self, tenant: str | None = None) -> IntArray:
        """Allocations per failure domain code (all tenants, or one tenant's)."""
        return self._fd_array(tenant).copy()

    def _touched(self, row: int) -> None:
        if self._memo:  # nobody remembers anything: nothing to re-score later
            self._dirty.append(row)
            if len(self._dirty) > 100_000:
                self._invalidate()

    def _invalidate(self) -> None:
        # anything but an allocation change (nodes, states, dimensions, tags) re-plans from scratch
        self.layout += 1
        self._memo.clear()
        self._dirty.clear()
