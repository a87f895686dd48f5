"""Inbox namespaces and the reply-subject check: a responder answers only the requester's inbox.
The three disjoint prefixes and the threats they stop: docs/security.md.
"""

from __future__ import annotations

import logging
import re
import threading
import time

from bus.subjects import token

log = logging.getLogger(__name__)

INBOX_ROOT = "_INBOX"
TENANT_INBOXES = f"{INBOX_ROOT}.t"
NODE_INBOXES = f"{INBOX_ROOT}.n"
ADMIN_INBOXES = f"{INBOX_ROOT}.a"
# the reply subjects nats-server itself names in the exporting account for a request that
# crossed a service import: how a tenant's command reaches the plane from its own account
# (ADR 027). The tenant's own reply subject stays in its account; the answer to this one is
# routed back to it there, and nowhere else
SERVICE_REPLIES = "_R_"

# a reply subject's tokens as nats clients make them: no wildcards, no spaces, nothing empty
_REPLY_TOKEN = re.compile(r"^[A-Za-z0-9_-]{1,128}$")
_MAX_REPLY_LENGTH = 512


def tenant_inbox(tenant: str) -> str:
    """The reply-subject prefix of a tenant's clients (`inbox_prefix=`)."""
    return f"{TENANT_INBOXES}.{token(tenant)}"


def node_inbox(node: str) -> str:
    """The reply-subject prefix of a node agent."""
    return f"{NODE_INBOXES}.{token(node)}"


def admin_inbox(role: str) -> str:
    """The reply-subject prefix of an operator's or a control-plane role's client."""
    return f"{ADMIN_INBOXES}.{token(role)}"


def expected_inbox(subject: str) -> str | None:
    """The inbox prefix a request on `subject` must be answered under; None: never answered.

    A command `pool.cmd.<tenant>.…` is answered under its tenant's inbox, a node report
    `pool.node.<node>.…` under its node's, an admin command `pool.admin.…` or an operator's
    question `pool.ops.…` under the admin namespace (only operator users may publish there)."""
    parts = subject.split(".")
    if len(parts) >= 3 and parts[0] == "pool":
        if parts[1] == "cmd":
            return tenant_inbox(parts[2])
        if parts[1] == "node":
            return node_inbox(parts[2])
        if parts[1] in ("admin", "ops"):
            return ADMIN_INBOXES
    return None


def reply_allowed(subject: str, reply: str) -> bool:
    """Whether a request on `subject` may be answered on `reply`: strictly inside the
    requester's own inbox prefix, or for a tenant's command or a node's report the server's own
    `_R_` reply of a service import; made of plain tokens."""
    prefix = expected_inbox(subject)
    if prefix is None or len(reply) > _MAX_REPLY_LENGTH:
        return False
    if prefix.startswith((TENANT_INBOXES + ".", NODE_INBOXES + ".")) \
            and reply.startswith(SERVICE_REPLIES + "."):
        # a tenant's command or a node's report from its own account: the server named this
        # reply (no client may name a `_R_` reply) and routes its answer to the tenant or
        # node that asked, only there
        prefix = SERVICE_REPLIES
    elif not reply.startswith(prefix + "."):
        return False
    rest = reply[len(prefix) + 1:].split(".")
    return all(_REPLY_TOKEN.match(t) for t in rest)


class RefusedReplies:
    """Counts requests left unanswered because of their reply subject; logs once per interval."""

    def __init__(self, interval_s: float = 60.0) -> None:
        self.interval_s = interval_s
        self.count = 0
        self._logged_count = 0
        self._last_log = float("-inf")
        self._lock = threading.Lock()

    def refuse(self, subject: str, reply: str) -> None:
        with self._lock:
            self.count += 1
            now = time.monotonic()
            if now - self._last_log < self.interval_s:
                return
            since, self._logged_count, self._last_log = (self.count - self._logged_count,
                                                         self.count, now)
        # %r: the subjects are the requester's, possibly crafted for a log line
        log.warning("refused to answer %d request(s) on a reply subject outside the "
                    "requester's inbox (latest: %r on %r)", since, reply[:200], subject[:200])
