"""`pool bench all`: every benchmark in one run, one table of figures, goals and ratios.
What it measures and how: docs/architecture.md#the-benchmarks.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def _fmt(v: float | None, unit: str) -> str:
    if v is None:
        return "n/a"
    if unit in ("s", "ms"):
        return f"{v:,.3f}" if v < 10 else f"{v:,.1f}"
    return f"{v:,.0f}"


def run_all(*, quick: bool = False, database_url: str | None = None,
            progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    from bench.agent import run_agent_bench
    from bench.bus_rates import run_eventlog_bench
    from bench.e2e import rows as e2e_rows
    from bench.e2e import run_e2e_bench
    from bench.machine import machine_line
    from bench.projections import run_projections_bench
    from bench.schedule import BACKLOG_LABEL, run_schedule_bench

    say = progress or (lambda _s: None)
    started = time.monotonic()
    say("== e2e")
    e2e = run_e2e_bench(quick=quick, progress=say)
    say("== eventlog")
    ev = run_eventlog_bench(quick=quick, progress=say)
    say("== schedule")
    sc = run_schedule_bench(quick=quick, progress=say)
    say("== projections")
    pr = run_projections_bench(database_url=database_url, quick=quick, progress=say)
    say("== agent")
    ag = run_agent_bench(quick=quick, progress=say)
    raw_ev = ev["raw"]["atomic_999"]
    rows: list[tuple[str, float | None, str, str, str]] = []

    def row(label: str, value: float | None, unit: str, goal: str, raw: float | None) -> None:
        ratio = "" if value is None or not raw or unit not in ("/s",) else f"{value / raw:.3f}"
        rows.append((label, value, unit, goal, ratio))

    # first: what users see, from outside the control plane (its own raw rate, same run)
    for label, value, unit, goal, raw in e2e_rows(e2e):
        row(label, value, unit, goal, raw)
    row("raw JetStream atomic batch of 999 (msgs/s)", raw_ev, "/s", "", raw_ev)
    row("raw publish, awaited (msgs/s)", ev["raw"]["awaited"], "/s", "", raw_ev)
    row("Application save, 3 aggregates (saves/s)", ev["application"]["save_3"], "/s", "", raw_ev)
    row(BACKLOG_LABEL, sc.get("backlog_placements_per_s"), "/s", "≥ 5,000",
        sc.get("raw_atomic_msgs_per_s"))
    row("placement latency p99 at a steady load (s)", sc.get("latency_p99_s"), "s", "", None)
    row("scheduler + producer max RSS (MiB)", sc.get("rss_mib"), "MiB", "< 1,024", None)
    row("events/s applied into PostgreSQL", pr.get("applied_events_per_s"), "/s", "≥ 20,000",
        pr.get("raw_atomic_msgs_per_s"))
    row("projection lag p99 at a steady producer (s)", pr.get("lag_p99_s"), "s", "≤ 0.250", None)
    row("rebuild of 1M events (s)" + (" (extrapolated)" if pr.get("rebuild_1m_extrapolated")
                                      else ""), pr.get("rebuild_1m_s"), "s", "≤ 60", None)
    row("audit replay, credit events/s", pr.get("audit_credit_events_per_s"), "/s",
        "≥ 100,000", pr.get("raw_atomic_msgs_per_s"))
    proc = ag.get("process") or {}
    if "delivered" in proc:
        row("process runtime: order delivered → running p50 (ms)",
            proc["delivered"]["p50_ms"], "ms", "", None)
    dock = ag.get("docker") or {}
    if "delivered" in dock:
        row("docker runtime: order delivered → running p50 (ms)",
            dock["delivered"]["p50_ms"], "ms", "", None)
        plain = (ag.get("docker_plain") or {}).get("p50_ms")
        row("plain `docker run -d`, same image p50 (ms)", plain, "ms", "", None)
    width = max(len(r[0]) for r in rows)
    lines = [f"{'figure':<{width}}  {'value':>12}  {'goal':>10}  {'÷ raw':>7}",
             "-" * (width + 35)]
    for label, value, unit, goal, ratio in rows:
        lines.append(f"{label:<{width}}  {_fmt(value, unit):>12}  {goal:>10}  {ratio:>7}")
    lines.append(f"÷ raw: the figure over the raw 999-message atomic-batch rate its own benchmark "
                 f"measured in the same run; {'quick' if quick else 'full'} sizes; "
                 f"{time.monotonic() - started:.0f} s in all")
    lines.append(f"machine: {machine_line()}; nats-server file storage, sync_interval always")
    return {"e2e": {k: v for k, v in e2e.items() if k != "table"},
            "eventlog": {k: v for k, v in ev.items() if k != "table"},
            "schedule": {k: v for k, v in sc.items() if k != "table"},
            "projections": {k: v for k, v in pr.items() if k != "table"},
            "agent": {k: v for k, v in ag.items() if k != "table"},
            "table": "\n".join(lines)}
