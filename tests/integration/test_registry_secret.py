"""A private registry's image through a lease: Debian's docker-registry on 127.0.0.1 with
htpasswd users, an image pushed there, and a docker agent that pulls it only with the job's
registry secret (`--registry-secret`), whose value reaches no stream, server file or log."""

from __future__ import annotations

import io
import logging
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import docker
import pytest

from agents.agent import Agent
from agents.probe import NodeProbe, Reserve
from agents.runtimes.docker import LABEL_NODE, DockerRuntime
from bench.docker_engine import (
    LocalRegistry,
    busybox_unavailable,
    engine_unavailable,
    import_busybox,
)
from bus.admin import ensure_all_streams
from bus.agentbus import AgentLink
from bus.local.server import NatsServer
from client.api import PoolClient
from tests.control_plane import setup_pool
from tests.integration.test_job_secrets import _forms, _stream_bytes
from workers.plane import ControlPlane
from workers.secrets.settings import SecretSettings

_WHY = engine_unavailable() or busybox_unavailable() or LocalRegistry.unavailable()
if _WHY is not None:
    pytest.skip(_WHY, allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]
PROBE = NodeProbe(cpu_millis=4500, cpu_arch="amd64", memory_mib=9216, local_disk_gib=50)
USER = "puller"
PASSWORD = "pw-" + uuid.uuid4().hex  # what must be found nowhere


@dataclass
class Private:
    ref: str  # HOST/repo@sha256:…, pushed as USER and pullable only with USER's password
    registry: LocalRegistry


@pytest.fixture(scope="module")
def private(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Private]:
    import bcrypt

    root = tmp_path_factory.mktemp("private-registry")
    htpasswd = root / "htpasswd"
    hashed = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(rounds=4)).decode()
    htpasswd.write_text(f"{USER}:{hashed}\n")
    registry = LocalRegistry(root / "registry", htpasswd=htpasswd)
    registry.start()
    client = docker.from_env(timeout=120)
    repo, tag = f"computepool-test/private-{uuid.uuid4().hex[:8]}", "t"
    image_id = None
    try:
        # this client's own credentials, for the push only: the engine keeps none
        client.login(username=USER, password=PASSWORD, registry=registry.host)
        image_id = import_busybox(client, repo, tag)
        ref = registry.push(client, image_id, repo, tag)
        client.images.remove(f"{repo}:{tag}")
        client.images.remove(f"{registry.host}/{repo}:{tag}")
        yield Private(ref, registry)
    finally:
        for gone in (ref.split("@")[0] if image_id else None, image_id):
            if gone:
                try:
                    client.images.remove(gone, force=True)
                except docker.errors.DockerException:
                    pass
        registry.stop()
        client.close()


@dataclass
class Plane:
    url: str
    store_dir: Path
    logs: io.StringIO


@pytest.fixture()
def plane(fresh_nats: NatsServer, tmp_path: Path) -> Iterator[Plane]:
    logs = io.StringIO()
    handler = logging.StreamHandler(logs)
    handler.setFormatter(logging.Formatter("%(name)s %(levelname)s %(message)s"))
    root = logging.getLogger()
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    ensure_all_streams(fresh_nats.url)
    cp = ControlPlane(fresh_nats.url, leader_ttl_seconds=1.0,
                      secrets=SecretSettings.with_keys("k1=registry")).start()
    node = f"rg-{uuid.uuid4().hex[:8]}"
    with PoolClient(fresh_nats.url) as admin:
        setup_pool(admin, tenants={"alpha": 1.0}, heartbeat_timeout_seconds=5)
        assert admin.admin("node.enroll", {"node_id": node, "pool_id": "p1",
                                           "trust_level": "trusted"})["ok"]
    link = AgentLink(fresh_nats.url, node).connect()
    agent = Agent(link, DockerRuntime(tmp_path / node, node_id=node), node_id=node,
                  pool_id="p1", probe=PROBE, state_dir=tmp_path / node,
                  reserve=Reserve(500, 1024, 0), heartbeat_interval=0.5)
    stop = threading.Event()
    thread = threading.Thread(target=agent.run, args=(stop,), daemon=True)
    thread.start()
    try:
        yield Plane(fresh_nats.url, fresh_nats.store_dir, logs)
    finally:
        stop.set()
        thread.join(15)
        link.close()
        cp.stop()
        root.removeHandler(handler)
        root.setLevel(level)
        engine = docker.from_env(timeout=60)
        for c in engine.containers.list(all=True, filters={"label": f"{LABEL_NODE}={node}"}):
            c.remove(force=True)
        engine.close()


def _pool(*argv: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("POOL_")}
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run([sys.executable, "-m", "cli.main", *argv], cwd=ROOT, env=env,
                          input=stdin, capture_output=True, text=True, timeout=120,
                          check=False)


def test_a_private_image_is_pulled_with_the_registry_secret_and_refused_without(
        private: Private, plane: Plane) -> None:
    who = ["--nats-url", plane.url, "--tenant", "alpha"]
    done = _pool("secret", "set", "regcred", *who, stdin=f"{USER}:{PASSWORD}\n")
    assert done.returncode == 0, done.stderr
    run = ("lease", "run", *who, "--pool", "p1", "--cpu-millis", "500", "--memory-mib", "128",
           "--max-runtime", "120", "--image", private.ref, "--runtime", "container")

    refused = _pool(*run, "--", "/bin/echo", "pulled")
    assert refused.returncode != 0 and refused.stdout == ""
    lid = refused.stderr.split("lease ", 1)[1].split()[0]
    with PoolClient(plane.url, "alpha") as alpha:  # the start's failure sample says why
        deadline = time.monotonic() + 10  # published beside the end's report: stored soon after
        while not (got := alpha.replay_telemetry({"lease": lid, "kind": "failure"})[
                "result"]["samples"]) and time.monotonic() < deadline:
            time.sleep(0.05)
    assert [s["event"]["attrs"]["reason"] for s in got] == ["registry_unauthorized"], got

    pulled = _pool(*run, "--registry-secret", "regcred", "--", "/bin/echo", "pulled")
    assert pulled.returncode == 0, pulled.stderr
    assert pulled.stdout == "pulled\n"

    unknown = _pool(*run, "--registry-secret", "nosuch", "--", "/bin/echo", "pulled")
    assert unknown.returncode != 0 and "secret_unknown" in unknown.stderr, unknown.stderr

    # the password is in no stream (the log, telemetry, KV: sealed there), no file of the
    # server, no log record of the plane or the agent, and nothing the CLI printed
    streams = _stream_bytes(plane.url)
    assert b"regcred" in streams["POOL_EVENTS"]  # the log names it
    server_files = b"".join(p.read_bytes() for p in plane.store_dir.rglob("*") if p.is_file())
    logs = plane.logs.getvalue().encode()
    assert logs
    for form in _forms(PASSWORD.encode()):
        for name, data in streams.items():
            assert form not in data, f"the registry password is in stream {name}"
        assert form not in server_files and form not in logs
        for out in (done, refused, pulled, unknown):
            assert form.decode() not in out.stdout + out.stderr
