"""Which NATS account each user lives in and what crosses between accounts: the plane's POOL
account, one account per tenant (ADR 027) and one per node (ADR 028), joined only by the
exports and imports made here.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from bus.replies import INBOX_ROOT
from bus.subjects import SESSION_PREFIX, TELEMETRY_PREFIX

log = logging.getLogger(__name__)

# the control plane's roles, the operator and the admin CLI; the only account with JetStream,
# so every stream, KV bucket and object store lives here
POOL_ACCOUNT = "POOL"
# the account nats-server puts users in when there are no accounts (a store from before them)
GLOBAL_ACCOUNT = "$G"
TENANT_ACCOUNT_PREFIX = "TENANT_"
NODE_ACCOUNT_PREFIX = "NODE_"
# An account without JetStream is given the server's own answer to every JetStream API
# request ("not enabled for account"), which would race POOL's answer to the same request
# through an import, unless the account imports `$JS.API.INFO` itself. So each tenant's and
# node's account imports it from POOL, mapped onto a subject no one in POOL answers: no
# responders.
NO_JETSTREAM_PREFIX = "pool.nojs"
JS_API_INFO = "$JS.API.INFO"
# the JetStream requests answered by several messages: a batched direct get, a pull
_STREAMED = ("$JS.API.DIRECT.GET.", "$JS.API.CONSUMER.MSG.NEXT.")
# what a node publishes and a tenant reads: it reaches the reader's account through POOL only
# as two service imports in a row (stream imports do not chain), so the reader's account
# exports these to POOL as services, answered by no one
_CHAINED = (f"{SESSION_PREFIX}.", f"{TELEMETRY_PREFIX}.")
# how long the server keeps the way back of a request that crossed into such an account (a
# node's JetStream publish of telemetry carries one, answered by POOL's stream, not there):
# the mapping is dropped past it, instead of after the server's default 2 minutes
UNANSWERED_THRESHOLD = "2s"


def tenant_account(tenant: str) -> str:
    """The account of one tenant's user (the tenant's name is a subject token already)."""
    return f"{TENANT_ACCOUNT_PREFIX}{tenant}"


def node_account(node: str) -> str:
    """The account of one node agent's user (ADR 028)."""
    return f"{NODE_ACCOUNT_PREFIX}{node}"


@dataclass(frozen=True)
class Crossing:
    """One subject that crosses between POOL and a tenant's or node's account. A `service`
    goes from the importing account to the exporting one, and its answers come back (the
    server names the reply in the exporter, `_R_.…`, so the asker's own reply subject never
    reaches it): POOL exports it and the account imports it (what the account publishes), or,
    `to_pool`, the account exports it to POOL, which imports it (what the account reads of
    what another tenant's or node's account publishes). Service imports chain, stream imports
    do not: a tenant's session `in` crosses into POOL and on into the node's account, a node's
    `out` and telemetry into POOL and on into the tenant's. A `stream` flows from POOL into
    the account only. `streamed`: a service answered by several messages (a batched direct
    get, a pull)."""

    subject: str
    kind: Literal["service", "stream"]
    to_pool: bool = False
    streamed: bool = False


def crossings(publish: tuple[str, ...], subscribe: tuple[str, ...]) -> list[Crossing]:
    """What a tenant's or node's account imports from POOL and exports to it, from what its
    user may publish and subscribe to (its Rule, `{name}` and `{tenant}` filled in): every
    subject it publishes is a service of POOL but its own inbox; every subject it subscribes
    to is a stream from POOL but its own inbox, where the answers come back, and what the
    other end publishes from an account of its own (sessions' bytes, a node's telemetry): a
    service it exports to POOL, so that it chains on from that account."""
    out: list[Crossing] = []
    for subject in publish:
        if not subject.startswith(f"{INBOX_ROOT}."):
            out.append(Crossing(subject, "service", streamed=subject.startswith(_STREAMED)))
    for subject in subscribe:
        if subject.startswith(_CHAINED):
            out.append(Crossing(subject, "service", to_pool=True))
        elif not subject.startswith(f"{INBOX_ROOT}."):
            out.append(Crossing(subject, "stream"))
    return out


@dataclass(frozen=True)
class Member:
    """One account beside POOL: its one user, what crosses, its limits (None: none)."""

    user: dict[str, object]
    crossing: list[Crossing]
    limits: dict[str, int] | None = None


def render_accounts(pool_users: list[dict[str, object]],
                    members: dict[str, Member]) -> dict[str, object]:
    """The server's `accounts` block less the system account: POOL with JetStream,
    `pool_users` and each export to the accounts that import it alone; each member's account
    (by name) with its one user, its imports and exports, its `limits`, and no JetStream of
    its own."""
    exports: dict[tuple[str, str, bool], list[str]] = {}
    imports: list[dict[str, object]] = []
    accounts: dict[str, object] = {}
    for account, member in sorted(members.items()):
        m_imports: list[dict[str, object]] = []
        m_exports: list[dict[str, object]] = []
        for c in member.crossing:
            if c.to_pool:
                m_exports.append({c.kind: c.subject, "accounts": [POOL_ACCOUNT],
                                  "response_threshold": UNANSWERED_THRESHOLD})
                imports.append({c.kind: {"account": account, "subject": c.subject}})
            else:
                exports.setdefault((c.kind, c.subject, c.streamed), []).append(account)
                m_imports.append({c.kind: {"account": POOL_ACCOUNT, "subject": c.subject}})
        shadow = f"{NO_JETSTREAM_PREFIX}.{account}"
        exports.setdefault(("service", shadow, False), []).append(account)
        m_imports.append({"service": {"account": POOL_ACCOUNT, "subject": shadow},
                          "to": JS_API_INFO})
        accounts[account] = {"users": [member.user], "imports": m_imports,
                             "exports": m_exports,
                             **({"limits": dict(member.limits)} if member.limits else {})}
    pool: dict[str, object] = {
        "jetstream": "enabled", "users": pool_users,
        "exports": [{kind: subject, "accounts": to,
                     **({"response": "stream"} if streamed else {})}
                    for (kind, subject, streamed), to in sorted(exports.items())],
        "imports": imports}
    return {POOL_ACCOUNT: pool, **accounts}


def reloads_to_apply(before: str, after: str) -> int:
    """How many reloads make a server running the rendered accounts `before` apply `after`:
    none when they are the same; two when `after` adds an account, as nats-server (2.15) wires
    a new account's service imports at its second reload only (at the first it knows the
    account, whose requests then find no responders); else one."""
    if before == after:
        return 0

    def names(text: str) -> set[str]:
        try:
            return set(json.loads(text.removeprefix("accounts: ")))
        except ValueError:
            return set()  # not accounts as rendered here (users of the global account)

    return 2 if names(after) - names(before) else 1


def adopt_global_store(jetstream_dir: Path) -> bool:
    """Move a single server's JetStream store from the global account (a server configured
    before accounts: every stream under `$G`) to POOL's, so its streams stay the plane's;
    whether it moved. A store already under POOL, or with nothing under `$G`, is left alone.
    `jetstream_dir` is the server's `store_dir` (the server keeps accounts in its `jetstream/`)."""
    root = jetstream_dir / "jetstream"
    old, new = root / GLOBAL_ACCOUNT, root / POOL_ACCOUNT
    if not old.is_dir() or new.exists():
        return False
    old.rename(new)
    log.warning("moved the JetStream store of %s from the global account to %s (ADR 027)",
                root, POOL_ACCOUNT)
    return True
