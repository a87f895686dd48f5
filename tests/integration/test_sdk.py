"""The SDK (computepool, docs/sdk.md): its documented example run as written over the gateway
and over NATS, and its one typed error, against a real plane, gateway and bubblewrap agent."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from bus.local.auth import load, url_with_credentials
from bus.objects import ensure_tenant_buckets_sync
from computepool import AsyncClient, Client, PoolError
from tests.integration.test_cli_http import Laptop, laptop  # noqa: F401 - the plane it runs on

ROOT = Path(__file__).resolve().parents[2]


def _example() -> str:
    text = (ROOT / "docs" / "sdk.md").read_text()
    found = re.search(r"^## Example$.*?^```python\n(.*?)^```$", text, re.DOTALL | re.MULTILINE)
    assert found, "docs/sdk.md has no python example under ## Example"
    return found.group(1)


def _tenant_nats_url(lab: Laptop) -> str:
    """nats://tenant-alpha:PASSWORD@host:port: alpha's own NATS user, not the service's."""
    auth = load(lab.home.parent / "auth.json")
    assert auth is not None
    plain = urlsplit(lab.service_url)
    return url_with_credentials(f"nats://{plain.hostname}:{plain.port}", auth.tenants["alpha"])


def _clients(lab: Laptop) -> list[Client]:
    return [Client(lab.url, token=lab.tokens["alpha"]),
            Client(_tenant_nats_url(lab), tenant="alpha")]


@pytest.mark.parametrize("transport", ["http", "nats"])
def test_the_documented_example_runs_over_http_and_over_nats(laptop: Laptop,  # noqa: F811
                                                             transport: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("POOL_")}
    env["PYTHONPATH"] = str(ROOT)
    if transport == "http":
        env.update(POOL_URL=laptop.url, POOL_TOKEN=laptop.tokens["alpha"])
    else:
        env.update(POOL_URL=_tenant_nats_url(laptop), POOL_TENANT="alpha")
    done = subprocess.run([sys.executable, "-c", _example()], env=env, cwd=laptop.home,
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[:3] == ["exit code 3", "hello", "world"], done.stdout
    states = lines[3].split()
    assert states[0] == "states" and states[-1] == "released", lines[3]
    assert lines[4:] == ["logs ['hello\\n', 'world\\n']", "listed True",
                         "refused illegal_transition"], done.stdout


def test_a_refusal_is_one_typed_error_with_the_stable_code(laptop: Laptop) -> None:  # noqa: F811
    for client in _clients(laptop):
        with client, pytest.raises(PoolError) as refused:
            client.get("no-such-lease")
        assert refused.value.code == "lease_not_found", refused.value
        assert refused.value.message and isinstance(refused.value.reasons, dict)

    async def awaited() -> PoolError:
        async with AsyncClient(laptop.url, token=laptop.tokens["beta"]) as c:
            try:
                await c.why("no-such-lease")
            except PoolError as e:
                return e
        raise AssertionError("not refused")

    assert asyncio.run(awaited()).code == "lease_not_found"


def test_a_transport_failure_or_a_bad_url_is_a_pool_error_too(tmp_path: Path) -> None:
    with pytest.raises(PoolError) as unreachable:
        Client("http://127.0.0.1:9", token="cpt_x", timeout=2).get("l1")
    assert unreachable.value.code == "gateway_unreachable"
    with pytest.raises(PoolError) as scheme:
        Client("ftp://127.0.0.1/", token="t")
    assert scheme.value.code == "bad_url"
    with pytest.raises(PoolError) as tenantless:
        Client("nats://127.0.0.1:4222")
    assert tenantless.value.code == "no_tenant"


def test_artifacts_come_back_over_nats_and_over_http(
    laptop: Laptop, tmp_path: Path,  # noqa: F811
) -> None:
    ensure_tenant_buckets_sync(laptop.service_url, ["alpha"])  # as `pool admin tenant set`
    http, nats = _clients(laptop)
    with nats:
        done = nats.run(["sh", "-c", "mkdir -p out && printf data > out/a.txt"],
                        artifacts=["out/*"], max_runtime_seconds=120)
        assert done.exit_code == 0, done
        lid = done.lease.lease_id
        kept = nats.artifacts(lid)
        assert [(a.name, a.size_bytes) for a in kept] == [("out/a.txt", 4)]
        assert [p.read_text() for p in nats.download(lid, tmp_path)] == ["data"]
    with http:  # the same through the gateway, with a URL and a token
        assert [(a.name, a.size_bytes) for a in http.artifacts(lid)] == [("out/a.txt", 4)]
        got = http.download(lid, tmp_path / "http")
        assert [p.read_text() for p in got] == ["data"]


@pytest.mark.parametrize("transport", ["http", "nats"])
def test_a_secret_is_set_listed_and_deleted(laptop: Laptop, transport: str) -> None:  # noqa: F811
    client = _clients(laptop)[0 if transport == "http" else 1]
    name = f"sdk-{transport}"
    with client:
        assert client.set_secret(name, b"v4lue")["version"] == 1
        assert name in [s["name"] for s in client.secrets()]
        assert all("value" not in s for s in client.secrets())
        client.delete_secret(name)
        with pytest.raises(PoolError) as gone:
            client.delete_secret(name)
        assert gone.value.code == "secret_unknown"


def test_the_async_client_follows_the_feed_and_the_output(laptop: Laptop) -> None:  # noqa: F811
    async def go() -> tuple[list[str], list[str]]:
        async with AsyncClient(laptop.url, token=laptop.tokens["alpha"]) as c:
            done = await c.run(["sh", "-c", "echo one; echo two"], max_runtime_seconds=120)
            states = [r.state async for r in c.watch(done.lease.lease_id)]
            lines = [line async for line in c.logs(done.lease.lease_id, follow=True)]
            return states, lines

    states, lines = asyncio.run(go())
    assert states[-1] == "released" and lines == ["one\n", "two\n"]


def test_a_saved_context_picks_the_gateway_and_the_token(
    laptop: Laptop, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,  # noqa: F811
) -> None:
    from client import contexts

    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    monkeypatch.delenv("POOL_CONTEXT", raising=False)
    with pytest.raises(PoolError) as none_saved:
        Client.from_context()
    assert none_saved.value.code == "no_context"
    ctx = contexts.Context(name="lab", url=laptop.url, token=laptop.tokens["alpha"],
                           tenant="alpha", pool="default")
    contexts.save(contexts.Config().with_context(ctx))
    with Client.from_context() as c, pytest.raises(PoolError) as refused:
        c.get("no-such-lease")
    assert refused.value.code == "lease_not_found" and c.pool == "default"
    with pytest.raises(PoolError) as unknown:
        Client.from_context("elsewhere")
    assert unknown.value.code == "unknown_context"


def test_a_run_no_node_can_hold_raises_not_reserved_saying_why(laptop: Laptop) -> None:  # noqa: F811
    for client in _clients(laptop):
        with client, pytest.raises(PoolError) as refused:
            client.run(["true"], cpu_millis=999_999, timeout=20)
        assert refused.value.code == "not_reserved", refused.value
        assert refused.value.reasons["filters"] == {"insufficient_cpu": 1}
