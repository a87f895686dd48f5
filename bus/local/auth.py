"""NATS users of the embedded default and what each may do: one table, `PERMISSIONS`.
The server configuration and docs/security.md's permission matrix are generated from it.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote, unquote, urlsplit, urlunsplit

from bus.caps import Caps
from bus.errors import NameCollision
from bus.local.accounts import (
    Crossing,
    Member,
    crossings,
    node_account,
    reloads_to_apply,
    render_accounts,
    tenant_account,
)
from bus.replies import (
    ADMIN_INBOXES,
    INBOX_ROOT,
    NODE_INBOXES,
    SERVICE_REPLIES,
    TENANT_INBOXES,
    admin_inbox,
    tenant_inbox,
)
from bus.subjects import (
    ARTIFACTS_BUCKET_PREFIX,
    CHECKPOINT_PREFIX,
    CHECKPOINT_STREAM,
    DECISIONS_PREFIX,
    DECISIONS_STREAM,
    FEED_LIVE_PREFIX,
    LEAD_PREFIX,
    OPS_PREFIX,
    SECRETS_BUCKET,
    SESSION_PREFIX,
    SNAPSHOTS_PREFIX,
    SNAPSHOTS_STREAM,
    TELEMETRY_STREAM,
    TENANT_TELEMETRY_STREAM_PREFIX,
    WEBHOOK_BUCKET,
    WORK_BUCKET_PREFIX,
    is_token,
)

log = logging.getLogger(__name__)


def _password() -> str:
    """A new user's password: 144 random bits (secrets is loaded only to make one)."""
    import secrets

    return secrets.token_urlsafe(18)

SERVICE_USER = "pool-service"
RESPONDER_USER = "pool-responder"
# the connection guard's user (bus/connguard.py): the one user of the server's system account
GUARD_USER = "pool-guard"
SYSTEM_ACCOUNT = "$SYS"
TENANT_USER_PREFIX = "tenant-"
NODE_USER_PREFIX = "node-"
# the control plane's roles and the admin CLI, each its own user `pool-<role>` (PERMISSIONS)
ROLES = ("commands", "scheduler", "reconciler", "projector", "admin")
ROLE_INBOXES = f"{INBOX_ROOT}.r"
# bcrypt's cost. Every password here is made by _password() (144 random bits),
# which no work factor makes harder to guess; and nats-server checks the hash on every connect,
# so the usual cost for people's passwords (10) made each connect of a `pool` command 60-160 ms
# of server CPU (docs/security.md, docs/performance-log.md 2026-12-06).
BCRYPT_ROUNDS = 4


@dataclass(frozen=True)
class Rule:
    """What one kind of user may publish and subscribe to (None: anything). `{name}` is the
    user's own tenant or node; a subject with `{tenant}` is allowed once for every tenant (a
    node's agent reads any tenant's work directories); `why` is the matrix's last column."""

    publish: tuple[str, ...] | None
    subscribe: tuple[str, ...] | None
    why: str


# what reading the event log takes: stream info, direct gets (and, on a replicated stream, the
# leader's own get: bus.jetstream.recorder), and ordered pull consumers
_READS_LOG = (
    "$JS.API.STREAM.INFO.POOL_EVENTS", "$JS.API.STREAM.MSG.GET.POOL_EVENTS",
    "$JS.API.DIRECT.GET.POOL_EVENTS",
    "$JS.API.DIRECT.GET.POOL_EVENTS.>", "$JS.API.CONSUMER.CREATE.POOL_EVENTS",
    "$JS.API.CONSUMER.CREATE.POOL_EVENTS.>", "$JS.API.CONSUMER.MSG.NEXT.POOL_EVENTS.*",
    "$JS.API.CONSUMER.INFO.POOL_EVENTS.*", "$JS.API.CONSUMER.DELETE.POOL_EVENTS.*",
)

# what reading the tenants' lease feed takes (its stored records; the live ones are republished)
_READS_FEED = ("$JS.API.STREAM.INFO.POOL_FEED", "$JS.API.DIRECT.GET.POOL_FEED",
               "$JS.API.DIRECT.GET.POOL_FEED.>")


# reading the latest snapshot of an account, node or pool (bus.jetstream.snapshots): the
# stream's info, a direct get by subject, the leader's own get on a replicated stream
_READS_SNAPSHOTS = (f"$JS.API.STREAM.INFO.{SNAPSHOTS_STREAM}",
                    f"$JS.API.STREAM.MSG.GET.{SNAPSHOTS_STREAM}",
                    f"$JS.API.DIRECT.GET.{SNAPSHOTS_STREAM}.>")
# and saving one: what the roles that save those aggregates may do
_SNAPSHOTS = (f"{SNAPSHOTS_PREFIX}.>", *_READS_SNAPSHOTS)

# the scheduler's checkpoints (bus.checkpoints): store chunks and a head, read them back
_CHECKPOINTS = (f"{CHECKPOINT_PREFIX}.>", f"$JS.API.DIRECT.GET.{CHECKPOINT_STREAM}.>")

# reading the tenants' telemetry (bus.telemetry_streams): each tenant's stream POOL_TEL_<t>
# (its info says where its sequences start; named once a tenant, as a wildcard matches whole
# tokens only) and the node-level POOL_TELEMETRY, which on a store from before the split
# still holds the tenants' older samples
_READS_TELEMETRY = (f"$JS.API.DIRECT.GET.{TELEMETRY_STREAM}",
                    f"$JS.API.STREAM.INFO.{TENANT_TELEMETRY_STREAM_PREFIX}{{tenant}}",
                    f"$JS.API.DIRECT.GET.{TENANT_TELEMETRY_STREAM_PREFIX}{{tenant}}")

# the scheduler's decision records (bus.decisions): it alone writes them, and (answering
# `why --at` for the asking tenant's lease only) reads them back
_DECISIONS = (f"{DECISIONS_PREFIX}.>", f"$JS.API.DIRECT.GET.{DECISIONS_STREAM}",
              f"$JS.API.STREAM.INFO.{DECISIONS_STREAM}")


def _files_read(bucket: str) -> tuple[str, ...]:
    """Reading a file bucket's objects (bus.objects): direct gets only, so no consumer."""
    return (f"$JS.API.DIRECT.GET.OBJ_{bucket}", f"$JS.API.DIRECT.GET.OBJ_{bucket}.>")


def _files_usage(bucket: str) -> str:
    """A file bucket's bytes held and quota (its stream's info), asked before a put."""
    return f"$JS.API.STREAM.INFO.OBJ_{bucket}"


# the tenant's own file buckets: it stores (and cleans up) its packed work directories and
# reads its jobs' artifacts, which only the nodes write; the operator makes both buckets
_TENANT_FILES = (f"$O.{WORK_BUCKET_PREFIX}{{name}}.>",
                 f"$JS.API.STREAM.PURGE.OBJ_{WORK_BUCKET_PREFIX}{{name}}",
                 *_files_read(f"{WORK_BUCKET_PREFIX}{{name}}"),
                 *_files_read(f"{ARTIFACTS_BUCKET_PREFIX}{{name}}"),
                 _files_usage(f"{WORK_BUCKET_PREFIX}{{name}}"),
                 _files_usage(f"{ARTIFACTS_BUCKET_PREFIX}{{name}}"))
# a node reads every tenant's work directories and writes every tenant's artifacts
_NODE_FILES = (*_files_read(f"{WORK_BUCKET_PREFIX}{{tenant}}"),
               f"$O.{ARTIFACTS_BUCKET_PREFIX}{{tenant}}.>",
               _files_usage(f"{ARTIFACTS_BUCKET_PREFIX}{{tenant}}"))


def _kv(bucket: str, *, watch: bool = False) -> tuple[str, ...]:
    """Reading and writing one KV bucket's keys (and, `watch`, watching them)."""
    out: tuple[str, ...] = (f"$KV.{bucket}.>", f"$JS.API.STREAM.INFO.KV_{bucket}",
                            f"$JS.API.STREAM.MSG.GET.KV_{bucket}",
                            f"$JS.API.DIRECT.GET.KV_{bucket}.>")
    if watch:
        out += (f"$JS.API.CONSUMER.CREATE.KV_{bucket}", f"$JS.API.CONSUMER.CREATE.KV_{bucket}.>",
                f"$JS.API.CONSUMER.INFO.KV_{bucket}.*", f"$JS.API.CONSUMER.DELETE.KV_{bucket}.*",
                f"$JS.FC.KV_{bucket}.>")
    return out


# the webhook deliverer's leader lease: its own key of the leaders' bucket, read the rest
_WEBHOOK_LEADER = ("$KV.pool_leaders.webhooks", "$JS.API.STREAM.INFO.KV_pool_leaders",
                   "$JS.API.STREAM.MSG.GET.KV_pool_leaders", "$JS.API.DIRECT.GET.KV_pool_leaders.>")


# The one permission table. Every user the server knows is one of these kinds.
PERMISSIONS: dict[str, Rule] = {
    "operator": Rule(
        None, None,
        "makes and changes the streams and KV buckets (`pool up`, `pool cluster init`), runs "
        "simulated fleets and benchmarks; trusted, used by no role of the control plane"),
    "responder": Rule(
        (f"{TENANT_INBOXES}.>", f"{NODE_INBOXES}.>", f"{ADMIN_INBOXES}.>",
         f"{SERVICE_REPLIES}.>"),
        ("pool.cmd.>", "pool.node.>", "pool.admin.>", f"{OPS_PREFIX}.>"),
        "the command responders' connection (and the scheduler's, answering `why`, queue "
        "positions and an operator's `pool.ops` questions): receives commands, publishes "
        "replies into inboxes (a tenant's, from its own account, the server's `_R_` reply of its "
        "service import) and nowhere else (never the log, timers, work queues, JetStream "
        "or KV)"),
    "commands": Rule(
        ("pool.evt.>", *_READS_LOG, *_SNAPSHOTS, *_READS_TELEMETRY, *_READS_FEED, *_kv(WEBHOOK_BUCKET, watch=True), *_kv(SECRETS_BUCKET, watch=True)),
        (f"{ROLE_INBOXES}.commands.>", "pool.appended.>"),
        "the command handlers' application: appends decided events, reads the log, saves and "
        "reads snapshots, reads tenants' telemetry and lease-feed pages and webhook "
        "deliveries' state; the only role that reads or writes the sealed secrets"),
    "scheduler": Rule(
        ("pool.evt.>", *_READS_LOG, *_SNAPSHOTS, "pool.agent.*.*", "pool.sched.>", "pool.feed.>",
         *_READS_FEED,
         "$JS.API.CONSUMER.DURABLE.CREATE.POOL_AGENT.*", "$JS.API.CONSUMER.CREATE.POOL_AGENT.>",
         *_kv("pool_leaders", watch=True), *_kv("pool_positions"), f"{LEAD_PREFIX}.>",
         f"{ROLE_INBOXES}.scheduler.>", *_CHECKPOINTS, *_DECISIONS),
        (f"{ROLE_INBOXES}.scheduler.>", "pool.appended.>", f"{LEAD_PREFIX}.>"),
        "scheduler and dispatcher: placements into the log, snapshots, agent orders and each node's "
        "queue, timers, the tenants' lease feed, leader leases and the positions in KV, "
        "questions to and answers from a pool's leader, the scheduler's checkpoints and its "
        "decision records (the only user besides the operator that may write or read them); "
        "never reads a work queue"),
    "reconciler": Rule(
        ("pool.evt.>", *_READS_LOG, *_SNAPSHOTS, "pool.sched.>",
         "$JS.API.CONSUMER.MSG.NEXT.POOL_SCHED.reconciler", "$JS.ACK.POOL_SCHED.reconciler.>",
         # the webhook deliverer: its consumer on the feed, its bucket, its leader lease
         "$JS.API.CONSUMER.MSG.NEXT.POOL_FEED.webhooks", "$JS.ACK.POOL_FEED.webhooks.>",
         *_kv(WEBHOOK_BUCKET, watch=True), *_WEBHOOK_LEADER),
        (f"{ROLE_INBOXES}.reconciler.>", "pool.appended.>"),
        "fired timers from its one consumer, their events into the log, snapshots, timers "
        "re-armed; the tenants' webhooks from its one consumer on the lease feed; no agent "
        "orders, no tenant subjects"),
    "projector": Rule(
        (*_READS_LOG, *_READS_SNAPSHOTS),
        (f"{ROLE_INBOXES}.projector.>", "pool.evt.>"),
        "reads the log (and wakes on its appends) into PostgreSQL, and snapshots; publishes "
        "nothing"),
    "admin": Rule(
        ("pool.admin.>", f"{OPS_PREFIX}.>", *_READS_LOG, *_READS_SNAPSHOTS, "$JS.API.INFO",
         "$JS.API.STREAM.NAMES", "$JS.API.STREAM.LIST", "$JS.API.STREAM.INFO.*",
         *_READS_TELEMETRY),
        (f"{ADMIN_INBOXES}.operator.>",),
        "the admin CLI: operators' commands, their questions for the scheduler (`pool.ops`), "
        "reads of the log, snapshots, telemetry and stream state; no work queue, timer or KV, "
        "and no stream changes (`pool up` and `pool cluster init` make the streams as the "
        "operator)"),
    "tenant": Rule(
        # replay goes through pool.cmd.<tenant>.telemetry.replay: no JetStream API at all (but
        # its files' direct gets), so no consumer (and no deliver subject). Not even a direct
        # get on its own telemetry stream: the server sends the answer to whatever reply
        # subject the asker names, unchecked, a log subject included
        ("pool.cmd.{name}.>", *_TENANT_FILES, f"{SESSION_PREFIX}.{{name}}.*.*.in"),
        # telemetry and feed subjects carry the tenant as a whole token, so these select
        # exactly its own leases (wildcards cannot match a prefix); the feed's stored records
        # are replayed through pool.cmd.<tenant>.feed.replay, its live ones read here
        (f"{TENANT_INBOXES}.{{name}}.>", "pool.tel.*.*.{name}.>",
         f"{FEED_LIVE_PREFIX}.{{name}}.>", f"{SESSION_PREFIX}.{{name}}.*.*.out"),
        "its own commands and queries, its own replies, telemetry and lease feed; its own "
        "file buckets: work directories read and written, artifacts read; its own sessions' "
        "bytes to the node (`in`) and back (`out`). In an account of its own (ADR 027): each "
        "of these crosses into the plane's account by an import, and every answer comes back "
        "into the tenant's"),
    "guard": Rule(
        ("$SYS.REQ.SERVER.PING.CONNZ", "$SYS.REQ.SERVER.*.CONNZ", "$SYS.REQ.SERVER.*.KICK"),
        ("$SYS.ACCOUNT.*.CONNECT", "$SYS.ACCOUNT.*.DISCONNECT", "_INBOX.>"),
        "the connection guard, alone in the server's system account (its `_INBOX` is its "
        "own): hears connects and disconnects, lists connections, closes a tenant's "
        "connections past its caps (ADR 023); nothing in the plane's subjects"),
    "node": Rule(
        ("pool.node.{name}.>", "pool.tel.*.{name}.>",
         "$JS.API.CONSUMER.MSG.NEXT.POOL_AGENT.agent-{name}",
         "$JS.ACK.POOL_AGENT.agent-{name}.>", f"{NODE_INBOXES}.{{name}}.>", *_NODE_FILES,
         f"{SESSION_PREFIX}.*.{{name}}.*.out"),
        (f"{NODE_INBOXES}.{{name}}.>", "pool.agent.{name}.>", f"{SESSION_PREFIX}.*.{{name}}.*.in"),
        "its own reports and telemetry; pulls and acks its own work queue only; reads "
        "tenants' work directories and writes their jobs' artifacts, never a stream's config; "
        "the sessions the plane sent it (its own node token): reads `in`, writes `out`. In an "
        "account of its own (ADR 028): each of these crosses into the plane's account by an "
        "import, every answer comes back into the node's, and a session's bytes and its "
        "telemetry go on to the tenant's account"),
}


def role_user(role: str) -> str:
    """The NATS user of a control-plane role or the admin CLI."""
    return f"pool-{role}"


def role_inbox(role: str) -> str:
    """The reply-subject prefix of a role's connection: the admin CLI's sits in the admin
    namespace (the responders answer `pool.admin.…` there); the others in `_INBOX.r.`, which
    no responder may publish to."""
    return admin_inbox("operator") if role == "admin" else f"{ROLE_INBOXES}.{role}"


def inbox_of(user: str) -> str | None:
    """The inbox prefix a connection as `user` must use, when that user is a role's."""
    for role in ROLES:
        if user == role_user(role):
            return role_inbox(role)
    return None


def speaks_as_role(url: str) -> bool:
    """Whether a connection to `url` is a role's user (named in the URL or, for a URL without
    one, in POOL_NATS_USER): such a user may not create or change streams."""
    first = url.split(",")[0].strip()
    user = unquote(urlsplit(first).username or "") or os.environ.get("POOL_NATS_USER", "")
    return inbox_of(user) is not None


def permissions(kind: str, name: str = "", tenants: tuple[str, ...] = ()
                ) -> dict[str, object] | None:
    """The server's `permissions` block for a user of `kind` (None: no restriction); a
    `{tenant}` subject is allowed once for each of `tenants`."""
    rule = PERMISSIONS[kind]
    if rule.publish is None and rule.subscribe is None:
        return None
    out: dict[str, object] = {}
    for direction, allowed in (("publish", rule.publish), ("subscribe", rule.subscribe)):
        if allowed is not None:
            subjects: list[str] = []
            for a in allowed:
                a = a.replace("{name}", name)
                subjects += [a.replace("{tenant}", t) for t in tenants] if "{tenant}" in a \
                    else [a]
            out[direction] = {"allow": subjects}
    return out


def _crossings(kind: str, name: str, tenants: tuple[str, ...]) -> list[Crossing]:
    """What crosses between POOL and the account of a user of `kind` named `name`: what its
    permissions name (accounts.crossings)."""
    allow = {d: tuple(b["allow"]) for d, b in (permissions(kind, name, tenants) or {}).items()
             if isinstance(b, dict)}
    return crossings(allow.get("publish", ()), allow.get("subscribe", ()))


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
        default_factory=lambda: Credentials(SERVICE_USER, _password())
    )
    responder: Credentials = field(
        default_factory=lambda: Credentials(RESPONDER_USER, _password())
    )
    roles: dict[str, Credentials] = field(default_factory=lambda: {
        r: Credentials(role_user(r), _password()) for r in ROLES})
    tenants: dict[str, Credentials] = field(default_factory=dict)
    nodes: dict[str, Credentials] = field(default_factory=dict)
    guard: Credentials = field(
        default_factory=lambda: Credentials(GUARD_USER, _password())
    )
    # each tenant's and node's account's limits: kept with the users, so whoever renders them
    # (`pool up`, the CLI adding a user) renders the caps `pool up` was started with
    tenant_caps: Caps = field(default_factory=Caps.from_env)
    node_caps: Caps = field(default_factory=Caps.nodes_from_env)

    def add_tenant(self, tenant: str, password: str | None = None) -> Credentials:
        tenant = checked_name("tenant", tenant)
        c = Credentials(f"{TENANT_USER_PREFIX}{tenant}", password or _password())
        self.tenants[tenant] = c
        return c

    def add_node(self, node_id: str, password: str | None = None) -> Credentials:
        node_id = checked_name("node", node_id)
        c = Credentials(f"{NODE_USER_PREFIX}{node_id}", password or _password())
        self.nodes[node_id] = c
        return c

    def render(self) -> str:
        """The server's accounts (ADR 027, 028): the system account with the guard's user
        alone; POOL with the operator, the responders and the roles; one account per tenant
        and one per node with its user, importing from POOL what its permissions name. Every user with
        its bcrypt-hashed password (the server never sees them in plain) and its permissions
        from PERMISSIONS; each tenant's and node's account capped at its caps (the
        connection guard's)."""
        users: list[dict[str, object]] = []

        tenants = tuple(sorted(self.tenants))

        def user(kind: str, c: Credentials, name: str = "") -> dict[str, object]:
            out: dict[str, object] = {"user": c.user, "password": c.password_hash()}
            perms = permissions(kind, name, tenants)
            if perms is not None:
                out["permissions"] = perms
            return out

        def add(kind: str, c: Credentials, name: str = "") -> None:
            users.append(user(kind, c, name))

        add("operator", self.service)
        add("responder", self.responder)
        for role in ROLES:
            add(role, self.roles[role])
        members: dict[str, Member] = {}
        for tenant, c in sorted(self.tenants.items()):
            members[tenant_account(tenant)] = Member(user("tenant", c, tenant), _crossings(
                "tenant", tenant, tenants), self.tenant_caps.to_dict())
        for node, c in sorted(self.nodes.items()):
            members[node_account(node)] = Member(user("node", c, node), _crossings(
                "node", node, tenants), self.node_caps.to_dict())
        accounts = render_accounts(users, members)
        # the server's own system account by its own name: a server started before it had
        # users reloads into this one (naming another with `system_account` needs a restart)
        accounts[SYSTEM_ACCOUNT] = {"users": [user("guard", self.guard)]}
        # the server's config format accepts JSON values
        return f"accounts: {json.dumps(accounts, indent=1)}"


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
        "roles": {k: c(v) for k, v in sorted(auth.roles.items())},
        "tenants": {k: c(v) for k, v in sorted(auth.tenants.items())},
        "nodes": {k: c(v) for k, v in sorted(auth.nodes.items())},
        "guard": c(auth.guard),
        "tenant_caps": auth.tenant_caps.to_dict(),
        "node_caps": auth.node_caps.to_dict(),
    }


def from_dict(data: dict[str, object]) -> AuthConfig:
    def c(x: object) -> Credentials:
        assert isinstance(x, dict)
        return Credentials(str(x["user"]), str(x["password"]), str(x.get("bcrypt") or ""))

    tenants = data.get("tenants") or {}
    nodes = data.get("nodes") or {}
    roles = data.get("roles") or {}
    assert isinstance(tenants, dict) and isinstance(nodes, dict) and isinstance(roles, dict)
    given = {str(k): c(v) for k, v in roles.items() if k in ROLES}
    # passwords are made only for the users a file lacks (an older file's: saved on next change)
    auth = AuthConfig(
        service=c(data["service"]),
        responder=c(data["responder"]) if data.get("responder")
        else Credentials(RESPONDER_USER, _password()),
        roles={r: given.get(r) or Credentials(role_user(r), _password()) for r in ROLES},
        tenants={str(k): c(v) for k, v in tenants.items()},
        nodes={str(k): c(v) for k, v in nodes.items()},
        guard=c(data["guard"]) if data.get("guard") else Credentials(GUARD_USER, _password()),
    )
    # a file from before the node caps: this start's (`pool up` saves them)
    auth.tenant_caps = Caps.saved(data.get("tenant_caps"), auth.tenant_caps)
    auth.node_caps = Caps.saved(data.get("node_caps"), auth.node_caps)
    return auth


def load(path: Path) -> AuthConfig | None:
    """The deployment's users from `path`, or None when there is none yet."""
    if not path.exists():
        return None
    data = json.loads(path.read_text())
    auth = from_dict(data)
    if ("responder" not in data or "guard" not in data
            or set(data.get("roles") or {}) != set(ROLES)):
        save(auth, path)  # a file from before the responder's, guard's or roles' users: keep them
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


def write_server_include(auth: AuthConfig, path: Path) -> int:
    """The accounts and users as their own file, `include`d by the server's configuration;
    how many reloads a server running the file as it was needs to apply it (0: unchanged;
    2: a tenant's account is new, `reloads_to_apply`)."""
    text = auth.render() + "\n"
    try:
        before = path.read_text()
    except OSError:
        before = ""  # none yet
    reloads = reloads_to_apply(before.strip(), text.strip())
    if reloads:
        write_private(path, text)
    return reloads


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


def guard_url(url: str, auth: AuthConfig) -> str:
    """`url` with the connection guard's credentials (the system account's user)."""
    return url_with_credentials(url, auth.guard)


def role_urls(url: str, auth: AuthConfig) -> dict[str, str]:
    """`url` with each role's credentials: what each process of the control plane connects as."""
    return {role: url_with_credentials(url, c) for role, c in auth.roles.items()}


def password_env(user: str) -> str:
    """The environment variable a deployment passes `user`'s password in (compose.yaml's .env):
    `pool-scheduler` → POOL_SCHEDULER_PASSWORD, `node-agent-1` → POOL_NODE_AGENT_1_PASSWORD."""
    name = user.removeprefix("pool-").upper().replace("-", "_")
    return f"POOL_{name}_PASSWORD"


def role_urls_from_env(url: str, environ: Mapping[str, str]) -> dict[str, str]:
    """`url` with the credentials of each role (and the responders) whose password the
    environment holds: how `pool serve` speaks as its roles' users in compose.yaml."""
    out: dict[str, str] = {}
    for role in (*ROLES, "responder"):
        user = RESPONDER_USER if role == "responder" else role_user(role)
        password = environ.get(password_env(user))
        if password:
            out[role] = url_with_credentials(url, Credentials(user, password))
    return out


def env_file(auth: AuthConfig) -> str:
    """Every user's password as `NAME=value` lines (compose.yaml reads them from .env)."""
    users = [auth.service, auth.responder, auth.guard, *auth.roles.values(),
             *auth.nodes.values()]
    return "".join(f"{password_env(c.user)}={c.password}\n" for c in users)


def redact(url: str) -> str:
    """`url` without its password, for printing."""
    if "," in url:
        return ",".join(redact(u.strip()) for u in url.split(",") if u.strip())
    parts = urlsplit(url)
    if parts.password is None:
        return url
    # a socket URL (`postgresql://u:p@/db?host=/dir`) has no host before its path
    netloc = f"{parts.username}:***@{parts.hostname or ''}" + (f":{parts.port}" if parts.port
                                                               else "")
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))
