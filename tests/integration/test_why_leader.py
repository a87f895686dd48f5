"""`why`, queue positions and fair shares for a pool another scheduler process leads: answered
with that leader's, asked on `pool.lead.<pool>.<verb>`."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from bus.errors import BusTimeout, BusUnavailable
from bus.lead import LeadDesk
from bus.leader import LeaderElection
from bus.local.server import NatsServer
from bus.runtime import BusRuntime
from bus.service import Client
from bus.subjects import lead_subject
from client.api import PoolClient
from tests.control_plane import FakeClock, lease_body, node_body, setup_pool, start
from workers.plane import ControlPlane
from workers.pool_leaders import pool_election_name
from workers.why import lead_answers, why_handler

POOLS = ("p1", "p2")
TTL = 1.0
ASKS = 12  # each answered by either process: all twelve from one is a chance of 1 in 2,048


def _wait(pred: Callable[[], bool], timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.1)
    return False


def test_a_desk_answers_only_for_the_pools_it_serves(fresh_nats: NatsServer) -> None:
    rt = BusRuntime(fresh_nats.url)
    desk = LeadDesk(rt, lambda pool, verb, body: f"{pool}:{verb}:{body.decode()}".encode(),
                    timeout=0.3)
    try:
        assert desk.ask("p1", "why", b"q") is None  # nobody leads p1 here yet
        desk.serve("p1")
        assert desk.ask("p1", "why", b"q") == b"p1:why:q"
        assert desk.ask("p2", "why", b"q") is None
        # a reply subject outside every inbox is not answered
        with (Client(fresh_nats.url, inbox_prefix=b"pool.evt.x") as hostile,
              pytest.raises(BusTimeout)):
            hostile.request(lead_subject("p1", "why"), b"q", timeout=0.3)
        assert desk.answered == 1
        desk.serve("p1", False)
        assert desk.ask("p1", "why", b"q") is None
    finally:
        desk.close()
        rt.close()


def test_with_no_answer_from_the_leader_a_process_gives_its_own_marked_stale(
        fresh_nats: NatsServer) -> None:
    cp = start(fresh_nats.url, FakeClock())  # its scheduler cycled by hand
    desk = LeadDesk(fresh_nats.url, lambda *_: b"", timeout=0.2)  # leads no pool
    try:
        with PoolClient(fresh_nats.url) as admin, PoolClient(fresh_nats.url, "alpha") as alpha:
            setup_pool(admin)
            assert admin.admin("node.register", node_body("n1", cpu_millis=2000))["ok"]
            alpha.request_lease(lease_body("fill", cpu_millis=2000))
            cp.scheduler.cycle()
            lid = alpha.request_lease(lease_body("wait", cpu_millis=2000))["lease"]["lease_id"]
            cp.scheduler.cycle()
        cp.scheduler.leads = lambda _pool: False  # another process leads p1, and is silent
        handle = why_handler(cp.scheduler, desk)
        why = json.loads(handle(f"pool.cmd.alpha.lease.{lid}.why", b"{}", {}))
        assert why["ok"] and why["result"]["stale"] is True, why
        assert why["result"]["reasons"]["filters"] == {"insufficient_cpu": 1}
        queue = json.loads(handle("pool.cmd.alpha.queue", b"{}", {}))
        assert [(r["lease_id"], r["stale"]) for r in queue["result"]["leases"]] == [(lid, True)]
    finally:
        desk.close()
        cp.stop()


def test_queue_positions_ask_every_other_pools_leader_at_once(fresh_nats: NatsServer) -> None:
    cp = start(fresh_nats.url, FakeClock())  # its scheduler cycled by hand
    waiting = {}
    with PoolClient(fresh_nats.url) as admin, PoolClient(fresh_nats.url, "alpha") as alpha:
        for pool in POOLS:
            setup_pool(admin, pool)
            assert admin.admin("node.register",
                               node_body(f"n-{pool}", pool, cpu_millis=2000))["ok"]
            alpha.request_lease(lease_body(f"fill-{pool}", pool, cpu_millis=2000))
            cp.scheduler.cycle()
            waiting[pool] = alpha.request_lease(
                lease_body(f"wait-{pool}", pool, cpu_millis=2000))["lease"]["lease_id"]
        cp.scheduler.cycle()
    cp.scheduler.leads = lambda _pool: False  # another process leads both pools
    # that process answers a question only while the other pool's is in flight too: asked one
    # pool after the other, the first answer never comes and both rows are marked stale
    both = threading.Barrier(len(POOLS), timeout=3.0)
    answer = lead_answers(cp.scheduler)

    def together(pool: str, verb: str, body: bytes) -> bytes:
        both.wait()
        return answer(pool, verb, body)

    leader_rt, asker_rt = BusRuntime(fresh_nats.url), BusRuntime(fresh_nats.url)
    leader = LeadDesk(leader_rt, together, timeout=5.0, threads=len(POOLS))
    asker = LeadDesk(asker_rt, lambda *_: b"", timeout=5.0)
    try:
        for pool in POOLS:
            leader.serve(pool)
        handle = why_handler(cp.scheduler, asker)
        rows = json.loads(handle("pool.cmd.alpha.queue", b"{}", {}))["result"]["leases"]
        assert [(r["pool"], r["lease_id"], r.get("stale")) for r in rows] == [
            (pool, lid, None) for pool, lid in waiting.items()], rows
        assert leader.answered == len(POOLS)
    finally:
        leader.close()
        asker.close()
        leader_rt.close()
        asker_rt.close()
        cp.stop()


def test_a_pools_shares_are_its_leaders_or_this_processs_own_marked_stale(
        fresh_nats: NatsServer) -> None:
    cp = start(fresh_nats.url, FakeClock())  # its scheduler cycled by hand
    with PoolClient(fresh_nats.url) as admin:
        setup_pool(admin, tenants={"alpha": 2.0})
    cp.scheduler.cycle()
    cp.scheduler.leads = lambda _pool: False  # another process leads p1
    leader_rt, asker_rt = BusRuntime(fresh_nats.url), BusRuntime(fresh_nats.url)
    leader = LeadDesk(leader_rt, lead_answers(cp.scheduler), timeout=2.0)
    asker = LeadDesk(asker_rt, lambda *_: b"", timeout=0.3)
    try:
        handle = why_handler(cp.scheduler, asker)

        def ask(pool: str) -> dict[str, Any]:
            got: dict[str, Any] = json.loads(handle("pool.ops.pool.shares",
                                                       json.dumps({"pool_id": pool}).encode(),
                                                       {}))
            return got

        silent = ask("p1")  # nobody answers for p1 yet: this process's own figures
        assert silent["ok"] and silent["result"]["stale"] is True, silent
        leader.serve("p1")
        led = ask("p1")
        assert led["ok"] and "stale" not in led["result"], led
        assert [r["tenant"] for r in led["result"]["tenants"]] == ["alpha"]
        assert leader.answered == 1
        assert ask("nowhere")["error"]["code"] == "unknown_pool"
        assert leader.answered == 1  # a pool no process knows is not asked about
    finally:
        leader.close()
        asker.close()
        leader_rt.close()
        asker_rt.close()
        cp.stop()


def test_a_plane_whose_scheduler_never_runs_does_not_answer_why(
        fresh_nats: NatsServer) -> None:
    # on its default roles, scheduler included: its scheduler's memory never follows the log,
    # so an answer from it would call every lease not found
    cp = ControlPlane(fresh_nats.url, run_scheduler=False, data_plane=False).start()
    try:
        with PoolClient(fresh_nats.url) as admin, PoolClient(fresh_nats.url, "alpha") as alpha:
            setup_pool(admin)
            lid = alpha.request_lease(lease_body("queued"))["lease"]["lease_id"]
            assert cp.why is None
            # no responder: nobody answers, where an answer would have been wrong
            with pytest.raises((BusUnavailable, BusTimeout)):
                alpha.call(f"pool.cmd.alpha.lease.{lid}.why", {}, timeout=1.0)
    finally:
        cp.stop()


@pytest.fixture()
def commands(fresh_nats: NatsServer) -> Iterator[ControlPlane]:
    # commands only: a plane holding the scheduler role without running it answers `why` too
    cp = ControlPlane(fresh_nats.url, roles=["commands"], data_plane=False).start()
    yield cp
    cp.stop()


def _scheduler(url: str, home: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "POOL_HOME": str(home), "POOL_DATABASE_URL": ""}
    return subprocess.Popen(
        [sys.executable, "-m", "cli.main", "serve", "--role", "scheduler", "--nats-url", url,
         "--leader-ttl", str(TTL)],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _leaders(url: str) -> set[str | None]:
    out: set[str | None] = set()
    for pool in POOLS:
        record = LeaderElection(url, name=pool_election_name(pool), holder_id="observer",
                                ttl_seconds=TTL).current_leader()
        out.add(None if record is None else str(record.get("holder")))
    return out


def test_why_and_queue_land_on_either_process_and_give_the_pool_leaders_answers(
        fresh_nats: NatsServer, commands: ControlPlane, tmp_path: Path) -> None:
    url = fresh_nats.url
    with PoolClient(url) as admin:
        for pool in POOLS:
            setup_pool(admin, pool)
            assert admin.admin("node.register",
                               node_body(f"n-{pool}", pool, cpu_millis=2000))["ok"]
    procs = [_scheduler(url, tmp_path / f"s{i}") for i in range(2)]
    try:
        # each process leads one pool, so either one is not the leader of one of them
        assert _wait(lambda: len(_leaders(url)) == 2 and None not in _leaders(url))
        with PoolClient(url, "alpha") as alpha:
            waiting = {}
            for pool in POOLS:
                full = alpha.request_lease(lease_body(f"fill-{pool}", pool, cpu_millis=2000))
                fid = full["lease"]["lease_id"]
                assert _wait(lambda fid=fid: alpha.lease(fid, "get")["lease"]["state"]
                             == "reserved")
                waiting[pool] = alpha.request_lease(
                    lease_body(f"wait-{pool}", pool, cpu_millis=2000))["lease"]["lease_id"]
            for pool, lid in waiting.items():
                # the leader has examined it once its reasons name the node that is full
                assert _wait(lambda lid=lid: "filters" in alpha.lease(lid, "why")["result"]
                             ["reasons"]), pool
                for _ in range(ASKS):
                    answer = alpha.lease(lid, "why")
                    assert answer["ok"], (pool, answer)
                    result = answer["result"]
                    assert result["reasons"].get("filters") == {"insufficient_cpu": 1}, (pool, result)
                    assert "stale" not in result
            for _ in range(ASKS):
                rows = alpha.queue_positions()["result"]["leases"]
                assert [(r["pool"], r["lease_id"], r["position"], r.get("stale")) for r in rows] \
                    == [(pool, lid, 1, None) for pool, lid in waiting.items()], rows
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
