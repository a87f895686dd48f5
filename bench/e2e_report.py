"""`pool bench e2e`'s report: its rows (also the first rows of `pool bench all`) and the
printed table with the CPU budgets the goals leave."""

from __future__ import annotations

from typing import Any

from bench.latency import stage_lines

GOAL_ACCEPTED, GOAL_RESERVED = 5000, 3000  # issue 15's goals for this machine, per second


def rows(result: dict[str, Any]) -> list[tuple[str, float | None, str, str, float | None]]:
    """(figure, value, unit, goal, raw rate to divide by) — also the first rows of bench all."""
    s, st, raw = result["saturated"], result["steady"], result["raw_atomic_msgs_per_s"]
    c = result["clients"]
    count = result["count"]
    each = f" ({count} leases each)" if count > 1 else ""
    out: list[tuple[str, float | None, str, str, float | None]] = [
        (f"e2e: accepted requests/s, {c} clients{each}", s["accepted_per_s"], "/s",
         f"≥ {GOAL_ACCEPTED:,}", raw),
    ]
    if count > 1:
        out.append(("e2e: accepted leases/s, same run", s["leases_per_s"], "/s", "", raw))
    return out + [
        ("e2e: reserved/s, same run", s["reserved_per_s"], "/s", f"≥ {GOAL_RESERVED:,}", raw),
        ("e2e: reply p99 at saturation (ms)", s["reply_p99_ms"], "ms", "", None),
        ("e2e: request → reserved p50 at saturation (ms)", s["reserved_p50_ms"], "ms", "", None),
        ("e2e: request → reserved p99 at saturation (ms)", s["reserved_p99_ms"], "ms", "", None),
        (f"e2e: request → reserved p50 at {result['offered_per_s']:,.0f}/s offered (ms)",
         st["reserved_p50_ms"], "ms", "", None),
        (f"e2e: request → reserved p99 at {result['offered_per_s']:,.0f}/s offered (ms)",
         st["reserved_p99_ms"], "ms", "≤ 50", None),
        (f"e2e: request → reserved max at {result['offered_per_s']:,.0f}/s offered (ms)",
         st["reserved_max_ms"], "ms", "", None),
        (f"e2e: accepted/s at {result['offered_per_s']:,.0f}/s offered", st["accepted_per_s"],
         "/s", "", raw),
        # the goal's rate as CPU: what every process together may spend on a request here
        ("e2e: CPU per accepted request, all processes (ms)", _all_cpu(s), "ms",
         f"≤ {_budgetms(result, GOAL_ACCEPTED):.2f}", None),
    ]


def _budgetms(result: dict[str, Any], rate: int) -> float:
    """The CPU ms per request that `rate` requests/s leave on the run's cores."""
    return float(result.get("cores") or 1) * 1000 / rate


def _all_cpu(saturated: dict[str, Any]) -> float | None:
    """The plane's, the server's and the clients' CPU ms per accepted request, summed."""
    cpu = saturated.get("cpu_ms_per_request") or {}
    parts = [cpu.get(who) for who in ("plane", "server", "clients")]
    return None if any(v is None for v in parts) else sum(v for v in parts if v is not None)


def _budget_lines(result: dict[str, Any]) -> list[str]:
    """What the goals leave per request on this machine's cores, beside what a request that
    stores nothing already cost the server and the clients in the same run."""
    floor = result.get("stateless_cpu_ms_per_reply") or {}
    if floor.get("server") is None or floor.get("clients") is None:
        return []
    carried = floor["server"] + floor["clients"]
    return [
        f"  its CPU ms per reply: server {floor['server']:.2f}, clients {floor['clients']:.2f}"
        + (f", responder {floor['responder']:.2f}" if floor.get("responder") is not None
           else ""),
        (f"CPU per request the goals leave on {result.get('cores') or 1} cores: "
         f"{_budgetms(result, GOAL_ACCEPTED):.2f} ms at {GOAL_ACCEPTED:,} accepted/s, "
         f"{_budgetms(result, GOAL_RESERVED):.2f} ms at {GOAL_RESERVED:,} reserved/s; carrying a "
         f"request that stores nothing took the server and the clients {carried:.2f} ms")]


def table(result: dict[str, Any]) -> str:
    s, st = result["saturated"], result["steady"]
    lines = [f"{'figure':<58} {'value':>10} {'goal':>9} {'÷ raw':>7}", "-" * 87]
    for label, value, unit, goal, raw in rows(result):
        ratio = f"{value / raw:.3f}" if value is not None and raw and unit == "/s" else ""
        text = ("n/a" if value is None else f"{value:,.0f}" if unit != "ms"
                else f"{value:,.2f}" if value < 10 else f"{value:,.1f}")
        lines.append(f"{label:<58} {text:>10} {goal:>9} {ratio:>7}")
    lines.append(f"{'raw JetStream atomic batch of 999, same server (msgs/s)':<58} "
                 f"{result['raw_atomic_msgs_per_s']:>10,.0f}")
    floor = result.get("stateless_replies_per_s")
    if floor:
        lines.append(f"{'the same clients, a responder storing nothing (replies/s)':<58} "
                     f"{floor:>10,.0f}   accepted ÷ it: {s['accepted_per_s'] / floor:.3f}")
    lines.extend(_budget_lines(result))
    if result.get("pools", 1) > 1 or result.get("scheduler_processes", 1) > 1:
        led = result.get("pool_leaders") or {}
        by = f"; leaders (pid): {', '.join(f'{p} {pid}' for p, pid in led.items())}" if led else ""
        lines.append(f"{result['pools']} pools, {result['scheduler_processes']} scheduler "
                     f"processes{by}")
    cpu = s.get("cpu_ms_per_request") or {}
    if any(v is not None for v in cpu.values()):
        parts = ", ".join(f"{who} {v:.2f}" for who, v in cpu.items() if v is not None)
        lines.append(f"CPU ms per accepted request at saturation, by process: {parts}")
    shares = [p for p in s.get("plane_cpu_ms_per_request") or [] if p["ms"] is not None]
    if len(shares) > 1:
        lines.append("the plane's, by its processes: "
                     + ", ".join(f"{p['roles']} {p['ms']:.2f}" for p in shares))
    settled = s.get("settled_cpu_ms_per_request") or {}
    if any(v is not None for v in settled.values()):
        parts = ", ".join(f"{who} {v:.2f}" for who, v in settled.items() if v is not None)
        more = s.get("settled_msgs_per_request")
        lines.append(f"the same until the dispatcher caught up ({s['settled_s']:.0f} s after the "
                     f"phase began, everything run meanwhile included): {parts}"
                     + (f"; server messages {more['in']:.1f} in, {more['out']:.1f} out"
                        if more else ""))
    lines.extend(stage_lines(s, "at saturation"))
    lines.extend(stage_lines(st, f"at {result['offered_per_s']:,.0f}/s offered"))
    msgs = s.get("server_msgs_per_request")
    if msgs:
        lines.append(f"server messages per accepted request at saturation: {msgs['in']:.1f} in, "
                     f"{msgs['out']:.1f} out")
    lines.append(
        f"saturation: {s['requests']:,} requests, {s['accepted']:,} accepted, "
        f"{s['reserved']:,} reserved, errors {s['errors'] or 'none'}; steady: "
        f"{st['requests']:,} sent, {st['accepted']:,} accepted, {st['reserved']:,} reserved, "
        f"errors {st['errors'] or 'none'}")
    more_commands = result["command_processes"] - 1
    more_schedulers = result.get("scheduler_processes", 1) - 1
    planes = result.get("plane_processes", 1)
    lines.append(
        f"{result['clients']} clients in {result['client_processes']} processes (one NATS "
        f"connection each); "
        + ("the plane in two processes (the scheduler's roles in one of their own, as "
           "`pool up` runs it)" if planes - more_commands - more_schedulers == 2
           else "the plane in one process")
        + (f", {more_commands} more command process(es)" if more_commands else "")
        + (f", {more_schedulers} more scheduler process(es)" if more_schedulers else "")
        + (f" (CPU of all {planes})" if planes > 1 else "")
        + ("; no views folded (no PostgreSQL)" if not result.get("views", True) else "")
        + ("; leases left reserved (none committed or started)"
           if not result.get("leases_committed", True) else "")
        + f"; {result['nodes']} simulated nodes beating every "
        f"{result['heartbeat_seconds']:g} s (registered in {result['register_s']:.1f} s); "
        f"{'quick' if result['quick'] else 'full'} sizes, {result['elapsed_s']:.0f} s in all")
    lines.append(f"machine: {result['machine']}")
    return "\n".join(lines)

