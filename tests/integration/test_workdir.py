"""The user's files through a lease, with real components: a secured nats-server (tenant and
node users as `pool up` makes them), the control plane, an agent running the job in the
bubblewrap sandbox, and the `pool` binary. A work directory goes in by digest, artifacts come
back byte-identical, an unchanged directory is not sent again, limits are refused by code, and
a hostile archive is refused by the agent."""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from agents.agent import Agent
from agents.probe import NodeProbe, Reserve
from agents.runtimes.process import ProcessRuntime
from bus.admin import ensure_all_streams
from bus.agentbus import AgentLink
from bus.errors import BusError
from bus.local.auth import AuthConfig, url_with_credentials
from bus.local.server import NatsServer
from bus.objects import artifacts_bucket, ensure_tenant_buckets_sync, work_bucket
from client.api import PoolClient
from client.workdir import pack
from tests.control_plane import lease_body, setup_pool
from workers.plane import ControlPlane

if ProcessRuntime(Path("/tmp")).available() is not None:
    pytest.skip(f"process runtime unavailable: {ProcessRuntime(Path('/tmp')).available()}",
                allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]
PROBE = NodeProbe(cpu_millis=4500, cpu_arch="amd64", memory_mib=9216, local_disk_gib=50)
LIMIT = 8 << 20  # the pool's max_workdir_bytes here
ARTIFACT_LIMIT = 1 << 20  # and its max_artifact_bytes

TRAIN = """\
import csv, hashlib, os
rows = list(csv.reader(open("data.csv")))
total = sum(int(r[1]) for r in rows[1:])
os.makedirs("out", exist_ok=True)
with open("out/model.txt", "w") as f:
    f.write(f"rows={len(rows) - 1} total={total} cwd={os.getcwd()}\\n")
    for k in ("POOL_LEASE_ID", "POOL_TENANT", "POOL_POOL", "POOL_NODE", "POOL_WORKDIR"):
        f.write(f"{k}={os.environ.get(k)}\\n")
print("trained on", len(rows) - 1, "rows")
"""


@dataclass
class Stack:
    url: str
    auth: AuthConfig
    tenant_url: str
    agent: Agent


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("workdir")
    auth = AuthConfig()
    auth.add_tenant("alpha")
    auth.add_tenant("beta")
    auth.add_node("n1")
    server = NatsServer(store_dir=tmp / "nats", server_name="pool-files",
                        extra_config=auth.render())
    server.start()
    service = url_with_credentials(server.url, auth.service)
    ensure_all_streams(service)
    ensure_tenant_buckets_sync(service, ["alpha", "beta"])
    cp = ControlPlane(service, leader_ttl_seconds=1.0).start()
    with PoolClient(service) as admin:
        setup_pool(admin, tenants={"alpha": 1.0}, heartbeat_timeout_seconds=5,
                   max_workdir_bytes=LIMIT, max_artifact_bytes=ARTIFACT_LIMIT,
                   preemption={"enabled": False, "grace_seconds": 2})
        assert admin.admin("node.enroll", {"node_id": "n1", "pool_id": "p1",
                                           "trust_level": "trusted"})["ok"]
    link = AgentLink(url_with_credentials(server.url, auth.nodes["n1"]), "n1").connect()
    agent = Agent(link, ProcessRuntime(tmp / "n1"), node_id="n1", pool_id="p1", probe=PROBE,
                  state_dir=tmp / "n1", reserve=Reserve(500, 1024, 0), heartbeat_interval=0.5)
    stop = threading.Event()
    thread = threading.Thread(target=agent.run, args=(stop,), daemon=True)
    thread.start()
    yield Stack(server.url, auth, url_with_credentials(server.url, auth.tenants["alpha"]), agent)
    stop.set()
    thread.join(15)
    link.close()
    cp.stop()
    server.stop()


def _pool(cwd: Path, *argv: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("POOL_")}
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run([sys.executable, "-m", "cli.main", *argv], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout, check=False)


def _run_args(stack: Stack) -> list[str]:
    return ["lease", "run", "--nats-url", stack.tenant_url, "--tenant", "alpha", "--pool", "p1",
            "--cpu-millis", "500", "--memory-mib", "256", "--runtime", "sandboxed",
            "--max-runtime", "120"]


def _project(tmp: Path) -> Path:
    d = tmp / "project"
    d.mkdir()
    (d / "train.py").write_text(TRAIN)
    lines = ["id,value"] + [f"{i},{i % 97}" for i in range(300_000)]  # about 3 MiB
    (d / "data.csv").write_text("\n".join(lines) + "\n")
    (d / "scratch.log").write_text("left out\n")
    (d / ".poolignore").write_text("*.log\n")
    return d


def _lease_id(out: subprocess.CompletedProcess[str]) -> str:
    for line in out.stderr.splitlines():
        if " running on " in line:
            return line.split("lease ", 1)[1].split()[0]
    raise AssertionError(out.stderr)


def test_a_workdir_goes_in_by_digest_and_artifacts_come_back_byte_identical(
        stack: Stack, tmp_path: Path) -> None:
    project = _project(tmp_path)
    first = _pool(project, *_run_args(stack), "--workdir", ".", "--artifacts", "out/*",
                  "--", "python3", "train.py")
    assert first.returncode == 0, first.stderr
    assert first.stdout == "trained on 300000 rows\n"
    assert "workdir: 3 files," in first.stderr and "bytes uploaded" in first.stderr
    lid = _lease_id(first)

    got = _pool(tmp_path, "lease", "artifacts", lid, "--get", str(tmp_path / "got"),
                "--nats-url", stack.tenant_url, "--tenant", "alpha", "--json")
    assert got.returncode == 0, got.stderr
    listed = json.loads(got.stdout)["result"]["artifacts"]
    assert [a["name"] for a in listed] == ["model.txt"] or \
        [a["name"] for a in listed] == ["out/model.txt"]
    model = (tmp_path / "got" / "out" / "model.txt").read_bytes()
    assert hashlib.sha256(model).hexdigest() == listed[0]["sha256"]
    text = model.decode()
    # the job read the data from its /work, its working directory, and knew where it ran
    assert "rows=300000 total=" in text and "cwd=/work" in text
    assert f"POOL_LEASE_ID={lid}" in text and "POOL_TENANT=alpha" in text
    assert "POOL_POOL=p1" in text and "POOL_NODE=n1" in text and "POOL_WORKDIR=/work" in text

    # the same directory again: nothing is sent, the node's cache serves it
    second = _pool(project, *_run_args(stack), "--workdir", ".", "--", "python3", "train.py")
    assert second.returncode == 0, second.stderr
    assert "workdir: unchanged" in second.stderr


def test_a_failed_jobs_regular_files_are_kept_and_its_links_and_fifos_are_not(
        stack: Stack, tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    script = ("mkdir -p out && echo partial > out/p.txt && ln -s /etc/passwd out/link && "
              "mkfifo out/fifo && exit 3")
    out = _pool(empty, *_run_args(stack), "--key", "partial", "--artifacts", "out/*",
                "--", "sh", "-c", script)
    assert out.returncode == 3, out.stderr
    with PoolClient(stack.tenant_url, "alpha") as alpha:
        lid = alpha.request_lease(lease_body("partial", max_runtime=120, runtime="sandboxed",
                                             cpu_millis=500, memory_mib=256))["lease"]["lease_id"]
        kept = alpha.files().list(artifacts_bucket("alpha"), f"{lid}/")
        deadline = time.monotonic() + 10  # published beside the end's report: stored soon after
        while not (ends := alpha.call("pool.cmd.alpha.telemetry.replay", {
                "lease": lid, "kind": "failure"})["result"]["samples"]) \
                and time.monotonic() < deadline:
            time.sleep(0.05)
    assert [(o.name, o.size_bytes) for o in kept] == [(f"{lid}/out/p.txt", 8)]
    attrs = ends[-1]["event"]["attrs"]
    assert attrs["exit_code"] == 3 and attrs["artifacts"] == 1
    assert attrs["artifacts_left_out_not_regular"] == 2  # the link and the FIFO


def test_artifacts_past_the_pools_limit_are_left_out_whole_and_counted_by_its_name(
        stack: Stack, tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    # in name order: a (600 KiB) fits, b (600 KiB) would pass the 1 MiB, c (1 KiB) still fits
    script = ("mkdir -p out && head -c 614400 /dev/zero > out/a && "
              "head -c 614400 /dev/zero > out/b && head -c 1024 /dev/zero > out/c")
    out = _pool(empty, *_run_args(stack), "--key", "over", "--artifacts", "out/*",
                "--", "sh", "-c", script)
    assert out.returncode == 0, out.stderr
    with PoolClient(stack.tenant_url, "alpha") as alpha:
        lid = alpha.request_lease(lease_body("over", max_runtime=120, runtime="sandboxed",
                                             cpu_millis=500, memory_mib=256))["lease"]["lease_id"]
        kept = alpha.files().list(artifacts_bucket("alpha"), f"{lid}/")
        end = alpha.call("pool.cmd.alpha.telemetry.replay", {"lease": lid, "kind": "execution"})
    # nothing of b is stored, not even a part of it
    assert [(o.name, o.size_bytes) for o in kept] == [(f"{lid}/out/a", 614400),
                                                       (f"{lid}/out/c", 1024)]
    attrs = end["result"]["samples"][-1]["event"]["attrs"]
    assert attrs["artifacts"] == 2 and attrs["artifact_bytes"] == 614400 + 1024
    assert attrs["artifacts_left_out_max_artifact_bytes"] == 1


def test_a_workdir_over_the_pools_limit_is_refused_at_commit_with_its_code(
        stack: Stack, tmp_path: Path) -> None:
    big = tmp_path / "big"
    big.mkdir()
    (big / "blob.bin").write_bytes(os.urandom(LIMIT + 1))
    out = _pool(big, *_run_args(stack), "--key", "too-big", "--workdir", ".", "--", "true")
    assert out.returncode == 1
    assert "[workdir_too_large]" in out.stderr and "max_workdir_bytes" in out.stderr, out.stderr
    # nothing is left half-kept: the archive this run stored is removed, the lease given back
    digest = pack(big, tmp_path / "big.tar").digest
    with PoolClient(stack.tenant_url, "alpha") as alpha:
        lid = alpha.request_lease(lease_body("too-big", max_runtime=120, runtime="sandboxed",
                                             cpu_millis=500, memory_mib=256))["lease"]["lease_id"]
        assert alpha.files().info(work_bucket("alpha"), digest) is None
        lease = alpha.lease(lid, "get")["lease"]
    assert (lease["state"], lease["end_reason"]) == ("released", "reservation_released")


def _hostile(kind: str) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        if kind == "traversal":
            data = b"owned\n"
            info = tarfile.TarInfo("../../escaped.txt")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        else:
            info = tarfile.TarInfo("etc")
            info.type = tarfile.SYMTYPE
            info.linkname = "/etc"
            tar.addfile(info)
    return buf.getvalue()


@pytest.mark.parametrize("kind", ["traversal", "symlink"])
def test_a_hostile_archive_is_refused_by_the_agent(stack: Stack, tmp_path: Path,
                                                   kind: str) -> None:
    # stored as any tenant could store bytes in its own bucket, under their true digest
    archive = tmp_path / "hostile.tar"
    archive.write_bytes(_hostile(kind))
    digest = "sha256:" + hashlib.sha256(archive.read_bytes()).hexdigest()
    with PoolClient(stack.tenant_url, "alpha") as alpha:
        alpha.files().put(work_bucket("alpha"), digest, archive)
        r = alpha.request_lease(lease_body(f"hostile-{kind}", runtime="sandboxed",
                                           memory_mib=256))
        assert r["ok"], r
        lid = r["lease"]["lease_id"]
        deadline = time.monotonic() + 15
        while alpha.lease(lid, "get")["lease"]["state"] != "reserved":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        job = {"command": ["true"], "workdir": {"digest": digest,
                                                "size_bytes": archive.stat().st_size}}
        assert alpha.lease(lid, "commit", {"job": job})["ok"]
        while (lease := alpha.lease(lid, "get")["lease"])["state"] not in ("released",):
            assert time.monotonic() < deadline + 15, lease
            time.sleep(0.05)
        # the tenant is told why, in the lease's failure sample (published beside the
        # agent's report of the end, so it may be stored a moment after the release)
        while not (samples := alpha.call("pool.cmd.alpha.telemetry.replay", {
                "lease": lid, "kind": "failure"})["result"]["samples"]):
            assert time.monotonic() < deadline + 20
            time.sleep(0.05)
    assert lease["end_reason"] == "failed" and lease["exit_code"] is None
    reasons = [s["event"]["attrs"] for s in samples]
    assert [(r["reason"], r["phase"]) for r in reasons] == [("workdir_rejected", "workdir")]
    assert not (tmp_path.parent / "escaped.txt").exists()


def test_each_user_reaches_only_the_buckets_its_role_allows(stack: Stack, tmp_path: Path) -> None:
    f = tmp_path / "f.bin"
    f.write_bytes(b"x" * 1000)
    with PoolClient(stack.tenant_url, "alpha") as alpha:
        files = alpha.files()
        files.put(work_bucket("alpha"), "mine", f)
        assert files.info(work_bucket("alpha"), "mine") is not None
        for bucket in (work_bucket("beta"), artifacts_bucket("beta")):
            with pytest.raises(BusError):  # the server drops the request: no answer comes
                files.info(bucket, "mine", timeout=1)
        with pytest.raises(BusError):  # artifacts are the nodes' to write
            files.put(artifacts_bucket("alpha"), "forged", f, timeout=1)
        assert files.info(artifacts_bucket("alpha"), "forged") is None
    link = AgentLink(url_with_credentials(stack.url, stack.auth.nodes["n1"]), "n1").connect()
    try:
        node = link.files()
        assert node.info(work_bucket("alpha"), "mine") is not None  # reads work directories
        with pytest.raises(BusError):  # ...but never writes them
            node.put(work_bucket("alpha"), "mine", f, timeout=1)
    finally:
        link.close()


def test_each_lease_of_a_count_request_knows_its_place_in_the_array(stack: Stack) -> None:
    with PoolClient(stack.tenant_url, "alpha") as alpha:
        body = {**lease_body("array-" + os.urandom(4).hex(), runtime="sandboxed",
                             cpu_millis=500, memory_mib=256, max_runtime=120), "count": 2}
        r = alpha.request_lease(body)
        assert r["ok"], r
        lids = r["result"]["lease_ids"]
        job = {"command": ["sh", "-c", 'echo "$POOL_ARRAY_INDEX/$POOL_ARRAY_SIZE"']}
        deadline = time.monotonic() + 30
        for lid in lids:
            while alpha.lease(lid, "get")["lease"]["state"] != "reserved":
                assert time.monotonic() < deadline
                time.sleep(0.05)
            assert alpha.lease(lid, "commit", {"job": job})["ok"]
        said = []
        for lid in lids:
            while alpha.lease(lid, "get")["lease"]["state"] != "released":
                assert time.monotonic() < deadline
                time.sleep(0.05)
            out = alpha.call("pool.cmd.alpha.telemetry.replay", {"lease": lid, "kind": "output"})
            said.append("".join(s["event"]["attrs"]["text"] for s in out["result"]["samples"]))
    assert said == ["0/2\n", "1/2\n"]


def test_a_job_mounts_the_pools_volumes_by_name_and_no_other(stack: Stack,
                                                              tmp_path: Path) -> None:
    data, scratch, other = tmp_path / "datasets", tmp_path / "scratch", tmp_path / "other"
    for d in (data, scratch, other):
        d.mkdir()
    (data / "f.txt").write_text("from the host\n")
    scratch.chmod(0o777)  # the sandbox's uid writes there
    admin = url_with_credentials(stack.url, stack.auth.service)
    done = _pool(tmp_path, "admin", "pool", "set", "p1", "--nats-url", admin,
                 "--volume", f"datasets={data}", "--volume", f"scratch={scratch}:rw",
                 "--volume", f"market={other}@marketplace")
    assert done.returncode == 0, done.stderr
    try:
        script = ("cat /data/f.txt; echo hi > /scratch/out; "
                  "(echo x > /data/w) 2>/dev/null && echo writable || echo read-only")
        run = _pool(tmp_path, *_run_args(stack), "--volume", "datasets:/data",
                    "--volume", "scratch:/scratch", "--", "sh", "-c", script)
        assert run.returncode == 0, run.stderr
        assert run.stdout == "from the host\nread-only\n"
        assert (scratch / "out").read_text() == "hi\n" and not (data / "w").exists()

        unknown = _pool(tmp_path, *_run_args(stack), "--key", "vol-unknown",
                        "--volume", "nope:/data", "--", "true")
        assert unknown.returncode == 1
        assert "[volume_unknown]" in unknown.stderr and "'nope'" in unknown.stderr
        barred = _pool(tmp_path, *_run_args(stack), "--key", "vol-barred",
                       "--volume", "market:/m", "--", "true")
        assert barred.returncode == 1
        assert "[volume_not_allowed]" in barred.stderr and "marketplace" in barred.stderr
        # a job names a place in the sandbox, never one the sandbox provides
        covered = _pool(tmp_path, *_run_args(stack), "--volume", "datasets:/usr/x", "--", "true")
        assert covered.returncode != 0 and "/usr" in covered.stderr
    finally:
        assert _pool(tmp_path, "admin", "pool", "set", "p1", "--nats-url", admin,
                     "--no-volumes").returncode == 0


def test_an_object_of_many_batches_comes_back_whole_beside_another_stored_at_once(
        stack: Stack, tmp_path: Path) -> None:
    from bus.objects import BATCH_CHUNKS, CHUNK_BYTES

    # more chunks than one batched read holds, their sequences interleaved with another's
    big = tmp_path / "big.bin"
    big.write_bytes(os.urandom(CHUNK_BYTES * (2 * BATCH_CHUNKS + 3) + 17))
    small = tmp_path / "small.bin"
    small.write_bytes(os.urandom(CHUNK_BYTES * 3))
    with PoolClient(stack.tenant_url, "alpha") as alpha:
        store = alpha.files()
        bucket = work_bucket("alpha")
        side = threading.Thread(target=lambda: [store.put(bucket, f"side-{i}", small)
                                                for i in range(6)])
        side.start()
        store.put(bucket, "many-batches", big)
        side.join(30)
        store.get(bucket, "many-batches", tmp_path / "back.bin")
        assert (tmp_path / "back.bin").read_bytes() == big.read_bytes()
        for name in ("many-batches", *(f"side-{i}" for i in range(6))):
            store.delete(bucket, name)
