"""HTTP bearer tokens: kept only as digests, one per holder, replaced only by rotation."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.tokens import BadTenant, Principal, TokenExists, TokenStore


def test_a_token_is_stored_only_as_its_digest(tmp_path: Path) -> None:
    store = TokenStore(tmp_path / "t.json")
    token = store.issue_tenant("alpha")
    text = (tmp_path / "t.json").read_text()
    assert token not in text and token[4:20] not in text
    assert (tmp_path / "t.json").stat().st_mode & 0o777 == 0o600
    assert store.verify(token) == Principal("tenant", "alpha")


def test_rotation_replaces_the_old_token_and_a_second_issue_is_refused(tmp_path: Path) -> None:
    store = TokenStore(tmp_path / "t.json")
    old = store.issue_tenant("alpha")
    with pytest.raises(TokenExists):
        store.issue_tenant("alpha")
    new = store.issue_tenant("alpha", rotate=True)
    # a second reader of the same file (a running gateway) sees the rotation
    other = TokenStore(tmp_path / "t.json")
    assert other.verify(old) is None
    assert other.verify(new) == Principal("tenant", "alpha")


def test_the_admin_token_is_separate_from_every_tenants(tmp_path: Path) -> None:
    store = TokenStore(tmp_path / "t.json")
    tenant = store.issue_tenant("alpha")
    admin = store.issue_admin()
    assert store.verify(admin) == Principal("admin")
    assert store.verify(tenant) != store.verify(admin)
    with pytest.raises(TokenExists):
        store.issue_admin()


@pytest.mark.parametrize("token", ["", "cpt_", "cpt_nope", "x" * 300, "Bearer cpt_x"])
def test_anything_else_is_no_one(tmp_path: Path, token: str) -> None:
    store = TokenStore(tmp_path / "t.json")
    store.issue_tenant("alpha")
    assert store.verify(token) is None


@pytest.mark.parametrize("name", ["Alpha", "a.b", "", "a b", "a>"])
def test_a_tenant_name_must_be_a_subject_token(tmp_path: Path, name: str) -> None:
    with pytest.raises(BadTenant):
        TokenStore(tmp_path / "t.json").issue_tenant(name)
