"""Each tenant's bucket for all its commands (workers/throttle.py): a tenant past it is
refused with `rate_limited` and the limit's numbers; another tenant, a node and an operator
are not held by it."""

from __future__ import annotations

import json

import pytest

from workers.throttle import TenantThrottle


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_tenant_past_its_burst_is_refused_until_a_token_comes_back() -> None:
    clock = Clock()
    gate = TenantThrottle(per_second=2, burst=3, clock=clock)
    beat = "pool.cmd.alpha.lease.l1.heartbeat"
    assert [gate(beat) for _ in range(3)] == [None, None, None]
    refused = gate(beat)
    assert refused is not None and refused[0] == "alpha"
    error = json.loads(refused[1])["error"]
    assert error["code"] == "rate_limited"
    assert error["reasons"] == {"tenant_commands_per_second": 2, "tenant_command_burst": 3,
                                "retry_after_seconds": 1}
    assert "tenant_commands_per_second of 2" in error["message"]
    clock.now += 0.5  # one token back
    assert gate(beat) is None
    assert gate(beat) is not None
    assert gate.refused == 2


def test_one_tenant_s_flood_leaves_others_nodes_and_operators_alone() -> None:
    gate = TenantThrottle(per_second=1, burst=1, clock=Clock())
    assert gate("pool.cmd.alpha.query.leases") is None
    assert gate("pool.cmd.alpha.lease.request") is not None  # its reads and commands: one bucket
    assert gate("pool.cmd.beta.lease.request") is None
    for _ in range(5):
        assert gate("pool.node.n1.heartbeat") is None
        assert gate("pool.admin.pool.set") is None


def test_the_rate_and_burst_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    mp = monkeypatch
    mp.setenv("POOL_TENANT_COMMANDS_PER_SECOND", "7")
    mp.setenv("POOL_TENANT_COMMAND_BURST", "9")
    gate = TenantThrottle.from_env()
    assert (gate.per_second, gate.burst) == (7, 9)
    mp.delenv("POOL_TENANT_COMMANDS_PER_SECOND")
    mp.delenv("POOL_TENANT_COMMAND_BURST")
    assert (TenantThrottle.from_env().per_second, TenantThrottle.from_env().burst) == (400, 2000)
