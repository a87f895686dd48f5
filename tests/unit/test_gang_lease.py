"""Gang leases in the domain: membership ids, the lease's record of its gang (also through the
scheduler's compact record), a lost member requeued with its gang, and members on nodes."""

from __future__ import annotations

import pytest

from domain.gang import GangMembership, job_env, member_key
from domain.lease import Lease, LeaseState
from domain.policy.gang import GangSpec, place_members
from domain.policy.placement import NodeTable
from domain.resources import NodeCapabilities, NodeId, PoolId, Resources, Shape, TenantId
from workers.pending import LeaseMemory, QueuedLease


def _members(n: int = 3, **kw: str) -> list[GangMembership]:
    return GangMembership.members("alpha", "train", GangSpec.build(n, **kw))


def _lease(m: GangMembership, *, requeue: bool = True) -> Lease:
    lease = Lease.request(tenant_id=TenantId("alpha"), pool_id=PoolId("p"),
                          idempotency_key=member_key(m.lead_key, m.member),
                          shape=Shape.build(cpu_millis=1000, memory_mib=512),
                          maximum_runtime_seconds=600, now=1.0, gang=m,
                          requeue_when_preempted=requeue)
    lease.queue(1.0)
    return lease


def test_member_ids_are_the_lease_ids_of_the_members_keys() -> None:
    members = _members(3, same="rack")
    ids = members[0].member_ids("alpha")
    assert ids == [Lease.create_id("alpha", k) for k in ("train", "train#1", "train#2")]
    assert {m.gang_id for m in members} == {str(ids[0])}
    assert members[0].is_lead and not members[1].is_lead
    assert members[2].spec() == GangSpec(3, "STRICT_PACK", same="rack")


def test_a_membership_refuses_what_the_policy_refuses() -> None:
    with pytest.raises(ValueError):
        GangMembership(gang_id="g", member=0, size=2, lead_key="k", same="hostname")
    with pytest.raises(ValueError):
        GangMembership(gang_id="g", member=2, size=2, lead_key="k")


def test_a_lease_keeps_its_gang_through_the_schedulers_compact_record() -> None:
    m = _members(2, spread="zone")[1]
    lease = _lease(m)
    assert lease.gang == m
    memory = LeaseMemory()
    for event in lease.collect_events():
        memory.absorb(event)
    record = memory.peek(lease.id)
    assert isinstance(record, QueuedLease) and record.gang == m
    whole = memory.get(lease.id)  # rebuilt whole from the record
    assert whole.gang == m
    assert memory.compact(whole) and memory.peek(lease.id).gang == m


def test_a_gang_member_lost_with_its_node_goes_back_in_line_when_the_gang_requeues() -> None:
    for requeue, end in ((True, LeaseState.QUEUED), (False, LeaseState.RELEASED)):
        lease = _lease(_members(2)[0], requeue=requeue)
        lease.reserve(2.0, node_id=NodeId("n1"), commit_timeout_seconds=30, hold_microcredits=0)
        lease.commit(3.0)
        lease.expire(4.0, "node_lost")
        lease.begin_reconciliation(4.0)
        assert lease.confirm_stopped(9.0) is end
        if requeue:
            assert lease.node_id is None and lease.attempts == 2 and lease.expiry_reason is None
            assert lease.run_ended_at == 4.0  # billing stopped where the expiry put it


def test_a_plain_lease_lost_with_its_node_is_released_as_before() -> None:
    lease = Lease.request(tenant_id=TenantId("a"), pool_id=PoolId("p"), idempotency_key="k",
                          shape=Shape.build(cpu_millis=1), maximum_runtime_seconds=60, now=0.0,
                          requeue_when_preempted=True)
    lease.queue(0.0)
    lease.reserve(1.0, node_id=NodeId("n"), commit_timeout_seconds=30, hold_microcredits=0)
    lease.commit(1.0)
    lease.expire(2.0, "node_lost")
    lease.begin_reconciliation(2.0)
    assert lease.confirm_stopped(3.0) is LeaseState.RELEASED and lease.gang is None


def _table(racks: dict[str, int], gpus: int = 8) -> tuple[NodeTable, dict[str, dict[str, str]]]:
    table = NodeTable()
    labels: dict[str, dict[str, str]] = {}
    for rack, count in racks.items():
        for i in range(count):
            node = f"{rack}-n{i}"
            table.add_or_update_node(node, NodeCapabilities(
                Resources(cpu_millis=64_000, memory_mib=512 * 1024, gpu_count=gpus)))
            labels[node] = {"rack": rack}
    return table, labels


def test_members_land_in_one_rack_and_wait_saying_how_much_of_the_best_rack_is_free() -> None:
    table, labels = _table({"r1": 2, "r2": 4})
    whole = Shape.build(cpu_millis=1000, memory_mib=1024, gpu_count=8)
    got = place_members(GangSpec.build(3, same="rack"), [whole] * 3, table, labels.__getitem__)
    assert got.placed and {labels[n]["rack"] for n in got.nodes} == {"r2"}
    assert len(set(got.nodes)) == 3
    table.allocate("r2-n0", "busy", Resources(cpu_millis=1, gpu_count=1))
    table.allocate("r2-n1", "busy2", Resources(cpu_millis=1, gpu_count=1))
    wait = place_members(GangSpec.build(3, same="rack"), [whole] * 3, table, labels.__getitem__)
    assert not wait.placed and not wait.never_fits
    assert wait.reason == "gang_incomplete: best rack r1 holds 2 of 3"
    never = place_members(GangSpec.build(5, same="rack"), [whole] * 5, table, labels.__getitem__)
    assert never.never_fits and "largest rack holds 4" in (never.reason or "")


def test_mixed_members_go_only_where_every_shape_fits() -> None:
    table, labels = _table({"r1": 2})
    table.add_or_update_node("cpu-only", NodeCapabilities(Resources(cpu_millis=64_000,
                                                                    memory_mib=1 << 20)))
    labels["cpu-only"] = {"rack": "r1"}
    shapes = [Shape.build(cpu_millis=1000, gpu_count=8), Shape.build(cpu_millis=1000)]
    got = place_members(GangSpec.build(2), shapes, table, labels.__getitem__)
    assert got.placed and "cpu-only" not in got.nodes
    three = place_members(GangSpec.build(3), [*shapes, shapes[1]], table, labels.__getitem__)
    assert three.never_fits and three.filters.get("insufficient_gpu") == 1


def test_a_cordoned_node_keeps_a_gang_waiting_instead_of_rejected() -> None:
    table, labels = _table({"r1": 2})
    table.set_state("r1-n1", "cordoned")
    whole = Shape.build(cpu_millis=1000, gpu_count=8)
    got = place_members(GangSpec.build(2, same="rack"), [whole] * 2, table, labels.__getitem__)
    assert not got.placed and not got.never_fits
    assert (got.reason or "").startswith("gang_incomplete")


def test_a_members_job_learns_its_rank_and_the_gangs_nodes() -> None:
    m = _members(2)[1]
    env = job_env(m, ["n1", "n2"])
    assert env["POOL_GANG_RANK"] == "1" and env["POOL_GANG_NODES"] == "n1,n2"
    assert env["POOL_GANG_SIZE"] == "2" and env["POOL_GANG_ID"] == m.gang_id


def _request(**group: object) -> dict[str, object]:
    return {"pool_id": "p", "shape": {"cpu_millis": 1, "memory_mib": 1},
            "maximum_runtime_seconds": 60, "idempotency_key": "k", "group": group}


@pytest.mark.parametrize(("group", "extra", "words"), [
    ({"members": 0}, {}, ">= 1"),
    ({"members": 257}, {}, "<= 256"),
    ({"members": 2, "same": "rack", "spread": "zone"}, {}, "not both"),
    ({"members": 2, "same": "hostname"}, {}, "Invalid enum value"),
    ({"members": 2, "same": "rack", "strategy": "SPREAD"}, {}, "PACK or STRICT_PACK"),
    ({"members": 2, "member_shapes": [{"cpu_millis": 1, "memory_mib": 1}]}, {}, "1 shape(s)"),
    ({"members": 2}, {"count": 2}, "not both"),
    ({"members": 2, "ranks": 2}, {}, "unknown field"),
])
def test_a_malformed_group_is_refused_with_a_typed_error(
        group: dict[str, object], extra: dict[str, object], words: str) -> None:
    import json

    from schemas.codec import SchemaError, decode_command

    with pytest.raises(SchemaError) as e:
        decode_command("lease.request", json.dumps(_request(**group) | extra))
    assert e.value.code and words in str(e.value)


def test_a_well_formed_group_decodes() -> None:
    import json

    from schemas.codec import decode_command

    req = decode_command("lease.request", json.dumps(_request(members=4, same="nvlink_domain")))
    assert req.group is not None and req.group.members == 4  # type: ignore[attr-defined]
