"""A real stack for the gateway's tests: a nats-server with users, the control plane, the
projector into a schema of its own, the query service, and the gateway on a free port."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bus.admin import ensure_all_streams
from bus.local.auth import AuthConfig, save, url_with_credentials
from bus.local.server import NatsServer
from bus.service import Service
from client.api import PoolClient
from gateway.app import create_app
from gateway.server import ServerThread
from gateway.tokens import TokenStore
from gateway.upstream import Settings
from tests.control_plane import node_body, setup_pool
from workers.bootstrap import application
from workers.commands import QUERY_SUBJECTS, CommandHandler
from workers.plane import ControlPlane
from workers.projector import Projector
from workers.secrets.settings import SecretSettings
from workers.webhooks.settings import WebhookSettings
from workers.webhooks.signing import plane_key

TENANTS = ("alpha", "beta")


@dataclass
class Stack:
    url: str  # the gateway's
    service_url: str  # NATS, as the service user
    tokens: dict[str, str]  # tenant (or "admin") → bearer token
    plane: ControlPlane

    def client(self, who: str) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=15,
                            headers={"Authorization": f"Bearer {self.tokens[who]}"})


def sse_events(response: httpx.Response, count: int) -> list[dict[str, str]]:
    """The first `count` events of a text/event-stream response (fewer if it ends)."""
    events: list[dict[str, str]] = []
    current: dict[str, str] = {}
    for line in response.iter_lines():
        if not line:
            if "data" in current:
                events.append(current)
                if len(events) >= count:
                    break
            current = {}
            continue
        if line.startswith(":"):
            continue
        name, _, value = line.partition(":")
        current[name] = value.removeprefix(" ")
    return events


def wait_for(predicate: Any, timeout: float = 10.0, every: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = predicate()
        if got or time.monotonic() > deadline:
            return got
        time.sleep(every)


@contextlib.contextmanager
def stack_in_own_schema(home: Path, database_url: str, prefix: str) -> Iterator[Stack]:
    """`gateway_stack` with its views in a schema of its own (`prefix` and a random suffix),
    dropped afterwards."""
    import uuid

    from projections.views import drop_schema

    schema = f"{prefix}_{uuid.uuid4().hex[:8]}"
    try:
        with gateway_stack(home, database_url, schema) as s:
            yield s
    finally:
        drop_schema(database_url, schema)


@contextlib.contextmanager
def gateway_stack(home: Path, database_url: str, schema: str, *,
                  metrics_port: int | None = None) -> Iterator[Stack]:
    auth = AuthConfig()
    for t in TENANTS:
        auth.add_tenant(t)
    save(auth, home / "auth.json")
    server = NatsServer(store_dir=home / "nats", server_name="pool-gw",
                        extra_config=auth.render())
    server.start()
    service_url = url_with_credentials(server.url, auth.service)
    stack: list[Any] = []
    try:
        ensure_all_streams(service_url, tenants=TENANTS)  # as `pool up`: theirs too
        # webhooks on (a key to seal their secrets), to no address but public ones
        plane = ControlPlane(service_url, database_url=None, metrics_port=metrics_port,
                             webhooks=WebhookSettings(key=plane_key("gateway stack")),
                             secrets=SecretSettings.with_keys("k1=gateway stack")).start()
        stack.append(plane)
        queries = Service(service_url, QUERY_SUBJECTS,
                          CommandHandler(plane.app, database_url=database_url,
                                         views_schema=schema), queue="pool-queries").start()
        stack.append(queries)
        projector = Projector(application(service_url), database_url, schema=schema).start()
        stack.append(projector)
        with PoolClient(service_url) as admin:
            # a renewable term shorter than the maximum runtime, so renewals have room; its
            # nodes have no agent to beat for them, so they stay ready for the whole module
            setup_pool(admin, tenants={t: 1.0 for t in TENANTS}, default_lease_seconds=300,
                       node_timeout_seconds=3600)
            for n in ("n1", "n2"):
                assert admin.admin("node.register", node_body(n, zone=f"z-{n}"))["ok"]
        store = TokenStore(home / "http-tokens.json")
        tokens = {t: store.issue_tenant(t) for t in TENANTS}
        tokens["admin"] = store.issue_admin()
        app = create_app(Settings(server.url, auth_path=home / "auth.json"), store,
                         database_url=database_url, views_schema=schema,
                         open_log=application)
        http = ServerThread(app, port=0).start()
        stack.append(http)
        yield Stack(http.url, service_url, tokens, plane)
    finally:
        for part in reversed(stack):
            with contextlib.suppress(Exception):
                part.stop()
        server.stop()
