"""Placement's filter: the nodes that can hold a shape, with per-filter counts of the rest."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

import numpy as np

from domain.policy import reasons as R
from domain.policy.placement.table import (
    NODE_STATES,
    READY,
    BoolArray,
    FilterResult,
    IntArray,
    Table,
    reason_for_dimension,
    requested_egress_rank,
)
from domain.resources import SCALAR_DIMENSIONS, Resources, Shape, partition_dimension


class Filtering(Table):
    """The table's vectorised filter: which nodes can hold a shape, and why the others cannot."""

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
        return self._filter_masks(shape, allowed_trust_levels)[0]

    def _filter_masks(self, shape: Shape, allowed_trust_levels: Iterable[str] | None
                      ) -> tuple[FilterResult, dict[str, BoolArray]]:
        """`filter`, and per capacity reason the nodes failing it (what `_recount` updates)."""
        n = self._n
        empty = np.zeros(0, dtype=np.int64)
        if n == 0:
            return FilterResult(0, empty, {}, False, 0, empty), {}
        failures: dict[str, int] = {}

        ready = self._ready(n, failures)
        static_ok = self._static_ok(shape, n, allowed_trust_levels, failures)
        fits_empty, fits_now, by_code = self._fits(shape, n, failures)

        could = static_ok & fits_empty
        fit_when_empty = int(np.count_nonzero(could))
        ok_now = could & ready
        eligible = np.flatnonzero(ok_now & fits_now).astype(np.int64, copy=False)
        busy = np.flatnonzero(ok_now & ~fits_now).astype(np.int64, copy=False)
        return (FilterResult(n, eligible, failures, fit_when_empty == 0, fit_when_empty, busy),
                by_code)

    def _ready(self, n: int, failures: dict[str, int]) -> BoolArray:
        """The nodes ready for placements; the others counted by their state's reason."""
        # Node state: transient, so it never makes a request unsatisfiable.
        state = self._state[:n]
        ready: BoolArray = state == READY
        if not ready.all():
            per_state = np.bincount(state, minlength=len(NODE_STATES))
            for s, code in zip(NODE_STATES[1:], R.STATE_REASONS):
                c = int(per_state[NODE_STATES.index(s)])
                if c:
                    failures[code] = c
        return ready

    def _static_ok(self, shape: Shape, n: int, allowed_trust_levels: Iterable[str] | None,
                   failures: dict[str, int]) -> BoolArray:
        """The nodes whose fixed properties suit `shape` (architecture, GPU model and memory,
        partitions, isolation, network, place); each failing filter counted."""
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
        need_egress = requested_egress_rank(shape.network_egress)
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
        return static_ok

    def _fits(self, shape: Shape, n: int, failures: dict[str, int]
              ) -> tuple[BoolArray, BoolArray, dict[str, BoolArray]]:
        """Per node whether `shape`'s resources fit it empty and fit it now; the nodes too busy
        or too small counted per capacity reason."""
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
            code = reason_for_dimension(dim)
            prev = by_code.get(code)
            by_code[code] = fail if prev is None else prev | fail
        _count_capacity(by_code, failures)
        return fits_empty, fits_now, by_code

    def _recount(self, shape: Shape, result: FilterResult, by_code: dict[str, BoolArray],
                 rows: IntArray) -> FilterResult:
        """`result` (no node eligible) brought up to date after allocations and frees on
        `rows` alone, its capacity masks `by_code` updated in place: what `filter` would
        return now, provided no node, state or dimension changed and none of `rows` fits.
        Only the capacity counts can move: eligibility, `busy` and the static counts do not
        depend on what is allocated where no node fits."""
        used = self._used
        partition_dim = (
            partition_dimension(shape.gpu_partition) if shape.gpu_partition != "none" else None
        )
        fresh: dict[str, BoolArray] = {}
        for dim, col, amount in self._request(shape.resources):
            if col is None:  # as `_fits` counts a dimension no node has ever offered
                fail = np.full(rows.size, dim != partition_dim, dtype=np.bool_)
            else:
                alloc = self._alloc[rows, col]
                fail = (alloc - used[rows, col]) < amount
                if dim == partition_dim:
                    fail = fail & (alloc > 0)
            code = reason_for_dimension(dim)
            prev = fresh.get(code)
            fresh[code] = fail if prev is None else prev | fail
        for code, fail in fresh.items():
            by_code[code][rows] = fail
        failures = {c: k for c, k in result.failures.items() if c not in R.CAPACITY_REASONS}
        _count_capacity(by_code, failures)
        return replace(result, failures=failures)


def _count_capacity(by_code: dict[str, BoolArray], failures: dict[str, int]) -> None:
    """Each capacity reason's count of failing nodes from its mask, where any fail."""
    for code in R.CAPACITY_REASONS:
        mask = by_code.get(code)
        if mask is not None:
            c = int(np.count_nonzero(mask))
            if c:
                failures[code] = c
