"""The accounts the server's configuration is rendered with: what crosses between a tenant's
account and POOL follows from the tenant's rule alone, and names that tenant only (ADR 027)."""

from __future__ import annotations

import json

from bus.local.accounts import (
    JS_API_INFO,
    POOL_ACCOUNT,
    crossings,
    node_account,
    reloads_to_apply,
    tenant_account,
)
from bus.local.auth import PERMISSIONS, AuthConfig, permissions


def _accounts(auth: AuthConfig) -> dict[str, dict[str, list[dict[str, object]]]]:
    return json.loads(auth.render().removeprefix("accounts: "))  # type: ignore[no-any-return]


def test_every_subject_of_a_tenants_rule_crosses_but_its_own_inbox() -> None:
    rule = PERMISSIONS["tenant"]
    assert rule.publish is not None and rule.subscribe is not None
    publish = tuple(s.replace("{name}", "alpha") for s in rule.publish)
    subscribe = tuple(s.replace("{name}", "alpha") for s in rule.subscribe)
    crossed = {c.subject: c for c in crossings(publish, subscribe)}
    assert set(publish) <= set(crossed)
    assert set(subscribe) - set(crossed) == {"_INBOX.t.alpha.>"}
    # what a node publishes reaches the tenant through two service imports in a row
    assert crossed["pool.sess.alpha.*.*.out"].to_pool
    assert crossed["pool.tel.*.*.alpha.>"].to_pool
    assert crossed["pool.tel.*.*.alpha.>"].kind == "service"
    assert not crossed["pool.sess.alpha.*.*.in"].to_pool
    assert crossed["pool.cmd.alpha.>"].kind == "service"
    assert crossed["pool.feedlive.alpha.>"].kind == "stream"
    assert all(c.streamed == c.subject.startswith("$JS.API.DIRECT.GET.") for c in crossed.values())


def test_every_subject_of_a_nodes_rule_crosses_but_its_own_inbox() -> None:
    perms = permissions("node", "n1", ("alpha",))
    assert perms is not None
    publish = tuple(perms["publish"]["allow"])  # type: ignore[index]
    subscribe = tuple(perms["subscribe"]["allow"])  # type: ignore[index]
    crossed = {c.subject: c for c in crossings(publish, subscribe)}
    assert set(publish) - set(crossed) == {"_INBOX.n.n1.>"}
    assert set(subscribe) - set(crossed) == {"_INBOX.n.n1.>"}
    assert crossed["pool.sess.*.n1.*.in"].to_pool
    assert crossed["pool.agent.n1.>"].kind == "stream"
    assert crossed["$JS.API.CONSUMER.MSG.NEXT.POOL_AGENT.agent-n1"].streamed
    assert not any(c.to_pool for s, c in crossed.items() if s in publish)


def test_a_tenants_account_imports_its_own_subjects_only_and_has_no_jetstream() -> None:
    auth = AuthConfig()
    for t in ("alpha", "beta"):
        auth.add_tenant(t)
    auth.add_node("n1")
    accounts = _accounts(auth)
    assert set(accounts) == {POOL_ACCOUNT, "$SYS", tenant_account("alpha"), tenant_account("beta"),
                             node_account("n1")}
    alpha = accounts[tenant_account("alpha")]
    assert "jetstream" not in alpha and [u["user"] for u in alpha["users"]] == ["tenant-alpha"]
    text = json.dumps(alpha)
    assert "beta" not in text and "alpha" in text
    imported = [i for i in alpha["imports"] if "service" in i]
    assert any(i.get("to") == JS_API_INFO for i in imported)
    assert accounts[POOL_ACCOUNT]["jetstream"] == "enabled"  # type: ignore[comparison-overlap]
    pool_users = {u["user"] for u in accounts[POOL_ACCOUNT]["users"]}
    assert not any(u.startswith(("tenant-", "node-")) for u in pool_users)
    # every export of POOL to a tenant's account names that tenant; to a node's, that node or
    # a tenant's files (which every node reads and writes)
    for export in accounts[POOL_ACCOUNT]["exports"]:
        subject = str(export.get("service") or export.get("stream"))
        for target in export["accounts"]:  # type: ignore[union-attr]
            name = str(target).removeprefix("TENANT_").removeprefix("NODE_")
            files = "OBJ_" in subject or "$O." in subject
            assert name in subject or (target == node_account("n1") and files), target


def test_a_new_tenant_takes_two_reloads_a_new_password_one() -> None:
    auth = AuthConfig()
    auth.add_tenant("alpha")
    before = auth.render()
    assert reloads_to_apply(before, before) == 0
    auth.add_tenant("beta")
    grown = auth.render()
    assert reloads_to_apply(before, grown) == 2
    auth.add_tenant("beta", password="another-password-of-beta")
    assert reloads_to_apply(grown, auth.render()) == 1
    assert reloads_to_apply("authorization { users: [] }", grown) == 2
