"""`pool lease run|logs|watch` and `request --wait`, the real binary against a real control plane
and a real agent running jobs in the bubblewrap sandbox."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agents.agent import Agent
from agents.probe import NodeProbe, Reserve
from agents.runtimes.process import ProcessRuntime
from bus.admin import ensure_all_streams
from bus.agentbus import AgentLink
from bus.local.server import NatsServer
from client.api import PoolClient
from tests.control_plane import setup_pool
from workers.plane import ControlPlane

if ProcessRuntime(Path("/tmp")).available() is not None:
    pytest.skip(f"process runtime unavailable: {ProcessRuntime(Path('/tmp')).available()}",
                allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]
PROBE = NodeProbe(cpu_millis=4500, cpu_arch="amd64", memory_mib=9216, local_disk_gib=50)


@pytest.fixture()
def plane(fresh_nats: NatsServer, tmp_path: Path) -> Iterator[str]:
    ensure_all_streams(fresh_nats.url)  # as `pool up` does: telemetry carries the job's output
    cp = ControlPlane(fresh_nats.url, leader_ttl_seconds=1.0).start()
    with PoolClient(fresh_nats.url) as admin:
        # a short grace: a stopped job has 2 s before SIGKILL
        setup_pool(admin, tenants={"alpha": 1.0}, heartbeat_timeout_seconds=5,
                   preemption={"enabled": False, "grace_seconds": 2})
        assert admin.admin("node.enroll", {"node_id": "n1", "pool_id": "p1",
                                           "trust_level": "trusted"})["ok"]
    link = AgentLink(fresh_nats.url, "n1").connect()
    agent = Agent(link, ProcessRuntime(tmp_path / "n1"), node_id="n1", pool_id="p1",
                  probe=PROBE, state_dir=tmp_path / "n1", reserve=Reserve(500, 1024, 0),
                  heartbeat_interval=0.5)
    stop = threading.Event()
    thread = threading.Thread(target=agent.run, args=(stop,), daemon=True)
    thread.start()
    yield fresh_nats.url
    stop.set()
    thread.join(15)
    link.close()
    cp.stop()


def _pool(url: str, *argv: str, timeout: float = 60,
          lean: bool = True) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("POOL_")}
    if not lean:
        env["POOL_FAST_PATHS"] = "off"  # cli/lease.py: the client with nats-py
    return subprocess.run([sys.executable, "-m", "cli.main", *argv], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout, check=False)


def _lease_args(url: str) -> list[str]:
    return ["--nats-url", url, "--tenant", "alpha", "--pool", "p1", "--cpu-millis", "500",
            "--memory-mib", "256", "--runtime", "sandboxed", "--max-runtime", "120"]


def test_lease_run_prints_the_job_s_output_and_exits_0(plane: str) -> None:
    out = _pool(plane, "lease", "run", *_lease_args(plane), "--", "python3", "-c", "print(1)")
    assert out.returncode == 0, out.stderr
    assert out.stdout == "1\n"


def test_lease_run_exits_with_the_job_s_exit_code_and_shows_both_streams(plane: str) -> None:
    out = _pool(plane, "lease", "run", *_lease_args(plane), "--json", "--",
                "sh", "-c", "echo to-out; echo to-err >&2; exit 3")
    assert out.returncode == 3, out.stderr
    assert "to-out\n" in out.stdout and "to-err\n" in out.stdout
    ended = json.loads(out.stdout.splitlines()[-1])["lease"]
    assert (ended["end_reason"], ended["exit_code"]) == ("failed", 3)


def test_lease_run_over_core_nats_ends_as_over_nats_py(plane: str) -> None:
    # the lean client (client.lean) and the plain one: the same output, exit code and lease
    job = ["--json", "--", "sh", "-c", "echo to-out; echo to-err >&2; exit 3"]
    lean = _pool(plane, "lease", "run", *_lease_args(plane), *job)
    plain = _pool(plane, "lease", "run", *_lease_args(plane), *job, lean=False)
    assert (lean.returncode, plain.returncode) == (3, 3), (lean.stderr, plain.stderr)
    assert lean.stdout.splitlines()[:-1] == plain.stdout.splitlines()[:-1]
    leases = [json.loads(out.stdout.splitlines()[-1]) for out in (lean, plain)]
    # less the ids, the times and the event count (the plane's: its reports and timers
    # land as they may, one event more or less whichever client asked)
    same = [{k: v for k, v in lease["lease"].items()
             if k not in ("lease_id", "idempotency_key", "version") and "_at" not in k
             and "deadline" not in k} for lease in leases]
    assert same[0] == same[1]
    assert leases[0]["lease"].keys() == leases[1]["lease"].keys()
    assert [ln for ln in lean.stderr.splitlines() if "lease" not in ln] == \
        [ln for ln in plain.stderr.splitlines() if "lease" not in ln]


def test_lease_logs_replays_a_finished_job_and_follows_a_running_one(plane: str) -> None:
    lid = _pool(plane, "lease", "run", *_lease_args(plane), "--detach", "--",
                "sh", "-c", "for i in 1 2 3; do echo line-$i; sleep 0.5; done").stdout.strip()
    u = ["--nats-url", plane, "--tenant", "alpha"]
    followed = _pool(plane, "lease", "logs", lid, "--follow", *u)
    assert followed.returncode == 0, followed.stderr
    assert followed.stdout == "line-1\nline-2\nline-3\n"
    assert _pool(plane, "lease", "logs", lid, *u).stdout == "line-1\nline-2\nline-3\n"
    watched = _pool(plane, "lease", "watch", lid, *u)
    assert watched.returncode == 0 and "released" in watched.stdout.splitlines()[-1]
    assert "succeeded" in watched.stdout


def test_ctrl_c_on_lease_run_cancels_the_lease(plane: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("POOL_")}
    proc = subprocess.Popen([sys.executable, "-m", "cli.main", "lease", "run",
                             *_lease_args(plane), "--key", "ctrl-c", "--", "sleep", "60"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stderr is not None
        for line in proc.stderr:
            if "running on" in line:
                break
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 130
    finally:
        if proc.poll() is None:
            proc.kill()
    with PoolClient(plane, "alpha") as alpha:
        from domain.lease import Lease

        lid = str(Lease.create_id("alpha", "ctrl-c"))
        lease = alpha.lease(lid, "get")["lease"]
    assert lease["state"] == "cancelled" and lease["end_reason"] == "cancelled"


def test_request_wait_says_why_a_lease_cannot_be_placed(plane: str) -> None:
    t0 = time.monotonic()
    out = _pool(plane, "lease", "request", "--nats-url", plane, "--tenant", "alpha", "--pool",
                "p1", "--cpu-millis", "500000", "--memory-mib", "256", "--max-runtime", "60",
                "--wait")
    assert out.returncode == 1 and out.stdout == ""
    assert "not_reserved" in out.stderr and time.monotonic() - t0 < 30
    ok = _pool(plane, "lease", "request", *_lease_args(plane), "--wait", "--json")
    assert ok.returncode == 0 and json.loads(ok.stdout)["lease"]["state"] == "reserved"


def test_lease_run_takes_its_request_and_job_from_a_job_file(plane: str, tmp_path: Path) -> None:
    job = tmp_path / "job.yaml"
    job.write_text("""\
pool_id: p1
shape: {cpu_millis: 500, memory_mib: 256, runtime: sandboxed}
maximum_runtime_seconds: 120
command: [sh, -c, 'echo "hello $WHO"']
env: {WHO: world}
""")
    out = _pool(plane, "lease", "run", "-f", str(job), "--nats-url", plane, "--tenant", "alpha")
    assert out.returncode == 0, out.stderr
    assert out.stdout == "hello world\n"


def test_lease_run_loads_nothing_of_the_scheduler(plane: str) -> None:
    # a tenant's command starts fast: numpy, eventsourcing, the control plane and PostgreSQL
    # are the plane's, never loaded by `pool lease run` (nor the domain's aggregates)
    code = ("import json, sys\nfrom cli.main import main\nrc = main(sys.argv[1:])\n"
            "sys.stderr.write('\\nMODULES ' + json.dumps(sorted(sys.modules)))\nsys.exit(rc)")
    env = {k: v for k, v in os.environ.items() if not k.startswith("POOL_")}
    out = subprocess.run([sys.executable, "-c", code, "lease", "run", *_lease_args(plane),
                          "--", "true"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    modules = json.loads(out.stderr.rsplit("MODULES ", 1)[1])
    heavy = [m for m in modules if m.split(".")[0] in ("numpy", "eventsourcing", "workers",
                                                       "psycopg", "projections")
             or m in ("domain.lease", "domain.policy.fairness", "domain.policy.placement")]
    assert heavy == []
    # nor, over NATS, nats-py, asyncio, OpenTelemetry or the schemas (client.lean)
    from tests.unit.test_cli_start import LEAN_RUN_SPARES

    assert [m for m in modules if any(m == s or m.startswith(s + ".")
                                      for s in LEAN_RUN_SPARES)] == []
