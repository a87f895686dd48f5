"""A docker lease's output reaches its tenant: the real agent ships the container's stdout and
stderr as `output` telemetry, so `pool lease run` streams it and `pool lease logs` replays it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import docker
import pytest

from agents.agent import Agent
from agents.probe import NodeProbe, Reserve
from agents.runtimes.docker import LABEL_NODE, DockerRuntime
from bench.docker_engine import (
    LocalRegistry,
    busybox_by_digest,
    busybox_unavailable,
    engine_unavailable,
)
from bus.admin import ensure_all_streams
from bus.agentbus import AgentLink
from bus.local.server import NatsServer
from client.api import PoolClient
from tests.control_plane import setup_pool
from workers.plane import ControlPlane

_WHY = engine_unavailable() or busybox_unavailable() or LocalRegistry.unavailable()
if _WHY is not None:
    pytest.skip(_WHY, allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]
PROBE = NodeProbe(cpu_millis=4500, cpu_arch="amd64", memory_mib=9216, local_disk_gib=50)


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    client = docker.from_env(timeout=120)
    with busybox_by_digest(client, tmp_path_factory.mktemp("registry")) as ref:
        yield ref
    client.close()


@pytest.fixture()
def plane(fresh_nats: NatsServer, tmp_path: Path) -> Iterator[str]:
    ensure_all_streams(fresh_nats.url)
    cp = ControlPlane(fresh_nats.url, leader_ttl_seconds=1.0).start()
    node = f"dk-{uuid.uuid4().hex[:8]}"
    with PoolClient(fresh_nats.url) as admin:
        setup_pool(admin, tenants={"alpha": 1.0}, heartbeat_timeout_seconds=5)
        assert admin.admin("node.enroll", {"node_id": node, "pool_id": "p1",
                                           "trust_level": "trusted"})["ok"]
    runtime = DockerRuntime(tmp_path / node, node_id=node)
    link = AgentLink(fresh_nats.url, node).connect()
    agent = Agent(link, runtime, node_id=node, pool_id="p1", probe=PROBE,
                  state_dir=tmp_path / node, reserve=Reserve(500, 1024, 0),
                  heartbeat_interval=0.5)
    stop = threading.Event()
    thread = threading.Thread(target=agent.run, args=(stop,), daemon=True)
    thread.start()
    yield fresh_nats.url
    stop.set()
    thread.join(15)
    link.close()
    cp.stop()
    engine = docker.from_env(timeout=60)
    for c in engine.containers.list(all=True, filters={"label": f"{LABEL_NODE}={node}"}):
        c.remove(force=True)
    engine.close()


def _pool(*argv: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("POOL_")}
    return subprocess.run([sys.executable, "-m", "cli.main", *argv], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120, check=False)


def test_a_docker_job_s_output_is_streamed_and_replayed(plane: str, image: str) -> None:
    who = ["--nats-url", plane, "--tenant", "alpha"]
    run = _pool("lease", "run", *who, "--pool", "p1", "--cpu-millis", "500", "--memory-mib",
                "128", "--max-runtime", "120", "--image", image, "--runtime", "container",
                "--", "/bin/sh", "-c", "echo to-out; sleep 0.3; echo to-err >&2; sleep 1; echo done; exit 2")
    assert run.returncode == 2, run.stderr
    assert run.stdout == "to-out\nto-err\ndone\n"
    lid = re.search(r"lease (\S+) running on", run.stderr).group(1)  # type: ignore[union-attr]
    logs = _pool("lease", "logs", lid, *who)
    assert logs.returncode == 0, logs.stderr
    assert logs.stdout == "to-out\nto-err\ndone\n"
