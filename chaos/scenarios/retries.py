"""Fault scenario 5: every command retried with its idempotency key; each took effect once."""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from typing import Any

from bus.errors import BusError
from chaos.harness import Outcome, Workspace, error_code, lease_body, lease_id_for, setup_pool

# -- 5. idempotent retries ----------------------------------------------------------------------------


def scenario_idempotent_retries(ws: Workspace, size: dict[str, Any], o: Outcome) -> None:
    """Every command sent three times with the same key, each with a random client timeout
    (some expire before the reply, while the service is still applying it); the log must hold
    each effect at most once, and every acknowledged one."""
    from projections.decisions import count_events

    url = ws.nats().url
    ws.serve(url, name="serve")
    ws.serve(url, name="serve")  # two command handlers in one queue group: retries race
    admin = ws.client(url)
    tenants = ["alpha", "beta"]
    setup_pool(admin, tenants, nodes=2)
    log = ws.log_reader(url)
    rng = random.Random(5)
    lock = threading.Lock()
    requests = [0]
    acked: set[tuple[str, str]] = set()
    answers: dict[tuple[str, str], set[str]] = {}
    cancellable: list[tuple[str, str]] = []
    errors: Counter[str] = Counter()

    def one(i: int, clients: dict[str, Any]) -> None:
        t = tenants[i % 2]
        kind = rng.choices(("request", "grant", "cancel"), (5, 3, 2))[0]
        with lock:
            if kind == "cancel" and not cancellable:
                kind = "request"
            target = cancellable.pop(rng.randrange(len(cancellable))) if kind == "cancel" \
                else None
        if kind == "request":
            key = ("LeaseRequested", lease_id_for(t, f"r{i}"))
            subject, body, c = f"pool.cmd.{t}.lease.request", lease_body(f"r{i}"), clients[t]
        elif kind == "grant":
            key = ("CreditsGranted", f"g{i}")
            subject, c = "pool.admin.credits.grant", clients[""]
            body = {"tenant": t, "amount_microcredits": 1000 + i, "transfer_id": f"g{i}"}
        else:
            assert target is not None
            t, lid = target
            key = ("LeaseCancelled", lid)
            subject, body, c = f"pool.cmd.{t}.lease.{lid}.cancel", {"reason": "chaos"}, \
                clients[t]
        for _ in range(3):
            with lock:
                requests[0] += 1
            try:
                # half give up before a reply can come, while the service is still applying
                timeout = rng.uniform(0.001, 0.03) if rng.random() < 0.5 else \
                    rng.uniform(0.03, 1.0)
                r = c.call(subject, body, timeout=timeout)
            except BusError as e:
                with lock:
                    errors[error_code(e)] += 1
                continue
            with lock:
                if r.get("ok"):
                    acked.add(key)
                    if kind == "request":
                        lid = r["lease"]["lease_id"]
                        if key not in answers:
                            cancellable.append((t, lid))
                        answers.setdefault(key, set()).add(lid)
                else:
                    errors[str((r.get("error") or {}).get("code"))] += 1

    def worker(ids: list[int]) -> None:
        clients = {t: ws.client(url, t, timeout=5) for t in tenants}
        clients[""] = ws.client(url, timeout=5)
        for i in ids:
            one(i, clients)

    n, threads = int(size["commands"]), int(size["threads"])
    pool = [threading.Thread(target=worker, args=(list(range(k, n, threads)),), daemon=True)
            for k in range(threads)]
    for th in pool:
        th.start()
    for th in pool:
        th.join(600)
    time.sleep(1.0)  # the last attempts' effects land (their clients gave up waiting)
    effects = count_events(log, {"LeaseRequested", "LeaseCancelled"})
    grants = count_events(log, {"CreditsGranted"}, key="transfer_id")
    grants = Counter({k: v for k, v in grants.items() if not k[1].startswith("initial-")})
    both = effects + grants
    dup = sum(c - 1 for c in both.values() if c > 1)
    lost = [k for k in acked if both.get(k, 0) == 0]
    o.figures.update(commands=n, requests=requests[0], effects=len(both), acked=len(acked))
    o.zero("duplicate_effects", dup)
    o.zero("lost", len(lost), ", ".join(map(str, lost[:3])))
    o.zero("lease_ids_diverged", sum(1 for ids in answers.values() if len(ids) > 1))
    o.figures["errors"] = dict(errors)
    o.expect(len(both) > 0, "no command took effect")
