"""`pool whatif`: a pool's real requests replayed under another policy, beside the log's own
outcome, which must be the log's for every lease."""

from __future__ import annotations

import json
from collections.abc import Iterator
from uuid import UUID

import pytest

from bench.policy import NothingToReplay, pool_from_log
from bench.whatif import BadPolicy, parse_policy, whatif, whatif_from_log
from bus.local.server import NatsServer
from cli.main import main
from client.api import PoolClient
from projections.replay import event_name, notifications, state_of
from tests.control_plane import FakeClock, lease_body, node_body, setup_pool, start
from workers.plane import ControlPlane

JOB = {"job": {"image": "busybox@sha256:" + "a" * 64, "command": ["true"]}}
Scripted = tuple[ControlPlane, dict[str, str]]  # the plane whose log `_script` wrote, its ids


def _script(cp: ControlPlane, admin: PoolClient, clock: FakeClock) -> dict[str, str]:
    """One 4-core node; alpha and beta queue behind each other, one request is cancelled."""
    setup_pool(admin, tenants={"alpha": 1.0, "beta": 3.0}, default_lease_seconds=3600,
               heartbeat_timeout_seconds=3600)
    admin.admin("node.register", node_body("n1", cpu_millis=4000))
    ids: dict[str, str] = {}
    with PoolClient(cp.nats_url, "alpha") as a, PoolClient(cp.nats_url, "beta") as b:
        def ask(who: PoolClient, key: str, max_runtime: int = 600) -> str:
            r = who.request_lease(lease_body(key, cpu_millis=4000, max_runtime=max_runtime))
            ids[key] = r["lease"]["lease_id"]
            return ids[key]

        def run(who: PoolClient, lid: str, seconds: float) -> None:
            assert who.lease(lid, "commit", JOB)["ok"]
            clock.advance(seconds)
            assert who.lease(lid, "release", {"exit_code": 0})["ok"]

        a1 = ask(a, "a1")
        cp.scheduler.cycle()
        assert a.lease(a1, "commit", JOB)["ok"]
        clock.advance(30)
        b1 = ask(b, "b1", 300)
        cp.scheduler.cycle()  # b1 waits behind a1
        clock.advance(70)
        assert a.lease(a1, "release", {"exit_code": 0})["ok"]
        cp.scheduler.cycle()  # b1 placed at 100, after 70 s
        clock.advance(5)
        ask(a, "a2")
        clock.advance(5)
        ask(b, "b2")
        cp.scheduler.cycle()  # both wait behind b1
        run(b, b1, 30)
        a3 = ask(a, "a3")
        assert a.lease(a3, "cancel", {"reason": "user"})["ok"]
        waiting = {ids["a2"]: a, ids["b2"]: b}
        while waiting:
            cp.scheduler.cycle()
            lid = next(lid for lid in waiting
                       if cp.app.repository.get(UUID(lid)).state.value == "reserved")
            run(waiting.pop(lid), lid, 20)
    return ids


@pytest.fixture(scope="module")
def scripted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scripted]:
    """`_script`'s log, written once for the module on a server of its own: every test here
    only reads it (`pool whatif` replays a log, it never writes one)."""
    server = NatsServer(store_dir=tmp_path_factory.mktemp("whatif"), server_name="pool-whatif")
    server.start()
    clock = FakeClock()
    cp = start(server.url, clock)
    admin = PoolClient(server.url)
    try:
        yield cp, _script(cp, admin, clock)
    finally:
        admin.close()
        cp.stop()
        server.stop()


def _log_outcome(cp: ControlPlane) -> dict[str, tuple[float, float | None]]:
    """Each lease's request time and first placement, read from the events themselves."""
    out: dict[str, tuple[float, float | None]] = {}
    for n in notifications(cp.app):
        name = event_name(n.topic)
        lid = str(n.originator_id)
        if name == "LeaseRequested":
            out[lid] = (float(state_of(n)["requested_at"]), None)
        elif name == "LeaseReserved" and out[lid][1] is None:
            out[lid] = (out[lid][0], float(state_of(n)["at"]))
    return out


def test_the_real_column_is_the_log_s_own_outcome_for_every_lease(scripted: Scripted) -> None:
    cp, ids = scripted
    truth = _log_outcome(cp)
    assert truth[ids["b1"]][1] is not None and truth[ids["a3"]][1] is None
    log = pool_from_log(cp.app)
    for spec in ("fifo", "drf", "drf+backfill", "drf+decay"):
        found = whatif(log, parse_policy(spec))
        assert {m.lease_id for m in found.leases} == set(truth)
        for m in found.leases:
            requested, started = truth[m.lease_id]
            assert m.requested_at == requested and m.real_start_at == started, m
            assert m.real_wait_seconds == (None if started is None else started - requested)
            if m.moved_seconds is not None:
                assert m.whatif_start_at == m.real_start_at + m.moved_seconds  # type: ignore
        waits = sorted(s - r for r, s in truth.values() if s is not None)
        assert found.real.waits.count == len(waits) == 4
        assert found.real.waits.max_seconds == waits[-1] and 70.0 in waits
        assert found.real.waits.never_started == 1  # a3, cancelled while it waited
        assert found.whatif.waits.count + found.whatif.waits.never_started == 5


def test_pool_whatif_prints_the_replay_beside_the_log(
        scripted: Scripted, capsys: pytest.CaptureFixture[str]) -> None:
    cp, ids = scripted
    url = ["--nats-url", cp.nats_url]
    assert main(["whatif", "--policy", "drf+backfill", "--weight", "alpha=5", *url,
                 "--json"]) == 0
    result = json.loads(capsys.readouterr().out)["result"]
    assert result["policy"] == "drf+backfill" and result["weights"] == {"alpha": 5.0}
    assert result["requests"] == 5 and "gangs" in " ".join(result["not_modelled"])
    assert set(result["real"]["by_tenant"]) == {"alpha", "beta"}
    truth = _log_outcome(cp)
    assert {r["lease_id"]: r["real_start_at"] for r in result["leases"]} == {
        k: v[1] for k, v in truth.items()}
    assert main(["whatif", "--policy", "fifo", *url]) == 0
    text = capsys.readouterr().out
    assert "real" in text and "what if" in text and "not modelled" in text
    # a window that leaves out a1 and b1
    start = str(truth[ids["a2"]][0])
    assert main(["whatif", "--policy", "drf", "--from", start, *url, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["result"]["requests"] == 3


@pytest.mark.parametrize(("argv", "flag"), [
    (["--policy", "lottery"], "--policy"),
    (["--policy", "fifo+decay"], "--policy"),
    (["--policy", "drf", "--weight", "alpha"], "--weight"),
    (["--policy", "drf", "--weight", "alpha=0"], "--weight"),
    (["--policy", "drf", "--weight", "nobody=2"], "--weight"),
    (["--policy", "drf", "--pool", "nope"], "--pool"),
    (["--policy", "drf", "--from", "2099-01-01"], "--from"),
    (["--policy", "drf", "--from", "yesterday"], "--from"),
])
def test_pool_whatif_names_the_flag_it_refuses(
        scripted: Scripted, capsys: pytest.CaptureFixture[str], argv: list[str],
        flag: str) -> None:
    cp, _ = scripted  # a log to replay: the refusal is the flag's, not an empty log's
    assert main(["whatif", *argv, "--nats-url", cp.nats_url]) != 0
    err = capsys.readouterr().err
    assert flag in err and len(err.strip().splitlines()) == 1, err


def test_a_policy_spec_reads_as_the_simulator_s_policies() -> None:
    assert parse_policy("drf+backfill").backfill and parse_policy("DRF+Decay").half_life_seconds
    assert parse_policy("backfill+drf".replace("backfill+drf", "drf+backfill")).name == \
        "drf+backfill"
    fb = parse_policy("fifo+backfill")
    assert fb.order == "fifo" and fb.backfill
    with pytest.raises(BadPolicy):
        parse_policy("drf+drf")


def test_an_empty_window_is_refused(scripted: Scripted) -> None:
    cp, _ = scripted
    with pytest.raises(NothingToReplay):
        whatif_from_log(cp.app, parse_policy("drf"), start=4_000_000_000.0)
