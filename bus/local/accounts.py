"""Which NATS account each user lives in and what crosses between accounts: the plane's POOL
account and one account per tenant, joined only by the exports and imports made here (ADR 027).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from bus.replies import TENANT_INBOXES
from bus.subjects import SESSION_PREFIX

log = logging.getLogger(__name__)

# the control plane's roles, the operator, the admin CLI and the node agents; the only account
# with JetStream, so every stream, KV bucket and object store lives here
POOL_ACCOUNT = "POOL"
# the account nats-server puts users in when there are no accounts (a store from before them)
GLOBAL_ACCOUNT = "$G"
TENANT_ACCOUNT_PREFIX = "TENANT_"
# An account without JetStream is given the server's own answer to every JetStream API
# request ("not enabled for account"), which would race POOL's answer to the same request
# through an import, unless the account imports `$JS.API.INFO` itself. So each tenant's
# account imports it from POOL, mapped onto a subject no one in POOL answers: no responders.
NO_JETSTREAM_PREFIX = "pool.nojs"
JS_API_INFO = "$JS.API.INFO"


def tenant_account(tenant: str) -> str:
    """The account of one tenant's user (the tenant's name is a subject token already)."""
    return f"{TENANT_ACCOUNT_PREFIX}{tenant}"


@dataclass(frozen=True)
class Crossing:
    """One subject that crosses between POOL and a tenant's account. A `service` goes from
    the tenant to POOL and its answers come back (the server names the reply in POOL, `_R_.…`,
    so the tenant's own reply subject never reaches POOL); a `stream` flows one way only:
    `to_pool` the tenant's messages into POOL, else POOL's into the tenant's account.
    `streamed`: a service answered by several messages (a batched direct get)."""

    subject: str
    kind: Literal["service", "stream"]
    to_pool: bool = False
    streamed: bool = False


def crossings(publish: tuple[str, ...], subscribe: tuple[str, ...]) -> list[Crossing]:
    """What a tenant's account imports from POOL and exports to it, from what its user may
    publish and subscribe to (its Rule, `{name}` filled in): every subject it publishes is a
    service of POOL but its sessions' `in`, which POOL imports as a stream; every subject it
    subscribes to is a stream from POOL but its own inbox, where the answers come back."""
    out: list[Crossing] = []
    for subject in publish:
        if subject.startswith(f"{SESSION_PREFIX}."):
            out.append(Crossing(subject, "stream", to_pool=True))
        else:
            out.append(Crossing(subject, "service",
                                streamed=subject.startswith("$JS.API.DIRECT.GET.")))
    for subject in subscribe:
        if not subject.startswith(f"{TENANT_INBOXES}."):
            out.append(Crossing(subject, "stream"))
    return out


def render_accounts(pool_users: list[dict[str, object]],
                    tenants: dict[str, tuple[dict[str, object], list[Crossing]]],
                    limits: dict[str, int]) -> dict[str, object]:
    """The server's `accounts` block less the system account: POOL with JetStream, `pool_users`
    and an export to each tenant's account alone; each tenant's account with its one user,
    its imports, its connection and subscription `limits`, and no JetStream of its own."""
    exports: list[dict[str, object]] = []
    imports: list[dict[str, object]] = []
    accounts: dict[str, object] = {}
    for tenant, (user, crossing) in sorted(tenants.items()):
        account = tenant_account(tenant)
        t_imports: list[dict[str, object]] = []
        t_exports: list[dict[str, object]] = []
        for c in crossing:
            if c.kind == "service":
                exports.append({"service": c.subject, "accounts": [account],
                                **({"response": "stream"} if c.streamed else {})})
                t_imports.append({"service": {"account": POOL_ACCOUNT, "subject": c.subject}})
            elif c.to_pool:
                t_exports.append({"stream": c.subject, "accounts": [POOL_ACCOUNT]})
                imports.append({"stream": {"account": account, "subject": c.subject}})
            else:
                exports.append({"stream": c.subject, "accounts": [account]})
                t_imports.append({"stream": {"account": POOL_ACCOUNT, "subject": c.subject}})
        shadow = f"{NO_JETSTREAM_PREFIX}.{tenant}"
        exports.append({"service": shadow, "accounts": [account]})
        t_imports.append({"service": {"account": POOL_ACCOUNT, "subject": shadow},
                          "to": JS_API_INFO})
        accounts[account] = {"users": [user], "limits": dict(limits), "imports": t_imports,
                             "exports": t_exports}
    pool: dict[str, object] = {"jetstream": "enabled", "users": pool_users, "exports": exports,
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
