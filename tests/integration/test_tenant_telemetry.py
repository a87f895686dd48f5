"""Each tenant's telemetry in its own stream, against a real nats-server with users: one tenant's
flood never evicts another's output, a tenant reads no other's stream, an older store's samples
stay readable across the split, and a retention the server cannot reserve is refused.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import nats
import pytest
from nats.js.errors import NotFoundError

from bus.admin import ensure_all_streams
from bus.errors import TelemetryRetentionUnreservable
from bus.local.auth import AuthConfig, inbox_prefix, role_urls, url_with_credentials
from bus.local.server import NatsServer
from bus.streams import TELEMETRY_MAX_BYTES, feed_stream_config, telemetry_stream_config
from bus.subjects import TELEMETRY_STREAM, telemetry_subject, tenant_telemetry_stream
from bus.telemetry_streams import ensure_tenant_telemetry_sync
from schemas import v1
from tests.placed import place_on
from workers.plane import ControlPlane

RETENTION = 64 * 1024  # alpha's: small, so a test floods past it in moments
LINE = "x" * 1000
OLD_BYTES = 1 << 30  # POOL_TELEMETRY's limit before each tenant had a stream


@pytest.fixture()
def server(tmp_path: Path) -> Iterator[tuple[NatsServer, AuthConfig]]:
    auth = AuthConfig()
    for tenant in ("alpha", "beta"):
        auth.add_tenant(tenant)
    auth.add_node("n1")
    srv = NatsServer(store_dir=tmp_path / "nats", server_name="pool-tentel",
                     extra_config=auth.render())
    srv.start()
    yield srv, auth
    srv.stop()


def _service(srv: NatsServer, auth: AuthConfig) -> str:
    return url_with_credentials(srv.url, auth.service)


def _commands(srv: NatsServer, auth: AuthConfig) -> ControlPlane:
    """The command service as its own role's user: what it may read is what the table says."""
    return ControlPlane(_service(srv, auth), roles=["commands"], data_plane=False,
                        role_urls=role_urls(srv.url, auth),
                        responder_url=url_with_credentials(srv.url, auth.responder)).start()


def _output(srv: NatsServer, auth: AuthConfig, tenant: str, lease: str,
            texts: list[str]) -> None:
    """`texts` as the lease's output, published in order by node n1, which holds the lease
    (one connection, flushed: the agents' publisher is lossy by design, a test's is not)."""
    place_on(_service(srv, auth), tenant, lease, "n1")

    async def go() -> None:
        c = auth.nodes["n1"]
        nc = await nats.connect(srv.url, user=c.user, password=c.password)
        try:
            for i, text in enumerate(texts):
                event = v1.TelemetryEvent(kind="output", at=time.time(), seq=i,
                                          attrs={"stream": "stdout", "text": text})
                await nc.publish(telemetry_subject("p1", "n1", tenant, lease, "output"),
                                 msgspec.json.encode(event))
                if i % 20 == 19:
                    await nc.flush()
            await nc.flush()
        finally:
            await nc.close()

    asyncio.run(go())


async def _as_tenant(srv: NatsServer, auth: AuthConfig, tenant: str, **kw: Any) -> nats.NATS:
    c = auth.tenants[tenant]
    return await nats.connect(srv.url, user=c.user, password=c.password,
                              inbox_prefix=inbox_prefix(tenant).encode(), **kw)


async def _ask(nc: nats.NATS, subject: str, body: dict[str, Any]) -> Any:
    """A request, asked again while no responder is subscribed yet (a lane starting)."""
    deadline = time.monotonic() + 10
    while True:
        try:
            return await nc.request(subject, json.dumps(body).encode(), timeout=10)
        except nats.errors.NoRespondersError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.1)


def _replay(srv: NatsServer, auth: AuthConfig, tenant: str, *, limit: int = 500,
            **body: Any) -> list[dict[str, Any]]:
    """Every page of the tenant's replay through the command service, as its own user."""

    async def go() -> list[dict[str, Any]]:
        nc = await _as_tenant(srv, auth, tenant)
        samples: list[dict[str, Any]] = []
        after = 0
        try:
            while True:
                ask = {**body, "limit": limit, **({"after_seq": after} if after else
                                                   {"since": 0})}
                reply = await _ask(nc, f"pool.cmd.{tenant}.telemetry.replay", ask)
                env = json.loads(reply.data)
                assert env["ok"], env
                result = env["result"]
                samples += result["samples"]
                after = max(after, int(result["last_seq"]))
                if result["at_end"]:
                    return samples
        finally:
            await nc.close()

    return asyncio.run(go())


def _texts(samples: list[dict[str, Any]]) -> list[str]:
    return [s["event"]["attrs"]["text"] for s in samples]


def _wait_stored(url: str, stream: str, last_seq: int) -> None:
    """Until `stream` stored its message `last_seq`: a flush says the server has the messages,
    not that JetStream stored them yet."""

    async def go() -> None:
        nc = await nats.connect(url)
        try:
            deadline = time.monotonic() + 10
            while (await nc.jetstream().stream_info(stream)).state.last_seq < last_seq:
                assert time.monotonic() < deadline, f"{stream} never stored {last_seq}"
                await asyncio.sleep(0.05)
        finally:
            await nc.close()

    asyncio.run(go())


def _stream_bytes(url: str, stream: str) -> tuple[int, int]:
    async def go() -> tuple[int, int]:
        nc = await nats.connect(url)
        try:
            info = await nc.jetstream().stream_info(stream)
            return int(info.state.bytes), int(info.config.max_bytes or -1)
        finally:
            await nc.close()

    return asyncio.run(go())


def test_a_tenant_flooding_its_output_never_evicts_anothers(
    server: tuple[NatsServer, AuthConfig],
) -> None:
    srv, auth = server
    ensure_all_streams(_service(srv, auth), tenants=("alpha", "beta"))
    ensure_tenant_telemetry_sync(_service(srv, auth), ["alpha"], max_bytes=RETENTION)
    _output(srv, auth, "beta", "lb", ["beta's first line\n"])
    # alpha writes four times what its retention keeps, from many leases
    flood = [f"{i:05d} {LINE}\n" for i in range(4 * RETENTION // len(LINE))]
    published: list[str] = []
    for n in range(4):
        _output(srv, auth, "alpha", f"la{n}", flood[n::4])
        published += flood[n::4]
    _wait_stored(_service(srv, auth), tenant_telemetry_stream("beta"), 1)
    _wait_stored(_service(srv, auth), tenant_telemetry_stream("alpha"), len(flood))

    cp = _commands(srv, auth)
    try:
        assert _texts(_replay(srv, auth, "beta")) == ["beta's first line\n"]
        kept = _texts(_replay(srv, auth, "alpha"))
    finally:
        cp.stop()
    # alpha lost its own oldest output, and only that: what is kept is its newest
    assert 0 < len(kept) < len(flood) // 2
    assert kept == published[-len(kept):]
    held, limit = _stream_bytes(_service(srv, auth), tenant_telemetry_stream("alpha"))
    assert limit == RETENTION and held <= RETENTION


def test_a_tenant_reads_its_own_telemetry_through_the_plane_and_no_stream_directly(
    server: tuple[NatsServer, AuthConfig],
) -> None:
    """Its replay reads its own stream only; a direct get on any tenant's stream, its own too,
    is refused by the server (the answer would go to any reply subject it names, unchecked)."""
    srv, auth = server
    ensure_all_streams(_service(srv, auth), tenants=("alpha", "beta"))
    _output(srv, auth, "alpha", "la", ["alpha's\n"])
    _output(srv, auth, "beta", "lb", ["beta's secret\n"])
    for tenant in ("alpha", "beta"):
        _wait_stored(_service(srv, auth), tenant_telemetry_stream(tenant), 1)
    cp = _commands(srv, auth)
    try:
        assert _texts(_replay(srv, auth, "alpha")) == ["alpha's\n"]
        assert _replay(srv, auth, "alpha", lease="lb") == []
    finally:
        cp.stop()

    async def scenario() -> tuple[list[bytes], list[str]]:
        errors: list[str] = []

        async def on_error(e: Exception) -> None:
            errors.append(str(e))

        alpha = await _as_tenant(srv, auth, "alpha", error_cb=on_error)
        got: list[bytes] = []
        for api in ("DIRECT.GET", "STREAM.INFO"):
            for tenant in ("alpha", "beta"):
                try:
                    msg = await alpha.request(
                        f"$JS.API.{api}.{tenant_telemetry_stream(tenant)}",
                        json.dumps({"seq": 1, "next_by_subj": "pool.tel.>"}).encode(),
                        timeout=1)
                    got.append(msg.data)
                except nats.errors.TimeoutError:
                    pass
        await alpha.close()
        return got, errors

    got, errors = asyncio.run(scenario())
    assert got == []
    for api in ("direct.get", "stream.info"):
        for tenant in ("alpha", "beta"):
            assert any("permissions violation" in e.lower()
                       and f"{api}.pool_tel_{tenant}" in e.lower() for e in errors), errors


def test_an_older_stores_samples_stay_readable_after_the_split(
    server: tuple[NatsServer, AuthConfig],
) -> None:
    srv, auth = server
    service = _service(srv, auth)

    async def old_store() -> None:  # POOL_TELEMETRY as it was: every tenant's samples
        nc = await nats.connect(service)
        try:
            await nc.jetstream().add_stream(dataclasses.replace(
                telemetry_stream_config(), subjects=["pool.tel.>"], max_bytes=OLD_BYTES))
            await nc.jetstream().add_stream(feed_stream_config())  # where leases are placed
        finally:
            await nc.close()

    asyncio.run(old_store())
    _output(srv, auth, "alpha", "la", ["old 1\n", "old 2\n"])
    _output(srv, auth, "beta", "lb", ["beta old\n"])
    _wait_stored(service, TELEMETRY_STREAM, 3)
    ensure_all_streams(service, tenants=("alpha", "beta"))  # the upgrade's `pool up`
    _output(srv, auth, "alpha", "la", ["new 1\n"])
    _wait_stored(service, tenant_telemetry_stream("alpha"), 4)  # its sequences run on
    # what it held stays under the limit it had, not a new plane's smaller one
    assert _stream_bytes(service, TELEMETRY_STREAM)[1] == OLD_BYTES > TELEMETRY_MAX_BYTES

    cp = _commands(srv, auth)
    try:
        every = _replay(srv, auth, "alpha")
        assert _texts(every) == ["old 1\n", "old 2\n", "new 1\n"]
        seqs = [s["seq"] for s in every]
        assert seqs == sorted(set(seqs))
        # a page at a time, across both streams, nothing skipped or repeated
        assert _replay(srv, auth, "alpha", limit=1) == every
        assert _texts(_replay(srv, auth, "beta")) == ["beta old\n"]
    finally:
        cp.stop()


def test_a_retention_the_server_cannot_reserve_is_refused_with_a_code(
    server: tuple[NatsServer, AuthConfig],
) -> None:
    srv, auth = server
    service = _service(srv, auth)
    ensure_all_streams(service, tenants=("alpha",))
    with pytest.raises(TelemetryRetentionUnreservable, match="max_file_store") as refused:
        ensure_tenant_telemetry_sync(service, ["alpha"], max_bytes=1 << 50)
    assert refused.value.code == "telemetry_retention_unreservable"
    with pytest.raises(TelemetryRetentionUnreservable):  # nor is a new tenant's stream made
        ensure_tenant_telemetry_sync(service, ["gamma"], max_bytes=1 << 50)

    async def gamma_missing() -> bool:
        nc = await nats.connect(service)
        try:
            await nc.jetstream().stream_info(tenant_telemetry_stream("gamma"))
            return False
        except NotFoundError:
            return True
        finally:
            await nc.close()

    assert asyncio.run(gamma_missing())

    def pool(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "cli.main", "admin", "tenant",
                               "telemetry-retention", "alpha", "--nats-url", service, "--json",
                               *args], capture_output=True, text=True, timeout=60, check=False)

    out = pool("--bytes", str(1 << 50))
    assert out.returncode != 0 and "telemetry_retention_unreservable" in out.stdout + out.stderr
    out = pool("--bytes", str(RETENTION), "--max-age-seconds", "3600")
    assert out.returncode == 0, out.stderr
    row = json.loads(out.stdout)["result"]
    assert (row["max_bytes"], row["max_age_seconds"]) == (RETENTION, 3600)
    assert _stream_bytes(service, tenant_telemetry_stream("alpha"))[1] == RETENTION
