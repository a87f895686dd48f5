"""NATS accounts for the embedded default: a user per tenant, per node agent, and the service.

Tenants may publish only on `pool.cmd.<tenant>.>` and read only their own inbox prefix, so one
tenant can neither act as another nor read its replies; the server enforces it, not our code.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field

from bus.subjects import token

SERVICE_USER = "pool-service"


def inbox_prefix(tenant: str) -> str:
    """The reply-subject prefix a tenant's client must use (`Client(..., inbox_prefix=...)`)."""
    return f"_INBOX_{token(tenant)}"


@dataclass
class Credentials:
    user: str
    password: str


@dataclass
class AuthConfig:
    """Users and passwords for one deployment; rendered into the server's configuration."""

    service: Credentials = field(
        default_factory=lambda: Credentials(SERVICE_USER, secrets.token_urlsafe(18))
    )
    tenants: dict[str, Credentials] = field(default_factory=dict)
    nodes: dict[str, Credentials] = field(default_factory=dict)

    def add_tenant(self, tenant: str, password: str | None = None) -> Credentials:
        c = Credentials(f"tenant-{token(tenant)}", password or secrets.token_urlsafe(18))
        self.tenants[token(tenant)] = c
        return c

    def add_node(self, node_id: str, password: str | None = None) -> Credentials:
        c = Credentials(f"node-{token(node_id)}", password or secrets.token_urlsafe(18))
        self.nodes[token(node_id)] = c
        return c

    def render(self) -> str:
        users: list[dict[str, object]] = [
            {"user": self.service.user, "password": self.service.password}
        ]
        for tenant, c in sorted(self.tenants.items()):
            users.append(
                {
                    "user": c.user,
                    "password": c.password,
                    "permissions": {
                        "publish": {"allow": [f"pool.cmd.{tenant}.>"]},
                        "subscribe": {
                            "allow": [f"{inbox_prefix(tenant)}.>", f"pool.tel.*.*.{tenant}-*.>"]
                        },
                    },
                }
            )
        for node, c in sorted(self.nodes.items()):
            users.append(
                {
                    "user": c.user,
                    "password": c.password,
                    "permissions": {
                        "publish": {
                            "allow": [
                                f"pool.node.{node}.>",
                                "pool.tel.*." + node + ".>",
                                "$JS.API.CONSUMER.MSG.NEXT.POOL_AGENT.agent-" + node,
                                "$JS.ACK.POOL_AGENT.agent-" + node + ".>",
                                f"_INBOX_{node}.>",
                            ]
                        },
                        "subscribe": {"allow": [f"_INBOX_{node}.>", f"pool.agent.{node}.>"]},
                    },
                }
            )
        # the server's config format accepts JSON values
        return "authorization { users: " + json.dumps(users, indent=1) + " }"
