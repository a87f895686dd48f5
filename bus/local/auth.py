"""NATS users of the embedded default and what each may do: one table, `PERMISSIONS`.
The server configuration and docs/security.md's permission matrix are generated from it.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote, urlsplit, urlunsplit

from bus.errors import NameCollision
from bus.replies import ADMIN_INBOXES, NODE_INBOXES, TENANT_INBOXES, tenant_inbox
from bus.subjects import FEED_LIVE_PREFIX, is_token

log = logging.getLogger(__name__)

SERVICE_USER = "pool-service"
RESPONDER_USER = "pool-responder"
BCRYPT_ROUNDS = 10  # bcrypt's usual cost; nats-server checks it on every connect (docs/security.md)


@dataclass(frozen=True)
class Rule:
    """What one kind of user may publish and subscribe to (None: anything). `{name}` is the
    user's own tenant or node; `why` is the matrix's last column."""

    publish: tuple[str, ...] | None
    subscribe: tuple[str, ...] | None
    why: str


# The one permission table. Every user the server knows is one of these kinds.
PERMISSIONS: dict[str, Rule] = {
    "operator": Rule(
        None, None,
        "the admin CLI and `pool up`'s control plane (log, timers, work queues, KV); trusted"),
    "responder": Rule(
        (f"{TENANT_INBOXES}.>", f"{NODE_INBOXES}.>", f"{ADMIN_INBOXES}.>"),
        ("pool.cmd.>", "pool.node.>", "pool.admin.>"),
        "the command responders' connection: receives commands, publishes replies into inboxes "
        "and nowhere else (never the log, timers, work queues, JetStream or KV)"),
    "tenant": Rule(
        # replay goes through pool.cmd.<tenant>.telemetry.replay: no JetStream API at all, so
        # no consumer (and no deliver subject)
        ("pool.cmd.{name}.>",),
        # telemetry and feed subjects carry the tenant as a whole token, so these select
        # exactly its own leases (wildcards cannot match a prefix); the feed's stored records
        # are replayed through pool.cmd.<tenant>.feed.replay, its live ones read here
        (f"{TENANT_INBOXES}.{{name}}.>", "pool.tel.*.*.{name}.>",
         f"{FEED_LIVE_PREFIX}.{{name}}.>"),
        "its own commands and queries, its own replies, telemetry and lease feed"),
    "node": Rule(
        ("pool.node.{name}.>", "pool.tel.*.{name}.>",
         "$JS.API.CONSUMER.MSG.NEXT.POOL_AGENT.agent-{name}",
         "$JS.ACK.POOL_AGENT.agent-{name}.>", f"{NODE_INBOXES}.{{name}}.>"),
        (f"{NODE_INBOXES}.{{name}}.>", "pool.agent.{name}.>"),
        "its own reports and telemetry; pulls and acks its own work queue only"),
}


def permissions(kind: str, name: str = "") -> dict[str, object] | None:
    """The server's `permissions` block for a user of `kind` (None: no restriction)."""
    rule = PERMISSIONS[kind]
    if rule.publish is None and rule.subscribe is None:
        return None
    out: dict[str, object] = {}
    for direction, allowed in (("publish", rule.publish), ("subscribe", rule.subscribe)):
        if allowed is not None:
            out[direction] = {"allow": [a.replace("{name}", name) for a in allowed]}
    return out


def permission_matrix() -> str:
    """PERMISSIONS as a Markdown table (printed in docs/security.md)."""
    rows = ["| user | may publish | may subscribe | why |", "|---|---|---|---|"]

    def cell(allowed: tuple[str, ...] | None) -> str:
        return "anything" if allowed is None else "<br>".join(f"`{a}`" for a in allowed)

    for kind, rule in PERMISSIONS.items():
        rows.append(f"| {kind} | {cell(rule.publish)} | {cell(rule.subscribe)} | {rule.why} |")
    return "\n".join(rows) + "\n"


def inbox_prefix(tenant: str) -> str:
    """The reply-subject prefix a tenant's client must use (`Client(..., inbox_prefix=...)`)."""
    return tenant_inbox(tenant)


def checked_name(kind: str, name: str) -> str:
    """`name` when it is already one subject token; anything else would be folded onto another
    name's subjects, user and inbox (`Alpha`, `alpha` and `a.lpha` meet), so it is refused."""
    if not is_token(name):
        raise NameCollision(f"{kind} name {name!r} is not a subject token (a-z 0-9 - _, at most "
                            "128): it would share subjects and an inbox with another name")
    return name


@dataclass
class Credentials:
    user: str
    password: str
    hashed: str = ""  # bcrypt of the password: what the server's configuration holds

    def password_hash(self) -> str:
        """The bcrypt hash of the password (made once, kept with the credentials); the plain
        password, with a warning, where the bcrypt package is missing (an install older than
        this requirement), so such a checkout still serves."""
        if not self.hashed:  # a new or rotated password comes without one
            try:
                import bcrypt
            except ImportError:
                log.warning("bcrypt is not installed: the server's users keep plain passwords "
                            "(pip install -e . installs it)")
                return self.password
            self.hashed = bcrypt.hashpw(self.password.encode(),
                                        bcrypt.gensalt(BCRYPT_ROUNDS)).decode()
        return self.hashed


@dataclass
class AuthConfig:
    """Users and passwords for one deployment; rendered into the server's configuration."""

    service: Credentials = field(
        default_factory=lambda: Credentials(SERVICE_USER, secrets.token_urlsafe(18))
    )
    responder: Credentials = field(
        default_factory=lambda: Credentials(RESPONDER_USER, secrets.token_urlsafe(18))
    )
    tenants: dict[str, Credentials] = field(default_factory=dict)
    nodes: dict[str, Credentials] = field(default_factory=dict)

    def add_tenant(self, tenant: str, password: str | None = None) -> Credentials:
        tenant = checked_name("tenant", tenant)
        c = Credentials(f"tenant-{tenant}", password or secrets.token_urlsafe(18))
        self.tenants[tenant] = c
        return c

    def add_node(self, node_id: str, password: str | None = None) -> Credentials:
        node_id = checked_name("node", node_id)
        c = Credentials(f"node-{node_id}", password or secrets.token_urlsafe(18))
        self.nodes[node_id] = c
        return c

    def render(self) -> str:
        """The server's `authorization` block: every user with its bcrypt-hashed password (the
        server never sees them in plain) and its permissions from PERMISSIONS."""
        users: list[dict[str, object]] = []

        def add(kind: str, c: Credentials, name: str = "") -> None:
            user: dict[str, object] = {"user": c.user, "password": c.password_hash()}
            perms = permissions(kind, name)
            if perms is not None:
                user["permissions"] = perms
            users.append(user)

        add("operator", self.service)
        add("responder", self.responder)
        for tenant, c in sorted(self.tenants.items()):
            add("tenant", c, tenant)
        for node, c in sorted(self.nodes.items()):
            add("node", c, node)
        # the server's config format accepts JSON values
        return "authorization { users: " + json.dumps(users, indent=1) + " }"


# -- persistence: $POOL_HOME/auth.json (mode 0600) and the server's included auth.conf ---------


def write_private(path: Path, text: str) -> None:
    """Write `text` to `path` readable by its owner only, replacing it atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)


def to_dict(auth: AuthConfig) -> dict[str, object]:
    def c(x: Credentials) -> dict[str, str]:
        return {"user": x.user, "password": x.password, "bcrypt": x.password_hash()}

    return {
        "service": c(auth.service),
        "responder": c(auth.responder),
        "tenants": {k: c(v) for k, v in sorted(auth.tenants.items())},
        "nodes": {k: c(v) for k, v in sorted(auth.nodes.items())},
    }


def from_dict(data: dict[str, object]) -> AuthConfig:
    def c(x: object) -> Credentials:
        assert isinstance(x, dict)
        return Credentials(str(x["user"]), str(x["password"]), str(x.get("bcrypt") or ""))

    tenants = data.get("tenants") or {}
    nodes = data.get("nodes") or {}
    assert isinstance(tenants, dict) and isinstance(nodes, dict)
    auth = AuthConfig(
        service=c(data["service"]),
        tenants={str(k): c(v) for k, v in tenants.items()},
        nodes={str(k): c(v) for k, v in nodes.items()},
    )
    if data.get("responder"):  # older files had none: the new one is saved on next change
        auth.responder = c(data["responder"])
    return auth


def load(path: Path) -> AuthConfig | None:
    """The deployment's users from `path`, or None when there is none yet."""
    if not path.exists():
        return None
    data = json.loads(path.read_text())
    auth = from_dict(data)
    if "responder" not in data:  # a file from before the responder user: keep the one made now
        save(auth, path)
    return auth


def save(auth: AuthConfig, path: Path) -> None:
    write_private(path, json.dumps(to_dict(auth), indent=2) + "\n")


def load_or_create(path: Path) -> AuthConfig:
    """The users in `path`; on first use, new service credentials are generated and saved."""
    auth = load(path)
    if auth is None:
        auth = AuthConfig()
        save(auth, path)
    return auth


def write_server_include(auth: AuthConfig, path: Path) -> None:
    """The authorization block as its own file, `include`d by the server's configuration."""
    write_private(path, auth.render() + "\n")


def url_with_credentials(url: str, creds: Credentials) -> str:
    """`nats://user:password@host:port` (nats-py takes credentials from the URL); a
    comma-separated URL (the servers of a cluster) gets them on every server."""
    if "," in url:
        return ",".join(url_with_credentials(u.strip(), creds) for u in url.split(",") if u.strip())
    parts = urlsplit(url)
    host = parts.hostname or "127.0.0.1"
    netloc = f"{quote(creds.user, safe='')}:{quote(creds.password, safe='')}@{host}"
    if parts.port:
        netloc += f":{parts.port}"
    return urlunsplit((parts.scheme or "nats", netloc, parts.path, "", ""))


def redact(url: str) -> str:
    """`url` without its password, for printing."""
    if "," in url:
        return ",".join(redact(u.strip()) for u in url.split(",") if u.strip())
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = f"{parts.username}:***@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))
