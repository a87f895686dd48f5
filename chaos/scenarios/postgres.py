"""Fault scenario 7: PostgreSQL restarted under load; the views catch up with nothing lost."""

from __future__ import annotations

import threading
import time
from collections import Counter
from functools import partial
from typing import Any

from bus.errors import BusError
from chaos.harness import (
    Outcome,
    Workspace,
    count_notifications,
    error_code,
    known_codes,
    private_postgres,
    setup_pool,
    wait_for,
)

# -- 7. PostgreSQL restarted mid-stream -----------------------------------------------------------


def scenario_postgres_restart(ws: Workspace, size: dict[str, Any], o: Outcome) -> None:
    """`pool serve` with views (projector + tenant queries) on a private PostgreSQL, which is
    crashed (SIGKILL) and started again while credit grants stream in through the commands."""
    from projections import views as pv

    pg = private_postgres(ws)
    url = ws.nats().url
    ws.serve(url, name="serve", database_url=pg.url)
    admin = ws.client(url)
    tenants = [f"t{k}" for k in range(5)]
    setup_pool(admin, tenants)
    log = ws.log_reader(url)
    expected = Counter({t: 10**14 for t in tenants})
    n, rate = int(size["grants"]), float(size["rate"])
    restarts = int(size["restarts"])
    done = [0]
    outage_answers: Counter[str] = Counter()

    def write() -> None:
        t0 = time.monotonic()
        for i in range(n):
            while time.monotonic() - t0 < i / rate:
                time.sleep(0.005)
            t, amount = tenants[i % len(tenants)], 1000 + i
            for _ in range(5):  # same transfer id: a retry cannot grant twice
                try:
                    r = admin.admin("credits.grant", {"tenant": t, "amount_microcredits": amount,
                                                      "transfer_id": f"g{i}"})
                except BusError:
                    continue
                if r.get("ok"):
                    expected[t] += amount
                    break
            done[0] = i + 1

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    def written(share: float) -> bool:
        return done[0] >= share

    reader = ws.client(url, "t0", timeout=10)
    for k in range(restarts):
        wait_for(partial(written, n * (k + 1) / (restarts + 1)), 300, 0.05)
        pg.crash()
        for _ in range(3):  # queries while it is down: a typed refusal, not a hang
            try:
                r = reader.call("pool.cmd.t0.query.balance", {})
                outage_answers["ok" if r.get("ok") else
                               str((r.get("error") or {}).get("code"))] += 1
            except BusError as e:
                outage_answers[error_code(e)] += 1
            time.sleep(0.5)
        pg.start()
    writer.join()
    top = log.recorder.max_notification_id() or 0

    def caught_up() -> bool:
        pos = pv.positions_at(pg.url)
        return len(pos) == len(pv.VIEWS) and min(p for p, _ in pos.values()) >= top

    ok = wait_for(caught_up, 120, 0.2)
    total = count_notifications(log)
    applied = {v: a for v, (_p, a) in pv.positions_at(pg.url).items()}
    o.figures.update(events=total, restarts=restarts)
    o.zero("lost_events", max((total - a for a in applied.values()), default=total),
           f"applied per view {applied}, log {total}")
    wrong = []
    for t in tenants:
        c = ws.client(url, t, timeout=10)
        r = wait_for(partial(c.call, f"pool.cmd.{t}.query.balance", {}), 20, 0.5) or {}
        rows = (r.get("result") or {}).get("rows") or []
        if not r.get("ok") or not rows or rows[0]["granted"] != expected[t]:
            wrong.append(f"{t}: {r.get('error') or (rows[0]['granted'] if rows else None)} "
                         f"!= {expected[t]}")
    o.zero("query_mismatches", len(wrong), "; ".join(wrong[:2]))
    o.figures["outage_answers"] = dict(outage_answers)
    known = known_codes()
    o.zero("untyped_outage_answers", sum(c for k, c in outage_answers.items()
                                         if k != "ok" and k not in known),
           f"answers while down: {dict(outage_answers)}")
    o.expect(bool(ok), f"the views did not catch up with {top} within 120 s")
