"""Placement policy: the pool's nodes as numpy columns, vectorised filtering and ranking.
Its cost is measured by bench/placement_micro.py.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

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
    Shape,
    partition_dimension,
)

IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]

NodeState = Literal["ready", "cordoned", "draining", "maintenance", "lost"]
NODE_STATES: tuple[str, ...] = ("ready", "cordoned", "draining", "maintenance", "lost")
_READY = 0
Packing = Literal["best-fit", "spread"]
PREFERENCE_KINDS: tuple[str, ...] = ("zone", "region", "image_cached", "gpu_model", "node_label")

_SCALAR_REASON: dict[str, str] = {
    "cpu_millis": R.INSUFFICIENT_CPU,
    "memory_mib": R.INSUFFICIENT_MEMORY,
    "gpu_count": R.INSUFFICIENT_GPU,
    "local_disk_gib": R.INSUFFICIENT_DISK,
}
# Bit budget of the int64 rank key: preference bonus | packing terms | position (tie-break).
_PREF_BITS = 12
_POS_BITS = 17
_POS_LIMIT = 1 << _POS_BITS
_Q20 = float((1 << 20) - 1)
_Q16 = float((1 << 16) - 1)
_Q14 = float((1 << 14) - 1)
_Q18 = np.int64((1 << 18) - 1)
# Per-node 1-D columns, moved together on growth and on remove_node.
_ROW_COLUMNS: tuple[str, ...] = (
    "_inv_ndims", "_arch", "_gpu_model", "_zone", "_region", "_fd", "_trust", "_gpu_mem",
    "_egress", "_bandwidth", "_runtimes", "_state",
)
_NO_CODE = -1  # a node without the trait (gpu_model None)
_UNKNOWN = -2  # a requested value no node has ever had: matches nothing


def _reason_for_dimension(dim: str) -> str:
    if dim in _SCALAR_REASON:
        return _SCALAR_REASON[dim]
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


class _Codes:
    """A growing str → small int encoding for one categorical column."""

    def __init__(self) -> None:
        self.by_name: dict[str, int] = {}
        self.names: list[str] = []

    def encode(self, name: str | None) -> int:
        if name is None:
            return _NO_CODE
        code = self.by_name.get(name)
        if code is None:
            code = len(self.names)
            self.by_name[name] = code
            self.names.append(name)
        return code

    def lookup(self, name: str) -> int:
        return self.by_name.get(name, _UNKNOWN)


@dataclass
class _Lease:
    node: int
    vector: IntArray
    tenant: str | None


class NodeTable:
    """Every node of a pool as rows of numpy arrays; allocations tracked per lease.

    Row indices are dense and change when a node is removed (the last row moves into the gap),
    so indices are only meaningful until the next `remove_node`; ids are stable.
    """

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
        self._codes = {k: _Codes() for k in ("arch", "gpu_model", "zone", "region", "fd", "trust")}
        self._runtime_bits: dict[str, int] = {r: 1 << i for i, r in enumerate(RUNTIME_CLASSES)}
        # Sparse per-node sets (image cache, labels) as one boolean column per distinct tag,
        # so a preference is a single column lookup rather than a Python loop over nodes.
        self._tags: dict[str, BoolArray] = {}
        self._node_tags: list[tuple[str, ...]] = []
        self._ids: list[str] = []
        self._index: dict[str, int] = {}
        self._leases: dict[str, _Lease] = {}
        self._node_leases: list[set[str]] = []
        # place_fast's memory: per shape, each node's key; rows touched since are re-scored
        self._memo: dict[Any, _Memo] = {}
        self._lease_vectors: dict[tuple[Resources, int], tuple[IntArray, list[int]]] = {}
        self._dirty: list[int] = []
        self._fd_counts = np.zeros(0, dtype=np.int64)
        self._fd_tenant_counts: dict[str, IntArray] = {}

    # ---------------------------------------------------------------- shape of the table

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
        for name in _ROW_COLUMNS:
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

    def _count_fd(self, lease: _Lease, sign: int) -> None:
        fd = int(self._fd[lease.node])
        self._fd_array(None)[fd] += sign
        if lease.tenant is not None:
            self._fd_array(lease.tenant)[fd] += sign

    # ---------------------------------------------------------------- membership

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
        self._egress[i] = _node_egress_rank(caps.network_egress)
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
            for name in _ROW_COLUMNS:
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

    # ---------------------------------------------------------------- allocations

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
        lease = _Lease(i, v, tenant)
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
            a = a[self._state[: self._n] == _READY]
        return self._resources(a.sum(axis=0))

    def failure_domain_counts(self, tenant: str | None = None) -> IntArray:
        """Allocations per failure domain code (all tenants, or one tenant's)."""
        return self._fd_array(tenant).copy()

    # ---------------------------------------------------------------- filtering

    def _request(self, res: Resources) -> list[tuple[str, int | None, int]]:
        """(dimension, column or None if never seen, amount) for each requested dimension."""
        out: list[tuple[str, int | None, int]] = []
        for d in SCALAR_DIMENSIONS:
            amount = int(getattr(res, d))
            if amount > 0:
                out.append((d, self._dim_index[d], amount))
        for d, amount in res.extended:
            if amount > 0:
                out.append((d, self._dim_index.get(d), amount))
        return out

    def filter(
        self, shape: Shape, *, allowed_trust_levels: Iterable[str] | None = None
    ) -> FilterResult:
        """Which nodes can take `shape` now, and how many fail each filter and why.

        One boolean mask per filter, in the fixed order of `reasons.FILTER_REASONS`; filters a
        shape does not constrain cost nothing. `allowed_trust_levels` (e.g. {"trusted"} for a
        tenant that refuses marketplace nodes) counts failures as isolation_unavailable.
        """
        n = self._n
        empty = np.zeros(0, dtype=np.int64)
        if n == 0:
            return FilterResult(0, empty, {}, False, 0, empty)
        failures: dict[str, int] = {}

        # Node state: transient, so it never makes a request unsatisfiable.
        state = self._state[:n]
        ready = state == _READY
        if not ready.all():
            per_state = np.bincount(state, minlength=len(NODE_STATES))
            for s, code in zip(NODE_STATES[1:], R.STATE_REASONS):
                c = int(per_state[NODE_STATES.index(s)])
                if c:
                    failures[code] = c

        static_ok = np.ones(n, dtype=np.bool_)

        def static(code: str, fail: BoolArray) -> None:
            nonlocal static_ok
            c = int(np.count_nonzero(fail))
            if c:
                failures[code] = failures.get(code, 0) + c
                static_ok &= ~fail

        if shape.cpu_arch is not None:
            static(R.ARCH_MISMATCH, self._arch[:n] != self._codes["arch"].lookup(shape.cpu_arch))
        if shape.gpu_model is not None:
            model_code = self._codes["gpu_model"].lookup(shape.gpu_model)
            static(R.GPU_MODEL_MISMATCH, self._gpu_model[:n] != model_code)
        if shape.gpu_memory_gib_min > 0:
            static(R.INSUFFICIENT_GPU_MEMORY, self._gpu_mem[:n] < shape.gpu_memory_gib_min)
        if shape.gpu_partition != "none":
            partition_col: int | None = self._dim_index.get(
                partition_dimension(shape.gpu_partition)
            )
            if partition_col is None:
                static(R.GPU_PARTITION_UNAVAILABLE, np.ones(n, dtype=np.bool_))
            else:
                static(R.GPU_PARTITION_UNAVAILABLE, self._alloc[:n, partition_col] <= 0)
        # A runtime no node has ever listed has bit 0, so every node fails it.
        bit = self._runtime_bits.get(shape.runtime, 0)
        isolation_fail = (self._runtimes[:n] & bit) == 0
        if allowed_trust_levels is not None:
            allowed = [self._codes["trust"].lookup(t) for t in allowed_trust_levels]
            isolation_fail |= ~np.isin(self._trust[:n], allowed)
        static(R.ISOLATION_UNAVAILABLE, isolation_fail)
        need_egress = _requested_egress_rank(shape.network_egress)
        if need_egress > 0 or shape.bandwidth_mbps_min > 0:
            net_fail = (self._egress[:n] < need_egress) | (
                self._bandwidth[:n] < shape.bandwidth_mbps_min
            )
            static(R.NETWORK_UNAVAILABLE, net_fail)
        if shape.region is not None:
            region = self._codes["region"].lookup(shape.region)
            static(R.REGION_MISMATCH, self._region[:n] != region)
        if shape.zone is not None:
            static(R.ZONE_MISMATCH, self._zone[:n] != self._codes["zone"].lookup(shape.zone))

        # Capacity: "never fits" (allocatable < request) versus "busy" (free < request).
        fits_empty = np.ones(n, dtype=np.bool_)
        fits_now = np.ones(n, dtype=np.bool_)
        by_code: dict[str, BoolArray] = {}
        partition_dim = (
            partition_dimension(shape.gpu_partition) if shape.gpu_partition != "none" else None
        )
        for dim, col, amount in self._request(shape.resources):
            if col is None:  # no node has ever offered this dimension
                fits_empty[:] = False
                fail = np.ones(n, dtype=np.bool_)
            else:
                alloc = self._alloc[:n, col]
                fits_empty &= alloc >= amount
                fail = (alloc - self._used[:n, col]) < amount
            fits_now &= ~fail
            if dim == partition_dim:
                # Nodes without the profile at all already count as gpu_partition_unavailable.
                fail = fail & (self._alloc[:n, col] > 0) if col is not None else ~fail
            code = _reason_for_dimension(dim)
            prev = by_code.get(code)
            by_code[code] = fail if prev is None else prev | fail
        for code in R.CAPACITY_REASONS:
            mask = by_code.get(code)
            if mask is not None:
                c = int(np.count_nonzero(mask))
                if c:
                    failures[code] = c

        could = static_ok & fits_empty
        fit_when_empty = int(np.count_nonzero(could))
        ok_now = could & ready
        eligible = np.flatnonzero(ok_now & fits_now).astype(np.int64, copy=False)
        busy = np.flatnonzero(ok_now & ~fits_now).astype(np.int64, copy=False)
        return FilterResult(n, eligible, failures, fit_when_empty == 0, fit_when_empty, busy)

    # ---------------------------------------------------------------- ranking

    def _preference_score(self, shape: Shape, idx: IntArray) -> tuple[IntArray, int] | None:
        """Bonus per node for the ranked preferences, and the largest possible bonus."""
        prefs = shape.preferences[:_PREF_BITS]
        if not prefs:
            return None
        score = np.zeros(idx.size, dtype=np.int64)
        k = len(prefs)
        for rank_pos, (kind, value) in enumerate(prefs):
            # Powers of two: one higher-ranked match outweighs all lower-ranked ones together.
            bonus = np.int64(1 << (k - 1 - rank_pos))
            match: BoolArray | None
            if kind == "zone":
                match = self._zone[idx] == self._codes["zone"].lookup(value)
            elif kind == "region":
                match = self._region[idx] == self._codes["region"].lookup(value)
            elif kind == "gpu_model":
                match = self._gpu_model[idx] == self._codes["gpu_model"].lookup(value)
            elif kind in ("image_cached", "node_label"):
                col = self._tags.get(("image:" if kind == "image_cached" else "label:") + value)
                match = None if col is None else col[idx]
            else:
                match = None  # an unknown preference kind is ignored, not an error
            if match is not None:
                score += match * bonus
        return score, (1 << k) - 1

    def rank(
        self,
        shape: Shape,
        eligible: IntArray | Sequence[int],
        packing: Packing = "best-fit",
        spread_counts: IntArray | Mapping[str, int] | None = None,
        *,
        limit: int | None = None,
    ) -> IntArray:
        """Order eligible node indices, best first (only the first `limit` when given).

        Key, most significant first: preference bonus (descending; the first 12 preferences
        count); then packing: best-fit = smallest dominant leftover share over the requested
        dimensions after placing, then smallest mean leftover share over every dimension the
        node has (so CPU-only work avoids stranding GPU nodes); spread = fewest allocations in
        the node's failure domain (`spread_counts` by failure-domain code or name; default:
        all leases in the table), then the emptiest node. Remaining ties go to the lower index.
        Shares are quantised (2^-20 best-fit, 2^-16 spread) into one int64 sort key.
        """
        idx = np.asarray(eligible, dtype=np.int64)
        k = idx.size
        if k == 0:
            return idx
        key = self._rank_keys(shape, idx, packing, spread_counts)
        pos = np.arange(k, dtype=np.int64)
        if k <= _POS_LIMIT:
            key |= pos  # the position makes every key unique: ties go to the lower index
            if limit is not None and limit < k:
                if limit <= 0:
                    return idx[:0]
                part = np.argpartition(key, limit - 1)[:limit]
                return idx[part[np.argsort(key[part])]]
            return idx[np.argsort(key)]
        order = np.argsort(key, kind="stable")  # huge pools: stable sort keeps index order
        return idx[order if limit is None else order[: max(limit, 0)]]

    def _rank_keys(
        self,
        shape: Shape,
        idx: IntArray,
        packing: Packing,
        spread_counts: IntArray | Mapping[str, int] | None,
    ) -> IntArray:
        """The sort key of each node in `idx` (smaller is better), low _POS_BITS left zero."""
        k = idx.size
        if packing not in ("best-fit", "spread"):
            raise ValueError(f"unknown packing {packing!r}")
        req = self._vector_readonly(shape.resources)
        best_fit = packing == "best-fit"
        dominant: npt.NDArray[np.float64] | None = None  # max leftover share, requested dims
        emptiest: npt.NDArray[np.float64] | None = None  # min leftover share, requested dims
        total = np.zeros(k) if best_fit else None
        # Column by column: each column is contiguous (Fortran order), so a 1-D take is cheap.
        for j in range(len(self._dims)):
            requested = req[j] > 0
            if not (requested or best_fit):
                continue
            a = self._alloc[:, j].take(idx)
            if not requested and not a.any():
                continue
            left = (a - self._used[:, j].take(idx) - req[j]) * self._inv[:, j].take(idx)
            np.clip(left, 0.0, 1.0, out=left)
            if total is not None:
                total += left
            if requested:
                dominant = left if dominant is None else np.maximum(dominant, left)
                emptiest = left if emptiest is None else np.minimum(emptiest, left)
        if dominant is None or emptiest is None:
            dominant = emptiest = np.zeros(k)
        pref = self._preference_score(shape, idx)
        key = np.zeros(k, dtype=np.int64)
        if pref is not None:
            key |= (pref[1] - pref[0]) << np.int64(63 - _PREF_BITS)
        if best_fit:
            assert total is not None
            mean = total * self._inv_ndims.take(idx)
            key |= (dominant * _Q20).astype(np.int64) << np.int64(_POS_BITS + 14)
            key |= (mean * _Q14).astype(np.int64) << np.int64(_POS_BITS)
        else:
            counts = self._spread_counts(spread_counts)
            fd_count = np.minimum(counts.take(self._fd.take(idx)), _Q18)
            key |= fd_count << np.int64(_POS_BITS + 16)
            key |= ((1.0 - emptiest) * _Q16).astype(np.int64) << np.int64(_POS_BITS)
        return key

    def _vector_readonly(self, res: Resources) -> IntArray:
        # Like _vector but never grows the table: an unseen dimension was filtered out already.
        v = np.zeros(len(self._dims), dtype=np.int64)
        v[0], v[1], v[2], v[3] = res.cpu_millis, res.memory_mib, res.gpu_count, res.local_disk_gib
        for k, amount in res.extended:
            j = self._dim_index.get(k)
            if j is not None:
                v[j] = amount
        return v

    def _spread_counts(self, spread_counts: IntArray | Mapping[str, int] | None) -> IntArray:
        size = len(self._codes["fd"].names)
        if spread_counts is None:
            return self._fd_array(None)
        if isinstance(spread_counts, Mapping):
            out = np.zeros(size, dtype=np.int64)
            for name, c in spread_counts.items():
                code = self._codes["fd"].lookup(name)
                if code >= 0:
                    out[code] = c
            return out
        arr = np.asarray(spread_counts, dtype=np.int64)
        if arr.size < size:
            arr = np.concatenate([arr, np.zeros(size - arr.size, dtype=np.int64)])
        return arr

    def place(
        self,
        shape: Shape,
        packing: Packing = "best-fit",
        spread_counts: IntArray | Mapping[str, int] | None = None,
        *,
        allowed_trust_levels: Iterable[str] | None = None,
    ) -> tuple[str | None, FilterResult]:
        """filter + rank: the best node id (None if none fits now) and the filter result."""
        result = self.filter(shape, allowed_trust_levels=allowed_trust_levels)
        if not result.eligible.size:
            return None, result
        best = self.rank(shape, result.eligible, packing, spread_counts, limit=1)
        return self._ids[int(best[0])], result


    def place_fast(
        self,
        shape: Shape,
        packing: Packing = "best-fit",
        *,
        allowed_trust_levels: Iterable[str] | None = None,
    ) -> tuple[str | None, FilterResult]:
        """`place`, remembering per shape the key of every node: after the first call only the
        rows allocated or freed since are re-scored, so a cycle of many requests of few shapes
        costs one full filter per shape. Same choice as `place` (a test holds it to that).

        When a node is found the FilterResult may date from an earlier call (its counts are
        for reporting only); when none is, the result is computed afresh.
        """
        if packing != "best-fit":  # spread keys move with every allocation in a domain
            return self.place(shape, packing, allowed_trust_levels=allowed_trust_levels)
        trust = None if allowed_trust_levels is None else tuple(sorted(allowed_trust_levels))
        memo_key = (shape, trust)
        memo = self._memo.get(memo_key)
        if memo is None:
            result = self.filter(shape, allowed_trust_levels=allowed_trust_levels)
            keys = np.full(self._n, _NO_KEY, dtype=np.int64)
            if result.eligible.size:
                keys[result.eligible] = self._rank_keys(shape, result.eligible, packing, None)
            candidates = np.zeros(self._n, dtype=np.bool_)
            candidates[result.eligible] = True
            candidates[result.busy] = True
            memo = _Memo(keys, candidates, len(self._dirty), result)
            memo.rebuild_heap()
            self._memo[memo_key] = memo
        elif len(self._dirty) - memo.seen <= _SCALAR_ROWS:
            # the common case (a placement or two since the last call): re-score those rows
            # with Python scalars; numpy's per-call overhead dwarfs the work on one row
            for row in set(self._dirty[memo.seen:]):
                key = self._row_key(shape, row) if memo.candidates[row] else _NO_KEY
                memo.keys[row] = key
                if key != _NO_KEY:
                    heapq.heappush(memo.heap, (key, row))
            memo.seen = len(self._dirty)
        elif memo.seen < len(self._dirty):
            rows = np.unique(np.asarray(self._dirty[memo.seen:], dtype=np.int64))
            memo.seen = len(self._dirty)
            memo.keys[rows] = _NO_KEY
            cand = rows[memo.candidates[rows]]
            if cand.size:
                req = self._vector_readonly(shape.resources)
                free = self._alloc[cand, :] - self._used[cand, :]
                fits = ((free >= req) | (req == 0)).all(axis=1)
                ok = cand[fits]
                if ok.size:
                    memo.keys[ok] = self._rank_keys(shape, ok, packing, None)
            memo.rebuild_heap()
        best = memo.best()
        if best < 0:
            del self._memo[memo_key]
            return None, self.filter(shape, allowed_trust_levels=allowed_trust_levels)
        return self._ids[best], memo.result

    def _row_key(self, shape: Shape, i: int) -> int:
        """One row's best-fit key exactly as `_rank_keys` computes it (same float operations
        in the same order), or _NO_KEY when the shape does not fit the row's free capacity."""
        res = shape.resources
        req = [res.cpu_millis, res.memory_mib, res.gpu_count, res.local_disk_gib]
        ndims = len(self._dims)
        if ndims > 4:
            req += [0] * (ndims - 4)
            for name, amount in res.extended:
                col = self._dim_index.get(name)
                if col is not None:
                    req[col] = amount
        alloc = self._alloc[i].tolist()
        used = self._used[i].tolist()
        inv = self._inv[i].tolist()
        total = 0.0
        dominant = emptiest = -1.0  # shares are ≥ 0: negative means no requested dimension
        for j in range(ndims):
            r = req[j]
            a = alloc[j]
            free = a - used[j]
            if r > 0:
                if free < r:
                    return _NO_KEY
            elif not a:
                continue
            left = (free - r) * inv[j]
            left = min(max(left, 0.0), 1.0)
            total += left
            if r > 0:
                dominant = left if dominant < 0.0 else max(dominant, left)
                emptiest = left if emptiest < 0.0 else min(emptiest, left)
        dominant = max(dominant, 0.0)
        key = 0
        prefs = shape.preferences[:_PREF_BITS]
        if prefs:
            score = 0
            k = len(prefs)
            for rank_pos, (kind, value) in enumerate(prefs):
                if kind == "zone":
                    match = int(self._zone[i]) == self._codes["zone"].lookup(value)
                elif kind == "region":
                    match = int(self._region[i]) == self._codes["region"].lookup(value)
                elif kind == "gpu_model":
                    match = int(self._gpu_model[i]) == self._codes["gpu_model"].lookup(value)
                elif kind in ("image_cached", "node_label"):
                    tag = self._tags.get(("image:" if kind == "image_cached" else "label:")
                                         + value)
                    match = tag is not None and bool(tag[i])
                else:
                    match = False
                if match:
                    score += 1 << (k - 1 - rank_pos)
            key |= (((1 << k) - 1) - score) << (63 - _PREF_BITS)
        mean = total * float(self._inv_ndims[i])
        key |= int(dominant * _Q20) << (_POS_BITS + 14)
        key |= int(mean * _Q14) << _POS_BITS
        return key

    def _touched(self, row: int) -> None:
        if self._memo:  # nobody remembers anything: nothing to re-score later
            self._dirty.append(row)
            if len(self._dirty) > 100_000:
                self._invalidate()

    def _invalidate(self) -> None:
        # anything but an allocation change (nodes, states, dimensions, tags) re-plans from scratch
        self._memo.clear()
        self._dirty.clear()


@dataclass
class _Memo:
    keys: IntArray  # per node; _NO_KEY where the node cannot take the shape now
    candidates: BoolArray  # ready and statically fit: only these can become eligible
    seen: int  # how much of the dirty-row log is folded in
    result: FilterResult
    # (key, row) of every row with a key, smallest first; an entry whose key is no longer the
    # row's is stale and skipped when it comes to the top. Ties go to the lower row, as argmin's
    heap: list[tuple[int, int]] = field(default_factory=list)

    def rebuild_heap(self) -> None:
        rows = np.flatnonzero(self.keys != _NO_KEY)
        self.heap = list(zip(self.keys[rows].tolist(), rows.tolist(), strict=True))
        heapq.heapify(self.heap)

    def best(self) -> int:
        """The row with the smallest key (the lowest such row), or -1 when none has one: the
        same row `keys.argmin()` names, without a pass over every node."""
        heap, keys = self.heap, self.keys
        while heap:
            key, row = heap[0]
            if keys[row] == key:
                return row
            heapq.heappop(heap)
        return -1


_NO_KEY = int(np.iinfo(np.int64).max)
_SCALAR_ROWS = 8  # re-scored one by one in Python up to this many touched rows


def _node_egress_rank(name: str) -> int:
    # A node advertising a class we do not know is trusted with the least egress only.
    return NETWORK_CLASSES.index(name) if name in NETWORK_CLASSES else 0


def _requested_egress_rank(name: str) -> int:
    # An unknown requested class is treated as stricter than any node can promise.
    return NETWORK_CLASSES.index(name) if name in NETWORK_CLASSES else len(NETWORK_CLASSES)
