"""A tenant's secrets through a lease, with real components: a secured nats-server (tenant and
node users as `pool up` makes them), the control plane and its PostgreSQL views, an agent
running the job in the bubblewrap sandbox, and the `pool` binary. A secret reaches the job as a
variable and a file and is found nowhere else: not in any stream's messages, the server's
files, the views or the logs; another tenant and another node cannot reach it."""

from __future__ import annotations

import base64
import hashlib
import io
import json
import logging
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
import pytest
from nats.js.errors import NotFoundError

from agents.agent import Agent
from agents.probe import NodeProbe, Reserve
from agents.runtimes.process import ProcessRuntime
from bus.admin import ensure_all_streams
from bus.agentbus import AgentLink
from bus.connection import connect
from bus.errors import BusError
from bus.local.auth import AuthConfig, url_with_credentials
from bus.local.server import NatsServer
from bus.objects import ensure_tenant_buckets_sync
from bus.replies import node_inbox
from bus.runtime import run_sync
from client.api import PoolClient
from projections.views.schema import drop_schema
from tests.control_plane import lease_body, setup_pool
from workers.bootstrap import application
from workers.plane import ControlPlane
from workers.projector import Projector
from workers.secrets.settings import SecretSettings

if ProcessRuntime(Path("/tmp")).available() is not None:
    pytest.skip(f"process runtime unavailable: {ProcessRuntime(Path('/tmp')).available()}",
                allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]
PROBE = NodeProbe(cpu_millis=4500, cpu_arch="amd64", memory_mib=9216, local_disk_gib=50)
# the job proves it holds the value by its digest: printing the value would put it in the
# tenant's own telemetry stream, which is the job's choice, not the plane's leak
CHECK = """\
import hashlib, os, stat
env = os.environ["API_TOKEN"].encode()
path = "/run/secrets/api-token"
data = open(path, "rb").read()
mode = stat.S_IMODE(os.stat(path).st_mode)
print(hashlib.sha256(env).hexdigest(), hashlib.sha256(data).hexdigest(), oct(mode))
"""


@dataclass
class Stack:
    url: str
    auth: AuthConfig
    store_dir: Path
    database_url: str
    schema: str
    logs: io.StringIO
    value: bytes = field(default_factory=lambda: f"s3cr3t-{uuid.uuid4().hex}".encode())

    def tenant_url(self, tenant: str) -> str:
        return url_with_credentials(self.url, self.auth.tenants[tenant])


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, database_url: str) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("secrets")
    # every log record of the plane and the agent, at every level, for the leak check
    logs = io.StringIO()
    handler = logging.StreamHandler(logs)
    handler.setFormatter(logging.Formatter("%(name)s %(levelname)s %(message)s"))
    root = logging.getLogger()
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    auth = AuthConfig()
    for t in ("alpha", "beta"):
        auth.add_tenant(t)
    for n in ("n1", "n2"):
        auth.add_node(n)
    server = NatsServer(store_dir=tmp / "nats", server_name="pool-secrets",
                        extra_config=auth.render())
    server.start()
    service = url_with_credentials(server.url, auth.service)
    ensure_all_streams(service)
    ensure_tenant_buckets_sync(service, ["alpha", "beta"])  # the workdir with the script
    schema = "views_secrets_" + uuid.uuid4().hex[:8]
    cp = ControlPlane(service, leader_ttl_seconds=1.0,
                      secrets=SecretSettings.with_keys("k2=new-key,k1=old-key")).start()
    projector = Projector(application(service), database_url, schema=schema).start()
    with PoolClient(service) as admin:
        setup_pool(admin, tenants={"alpha": 1.0, "beta": 1.0}, heartbeat_timeout_seconds=5,
                   preemption={"enabled": False, "grace_seconds": 2})
        assert admin.admin("node.enroll", {"node_id": "n1", "pool_id": "p1",
                                           "trust_level": "trusted"})["ok"]
    link = AgentLink(url_with_credentials(server.url, auth.nodes["n1"]), "n1").connect()
    agent = Agent(link, ProcessRuntime(tmp / "n1"), node_id="n1", pool_id="p1", probe=PROBE,
                  state_dir=tmp / "n1", reserve=Reserve(500, 1024, 0), heartbeat_interval=0.5)
    stop = threading.Event()
    thread = threading.Thread(target=agent.run, args=(stop,), daemon=True)
    thread.start()
    try:
        yield Stack(server.url, auth, tmp / "nats", database_url, schema, logs)
    finally:
        stop.set()
        thread.join(15)
        link.close()
        projector.stop()
        cp.stop()
        server.stop()
        drop_schema(database_url, schema)
        root.removeHandler(handler)
        root.setLevel(level)


def _pool(stack: Stack, cwd: Path, *argv: str, stdin: bytes | None = None,
          timeout: float = 60) -> subprocess.CompletedProcess[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("POOL_")}
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run([sys.executable, "-m", "cli.main", *argv], cwd=cwd, env=env,
                          input=stdin, capture_output=True, timeout=timeout, check=False)


def _tenant(stack: Stack, tenant: str = "alpha") -> list[str]:
    return ["--nats-url", stack.tenant_url(tenant), "--tenant", tenant]


def _run_args(stack: Stack, tenant: str = "alpha") -> list[str]:
    return ["lease", "run", *_tenant(stack, tenant), "--pool", "p1", "--cpu-millis", "500",
            "--memory-mib", "256", "--runtime", "sandboxed", "--max-runtime", "120",
            "--timeout", "30"]


def _set(stack: Stack, tmp: Path, name: str, value: bytes, tenant: str = "alpha") -> None:
    done = _pool(stack, tmp, "secret", "set", name, *_tenant(stack, tenant), stdin=value + b"\n")
    assert done.returncode == 0, done.stderr
    assert value not in done.stdout + done.stderr


def _stream_bytes(url: str) -> dict[str, bytes]:
    """Every message of every stream, read directly (subject, headers and body), by stream."""

    async def go() -> dict[str, bytes]:
        nc = await connect(url, reconnect=False)
        out: dict[str, bytes] = {}
        try:
            js = nc.jetstream()
            for info in await js.streams_info():
                name = str(info.config.name)
                chunks: list[bytes] = []
                for seq in range(max(1, info.state.first_seq), info.state.last_seq + 1):
                    try:
                        msg = await js.get_msg(name, seq)
                    except NotFoundError:  # deleted, purged or expired
                        continue
                    chunks += [(msg.subject or "").encode(), repr(msg.headers).encode(),
                               msg.data or b""]
                out[name] = b"\n".join(chunks)
        finally:
            await nc.close()
        return out

    result: dict[str, bytes] = run_sync(go(), timeout=60)
    return result


def _views_text(stack: Stack) -> str:
    with psycopg.connect(stack.database_url, autocommit=True) as conn:
        tables = [r[0] for r in conn.execute(
            "SELECT table_name FROM information_schema.tables WHERE table_schema = %s",
            (stack.schema,))]
        rows: list[str] = []
        for t in tables:
            rows += [str(r[0]) for r in conn.execute(
                f'SELECT t::text FROM "{stack.schema}"."{t}" t')]
    return "\n".join(rows)


def _forms(value: bytes) -> list[bytes]:
    """The value as it could be written down: raw, base64 (JSON bytes), hex, JSON-escaped."""
    return [value, base64.b64encode(value), value.hex().encode(),
            json.dumps(value.decode()).encode()[1:-1]]


def _wait_for(pred: Any, timeout: float = 20.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = pred()
        if got:
            return got
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def test_a_secret_reaches_the_job_as_a_variable_and_a_file_and_nowhere_else(
        stack: Stack, tmp_path: Path) -> None:
    _set(stack, tmp_path, "api-token", stack.value)
    listed = _pool(stack, tmp_path, "secret", "list", *_tenant(stack), "--json")
    [row] = json.loads(listed.stdout)["result"]["secrets"]
    assert (row["name"], row["version"], row["size_bytes"], row["key_id"]) == \
        ("api-token", 1, len(stack.value), "k2")
    (tmp_path / "check.py").write_text(CHECK)
    done = _pool(stack, tmp_path, *_run_args(stack), "--workdir", ".",
                 "--secret-env", "API_TOKEN=api-token", "--secret-file", "api-token",
                 "--env", "PUBLIC=visible", "--", "python3", "check.py")
    assert done.returncode == 0, done.stderr
    want = hashlib.sha256(stack.value).hexdigest()
    assert done.stdout.decode().split() == [want, want, "0o400"]
    lid = done.stderr.decode().split("lease ", 1)[1].split()[0]

    # the log names the secret and its version, never its value
    with PoolClient(stack.tenant_url("alpha"), "alpha") as alpha:
        lease = alpha.lease(lid, "get")["lease"]
    assert lease["state"] == "released"
    _wait_for(lambda: lid in _views_text(stack) and "released" in _views_text(stack))
    streams = _stream_bytes(url_with_credentials(stack.url, stack.auth.service))
    assert b"api-token" in streams["POOL_EVENTS"] and b"visible" in streams["POOL_EVENTS"]
    assert b"api-token" in streams["KV_pool_secrets"] and "POOL_TELEMETRY" in streams
    server_files = b"".join(p.read_bytes() for p in stack.store_dir.rglob("*") if p.is_file())
    views = _views_text(stack).encode()
    logs = stack.logs.getvalue().encode()
    assert logs and views
    for form in _forms(stack.value):
        for name, data in streams.items():
            assert form not in data, f"the secret is in stream {name}"
        assert form not in server_files, "the secret is in the server's files"
        assert form not in views, "the secret is in the views"
        assert form not in logs, "the secret is in the logs"
        assert form not in done.stderr


def test_another_tenant_cannot_read_list_or_use_a_secret(stack: Stack, tmp_path: Path) -> None:
    _set(stack, tmp_path, "alpha-only", b"alpha's")
    with PoolClient(stack.tenant_url("beta"), "beta") as beta:
        assert beta.call("pool.cmd.beta.secret.list", {})["result"]["secrets"] == []
        with pytest.raises(BusError):  # another tenant's subject: the server drops it
            beta.call("pool.cmd.alpha.secret.list", {}, timeout=1)
        gone = beta.call("pool.cmd.beta.secret.delete", {"name": "alpha-only"})
        assert gone["error"]["code"] == "secret_unknown"
    used = _pool(stack, tmp_path, *_run_args(stack, "beta"), "--secret-env", "T=alpha-only",
                 "--", "true")
    assert used.returncode == 1 and b"[secret_unknown]" in used.stderr, used.stderr
    with PoolClient(stack.tenant_url("alpha"), "alpha") as alpha:
        names = [s["name"] for s in alpha.call("pool.cmd.alpha.secret.list", {})
                 ["result"]["secrets"]]
    assert "alpha-only" in names

    # and no tenant reads the sealed bucket itself
    async def read_bucket() -> None:
        nc = await connect(stack.tenant_url("alpha"), reconnect=False)
        try:
            js = nc.jetstream(timeout=1)
            await js.get_msg("KV_pool_secrets", 1, direct=True)
        finally:
            await nc.close()

    with pytest.raises(BusError):  # a permission violation: no answer comes
        run_sync(read_bucket(), timeout=10)


def test_only_the_node_holding_the_lease_gets_its_secrets_for_its_epoch(
        stack: Stack, tmp_path: Path) -> None:
    _set(stack, tmp_path, "held", b"for-n1-only")
    with PoolClient(stack.tenant_url("alpha"), "alpha") as alpha:
        r = alpha.request_lease(lease_body("held-" + uuid.uuid4().hex[:6], runtime="sandboxed",
                                           memory_mib=256, max_runtime=120))
        lid = r["lease"]["lease_id"]
        _wait_for(lambda: alpha.lease(lid, "get")["lease"]["state"] == "reserved")
        job = {"command": ["sleep", "5"], "secret_files": {"held": "/run/secrets/held"}}
        assert alpha.lease(lid, "commit", {"job": job})["ok"]
        epoch = alpha.lease(lid, "get")["lease"]["epoch"]
        n1 = AgentLink(url_with_credentials(stack.url, stack.auth.nodes["n1"]), "n1").connect()
        n2 = AgentLink(url_with_credentials(stack.url, stack.auth.nodes["n2"]), "n2").connect()
        try:
            def fetch(link: AgentLink, e: int) -> dict[str, Any]:
                reply = link.request(f"lease.{lid}.secrets", json.dumps({"epoch": e}).encode())
                return json.loads(reply)  # type: ignore[no-any-return]

            # another node: the lease is not found there
            assert fetch(n2, epoch)["error"]["code"] == "lease_not_found"
            with pytest.raises(BusError):  # nor may it speak as n1: no answer comes
                _as_other_node(stack, lid)
            assert fetch(n1, epoch + 1)["error"]["code"] == "stale_epoch"
            got = fetch(n1, epoch)["result"]
            assert [(s["name"], base64.b64decode(s["value"])) for s in got["secrets"]] == \
                [("held", b"for-n1-only")]
        finally:
            n1.close()
            n2.close()
        assert alpha.lease(lid, "cancel")["ok"]


def _as_other_node(stack: Stack, lid: str) -> None:
    """n2 publishing on n1's subject: the server refuses it (no reply comes)."""

    async def go() -> None:
        nc = await connect(url_with_credentials(stack.url, stack.auth.nodes["n2"]),
                           reconnect=False, inbox_prefix=node_inbox("n2"))
        try:
            await nc.request(f"pool.node.n1.lease.{lid}.secrets", b'{"epoch": 1}', timeout=1)
        finally:
            await nc.close()

    run_sync(go(), timeout=10)


def test_an_unknown_secret_is_refused_at_request_time_naming_it(
        stack: Stack, tmp_path: Path) -> None:
    done = _pool(stack, tmp_path, *_run_args(stack), "--key", "unknown-secret",
                 "--secret-file", "never-set", "--", "true")
    assert done.returncode == 1
    assert b"[secret_unknown]" in done.stderr and b"never-set" in done.stderr, done.stderr
    # nothing is left half-done: the reservation is given back
    with PoolClient(stack.tenant_url("alpha"), "alpha") as alpha:
        lid = alpha.request_lease(lease_body("unknown-secret", max_runtime=120,
                                             runtime="sandboxed", cpu_millis=500,
                                             memory_mib=256))["lease"]["lease_id"]
        lease = alpha.lease(lid, "get")["lease"]
    assert (lease["state"], lease["end_reason"]) == ("released", "reservation_released")


class _Clock:
    """What a desk asks of the application to set a secret: the time."""

    clock = staticmethod(time.time)


def test_a_secret_sealed_under_an_older_key_is_resealed_so_that_key_can_go(
        stack: Stack, tmp_path: Path) -> None:
    from bus.secrets import SecretStore
    from schemas.secret import SecretSet
    from workers.secrets.desk import SecretDesk, sealed_context

    service = url_with_credentials(stack.url, stack.auth.service)
    store = SecretStore(service)
    # set by a plane from before the rotation, whose ring's active key was k1
    old = SecretDesk(_Clock(), SecretSettings.with_keys("k1=old-key"),  # type: ignore[arg-type]
                     store=store)
    assert old.set("alpha", SecretSet(name="rotated", value=b"r0t"))["secret"]["key_id"] == "k1"
    done = _pool(stack, tmp_path, "admin", "secrets", "reseal", "--nats-url", service, "--json")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)["result"]
    assert (result["active_key"], result["unreadable"]) == ("k2", 0) and result["resealed"] >= 1
    with PoolClient(service) as admin:
        assert admin.admin("secrets.reseal", {})["result"]["resealed"] == 0  # all current now
    with PoolClient(stack.tenant_url("alpha"), "alpha") as alpha:
        rows = {s["name"]: s for s in alpha.call("pool.cmd.alpha.secret.list", {})
                ["result"]["secrets"]}
    assert (rows["rotated"]["key_id"], rows["rotated"]["version"]) == ("k2", 1)
    # a ring without k1 opens it now: the old key may go
    found = store.latest("alpha", "rotated")
    assert found is not None
    ring = SecretSettings.with_keys("k2=new-key").ring
    assert ring is not None
    assert ring.open(found[0].key_id, found[0].sealed,
                     context=sealed_context("alpha", "rotated", 1)) == b"r0t"
