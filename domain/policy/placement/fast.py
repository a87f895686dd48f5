"""Placement's fast path: the best node of a common shape kept in a heap between placements."""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from domain.policy.placement.rank import Ranking
from domain.policy.placement.table import (
    NO_KEY,
    POS_BITS,
    PREF_BITS,
    Q14,
    Q20,
    SCALAR_ROWS,
    BoolArray,
    FilterResult,
    IntArray,
    Packing,
)
from domain.resources import Shape

# shapes (with trust levels) a table remembers at once, the oldest dropped past them: each costs
# a few arrays as long as the table (about 110 KB at 10,000 nodes), and a shape that misses is
# kept until the nodes change
MEMO_SHAPES = 256


@dataclass
class Memo:
    keys: IntArray  # per node; NO_KEY where the node cannot take the shape now
    candidates: BoolArray  # ready and statically fit: only these can become eligible
    seen: int  # how much of the dirty-row log is folded in
    result: FilterResult
    # while no node takes the shape: the filter's result, exact as of `counted` (a position
    # in the dirty-row log), and its per-reason capacity masks, brought up to date from the
    # rows touched since rather than by filtering every node again (`_missed`)
    missed: FilterResult
    masks: dict[str, BoolArray]
    counted: int
    # (key, row) of every row with a key, smallest first; an entry whose key is no longer the
    # row's is stale and skipped when it comes to the top. Ties go to the lower row, as argmin's
    heap: list[tuple[int, int]] = field(default_factory=list)

    def rebuild_heap(self) -> None:
        rows = np.flatnonzero(self.keys != NO_KEY)
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


class NodeTable(Ranking):
    """A pool's nodes for placement: the table, its filter and ranking, and the fast path."""

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
            result, masks = self._filter_masks(shape, allowed_trust_levels)
            keys = np.full(self._n, NO_KEY, dtype=np.int64)
            if result.eligible.size:
                keys[result.eligible] = self._rank_keys(shape, result.eligible, packing, None)
            candidates = np.zeros(self._n, dtype=np.bool_)
            candidates[result.eligible] = True
            candidates[result.busy] = True
            memo = Memo(keys, candidates, len(self._dirty), result, result, masks,
                        len(self._dirty))
            memo.rebuild_heap()
            if len(self._memo) >= MEMO_SHAPES:
                del self._memo[next(iter(self._memo))]
            self._memo[memo_key] = memo
        elif len(self._dirty) - memo.seen <= SCALAR_ROWS:
            # the common case (a placement or two since the last call): re-score those rows
            # with Python scalars; numpy's per-call overhead dwarfs the work on one row
            for row in set(self._dirty[memo.seen:]):
                key = self._row_key(shape, row) if memo.candidates[row] else NO_KEY
                memo.keys[row] = key
                if key != NO_KEY:
                    heapq.heappush(memo.heap, (key, row))
            memo.seen = len(self._dirty)
        elif memo.seen < len(self._dirty):
            rows = np.unique(np.asarray(self._dirty[memo.seen:], dtype=np.int64))
            memo.seen = len(self._dirty)
            memo.keys[rows] = NO_KEY
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
            return None, self._missed(memo_key, memo, shape, allowed_trust_levels)
        return self._ids[best], memo.result

    def _missed(self, memo_key: object, memo: Memo, shape: Shape,
                allowed_trust_levels: Iterable[str] | None) -> FilterResult:
        """What `filter` says now of a shape no node takes. A queue holds many requests of
        one shape, and once one fits nowhere the rest of a cycle's do too (its placements
        only take capacity): the first filters every node, the others recount the capacity
        of the rows allocated or freed since. `misses_remembered` False filters each time
        (the plain path the parity tests hold this one to)."""
        if not self.misses_remembered:
            del self._memo[memo_key]
            return self.filter(shape, allowed_trust_levels=allowed_trust_levels)
        if memo.missed.eligible.size:  # last filtered while something fitted: not a miss
            memo.missed, memo.masks = self._filter_masks(shape, allowed_trust_levels)
        elif memo.counted < len(self._dirty):
            rows = np.unique(np.asarray(self._dirty[memo.counted:], dtype=np.int64))
            memo.missed = self._recount(shape, memo.missed, memo.masks, rows)
        memo.counted = len(self._dirty)
        return memo.missed

    def _row_key(self, shape: Shape, i: int) -> int:
        """One row's best-fit key exactly as `_rank_keys` computes it (same float operations
        in the same order), or NO_KEY when the shape does not fit the row's free capacity."""
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
                    return NO_KEY
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
        prefs = shape.preferences[:PREF_BITS]
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
            key |= (((1 << k) - 1) - score) << (63 - PREF_BITS)
        mean = total * float(self._inv_ndims[i])
        key |= int(dominant * Q20) << (POS_BITS + 14)
        key |= int(mean * Q14) << POS_BITS
        return key


def remember_misses(on: bool) -> None:
    """Whether every node table answers a shape that fits nowhere from its memory (on) or
    filters every node each time (off): set at process start by workers.fastpaths, never read
    from the environment here."""
    NodeTable.misses_remembered = bool(on)
