"""Telemetry against a real nats-server with users: tenants read only their own leases' samples,
nodes write only under their own node, the stream keeps samples and `--since` replays them.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nats
import pytest
from nats.js.api import RetentionPolicy, StorageType

from bus.admin import ensure_all_streams
from bus.errors import PermissionDenied
from bus.local.auth import AuthConfig, inbox_prefix, url_with_credentials
from bus.local.server import NatsServer
from bus.streams import telemetry_stream_config, tenant_telemetry_stream_config
from bus.subjects import TELEMETRY_STREAM, telemetry_subject
from bus.telemetry import TelemetryPublisher, TelemetrySample
from bus.telemetry_follow import follow
from schemas import v1
from tests.placed import place_on
from workers.plane import ControlPlane


@pytest.fixture()
def secured(tmp_path: Path) -> Iterator[tuple[NatsServer, AuthConfig]]:
    auth = AuthConfig()
    for tenant in ("alpha", "beta"):
        auth.add_tenant(tenant)
    for node in ("n1", "n2"):
        auth.add_node(node)
    server = NatsServer(store_dir=tmp_path / "nats", server_name="pool-tel",
                        extra_config=auth.render())
    server.start()
    # as `pool up` does for the tenants it knows: each its own telemetry stream
    ensure_all_streams(url_with_credentials(server.url, auth.service), tenants=("alpha", "beta"))
    yield server, auth
    server.stop()


def _sample(kind: str = "startup", **attrs: str) -> v1.TelemetryEvent:
    return v1.TelemetryEvent(kind=kind, at=time.time(), attrs=attrs)  # type: ignore[arg-type]


def _publish(url: str, auth: AuthConfig, node: str, tenant: str, lease: str,
             kind: str = "startup", *, as_node: str | None = None) -> None:
    # the lease held by the node, as its feed says: what a replay checks a sample against
    place_on(url_with_credentials(url, auth.service), tenant, lease, node)
    pub = TelemetryPublisher(url_with_credentials(url, auth.nodes[as_node or node]))
    try:
        pub.publish(pool="p1", node=node, tenant=tenant, lease=lease, kind=kind,
                    event=_sample(kind, lease=lease))
        pub.flush()
    finally:
        pub.close()


def _as_tenant(auth: AuthConfig, tenant: str) -> dict[str, Any]:
    c = auth.tenants[tenant]
    return {"user": c.user, "password": c.password, "inbox_prefix": inbox_prefix(tenant)}


def _stored_subjects(url: str) -> list[str]:
    got: list[TelemetrySample] = []
    follow(url, got.append, since=dt.datetime.now(dt.UTC) - dt.timedelta(hours=1),
           duration_s=1.0)
    return [s.subject for s in got]


def _follow_live_while(publish: Any, url: str, **kw: Any) -> list[TelemetrySample]:
    """Follow live; once the subscription is in place, run `publish` on another thread."""
    got: list[TelemetrySample] = []

    def ready() -> None:
        threading.Thread(target=publish, daemon=True).start()

    follow(url, got.append, on_ready=ready, max_samples=1, duration_s=10, **kw)
    return got


# -- permissions ---------------------------------------------------------------------------------


def test_a_tenant_follows_its_own_leases_and_is_refused_on_anothers(
    secured: tuple[NatsServer, AuthConfig],
) -> None:
    server, auth = secured
    # a tenant's live samples are checked against its leases' feeds, read through the plane
    cp = ControlPlane(url_with_credentials(server.url, auth.service), roles=["commands"],
                      data_plane=False).start()
    try:
        got = _follow_live_while(lambda: _publish(server.url, auth, "n1", "alpha", "la"),
                                 server.url, tenant="alpha", **_as_tenant(auth, "alpha"))
    finally:
        cp.stop()
    assert [(s.tenant, s.lease, s.kind) for s in got] == [("alpha", "la", "startup")]
    assert got[0].event is not None and got[0].event.attrs == {"lease": "la"}

    with pytest.raises(PermissionDenied, match="permissions violation for subscription"):
        follow(server.url, lambda s: None, tenant="beta", duration_s=5,
               **_as_tenant(auth, "alpha"))


def test_the_server_refuses_a_raw_subscription_to_another_tenants_telemetry(
    secured: tuple[NatsServer, AuthConfig],
) -> None:
    server, auth = secured

    async def scenario() -> tuple[list[str], list[str]]:
        errors: list[str] = []

        async def on_error(e: Exception) -> None:
            errors.append(str(e))

        a = auth.tenants["alpha"]
        alpha = await nats.connect(server.url, user=a.user, password=a.password,
                                   inbox_prefix=inbox_prefix("alpha").encode(), error_cb=on_error)
        snooped: list[str] = []

        async def snoop(msg: Any) -> None:
            snooped.append(msg.subject)

        # every telemetry subject, and beta's in particular: both refused by the server
        await alpha.subscribe("pool.tel.>", cb=snoop)
        await alpha.subscribe("pool.tel.*.*.beta.>", cb=snoop)
        await alpha.flush()
        await asyncio.to_thread(_publish, server.url, auth, "n1", "beta", "lb")
        await asyncio.sleep(0.3)
        await alpha.close()
        return errors, snooped

    errors, snooped = asyncio.run(scenario())
    assert snooped == []
    assert any('subscription to "pool.tel.>"' in e for e in errors), errors
    assert any('subscription to "pool.tel.*.*.beta.>"' in e for e in errors), errors


def test_a_node_publishes_telemetry_only_under_its_own_node(
    secured: tuple[NatsServer, AuthConfig],
) -> None:
    server, auth = secured
    service = url_with_credentials(server.url, auth.service)
    _publish(server.url, auth, "n1", "alpha", "own")
    _publish(server.url, auth, "n2", "alpha", "forged", as_node="n1")  # n1 posing as n2
    assert _stored_subjects(service) == [telemetry_subject("p1", "n1", "alpha", "own", "startup")]


def test_publishing_with_no_server_neither_raises_nor_blocks() -> None:
    from bus.local.server import free_port

    pub = TelemetryPublisher(f"nats://127.0.0.1:{free_port()}")
    try:
        started = time.monotonic()
        for i in range(100):
            pub.publish(pool="p1", node="n1", tenant="alpha", lease=f"l{i}", kind="utilization",
                        event=_sample("utilization"))
        assert time.monotonic() - started < 1.0
        pub.flush(timeout=1)  # logs, does not raise
        with pytest.raises(ValueError):  # a programming error is still an error
            pub.publish(pool="p", node="n", tenant="t", lease="l", kind="bogus",
                        event=_sample())
    finally:
        pub.close()


# -- the stream and replay -----------------------------------------------------------------------


def test_the_telemetry_streams_have_limits_retention_of_their_own() -> None:
    shared, alpha = telemetry_stream_config(), tenant_telemetry_stream_config("alpha")
    assert shared.name == TELEMETRY_STREAM and shared.subjects == ["pool.tel.node.*.*"]
    assert alpha.name == "POOL_TEL_alpha" and alpha.subjects == ["pool.tel.*.*.alpha.>"]
    for cfg in (shared, alpha):
        assert cfg.retention == RetentionPolicy.LIMITS and cfg.storage == StorageType.FILE
        assert cfg.max_age and 0 < cfg.max_age <= 30 * 86400
        assert cfg.max_bytes and cfg.max_bytes > 0


def test_the_stream_keeps_samples_and_since_replays_them_then_follows(
    secured: tuple[NatsServer, AuthConfig],
) -> None:
    server, auth = secured
    for lease in ("l1", "l2"):
        _publish(server.url, auth, "n1", "alpha", lease)
    _publish(server.url, auth, "n2", "beta", "l3", "failure")
    since = dt.datetime.now(dt.UTC) - dt.timedelta(minutes=10)

    # the operator replays everything, each tenant's in its stream's order
    replayed: list[TelemetrySample] = []
    follow(url_with_credentials(server.url, auth.service), replayed.append, since=since,
           max_samples=3, duration_s=10)
    assert sorted(s.lease for s in replayed) == ["l1", "l2", "l3"]
    alphas = [s for s in replayed if s.tenant == "alpha"]
    assert [s.lease for s in alphas] == ["l1", "l2"]
    seqs = [s.stream_seq for s in alphas]
    assert all(seqs) and seqs == sorted(seqs)

    # a tenant replays its own leases through the control plane (it may not create consumers),
    # then keeps following new samples without a gap
    cp = ControlPlane(url_with_credentials(server.url, auth.service), roles=["commands"],
                      data_plane=False).start()
    try:
        got = _follow_live_while(lambda: _publish(server.url, auth, "n1", "alpha", "l4"),
                                 server.url, tenant="alpha", since=since,
                                 **_as_tenant(auth, "alpha"))
        assert [s.lease for s in got] == ["l1"]
        later: list[TelemetrySample] = []
        follow(server.url, later.append, tenant="alpha", since=since, max_samples=3,
               duration_s=10, **_as_tenant(auth, "alpha"))
        assert [s.lease for s in later] == ["l1", "l2", "l4"]
        assert [s.stream_seq for s in later] == sorted(s.stream_seq or 0 for s in later)
        # and one published after the replay caught up arrives too, once
        more: list[TelemetrySample] = []
        _publish_later = threading.Timer(1.5, lambda: _publish(server.url, auth, "n1", "alpha",
                                                               "l5"))
        _publish_later.start()
        follow(server.url, more.append, tenant="alpha", since=since, max_samples=4,
               duration_s=15, **_as_tenant(auth, "alpha"))
        assert [s.lease for s in more] == ["l1", "l2", "l4", "l5"]

        # replaying another tenant's samples is refused by the server: alpha may not publish
        # on beta's command subjects
        with pytest.raises(PermissionDenied, match="pool.cmd.beta"):
            follow(server.url, lambda s: None, tenant="beta", since=since, duration_s=5,
                   **_as_tenant(auth, "alpha"))
    finally:
        cp.stop()


def test_a_tenant_may_not_create_a_stream_consumer_at_all(
    secured: tuple[NatsServer, AuthConfig],
) -> None:
    """No JetStream API for tenants: a consumer could name any deliver subject (the server does
    not check it against the creator's permissions), so replay is the service's job."""
    server, auth = secured
    _publish(server.url, auth, "n1", "alpha", "mine")

    async def scenario() -> list[str]:
        errors: list[str] = []

        async def on_error(e: Exception) -> None:
            errors.append(str(e))

        a = auth.tenants["alpha"]
        alpha = await nats.connect(server.url, user=a.user, password=a.password,
                                   inbox_prefix=inbox_prefix("alpha").encode(),
                                   error_cb=on_error)
        config = {"name": "c1", "filter_subject": "pool.tel.*.*.alpha.>",
                  "deliver_subject": "pool.cmd.beta.lease.request", "ack_policy": "none"}
        with pytest.raises(nats.errors.TimeoutError):
            await alpha.request(
                f"$JS.API.CONSUMER.CREATE.{TELEMETRY_STREAM}.c1.pool.tel.*.*.alpha.>",
                json.dumps({"stream_name": TELEMETRY_STREAM, "config": config}).encode(),
                timeout=2)
        await alpha.close()
        return errors

    errors = asyncio.run(scenario())
    assert any("permissions violation" in e.lower() and "consumer.create" in e.lower()
               for e in errors), errors


def test_the_replay_service_narrows_only_within_the_tenants_own_samples(
    secured: tuple[NatsServer, AuthConfig],
) -> None:
    server, auth = secured
    _publish(server.url, auth, "n1", "alpha", "mine")
    _publish(server.url, auth, "n2", "beta", "secret")
    cp = ControlPlane(url_with_credentials(server.url, auth.service), roles=["commands"],
                      data_plane=False).start()

    async def ask(body: dict[str, Any]) -> dict[str, Any]:
        a = auth.tenants["alpha"]
        alpha = await nats.connect(server.url, user=a.user, password=a.password,
                                   inbox_prefix=inbox_prefix("alpha").encode())
        try:
            reply = await alpha.request("pool.cmd.alpha.telemetry.replay",
                                        json.dumps(body).encode(), timeout=5)
            out: dict[str, Any] = json.loads(reply.data)
            return out
        finally:
            await alpha.close()

    try:
        everything = asyncio.run(ask({"since": 0}))
        assert everything["ok"], everything
        assert [s["subject"].split(".")[4] for s in everything["result"]["samples"]] == ["alpha"]
        assert everything["result"]["at_end"] is True
        # naming beta's lease or node finds nothing: the tenant token is the subject's
        assert asyncio.run(ask({"since": 0, "lease": "secret"}))["result"]["samples"] == []
        assert asyncio.run(ask({"since": 0, "node": "n2"}))["result"]["samples"] == []
        # paging: after the last sequence there is nothing more
        seq = everything["result"]["samples"][-1]["seq"]
        assert asyncio.run(ask({"after_seq": seq}))["result"]["samples"] == []
        # bad input is a typed refusal
        bad = asyncio.run(ask({"since": 0, "limit": 5000}))
        assert not bad["ok"] and bad["error"]["code"] == "invalid_field", bad
        unknown = asyncio.run(ask({"tenant": "beta"}))
        assert not unknown["ok"] and unknown["error"]["code"] == "unknown_field", unknown
    finally:
        cp.stop()


# -- the CLI -------------------------------------------------------------------------------------


def _env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("POOL_")}
    env.update(POOL_HOME=str(home), POOL_NATS_PORT="0")
    return env


def _pool(home: Path, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "cli.main", *args], capture_output=True,
                          text=True, env=_env(home), timeout=timeout, check=False)


def test_pool_telemetry_follow_replays_a_sample_and_ctrl_c_exits_cleanly(tmp_path: Path) -> None:
    home = tmp_path / "home"
    # with its control plane: a tenant's --since replays through it
    up = subprocess.Popen(
        [sys.executable, "-m", "cli.main", "up", "--no-postgres", "--json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(home),
    )
    try:
        assert up.stdout is not None
        info = json.loads(up.stdout.readline())
        assert TELEMETRY_STREAM in {s["name"] for s in info["streams"]}
        node = json.loads(_pool(home, "admin", "node", "creds", "n1", "--json").stdout)["result"]
        assert _pool(home, "admin", "tenant", "creds", "alpha", "--json").returncode == 0
        from local.embedded import service_url

        place_on(service_url(home), "alpha", "lease-1", "n1")  # the node holds the lease
        pub = TelemetryPublisher(info["nats_url"].replace(
            "nats://", f"nats://{node['user']}:{node['password']}@"))
        pub.publish(pool="p1", node="n1", tenant="alpha", lease="lease-1", kind="utilization",
                    event=v1.TelemetryEvent(kind="utilization", at=time.time(),
                                            utilization=v1.Utilization(cpu_millis_used=250)))
        pub.flush()
        pub.close()

        out = _pool(home, "telemetry", "follow", "--tenant", "alpha", "--since", "10m",
                    "--count", "1", timeout=30)
        assert out.returncode == 0, out.stderr
        assert "utilization" in out.stdout and "alpha/lease-1" in out.stdout
        assert "cpu_millis_used=250" in out.stdout

        js = _pool(home, "telemetry", "follow", "--tenant", "alpha", "--lease", "lease-1",
                   "--since", "10m", "--count", "1", "--json", timeout=30)
        envelope = json.loads(js.stdout)
        sample = envelope["result"]
        assert envelope["ok"] and sample["lease"] == "lease-1" and sample["stream_seq"] >= 1

        # following live until Ctrl-C: exit 0, no traceback
        live = subprocess.Popen(
            [sys.executable, "-m", "cli.main", "telemetry", "follow", "--tenant", "alpha"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(home),
        )
        assert live.stderr is not None
        assert "following telemetry" in live.stderr.readline()
        live.send_signal(signal.SIGINT)
        _, err = live.communicate(timeout=20)
        assert live.returncode == 0 and "Traceback" not in err, err
    finally:
        up.send_signal(signal.SIGINT)
        up.wait(30)


def test_a_replay_that_misses_a_delivery_recreates_its_consumer_and_loses_nothing(
    nats_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ordered replay: a gap in consumer sequence (a lost push delivery, simulated by dropping
    two) recreates the consumer from the next stream sequence; every sample arrives once."""
    import bus.telemetry_follow as tel

    ensure_all_streams(nats_url, tenants=("alpha",))
    pool = f"gap{time.time_ns()}"  # the session's server is shared: a pool of this test's own
    pub = TelemetryPublisher(nats_url)
    for i in range(10):
        pub.publish(pool=pool, node="n1", tenant="alpha", lease=f"l{i}",
                    kind="startup", event=_sample())
    pub.flush()
    pub.close()
    original = tel._OrderedReplay._on_message
    dropped: list[int] = []

    async def lossy(self: Any, msg: Any) -> None:
        if not (msg.headers or {}).get("Status") and msg.metadata.sequence.consumer in (3, 6) \
                and len(dropped) < 2:
            dropped.append(msg.metadata.sequence.stream)
            return
        await original(self, msg)

    monkeypatch.setattr(tel._OrderedReplay, "_on_message", lossy)
    got: list[TelemetrySample] = []
    follow(nats_url, got.append, since=dt.datetime.now(dt.UTC) - dt.timedelta(hours=1),
           max_samples=10, duration_s=20, pool=pool)
    assert len(dropped) == 2
    assert [s.lease for s in got] == [f"l{i}" for i in range(10)]


def test_a_plane_served_on_a_bare_server_answers_telemetry_replays(fresh_nats: NatsServer) -> None:
    """`pool serve` against a server no `pool up` prepared: the data plane makes its streams,
    telemetry's among them, so a tenant's replay is answered (empty), not bus_unavailable."""
    from client.api import PoolClient

    cp = ControlPlane(fresh_nats.url).start()
    try:
        with PoolClient(fresh_nats.url, "alpha") as a:
            got = a.call("pool.cmd.alpha.telemetry.replay", {"since": 0, "limit": 10})
    finally:
        cp.stop()
    assert got["ok"], got
    assert got["result"]["samples"] == []
