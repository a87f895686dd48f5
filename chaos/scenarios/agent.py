"""Fault scenario 6: an agent stopped past its grace; its leases reconciled, no job ran twice."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections import Counter
from functools import partial
from typing import Any

from chaos.harness import ROOT, Outcome, Workspace, lease_body, must, wait_for

# -- 6. agent stopped past its lease's grace --------------------------------------------------------


def scenario_agent_stopped(ws: Workspace, size: dict[str, Any], o: Outcome) -> None:
    """`pool up` with users, `pool agent run` as its node: committed leases run sandboxed
    workloads; SIGSTOP the agent past the heartbeat timeout, SIGCONT it. No heartbeat may be
    recorded after a lease expired, and no workload may start twice."""
    from agents.runtimes.process import ProcessRuntime
    from projections.replay import event_name, notifications

    why = ProcessRuntime(ws.dir / "probe").available()
    if why is not None:
        o.skipped = f"process runtime unavailable ({why})"
        return
    up = ws.spawn("up", "up", "--no-postgres")
    up.wait_ready("ready:")
    endpoints = json.loads((ws.home / "endpoints.json").read_text())
    service_url = str(endpoints.get("service_url") or endpoints["nats_url"])
    ws.urls.add(service_url)

    def pool(*args: str) -> dict[str, Any]:
        out = subprocess.run([sys.executable, "-m", "cli.main", *args, "--json"],
                             capture_output=True, text=True, env=ws.env(), timeout=60, cwd=ROOT,
                             check=False)
        lines = out.stdout.strip().splitlines()
        return json.loads(lines[-1]) if lines else {"ok": False, "error": {"code": "no_output",
                                                                          "message": out.stderr}}

    must(pool("admin", "pool", "create", "p1", "--priority-classes", "standard=10",
               "--heartbeat-timeout", "2", "--node-timeout", "600"))
    must(pool("admin", "tenant", "set", "acme", "--pool", "p1"))
    must(pool("credits", "grant", "acme", "1000000000000"))
    # the operator enrolls the node before its agent may register
    must(pool("admin", "node", "creds", "n1", "--pool", "p1", "--trust", "trusted"))
    state = ws.home / "agents" / "n1"
    agent = ws.spawn("agent", "agent", "run", "--node-id", "n1", "--pool", "p1",
                     "--heartbeat-interval", "0.5", "--reserve-memory-mib", "0")
    agent.wait_ready("agent n1 in pool p1")
    log = ws.log_reader(service_url)
    leases: list[str] = []
    stale_refused = 0
    # the tenant's own user, as `--tenant acme` commands connect
    from bus.local.auth import url_with_credentials
    from local.embedded import tenant_credentials

    creds = tenant_credentials("acme", ws.home)
    assert creds is not None
    acme = ws.client(url_with_credentials(str(endpoints["nats_url"]), creds), "acme")

    def lease_state(lid: str) -> str:
        return str((acme.lease(lid, "get").get("lease") or {}).get("state"))

    def started() -> dict[str, Any]:
        try:
            out: dict[str, Any] = json.loads((state / "started.json").read_text())
            return out
        except (OSError, ValueError):
            return {}

    def all_in(state: str, lids: list[str]) -> bool:
        return all(lease_state(lid) == state for lid in lids)

    def all_started(lids: list[str]) -> bool:
        on_disk = started()
        return all(any(k.startswith(lid) for k in on_disk) for lid in lids)

    for r in range(int(size["rounds"])):
        batch = []
        for k in range(int(size["leases"])):
            body = lease_body(f"k{r}-{k}", cpu_millis=200, memory_mib=64)
            body["shape"]["runtime"] = "sandboxed"
            batch.append(must(acme.request_lease(body))["lease"]["lease_id"])
        for lid in batch:
            if not wait_for(partial(all_in, "reserved", [lid]), 30, 0.2):
                o.problems.append(f"lease {lid} was not reserved within 30 s")
                return
            must(acme.lease(lid, "commit", {"job": {
                "image": "local/job@sha256:" + "b" * 64, "command": ["sleep", "300"]}}))
        if not wait_for(partial(all_started, batch),
                        30, 0.2):
            o.problems.append("the workloads did not start within 30 s")
            return
        agent.signal(signal.SIGSTOP)
        if not wait_for(partial(all_in, "reconciling", batch), 40,
                        0.3):
            o.problems.append("stopped agent's leases were not expired into reconciling")
        # the tenant's own late heartbeat must be refused too
        for lid in batch:
            hb = acme.lease(lid, "heartbeat", {"epoch": 1})
            stale_refused += not hb.get("ok")
        time.sleep(1.0)  # longer past the grace
        agent.signal(signal.SIGCONT)
        if not wait_for(partial(all_in, "released", batch), 40, 0.3):
            o.problems.append("leases were not released after the agent came back")
        leases += batch
    agent.stop()
    expired_at: dict[str, int] = {}
    stale = 0
    starts: Counter[str] = Counter()
    for n in notifications(log):
        name, lid = event_name(n.topic), str(n.originator_id)
        if lid not in leases:
            continue
        if name == "LeaseExpired":
            expired_at.setdefault(lid, n.id)
        elif name == "HeartbeatRecorded" and lid in expired_at:
            stale += 1
        elif name == "JobStarted":
            starts[lid] += 1
    on_disk = started()
    twice = sum(1 for lid in leases
                if len([k for k in on_disk if k.startswith(lid)]) > 1 or starts[lid] > 1)
    o.figures.update(leases=len(leases), expired=len(expired_at),
                     stale_heartbeats_refused=stale_refused)
    o.zero("stale_heartbeats_accepted", stale)
    o.zero("workloads_run_twice", twice)
    left = list((state / "process").glob("*.json")) if (state / "process").exists() else []
    o.zero("workloads_left_running", len([p for p in left if any(p.name.startswith(x)
                                                                   for x in leases)]))
    o.expect(len(expired_at) == len(leases),
             f"{len(expired_at)} of {len(leases)} leases expired while the agent was stopped")
