"""A pool's egress allow-list as a setting: from the operator's flags, through the wire and the
pool's event, to the start order its node's runtime reads (`LeaseAssignment.egress_allow`)."""

from __future__ import annotations

import msgspec
import pytest

from cli.main import build_parser
from cli.output import UsageError
from domain.lease import JobSpec, Lease
from domain.pool import Pool
from domain.poolconfig import PoolConfig
from domain.resources import NodeId, PoolId, Shape, TenantId
from schemas import v1
from schemas.codec import decode
from schemas.convert import pool_config_from_wire, pool_config_patched
from workers.dispatcher import orders_for


def _body(*flags: str) -> dict[str, object]:
    args = build_parser().parse_args(["admin", "pool", "set", "p", *flags])
    return dict(args.build(args)[1])


def test_the_flags_replace_the_list_clear_it_or_leave_it_alone() -> None:
    assert _body("--egress-allow", "203.0.113.7", "--egress-allow", "198.51.100.0/24")[
        "egress_allow"] == ["203.0.113.7/32", "198.51.100.0/24"]
    assert _body("--no-egress-allow")["egress_allow"] == []
    assert "egress_allow" not in _body("--max-attempts", "3")
    for bad in ("10.0.0.0/33", "example.com", "2001:db8::/32"):
        with pytest.raises(UsageError, match="--egress-allow"):
            _body("--egress-allow", bad)


def test_the_wire_holds_only_ipv4_networks_and_the_pool_keeps_them_normalised() -> None:
    with pytest.raises(msgspec.ValidationError, match="egress_allow"):
        msgspec.convert({"pool_id": "p", "egress_allow": ["2001:db8::/32"]}, v1.PoolConfig)
    wire = msgspec.convert({"pool_id": "p", "egress_allow": ["203.0.113.7", "203.0.113.7/32"]},
                           v1.PoolConfig)
    cfg = pool_config_from_wire(wire)
    assert cfg.egress_allow == ("203.0.113.7/32",) and cfg.problems() == []
    # a dotted quad the pattern lets through but that is no address is named by the pool
    assert any("999.1.1.1" in p for p in PoolConfig(egress_allow=("999.1.1.1/32",)).problems())
    assert PoolConfig.from_dict(cfg.to_dict()) == cfg
    assert "egress_allow" not in PoolConfig().to_dict()  # a pool without records as before


def test_a_patch_replaces_the_list_and_a_patch_without_it_keeps_it() -> None:
    base = PoolConfig(egress_allow=("203.0.113.0/24",))
    kept = pool_config_patched(base, v1.PoolPatch(pool_id="p", max_attempts=3))
    assert kept.egress_allow == ("203.0.113.0/24",)
    cleared = pool_config_patched(base, v1.PoolPatch(pool_id="p", egress_allow=[]))
    assert cleared.egress_allow == ()


def test_the_start_order_carries_the_pools_list_in_force() -> None:
    pool = Pool.create(pool_id=PoolId("p"), now=1.0)
    pool.configure(PoolConfig(egress_allow=("203.0.113.0/24",)), 2.0)
    lease = Lease.request(tenant_id=TenantId("acme"), pool_id=PoolId("p"), idempotency_key="k",
                          shape=Shape.build(cpu_millis=1000, memory_mib=512, runtime="sandboxed"),
                          maximum_runtime_seconds=600, now=3.0)
    lease.queue(4.0)
    lease.reserve(5.0, node_id=NodeId("n1"), commit_timeout_seconds=30, hold_microcredits=0)
    lease.commit(6.0, JobSpec(image="", command=("true",)))
    (order,) = orders_for("LeaseCommitted", lease, pool)
    assert decode(v1.LeaseAssignment, order.body).egress_allow == ["203.0.113.0/24"]
