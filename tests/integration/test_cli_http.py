"""From a laptop: `pool login URL --token-stdin`, then the tenant commands over the gateway's
HTTP API alone, from a fresh HOME with no POOL_* variables and no .pool directory, against a
real plane, gateway, views and agent running jobs in the bubblewrap sandbox."""

from __future__ import annotations

import contextlib
import json
import os
import stat
import subprocess
import sys
import threading
import uuid
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
from bus.local.auth import AuthConfig, save, url_with_credentials
from bus.local.server import NatsServer
from bus.objects import ensure_tenant_buckets_sync
from bus.service import Service
from client.api import PoolClient
from gateway.app import create_app
from gateway.server import ServerThread
from gateway.tokens import TokenStore
from gateway.upstream import Settings
from tests.control_plane import setup_pool
from workers.bootstrap import application
from workers.commands import QUERY_SUBJECTS, CommandHandler
from workers.plane import ControlPlane
from workers.projector import Projector
from workers.secrets.settings import SecretSettings

if ProcessRuntime(Path("/tmp")).available() is not None:
    pytest.skip(f"process runtime unavailable: {ProcessRuntime(Path('/tmp')).available()}",
                allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]
PROBE = NodeProbe(cpu_millis=4500, cpu_arch="amd64", memory_mib=9216, local_disk_gib=50)


@dataclass
class Laptop:
    url: str  # the gateway's
    tokens: dict[str, str]  # tenant → bearer token
    home: Path  # a fresh HOME for alpha's CLI
    service_url: str
    settings: Settings  # the gateway's
    schema: str
    token_store: TokenStore

    def pool(self, *argv: str, stdin: str | None = None, home: Path | None = None,
             env: dict[str, str] | None = None, timeout: float = 90,
             ) -> subprocess.CompletedProcess[str]:
        """The `pool` command as a new user runs it: no POOL_* variables, a fresh HOME, and
        a working directory with no .pool in it."""
        home = home or self.home
        environ = {k: v for k, v in os.environ.items()
                   if not k.startswith("POOL_") and k != "XDG_CONFIG_HOME"}
        environ.update(HOME=str(home), PYTHONPATH=str(ROOT), **(env or {}))
        return subprocess.run([sys.executable, "-m", "cli.main", *argv], cwd=home, env=environ,
                              input=stdin, capture_output=True, text=True, timeout=timeout,
                              check=False)


@pytest.fixture(scope="module")
def laptop(tmp_path_factory: pytest.TempPathFactory, database_url: str) -> Iterator[Laptop]:
    from projections.views import drop_schema

    tmp = tmp_path_factory.mktemp("laptop")
    schema = "views_http_" + uuid.uuid4().hex[:8]
    auth = AuthConfig()
    for t in ("alpha", "beta"):
        auth.add_tenant(t)
    auth.add_node("n1")
    save(auth, tmp / "auth.json")
    server = NatsServer(store_dir=tmp / "nats", server_name="pool-laptop",
                        extra_config=auth.render())
    server.start()
    service = url_with_credentials(server.url, auth.service)
    parts: list[Any] = []
    stop = threading.Event()
    try:
        ensure_all_streams(service)
        ensure_tenant_buckets_sync(service, ["alpha", "beta"])
        parts.append(ControlPlane(service, leader_ttl_seconds=1.0,
                                  secrets=SecretSettings.with_keys("k1=laptop")).start())
        parts.append(Service(service, QUERY_SUBJECTS,
                             CommandHandler(parts[0].app, database_url=database_url,
                                            views_schema=schema), queue="pool-queries").start())
        parts.append(Projector(application(service), database_url, schema=schema).start())
        with PoolClient(service) as admin:
            # the pool a request names when neither it nor the context names one
            setup_pool(admin, "default", tenants={"alpha": 1.0, "beta": 1.0},
                       heartbeat_timeout_seconds=5,
                       preemption={"enabled": False, "grace_seconds": 2})
            assert admin.admin("node.enroll", {"node_id": "n1", "pool_id": "default",
                                               "trust_level": "trusted"})["ok"]
        link = AgentLink(url_with_credentials(server.url, auth.nodes["n1"]), "n1").connect()
        agent = Agent(link, ProcessRuntime(tmp / "n1"), node_id="n1", pool_id="default",
                      probe=PROBE, state_dir=tmp / "n1", reserve=Reserve(500, 1024, 0),
                      heartbeat_interval=0.5)
        thread = threading.Thread(target=agent.run, args=(stop,), daemon=True)
        thread.start()
        store = TokenStore(tmp / "http-tokens.json")
        tokens = {t: store.issue_tenant(t) for t in ("alpha", "beta")}
        settings = Settings(server.url, auth_path=tmp / "auth.json")
        app = create_app(settings, store, database_url=database_url, views_schema=schema,
                         dashboard=False, open_log=application)
        http = ServerThread(app, port=0).start()
        parts.append(http)
        home = tmp / "home"
        home.mkdir()
        yield Laptop(http.url, tokens, home, service, settings, schema, store)
        stop.set()
        thread.join(15)
        link.close()
        # a job outlives its agent by design (it is never recycled while it may run): the
        # tests' jobs still running (a port-forward's web server) are stopped here
        runtime = ProcessRuntime(tmp / "n1")
        for handle in runtime.adopt():
            with contextlib.suppress(Exception):
                runtime.stop(handle, 0)
                runtime.forget(handle)
    finally:
        stop.set()
        for part in reversed(parts):
            with contextlib.suppress(Exception):
                part.stop()
        server.stop()
        drop_schema(database_url, schema)


def _login(laptop: Laptop) -> None:
    done = laptop.pool("login", laptop.url, "--token-stdin", "--name", "lab",
                       stdin=laptop.tokens["alpha"] + "\n")
    assert done.returncode == 0, done.stderr
    assert "tenant alpha" in done.stdout


def test_from_a_fresh_home_login_then_run_list_and_read_logs_over_http(laptop: Laptop) -> None:
    _login(laptop)
    config = laptop.home / ".config" / "computepool" / "config.toml"
    assert stat.S_IMODE(config.stat().st_mode) == 0o600
    assert not (laptop.home / ".pool").exists()

    ran = laptop.pool("lease", "run", "--", "echo", "hi")
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout == "hi\n"
    failed = laptop.pool("lease", "run", "-q", "--max-runtime", "120", "--",
                         "sh", "-c", "echo out; exit 3")
    assert failed.returncode == 3 and failed.stdout == "out\n", failed.stderr

    listed = laptop.pool("leases", "--json")
    assert listed.returncode == 0, listed.stderr
    rows = json.loads(listed.stdout)["result"]["rows"]
    assert rows and all(r["tenant"] == "alpha" for r in rows)
    done = [r for r in rows if r.get("exit_code") == 0]
    assert done, rows
    lease_id = done[0]["lease_id"]
    assert "lease_id" in laptop.pool("leases").stdout

    logs = laptop.pool("lease", "logs", lease_id)
    assert logs.returncode == 0 and logs.stdout == "hi\n", logs.stderr
    got = laptop.pool("lease", "get", lease_id, "--json")
    assert got.returncode == 0 and json.loads(got.stdout)["lease"]["state"] == "released"
    why = laptop.pool("lease", "why", lease_id)
    assert why.returncode == 0, why.stderr
    watched = laptop.pool("lease", "watch", lease_id)
    assert watched.returncode == 0 and "released" in watched.stdout, watched.stderr

    queue = laptop.pool("queue")
    assert queue.returncode == 0 and "lease_id" in queue.stdout, queue.stderr
    balance = laptop.pool("balance", "--json")
    assert balance.returncode == 0, balance.stderr
    assert json.loads(balance.stdout)["result"]["rows"][0]["tenant"] == "alpha"
    usage = laptop.pool("usage", "--json")
    assert usage.returncode == 0, usage.stderr
    assert json.loads(usage.stdout)["result"]["pools"]["default"]["leases"] >= 2
    who = laptop.pool("whoami")
    assert who.returncode == 0 and "tenant alpha" in who.stdout and laptop.url in who.stdout


def test_a_request_is_cancelled_and_released_over_http(laptop: Laptop) -> None:
    _login(laptop)
    # `lease request` has no everyday pool: the context's (`login --pool`) stands in for it
    again_login = laptop.pool("login", laptop.url, "--token-stdin", "--name", "lab",
                              "--pool", "default", stdin=laptop.tokens["alpha"] + "\n")
    assert again_login.returncode == 0, again_login.stderr
    req = laptop.pool("lease", "request", "--cpu-millis", "100", "--memory-mib", "64",
                      "--max-runtime", "60", "--runtime", "sandboxed", "--wait", "--json")
    assert req.returncode == 0, req.stderr
    lease_id = json.loads(req.stdout)["lease"]["lease_id"]
    assert json.loads(req.stdout)["lease"]["state"] == "reserved"
    released = laptop.pool("lease", "release", lease_id)
    assert released.returncode == 0, released.stderr
    again = laptop.pool("lease", "cancel", lease_id)
    assert again.returncode == 1 and "pool: error [" in again.stderr


def test_a_wrong_token_or_url_is_refused_in_one_line_naming_the_flag(
    laptop: Laptop, tmp_path: Path,
) -> None:
    wrong = laptop.pool("login", laptop.url, "--token-stdin", stdin="cpt_wrong\n",
                        home=tmp_path)
    assert wrong.returncode == 1
    assert wrong.stderr.count("\n") == 1 and "[unauthenticated]" in wrong.stderr
    assert "--token-stdin" in wrong.stderr
    assert not (tmp_path / ".config").exists()
    nothing = laptop.pool("login", "http://127.0.0.1:9", "--token", "cpt_x", home=tmp_path)
    assert nothing.returncode == 1 and "[gateway_unreachable]" in nothing.stderr
    assert nothing.stderr.count("\n") == 1 and "URL" in nothing.stderr
    bad = laptop.pool("login", "ftp://x", "--token", "cpt_x", home=tmp_path)
    assert bad.returncode == 1 and "[bad_url]" in bad.stderr


def test_another_tenants_token_cannot_read_this_tenants_lease(
    laptop: Laptop, tmp_path: Path,
) -> None:
    _login(laptop)
    req = laptop.pool("lease", "request", "--pool", "default", "--cpu-millis", "100",
                      "--memory-mib", "64", "--max-runtime", "60", "--runtime", "sandboxed",
                      "--json")
    assert req.returncode == 0, req.stderr
    lease_id = json.loads(req.stdout)["lease"]["lease_id"]
    beta = laptop.pool("login", laptop.url, "--token-stdin",
                       stdin=laptop.tokens["beta"] + "\n", home=tmp_path)
    assert beta.returncode == 0, beta.stderr
    for verb in ("get", "why", "logs", "watch", "cancel"):
        got = laptop.pool("lease", verb, lease_id, home=tmp_path)
        assert got.returncode == 1, (verb, got.stdout)
        assert "[lease_not_found]" in got.stderr, (verb, got.stderr)
    listed = laptop.pool("leases", "--json", home=tmp_path)
    assert lease_id not in listed.stdout
    assert laptop.pool("lease", "cancel", lease_id).returncode == 0


def test_contexts_are_listed_used_deleted_and_picked_by_flag_or_variable(
    laptop: Laptop, tmp_path: Path,
) -> None:
    for name, tenant in (("a", "alpha"), ("b", "beta")):
        done = laptop.pool("login", laptop.url, "--token-stdin", "--name", name,
                           stdin=laptop.tokens[tenant] + "\n", home=tmp_path)
        assert done.returncode == 0, done.stderr
    listed = laptop.pool("context", "list", home=tmp_path)
    assert "cpt_" not in listed.stdout
    assert [line.split()[:2] for line in listed.stdout.splitlines()[1:]] == [["a", laptop.url],
                                                                             ["*", "b"]]
    assert "tenant beta" in laptop.pool("whoami", home=tmp_path).stdout
    assert "tenant alpha" in laptop.pool("--context", "a", "whoami", home=tmp_path).stdout
    assert "tenant alpha" in laptop.pool("whoami", home=tmp_path,
                                         env={"POOL_CONTEXT": "a"}).stdout
    assert laptop.pool("context", "use", "a", home=tmp_path).returncode == 0
    assert "tenant alpha" in laptop.pool("whoami", home=tmp_path).stdout
    unknown = laptop.pool("--context", "zz", "whoami", home=tmp_path)
    assert unknown.returncode == 2 and "--context" in unknown.stderr
    assert laptop.pool("context", "delete", "a", home=tmp_path).returncode == 0
    listed = laptop.pool("context", "list", "--json", home=tmp_path)
    assert json.loads(listed.stdout)["result"]["current"] is None


def test_logs_follow_a_running_job_over_http_writing_each_line_once(laptop: Laptop) -> None:
    _login(laptop)
    run = laptop.pool("lease", "run", "-d", "--max-runtime", "120", "--", "sh", "-c",
                      "for i in 1 2 3; do echo $i; sleep 1; done")
    assert run.returncode == 0, run.stderr
    lease_id = run.stdout.strip()
    logs = laptop.pool("lease", "logs", lease_id, "--follow")
    assert logs.returncode == 0, logs.stderr
    assert logs.stdout == "1\n2\n3\n"
    again = laptop.pool("lease", "logs", lease_id, "--follow")  # ended: what is stored, once
    assert again.stdout == "1\n2\n3\n"


def test_a_request_no_node_can_hold_ends_at_once_saying_why_over_http(laptop: Laptop) -> None:
    _login(laptop)
    ran = laptop.pool("lease", "run", "--cpu-millis", "64000", "--max-runtime", "60", "--",
                      "true")
    assert ran.returncode == 1
    assert "[not_reserved]" in ran.stderr and "insufficient_cpu" in ran.stderr, ran.stderr


def test_ctrl_c_on_lease_run_over_http_cancels_the_lease(laptop: Laptop) -> None:
    import signal
    import time

    _login(laptop)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("POOL_") and k != "XDG_CONFIG_HOME"}
    env.update(HOME=str(laptop.home), PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-m", "cli.main", "lease", "run", "--max-runtime",
                             "120", "--", "sh", "-c", "echo started; sleep 60"],
                            cwd=laptop.home, env=env, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline() == "started\n"
        proc.send_signal(signal.SIGINT)
        start = time.monotonic()
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 130, err
        assert time.monotonic() - start < 20
    finally:
        if proc.poll() is None:
            proc.kill()
    lease_id = err.split("lease ")[1].split()[0]
    got = laptop.pool("lease", "get", lease_id, "--json")
    assert json.loads(got.stdout)["lease"]["state"] == "cancelled", got.stdout


def test_names_and_labels_are_shown_and_filter_the_list_over_http(laptop: Laptop) -> None:
    _login(laptop)
    tag = uuid.uuid4().hex[:8]
    for name, labels in ((f"train-{tag}", ["team=vision", f"run={tag}"]),
                         (f"eval-{tag}", ["team=speech", f"run={tag}"])):
        ran = laptop.pool("lease", "run", "-q", "--max-runtime", "60", "--name", name,
                          *(f"--label={x}" for x in labels), "--", "true")
        assert ran.returncode == 0, ran.stderr

    def names(*argv: str) -> set[str]:
        got = laptop.pool("leases", "--json", *argv)
        assert got.returncode == 0, got.stderr
        return {r["name"] for r in json.loads(got.stdout)["result"]["rows"]}

    assert names("-l", f"run={tag}") == {f"train-{tag}", f"eval-{tag}"}
    assert names("-l", f"run={tag}", "-l", "team=vision") == {f"train-{tag}"}
    assert names("--name", f"eval-{tag}") == {f"eval-{tag}"}
    table = laptop.pool("leases", "--name", f"train-{tag}", "-o", "wide").stdout
    assert f"train-{tag}" in table and "team=vision" in table
    bad = laptop.pool("lease", "run", "--name", "no spaces", "--", "true")
    assert bad.returncode == 1 and "--name" in bad.stderr, bad.stderr


def test_a_secret_is_set_used_and_deleted_from_a_laptop_over_http(laptop: Laptop) -> None:
    import hashlib

    _login(laptop)
    done = laptop.pool("secret", "set", "laptop-token", stdin="v4lue\n")
    assert done.returncode == 0, done.stderr
    assert "secret laptop-token version 1 set (5 bytes)" in done.stdout
    listed = json.loads(laptop.pool("secret", "list", "--json").stdout)["result"]["secrets"]
    assert [(s["name"], s["version"]) for s in listed] == [("laptop-token", 1)]
    digest = hashlib.sha256(b"v4lue").hexdigest()
    ran = laptop.pool("lease", "run", "--secret-env", "T=laptop-token", "--", "sh", "-c",
                      'printf %s "$T" | sha256sum')
    assert ran.returncode == 0 and ran.stdout == f"{digest}  -\n", ran.stderr
    assert laptop.pool("secret", "delete", "laptop-token").returncode == 0
    gone = laptop.pool("secret", "delete", "laptop-token")
    assert gone.returncode == 1 and "[secret_unknown]" in gone.stderr


TRAIN = """\
import os
data = open("data.csv", "rb").read()
os.makedirs("out", exist_ok=True)
lines = data.count(b"\\n")
open("out/model.txt", "w").write(f"bytes={len(data)} lines={lines}\\n")
print("trained")
"""


def test_a_workdir_goes_in_and_artifacts_come_back_over_http_alone(laptop: Laptop,
                                                                   tmp_path: Path) -> None:
    import hashlib

    import httpx

    _login(laptop)
    project = tmp_path / "project"
    project.mkdir()
    (project / "train.py").write_text(TRAIN)
    (project / "data.csv").write_bytes(b"".join(b"%07d,%d\n" % (i, i % 7)
                                                for i in range(5 * 1024 * 1024 // 10)))
    argv = ("lease", "run", "--workdir", str(project), "--artifacts", "out/*", "--",
            "python3", "train.py")
    first = laptop.pool(*argv)
    assert first.returncode == 0 and first.stdout == "trained\n", first.stderr
    assert "workdir: 2 files," in first.stderr and "bytes uploaded" in first.stderr
    lid = next(line.split("lease ", 1)[1].split()[0] for line in first.stderr.splitlines()
               if " running on " in line)

    got = laptop.pool("lease", "artifacts", lid, "--get", str(tmp_path / "got"), "--json")
    assert got.returncode == 0, got.stderr
    [row] = json.loads(got.stdout)["result"]["artifacts"]
    model = (tmp_path / "got" / "out" / "model.txt").read_bytes()
    assert model == b"bytes=5242880 lines=524288\n"
    assert row["name"] == "out/model.txt" and row["sha256"] == hashlib.sha256(model).hexdigest()

    again = laptop.pool(*argv)
    assert again.returncode == 0, again.stderr
    assert "workdir: unchanged" in again.stderr

    # the same with nothing but the URL and the token: list, then stream the bytes
    with httpx.Client(base_url=laptop.url, timeout=15,
                      headers={"Authorization": f"Bearer {laptop.tokens['alpha']}"}) as http:
        listed = http.get(f"/v1/compute-leases/{lid}/artifacts").json()["items"]
        assert [a["name"] for a in listed] == ["out/model.txt"]
        r = http.get(f"/v1/compute-leases/{lid}/artifacts/out/model.txt")
        assert r.status_code == 200 and r.content == model
        assert r.headers["x-content-sha256"] == row["sha256"]
        # another tenant's token reaches none of it
        other = {"Authorization": f"Bearer {laptop.tokens['beta']}"}
        assert http.get(f"/v1/compute-leases/{lid}/artifacts", headers=other
                        ).json()["items"] == []
        gone = http.get(f"/v1/compute-leases/{lid}/artifacts/out/model.txt", headers=other)
        assert gone.status_code == 404 and gone.json()["code"] == "object_missing"


def test_a_workdir_upload_over_http_is_refused_whole_unless_it_hashes_to_its_name(
        laptop: Laptop) -> None:
    import hashlib

    import httpx

    body = b"not the bytes named" * 1000
    wrong = "sha256:" + hashlib.sha256(b"other").hexdigest()
    with httpx.Client(base_url=laptop.url, timeout=15,
                      headers={"Authorization": f"Bearer {laptop.tokens['alpha']}"}) as http:
        r = http.put(f"/v1/workdirs/{wrong}", content=body)
        assert r.status_code == 422 and r.json()["code"] == "digest_mismatch", r.text
        assert http.get(f"/v1/workdirs/{wrong}").json()["code"] == "object_missing"
        bad = http.put("/v1/workdirs/sha256:nothex", content=body)
        assert bad.status_code == 422 and bad.json()["code"] == "invalid_field"
        right = "sha256:" + hashlib.sha256(body).hexdigest()
        stored = http.put(f"/v1/workdirs/{right}", content=body)
        assert stored.status_code == 201 and stored.json()["uploaded"] is True
        assert http.put(f"/v1/workdirs/{right}", content=body).json()["uploaded"] is False
        assert http.get(f"/v1/workdirs/{right}").json()["size_bytes"] == len(body)
        escape = http.get("/v1/compute-leases/x1/artifacts/..%2F..%2Fetc%2Fpasswd")
        assert escape.json()["code"] == "invalid_field", escape.text


def test_a_workdir_over_the_gateways_upload_limit_is_refused_naming_it_and_not_stored(
        laptop: Laptop, database_url: str) -> None:
    import dataclasses
    import hashlib

    import httpx

    small = create_app(dataclasses.replace(laptop.settings, max_upload_bytes=1000),
                       laptop.token_store, database_url=database_url,
                       views_schema=laptop.schema, dashboard=False)
    http = ServerThread(small, port=0).start()
    try:
        body = b"x" * 2000
        digest = "sha256:" + hashlib.sha256(body).hexdigest()
        auth = {"Authorization": f"Bearer {laptop.tokens['alpha']}"}
        with httpx.Client(base_url=http.url, timeout=15, headers=auth) as c:
            refused = c.put(f"/v1/workdirs/{digest}", content=body)
            assert refused.status_code == 413, refused.text
            assert refused.json()["code"] == "workdir_too_large"
            assert "max_upload_bytes" in refused.json()["detail"]
            # streamed with no length given: refused the same way once past the limit
            chunks = (b"x" * 500 for _ in range(4))
            streamed = c.put(f"/v1/workdirs/{digest}", content=chunks)
            assert streamed.json()["code"] == "workdir_too_large", streamed.text
            assert c.get(f"/v1/workdirs/{digest}").json()["code"] == "object_missing"
    finally:
        http.stop()


def test_a_workdir_past_the_tenants_bucket_quota_is_refused_over_http_keeping_nothing(
        laptop: Laptop) -> None:
    import hashlib

    import httpx

    from bus.objects import DEFAULT_BUCKET_QUOTA_BYTES, work_bucket

    bucket = work_bucket("beta")
    held = ensure_tenant_buckets_sync(laptop.service_url, ["beta"], quota_bytes=1 << 20)[bucket][0]
    try:
        body = os.urandom(2 << 20)
        digest = "sha256:" + hashlib.sha256(body).hexdigest()
        with httpx.Client(base_url=laptop.url, timeout=30,
                          headers={"Authorization": f"Bearer {laptop.tokens['beta']}"}) as http:
            refused = http.put(f"/v1/workdirs/{digest}", content=body)
            assert refused.status_code == 409, refused.text
            assert refused.json()["code"] == "bucket_quota_exceeded"
            assert f"{1 << 20}-byte quota" in refused.json()["detail"]
            assert http.get(f"/v1/workdirs/{digest}").json()["code"] == "object_missing"
            # refused by its Content-Length, before its bytes are read (and so hashed)
            early = http.put(f"/v1/workdirs/{digest}", content=b"y" * len(body))
            assert early.json()["code"] == "bucket_quota_exceeded", early.text
        # not a chunk of it kept
        assert ensure_tenant_buckets_sync(laptop.service_url, ["beta"])[bucket][0] == held
    finally:
        ensure_tenant_buckets_sync(laptop.service_url, ["beta"],
                                   quota_bytes=DEFAULT_BUCKET_QUOTA_BYTES)
