"""Latency figures of the e2e benchmarks: nearest-rank percentiles, and request → reserved
split into its stages per lease."""

from __future__ import annotations

from typing import Any

# one request as a client saw it: sent, replied (wall clock), ok, its lease ids, error code
Record = tuple[float, float, bool, tuple[str, ...], str]


def pct(values: list[float], q: float) -> float | None:
    """The nearest-rank `q` quantile of `values` (None for none)."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# request → reserved in its stages, each lease's: the server's stored times of its log events
# (read after the run), the clients' clocks and the tenants' feed watcher's, on one machine
STAGES = (("sent_to_stored", "sent → request stored"),
          ("stored_to_reply", "request stored → reply at the client"),
          ("stored_to_reserved", "request stored → reservation stored"),
          ("reserved_to_feed", "reservation stored → on the tenant's feed"))


def stages(records: list[Record], requested: dict[str, float], stored: dict[str, float],
           seen: dict[str, float]) -> dict[str, dict[str, float | None]]:
    """p50 / p99 ms of each stage of STAGES over the accepted requests' leases."""
    got: dict[str, list[float]] = {key: [] for key, _ in STAGES}
    for sent_at, replied_at, ok, ids, _code in records:
        if not ok:
            continue
        for lid in ids:
            asked = requested.get(lid)
            if asked is None:
                continue
            got["sent_to_stored"].append(asked - sent_at)
            got["stored_to_reply"].append(replied_at - asked)
            placed = stored.get(lid)
            if placed is not None:
                got["stored_to_reserved"].append(placed - asked)
                if lid in seen:
                    got["reserved_to_feed"].append(seen[lid] - placed)
    return {key: {"p50_ms": ms(pct(v, 0.5)), "p99_ms": ms(pct(v, 0.99))}
            for key, v in got.items()}


def ms(v: float | None) -> float | None:
    """Seconds as milliseconds, None kept."""
    return None if v is None else v * 1000


def stage_lines(phase: dict[str, Any], where: str) -> list[str]:
    """The phase's request → reserved in its stages, p50 / p99 ms, on one line."""
    split = phase.get("stages") or {}
    parts = [f"{label} {got['p50_ms']:.1f} / {got['p99_ms']:.1f}" for key, label in STAGES
             if (got := split.get(key)) and got["p50_ms"] is not None
             and got["p99_ms"] is not None]
    if not parts:
        return []
    return [f"request → reserved in stages {where}, p50 / p99 ms: " + "; ".join(parts)]
