"""Inbox namespaces: where the replies of tenants, nodes and operators come back.

Tenants reply under `_INBOX.t.<tenant>`, nodes under `_INBOX.n.<node>`, operators and control-plane
roles under `_INBOX.a.<role>`; the three never overlap, whatever the names.
"""

from __future__ import annotations

from bus.subjects import token

INBOX_ROOT = "_INBOX"
TENANT_INBOXES = f"{INBOX_ROOT}.t"
NODE_INBOXES = f"{INBOX_ROOT}.n"
ADMIN_INBOXES = f"{INBOX_ROOT}.a"


def tenant_inbox(tenant: str) -> str:
    """The reply-subject prefix of a tenant's clients (`inbox_prefix=`)."""
    return f"{TENANT_INBOXES}.{token(tenant)}"


def node_inbox(node: str) -> str:
    """The reply-subject prefix of a node agent."""
    return f"{NODE_INBOXES}.{token(node)}"


def admin_inbox(role: str) -> str:
    """The reply-subject prefix of an operator's or a control-plane role's client."""
    return f"{ADMIN_INBOXES}.{token(role)}"
