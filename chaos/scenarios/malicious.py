"""Fault scenario 9: a malicious tenant with only its own credentials, beside tenants that work.
Judged from the log: nothing foreign in it, every normal command answered, no double placement.
"""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from chaos.harness import ROOT, Outcome, Workspace, lease_body, must, node_body
from chaos.hostile import count_foreign, flood_connections, publish_raw
from domain.gang import MAX_GANG_MEMBERS
from schemas.v1 import MAX_LEASES_PER_REQUEST

NORMAL = ("beta", "gamma")
# reply subjects aimed at every stream and KV, the JetStream API, others' inboxes and prefixes
# that only look like the tenant's own
REPLY_TARGETS = ("pool.evt.pool.{r}", "pool.evt.account.{r}", "pool.trk.{r}",
                 "pool.sched.lease.{r}", "pool.due.lease.{r}", "pool.agent.n0.start",
                 "pool.agent.{r}.preempt", "pool.tel.p1.n0.beta.{r}.usage",
                 "$KV.pool_leader.scheduler", "$KV.{r}.x", "$JS.API.STREAM.DELETE.POOL_EVENTS",
                 "$JS.API.STREAM.PURGE.POOL_AGENT", "$JS.API.CONSUMER.CREATE.POOL_SCHED.{r}",
                 "_INBOX.t.beta.{r}", "_INBOX.n.n0.{r}", "_INBOX.a.operator.{r}", "_INBOX.{r}",
                 "_INBOX.t.alphax.{r}", "_INBOX.t.alpha", "pool.feed.beta.lease.{r}",
                 "pool.feedlive.beta.lease.{r}", "pool.lead.p1.why", "pool.lead.p1.queue",
                 "pool.lead.p1.shares", "pool.ops.pool.shares",
                 "$JS.API.DIRECT.GET.POOL_FEED", "pool.snap.pool.{r}",
                 "$JS.API.DIRECT.GET.POOL_SNAPSHOTS.pool.snap.pool.{r}",
                 "$JS.API.DIRECT.GET.POOL_TEL_beta")
# subjects outside its own: the server refuses them before any service sees them
FOREIGN_SUBJECTS = ("pool.cmd.beta.lease.request", "pool.node.n0.register", "pool.admin.pool.set",
                    "pool.evt.account.{r}", "pool.agent.n0.start", "pool.sched.lease.{r}",
                    "$KV.pool_leader.scheduler", "$JS.API.STREAM.LIST", "{r}.{r}",
                    "pool.lead.p1.why", "pool.lead.p1.queue", "pool.lead.p1.shares",
                    "pool.ops.pool.shares", "pool.feed.beta.lease.{r}",
                    "pool.feedlive.beta.lease.{r}", "pool.cmd.beta.feed.replay",
                    "$JS.API.DIRECT.GET.POOL_FEED", "pool.snap.pool.{r}",
                    "$JS.API.DIRECT.GET.POOL_SNAPSHOTS.pool.snap.pool.{r}",
                    "$JS.API.STREAM.MSG.GET.POOL_SNAPSHOTS", "$JS.API.DIRECT.GET.POOL_TEL_beta",
                    "$JS.API.STREAM.INFO.POOL_TEL_beta")
OWN_VERBS = ("lease.request", "lease.{r}.get", "lease.{r}.release", "lease.{r}.commit",
             "telemetry.replay", "query.queue", "lease.{r}.why", "feed.replay", "queue")
# what it subscribes to while it floods: others' feeds, the leaders' questions, snapshots,
# others' inboxes
LISTEN = ("pool.feedlive.beta.>", "pool.feedlive.>", "pool.feed.>", "pool.lead.>",
          "pool.ops.>", "pool.snap.>", "_INBOX.t.beta.>", ">")
# batch and gang sizes, mostly out of range, and keys that are the normal tenants' own
COUNTS = (0, -1, MAX_LEASES_PER_REQUEST + 1, 10**9, 2**63, "3", 2, 3)
GANGS = (0, -1, MAX_GANG_MEMBERS + 1, 10**6, 2)


def _pool(ws: Workspace, *args: str) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-m", "cli.main", *args, "--json"],
                         capture_output=True, text=True, env=ws.env(), timeout=60, cwd=ROOT,
                         check=False)
    lines = out.stdout.strip().splitlines()
    return json.loads(lines[-1]) if lines else {"ok": False, "error": {"code": "no_output",
                                                                      "message": out.stderr}}


def _attacks(creds: dict[str, Any], attacks: int, seed: int) -> list[tuple[str, bytes, str]]:
    """`attacks` messages of the malicious tenant: its own subjects with replies aimed
    elsewhere, and subjects outside its own."""
    rnd = random.Random(seed)
    out: list[tuple[str, bytes, str]] = []
    for i in range(attacks):
        r = f"x{i}"
        body = json.dumps(lease_body(f"evil-{i}")).encode()
        roll = rnd.random()
        if roll < 0.1:  # batches and gangs, answered in its own inbox
            key = rnd.choice((f"evil-{i}", f"{rnd.choice(NORMAL)}-{i % 5}"))
            size: dict[str, Any] = ({"count": rnd.choice(COUNTS)} if rnd.random() < 0.5 else
                                    {"group": {"members": rnd.choice(GANGS)}})
            out.append(("pool.cmd.alpha.lease.request",
                        json.dumps({**lease_body(key, cpu_millis=100), **size}).encode(),
                        f"{creds['inbox_prefix']}.{r}"))
        elif roll < 0.7:
            subject = "pool.cmd.alpha." + rnd.choice(OWN_VERBS).format(r=r)
            out.append((subject, body, rnd.choice(REPLY_TARGETS).format(r=r)))
        else:
            out.append((rnd.choice(FOREIGN_SUBJECTS).format(r=r), body,
                        f"{creds['inbox_prefix']}.{r}"))
    return out


def run(ws: Workspace, size: dict[str, Any], o: Outcome) -> None:
    """`pool up` with users; tenant alpha floods its own and others' subjects with crafted reply
    subjects, then opens connections past its cap, and tries colliding names while beta and
    gamma request leases."""
    from bus.caps import Caps
    from bus.local.auth import url_with_credentials
    from client.api import PoolClient
    from local.embedded import tenant_credentials
    from projections.decisions import check_placements

    up = ws.spawn("up", "up", "--no-postgres", "--http", "off")  # NATS is the surface here
    up.wait_ready("ready:")
    endpoints = json.loads((ws.home / "endpoints.json").read_text())
    nats_url = str(endpoints["nats_url"])
    service_url = str(endpoints.get("service_url") or nats_url)
    ws.urls.add(service_url)
    must(_pool(ws, "admin", "pool", "create", "p1", "--priority-classes", "standard=10"))
    admin = ws.client(service_url)
    for i in range(int(size["nodes"])):
        must(admin.admin("node.register", node_body(f"n{i}")))
    for t in ("alpha", *NORMAL):
        must(_pool(ws, "admin", "tenant", "set", t, "--pool", "p1"))
        must(_pool(ws, "credits", "grant", t, "1000000000000"))
    alpha = must(_pool(ws, "admin", "tenant", "creds", "alpha"))["result"]
    # colliding names: another spelling of a tenant, a node named like a tenant's user
    collisions = [_pool(ws, "admin", "tenant", "creds", name) for name in ("Beta", "be.ta")]
    o.figures["collisions_refused"] = sum(
        (c.get("error") or {}).get("code") == "name_collision" for c in collisions)
    o.expect(o.figures["collisions_refused"] == len(collisions),
             f"a colliding name was accepted: {collisions}")

    attacks = int(size["attacks"])
    result: dict[str, Any] = {}

    cap = Caps.from_env(ws.env()).max_connections

    def attack() -> None:
        result.update(asyncio.run(publish_raw(
            nats_url, _attacks(alpha, attacks, seed=9), user=alpha["user"],
            password=alpha["password"], inbox_prefix=str(alpha["inbox_prefix"]),
            listen=LISTEN)))
        result["kept"] = asyncio.run(flood_connections(
            nats_url, cap * 2, user=alpha["user"], password=alpha["password"]))

    flood = threading.Thread(target=attack, name="chaos-malicious")
    flood.start()

    def work(tenant: str) -> list[dict[str, Any]]:
        creds = tenant_credentials(tenant, ws.home)
        assert creds is not None
        with PoolClient(url_with_credentials(nats_url, creds), tenant, timeout=30) as c:
            out = [c.request_lease(lease_body(f"{tenant}-{k}", cpu_millis=500))
                   for k in range(int(size["leases"]))]
            # its own queue and feed: answered, and only its own
            out.append(c.queue_positions())
            feed = c.call(f"pool.cmd.{tenant}.feed.replay", {})
            records = (feed.get("result") or {}).get("records") or []
            if any((r.get("record") or {}).get("tenant") != tenant for r in records):
                feed = {"ok": False, "error": {"code": "foreign_feed_record"}}
            out.append(feed)
            return out

    with ThreadPoolExecutor(len(NORMAL)) as pool:
        answers = [r for rs in pool.map(work, NORMAL) for r in rs]
    flood.join(600)
    o.figures["attacks"] = attacks
    o.figures["server_refused"] = result.get("refused", 0)
    o.zero("foreign_reads", result.get("heard", 0))
    o.figures["connections_kept"] = result.get("kept", -1)
    o.expect(result.get("kept") == cap, f"alpha opened {cap * 2} connections and kept "
             f"{result.get('kept')}, its cap is {cap}")
    o.figures["normal_commands"] = len(answers)
    o.zero("normal_unanswered", sum(not a.get("ok") for a in answers),
           str([a.get("error") for a in answers if not a.get("ok")][:3]))
    judged = asyncio.run(count_foreign(service_url))
    o.zero("foreign_messages", judged["foreign_messages"])
    o.figures["log_messages"] = judged["log_messages"]
    log = ws.log_reader(service_url)
    o.zero("double_placements", check_placements(log).double_placements)
