"""Placement's ranking: best-fit or spread packing, preferences and failure-domain spread."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import numpy.typing as npt

from domain.policy.placement.filter import Filtering
from domain.policy.placement.table import (
    POS_BITS,
    POS_LIMIT,
    PREF_BITS,
    Q14,
    Q16,
    Q18,
    Q20,
    BoolArray,
    FilterResult,
    IntArray,
    Packing,
)
from domain.resources import Resources, Shape


class Ranking(Filtering):
    """The table's ranking of eligible nodes: packing, preferences, spread."""

    def _preference_score(self, shape: Shape, idx: IntArray) -> tuple[IntArray, int] | None:
        """Bonus per node for the ranked preferences, and the largest possible bonus."""
        prefs = shape.preferences[:PREF_BITS]
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
        if k <= POS_LIMIT:
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
        """The sort key of each node in `idx` (smaller is better), low POS_BITS left zero."""
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
            key |= (pref[1] - pref[0]) << np.int64(63 - PREF_BITS)
        if best_fit:
            assert total is not None
            mean = total * self._inv_ndims.take(idx)
            key |= (dominant * Q20).astype(np.int64) << np.int64(POS_BITS + 14)
            key |= (mean * Q14).astype(np.int64) << np.int64(POS_BITS)
        else:
            counts = self._spread_counts(spread_counts)
            fd_count = np.minimum(counts.take(self._fd.take(idx)), Q18)
            key |= fd_count << np.int64(POS_BITS + 16)
            key |= ((1.0 - emptiest) * Q16).astype(np.int64) << np.int64(POS_BITS)
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
