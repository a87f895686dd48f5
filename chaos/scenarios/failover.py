"""Fault scenario 3: schedulers killed in turn while requests flow; the log shows one placement each."""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from functools import partial
from typing import Any

from bus.errors import BusError
from chaos.harness import (
    Outcome,
    Proc,
    Workspace,
    error_code,
    lease_body,
    must,
    percentile,
    setup_pool,
    wait_for,
)

# -- 3. scheduler failover -------------------------------------------------------------------------


def scenario_scheduler_failover(ws: Workspace, size: dict[str, Any], o: Outcome) -> None:
    """Two `pool serve` processes on one log; SIGKILL whichever leads, as soon as it is placing
    a burst, again and again; time until the standby places, and replay the log for capacity."""
    from bus.leader import LeaderElection
    from projections.decisions import check_gangs, check_placements, check_quotas
    from projections.replay import event_name

    ttl = float(size["leader_ttl_s"])
    url = ws.nats().url
    serves = [ws.serve(url, name="sched", leader_ttl=ttl) for _ in range(2)]
    admin = ws.client(url)
    tenants = ["alpha", "beta"]
    # GPU nodes: the replay also checks that no device is ever held by two leases at once
    setup_pool(admin, tenants, nodes=int(size["nodes"]), gpus=4)
    # the tenants share a cohort with half the GPUs each, alpha borrowing at most a quarter
    # more: the replay also checks that no placement took a tenant past its quota
    gpus = int(size["nodes"]) * 4
    must(admin.admin("cohort.set", {"pool_id": "p1", "name": "chaos"}))
    for t, extra in (("alpha", {"borrow_limit": {"gpu_count": gpus // 4}}), ("beta", {})):
        must(admin.admin("tenant.set", {"tenant": t, "pool_id": "p1", "cohort": "chaos",
                                         "nominal": {"gpu_count": gpus // 2}, **extra}))
    log = ws.log_reader(url)
    observer = LeaderElection(url, name="scheduler", holder_id="chaos-observer", ttl_seconds=ttl)
    stop = threading.Event()
    acked: dict[str, str] = {}
    unanswered = Counter[str]()
    rng = random.Random(3)

    def load() -> None:
        clients = {t: ws.client(url, t, timeout=5) for t in tenants}
        i = 0
        while not stop.is_set():
            t = tenants[i % 2]
            key = f"k{i}"
            body = lease_body(key, cpu_millis=rng.choice((500, 1000, 1500, 2000)),
                              gpu_count=rng.choice((0, 0, 1, 2)))
            if i % 10 == 9:  # a gang: its members reserved in one save or not at all
                body["group"] = {"members": 2}
            for _attempt in range(5):  # a killed process drops what it was answering: retry
                try:
                    r = clients[t].request_lease(body)
                except BusError as e:
                    unanswered[error_code(e)] += 1
                    continue
                if r.get("ok"):
                    acked[r["lease"]["lease_id"]] = t
                break
            i += 1
            stop.wait(1.0 / float(size["rate"]))

    # reserved leases are cancelled after a moment, so capacity keeps turning over
    placed_at: list[tuple[int, str, float]] = []
    position = [log.recorder.max_notification_id() or 0]

    def follow() -> None:
        while not stop.is_set():
            try:
                batch = log.recorder.select_notifications(position[0] + 1, 500)
            except BusError:
                stop.wait(0.2)
                continue
            for n in batch:
                if event_name(n.topic) == "LeaseReserved":
                    placed_at.append((n.id, str(n.originator_id), time.monotonic()))
            if batch:
                position[0] = batch[-1].id
            else:
                stop.wait(0.02)

    def cancel() -> None:
        clients = {t: ws.client(url, t, timeout=5) for t in tenants}
        done = 0
        while not stop.is_set():
            now = time.monotonic()
            due = [p for p in placed_at[done:] if now - p[2] > 0.8]
            for _nid, lid, _at in due:
                t = acked.get(lid)
                if t is not None:
                    try:
                        clients[t].lease(lid, "cancel", {"reason": "chaos"})
                    except BusError:
                        pass
            done += len(due)
            stop.wait(0.1)

    threads = [threading.Thread(target=f, daemon=True) for f in (load, follow, cancel)]
    for thread in threads:
        thread.start()

    def leader_proc() -> tuple[Proc, str] | None:
        rec = observer.current_leader(timeout=2)
        if not rec:
            return None
        for p in serves:
            if p.alive() and f"-{p.pid}-" in str(rec.get("holder")):
                return p, str(rec["holder"])
        return None

    def placed_beyond(n: int) -> bool:
        return len(placed_at) > n

    takeovers: list[float] = []
    try:
        for k in range(int(size["kills"])):
            time.sleep(rng.uniform(1.0, 2.0))
            found = wait_for(leader_proc, 20)
            if not found:
                o.problems.append(f"kill {k + 1}: no live leader within 20 s")
                break
            leader, holder = found
            # mid-cycle: kill as soon as this leader is seen placing
            seen = len(placed_at)
            wait_for(partial(placed_beyond, seen), 10, 0.01)
            t0 = time.monotonic()
            leader.kill()
            serves.remove(leader)

            def new_leader(holder: str = holder) -> bool:
                rec = observer.current_leader(timeout=2)
                return bool(rec) and rec.get("holder") != holder  # type: ignore[union-attr]

            if not wait_for(new_leader, 30, 0.02):
                o.problems.append(f"kill {k + 1}: no standby took over within 30 s")
                break
            mark = len(placed_at)
            if not wait_for(partial(placed_beyond, mark), 30, 0.01):
                o.problems.append(f"kill {k + 1}: the new leader placed nothing within 30 s")
                break
            takeovers.append(placed_at[mark][2] - t0)
            serves.append(ws.serve(url, name="sched", leader_ttl=ttl))  # the next standby
    finally:
        stop.set()
        for thread in threads:
            thread.join(15)
    for p in serves:
        p.stop()
    report = check_placements(log)
    o.figures.update(kills=len(takeovers), placements=report.placements,
                     device_placements=report.device_placements, leader_ttl_s=ttl, takeover_p50_s=round(percentile(takeovers, 50), 2),
                     takeover_p99_s=round(percentile(takeovers, 99), 2))
    o.zero("double_placements", report.double_placements,
           "; ".join((report.over_allocations + report.double_holds
                      + report.device_conflicts)[:2]))
    o.zero("foreign_devices", len(report.foreign_devices), "; ".join(report.foreign_devices[:2]))
    quotas = check_quotas(log)
    o.figures.update(quota_placements=quotas.placements)
    o.zero("quota_breaches", len(quotas.breaches), "; ".join(quotas.breaches[:2]))
    o.expect(len(takeovers) == int(size["kills"]),
             f"{len(takeovers)} of {size['kills']} takeovers measured")
    gangs = check_gangs(log)
    o.figures.update(gang_placements=gangs.placements)
    o.zero("partial_gangs", len(gangs.partial), "; ".join(gangs.partial[:2]))
    # the rest of `pool audit decisions`, its own functions: workflows, fair share, priority
    # and credits, judged over the same log
    from projections.decisions import audit_decisions

    audit = audit_decisions(log)
    for check in ("workflows", "fair_share", "priority", "credits"):
        found = audit.violations.get(check, [])
        o.zero(f"{check}_violations", len(found), "; ".join(found[:2]))
    o.expect(report.placements > 0, "nothing was placed")
    o.expect(report.device_placements > 0, "no placement was bound to GPU devices")
