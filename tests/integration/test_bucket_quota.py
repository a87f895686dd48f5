"""A tenant's bucket quota with real components (a secured nats-server, the control plane, an
agent in the bubblewrap sandbox, the `pool` binary): a work directory past it is refused with
its code and nothing of it is kept; artifacts past it are left out and counted; a lowered
quota removes nothing."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from agents.agent import Agent
from agents.probe import NodeProbe, Reserve
from agents.runtimes.process import ProcessRuntime
from bus.admin import ensure_all_streams
from bus.agentbus import AgentLink
from bus.errors import BucketQuotaExceeded
from bus.local.auth import AuthConfig, url_with_credentials
from bus.local.server import NatsServer
from bus.objects import (
    FileStore,
    artifacts_bucket,
    ensure_tenant_buckets_sync,
    work_bucket,
)
from client.api import PoolClient
from tests.control_plane import lease_body, setup_pool
from workers.plane import ControlPlane

if ProcessRuntime(Path("/tmp")).available() is not None:
    pytest.skip(f"process runtime unavailable: {ProcessRuntime(Path('/tmp')).available()}",
                allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]
PROBE = NodeProbe(cpu_millis=4500, cpu_arch="amd64", memory_mib=9216, local_disk_gib=50)
QUOTA = 1 << 20  # alpha's bucket quota here


@dataclass
class Stack:
    url: str
    service: str
    tenant_url: str


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("quota")
    auth = AuthConfig()
    auth.add_tenant("alpha")
    auth.add_node("n1")
    server = NatsServer(store_dir=tmp / "nats", server_name="pool-quota",
                        extra_config=auth.render())
    server.start()
    service = url_with_credentials(server.url, auth.service)
    ensure_all_streams(service)
    ensure_tenant_buckets_sync(service, ["alpha"], quota_bytes=QUOTA)
    cp = ControlPlane(service, leader_ttl_seconds=1.0).start()
    with PoolClient(service) as admin:
        setup_pool(admin, tenants={"alpha": 1.0}, heartbeat_timeout_seconds=5,
                   preemption={"enabled": False, "grace_seconds": 2})
        assert admin.admin("node.enroll", {"node_id": "n1", "pool_id": "p1",
                                           "trust_level": "trusted"})["ok"]
    link = AgentLink(url_with_credentials(server.url, auth.nodes["n1"]), "n1").connect()
    agent = Agent(link, ProcessRuntime(tmp / "n1"), node_id="n1", pool_id="p1", probe=PROBE,
                  state_dir=tmp / "n1", reserve=Reserve(500, 1024, 0), heartbeat_interval=0.5)
    stop = threading.Event()
    thread = threading.Thread(target=agent.run, args=(stop,), daemon=True)
    thread.start()
    yield Stack(server.url, service, url_with_credentials(server.url, auth.tenants["alpha"]))
    stop.set()
    thread.join(15)
    link.close()
    cp.stop()
    server.stop()


def _pool(cwd: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("POOL_")}
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run([sys.executable, "-m", "cli.main", *argv], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=90, check=False)


def _run_args(stack: Stack, key: str) -> list[str]:
    return ["lease", "run", "--nats-url", stack.tenant_url, "--tenant", "alpha", "--pool", "p1",
            "--cpu-millis", "500", "--memory-mib", "256", "--runtime", "sandboxed",
            "--max-runtime", "120", "--key", key]


def _held(stack: Stack, bucket: str) -> int:
    return ensure_tenant_buckets_sync(stack.service, ["alpha"])[bucket][0]


def test_a_workdir_past_the_tenants_quota_is_refused_naming_it_and_nothing_is_kept(
        stack: Stack, tmp_path: Path) -> None:
    big = tmp_path / "big"
    big.mkdir()
    (big / "blob.bin").write_bytes(os.urandom(2 << 20))
    out = _pool(big, *_run_args(stack, "over-quota"), "--workdir", ".", "--", "true")
    assert out.returncode != 0
    assert "bucket_quota_exceeded" in out.stderr, out.stderr
    assert f"{QUOTA}-byte quota" in out.stderr and "holds 0 bytes" in out.stderr
    assert _held(stack, work_bucket("alpha")) == 0  # not a chunk of it


def test_a_put_refused_part_way_by_the_server_purges_its_chunks(
        stack: Stack, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async def no_check(self: Any, bucket: str, size: int) -> None:
        return None

    # as when another upload fills the bucket between the check and the chunks
    monkeypatch.setattr(FileStore, "_room_for", no_check)
    f = tmp_path / "f.bin"
    f.write_bytes(os.urandom(2 << 20))
    with PoolClient(stack.tenant_url, "alpha") as alpha:
        with pytest.raises(BucketQuotaExceeded, match="bucket_quota_bytes"):
            alpha.files().put(work_bucket("alpha"), "partway", f)
        assert alpha.files().info(work_bucket("alpha"), "partway") is None
    assert _held(stack, work_bucket("alpha")) == 0


def test_artifacts_past_the_quota_are_left_out_and_counted_and_the_agent_goes_on(
        stack: Stack, tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    # in name order: a (600 KiB) fits, b (600 KiB) would pass the 1 MiB quota, c (1 KiB) fits
    script = ("mkdir -p out && head -c 614400 /dev/zero > out/a && "
              "head -c 614400 /dev/zero > out/b && head -c 1024 /dev/zero > out/c")
    out = _pool(empty, *_run_args(stack, "art-quota"), "--artifacts", "out/*",
                "--", "sh", "-c", script)
    assert out.returncode == 0, out.stderr
    with PoolClient(stack.tenant_url, "alpha") as alpha:
        lid = alpha.request_lease(lease_body("art-quota", max_runtime=120, runtime="sandboxed",
                                             cpu_millis=500, memory_mib=256))["lease"]["lease_id"]
        kept = alpha.files().list(artifacts_bucket("alpha"), f"{lid}/")
        end = alpha.call("pool.cmd.alpha.telemetry.replay", {"lease": lid, "kind": "execution"})
    assert [(o.name, o.size_bytes) for o in kept] == [(f"{lid}/out/a", 614400),
                                                       (f"{lid}/out/c", 1024)]
    attrs = end["result"]["samples"][-1]["event"]["attrs"]
    assert attrs["artifacts"] == 2 and attrs["artifacts_left_out_bucket_quota_exceeded"] == 1
    again = _pool(empty, *_run_args(stack, "after-quota"), "--", "echo", "still here")
    assert again.returncode == 0 and again.stdout == "still here\n", again.stderr


def test_a_quota_lowered_under_what_a_bucket_holds_removes_nothing(
        stack: Stack, tmp_path: Path) -> None:
    f = tmp_path / "f.bin"
    f.write_bytes(os.urandom(100_000))
    bucket = work_bucket("alpha")
    with PoolClient(stack.tenant_url, "alpha") as alpha:
        alpha.files().put(bucket, "kept", f)
        held = _held(stack, bucket)
        try:
            assert ensure_tenant_buckets_sync(stack.service, ["alpha"], quota_bytes=50_000)[
                bucket] == (held, 50_000)
            assert alpha.files().info(bucket, "kept") is not None
            with pytest.raises(BucketQuotaExceeded):
                alpha.files().put(bucket, "more", f)
        finally:
            ensure_tenant_buckets_sync(stack.service, ["alpha"], quota_bytes=QUOTA)
        assert alpha.files().delete(bucket, "kept")


def test_the_operator_reads_and_sets_a_tenants_bucket_quota(stack: Stack, tmp_path: Path) -> None:
    import json

    def quota(*extra: str) -> subprocess.CompletedProcess[str]:
        return _pool(tmp_path, "admin", "tenant", "bucket-quota", "alpha", "--nats-url",
                     stack.service, "--json", *extra)

    shown = quota()
    assert shown.returncode == 0, shown.stderr
    rows = json.loads(shown.stdout)["result"]["buckets"]
    assert {r["bucket"]: r["quota_bytes"] for r in rows} == {
        work_bucket("alpha"): QUOTA, artifacts_bucket("alpha"): QUOTA}
    try:
        set_ = quota("--bytes", str(2 * QUOTA))
        assert {r["quota_bytes"] for r in json.loads(set_.stdout)["result"]["buckets"]} == {
            2 * QUOTA}
        # `pool up` makes the buckets again on every start: the operator's quota stays
        assert ensure_tenant_buckets_sync(stack.service, ["alpha"])[work_bucket("alpha")][1] \
            == 2 * QUOTA
    finally:
        ensure_tenant_buckets_sync(stack.service, ["alpha"], quota_bytes=QUOTA)
    zero = quota("--bytes", "0")
    assert zero.returncode != 0 and "never without a quota" in zero.stderr


def test_a_bucket_made_before_quotas_gets_the_default_on_the_next_start(stack: Stack) -> None:
    import asyncio

    import nats

    from bus.objects import DEFAULT_BUCKET_QUOTA_BYTES, bucket_config

    async def old_bucket() -> None:
        nc = await nats.connect(stack.service)
        try:
            await nc.jetstream().add_stream(bucket_config(work_bucket("legacy"), quota_bytes=-1))
        finally:
            await nc.close()

    asyncio.run(old_bucket())
    made = ensure_tenant_buckets_sync(stack.service, ["legacy"])
    assert made[work_bucket("legacy")][1] == DEFAULT_BUCKET_QUOTA_BYTES
    assert made[artifacts_bucket("legacy")][1] == DEFAULT_BUCKET_QUOTA_BYTES


def test_a_quota_the_servers_store_cannot_reserve_is_refused_naming_what_to_do(
        stack: Stack) -> None:
    from bus.errors import BucketQuotaUnreservable

    with pytest.raises(BucketQuotaUnreservable, match="max_file_store"):
        ensure_tenant_buckets_sync(stack.service, ["alpha"], quota_bytes=1 << 60)
    held = ensure_tenant_buckets_sync(stack.service, ["alpha"])
    assert held[work_bucket("alpha")][1] == QUOTA  # unchanged
