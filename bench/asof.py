"""The views read as they were (`--at`): how long one page takes at points across a log's
span, on views a bench already built (`pool bench projections` reports it)."""

from __future__ import annotations

import statistics
import time
from typing import Any

FRACTIONS = (0.05, 0.25, 0.5, 0.75, 0.95)  # of the span between the log's first and last event
VIEWS = ("leases", "queue", "capacity", "balance")


def time_as_of(database_url: str, schema: str, *, repeats: int = 3) -> dict[str, Any]:
    """For each view and each point of FRACTIONS: a first page (100 rows, every tenant) of
    the view as it was then, as the CLI reads it (a connection each), `repeats` times; the
    median of each, and the slowest median."""
    from projections.queries import query_url
    from projections.views.history import history_extent

    lo, hi, versions = history_extent(database_url, schema)
    if lo is None or hi is None:
        return {"points": [], "slowest_s": 0.0, "history_versions": versions, "span_s": 0.0}
    points = []
    for view in VIEWS:
        for f in FRACTIONS:
            at = lo + f * (hi - lo)
            runs = []
            for _ in range(repeats):
                t = time.perf_counter()
                page = query_url(database_url, view, tenant=None, schema=schema, at=at,
                                 limit=100)
                runs.append(time.perf_counter() - t)
            points.append({"view": view, "fraction": f, "at": at,
                           "as_of_seq": page["as_of_seq"], "rows": len(page["rows"]),
                           "median_s": statistics.median(runs)})
    return {"points": points, "slowest_s": max(p["median_s"] for p in points),
            "history_versions": versions, "span_s": hi - lo}
