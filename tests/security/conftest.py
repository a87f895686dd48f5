"""A secured nats-server (a user per tenant, node and the service) for the adversarial tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from bus.local.auth import AuthConfig, url_with_credentials
from bus.local.server import NatsServer


@pytest.fixture()
def secured(tmp_path: Path) -> Iterator[tuple[NatsServer, AuthConfig]]:
    """Tenants alpha, beta and gpu-7, node gpu-7 (named like the tenant), on a server of its own."""
    auth = AuthConfig()
    for tenant in ("alpha", "beta", "gpu-7"):
        auth.add_tenant(tenant)
    auth.add_node("gpu-7")
    server = NatsServer(store_dir=tmp_path / "nats", server_name="pool-sec",
                        extra_config=auth.render())
    server.start()
    yield server, auth
    server.stop()


def service_url(server: NatsServer, auth: AuthConfig) -> str:
    return url_with_credentials(server.url, auth.service)
