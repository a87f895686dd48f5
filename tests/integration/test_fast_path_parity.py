"""The command service's half of the fast-path switch (POOL_FAST_PATHS): one table of commands
through a plane with its fast paths on and one with them off gets the same replies, stores the
same events and folds into the same aggregates; the fast path's log replays the same plainly."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from bus.local.server import NatsServer
from bus.replies import node_inbox
from client.api import PoolClient
from domain.fold import Fold, lean_paths, use_lean_paths
from projections.replay import notifications, state_of
from tests.control_plane import (
    FakeClock,
    lease_body,
    node_body,
    setup_pool,
    start,
    threaded_subjects,
)
from workers import fastpaths
from workers.plane import ControlPlane

# what differs between two runs of the same commands: when the events were made
VOLATILE = frozenset({"timestamp", "_created_on", "_modified_on", "_pending_events"})


class Clients:
    """The table's actors: the operator, a tenant, a node's agent, and the hand-driven plane."""

    def __init__(self, cp: ControlPlane, url: str, clock: FakeClock) -> None:
        self.cp, self.clock = cp, clock
        self.admin = PoolClient(url)
        self.alpha = PoolClient(url, "alpha")
        self.agent = PoolClient(url, inbox_prefix=node_inbox("n1").encode())

    def beat(self, seq: int, *leases: tuple[str, int]) -> dict[str, Any]:
        return self.agent.call("pool.node.n1.heartbeat", {
            "node_id": "n1", "seq": seq,
            "leases": [{"lease_id": lid, "epoch": epoch} for lid, epoch in leases]})

    def lease_id(self, key: str) -> str:
        got = self.alpha.call("pool.cmd.alpha.lease.request", lease_body(key))
        return str(got["lease"]["lease_id"])  # a retry: answered with the lease it made

    def close(self) -> None:
        for c in (self.agent, self.alpha, self.admin):
            c.close()


Step = Callable[[Clients], Any]
# (what it does, the step); each step's reply is compared, run against run
TABLE: list[tuple[str, Step]] = [
    ("a first request, policies not cached", lambda c: c.alpha.request_lease(lease_body("cold"))),
    *[(f"a warm request {i}", lambda c, i=i: c.alpha.request_lease(lease_body(f"warm-{i}")))
      for i in range(3)],
    ("many leases in one request", lambda c: c.alpha.request_lease(
        {**lease_body("many"), "count": 3})),
    ("the same request again", lambda c: c.alpha.request_lease(
        {**lease_body("many"), "count": 3})),
    ("a key reused for another request", lambda c: c.alpha.request_lease(
        {**lease_body("warm-0"), "maximum_runtime_seconds": 601})),
    ("an unknown priority class", lambda c: c.alpha.request_lease(
        lease_body("k2", priority="no-such-class"))),
    ("a malformed request", lambda c: c.alpha.call(
        "pool.cmd.alpha.lease.request", {"pool_id": "p1"})),
    ("a scheduling cycle", lambda c: c.cp.scheduler.cycle().placed),
    ("a commit", lambda c: c.alpha.lease(c.lease_id("cold"), "commit", {})),
    ("a first beat, nothing cached", lambda c: c.beat(1, (c.lease_id("cold"), 1))),
    ("ten seconds on", lambda c: c.clock.advance(10)),
    ("a beat that is news", lambda c: c.beat(2, (c.lease_id("cold"), 1))),
    ("a beat of an older placement", lambda c: c.beat(3, (c.lease_id("cold"), 7))),
    ("a beat naming a reserved lease", lambda c: c.beat(4, (c.lease_id("warm-0"), 1))),
    ("a release", lambda c: c.alpha.lease(c.lease_id("cold"), "release", {"exit_code": 0})),
    ("a beat after the release", lambda c: c.beat(5, (c.lease_id("cold"), 1))),
    ("a request after it all", lambda c: c.alpha.request_lease(lease_body("last"))),
]


def _stable(value: Any) -> Any:
    """`value` with its times left out (keys naming them), for comparing two runs."""
    if isinstance(value, dict):
        return {k: _stable(v) for k, v in value.items() if k not in VOLATILE}
    if isinstance(value, list):
        return [_stable(v) for v in value]
    return value


def _whole(agg: Any) -> dict[str, Any]:
    return {k: v for k, v in vars(agg).items() if k != "_pending_events"}


def _fold(cp: ControlPlane, *, lean: bool) -> dict[Any, dict[str, Any]]:
    """The whole log folded, through the lean fold or the library's own."""
    was = lean_paths()
    use_lean_paths(lean)
    try:
        fold = Fold()
        for n in notifications(cp.app):
            assert fold.step(cp.app.mapper.to_domain_event(n)) is not None
        return {k: _whole(v) for k, v in fold.aggregates.items()}  # type: ignore[attr-defined]
    finally:
        use_lean_paths(was)


@pytest.fixture()
def switched() -> Iterator[Callable[[bool], None]]:
    was = fastpaths.ON
    yield lambda on: fastpaths.configure({fastpaths.ENV: "on" if on else "off"})
    fastpaths.configure({fastpaths.ENV: "on" if was else "off"})


def _run(tmp_path: Path, on: bool, switched: Callable[[bool], None]) -> dict[str, Any]:
    switched(on)  # as a process started with POOL_FAST_PATHS set would be
    server = NatsServer(store_dir=tmp_path / ("on" if on else "off") / "nats",
                        server_name="pool-parity")
    server.start()
    clock = FakeClock()
    cp = start(server.url, clock)
    clients = Clients(cp, server.url, clock)
    try:
        setup_pool(clients.admin, tenants={"alpha": 1.0})
        assert clients.admin.admin("node.register", node_body("n1"))["ok"]
        threaded = threaded_subjects(cp)
        replies = [(what, _stable(step(clients))) for what, step in TABLE]
        events = [(n.originator_id, n.originator_version, n.topic, _stable(state_of(n)))
                  for n in notifications(cp.app)]
        lean, plain = _fold(cp, lean=True), _fold(cp, lean=False)
        return {"replies": replies, "events": events, "threaded": len(threaded),
                "on_loop": cp.commands is not None and cp.commands.fast is not None,
                "lean": lean, "plain": plain,
                "state": {k: _stable(v) for k, v in lean.items()}}
    finally:
        clients.close()
        cp.stop()
        server.stop()


def test_the_same_commands_get_the_same_replies_events_and_state_either_way(
        tmp_path: Path, switched: Callable[[bool], None]) -> None:
    fast = _run(tmp_path, True, switched)
    plain = _run(tmp_path, False, switched)
    # the runs took their own paths: the plain one answered every command on a thread
    assert fast["on_loop"] and not plain["on_loop"]
    assert fast["threaded"] < plain["threaded"]
    for (what, mine), (_, theirs) in zip(fast["replies"], plain["replies"], strict=True):
        assert mine == theirs, what
    assert fast["events"] == plain["events"]
    assert fast["state"] == plain["state"]
    # each log folds the same through the lean fold and the library's, times and all
    assert fast["lean"] == fast["plain"]
    assert plain["lean"] == plain["plain"]
