"""The fault suite, `pool chaos`: runs each scenario of chaos/scenarios/ at its size and judges it.
How it runs and judges: docs/architecture.md#the-fault-suite.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from chaos.harness import Outcome, Workspace
from chaos.scenarios.agent import scenario_agent_stopped
from chaos.scenarios.bad_input import scenario_bad_input
from chaos.scenarios.failover import scenario_scheduler_failover
from chaos.scenarios.malicious import run as scenario_malicious_tenant
from chaos.scenarios.nats import scenario_nats_kills, scenario_quorum_loss
from chaos.scenarios.noisy import scenario_noisy_neighbour
from chaos.scenarios.postgres import scenario_postgres_restart
from chaos.scenarios.projector import scenario_projector_kills
from chaos.scenarios.retries import scenario_idempotent_retries

NAMES = {
    1: "nats node kills (R3)",
    2: "quorum loss",
    3: "scheduler failover",
    4: "projector kills",
    5: "idempotent retries",
    6: "agent stopped past grace",
    7: "postgres restart",
    8: "bad input",
    9: "malicious tenant",
    10: "noisy neighbour",
}

# scenario 10's pool: limits low enough that a flood of a few seconds meets each of them
_NOISY: dict[str, Any] = {"heartbeat_timeout_s": 30, "node_timeout_s": 5, "queue_cap": 30,
                          "requests_per_second": 20, "request_burst": 40,
                          "commands_per_second": 20, "command_burst": 40,
                          "output_cap": 256 << 10, "output_bytes": 8 << 20}

# --quick fits CI on a 2-core machine; the full sizes are the issue's
QUICK: dict[int, dict[str, Any]] = {
    1: {"commands": 1000, "kill_every_s": 2.0, "threads": 6},
    2: {"outage_s": 5.0, "before": 60, "after": 60},
    3: {"kills": 3, "nodes": 4, "rate": 12.0, "leader_ttl_s": 1.0},
    4: {"events": 4000, "kills": 4},
    5: {"commands": 300, "threads": 6},
    6: {"rounds": 1, "leases": 1},
    7: {"grants": 240, "restarts": 1, "rate": 40.0},
    8: {"inputs": 1000},
    9: {"attacks": 2000, "leases": 20, "nodes": 4},
    10: {**_NOISY, "rounds": 5, "quiet": 40, "rate": 10.0, "concurrency": 8, "streams": 24},
}
FULL: dict[int, dict[str, Any]] = {
    1: {"commands": 10_000, "kill_every_s": 4.0, "threads": 8},
    2: {"outage_s": 15.0, "before": 300, "after": 300},
    3: {"kills": 10, "nodes": 6, "rate": 15.0, "leader_ttl_s": 1.0},
    4: {"events": 50_000, "kills": 20},
    5: {"commands": 2000, "threads": 8},
    6: {"rounds": 3, "leases": 2},
    7: {"grants": 2000, "restarts": 3, "rate": 60.0},
    8: {"inputs": 5000},
    9: {"attacks": 10_000, "leases": 100, "nodes": 8},
    10: {**_NOISY, "rounds": 4, "quiet": 150, "rate": 10.0, "concurrency": 32, "streams": 64},
}


SCENARIOS: dict[int, Callable[[Workspace, dict[str, Any], Outcome], None]] = {
    1: scenario_nats_kills,
    2: scenario_quorum_loss,
    3: scenario_scheduler_failover,
    4: scenario_projector_kills,
    5: scenario_idempotent_retries,
    6: scenario_agent_stopped,
    7: scenario_postgres_restart,
    8: scenario_bad_input,
    9: scenario_malicious_tenant,
    10: scenario_noisy_neighbour,
}


def run_scenario(number: int, *, quick: bool = False, keep: bool = False,
                 size: dict[str, Any] | None = None) -> Outcome:
    """Run one scenario in a workspace of its own; an exception is a failure, not a crash."""
    o = Outcome(number, NAMES[number])
    ws = Workspace(f"s{number}", keep=keep)
    t0 = time.monotonic()
    try:
        SCENARIOS[number](ws, size or (QUICK if quick else FULL)[number], o)
    except Exception as e:  # noqa: BLE001 - the scenario could not finish: that is a failure
        o.problems.append(f"{type(e).__name__}: {str(e)[:300]}")
        import traceback

        (ws.dir / "chaos-traceback.txt").write_text(traceback.format_exc())
    finally:
        o.seconds = time.monotonic() - t0
        ws.close(failed=not o.passed and o.skipped is None)
        if not o.passed and o.skipped is None:
            o.problems.append(f"logs in {ws.dir}")
    return o


def run_suite(*, quick: bool = False, only: list[int] | None = None, keep: bool = False,
              progress: Callable[[str], None] | None = None,
              on_result: Callable[[Outcome], None] | None = None) -> list[Outcome]:
    results = []
    for n in only or sorted(SCENARIOS):
        if progress:
            progress(f"chaos: {n}. {NAMES[n]} …")
        o = run_scenario(n, quick=quick, keep=keep)
        results.append(o)
        if on_result:
            on_result(o)
    return results


def summary(results: list[Outcome]) -> str:
    passed = sum(o.passed for o in results)
    skipped = sum(o.skipped is not None for o in results)
    failed = len(results) - passed - skipped
    return f"faults: {passed} passed, {failed} failed" + (f", {skipped} skipped"
                                                          if skipped else "")
