"""One scheduler per pool: pools spread over scheduler processes, one leader each, and the
survivor takes a killed process's pools."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from bus.leader import LeaderElection
from bus.local.server import NatsServer
from client.api import PoolClient
from tests.control_plane import lease_body, node_body, setup_pool
from workers.plane import ControlPlane, holder_pid
from workers.pool_leaders import assigned, pool_election_name

POOLS = ("p1", "p2", "p3", "p4")
TTL = 1.0


def _wait(pred: Callable[[], bool], timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.1)
    return False


def test_pools_are_dealt_round_the_members_evenly() -> None:
    dealt = assigned(["p3", "p1", "p4", "p2", "p5"], ["b", "a"])
    assert dealt == {"p1": "a", "p2": "b", "p3": "a", "p4": "b", "p5": "a"}
    assert assigned(POOLS, []) == {}


@pytest.fixture()
def commands(fresh_nats: NatsServer) -> Iterator[ControlPlane]:
    cp = ControlPlane(fresh_nats.url, run_scheduler=False, data_plane=False).start()
    yield cp
    cp.stop()


def _scheduler(url: str, home: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "POOL_HOME": str(home), "POOL_DATABASE_URL": ""}
    return subprocess.Popen(
        [sys.executable, "-m", "cli.main", "serve", "--role", "scheduler", "--nats-url", url,
         "--leader-ttl", str(TTL)],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _leaders(url: str) -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for pool in POOLS:
        observer = LeaderElection(url, name=pool_election_name(pool), holder_id="observer",
                                  ttl_seconds=TTL)
        record = observer.current_leader()
        out[pool] = None if record is None else str(record.get("holder"))
    return out


def _shares(url: str) -> list[int]:
    """How many pools each leading process leads, fewest first."""
    by_pid: dict[int | None, int] = {}
    for holder in _leaders(url).values():
        pid = holder_pid(holder)
        by_pid[pid] = by_pid.get(pid, 0) + 1
    return sorted(by_pid.values())


def _all_placed(alpha: PoolClient, key: str) -> bool:
    ids = [alpha.request_lease(lease_body(f"{key}-{p}", pool=p))["lease"]["lease_id"]
           for p in POOLS]
    return _wait(lambda: all(alpha.lease(i, "get")["lease"]["state"] == "reserved"
                             for i in ids))


def test_two_scheduler_processes_share_four_pools_and_the_survivor_takes_them_all(
        fresh_nats: NatsServer, commands: ControlPlane, tmp_path: Path) -> None:
    url = fresh_nats.url
    with PoolClient(url) as admin:
        for pool in POOLS:
            setup_pool(admin, pool)
            assert admin.admin("node.register", node_body(f"n-{pool}", pool))["ok"]
    procs = [_scheduler(url, tmp_path / f"s{i}") for i in range(2)]
    try:
        pids = {p.pid for p in procs}
        # each pool one leader, and both processes lead their share
        assert _wait(lambda: {holder_pid(h) for h in _leaders(url).values()} == pids), \
            _leaders(url)
        # and their shares even out: the second process may first lead one pool while the
        # first still holds three, until the first hands one over
        assert _wait(lambda: _shares(url) == [2, 2]), _leaders(url)
        with PoolClient(url, "alpha") as alpha:
            assert _all_placed(alpha, "before")
            # one process dies without a word: its pools go to the other within a few TTLs
            victim = procs[0]
            victim.send_signal(signal.SIGKILL)
            victim.wait(10)
            survivor = procs[1].pid
            started = time.monotonic()
            assert _wait(lambda: all(holder_pid(h) == survivor
                                     for h in _leaders(url).values())), _leaders(url)
            takeover = time.monotonic() - started
            assert _all_placed(alpha, "after")
        assert takeover < 10 * TTL
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
