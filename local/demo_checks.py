"""The demo's verdict: each check judged from the leases and the log (fair share, decisions,
the credit audit), and the report that says what happened and where to look next."""

from __future__ import annotations

import time
from typing import Any

from local.demo_stage import POOL, TENANTS, Tracked
from local.demo_story import Story


class Checks(Story):
    """The judgement of one run, after its story."""

    def judge(self) -> None:
        c = self.checks
        if self.impossible is not None:
            why = self.clients["globex"].lease(self.impossible.lease_id, "why").get(
                "result") or {}
            lease = self.get(self.impossible)
            c["unsatisfiable"].ok = lease.get("state") == "rejected"
            c["unsatisfiable"].detail = (f"{lease.get('rejection_code')}: "
                                         f"{why.get('reasons', {})}")[:200]
        if self.to_cancel is not None:
            st = self.get(self.to_cancel).get("state")
            c["cancellation"].ok = st == "cancelled"
            c["cancellation"].detail = (f"running → stopping → {st} "
                                        f"({self.get(self.to_cancel).get('end_reason')})")
        if self.quiet is not None:
            lease = self.get(self.quiet)
            c["silent_agent"].ok = (lease.get("state") == "released"
                                    and lease.get("end_reason") in ("heartbeat_lost",
                                                                    "node_lost"))
            c["silent_agent"].detail = (f"expired ({lease.get('end_reason')}) → reconciling "
                                        f"→ {lease.get('state')}, capacity held until then")
        # a victim counts once it was requeued and its next placement really ran: started
        # again and not lost (its heartbeats kept the new epoch alive)
        again = [self.get(v) for v in self.victims]
        preempted = [v for v in again if (v.get("attempts") or 1) > 1
                     and v.get("epoch", 1) > 1 and v.get("started_at")
                     and v.get("end_reason") not in ("heartbeat_lost", "node_lost")]
        urgent: Tracked | None = getattr(self, "high", None)
        high = self.get(urgent) if urgent else {}
        c["preemption"].ok = bool(preempted) and high.get("end_reason") == "succeeded"
        c["preemption"].detail = (f"{len(preempted)} preemptible lease(s) noticed, given 2 s "
                                  f"grace, requeued and running again (attempt "
                                  f"{max([v.get('attempts') or 1 for v in again] or [1])}); "
                                  f"the high-priority lease {high.get('state')} "
                                  f"({high.get('end_reason')})")
        owner: Tracked | None = getattr(self, "owner", None)
        mine = self.get(owner) if owner else {}
        taken = [b for b in (self.get(t) for t in getattr(self, "borrowers", []))
                 if b.get("state") == "preempted"]
        borrowed = ((getattr(self, "reclaim_why", None) or {}).get("quota", {})
                    .get("borrowed_by", {}).get("globex", {}))
        lent = ",".join(f"{d}={v}" for d, v in borrowed.items())
        c["reclaim"].ok = (bool(taken) and mine.get("started_at") is not None
                           and mine.get("end_reason") == "succeeded")
        c["reclaim"].detail = (f"globex borrowed {lent or 'half the lab'} of acme's quota; "
                               f"acme's request preempted {len(taken)} borrower lease(s) "
                               f"(reclaiming_quota, 2 s grace) and ran: {mine.get('state')} "
                               f"({mine.get('end_reason')})")
        # the urgent lease was bound to the HPC node's eight GPUs by id (`pool lease get`)
        devices = list(high.get("devices") or ())
        c["gpu_devices"].ok = len(set(devices)) == 8
        c["gpu_devices"].detail = (f"the urgent lease held {len(set(devices))} GPU devices of "
                                   f"{high.get('node_id')}: {', '.join(devices[:2])}, …")
        gang_lead: Tracked | None = getattr(self, "gang", None)
        members = ((self.get(gang_lead).get("gang") or {}).get("members") or []
                   if gang_lead else [])
        self.gang_members = members
        bound = [m for m in members if len(set(m.get("devices") or ())) == 8]
        c["gang"].ok = (len(members) == 2 and len(bound) == 2
                        and len({m.get("node_id") for m in members}) == 2
                        and self.get(gang_lead or Tracked("", "acme", None)).get(
                            "end_reason") == "succeeded")
        c["gang"].detail = ("a 2-node gang (same rack) reserved in one save, committed "
                            "together: " + "; ".join(
                                f"member {m.get('member')} {m.get('state')} on "
                                f"{m.get('node_id')} with {len(m.get('devices') or ())} GPUs"
                                for m in members))
        why = getattr(self, "credit_why", {}) or {}
        reasons = why.get("reasons", {})
        c["out_of_credit"].ok = "insufficient_credits" in str(reasons)
        c["out_of_credit"].detail = f"initech waits: {reasons}"[:200]
        if self.sandboxed:
            done = [self.get(t) for t in self.sandboxed]
            c["real_sandbox"].ok = all(d.get("state") == "released" and d.get("exit_code") == 0
                                       for d in done)
            c["real_sandbox"].detail = (f"{len(done)} jobs ran under bubblewrap as uid 65534 on "
                                        f"local-1, exit codes {[d.get('exit_code') for d in done]}")

    def judge_fair_share(self, app: Any) -> None:
        """Fair share, judged from the log: every placement in the flood's pool made while
        acme and globex both waited must go to the one further below its weighted dominant
        share. Counted in placements (the flood's size sets how many), not sampled in time."""
        from projections.fair_share import check_fair_share, records_from_log

        fair = self.fair = check_fair_share(records_from_log(app, POOL), TENANTS,
                                            tenants=("acme", "globex"))
        need = self.min_contended()
        c = self.checks["fair_share"]
        c.ok = fair.ok(minimum=need)
        c.detail = fair.describe() + (f"; {len(fair.violations)} not: {fair.violations[0]}"
                                      if fair.violations else "")
        if fair.contended < need:
            c.detail += f"; too few to judge (want {need})"

    def judge_decisions(self, app: Any) -> None:
        """`pool audit decisions` over the whole log: every pool's placements sound."""
        from projections.decisions import audit_decisions

        found = audit_decisions(app)
        c = self.checks["decisions"]
        c.ok = found.ok
        bad = [f"{k}: {v[0]}" for k, v in found.violations.items() if v]
        c.detail = ("; ".join(f"{k} {s}" for k, s in found.checks.items()) if not bad
                    else f"{len(bad)} check(s) failed, first {bad[0]}")[:240]

    def min_contended(self) -> int:
        """Contended placements the fair-share check needs: a tenth of the flood (the rest
        fill the zone or drain after one tenant's requests are all placed)."""
        return max(5, self.flood // 10)

    def audit(self) -> None:
        from projections.audit import audit_credits
        from projections.summary import Summary
        from workers.bootstrap import PlaneConfig, Role, build

        app = build(PlaneConfig(self.url), {Role.LOG}).log
        assert app is not None
        summary = Summary(self.emb.database_url)
        try:
            last = app.recorder.max_notification_id() or 0
            deadline = time.monotonic() + 20  # let the views catch up before cross-checking
            while time.monotonic() < deadline and summary.position() < last:
                time.sleep(0.3)
            report = audit_credits(app, database_url=self.emb.database_url)
            self.judge_fair_share(app)
            self.judge_decisions(app)
        finally:
            summary.close()
            app.close()
        self.audit_lines = report.lines()
        self.checks["audit"].ok = report.ok
        self.checks["audit"].detail = self.audit_lines[-1] if self.audit_lines else ""

    def report(self) -> None:
        say = self.say
        say("")
        say("credit audit (replayed from the JetStream log, cross-checked with the views):")
        for line in self.audit_lines[-3:]:
            say(f"  {line}")
        say("")
        say("fair share under contention (32-core jobs flooding zone z1), from the log:")
        fair = self.fair
        say(f"  {'tenant':<8} {'weight':>6} {'placements':>10} {'mean weighted share':>20}")
        for t, w in TENANTS.items():
            if fair is not None and t in fair.tenants:
                say(f"  {t:<8} {w:>6.0f} {fair.by_tenant.get(t, 0):>10} "
                    f"{fair.mean_share(t):>20.3f}")
        say("  (each placement made while both waited; initech is capped by its credits: it "
            "ran out, see below)")
        if self.unanswered:
            say(f"  the plane left {len(self.unanswered)} command(s) unanswered in time, first: "
                f"{self.unanswered[0]} (see {self.home / 'logs'})")
        say("")
        say("what happened:")
        for c in self.checks.values():
            say(f"  {'✓' if c.ok else '✗'} {c.name:<14} {c.detail}")
        say("")
        imp = self.impossible.lease_id if self.impossible else "ID"
        say("where to look next:")
        say(f"  {self.dashboard}")
        say(f"  pool demo --keep, then in another terminal (POOL_HOME={self.home}):")
        say(f"    pool lease why {imp} --tenant globex     # why it was rejected")
        if self.gang is not None:
            say(f"    pool lease get {self.gang.lease_id} --tenant acme   # the gang: every "
                "member, its node and devices")
            for m in getattr(self, "gang_members", []):
                devices = list(m.get("devices") or ())
                say(f"      member {m.get('member')}  {m.get('node_id')}  "
                    f"{', '.join(devices[:2])}, … ({len(devices)} devices)")
        say("    pool telemetry follow --since 5m           # startup, utilization, exits")
        say("    pool queue; pool capacity; pool balance; pool audit credits")
