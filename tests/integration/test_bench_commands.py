"""The benchmark commands run at their --quick size and report complete, sane results.

They print figures; these tests check behaviour only (everything placed, nothing lost).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.schedule import BACKLOG_LABEL, run_schedule_bench


@pytest.mark.parametrize("priced", [False, True], ids=["free", "priced"])
def test_the_schedule_bench_places_every_request_it_submits(priced: bool) -> None:
    # the quick backlog (its batches set the messages per placement asserted below), and one
    # second of the quick steady rate: 500 requests
    result = run_schedule_bench(quick=True, priced=priced, steady_seconds=1.0)
    assert result["placed"] == result["requests"] == 3000
    assert result["steady_placed"] == int(result["steady_rate"] * 1.0)  # every steady request
    assert result["steady_placements_per_s"] > 0 and result["backlog_placements_per_s"] > 0
    assert 0 < result["latency_p50_s"] <= result["latency_p99_s"]
    # the scheduler-alone figure says so, and its timer includes reading the backlog
    assert BACKLOG_LABEL in result["table"]
    assert 0 < result["backlog_read_s"] < result["backlog_s"]
    # and what the backlog cost the process in CPU, the figure a loaded machine moves least
    assert 0 < result["backlog_cpu_us_per_placement"] < 1e6
    assert "process CPU per backlog placement" in result["table"]
    assert result["backlog_placements_per_s_read_untimed"] > result["backlog_placements_per_s"]
    # messages per placement: a LeaseReserved each, one node event per node per batch, and
    # when the pool has prices one CreditsHeldBatch per tenant per batch (a CreditsHeld per
    # placement would make it over 2)
    per_placement = result["backlog_msgs_per_s"] / result["backlog_placements_per_s"]
    assert 1.0 < per_placement < 1.2


def test_the_schedule_bench_places_its_backlog_past_a_deep_queue_that_waits() -> None:
    # --unplaceable: requests that fit no node now, ahead of the backlog; every cycle examines
    # them and they wait (the cordoned node could hold them: not rejected as never fitting)
    result = run_schedule_bench(quick=True, steady_seconds=0.5, unplaceable=400)
    assert result["placed"] == result["requests"] == 3000
    assert result["unplaceable"] == result["waiting_at_end"] == 400
    assert "queued ahead of the backlog, fitting no node" in result["table"]
    with pytest.raises(ValueError, match="unplaceable"):
        run_schedule_bench(quick=True, unplaceable=5000)  # no cycle would reach the backlog


def test_the_agent_bench_starts_every_workload_it_sends() -> None:
    from bench.agent import run_agent_bench

    result = run_agent_bench(starts=3)  # three timed starts: a median and a p90 still
    process = result["process"]
    if "unavailable" in process:
        pytest.skip(process["unavailable"])
    assert process["published"]["n"] == process["delivered"]["n"] == result["starts"] == 3
    assert 0 < process["delivered"]["p50_ms"] <= process["delivered"]["p90_ms"]


def test_the_e2e_bench_sees_every_accepted_request_reserved() -> None:
    from bench.e2e import rows, run_e2e_bench

    result = run_e2e_bench(quick=True, seconds=1.0, steady_seconds=1.0, rate=50.0)
    sat, steady = result["saturated"], result["steady"]
    assert sat["accepted"] > 0 and sat["errors"] == {} and steady["errors"] == {}
    # every accepted lease was seen reserved, and no reservation came before its request
    assert sat["reserved"] == sat["leases"] == sat["accepted"]
    assert steady["reserved"] == steady["accepted"] == steady["requests"] == 50
    assert 0 < steady["reserved_p50_ms"] <= steady["reserved_p99_ms"] <= steady["reserved_max_ms"]
    assert result["raw_atomic_msgs_per_s"] > 0
    # the stateless responder answers the same clients, and faster than a plane that stores
    assert result["stateless_replies_per_s"] > sat["accepted_per_s"] > 0
    assert "a responder storing nothing" in result["table"]
    # what carrying a request costs the server and the clients, beside the goals' budget
    floor = result["stateless_cpu_ms_per_reply"]
    assert floor["server"] > 0 and floor["clients"] > 0
    assert result["cores"] >= 1 and "CPU per request the goals leave on" in result["table"]
    # and the goal's rate as CPU per request, beside all processes' CPU per request
    [cpu_row] = [r for r in rows(result) if r[0].startswith("e2e: CPU per accepted request")]
    assert cpu_row[1] == pytest.approx(sum(sat["cpu_ms_per_request"].values()))
    assert cpu_row[3] == f"≤ {result['cores'] * 1000 / 5000:.2f}"
    # a request is at least its own message in and its reply out
    msgs = sat["server_msgs_per_request"]
    assert msgs["in"] >= 1 and msgs["out"] >= 1
    assert "server messages per accepted request" in result["table"]
    # and until the dispatcher caught up: at least the request and its reply again
    assert sat["settled_s"] > 0 and sat["settled_msgs_per_request"]["in"] >= msgs["in"]
    assert "until the dispatcher caught up" in result["table"]
    assert "cores" in result["machine"] and "e2e: accepted requests/s" in result["table"]
    # what the plane does not do in this bench is said beside its figures
    assert result["views"] is False and "no views folded (no PostgreSQL)" in result["table"]
    assert "leases left reserved (none committed or started)" in result["table"]
    # request → reserved in its stages, from the server's stored times: a reservation is
    # stored after its request, and every stage seen for the steady phase's leases
    for phase in (sat, steady):
        stages = phase["stages"]
        assert set(stages) == {"sent_to_stored", "stored_to_reply", "stored_to_reserved",
                               "reserved_to_feed"}
        assert all(s["p50_ms"] is not None and s["p50_ms"] <= s["p99_ms"]
                   for s in stages.values())
        assert stages["stored_to_reserved"]["p50_ms"] > 0
    assert "request → reserved in stages at 50/s offered" in result["table"]


def test_the_e2e_bench_over_pools_led_by_two_scheduler_processes_places_every_request() -> None:
    from bench.e2e import pool_names, run_e2e_bench

    result = run_e2e_bench(quick=True, seconds=1.0, steady_seconds=1.0, rate=40.0, pools=4,
                           scheduler_processes=2)
    sat, steady = result["saturated"], result["steady"]
    assert sat["accepted"] > 0 and sat["errors"] == {} and steady["errors"] == {}
    assert sat["reserved"] == sat["accepted"] and steady["reserved"] == steady["requests"] == 40
    # every pool led, each scheduler process leading some, and the CPU of all of them counted
    leaders = result["pool_leaders"]
    assert sorted(leaders) == pool_names(4) and len(set(leaders.values())) == 2
    assert result["plane_processes"] == 3 and "1 more scheduler process" in result["table"]
    # the plane's CPU split by its processes, named by their roles, adding up to its whole
    shares = sat["plane_cpu_ms_per_request"]
    assert [p["roles"] for p in shares][1:] == ["scheduler+reconciler", "scheduler"]
    assert sum(p["ms"] for p in shares) == pytest.approx(sat["cpu_ms_per_request"]["plane"])
    assert "the plane's, by its processes: commands+projector " in result["table"]


@pytest.mark.parametrize("argv, flag", [
    (["--clients", "0"], "--clients"),
    (["--pools", "0"], "--pools"),
    (["--scheduler-processes", "2", "--one-process"], "--scheduler-processes"),
    (["--pools", "5", "--nodes", "4"], "--nodes"),
])
def test_pool_bench_e2e_names_a_bad_flag(argv: list[str], flag: str) -> None:
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "cli.main", "bench", "e2e", *argv],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode != 0 and flag in done.stderr


def test_the_queued_bench_replays_every_request_and_holds_the_waiting_ones_compactly() -> None:
    from bench.queued import run_queued_bench

    result = run_queued_bench(nodes=20, requests=2000)
    assert result["queued"] + result["placed_first_cycle"] == 2000
    assert result["held_compactly"] == result["queued"] > 0  # every waiting one is a record
    assert result["replay_s"] > 0 and result["rss_after_replay_mib"] > result["rss_base_mib"]


def test_the_queued_bench_starts_a_scheduler_from_the_checkpoint_beside_the_full_replay() -> None:
    from bench.queued import run_queued_bench

    result = run_queued_bench(nodes=20, requests=2000, checkpoint=True)
    restored = result["from_checkpoint"]
    assert restored["restored_at"] is not None and result["checkpoint_bytes"] > 0
    # it folds the tail and the first process's placements, not the log again
    assert 0 < restored["events"] < result["events"]
    assert restored["queued"] + restored["placed_first_cycle"] == (
        result["queued"] + restored["tail"])
    assert "start-up from the checkpoint / full replay" in result["table"]


def test_the_run_bench_runs_every_lease_and_times_every_end() -> None:
    from agents.runtimes.process import ProcessRuntime
    from bench.run import run_run_bench

    why = ProcessRuntime(Path("/tmp")).available()
    if why is not None:
        pytest.skip(f"process runtime unavailable: {why}")
    # three counted runs (after the uncounted warm-up): a median of each still compares
    result = run_run_bench(runs=3)
    assert result["lease_run"]["n"] == result["help"]["n"] == result["exit_to_ended"]["n"] == 3
    assert result["echo_to_terminal"]["n"] == 10 and result["echo_to_terminal"]["p50_ms"] > 0
    # the whole run costs more than the sandbox alone, and more than the end's report
    assert 0 < result["bwrap"]["p50_ms"] < result["lease_run"]["p50_ms"]
    assert 0 < result["exit_to_ended"]["p50_ms"] < result["lease_run"]["p50_ms"]
    assert "pool lease run -- true" in result["table"]


def test_the_run_bench_times_the_docker_runtime_beside_docker_run() -> None:
    from bench.run import docker_unavailable, run_run_bench

    why = docker_unavailable()
    if why is not None:
        pytest.skip(why)
    result = run_run_bench(runs=2, docker=True)
    assert result["docker_skipped"] is None
    assert result["docker_lease_run"]["n"] == result["docker_run"]["n"] == 2
    # a lease's container is a container too, and more: its start is under the lease's
    assert 0 < result["docker_run"]["min_ms"] < result["docker_lease_run"]["max_ms"]
    assert "docker run --rm … true" in result["table"]


def test_the_workdir_bench_moves_every_byte_and_compares_with_the_raw_store() -> None:
    from bench.workdir import run_workdir_bench

    result = run_workdir_bench(quick=True)
    assert result["mib"] == 4 and result["files"] == 17 and result["runs"] == 2
    for k in ("upload_mib_s", "raw_put_mib_s", "fetch_mib_s", "raw_get_mib_s"):
        assert result[k] > 0, k
    assert result["upload_ratio"] > 0 and result["fetch_ratio"] > 0
    assert "raw object put" in result["table"] and "goal >= 0.8" in result["table"]
    if "unavailable" not in result:
        assert result["start_none_ms"] > 0 and result["start_cached_ms"] > 0
