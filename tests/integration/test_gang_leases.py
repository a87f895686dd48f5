"""Gang leases end to end on a real log: placed all-or-nothing in one save, committed, renewed,
heartbeated, cancelled, preempted and requeued together, and a replay that finds no gang ever
partly reserved, also with two schedulers racing."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from bus.local.server import NatsServer
from client.api import PoolClient
from domain.gang import GangMembership, member_key
from domain.lease import Lease, LeaseState
from domain.policy.gang import GangSpec
from domain.resources import NodeId, PoolId, Shape, TenantId
from projections.decisions import check_gangs, check_placements
from tests.control_plane import (
    FakeClock,
    lease_body,
    node_body,
    node_report,
    race,
    rival_schedulers,
    setup_pool,
    start,
)
from workers.plane import ControlPlane

Plane = tuple[ControlPlane, PoolClient, PoolClient, FakeClock]
PREEMPTION = {"enabled": True, "min_runtime_seconds": 0, "grace_seconds": 10}


def gpu_node(node_id: str, rack: str, gpus: int = 4) -> dict[str, Any]:
    body = node_body(node_id, gpu_count=gpus, gpu_model="NVIDIA A100 80GB", gpu_memory_gib=80,
                     labels={"rack": rack})
    body["capabilities"]["devices"] = [
        {"id": f"GPU-{node_id}-{k}", "model": "NVIDIA A100 80GB", "memory_mib": 80 * 1024,
         "minor": k} for k in range(gpus)]
    return body


def gang_body(key: str, members: int, *, gpus: int = 4, priority: str = "standard",
              **group: Any) -> dict[str, Any]:
    return lease_body(key, gpu_count=gpus, priority=priority) | {
        "group": {"members": members, **group}, "preemptible_requeue": True}


@pytest.fixture()
def plane(fresh_nats: NatsServer) -> Iterator[Plane]:
    clock = FakeClock()
    cp = start(fresh_nats.url, clock)
    admin = PoolClient(fresh_nats.url)
    alpha = PoolClient(fresh_nats.url, "alpha")
    setup_pool(admin, tenants={"alpha": 1.0, "beta": 1.0}, preemption=PREEMPTION)
    yield cp, admin, alpha, clock
    alpha.close()
    admin.close()
    cp.stop()


def _racks(admin: PoolClient, racks: dict[str, int]) -> None:
    for rack, count in racks.items():
        for i in range(count):
            assert admin.admin("node.register", gpu_node(f"{rack}-n{i}", rack))["ok"]


def _gang(alpha: PoolClient, lid: str) -> dict[str, Any]:
    got = alpha.lease(lid, "get")
    assert got["ok"], got
    gang: dict[str, Any] = got["lease"]["gang"]
    return gang


def _leases(cp: ControlPlane, *keys: str) -> list[Lease]:
    out: list[Lease] = [cp.app.repository.get(Lease.create_id("alpha", k)) for k in keys]
    return out


def _why(client: PoolClient, lid: str) -> dict[str, Any]:
    got = client.lease(lid, "why")
    assert got["ok"], got
    result: dict[str, Any] = got["result"]
    return result


def _no_partial_gang(cp: ControlPlane) -> int:
    report = check_gangs(cp.app)
    assert not report.partial, report.partial
    return report.placements


def test_a_gang_is_reserved_whole_in_one_rack_and_get_lists_every_member(plane: Plane) -> None:
    cp, admin, alpha, _clock = plane
    _racks(admin, {"r1": 2, "r2": 3})
    r = alpha.request_lease(gang_body("train", 3, same="rack"))
    assert r["ok"], r
    ids = r["result"]["lease_ids"]
    assert len(ids) == 3 and r["lease"]["gang"]["size"] == 3
    assert cp.scheduler.cycle().placed == 3
    gang = _gang(alpha, ids[1])
    assert [m["lease_id"] for m in gang["members"]] == ids
    assert gang["strategy"] == "STRICT_PACK" and gang["same"] == "rack"
    nodes = [m["node_id"] for m in gang["members"]]
    assert len(set(nodes)) == 3 and {n.split("-")[0] for n in nodes} == {"r2"}
    for m in gang["members"]:
        assert m["state"] == "reserved" and len(m["devices"]) == 4
        assert all(d.startswith(f"GPU-{m['node_id']}-") for d in m["devices"])
    assert _no_partial_gang(cp) == 1
    report = check_placements(cp.app)
    assert report.double_placements == 0 and report.device_violations == 0
    one = alpha.request_lease(gang_body("one", 1))
    assert one["lease"]["gang"]["size"] == 1 and one["result"]["lease_ids"] == [
        one["lease"]["lease_id"]]


def test_a_gang_that_can_never_fit_is_rejected_at_once_with_per_filter_counts(
        plane: Plane) -> None:
    cp, admin, alpha, _clock = plane
    _racks(admin, {"r1": 2, "r2": 3})
    ids = alpha.request_lease(gang_body("huge", 4, same="rack"))["result"]["lease_ids"]
    report = cp.scheduler.cycle()
    assert report.rejected == 4 and report.placed == 0
    why = _why(alpha, ids[0])
    assert why["state"] == "rejected", why
    assert "gang_never_fits: the largest rack holds 3 eligible node(s) of 4" in str(why)
    eights = alpha.request_lease(gang_body("eights", 2, gpus=8))["result"]["lease_ids"]
    cp.scheduler.cycle()
    why = _why(alpha, eights[1])
    assert why["reasons"]["filters"] == {"insufficient_gpu": 5}, why


def test_a_waiting_gang_says_how_much_of_its_best_rack_is_free(plane: Plane) -> None:
    cp, admin, alpha, _clock = plane
    _racks(admin, {"r1": 2, "r2": 3})
    for i in range(4):
        alpha.request_lease(lease_body(f"small-{i}", gpu_count=3))
    assert cp.scheduler.cycle().placed == 4  # three GPUs taken in four nodes of five
    ids = alpha.request_lease(gang_body("wait", 3, same="rack"))["result"]["lease_ids"]
    assert cp.scheduler.cycle().placed == 0
    why = _why(alpha, ids[2])
    assert why["state"] == "queued"
    assert why["reasons"]["gang"].startswith("gang_incomplete: best rack r"), why
    assert why["reasons"]["gang"].endswith("holds 1 of 3")
    assert _no_partial_gang(cp) == 0


def test_commit_heartbeat_renew_and_cancel_apply_to_every_member(plane: Plane) -> None:
    cp, admin, alpha, clock = plane
    setup_pool(admin, tenants={"alpha": 1.0}, preemption=PREEMPTION, default_lease_seconds=600)
    _racks(admin, {"r1": 2})
    ids = alpha.request_lease(gang_body("job", 2) | {"maximum_runtime_seconds": 3600})[
        "result"]["lease_ids"]
    assert cp.scheduler.cycle().placed == 2
    job = {"image": "busybox@sha256:" + "a" * 64, "command": ["train"]}
    assert alpha.lease(ids[0], "commit", {"job": job})["ok"]
    leases = _leases(cp, "job", "job#1")
    assert all(lease.state is LeaseState.RUNNING for lease in leases)
    nodes = ",".join(str(lease.node_id) for lease in leases)
    for rank, lease in enumerate(leases):
        assert lease.job is not None
        env = dict(lease.job.spec.env)
        assert env["POOL_GANG_RANK"] == str(rank) and env["POOL_GANG_NODES"] == nodes
    clock.advance(100)
    assert alpha.lease(ids[1], "heartbeat", {"epoch": 1})["ok"]
    assert alpha.lease(ids[1], "renew", {"extend_seconds": 1000})["ok"]
    leases = _leases(cp, "job", "job#1")
    assert {lease.last_heartbeat_at for lease in leases} == {clock()}
    assert {lease.deadline for lease in leases} == {clock() + 1000}
    assert alpha.lease(ids[0], "cancel", {})["ok"]
    states = {m["state"] for m in _gang(alpha, ids[0])["members"]}
    assert states == {"stopping"}


def _running_gang(cp: ControlPlane, alpha: PoolClient, key: str, members: int,
                  **kw: Any) -> list[str]:
    ids: list[str] = alpha.request_lease(gang_body(key, members, **kw))["result"]["lease_ids"]
    assert cp.scheduler.cycle().placed == members
    assert alpha.lease(ids[0], "commit", {})["ok"]
    return ids


def test_preempting_one_member_notices_the_whole_gang_with_one_grace(plane: Plane) -> None:
    cp, admin, alpha, clock = plane
    _racks(admin, {"r1": 3})
    ids = _running_gang(cp, alpha, "low", 2, priority="preemptible")
    with PoolClient(cp.nats_url, "beta") as beta:
        high = beta.request_lease(lease_body("high", gpu_count=4, priority="high"))
        assert high["ok"]
        spare = beta.request_lease(lease_body("spare", gpu_count=4, priority="high"))
        report = cp.scheduler.cycle()
        assert report.placed == 1 and report.preempted == 2  # one victim chosen, two noticed
        members = _gang(alpha, ids[0])["members"]
        assert {m["state"] for m in members} == {"preempting"}
        leases = _leases(cp, "low", "low#1")
        assert len({lease.grace_deadline for lease in leases}) == 1
        # one member stopped: the gang waits for the other before it goes back whole
        first = leases[0]
        assert node_report(cp.nats_url, str(first.node_id), str(first.id), "stopped",
                           {"epoch": first.epoch})["ok"]
        clock.advance(1)
        cp.scheduler.cycle()
        assert "gang_members_leaving" in _why(alpha, ids[0])["reasons"]["gang"]
        second = leases[1]
        assert node_report(cp.nats_url, str(second.node_id), str(second.id), "stopped",
                           {"epoch": second.epoch})["ok"]
        cp.scheduler.cycle()
        assert beta.lease(spare["lease"]["lease_id"], "get")["lease"]["state"] == "reserved"
    assert _no_partial_gang(cp) == 1


def test_a_lost_node_takes_its_gang_back_in_line_and_it_is_placed_whole_again(
        plane: Plane) -> None:
    cp, admin, alpha, clock = plane
    _racks(admin, {"r1": 4})
    ids = _running_gang(cp, alpha, "lost", 2)
    leases = _leases(cp, "lost", "lost#1")
    gone, peer = leases
    clock.advance(31)  # past the node timeout: only the node asked about is judged
    done = cp.app.node_due(str(gone.node_id))
    assert "node_lost" in done and f"gang_member_lost:{peer.id}" in done
    members = {m["lease_id"]: m["state"] for m in _gang(alpha, ids[0])["members"]}
    assert members == {str(gone.id): "reconciling", str(peer.id): "preempting"}
    assert node_report(cp.nats_url, str(peer.node_id), str(peer.id), "stopped",
                       {"epoch": peer.epoch})["ok"]
    clock.advance(300)
    assert f"released:{gone.id}" in cp.app.node_due(str(gone.node_id))
    assert {m["state"] for m in _gang(alpha, ids[0])["members"]} == {"queued"}
    assert cp.scheduler.cycle().placed == 2
    again = _gang(alpha, ids[0])["members"]
    assert {m["state"] for m in again} == {"reserved"} and {m["node_id"] for m in again} & {
        gone.node_id} == set()
    assert _no_partial_gang(cp) == 2


def test_a_member_whose_heartbeats_stop_takes_its_gang_back_in_line_together(
        plane: Plane) -> None:
    from schemas import v1

    cp, admin, alpha, clock = plane
    _racks(admin, {"r1": 3})
    ids = _running_gang(cp, alpha, "quiet", 2)
    silent, alive = _leases(cp, "quiet", "quiet#1")
    clock.advance(20)  # only the peer's agent still beats for it
    cp.app.node_heartbeat(str(alive.node_id), v1.NodeHeartbeat(
        node_id=str(alive.node_id), seq=1,
        leases=[v1.LeaseBeat(lease_id=str(alive.id), epoch=alive.epoch)]))
    clock.advance(15)
    report = cp.scheduler.cycle()
    assert report.expired == 1 and report.preempted == 1
    members = {m["lease_id"]: m["state"] for m in _gang(alpha, ids[0])["members"]}
    assert members == {str(silent.id): "reconciling", str(alive.id): "preempting"}
    for lease in (alive, silent):  # each agent confirms its workload gone
        assert node_report(cp.nats_url, str(lease.node_id), str(lease.id), "stopped",
                           {"epoch": lease.epoch})["ok"]
    assert {m["state"] for m in _gang(alpha, ids[0])["members"]} == {"queued"}
    assert cp.scheduler.cycle().placed == 2
    assert _no_partial_gang(cp) == 2


def _held_gang(cp: ControlPlane, admin: PoolClient, alpha: PoolClient) -> tuple[str, str, str]:
    """A 1-GPU lease on one of a rack's two nodes, a 2-node gang waiting for the rack (holding
    the free node), and a 4-GPU lease that fits only on that node: (small, gang lead, wide)."""
    _racks(admin, {"r1": 2})
    small = alpha.request_lease(lease_body("small", gpu_count=1, max_runtime=3600))
    assert cp.scheduler.cycle().placed == 1 and alpha.lease(small["lease"]["lease_id"],
                                                            "commit", {})["ok"]
    ids = alpha.request_lease(gang_body("held", 2, same="rack"))["result"]["lease_ids"]
    assert cp.scheduler.cycle().placed == 0
    hold = _why(alpha, ids[0])["reasons"]["gang_hold"]
    busy = alpha.lease(small["lease"]["lease_id"], "get")["lease"]["node_id"]
    free = "r1-n1" if busy == "r1-n0" else "r1-n0"
    assert hold["nodes"] == [free]
    wide = alpha.request_lease(lease_body("wide", gpu_count=4))["lease"]["lease_id"]
    assert cp.scheduler.cycle().placed == 0  # the free node is the gang's while it gathers
    assert "waiting_for_reservation" in _why(alpha, wide)["reasons"]["tenant"]
    return small["lease"]["lease_id"], ids[0], wide


def test_a_waiting_gang_holds_the_nodes_it_gathered_until_it_is_placed(plane: Plane) -> None:
    cp, admin, alpha, _clock = plane
    small, lead, wide = _held_gang(cp, admin, alpha)
    assert alpha.lease(small, "cancel", {})["ok"]
    node = cp.app.repository.get(Lease.create_id("alpha", "small")).node_id
    assert node_report(cp.nats_url, str(node), small, "stopped", {"epoch": 1})["ok"]
    assert cp.scheduler.cycle().placed == 2  # the gang, not the wide lease
    assert {m["state"] for m in _gang(alpha, lead)["members"]} == {"reserved"}
    assert alpha.lease(wide, "get")["lease"]["state"] == "queued"


def test_a_gangs_hold_is_bounded_and_then_the_node_goes_to_others(plane: Plane) -> None:
    from domain.policy.gang import LIVE_HOLD_SECONDS

    cp, admin, alpha, clock = plane
    _small, lead, wide = _held_gang(cp, admin, alpha)
    clock.advance(LIVE_HOLD_SECONDS + 1)
    cp.scheduler.cycle()
    assert alpha.lease(wide, "get")["lease"]["state"] == "reserved"
    assert "gang_hold" not in _why(alpha, lead)["reasons"]  # cooling down: holds nothing


def test_a_gang_keeps_off_a_node_whose_maintenance_window_it_would_run_into(
        plane: Plane) -> None:
    cp, admin, alpha, clock = plane
    _racks(admin, {"r1": 3})
    assert admin.admin("reservation.create", {
        "pool_id": "p1", "reservation_id": "m1", "start_at": clock() + 1000,
        "duration_seconds": 600, "node_ids": ["r1-n0"]})["ok"]
    ids = alpha.request_lease(gang_body("maint", 2) | {"maximum_runtime_seconds": 3600})[
        "result"]["lease_ids"]
    assert cp.scheduler.cycle().placed == 2
    assert {m["node_id"] for m in _gang(alpha, ids[0])["members"]} == {"r1-n1", "r1-n2"}
    three = alpha.request_lease(gang_body("three", 2) | {"maximum_runtime_seconds": 3600})
    assert cp.scheduler.cycle().placed == 0  # one node left, and it goes into maintenance
    assert "gang_incomplete" in _why(alpha, three["result"]["lease_ids"][0])["reasons"]["gang"]


def test_a_high_priority_gang_preempts_lower_work_on_the_nodes_it_chooses(
        plane: Plane) -> None:
    cp, admin, alpha, _clock = plane
    _racks(admin, {"r1": 2, "r2": 1})
    with PoolClient(cp.nats_url, "beta") as beta:
        low = []
        for i in range(3):  # every node busy with preemptible work
            r = beta.request_lease(lease_body(f"low-{i}", gpu_count=4, priority="preemptible"))
            low.append(r["lease"]["lease_id"])
        assert cp.scheduler.cycle().placed == 3
        for lid in low:
            assert beta.lease(lid, "commit", {})["ok"]
        ids = alpha.request_lease(gang_body("urgent", 2, same="rack", priority="high"))[
            "result"]["lease_ids"]
        report = cp.scheduler.cycle()
        assert report.placed == 0 and report.preempted == 2
        why = _why(alpha, ids[0])["reasons"]
        assert why["tenant"] == ["waiting_for_preemption"]
        victims = why["preemption"]["victims"]
        got = {lid: beta.lease(lid, "get")["lease"] for lid in low}
        assert {got[v]["node_id"] for v in victims} == {"r1-n0", "r1-n1"}  # the rack it needs
        assert cp.scheduler.cycle().preempted == 0  # one plan at a time: nothing more noticed
        for v in victims:
            assert node_report(cp.nats_url, got[v]["node_id"], v, "stopped",
                               {"epoch": got[v]["epoch"]})["ok"]
        assert cp.scheduler.cycle().placed == 2
        assert {m["node_id"] for m in _gang(alpha, ids[0])["members"]} == {"r1-n0", "r1-n1"}


def test_racing_schedulers_never_reserve_part_of_a_gang(plane: Plane) -> None:
    from workers.scheduler import Scheduler

    cp, admin, alpha, clock = plane
    _racks(admin, {"r1": 4, "r2": 4, "r3": 3})
    for i in range(12):
        if i % 3 == 2:
            alpha.request_lease(lease_body(f"one-{i}", gpu_count=1, cpu_millis=100))
        else:
            alpha.request_lease(gang_body(f"gang-{i}", 2 + i % 3, gpus=2, same="rack"))
    rivals = rival_schedulers(cp, clock)

    def four_cycles(s: Scheduler) -> None:
        for _ in range(4):
            s.cycle()

    race(rivals, four_cycles)
    placed = _no_partial_gang(cp)
    assert placed >= 4
    report = check_placements(cp.app)
    assert report.double_placements == 0 and report.device_violations == 0
    for s in rivals:
        s.app.close()


def test_the_replay_check_finds_a_gang_reserved_in_part(plane: Plane) -> None:
    cp, admin, alpha, _clock = plane
    _racks(admin, {"r1": 2})
    alpha.request_lease(gang_body("half", 2))
    (lead,) = _leases(cp, "half")
    # written past the scheduler, as a buggy one would: one member reserved on its own
    lead.reserve(1.0, node_id=NodeId("r1-n0"), commit_timeout_seconds=30, hold_microcredits=0)
    cp.app.save(lead)
    alpha.request_lease(lease_body("after", cpu_millis=10))
    partial = check_gangs(cp.app).partial
    assert len(partial) == 1 and "1 of 2 member(s) not reserved" in partial[0]


def _old_form_gang(key: str, size: int) -> list[Lease]:
    """A gang's members as logs before one-event requests hold them: a LeaseRequested without
    queued_at each, their LeaseQueued still to be written."""
    spec = GangSpec.build(size)
    return [Lease.request(tenant_id=TenantId("alpha"), pool_id=PoolId("p1"),
                          idempotency_key=member_key(key, m.member),
                          shape=Shape.build(cpu_millis=1000, memory_mib=512),
                          maximum_runtime_seconds=600, now=1.0, priority_class="standard",
                          request_digest="ab" * 32, gang=m, queued=False)
            for m in GangMembership.members("alpha", key, spec)]


def test_the_replay_check_reads_gangs_requested_in_the_two_event_form(plane: Plane) -> None:
    cp, _admin, _alpha, _clock = plane
    whole = _old_form_gang("old-whole", 2)
    cp.app.save(*whole)
    for lease in whole:  # queued by events of their own, then reserved in one save
        lease.queue(2.0)
    cp.app.save(*whole)
    for i, lease in enumerate(whole):
        lease.reserve(3.0, node_id=NodeId(f"r1-n{i}"), commit_timeout_seconds=30,
                      hold_microcredits=0)
    cp.app.save(*whole)
    report = check_gangs(cp.app)
    assert (report.gangs, report.placements, report.partial) == (1, 1, [])
    # a member reserved while its peer's LeaseQueued has not been written: not a whole round
    early = _old_form_gang("old-early", 2)
    cp.app.save(*early)
    early[0].queue(4.0)
    cp.app.save(early[0])
    early[0].reserve(5.0, node_id=NodeId("r1-n0"), commit_timeout_seconds=30,
                     hold_microcredits=0)
    cp.app.save(early[0])
    report = check_gangs(cp.app)
    assert report.placements == 1 and len(report.partial) == 1, report.partial
    assert f"{early[1].id} requested" in report.partial[0]


def test_the_cli_requests_a_gang_by_flags_or_file_and_get_lists_members_with_devices(
        plane: Plane, tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from cli.main import main

    cp, admin, _alpha, _clock = plane
    _racks(admin, {"r1": 2, "r2": 2})
    u = ["--nats-url", cp.nats_url, "--tenant", "alpha"]
    assert main(["lease", "request", "--pool", "p1", "--cpu-millis", "1000", "--memory-mib",
                 "1024", "--gpu-count", "2", "--max-runtime", "600", "--key", "flags",
                 "--members", "2", "--same", "rack", "--json", *u]) == 0
    ids = json.loads(capsys.readouterr().out)["result"]["lease_ids"]
    job = tmp_path / "job.yaml"
    job.write_text("pool_id: p1\nshape: {cpu_millis: 1000, memory_mib: 1024, gpu_count: 2}\n"
                   "maximum_runtime_seconds: 600\ncommand: [python3, train.py]\n"
                   "group:\n  members: 2\n  spread: rack\n  member_shapes:\n"
                   "    - {cpu_millis: 1000, memory_mib: 1024, gpu_count: 2}\n"
                   "    - {cpu_millis: 500, memory_mib: 512}\n")
    assert main(["lease", "request", "-f", str(job), "--key", "file", *u]) == 0
    assert len(capsys.readouterr().out.split()) == 2  # one id a line
    assert cp.scheduler.cycle().placed == 4
    assert main(["lease", "get", ids[1], *u]) == 0
    out = capsys.readouterr().out
    assert "gang " in out and "2 member(s), STRICT_PACK over rack" in out
    for lid in ids:
        assert lid in out
    assert "GPU-r" in out and out.count("reserved") >= 3
    assert main(["lease", "request", "--pool", "p1", "--cpu-millis", "1", "--memory-mib", "1",
                 "--max-runtime", "60", "--same", "rack", *u]) != 0
    assert "--members" in capsys.readouterr().err
    spread = _leases(cp, "file", "file#1")
    racks = {str(lease.node_id).split("-")[0] for lease in spread}
    assert racks == {"r1", "r2"} and spread[1].requested_shape.resources.gpu_count == 0


def test_the_gangs_view_is_one_row_per_gang_with_its_members(
        plane: Plane, database_url: str, schema: str) -> None:
    from projections import views as pv
    from projections.queries import query_url

    cp, admin, alpha, _clock = plane
    _racks(admin, {"r1": 2})
    ids = alpha.request_lease(gang_body("viewed", 2, same="rack"))["result"]["lease_ids"]
    alpha.request_lease(lease_body("alone", cpu_millis=10))
    assert cp.scheduler.cycle().placed == 3
    proj = pv.PoolViews(cp.app, database_url, schema=schema)
    proj.setup()
    try:
        proj.catch_up()
    finally:
        proj.close()
    got = query_url(database_url, "gangs", tenant="alpha", schema=schema)["rows"]
    assert len(got) == 1
    row = got[0]
    assert row["gang_id"] == ids[0] and row["size"] == 2 and row["state"] == "reserved"
    assert [m["lease_id"] for m in row["members"]] == ids
    assert {m["node_id"] for m in row["members"]} == {"r1-n0", "r1-n1"}
    leases = query_url(database_url, "leases", tenant="alpha", schema=schema,
                       filters={"gang_id": ids[0]})["rows"]
    assert sorted(r["gang_member"] for r in leases) == [0, 1]
