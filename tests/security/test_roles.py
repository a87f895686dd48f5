"""Least privilege per role: each control-plane role and the admin CLI as its own user, doing its
whole job without a permission violation and refused by the server outside it."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import nats
import pytest

from bus.local.auth import PERMISSIONS, ROLES, AuthConfig, role_user, url_with_credentials
from bus.local.server import NatsServer
from client.api import PoolClient
from tests.security.roles import lease_lifecycle, secured_plane, violations, wait_for
from workers.bootstrap import application
from workers.plane import ControlPlane
from workers.projector import Projector


async def _attempt(server: NatsServer, auth: AuthConfig, role: str, *,
                   publish: Sequence[str] = (), subscribe: Sequence[str] = ()) -> dict[str, Any]:
    """`role`'s user publishes to and subscribes on each subject; what landed (seen by the
    operator) and what the server refused."""
    errors: list[str] = []

    async def on_error(e: Exception) -> None:
        errors.append(str(e))

    watcher = await nats.connect(url_with_credentials(server.url, auth.service))
    landed: list[str] = []

    async def watch(msg: Any) -> None:
        landed.append(msg.subject)

    for subject in publish:
        await watcher.subscribe(subject, cb=watch)
    await watcher.flush()
    c = auth.roles[role]
    nc = await nats.connect(server.url, user=c.user, password=c.password, error_cb=on_error,
                            max_reconnect_attempts=0)
    for subject in publish:
        await nc.publish(subject, b'{"ok": true}')
    for subject in subscribe:
        await nc.subscribe(subject)
    await nc.flush()
    await asyncio.sleep(0.5)
    for conn in (nc, watcher):
        await conn.close()
    return {"landed": landed,
            "refused": sum("permissions violation" in e.lower() for e in errors)}


# the sealed secrets: only the command role may write or read them
_SECRETS = ["$KV.pool_secrets.alpha.tok",
            "$JS.API.DIRECT.GET.KV_pool_secrets.$KV.pool_secrets.alpha.tok",
            "$JS.API.CONSUMER.CREATE.KV_pool_secrets"]

# the scheduler's decision records: only the scheduler role may write or read them
_DECISIONS = ["pool.dec.alpha.l1", "$JS.API.DIRECT.GET.POOL_DECISIONS"]

# what each role must never do, as a malicious or buggy process of that role would try it
FORBIDDEN: dict[str, dict[str, list[str]]] = {
    "projector": {
        "publish": ["pool.evt.account.alpha", "pool.sched.lease.l1", "pool.agent.n1.start",
                    "pool.cmd.alpha.lease.request", "$KV.pool_leaders.scheduler",
                    "$JS.API.STREAM.DELETE.POOL_EVENTS", "_INBOX.t.alpha.x",
                    "pool.ckpt.scheduler.head",
                    "$JS.API.DIRECT.GET.POOL_CHECKPOINTS.pool.ckpt.scheduler.head",
                    "pool.snap.pool.x", "$JS.API.STREAM.PURGE.POOL_SNAPSHOTS",
                    *_SECRETS, *_DECISIONS],
        "subscribe": ["pool.agent.>", "_INBOX.t.alpha.>", "pool.cmd.>", "pool.snap.>"],
    },
    "reconciler": {
        "publish": ["pool.cmd.alpha.lease.request", "pool.cmd.beta.lease.l1.cancel",
                    "pool.agent.n1.start", "pool.admin.credits.grant",
                    "$KV.pool_leaders.scheduler", "$JS.API.CONSUMER.MSG.NEXT.POOL_AGENT.agent-n1",
                    "$JS.API.STREAM.PURGE.POOL_EVENTS", "_INBOX.n.n1.x",
                    "pool.ckpt.scheduler.head", "$JS.API.STREAM.PURGE.POOL_SNAPSHOTS",
                    *_SECRETS, *_DECISIONS],
        "subscribe": ["pool.agent.>", "pool.cmd.>", "_INBOX.r.scheduler.>"],
    },
    "scheduler": {
        "publish": ["pool.cmd.alpha.lease.request", "pool.admin.credits.grant",
                    "$JS.API.CONSUMER.MSG.NEXT.POOL_AGENT.agent-n1",
                    "$JS.API.CONSUMER.MSG.NEXT.POOL_SCHED.reconciler",
                    "$JS.API.STREAM.UPDATE.POOL_EVENTS", "_INBOX.t.alpha.x",
                    "$JS.API.STREAM.PURGE.POOL_CHECKPOINTS",
                    "$JS.API.STREAM.DELETE.POOL_SNAPSHOTS",
                    *_SECRETS, "$JS.API.STREAM.PURGE.POOL_DECISIONS"],
        "subscribe": ["pool.agent.>", "pool.cmd.>", "_INBOX.t.>"],
    },
    "commands": {
        "publish": ["pool.agent.n1.start", "pool.sched.lease.l1", "$KV.pool_leaders.scheduler",
                    "pool.cmd.alpha.lease.request", "$JS.API.STREAM.DELETE.POOL_EVENTS",
                    "_INBOX.t.alpha.x", "pool.ckpt.scheduler.head",
                    "$JS.API.DIRECT.GET.POOL_CHECKPOINTS.pool.ckpt.scheduler.head",
                    "$JS.API.STREAM.PURGE.POOL_SNAPSHOTS", *_DECISIONS],
        "subscribe": ["pool.agent.>", "pool.cmd.>", "_INBOX.t.>"],
    },
    "admin": {
        "publish": ["pool.evt.account.alpha", "pool.agent.n1.start", "pool.sched.lease.l1",
                    "pool.cmd.alpha.lease.request", "$KV.pool_leaders.scheduler",
                    "$JS.API.CONSUMER.MSG.NEXT.POOL_AGENT.agent-n1",
                    "$JS.API.CONSUMER.CREATE.POOL_AGENT", "$JS.API.STREAM.MSG.GET.POOL_AGENT",
                    "$JS.API.STREAM.DELETE.POOL_EVENTS", "$JS.API.STREAM.CREATE.POOL_X",
                    "pool.snap.pool.x", "$JS.API.STREAM.PURGE.POOL_SNAPSHOTS",
                    *_SECRETS, *_DECISIONS],
        "subscribe": ["pool.agent.>", "pool.cmd.>", "_INBOX.n.>", "_INBOX.t.>"],
    },
}


@pytest.fixture()
def server(tmp_path: Path) -> Any:
    auth = AuthConfig()
    auth.add_tenant("alpha")
    auth.add_node("n1")
    s = NatsServer(store_dir=tmp_path / "nats", server_name="pool-roles",
                   extra_config=auth.render()).start()
    yield s, auth
    s.stop()


def test_every_role_and_the_admin_cli_has_its_own_user_and_rule() -> None:
    auth = AuthConfig()
    assert {c.user for c in auth.roles.values()} == {role_user(r) for r in ROLES}
    assert len({auth.service.user, auth.responder.user, *(c.user for c in auth.roles.values())}
               ) == len(ROLES) + 2
    for role in ROLES:
        rule = PERMISSIONS[role]
        assert rule.publish is not None and rule.subscribe is not None  # nothing unlimited
        # no role but the scheduler and reconciler touches timers; none reads a work queue
        assert not any(s.startswith("pool.agent") for s in rule.subscribe)
        assert not any("POOL_AGENT" in s and ("MSG.NEXT" in s or "$JS.ACK" in s)
                       for s in rule.publish)
        assert not any(s.startswith(("$JS.API.STREAM.CREATE", "$JS.API.STREAM.UPDATE",
                                     "$JS.API.STREAM.DELETE", "$JS.API.STREAM.PURGE"))
                       for s in rule.publish)


@pytest.mark.parametrize("role", sorted(FORBIDDEN))
def test_a_role_is_refused_by_the_server_outside_its_limits(role: str, server: Any) -> None:
    s, auth = server
    want = FORBIDDEN[role]
    out = asyncio.run(_attempt(s, auth, role, publish=want["publish"],
                               subscribe=want["subscribe"]))
    assert out["landed"] == []
    assert out["refused"] == len(want["publish"]) + len(want["subscribe"])


def test_the_projector_cannot_append_to_the_event_log(server: Any) -> None:
    s, auth = server
    from bus.admin import ensure_all_streams

    ensure_all_streams(url_with_credentials(s.url, auth.service))
    out = asyncio.run(_attempt(s, auth, "projector", publish=["pool.evt.pool.x"]))
    assert out == {"landed": [], "refused": 1}

    async def log_length() -> int:
        nc = await nats.connect(url_with_credentials(s.url, auth.service))
        info = await nc.jetstream().stream_info("POOL_EVENTS")
        await nc.close()
        return int(info.state.messages)

    assert asyncio.run(log_length()) == 0


Lived = tuple[NatsServer, AuthConfig, ControlPlane, dict[str, str]]


@pytest.fixture(scope="module")
def lived(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lived]:
    """A secured plane on which `lease_lifecycle` ran, once for the module: the tests that
    take it provoke no violation of their own (the checkpoint test, which does, has its own)."""
    home = tmp_path_factory.mktemp("roles")
    with secured_plane(home) as (server, auth, cp):
        yield server, auth, cp, lease_lifecycle(server, auth, home / "state")


def test_every_role_runs_a_lease_from_request_to_release_as_its_own_user(
        lived: Lived) -> None:
    server, _auth, cp, out = lived
    assert cp.role_urls.keys() == set(ROLES)
    assert out == {"ran": "released", "voided": "voided", "silent": "reconciling"}
    assert violations(server) == []


def test_the_command_role_keeps_tenants_secrets_as_its_own_user(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from bus.secrets import SecretStore

    monkeypatch.setenv("POOL_SECRET_KEYS", "k1=roles")
    with secured_plane(tmp_path) as (server, auth, _cp):
        with PoolClient(url_with_credentials(server.url, auth.tenants["alpha"]),
                        "alpha") as alpha:
            for value in ("b25l", "dHdv"):  # set, then a second version
                assert alpha.call("pool.cmd.alpha.secret.set",
                                  {"name": "tok", "value": value})["ok"]
            listed = alpha.call("pool.cmd.alpha.secret.list", {})["result"]["secrets"]
            assert [(r["name"], r["version"]) for r in listed] == [("tok", 2)]
            # the first version is still kept, as the command role reads it
            store = SecretStore(url_with_credentials(server.url, auth.roles["commands"]))
            first = store.version("alpha", "tok", 1)
            assert first is not None and first.version == 1
            assert alpha.call("pool.cmd.alpha.secret.delete", {"name": "tok"})["ok"]
            assert alpha.call("pool.cmd.alpha.secret.list", {})["result"]["secrets"] == []
        assert violations(server) == []


def test_the_scheduler_stores_and_reads_its_checkpoint_as_its_own_user(tmp_path: Path) -> None:
    """Signed with a key from the scheduler's own password: a process holding another
    role's password can neither write the stream nor make a checkpoint that verifies."""
    from bus.checkpoints import CheckpointStore, checkpoint_key
    from workers.application import PoolApp
    from workers.bootstrap import app_env
    from workers.scheduler import Scheduler
    from workers.scheduler.checkpoint import Checkpointer

    with secured_plane(tmp_path) as (server, auth, cp):
        lease_lifecycle(server, auth, tmp_path / "state")
        live = cp.scheduler
        assert live.checkpoints is not None and live.checkpoints.write_now(live)
        url = url_with_credentials(server.url, auth.roles["scheduler"])
        fresh = Scheduler(PoolApp(env=app_env(url)))
        key = checkpoint_key(url)
        assert key is not None
        fresh.checkpoints = Checkpointer(CheckpointStore(url), key)
        try:
            fresh.catch_up()
            assert fresh.checkpoints.restored_at is not None
            assert fresh.position == live.position
        finally:
            fresh.close()
            fresh.app.close()
        assert violations(server) == []
        other = url_with_credentials(server.url, auth.roles["commands"])
        assert checkpoint_key(other) != key
        out = asyncio.run(_attempt(server, auth, "commands",
                                   publish=["pool.ckpt.scheduler.head"]))
        assert out == {"landed": [], "refused": 1}


def test_the_projector_folds_the_log_as_its_own_user(lived: Lived, database_url: str,
                                                     schema: str) -> None:
    server, auth, _cp, _ = lived
    proj = Projector(application(url_with_credentials(server.url, auth.roles["projector"])),
                     database_url, schema=schema).start()
    try:
        wait_for(lambda: proj.position >= (proj.app.recorder.max_notification_id() or 0))
    finally:
        proj.stop()
        proj.app.close()
    assert violations(server) == []


def test_pool_serve_speaks_as_the_roles_whose_passwords_its_environment_holds(
        tmp_path: Path) -> None:
    """What compose.yaml does: each `pool serve --role R` process holds only R's password
    (and the responders'), the admin CLI its own user's, the operator made the streams."""
    import os
    import subprocess
    import sys

    from bus.admin import ensure_all_streams
    from bus.local.auth import env_file

    auth = AuthConfig()
    server = NatsServer(store_dir=tmp_path / "nats", server_name="pool-serve",
                        extra_config=auth.render()).start()
    procs: list[subprocess.Popen[str]] = []
    heard: list[list[str]] = [[], [], []]  # what each role's process said before its stop
    try:
        ensure_all_streams(url_with_credentials(server.url, auth.service))
        pw = dict(line.split("=", 1) for line in env_file(auth).splitlines())
        env = {k: v for k, v in os.environ.items() if not k.startswith("POOL_")}
        env.update(POOL_NATS_URL=server.url, POOL_HOME=str(tmp_path / "home"))
        responder = {"POOL_RESPONDER_PASSWORD": pw["POOL_RESPONDER_PASSWORD"]}
        for role, extra in (("commands", responder), ("scheduler", responder),
                            ("reconciler", {})):
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "cli.main", "serve", "--role", role],
                env={**env, **extra, f"POOL_{role.upper()}_PASSWORD":
                     pw[f"POOL_{role.upper()}_PASSWORD"]},
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        admin = {**env, "POOL_NATS_USER": "pool-admin",
                 "POOL_NATS_PASSWORD": pw["POOL_ADMIN_PASSWORD"]}

        def pool_set() -> bool:
            r = subprocess.run([sys.executable, "-m", "cli.main", "admin", "pool", "set", "p1",
                                "--json"], env=admin, capture_output=True, text=True,
                               timeout=60, check=False)
            return r.returncode == 0

        wait_for(pool_set, timeout=60, every=1.0)
        # the commands role alone answers `pool set`: the others may still be starting, and
        # stopped now they would say nothing; each is stopped once it said it serves (or ended)
        for p, said in zip(procs, heard, strict=False):
            assert p.stdout is not None
            while not said or "serving" not in said[-1]:
                line = p.stdout.readline()
                if not line:
                    break
                said.append(line)
    finally:
        for p in procs:
            p.terminate()
        outputs = ["".join(said) + p.communicate(timeout=30)[0]
                   for p, said in zip(procs, heard, strict=False)]
        server.stop()
    assert all("serving" in out and "error" not in out for out in outputs), outputs
    assert violations(server) == []
